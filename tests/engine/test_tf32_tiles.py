"""The TF32x3 score tiles (``kernels_src/products/tiles_ws_tf32.cu``,
``losses.nt_xent_tf32.tile_lse_tf32x3``, issue 24) on Hopper: float32 inputs, row
log-sum-exps and losses against a float64 NumPy oracle and against the float32 cuBLAS products.

What is measured where (relative, ‖x − ref‖ / ‖ref‖ over the rows), with bounds sized by a
CPU emulation of the kernel (``benchmarks/emulate_tf32x3.py``: each k8 MMA step adds to the
accumulator rounding toward zero, chunks of 32 of K added to the fp32 sum rounding to
nearest; fp32 as a sequential FMA chain), on unit rows with k_i = unit(q_i + 0.3 noise)
(same-sign products, the truncation's worst case) and s = 1/0.07:

* the products, through the positive logits L_{i,p(i)} (the kernel writes its product times s,
  rounded once to float32): against float64 ≤ 2e-7 (emulated 1.1-1.3e-7), and against
  cuBLAS's fp32 product (``cublas.gemm``) times s rounded the same way: at most 2x its error
  at D = 32 (one chunk: 4 truncating hi·hi steps against 32 round-to-nearest FMAs, emulated
  1.3x; cuBLAS may sum more cleverly than one chain), 1.5x at D = 72 (emulated 0.9x), 1x at
  D = 512 (emulated 0.4x; measured with cuBLAS chunks, docs/decisions.md: 0.6x) and there at
  most 1/4 of cuBLAS's 3xTF32 (one truncating chain, emulated 1/11);
* the row lse and the loss against float64: ≤ 3e-7, not 2e-7.  The lse carries the shared
  epilogue's float32 arithmetic besides the products' error (s·log2(e) rounded once for every
  logit, -4.7e-8 relative at s = 1/0.07; each logit, the row max times ln 2, the sums and the
  final add rounded): emulated 1.6-1.9e-7 for the kernel, and 1.3-3.0e-7 for fp32-accurate
  scores through the same epilogue, so 2e-7 would leave no margin.  For the same reason the
  lse is no probe of the products: cuBLAS fp32 scores reduced in float64 on the host
  (emulated 0.8-2.9e-7) are only reported in the messages.

Skips without CuPy / a GPU / compute capability 9.0 and tensor maps, as engine/test_tiles_ws.py.
CPU tests at the end (ring plan, argument checks, the off-Hopper error).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cupynce.config as cfg  # noqa: E402
from cupynce._engine import tma  # noqa: E402
from cupynce._engine.gemm import cublas, tf32x3  # noqa: E402
from cupynce._engine.losses import nt_xent_tf32  # noqa: E402

gpu = pytest.mark.gpu
SCALE = 1 / 0.07
LSE_TOL = 3e-7  # row lse and loss (module doc)
POS_TOL = 2e-7  # positive logits: the products, rounded once
#: the kernel's positive-logit error over cuBLAS fp32's, at most (module doc)
FP32_FACTOR = {32: 2.0, 72: 1.5, 512: 1.0}


@pytest.fixture
def tf32():
    if not tf32x3.available():
        pytest.skip("the TF32 tiles need a compute-capability 9.0 GPU and TMA")


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    num = np.linalg.norm((x - ref).ravel())
    return math.inf if not np.isfinite(num) else float(num / np.linalg.norm(ref.ravel()))


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _inputs(n, m, d, seed):
    """float32 unit rows q (n, d) and k (m, d), k_i = unit(q_i + 0.3 noise) for i < min(n, m)."""
    rng = np.random.default_rng(seed)
    q = _unit(rng.standard_normal((n, d)))
    k = _unit(rng.standard_normal((m, d)))
    c = min(n, m)
    k[:c] = _unit(q[:c] + 0.3 * _unit(rng.standard_normal((c, d))))
    return q.astype(np.float32), k.astype(np.float32)


def _oracle(q, k, scale, exclude_diag=False, pos_shift=0, pos_mod=None):
    """float64 (lse, loss, pos) of the float32 inputs."""
    m = k.shape[0]
    pos_mod = m if pos_mod is None else pos_mod
    logits = scale * (q.astype(np.float64) @ k.astype(np.float64).T)
    return _reduce(logits, exclude_diag, pos_shift, pos_mod)


def _reduce(logits, exclude_diag, pos_shift, pos_mod):
    n = logits.shape[0]
    p = (np.arange(n) + pos_shift) % pos_mod
    pos = logits[np.arange(n), p]
    if exclude_diag:
        logits = logits.copy()
        idx = np.arange(min(n, logits.shape[1]))
        logits[idx, idx] = -np.inf
    mx = logits.max(1)
    lse = mx + np.log(np.exp(logits - mx[:, None]).sum(1))
    return lse, lse - pos, pos


def _cublas_logits(q, k, precision):
    """s q kᵀ from cuBLAS in ``precision`` ("fp32" / "3xtf32"), float32, to the host."""
    qd, kd = cp.asarray(q), cp.asarray(k)
    out = cp.empty((q.shape[0], k.shape[0]), np.float32)
    assert out.size * q.shape[1] > cfg.current().small_gemm_macs, \
        "would take the small-product kernel"
    with cfg.float32_precision(precision):
        cublas.gemm(qd, kd, out, trans_b=True)
    return cp.asnumpy(out)


def _run(q, k, **kw):
    lse, loss, pos = nt_xent_tf32.tile_lse_tf32x3(cp.asarray(q), cp.asarray(k), SCALE,
                                                  positives=True, **kw)
    return cp.asnumpy(lse), cp.asnumpy(loss), cp.asnumpy(pos)


SHAPES = [(300, 200, 32), (1030, 777, 72), (200, 301, 70), (257, 1100, 512), (130, 129, 512)]


@gpu
@pytest.mark.parametrize("n,m,d", SHAPES)
def test_lse_loss_match_float64(tf32, n, m, d):
    q, k = _inputs(n, m, d, seed=n + m + d)
    lse, loss, pos = _run(q, k)
    ref_lse, ref_loss, ref_pos = _oracle(q, k, SCALE)
    e_lse, e_pos = _rel(lse, ref_lse), _rel(pos, ref_pos)
    # the loss lse - pos may be small against its parts: bounded through them
    e_loss = float(np.linalg.norm(loss - ref_loss) /
                   (np.linalg.norm(ref_lse) + np.linalg.norm(ref_pos)))
    # for the record: cuBLAS fp32 scores, float64 reductions on the host
    f_lse = _rel(_reduce(SCALE * _cublas_logits(q, k, "fp32").astype(np.float64), False, 0,
                         m)[0], ref_lse)
    msg = (f"n={n} m={m} d={d}: lse {e_lse:.3e}, loss {e_loss:.3e}, pos {e_pos:.3e}; "
           f"cuBLAS fp32 scores + float64 lse: {f_lse:.3e}")
    assert e_lse <= LSE_TOL, msg
    assert e_pos <= POS_TOL, msg
    assert e_loss <= LSE_TOL, msg


@gpu
@pytest.mark.parametrize("d", [32, 72, 512])
def test_products_at_least_as_accurate_as_fp32(tf32, d):
    """The positive logits (the kernel's products, module doc) against cuBLAS fp32's, and at
    D = 512 against cuBLAS's 3xTF32 (one truncating accumulation)."""
    n = m = 2000
    q, k = _inputs(n, m, d, seed=d)
    _, _, pos = _run(q, k)
    ref = _oracle(q, k, SCALE)[2]
    rows = np.arange(n)
    s32 = np.float32(SCALE)
    e_kernel = _rel(pos, ref)
    e_fp32 = _rel((_cublas_logits(q, k, "fp32")[rows, rows] * s32).astype(np.float32), ref)
    e_3x = _rel((_cublas_logits(q, k, "3xtf32")[rows, rows] * s32).astype(np.float32), ref)
    msg = (f"d={d}: positive logits, kernel {e_kernel:.3e}, cuBLAS fp32 {e_fp32:.3e} "
           f"(bound {FP32_FACTOR[d]}x), cuBLAS 3xtf32 {e_3x:.3e}")
    assert e_kernel <= FP32_FACTOR[d] * e_fp32, msg
    if d >= 512:
        assert e_kernel <= 0.25 * e_3x, msg


@gpu
def test_nt_xent_pairing_and_scale_log(tf32):
    """q is k (one split), the diagonal left out, positive i <-> i + n/2, s = 0.5 exp(log 2 / 0.07)
    through the device scalar (the oracle takes the kernel's s, 0.5 expf(x) in float32, from
    CuPy's expf: the float64 exp would differ by a rounding or two, a bias of every logit)."""
    n, d = 1030, 72
    q, _ = _inputs(n, n, d, seed=7)
    qd = cp.asarray(q)
    sl = cp.asarray(np.array([math.log(2 * SCALE)], np.float32))
    lse, loss, pos = nt_xent_tf32.tile_lse_tf32x3(qd, qd, 0.5, exclude_diag=True,
                                                  pos_shift=n // 2, pos_mod=n, scale_log=sl,
                                                  positives=True)
    s = float(cp.asnumpy(cp.exp(sl) * np.float32(0.5))[0])
    ref_lse, ref_loss, ref_pos = _oracle(q, q, s, exclude_diag=True, pos_shift=n // 2,
                                         pos_mod=n)
    # (random pairs: their dots cancel, ~1.5e-7 emulated for the kernel and for fp32)
    assert _rel(cp.asnumpy(lse), ref_lse) <= LSE_TOL
    assert _rel(cp.asnumpy(pos), ref_pos) <= POS_TOL
    assert float(np.linalg.norm(cp.asnumpy(loss) - ref_loss)) <= LSE_TOL * (
        np.linalg.norm(ref_lse) + np.linalg.norm(ref_pos))


@gpu
@pytest.mark.parametrize("splits", [None, 3])
def test_deterministic(tf32, splits):
    q, k = _inputs(1030, 1500, 512, seed=3)
    a = _run(q, k, splits=splits)
    b = _run(q, k, splits=splits)
    for x, y in zip(a, b):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))


@gpu
def test_split_count_changes_only_the_merge(tf32):
    """Splits change the order of the row merges only: lse within float32 roundings."""
    q, k = _inputs(600, 1500, 72, seed=5)
    one = _run(q, k, splits=1)
    four = _run(q, k, splits=4)
    assert np.array_equal(one[2], four[2])  # the positive logits: the same products
    assert _rel(four[0], one[0]) <= 1e-7


# ---- the product tiles (mm) and NT-Xent's passes (lse2, h) ---------------------------------

def _nt_xent_oracle(z, scale, w=None):
    """float64 (lse, loss, dz) of NT-Xent's mean loss over the float32 rows z (positive
    i <-> i + n/2, the diagonal left out): dz = s (dS + dSᵀ) z, dS = (P - E) / n (``w``:
    the loss sum_i w_i loss_i instead, dS = diag(w) (P - E))."""
    n = z.shape[0]
    z64 = z.astype(np.float64)
    logits = scale * (z64 @ z64.T)
    lse, loss, _ = _reduce(logits, True, n // 2, n)
    p = np.exp(logits - lse[:, None])
    p[np.arange(n), np.arange(n)] = 0.0
    p[np.arange(n), (np.arange(n) + n // 2) % n] -= 1.0
    ds = p / n if w is None else p * np.asarray(w, np.float64)[:, None]
    return lse, loss, scale * ((ds + ds.T) @ z64)


def _nt_xent_inputs(n, d, seed):
    rng = np.random.default_rng(seed)
    z = _unit(rng.standard_normal((n, d)))
    h = n // 2
    z[h:2 * h] = _unit(z[:h] + 0.3 * _unit(rng.standard_normal((h, d))))
    return z.astype(np.float32)


def _nt_xent_fp32(z, t, w=None):
    """cupynce's float32 cuBLAS path (precision="fp32"): (lse, loss, dz) on the host (``w``:
    the per-row loss weights, default 1 / n)."""
    import cupynce

    zd = cp.asarray(z)
    loss, ctx = cupynce.nt_xent_forward(zd, t, reduction="none", requires_grad=True,
                                        precision="fp32")
    g = cp.full((z.shape[0],), 1.0 / z.shape[0], np.float32) if w is None else cp.asarray(w)
    dz = cupynce.nt_xent_backward(ctx, g)
    return cp.asnumpy(ctx.stats[0]), cp.asnumpy(loss), cp.asnumpy(dz)


#: the mm tiles' error over cuBLAS fp32's, at most.  Measured on an H100 (2026-11-26): same-sign
#: operands 1.36e-7 / 1.45e-7 / 1.94e-7 against cuBLAS fp32's 7.8e-8 / 6.5e-8 / 1.7e-7 at
#: K = 520 / 1030 / 4096 (cuBLAS's fp32 sums K in short blocks; the promoted chunks still lose
#: a truncation per k8 step inside each 32), so 2.5x; zero-mean operands 1.04x at K = 1030
#: (random-walk partial sums: rounding noise of one size), so 1.25x.  The products alone are
#: thus not fp32-accurate; the op's gradient is (test_nt_xent_against_float64_and_fp32: H's
#: accuracy dominates it).  And against float64 at most MM_TOL, the kernel's own bound.
MM_FACTOR = {"positive": 2.5, "zero-mean": 1.25}
MM_TOL = 3e-7


@gpu
@pytest.mark.parametrize("data", ["positive", "zero-mean"])
@pytest.mark.parametrize("m,k,c", [(300, 520, 200), (129, 1030, 130), (257, 4096, 512)])
def test_mm_against_float64_and_fp32(tf32, m, k, c, data):
    """out = A Bᵀ on the promoted TF32x3 tiles against float64 and cuBLAS fp32's product
    (K >= 520: 17+ promoted chunks; MM_FACTOR), deterministic, alpha applied."""
    rng = np.random.default_rng(m + k)
    if data == "positive":
        a = rng.random((m, k)).astype(np.float32)
        b = rng.random((c, k)).astype(np.float32)
    else:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((c, k)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    ad, bd = cp.asarray(a), cp.asarray(b)
    out = cp.empty((m, c), np.float32)
    tf32x3.mm(tf32x3.padded(ad), tf32x3.split(bd), out, alpha=0.5)
    got = 2.0 * cp.asnumpy(out)
    fp32 = cp.empty((m, c), np.float32)
    with cfg.float32_precision("fp32"):
        cublas.gemm(ad, bd, fp32, trans_b=True)
    e_k, e_f = _rel(got, ref), _rel(cp.asnumpy(fp32), ref)
    msg = f"tf32x3 mm {e_k:.3g} against cuBLAS fp32 {e_f:.3g}"
    assert e_k <= MM_FACTOR[data] * e_f, msg
    assert e_k <= MM_TOL, msg
    again = cp.empty((m, c), np.float32)
    tf32x3.mm(tf32x3.padded(ad), tf32x3.split(bd), again, alpha=0.5)
    assert np.array_equal(cp.asnumpy(again).view(np.uint32), cp.asnumpy(out).view(np.uint32))


@gpu
@pytest.mark.parametrize("symmetric,blocks", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("n,d", [(1030, 72), (512, 130), (2048, 512), (258, 33)])
def test_nt_xent_against_float64_and_fp32(tf32, n, d, symmetric, blocks):
    """NT-Xent on the TF32x3 tiles (lse2 or lse, h, mm) against float64: lse, loss and dz no
    less accurate than cupynce's float32 cuBLAS path (the issue's bar), with a floor of 2e-7
    for the statistics (the shared epilogue's float32 arithmetic, module doc).  ``blocks``:
    H in row blocks of 256 (square tiles, a product per block), the workspace a caller's
    ``workspace_bytes`` bounds."""
    t = 0.07
    z = _nt_xent_inputs(n, d, seed=n + d)
    ref_lse, ref_loss, ref_dz = _nt_xent_oracle(z, 1 / t)
    f_lse, f_loss, f_dz = _nt_xent_fp32(z, t)
    ws = 4 * (-(-n // 4) * 4) * 256 if blocks else None
    lse, loss, dz = nt_xent_tf32.nt_xent(cp.asarray(z), 1 / t, (None, 0, 1.0 / n),
                                         symmetric=symmetric, workspace_bytes=ws)
    got = [cp.asnumpy(x) for x in (lse, loss, dz)]
    errs = [(_rel(g, r), _rel(f, r)) for g, f, r in zip(got, (f_lse, f_loss, f_dz),
                                                          (ref_lse, ref_loss, ref_dz))]
    msg = "tf32x3 / fp32 errors (lse, loss, dz): " + ", ".join(f"{a:.3g} / {b:.3g}"
                                                                 for a, b in errs)
    # (the loss is lse - L_pos: its floor is the lse's, over the loss's smaller norm)
    loss_floor = 2e-7 * np.linalg.norm(ref_lse) / np.linalg.norm(ref_loss)
    for (e_k, e_f), floor in zip(errs, (2e-7, loss_floor, 0.0)):
        assert e_k <= max(e_f, floor), msg


@gpu
@pytest.mark.parametrize("n,d,r", [(1030, 72, 384), (2048, 64, 512), (640, 40, 128)])
def test_nt_xent_pair_schedule(tf32, n, d, r, monkeypatch):
    """Above the workspace H goes in square pair blocks, each computed once and used by an
    ``mm`` and an ``mmt`` (``rows``): every block ran (a ragged last one at n = 1030), the
    per-row weights and the (M, log2 S) pairs read at the shifted indices, the diagonal and
    the positives where they fall globally -- dz against float64 no less accurate than the
    float32 cuBLAS path's and within 1.5x the whole-H path's (the same H, the products summed
    in blocks), its bits repeated."""
    t = 0.07
    rng = np.random.default_rng(n)
    z = _nt_xent_inputs(n, d, seed=n + 1)
    w = (rng.uniform(0.5, 2.0, n) / n).astype(np.float32)
    ws = 4 * r * r
    assert nt_xent_tf32.pair_rows(n, ws) == r
    calls = []
    real = nt_xent_tf32.h_pair
    monkeypatch.setattr(nt_xent_tf32, "h_pair",
                        lambda *a: calls.append(a[5:7]) or real(*a))
    zd, wd = cp.asarray(z), cp.asarray(w)
    _, _, dz = nt_xent_tf32.nt_xent(zd, 1 / t, (wd, 1, 1.0), workspace_bytes=ws)
    nb = -(-n // r)
    assert len(calls) == nb * (nb + 1) // 2
    assert calls[0] == ((0, r), (0, r)) and calls[-1][1][1] == n
    _, _, again = nt_xent_tf32.nt_xent(zd, 1 / t, (wd, 1, 1.0), workspace_bytes=ws)
    assert np.array_equal(cp.asnumpy(again).view(np.uint32), cp.asnumpy(dz).view(np.uint32))
    monkeypatch.setattr(nt_xent_tf32, "h_pair", real)
    _, _, whole = nt_xent_tf32.nt_xent(zd, 1 / t, (wd, 1, 1.0))
    ref = _nt_xent_oracle(z, 1 / t, w)[2]
    e_pair, e_whole = _rel(cp.asnumpy(dz), ref), _rel(cp.asnumpy(whole), ref)
    e_fp32 = _rel(_nt_xent_fp32(z, t, w)[2], ref)
    msg = f"dz errors: pairs {e_pair:.3g}, whole H {e_whole:.3g}, fp32 {e_fp32:.3g}"
    assert e_pair <= e_fp32 and e_pair <= 1.5 * e_whole, msg


@gpu
def test_nt_xent_passes_deterministic(tf32):
    z = cp.asarray(_nt_xent_inputs(1030, 72, seed=1))
    a = nt_xent_tf32.nt_xent(z, 1 / 0.07, (None, 0, 1e-3))
    b = nt_xent_tf32.nt_xent(z, 1 / 0.07, (None, 0, 1e-3))
    for x, y in zip(a, b):
        assert np.array_equal(cp.asnumpy(x).view(np.uint32), cp.asnumpy(y).view(np.uint32))


# ---- CPU (no GPU needed) -------------------------------------------------------------------

def test_ring_plan():
    """Three 64 KiB stages in an H100's 227 KiB beside ~2 KiB of static memory; none below 2."""
    assert tf32x3.STAGE_BYTES == 65536
    assert tf32x3.ring(2048, 232448) == (3, 1024 + 3 * 65536)
    assert tf32x3.ring(2048, 101376) is None  # (99 KiB: an sm_86-sized block)


def test_matrix_map_checks_dtype_and_box():
    """float32 maps take 32-column boxes (128-byte rows); anything else is refused before the
    driver is asked."""
    x = np.zeros((4, 64), np.float32)
    with pytest.raises(ValueError, match="float32 with 32"):
        tma.matrix_map(x, 128, 64)
    with pytest.raises(ValueError, match="float64"):
        tma.matrix_map(np.zeros((4, 64)), 128, 16)


def test_arguments_checked_before_the_device(monkeypatch):
    q = np.zeros((10, 8), np.float32)
    with pytest.raises(NotImplementedError, match="neg_s"):
        nt_xent_tf32.tile_lse_tf32x3(q, q, 1.0, neg_s=q)
    with pytest.raises(ValueError, match="float32"):
        nt_xent_tf32.tile_lse_tf32x3(q.astype(np.float16), q, 1.0)
    with pytest.raises(ValueError, match="same d"):
        nt_xent_tf32.tile_lse_tf32x3(q, np.zeros((10, 4), np.float32), 1.0)
    with pytest.raises(ValueError, match="do not fit together"):
        tf32x3.mm(np.zeros((10, 8), np.float32), (q[:, :4], q[:, :4]),
                  np.zeros((10, 10), np.float32))
    monkeypatch.setattr(tf32x3, "available", lambda: False)
    with pytest.raises(tf32x3.TF32TilesUnavailable, match="compute-capability 9.0"):
        nt_xent_tf32.tile_lse_tf32x3(q, q, 1.0)


@gpu
@pytest.mark.parametrize("mode", ["auto", "3xtf32", "fp32", "tf32"])
def test_ops_route_float32_nt_xent_here(tf32, mode, monkeypatch, configure):
    """The ops' float32 NT-Xent (forward, fused and recompute backward) runs these tiles under
    "3xtf32" and, from tf32x3_min_rows x tf32x3_min_dim on, "auto"; cuBLAS under "fp32" and
    "tf32"; CUPYNCE_TILES=0 (config.tiles False) turns them off as it does the 16-bit tiles;
    other ops never come here."""
    import cupynce

    calls = []
    real = nt_xent_tf32.rows
    monkeypatch.setattr(nt_xent_tf32, "rows", lambda *a, **k: calls.append(k) or real(*a, **k))
    big = (cfg.current().tf32x3_min_rows, cfg.current().tf32x3_min_dim)
    small = [(big[0] - 2, big[1]), (big[0], big[1] - 1), (260, 64)]
    for n, d in [big] + small:
        z = cp.asarray(_nt_xent_inputs(n, d, seed=3))
        _, ctx = cupynce.nt_xent_forward(z, 0.1, precision=mode)
        cupynce.nt_xent_backward(ctx)
        _, ctx = cupynce.nt_xent_forward(z, 0.1, reduction="none", precision=mode)
        cupynce.nt_xent_backward(ctx, cp.ones((n,), np.float32))
        on = mode == "3xtf32" or (mode == "auto" and (n, d) == big)
        assert len(calls) == (3 if on else 0), (n, d, calls)
        if on:
            assert [c["lse_in"] is None for c in calls] == [True, True, False]
        del calls[:]
    z = cp.asarray(_nt_xent_inputs(*big, seed=3))
    cupynce.info_nce(z[:big[0] // 2], z[big[0] // 2:], 0.1, precision=mode)
    cupynce.nt_xent(z.astype(cp.float64), 0.1, precision=mode)
    configure(tiles=False)
    cupynce.nt_xent(z, 0.1, precision=mode)
    assert calls == []


@gpu
def test_h_from_s_row_loop_and_fallback(tf32, monkeypatch):
    """cpn_tf32x3_h_from_s with fewer grid rows than H's (each block looping over rows) gives
    the same bits; a launch the tiles refuse falls back to the row blocks (fp32's bits under
    "auto")."""
    import cupynce
    from cupynce.ops import _graphs

    n, d = cfg.current().tf32x3_min_rows, cfg.current().tf32x3_min_dim
    z = cp.asarray(_nt_xent_inputs(n, d, seed=5))

    def step(**kw):
        loss, ctx = cupynce.nt_xent_forward(z, 0.1, **kw)
        return [cp.asnumpy(x) for x in (loss, cupynce.nt_xent_backward(ctx))]

    # (a CUDA-graph plan of this problem cached by an earlier test would replay its own
    # kernels: every step below must run or capture them afresh)
    _graphs.clear()
    want = step()
    _graphs.clear()
    monkeypatch.setattr(nt_xent_tf32, "H_FROM_S_GRID_Y", 7)
    for x, y in zip(step(), want):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))

    def refuse(*a, **k):
        raise tf32x3.TF32TilesUnavailable("refused")
    monkeypatch.setattr(tf32x3, "launch", refuse)
    _graphs.clear()
    for x, y in zip(step(), step(precision="fp32")):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))


@gpu
def test_lse_pairs_from_natural_lse(tf32):
    """ml_from_lse: M + log2 S equals lse log2(e) to ~48 bits (what the recompute backward's
    H reads), M the float32 rounding of it."""
    lse = cp.asarray(np.random.default_rng(0).uniform(-40, 60, 1000).astype(np.float32))
    ml = cp.asnumpy(nt_xent_tf32.ml_from_lse(lse)).astype(np.float64)
    want = cp.asnumpy(lse).astype(np.float64) / math.log(2.0)
    # (the pair holds ~48 bits: lo's own float32 rounding, 2^-24 |lo| <= 2^-49 |want|, and
    # the float64 products' roundings)
    assert np.all(np.abs(ml[:, 0] + ml[:, 1] - want) <= 2.0 ** -46 * np.abs(want))
    assert np.array_equal(ml[:, 0], want.astype(np.float32).astype(np.float64))


def test_applies_thresholds(monkeypatch, configure):
    """Which problems the engine routes to the tiles (no GPU needed: the device check is
    stubbed): NT-Xent's symmetric float32 problem only; "auto" from tf32x3_min_rows x
    tf32x3_min_dim, "3xtf32" at every size, "fp32" / "tf32" never; config.tiles False never."""
    monkeypatch.setattr(tf32x3, "available", lambda: True)
    n0, d0 = cfg.current().tf32x3_min_rows, cfg.current().tf32x3_min_dim

    def ok(n, d, mode, dtype=np.float32, neg_s=None, **kw):
        q = np.empty((n, d), dtype)
        args = dict(exclude_diag=True, pos_shift=n // 2, pos_mod=n, self_pair=True,
                    scale_log=None)
        args.update(kw)
        with cfg.float32_precision(mode):
            return nt_xent_tf32.applies(q, q, neg_s, **args)

    assert ok(n0, d0, "auto") and ok(2 * n0, 4 * d0, "auto")
    assert not ok(n0 - 2, d0, "auto") and not ok(n0, d0 - 1, "auto")
    assert ok(6, 3, "3xtf32") and ok(n0, d0, "3xtf32")
    assert not ok(n0, d0, "fp32") and not ok(n0, d0, "tf32")
    assert not ok(n0, d0, "auto", dtype=np.float64)
    assert not ok(n0, d0, "3xtf32", exclude_diag=False)
    assert not ok(n0, d0, "3xtf32", self_pair=False)
    assert not ok(n0, d0, "3xtf32", pos_shift=0)
    assert not ok(n0, d0, "3xtf32", scale_log=np.zeros(1, np.float32))
    assert not ok(n0, d0, "3xtf32", neg_s=np.empty((8, d0), np.float32))
    configure(tiles=False)
    assert not ok(n0, d0, "auto") and not ok(6, 3, "3xtf32")
