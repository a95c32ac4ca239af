"""The cuBLAS row-block path: score blocks as cuBLAS products, fused row / column kernels
(``kernels_src/contrastive.cu``) between them.

Every float32 / float64 call, and 16-bit calls the tile kernels do not take (``tiles.tiles_ok``),
runs here.  The score matrix is processed in row blocks that fit the workspace
(``blas.plan_rows``); per-row statistics and gradient accumulators are float32 (float64).

* :func:`rows` — a row softmax over [keys | shared negatives | per-query negatives] (NT-Xent,
  InfoNCE);
* :func:`clip` — the row and the column softmax of one score matrix (CLIP).
"""
from __future__ import annotations

import numpy as np

from . import blas, kernels
from .arrays import FILE, buffers, ptr
from .kernels import BLOCK, acc_dtype


def rows(q, k, neg_s, neg_p, scale: float, *, exclude_diag: bool, pos_shift: int,
         pos_mod: int, lse_in, weights, want_grad: bool, workspace_bytes, op: str,
         self_pair: bool = False, scale_log=None):
    """Row log-sum-exps, per-row losses and (optionally) accumulated gradients.

    q (N, D) queries, k (Nk, D) keys (columns 0..Nk-1), neg_s (Ms, D) shared negatives
    (columns Nk..Nk+Ms-1), neg_p (N, Mp, D) per-query negatives.  ``self_pair`` means q is k
    (NT-Xent): the two gradient products accumulate into one buffer.
    Returns ``lse, loss, (dq, dk, dns, dnp)`` with float32/64 gradient accumulators.
    """
    import cupy as cp

    t = q.dtype
    a = acc_dtype(t)
    n, d = q.shape
    nk = k.shape[0]
    ms = 0 if neg_s is None else neg_s.shape[0]
    mp = 0 if neg_p is None else neg_p.shape[1]
    ncols = nk + ms
    split_g = want_grad and t != a  # half inputs: the gradient block is stored in T separately
    row_bytes = ncols * a.itemsize + (ncols * t.itemsize if split_g else 0)
    rb = blas.plan_rows(op, n, row_bytes, workspace_bytes)
    # the call's scratch (score / gradient blocks, paired-negative dots) and what it returns
    # come from two allocations: an output the caller keeps (a per-row loss, the saved
    # gradient accumulators) never holds the score block alive.  The gradient accumulators
    # are written by the first row block's products (beta = 0).
    s_buf, g_buf, e, g2 = buffers((
        ((rb, ncols), a), ((rb, ncols), t) if split_g else None,
        ((n, mp), a) if mp else None, ((n, mp), a) if mp and want_grad else None))
    lse, loss, dq, dk, dns = buffers((
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
        kernels.launch(FILE, "paired_dots", t, ((nwarps * 32 + BLOCK - 1) // BLOCK,),
               (q, np.int64(blas.leading_dim(q)), neg_p, np.int32(n), np.int32(mp), np.int32(d), e))
    w_arr, w_stride, w_mul = weights

    for r0 in range(0, n, rb):
        r1 = min(n, r0 + rb)
        nrows = r1 - r0
        s_blk = s_buf[:nrows]
        qb = q[r0:r1]
        blas.gemm(qb, k, s_blk[:, :nk], trans_b=True)
        if ms:
            blas.gemm(qb, neg_s, s_blk[:, nk:], trans_b=True)
        g_blk = g_buf[:nrows] if want_grad else None
        kernels.launch(FILE, "row_softmax", t, (nrows,), (
            s_blk, np.int64(ncols), np.int32(ncols),
            ptr(e) + r0 * mp * a.itemsize if mp else 0, np.int64(mp), np.int32(mp),
            np.int32(r0), np.int32(exclude_diag), np.int32(pos_shift), np.int32(pos_mod),
            ptr(scale_log), a.type(scale), ptr(lse_in), lse if lse_in is None else 0, loss,
            ptr(g_blk), np.int64(ncols),
            ptr(g2) + r0 * mp * a.itemsize if g2 is not None else 0, np.int64(mp),
            ptr(w_arr), np.int64(w_stride), a.type(w_mul)))
        if want_grad:
            acc = 1.0 if r0 else 0.0
            if self_pair:  # dk is dq: its every row is first written by the Gᵀ Q product
                blas.gemm(g_blk[:, :nk], qb, dk, trans_a=True, beta=acc)
                blas.gemm(g_blk[:, :nk], k, dq[r0:r1], beta=1.0)
            else:
                blas.gemm(g_blk[:, :nk], k, dq[r0:r1])
                blas.gemm(g_blk[:, :nk], qb, dk, trans_a=True, beta=acc)
            if ms:
                blas.gemm(g_blk[:, nk:], neg_s, dq[r0:r1], beta=1.0)
                blas.gemm(g_blk[:, nk:], qb, dns, trans_a=True, beta=acc)
    if want_grad and mp:
        dnp = cp.empty((n, mp, d), a)
        kernels.launch(FILE, "paired_grad", t, (n,),
               (q, np.int64(blas.leading_dim(q)), neg_p, g2, np.int32(mp), np.int32(d), dq, dnp))
    return lse, loss, (dq, dk, dns, dnp)


def clip(an, bn, ls, *, lse_r, lse_c, weights, want_loss: bool, want_grad: bool,
         workspace_bytes):
    """Row/column statistics (when ``want_loss``) and the gradient accumulators.

    ``ls`` is logit_scale as a (1,) device array of the accumulator dtype.
    Returns ``lse_r, lse_c, pair_loss, (da, db, dscale_parts)``.
    """
    t = an.dtype
    a = acc_dtype(t)
    n, d = an.shape
    split_g = want_grad and t != a
    row_bytes = n * a.itemsize + (n * t.itemsize if split_g else 0)
    rb = blas.plan_rows("clip_loss", n, row_bytes, workspace_bytes)
    reuse = rb >= n  # the whole score matrix fits: the gradient pass reuses it
    chunk = 64
    nch = (rb + chunk - 1) // chunk
    # scratch and outputs from two allocations (see rows).  part_m / part_s: column
    # partials of a row block; col_m: the running column state between row blocks (the first
    # block starts it: no fill); da, db: written by the first row block's products (beta = 0)
    s_buf, g_buf, row_loss, part_m, part_s, col_m = buffers((
        ((rb, n), a), ((rb, n), t) if split_g else None,
        ((n,), a) if want_loss else None,
        ((nch, n), a) if want_loss else None, ((nch, n), a) if want_loss else None,
        ((2, n), a) if want_loss and rb < n else None))
    vec = ((n,), a)
    lse_r2, lse_c2, pair_loss, da, db, dsp = buffers((
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
            nrows = r1 - r0
            s_blk = s_buf[:nrows]
            blas.gemm(an[r0:r1], bn, s_blk, trans_b=True)
            kernels.launch(FILE, "row_softmax", t, (nrows,), (
                s_blk, np.int64(n), np.int32(n), 0, np.int64(0), np.int32(0),
                np.int32(r0), np.int32(0), np.int32(0), np.int32(n), ls, a.type(1.0),
                0, lse_r, row_loss, 0, np.int64(0), 0, np.int64(0), 0, np.int64(0), a.type(0)))
            nc = (nrows + chunk - 1) // chunk
            kernels.launch(FILE, "col_partial", t, (cgrid[0], nc), (
                s_blk, np.int64(n), np.int32(nrows), np.int32(n), np.int32(chunk), ls,
                a.type(1.0), part_m, part_s))
            mode = (2 if r0 == 0 else 0) | (1 if r1 == n else 0)  # fresh | finalize
            kernels.launch(FILE, "col_combine", t, (-(-n // 32),), (
                part_m, part_s, np.int32(nc), np.int32(n), ptr(col_m),
                0 if col_m is None else col_m[1], np.int32(mode),
                lse_r, row_loss, lse_c, pair_loss))
    grads = None
    if want_grad:
        w_arr, w_stride, w_mul = weights
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            nrows = r1 - r0
            s_blk = s_buf[:nrows]
            if not (reuse and want_loss):
                blas.gemm(an[r0:r1], bn, s_blk, trans_b=True)
            g_blk = g_buf[:nrows]
            kernels.launch(FILE, "clip_grad", t, (nrows,), (
                s_blk, np.int64(n), np.int32(n), np.int32(r0), ls, lse_r, lse_c,
                ptr(w_arr), np.int64(w_stride), a.type(w_mul), g_blk, np.int64(n), dsp))
            blas.gemm(g_blk, bn, da[r0:r1])
            blas.gemm(g_blk, an[r0:r1], db, trans_a=True, beta=1.0 if r0 else 0.0)
        grads = (da, db, dsp)
    return lse_r, lse_c, pair_loss, grads
