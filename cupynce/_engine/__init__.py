"""The GPU engine every op shares: CuPy arrays in, CuPy arrays out, one job per module.

Layers, each importing only those below it (``tests/packaging/test_layout.py`` checks)::

    __init__ (this)   rows / clip / cross / siglip: pick the loss path of a problem
    losses/           the softmax loss paths: row_blocks (cuBLAS score blocks + row kernels),
                      score_tiles (16-bit fused tiles), nt_xent_tf32 (float32 NT-Xent on the
                      TF32x3 tiles); stats (the statistics kernels they share)
    splade.py         SPLADE's fused max forward and sparse backward
    gemm/             the products: cublas, tf32x3, f16x3, and plan (the chooser)
    tiling.py         the tile kernels' launch plumbing (geometry, packed arguments, maps)
    side.py, tail.py  the side stream; the deferred last products
    workspace.py      scratch planning (row blocks under workspace_bytes)
    arrays.py, tma.py buffers, row normalisation, fixed-order sums; TMA tensor maps
    kernels.py        the loader: kernels_src, the dtype table, NVRTC / prebuilt cubins
    ../config.py      every switch, read through ``config.current()``

:func:`rows`, :func:`clip`, :func:`cross` and :func:`siglip` pick the path: the score tiles
where they take the operands (16-bit, aligned, see ``tiling.tiles_ok``; float32 NT-Xent on
Hopper: ``nt_xent_tf32.applies``), the row blocks otherwise.  Ops describe their problem to
them (scale, diagonal exclusion, where each row's positive is, whether the keys are the
queries); nothing here knows which op is calling.  ``compat`` keeps the 0.2 module
attributes (``products_tf32.USE_F16X3``, ...) working with a DeprecationWarning.
"""
from __future__ import annotations

from .. import config
from . import compat, tiling
from .gemm import tf32x3
from .losses import nt_xent_tf32, row_blocks, score_tiles, stats


def rows(q, k, neg_s, neg_p, scale: float, *, exclude_diag: bool, pos_shift: int,
         pos_mod: int, lse_in, weights, want_grad: bool, workspace_bytes, op: str,
         self_pair: bool = False, scale_log=None, labels=None, smoothing: float = 0.0,
         hardness=None, pair_labels=None, pair_row0: int = 0, col_grads: bool = True,
         positives: bool = True):
    """A row softmax over [keys k | shared negatives neg_s | per-query negatives neg_p].

    q (N, D) queries; k (Nk, D); neg_s (Ms, D) or None; neg_p (N, Mp, D) or None.  Row i's
    positive is column ``(i + pos_shift) % pos_mod`` of k; ``exclude_diag`` drops column i;
    ``self_pair`` means k is q (NT-Xent).  ``lse_in``: the forward's row log-sum-exps (the
    recompute backward); ``weights``: ``(w_array_or_None, stride, multiplier)`` per row.
    Returns ``lse, loss, (dq, dk, dns, dnp)``: float32 (float64) statistics and gradient
    accumulators (None where not asked for).  ``scale_log``: a (1,) device array t of the
    accumulator dtype; the logits are then ``scale · exp(t) · q·c`` (a learnable log scale,
    never read on the host).  ``labels`` (row labels, labels of the leading columns) and
    ``smoothing``: the
    label-aware row (a same-label key other than the positive is no candidate; the target
    smoothed over the candidates) -- on the row blocks alone for now (the tiles' epilogues
    and the TF32x3 kernels do not take them).  ``hardness``: a :class:`row_blocks.Hardness`
    (sentence-transformers' hardness weighting), and ``pair_labels`` (pytorch-metric-learning's
    NTXentLoss rows), also on the row blocks alone.  ``col_grads=False``: the caller needs
    no column-side gradient (dk, dns: MoCo's detached queue as the keys); the score tiles
    then skip those products and return None for them (the other paths may still return
    them).  ``positives=False``: the columns hold no row's positive (InfoNCE's ring, another
    rank's keys), the gradient pass alone (``lse_in`` given, no labels, smoothing, hardness
    or pairs): every row's positive numbered past the last column, no row loss (None).
    See :func:`row_blocks.rows`.
    """
    if not positives:
        if (lse_in is None or labels is not None or smoothing or hardness is not None
                or pair_labels is not None or self_pair):
            raise ValueError("rows: positives=False is the gradient pass of a block without "
                             "positives (lse_in given; no labels, smoothing, hardness, pairs)")
        # (i + ncols) mod FAR_MOD: no column of the keys or the shared negatives
        pos_shift = k.shape[0] + (0 if neg_s is None else neg_s.shape[0])
        pos_mod = stats.FAR_MOD
        if q.shape[0] + pos_shift >= pos_mod:
            raise ValueError(f"rows: {q.shape[0]} rows and {pos_shift} columns: no index past "
                             f"the columns below {pos_mod}")
    kw = dict(exclude_diag=exclude_diag, pos_shift=pos_shift, pos_mod=pos_mod, lse_in=lse_in,
              weights=weights, want_grad=want_grad, workspace_bytes=workspace_bytes, op=op,
              self_pair=self_pair, scale_log=scale_log)
    if labels is not None or smoothing or hardness is not None or pair_labels is not None:
        return row_blocks.rows(q, k, neg_s, neg_p, scale, labels=labels, smoothing=smoothing,
                               hardness=hardness, pair_labels=pair_labels,
                               pair_row0=pair_row0, **kw)
    if neg_p is None and tiling.tiles_ok(q, k, neg_s):
        if want_grad and lse_in is None and _nt_xent_keeps_scores(
                q, neg_s, exclude_diag, pos_shift, pos_mod, self_pair, scale_log,
                workspace_bytes, op):
            return row_blocks.nt_xent_kept(q, scale, pos_shift=pos_shift, weights=weights,
                                           op=op)
        return score_tiles.rows(q, k, neg_s, scale, col_grads=col_grads, **kw)
    if neg_p is None and nt_xent_tf32.applies(q, k, neg_s, exclude_diag=exclude_diag,
                                              pos_shift=pos_shift, pos_mod=pos_mod,
                                              self_pair=self_pair, scale_log=scale_log):
        try:
            return nt_xent_tf32.rows(q, scale, pos_shift=pos_shift, lse_in=lse_in,
                                     weights=weights, want_grad=want_grad,
                                     workspace_bytes=workspace_bytes, op=op)
        except tf32x3.TF32TilesUnavailable:
            pass  # (a tensor map or the shared memory refused at launch: the row blocks,
            # fp32-accurate under "auto", cuBLAS 3xTF32 under "3xtf32", as elsewhere)
    return row_blocks.rows(q, k, neg_s, neg_p, scale, positives=positives, **kw)


def _nt_xent_keeps_scores(q, neg_s, exclude_diag: bool, pos_shift: int, pos_mod: int,
                          self_pair: bool, scale_log, workspace_bytes, op: str) -> bool:
    """The chooser by cost for NT-Xent's fused 16-bit call (its symmetric S = Z Zᵀ, no
    learnable scale): the kept scores (``row_blocks.nt_xent_kept``: two cuBLAS products) in
    place of the tiles (two product-equivalents of the tile kernels, which run below cuBLAS's
    rate at large D) from ``config.nt_xent_keep_min_dim`` columns and ``nt_xent_keep_min_nd``
    = N · D, where 4 N² bytes fit ``workspace_bytes``.  H200, bf16, N = 16384, D = 4096:
    0.69× eager's time against the tiles' 0.93×; at N = 8192 or D = 2048 the tiles were as
    fast or faster (their fused passes write no N × N float32 matrix), hence both bounds."""
    n, d = q.shape
    if not (nt_xent_wide(n, d) and score_tiles.self_symmetric(
            n, neg_s, exclude_diag, pos_shift, pos_mod, self_pair, scale_log)):
        return False
    return row_blocks.nt_xent_keeps_scores(q, workspace_bytes, op)


def nt_xent_wide(n: int, d: int) -> bool:
    """NT-Xent's size bounds for the kept scores (``config.nt_xent_keep_min_dim``,
    ``nt_xent_keep_min_nd``); also the graph estimate's (``ops.nt_xent._kept_bytes``)."""
    cfg = config.current()
    return d >= cfg.nt_xent_keep_min_dim and n * d >= cfg.nt_xent_keep_min_nd


def clip(an, bn, ls, *, lse_r, lse_c, weights, want_loss: bool, want_grad: bool,
         workspace_bytes, row0: int = 0, col_shift=None, col_state: bool = False,
         labels=None, positives: bool = True):
    """CLIP's row and column statistics (``want_loss``) and gradient accumulators.

    ``ls`` is logit_scale as a (1,) device array of the accumulator dtype (or a function
    returning it: see :func:`row_blocks.clip`).  Returns
    ``lse_r, lse_c, pair_loss, (da, db, dscale_parts)``.  A rank's block of a distributed
    CLIP: an holds the rows ``row0 ..`` of the image side, bn every column, ``col_shift`` the
    raw positive dots of every column (the tile path's column shift), and ``col_state``
    returns the columns' (2, Nc) (m, s) state over these rows in place of lse_c and the row
    losses in place of pair_loss; the backward takes the merged column lse (:func:`col_lse`).
    See :func:`row_blocks.clip`.  ``labels`` (CLIP's same-label pairs left out): on the
    score tiles too (their ``lse2`` / ``clip`` epilogues mask in registers) where
    ``config.clip_labels_tiles`` and :func:`_clip_labels_tiles` allow, else the row blocks.
    ``positives=False``: a block without pairs (a ring's chunk of another rank's texts; with
    ``col_state`` and ``col_shift``, no labels or row weights): G = ½ w (p_row + p_col), the
    row losses None -- the tiles' CLIP epilogues with the rows numbered past the columns, or
    elsewhere :func:`cross`'s block, the same values.
    """
    kw = dict(lse_r=lse_r, lse_c=lse_c, weights=weights, want_loss=want_loss,
              want_grad=want_grad, workspace_bytes=workspace_bytes, row0=row0,
              col_shift=col_shift, col_state=col_state)
    if not positives:
        check_without_positives(labels, want_loss, want_grad, col_state, col_shift, weights,
                                gpu=True)
        ls = ls() if callable(ls) else ls
        if tiling.tiles_ok(an, bn):
            return score_tiles.clip(an, bn, ls, positives=False, **kw)
        w = None if not want_grad else (None, None, 0.5 * weights[2])
        lse_q, state, g = cross(an, bn, 1.0, lse_r=lse_r, lse_c=lse_c, weights=w,
                                want_stats=want_loss, want_grad=want_grad,
                                workspace_bytes=workspace_bytes, col_shift=col_shift,
                                scale_log=ls)
        return lse_q, state, None, None if g is None else (g[0], g[1], None)
    if labels is not None and not _clip_labels_tiles(an, bn, want_loss, row0, col_shift,
                                                     labels):
        return row_blocks.clip(an, bn, ls, labels=labels, **kw)
    if tiling.tiles_ok(an, bn) and not _clip_keeps_scores(an, bn, want_loss, want_grad,
                                                          workspace_bytes, row0, col_state):
        return score_tiles.clip(an, bn, ls() if callable(ls) else ls, labels=labels, **kw)
    return row_blocks.clip(an, bn, ls, labels=labels, **kw)


def check_without_positives(labels, want_loss: bool, want_grad: bool, col_state: bool,
                            col_shift, weights, gpu: bool) -> None:
    """A CLIP block call with ``positives=False`` (no pair in it: a ring's chunk of another
    rank's texts): the statistics as column states (with the GPU's column shift), uniform
    weights, labels on the NumPy path alone -- what its G = ½ w (p_row + p_col) and its
    missing row losses allow."""
    if ((gpu and labels is not None) or (want_loss and not col_state)
            or (gpu and want_loss and col_shift is None)
            or (want_grad and weights is not None and weights[0] is not None)):
        raise ValueError("clip: positives=False takes col_state (and on the GPU col_shift) "
                         "for the statistics, uniform weights, no labels on the GPU")


def _clip_labels_tiles(an, bn, want_loss: bool, row0: int, col_shift, labels) -> bool:
    """Whether a CLIP call with ``labels`` may take the score tiles (the rest of the choice
    is :func:`clip`'s, as without labels): ``config.clip_labels_tiles``, one array for the
    rows' and the columns' labels (the tiles read both from it: ``ops.clip`` passes one),
    and a statistics pass has its column shift -- given (a rank's block: ``ops.clip``
    gathers the pairs' dots) or computable here (square: ``score_tiles.clip``'s
    ``paired_dots``)."""
    if not config.current().clip_labels_tiles or labels[0] is not labels[1]:
        return False
    return (not want_loss or col_shift is not None
            or (row0 == 0 and an.shape[0] == bn.shape[0]))


def _clip_keeps_scores(an, bn, want_loss: bool, want_grad: bool, workspace_bytes, row0: int,
                       col_state: bool) -> bool:
    """The chooser by cost for a fused CLIP call (loss and gradient in one): the cuBLAS row
    blocks that keep the whole score matrix (three products) instead of the score tiles,
    which recompute the scores in their gradient pass (four), where D >= the configured
    ``keep_scores_min_dim`` (there the fourth product outweighs the tiles' fusion: H200, bf16,
    ``benchmarks/bench_chooser.py``, docs/results.md) and the matrix fits ``workspace_bytes``
    (4 N² bytes for 16-bit inputs: N <= 16384 under the default 1 GiB).  Not a distributed
    rank's block (``row0``, ``col_state``), whose columns span every rank."""
    if (not (want_loss and want_grad) or row0 or col_state
            or an.shape[1] < config.current().keep_scores_min_dim):
        return False
    return row_blocks.clip_keeps_scores(an, bn, workspace_bytes)


def cross(q, k, scale: float, *, lse_r, lse_c, weights, want_stats: bool, want_grad: bool,
          workspace_bytes, col_shift=None, scale_log=None):
    """The block of two disjoint row sets of one symmetric softmax (a global NT-Xent's
    off-diagonal rank block): q's row statistics and k's column state over it, or both sides'
    gradient accumulators.  See :func:`row_blocks.cross`; ``col_shift`` (the raw positive dots
    of k's rows) is the tile path's column shift; ``scale_log`` (a (1,) device array of the
    accumulator dtype, or None) multiplies the scale by its exp in the kernels (CLIP's ring
    with a device logit_scale: no host read, no rows rescaled)."""
    if want_stats and col_shift is None:  # (the tiles would read address 0)
        raise ValueError("cross: want_stats needs col_shift, the raw positive dots of k's rows")
    kw = dict(lse_r=lse_r, lse_c=lse_c, weights=weights, want_stats=want_stats,
              want_grad=want_grad, workspace_bytes=workspace_bytes, col_shift=col_shift,
              scale_log=scale_log)
    if tiling.tiles_ok(q, k):  # (the statistics pass needs col_shift there)
        return score_tiles.cross(q, k, scale, **kw)
    return row_blocks.cross(q, k, scale, **kw)


def siglip(an, bn, ls, lb, *, weights, want_loss: bool, want_grad: bool, workspace_bytes,
           row0: int = 0, col0: int = 0):
    """SigLIP's per-row losses and gradient accumulators: the tensor-core tiles where they
    apply (16-bit, aligned; ``score_tiles.siglip``), else the cuBLAS row blocks
    (:func:`row_blocks.siglip`, which documents the arguments and returns)."""
    kw = dict(weights=weights, want_loss=want_loss, want_grad=want_grad,
              workspace_bytes=workspace_bytes, row0=row0, col0=col0)
    if tiling.tiles_ok(an, bn):
        return score_tiles.siglip(an, bn, ls, lb, **kw)
    return row_blocks.siglip(an, bn, ls, lb, **kw)


col_lse = stats.col_lse
pair_dots = stats.pair_dots
