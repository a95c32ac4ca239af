"""Device buffers and the small per-row kernels every op shares (``kernels_src/losses/arrays.cu``).

* :func:`buffers` — several outputs / scratch arrays from one allocation (host time);
* :func:`normalize` / :func:`finish` — the L2 row normalisation and the input-dtype gradient
  through it (``l2norm_fwd`` / ``l2norm_bwd`` / ``scale_cast``);
* :func:`fixed_sum` — a fixed-order single-block sum (the reduced loss, the same bits on every
  run); :func:`class_sums` — per-label sums of rows, in a fixed order (SupCon's terms);
* :func:`scalar` / :func:`grad_scale` — scalars as (1,) device arrays, never read back;
  :func:`guard_log_scale` — a device log scale past the limit made NaN, on the device.

CuPy is imported inside the functions: importing the engine needs no GPU.
"""
from __future__ import annotations

import numpy as np

from .. import config
from . import compat, kernels
from .kernels import BLOCK, acc_dtype

#: ``F.normalize``'s epsilon: rows are divided by ``max(||x||, NORM_EPS)``.
NORM_EPS = 1e-12
#: The row kernels' source (the row-block path's kernels live there too, see losses/row_blocks.py).
FILE = "losses/arrays.cu"
# Buffers totalling at most ``config.arena_bytes`` come from one allocation (:func:`buffers`):
# under ``cupynce.torch`` every allocation goes through torch's caching allocator at 6-20 µs
# of host time each, more than a tiny op's kernels.  A view keeps its whole allocation
# alive, so the cuBLAS path carves its scratch and its outputs from two separate ones.


def ptr(x) -> int:
    """The device pointer of ``x`` (0 for None: the kernels' "absent"; an int is one already)."""
    if x is None or isinstance(x, int):
        return x or 0
    return x.data.ptr


def leading_dim(x, name: str = "x") -> int:
    """Leading dimension (elements) of a row-major matrix view with unit column stride (what
    cuBLAS, the kernels and the tensor maps take as a row stride)."""
    item = x.dtype.itemsize
    if x.ndim == 2 and x.size == 0:  # CuPy gives empty arrays zero strides; nothing is read
        return max(x.shape[1], 1)
    if x.ndim != 2 or (x.shape[1] > 1 and x.strides[1] != item) or x.strides[0] % item:
        raise ValueError(f"gemm: {name} must be a row-major matrix view, strides {x.strides}")
    return max(x.strides[0] // item, x.shape[1], 1)


def rowmajor(xp, x):
    """A view the kernels and cuBLAS can read (unit column stride), copying only if needed."""
    if x.ndim == 2:
        item = x.dtype.itemsize
        (_, cols), (s0, s1) = x.shape, x.strides  # (each attribute read builds a tuple)
        if (cols <= 1 or s1 == item) and s0 % item == 0 and s0 >= cols * item:
            return x
    return xp.ascontiguousarray(x)


def buffers(specs):
    """``[cp.empty(shape, dtype) for shape, dtype in specs]`` (a None spec gives None), from
    one allocation (256-byte aligned views) when they total at most ``config.arena_bytes``.
    ``dtype`` must be a ``numpy.dtype`` (plain integer arithmetic: NumPy calls cost µs)."""
    import cupy as cp

    sizes, total = [], 0
    for sp in specs:
        nbytes = 0
        if sp is not None:
            nbytes = sp[1].itemsize
            for extent in sp[0]:
                nbytes *= extent
            nbytes = (nbytes + 255) & ~255
        sizes.append(nbytes)
        total += nbytes
    if total > config.current().arena_bytes:
        return [None if sp is None else cp.empty(sp[0], sp[1]) for sp in specs]
    mem = cp.cuda.alloc(max(total, 256))
    out, off = [], 0
    for sp, nbytes in zip(specs, sizes):
        out.append(None if sp is None else cp.ndarray(sp[0], sp[1], memptr=mem + off))
        off += nbytes
    return out


def fixed_sum(x, divisor: int, out=None):
    """``sum(x) / divisor`` as a 0-d array of x's (float32/64) dtype, in a fixed order.

    One single-block kernel (``sum_rows``) instead of CuPy's reduction, whose host time is
    several launches'.  ``out``: a 0-d array of that dtype to write (None: a new one).
    """
    import cupy as cp

    if not x.flags.c_contiguous:
        x = cp.ascontiguousarray(x)
    if out is None:
        out = cp.empty((), x.dtype)
    kernels.launch(FILE, "sum_rows", x.dtype, (1,),
                   (x, np.int64(x.size), x.dtype.type(divisor), out))
    return out


def fixed_sums(x, divisor: int):
    """:func:`fixed_sum` of each row of the C-contiguous 2-D ``x`` in one launch: an array of
    ``x.shape[0]`` sums, each with the bits :func:`fixed_sum` gives that row."""
    import cupy as cp

    rows, n = x.shape
    out = cp.empty((rows,), x.dtype)
    kernels.launch(FILE, "sum_rows", x.dtype, (rows,),
                   (x, np.int64(n), x.dtype.type(divisor), out))
    return out


#: ``CPN_SEG_CHUNK`` of arrays.cu: the sorted positions a ``seg_partial`` thread walks
SEG_CHUNK = 32


def class_sums(x, groups, w=None, *, per_row: bool = True):
    """Each row's class sum: ``out[i] = Σ_{j: labels_j = labels_i} w_j x_j`` (N, D) in the
    accumulator dtype, in a fixed order (``seg_partial`` / ``seg_heads``: the same bits on
    every run, no atomics).  ``x`` (N, D) row-major, any float dtype; ``w`` None or an (N,)
    accumulator-dtype array; ``groups``: ``ops._variants.label_groups``'s (order, sorted
    labels, each sorted position's class end, each row's class start, ...).  ``per_row=False``:
    the sums where the kernels leave them, row i's at row ``start_i`` (no gather)."""
    import cupy as cp

    order, sl, end, start = groups[:4]
    a = acc_dtype(x.dtype)
    n, d = x.shape
    part = cp.empty((n, d), a)
    chunks = -(-n // SEG_CHUNK)
    kernels.launch(FILE, "seg_partial", x.dtype, (-(-d // BLOCK), min(chunks, 65535)),
                   (x, np.int64(leading_dim(x)), np.int32(d), order, sl,
                    0 if w is None else cp.ascontiguousarray(w, dtype=a), np.int64(n), part))
    kernels.launch(FILE, "seg_heads", a, (min(n, 1 << 30), min(-(-d // BLOCK), 65535)),
                   (sl, end, np.int64(n), np.int32(d), part))
    return part[start] if per_row else part


def supcon_rows(zn, start, stop, pc, pw, scale: float, lse, w, acc, scale_log=None):
    """SupCon's loss rows from NT-Xent's row log-sum-exps ``lse`` (None: no loss) and, with
    the row weights ``w`` and the weighted class sums ``pw``, the gradient's difference added
    into ``acc`` (``supcon_rows``: one pass; ``ops._variants.supcon_terms`` has the
    formulas).  ``start`` / ``stop``: each row's class bounds in the sorted order; ``pc`` /
    ``pw``: :func:`class_sums` with ``per_row=False`` (of ẑ, and of u ẑ); ``scale_log``: a
    (1,) device array, the scale then ``scale · exp(scale_log)`` (never read).  Returns the
    (N,) loss or None."""
    import cupy as cp

    a = acc_dtype(zn.dtype)
    n, d = zn.shape
    loss = None if lse is None else cp.empty((n,), a)
    grad = pw is not None
    kernels.launch(FILE, "supcon_rows", zn.dtype, (n,), (
        zn, np.int64(leading_dim(zn)), np.int32(d), np.int64(n), np.int64(n // 2),
        cp.ascontiguousarray(start), cp.ascontiguousarray(stop), pc, ptr(pw),
        cp.ascontiguousarray(w, dtype=a) if grad else 0, ptr(lse), a.type(scale),
        ptr(scale_log), ptr(loss), ptr(acc) if grad else 0,
        np.int64(leading_dim(acc, "acc") if grad else 0)))
    return loss


#: entries a lane of the normalisation kernels sums at most before a row takes more warps
_NORM_PER_LANE = 64


def norm_warps(d: int) -> int:
    """Warps per row of the row-normalisation kernels (1, 2, 4 or 8): one up to 64 · 32 = 2048
    columns, then enough that a lane sums at most ``_NORM_PER_LANE`` entries, at most a block's
    8.  (A warp per row took 4.5× F.normalize's time at 8 rows × 32768 on an H200; a block per
    row 8× its bytes' time at 65536 × 128: docs/decisions.md.)"""
    w = 1
    while w < BLOCK // 32 and d > _NORM_PER_LANE * 32 * w:
        w *= 2
    return w


def normalize(x):
    """``(x / max(||x_i||, NORM_EPS), ||x_i||)`` for the rows of the (N, D) matrix ``x``."""
    import cupy as cp

    a = acc_dtype(x.dtype)
    n, d = x.shape
    xn = cp.empty((n, d), x.dtype)
    norm = cp.empty((n,), a)
    if n:  # (norm_warps(d) warps a row: BLOCK // 32 // that many rows a block)
        wpr = norm_warps(d)
        kernels.launch(FILE, "l2norm_fwd", x.dtype, (-(-n // (BLOCK // 32 // wpr)),),
                       (x, np.int64(leading_dim(x)), np.int64(n), np.int32(d),
                        a.type(NORM_EPS), xn, norm, np.int32(wpr)))
    return xn, norm


def finish(x, norm, acc, g):
    """The input-dtype gradient ``g * acc`` (through the normalisation when ``norm`` is given)."""
    import cupy as cp

    out = cp.empty(acc.shape, x.dtype)
    if acc.size == 0:
        return out
    if norm is not None:
        n, d = x.shape
        wpr = norm_warps(d)
        kernels.launch(FILE, "l2norm_bwd", x.dtype, (-(-n // (BLOCK // 32 // wpr)),),
                       (x, np.int64(leading_dim(x)), np.int64(n), np.int32(d),
                        acc.dtype.type(NORM_EPS), norm, acc, ptr(g), out, np.int32(wpr)))
    else:
        per_thread = 4 if acc.dtype == np.float32 else 1  # (4-wide loads for fp32, aligned)
        grid = min(-(-acc.size // (BLOCK * per_thread)), 65535)
        kernels.launch(FILE, "scale_cast", x.dtype, (grid,),
                       (acc, np.int64(acc.size), ptr(g), out))
    return out


def owned_copy(x, dtype):
    """``x.astype(dtype, copy=True)``, as one device-to-device copy where the dtype is the same
    and ``x`` is C-contiguous: a ``cudaMemcpyAsync`` takes ~3 µs of host time, CuPy's
    ``astype`` / ``copy`` an elementwise launch of ~10-15 µs.  The backwards' scalar gradients
    are their last launches, which the GPU waits for when the host is slow."""
    import cupy as cp

    dtype = np.dtype(dtype)
    if x.dtype != dtype or not x.flags.c_contiguous:
        return x.astype(dtype, copy=True)
    out = cp.empty(x.shape, dtype)
    if x.nbytes:
        cp.cuda.runtime.memcpyAsync(out.data.ptr, x.data.ptr, x.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToDevice,
                                    cp.cuda.get_current_stream().ptr)
    return out


def fill(x, value: float):
    """Set every element of the contiguous float32 / float64 CuPy array ``x`` to ``value``
    (``cpn_fill_<dtype>`` of blas.cu, one of the prebuilt cubins: ``x.fill`` would compile a
    CuPy kernel at the first call on a fresh machine).  Returns ``x``."""
    if x.size:
        kern = kernels.get_function("products/blas.cu", f"cpn_fill_{kernels.dtype_suffix(x.dtype)}")
        kern((-(-x.size // BLOCK),), (BLOCK,), (x, x.dtype.type(value), np.int64(x.size)))
    return x


def scalar(value, a):
    """A (1,) device array of dtype ``a`` (float32 / float64) holding a Python float: a fill
    kernel, no host-device copy."""
    import cupy as cp

    return fill(cp.empty((1,), dtype=a), value)


def guard_log_scale(ls, limit: float):
    """A device ``logit_scale`` (the log of the scale; a (1,) float32 / float64 array), NaN
    where it exceeds ``limit``: one small kernel (``guard_log_scale``), no host read.  The
    host check refuses such a value; on the device it cannot be read without a
    synchronisation, so it poisons the loss and the gradients instead (float32's exp
    overflows there anyway; float64's would not, and would give a finite, meaningless loss)."""
    import cupy as cp

    out = cp.empty(ls.shape, ls.dtype)
    kernels.launch(FILE, "guard_log_scale", ls.dtype, (-(-ls.size // BLOCK),),
                   (ls, np.int64(ls.size), ls.dtype.type(limit), out))
    return out


def grad_scale(grad_loss, a):
    """``grad_loss`` (float or 0-d/1-element array) as a (1,) device array of dtype ``a``
    (None for 1.0: the kernels skip the multiplication)."""
    if isinstance(grad_loss, float):
        return None if grad_loss == 1.0 else scalar(grad_loss, a)
    return grad_loss.astype(a, copy=False).reshape(1)


def pair_weights(weights, a):
    """``(w_r, w_c, mul)`` as the kernels read them: one array indexed by the global row,
    [w_c (m) | w_r (n)] (None when both are None: every weight is ``mul``), and ``mul``."""
    w_r, w_c, mul = weights
    if w_r is None and w_c is None:
        return None, float(mul)
    import cupy as cp

    return cp.concatenate([w_c, w_r]).astype(a, copy=False), float(mul)


compat.legacy_switches(__name__, {"ARENA_BYTES": "arena_bytes"})
