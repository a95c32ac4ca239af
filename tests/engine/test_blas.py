"""cupynce's cuBLAS binding and products (``cupynce._engine.gemm.cublas``).

Without a GPU: the binding's fallback to CuPy's wrappers when cuBLAS cannot be reached through
ctypes.  Marked ``gpu``: ``gemm``, the small-product kernel (``kernels_src/products/blas.cu``)
and the cuBLAS route, against a float64 NumPy product, and its float32 precision modes.

Tolerances (relative, ‖x − ref‖ / ‖ref‖, inputs already rounded to their dtype so that only
the accumulation is measured): float64 1e-13, float32 and 16-bit inputs (fp32 accumulation)
2e-6 for k <= 1024.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupynce.config as cfg
from cupynce._engine.gemm import cublas

try:
    import cupy as cp
except ImportError:  # (the gpu tests are skipped without it: conftest)
    cp = None
ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), BF16]


# ---- without a GPU: the binding ------------------------------------------------------------
def test_cublas_binding_falls_back_to_cupy(monkeypatch):
    """Without a ctypes-reachable cuBLAS the products use CuPy's wrappers (one warning),
    and binding a capture stream is a no-op (the capture is then refused, not broken)."""
    def missing():
        raise OSError("libcublas.so.99: cannot open shared object file")

    monkeypatch.setattr(cublas, "_LIB", None)
    monkeypatch.setattr(cublas, "_libcublas", missing)
    with pytest.warns(RuntimeWarning, match="CuPy's cuBLAS wrappers"):
        assert cublas._ctypes_ok() is False
    assert cublas._ctypes_ok() is False  # decided once
    cublas.bind_stream()  # no handle, no error


# ---- gemm on the GPU ----------------------------------------------------------------------
gpu = pytest.mark.gpu


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
    monkeypatch.setattr(cublas, "cublas_gemm", boom)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False),
                                             (True, True)])
@pytest.mark.parametrize("beta", [0.0, 1.0, -0.5])
@pytest.mark.parametrize("m,n,k,pad", [(64, 64, 32, 0), (33, 7, 129, 3), (1, 300, 5, 1),
                                       (257, 2, 1024, 0)])
def test_small_gemm_matches_float64(dtype, trans_a, trans_b, beta, m, n, k, pad, monkeypatch):
    assert m * n * k <= cfg.current().small_gemm_macs and k <= cfg.current().small_gemm_max_k
    _no_cublas(monkeypatch)
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a, b, a64, b64 = _operands(rng, dtype, m, n, k, trans_a, trans_b, pad)
    acc = np.float64 if dtype == np.float64 else np.float32
    start = rng.standard_normal((m, n + 2)).astype(acc)
    full = cp.asarray(start)
    out = full[:, :n]  # a row-strided output view
    if beta == 0.0:
        out[...] = np.nan  # beta = 0 must not read the output
    cublas.gemm(a, b, out, trans_a=trans_a, trans_b=trans_b, alpha=0.75, beta=beta)
    ref = 0.75 * (a64 @ b64) + (beta * start[:, :n].astype(np.float64) if beta else 0.0)
    assert _rel(out, ref) <= _tol(dtype)
    assert np.array_equal(cp.asnumpy(full[:, n:]), start[:, n:])  # padding untouched


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_gemm_is_deterministic_and_agrees_with_cublas(dtype, monkeypatch, configure):
    rng = np.random.default_rng(7)
    a, b, a64, b64 = _operands(rng, dtype, 96, 80, 48, False, True, 0)
    acc = np.float64 if dtype == np.float64 else np.float32
    outs = []
    for _ in range(2):
        out = cp.empty((96, 80), acc)
        cublas.gemm(a, b, out, trans_b=True)
        outs.append(cp.asnumpy(out))
    assert np.array_equal(outs[0], outs[1])
    calls = []
    real = cublas.cublas_gemm
    monkeypatch.setattr(cublas, "cublas_gemm", lambda *args: calls.append(1) or real(*args))
    configure(small_gemm_macs=0)  # the same product through cuBLAS
    out = cp.empty((96, 80), acc)
    cublas.gemm(a, b, out, trans_b=True)
    assert calls == [1]
    ref = a64 @ b64
    assert _rel(out, ref) <= _tol(dtype)
    assert _rel(outs[0], ref) <= _tol(dtype)


@gpu
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
    cublas.gemm(a, b, out, beta=beta)
    np.testing.assert_array_equal(cp.asnumpy(out), beta * start)


@gpu
def test_gemm_rejects_mixed_dtypes():
    with pytest.raises(ValueError, match="gemm: a and b must share a dtype"):
        cublas.gemm(cp.ones((2, 2), cp.float32), cp.ones((2, 2), cp.float64),
                    cp.empty((2, 2), cp.float32))


@gpu
def test_large_or_long_products_use_cublas(monkeypatch):
    """Above the size or k limit, and for a 16-bit output, the product goes to cuBLAS."""
    calls = []
    real = cublas.cublas_gemm

    def spy(*args, **kwargs):
        calls.append(args[3:6])
        return real(*args, **kwargs)
    monkeypatch.setattr(cublas, "cublas_gemm", spy)
    f32 = cp.float32
    long_k = cfg.current().small_gemm_max_k + 1
    cublas.gemm(cp.ones((2, long_k), f32), cp.ones((long_k, 2), f32), cp.empty((2, 2), f32))
    cublas.gemm(cp.ones((128, 128), f32), cp.ones((128, 128), f32), cp.empty((128, 128), f32))
    h = cp.ones((4, 4), cp.float16)
    cublas.gemm(h, h, cp.empty((4, 4), cp.float16))
    assert len(calls) == 3


# ---- float32 precision modes (issue 24; config.float32_precision) ---------------------------
import test_float32_precision as P  # noqa: E402  (its folder is on sys.path: conftest)

_COMPUTE = {"fp32": 68, "tf32": cublas.COMPUTE_32F_FAST_TF32,
            "3xtf32": cublas.COMPUTE_32F_FAST_TF32}


def _f32_case(seed, m, n, k, trans_a, trans_b, pad, beta, mode):
    """gemm of row-strided float32 views in ``mode`` through cuBLAS: (error vs float64, out)."""
    rng = np.random.default_rng(seed)
    a, b, a64, b64 = _operands(rng, np.float32, m, n, k, trans_a, trans_b, pad)
    start = rng.standard_normal((m, n + 2)).astype(np.float32)
    full = cp.asarray(start)
    out = full[:, :n]
    if beta == 0.0:
        out[...] = np.nan  # beta = 0 must not read the output
    with cfg.float32_precision(mode):
        cublas.gemm(a, b, out, trans_a=trans_a, trans_b=trans_b, alpha=0.75, beta=beta)
    assert np.array_equal(cp.asnumpy(full[:, n:]), start[:, n:])  # padding untouched
    ref = 0.75 * (a64 @ b64) + (beta * start[:, :n].astype(np.float64) if beta else 0.0)
    return _rel(out, ref), cp.asnumpy(out)


@gpu
@pytest.mark.parametrize("mode", ["tf32", "3xtf32"])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False),
                                             (True, True)])
@pytest.mark.parametrize("beta", [0.0, 1.0, -0.5])
@pytest.mark.parametrize("m,n,k,pad", [(256, 192, 64, 0), (130, 70, 1000, 3), (64, 300, 4096, 1),
                                       (33, 517, 257, 5)])
def test_float32_modes_against_float64(mode, trans_a, trans_b, beta, m, n, k, pad, configure):
    """3xtf32 within 2x fp32's error plus the tensor cores' truncation bias (same inputs) and
    30x better than tf32; tf32 within 1e-2; fp32 as before."""
    configure(small_gemm_macs=0)  # every product through cuBLAS
    case = (m * 7 + n * 3 + k, m, n, k, trans_a, trans_b, pad, beta)
    e32, _ = _f32_case(*case, "fp32")
    e, _ = _f32_case(*case, mode)
    assert e32 <= _tol(np.float32)
    if mode == "3xtf32":
        e_tf32, _ = _f32_case(*case, "tf32")
        assert e <= 2 * e32 + P.truncation_bound(k), (e, e32)
        assert e <= e_tf32 / 30, (e, e_tf32)
    else:
        assert e <= 1e-2, e


@gpu
@pytest.mark.parametrize("mode", ["fp32", "tf32", "3xtf32"])
def test_float32_modes_issue_their_compute_type(mode, monkeypatch):
    """fp32: the one call of before (compute 68), bit-identical to the default; tf32: the same
    call with FAST_TF32; 3xtf32: three FAST_TF32 calls."""
    calls = []
    real = cublas.cublas_gemm
    monkeypatch.setattr(cublas, "cublas_gemm", lambda *args: calls.append(args) or real(*args))
    case = (5, 200, 160, 320, False, True, 2, 0.5)
    _, default = _f32_case(*case, cfg.current().float32_precision)
    calls.clear()
    _, got = _f32_case(*case, mode)
    assert [c[17] for c in calls] == [_COMPUTE[mode]] * (3 if mode == "3xtf32" else 1)
    if mode == "fp32":
        assert np.array_equal(got, default)


@gpu
def test_split_kernel_matches_numpy_emulation():
    """cpn_split_tf32_f32 on a row-strided view, bit for bit against the NumPy rule (random bit
    patterns over every exponent, subnormals, the largest values, inf / NaN)."""
    x = P._bits(np.random.default_rng(3), 300 * 257)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, np.finfo(np.float32).max,
                         np.finfo(np.float32).smallest_subnormal * 4097], np.float32)
    x = np.concatenate([specials, x])[:300 * 250].reshape(300, 250)
    full = cp.zeros((300, 257), cp.float32)
    full[:, :250] = cp.asarray(x)
    hi, lo = cublas.split_tf32(full[:, :250])
    ref_hi, ref_lo = P.split_tf32(x)
    assert np.array_equal(cp.asnumpy(hi).view(np.uint32), ref_hi.view(np.uint32))
    assert np.array_equal(cp.asnumpy(lo).view(np.uint32), ref_lo.view(np.uint32))


@gpu
def test_3xtf32_splits_a_shared_operand_once(monkeypatch):
    """S = Z Z^T (b is a's very view) splits Z once; the result within 2x fp32's error plus the
    truncation bias (Z Zᵀ's positive diagonal shows it most: 8.7e-7 against fp32's 2.7e-7)."""
    splits = []
    real = cublas.split_tf32
    monkeypatch.setattr(cublas, "split_tf32", lambda x, name="x": splits.append(name)
                        or real(x, name))
    z = cp.asarray(np.random.default_rng(4).standard_normal((512, 256)).astype(np.float32))
    z64 = cp.asnumpy(z).astype(np.float64)
    outs = {}
    for mode in ("fp32", "3xtf32"):
        outs[mode] = cp.empty((512, 512), cp.float32)
        with cfg.float32_precision(mode):
            cublas.gemm(z, z, outs[mode], trans_b=True)
    assert splits == ["a"]
    ref = z64 @ z64.T
    assert _rel(outs["3xtf32"], ref) <= 2 * _rel(outs["fp32"], ref) + P.truncation_bound(256)


@gpu
@pytest.mark.parametrize("mode", ["tf32", "3xtf32"])
def test_small_products_stay_fp32(mode, monkeypatch):
    """The small_gemm route ignores the precision: the same bits in every mode."""
    _no_cublas(monkeypatch)
    case = (6, 64, 64, 32, True, False, 1, 1.0)
    _, default = _f32_case(*case, "fp32")
    _, got = _f32_case(*case, mode)
    assert np.array_equal(got, default)


@gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [0, 1, 255, 256, 257, 100_003])
@pytest.mark.parametrize("value", [0.5, -3.25e-7, float("nan"), float("inf")])
def test_fill_kernel(dtype, size, value):
    """``arrays.fill`` (``cpn_fill_<dtype>``): every element written, nothing past the end."""
    from cupynce._engine import arrays

    buf = cp.full((size + 64,), 7.0, dtype)  # the tail past `size` must stay 7
    out = arrays.fill(buf[:size], value)
    assert out.data.ptr == buf.data.ptr
    host = cp.asnumpy(buf)
    np.testing.assert_array_equal(host[:size], np.full(size, value, dtype))
    np.testing.assert_array_equal(host[size:], 7.0)
    s = arrays.scalar(value, np.dtype(dtype))
    assert s.shape == (1,) and s.dtype == dtype
    np.testing.assert_array_equal(cp.asnumpy(s), np.full(1, value, dtype))
