"""The cuBLAS backend: products through ``cublasGemmEx`` (and the small-product kernel).

``gemm`` computes ``out = alpha * op(a) @ op(b) + beta * out`` on row-major CuPy matrices
that may be row-strided views (unit column stride, any row stride), with an output dtype
that may differ from the inputs' (float16/bfloat16 products land in float32).  Precision:

=========  ===========================  ============================
inputs     cuBLAS compute type          output
=========  ===========================  ============================
float16    CUBLAS_COMPUTE_32F           float32 (or float16)
bfloat16   CUBLAS_COMPUTE_32F           float32 (or bfloat16)
float32    CUBLAS_COMPUTE_32F (no TF32) float32   (precision "fp32", and "auto")
float32    CUBLAS_COMPUTE_32F_FAST_TF32 float32   (precision "tf32")
float32    3 x FAST_TF32 on hi/lo split float32   (precision "3xtf32")
float64    CUBLAS_COMPUTE_64F           float64
=========  ===========================  ============================

Launches go to the current CuPy stream (CuPy's binding sets it on the handle).

float32 precision: ``config.current().float32_precision`` (:mod:`cupynce.config`: env
``CUPYNCE_FLOAT32``, default "auto"; ``cupynce.set_float32_precision``), overridden in a
thread by ``with config.float32_precision(p):``, which every public entry point opens around
its engine work with its ``precision=`` argument.
"fp32" is the true-fp32 product; "tf32" rounds the operands to TF32 (10 mantissa bits,
~1e-3 relative error); "3xtf32" splits each operand x = hi + lo (hi = x rounded to TF32,
``kernels_src/products/blas.cu``'s ``cpn_split_tf32_f32``) and sums three TF32 tensor-core products,
hi·hi + hi·lo + lo·hi (lo·lo, ~2^-22 relative, dropped), as CUTLASS's 3xTF32 does.  On an
H100 its products came out 3-13x less accurate than true fp32 (8.8e-7 against 2.7e-7 relative
for Z·Zᵀ at k = 256: Hopper's tensor cores accumulate with truncation toward zero,
``benchmarks/bench_f32_products.py``), so it is never a default.  "auto" (the default) is
"fp32" for every product here; what makes it a mode of its own is above this module: the
chooser (:mod:`.plan`) takes the promoted TF32x3 / F16x3 tiles under it where they were
measured as accurate as fp32 or more, as under "3xtf32".  An infinite entry
splits as hi = inf, lo = 0, so its cross term with a TF32-exact entry (lo = 0) is inf·0 = NaN
where fp32 gives ±inf.

Tiny products (at most ``config.small_gemm_macs`` multiply-adds, ``k <= small_gemm_max_k``, output
in the accumulator dtype) skip cuBLAS: ``kernels_src/products/blas.cu``'s ``small_gemm`` (one thread
per output element, k summed in order with fused multiply-adds in float32 / float64).  A
cuBLAS call costs 25-60 µs of host time on the H100 host, several times such a product's own
GPU time; a launch costs ~10.  Same accumulation precision (fp32 / fp64, no TF32, whatever
the float32 precision: a tiny product gains nothing from the tensor cores), not the same bits
as cuBLAS; deterministic either way.  Like every NVRTC-built cupynce kernel (CuPy compiles
with ``-ftz=true``) it flushes float32 subnormals to zero, which cuBLAS keeps (a product of
1e-20-sized entries gives 0 here, ~1e-39 there): irrelevant at the magnitudes of the scores
and gradients of these losses.
"""
from __future__ import annotations

import threading
from typing import Optional

import numpy as np

from ... import config
from .. import kernels
from ..arrays import leading_dim
from ..kernels import BFLOAT16, BLOCK, SUPPORTED_DTYPES, acc_dtype

#: cublasComputeType_t's CUBLAS_COMPUTE_32F_FAST_TF32 (cublas_api.h; CUBLAS_COMPUTE_32F = 68).
COMPUTE_32F_FAST_TF32 = 77


_CUDA_TYPES: dict = {}


def _cuda_type(dtype) -> int:
    t = _CUDA_TYPES.get(dtype)
    if t is not None:
        return t
    from cupy.cuda import runtime

    key = dtype
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        t = runtime.CUDA_R_32F
    elif dtype == np.float64:
        t = runtime.CUDA_R_64F
    elif dtype == np.float16:
        t = runtime.CUDA_R_16F
    elif dtype == BFLOAT16:
        t = runtime.CUDA_R_16BF
    else:
        raise ValueError(f"gemm: unsupported dtype {dtype}")
    _CUDA_TYPES[key] = t
    return t


_SCALARS: dict = {}


def _scalar(value: float, wide: bool):
    """alpha / beta as a host scalar cuBLAS reads by pointer (kept alive: the common values
    are made once)."""
    key = (value, wide)
    arr = _SCALARS.get(key)
    if arr is None:
        arr = np.array(value, dtype=np.float64 if wide else np.float32)
        if len(_SCALARS) < 64:
            _SCALARS[key] = arr
    return arr


class _Local(threading.local):
    """This thread's cuBLAS handles and :class:`recording`.  ``recording`` defaults to None
    as a class attribute, so reading it never misses (a ``getattr`` default on a
    ``threading.local`` raises and catches AttributeError inside: ~0.35 us a read)."""

    recording: Optional[list] = None  # (see recording)


_LOCAL = _Local()
_LIB = None


class NotRecordable(RuntimeError):
    """A product :class:`recording` cannot hold as one ``cublasGemmEx`` call."""


class recording:
    """``with blas.recording() as calls:`` -- the cuBLAS products :func:`gemm` would issue in
    this thread meanwhile, recorded instead of issued, as ``(args, keep)``: the
    ``cublasGemmEx`` arguments (C's pointer at :data:`GEMM_C_AT`) and the host scalars they
    point to.  ``ops._graphs`` records a deferred product once and replays it with
    :func:`issue` (one library call, no Python planning).  A product that is not one such
    call (a tiny one: the small-product kernel; "3xtf32": a split and three calls; no ctypes
    binding) raises :class:`NotRecordable`."""

    def __enter__(self) -> list:
        self.before = _LOCAL.recording
        _LOCAL.recording = []
        return _LOCAL.recording

    def __exit__(self, *exc) -> None:
        _LOCAL.recording = self.before


#: where C's device pointer is in a recorded call's arguments
GEMM_C_AT = 14


def issue(handle: int, args: tuple, c_ptr: int) -> None:
    """A recorded ``cublasGemmEx`` call (see :class:`recording`) on ``handle`` with C at
    ``c_ptr``."""
    cublas_gemm(handle, *args[1:GEMM_C_AT], c_ptr, *args[GEMM_C_AT + 1:])


def _libcublas():
    """The cuBLAS library CuPy loaded, through ctypes (cupynce calls ``cublasGemmEx`` itself:
    CuPy's wrappers set the handle's stream on every call and refuse to while a stream is
    captured into a CUDA graph, see ``ops._graphs``).  The very file CuPy loaded (from
    ``/proc/self/maps``), else the soname of CuPy's CUDA major version: a handle and the calls
    on it must come from one library."""
    global _LIB
    if _LIB is None:
        import ctypes

        import cupy
        from cupy_backends.cuda.libs import cublas  # noqa: F401 - CuPy loads the library

        path = None
        try:
            with open("/proc/self/maps") as maps:
                path = next((line.split()[-1] for line in maps
                             if "/libcublas.so" in line and "libcublasLt" not in line), None)
        except OSError:
            pass
        major = cupy.cuda.runtime.runtimeGetVersion() // 1000
        lib = ctypes.CDLL(path or f"libcublas.so.{major}")
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i,
                                     i]
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasDestroy_v2.argtypes = [vp]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetPointerMode_v2.argtypes = [vp, i]
        _LIB = lib
    return _LIB


class _Handles(dict):
    """This thread's handles, ``{device: [handle, bound stream]}``; destroyed with the thread."""

    def __del__(self):
        try:
            import cupy

            lib = _LIB
            for dev, (h, _s) in self.items():
                with cupy.cuda.Device(dev):
                    lib.cublasDestroy_v2(h)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to free
            pass


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"cupynce: {what} failed with cuBLAS status {status}")


def _ctypes_ok() -> bool:
    """Whether cuBLAS is reachable through ctypes here (else: CuPy's wrappers, one warning;
    the products then cannot be captured into CUDA graphs, which fall back to plain calls)."""
    global _LIB
    if _LIB is None:
        try:
            _libcublas()
        except (OSError, AttributeError, ImportError) as exc:
            import warnings

            _LIB = False
            warnings.warn(f"cupynce: cuBLAS not reachable through ctypes ({exc}); using "
                          f"CuPy's cuBLAS wrappers (no CUDA-graph capture of small calls)",
                          RuntimeWarning, stacklevel=3)
    return _LIB is not False


def cublas_gemm(*args) -> None:
    """``cublasGemmEx(*args)`` (CuPy's ``gemmEx`` argument order); raises on an error status."""
    _check(_libcublas().cublasGemmEx(*args), "cublasGemmEx")


def thread_handle() -> int:
    """This thread's cuBLAS handle on the current device, bound to CuPy's current stream.

    cupynce's own handles rather than CuPy's (``device.get_cublas_handle``), created with
    ``cublasCreate`` as CuPy's are (same defaults, so the same algorithms), in host pointer
    mode, one per thread and device (a handle is not safe to share between threads).  The
    stream is set only when it changes, so that a product inside a stream capture
    (``ops._graphs`` binds the capture stream first, :func:`bind_stream`) makes no call
    besides ``cublasGemmEx``.
    """
    import ctypes

    import cupy
    from cupy_backends.cuda.libs import cublas

    handles = getattr(_LOCAL, "handles", None)
    if handles is None:
        handles = _LOCAL.handles = _Handles()
    dev = cupy.cuda.runtime.getDevice()
    entry = handles.get(dev)
    lib = _libcublas()
    if entry is None:
        h = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        _check(lib.cublasSetPointerMode_v2(h, cublas.CUBLAS_POINTER_MODE_HOST),
               "cublasSetPointerMode")
        entry = handles[dev] = [h.value, None]
    ptr = cupy.cuda.get_current_stream().ptr
    if entry[1] != ptr:
        _check(lib.cublasSetStream_v2(entry[0], ptr), "cublasSetStream")
        entry[1] = ptr
    return entry[0]


def bind_stream() -> None:
    """Bind this thread's handle to CuPy's current stream now (before a stream capture
    begins); nothing without the ctypes binding (the capture then fails and is refused)."""
    if _ctypes_ok():
        thread_handle()


def unbind_stream() -> None:
    """Forget which stream this thread's handle on the current device is bound to (after a
    capture, whose stream goes away: the next product sets its stream again)."""
    import cupy

    entry = getattr(_LOCAL, "handles", {}).get(cupy.cuda.runtime.getDevice())
    if entry is not None:
        entry[1] = None


def split_row_bytes(dtype, cols: int) -> int:
    """Scratch bytes per row that a "3xtf32" product adds for a float32 operand of ``cols``
    columns per row (its hi and lo halves, :func:`split_tf32`), 0 in every other case: the
    row-block planners add it for the score / gradient block that the gradient products
    take as an operand, so that ``workspace_bytes`` (and the default's share of the free
    memory) bounds the block and its split together."""
    if np.dtype(dtype) == np.float32 and config.current().float32_precision == "3xtf32":
        return 2 * cols * 4
    return 0


def split_tf32(x, name: str = "x"):
    """``(hi, lo)``, contiguous float32 (rows, cols), of the float32 matrix view ``x`` (row
    stride any): ``x == hi + lo`` exactly, ``hi`` rounded to TF32 (``cpn_split_tf32_f32``)."""
    import cupy

    rows, cols = x.shape
    hi = cupy.empty((rows, cols), np.float32)
    lo = cupy.empty((rows, cols), np.float32)
    if hi.size:
        kernels.launch("products/blas.cu", "split_tf32", np.float32, (-(-hi.size // BLOCK),), (
            x, np.int64(leading_dim(x, name)), hi, lo, np.int64(rows), np.int32(cols)))
    return hi, lo


def small_product(m: int, n: int, k: int) -> bool:
    """Whether an (m, k) x (k, n) product takes :func:`gemm`'s ``small_gemm`` route (fp32 in
    every float32 mode): at most ``config.small_gemm_macs`` multiply-adds, k <=
    ``small_gemm_max_k``."""
    cfg = config.current()
    return m * n * k <= cfg.small_gemm_macs and k <= cfg.small_gemm_max_k


def gemm(a, b, out, *, trans_a: bool = False, trans_b: bool = False,
         alpha: float = 1.0, beta: float = 0.0) -> None:
    """``out[m, n] = alpha * op(a) @ op(b) + beta * out`` (row-major), in place.

    ``op(a)`` is ``a`` (m, k) or, with ``trans_a``, ``a.T`` for ``a`` of shape (k, m);
    likewise ``b``.  ``a`` and ``b`` share a dtype; ``out`` may be wider (see module doc).

    float32 ``a``, ``b`` and ``out`` follow the float32 precision in effect (tiny products,
    the ``small_gemm`` route, stay fp32 in every mode).  "3xtf32" splits ``a`` and ``b``
    (:func:`split_tf32`; 2 x their sizes in float32 from CuPy's pool for the call, one split
    when ``b`` is ``a``'s very view; the row-block planners count a score block's split in
    the workspace, :func:`split_row_bytes`) and issues three TF32 products into ``out``, small
    terms first as CUTLASS does: ``out = alpha lo_a·hi_b + beta out``, then ``+= alpha
    hi_a·lo_b``, then ``+= alpha hi_a·hi_b`` (each rounded to float32 in ``out``).
    """
    from cupy_backends.cuda.libs import cublas

    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    if m == 0 or n == 0:
        return
    if a.dtype != b.dtype:
        raise ValueError(f"gemm: a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if small_product(m, n, k) and a.dtype in SUPPORTED_DTYPES:
        acc = acc_dtype(a.dtype)
        if out.dtype == acc:
            if _LOCAL.recording is not None:
                raise NotRecordable("a tiny product runs the small-product kernel")
            kernels.launch("products/blas.cu", "small_gemm", a.dtype, (-(-m * n // BLOCK),), (
                a, np.int64(leading_dim(a, "a")), np.int32(trans_a),
                b, np.int64(leading_dim(b, "b")), np.int32(trans_b),
                out, np.int64(leading_dim(out, "out")), np.int32(m), np.int32(n),
                np.int32(k), acc.type(alpha), acc.type(beta)))
            return
    wide = a.dtype == np.float64
    compute = cublas.CUBLAS_COMPUTE_64F if wide else cublas.CUBLAS_COMPUTE_32F
    if a.dtype == np.float32 and out.dtype == np.float32:
        mode = config.current().float32_precision
        if mode == "3xtf32":
            if _LOCAL.recording is not None:
                raise NotRecordable("a 3xTF32 product is a split and three calls")
            _gemm_3xtf32(a, b, out, trans_a, trans_b, alpha, beta)
            return
        if mode == "tf32":
            compute = COMPUTE_32F_FAST_TF32
    _cublas_gemm(a, b, out, trans_a, trans_b, alpha, beta, compute)


def _gemm_3xtf32(a, b, out, trans_a: bool, trans_b: bool, alpha: float, beta: float) -> None:
    """gemm's "3xtf32" mode: three TF32 products of the operands' hi / lo parts."""
    a_hi, a_lo = split_tf32(a, "a")
    same = (b.data.ptr == a.data.ptr and b.shape == a.shape and b.strides == a.strides)
    b_hi, b_lo = (a_hi, a_lo) if same else split_tf32(b, "b")
    for x, y, bt in ((a_lo, b_hi, beta), (a_hi, b_lo, 1.0), (a_hi, b_hi, 1.0)):
        _cublas_gemm(x, y, out, trans_a, trans_b, alpha, bt, COMPUTE_32F_FAST_TF32)


def _cublas_gemm(a, b, out, trans_a: bool, trans_b: bool, alpha: float, beta: float,
                 compute: int) -> None:
    """One ``cublasGemmEx`` of gemm's product with the compute type ``compute``."""
    from cupy_backends.cuda.libs import cublas

    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    wide = a.dtype == np.float64
    al = _scalar(alpha, wide)
    be = _scalar(beta, wide)
    if _ctypes_ok():
        handle, call = thread_handle(), cublas_gemm
    else:  # (CuPy's handle and wrapper: what cupynce used before it called cuBLAS itself)
        from cupy.cuda import device

        handle, call = device.get_cublas_handle(), cublas.gemmEx
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    # Row-major C = op(A) op(B)  <=>  column-major C^T = op(B)^T op(A)^T: swap the operands.
    op_a = cublas.CUBLAS_OP_T if trans_a else cublas.CUBLAS_OP_N
    op_b = cublas.CUBLAS_OP_T if trans_b else cublas.CUBLAS_OP_N
    args = (handle, op_b, op_a, n, m, k,
            al.ctypes.data, b.data.ptr, _cuda_type(b.dtype), leading_dim(b, "b"),
            a.data.ptr, _cuda_type(a.dtype), leading_dim(a, "a"),
            be.ctypes.data, out.data.ptr, _cuda_type(out.dtype), leading_dim(out, "out"),
            compute, cublas.CUBLAS_GEMM_DEFAULT)
    rec = _LOCAL.recording
    if rec is not None:
        if call is not cublas_gemm:
            raise NotRecordable("cuBLAS is not reachable through ctypes")
        rec.append((args, (al, be)))
        return
    call(*args)
