"""GPU tests of ``cupynce._engine.blas.gemm``: the small-product kernel (``kernels_src/blas.cu``) and
the cuBLAS route, against a float64 NumPy product.

Tolerances (relative, ‖x − ref‖ / ‖ref‖, inputs already rounded to their dtype so that only
the accumulation is measured): float64 1e-13, float32 and 16-bit inputs (fp32 accumulation)
2e-6 for k <= 1024.
"""
from __future__ import annotations

import numpy as np
import pytest

from cupynce._engine import blas as _blas

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), BF16]


def _tol(dtype) -> float:
    return 1e-13 if dtype == np.float64 else 2e-6


def _rel(x, ref) -> float:
    x = np.asarray(cp.asnumpy(x), np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _operands(rng, dtype, m, n, k, trans_a, trans_b, pad):
    """Row-major views (row stride padded by ``pad`` columns) holding op(a) (m, k), op(b) (k, n)."""
    def mat(rows, cols):
        full = rng.standard_normal((rows, cols + pad)).astype(dtype)
        return cp.asarray(full)[:, :cols]
    a = mat(k, m) if trans_a else mat(m, k)
    b = mat(n, k) if trans_b else mat(k, n)
    a64 = cp.asnumpy(a).astype(np.float64)
    b64 = cp.asnumpy(b).astype(np.float64)
    return a, b, (a64.T if trans_a else a64), (b64.T if trans_b else b64)


def _no_cublas(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("cuBLAS was called for a small product")
    monkeypatch.setattr(_blas, "cublas_gemm", boom)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False),
                                             (True, True)])
@pytest.mark.parametrize("beta", [0.0, 1.0, -0.5])
@pytest.mark.parametrize("m,n,k,pad", [(64, 64, 32, 0), (33, 7, 129, 3), (1, 300, 5, 1),
                                       (257, 2, 1024, 0)])
def test_small_gemm_matches_float64(dtype, trans_a, trans_b, beta, m, n, k, pad, monkeypatch):
    assert m * n * k <= _blas.SMALL_GEMM_MACS and k <= _blas.SMALL_GEMM_MAX_K
    _no_cublas(monkeypatch)
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a, b, a64, b64 = _operands(rng, dtype, m, n, k, trans_a, trans_b, pad)
    acc = np.float64 if dtype == np.float64 else np.float32
    start = rng.standard_normal((m, n + 2)).astype(acc)
    full = cp.asarray(start)
    out = full[:, :n]  # a row-strided output view
    if beta == 0.0:
        out[...] = np.nan  # beta = 0 must not read the output
    _blas.gemm(a, b, out, trans_a=trans_a, trans_b=trans_b, alpha=0.75, beta=beta)
    ref = 0.75 * (a64 @ b64) + (beta * start[:, :n].astype(np.float64) if beta else 0.0)
    assert _rel(out, ref) <= _tol(dtype)
    assert np.array_equal(cp.asnumpy(full[:, n:]), start[:, n:])  # padding untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_gemm_is_deterministic_and_agrees_with_cublas(dtype, monkeypatch):
    rng = np.random.default_rng(7)
    a, b, a64, b64 = _operands(rng, dtype, 96, 80, 48, False, True, 0)
    acc = np.float64 if dtype == np.float64 else np.float32
    outs = []
    for _ in range(2):
        out = cp.empty((96, 80), acc)
        _blas.gemm(a, b, out, trans_b=True)
        outs.append(cp.asnumpy(out))
    assert np.array_equal(outs[0], outs[1])
    calls = []
    real = _blas.cublas_gemm
    monkeypatch.setattr(_blas, "cublas_gemm", lambda *args: calls.append(1) or real(*args))
    monkeypatch.setattr(_blas, "SMALL_GEMM_MACS", 0)  # the same product through cuBLAS
    out = cp.empty((96, 80), acc)
    _blas.gemm(a, b, out, trans_b=True)
    assert calls == [1]
    ref = a64 @ b64
    assert _rel(out, ref) <= _tol(dtype)
    assert _rel(outs[0], ref) <= _tol(dtype)


@pytest.mark.parametrize("beta", [0.0, 2.0])
def test_small_gemm_empty_k(beta, monkeypatch):
    """k = 0: out = beta * out (0 for beta = 0, without reading out), as cuBLAS."""
    _no_cublas(monkeypatch)
    a = cp.empty((5, 0), cp.float32)
    b = cp.empty((0, 6), cp.float32)
    start = np.arange(30, dtype=np.float32).reshape(5, 6)
    out = cp.asarray(start)
    if beta == 0.0:
        out[...] = np.nan
    _blas.gemm(a, b, out, beta=beta)
    np.testing.assert_array_equal(cp.asnumpy(out), beta * start)


def test_gemm_rejects_mixed_dtypes():
    with pytest.raises(ValueError, match="gemm: a and b must share a dtype"):
        _blas.gemm(cp.ones((2, 2), cp.float32), cp.ones((2, 2), cp.float64),
                   cp.empty((2, 2), cp.float32))


def test_large_or_long_products_use_cublas(monkeypatch):
    """Above the size or k limit, and for a 16-bit output, the product goes to cuBLAS."""
    calls = []
    real = _blas.cublas_gemm

    def spy(*args, **kwargs):
        calls.append(args[3:6])
        return real(*args, **kwargs)
    monkeypatch.setattr(_blas, "cublas_gemm", spy)
    f32 = cp.float32
    long_k = _blas.SMALL_GEMM_MAX_K + 1
    _blas.gemm(cp.ones((2, long_k), f32), cp.ones((long_k, 2), f32), cp.empty((2, 2), f32))
    _blas.gemm(cp.ones((128, 128), f32), cp.ones((128, 128), f32), cp.empty((128, 128), f32))
    h = cp.ones((4, 4), cp.float16)
    _blas.gemm(h, h, cp.empty((4, 4), cp.float16))
    assert len(calls) == 3
