"""The InfoNCE family: NT-Xent (SimCLR), query/key InfoNCE, and CLIP's symmetric loss.

Each op has three entry points:

* ``op(...)`` — the loss only (no gradient work);
* ``op_forward(..., requires_grad=True)`` → ``(loss, ctx)``;
* ``op_backward(ctx, grad_loss=1.0)`` → the gradients of every array input.

CuPy arrays run on the GPU: cuBLAS products on row blocks of the score matrix, with the fused
row/column kernels of ``kernels_src/contrastive.cu`` between them.  NumPy arrays run the same
blocked algorithm in vectorised NumPy.  The two never mix.

How the gradient is computed
----------------------------
For ``reduction="mean"`` / ``"sum"`` the gradient is linear in the scalar ``grad_loss``, so
``op_forward(requires_grad=True)`` computes it for ``grad_loss = 1`` in the same pass over the
score blocks that yields the loss (one product fewer than recomputing later) and keeps only
the O(N·D) float32 (float64) result; ``op_backward`` multiplies by ``grad_loss`` and casts.
For ``reduction="none"`` the row weights are known only in backward, so forward keeps the
inputs and the row log-sum-exps (O(N·D + N)) and backward recomputes the score blocks.
The full N × N matrix never exists unless it fits in the workspace.
"""
from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _blas, _checks
from ._kernels import BLOCK, acc_dtype, arch_specific_build, get_kernel, launch

#: ``F.normalize``'s epsilon: rows are divided by ``max(||x||, NORM_EPS)``.
NORM_EPS = 1e-12
#: Workspace for the NumPy path's score blocks when the caller gives none (bytes).
NUMPY_WORKSPACE_BYTES = 256 << 20
_FILE = "contrastive.cu"
_TILES = "tiles.cu"
#: The tensor-core tile kernels of ``kernels_src/tiles.cu`` (scores never leave registers) for
#: float16 / bfloat16 inputs whose D, leading dimensions and pointers are multiples of 8
#: elements / 16 bytes.  ``CUPYNCE_TILES``: unset / ``auto`` uses them where their wgmma main
#: loop is built (compute capability 9.0: Hopper, sm_90a), which is faster than cuBLAS + row
#: kernels there (benchmarks/NOTES.md); ``1`` also on other sm_80+ GPUs (mma.sync main loop,
#: slower than the cuBLAS path, kept for testing); ``0`` never.  None / True / False here.
#: The same switch selects SPLADE's fused forward (splade.py).
USE_TILES: Optional[bool] = {"0": False, "1": True}.get(os.environ.get("CUPYNCE_TILES", "auto"))
#: On Hopper, run the wgmma main loop (False: the mma.sync one, so tests can cover both there).
USE_WGMMA = True
#: NT-Xent's forward on the tiles computes each pair of score tiles once (S = Z Zᵀ is
#: symmetric: row and column partials of half the tiles, see ``_tile_lse_symmetric``) when
#: N · D >= ``SYMMETRIC_LSE_MIN_ND`` and its column partials, 8 · N · ceil(N / 128) bytes, fit
#: the workspace; False: every tile.  Its row + column epilogue costs more per tile than the
#: row-only one, so it pays where the products dominate.  Measured on an H100 (bf16,
#: forward + backward, square -> symmetric): D = 512: N = 65536 34.3 -> 30.6 ms, 32768 8.54 ->
#: 7.72, 16384 2.17 -> 2.09, 8192 0.65 -> 0.68; D = 256: 65536 22.0 -> 21.6, 32768 5.54 ->
#: 5.53, 16384 1.48 -> 1.54, 8192 0.47 -> 0.54; hence the threshold (N = 16384 at D = 512).
SYMMETRIC_LSE = True
SYMMETRIC_LSE_MIN_ND = 16384 * 512
#: NT-Xent's gradient pass on the tiles computes each pair of H = G + Gᵀ tiles once and
#: writes the tile and its mirror (H is symmetric) when the whole 16-bit H fits the workspace
#: in one block (N ≲ 23000 with the default 1 GiB); False: every tile.  H100, bf16, D = 512,
#: forward + backward: N = 16384 2.17 -> 1.90 ms, 8192 0.65 -> 0.58; D = 256: 1.48 -> 1.46,
#: 0.47 -> 0.46.
SYMMETRIC_H = True
_TILE = 128  # rows / columns of one score tile (TBM = TBN in tiles.cu)
_TILE_THREADS = 256
#: dynamic shared memory of a tile CTA (TSMEM_BYTES / WSMEM_BYTES in tiles.cu; a GPU test
#: checks they agree through cpn_tile_smem): mma.sync, 3 stages x (TBM + TBN) x TLD x 2 bytes;
#: wgmma, 6 stages x (TBM + TBN) x TBK x 2 bytes + 1 KiB to align the swizzled stages
_TILE_SMEM = 3 * (128 + 128) * 72 * 2
_WG_SMEM = 6 * (128 + 128) * 64 * 2 + 1024


@dataclass
class Context:
    """What ``*_backward`` needs from ``*_forward``; treat as opaque.

    ``saved`` holds O(N·D) arrays only: either the unit-weight gradients (mean/sum) or the
    (normalised) inputs and row statistics needed to recompute them (none).
    """

    op: str
    reduction: str
    n: int
    xp: ModuleType
    saved: Dict[str, Any] = field(default_factory=dict)
    #: The O(N) row statistics of the forward (set when ``requires_grad``): ``(lse,)`` for
    #: nt_xent / info_nce, ``(lse_rows, lse_cols)`` for clip_loss; float32 (float64 for
    #: float64 inputs).  With the inputs they are all ``*_backward_from_stats`` needs.
    stats: Tuple[Any, ...] = ()


# ----------------------------------------------------------------------------------------
# small helpers shared by the GPU and NumPy paths
# ----------------------------------------------------------------------------------------
def _reduce(xp, per_row, reduction: str):
    """The reduced loss: a 0-d array (mean/sum) or the per-row array (none).

    On the GPU one single-block kernel (``sum_rows``: a fixed-order sum, then / n for the
    mean) instead of CuPy's reduction, whose host time is several launches'.
    """
    if reduction == "none":
        return per_row
    if xp is np:
        return np.asarray(per_row.mean() if reduction == "mean" else per_row.sum())
    return _gpu_sum(per_row, per_row.size if reduction == "mean" else 1)


def _gpu_sum(x, divisor: int):
    """``sum(x) / divisor`` as a 0-d array of x's (float32/64) dtype, in a fixed order."""
    import cupy as cp

    if not x.flags.c_contiguous:
        x = cp.ascontiguousarray(x)
    out = cp.empty((), x.dtype)
    launch(_FILE, "sum_rows", x.dtype, (1,), (x, np.int64(x.size), x.dtype.type(divisor), out))
    return out


def _row_weight(reduction: str, n: int) -> float:
    return 1.0 / n if reduction == "mean" else 1.0


def _rowmajor(xp, x):
    """A view the kernels and cuBLAS can read (unit column stride), copying only if needed."""
    item = x.dtype.itemsize
    if x.ndim == 2 and (x.shape[1] <= 1 or x.strides[1] == item) and x.strides[0] % item == 0 \
            and x.strides[0] >= x.shape[1] * item:
        return x
    return xp.ascontiguousarray(x)


def _ptr(x):
    return 0 if x is None else x.data.ptr


#: Buffers totalling at most this many bytes come from one allocation (:func:`_buffers`):
#: under ``cupynce.torch`` every allocation goes through torch's caching allocator at 6-20 µs
#: of host time each, more than a tiny op's kernels.  A view keeps its whole allocation
#: alive, so the cuBLAS path carves its scratch and its outputs from two separate ones.
ARENA_BYTES = 1 << 20


def _buffers(specs):
    """``[cp.empty(shape, dtype) for shape, dtype in specs]`` (a None spec gives None), from
    one allocation (256-byte aligned views) when they total at most ``ARENA_BYTES``.
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
    if total > ARENA_BYTES:
        return [None if sp is None else cp.empty(sp[0], sp[1]) for sp in specs]
    mem = cp.cuda.alloc(max(total, 256))
    out, off = [], 0
    for sp, nbytes in zip(specs, sizes):
        out.append(None if sp is None else cp.ndarray(sp[0], sp[1], memptr=mem + off))
        off += nbytes
    return out


# ----------------------------------------------------------------------------------------
# GPU building blocks
# ----------------------------------------------------------------------------------------
def _gpu_normalize(x):
    import cupy as cp

    a = acc_dtype(x.dtype)
    n, d = x.shape
    xn = cp.empty((n, d), x.dtype)
    norm = cp.empty((n,), a)
    launch(_FILE, "l2norm_fwd", x.dtype, (n,),
           (x, np.int64(_blas.leading_dim(x)), np.int32(d), a.type(NORM_EPS), xn, norm))
    return xn, norm


def _gpu_finish(x, norm, acc, g):
    """The input-dtype gradient ``g * acc`` (through the normalisation when ``norm`` is given)."""
    import cupy as cp

    out = cp.empty(acc.shape, x.dtype)
    if acc.size == 0:
        return out
    if norm is not None:
        n, d = x.shape
        launch(_FILE, "l2norm_bwd", x.dtype, (n,),
               (x, np.int64(_blas.leading_dim(x)), np.int32(d), acc.dtype.type(NORM_EPS), norm, acc,
                _ptr(g), out))
    else:
        per_thread = 4 if acc.dtype == np.float32 else 1  # (4-wide loads for fp32, aligned)
        grid = min(-(-acc.size // (BLOCK * per_thread)), 65535)
        launch(_FILE, "scale_cast", x.dtype, (grid,), (acc, np.int64(acc.size), _ptr(g), out))
    return out


def _gpu_scalar(value, a):
    """A (1,) device array holding a Python float (a fill kernel: no host-device copy)."""
    import cupy as cp

    return cp.full((1,), value, dtype=a)


def _gpu_grad_scale(grad_loss, a):
    """``grad_loss`` (float or 0-d/1-element array) as a (1,) device array of dtype ``a``."""
    if isinstance(grad_loss, float):
        return None if grad_loss == 1.0 else _gpu_scalar(grad_loss, a)
    return grad_loss.astype(a, copy=False).reshape(1)


def _weights(xp, grad_loss, reduction: str, n: int, a):
    """Row weights for the gradient: ``(w_ptr_array_or_None, stride, multiplier)``."""
    if grad_loss is None:
        return None, 0, _row_weight(reduction, n)
    if isinstance(grad_loss, float):
        return None, 0, grad_loss * _row_weight(reduction, n)
    g = xp.ascontiguousarray(grad_loss.astype(a, copy=False)).reshape(-1)
    return g, (1 if g.size == n and reduction == "none" else 0), _row_weight(reduction, n)


# ----------------------------------------------------------------------------------------
# The row-softmax engine (nt_xent, info_nce): GPU
# ----------------------------------------------------------------------------------------
def _gpu_rows(q, k, neg_s, neg_p, scale: float, *, exclude_diag: bool, pos_shift: int,
              pos_mod: int, lse_in, weights, want_grad: bool, workspace_bytes, op: str,
              self_pair: bool = False):
    """Row log-sum-exps, per-row losses and (optionally) accumulated gradients.

    q (N, D) queries, k (Nk, D) keys (columns 0..Nk-1), neg_s (Ms, D) shared negatives
    (columns Nk..Nk+Ms-1), neg_p (N, Mp, D) per-query negatives.  ``self_pair`` means q is k
    (NT-Xent): the two gradient products accumulate into one buffer.
    Returns ``lse, loss, (dq, dk, dns, dnp)`` with float32/64 gradient accumulators.
    """
    import cupy as cp

    if neg_p is None and _tiles_ok(q, k, neg_s):
        return _gpu_rows_tiles(q, k, neg_s, scale, exclude_diag=exclude_diag, pos_shift=pos_shift,
                               pos_mod=pos_mod, lse_in=lse_in, weights=weights,
                               want_grad=want_grad, workspace_bytes=workspace_bytes, op=op,
                               self_pair=self_pair)
    t = q.dtype
    a = acc_dtype(t)
    n, d = q.shape
    nk = k.shape[0]
    ms = 0 if neg_s is None else neg_s.shape[0]
    mp = 0 if neg_p is None else neg_p.shape[1]
    ncols = nk + ms
    split_g = want_grad and t != a  # half inputs: the gradient block is stored in T separately
    row_bytes = ncols * a.itemsize + (ncols * t.itemsize if split_g else 0)
    rb = _blas.plan_rows(op, n, row_bytes, workspace_bytes)
    # the call's scratch (score / gradient blocks, paired-negative dots) and what it returns
    # come from two allocations: an output the caller keeps (a per-row loss, the saved
    # gradient accumulators) never holds the score block alive.  The gradient accumulators
    # are written by the first row block's products (beta = 0).
    s_buf, g_buf, e, g2 = _buffers((
        ((rb, ncols), a), ((rb, ncols), t) if split_g else None,
        ((n, mp), a) if mp else None, ((n, mp), a) if mp and want_grad else None))
    lse, loss, dq, dk, dns = _buffers((
        ((n,), a) if lse_in is None else None, ((n,), a),
        ((n, d), a) if want_grad else None,
        ((nk, d), a) if want_grad and not self_pair else None,
        ((ms, d), a) if want_grad and ms else None))
    if not split_g:
        g_buf = s_buf if want_grad else None
    if lse is None:
        lse = lse_in
    if self_pair:
        dk = dq
    dnp = None
    if mp:
        nwarps = n * mp
        launch(_FILE, "paired_dots", t, ((nwarps * 32 + BLOCK - 1) // BLOCK,),
               (q, np.int64(_blas.leading_dim(q)), neg_p, np.int32(n), np.int32(mp), np.int32(d), e))
    w_arr, w_stride, w_mul = weights

    for r0 in range(0, n, rb):
        r1 = min(n, r0 + rb)
        rows = r1 - r0
        s_blk = s_buf[:rows]
        qb = q[r0:r1]
        _blas.gemm(qb, k, s_blk[:, :nk], trans_b=True)
        if ms:
            _blas.gemm(qb, neg_s, s_blk[:, nk:], trans_b=True)
        g_blk = g_buf[:rows] if want_grad else None
        launch(_FILE, "row_softmax", t, (rows,), (
            s_blk, np.int64(ncols), np.int32(ncols),
            _ptr(e) + r0 * mp * a.itemsize if mp else 0, np.int64(mp), np.int32(mp),
            np.int32(r0), np.int32(exclude_diag), np.int32(pos_shift), np.int32(pos_mod),
            0, a.type(scale), _ptr(lse_in), lse if lse_in is None else 0, loss,
            _ptr(g_blk), np.int64(ncols),
            _ptr(g2) + r0 * mp * a.itemsize if g2 is not None else 0, np.int64(mp),
            _ptr(w_arr), np.int64(w_stride), a.type(w_mul)))
        if want_grad:
            acc = 1.0 if r0 else 0.0
            if self_pair:  # dk is dq: its every row is first written by the Gᵀ Q product
                _blas.gemm(g_blk[:, :nk], qb, dk, trans_a=True, beta=acc)
                _blas.gemm(g_blk[:, :nk], k, dq[r0:r1], beta=1.0)
            else:
                _blas.gemm(g_blk[:, :nk], k, dq[r0:r1])
                _blas.gemm(g_blk[:, :nk], qb, dk, trans_a=True, beta=acc)
            if ms:
                _blas.gemm(g_blk[:, nk:], neg_s, dq[r0:r1], beta=1.0)
                _blas.gemm(g_blk[:, nk:], qb, dns, trans_a=True, beta=acc)
    if want_grad and mp:
        dnp = cp.empty((n, mp, d), a)
        launch(_FILE, "paired_grad", t, (n,),
               (q, np.int64(_blas.leading_dim(q)), neg_p, g2, np.int32(mp), np.int32(d), dq, dnp))
    return lse, loss, (dq, dk, dns, dnp)


# ----------------------------------------------------------------------------------------
# Tensor-core tile engine (float16 / bfloat16): kernels_src/tiles.cu
# ----------------------------------------------------------------------------------------
_SM_COUNT: Dict[int, Tuple[int, int]] = {}


def _device_caps() -> Tuple[int, int]:
    """(compute capability as an int, SM count) of the current device, cached per device."""
    import cupy as cp

    dev = cp.cuda.Device()
    if dev.id not in _SM_COUNT:
        _SM_COUNT[dev.id] = (int(dev.compute_capability),
                             int(dev.attributes["MultiProcessorCount"]))
    return _SM_COUNT[dev.id]


def _tiles_ok(*xs) -> bool:
    """Whether the tile kernels take these (2-D, same 16-bit dtype) operands (see USE_TILES)."""
    if USE_TILES is False or xs[0].dtype.itemsize != 2:
        return False
    for x in xs:
        if x is None:
            continue
        if x.shape[1] % 8 or _blas.leading_dim(x) % 8 or x.data.ptr % 16:
            return False
    if USE_TILES is None:
        return _wgmma()
    return _device_caps()[0] >= 80


def _wgmma() -> bool:
    """Whether the tile kernels run the wgmma main loop (tiles.cu built for sm_90a here)."""
    return USE_WGMMA and arch_specific_build(_TILES)


def _splits(row_tiles: int, col_tiles: int) -> int:
    return _splits_for(row_tiles, col_tiles, _device_caps()[1])


@functools.lru_cache(maxsize=1024)
def _splits_for(row_tiles: int, col_tiles: int, slots: int) -> int:
    """Column splits of a tile grid: the fewest (longest CTAs, fewest partials) that fill the
    GPU's CTA slots in waves >= 90 % full on average, else the best-filling count.

    Slots: one CTA per SM for both main loops (wgmma: 193 KiB of shared memory; mma.sync:
    116 KiB, two of which exceed an H100 SM's 228 KiB).  (N = 8192 on an H100: 64 row tiles
    x 2 splits = 128 CTAs, one wave 97 % full, where the former "two CTAs per SM" rule gave
    320 CTAs in 3 waves, the last 42 % full.)
    """
    rt = max(row_tiles, 1)
    best, best_fill = 1, 0.0
    for s in range(1, max(1, min(col_tiles, 4 * slots)) + 1):
        ctas = rt * s
        fill = ctas / (slots * -(-ctas // slots))
        if fill >= 0.9:
            return s
        if fill > best_fill:
            best, best_fill = s, fill
    return best


#: The contrastive tile kernels' arguments: one by-value struct (``TileArgs`` in tiles.cu),
#: packed with ``struct`` -- one parameter for CuPy to marshal instead of 31 (~20 us less
#: host time per launch).  14 pointers, 6 int64, 9 int32, 2 float32, padded to 8 bytes;
#: ``_TILE_ARGS_FIELDS`` is the declaration order (a GPU test checks the offsets).
_TILE_ARGS_FORMAT = "<14Q6q9i2f4x"
_TILE_ARGS_FIELDS = (
    "A", "B1", "B2", "scale_log", "part_m", "part_s", "pos_out", "colp_m", "colp_s",
    "lse_row", "lse_col", "w_ptr", "g", "dsp_part",
    "lda", "ldb1", "ldb2", "part_ld", "w_stride", "ldg",
    "rows", "row0", "n1", "n2", "d", "exclude_diag", "pos_shift", "pos_mod", "tri",
    "scale_mul", "w_mul")
_TILE_ARGS_DTYPE = np.dtype({"names": ["raw"], "formats": [("u1", struct.calcsize(_TILE_ARGS_FORMAT))]})
_pack_tile_args = struct.Struct(_TILE_ARGS_FORMAT).pack


def _tile(stage: str, t, grid, a, row0: int, b1, b2, *, scale: float = 1.0, scale_log=None,
          exclude_diag: bool = False, pos_shift: int = 0, pos_mod: int = 1,
          part=(0, 0, 0), pos_out=0, colp=(0, 0), lse_row=None, lse_col=None,
          weights=(None, 0, 0.0), g=None, dsp=0, tri: bool = False) -> None:
    """Launch ``cpn_tile_<stage>`` over rows ``a`` (global row ``row0`` first) x columns b1|b2."""
    rows, d = a.shape
    w_arr, w_stride, w_mul = weights
    n2 = 0 if b2 is None else b2.shape[0]
    b2 = b1 if b2 is None else b2
    ld = _blas.leading_dim
    raw = _pack_tile_args(
        a.data.ptr, b1.data.ptr, b2.data.ptr, _ptr(scale_log), part[0], part[1], pos_out,
        colp[0], colp[1], _ptr(lse_row), _ptr(lse_col), _ptr(w_arr), _ptr(g), dsp,
        ld(a), ld(b1), ld(b2), part[2], w_stride, 0 if g is None else ld(g),
        rows, row0, b1.shape[0], n2, d, int(exclude_diag), pos_shift, pos_mod, int(tri),
        scale, w_mul)
    _tile_launch(stage, t, grid, (np.frombuffer(raw, _TILE_ARGS_DTYPE),))


#: kernels already opted in to their dynamic shared memory (the attribute query costs host time)
_SMEM_OPTED: set = set()


def _tile_launch(stage: str, t, grid, args) -> None:
    """Launch ``cpn_(wg)tile_<stage>`` with the main loop in use and its shared memory."""
    wg = _wgmma()
    kern = get_kernel(_TILES, f"{'wgtile' if wg else 'tile'}_{stage}", t)
    smem = _WG_SMEM if wg else _TILE_SMEM
    if id(kern) not in _SMEM_OPTED:  # opt in above 48 KiB, once per kernel
        if kern.max_dynamic_shared_size_bytes < smem:
            kern.max_dynamic_shared_size_bytes = smem
        _SMEM_OPTED.add(id(kern))
    kern(tuple(grid), (_TILE_THREADS,), args, shared_mem=smem)


def _tile_lse(q, k, neg_s, scale: float, *, exclude_diag: bool, pos_shift: int, pos_mod: int):
    """Row log-sum-exps and losses ``lse_i - s q_i.k_pos(i)`` with no score matrix in memory."""
    import cupy as cp

    t, f32 = q.dtype, np.dtype(np.float32)
    n = q.shape[0]
    ncols = k.shape[0] + (0 if neg_s is None else neg_s.shape[0])
    rt, ct = -(-n // _TILE), -(-ncols // _TILE)
    splits = _splits(rt, ct)
    part = cp.empty((2, splits, n), f32)
    part_s = part.data.ptr + 4 * splits * n  # the sums' half (a pointer: no view)
    pos = cp.empty((n,), f32)
    _tile("lse", t, (rt, splits), q, 0, k, neg_s, scale=scale, exclude_diag=exclude_diag,
          pos_shift=pos_shift, pos_mod=pos_mod,
          part=(part.data.ptr, part_s, n), pos_out=pos.data.ptr)
    lse = cp.empty((n,), f32)
    loss = cp.empty((n,), f32)
    launch(_TILES, "tile_finish", t, (-(-n // BLOCK),),
           (part, part_s, np.int64(n), np.int32(splits), np.int32(n), pos, lse, loss))
    return lse, loss


def _tile_lse_symmetric(z, scale: float, pos_shift: int, workspace_bytes):
    """NT-Xent's row log-sum-exps and losses with each pair of score tiles computed once.

    S = Z Zᵀ is symmetric, so the column sums of tile (I, J) are the row sums of tile (J, I).
    Row tile I takes the tiles I + o (mod CT) for o < ``tri_count(I)`` (tiles.cu: every
    unordered pair once, every CTA about CT / 2 tiles); the ``lse2`` pass writes the row
    partials of those tiles and the column partials of the off-diagonal ones (shifted by each
    column's positive logit, ``paired_dots``), and ``tile_finish_tri`` merges, for each row,
    its row partials and the column partials of the tiles that covered it, in a fixed order.
    About half the tensor-core work of the square pass.  Returns None (the caller runs the
    square pass) when the column partials, 8 · N · CT bytes, exceed the workspace.
    """
    import cupy as cp

    t, f32 = z.dtype, np.dtype(np.float32)
    n, d = z.shape
    ct = -(-n // _TILE)
    if not _blas.fits(8 * n * ct, workspace_bytes):
        return None
    half = pos_shift  # NT-Xent: positive of row i is i + half (mod 2 half)
    cnt = ct // 2 + 1  # tiles of the busiest row tile
    splits = _splits(ct, cnt)
    part = cp.empty((2, splits, n), f32)
    colp = cp.empty((2, ct, n), f32)
    # the lse2 pass reads the column shift from lse_col: the positive dot of every column,
    # dots[i] = dots[i + half] = z_i . z_{i + half}
    dots = cp.empty((n,), f32)
    second = z[half:]
    if _blas.leading_dim(second) != d:
        second = cp.ascontiguousarray(second)
    launch(_FILE, "paired_dots", t, (-(-half * 32 // BLOCK),),
           (z, np.int64(_blas.leading_dim(z)), second, np.int32(half), np.int32(1),
            np.int32(d), dots))
    cp.cuda.runtime.memcpyAsync(dots.data.ptr + 4 * half, dots.data.ptr, 4 * half,
                                cp.cuda.runtime.memcpyDeviceToDevice,
                                cp.cuda.get_current_stream().ptr)
    _tile("lse2", t, (ct, splits), z, 0, z, None, scale=scale, exclude_diag=True,
          pos_shift=pos_shift, pos_mod=n, part=(part.data.ptr, part[1].data.ptr, n),
          colp=(colp.data.ptr, colp[1].data.ptr), lse_col=dots, tri=True)
    lse = cp.empty((n,), f32)
    loss = cp.empty((n,), f32)
    launch(_TILES, "tile_finish_tri", t, (-(-n // 32),),
           (part, part[1], np.int64(n), np.int32(splits), np.int32(n), colp, colp[1], dots,
            np.int32(half), np.float32(scale), lse, loss))
    return lse, loss


def _gpu_rows_tiles(q, k, neg_s, scale: float, *, exclude_diag: bool, pos_shift: int,
                    pos_mod: int, lse_in, weights, want_grad: bool, workspace_bytes, op: str,
                    self_pair: bool):
    """:func:`_gpu_rows` on the tile kernels (no per-query negatives).

    The gradient pass writes the 16-bit gradient block G (or, for NT-Xent, H = G + Gᵀ, which
    needs one product instead of two) straight from the tile registers, then cuBLAS
    multiplies it by the keys / queries.
    """
    import cupy as cp

    t, f32 = q.dtype, np.dtype(np.float32)
    n, d = q.shape
    nk = k.shape[0]
    ms = 0 if neg_s is None else neg_s.shape[0]
    ncols = nk + ms
    # NT-Xent: S = Z Zᵀ and the pairing i <-> i + n/2 is its own inverse, so S and H = G + Gᵀ
    # are symmetric and each pair of tiles needs computing once (tiles.cu tri_count)
    symmetric = (self_pair and neg_s is None and exclude_diag and pos_mod == n
                 and 2 * pos_shift == n)
    stats = None
    if lse_in is not None:
        stats = lse_in, None
    elif symmetric and SYMMETRIC_LSE and n * d >= SYMMETRIC_LSE_MIN_ND:
        stats = _tile_lse_symmetric(q, scale, pos_shift, workspace_bytes)
    if stats is None:
        stats = _tile_lse(q, k, neg_s, scale, exclude_diag=exclude_diag, pos_shift=pos_shift,
                          pos_mod=pos_mod)
    lse, loss = stats
    if not want_grad:
        return lse, loss, (None, None, None, None)
    ldg = -(-ncols // 8) * 8  # 16-byte rows for the kernel's paired stores and cuBLAS
    rb = _blas.plan_rows(op, n, ldg * t.itemsize, workspace_bytes, align=_TILE)
    g_buf = cp.empty((rb, ldg), t)
    dq = cp.empty((n, d), f32)
    dk = dq if self_pair else cp.empty((nk, d), f32)  # first row block: beta = 0
    dns = cp.empty((ms, d), f32) if ms else None
    ct = -(-ncols // _TILE)
    tri = symmetric and SYMMETRIC_H and rb >= n  # all of H in one block: tiles mirrored
    for r0 in range(0, n, rb):
        r1 = min(n, r0 + rb)
        qb = q[r0:r1]
        g_blk = g_buf[:r1 - r0, :ncols]
        rt = -(-(r1 - r0) // _TILE)
        splits = _splits(rt, ct // 2 + 1 if tri else ct)
        _tile("h" if self_pair else "g", t, (rt, splits), qb, r0, k, neg_s,
              scale=scale, exclude_diag=exclude_diag, pos_shift=pos_shift, pos_mod=pos_mod,
              lse_row=lse, lse_col=lse, weights=weights, g=g_blk, tri=tri)
        acc = 1.0 if r0 else 0.0
        _blas.gemm(g_blk[:, :nk], k, dq[r0:r1])
        if not self_pair:
            _blas.gemm(g_blk[:, :nk], qb, dk, trans_a=True, beta=acc)
        if ms:
            _blas.gemm(g_blk[:, nk:], neg_s, dq[r0:r1], beta=1.0)
            _blas.gemm(g_blk[:, nk:], qb, dns, trans_a=True, beta=acc)
    return lse, loss, (dq, dk, dns, None)


def _gpu_clip_tiles(an, bn, ls, *, lse_r, lse_c, weights, want_loss: bool, want_grad: bool,
                    workspace_bytes):
    """:func:`_gpu_clip` on the tile kernels: row and column statistics in one pass."""
    import cupy as cp

    t, f32 = an.dtype, np.dtype(np.float32)
    n, d = an.shape
    nt = -(-n // _TILE)
    pair_loss = None
    if want_loss:
        splits = _splits(nt, nt)
        # column partials: one (m, s) pair per (row tile, column) of the rows in flight
        rg = _blas.plan_rows("clip_loss", n, -(-8 * n // _TILE), workspace_bytes, align=_TILE)
        cpt = -(-rg // _TILE)
        # one fp32 scratch allocation (allocations are host time before the first kernel):
        # dots (n) | pos (n) | part (2, splits, n) | colp (2, cpt, n); kernels get pointers
        scratch = cp.empty(((2 + 2 * splits + 2 * cpt) * n,), f32)
        dots, pos = scratch[:n], scratch.data.ptr + 4 * n
        part, part_s = pos + 4 * n, pos + 4 * n * (1 + splits)
        colp, colp_s = part + 8 * splits * n, part + 4 * n * (2 * splits + cpt)
        # running column state (m and s rows), only when the rows come in several groups
        col_m = cp.empty((2, n), f32) if rg < n else None
        cgrid = (-(-n // BLOCK),)
        # a_j . b_j: the kernel shifts column j's exponentials by its positive logit
        b_rows = bn if _blas.leading_dim(bn) == d else cp.ascontiguousarray(bn)
        launch(_FILE, "paired_dots", t, (-(-n * 32 // BLOCK),),
               (an, np.int64(_blas.leading_dim(an)), b_rows, np.int32(n), np.int32(1),
                np.int32(d), dots))
        for r0 in range(0, n, rg):
            r1 = min(n, r0 + rg)
            rt = -(-(r1 - r0) // _TILE)
            _tile("lse2", t, (rt, splits), an[r0:r1], r0, bn, None, scale_log=ls, pos_mod=n,
                  part=(part + 4 * r0, part_s + 4 * r0, n),
                  pos_out=pos + 4 * r0, colp=(colp, colp_s), lse_col=dots)
            if col_m is not None:  # several row groups: fold into the running column state
                launch(_FILE, "col_combine", t, (-(-n // 32),), (
                    colp, colp_s, np.int32(rt), np.int32(n), col_m, col_m[1],
                    np.int32(2 if r0 == 0 else 0), 0, 0, 0, 0))
        lse_r = cp.empty((n,), f32)
        row_loss = cp.empty((n,), f32)
        launch(_TILES, "tile_finish", t, cgrid,
               (part, part_s, np.int64(n), np.int32(splits), np.int32(n), pos, lse_r, row_loss))
        lse_c = cp.empty((n,), f32)
        pair_loss = cp.empty((n,), f32)
        if col_m is None:  # one group: its partials straight to the column lse (fresh + finalize)
            fold = (colp, colp_s, np.int32(rt), 0, 0, np.int32(3))
        else:  # the running state (finalize)
            fold = (0, 0, np.int32(0), col_m, col_m[1], np.int32(1))
        launch(_FILE, "col_combine", t, (-(-n // 32),),
               fold[:3] + (np.int32(n),) + fold[3:] + (lse_r, row_loss, lse_c, pair_loss))
    grads = None
    if want_grad:
        ldg = -(-n // 8) * 8
        rb = _blas.plan_rows("clip_loss", n, ldg * t.itemsize, workspace_bytes, align=_TILE)
        g_buf = cp.empty((rb, ldg), t)
        da = cp.empty((n, d), f32)
        db = cp.empty((n, d), f32)  # the first row block's product writes it (beta = 0)
        dsp = cp.empty((n,), f32)
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            rt = -(-(r1 - r0) // _TILE)
            splits = _splits(rt, nt)
            dpart = cp.empty((splits, r1 - r0), f32)
            g_blk = g_buf[:r1 - r0, :n]
            _tile("clip", t, (rt, splits), an[r0:r1], r0, bn, None, scale_log=ls, pos_mod=n,
                  lse_row=lse_r, lse_col=lse_c, weights=weights, g=g_blk,
                  dsp=dpart.data.ptr, part=(0, 0, r1 - r0))
            launch(_TILES, "tile_sum", t, (-(-(r1 - r0) // BLOCK),),
                   (dpart, np.int64(r1 - r0), np.int32(splits), np.int32(r1 - r0), dsp[r0:r1]))
            _blas.gemm(g_blk, bn, da[r0:r1])
            _blas.gemm(g_blk, an[r0:r1], db, trans_a=True, beta=1.0 if r0 else 0.0)
        grads = (da, db, dsp)
    return lse_r, lse_c, pair_loss, grads


# ----------------------------------------------------------------------------------------
# The row-softmax engine: NumPy (same algorithm, vectorised per row block)
# ----------------------------------------------------------------------------------------
def _np_lse(x):
    """Row log-sum-exp; NaN for a row holding NaN or +inf (as the CUDA kernel)."""
    m = np.max(x, axis=1, keepdims=True)
    bad = ~np.isfinite(m) & (m > 0) | np.isnan(m)
    m = np.where(np.isfinite(m), m, 0)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        out = (np.log(np.sum(np.exp(x - m), axis=1, keepdims=True)) + m)[:, 0]
    return np.where(bad[:, 0], np.nan, out).astype(x.dtype, copy=False)


def _np_rows(q, k, neg_s, neg_p, scale: float, *, exclude_diag: bool, pos_shift: int,
             pos_mod: int, lse_in, weights, want_grad: bool, workspace_bytes, op: str,
             self_pair: bool = False):
    a = acc_dtype(q.dtype)
    qa, ka = q.astype(a), k.astype(a)
    nsa = None if neg_s is None else neg_s.astype(a)
    npa = None if neg_p is None else neg_p.astype(a)
    n, d = q.shape
    nk = k.shape[0]
    ncols = nk + (0 if nsa is None else nsa.shape[0])
    cap = workspace_bytes or NUMPY_WORKSPACE_BYTES
    rb = max(1, min(n, cap // max(1, ncols * a.itemsize)))
    lse = np.empty((n,), a) if lse_in is None else lse_in
    loss = np.empty((n,), a)
    dq = dk = dns = dnp = None
    if want_grad:
        dq = np.zeros((n, d), a)
        dk = dq if self_pair else np.zeros((nk, d), a)
        dns = None if nsa is None else np.zeros_like(nsa)
        dnp = None if npa is None else np.empty_like(npa)
    w_arr, w_stride, w_mul = weights
    for r0 in range(0, n, rb):
        r1 = min(n, r0 + rb)
        rows = np.arange(r0, r1)
        qb = qa[r0:r1]
        blocks = [qb @ ka.T]
        if nsa is not None:
            blocks.append(qb @ nsa.T)
        if npa is not None:
            blocks.append(np.einsum("rd,rmd->rm", qb, npa[r0:r1]))
        s = np.concatenate(blocks, axis=1) * a.type(scale)
        if exclude_diag:
            s[np.arange(r1 - r0), rows] = -np.inf
        pos = (rows + pos_shift) % pos_mod
        if lse_in is None:
            lse[r0:r1] = _np_lse(s)
        with np.errstate(invalid="ignore"):
            loss[r0:r1] = lse[r0:r1] - s[np.arange(r1 - r0), pos]
        if not want_grad:
            continue
        w = a.type(w_mul) * (w_arr[rows * w_stride] if w_arr is not None else a.type(1))
        with np.errstate(invalid="ignore", over="ignore"):
            p = np.exp(s - lse[r0:r1, None])
        p[np.arange(r1 - r0), pos] -= 1
        g = p * (np.asarray(w, a) * a.type(scale)).reshape(-1, 1)
        dq[r0:r1] += g[:, :nk] @ ka
        dk += g[:, :nk].T @ qb
        if nsa is not None:
            dq[r0:r1] += g[:, nk:ncols] @ nsa
            dns += g[:, nk:ncols].T @ qb
        if npa is not None:
            gp = g[:, ncols:]
            dq[r0:r1] += np.einsum("rm,rmd->rd", gp, npa[r0:r1])
            dnp[r0:r1] = gp[:, :, None] * qb[:, None, :]
    return lse, loss, (dq, dk, dns, dnp)


def _np_normalize(x):
    a = acc_dtype(x.dtype)
    xa = x.astype(a)
    norm = np.sqrt(np.sum(xa * xa, axis=-1))
    return (xa / np.maximum(norm, NORM_EPS)[..., None]).astype(x.dtype), norm


def _np_finish(x, norm, acc, g):
    a = acc.dtype
    gs = a.type(1) if g is None else np.asarray(g, a).reshape(())
    if norm is None:
        return (acc * gs).astype(x.dtype)
    xa = x.astype(a)
    den = np.maximum(norm, NORM_EPS)[..., None]
    xn = xa / den
    proj = np.where(norm > NORM_EPS, np.sum(xn * acc, axis=-1), 0)[..., None]
    return (gs * (acc - xn * proj) / den).astype(x.dtype)


def _np_grad_scale(grad_loss, a):
    if isinstance(grad_loss, float):
        return None if grad_loss == 1.0 else np.asarray(grad_loss, a)
    return np.asarray(grad_loss, a).reshape(())


# ----------------------------------------------------------------------------------------
# dispatch helpers
# ----------------------------------------------------------------------------------------
class _Path:
    """The per-backend primitives, chosen once per call from the array module."""

    def __init__(self, xp):
        self.gpu = xp is not np
        self.rows = _gpu_rows if self.gpu else _np_rows
        self.normalize = _gpu_normalize if self.gpu else _np_normalize
        self.finish = _gpu_finish if self.gpu else _np_finish
        self.grad_scale = _gpu_grad_scale if self.gpu else _np_grad_scale


def _prep(xp, path: _Path, x, normalize: bool):
    """(array the products use, its norms or None): normalised when asked.

    ``x`` has already been laid out by :func:`_contig_inputs`.
    """
    if x is None:
        return None, None
    if not normalize:
        return x, None
    if x.ndim == 3:  # (N, M, D) negatives: normalise their rows as a 2-D view
        xn, norm = path.normalize(x.reshape(-1, x.shape[-1]))
        return xn.reshape(x.shape), norm.reshape(x.shape[:2])
    return path.normalize(x)


def _finish_all(path, originals, norms, accs, g):
    out = []
    for x, nrm, acc in zip(originals, norms, accs):
        if x is None:
            out.append(None)
            continue
        if x.ndim == 3:
            flat = path.finish(x.reshape(-1, x.shape[-1]),
                               None if nrm is None else nrm.reshape(-1),
                               acc.reshape(-1, x.shape[-1]), g)
            out.append(flat.reshape(x.shape))
        else:
            out.append(path.finish(x, nrm, acc, g))
    return out


def _contig_inputs(xp, *xs):
    """Inputs as the finishing kernels need them (row-major; 3-D contiguous)."""
    return [None if x is None else (_rowmajor(xp, x) if x.ndim == 2 else xp.ascontiguousarray(x))
            for x in xs]


# ----------------------------------------------------------------------------------------
# NT-Xent
# ----------------------------------------------------------------------------------------
def _check_nt_xent(z, temperature, reduction, workspace_bytes):
    op = "nt_xent"
    xp = _checks.array_module(op, z=z)
    _checks.check_matrix(op, "z", z, min_rows=2)
    if z.shape[0] % 2:
        raise ValueError(f"nt_xent: z must have an even number of rows (2B views), "
                         f"got shape {tuple(z.shape)}")
    t = _checks.check_temperature(op, temperature)
    _checks.check_reduction(op, reduction)
    _checks.check_workspace(op, workspace_bytes)
    return xp, t


def nt_xent_forward(z, temperature: float = 0.5, *, reduction: str = "mean",
                    normalize: bool = False, workspace_bytes: Optional[int] = None,
                    requires_grad: bool = True) -> Tuple[Any, Context]:
    """SimCLR's NT-Xent loss and a context for :func:`nt_xent_backward`.

    Parameters
    ----------
    z : (2B, D) array (numpy or cupy), float16 / bfloat16 / float32 / float64
        The two views stacked: row ``i`` and row ``(i + B) mod 2B`` are a positive pair.
    temperature : float > 0
    reduction : "mean" | "sum" | "none"
    normalize : bool
        L2-normalise the rows first (as ``F.normalize``, eps 1e-12); gradients go through it.
    workspace_bytes : int, optional
        Cap on the score-block workspace; default ``min(1 GiB, half the free memory)``.
    requires_grad : bool
        Also prepare the gradient (see the module notes).

    Returns
    -------
    loss : 0-d array (mean/sum) or (2B,) array (none); float32, float64 for float64 input.
    ctx : Context

    Notes
    -----
    With S = ẑ ẑᵀ / τ and p(i) = (i + B) mod 2B::

        loss_i = log Σ_{j≠i} exp(S_ij) − S_{i,p(i)}
        ∂loss/∂ẑ = (G + Gᵀ) ẑ / τ,   G_ij = w_i (softmax_{j≠i}(S_i)_j − [j = p(i)])

    Equal to ``F.cross_entropy(masked_fill(z @ z.T, eye, -inf) / τ, labels)``.
    """
    xp, t = _check_nt_xent(z, temperature, reduction, workspace_bytes)
    path = _Path(xp)
    n = z.shape[0]
    z = _contig_inputs(xp, z)[0]
    zn, norm = _prep(xp, path, z, normalize)
    fused = requires_grad and reduction != "none"
    lse, loss, (dz, *_rest) = path.rows(
        zn, zn, None, None, 1.0 / t, exclude_diag=True, pos_shift=n // 2, pos_mod=n,
        lse_in=None, weights=_weights(xp, None, reduction, n, acc_dtype(z.dtype)),
        want_grad=fused, workspace_bytes=workspace_bytes, op="nt_xent", self_pair=True)
    ctx = Context("nt_xent", reduction, n, xp, stats=(lse,) if requires_grad else ())
    if fused:
        ctx.saved = dict(z=z, norm=norm, dz=dz)
    elif requires_grad:
        ctx.saved = dict(z=z, zn=zn, norm=norm, lse=lse, t=t, ws=workspace_bytes)
    return _reduce(xp, loss, reduction), ctx


def nt_xent_backward(ctx: Context, grad_loss: Any = 1.0):
    """Gradient of :func:`nt_xent_forward`'s loss w.r.t. ``z``, times ``grad_loss``.

    ``grad_loss``: a real or 0-d array (mean/sum), or a (2B,) array (none).  Returns dz (2B, D)
    in z's dtype.
    """
    _require(ctx, "nt_xent")
    xp, s = ctx.xp, ctx.saved
    path = _Path(xp)
    g = _checks.check_grad_loss("nt_xent_backward", grad_loss, ctx.reduction, ctx.n, xp)
    a = acc_dtype(s["z"].dtype)
    if "dz" in s:
        return path.finish(s["z"], s["norm"], s["dz"], path.grad_scale(g, a))
    n = ctx.n
    _, _, (dz, *_rest) = path.rows(
        s["zn"], s["zn"], None, None, 1.0 / s["t"], exclude_diag=True, pos_shift=n // 2,
        pos_mod=n, lse_in=s["lse"], weights=_weights(xp, g, ctx.reduction, n, a), want_grad=True,
        workspace_bytes=s["ws"], op="nt_xent", self_pair=True)
    return path.finish(s["z"], s["norm"], dz, None)


def nt_xent_backward_from_stats(z, lse, grad_loss: Any = 1.0, *, temperature: float = 0.5,
                                reduction: str = "mean", normalize: bool = False,
                                workspace_bytes: Optional[int] = None):
    """``dz`` from the input and the forward's row log-sum-exps (``ctx.stats[0]``) alone.

    For callers that keep only O(N) state between forward and backward (the PyTorch ops):
    the score blocks and the normalisation are recomputed.  Same result as
    :func:`nt_xent_backward` on the forward's context.
    """
    xp, t = _check_nt_xent(z, temperature, reduction, workspace_bytes)
    _check_stats("nt_xent", xp, z.shape[0], z.dtype, lse=lse)
    z = _contig_inputs(xp, z)[0]
    zn, norm = _prep(xp, _Path(xp), z, normalize)
    ctx = Context("nt_xent", reduction, z.shape[0], xp, stats=(lse,),
                  saved=dict(z=z, zn=zn, norm=norm, lse=lse, t=t, ws=workspace_bytes))
    return nt_xent_backward(ctx, grad_loss)


def nt_xent(z, temperature: float = 0.5, *, reduction: str = "mean", normalize: bool = False,
            workspace_bytes: Optional[int] = None):
    """SimCLR's NT-Xent loss of ``z`` (2B, D); see :func:`nt_xent_forward`."""
    return nt_xent_forward(z, temperature, reduction=reduction, normalize=normalize,
                           workspace_bytes=workspace_bytes, requires_grad=False)[0]


def _check_stats(op: str, xp, n: int, dtype, **stats) -> None:
    """Row statistics handed to ``*_backward_from_stats``: (n,) arrays of the accumulator dtype."""
    want = acc_dtype(dtype)
    for name, v in stats.items():
        if not isinstance(v, xp.ndarray) or v.shape != (n,) or v.dtype != want:
            got = f"{type(v).__name__} {getattr(v, 'shape', '')} {getattr(v, 'dtype', '')}"
            raise ValueError(f"{op}_backward_from_stats: {name} must be a ({n},) {want} "
                             f"{xp.__name__} array (ctx.stats of {op}_forward), got {got}")


def _require(ctx, op):
    if not isinstance(ctx, Context) or ctx.op != op:
        raise TypeError(f"{op}_backward: ctx must be the Context returned by {op}_forward")
    if not ctx.saved:
        raise ValueError(f"{op}_backward: the forward ran with requires_grad=False; "
                         f"run {op}_forward(..., requires_grad=True)")


# ----------------------------------------------------------------------------------------
# InfoNCE (query / key, in-batch and explicit negatives)
# ----------------------------------------------------------------------------------------
def _check_info_nce(query, key, negatives, temperature, reduction, workspace_bytes):
    op = "info_nce"
    xp = _checks.array_module(op, query=query, key=key, negatives=negatives,
                              optional=("negatives",))
    _checks.check_matrix(op, "query", query, min_rows=2)
    _checks.check_matrix(op, "key", key, min_rows=2)
    if key.shape[0] != query.shape[0]:
        raise ValueError(f"info_nce: query and key must have the same number of rows "
                         f"(paired by row), got {tuple(query.shape)} and {tuple(key.shape)}")
    _checks.check_same(op, ("query", "key"), (query.shape[1], key.shape[1]), "feature sizes D")
    if negatives is not None:
        if negatives.ndim not in (2, 3):
            raise ValueError(f"info_nce: negatives must be (M, D) shared or (N, M, D) per query, "
                             f"got shape {tuple(negatives.shape)}")
        _checks.check_float(op, "negatives", negatives)
        if negatives.shape[-1] != query.shape[1]:
            raise ValueError(f"info_nce: negatives must have D={query.shape[1]} features like "
                             f"query, got shape {tuple(negatives.shape)}")
        if negatives.ndim == 3 and negatives.shape[0] != query.shape[0]:
            raise ValueError(f"info_nce: per-query negatives must be (N={query.shape[0]}, M, D), "
                             f"got shape {tuple(negatives.shape)}")
    _checks.check_same_dtype(op, query=query, key=key, negatives=negatives)
    t = _checks.check_temperature(op, temperature)
    _checks.check_reduction(op, reduction)
    _checks.check_workspace(op, workspace_bytes)
    return xp, t


def _prep_info_nce(xp, path, query, key, negatives, normalize: bool):
    """(laid-out inputs, their norms, (q̂, k̂, shared negatives, per-query negatives))."""
    query, key, negatives = _contig_inputs(xp, query, key, negatives)
    qn, nq = _prep(xp, path, query, normalize)
    kn, nk = _prep(xp, path, key, normalize)
    negn, nneg = _prep(xp, path, negatives, normalize)
    neg_s = negn if negatives is not None and negatives.ndim == 2 else None
    neg_p = negn if negatives is not None and negatives.ndim == 3 else None
    return (query, key, negatives), (nq, nk, nneg), (qn, kn, neg_s, neg_p)


def info_nce_forward(query, key, temperature: float = 0.1, *, negatives=None,
                     reduction: str = "mean", normalize: bool = False,
                     workspace_bytes: Optional[int] = None,
                     requires_grad: bool = True) -> Tuple[Any, Context]:
    """Query/key InfoNCE with in-batch negatives (and optional explicit ones).

    Parameters
    ----------
    query, key : (N, D) arrays, paired by row; key i is query i's positive and the other
        N − 1 keys are its in-batch negatives.
    negatives : None, (M, D) or (N, M, D)
        Extra negatives added to the candidates: shared by every query (M, D), or
        per query (N, M, D).
    temperature, reduction, normalize, workspace_bytes, requires_grad : as for nt_xent.
        ``normalize`` applies to query, key and negatives alike.

    Returns
    -------
    loss, ctx — see :func:`nt_xent_forward`.

    Notes
    -----
    ``loss_i = log Σ_{c ∈ C_i} exp(q̂_i·ĉ/τ) − q̂_i·k̂_i/τ`` with candidates C_i = all keys,
    plus the shared negatives, plus query i's own negatives.  (info-nce-pytorch drops the
    in-batch keys when explicit negatives are given; here they are always candidates.)
    """
    xp, t = _check_info_nce(query, key, negatives, temperature, reduction, workspace_bytes)
    path = _Path(xp)
    n = query.shape[0]
    (query, key, negatives), (nq, nk, nneg), (qn, kn, neg_s, neg_p) = _prep_info_nce(
        xp, path, query, key, negatives, normalize)
    fused = requires_grad and reduction != "none"
    lse, loss, grads = path.rows(
        qn, kn, neg_s, neg_p, 1.0 / t, exclude_diag=False, pos_shift=0, pos_mod=n,
        lse_in=None, weights=_weights(xp, None, reduction, n, acc_dtype(query.dtype)),
        want_grad=fused, workspace_bytes=workspace_bytes, op="info_nce")
    ctx = Context("info_nce", reduction, n, xp, stats=(lse,) if requires_grad else ())
    base = dict(x=(query, key, negatives), norms=(nq, nk, nneg))
    if fused:
        dq, dk, dns, dnp = grads
        ctx.saved = dict(base, acc=(dq, dk, dns if dns is not None else dnp))
    elif requires_grad:
        ctx.saved = dict(base, xn=(qn, kn, neg_s, neg_p), lse=lse, t=t, ws=workspace_bytes)
    return _reduce(xp, loss, reduction), ctx


def info_nce_backward(ctx: Context, grad_loss: Any = 1.0):
    """Gradients ``(dquery, dkey, dnegatives)`` of :func:`info_nce_forward`'s loss.

    ``dnegatives`` is None when no negatives were given.  Dtypes follow the inputs.
    """
    _require(ctx, "info_nce")
    xp, s = ctx.xp, ctx.saved
    path = _Path(xp)
    g = _checks.check_grad_loss("info_nce_backward", grad_loss, ctx.reduction, ctx.n, xp)
    a = acc_dtype(s["x"][0].dtype)
    if "acc" in s:
        return tuple(_finish_all(path, s["x"], s["norms"], s["acc"], path.grad_scale(g, a)))
    qn, kn, neg_s, neg_p = s["xn"]
    _, _, (dq, dk, dns, dnp) = path.rows(
        qn, kn, neg_s, neg_p, 1.0 / s["t"], exclude_diag=False, pos_shift=0, pos_mod=ctx.n,
        lse_in=s["lse"], weights=_weights(xp, g, ctx.reduction, ctx.n, a), want_grad=True,
        workspace_bytes=s["ws"], op="info_nce")
    accs = (dq, dk, dns if dns is not None else dnp)
    return tuple(_finish_all(path, s["x"], s["norms"], accs, None))


def info_nce_backward_from_stats(query, key, negatives, lse, grad_loss: Any = 1.0, *,
                                 temperature: float = 0.1, reduction: str = "mean",
                                 normalize: bool = False, workspace_bytes: Optional[int] = None):
    """``(dquery, dkey, dnegatives)`` from the inputs and ``ctx.stats[0]`` (row lse) alone.

    See :func:`nt_xent_backward_from_stats`; ``dnegatives`` is None without negatives.
    """
    xp, t = _check_info_nce(query, key, negatives, temperature, reduction, workspace_bytes)
    n = query.shape[0]
    _check_stats("info_nce", xp, n, query.dtype, lse=lse)
    path = _Path(xp)
    (query, key, negatives), (nq, nk, nneg), (qn, kn, neg_s, neg_p) = _prep_info_nce(
        xp, path, query, key, negatives, normalize)
    ctx = Context("info_nce", reduction, n, xp, stats=(lse,), saved=dict(
        x=(query, key, negatives), norms=(nq, nk, nneg), xn=(qn, kn, neg_s, neg_p), lse=lse,
        t=t, ws=workspace_bytes))
    return info_nce_backward(ctx, grad_loss)


def info_nce(query, key, temperature: float = 0.1, *, negatives=None, reduction: str = "mean",
             normalize: bool = False, workspace_bytes: Optional[int] = None):
    """Query/key InfoNCE loss; see :func:`info_nce_forward`."""
    return info_nce_forward(query, key, temperature, negatives=negatives, reduction=reduction,
                            normalize=normalize, workspace_bytes=workspace_bytes,
                            requires_grad=False)[0]


# ----------------------------------------------------------------------------------------
# CLIP's symmetric loss with a learnable temperature
# ----------------------------------------------------------------------------------------
def _gpu_clip(an, bn, ls, *, lse_r, lse_c, weights, want_loss: bool, want_grad: bool,
              workspace_bytes):
    """Row/column statistics (when ``want_loss``) and the gradient accumulators.

    ``ls`` is logit_scale as a (1,) device array of the accumulator dtype.
    Returns ``lse_r, lse_c, pair_loss, (da, db, dscale_parts)``.
    """
    if _tiles_ok(an, bn):
        return _gpu_clip_tiles(an, bn, ls, lse_r=lse_r, lse_c=lse_c, weights=weights,
                               want_loss=want_loss, want_grad=want_grad,
                               workspace_bytes=workspace_bytes)
    t = an.dtype
    a = acc_dtype(t)
    n, d = an.shape
    split_g = want_grad and t != a
    row_bytes = n * a.itemsize + (n * t.itemsize if split_g else 0)
    rb = _blas.plan_rows("clip_loss", n, row_bytes, workspace_bytes)
    reuse = rb >= n  # the whole score matrix fits: the gradient pass reuses it
    chunk = 64
    nch = (rb + chunk - 1) // chunk
    # scratch and outputs from two allocations (see _gpu_rows).  part_m / part_s: column
    # partials of a row block; col_m: the running column state between row blocks (the first
    # block starts it: no fill); da, db: written by the first row block's products (beta = 0)
    s_buf, g_buf, row_loss, part_m, part_s, col_m = _buffers((
        ((rb, n), a), ((rb, n), t) if split_g else None,
        ((n,), a) if want_loss else None,
        ((nch, n), a) if want_loss else None, ((nch, n), a) if want_loss else None,
        ((2, n), a) if want_loss and rb < n else None))
    vec = ((n,), a)
    lse_r2, lse_c2, pair_loss, da, db, dsp = _buffers((
        *((vec,) * 3 if want_loss else (None,) * 3),
        ((n, d), a) if want_grad else None, ((n, d), a) if want_grad else None,
        vec if want_grad else None))
    if not split_g:
        g_buf = s_buf
    if want_loss:
        lse_r, lse_c = lse_r2, lse_c2
        cgrid = ((n + BLOCK - 1) // BLOCK,)
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            rows = r1 - r0
            s_blk = s_buf[:rows]
            _blas.gemm(an[r0:r1], bn, s_blk, trans_b=True)
            launch(_FILE, "row_softmax", t, (rows,), (
                s_blk, np.int64(n), np.int32(n), 0, np.int64(0), np.int32(0),
                np.int32(r0), np.int32(0), np.int32(0), np.int32(n), ls, a.type(1.0),
                0, lse_r, row_loss, 0, np.int64(0), 0, np.int64(0), 0, np.int64(0), a.type(0)))
            nc = (rows + chunk - 1) // chunk
            launch(_FILE, "col_partial", t, (cgrid[0], nc), (
                s_blk, np.int64(n), np.int32(rows), np.int32(n), np.int32(chunk), ls,
                a.type(1.0), part_m, part_s))
            mode = (2 if r0 == 0 else 0) | (1 if r1 == n else 0)  # fresh | finalize
            launch(_FILE, "col_combine", t, (-(-n // 32),), (
                part_m, part_s, np.int32(nc), np.int32(n), _ptr(col_m),
                0 if col_m is None else col_m[1], np.int32(mode),
                lse_r, row_loss, lse_c, pair_loss))
    grads = None
    if want_grad:
        w_arr, w_stride, w_mul = weights
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            rows = r1 - r0
            s_blk = s_buf[:rows]
            if not (reuse and want_loss):
                _blas.gemm(an[r0:r1], bn, s_blk, trans_b=True)
            g_blk = g_buf[:rows]
            launch(_FILE, "clip_grad", t, (rows,), (
                s_blk, np.int64(n), np.int32(n), np.int32(r0), ls, lse_r, lse_c,
                _ptr(w_arr), np.int64(w_stride), a.type(w_mul), g_blk, np.int64(n), dsp))
            _blas.gemm(g_blk, bn, da[r0:r1])
            _blas.gemm(g_blk, an[r0:r1], db, trans_a=True, beta=1.0 if r0 else 0.0)
        grads = (da, db, dsp)
    return lse_r, lse_c, pair_loss, grads


def _np_clip(an, bn, ls, *, lse_r, lse_c, weights, want_loss: bool, want_grad: bool,
             workspace_bytes):
    a = acc_dtype(an.dtype)
    aa, ba = an.astype(a), bn.astype(a)
    n = aa.shape[0]
    scale = np.exp(np.asarray(ls, a).reshape(()))
    logits = scale * (aa @ ba.T)  # the NumPy path keeps N x N (CPU memory, small N)
    pair_loss = None
    idx = np.arange(n)
    if want_loss:
        lse_r = _np_lse(logits)
        lse_c = _np_lse(logits.T)
        diag = logits[idx, idx]
        pair_loss = 0.5 * ((lse_r - diag) + (lse_c - diag))
    grads = None
    if want_grad:
        w_arr, w_stride, w_mul = weights
        w = a.type(w_mul) * (w_arr[idx * w_stride] if w_arr is not None else np.ones(n, a))
        with np.errstate(over="ignore", invalid="ignore"):
            g = 0.5 * (w[:, None] * np.exp(logits - lse_r[:, None])
                       + w[None, :] * np.exp(logits - lse_c[None, :]))
        g[idx, idx] -= 0.5 * (w + w)
        dsp = np.sum(g * logits, axis=1)
        gs = g * scale
        grads = (gs @ ba, gs.T @ aa, dsp)
    return lse_r, lse_c, pair_loss, grads


def _logit_scale_array(xp, ls, acc):
    """logit_scale as a (1,) array of the accumulator dtype on the inputs' side."""
    if xp is np:
        return np.asarray(ls, acc).reshape(1)
    return _gpu_scalar(ls, acc) if isinstance(ls, float) else \
        ls.astype(acc, copy=False).reshape(1)


def _check_clip(a, b, logit_scale, reduction, workspace_bytes):
    op = "clip_loss"
    xp = _checks.array_module(op, a=a, b=b)
    _checks.check_matrix(op, "a", a, min_rows=2)
    _checks.check_matrix(op, "b", b, min_rows=2)
    if a.shape != b.shape:
        raise ValueError(f"clip_loss: a and b must have the same shape (N pairs, D), "
                         f"got {tuple(a.shape)} and {tuple(b.shape)}")
    _checks.check_same_dtype(op, a=a, b=b)
    ls, ls_shape = _checks.check_logit_scale(op, logit_scale, xp)
    if xp is not np and not isinstance(ls, float) and ls.device.id != a.device.id:
        raise ValueError(f"clip_loss: logit_scale is on cuda:{ls.device.id} but a is on "
                         f"cuda:{a.device.id}")
    _checks.check_reduction(op, reduction)
    _checks.check_workspace(op, workspace_bytes)
    return xp, ls, ls_shape


def clip_loss_forward(a, b, logit_scale, *, reduction: str = "mean", normalize: bool = False,
                      workspace_bytes: Optional[int] = None,
                      requires_grad: bool = True) -> Tuple[Any, Context]:
    """CLIP's symmetric contrastive loss and a context for :func:`clip_loss_backward`.

    Parameters
    ----------
    a, b : (N, D) arrays — image and text embeddings, pair i is (a_i, b_i).
    logit_scale : real, or 0-d / (1,) array (learnable log inverse temperature).
        s = exp(logit_scale); a device array is never read back to the host.
    reduction : "mean" | "sum" | "none" (per pair: (row CE_i + column CE_i) / 2).
    normalize, workspace_bytes, requires_grad : as for nt_xent.

    Notes
    -----
    ``L = s · â b̂ᵀ``;  ``loss = (CE(L, arange) + CE(Lᵀ, arange)) / 2``.  Gradients:
    ``dâ = s G b̂``, ``db̂ = s Gᵀ â``, ``dlogit_scale = Σ_ij G_ij L_ij`` with
    ``G_ij = ½[w_i (softmax_row(L)_ij − δ_ij) + w_j (softmax_col(L)_ij − δ_ij)]``.
    The column direction reads the score blocks column-wise: no transposed copy.
    """
    xp, ls, ls_shape = _check_clip(a, b, logit_scale, reduction, workspace_bytes)
    path = _Path(xp)
    n = a.shape[0]
    acc = acc_dtype(a.dtype)
    a, b = _contig_inputs(xp, a, b)
    an, na = _prep(xp, path, a, normalize)
    bn, nb = _prep(xp, path, b, normalize)
    ls_dev = _logit_scale_array(xp, ls, acc)
    engine = _gpu_clip if path.gpu else _np_clip
    fused = requires_grad and reduction != "none"
    lse_r, lse_c, pair_loss, grads = engine(
        an, bn, ls_dev, lse_r=None, lse_c=None,
        weights=_weights(xp, None, reduction, n, acc), want_loss=True, want_grad=fused,
        workspace_bytes=workspace_bytes)
    ctx = Context("clip_loss", reduction, n, xp,
                  stats=(lse_r, lse_c) if requires_grad else ())
    ls_dtype = acc if isinstance(ls, float) else ls.dtype
    base = dict(x=(a, b), norms=(na, nb), ls_shape=ls_shape, ls_dtype=ls_dtype)
    if fused:
        da, db, dsp = grads
        ctx.saved = dict(base, acc=(da, db), dscale=_reduce(xp, dsp, "sum"))
    elif requires_grad:
        ctx.saved = dict(base, xn=(an, bn), ls=ls_dev, lse=(lse_r, lse_c), ws=workspace_bytes)
    return _reduce(xp, pair_loss, reduction), ctx


def clip_loss_backward(ctx: Context, grad_loss: Any = 1.0):
    """Gradients ``(da, db, dlogit_scale)`` of :func:`clip_loss_forward`'s loss.

    ``dlogit_scale`` has logit_scale's shape and dtype (0-d float32/64 when a Python float was
    given); da, db follow the inputs' dtype.
    """
    _require(ctx, "clip_loss")
    xp, s = ctx.xp, ctx.saved
    path = _Path(xp)
    g = _checks.check_grad_loss("clip_loss_backward", grad_loss, ctx.reduction, ctx.n, xp)
    acc = acc_dtype(s["x"][0].dtype)
    if "acc" in s:
        gs = path.grad_scale(g, acc)
        da, db = _finish_all(path, s["x"], s["norms"], s["acc"], gs)
        # (a copy when returned as saved: the caller may change the array it gets)
        dscale = s["dscale"].copy() if gs is None else s["dscale"] * gs.reshape(())
    else:
        engine = _gpu_clip if path.gpu else _np_clip
        an, bn = s["xn"]
        _, _, _, (da_acc, db_acc, dsp) = engine(
            an, bn, s["ls"], lse_r=s["lse"][0], lse_c=s["lse"][1],
            weights=_weights(xp, g, ctx.reduction, ctx.n, acc), want_loss=False, want_grad=True,
            workspace_bytes=s["ws"])
        da, db = _finish_all(path, s["x"], s["norms"], (da_acc, db_acc), None)
        dscale = _reduce(xp, dsp, "sum")
    dscale = xp.asarray(dscale).astype(s["ls_dtype"], copy=False).reshape(s["ls_shape"])
    return da, db, dscale


def clip_loss_backward_from_stats(a, b, logit_scale, lse_r, lse_c, grad_loss: Any = 1.0, *,
                                  reduction: str = "mean", normalize: bool = False,
                                  workspace_bytes: Optional[int] = None):
    """``(da, db, dlogit_scale)`` from the inputs and ``ctx.stats`` (row and column lse) alone.

    See :func:`nt_xent_backward_from_stats` and :func:`clip_loss_backward`.
    """
    xp, ls, ls_shape = _check_clip(a, b, logit_scale, reduction, workspace_bytes)
    n = a.shape[0]
    _check_stats("clip_loss", xp, n, a.dtype, lse_r=lse_r, lse_c=lse_c)
    path = _Path(xp)
    acc = acc_dtype(a.dtype)
    a, b = _contig_inputs(xp, a, b)
    an, na = _prep(xp, path, a, normalize)
    bn, nb = _prep(xp, path, b, normalize)
    ctx = Context("clip_loss", reduction, n, xp, stats=(lse_r, lse_c), saved=dict(
        x=(a, b), norms=(na, nb), ls_shape=ls_shape,
        ls_dtype=acc if isinstance(ls, float) else ls.dtype, xn=(an, bn),
        ls=_logit_scale_array(xp, ls, acc), lse=(lse_r, lse_c), ws=workspace_bytes))
    return clip_loss_backward(ctx, grad_loss)


def clip_loss(a, b, logit_scale, *, reduction: str = "mean", normalize: bool = False,
              workspace_bytes: Optional[int] = None):
    """CLIP's symmetric loss; see :func:`clip_loss_forward`."""
    return clip_loss_forward(a, b, logit_scale, reduction=reduction, normalize=normalize,
                             workspace_bytes=workspace_bytes, requires_grad=False)[0]
