"""The warp-specialised tile kernels (``kernels_src/losses/tiles_ws.cu``, issue 23) on Hopper,
against the float64 oracle and against the cp.async wgmma loop they replace
(``config.ws_tiles``).

Every test that must run the new kernels checks that they ran (a spy on
``score_tiles.ws_launch``).
Tolerances: against the oracle those of ops/test_contrastive_kernels.py / ops/test_siglip.py (their
``check`` / ``_check_oracle``); new against old loop: the row / column statistics are float32
sums of the same products in another order (1e-5 relative), the gradient blocks are rounded to
16 bits by both (1e-2 bf16, 2e-3 f16, as test_tiles_agree_with_cublas_path); the ring layout
(A resident or not, stage count) does not change any arithmetic: the same bits.
CPU tests at the end: the ring's shared-memory plan (no GPU needed).
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

import cupynce
import cupynce.config as cfg

cp = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

from cupynce._engine import tiling  # noqa: E402
from cupynce._engine.losses import score_tiles, stats  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
HALF = [pytest.param(BF16, id="bf16"), pytest.param(F16, id="f16")]
GTOL = {BF16: 1e-2, F16: 2e-3}  # new vs old loop, 16-bit gradient blocks
gpu = pytest.mark.gpu


def _hopper() -> bool:
    from cupynce._engine import tma
    from cupynce._engine.kernels import arch_specific_build

    return arch_specific_build(score_tiles.FILE) and tma.available()


@pytest.fixture
def ws(monkeypatch, configure):
    """Tiles on, the wgmma loop, the warp-specialised kernels; returns the log of
    ``ws_launch`` calls, (stage, launched)."""
    if not _hopper():
        pytest.skip("the warp-specialised tiles need a compute-capability 9.0 GPU and TMA")
    configure(tiles=True, wgmma=True, ws_tiles=True)
    log = []
    real = score_tiles.ws_launch

    def spy(stage, *args, **kw):
        ok = real(stage, *args, **kw)
        log.append((stage, ok))
        return ok

    monkeypatch.setattr(score_tiles, "ws_launch", spy)  # (what score_tiles.tile calls)
    return log


def _old(configure, fn):
    """fn() on the cp.async wgmma loop (config.ws_tiles off), then the switch back on."""
    configure(ws_tiles=False)
    try:
        return fn()
    finally:
        configure(ws_tiles=True)


def _assert_h_symmetric(g, dtype):
    """H = Hᵀ: bit for bit where a tile was mirrored (off the diagonal tiles).  Inside a
    diagonal tile H_rc and H_cr are computed apart, each warp choosing the one-exp2 or the
    two-exp2 form for its 16 x 128 block, so the two may differ by one rounding of the dtype
    (seen on an H100: f16, n = 1030, d = 136, one pair in tile (6, 6), 1 ulp; the cp.async
    loop gives the same two values)."""
    import ml_dtypes

    g = np.asarray(g, np.float64)
    t = np.arange(g.shape[0]) // tiling.TILE
    diag = t[:, None] == t[None, :]
    assert np.array_equal(g[~diag], g.T[~diag]), "the mirrored H is not symmetric"
    fi = ml_dtypes.finfo(dtype)
    np.testing.assert_allclose(g[diag], g.T[diag], rtol=float(fi.eps),
                               atol=float(fi.eps) * float(fi.tiny), err_msg="diagonal tiles")


def _ran(log, *stages):
    got = {s for s, ok in log if ok}
    for s in stages:
        assert s in got, f"cpn_wstile_{s} did not run: {log}"


def _host(x):
    return None if x is None else cp.asnumpy(x)


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    den = np.linalg.norm(ref.ravel())
    num = np.linalg.norm((x - ref).ravel())
    if not np.isfinite(num):
        return math.inf
    return float(num / den) if den > 0 else float(num)


def _compare(new, old, dtype, what):
    """(loss, grads) of the new loop against the old one."""
    e = _rel(_host(new[0]), _host(old[0]))
    assert e <= 1e-5, f"{what}: loss new vs old loop {e:.3e}"
    for i, (a, b) in enumerate(zip(new[1], old[1])):
        if b is None:
            assert a is None
            continue
        e = _rel(_host(a), _host(b))
        assert e <= GTOL[dtype], f"{what}: grad {i} new vs old loop {e:.3e}"


# ---- the public ops: oracle and old loop -------------------------------------------------
import test_contrastive_kernels as TC  # noqa: E402

OPS = [("nt_xent", None), ("info_nce", None), ("info_nce", "shared"), ("clip_loss", None)]
STAGES = {"nt_xent": ("lse", "h"), "info_nce": ("lse", "g"), "clip_loss": ("lse2", "clip")}


def _stages(op, neg, n):
    """The stages that must run on the new kernels: InfoNCE's gradient declines shared
    negatives after n % 8 != 0 keys."""
    if op == "info_nce" and neg == "shared" and n % 8:
        return ("lse",)
    return STAGES[op]


def _contrastive(op, neg, dtype, n, d, reduction, normalize, seed, m=130, ws=None):
    rng = np.random.default_rng(seed)
    inputs = TC.make_case(op, dtype, n, d, rng, neg, m=m, scale=1 / np.sqrt(d))
    kw = dict(t=0.1, reduction=reduction, normalize=normalize)
    return inputs, kw, TC.grad_for(reduction, n, rng)


@gpu
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("n", [1, 127, 129, 300, 1030])
@pytest.mark.parametrize("op,neg", OPS)
def test_ops_against_oracle_and_old_loop(op, neg, n, normalize, reduction, dtype, ws,
                                         configure):
    if op == "nt_xent":
        n += n % 2  # (pairs)
    d = 64 if n < 1000 else 136
    seed = zlib.crc32(f"ws{op}{neg}{n}{normalize}{reduction}{dtype}".encode())
    inputs, kw, g = _contrastive(op, neg, dtype, n, d, reduction, normalize, seed)
    TC.check(op, dtype, inputs, kw, g)
    _ran(ws, *_stages(op, neg, n))
    new = TC.run_cupynce(op, inputs, kw, g)
    old = _old(configure, lambda: TC.run_cupynce(op, inputs, kw, g))
    _compare(new, old, dtype, f"{op} {neg} n={n}")


@gpu
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op,neg", OPS)
def test_ops_large(op, neg, dtype, ws, configure):
    """N = 4096, D = 512 (A resident, 6 stages for the LSE pass; NT-Xent's forward on the
    symmetric LSE2 schedule and its gradient on the mirrored H tiles)."""
    configure(symmetric_lse_min_nd=0)
    inputs, kw, g = _contrastive(op, neg, dtype, 4096, 512, "mean", True, 7)
    TC.check(op, dtype, inputs, kw, g)
    _ran(ws, *(("lse2", "h") if op == "nt_xent" else STAGES[op]))
    new = TC.run_cupynce(op, inputs, kw, g)
    old = _old(configure, lambda: TC.run_cupynce(op, inputs, kw, g))
    _compare(new, old, dtype, f"{op} {neg} n=4096")


@gpu
@pytest.mark.parametrize("n", [2, 256, 300, 1030, 2048])
def test_nt_xent_square_and_symmetric_passes(n, ws, configure):
    """NT-Xent's square LSE pass (positives, the diagonal excluded), its symmetric LSE2 pass
    (`tri`: row and column partials of every pair of tiles once, some CTAs with no tile) and
    both gradient passes (H on every tile, and mirrored)."""
    inputs, kw, g = _contrastive("nt_xent", None, BF16, n, 64, "none", True, n)
    for sym in (False, True):
        configure(symmetric_lse=sym, symmetric_h=sym, symmetric_lse_min_nd=0)
        ws.clear()
        TC.check("nt_xent", BF16, inputs, kw, g)
        _ran(ws, "lse2" if sym else "lse", "h")
        new = TC.run_cupynce("nt_xent", inputs, kw, g)
        old = _old(configure, lambda: TC.run_cupynce("nt_xent", inputs, kw, g))
        _compare(new, old, BF16, f"nt_xent n={n} symmetric={sym}")


@gpu
@pytest.mark.parametrize("n", [300, 1024, 1032])
@pytest.mark.parametrize("m", [130, 256])
def test_info_nce_shared_negatives(n, m, ws, configure):
    """Shared negatives (B2): the new kernel's columns of B2 start at n1 (not at the next
    multiple of 128), so the last key tile ends at n1 and the first negative tile starts
    there.  The gradient stage declines n1 % 8 != 0 (its 16-byte stores would straddle n1)
    and runs on the old loop."""
    inputs, kw, g = _contrastive("info_nce", "shared", BF16, n, 64, "none", False, n + m, m=m)
    TC.check("info_nce", BF16, inputs, kw, g)
    _ran(ws, "lse")
    assert (("g", True) in ws) == (n % 8 == 0), ws
    new = TC.run_cupynce("info_nce", inputs, kw, g)
    old = _old(configure, lambda: TC.run_cupynce("info_nce", inputs, kw, g))
    _compare(new, old, BF16, f"info_nce shared n={n} m={m}")


@gpu
@pytest.mark.parametrize("op,neg", OPS)
def test_deterministic_and_nan(op, neg, ws):
    """ops/test_contrastive_kernels.py's determinism (3 runs, the same bits) and NaN checks on
    the new kernels."""
    TC.test_tiles_deterministic_and_nan(op, neg, "wgmma")
    _ran(ws, *_stages(op, neg, 1030))


@gpu
@pytest.mark.parametrize("op,neg", OPS)
def test_mixed_fast_and_fallback_epilogues(op, neg, ws, monkeypatch):
    """ops/test_contrastive_kernels.py's mixed case (rows 0-99 x 30: the checked / two-exp2 /
    max-based epilogues beside the fast ones in one launch) on the new kernels."""
    TC.test_tiles_mixed_fast_and_fallback_epilogues(op, neg, BF16, "wgmma")
    _ran(ws, *_stages(op, neg, 1030))


# ---- SigLIP ------------------------------------------------------------------------------
import test_siglip as TS  # noqa: E402


@gpu
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("n, d", [(1, 8), (127, 64), (129, 64), (300, 40), (1030, 136),
                                  (4096, 512)])
def test_siglip_against_oracle_and_old_loop(n, d, normalize, reduction, dtype, ws,
                                            configure):
    a, b = TS._inputs(n, d, dtype)
    g = np.random.default_rng(n).standard_normal(n).astype(np.float32) \
        if reduction == "none" else 0.7
    TS._check_oracle(a, b, math.log(10.0), -10.0, reduction, normalize, g)
    _ran(ws, "siglip")
    new = TS._run(a, b, math.log(10.0), -10.0, reduction, normalize, g)
    old = _old(configure, lambda: TS._run(a, b, math.log(10.0), -10.0, reduction,
                                          normalize, g))
    # (loss, da, db; the scalar gradients' sums cancel: the oracle check above bounds them)
    for i, (x, y) in enumerate(zip(new[:3], old[:3])):
        tol = 1e-5 if i == 0 else GTOL[dtype]
        assert _rel(x, y) <= tol, (i, _rel(x, y))
    loss = cupynce.siglip_loss(cp.asarray(a), cp.asarray(b), 2.3, -10.0, reduction="sum")
    again = cupynce.siglip_loss(cp.asarray(a), cp.asarray(b), 2.3, -10.0, reduction="sum")
    assert cp.asnumpy(loss).tobytes() == cp.asnumpy(again).tobytes()


# ---- the stages one launch at a time: every output written, new against old --------------
def _lse_host(m, s):
    """float64 log-sum-exp of (m, s) partials along axis 0 (natural-log units)."""
    m, s = np.asarray(m, np.float64), np.asarray(s, np.float64)
    top = np.max(np.where(s > 0, m, -np.inf), axis=0)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        return top + np.log(np.sum(s * np.exp(m - top), axis=0))


def _stage_outputs(stage, dt, n, d, seed, splits=None, n2=0, row0=0):
    """One launch of ``stage`` on seeded inputs (outputs NaN-filled first), its outputs on
    the host: the combined partials, the gradient block."""
    rng = cp.random.default_rng(seed)
    q = (rng.standard_normal((n, d), dtype=cp.float32) / 8).astype(dt)
    sym = stage in ("h", "h_tri", "lse2_tri", "lse_sym")
    k = q if sym else (rng.standard_normal((n, d), dtype=cp.float32) / 8).astype(dt)
    neg = (rng.standard_normal((n2, d), dtype=cp.float32) / 8).astype(dt) if n2 else None
    ncols = n + n2
    s = 10.0
    shift = n // 2 if sym else 0
    rt, ct = -(-n // tiling.TILE), -(-ncols // tiling.TILE)
    tri = stage in ("h_tri", "lse2_tri")
    sp = splits or tiling.grid_splits(rt, ct // 2 + 1 if tri else ct)
    nan = np.float32(np.nan)
    out = {}
    lse = cp.asarray(np.random.default_rng(seed).uniform(2.0, 4.0, n + ncols + row0)
                     .astype(np.float32))
    if stage in ("lse", "lse_sym"):
        part = cp.full((2, sp, n), nan, cp.float32)
        pos = cp.full((n,), nan, cp.float32)
        score_tiles.tile("lse", dt, (rt, sp), q, row0, k, neg, scale=s, exclude_diag=sym,
                         pos_shift=shift, pos_mod=n, part=(part.data.ptr, part[1].data.ptr, n),
                         pos_out=pos.data.ptr)
        out["part"] = cp.asnumpy(part)
        out["pos"] = cp.asnumpy(pos)
    elif stage in ("lse2", "lse2_tri"):
        part = cp.full((2, sp, n), nan, cp.float32)
        pos = cp.full((n,), nan, cp.float32)
        colp = cp.full((2, rt, ncols), nan, cp.float32)
        dots = (q.astype(cp.float32) * k.astype(cp.float32)).sum(1)
        ls = cp.full((1,), math.log(s), cp.float32)
        score_tiles.tile("lse2", dt, (rt, sp), q, row0, k, None, scale=1.0 if not tri else s,
                         scale_log=None if tri else ls, exclude_diag=tri, pos_shift=shift,
                         pos_mod=n, part=(part.data.ptr, part[1].data.ptr, n),
                         pos_out=0 if tri else pos.data.ptr,
                         colp=(colp.data.ptr, colp[1].data.ptr), lse_col=dots, tri=tri)
        out["part"] = cp.asnumpy(part)
        out["colp"] = cp.asnumpy(colp)
        if not tri:
            out["pos"] = cp.asnumpy(pos)
    else:
        ldg = -(-ncols // 8) * 8
        g = cp.full((n, ldg), nan, cp.float32).astype(dt)
        w = cp.asarray(np.random.default_rng(seed + 1).uniform(0.5, 1.5, n + ncols + row0)
                       .astype(np.float32))
        kw = dict(pos_shift=shift, pos_mod=n, lse_row=lse, lse_col=lse,
                  weights=(w, 1, 1.0 / n), g=g[:, :ncols])
        if stage == "clip":
            dsp = cp.full((sp, n), nan, cp.float32)
            ls = cp.full((1,), math.log(s), cp.float32)
            score_tiles.tile("clip", dt, (rt, sp), q, row0, k, None, scale_log=ls,
                             dsp=dsp.data.ptr, part=(0, 0, n), **kw)
            out["dsp"] = cp.asnumpy(dsp)
        elif stage == "siglip":
            parts = cp.full((3, sp, n), nan, cp.float32)
            ls = cp.full((1,), math.log(s), cp.float32)
            lb = cp.full((1,), -5.0, cp.float32)
            kw.update(lse_col=lb, pos_mod=stats.FAR_MOD)
            score_tiles.tile("siglip", dt, (rt, sp), q, row0, k, None, scale_log=ls,
                             part=(parts[0].data.ptr, parts[1].data.ptr, n),
                             dsp=parts[2].data.ptr, **kw)
            out["parts"] = cp.asnumpy(parts)
        else:
            score_tiles.tile("h" if sym else "g", dt, (rt, sp), q, row0, k, neg, scale=s,
                             exclude_diag=sym, tri=tri, **kw)
        out["g"] = cp.asnumpy(g[:, :ncols].astype(cp.float32))
    return out


def _same_outputs(a, b, what):
    for key in a:
        x, y = a[key], b[key]
        assert np.array_equal(np.isnan(x), np.isnan(y)), f"{what} {key}: written elements differ"
        if key == "part":  # per split: the row lse from (m, s)
            x, y = _lse_host(x[0], x[1]), _lse_host(y[0], y[1])
        elif key == "colp":  # per row tile: each column's lse
            x, y = _lse_host(x[0][None], x[1][None]), _lse_host(y[0][None], y[1][None])
        ok = ~np.isnan(y)
        if key == "g":
            np.testing.assert_allclose(x, y, rtol=2.0 ** -7, atol=1e-4 * float(np.abs(y).max()),
                                       err_msg=f"{what} g")
        else:  # (CLIP's dscale and SigLIP's partials are sums of signed terms: 1e-4)
            # a partial whose every term underflowed is log(0) = -inf: the same in both
            inf = np.isinf(x) | np.isinf(y)
            assert np.array_equal(x[inf & ok], y[inf & ok]), f"{what} {key}: infinities differ"
            ok &= ~inf
            e = _rel(x[ok], y[ok])
            tol = 1e-4 if key in ("dsp", "parts") else 1e-5
            assert e <= tol, f"{what} {key}: new vs old {e:.3e}"


ALL_STAGES = ["lse", "lse_sym", "lse2", "lse2_tri", "g", "h", "h_tri", "clip", "siglip"]


@gpu
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n,d", [(1, 64), (130, 8), (300, 40), (1030, 136), (1030, 1024)])
@pytest.mark.parametrize("stage", ALL_STAGES)
def test_stage_against_old_loop(stage, n, d, dtype, ws, configure):
    """Each stage's raw outputs, new kernel against the old loop: the same elements written
    (NaN-filled before; where the old loop leaves partials unwritten -- the symmetric
    schedule's column partials -- the new one must too), the same values to the loops'
    accumulation orders.  K tails (d % 64), D past the A-resident ring (1024: 32 KiB stages),
    a partial last row and column tile, a one-row problem."""
    if stage in ("lse_sym", "h", "h_tri", "lse2_tri") and n % 2:
        n += 1
    new = _stage_outputs(stage, dtype, n, d, n + d)
    _ran(ws, stage.split("_")[0])
    old = _old(configure, lambda: _stage_outputs(stage, dtype, n, d, n + d))
    if stage == "h_tri":
        _assert_h_symmetric(new["g"], dtype)
    for key, x in new.items():
        if key != "colp" or stage == "lse2":  # (the symmetric schedule skips some)
            assert not np.isnan(x).any(), f"{stage}: unwritten {key} {np.argwhere(np.isnan(x))[:5]}"
    _same_outputs(new, old, f"{stage} n={n} d={d}")


@gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("stage", ["lse", "lse2", "lse2_tri", "g", "h_tri", "clip", "siglip"])
def test_stage_splits_and_global_rows(stage, splits, ws, configure):
    """Column splits by hand: CTAs with an odd number of tiles (consumer 0 takes the last),
    one tile (consumer 1 idle), none (splits past the tile count: the partials still
    written); and rows numbered from row0 = 200 (a rank's rows: diagonal and positives away
    from the local ones) for the non-symmetric stages."""
    row0 = 0 if stage in ("lse2_tri", "h_tri") else 200
    n = 1030 if stage != "lse2_tri" else 1024
    new = _stage_outputs(stage, BF16, n, 64, splits, splits=splits, row0=row0)
    _ran(ws, stage.split("_")[0])
    old = _old(configure, lambda: _stage_outputs(stage, BF16, n, 64, splits, splits=splits,
                                                 row0=row0))
    _same_outputs(new, old, f"{stage} splits={splits}")


@gpu
@pytest.mark.parametrize("n,n2", [(300, 130), (1032, 130), (1024, 256), (129, 1)])
@pytest.mark.parametrize("stage", ["lse", "g"])
def test_stage_b2_columns(stage, n, n2, ws, configure):
    """Columns from two matrices: B2's tiles start at n1; g only where n1 % 8 == 0."""
    new = _stage_outputs(stage, BF16, n, 72, n, n2=n2)
    assert ((stage, True) in ws) == (stage == "lse" or n % 8 == 0), ws
    old = _old(configure, lambda: _stage_outputs(stage, BF16, n, 72, n, n2=n2))
    _same_outputs(new, old, f"{stage} n1={n} n2={n2}")


@gpu
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("n1,n2", [(300, 130), (129, 256), (1000, 300)])
def test_stage_b2_positive_after_a_b1_tail(n1, n2, splits, ws, configure):
    """Positives among B2's first columns while B1's last tile ends at n1 % 128 != 0: that
    tile's columns past n1 (TMA zero fill) carry the numbers of B2's first columns, and must
    not write pos_out (the review of issue 23; no caller has such positives today).  Row i's
    positive is column (i + n1) % (n1 + n2): B2's row i for i < n2.  pos_out and the row
    lse against float64 and the old loop, and the same bits on every run (the wrong write
    raced the right one)."""
    assert n1 % 128 and n2 > 0
    d, s = 72, 10.0
    rng = np.random.default_rng(n1 + n2)
    q, k, neg = ((rng.standard_normal((r, d)) / 8).astype(BF16) for r in (n1, n1, n2))
    rt = -(-n1 // tiling.TILE)

    def run():
        part = cp.full((2, splits, n1), np.nan, cp.float32)
        pos = cp.full((n1,), np.nan, cp.float32)
        score_tiles.tile("lse", BF16, (rt, splits), cp.asarray(q), 0, cp.asarray(k),
                         cp.asarray(neg), scale=s, pos_shift=n1, pos_mod=n1 + n2,
                         part=(part.data.ptr, part[1].data.ptr, n1), pos_out=pos.data.ptr)
        return {"part": cp.asnumpy(part), "pos": cp.asnumpy(pos)}

    new = run()
    _ran(ws, "lse")
    cols = np.concatenate([k, neg]).astype(np.float64)
    logits = s * (q.astype(np.float64) @ cols.T)
    want = logits[np.arange(n1), (np.arange(n1) + n1) % (n1 + n2)]
    np.testing.assert_allclose(new["pos"], want, rtol=1e-4, atol=1e-4)
    top = logits.max(1)
    lse = top + np.log(np.exp(logits - top[:, None]).sum(1))
    assert _rel(_lse_host(new["part"][0], new["part"][1]), lse) <= 1e-5
    for _ in range(2):
        again = run()
        assert all(again[key].tobytes() == new[key].tobytes() for key in new)
    _same_outputs(new, _old(configure, run), f"lse n1={n1} n2={n2} splits={splits}")


@gpu
@pytest.mark.parametrize("d", [64, 512])
def test_siglip_loss_alone_no_staging(d, ws, monkeypatch, configure):
    """SigLIP's loss alone (no g) reserves no SOUT staging, so at D = 512 A stays resident
    (6 B stages); its loss partials: the same bits as the A + B ring (ws_ar_min_stages = 99)
    and as the call with the gradient block, near the old loop's."""
    rings = []
    real_ring = score_tiles.ws_ring

    def spy(*args, **kw):
        r = real_ring(*args, **kw)
        rings.append(r)
        return r

    monkeypatch.setattr(score_tiles, "ws_ring", spy)  # (what ws_launch calls)
    n, s = 1030, 10.0
    rng = cp.random.default_rng(d)
    q, k = ((rng.standard_normal((n, d), dtype=cp.float32) / 8).astype(BF16) for _ in "qk")
    ls = cp.full((1,), math.log(s), cp.float32)
    lb = cp.full((1,), -5.0, cp.float32)
    rt, sp = -(-n // tiling.TILE), 3

    def run(grad=False):
        parts = cp.full((3, sp, n), np.nan, cp.float32)
        g = cp.empty((n, -(-n // 8) * 8), BF16)[:, :n] if grad else None
        score_tiles.tile("siglip", BF16, (rt, sp), q, 0, k, None, scale_log=ls,
                         pos_mod=stats.FAR_MOD,
                         part=(parts[0].data.ptr, parts[1].data.ptr if grad else 0, n),
                         dsp=parts[2].data.ptr if grad else 0, lse_col=lb,
                         weights=(None, 0, 1.0), g=g)
        return cp.asnumpy(parts[0])

    loss = run()
    _ran(ws, "siglip")
    assert rings[-1][0] & 256, rings  # A resident, and no staging after the ring
    assert rings[-1][1] == 1024 + (-(-d // 64) + (rings[-1][0] & 255)) * 16384, rings
    ar_min = cfg.current().ws_ar_min_stages
    configure(ws_ar_min_stages=99)
    assert run().tobytes() == loss.tobytes()
    assert not rings[-1][0] & 256, rings
    configure(ws_ar_min_stages=ar_min)
    assert run(grad=True).tobytes() == loss.tobytes()  # (with the staging)
    old = _old(configure, run)
    assert not np.isnan(loss).any()
    assert _rel(loss, old) <= 1e-4, _rel(loss, old)


@gpu
@pytest.mark.parametrize("d", [64, 200, 512])
@pytest.mark.parametrize("stage", ["lse", "lse2", "g", "clip", "siglip", "h_tri"])
def test_ring_layouts_same_bits(stage, d, ws, configure):
    """A resident or 32 KiB A + B stages, 2 stages or the most that fit: the same MMAs in the
    same order, so the same bits (the ring's wrap-around, each consumer's parities per
    stage, the A barrier)."""
    n = 1030 if stage != "h_tri" else 1024
    runs = []
    for ar_min, st_max in ((1, 8), (99, 8), (1, 2), (99, 2), (1, 3)):
        configure(ws_ar_min_stages=ar_min, ws_max_stages=st_max)
        ws.clear()
        runs.append(_stage_outputs(stage, BF16, n, d, d))
        _ran(ws, stage.split("_")[0])
    for other in runs[1:]:
        for key in runs[0]:
            assert runs[0][key].tobytes() == other[key].tobytes(), (stage, d, key)


@gpu
def test_lse_device_scale_log(ws, configure):
    """tile_lse with a device log scale (InfoNCE's learnable temperature on the global path)
    against float64 and the old loop."""
    rng = np.random.default_rng(4)
    n, d = 700, 96
    q = (rng.standard_normal((n, d)) / 8).astype(BF16)
    k = (rng.standard_normal((n, d)) / 8).astype(BF16)
    ls = cp.asarray(np.array([math.log(12.0)], np.float32))

    def run():
        return [cp.asnumpy(x) for x in score_tiles.tile_lse(cp.asarray(q), cp.asarray(k), None,
                                                            0.5, exclude_diag=False,
                                                            pos_shift=0, pos_mod=n,
                                                            scale_log=ls)]

    lse, loss = run()
    _ran(ws, "lse")
    s = 0.5 * 12.0 * (q.astype(np.float64) @ k.astype(np.float64).T)
    top = s.max(1)
    want = top + np.log(np.exp(s - top[:, None]).sum(1))
    assert _rel(lse, want) <= 1e-5
    assert _rel(loss, want - np.diag(s)) <= 1e-4
    old = _old(configure, run)
    assert _rel(lse, old[0]) <= 1e-6 and _rel(loss, old[1]) <= 1e-5


# ---- global (row0 != 0) paths: distributed/test_global_emulated.py's checks on the new kernels
import test_global_emulated as TG  # noqa: E402


@gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("op", ["clip", "siglip", "nt_xent", "info_nce"])
def test_global_ranks(op, P, ws):
    if op == "clip":
        TG._check_clip(cp, "bfloat16", P, 136, 64, "none", True, True, device=0)
    elif op == "siglip":
        TG._check_siglip(cp, "bfloat16", P, 136, 64, "none", True, True, device=0)
    elif op == "nt_xent":
        TG._check_nt_xent(cp, "bfloat16", P, 200, 64, "mean", True, device=0)
    else:
        TG._check_info_nce(cp, "bfloat16", P, 72, 64, "mean", False, "shared", device=0)
    assert any(ok for _, ok in ws), ws


@gpu
@pytest.mark.parametrize("op", ["clip", "siglip"])
@pytest.mark.parametrize("P", [1, 4])
def test_gradient_blocks_128(monkeypatch, configure, op, P, ws):
    """test_global_emulated's forced 128 x 128 gradient blocks (rows from row0 + r0 - c0,
    negative right of the diagonal) on the new kernels."""
    TG.test_tile_gradient_in_row_and_column_blocks(monkeypatch, configure, op, P, "bfloat16",
                                                   "none")
    _ran(ws, op)


# ---- CPU: the ring's shared-memory plan -------------------------------------------------
SMEM_MAX = 232448  # an H100's opt-in shared memory per block


@pytest.mark.parametrize("stage,static,d,want", [
    ("lse", 2048, 512, (6 | 256, 1024 + 14 * 16384)),   # the prototype's pp_ar6
    ("lse", 2048, 1024, (7, 1024 + 7 * 32768)),         # A does not stay: 7 A + B stages
    ("lse", 2048, 64, (8 | 256, 1024 + 9 * 16384)),
    ("lse2", 12288, 512, (5 | 256, 1024 + 13 * 16384)),  # A resident with 5 B stages
    ("lse2", 40000, 512, (5, 1024 + 5 * 32768)),         # A resident would leave 3
    ("g", 1024, 512, (5 | 256, 1024 + 13 * 16384 + 8192)),
    ("h", 7168, 512, (5, 1024 + 5 * 32768 + 32768)),     # (16 KiB staging a consumer)
    ("clip", 8192, 256, (8 | 256, 1024 + 12 * 16384 + 8192)),
])
def test_ws_ring_plan(stage, static, d, want):
    got = score_tiles.ws_ring(stage, d, static, SMEM_MAX)
    assert got == want
    assert static + got[1] <= SMEM_MAX


def test_ws_ring_none_when_nothing_fits():
    assert score_tiles.ws_ring("g", 64, 200000, SMEM_MAX) is None


def test_ws_ring_siglip_loss_alone_reserves_no_staging():
    """SigLIP without the gradient block (g absent) never touches the staging: its 8 KiB go
    to the ring, one more B stage; G, H and CLIP always stage (the kernel does)."""
    assert score_tiles.ws_ring("siglip", 512, 2048, SMEM_MAX) == \
        (5 | 256, 1024 + 13 * 16384 + 8192)
    assert score_tiles.ws_ring("siglip", 512, 2048, SMEM_MAX, block=False) == \
        (6 | 256, 1024 + 14 * 16384)
    for stage in ("g", "h", "clip"):
        assert score_tiles.ws_ring(stage, 512, 8192, SMEM_MAX, block=False) == \
            score_tiles.ws_ring(stage, 512, 8192, SMEM_MAX)


class _FakeMatrix:
    """What ws_launch reads of a CuPy matrix (pointer, shape, strides, dtype), no GPU."""

    def __init__(self, rows, cols, ptr=1 << 20):
        self.shape, self.ndim, self.size = (rows, cols), 2, rows * cols
        self.dtype = BF16
        self.strides = (2 * cols, 2)
        self.data = type("Mem", (), {"ptr": ptr})()


def test_refused_tensor_maps_are_cached(monkeypatch):
    """A map the driver refuses is remembered like an encoded one: not asked again."""
    calls = []
    monkeypatch.setattr(tiling, "_MAPS", {})
    monkeypatch.setattr(tiling.tma, "matrix_map", lambda x, r, c: calls.append(x) or None)
    x = _FakeMatrix(300, 64)
    assert tiling.tile_map(x) is None and tiling.tile_map(x) is None
    assert len(calls) == 1
    # (declined, not launched)
    assert not score_tiles.ws_launch("lse", BF16, (3, 1), x, x, x, 0, None)
    assert len(calls) == 1


def test_ws_launch_opts_in_before_recording(monkeypatch):
    """The shared-memory opt-in is set before the kernel is recorded as opted in (a thread
    that finds the record must not launch first), and SigLIP's loss alone launches the
    A-resident ring without staging."""
    import cupy

    launches = []

    class Kern:
        attributes = {"shared_size_bytes": 2048}
        _smem = 48 << 10

        @property
        def max_dynamic_shared_size_bytes(self):
            return self._smem

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, v):
            assert id(self) not in tiling._WS_SMEM, "recorded before the opt-in was set"
            self._smem = v

        def __call__(self, grid, block, args, shared_mem):
            assert shared_mem <= self._smem
            (blob,) = args  # (WsLaunch: the ring after the TileArgs)
            at = tiling.LAUNCH_ARGS_AT + tiling.TILE_ARGS_DTYPE.itemsize
            launches.append((int(np.frombuffer(blob.tobytes(), "<i4", 1, at)[0]), shared_mem))

    class Device:
        attributes = {"MaxSharedMemoryPerBlockOptin": SMEM_MAX}

    kern = Kern()
    monkeypatch.setattr(tiling, "_WS_SMEM", {})
    # (score_tiles imports tile_map by name: patched where ws_launch looks it up)
    monkeypatch.setattr(score_tiles, "tile_map",
                        lambda x: np.zeros(1, tiling.tma.TENSOR_MAP_DTYPE))
    monkeypatch.setattr(score_tiles.kernels, "get_kernel", lambda f, st, t: kern)
    monkeypatch.setattr(cupy.cuda, "Device", Device)
    a = _FakeMatrix(1030, 512)
    raw = bytes(tiling.TILE_ARGS_DTYPE.itemsize)
    assert score_tiles.ws_launch("siglip", BF16, (9, 2), a, a, a, 0, raw, block=False)
    assert id(kern) in tiling._WS_SMEM and kern._smem == SMEM_MAX - 2048
    assert score_tiles.ws_launch("siglip", BF16, (9, 2), a, a, a, 0, raw)
    assert launches == [(6 | 256, 1024 + 14 * 16384), (5 | 256, 1024 + 13 * 16384 + 8192)]


def test_launch_blob_layout():
    """The warp-specialised kernels' one argument: maps at 0, 128, 256, 384, the TileArgs at
    LAUNCH_ARGS_AT, the ring after them, the tail, zeros to LAUNCH_BYTES (the layout the
    kernels' static_asserts hold: WsLaunch, WsTf32Launch, WsF16Launch)."""
    maps = [np.frombuffer(bytes([k + 1]) * 128, tiling.tma.TENSOR_MAP_DTYPE) for k in range(4)]
    raw = bytes(range(tiling.TILE_ARGS_DTYPE.itemsize))
    b = tiling.launch_blob(maps, raw, 0x1234 | 256, b"\x07\x08").tobytes()
    # (the C side's numbers: TileArgs 224 bytes, the ring at 736, F16x3's comp at 740)
    assert len(b) == tiling.LAUNCH_BYTES == 768 and tiling.LAUNCH_ARGS_AT == 512
    assert len(raw) == 224 and tiling._RING.size == 4
    assert all(b[128 * k:128 * (k + 1)] == bytes([k + 1]) * 128 for k in range(4))
    at = tiling.LAUNCH_ARGS_AT
    assert b[at:at + len(raw)] == raw
    assert int.from_bytes(b[at + len(raw):at + len(raw) + 4], "little") == 0x1234 | 256
    assert b[at + len(raw) + 4:at + len(raw) + 6] == b"\x07\x08"
    assert b[at + len(raw) + 6:] == bytes(768 - at - len(raw) - 6)
    with pytest.raises(ValueError, match="launch_blob: 4 maps"):
        tiling.launch_blob(maps[:3], raw, 0)
    with pytest.raises(ValueError, match="launch_blob: 4 maps"):
        tiling.launch_blob(maps, raw + b"x", 0)
    with pytest.raises(ValueError, match="launch_blob: 4 maps"):  # (a tail past 768 bytes)
        tiling.launch_blob(maps, raw, 0, bytes(768 - 736 - 4 + 1))
    from cupynce._engine.gemm import f16x3
    tail = f16x3._TAIL.pack(1.5, 1, 2, 3)  # comp, rowf, colf, ufac at 740, 744, 752, 760
    b = tiling.launch_blob(maps, raw, 7, tail).tobytes()
    assert int.from_bytes(b[736:740], "little") == 7 and b[740:768] == tail


def test_ws_switches_key_cuda_graphs():
    """Every switch that changes what the warp-specialised kernels do is part of the
    CUDA-graph key (_graphs.switches: the config)."""
    from cupynce.ops import _graphs

    base = _graphs.switches()
    for name, value in (("ws_tiles", not cfg.current().ws_tiles), ("ws_max_stages", 3),
                        ("ws_ar_min_stages", 99), ("ws_stages", frozenset({"lse"}))):
        with cfg.override(**{name: value}):
            assert _graphs.switches() != base, name
    assert _graphs.switches() == base
