"""SigLIP's pairwise sigmoid loss with a learnable scale and bias, on CuPy and NumPy arrays.

a, b (N, D) are paired rows (image i, text i); the logits are ``exp(logit_scale) · â b̂ᵀ +
logit_bias`` and every pair (i, j) is a binary decision, positive for i = j: ``loss_ij =
−log σ(z_ij L_ij)`` with ``z_ij = +1`` on the diagonal and −1 elsewhere.  No softmax couples
the pairs, so the loss and its gradient need no row statistics: the backward recomputes the
scores from the inputs.  Entry points: :func:`siglip_loss`, :func:`siglip_loss_forward`,
:func:`siglip_loss_backward` → ``(da, db, dlogit_scale, dlogit_bias)``,
:func:`siglip_loss_backward_from_inputs` (the same from the inputs alone).

Reference: Zhai et al., "Sigmoid Loss for Language Image Pre-Training" (SigLIP), ICCV 2023.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from .. import _checks, _engine, config
from .._engine import arrays
from .._engine.kernels import acc_dtype
from . import _comm, _cpu, _global, _graphs, _memo, _variants
from ._base import (Context, Path, contig_inputs, contig_remembered, finish_all,
                    in_ctx_precision, prep, reduce, require, weights)
from ._comm import Comm

__all__ = ["siglip_loss", "siglip_loss_forward", "siglip_loss_backward",
           "siglip_loss_backward_from_inputs"]

OP = "siglip_loss"


def numpy_siglip(an, bn, ls, lb, *, weights, want_loss: bool, want_grad: bool,
                 row0: int = 0, col0: int = 0):
    """The NumPy path: ``(row_loss, (da, db, dscale, dbias))`` in the accumulation dtype
    (None where not asked for), on the namespace of ``_cpu.current()``.  an holds the rows
    ``row0 ..`` of the image side, bn the columns ``col0 ..`` (every column, or one rank's
    chunk of them: row r's positive is global column row0 + r, where bn holds it; the weights
    are read at the global rows).  Keeps the n × Nc logits (CPU memory, small sizes)
    and, for the loss, one more n × Nc buffer.

    Off the diagonal ``z = −1``: the terms are softplus(L) and ``G = w σ(L)``, one pass each
    over the logits; the n positives are set apart (``softplus(−L)``, ``G = −w σ(−L)``: exact
    where σ(L) rounds to 1).  ``dt = Σ_ij G_ij (L_ij − β)`` is ``Σ_i â_i · da_i``."""
    xp = _cpu.current()
    a = acc_dtype(an.dtype)
    aa, ba = (xp.astype(xp.asarray(x), a) for x in (an, bn))
    n = aa.shape[0]
    scale = float(np.exp(np.asarray(ls, a).reshape(())))
    bias = float(np.asarray(lb, a).reshape(()))
    logits = xp.matmul(aa, ba.T)
    logits *= scale
    logits += bias
    grow = xp.arange(n) + row0  # the global rows
    on = (grow >= col0) & (grow < col0 + ba.shape[0])  # rows whose positive bn holds
    idx, pos = xp.arange(n)[on], grow[on] - col0
    l_pos = logits[idx, pos]
    row_loss = grads = None
    if want_loss:
        terms = xp.softplus(logits)
        terms[idx, pos] = xp.softplus(-l_pos)
        row_loss = xp.sum(terms, axis=1)
        del terms
    if want_grad:
        w_arr, stride, mul = weights
        w = (xp.full((n,), float(mul), a) if w_arr is None
             else xp.astype(xp.asarray(w_arr)[grow * stride] * mul, a))
        with xp.errstate(invalid="ignore"):  # (NaN scores give NaN gradients)
            g = xp.sigmoid(logits, out=logits)
            g *= w[:, None]
            g[idx, pos] = -w[idx] * xp.sigmoid(-l_pos)
        da = g @ ba
        da *= scale
        db = g.T @ aa
        db *= scale
        dscale = xp.sum(xp.einsum("ij,ij->i", aa, da))
        dbias = xp.sum(xp.sum(g, axis=1))  # (rows first: an order that no thread count changes)
        grads = (da, db, dscale, dbias)
    host = xp.host
    return host(row_loss), grads and tuple(host(x) for x in grads)


def _check(a, b, logit_scale, logit_bias, reduction, workspace_bytes, normalize, precision):
    xp = _checks.check_pairs(OP, a, b)
    ls, ls_shape = _checks.check_logit_scale(OP, logit_scale, xp, acc_dtype(a.dtype))
    lb, lb_shape = _checks.check_scalar_input(OP, "logit_bias", logit_bias, xp)
    for name, v in (("logit_scale", ls), ("logit_bias", lb)):
        _checks.check_scalar_device(OP, name, v, a, xp)
    return xp, (ls, ls_shape), (lb, lb_shape), _checks.check_flags(
        OP, reduction, workspace_bytes, normalize, precision)


def numpy_engine(an, bn, ls, lb, *, weights, want_loss: bool, want_grad: bool,
                 workspace_bytes=None, row0: int = 0, col0: int = 0):
    """:func:`numpy_siglip` with the GPU engine's signature (``workspace_bytes`` unused)."""
    return numpy_siglip(an, bn, ls, lb, weights=weights, want_loss=want_loss,
                        want_grad=want_grad, row0=row0, col0=col0)


def gpu_engine(an, bn, ls, lb, *, weights, want_loss: bool, want_grad: bool,
               workspace_bytes=None, row0: int = 0, col0: int = 0):
    """``cupynce._engine.siglip`` with the scalars as (1,) device arrays of the accumulator
    dtype (a Python float becomes one by a fill kernel; a device array is never read)."""
    acc = acc_dtype(an.dtype)
    ls_dev, lb_dev = (arrays.scalar(v, acc) if isinstance(v, float)
                      else v.astype(acc, copy=False).reshape(1) for v in (ls, lb))
    if not isinstance(ls, float):  # (a device value past the host check's limit: NaN)
        ls_dev = arrays.guard_log_scale(ls_dev, _checks.LOG_SCALE_LIMIT)
    return _engine.siglip(an, bn, ls_dev, lb_dev, weights=weights, want_loss=want_loss,
                          want_grad=want_grad, workspace_bytes=workspace_bytes, row0=row0,
                          col0=col0)


def _engine_for(xp):
    return numpy_engine if xp is np else gpu_engine


def _with_labels(engine, xp, path, groups):
    """``engine`` plus the labels' O(N·D) difference (``_variants.siglip_labels``): the same
    signature and results; ``groups`` None: ``engine`` itself."""
    if groups is None:
        return engine

    def run(an, bn, ls, lb, *, weights, want_loss: bool, want_grad: bool, row0: int = 0,
            **kw):
        row_loss, grads = engine(an, bn, ls, lb, weights=weights, want_loss=want_loss,
                                 want_grad=want_grad, row0=row0, **kw)
        drow, dgrads = _variants.siglip_labels(
            xp, path, an, bn, groups, ls, lb,
            _variants.row_weights(weights) if want_grad else None, want_loss=want_loss,
            row0=row0)
        if want_loss:
            row_loss += drow
        if want_grad:
            da, db, dscale, dbias = grads
            da += dgrads[0]
            db += dgrads[1]
            grads = (da, db, dscale + dgrads[2], dbias + dgrads[3])
        return row_loss, grads
    return run


def siglip_loss_forward(a, b, logit_scale, logit_bias, *, labels=None, reduction: str = "mean",
                        normalize: bool = False, workspace_bytes: Optional[int] = None,
                        requires_grad: bool = True, group=None,
                        precision: Optional[str] = None) -> Tuple[Any, Context]:
    """SigLIP's sigmoid loss and a context for :func:`siglip_loss_backward`.

    Parameters
    ----------
    a, b : (N, D) arrays — image and text embeddings, pair i is (a_i, b_i).
    logit_scale : real, or 0-d / (1,) array: t, the scale is s = exp(t) (SigLIP: log 10).
    logit_bias : real, or 0-d / (1,) array: β (SigLIP: −10).
        Device arrays are never read back to the host.  Pass learnable values as arrays: a
        Python float is a constant of the call (on the GPU it is part of the CUDA-graph key
        of repeated calls, so a float that changes every step is captured anew each time).
    labels : None or an integer (N,) array of the inputs' kind, on their device
        Pairs (i, j) with equal labels are positives too (z_ij = +1): duplicates and
        same-class pairs.  An O(N·D) difference from the plain loss
        (``cupynce.ops._variants.siglip_labels``, class sums in a fixed order): every path
        serves it; no CUDA-graph replay.  With ``group``: each rank's rows' labels, gathered
        with the texts (every rank passes labels, or none does).
    reduction : "mean" (the sum over all N² pairs divided by N, as open_clip and big_vision)
        | "sum" (the sum over the pairs) | "none" (the (N,) per-row sums).
    normalize, workspace_bytes, requires_grad : as for nt_xent.
    group : communicator, optional
        The loss of the global batch across ranks (every rank's images against every rank's
        texts), as for :func:`cupynce.clip_loss_forward`: each rank computes the n × N block
        of its rows; the gradients from ``*_backward`` follow the data-parallel convention (P
        times the global loss's with respect to the local rows); the scale's and bias's are
        the global ones on every rank.
    precision : "auto" | "fp32" | "tf32" | "3xtf32", optional
        float32 products on the GPU; as for :func:`cupynce.nt_xent_forward`.

    Notes
    -----
    ``L = s · â b̂ᵀ + β``, ``z_ij = 2 [i = j] − 1``, ``row_i = Σ_j −log σ(z_ij L_ij)``.
    Gradients, with ``G_ij = −w_i z_ij σ(−z_ij L_ij)``: ``dâ = s G b̂``, ``db̂ = s Gᵀ â``,
    ``dt = Σ_ij G_ij (L_ij − β)``, ``dβ = Σ_ij G_ij``.  −log σ(x) is evaluated as
    softplus(−x): finite for any finite logit.
    """
    if group is not None:
        return _global_forward(
            _comm.wrap(group), a, b, logit_scale, logit_bias, labels=labels,
            reduction=reduction, normalize=normalize, workspace_bytes=workspace_bytes,
            requires_grad=requires_grad, precision=precision)
    sig = _memo.signature(OP, a, b, logit_scale, logit_bias)
    hit = _memo.known(sig)
    if hit:  # the arrays and scalars passed these checks before, laid out (_memo)
        xp, ls, lb = _checks.cupy_module(), logit_scale, logit_bias
        ls_shape = () if type(ls) is float else ls.shape
        lb_shape = () if type(lb) is float else lb.shape
        p = _checks.check_flags(OP, reduction, workspace_bytes, normalize, precision)
    else:
        xp, (ls, ls_shape), (lb, lb_shape), p = _check(
            a, b, logit_scale, logit_bias, reduction, workspace_bytes, normalize, precision)
    _checks.check_bool(OP, "requires_grad", requires_grad)
    n = a.shape[0]
    labels = _checks.check_labels(OP, labels, n, xp, a)
    path = Path(xp)
    groups = None if labels is None else _variants.label_groups(xp, labels)
    engine = _with_labels(_engine_for(xp), xp, path, groups)
    acc = acc_dtype(a.dtype)
    (a, b), sig = contig_remembered(xp, sig, hit, a, b)
    fused = requires_grad and reduction != "none"
    ls_host, lb_host = isinstance(ls, float), isinstance(lb, float)
    on_host = (ls if ls_host else None, lb if lb_host else None)

    def compute(a, b, *scalars):
        scalars = iter(scalars)  # the device scalars, in order (the host ones are baked in)
        s = [v if v is not None else next(scalars) for v in on_host]
        an, na = prep(path, a, normalize)
        bn, nb = prep(path, b, normalize)
        row_loss, grads = engine(an, bn, *s, weights=weights(xp, None, reduction, n, acc),
                                 want_loss=True, want_grad=fused,
                                 workspace_bytes=workspace_bytes)
        return (reduce(xp, row_loss, reduction),) + (grads or (None,) * 4) + (na, nb), (an, bn)

    device = (() if ls_host else (ls,)) + (() if lb_host else (lb,))
    with config.float32_precision(p):  # (the graph key carries it too)
        # (nothing kept that aliases the inputs; labels are no input a graph replays)
        if path.gpu and (fused or not requires_grad) and groups is None:
            outs = _graphs.run((OP, on_host, reduction, normalize, workspace_bytes, fused),
                               (a, b) + device, lambda *xs: compute(*xs)[0], layout=sig)
        else:
            outs, xn = compute(a, b, *device)
    loss, da, db, dscale, dbias, na, nb = outs
    ctx = Context(OP, reduction, n, xp, precision=p)
    base = dict(x=(a, b), norms=(na, nb), shapes=(ls_shape, lb_shape),
                dtypes=tuple(acc if isinstance(v, float) else v.dtype for v in (ls, lb)))
    if fused:
        ctx.saved = dict(base, acc=(da, db), dscalars=(dscale, dbias))
    elif requires_grad:
        ctx.saved = dict(base, xn=xn, scalars=(ls, lb), ws=workspace_bytes, groups=groups)
    return loss, ctx


@in_ctx_precision
def siglip_loss_backward(ctx: Context, grad_loss: Any = 1.0):
    """Gradients ``(da, db, dlogit_scale, dlogit_bias)`` of :func:`siglip_loss_forward`'s loss.

    ``dlogit_scale`` / ``dlogit_bias`` have the shape and dtype of logit_scale / logit_bias
    (0-d float32 / float64 when a Python float was given); da, db follow the inputs' dtype.
    The products run in the forward's float32 precision (``ctx.precision``).
    """
    require(ctx, OP)
    if "global" in ctx.saved:
        return _global.backward(ctx, grad_loss)
    xp, s = ctx.xp, ctx.saved
    path = Path(xp)
    g = _checks.check_grad_loss(f"{OP}_backward", grad_loss, ctx.reduction, ctx.n, xp)
    acc = acc_dtype(s["x"][0].dtype)
    if "acc" in s:
        gs = path.grad_scale(g, acc)
        da, db = finish_all(path, s["x"], s["norms"], s["acc"], gs)
        scalars = tuple(v if gs is None else v * gs.reshape(()) for v in s["dscalars"])
    else:
        an, bn = s["xn"]
        engine = _with_labels(_engine_for(xp), xp, path, s.get("groups"))
        _, (da_acc, db_acc, dscale, dbias) = engine(
            an, bn, *s["scalars"], weights=weights(xp, g, ctx.reduction, ctx.n, acc),
            want_loss=False, want_grad=True, workspace_bytes=s["ws"])
        da, db = finish_all(path, s["x"], s["norms"], (da_acc, db_acc), None)
        scalars = (dscale, dbias)
    dls, dlb = (path.owned_copy(xp.asarray(v), dt).reshape(shape)
                for v, dt, shape in zip(scalars, s["dtypes"], s["shapes"]))
    return da, db, dls, dlb


def siglip_loss_backward_from_inputs(a, b, logit_scale, logit_bias, grad_loss: Any = 1.0, *,
                                     labels=None, reduction: str = "mean",
                                     normalize: bool = False,
                                     workspace_bytes: Optional[int] = None,
                                     precision: Optional[str] = None):
    """``(da, db, dlogit_scale, dlogit_bias)`` from the inputs alone (no forward context: the
    loss needs no row statistics), for callers that keep nothing between forward and
    backward (the PyTorch ops with reduction "none").  Same result as
    :func:`siglip_loss_backward` on the forward's context (given the forward's
    ``precision``; None: the global default)."""
    xp, (ls, ls_shape), (lb, lb_shape), p = _check(a, b, logit_scale, logit_bias, reduction,
                                                    workspace_bytes, normalize, precision)
    path = Path(xp)
    acc = acc_dtype(a.dtype)
    labels = _checks.check_labels(OP, labels, a.shape[0], xp, a)
    a, b = contig_inputs(xp, a, b)
    an, na = prep(path, a, normalize)
    bn, nb = prep(path, b, normalize)
    ctx = Context(OP, reduction, a.shape[0], xp, precision=p, saved=dict(
        x=(a, b), norms=(na, nb), shapes=(ls_shape, lb_shape),
        dtypes=tuple(acc if isinstance(v, float) else v.dtype for v in (ls, lb)),
        xn=(an, bn), scalars=(ls, lb), ws=workspace_bytes,
        groups=None if labels is None else _variants.label_groups(xp, labels)))
    return siglip_loss_backward(ctx, grad_loss)


def siglip_loss(a, b, logit_scale, logit_bias, *, labels=None, reduction: str = "mean",
                normalize: bool = False, workspace_bytes: Optional[int] = None, group=None,
                precision: Optional[str] = None):
    """SigLIP's sigmoid loss; see :func:`siglip_loss_forward`."""
    return siglip_loss_forward(a, b, logit_scale, logit_bias, labels=labels,
                               reduction=reduction,
                               normalize=normalize, workspace_bytes=workspace_bytes,
                               requires_grad=False, group=group, precision=precision)[0]


# ---- across ranks: this op's schedule for cupynce.ops._global ----------------------------
def _global_forward(comm: Comm, a, b, logit_scale, logit_bias, *, labels=None,
                    reduction="mean", normalize=False, workspace_bytes=None,
                    requires_grad=True, precision=None):
    """:func:`siglip_loss_forward` over ``comm``'s global batch: the rank's n × N
    block of its images against every text (b all-gathered), no softmax so no statistics to
    exchange; the texts' gradients are reduce-scattered to their owners and the scale's and
    bias's all-reduced (the global values on every rank)."""
    op = "siglip_loss"
    precision = _global.precision_setting(precision)
    ls_array, lb_array = hasattr(logit_scale, "shape"), hasattr(logit_bias, "shape")
    (xp, (ls, ls_shape), (lb, lb_shape), p), ring = _global.agree(comm, op, lambda: (
        _check(a, b, logit_scale, logit_bias, reduction, workspace_bytes, normalize,
               precision),
        _checks.check_bool(op, "requires_grad", requires_grad),
        _checks.check_labels(op, labels, a.shape[0], _checks.array_module(op, a=a), a))[0],
        [a, b], ["a", "b"],
        [0.0 if ls_array else logit_scale, ls_array, 0.0 if lb_array else logit_bias,
         lb_array, reduction, normalize, requires_grad, precision, labels is not None],
        ring_wish=lambda: _global.ring_possible(comm, a, requires_grad, reduction,
                                                gpu=labels is None))
    with config.float32_precision(p):  # every product of the rank's share (and graph keys)
        path = Path(xp)
        size = comm.size
        n = a.shape[0]
        acc = acc_dtype(a.dtype)
        a, b = contig_inputs(xp, a, b)
        an, na = prep(path, a, normalize)
        bn, nb = prep(path, b, normalize)
        fused = requires_grad and reduction != "none"
        w = weights(xp, None, reduction, n * size, acc)
        ctx = Context(op, reduction, n, xp, precision=p)
        base = dict(x=(a, b), norms=(na, nb), size=size, shapes=(ls_shape, lb_shape),
                    dtypes=tuple(acc if isinstance(v, float) else v.dtype for v in (ls, lb)))
        if ring:
            labs = None if labels is None else comm.all_gather(
                xp.ascontiguousarray(labels, dtype=np.int64))  # (P, n): every rank's labels
            rows, grads = _ring_share(comm, xp, path, an, bn, ls, lb, w, fused, workspace_bytes,
                                      labs)
            if fused:
                da, db, dscale, dbias = grads
                ctx.saved = dict(base, acc=(da, db),
                                 dscalars=_global_scalars(comm, xp, dscale, dbias))
            return _global.loss(comm, xp, rows, reduction, n * size), _global.tag(ctx, _GLOBAL)
        b_all = comm.all_gather(bn).reshape(n * size, -1)
        groups = None  # (labels: every rank's texts', gathered with them, then grouped)
        if labels is not None:
            labels = xp.ascontiguousarray(labels, dtype=np.int64)
            groups = _variants.label_groups(xp, comm.all_gather(labels).reshape(-1))
        engine = _with_labels(_engine_for(xp), xp, path, groups)
        rows, grads = engine(an, b_all, ls, lb, weights=w, want_loss=True, want_grad=fused,
                             workspace_bytes=workspace_bytes, row0=comm.rank * n)
        if fused:
            da, db, dscale, dbias = _global_scatter(comm, xp, grads, an.shape)
            ctx.saved = dict(base, acc=(da, db), dscalars=(dscale, dbias))
        elif requires_grad:
            ctx.saved = dict(base, an=an, b_all=b_all, scalars=(ls, lb), ws=workspace_bytes,
                             comm=comm, groups=groups)
        return _global.loss(comm, xp, rows, reduction, n * size), _global.tag(ctx, _GLOBAL)


def _ring_share(comm: Comm, xp, path, an, bn, ls, lb, w, fused: bool, workspace_bytes,
                labs=None):
    """The rank's rows against every rank's texts chunk by chunk on the ring
    (:func:`cupynce.ops._global.ring_blocks`): each chunk's block while the next travels, the
    texts' gradients summed along the ring to their owners.  Returns ``rows, grads`` as the
    all-gather schedule's engine call, but with ``grads = (da, db of this rank's texts,
    dscale, dbias)`` (this rank's rows' scalar parts, to all-reduce); the steps' parts are
    added in step order (own chunk first).  ``labs`` (P, n): every rank's labels, whose
    O(n·D) difference each chunk's block adds (``_variants.siglip_labels_block``)."""
    n, rank = an.shape[0], comm.rank
    engine = _engine_for(xp)
    w_row = _variants.row_weights(w) if fused else None

    def block(k, q, chunk):
        rows, grads = engine(an, chunk, ls, lb, weights=w, want_loss=True, want_grad=fused,
                             workspace_bytes=workspace_bytes, row0=rank * n, col0=q * n)
        if labs is not None:
            drow, dg = _variants.siglip_labels_block(xp, path, an, chunk, labs[rank], labs[q],
                                                     ls, lb, w_row, same=q == rank)
            rows = rows + drow
            if fused:  # (Δ∂/∂t: in dscale from the summed da below)
                grads = (grads[0] + dg[0], grads[1] + dg[1], None, grads[3] + dg[2])
        if not fused:
            return (rows,), None
        return (rows, grads[0], grads[3]), grads[1]  # (rows, da, dbias; dscale below)

    steps, db = _global.ring_blocks(comm, bn, block, col_grads=fused)
    total = _global.sum_steps(steps)
    if not fused:
        return total[0], None
    rows, da, dbias = total
    # d loss / d logit_scale = Σ_i â_i · da_i once from the summed da (as the engine: a sum
    # over the chunks' parts would turn an inf into inf − inf = NaN)
    dscale = xp.sum(xp.einsum("ij,ij->i", an.astype(da.dtype, copy=False), da))
    return rows, (da, db, dscale, dbias)


def _global_scatter(comm: Comm, xp, grads, shape):
    """The rank's (da, db) accumulators (the texts' gradients summed at their owners) and
    the all-reduced d loss / d logit_scale, d loss / d logit_bias."""
    da, db_all, dscale, dbias = grads
    db = comm.reduce_scatter(db_all.reshape(comm.size, *shape))
    return (da, db) + _global_scalars(comm, xp, dscale, dbias)


def _global_scalars(comm: Comm, xp, dscale, dbias):
    """d loss / d logit_scale, d loss / d logit_bias of the global loss from this rank's
    parts: one all-reduce of both (the same bits on every rank)."""
    both = comm.all_reduce(xp.stack([xp.asarray(dscale).reshape(()),
                                     xp.asarray(dbias).reshape(())]))
    return both[0], both[1]


def _global_acc(ctx: Context, g):
    """The "none" backward's accumulators and d loss / d logit_scale, d loss / d logit_bias."""
    s, xp = ctx.saved, ctx.xp
    comm = s["comm"]
    acc = acc_dtype(s["x"][0].dtype)
    g_all = comm.all_gather(_global.upstream(xp, g, ctx.n, acc)).reshape(-1)
    w = weights(xp, g_all, "none", ctx.n * comm.size, acc)
    engine = _with_labels(_engine_for(xp), xp, Path(xp), s["groups"])
    _, grads = engine(s["an"], s["b_all"], *s["scalars"], weights=w, want_loss=False,
                      want_grad=True, workspace_bytes=s["ws"], row0=comm.rank * ctx.n)
    da, db, dscale, dbias = _global_scatter(comm, xp, grads, s["an"].shape)
    return (da, db), (dscale, dbias)


def _global_result(path, xp, saved, grads, scalars):
    """``(da, db, dlogit_scale, dlogit_bias)``, the scalars' in their shapes and dtypes."""
    dls, dlb = (path.owned_copy(xp.asarray(v), dt).reshape(shape)
                for v, dt, shape in zip(scalars, saved["dtypes"], saved["shapes"]))
    return grads[0], grads[1], dls, dlb


_GLOBAL = _global.Schedule(recompute=_global_acc, result=_global_result,
                          scalars=lambda saved: saved["dscalars"])
