"""The rank-local blocks of the global losses on the GPU paths, with P emulated ranks on one GPU.

The blocks of every rank together must give the single-process op on the concatenated batch:
the float64 oracle within the float32 tolerances (float32), and, for 16-bit inputs, the
single-process op on the same path within what two orders of summation allow (fp32 statistics:
1e-5; gradients through a 16-bit gradient block: bfloat16 1e-2, float16 2e-3, as
``test_tiles_agree_with_cublas_path``).  Both the tile kernels and the cuBLAS row blocks run.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import cupynce
from cupynce import reference as ref

import test_local_block as LB  # noqa: E402  (its folder is on sys.path: conftest)

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
HALF_TOL = {BF16: 1e-2, np.dtype(np.float16): 2e-3}


@pytest.fixture(params=["cublas", "tiles"])
def gpu_path(request, monkeypatch):
    from cupynce._engine import tiles

    monkeypatch.setattr(tiles, "USE_TILES", request.param == "tiles")
    return request.param


def _same_dtype_single(op, arrays, t, reduction, g):
    """The single-process cupynce op on the concatenated batch (the same GPU path and dtype)."""
    dev = [None if a is None else cp.asarray(a) for a in arrays]
    gg = cp.asarray(g) if isinstance(g, np.ndarray) else g
    if op == "nt_xent":
        loss, ctx = cupynce.nt_xent_forward(dev[0], t, reduction=reduction)
        return LB._np(loss), [LB._np(cupynce.nt_xent_backward(ctx, gg))]
    loss, ctx = cupynce.info_nce_forward(dev[0], dev[1], t, negatives=dev[2],
                                         reduction=reduction)
    return LB._np(loss), [LB._np(x) for x in cupynce.info_nce_backward(ctx, gg)]


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16, np.dtype(np.float16)], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("P", [2, 3])
def test_nt_xent_blocks_gpu(P, reduction, dtype, gpu_path):
    rng = np.random.default_rng(zlib.crc32(f"gnt{P}{reduction}{dtype}".encode()))
    n, d = 40, 64
    Z = (rng.standard_normal((2 * n * P, d)) / 8).astype(dtype)
    g = rng.standard_normal(2 * n * P) if reduction == "none" else 0.7
    loss, dZ = LB.nt_xent_ranks(cp, Z, P, 0.2, reduction, g, to=cp.asarray)
    got = LB._reduced(loss, reduction)
    if dtype == np.float32:
        want, (dz_want,) = ref.nt_xent(Z, 0.2, reduction=reduction, grad_loss=g)
        tl, tg = 1e-5, 1e-4
    else:
        want, (dz_want,) = _same_dtype_single("nt_xent", [Z], 0.2, reduction, g)
        tl, tg = 1e-5, HALF_TOL[dtype]
    assert LB.rel(got, want) <= tl
    assert LB.rel(dZ, dz_want) <= tg


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
    loss, dQ, dK, dS, dNp = LB.info_nce_ranks(cp, Q, K, S, Np_, P, 0.2, "mean", 0.7,
                                              to=cp.asarray)
    if dtype == np.float32:
        want, grads = ref.info_nce(Q, K, 0.2, negatives=negs, grad_loss=0.7)
        tl, tg = 1e-5, 1e-4
    else:
        want, grads = _same_dtype_single("info_nce", [Q, K, negs], 0.2, "mean", 0.7)
        tl, tg = 1e-5, HALF_TOL[dtype]
    assert LB.rel(LB._reduced(loss, "mean"), want) <= tl
    assert LB.rel(dQ, grads[0]) <= tg and LB.rel(dK, grads[1]) <= tg
    if neg is not None:
        assert LB.rel(dS if neg == "shared" else dNp, grads[2]) <= tg
