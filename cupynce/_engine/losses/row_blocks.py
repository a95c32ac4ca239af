"""The cuBLAS row-block path: score blocks as cuBLAS products, fused row / column kernels
(``kernels_src/losses/stats.cu`` and ``grads.cu``) between them.

Every float32 / float64 call, and 16-bit calls the tile kernels do not take
(``tiling.tiles_ok``), runs here.  The score matrix is processed in row blocks that fit the
workspace (``workspace.plan_rows``); per-row statistics and gradient accumulators are float32
(float64).  The products are issued by the plan the chooser gives each call
(``gemm.plan``: cuBLAS, or the TF32x3 / F16x3 tiles for float32).

* :func:`rows` — a row softmax over [keys | shared negatives | per-query negatives] (NT-Xent,
  InfoNCE);
* :func:`clip` — the row and the column softmax of one score matrix (CLIP);
* :func:`siglip` — SigLIP's independent pairs (no softmax).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import kernels
from ..arrays import buffers, fixed_sums, leading_dim, pair_weights, ptr
from ..gemm import CUBLAS, f16x3
from ..gemm import plan as plan_products
from ..kernels import BLOCK, acc_dtype
from ..workspace import fits, plan_rows
from .stats import FAR_MOD, STATS_ROWS, row_col_stats
from .stats import FILE as STATS_FILE

#: the gradient blocks' kernels (the statistics' are ``stats.FILE``)
GRADS_FILE = "losses/grads.cu"


class Hardness(NamedTuple):
    """sentence-transformers' hardness weighting, as ``row_softmax`` (``stats.cu``) takes it:
    ``mode`` 1 in_batch_negatives, 2 hard_negatives, 3 all_negatives; ``alpha`` the strength;
    row i's own columns ``own_start + i + own_mod·m`` below ``own_start + own_count`` (its
    hard negatives in the library's layout) and every per-query negative."""

    mode: int
    alpha: float
    own_start: int
    own_count: int
    own_mod: int


def NO_HARDNESS(a) -> tuple:
    """``row_softmax``'s trailing arguments without hardness weighting."""
    return (np.int32(0), a.type(0), np.int32(0), np.int32(0), np.int32(1))


def _row_bytes(t, a, cols: int, want_grad: bool, plan, g_in_place: bool = False) -> int:
    """Workspace bytes a row block takes per row: its ``cols`` scores in the accumulator dtype
    ``a``; with the gradient, a separate copy of the gradient block in the input dtype ``t``
    for half inputs (none where ``g_in_place``: CLIP writes it over the scores) and, for
    float32 in "3xtf32" on cuBLAS, the split the gradient products make of it
    (``plan.split_row_bytes``: none when ``plan``, the block's products, is the TF32x3
    tiles')."""
    row = cols * a.itemsize
    if want_grad:
        row += ((cols * t.itemsize if t != a and not g_in_place else 0)
                + plan.split_row_bytes(t, cols))
    return row


def rows(q, k, neg_s, neg_p, scale: float, *, exclude_diag: bool, pos_shift: int,
         pos_mod: int, lse_in, weights, want_grad: bool, workspace_bytes, op: str,
         self_pair: bool = False, scale_log=None, labels=None, smoothing: float = 0.0,
         hardness=None, pair_labels=None, pair_row0: int = 0, positives: bool = True):
    """Row log-sum-exps, per-row losses and (optionally) accumulated gradients.

    q (N, D) queries, k (Nk, D) keys (columns 0..Nk-1), neg_s (Ms, D) shared negatives
    (columns Nk..Nk+Ms-1), neg_p (N, Mp, D) per-query negatives.  ``self_pair`` means q is k
    (NT-Xent): the two gradient products accumulate into one buffer.  ``labels``: (row
    labels (N,), column labels (L,)), int64 device arrays for the first L columns (the keys,
    and across ranks the other ranks' keys that lead the shared negatives): such a column of
    row i's label other than its positive is no candidate; ``smoothing``: the label
    smoothing over the candidates (``row_softmax`` in ``stats.cu``); ``hardness``: None or a
    :class:`Hardness` (penalised columns' logits + α·S, detached); ``pair_labels``: (N,) int64
    labels of q = k (``self_pair``, no negatives): pytorch-metric-learning's NTXentLoss rows
    instead of the softmax (``row_pairs`` in ``stats.cu``: each row's loss the sum over its
    positive pairs; the forward's ``lse_in`` is not needed, the statistics are recomputed);
    ``pair_row0``: q's rows are rows ``pair_row0 ..`` of k (a rank's rows among the gathered
    ones: the labels are k's, the per-row outputs and weights q's).  ``positives=False``
    (``_engine.rows``' block without positives, the positives numbered past the columns):
    no row loss, so ``row_softmax`` never reads a row's positive score.
    Returns ``lse, loss, (dq, dk, dns, dnp)`` with float32/64 gradient accumulators.
    """
    lab_r, lab_c = (None, None) if labels is None else labels
    if not positives and pair_labels is not None:
        raise ValueError("rows: positives=False takes no pair_labels")
    import cupy as cp

    t = q.dtype
    a = acc_dtype(t)
    n, d = q.shape
    nk = k.shape[0]
    ms = 0 if neg_s is None else neg_s.shape[0]
    mp = 0 if neg_p is None else neg_p.shape[1]
    ncols = nk + ms
    split_g = want_grad and t != a  # half inputs: the gradient block is stored in T separately
    # float32 products on the TF32x3 tiles where the precision takes them (not NT-Xent's
    # self-pair fallback -- a learnable scale or extra negatives: its accuracy on them was
    # never measured; the symmetric problem goes to nt_xent_tf32.rows)
    plan = (plan_products(q, k, scale_grad=scale_log is not None) if not self_pair
            else CUBLAS)
    gemm = plan.gemm
    rb = plan_rows(op, n, _row_bytes(t, a, ncols, want_grad, plan), workspace_bytes)
    # the call's scratch (score / gradient blocks, paired-negative dots) and what it returns
    # come from two allocations: an output the caller keeps (a per-row loss, the saved
    # gradient accumulators) never holds the score block alive.  The gradient accumulators
    # are written by the first row block's products (beta = 0).
    s_buf, g_buf, e, g2 = buffers((
        ((rb, ncols), a), ((rb, ncols), t) if split_g else None,
        ((n, mp), a) if mp else None, ((n, mp), a) if mp and want_grad else None))
    lse, loss, dq, dk, dns = buffers((
        ((n,), a) if lse_in is None else None, ((n,), a) if positives else None,
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
        kernels.launch(STATS_FILE, "paired_dots", t, ((nwarps * 32 + BLOCK - 1) // BLOCK,),
               (q, np.int64(leading_dim(q)), neg_p, np.int32(n), np.int32(mp), np.int32(d), e,
                0))
    w_arr, w_stride, w_mul = weights
    hard_args = NO_HARDNESS(a) if hardness is None else (
        np.int32(hardness.mode), a.type(hardness.alpha), np.int32(hardness.own_start),
        np.int32(hardness.own_count), np.int32(max(1, hardness.own_mod)))

    for r0 in range(0, n, rb):
        r1 = min(n, r0 + rb)
        nrows = r1 - r0
        s_blk = s_buf[:nrows]
        qb = q[r0:r1]
        gemm(qb, k, s_blk[:, :nk], trans_b=True)
        if ms:
            gemm(qb, neg_s, s_blk[:, nk:], trans_b=True)
        g_blk = g_buf[:nrows] if want_grad else None
        if pair_labels is not None:  # (per-row pointers shifted back: the kernel's row is k's)
            back = pair_row0 * a.itemsize
            kernels.launch(STATS_FILE, "row_pairs", t, (nrows,), (
                s_blk, np.int64(ncols), np.int32(ncols), np.int32(pair_row0 + r0),
                ptr(scale_log), a.type(scale), pair_labels,
                lse.data.ptr - back if lse_in is None else 0, loss.data.ptr - back, ptr(g_blk),
                np.int64(ncols), ptr(w_arr) - back * w_stride if w_arr is not None else 0,
                np.int64(w_stride), a.type(w_mul)))
        else:
            kernels.launch(STATS_FILE, "row_softmax", t, (nrows,), (
                s_blk, np.int64(ncols), np.int32(ncols),
                ptr(e) + r0 * mp * a.itemsize if mp else 0, np.int64(mp), np.int32(mp),
                np.int32(r0), np.int32(exclude_diag), np.int32(pos_shift), np.int32(pos_mod),
                ptr(scale_log), a.type(scale), ptr(lse_in), lse if lse_in is None else 0,
                ptr(loss), ptr(g_blk), np.int64(ncols),
                ptr(g2) + r0 * mp * a.itemsize if g2 is not None else 0, np.int64(mp),
                ptr(w_arr), np.int64(w_stride), a.type(w_mul),
                ptr(lab_r), ptr(lab_c), np.int32(0 if lab_c is None else lab_c.shape[0]),
                a.type(smoothing), *hard_args))
        if want_grad:
            acc = 1.0 if r0 else 0.0
            if self_pair:  # dk is dq: its every row is first written by the Gᵀ Q product
                gemm(g_blk[:, :nk], qb, dk, trans_a=True, beta=acc)
                gemm(g_blk[:, :nk], k, dq[r0:r1], beta=1.0)
            else:
                gemm(g_blk[:, :nk], k, dq[r0:r1])
                gemm(g_blk[:, :nk], qb, dk, trans_a=True, beta=acc)
            if ms:
                gemm(g_blk[:, nk:], neg_s, dq[r0:r1], beta=1.0)
                gemm(g_blk[:, nk:], qb, dns, trans_a=True, beta=acc)
    if want_grad and mp:
        dnp = cp.empty((n, mp, d), a)
        kernels.launch(GRADS_FILE, "paired_grad", t, (n,),
               (q, np.int64(leading_dim(q)), neg_p, g2, np.int32(mp), np.int32(d), dq, dnp))
    return lse, loss, (dq, dk, dns, dnp)


def nt_xent_keeps_scores(z, workspace_bytes, op: str) -> bool:
    """Whether NT-Xent's whole float32 score matrix (4 N² bytes; H written over it) fits
    ``workspace_bytes``: :func:`nt_xent_kept` runs then (the chooser,
    ``cupynce._engine.rows``)."""
    n = z.shape[0]
    return fits(n * n * acc_dtype(z.dtype).itemsize, workspace_bytes)  # (never raises)


def nt_xent_kept(z, scale: float, *, pos_shift: int, weights, op: str):
    """NT-Xent's fused call (statistics and gradient) on a kept score matrix, for 16-bit z
    (N, D): S = Z Zᵀ in float32 (one cuBLAS product), the row log-sum-exps and losses
    (``row_softmax`` without a gradient), H = G + Gᵀ written over S (``grad_inplace``: S is
    symmetric, so H_ij needs only S_ij and both rows' statistics), and dZ = H Z (one product).
    Two products where the row blocks run three and eager PyTorch three; the whole matrix
    must fit the workspace (:func:`nt_xent_keeps_scores`).  Returns ``rows``' results."""
    t = z.dtype
    a = acc_dtype(t)
    n = z.shape[0]
    (s,) = buffers((((n, n), a),))  # (scratch apart from the outputs the caller keeps)
    lse, loss, dz = buffers((((n,), a), ((n,), a), ((n, z.shape[1]), a)))
    CUBLAS.gemm(z, z, s, trans_b=True)
    w_arr, w_stride, w_mul = weights
    kernels.launch(STATS_FILE, "row_softmax", t, (n,), (
        s, np.int64(n), np.int32(n), 0, np.int64(0), np.int32(0), np.int32(0), np.int32(1),
        np.int32(pos_shift), np.int32(n), 0, a.type(scale), 0, lse, loss, 0, np.int64(n), 0,
        np.int64(0), ptr(w_arr), np.int64(w_stride), a.type(w_mul), 0, 0, np.int32(0),
        a.type(0), *NO_HARDNESS(a)))
    kernels.launch(GRADS_FILE, "grad_inplace", t, (n,), (
        s, np.int64(n), np.int32(n), np.int32(0), np.int32(pos_shift), np.int32(n),
        np.int32(1), a.type(1.0), 0, a.type(scale), lse, lse, ptr(w_arr), np.int64(w_stride),
        a.type(w_mul), 0))
    CUBLAS.gemm(s.view(t)[:, :n], z, dz)  # dZ = H Z
    return lse, loss, (dz, dz, None, None)


def _scores(gemm, prods, a_rows, an, bn, out) -> None:
    """The score block ``out = a_rows bnᵀ``; with ``prods`` (the tiles' products of a call in
    one block), the gradient products' operands bn and an split on its side stream beside
    it (:meth:`gemm.TilesPlan.mark` / ``prefetch``)."""
    pre = prods.mark(bn, an) if prods is not None else None
    gemm(a_rows, bn, out, trans_b=True)
    if pre is not None:
        prods.prefetch(pre)


def _mask(labels, s_blk, row: int) -> None:
    """CLIP's labels (``clip_mask`` in ``stats.cu``): the same-label pairs of the block's rows
    ``row ..`` (global) set to -inf."""
    if labels is not None:
        lab_r, lab_c = labels
        kernels.launch(STATS_FILE, "clip_mask", s_blk.dtype, (s_blk.shape[0],), (
            s_blk, np.int64(leading_dim(s_blk)), np.int32(s_blk.shape[1]), np.int32(row),
            lab_r, lab_c))


def clip(an, bn, ls, *, lse_r, lse_c, weights, want_loss: bool, want_grad: bool,
         workspace_bytes, row0: int = 0, col_shift=None, col_state: bool = False,
         labels=None):
    """Row/column statistics (when ``want_loss``) and the gradient accumulators.

    ``ls`` is logit_scale as a (1,) device array of the accumulator dtype, or a function
    returning it, called once the first score product is issued (its guard kernel's host
    time then runs under that product instead of before it).  an (n, D) are the
    rows ``row0 .. row0 + n - 1`` of the image side, bn (Nc, D) every column; row i's
    positive is column row0 + i (square problems: row0 = 0, Nc = n).
    Returns ``lse_r, lse_c, pair_loss, (da, db, dscale_parts)``; with ``col_state``
    ``lse_r, state, row_loss, grads`` where state (2, Nc) is the columns' running (m, s) over
    these rows (:func:`stats.col_lse` merges the states of several row sets).  ``col_shift`` is the
    tile path's (unused here).  ``labels``: (row labels indexed by the global row, column
    labels), int64 device arrays: same-label pairs off the diagonal leave both softmaxes
    (:func:`_mask` after every score product).
    """
    t = an.dtype
    a = acc_dtype(t)
    n, d = an.shape
    nc = bn.shape[0]
    split_g = want_grad and t != a
    plan = plan_products(an, bn, scale_grad=True)
    gemm = plan.gemm
    # F16x3 products: score rows of a multiple of 64 columns in every pass (the statistics
    # pass and a recompute must run the same score product), over which the gradient pass
    # writes G's float16 halves (cpn_clip_grad_f16x3) where the gradient products' outputs
    # (rows of D) take the F16x3 stores (D even; else G stays float32 on the TF32x3 tiles)
    f16_s = plan.f16
    f16 = f16_s and want_grad and d % 2 == 0
    ldn, row_bytes = _clip_row_bytes(an, bn, want_grad, plan)
    rb = plan_rows("clip_loss", n, row_bytes, workspace_bytes)
    reuse = rb >= n  # the whole score matrix fits: the gradient pass reuses it
    # scratch and outputs from two allocations (see rows).  part_m / part_s: column
    # partials of a row block; col_m: the running column state between row blocks (the first
    # block starts it: no fill); da, db: written by the first row block's products (beta = 0)
    nch = -(-rb // STATS_ROWS)
    keep_state = want_loss and (rb < n or col_state)
    s_buf, row_loss, part_m, part_s, col_m = buffers((
        ((rb, ldn), a), ((n,), a) if want_loss else None,
        ((nch, nc), a) if want_loss else None, ((nch, nc), a) if want_loss else None,
        ((2, nc), a) if keep_state else None))
    if f16:
        plan.grad_f16 = True
    if ldn != nc:
        s_buf = s_buf[:, :nc]
    # the gradient products' operands split on a side stream beside S's product (one block)
    prods = plan if plan.side_splits(want_grad, reuse) else None
    if want_loss and n:  # the first block's scores first: the host work below overlaps them
        # (s_buf holds rb rows; a view of an only when it has more: views cost host time)
        _scores(gemm, prods, an if rb == n else an[:rb], an, bn, s_buf)
        _mask(labels, s_buf[:min(rb, n)], row0)
    if callable(ls):
        ls = ls()
    vec = ((n,), a)
    lse_r2, lse_c2, pair_loss, da, db, dsp = buffers((
        vec if want_loss else None,
        vec if want_loss and not col_state else None, vec if want_loss and not col_state else None,
        ((n, d), a) if want_grad else None, ((nc, d), a) if want_grad else None,
        vec if want_grad else None))
    # 16-bit inputs: G's rows written in place over the score rows they come from (pitch
    # 2 ldn in T, cpn_grad_inplace); else G is S's own dtype, in place
    g_buf = s_buf.view(t)[:, :nc] if split_g else s_buf
    # per-row arrays are indexed by the global row (row0 + r) in the kernels
    shift = row0 * a.itemsize
    if want_loss:
        lse_r, lse_c = lse_r2, lse_c2
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            nrows = r1 - r0
            s_blk = s_buf[:nrows]
            if r0:
                gemm(an[r0:r1], bn, s_blk, trans_b=True)
                _mask(labels, s_blk, row0 + r0)
            nch_b = row_col_stats(s_blk, t, row0 + r0, 0, nc, ls, a.type(1.0),
                                  lse_r.data.ptr - shift, row_loss.data.ptr - shift, part_m,
                                  part_s)
            final = r1 == n and not col_state
            mode = (2 if r0 == 0 else 0) | (1 if final else 0)  # fresh | finalize
            kernels.launch(STATS_FILE, "col_combine", t, (-(-nc // 32),), (
                part_m, part_s, np.int32(nch_b), np.int32(nc), ptr(col_m),
                0 if col_m is None else col_m[1], np.int32(mode),
                lse_r, row_loss, ptr(lse_c), ptr(pair_loss)))
    grads = None
    if want_grad:
        w_arr, w_stride, w_mul = weights
        if f16:
            g16 = _f16_grad_args(weights, max(nc, row0 + n))
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            nrows = r1 - r0
            s_blk = s_buf[:nrows]
            if not (reuse and want_loss):
                _scores(gemm, prods, an[r0:r1], an, bn, s_blk)
                _mask(labels, s_blk, row0 + r0)
            g_blk = g_buf[:nrows]
            if f16:  # G's halves over the scores (no scale in them: the products take it)
                e_ptr, e_host, ufac = g16
                kernels.get_function(GRADS_FILE, "cpn_clip_grad_f16x3")((nrows,), (BLOCK,), (
                    s_blk, np.int64(ldn), np.int32(nc), np.int32(row0 + r0), ls,
                    np.float32(1.0), lse_r.data.ptr - shift, lse_c, ptr(w_arr),
                    np.int64(w_stride), np.float32(w_mul), e_ptr, np.int32(e_host), ufac,
                    dsp.data.ptr - shift))
                plan.set_grad_block(g_blk, ufac)
            elif split_g:
                kernels.launch(GRADS_FILE, "grad_inplace", t, (nrows,), (
                    s_blk, np.int64(ldn), np.int32(nc), np.int32(row0 + r0), np.int32(0),
                    np.int32(nc), np.int32(0), a.type(0.5), ls, a.type(1.0),
                    lse_r.data.ptr - shift, lse_c, ptr(w_arr), np.int64(w_stride),
                    a.type(w_mul), dsp.data.ptr - shift))
            else:
                kernels.launch(GRADS_FILE, "clip_grad", t, (nrows,), (
                    s_blk, np.int64(ldn), np.int32(nc), np.int32(row0 + r0), ls, a.type(1.0),
                    lse_r.data.ptr - shift, lse_c, ptr(w_arr), np.int64(w_stride),
                    a.type(w_mul), g_blk, np.int64(ldn), dsp.data.ptr - shift))
            gemm(g_blk, bn, da[r0:r1])
            gemm(g_blk, an[r0:r1], db, trans_a=True, beta=1.0 if r0 else 0.0)
        grads = (da, db, dsp)
    if prods is not None:
        prods.settle()
    if col_state:
        return lse_r, col_m, row_loss, grads
    return lse_r, lse_c, pair_loss, grads


def _clip_row_bytes(an, bn, want_grad: bool, plan) -> tuple:
    """(ldn, row bytes): :func:`clip`'s score rows' leading dimension (a multiple of 64
    columns for the F16x3 products) and the workspace bytes a row of its blocks takes."""
    t, nc = an.dtype, bn.shape[0]
    ldn = -(-nc // 64) * 64 if plan.f16 else nc
    return ldn, _row_bytes(t, acc_dtype(t), ldn, want_grad, plan, g_in_place=True)


def clip_keeps_scores(an, bn, workspace_bytes) -> bool:
    """Whether :func:`clip`'s fused call (statistics and gradient) holds the whole score
    matrix under ``workspace_bytes`` (float32 scores, the 16-bit gradient block written over
    them: 4 N² bytes for 16-bit inputs), so that its gradient pass reuses the scores instead
    of recomputing them: three products where the score tiles run four (the chooser's
    question at large D, ``cupynce._engine.clip``)."""
    row = _clip_row_bytes(an, bn, True, plan_products(an, bn, scale_grad=True))[1]
    return fits(an.shape[0] * row, workspace_bytes)  # (never raises: a row too large is no)


def _f16_grad_args(weights, length: int):
    """(e_ptr, e_host, ufac) of ``cpn_clip_grad_f16x3``: the exponent of G's bound (|G_ij| <=
    max |w|: the host's from w_mul alone, else a device one from the weights' first
    ``length`` entries, ``f16x3.bound_exp``; the kernel takes one less, a 2x margin)
    and a device float for the products' factor exp(logit_scale) 2^-e.  One scale for all of
    G: rows whose weight is far below the largest keep fewer bits (README, "F16x3")."""
    w_arr, w_stride, w_mul = weights
    ufac, e_dev = buffers((((1,), np.dtype(np.float32)),
                           ((1,), np.dtype(np.int32)) if w_arr is not None else None))
    if w_arr is None:
        return 0, f16x3.exp_for(float(np.float32(w_mul))), ufac
    f16x3.bound_exp(w_arr, length, w_stride, w_mul, e_dev)
    return e_dev, 0, ufac


def siglip(an, bn, ls, lb, *, weights, want_loss: bool, want_grad: bool, workspace_bytes,
           row0: int = 0, col0: int = 0):
    """SigLIP's per-row losses (``want_loss``) and gradient accumulators, in row blocks.

    ``ls`` / ``lb``: logit_scale and logit_bias as (1,) device arrays of the accumulator
    dtype.  an holds the rows ``row0 ..`` of the image side, bn the columns ``col0 ..`` (a
    rank's block of a global SigLIP, against every column or one rank's chunk of them: row
    r's positive is global column row0 + r, where bn holds it; the weights are read at the
    global rows).  Returns ``row_loss, (da, db, dscale, dbias)``: (n,) losses, (n, D) / (Nc, D)
    accumulators and the two 0-d scalar gradients (fixed-order sums of per-row parts); None
    where not asked for.  Each score block: one cuBLAS product, the ``siglip_rows`` kernel
    (loss, the gradient block without the uniform weight w_mul, in place or in the input dtype,
    the rows' scalar parts), the two gradient products with alpha = w_mul.
    """
    t = an.dtype
    a = acc_dtype(t)
    n, d = an.shape
    nc = bn.shape[0]
    split_g = want_grad and t != a
    plan = plan_products(an, bn, scale_grad=True)
    gemm = plan.gemm
    rb = plan_rows("siglip_loss", n, _row_bytes(t, a, nc, want_grad, plan), workspace_bytes)
    s_buf, g_buf = buffers((((rb, nc), a), ((rb, nc), t) if split_g else None))
    row_loss, da, db, parts = buffers((
        ((n,), a) if want_loss else None, ((n, d), a) if want_grad else None,
        ((nc, d), a) if want_grad else None, ((2, n), a) if want_grad else None))
    if not split_g:
        g_buf = s_buf if want_grad else None
    w_arr, w_stride, w_mul = weights
    # the kernel's row index i0 + r: its positive is bn's column i0 + r; the outputs and the
    # weights are shifted to match (the global row row0 + r is i0 + r + col0)
    i0 = row0 - col0
    w_ptr = ptr(w_arr) + a.itemsize * col0 * w_stride if w_arr is not None else 0
    # the gradient products' operands split on a side stream beside S's product (one block)
    prods = plan if plan.side_splits(want_grad, rb >= n) else None
    for r0 in range(0, n, rb):
        r1 = min(n, r0 + rb)
        s_blk = s_buf[:r1 - r0]
        _scores(gemm, prods, an[r0:r1], an, bn, s_blk)
        g_blk = g_buf[:r1 - r0] if want_grad else None
        kernels.launch(GRADS_FILE, "siglip_rows", t, (r1 - r0,), (
            s_blk, np.int64(nc), np.int32(nc), np.int32(i0 + r0), ls, lb,
            ptr(row_loss) - i0 * a.itemsize if row_loss is not None else 0,
            ptr(g_blk), np.int64(nc), w_ptr, np.int64(w_stride), a.type(w_mul),
            ptr(parts) - i0 * a.itemsize if parts is not None else 0,
            0 if parts is None else parts.data.ptr + (n - i0) * a.itemsize))
        if want_grad:  # (the block holds s G / w_mul; the first block's products write db)
            gemm(g_blk, bn, da[r0:r1], alpha=w_mul)
            gemm(g_blk, an[r0:r1], db, trans_a=True, alpha=w_mul, beta=1.0 if r0 else 0.0)
    if prods is not None:
        prods.settle()
    grads = None
    if want_grad:
        sums = fixed_sums(parts, 1)  # (dscale, dbias: one launch)
        grads = (da, db, sums[0], sums[1])
    return row_loss, grads


def cross(q, k, scale: float, *, lse_r, lse_c, weights, want_stats: bool, want_grad: bool,
          workspace_bytes, col_shift=None, scale_log=None):
    """The block of two disjoint row sets q (n, D), k (m, D) of one symmetric softmax (a
    global NT-Xent's off-diagonal rank block: S = scale · q kᵀ, no diagonal or positive in it).

    ``want_stats``: q's row log-sum-exps over these m columns (n,) and k's column (m, s)
    state over these n rows (2, m) (:func:`stats.col_lse` merges states).  ``want_grad``, given the
    full log-sum-exps ``lse_r`` (n,) and ``lse_c`` (m,): the accumulators (n, D), (m, D) of
    the weighted losses of both row sets, through H_ij = w_i p_i(j) + w_j p_j(i):
    ``dq = scale · H k``, ``dk = scale · Hᵀ q``.  ``weights``: ``(w_r, w_c, mul)``, per-row
    arrays (or None: 1) and their common multiplier.  ``col_shift`` is the tile path's;
    ``scale_log`` (a (1,) array of the accumulator dtype, or None): the scale times its exp,
    read by the kernels.
    Returns ``lse_q, state, (dq, dk)`` (None where not asked for).
    """
    t = q.dtype
    a = acc_dtype(t)
    n, d = q.shape
    m = k.shape[0]
    split_g = want_grad and t != a
    plan = plan_products(q, k)
    gemm = plan.gemm
    rb = plan_rows("nt_xent", n, _row_bytes(t, a, m, want_grad, plan), workspace_bytes)
    nch = -(-rb // STATS_ROWS)
    s_buf, g_buf, part_m, part_s = buffers((
        ((rb, m), a), ((rb, m), t) if split_g else None,
        ((nch, m), a) if want_stats else None, ((nch, m), a) if want_stats else None))
    lse_q, state, dq, dk = buffers((
        ((n,), a) if want_stats else None, ((2, m), a) if want_stats else None,
        ((n, d), a) if want_grad else None, ((m, d), a) if want_grad else None))
    if not split_g:
        g_buf = s_buf
    # the kernels index per-row arrays by the global row, here m + r: past every column
    shift = m * a.itemsize
    if want_stats:
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            s_blk = s_buf[:r1 - r0]
            gemm(q[r0:r1], k, s_blk, trans_b=True)
            nch_b = row_col_stats(s_blk, t, m + r0, 0, FAR_MOD, ptr(scale_log), a.type(scale),
                                  lse_q.data.ptr - shift, 0, part_m, part_s)
            kernels.launch(STATS_FILE, "col_combine", t, (-(-m // 32),), (
                part_m, part_s, np.int32(nch_b), np.int32(m), state, state[1],
                np.int32(2 if r0 == 0 else 0), 0, 0, 0, 0))
    if want_grad:
        w_arr, w_mul = pair_weights(weights, a)
        lse_row = lse_r.data.ptr - shift
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            s_blk = s_buf[:r1 - r0]
            gemm(q[r0:r1], k, s_blk, trans_b=True)
            g_blk = g_buf[:r1 - r0]
            # clip_grad halves w_i p_i(j) + w_j p_j(i): the weights go in doubled
            kernels.launch(GRADS_FILE, "clip_grad", t, (r1 - r0,), (
                s_blk, np.int64(m), np.int32(m), np.int32(m + r0), ptr(scale_log),
                a.type(scale), lse_row, lse_c, ptr(w_arr), np.int64(1), a.type(2 * w_mul), g_blk,
                np.int64(m), 0))
            gemm(g_blk, k, dq[r0:r1])
            gemm(g_blk, q[r0:r1], dk, trans_a=True, beta=1.0 if r0 else 0.0)
    return lse_q, state, ((dq, dk) if want_grad else None)

