"""Float32 products on the float16 tensor cores, "F16x3" (issue 24; a prototype, not yet
taken by any op): ``kernels_src/tiles_ws_f16x3.cu``.

Each float32 operand row is scaled by a power of two 2^e (its largest |x| into
[2^14, 2^15)) and split into float16 halves, x 2^e = hi + lo (~22 bits of x, as the TF32x3
split keeps); a product is lo_a·hi_b + hi_a·lo_b + hi_a·hi_b on the float16 tensor cores --
twice TF32's rate -- promoted to an fp32 register sum every 64 of K, and the scales come out
exactly in the store: ``out = alpha · (acc · rowf[i]) · colf[j]``.

Operands, all K-major float16 halves plus the inverse scales of their rows:

* :func:`split_rows` -- rows scaled each (A or B of S = A Bᵀ: K = the features);
* :func:`split_cols_t` -- xᵀ scaled per column of x (the B operand of G B: K = x's rows);
* :func:`split_scaled` -- one scale 2^e for the whole matrix (a gradient block G with a
  known bound: G's rows are K for G B's and its columns are M for Gᵀ A's, so neither may
  carry a scale of its own).

:func:`mm` multiplies them (``trans_a``: A given as the halves of the stored (K x M) matrix,
read MN-major by the tensor cores; no copy).
"""
from __future__ import annotations

import struct
from typing import NamedTuple, Optional, Tuple

import numpy as np

from . import blas, kernels, tiles, tiles_tf32, tma
from .kernels import BLOCK

FILE = "tiles_ws_f16x3.cu"
#: K per ring stage: one 128-byte swizzled row of float16; a stage is four 16 KiB boxes, the
#: TF32x3 tiles' 64 KiB (``tiles_tf32.ring`` sizes both)
KSTEP = 64

#: the kernels' one parameter, ``WsF16Launch``: four tensor maps, TileArgs<float> at 512,
#: ring at 720, comp at 724, rowf at 728, colf at 736; 768 bytes
LAUNCH_ARGS_AT = 512
LAUNCH_BYTES = 768
LAUNCH_DTYPE = np.dtype({"names": ["raw"], "formats": [("u1", LAUNCH_BYTES)]})
_TAIL = struct.Struct("<ifQQ")
#: the products are scaled by 1 + TRUNC in the store (the launch's ``comp``): the mean loss of
#: the tensor cores' truncating adds, as ``CPN_TF32X3_TRUNC`` for the TF32x3 tiles.  Measured
#: uncompensated on an H100 (benchmarks/tf32x3_bias.py, 2026-11-27: mean of (x - ref)
#: sign(ref) over the outputs relative to their mean |ref|): -8.7e-8 / -8.9e-8 zero-mean unit
#: rows (D = 64 / 512), -9.0e-8 pairs (D = 256), -8.0e-8 / -8.1e-8 a softmax-like block times
#: unit columns (K = 4096), -2.0e-7 all-positive unit rows (D = 128)
TRUNC = 0.86e-7
_LAUNCH_PAD = LAUNCH_BYTES - LAUNCH_ARGS_AT - tiles.TILE_ARGS_DTYPE.itemsize - _TAIL.size


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _rows4(x, name: str):
    """``x`` as a 2-D float32 array with unit column stride (copied where it is not)."""
    import cupy as cp

    if getattr(x, "ndim", None) != 2 or x.dtype != np.float32:
        raise ValueError(f"tiles_f16x3: {name} must be a 2-D float32 CuPy array, got "
                         f"{getattr(x, 'dtype', type(x))} of shape {getattr(x, 'shape', None)}")
    return x if x.shape[1] <= 1 or x.strides[1] == 4 else cp.ascontiguousarray(x)


def split_rows(x, name: str = "x"):
    """(hi, lo, inv) of ``x`` (rows, d) float32: hi + lo = x_r 2^e_r per row r (float16,
    (rows, d rounded up to 8), the pad zero), inv = 2^-e_r (float32, rows)."""
    import cupy as cp

    x = _rows4(x, name)
    rows, d = x.shape
    dp = _pad8(d)
    hi = cp.empty((rows, dp), np.float16)
    lo = cp.empty((rows, dp), np.float16)
    inv = cp.empty(rows, np.float32)
    if rows:
        kern = kernels.get_function(FILE, "cpn_f16x3_split_rows")
        kern((-(-rows * 32 // BLOCK),), (BLOCK,), (x, np.int64(blas.leading_dim(x, name)),
                                                  np.int32(rows), np.int32(d), np.int32(dp),
                                                  hi, lo, inv))
    return hi, lo, inv


def split_cols_t(x, name: str = "x"):
    """(hi, lo, inv) of xᵀ for ``x`` (rows, d) float32, each row c of xᵀ (a column of x)
    scaled by its own 2^e_c: hi, lo float16 (d, rows rounded up to 8), inv = 2^-e_c (d)."""
    import cupy as cp

    x = _rows4(x, name)
    rows, d = x.shape
    rp = _pad8(rows)
    hi = cp.empty((d, rp), np.float16)
    lo = cp.empty((d, rp), np.float16)
    inv = cp.empty(d, np.float32)
    if d and rp:
        cmax = cp.zeros(d, np.uint32)
        ld = np.int64(blas.leading_dim(x, name))
        kernels.get_function(FILE, "cpn_f16x3_colmax")(
            (max(1, -(-rows // 256)), -(-d // 32)), (256,), (x, ld, np.int32(rows), np.int32(d),
                                                              cmax))
        kernels.get_function(FILE, "cpn_f16x3_split_t")(
            (-(-rp // 32), -(-d // 32)), (256,), (x, ld, np.int32(rows), np.int32(rp),
                                                 np.int32(d), cmax, hi, lo, inv))
    return hi, lo, inv


def split_scaled(x, exp: int, name: str = "x"):
    """(hi, lo) of ``x`` (rows, cols) float32 scaled by 2^exp as a whole: float16 (rows,
    cols rounded up to 8), the pad zero.  ``exp`` puts the caller's bound on |x| at or below
    2^15 (beyond, hi overflows to inf)."""
    import cupy as cp

    x = _rows4(x, name)
    rows, cols = x.shape
    cp8 = _pad8(cols)
    hi = cp.empty((rows, cp8), np.float16)
    lo = cp.empty((rows, cp8), np.float16)
    n = rows * cp8
    if n:
        kernels.get_function(FILE, "cpn_f16x3_split_scaled")(
            (-(-n // BLOCK),), (BLOCK,), (x, np.int64(blas.leading_dim(x, name)), np.int64(rows),
                                          np.int32(cols), np.int32(cp8), np.int32(exp), hi, lo))
    return hi, lo


class Interleaved(NamedTuple):
    """The float16 halves of a (rows, cols) matrix interleaved in place in its float32
    buffer ``buf`` (:func:`split_scaled_il`): an A operand of :func:`mm`."""
    buf: object
    rows: int
    cols: int


def split_scaled_il(x, exp: int, name: str = "x") -> Interleaved:
    """:func:`split_scaled` in place: ``x`` (rows, cols) float32, unit column stride, leading
    dimension a multiple of 64 and at least cols rounded up to 64, becomes per row and
    64-column group that group's 64 hi then 64 lo float16 (no memory beyond x's own: what a
    gradient pass writing G could write instead).  ``x`` is overwritten."""
    rows, cols = x.shape
    ld = blas.leading_dim(x, name)
    if x.dtype != np.float32 or x.strides[1] != 4 or ld % 64 or ld < -(-cols // 64) * 64:
        raise ValueError(f"split_scaled_il: {name} must be float32 with unit column stride and "
                         f"a leading dimension a multiple of 64 covering its columns, got "
                         f"{x.dtype} {x.shape} strides {x.strides}")
    groups = -(-cols // 64)
    if rows and groups:
        kernels.get_function(FILE, "cpn_f16x3_split_scaled_il")(
            (-(-groups // 16), rows), (256,), (x, np.int64(ld), np.int32(cols), np.int32(exp)))
    return Interleaved(x, rows, cols)


def available() -> bool:
    """Whether the F16x3 tiles can run here (compute capability 9.0, tensor maps)."""
    return tiles_tf32.available()


def mm(a_parts, b_parts, out, alpha: float = 1.0, *, rowf=None, colf=None,
       trans_a: bool = False, accumulate: bool = False, k: Optional[int] = None,
       splits: Optional[int] = None):
    """``out = alpha · (op(A) Bᵀ · rowf[i]) · colf[j]`` (``accumulate``: ``+ out``).

    ``a_parts`` = (A_hi, A_lo): (m, K) K-major, or with ``trans_a`` the halves of the stored
    (K, m) matrix; or an :class:`Interleaved` (either way round); ``b_parts`` = (B_hi, B_lo) (c, K), float16 with 16-byte rows; ``rowf``
    (m,) / ``colf`` (c,) float32 inverse scales or None (1); ``k``: the K to sum over (default
    B's width; beyond the arrays the TMA reads zeros); ``out`` (m, c) float32 with an even
    leading dimension: m and c are its shape (the halves may be wider, padded).  Returns
    ``out``."""
    il = isinstance(a_parts, Interleaved)
    if il:
        a_hi = a_lo = None
        a_shape = (a_parts.rows, a_parts.cols)
    else:
        a_hi, a_lo = a_parts
        a_shape = a_hi.shape
    b_hi, b_lo = b_parts
    m, c = out.shape
    kk = b_hi.shape[1] if k is None else k
    for nm, x in (("A_hi", a_hi), ("A_lo", a_lo), ("B_hi", b_hi), ("B_lo", b_lo)):
        if x is None:
            continue
        if x.dtype != np.float16 or x.ndim != 2 or x.strides[1] != 2 \
                or blas.leading_dim(x) % 8 or x.data.ptr % 16:
            raise ValueError(f"tiles_f16x3.mm: {nm} must be float16 with 16-byte rows, got "
                             f"{x.dtype} strides {x.strides}")
    if (a_shape[1] if trans_a else a_shape[0]) < m or b_hi.shape[0] < c:
        raise ValueError(f"tiles_f16x3.mm: out {out.shape} has more rows than op(A) "
                         f"{a_shape}{' (transposed)' if trans_a else ''} or more columns "
                         f"than B {b_hi.shape} has rows")
    if out.dtype != np.float32 or out.strides[1] != 4 or blas.leading_dim(out) % 2:
        raise ValueError(f"tiles_f16x3.mm: out must be float32 with an even leading "
                         f"dimension, got {out.dtype} strides {out.strides}")
    rt, ct = -(-m // tiles.TILE), -(-c // tiles.TILE)
    if splits is None:
        splits = tiles.grid_splits(rt, ct)
    raw = tiles_tf32._args(b_hi, b_hi, rows=m, n1=c, d=kk, scale=alpha, g=out,
                           tri=accumulate)
    mode = ("mmt" if trans_a else "mm") + ("il" if il else "")
    kern = kernels.get_function(FILE, f"cpn_wstile_{mode}_f16x3")
    rg = tiles_tf32.ring(*tiles.ws_smem(kern))
    if rg is None:
        raise tiles_tf32.TF32TilesUnavailable(f"cpn_wstile_{mode}_f16x3: too little shared "
                                              f"memory for {tiles_tf32.MIN_STAGES} stages")
    box = 64 if trans_a else tiles.TILE
    if il:
        maps = [tma.interleaved_map(a_parts.buf, h, a_parts.rows, a_parts.cols, box)
                for h in (0, 1)]
    else:
        maps = [tiles._tile_map(x, box) for x in (a_hi, a_lo)]
    maps += [tiles._tile_map(x, tiles.TILE) for x in (b_hi, b_lo)]
    if any(mp is None for mp in maps):
        raise tiles_tf32.TF32TilesUnavailable(f"cpn_wstile_{mode}_f16x3: the driver refused "
                                              f"a tensor map")
    blob = b"".join([mp.tobytes() for mp in maps] + [
        raw, _TAIL.pack(rg[0] | ((1 << 9) if tiles_tf32.MM_INTERLEAVE else 0), TRUNC,
                        tiles.ptr(rowf), tiles.ptr(colf)), bytes(_LAUNCH_PAD)])
    kern((rt, splits), (tiles.WS_THREADS,), (np.frombuffer(blob, LAUNCH_DTYPE),),
         shared_mem=rg[1])
    return out
