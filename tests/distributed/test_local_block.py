"""The rank-local blocks of the global losses (``cupynce.ops._local``), with P emulated ranks.

Each rank's blocks (InfoNCE: its rows against every column; NT-Xent: the symmetric schedule of
``_local.NtXentPlan``, each pair of rank blocks once) must give its rows of the single-process
loss on the concatenated batch; the row-side gradients plus the column-side gradients summed
over ranks (what the reduce-scatter of the distributed ops does) must give the single-process
gradients.  Oracle: the float64 reference (``cupynce.reference``).
Runs on the NumPy path (CI) and, marked ``gpu``, on the GPU paths with the P ranks on one GPU,
where the blocks of every rank together must give the single-process op on the concatenated
batch: the float64 oracle within the float32 tolerances (float32), and, for 16-bit inputs, the
single-process op on the same path within what two orders of summation allow (fp32 statistics:
1e-5; gradients through a 16-bit gradient block: bfloat16 1e-2, float16 2e-3, as
``test_tiles_agree_with_cublas_path``).  Both the tile kernels and the cuBLAS row blocks run.
"""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

import cupynce
from cupynce import reference as ref
from cupynce.ops import _base, _local
from cupynce.ops._base import reduce, weights

try:
    import cupy as cp
except ImportError:  # (the gpu tests are skipped without it: conftest)
    cp = None

TOL = {np.dtype(np.float64): (1e-12, 1e-12), np.dtype(np.float32): (1e-5, 1e-4)}


def rel(x, r) -> float:
    x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
    den = np.linalg.norm(r.ravel())
    return float(np.linalg.norm((x - r).ravel()) / (den if den > 0 else 1.0))


def nt_xent_ranks(xp, Z, P, t, reduction, g, to=np.asarray):
    """(per-row loss in global order, dZ) from P emulated ranks running the symmetric
    NT-Xent schedule (``_local.NtXentPlan``) phase by phase: every rank's statistics, the
    column states exchanged and merged, every rank's gradient blocks summed at the owners."""
    from cupynce import _engine
    from cupynce.ops import _numpy

    engine = _numpy if xp is np else _engine
    n2g, d = Z.shape
    N = n2g // 2
    n = N // P
    path = _base.Path(xp)
    mine = [np.r_[np.arange(r * n, (r + 1) * n), N + np.arange(r * n, (r + 1) * n)]
            for r in range(P)]
    zs = [to(Z[m]) for m in mine]
    parts = xp.stack(zs)
    dots = xp.stack([xp.concatenate([engine.pair_dots(z[:n], z[n:])] * 2) for z in zs])
    plans = [_local.NtXentPlan(r, P, 2 * n) for r in range(P)]
    stats = [_local.nt_xent_stats(path, engine, plans[r], zs[r], parts, dots, 1.0 / t, None)
             for r in range(P)]
    states = xp.stack([s[3] for s in stats]) if plans[0].width else None
    lse = [_local.nt_xent_lse(plans[r], engine, stats[r][0], stats[r][2], states)
           for r in range(P)]
    loss = np.empty(n2g)
    for r in range(P):
        loss[mine[r]] = _np(stats[r][1] + (lse[r] - stats[r][0]))
    if reduction == "none":
        w_all, w_mul = xp.stack([to(g[m]) for m in mine]).astype(lse[0].dtype), 1.0
    else:
        w_all, w_mul = None, g * _base.row_weight(reduction, n2g)
    accs = [_local.nt_xent_grads(path, engine, plans[r], zs[r], parts, 1.0 / t,
                                 xp.stack(lse), w_all, w_mul, None) for r in range(P)]
    dZ = np.zeros((n2g, d))
    for r in range(P):  # the reduce-scatter: every rank's slot r, summed at rank r
        dZ[mine[r]] = sum(_np(acc[r]) for acc in accs)
    return loss, dZ


def info_nce_ranks(xp, Q, K, S, Np_, P, t, reduction, g, to=np.asarray):
    """(per-row loss, dQ, dK, dS, dNp) from P emulated ranks' InfoNCE blocks; S (P m, D):
    every rank's m shared negatives in rank order; Np_ (N, Mp, D): per-query negatives."""
    N, d = Q.shape
    n = N // P
    a = np.dtype(np.float64) if Q.dtype == np.float64 else np.dtype(np.float32)
    path = _base.Path(xp)
    loss = np.empty(N)
    dQ, dK = np.zeros((N, d)), np.zeros((N, d))
    dS = None if S is None else np.zeros(S.shape)
    dNp = None if Np_ is None else np.zeros(Np_.shape)
    for r in range(P):
        mine = np.arange(r * n, (r + 1) * n)
        other_keys = np.setdiff1d(np.arange(N), mine)
        parts = [K[other_keys]] + ([S] if S is not None else [])
        others = np.concatenate(parts) if sum(len(p) for p in parts) else None
        w = weights(xp, to(g[mine]) if reduction == "none" else g, reduction,
                    len(mine) if reduction == "none" else N, a)
        _, lr, (dq, dk, do, dnp) = _local.info_nce_block(
            path, to(Q[mine]), to(K[mine]), None if others is None else to(others),
            None if Np_ is None else to(Np_[mine]), 1.0 / t, lse_in=None, weights=w,
            want_grad=True, workspace_bytes=None)
        loss[mine] = _np(lr)
        dQ[mine] += _np(dq)
        dK[mine] += _np(dk)
        if others is not None:
            do = _np(do)
            dK[other_keys] += do[:len(other_keys)]
            if S is not None:
                dS += do[len(other_keys):]
        if Np_ is not None:
            dNp[mine] = _np(dnp)
    return loss, dQ, dK, dS, dNp


def _np(x):
    if x is None:
        return None
    if type(x).__module__.startswith("cupy"):
        x = x.get()
    return np.asarray(x, np.float64)


def _reduced(loss, reduction):
    return reduce(np, loss, reduction)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_nt_xent_blocks_give_the_global_loss(P, reduction, dtype):
    rng = np.random.default_rng(zlib.crc32(f"nt{P}{reduction}{dtype}".encode()))
    n, d = 3, 5
    Z = (rng.standard_normal((2 * n * P, d)) / np.sqrt(d)).astype(dtype)
    g = rng.standard_normal(2 * n * P) if reduction == "none" else 0.7
    want, (dz_want,) = ref.nt_xent(Z, 0.3, reduction=reduction, grad_loss=g)
    loss, dZ = nt_xent_ranks(np, Z, P, 0.3, reduction, g)
    tl, tg = TOL[np.dtype(dtype)]
    assert rel(_reduced(loss, reduction), want) <= tl
    assert rel(dZ, dz_want) <= tg


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("neg", [None, "shared", "paired"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("P", [1, 2, 3])
def test_info_nce_blocks_give_the_global_loss(P, reduction, neg, dtype):
    rng = np.random.default_rng(zlib.crc32(f"in{P}{reduction}{neg}{dtype}".encode()))
    n, d, m = 4, 6, 2
    N = n * P

    def arr(*shape):
        return (rng.standard_normal(shape) / np.sqrt(d)).astype(dtype)

    Q, K = arr(N, d), arr(N, d)
    S = arr(m * P, d) if neg == "shared" else None  # each rank's m, in rank order
    Np_ = arr(N, m, d) if neg == "paired" else None
    g = rng.standard_normal(N) if reduction == "none" else 0.7
    negs = S if neg == "shared" else Np_
    want, (dq_w, dk_w, dn_w) = ref.info_nce(Q, K, 0.2, negatives=negs, reduction=reduction,
                                            grad_loss=g)
    loss, dQ, dK, dS, dNp = info_nce_ranks(np, Q, K, S, Np_, P, 0.2, reduction, g)
    tl, tg = TOL[np.dtype(dtype)]
    assert rel(_reduced(loss, reduction), want) <= tl
    assert rel(dQ, dq_w) <= tg and rel(dK, dk_w) <= tg
    if neg is not None:
        assert rel(dS if neg == "shared" else dNp, dn_w) <= tg


def clip_ranks(A, B_, ls, P, reduction, g):
    """(per-pair loss, dA, dB, dlogit_scale) of the global CLIP on P emulated ranks (the one
    n × N block a rank of ``cupynce.ops._global``), gradients divided by P (the data-parallel
    factor) and assembled in rank order."""
    import cupynce
    from emulated_ranks import run

    N = A.shape[0]
    n = N // P
    a = np.dtype(np.float64) if A.dtype == np.float64 else np.dtype(np.float32)

    def rank(comm):
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        loss, ctx = cupynce.clip_loss_forward(A[sl], B_[sl], np.asarray(ls, a),
                                              reduction="none", group=comm)
        up = np.asarray(g[sl] if reduction == "none" else
                        np.full(n, g / (N if reduction == "mean" else 1)), a)
        return loss, cupynce.clip_loss_backward(ctx, up)

    out = run(P, rank)
    loss = np.concatenate([o[0] for o in out]).astype(np.float64)
    dA = np.concatenate([o[1][0] for o in out]).astype(np.float64) / P
    dB = np.concatenate([o[1][1] for o in out]).astype(np.float64) / P
    return loss, dA, dB, float(out[0][1][2])


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("P", [1, 2, 3])
def test_clip_blocks_give_the_global_loss(P, reduction, dtype):
    rng = np.random.default_rng(zlib.crc32(f"cl{P}{reduction}{dtype}".encode()))
    n, d = 4, 6
    A, B_ = ((rng.standard_normal((n * P, d)) / np.sqrt(d)).astype(dtype) for _ in range(2))
    g = rng.standard_normal(n * P) if reduction == "none" else 0.7
    want, (da_w, db_w, dls_w) = ref.clip_loss(A, B_, 2.3, reduction=reduction, grad_loss=g)
    loss, dA, dB, dls = clip_ranks(A, B_, 2.3, P, reduction, g)
    tl, tg = TOL[np.dtype(dtype)]
    assert rel(_reduced(loss, reduction), want) <= tl
    assert rel(dA, da_w) <= tg and rel(dB, db_w) <= tg
    assert rel(dls, dls_w) <= 4 * tg  # (a scalar sum that cancels)


# ---- the GPU paths (P ranks on one GPU) ----------------------------------------------------
gpu = pytest.mark.gpu
BF16 = np.dtype(ml_dtypes.bfloat16)
HALF_TOL = {BF16: 1e-2, np.dtype(np.float16): 2e-3}


@pytest.fixture(params=["cublas", "tiles"])
def gpu_path(request, configure):
    configure(tiles=request.param == "tiles")
    return request.param


def _same_dtype_single(op, arrays, t, reduction, g):
    """The single-process cupynce op on the concatenated batch (the same GPU path and dtype)."""
    dev = [None if a is None else cp.asarray(a) for a in arrays]
    gg = cp.asarray(g) if isinstance(g, np.ndarray) else g
    if op == "nt_xent":
        loss, ctx = cupynce.nt_xent_forward(dev[0], t, reduction=reduction)
        return _np(loss), [_np(cupynce.nt_xent_backward(ctx, gg))]
    loss, ctx = cupynce.info_nce_forward(dev[0], dev[1], t, negatives=dev[2],
                                         reduction=reduction)
    return _np(loss), [_np(x) for x in cupynce.info_nce_backward(ctx, gg)]


@gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16, np.dtype(np.float16)], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("P", [2, 3])
def test_nt_xent_blocks_gpu(P, reduction, dtype, gpu_path):
    rng = np.random.default_rng(zlib.crc32(f"gnt{P}{reduction}{dtype}".encode()))
    n, d = 40, 64
    Z = (rng.standard_normal((2 * n * P, d)) / 8).astype(dtype)
    g = rng.standard_normal(2 * n * P) if reduction == "none" else 0.7
    loss, dZ = nt_xent_ranks(cp, Z, P, 0.2, reduction, g, to=cp.asarray)
    got = _reduced(loss, reduction)
    if dtype == np.float32:
        want, (dz_want,) = ref.nt_xent(Z, 0.2, reduction=reduction, grad_loss=g)
        tl, tg = 1e-5, 1e-4
    else:
        want, (dz_want,) = _same_dtype_single("nt_xent", [Z], 0.2, reduction, g)
        tl, tg = 1e-5, HALF_TOL[dtype]
    assert rel(got, want) <= tl
    assert rel(dZ, dz_want) <= tg


@gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
@pytest.mark.parametrize("neg", [None, "shared", "paired"])
@pytest.mark.parametrize("P", [2, 3])
def test_info_nce_blocks_gpu(P, neg, dtype, gpu_path):
    rng = np.random.default_rng(zlib.crc32(f"gin{P}{neg}{dtype}".encode()))
    n, d, m = 40, 64, 8
    N = n * P

    def arr(*shape):
        return (rng.standard_normal(shape) / 8).astype(dtype)

    Q, K = arr(N, d), arr(N, d)
    S = arr(m * P, d) if neg == "shared" else None
    Np_ = arr(N, m, d) if neg == "paired" else None
    negs = S if neg == "shared" else Np_
    loss, dQ, dK, dS, dNp = info_nce_ranks(cp, Q, K, S, Np_, P, 0.2, "mean", 0.7,
                                              to=cp.asarray)
    if dtype == np.float32:
        want, grads = ref.info_nce(Q, K, 0.2, negatives=negs, grad_loss=0.7)
        tl, tg = 1e-5, 1e-4
    else:
        want, grads = _same_dtype_single("info_nce", [Q, K, negs], 0.2, "mean", 0.7)
        tl, tg = 1e-5, HALF_TOL[dtype]
    assert rel(_reduced(loss, "mean"), want) <= tl
    assert rel(dQ, grads[0]) <= tg and rel(dK, grads[1]) <= tg
    if neg is not None:
        assert rel(dS if neg == "shared" else dNp, grads[2]) <= tg


@gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
@pytest.mark.parametrize("m", [40, 256])
@pytest.mark.parametrize("d", [64, 60])
def test_clip_block_without_positives_gpu(dtype, m, d, gpu_path):
    """``_engine.clip(positives=False)`` (CLIP's ring: another rank's chunk of texts) against
    NumPy's block of the same rows (``numpy_clip(positives=False)``, float64 from the same
    16-bit values): the rows' log-sum-exps and the columns' (m, s) state merged to the
    column lse (1e-5), then the gradients from given statistics (float32 1e-4, bfloat16
    through its 16-bit gradient block 1e-2); the row losses None.  m = 256: several column
    tiles; the tiles (aligned) and the cuBLAS fallback both (d = 60: 16-bit rows the tiles
    do not take)."""
    from cupynce import _engine
    from cupynce.ops import _numpy
    from cupynce.ops.clip import numpy_clip

    rng = np.random.default_rng(zlib.crc32(f"cnp{m}{d}{dtype}".encode()))
    n = 64
    A, B = ((rng.standard_normal(s) / 8).astype(dtype) for s in ((n, d), (m, d)))
    Af, Bf = A.astype(np.float64), B.astype(np.float64)
    ls = 1.3
    shift = (Af @ Bf.T).max(axis=0)  # (each column's largest raw dot: a stable shift)
    w = (None, 0, 0.7)
    kw = dict(weights=None, want_grad=False, workspace_bytes=None, col_state=True,
              positives=False)
    lr, st, rl, _ = _engine.clip(cp.asarray(A), cp.asarray(B),
                                 cp.asarray(np.full(1, ls, np.float32)), lse_r=None,
                                 lse_c=None, want_loss=True, col_shift=cp.asarray(
                                     shift.astype(np.float32)), **kw)
    wr, wst, wrl, _ = numpy_clip(Af, Bf, np.full(1, ls), lse_r=None, lse_c=None,
                                 want_loss=True, col_shift=shift, **kw)
    assert rl is None and wrl is None
    assert rel(_np(lr), wr) <= 1e-5
    assert rel(_np(_engine.col_lse(st[None])), _numpy.col_lse(np.asarray(wst)[None])) <= 1e-5
    lse_r, lse_c = wr, _numpy.col_lse(np.asarray(wst)[None])
    kw.update(weights=w, want_grad=True, col_state=False)
    _, _, _, (da, db, _) = _engine.clip(
        cp.asarray(A), cp.asarray(B), cp.asarray(np.full(1, ls, np.float32)),
        lse_r=cp.asarray(lse_r.astype(np.float32)), lse_c=cp.asarray(lse_c.astype(np.float32)),
        want_loss=False, col_shift=None, **kw)
    _, _, _, (wa, wb, _) = numpy_clip(Af, Bf, np.full(1, ls), lse_r=lse_r, lse_c=lse_c,
                                      want_loss=False, col_shift=None, **kw)
    tg = 1e-4 if dtype == np.float32 else 1e-2
    assert rel(_np(da), wa) <= tg and rel(_np(db), wb) <= tg


@gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
@pytest.mark.parametrize("d", [64, 60])
@pytest.mark.parametrize("case", ["keys", "shared", "blocks"])
def test_rows_without_positives_gpu(dtype, d, case, gpu_path):
    """``_engine.rows(positives=False)`` (InfoNCE's ring: the gradient block of another rank's
    keys, no positive among them) against NumPy's (``_numpy.rows(positives=False)``, float64
    from the same 16-bit values) given the same row log-sum-exps: dq and dk (float32 1e-4,
    bfloat16 through its 16-bit gradient block 1e-2), no row loss; the tiles and the cuBLAS
    row blocks (d = 60: rows the tiles do not take); with shared negatives beside the keys
    (``shared``: every positive numbered past them too), and in several row blocks
    (``blocks``: a small workspace)."""
    from cupynce import _engine
    from cupynce.ops import _numpy

    rng = np.random.default_rng(zlib.crc32(f"rnp{d}{dtype}{case}".encode()))
    n, m, ms = 192, 200, 56
    Q, K, S = ((rng.standard_normal(s) / 8).astype(dtype) for s in ((n, d), (m, d), (ms, d)))
    Qf, Kf, Sf = (x.astype(np.float64) for x in (Q, K, S))
    cols = np.concatenate([Kf, Sf]) if case == "shared" else Kf
    lse = np.log(np.exp((Qf @ cols.T) * 5.0).sum(axis=1)) + 0.5  # (any row statistics)
    kw = dict(exclude_diag=False, pos_shift=0, pos_mod=n, weights=(None, 0, 0.7),
              want_grad=True, op="info_nce", positives=False,
              workspace_bytes=64 * m * 2 if case == "blocks" else None)
    shared = case == "shared"
    _, loss, (dq, dk, ds, _) = _engine.rows(
        cp.asarray(Q), cp.asarray(K), cp.asarray(S) if shared else None, None, 5.0,
        lse_in=cp.asarray(lse.astype(np.float32)), **kw)
    _, _, (wq, wk, ws, _) = _numpy.rows(Qf, Kf, Sf if shared else None, None, 5.0,
                                        lse_in=lse, **kw)
    assert loss is None
    tg = 1e-4 if dtype == np.float32 else 1e-2
    assert rel(_np(dq), wq) <= tg and rel(_np(dk), wk) <= tg
    if shared:
        assert rel(_np(ds), ws) <= tg
