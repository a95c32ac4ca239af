"""Tensor-memory-accelerator (TMA) descriptors for the Hopper kernels.

A TMA load (``cp.async.bulk.tensor``) reads a box of a global matrix into shared memory as
described by a ``CUtensorMap``: 128 opaque bytes that only the CUDA driver can encode
(``cuTensorMapEncodeTiled``).  CuPy does not wrap that call, so it is reached through
``ctypes`` on the driver library CuPy itself runs on (``libcuda.so.1``): nothing to build.
The map goes to the kernel by value (a ``__grid_constant__`` parameter), as a one-element
NumPy structured array, which CuPy passes as a struct argument.

Where the driver or the symbol is missing, :func:`available` is False and callers take their
other path.
"""
from __future__ import annotations

import ctypes
import functools
import sys
from typing import Optional

import numpy as np

from .arrays import leading_dim

#: ``CUtensorMap`` as CuPy passes it: 16 opaque 64-bit words (cuda.h ``CU_TENSOR_MAP_NUM_QWORDS``)
TENSOR_MAP_DTYPE = np.dtype([("opaque", "<u8", (16,))])

# cuda.h enumerators (CUDA 12.0+): CUtensorMapDataType, CUtensorMapSwizzle,
# CUtensorMapL2promotion, CUtensorMapInterleave / CUtensorMapFloatOOBfill (0: none / zeros)
_DATA_TYPE = {"float16": 6, "float32": 7, "bfloat16": 9}
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3


@functools.lru_cache(maxsize=None)
def _encode_fn():
    """``cuTensorMapEncodeTiled`` from the driver library, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    u32, u64p, u32p = ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    """Whether tensor maps can be encoded here (a CUDA 12+ driver with the entry point)."""
    return _encode_fn() is not None


def matrix_map(a, box_rows: int, box_cols: int) -> Optional[np.ndarray]:
    """A 128-byte-swizzled tile map over the row-major matrix ``a`` (rows, cols): float16,
    bfloat16 or float32 (the TF32 tiles read float32 boxes, ``tiles_ws_tf32.cu``).

    Boxes are ``box_rows`` rows x ``box_cols`` columns (``box_cols`` x the item size must be
    128 bytes: one swizzle span, 64 16-bit or 32 float32 values); boxes reaching past the
    matrix are zero-filled by the TMA unit.  ``a`` may have strided rows (a leading dimension
    of a multiple of 16 bytes, its pointer 16-byte aligned).  Returns the (1,)
    ``TENSOR_MAP_DTYPE`` array to pass to the kernel, or None where the driver refuses the
    map; ``ValueError`` for another dtype or box width.
    """
    item = a.dtype.itemsize
    code = _DATA_TYPE.get(a.dtype.name)
    if code is None or box_cols * item != 128:
        raise ValueError(f"matrix_map: a {a.dtype} matrix with {box_cols}-column boxes; expected "
                         f"float16 / bfloat16 with 64 or float32 with 32 (128-byte rows)")
    fn = _encode_fn()
    if fn is None:
        return None
    rows, cols = a.shape
    ld = leading_dim(a)
    # the driver wants the CUtensorMap it writes 64-byte aligned: a view of a larger buffer
    raw = np.zeros(TENSOR_MAP_DTYPE.itemsize + 64, np.uint8)
    off = -raw.ctypes.data % 64
    out = raw[off:off + TENSOR_MAP_DTYPE.itemsize].view(TENSOR_MAP_DTYPE)
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(ld * item)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    res = fn(out.ctypes.data, code, 2, ctypes.c_void_p(a.data.ptr), dims,
             strides, box, elem, 0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0)
    return out if res == 0 else None


def interleaved_map(buf, half: int, rows: int, cols: int, box_rows: int) -> Optional[np.ndarray]:
    """A 3-D 128-byte-swizzled map over the float16 halves that
    ``gemm.f16x3.split_scaled_il`` interleaves into the float32 matrix ``buf`` (rows, ld):
    per row, each 64-column group's 256 bytes hold 64 hi then 64 lo float16.  ``half`` 0:
    the hi, 1: the lo.  Dimensions (64, ceil(cols / 64), rows), boxes (64, 1, box_rows): a
    box lands in shared memory as :func:`matrix_map`'s (box_rows x 64) float16 box does.
    None where the driver refuses the map."""
    fn = _encode_fn()
    if fn is None:
        return None
    ld = leading_dim(buf)
    raw = np.zeros(TENSOR_MAP_DTYPE.itemsize + 64, np.uint8)
    off = -raw.ctypes.data % 64
    out = raw[off:off + TENSOR_MAP_DTYPE.itemsize].view(TENSOR_MAP_DTYPE)
    dims = (ctypes.c_uint64 * 3)(64, -(-cols // 64), rows)
    strides = (ctypes.c_uint64 * 2)(256, ld * 4)
    box = (ctypes.c_uint32 * 3)(64, 1, box_rows)
    elem = (ctypes.c_uint32 * 3)(1, 1, 1)
    res = fn(out.ctypes.data, _DATA_TYPE["float16"], 3, ctypes.c_void_p(buf.data.ptr + 128 * half),
             dims, strides, box, elem, 0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0)
    return out if res == 0 else None
