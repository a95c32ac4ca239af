"""The GPU engine every op shares: CuPy arrays in, CuPy arrays out, one job per module.

=============  ==========================================================================
kernels.py     the loader: finds ``kernels_src``, the dtype table, NVRTC builds (sm_90a
               where a file has Hopper-only code), memoized ``cpn_<stage>_<dtype>`` handles
blas.py        cuBLAS products (``gemmEx``, fp32 accumulation; float32 products in fp32, TF32
               or 3xTF32 per ``float32_precision``), the small-product kernel, and the
               workspace planning (rows per score block)
arrays.py      buffers from one allocation, row normalisation, gradient finishing, the
               fixed-order sum
blocks.py      the cuBLAS row-block path: score blocks through cuBLAS + the row / column
               kernels of ``contrastive.cu``
tiles.py       the tensor-core tile path (``tiles.cu``): planning, the launch struct, the
               symmetric NT-Xent schedules
tiles_tf32.py  float32 NT-Xent on Hopper's tensor cores: the TF32x3 tiles
               (``tiles_ws_tf32.cu``) under the float32 precisions "auto" and "3xtf32"
products_tf32  the row-block path's float32 products (CLIP, SigLIP, InfoNCE, a global
               NT-Xent's rank blocks) on those tiles: ``gemm_for`` picks them or cuBLAS
tma.py         TMA tensor maps (Hopper) through the CUDA driver
splade.py      SPLADE's forward (fused max on the tiles or the TMA kernel; cuBLAS tiles +
               max kernel) and its sparse backward
=============  ==========================================================================

:func:`rows`, :func:`clip`, :func:`cross` and :func:`siglip` pick the path: the tiles where
they take the operands (16-bit, aligned, see ``tiles.tiles_ok``; float32 NT-Xent on Hopper:
``tiles_tf32.applies``), the row-block path otherwise.  Ops
describe their problem to them (scale, diagonal exclusion, where each row's positive is,
whether the keys are the queries); nothing here knows which op is calling.

Layering: ``cupynce.ops`` → ``cupynce._engine`` → ``kernels_src``; nothing here imports an op.
"""
from __future__ import annotations

from . import blocks, tiles, tiles_tf32


def rows(q, k, neg_s, neg_p, scale: float, *, exclude_diag: bool, pos_shift: int,
         pos_mod: int, lse_in, weights, want_grad: bool, workspace_bytes, op: str,
         self_pair: bool = False, scale_log=None):
    """A row softmax over [keys k | shared negatives neg_s | per-query negatives neg_p].

    q (N, D) queries; k (Nk, D); neg_s (Ms, D) or None; neg_p (N, Mp, D) or None.  Row i's
    positive is column ``(i + pos_shift) % pos_mod`` of k; ``exclude_diag`` drops column i;
    ``self_pair`` means k is q (NT-Xent).  ``lse_in``: the forward's row log-sum-exps (the
    recompute backward); ``weights``: ``(w_array_or_None, stride, multiplier)`` per row.
    Returns ``lse, loss, (dq, dk, dns, dnp)``: float32 (float64) statistics and gradient
    accumulators (None where not asked for).  ``scale_log``: a (1,) device array t of the
    accumulator dtype; the logits are then ``scale · exp(t) · q·c`` (a learnable log scale,
    never read on the host).  See :func:`blocks.rows`.
    """
    kw = dict(exclude_diag=exclude_diag, pos_shift=pos_shift, pos_mod=pos_mod, lse_in=lse_in,
              weights=weights, want_grad=want_grad, workspace_bytes=workspace_bytes, op=op,
              self_pair=self_pair, scale_log=scale_log)
    if neg_p is None and tiles.tiles_ok(q, k, neg_s):
        return tiles.rows(q, k, neg_s, scale, **kw)
    if neg_p is None and tiles_tf32.applies(q, k, neg_s, exclude_diag=exclude_diag,
                                            pos_shift=pos_shift, pos_mod=pos_mod,
                                            self_pair=self_pair, scale_log=scale_log):
        try:
            return tiles_tf32.rows(q, scale, pos_shift=pos_shift, lse_in=lse_in,
                                   weights=weights, want_grad=want_grad,
                                   workspace_bytes=workspace_bytes, op=op)
        except tiles_tf32.TF32TilesUnavailable:
            pass  # (a tensor map or the shared memory refused at launch: the row blocks,
            # fp32-accurate under "auto", cuBLAS 3xTF32 under "3xtf32", as elsewhere)
    return blocks.rows(q, k, neg_s, neg_p, scale, **kw)


def clip(an, bn, ls, *, lse_r, lse_c, weights, want_loss: bool, want_grad: bool,
         workspace_bytes, row0: int = 0, col_shift=None, col_state: bool = False):
    """CLIP's row and column statistics (``want_loss``) and gradient accumulators.

    ``ls`` is logit_scale as a (1,) device array of the accumulator dtype (or a function
    returning it: see :func:`blocks.clip`).  Returns
    ``lse_r, lse_c, pair_loss, (da, db, dscale_parts)``.  A rank's block of a distributed
    CLIP: an holds the rows ``row0 ..`` of the image side, bn every column, ``col_shift`` the
    raw positive dots of every column (the tile path's column shift), and ``col_state``
    returns the columns' (2, Nc) (m, s) state over these rows in place of lse_c and the row
    losses in place of pair_loss; the backward takes the merged column lse (:func:`col_lse`).
    See :func:`blocks.clip`.
    """
    kw = dict(lse_r=lse_r, lse_c=lse_c, weights=weights, want_loss=want_loss,
              want_grad=want_grad, workspace_bytes=workspace_bytes, row0=row0,
              col_shift=col_shift, col_state=col_state)
    if tiles.tiles_ok(an, bn):
        return tiles.clip(an, bn, ls() if callable(ls) else ls, **kw)
    return blocks.clip(an, bn, ls, **kw)


def cross(q, k, scale: float, *, lse_r, lse_c, weights, want_stats: bool, want_grad: bool,
          workspace_bytes, col_shift=None):
    """The block of two disjoint row sets of one symmetric softmax (a global NT-Xent's
    off-diagonal rank block): q's row statistics and k's column state over it, or both sides'
    gradient accumulators.  See :func:`blocks.cross`; ``col_shift`` (the raw positive dots
    of k's rows) is the tile path's column shift."""
    kw = dict(lse_r=lse_r, lse_c=lse_c, weights=weights, want_stats=want_stats,
              want_grad=want_grad, workspace_bytes=workspace_bytes, col_shift=col_shift)
    if tiles.tiles_ok(q, k):  # (the statistics pass needs col_shift there)
        return tiles.cross(q, k, scale, **kw)
    return blocks.cross(q, k, scale, **kw)


def siglip(an, bn, ls, lb, *, weights, want_loss: bool, want_grad: bool, workspace_bytes,
           row0: int = 0):
    """SigLIP's per-row losses and gradient accumulators: the tensor-core tiles where they
    apply (16-bit, aligned; ``tiles.siglip``), else the cuBLAS row blocks
    (:func:`blocks.siglip`, which documents the arguments and returns)."""
    kw = dict(weights=weights, want_loss=want_loss, want_grad=want_grad,
              workspace_bytes=workspace_bytes, row0=row0)
    if tiles.tiles_ok(an, bn):
        return tiles.siglip(an, bn, ls, lb, **kw)
    return blocks.siglip(an, bn, ls, lb, **kw)
col_lse = blocks.col_lse
pair_dots = blocks.pair_dots
