"""The F16x3 backend: float32 products on the float16 tensor cores (issue 24,
``kernels_src/products/tiles_ws_f16x3.cu``).  The chooser (:mod:`.plan`) issues them for CLIP's
products and the other row-block ops' score products under "auto" on Hopper.

Each float32 operand row is scaled by a power of two 2^e (its largest |x| into
[2^14, 2^15)) and split into float16 halves, x 2^e = hi + lo (~22 bits of x, as the TF32x3
split keeps); a product is lo_a·hi_b + hi_a·lo_b + hi_a·hi_b on the float16 tensor cores --
twice TF32's rate -- promoted to an fp32 register sum every 64 of K, and the scales come out
exactly in the store: ``out = alpha · acc · rowf[i] · colf[j]``.

Operands, all K-major float16 halves plus the inverse scales of their rows:

* :func:`split_rows` -- rows scaled each (A or B of S = A Bᵀ: K = the features);
* :func:`split_cols_t` -- xᵀ scaled per column of x (the B operand of G B: K = x's rows);
* :func:`split_scaled` -- one scale 2^e for the whole matrix (a gradient block G with a
  known bound: G's rows are K for G B's and its columns are M for Gᵀ A's, so neither may
  carry a scale of its own); :func:`split_scaled_il` the same in place, interleaved (what
  ``cpn_clip_grad_f16x3`` writes).

:func:`mm` multiplies them (``trans_a``: A given as the halves of the stored (K x M) matrix,
read MN-major by the tensor cores; no copy).
"""
from __future__ import annotations

import math
import struct
from typing import NamedTuple, Optional, Tuple

import numpy as np

from ... import config
from .. import kernels, tma
from ..arrays import leading_dim, ptr
from ..kernels import BLOCK
from ..tiling import TILE, grid_splits, tile_map
from . import tf32x3

FILE = "products/tiles_ws_f16x3.cu"
#: K per ring stage: one 128-byte swizzled row of float16; a stage is four 16 KiB boxes, the
#: TF32x3 tiles' 64 KiB (``tf32x3.ring`` sizes both)
KSTEP = 64

#: the fields of the kernels' one parameter, ``WsF16Launch``, after the ring
#: (``tf32x3.launch_packed`` packs the rest: maps, TileArgs at 512, ring at 736): comp at
#: 740, rowf at 744, colf at 752, ufac at 760; 768 bytes in all
_TAIL = struct.Struct("<fQQQ")
# the products are scaled by 1 + ``config.f16x3_trunc`` in the store (the launch's ``comp``): the mean loss of
# the tensor cores' truncating adds, as ``CPN_TF32X3_TRUNC`` for the TF32x3 tiles.  Measured
# uncompensated on an H100 (benchmarks/tf32x3_bias.py, 2026-11-27: mean of (x - ref)
# sign(ref) over the outputs relative to their mean |ref|): -8.7e-8 / -8.9e-8 zero-mean unit
# rows (D = 64 / 512), -9.0e-8 pairs (D = 256), -8.0e-8 / -8.1e-8 a softmax-like block times
# unit columns (K = 4096), -2.0e-7 all-positive unit rows (D = 128)


#: the exponents the splits use (common.cuh F16X3_EXP_MIN / MAX: 2^e and 2^-e normal)
EXP_MIN, EXP_MAX = -113, 126


def _check_exp(exp, name: str) -> int:
    if not isinstance(exp, (int, np.integer)) or not EXP_MIN <= exp <= EXP_MAX:
        raise ValueError(f"f16x3: {name} must be an integer in [{EXP_MIN}, {EXP_MAX}], "
                         f"got {exp!r}")
    return int(exp)


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _rows4(x, name: str):
    """``x`` as a 2-D float32 array with unit column stride (copied where it is not)."""
    import cupy as cp

    if getattr(x, "ndim", None) != 2 or x.dtype != np.float32:
        raise ValueError(f"f16x3: {name} must be a 2-D float32 CuPy array, got "
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
        kern((-(-rows * 32 // BLOCK),), (BLOCK,), (x, np.int64(leading_dim(x, name)),
                                                  np.int32(rows), np.int32(d), np.int32(dp),
                                                  hi, lo, inv))
    return hi, lo, inv


def split_cols_t(x, name: str = "x", out=None):
    """(hi, lo, inv) of xᵀ for ``x`` (rows, d) float32, each row c of xᵀ (a column of x)
    scaled by its own 2^e_c: hi, lo float16 (d, rows rounded up to 8), inv = 2^-e_c (d).
    ``out``: (hi, lo, inv, cmax) to write (cmax: uint32 (d,) scratch, zeroed here), nothing
    allocated (``chooser.TilesPlan.prefetch`` splits on a side stream); ``x`` then
    needs unit column stride."""
    import cupy as cp

    if out is not None and x.ndim == 2 and x.shape[1] > 1 and x.strides[1] != 4:
        raise ValueError(f"split_cols_t: {name} with out= needs unit column stride, got "
                         f"strides {x.strides}")
    x = _rows4(x, name)
    rows, d = x.shape
    rp = _pad8(rows)
    if out is None:
        hi = cp.empty((d, rp), np.float16)
        lo = cp.empty((d, rp), np.float16)
        inv = cp.empty(d, np.float32)
        cmax = None
    else:
        hi, lo, inv, cmax = out
    if d and not rp:
        inv.fill(1)
    if d and rp:
        if cmax is None:
            cmax = cp.zeros(d, np.uint32)
        else:
            cmax.fill(0)
        ld = np.int64(leading_dim(x, name))
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

    exp = _check_exp(exp, "exp")
    x = _rows4(x, name)
    rows, cols = x.shape
    cp8 = _pad8(cols)
    hi = cp.empty((rows, cp8), np.float16)
    lo = cp.empty((rows, cp8), np.float16)
    n = rows * cp8
    if n:
        kernels.get_function(FILE, "cpn_f16x3_split_scaled")(
            (-(-n // BLOCK),), (BLOCK,), (x, np.int64(leading_dim(x, name)), np.int64(rows),
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
    exp = _check_exp(exp, "exp")
    check_interleaved(x, name)
    rows, cols = x.shape
    groups = -(-cols // 64)
    if rows and groups:
        kernels.get_function(FILE, "cpn_f16x3_split_scaled_il")(
            (-(-groups // 16), min(rows, 65535)), (256,),
            (x, np.int64(leading_dim(x, name)), np.int32(rows), np.int32(cols),
             np.int32(exp)))
    return Interleaved(x, rows, cols)


def check_interleaved(x, name: str = "x") -> None:
    """``ValueError`` unless ``x`` can hold its own interleaved halves: 2-D float32, unit
    column stride, 16-byte aligned, a leading dimension a multiple of 64 covering its
    columns rounded up to 64."""
    ok = getattr(x, "ndim", None) == 2 and x.dtype == np.float32
    if ok:
        ld = leading_dim(x, name)
        ok = (x.strides[1] == 4 and x.data.ptr % 16 == 0 and ld % 64 == 0
              and ld >= -(-x.shape[1] // 64) * 64)
    if not ok:
        raise ValueError(f"f16x3: {name} must be float32 with unit column stride, 16-byte "
                         f"aligned, and a leading dimension a multiple of 64 covering its "
                         f"columns, got {getattr(x, 'dtype', type(x))} "
                         f"{getattr(x, 'shape', None)} strides {getattr(x, 'strides', None)}")


def exp_for(bound: float) -> int:
    """The exponent e that puts ``bound`` (a largest |x|) into [2^14, 2^15): the kernels'
    ``f16x3_exp`` on the host (0 for inf / NaN, clamped to [EXP_MIN, EXP_MAX])."""
    if not math.isfinite(bound):
        return 0
    b = abs(bound)
    ex = math.frexp(b)[1] - 1 if b >= 2.0 ** -126 else -126  # floor(log2(b))
    return max(EXP_MIN, min(EXP_MAX, 14 - ex))


def bound_exp(w, n: int, stride: int, w_mul: float, out):
    """``out[0]`` (int32, device) = :func:`exp_for` of max_i |w_mul w[i stride]| (float32
    weights on the device: no host read)."""
    kernels.get_function(FILE, "cpn_f16x3_bound_exp")(
        (1,), (256,), (w, np.int64(n), np.int64(stride), np.float32(w_mul), out))
    return out


def available() -> bool:
    """Whether the F16x3 tiles can run here (compute capability 9.0, tensor maps)."""
    return tf32x3.available()


def mm(a_parts, b_parts, out, alpha: float = 1.0, *, rowf=None, colf=None, ufac=None,
       trans_a: bool = False, accumulate: bool = False, k: Optional[int] = None,
       splits: Optional[int] = None):
    """``out = alpha' · op(A) Bᵀ · rowf[i] · colf[j]`` (``accumulate``: ``+ out``), alpha'
    = alpha (times the device scalar ``ufac[0]`` where given: float32, rounded once), the
    product also scaled by 1 + ``config.f16x3_trunc``.

    ``a_parts`` = (A_hi, A_lo): (m, K) K-major, or with ``trans_a`` the halves of the stored
    (K, m) matrix; or an :class:`Interleaved` (either way round); ``b_parts`` = (B_hi, B_lo)
    (c, K), float16 with 16-byte rows; ``rowf``
    (m,) / ``colf`` (c,) float32 inverse scales or None (1); ``k``: the K to sum over (default
    B's width; at most A's and B's; the halves' columns past it -- a box reaches to the next
    multiple of 64 -- must be zero, as the splits' pads are); ``out`` (m, c) float32 with an even
    leading dimension: m and c are its shape (the halves may be wider, padded).  Returns
    ``out``."""
    il = isinstance(a_parts, Interleaved)
    if il:
        check_interleaved(a_parts.buf, "A")
        if (a_parts.rows, a_parts.cols) != tuple(a_parts.buf.shape):
            raise ValueError(f"f16x3.mm: an Interleaved A of {a_parts.rows} x "
                             f"{a_parts.cols} over a buffer of shape {a_parts.buf.shape}")
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
                or leading_dim(x) % 8 or x.data.ptr % 16:
            raise ValueError(f"f16x3.mm: {nm} must be float16 with 16-byte rows, got "
                             f"{x.dtype} strides {x.strides}")
    if (a_shape[1] if trans_a else a_shape[0]) < m or b_hi.shape[0] < c:
        raise ValueError(f"f16x3.mm: out {out.shape} has more rows than op(A) "
                         f"{a_shape}{' (transposed)' if trans_a else ''} or more columns "
                         f"than B {b_hi.shape} has rows")
    if out.dtype != np.float32 or out.strides[1] != 4 or leading_dim(out) % 2 \
            or out.data.ptr % 8:
        raise ValueError(f"f16x3.mm: out must be float32, 8-byte aligned, with an even "
                         f"leading dimension, got {out.dtype} strides {out.strides}")
    if not il and (a_hi.shape != a_lo.shape or a_hi.strides != a_lo.strides):
        raise ValueError(f"f16x3.mm: A's halves differ: {a_hi.shape} {a_hi.strides} "
                         f"and {a_lo.shape} {a_lo.strides}")
    if b_hi.shape != b_lo.shape or b_hi.strides != b_lo.strides:
        raise ValueError(f"f16x3.mm: B's halves differ: {b_hi.shape} {b_hi.strides} "
                         f"and {b_lo.shape} {b_lo.strides}")
    a_k = a_shape[0] if trans_a else a_shape[1]
    if not 0 <= kk <= min(a_k, b_hi.shape[1]):
        raise ValueError(f"f16x3.mm: k = {kk} must lie in [0, {min(a_k, b_hi.shape[1])}]"
                         f" (A's and B's K)")
    for nm, f, size in (("rowf", rowf, m), ("colf", colf, c), ("ufac", ufac, 1)):
        if f is not None and (f.dtype != np.float32 or f.ndim != 1 or f.size < size
                              or (f.size > 1 and f.strides[0] != 4)):
            raise ValueError(f"f16x3.mm: {nm} must be contiguous float32 of at least "
                             f"{size}, got {f.dtype} {f.shape}")
    if m == 0 or c == 0:
        return out
    if kk == 0:  # (the kernel needs a K step: an empty product is 0)
        if not accumulate:
            out.fill(0)
        return out
    rt, ct = -(-m // TILE), -(-c // TILE)
    if splits is None:
        splits = grid_splits(rt, ct)
    raw = tf32x3.args(b_hi, b_hi, rows=m, n1=c, d=kk, scale=alpha, g=out,
                           tri=accumulate)
    mode = ("mmt" if trans_a else "mm") + ("il" if il else "")
    name = f"cpn_wstile_{mode}_f16x3"
    box = 64 if trans_a else TILE
    if il:
        maps = [tma.interleaved_map(a_parts.buf, h, a_parts.rows, a_parts.cols, box)
                for h in (0, 1)]
    else:
        maps = [tile_map(x, box) for x in (a_hi, a_lo)]
    maps += [tile_map(x, TILE) for x in (b_hi, b_lo)]
    cfg = config.current()
    tf32x3.launch_packed(
        kernels.get_function(FILE, name), name, maps, (rt, splits), raw,
        (1 << 9) if cfg.mm_interleave else 0,
        _TAIL.pack(cfg.f16x3_trunc, ptr(rowf), ptr(colf), ptr(ufac)))
    return out
