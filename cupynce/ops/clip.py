"""CLIP's symmetric contrastive loss with a learnable temperature, on CuPy and NumPy arrays.

a, b (N, D) are paired rows (image i, text i); the logits are ``exp(logit_scale) · â b̂ᵀ`` and
the loss the mean of the row (image → text) and column (text → image) cross entropies.
Entry points: :func:`clip_loss`, :func:`clip_loss_forward`, :func:`clip_loss_backward` →
``(da, db, dlogit_scale)``, :func:`clip_loss_backward_from_stats`.  The column softmax reads
the score blocks column-wise: no transposed copy, no N × N matrix beyond the workspace.

Reference: Radford et al., "Learning Transferable Visual Models From Natural Language
Supervision" (CLIP), ICML 2021.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from .. import _checks, _engine, config
from .._engine import arrays, workspace
from .._engine.kernels import acc_dtype
from . import _comm, _cpu, _global, _graphs, _local, _memo, _numpy, _variants
from ._base import (Context, Path, check_stats, contig_inputs, contig_remembered, finish_all,
                    in_ctx_precision, prep, reduce, require, weights)
from ._comm import Comm

__all__ = ["clip_loss", "clip_loss_forward", "clip_loss_backward",
           "clip_loss_backward_from_stats"]


def numpy_clip(an, bn, ls, *, lse_r, lse_c, weights, want_loss: bool, want_grad: bool,
               workspace_bytes, row0: int = 0, col_shift=None, col_state: bool = False,
               labels=None, positives: bool = True):
    """``cupynce._engine.clip`` on the CPU (same arguments and results), on the namespace of
    ``_cpu.current()``; keeps the n × Nc logits and, for the column direction, a second
    n × Nc buffer (CPU memory, small sizes; ``workspace_bytes`` and ``col_shift`` are not
    used).  Each direction's exponentials are taken once, in place: the softmax is
    ``exp(L - m) / sum``; ``dsp_i = Σ_j G_ij L_ij`` is ``â_i · da_i``.  ``labels``: (row
    labels indexed by the global row, column labels): same-label pairs off the positive
    -inf, as the engine's ``clip_mask``.  ``positives=False``: no pair in the block (a ring's
    chunk of another rank's texts; uniform weights): no positive term, every same-label pair
    -inf, the row losses None."""
    if not positives:
        _engine.check_without_positives(labels, want_loss, want_grad, col_state, col_shift,
                                        weights, gpu=False)
    xp = _cpu.current()
    a = acc_dtype(an.dtype)
    aa, ba = (xp.astype(xp.asarray(x), a) for x in (an, bn))
    n, nc = aa.shape[0], ba.shape[0]
    scale = float(np.exp(np.asarray(ls, a).reshape(())))
    logits = xp.matmul(aa, ba.T)  # the NumPy path keeps n x Nc (CPU memory, small sizes)
    logits *= scale
    idx = xp.arange(n)
    pos = idx + row0  # row i's positive column
    if labels is not None:
        lab_r, lab_c = (xp.asarray(x) for x in labels)
        same = lab_r[row0:row0 + n, None] == lab_c[None, :]
        if positives:
            same[idx, pos] = False
        logits[same] = -float("inf")
    l_pos = logits[idx, pos] if positives else None
    pair_loss = state = None
    if col_state:  # (the rank's column states, before the logits turn into exponentials)
        state = _numpy.col_state(xp.host(logits))
    cols = None if col_state or not (want_loss or want_grad) else xp.copy(logits)
    if want_loss:
        lse_r, inv_r = _numpy.exp_lse(xp, logits, axis=1)  # logits: exp(L - m_row)
        row_loss = lse_r - l_pos if positives else None
        if col_state:
            lse_c, pair_loss = state, row_loss
        else:
            lse_c, inv_c = _numpy.exp_lse(xp, cols, axis=0)  # cols: exp(L - m_col)
            pair_loss = 0.5 * (row_loss + (lse_c - l_pos))
    elif want_grad:  # (the statistics given: the softmaxes straight)
        lse_r, lse_c = xp.asarray(lse_r), xp.asarray(lse_c)
        with xp.errstate(over="ignore", invalid="ignore"):
            logits -= lse_r[:, None]
            xp.exp(logits, out=logits)
            cols -= lse_c[None, :]
            xp.exp(cols, out=cols)
        inv_r = inv_c = 1.0
    grads = None
    if want_grad:
        w_arr, w_stride, w_mul = weights
        wc = w_mul * (xp.asarray(w_arr)[xp.arange(nc) * w_stride] if w_arr is not None
                      else xp.full((nc,), 1.0, a))
        w = wc[pos] if positives else xp.full((n,), w_mul, a)  # (no pair: uniform weights)
        # G = ½[w_i (softmax_row − δ) + w_j (softmax_col − δ)], in the logits' buffer
        with xp.errstate(invalid="ignore"):
            logits *= (0.5 * w)[:, None] * inv_r
            cols *= (0.5 * wc)[None, :] * inv_c
        logits += cols
        if positives:
            logits[idx, pos] -= w
        da = logits @ ba
        da *= scale
        db = logits.T @ aa
        db *= scale
        grads = (da, db, xp.einsum("ij,ij->i", aa, da))
    host = xp.host
    return (host(lse_r), state if col_state else host(lse_c),
            None if pair_loss is None else host(pair_loss),
            grads and tuple(host(x) for x in grads))


def _logit_scale_array(xp, ls, acc):
    """logit_scale as a (1,) array of the accumulator dtype on the inputs' side (a device
    value past the host check's limit becomes NaN: ``arrays.guard_log_scale``)."""
    if xp is np:
        return np.asarray(ls, acc).reshape(1)
    if isinstance(ls, float):  # (checked on the host)
        return arrays.scalar(ls, acc)
    return arrays.guard_log_scale(ls.astype(acc, copy=False).reshape(1),
                                  _checks.LOG_SCALE_LIMIT)


def _score_block_bytes(a, acc, workspace_bytes) -> int:
    """The score block a GPU call keeps on the row-block path (float32 / float64 inputs, and
    16-bit inputs from ``config.keep_scores_min_dim`` columns, with their 16-bit gradient
    block; 0 for other 16-bit inputs, whose tiles keep none), at most the workspace cap
    without its free-memory bound (no driver query): ``_graphs.run``'s ``est_bytes``."""
    n, d = a.shape
    if a.dtype == acc:
        row = n * acc.itemsize
    elif d >= config.current().keep_scores_min_dim:
        row = n * acc.itemsize  # (G is written over the scores)
    else:
        return 0
    return min(n * row, workspace.workspace_bound(workspace_bytes))


def _labels(xp, labels, like) -> dict:
    """The engine's ``labels=`` keyword for the pairs' labels (checked: integers, (N,), on
    the inputs' device), or no keyword."""
    labels = _checks.check_labels("clip_loss", labels, like.shape[0], xp, like)
    if labels is None:
        return {}
    labels = xp.asarray(labels, dtype=np.int64)
    return dict(labels=(labels, labels))


def _smoothing(xp, path, an, bn, ls, eps: float, w, masks: dict, *, want_loss: bool = True):
    """The label smoothing's O(N·D) difference (``_variants``): over every pair, or with the
    pairs' labels over each pair's candidates after the mask."""
    if masks:
        groups = _variants.label_groups(xp, masks["labels"][0])
        return _variants.clip_smoothing_labels(xp, path, an, bn, ls, eps, groups, w,
                                               want_loss=want_loss)
    return _variants.clip_smoothing(xp, an, bn, ls, eps, w, want_loss=want_loss)


def _check(a, b, logit_scale, reduction, workspace_bytes, normalize, precision):
    op = "clip_loss"
    xp = _checks.check_pairs(op, a, b)
    ls, ls_shape = _checks.check_logit_scale(op, logit_scale, xp, acc_dtype(a.dtype))
    _checks.check_scalar_device(op, "logit_scale", ls, a, xp)
    return xp, ls, ls_shape, _checks.check_flags(op, reduction, workspace_bytes, normalize,
                                                 precision)


def clip_loss_forward(a, b, logit_scale, *, label_smoothing: float = 0.0, labels=None,
                      reduction: str = "mean", normalize: bool = False,
                      workspace_bytes: Optional[int] = None,
                      requires_grad: bool = True, group=None,
                      precision: Optional[str] = None) -> Tuple[Any, Context]:
    """CLIP's symmetric contrastive loss and a context for :func:`clip_loss_backward`.

    Parameters
    ----------
    a, b : (N, D) arrays — image and text embeddings, pair i is (a_i, b_i).
    logit_scale : real, or 0-d / (1,) array (learnable log inverse temperature).
        s = exp(logit_scale); a device array is never read back to the host.
    label_smoothing : float in [0, 1), default 0
        Each direction's ``F.cross_entropy(label_smoothing=ε)`` (open_clip's request): an
        O(N·D) difference from the plain loss (``cupynce.ops._variants``), so every path
        serves it; the call makes no CUDA-graph replay.  With ``group`` the sums run over the
        global batch (Σ â gathered, Σ b̂ from the gathered texts).
    labels : None or an integer (N,) array of the inputs' kind (on their device)
        Pair i's label: a pair (i, j), j ≠ i, of one label is no negative in either
        direction (left out of row i's and column j's softmax): duplicates and false
        negatives (captions of one image, one class).  On the GPU the 16-bit score tiles
        mask in their epilogues (a tile whose rows and columns cannot share a label, by
        their 128-block label ranges, reads none), the cuBLAS row blocks with a mask kernel
        after each score product (float32 / float64, ``config.clip_labels_tiles=False``);
        the labels are an input of the CUDA-graph replay; with ``group`` each rank passes
        its pairs' labels (gathered with the texts).  With ``label_smoothing`` ε is spread
        over each pair's candidates left after the mask (class sums, O(N·D); with ``group``
        over every rank's pairs: the images gathered too, or on the ring schedule
        travelling with their texts).
    reduction : "mean" | "sum" | "none" (per pair: (row CE_i + column CE_i) / 2).
    normalize, workspace_bytes, requires_grad : as for nt_xent.
    group : communicator, optional
        The loss of the global batch across ranks: a ``cupy.cuda.nccl.NcclCommunicator``
        (or a ``cupyx.distributed`` NCCL backend) for CuPy arrays, or a
        :class:`cupynce.ops._comm.Comm`.  Every rank passes its local rows (equal counts); each rank
        computes one n × N block for both directions; ``dlogit_scale`` is the global one on
        every rank;
        the gradients from ``*_backward`` are P times those of the global loss with respect
        to the local rows (the data-parallel convention, see ``cupynce.ops._global``).
    precision : "auto" | "fp32" | "tf32" | "3xtf32", optional
        float32 products on the GPU; as for :func:`cupynce.nt_xent_forward`.

    Notes
    -----
    ``L = s · â b̂ᵀ``;  ``loss = (CE(L, arange) + CE(Lᵀ, arange)) / 2``.  Gradients:
    ``dâ = s G b̂``, ``db̂ = s Gᵀ â``, ``dlogit_scale = Σ_ij G_ij L_ij`` with
    ``G_ij = ½[w_i (softmax_row(L)_ij − δ_ij) + w_j (softmax_col(L)_ij − δ_ij)]``.
    The column direction reads the score blocks column-wise: no transposed copy.
    """
    if group is not None:
        return _global_forward(
            _comm.wrap(group), a, b, logit_scale, label_smoothing=label_smoothing,
            labels=labels, reduction=reduction, normalize=normalize,
            workspace_bytes=workspace_bytes, requires_grad=requires_grad, precision=precision)
    sig = _memo.signature("clip_loss", a, b, logit_scale)
    hit = _memo.known(sig)
    if hit:  # the arrays and logit_scale passed these checks before, laid out (_memo)
        xp, ls = _checks.cupy_module(), logit_scale
        ls_shape = () if type(ls) is float else ls.shape
        p = _checks.check_flags("clip_loss", reduction, workspace_bytes, normalize, precision)
    else:
        xp, ls, ls_shape, p = _check(a, b, logit_scale, reduction, workspace_bytes, normalize,
                                     precision)
    _checks.check_bool("clip_loss", "requires_grad", requires_grad)
    eps = _checks.check_smoothing("clip_loss", label_smoothing)
    masks = _labels(xp, labels, a)
    path = Path(xp)
    n = a.shape[0]
    acc = acc_dtype(a.dtype)
    (a, b), sig = contig_remembered(xp, sig, hit, a, b)
    engine = _engine.clip if path.gpu else numpy_clip
    fused = requires_grad and reduction != "none"
    host_ls = isinstance(ls, float)

    host_value = ls if host_ls else None  # (a graph plan keeps compute: no device array)

    def compute(a, b, ls_in=host_value, lab=None, *, defer: bool = False):
        masks = dict(labels=(lab, lab)) if lab is not None else {}
        an, na = prep(path, a, normalize)
        bn, nb = prep(path, b, normalize)
        # defer: the GPU engine makes the device scale once its first product is issued
        # (nothing keeps it here)
        ls_dev = ((lambda: _logit_scale_array(xp, ls_in, acc)) if defer
                  else _logit_scale_array(xp, ls_in, acc))
        w = weights(xp, None, reduction, n, acc)
        lse_r, lse_c, pair_loss, grads = engine(
            an, bn, ls_dev, lse_r=None, lse_c=None, weights=w, want_loss=True,
            want_grad=fused, workspace_bytes=workspace_bytes, **masks)
        da, db, dscale = None, None, None
        if fused:
            da, db, dsp = grads
            dscale = reduce(xp, dsp, "sum")
        if eps:  # (the O(N·D) difference: every path serves it)
            dloss, dgrads = _smoothing(xp, path, an, bn, ls_dev, eps,
                                       _variants.row_weights(w) if fused else None, masks)
            pair_loss = pair_loss + dloss
            if fused:
                da += dgrads[0]
                db += dgrads[1]
                dscale = dscale + dgrads[2]
        return (reduce(xp, pair_loss, reduction), lse_r, lse_c, da, db, dscale, na,
                nb), (an, bn, ls_dev)

    with config.float32_precision(p):  # (the graph key carries it too)
        # (nothing kept that aliases the inputs; the smoothing's array ops are no graph's)
        lab = masks["labels"][0] if masks else None
        if path.gpu and (fused or not requires_grad) and not eps:
            # (the labels, an input of the graph when given: their layout is (n,) int64 in
            # order, _checks.check_labels, so sig and the flag below key it)
            ins = ((a, b) if host_ls else (a, b, ls)) + (() if lab is None else (lab,))
            nls = 2 if host_ls else 3

            def graphed(*xs):
                return compute(*xs[:nls], lab=xs[nls] if len(xs) > nls else None,
                               defer=True)[0]
            outs = _graphs.run(
                ("clip_loss", ls if host_ls else None, reduction, normalize, workspace_bytes,
                 fused, lab is not None), ins, graphed,
                est_bytes=_score_block_bytes(a, acc, workspace_bytes), layout=sig)
        else:
            outs, kept = compute(a, b, ls, lab)
    loss, lse_r, lse_c, da, db, dscale, na, nb = outs
    ctx = Context("clip_loss", reduction, n, xp,
                  stats=(lse_r, lse_c) if requires_grad else (), precision=p)
    ls_dtype = acc if host_ls else ls.dtype
    base = dict(x=(a, b), norms=(na, nb), ls_shape=ls_shape, ls_dtype=ls_dtype)
    if fused:
        ctx.saved = dict(base, acc=(da, db), dscale=dscale)
    elif requires_grad:
        an, bn, ls_dev = kept
        ctx.saved = dict(base, xn=(an, bn), ls=ls_dev, lse=(lse_r, lse_c), ws=workspace_bytes,
                         eps=eps, masks=masks)
    return loss, ctx


@in_ctx_precision
def clip_loss_backward(ctx: Context, grad_loss: Any = 1.0):
    """Gradients ``(da, db, dlogit_scale)`` of :func:`clip_loss_forward`'s loss.

    ``dlogit_scale`` has logit_scale's shape and dtype (0-d float32/64 when a Python float was
    given); da, db follow the inputs' dtype.  The products run in the forward's float32
    precision (``ctx.precision``).
    """
    require(ctx, "clip_loss")
    if "global" in ctx.saved:
        return _global.backward(ctx, grad_loss)
    xp, s = ctx.xp, ctx.saved
    path = Path(xp)
    g = _checks.check_grad_loss("clip_loss_backward", grad_loss, ctx.reduction, ctx.n, xp)
    acc = acc_dtype(s["x"][0].dtype)
    if "acc" in s:
        gs = path.grad_scale(g, acc)
        da, db = finish_all(path, s["x"], s["norms"], s["acc"], gs)
        # (a copy when returned as saved: the caller may change the array it gets)
        dscale = (path.owned_copy(s["dscale"], s["dscale"].dtype) if gs is None
                  else s["dscale"] * gs.reshape(()))
    else:
        engine = _engine.clip if path.gpu else numpy_clip
        an, bn = s["xn"]
        w = weights(xp, g, ctx.reduction, ctx.n, acc)
        _, _, _, (da_acc, db_acc, dsp) = engine(
            an, bn, s["ls"], lse_r=s["lse"][0], lse_c=s["lse"][1], weights=w,
            want_loss=False, want_grad=True, workspace_bytes=s["ws"], **s.get("masks", {}))
        dscale = reduce(xp, dsp, "sum")
        if s.get("eps"):
            _, (dda, ddb, dds) = _smoothing(xp, path, an, bn, s["ls"], s["eps"],
                                            _variants.row_weights(w), s.get("masks", {}),
                                            want_loss=False)
            da_acc += dda
            db_acc += ddb
            dscale = dscale + dds
        da, db = finish_all(path, s["x"], s["norms"], (da_acc, db_acc), None)
    dscale = xp.asarray(dscale).astype(s["ls_dtype"], copy=False).reshape(s["ls_shape"])
    return da, db, dscale


def clip_loss_backward_from_stats(a, b, logit_scale, lse_r, lse_c, grad_loss: Any = 1.0, *,
                                  label_smoothing: float = 0.0, labels=None,
                                  reduction: str = "mean", normalize: bool = False,
                                  workspace_bytes: Optional[int] = None,
                                  precision: Optional[str] = None):
    """``(da, db, dlogit_scale)`` from the inputs and ``ctx.stats`` (row and column lse) alone.

    See :func:`nt_xent_backward_from_stats` (``precision`` too) and :func:`clip_loss_backward`.
    """
    xp, ls, ls_shape, p = _check(a, b, logit_scale, reduction, workspace_bytes, normalize,
                                 precision)
    n = a.shape[0]
    check_stats("clip_loss", xp, n, a.dtype, lse_r=lse_r, lse_c=lse_c)
    path = Path(xp)
    acc = acc_dtype(a.dtype)
    a, b = contig_inputs(xp, a, b)
    an, na = prep(path, a, normalize)
    bn, nb = prep(path, b, normalize)
    ctx = Context("clip_loss", reduction, n, xp, stats=(lse_r, lse_c), precision=p, saved=dict(
        x=(a, b), norms=(na, nb), ls_shape=ls_shape,
        ls_dtype=acc if isinstance(ls, float) else ls.dtype, xn=(an, bn),
        ls=_logit_scale_array(xp, ls, acc), lse=(lse_r, lse_c), ws=workspace_bytes,
        eps=_checks.check_smoothing("clip_loss", label_smoothing),
        masks=_labels(xp, labels, a)))
    return clip_loss_backward(ctx, grad_loss)


def clip_loss(a, b, logit_scale, *, label_smoothing: float = 0.0, labels=None,
              reduction: str = "mean", normalize: bool = False,
              workspace_bytes: Optional[int] = None, group=None,
              precision: Optional[str] = None):
    """CLIP's symmetric loss; see :func:`clip_loss_forward`."""
    return clip_loss_forward(a, b, logit_scale, label_smoothing=label_smoothing, labels=labels,
                             reduction=reduction, normalize=normalize,
                             workspace_bytes=workspace_bytes, requires_grad=False,
                             group=group, precision=precision)[0]


# ---- across ranks: this op's schedule for cupynce.ops._global ----------------------------
def _global_forward(comm: Comm, a, b, logit_scale, *, label_smoothing=0.0, labels=None,
                    reduction="mean", normalize=False, workspace_bytes=None,
                    requires_grad=True, precision=None):
    """:func:`clip_loss_forward` over ``comm``'s global batch: one n × N block per rank for
    both directions (see :mod:`cupynce.ops._global`).  ``logit_scale``'s gradient from
    :func:`cupynce.ops._global.backward` is the global one on every rank.
    """
    op = "clip_loss"
    precision = _global.precision_setting(precision)
    ls_array = hasattr(logit_scale, "shape")
    def checks():
        out = _check(a, b, logit_scale, reduction, workspace_bytes, normalize, precision)
        _checks.check_bool(op, "requires_grad", requires_grad)
        _checks.check_smoothing(op, label_smoothing)
        return out + (_labels(out[0], labels, a),)

    (xp, ls, ls_shape, p, masks), ring = _global.agree(
        comm, op, checks, [a, b], ["a", "b"],
        [0.0 if ls_array else logit_scale, ls_array, reduction, normalize, requires_grad,
         precision, label_smoothing, labels is not None],
        ring_wish=lambda: _global.ring_possible(comm, a, requires_grad, reduction,
                                                gpu=labels is None))
    if masks:  # (every pair's label, rank order: the rows' are this rank's of them)
        every_lab = comm.all_gather(masks["labels"][0]).reshape(-1)
        masks = dict(labels=(every_lab, every_lab))
    eps = float(label_smoothing)
    with config.float32_precision(p):  # every product of the rank's share (and graph keys)
        path = Path(xp)
        rank, size = comm.rank, comm.size
        n = a.shape[0]
        acc = acc_dtype(a.dtype)
        a, b = contig_inputs(xp, a, b)
        an, na = prep(path, a, normalize)
        bn, nb = prep(path, b, normalize)
        ls_dev = _logit_scale_array(xp, ls, acc)
        engine = _local.engine_for(xp)
        block = _engine.clip if path.gpu else numpy_clip
        fused = requires_grad and reduction != "none"
        ls_dtype = acc if isinstance(ls, float) else ls.dtype
        base = dict(x=(a, b), norms=(na, nb), ls_shape=ls_shape, ls_dtype=ls_dtype, size=size)
        if ring:
            w = weights(xp, None, reduction, n * size, acc) if fused else None
            labs = masks["labels"][0].reshape(size, n) if masks else None
            pair, lse_r, lse_c, grads, cls = _ring_share(
                comm, xp, engine, block, an, bn, ls_dev, w, workspace_bytes, labs,
                path=path if eps and masks else None)
            if eps and masks:  # over the global sums and the class sums the ring brought
                groups = _variants.label_groups(xp, masks["labels"][0])
                k = (n * size + 1 - (groups[4] - groups[3]))[rank * n:(rank + 1) * n]

                def usums(u):  # (Σ u_i â_i, Σ u_i b̂_i) over every rank's pairs
                    return _variants.global_sums(comm, xp, u[:, None] * an.astype(acc),
                                                 u[:, None] * bn.astype(acc))
                ring_sums = (k.astype(acc), *_variants.global_sums(comm, xp, an, bn), *cls,
                             usums)
                d, g = _variants.clip_smoothing_labels(
                    xp, path, an, bn, ls_dev, eps, None,
                    _variants.row_weights(w) if fused else None, ring=ring_sums)
                pair = pair + d
                if fused:
                    grads = (grads[0] + g[0], grads[1] + g[1], grads[2] + g[2])
            elif eps:  # the smoothing's O(N·D) difference over the global sums (no rows)
                sums = tuple(_variants.global_sums(comm, xp, an, bn)) + (n * size,)
                pair = pair + _variants.clip_smoothing(xp, an, bn, ls_dev, eps, sums=sums)[0]
                if fused:
                    w_row = _variants.row_weights(w)
                    dda, ddb, dsh = _variants.clip_smoothing(
                        xp, an, bn, ls_dev, eps, w_row, want_loss=False,
                        sums=sums + (sums[0] * w_row, sums[1] * w_row))[1]
                    grads = (grads[0] + dda, grads[1] + ddb, grads[2] + dsh)
            ctx = Context(op, reduction, n, xp, stats=(lse_r, lse_c) if requires_grad else (),
                          precision=p)
            if fused:  # (d loss / d logit_scale: the rank's shares all-reduced once)
                dscale = comm.all_reduce(xp.asarray(grads[2]).reshape(1)).reshape(())
                ctx.saved = dict(base, acc=grads[:2], dscale=dscale)
            return _global.loss(comm, xp, pair, reduction, n * size), _global.tag(ctx, _GLOBAL)
        # the texts and the pairs' raw dots a_j·b_j of every rank (the tile path's column shift)
        b_all = comm.all_gather(bn).reshape(n * size, -1)
        # (with labels too: the tiles take them, config.clip_labels_tiles)
        dots = comm.all_gather(engine.pair_dots(an, bn)).reshape(-1)
        lse_r, state, row_loss, _ = block(
            an, b_all, ls_dev, lse_r=None, lse_c=None, weights=None, want_loss=True,
            want_grad=False, workspace_bytes=workspace_bytes, row0=rank * n, col_shift=dots,
            col_state=True, **masks)
        lse_c = engine.col_lse(comm.all_gather(state))  # every text's lse, the same on every rank
        own = slice(rank * n, (rank + 1) * n)
        pair = 0.5 * (row_loss + (lse_c[own] - (lse_r - row_loss)))
        sums = lab = None
        if eps and masks:  # with labels: every rank's images too (the class sums), O(N·D)
            lab = (_variants.label_groups(xp, masks["labels"][0]),
                   comm.all_gather(an).reshape(n * size, -1))
            pair = pair + _variants.clip_smoothing_labels(
                xp, path, an, bn, ls_dev, eps, lab[0], every=(lab[1], b_all, None, rank * n))[0]
        elif eps:  # the smoothing's O(N·D) difference over the global sums (_variants): Σ â
            # of every rank (gathered, added in rank order), Σ b̂ of the gathered texts
            sums = (comm.all_gather(an.astype(acc, copy=False).sum(axis=0)).sum(axis=0),
                    b_all.astype(acc, copy=False).sum(axis=0), n * size)
            pair = pair + _variants.clip_smoothing(xp, an, bn, ls_dev, eps, sums=sums)[0]
        ctx = Context(op, reduction, n, xp, stats=(lse_r, lse_c[own]) if requires_grad else (),
                      precision=p)
        if fused:
            w = weights(xp, None, reduction, n * size, acc)
            smooth = None
            if eps:
                w_row = _variants.row_weights(w)
                smooth = (_variants.clip_smoothing_labels(
                    xp, path, an, bn, ls_dev, eps, lab[0], w_row, want_loss=False,
                    every=(lab[1], b_all, w_row, rank * n))[1] if lab is not None else
                    _variants.clip_smoothing(xp, an, bn, ls_dev, eps, w_row, want_loss=False,
                                             sums=sums + (sums[0] * w_row, sums[1] * w_row))[1])
            da, db, dscale = _global_grads(comm, block, xp, an, b_all, ls_dev, rank * n, lse_r,
                                           lse_c, w, workspace_bytes, smooth, masks)
            ctx.saved = dict(base, acc=(da, db), dscale=dscale)
        elif requires_grad:
            ctx.saved = dict(base, an=an, bn=bn, b_all=b_all, ls=ls_dev, lse=(lse_r, lse_c),
                             ws=workspace_bytes, comm=comm, eps=eps, sums=sums, masks=masks,
                             lab=lab)
        return _global.loss(comm, xp, pair, reduction, n * size), _global.tag(ctx, _GLOBAL)


def _ring_share(comm: Comm, xp, engine, block, an, bn, ls_dev, w, ws, labs=None, *,
                path=None):
    """The rank's rows against every rank's texts on the ring (``_global.ring_blocks``), in
    two passes.  First, each chunk of texts' block while the next chunk travels: the rows'
    log-sum-exps over the chunk and the chunk's column states over the rank's rows (the
    positive logits from the rank's own chunk); the rows' partials are merged in rank order,
    every rank's column states all-gathered (2 N floats a rank) and merged in rank order as
    the all-gather schedule merges them.  Then, with ``w`` (a gradient wanted), each kept
    chunk's gradient block, the texts' gradients summed along the ring to their owners.

    Every chunk runs on the op's block (``block``): the own chunk holds the rank's pairs, on
    the diagonal; another rank's holds none (``positives=False``: G = ½ w (p_row + p_col),
    on the GPU the same tile epilogues with the rows numbered past the columns).
    ``labs`` (P, n): every pair's label (the NumPy path's alone), the same-label pairs off
    the positive left out of both softmaxes in every chunk's block.  ``path`` (with
    ``labs``: the label smoothing's class sums): the images travel with their texts in the
    first pass (the all-gather schedule's bytes), and each chunk adds, for this rank's pairs,
    its images' and texts' sums of their labels (``_variants.cross_groups``; in step order).

    Returns ``(pair losses, lse_r, this rank's texts' lse_c, (da, db, this rank's share of
    d logit_scale) or None, (A_{y_i}, B_{y_i}) (n, D) or None)``; the rank's rows' parts are
    added in step order (own chunk first)."""
    n, rank, size = an.shape[0], comm.rank, comm.size
    chunks: List[Any] = [None] * size
    lse_parts: List[Any] = [None] * size
    states: List[Any] = [None] * size
    own_row_loss = []
    acc, cls = acc_dtype(an.dtype), None
    if path is not None:  # (the class sums: (A_{y_i}, B_{y_i}) of this rank's pairs)
        cls = xp.zeros((n, 2 * an.shape[1]), acc)

    def lab_of(q):  # (chunk q's pairs' labels against this rank's)
        return {} if labs is None else dict(labels=(labs[rank], labs[q]))

    # every pair's raw dot a_j · b_j: the column shift of the other ranks' chunks on the tile
    # path (the all-gather schedule's)
    dots = comm.all_gather(engine.pair_dots(an, bn))

    def stats(k, q, chunk):
        if cls is not None:  # (chunk: the texts, then their images; the pairs' [â | b̂] after
            # this rank's zero rows: each of its pairs' sums over the chunk's of its label)
            pairs = xp.concatenate([chunk[n:], chunk[:n]], axis=1).astype(acc)
            cls[:] += path.class_sums(xp.concatenate([xp.zeros_like(pairs), pairs]),
                                      _variants.cross_groups(xp, labs[rank], labs[q]))[:n]
            chunk = chunk[:n]
        chunks[q] = chunk
        lse_parts[q], states[q], rl, _ = block(
            an, chunk, ls_dev, lse_r=None, lse_c=None, weights=None, want_loss=True,
            want_grad=False, workspace_bytes=ws, col_state=True, positives=q == rank,
            col_shift=engine.pair_dots(an, chunk) if q == rank else dots[q], **lab_of(q))
        if q == rank:
            own_row_loss.append(rl)  # lse over the own chunk − the positive logit
        return None, None

    _global.ring_blocks(comm, bn if cls is None else xp.concatenate([bn, an]), stats,
                        col_grads=False)
    # each row's log-sum-exp from the chunks' ((m, s) = (lse_q, 1)), merged in rank order
    lse_r = _global.merge_lse(engine, lse_parts)
    lse_c = engine.col_lse(comm.all_gather(xp.concatenate(states, axis=1)))
    l_pos = lse_parts[rank] - own_row_loss[0]
    own = lse_c[rank * n:(rank + 1) * n]
    pair = 0.5 * ((lse_r - l_pos) + (own - l_pos))
    cls = None if cls is None else (cls[:, :an.shape[1]], cls[:, an.shape[1]:])
    if w is None:
        return pair, lse_r, own, None, cls

    def grads(k, q, _):
        _, _, _, (da, db, _) = block(
            an, chunks[q], ls_dev, lse_r=lse_r, lse_c=lse_c[q * n:(q + 1) * n], weights=w,
            want_loss=False, want_grad=True, workspace_bytes=ws, positives=q == rank,
            **lab_of(q))
        return da, db

    steps, db = _global.ring_blocks(comm, None, grads, col_grads=True)
    da = _global.sum_steps(steps)
    # d loss / d logit_scale = Σ_i â_i · da_i once, from the summed da (the all-gather
    # schedule's sum; the chunks' parts added would turn an inf into inf − inf = NaN)
    dsp = xp.sum(xp.einsum("ij,ij->i", an.astype(da.dtype, copy=False), da))
    return pair, lse_r, own, (da, db, dsp), cls


def _global_grads(comm: Comm, block, xp, an, b_all, ls, row0: int, lse_r, lse_c, w, ws,
                  smooth=None, masks=None):
    """(da, db, dlogit_scale) accumulators of the rank's block: the texts' gradients summed
    at their owners, d loss / d logit_scale all-reduced (the global value).  ``smooth``: the
    label smoothing's (Δda, Δdb, this rank's share of Δdlogit_scale) of the rank's pairs,
    added (the share before the all-reduce)."""
    _, _, _, (da, db_all, dsp) = block(
        an, b_all, ls, lse_r=lse_r, lse_c=lse_c, weights=w, want_loss=False, want_grad=True,
        workspace_bytes=ws, row0=row0, **(masks or {}))
    db = comm.reduce_scatter(db_all.reshape(comm.size, *an.shape))
    local = dsp.sum().reshape(1) if xp is np else arrays.fixed_sum(dsp, 1).reshape(1)
    if smooth is not None:
        da += smooth[0]
        db += smooth[1]
        local = local + xp.asarray(smooth[2]).reshape(1)
    dscale = comm.all_reduce(local).reshape(())
    return da, db, dscale


def _global_acc(ctx: Context, g):
    """The "none" backward's accumulators and d loss / d logit_scale."""
    s, xp = ctx.saved, ctx.xp
    comm = s["comm"]
    block = _engine.clip if xp is not np else numpy_clip
    # every pair's upstream gradient (its owner's), the weights of the block's columns
    acc = s["lse"][0].dtype
    g_all = comm.all_gather(_global.upstream(xp, g, ctx.n, acc)).reshape(-1)
    w = weights(xp, g_all, "none", ctx.n * comm.size, acc)
    smooth = None
    own = g_all[comm.rank * ctx.n:(comm.rank + 1) * ctx.n]
    if s["eps"] and s["lab"] is not None:  # (with labels: the class sums of every pair)
        smooth = _variants.clip_smoothing_labels(
            xp, Path(xp), s["an"], s["bn"], s["ls"], s["eps"], s["lab"][0], own,
            want_loss=False, every=(s["lab"][1], s["b_all"], g_all, comm.rank * ctx.n))[1]
    elif s["eps"]:  # (A_w: every rank's Σ w â, gathered; B_w from the gathered texts)
        an = s["an"].astype(acc, copy=False)
        a_w = comm.all_gather((own[:, None] * an).sum(axis=0)).sum(axis=0)
        b_w = (g_all[:, None] * s["b_all"].astype(acc, copy=False)).sum(axis=0)
        smooth = _variants.clip_smoothing(xp, s["an"], s["bn"], s["ls"], s["eps"], own,
                                          want_loss=False, sums=s["sums"] + (a_w, b_w))[1]
    da, db, dscale = _global_grads(comm, block, xp, s["an"], s["b_all"], s["ls"],
                                   comm.rank * ctx.n, *s["lse"], w, s["ws"], smooth,
                                   s["masks"])
    return (da, db), (dscale,)


def _global_result(path, xp, saved, grads, scalars):
    """``(da, db, dlogit_scale)``, d loss / d logit_scale in logit_scale's shape and dtype."""
    dscale = xp.asarray(scalars[0]).astype(saved["ls_dtype"], copy=False).reshape(
        saved["ls_shape"])
    return grads[0], grads[1], dscale


_GLOBAL = _global.Schedule(recompute=_global_acc, result=_global_result,
                          scalars=lambda saved: (saved["dscale"],), own_unscaled=True)
