"""The global InfoNCE family across ranks: every rank gets the loss of the whole batch.

With P ranks of a :class:`~cupynce.ops._comm.Comm`, each holding n local rows (the same n
everywhere; the global batch is the concatenation in rank order), each rank computes its
rows' share with the single-process engine (``_local`` blocks, CLIP's rectangular block) and
the collectives assemble the rest.  Never an n × N logits matrix; the bytes sent are O(N·D).

* **NT-Xent** (z = [view 1; view 2] of the rank's n images; the global batch is [every
  rank's view 1; every rank's view 2], lightly's ``gather_distributed`` semantics, exactly):
  z and its rows' positive dots are all-gathered.  S = Z Zᵀ is symmetric and every positive
  sits in a diagonal rank block, so each unordered pair of rank blocks is computed once
  (``_local.NtXentPlan``): a rank takes its diagonal block (the single-process symmetric
  NT-Xent) and about (P − 1) / 2 of its off-diagonal blocks (``engine.cross``: its rows'
  statistics and the other rows' column (m, s) states in one pass); the (2, ~N) states are
  all-gathered and each rank merges its rows' partials in a fixed order, then gathers every
  row's lse (2n floats a rank) for the gradient pass over the same blocks.  About half the
  products of computing each rank's rows against every column.
* **InfoNCE**: keys (and shared (M, D) negatives) all-gathered; per-query negatives stay.
* **CLIP, one block for both directions**: only b is all-gathered.  The rank computes the
  n × N block of its images against every text once: its rows' log-sum-exps (image → text,
  complete) and every column's partial (m, s) state over its n rows; the (2, N) states are
  all-gathered and merged in rank order into each text's column log-sum-exp (the same bits
  on every rank); the gradient pass reuses the block's recompute for both directions.  Half
  the products of computing the rows of both directions separately (open_clip's
  ``local_loss=True``), and half its gather.
* The loss of the mean / sum is all-reduced (a scalar): every rank returns the global loss;
  ``reduction="none"`` returns the rank's own rows of the global per-row loss.
* Gradients: the column-side gradients are reduce-scattered to the ranks that own those rows,
  in float32 (float64 for float64 inputs).  With ``reduction`` mean / sum and a gradient
  wanted, this happens in the forward (the backward is then local: it scales the rank's
  O(n·D) accumulators); ``"none"`` recomputes in the backward, which then holds collectives
  (all ranks must run it).

**Gradient convention (data parallel).**  DDP (and any data-parallel loop) averages the
parameter gradients over the ranks, so each rank's backward returns P times the gradient of
the global loss with respect to its local rows: after the average, the parameter gradients
equal those of one process training on the whole batch.  ``logit_scale``'s gradient is the
global one on every rank (its average is itself).

**Checks.**  Every rank runs the single-process op's checks, then exchanges its problems,
local shapes, dtypes and settings (one small all-gather; the settings hold the float32
``precision`` resolved, which the rank's share and its backward then run in): one rank's bad
input, unequal local sizes or disagreeing settings raise on every rank (the rank at fault
re-raises its own error), never a hang or a wrong number.  That exchange is the one host read
of the forward; the backward has none.  Deterministic for a fixed world size.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from .. import _checks, _engine
from .. import config
from .._engine import arrays
from .._engine.kernels import acc_dtype
from . import _local, _numpy
from . import clip as clip_op
from . import info_nce as info_nce_op
from . import nt_xent as nt_xent_op
from . import siglip as siglip_op
from ._base import (Context, Path, contig_inputs, finish_all, in_ctx_precision, prep, require,
                    row_weight, weights)
from ._comm import Comm

_DTYPE_CODE = {"float16": 1, "bfloat16": 2, "float32": 3, "float64": 4}
#: the string settings (reduction, float32 precision) as numbers to compare across ranks
_STR_CODE = {"mean": 0, "sum": 1, "none": 2, "fp32": 10, "tf32": 11, "3xtf32": 12,
             "auto": 13}


def _setting(v: Any) -> float:
    """A setting as a float to compare across ranks (NaN where it has none: the local
    checks reject such a value before it matters)."""
    if isinstance(v, str):
        return float(_STR_CODE.get(v, -1))
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _precision_setting(precision: Any) -> Any:
    """``precision=`` resolved (None → the global default) as the ranks compare it; a bad
    value as given (the local checks raise it, on every rank through the exchange).  Each
    forward resolves once and hands the result to both its local checks and the exchange, so
    the mode the ranks agreed on is the one the rank runs (a ``set_float32_precision`` from
    another thread between two reads cannot split them)."""
    try:
        return _checks.check_precision("", precision)
    except ValueError:
        return precision


def _dtype_name(code: int) -> str:
    return {c: n for n, c in _DTYPE_CODE.items()}.get(code, "?")


def agree(comm: Comm, op: str, local_checks: Callable[[], Any], arrays_: Sequence[Any],
          names: Sequence[str], settings: Sequence[Any]):
    """Run ``local_checks`` and exchange its outcome, the arrays' shapes / dtypes and the
    ``settings`` (numbers, bools, the reduction) with every rank; raise on every rank if any
    rank failed or they differ.

    Returns ``local_checks()``'s result.  The first collective of every call, of the same
    length on every rank: a rank whose inputs are wrong still takes part, so the others never
    wait on it.
    """
    err: Optional[BaseException] = None
    result = None
    pending = getattr(comm, "pending", None)  # an adapter's own argument check failed
    try:
        if pending is not None:
            raise pending
        result = local_checks()
        problem = comm.problem(arrays_)
        if problem is not None:
            err = ValueError(f"{op}: {problem}")
    except (TypeError, ValueError) as e:
        err = e
    meta: List[int] = [int(err is not None)]
    for v in settings:  # float64 bits as two int32 halves: exact comparison
        bits = int(np.array(_setting(v), np.float64).view(np.int64))
        meta += [bits >> 32, bits & 0xFFFFFFFF]
    base = len(meta)
    for x in arrays_:  # 5 integers an array: its ndim, shape (padded to 3), dtype
        shape = getattr(x, "shape", None)
        if x is None or not isinstance(shape, tuple):
            meta += [-1, 0, 0, 0, 0]
            continue
        meta += [len(shape)] + [int(d) for d in shape[:3]] + [0] * (3 - min(len(shape), 3)) \
            + [_DTYPE_CODE.get(str(getattr(x, "dtype", "")), 0)]
    rows = comm.exchange(meta)
    if err is not None:
        raise err
    bad = [i for i, r in enumerate(rows) if r[0]]
    if bad:
        raise ValueError(f"{op}: invalid inputs on rank(s) {bad} of the group (the error is "
                         f"raised there too)")
    if any(r[1:base] != rows[0][1:base] for r in rows):
        raise ValueError(f"{op}: every rank of the group must pass the same settings "
                         f"(temperature or logit_scale kind, reduction, normalize, "
                         f"requires_grad, float32 precision), got {[r[1:base] for r in rows]}")
    if any(r != rows[0] for r in rows):
        desc = "; ".join(
            f"rank {i}: " + ", ".join(
                f"{nm} {tuple(r[base + 1 + 5 * j:base + 1 + 5 * j + min(r[base + 5 * j], 3)])}"
                f" {_dtype_name(r[base + 5 * j + 4])}"
                for j, nm in enumerate(names) if r[base + 5 * j] >= 0)
            for i, r in enumerate(rows))
        raise ValueError(f"{op}: every rank of the group must pass the same local shapes and "
                         f"dtypes (equal local batch sizes), got {desc}")
    return result


# ---- shared pieces ------------------------------------------------------------------------
def _others(xp, parts, rank: int):
    """The rows of every rank but this one, in rank order ((P, r, D) → ((P − 1) r, D)), or
    None for one rank."""
    if parts.shape[0] == 1:
        return None
    return xp.concatenate([parts[:rank], parts[rank + 1:]]).reshape(-1, parts.shape[-1])


def _stack_own(xp, own, other, rank: int):
    """(P, rows, D): the other ranks' blocks of ``other`` (rank order, this rank left out)
    with ``own`` at this rank's place: what the reduce-scatter sends."""
    if other is None:
        return own[None]
    blocks = other.reshape(-1, *own.shape)
    return xp.concatenate([blocks[:rank], own[None], blocks[rank:]])


def _loss(comm: Comm, xp, rows, reduction: str, count: int):
    """The reduced loss of every rank's rows (``count`` in all): the sum or the mean as an
    all-reduced 0-d array (each rank adds its rows in a fixed order first); for "none" this
    rank's rows."""
    if reduction == "none":
        return rows
    div = count if reduction == "mean" else 1
    local = np.asarray(rows.sum() / rows.dtype.type(div)) if xp is np else \
        arrays.fixed_sum(rows, div)
    return comm.all_reduce(local.reshape(1)).reshape(())


def _scale(path: Path, g, size: int, a):
    """``size · g`` as the finishing kernels take it (the data-parallel factor P)."""
    if isinstance(g, float):
        return path.grad_scale(g * size, a)
    return path.grad_scale(g, a) * a.type(size)


def _tags(ctx: Context) -> Context:
    ctx.saved["global"] = True
    return ctx


# ---- NT-Xent ------------------------------------------------------------------------------
def nt_xent_forward(comm: Comm, z, temperature=0.5, *, reduction="mean", normalize=False,
                    workspace_bytes=None, requires_grad=True, precision=None):
    """:func:`cupynce.nt_xent_forward` over ``comm``'s global batch (see the module notes).

    ``z`` (2n, D): this rank's [view 1 of its n images; view 2 of them].  Returns the global
    loss (this rank's 2n rows of it for "none") and a context for :func:`backward`.
    """
    op = "nt_xent"
    precision = _precision_setting(precision)
    xp, t, p = agree(comm, op, lambda: (
        nt_xent_op._check(z, temperature, reduction, workspace_bytes, normalize, precision),
        _checks.check_bool(op, "requires_grad", requires_grad))[0], [z], ["z"],
        [temperature, reduction, normalize, requires_grad, precision])
    with config.float32_precision(p):  # every product of the rank's share (and graph keys)
        path = Path(xp)
        engine = _engine_for(xp)
        rank, size = comm.rank, comm.size
        n2 = z.shape[0]
        z = contig_inputs(xp, z)[0]
        zn, norm = prep(path, z, normalize)
        plan = _local.NtXentPlan(rank, size, n2)
        parts = comm.all_gather(zn)
        dots = engine.pair_dots(zn[:n2 // 2], zn[n2 // 2:])  # the rows' raw positive dots
        dots = comm.all_gather(xp.concatenate([dots, dots]))
        scale = 1.0 / t
        lse_d, loss_d, partial, state = _local.nt_xent_stats(path, engine, plan, zn, parts, dots,
                                                             scale, workspace_bytes)
        states = comm.all_gather(state) if plan.width else None
        lse = _local.nt_xent_lse(plan, engine, lse_d, partial, states)
        rows = loss_d + (lse - lse_d)
        ctx = Context(op, reduction, n2, xp, stats=(lse,) if requires_grad else (),
                      precision=p)
        if requires_grad:
            lse_all = comm.all_gather(lse) if size > 1 else lse[None]
            base = dict(x=(z,), norms=(norm,), size=size)
            if reduction != "none":
                w_mul = row_weight(reduction, n2 * size)
                acc = _local.nt_xent_grads(path, engine, plan, zn, parts, scale, lse_all, None,
                                           w_mul, workspace_bytes)
                ctx.saved = dict(base, acc=(comm.reduce_scatter(acc),))
            else:
                ctx.saved = dict(base, plan=plan, zn=zn, parts=parts, lse_all=lse_all,
                                 scale=scale, ws=workspace_bytes, comm=comm)
        return _loss(comm, xp, rows, reduction, n2 * size), _tags(ctx)


def _nt_xent_acc(ctx: Context, g):
    s, xp = ctx.saved, ctx.xp
    comm = s["comm"]
    w_all = comm.all_gather(_upstream(xp, g, ctx.n, s["lse_all"].dtype))
    engine = _engine_for(xp)
    acc = _local.nt_xent_grads(Path(xp), engine, s["plan"], s["zn"], s["parts"], s["scale"],
                               s["lse_all"], w_all, 1.0, s["ws"])
    return (comm.reduce_scatter(acc),)


def _upstream(xp, g, n: int, acc):
    """This rank's rows' upstream gradients as an (n,) array (a float broadcast)."""
    if isinstance(g, float):
        return xp.full((n,), g, acc)
    return xp.ascontiguousarray(xp.broadcast_to(g.astype(acc, copy=False), (n,)))


# ---- InfoNCE ------------------------------------------------------------------------------
def info_nce_forward(comm: Comm, query, key, temperature=0.1, *, negatives=None,
                     reduction="mean", normalize=False, workspace_bytes=None,
                     requires_grad=True, precision=None):
    """:func:`cupynce.info_nce_forward` over ``comm``'s global batch (see the module notes).

    Every rank's keys and shared (M, D) negatives join every query's candidates; per-query
    (n, M, D) negatives stay with their query.
    """
    op = "info_nce"
    precision = _precision_setting(precision)
    kind = 0 if negatives is None else getattr(negatives, "ndim", 0) - 1
    xp, t, p = agree(comm, op, lambda: (
        info_nce_op._check(query, key, negatives, temperature, reduction, workspace_bytes,
                           normalize, precision),
        _checks.check_bool(op, "requires_grad", requires_grad))[0],
        [query, key, negatives], ["query", "key", "negatives"],
        [temperature, reduction, normalize, requires_grad, kind, precision])
    with config.float32_precision(p):  # every product of the rank's share (and graph keys)
        path = Path(xp)
        rank, size = comm.rank, comm.size
        n = query.shape[0]
        (query, key, negatives), (nq, nk, nneg), (qn, kn, neg_s, neg_p) = info_nce_op._prep_all(
            xp, path, query, key, negatives, normalize)
        others = _others(xp, comm.all_gather(kn), rank)
        if neg_s is not None:  # every rank's shared negatives, in rank order, after the keys
            every = comm.all_gather(neg_s).reshape(-1, neg_s.shape[1])
            others = every if others is None else xp.concatenate([others, every])
        a = acc_dtype(query.dtype)
        fused = requires_grad and reduction != "none"
        lse, rows, grads = _local.info_nce_block(
            path, qn, kn, others, neg_p, 1.0 / t, lse_in=None,
            weights=weights(xp, None, reduction, n * size, a), want_grad=fused,
            workspace_bytes=workspace_bytes)
        ctx = Context(op, reduction, n, xp, stats=(lse,) if requires_grad else (),
                      precision=p)
        base = dict(x=(query, key, negatives), norms=(nq, nk, nneg), size=size)
        if fused:
            ctx.saved = dict(base, acc=_info_nce_scatter(comm, xp, grads, n, neg_s))
        elif requires_grad:
            ctx.saved = dict(base, xn=(qn, kn, others, neg_p), neg_s=neg_s, lse=lse, t=t,
                             ws=workspace_bytes, comm=comm)
        return _loss(comm, xp, rows, reduction, n * size), _tags(ctx)


def _info_nce_scatter(comm: Comm, xp, grads, n: int, neg_s):
    """The rank's (dq, dk, dneg) accumulators: the keys' and shared negatives' column-side
    gradients summed at their owners."""
    dq, dk, do, dnp = grads
    n_keys = n * (comm.size - 1)
    dk = comm.reduce_scatter(_stack_own(xp, dk, do[:n_keys] if n_keys else None, comm.rank))
    if neg_s is not None:
        return dq, dk, comm.reduce_scatter(do[n_keys:].reshape(comm.size, *neg_s.shape))
    return dq, dk, dnp


def _info_nce_acc(ctx: Context, g):
    s, xp = ctx.saved, ctx.xp
    qn, kn, others, neg_p = s["xn"]
    w = weights(xp, g, "none", ctx.n, s["lse"].dtype)
    _, _, grads = _local.info_nce_block(
        Path(xp), qn, kn, others, neg_p, 1.0 / s["t"], lse_in=s["lse"], weights=w,
        want_grad=True, workspace_bytes=s["ws"])
    return _info_nce_scatter(s["comm"], xp, grads, ctx.n, s["neg_s"])


# ---- CLIP ---------------------------------------------------------------------------------
def clip_loss_forward(comm: Comm, a, b, logit_scale, *, reduction="mean", normalize=False,
                      workspace_bytes=None, requires_grad=True, precision=None):
    """:func:`cupynce.clip_loss_forward` over ``comm``'s global batch: one n × N block per rank
    for both directions (see the module notes).  ``logit_scale``'s gradient from
    :func:`backward` is the global one on every rank.
    """
    op = "clip_loss"
    precision = _precision_setting(precision)
    ls_array = hasattr(logit_scale, "shape")
    xp, ls, ls_shape, p = agree(comm, op, lambda: (
        clip_op._check(a, b, logit_scale, reduction, workspace_bytes, normalize, precision),
        _checks.check_bool(op, "requires_grad", requires_grad))[0], [a, b], ["a", "b"],
        [0.0 if ls_array else logit_scale, ls_array, reduction, normalize, requires_grad,
         precision])
    with config.float32_precision(p):  # every product of the rank's share (and graph keys)
        path = Path(xp)
        rank, size = comm.rank, comm.size
        n = a.shape[0]
        acc = acc_dtype(a.dtype)
        a, b = contig_inputs(xp, a, b)
        an, na = prep(path, a, normalize)
        bn, nb = prep(path, b, normalize)
        ls_dev = clip_op._logit_scale_array(xp, ls, acc)
        engine = _engine_for(xp)
        # the texts and the pairs' raw dots a_j·b_j of every rank (the tile path's column shift)
        b_all = comm.all_gather(bn).reshape(n * size, -1)
        dots = comm.all_gather(engine.pair_dots(an, bn)).reshape(-1)
        lse_r, state, row_loss, _ = engine.clip(
            an, b_all, ls_dev, lse_r=None, lse_c=None, weights=None, want_loss=True,
            want_grad=False, workspace_bytes=workspace_bytes, row0=rank * n, col_shift=dots,
            col_state=True)
        lse_c = engine.col_lse(comm.all_gather(state))  # every text's lse, the same on every rank
        own = slice(rank * n, (rank + 1) * n)
        pair = 0.5 * (row_loss + (lse_c[own] - (lse_r - row_loss)))
        ctx = Context(op, reduction, n, xp, stats=(lse_r, lse_c[own]) if requires_grad else (),
                      precision=p)
        ls_dtype = acc if isinstance(ls, float) else ls.dtype
        base = dict(x=(a, b), norms=(na, nb), ls_shape=ls_shape, ls_dtype=ls_dtype, size=size)
        fused = requires_grad and reduction != "none"
        if fused:
            w = weights(xp, None, reduction, n * size, acc)
            da, db, dscale = _clip_grads(comm, engine, xp, an, b_all, ls_dev, rank * n, lse_r,
                                         lse_c, w, workspace_bytes)
            ctx.saved = dict(base, acc=(da, db), dscale=dscale)
        elif requires_grad:
            ctx.saved = dict(base, an=an, b_all=b_all, ls=ls_dev, lse=(lse_r, lse_c),
                             ws=workspace_bytes, comm=comm)
        return _loss(comm, xp, pair, reduction, n * size), _tags(ctx)


def _clip_grads(comm: Comm, engine, xp, an, b_all, ls, row0: int, lse_r, lse_c, w, ws):
    """(da, db, dlogit_scale) accumulators of the rank's block: the texts' gradients summed
    at their owners, d loss / d logit_scale all-reduced (the global value)."""
    _, _, _, (da, db_all, dsp) = engine.clip(
        an, b_all, ls, lse_r=lse_r, lse_c=lse_c, weights=w, want_loss=False, want_grad=True,
        workspace_bytes=ws, row0=row0)
    db = comm.reduce_scatter(db_all.reshape(comm.size, *an.shape))
    dscale = comm.all_reduce(dsp.sum().reshape(1) if xp is np else
                             arrays.fixed_sum(dsp, 1).reshape(1)).reshape(())
    return da, db, dscale


def _clip_acc(ctx: Context, g):
    s, xp = ctx.saved, ctx.xp
    comm = s["comm"]
    engine = _engine_for(xp)
    # every pair's upstream gradient (its owner's), the weights of the block's columns
    acc = s["lse"][0].dtype
    g_all = comm.all_gather(_upstream(xp, g, ctx.n, acc)).reshape(-1)
    w = weights(xp, g_all, "none", ctx.n * comm.size, acc)
    return _clip_grads(comm, engine, xp, s["an"], s["b_all"], s["ls"], comm.rank * ctx.n,
                       *s["lse"], w, s["ws"])


# ---- SigLIP -------------------------------------------------------------------------------
def siglip_loss_forward(comm: Comm, a, b, logit_scale, logit_bias, *, reduction="mean",
                        normalize=False, workspace_bytes=None, requires_grad=True,
                        precision=None):
    """:func:`cupynce.siglip_loss_forward` over ``comm``'s global batch: the rank's n × N
    block of its images against every text (b all-gathered), no softmax so no statistics to
    exchange; the texts' gradients are reduce-scattered to their owners and the scale's and
    bias's all-reduced (the global values on every rank)."""
    op = "siglip_loss"
    precision = _precision_setting(precision)
    ls_array, lb_array = hasattr(logit_scale, "shape"), hasattr(logit_bias, "shape")
    xp, (ls, ls_shape), (lb, lb_shape), p = agree(comm, op, lambda: (
        siglip_op._check(a, b, logit_scale, logit_bias, reduction, workspace_bytes, normalize,
                         precision),
        _checks.check_bool(op, "requires_grad", requires_grad))[0], [a, b], ["a", "b"],
        [0.0 if ls_array else logit_scale, ls_array, 0.0 if lb_array else logit_bias,
         lb_array, reduction, normalize, requires_grad, precision])
    with config.float32_precision(p):  # every product of the rank's share (and graph keys)
        path = Path(xp)
        size = comm.size
        n = a.shape[0]
        acc = acc_dtype(a.dtype)
        a, b = contig_inputs(xp, a, b)
        an, na = prep(path, a, normalize)
        bn, nb = prep(path, b, normalize)
        engine = siglip_op._engine_for(xp)
        b_all = comm.all_gather(bn).reshape(n * size, -1)
        fused = requires_grad and reduction != "none"
        w = weights(xp, None, reduction, n * size, acc)
        rows, grads = engine(an, b_all, ls, lb, weights=w, want_loss=True, want_grad=fused,
                             workspace_bytes=workspace_bytes, row0=comm.rank * n)
        ctx = Context(op, reduction, n, xp, precision=p)
        base = dict(x=(a, b), norms=(na, nb), size=size, shapes=(ls_shape, lb_shape),
                    dtypes=tuple(acc if isinstance(v, float) else v.dtype for v in (ls, lb)))
        if fused:
            da, db, dscale, dbias = _siglip_scatter(comm, xp, grads, an.shape)
            ctx.saved = dict(base, acc=(da, db), dscalars=(dscale, dbias))
        elif requires_grad:
            ctx.saved = dict(base, an=an, b_all=b_all, scalars=(ls, lb), ws=workspace_bytes,
                             comm=comm)
        return _loss(comm, xp, rows, reduction, n * size), _tags(ctx)


def _siglip_scatter(comm: Comm, xp, grads, shape):
    """The rank's (da, db) accumulators (the texts' gradients summed at their owners) and
    the all-reduced d loss / d logit_scale, d loss / d logit_bias."""
    da, db_all, dscale, dbias = grads
    db = comm.reduce_scatter(db_all.reshape(comm.size, *shape))
    both = comm.all_reduce(xp.stack([xp.asarray(dscale).reshape(()),
                                     xp.asarray(dbias).reshape(())]))
    return da, db, both[0], both[1]


def _siglip_acc(ctx: Context, g):
    s, xp = ctx.saved, ctx.xp
    comm = s["comm"]
    acc = acc_dtype(s["x"][0].dtype)
    g_all = comm.all_gather(_upstream(xp, g, ctx.n, acc)).reshape(-1)
    w = weights(xp, g_all, "none", ctx.n * comm.size, acc)
    _, grads = siglip_op._engine_for(xp)(s["an"], s["b_all"], *s["scalars"], weights=w,
                                     want_loss=False, want_grad=True, workspace_bytes=s["ws"],
                                     row0=comm.rank * ctx.n)
    return _siglip_scatter(comm, xp, grads, s["an"].shape)


class _numpy_engine:
    """The NumPy side of the engine calls above."""

    clip = staticmethod(clip_op.numpy_clip)
    cross = staticmethod(_numpy.cross)
    col_lse = staticmethod(_numpy.col_lse)
    pair_dots = staticmethod(_numpy.pair_dots)


def _engine_for(xp):
    """The engine of the GPU (``cupynce._engine``) or its NumPy side."""
    return _numpy_engine if xp is np else _engine


# ---- backward -----------------------------------------------------------------------------
@in_ctx_precision
def backward(ctx: Context, grad_loss: Any = 1.0):
    """The gradients of a global forward's loss (its op's ``*_backward`` routes here):
    P times the gradient of the global loss with respect to this rank's inputs (see the
    module notes), and for CLIP the global d loss / d logit_scale; in the forward's float32
    precision (``ctx.precision``)."""
    op = ctx.op
    require(ctx, op)
    xp, s = ctx.xp, ctx.saved
    path = Path(xp)
    g = _checks.check_grad_loss(f"{op}_backward", grad_loss, ctx.reduction, ctx.n, xp)
    a = acc_dtype(s["x"][0].dtype)
    size = s["size"]
    dscale = None
    if "acc" in s:  # the unit-upstream accumulators of the forward (mean / sum): scale them
        accs, gs = s["acc"], _scale(path, g, size, a)
        if op in ("clip_loss", "siglip_loss"):  # (the global values: no factor P)
            gd = path.grad_scale(g, a)
            scalars = (s["dscale"],) if op == "clip_loss" else s["dscalars"]
            if gd is not None:
                scalars = [x * gd.reshape(()) for x in scalars]
            elif op == "clip_loss":  # (owned: the caller may change what it gets; SigLIP's
                scalars = [path.owned_copy(x, x.dtype) for x in scalars]  # are copied below)
            dscale = scalars[0]
    else:  # reduction "none": recompute with the upstream gradient as the row weights
        accs = {"nt_xent": _nt_xent_acc, "info_nce": _info_nce_acc, "clip_loss": _clip_acc,
                "siglip_loss": _siglip_acc}[op](ctx, g)
        if op == "clip_loss":
            *accs, dscale = accs
        elif op == "siglip_loss":
            *accs, dsc, dbi = accs
            scalars = [dsc, dbi]
        gs = path.grad_scale(float(size), a)
    grads = finish_all(path, s["x"], s["norms"], accs, gs)
    if op == "nt_xent":
        return grads[0]
    if op == "info_nce":
        return tuple(grads)
    if op == "siglip_loss":
        dls, dlb = (path.owned_copy(xp.asarray(v), dt).reshape(shape)
                    for v, dt, shape in zip(scalars, s["dtypes"], s["shapes"]))
        return grads[0], grads[1], dls, dlb
    dscale = xp.asarray(dscale).astype(s["ls_dtype"], copy=False).reshape(s["ls_shape"])
    return grads[0], grads[1], dscale

