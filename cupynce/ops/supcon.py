"""Supervised contrastive loss (SupCon, Khosla et al. 2020's L_out) on CuPy and NumPy arrays.

z (N, D) stacks every view of the batch, labels (N,) their classes: every other row of row
i's class is a positive of i, every row but i a candidate of its softmax.  Entry points as
for NT-Xent (:mod:`cupynce.ops.nt_xent`): :func:`supcon_loss`, :func:`supcon_forward`,
:func:`supcon_backward`, :func:`supcon_backward_from_stats`.

How it is computed: the softmax's log-sum-exps over j ≠ i are NT-Xent's (the same engine and
paths, the score tiles included; the N × N matrix never exists unless it fits the
workspace), and the positives' mean is O(N·D) from class sums of the rows
(``cupynce.ops._variants.supcon_terms``): Σ_{p∈P(i)} S_ip = (ẑ_i · C_{y_i} − ‖ẑ_i‖²) / τ with
C_y = Σ_{labels_j = y} ẑ_j, summed in a fixed order (the same bits on every run).  No
N × N mask is built and the labels are read on the device only.  No CUDA-graph replay (the
labels change the weights).

Reference: Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020 (L_out, eq. 2).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from .. import _checks, config
from .._engine import tail
from .._engine.kernels import acc_dtype
from . import _comm, _global, _graphs, _local, _variants
from ._base import (Context, Path, Temperature, check_stats, contig_inputs, dtemperature,
                    in_ctx_precision, prep, require, temperature_input,
                    temperature_result)
from ._comm import Comm
from .nt_xent import _kept_bytes  # (NT-Xent's row softmax: the same kept block)
from .nt_xent import _ring_share  # (NT-Xent's ring, SupCon's class terms beside)

__all__ = ["supcon_loss", "supcon_forward", "supcon_backward", "supcon_backward_from_stats"]


def _check(z, labels, temperature, reduction, workspace_bytes, normalize, precision):
    op = "supcon_loss"
    xp = _checks.array_module(op, z=z)
    _checks.check_matrix(op, "z", z, min_rows=2)
    if labels is None:
        raise TypeError(f"{op}: labels are required (an integer array of shape "
                        f"({z.shape[0]},)), got None")
    labels = _checks.check_labels(op, labels, z.shape[0], xp, z)
    t = temperature_input(op, temperature, xp, z, acc_dtype(z.dtype))
    p = _checks.check_flags(op, reduction, workspace_bytes, normalize, precision)
    return xp, labels, t, p


def _row_weights(xp, has, reduction: str, a, grad_loss=None):
    """The gradient's row weights: 0 for an anchor without a positive; ``"mean"`` divides by
    the number of anchors with one (a device count: never read on the host); ``grad_loss``
    (the "none" backward): the upstream gradient per row."""
    w = has.astype(a)
    if reduction == "mean":
        w /= xp.maximum(w.sum(), 1)
    if grad_loss is not None:
        w *= xp.asarray(grad_loss, dtype=a).reshape(-1)
    return w


def _reduce(xp, loss, has, reduction: str):
    """The reduced loss: the anchors with a positive summed (their mean for "mean"; 0 when
    none has one), a fixed-order sum on the GPU."""
    if reduction == "none":
        return loss
    from ._base import reduce

    total = reduce(xp, loss, "sum")
    if reduction == "mean":
        total = total / xp.maximum(has.sum(), 1).astype(total.dtype)
    return xp.asarray(total)


def reduce_rows(ctx: Context, rows, reduction: str):
    """The reduced loss from a per-row ("none") forward's rows and context (``requires_grad``),
    as the forward with ``reduction`` gives it (``cupynce.torch``'s per-row path)."""
    return _reduce(ctx.xp, rows, ctx.saved["has"], reduction)


def _engine_rows(path, zn, t: Temperature, w, lse_in, want_grad, workspace_bytes):
    """NT-Xent's row softmax over j ≠ i (its positive (i + N//2) mod N is undone by
    ``_variants.supcon_terms``): ``(lse, dz accumulator or None)``.  An odd N runs it as a
    query/key pair (``self_pair=False``): the self-pair paths take the positive for its own
    inverse, as NT-Xent's (i + N/2) mod N is."""
    n = zn.shape[0]
    pair = n % 2 == 0
    lse, _, (dq, dk, *_rest) = path.rows(
        zn, zn, None, None, t.scale, exclude_diag=True, pos_shift=n // 2, pos_mod=n,
        lse_in=lse_in, weights=(w, 1, 1.0) if w is not None else (None, 0, 0.0),
        want_grad=want_grad, workspace_bytes=workspace_bytes, op="supcon_loss",
        self_pair=pair, scale_log=t.scale_log)
    if want_grad and not pair:
        dq += dk
    return lse, dq


def supcon_forward(z, labels, temperature: Any = 0.1, *, reduction: str = "mean",
                   normalize: bool = False, workspace_bytes: Optional[int] = None,
                   requires_grad: bool = True, temperature_grad: bool = False, group=None,
                   precision: Optional[str] = None) -> Tuple[Any, Context]:
    """The supervised contrastive loss and a context for :func:`supcon_backward`.

    Parameters
    ----------
    z : (N, D) array (numpy or cupy), float16 / bfloat16 / float32 / float64, N >= 2
        Every view of the batch stacked (any order).
    labels : integer (N,) array of the same kind (on z's device)
        The rows' classes; rows with equal labels are positives of each other.  Never read
        on the host.
    temperature : float > 0, or a 0-d / (1,) array, default 0.1
        As :func:`cupynce.nt_xent_forward`'s (a CuPy array is never read on the host).
    reduction : "mean" | "sum" | "none"
        Anchors without a positive (their label nowhere else in the batch) are left out:
        "mean" averages over the anchors that have one (0, with a zero gradient, when none
        has), "sum" sums those, "none" gives the others 0.
    normalize : bool
        L2-normalise the rows first (as ``F.normalize``, eps 1e-12); gradients go through it.
    workspace_bytes, requires_grad, temperature_grad, precision
        As :func:`cupynce.nt_xent_forward`'s (dL/dτ: ``−(1/(2τ)) Σ_i ẑ_i · ∂L/∂ẑ_i``, the class
        terms being linear in the logits).
    group : communicator, optional
        The loss of the global batch across ranks (as for :func:`cupynce.nt_xent_forward`):
        every rank passes its own (n, D) z and (n,) labels, n even and equal on every rank;
        the global batch is every rank's rows in rank order, each row against all the others
        and its positives every same-label row of every rank (the labels are gathered with
        the rows).  The gradients from ``*_backward`` are P times those of the global loss
        with respect to the local rows (the data-parallel convention).

    Returns
    -------
    loss : 0-d array (mean/sum) or (N,) array (none); float32, float64 for float64 input.
    ctx : Context

    Notes
    -----
    With S = ẑ ẑᵀ / τ and P(i) = {p ≠ i : labels_p = labels_i}::

        loss_i = log Σ_{a≠i} exp(S_ia) − (1/|P(i)|) Σ_{p∈P(i)} S_ip
        ∂loss/∂ẑ = (G + Gᵀ) ẑ / τ,   G_ij = w_i (softmax_{a≠i}(S_i)_j − [j∈P(i)] / |P(i)|)

    Equal to pytorch-metric-learning's ``SupConLoss`` and to Khosla et al.'s reference
    implementation's ``L_out`` (contrast_mode="all", base_temperature = temperature).
    """
    if group is not None:
        return _global_forward(_comm.wrap(group), z, labels, temperature, reduction=reduction,
                               normalize=normalize, workspace_bytes=workspace_bytes,
                               requires_grad=requires_grad, temperature_grad=temperature_grad,
                               precision=precision)
    xp, labels, t, p = _check(z, labels, temperature, reduction, workspace_bytes, normalize,
                              precision)
    _checks.check_bool("supcon_loss", "requires_grad", requires_grad)
    tgrad = _checks.check_bool("supcon_loss", "temperature_grad", temperature_grad)
    want_dt = requires_grad and (t.array or tgrad)
    path = Path(xp)
    n = z.shape[0]
    z = contig_inputs(xp, z)[0]
    a = acc_dtype(z.dtype)
    fused = requires_grad and reduction != "none"

    def compute(z, labels):
        zn, norm = prep(path, z, normalize)
        groups = _variants.label_groups(xp, labels)
        has = _variants.has_positive(groups)
        w = _row_weights(xp, has, reduction, a) if fused else None
        with tail.not_last():  # (the class terms add to what the products write)
            lse, dz = _engine_rows(path, zn, t, w, None, fused, workspace_bytes)
        loss = _variants.supcon_terms(xp, path, zn, groups, t.scale, lse, w, acc=dz,
                                      scale_log=t.scale_log)
        return (_reduce(xp, loss, has, reduction), lse, dz, norm), (zn, groups, has)

    with config.float32_precision(p):  # (the graph key carries it too)
        # (z and the labels are the graph's inputs: the host's Python -- the label groups'
        # sort and searches, the class sums -- replayed as one launch; a device temperature
        # or its gradient: no graph, as for nt_xent.  The sort is CuPy's Thrust argsort,
        # capturable where it runs par_nosync (CuPy 14); an older CuPy's synchronising sort
        # makes the capture fail, which _graphs refuses once: the plain call then runs)
        if path.gpu and (fused or not requires_grad) and t.scale_log is None and not want_dt:
            outs = _graphs.run(("supcon_loss", t.value, reduction, normalize,
                                workspace_bytes, fused), (z, labels),
                               lambda *xs: compute(*xs)[0],
                               est_bytes=_kept_bytes(z, workspace_bytes) if fused else 0)
        else:
            outs, (zn, groups, has) = compute(z, labels)
    total, lse, dz, norm = outs
    ctx = Context("supcon_loss", reduction, n, xp, stats=(lse,) if requires_grad else (),
                  precision=p)
    if fused:
        ctx.saved = dict(z=z, norm=norm, dz=dz, temp=t, tgrad=tgrad,
                         dt=dtemperature(xp, zn, dz, t, 2) if want_dt else None)
    elif requires_grad:
        ctx.saved = dict(z=z, zn=zn, norm=norm, lse=lse, t=t, ws=workspace_bytes, tgrad=tgrad,
                         groups=groups, has=has)
    return total, ctx


@in_ctx_precision
def supcon_backward(ctx: Context, grad_loss: Any = 1.0):
    """Gradient of :func:`supcon_forward`'s loss w.r.t. ``z``, times ``grad_loss`` (a real or
    0-d array for mean/sum, an (N,) array for none).  Returns dz (N, D) in z's dtype, or
    ``(dz, dtemperature)`` for a forward with ``temperature_grad=True``."""
    require(ctx, "supcon_loss")
    if "global" in ctx.saved:
        return _global.backward(ctx, grad_loss)
    xp, s = ctx.xp, ctx.saved
    path = Path(xp)
    g = _checks.check_grad_loss("supcon_backward", grad_loss, ctx.reduction, ctx.n, xp)
    a = acc_dtype(s["z"].dtype)
    if "dz" in s:
        dz = path.finish(s["z"], s["norm"], s["dz"], path.grad_scale(g, a))
        if not s["tgrad"]:
            return dz
        return dz, temperature_result(path, xp, s["dt"] * g, s["temp"])
    t = s["t"]
    w = _row_weights(xp, s["has"], ctx.reduction, a, g)
    _, dz = _engine_rows(path, s["zn"], t, w, s["lse"], True, s["ws"])
    _variants.supcon_terms(xp, path, s["zn"], s["groups"], t.scale, None, w, acc=dz,
                           scale_log=t.scale_log)
    dt = dtemperature(xp, s["zn"], dz, t, 2) if s["tgrad"] else None
    dz = path.finish(s["z"], s["norm"], dz, None)
    return (dz, temperature_result(path, xp, dt, t)) if s["tgrad"] else dz


def supcon_backward_from_stats(z, lse, grad_loss: Any = 1.0, *, labels,
                               temperature: Any = 0.1, reduction: str = "mean",
                               normalize: bool = False,
                               workspace_bytes: Optional[int] = None,
                               temperature_grad: bool = False,
                               precision: Optional[str] = None):
    """``dz`` from the input, the forward's row log-sum-exps (``ctx.stats[0]``) and the labels
    (by keyword, as the torch ops pass them) alone (the score blocks, the class sums and the
    normalisation recomputed); the result of :func:`supcon_backward` on the forward's
    context given the forward's ``precision``; ``(dz, dtemperature)`` with
    ``temperature_grad``."""
    xp, labels, t, p = _check(z, labels, temperature, reduction, workspace_bytes, normalize,
                              precision)
    tgrad = _checks.check_bool("supcon_loss", "temperature_grad", temperature_grad)
    check_stats("supcon_loss", xp, z.shape[0], z.dtype, lse=lse)
    z = contig_inputs(xp, z)[0]
    zn, norm = prep(Path(xp), z, normalize)
    groups = _variants.label_groups(xp, labels)
    ctx = Context("supcon_loss", reduction, z.shape[0], xp, stats=(lse,), precision=p,
                  saved=dict(z=z, zn=zn, norm=norm, lse=lse, t=t, ws=workspace_bytes,
                             groups=groups, has=_variants.has_positive(groups), tgrad=tgrad))
    return supcon_backward(ctx, grad_loss)


def _torch_forward(z, temperature, *, labels, **kw):
    """``cupynce.torch``'s forward: :func:`supcon_forward` with the op's argument order (the
    temperature an input after z, the labels by keyword)."""
    return supcon_forward(z, labels, temperature, **kw)


def _torch_backward(z, temperature, lse, grad_loss, *, labels, reduction: str = "mean",
                    normalize: bool = False, workspace_bytes: Optional[int] = None,
                    precision: Optional[str] = None):
    """``cupynce.torch``'s backward op: ``(dz, dtemperature)`` (a zero 0-d placeholder
    for a real temperature: no such input needs one)."""
    kw = dict(labels=labels, temperature=temperature, reduction=reduction,
              normalize=normalize, workspace_bytes=workspace_bytes, precision=precision)
    if isinstance(temperature, float):
        xp = _checks.array_module("supcon_loss", z=z)
        return supcon_backward_from_stats(z, lse, grad_loss, **kw), \
            xp.zeros((), acc_dtype(z.dtype))
    return supcon_backward_from_stats(z, lse, grad_loss, temperature_grad=True, **kw)


def supcon_loss(z, labels, temperature: Any = 0.1, *, reduction: str = "mean",
                normalize: bool = False, workspace_bytes: Optional[int] = None, group=None,
                precision: Optional[str] = None):
    """The supervised contrastive loss of ``z`` (N, D) with ``labels`` (N,); see
    :func:`supcon_forward`."""
    return supcon_forward(z, labels, temperature, reduction=reduction, normalize=normalize,
                          workspace_bytes=workspace_bytes, requires_grad=False, group=group,
                          precision=precision)[0]


# ---- across ranks: this op's schedule for cupynce.ops._global ----------------------------
def _even(z) -> None:
    if getattr(z, "ndim", 0) == 2 and z.shape[0] % 2:
        raise ValueError(f"supcon_loss: with group=, z must have an even number of rows on "
                         f"every rank (NT-Xent's schedule across ranks), got shape "
                         f"{tuple(z.shape)}")


def _global_forward(comm: Comm, z, labels, temperature=0.1, *, reduction="mean",
                    normalize=False, workspace_bytes=None, requires_grad=True,
                    temperature_grad=False, precision=None):
    """:func:`supcon_forward` over ``comm``'s global batch: NT-Xent's global row softmax
    (``cupynce.ops._local``'s schedule: the rows gathered, each rank its rows' log-sum-exps
    and its share of the gradient, reduce-scattered), the labels gathered with the rows and
    the class terms from the global class sums (every rank sums every rank's rows, in one
    fixed order: the same bits everywhere)."""
    op = "supcon_loss"
    precision = _global.precision_setting(precision)
    def checks():
        xp, lab, t, p = _check(z, labels, temperature, reduction, workspace_bytes, normalize,
                               precision)
        _checks.check_bool(op, "requires_grad", requires_grad)
        _checks.check_bool(op, "temperature_grad", temperature_grad)
        _even(z)
        return xp, lab, t, p  # (a device one too: _global.scaled_rows)

    host_t = _global.host_setting(temperature)  # (the ranks compare the host values)
    (xp, labels, temp, p), ring = _global.agree(
        comm, op, checks, [z], ["z"],
        [host_t, reduction, normalize, requires_grad, precision, temperature_grad is True],
        ring_wish=lambda: _global.ring_possible(comm, z, requires_grad, reduction))
    tgrad = bool(temperature_grad) and requires_grad
    with config.float32_precision(p):
        path = Path(xp)
        engine = _local.engine_for(xp)
        rank, size = comm.rank, comm.size
        n2 = z.shape[0]
        a = acc_dtype(z.dtype)
        z = contig_inputs(xp, z)[0]
        zn, norm = prep(path, z, normalize)
        zn, root, scale = _global.scaled_rows(xp, zn, temp)  # (a device τ: √s ẑ, scale 1)
        labs = comm.all_gather(labels)  # (P, 2n): every row's label
        groups = _variants.label_groups(xp, labs.reshape(-1))
        has = _variants.has_positive(groups)
        if ring:  # (no "none" with a gradient: NT-Xent's ring with the class terms beside)
            fused = requires_grad and reduction != "none"
            w_all = _row_weights(xp, has, reduction, a).reshape(size, n2) if fused else None
            classes = RingClasses(xp, path, zn, labs, groups, w_all, rank, scale)
            lse, _, acc = _ring_share(comm, path, engine, zn, scale, 1.0 if fused else None,
                                      workspace_bytes, w_all=w_all, classes=classes)
            rows = classes.loss(lse)
            ctx = Context(op, reduction, n2, xp, stats=(lse,) if requires_grad else (),
                          precision=p)
            if fused:
                classes.finish(acc)
                ctx.saved = dict(x=(z,), norms=(norm,), size=size, acc=(acc,), temp=temp,
                                 tgrad=tgrad)
                dt = _global.unscale_rows(comm, xp, zn, acc, temp, root, tgrad)
                if tgrad:
                    ctx.saved["dt"] = dt
            return _global_total(comm, xp, rows, has, reduction), _global.tag(ctx, _GLOBAL)
        plan = _local.NtXentPlan(rank, size, n2)
        parts = comm.all_gather(zn)
        dots = engine.pair_dots(zn[:n2 // 2], zn[n2 // 2:])
        dots = comm.all_gather(xp.concatenate([dots, dots]))
        lse_d, _, partial, state = _local.nt_xent_stats(path, engine, plan, zn, parts, dots,
                                                        scale, workspace_bytes)
        states = comm.all_gather(state) if plan.width else None
        lse = _local.nt_xent_lse(plan, engine, lse_d, partial, states)
        every = parts.reshape(size * n2, -1)
        ctx = Context(op, reduction, n2, xp, stats=(lse,) if requires_grad else (),
                      precision=p)
        acc = None
        if requires_grad:
            lse_all = comm.all_gather(lse) if size > 1 else lse[None]
            base = dict(x=(z,), norms=(norm,), size=size)
            if reduction != "none":
                w_all = _row_weights(xp, has, reduction, a)
                acc = comm.reduce_scatter(_local.nt_xent_grads(
                    path, engine, plan, zn, parts, scale, lse_all, w_all.reshape(size, n2), 1.0,
                    workspace_bytes))
                ctx.saved = dict(base, acc=(acc,), temp=temp, tgrad=tgrad)
            else:
                ctx.saved = dict(base, plan=plan, zn=zn, parts=parts, lse_all=lse_all,
                                 scale=scale, ws=workspace_bytes, comm=comm, groups=groups,
                                 has=has, temp=temp, tgrad=tgrad, root=root)
        rows = _variants.supcon_terms(
            xp, path, zn, None, scale, lse, acc=acc,
            every=(every, groups, w_all if acc is not None else None, rank * n2))
        if acc is not None:  # (after the class terms: dτ of the whole gradient)
            dt = _global.unscale_rows(comm, xp, zn, acc, temp, root, tgrad)
            if tgrad:
                ctx.saved["dt"] = dt
        return _global_total(comm, xp, rows, has, reduction), _global.tag(ctx, _GLOBAL)


def _global_total(comm: Comm, xp, rows, has, reduction: str):
    """The rank's rows' losses reduced over every rank (the anchors with a positive)."""
    if reduction == "none":
        return rows
    total = _global.loss(comm, xp, rows, "sum", 1)
    if reduction == "mean":
        total = total / xp.maximum(has.sum(), 1).astype(total.dtype)
    return total


class RingClasses:
    """SupCon's class terms (``_variants`` module notes) on NT-Xent's ring
    (``nt_xent._ring_share``), from the blocks the rank computes: the diagonal block's class
    sums, and each chunk block's class sums both ways (``_variants.cross_groups``) -- its
    rows' sums over the chunk's rows and the chunk's rows' over its rows.  The latter's
    dots ẑ_j · C_j travel in the gathered column states (:meth:`block`'s return), their
    gradient terms −u_j C_j − W_j with the chunk's gradient (:meth:`col_grad`); the rank's
    own rows' totals make the loss (:meth:`loss`) and their gradient terms (:meth:`finish`).
    Every pair of rows meets in one block, so the parts add up to the class sums over the
    global batch (in another order: the same values to rounding).

    ``labs`` (P, 2n) every row's label, ``groups`` their ``label_groups``, ``w_all`` (P, 2n)
    the rows' gradient weights (None: the loss alone), ``scale`` = 1/τ."""

    def __init__(self, xp, path, zn, labs, groups, w_all, rank: int, scale: float):
        a = acc_dtype(zn.dtype)
        size, n2 = labs.shape
        self.xp, self.path, self.rank, self.scale, self.a = xp, path, rank, scale, a
        self.z = zn.astype(a, copy=False)
        self.labs = labs
        self.cnt = (groups[4] - groups[3] - 1).reshape(size, n2)  # |P(i)|, every row
        self.w = w_all
        self.u = None if w_all is None else \
            w_all / xp.maximum(self.cnt, 1).astype(a)  # u_i = w_i / max(c_i, 1)
        self.c = xp.zeros(self.z.shape, a)  # the rank's rows' class sums C_i (its blocks')
        self.wc = None if w_all is None else xp.zeros(self.z.shape, a)  # and W_i
        self.t_in = xp.zeros(n2, a)  # ẑ_i · C_i from the other ranks' blocks
        self.cols = {}

    def diag(self) -> None:
        """The diagonal block: the class sums among the rank's rows (each row's own too)."""
        g = _variants.label_groups(self.xp, self.labs[self.rank])
        self.c += self.path.class_sums(self.z, g)
        if self.u is not None:
            self.wc += self.path.class_sums(self.z, g, self.u[self.rank])

    def block(self, q: int, rows, cols, chunk):
        """The block of the rank's ``rows`` against rank q's rows ``cols`` (``chunk``):
        returns the chunk rows' dots ẑ_j · (their class sums over ``rows``)."""
        xp, a = self.xp, self.a
        z, y = self.z[rows], chunk[cols].astype(a, copy=False)
        la, lb = self.labs[self.rank][rows], self.labs[q][cols]
        nr, m = z.shape[0], y.shape[0]
        both = xp.concatenate([z, y])
        groups = _variants.cross_groups(xp, la, lb)

        def sums(wa, wb):
            return self.path.class_sums(both, groups, xp.concatenate([wa, wb]))
        zr, zc, one_r, one_c = xp.zeros(nr, a), xp.zeros(m, a), xp.ones(nr, a), xp.ones(m, a)
        self.c[rows] += sums(zr, one_c)[:nr]
        col_c = sums(one_r, zc)[nr:]
        if self.u is not None:
            self.wc[rows] += sums(zr, self.u[q][cols])[:nr]
            col_w = sums(self.u[self.rank][rows], zc)[nr:]
            self.cols[q] = -(self.u[q][cols][:, None] * col_c) - col_w
        return (y * col_c).sum(axis=1)

    def gathered(self, sources, t_states) -> None:
        """The dots of the rank's rows that other ranks' blocks sent (``t_states`` (P,
        width), ``sources`` ``NtXentPlan.sources``)."""
        for r, off, rows in sources:
            self.t_in[rows] += t_states[r, off:off + rows.stop - rows.start]

    def col_grad(self, q: int):
        """Chunk q's rows' gradient terms from this rank's block (times 1/τ)."""
        return self.scale * self.cols[q]

    def loss(self, lse):
        """The rank's rows' SupCon losses from their log-sum-exps."""
        xp, z = self.xp, self.z
        t = (z * self.c).sum(axis=1) + self.t_in - (z * z).sum(axis=1)
        cnt = self.cnt[self.rank].astype(self.a)
        return xp.where(cnt > 0, lse - (self.scale / xp.maximum(cnt, 1)) * t,
                        0).astype(self.a, copy=False)

    def finish(self, acc) -> None:
        """The rank's rows' class and positive terms added into ``acc``."""
        xp, z = self.xp, self.z
        h = z.shape[0] // 2
        w, u = self.w[self.rank], self.u[self.rank][:, None]
        c = -u * self.c - self.wc + (2 * u) * z
        c += w[:, None] * xp.roll(z, -h, axis=0)  # w_i ẑ_{p(i)}
        c += xp.roll(w[:, None] * z, h, axis=0)  # w_{q(i)} ẑ_{q(i)}
        acc += self.scale * c


def _global_acc(ctx: Context, g):
    """The "none" backward's accumulator: every rank's upstream gradients (times their
    anchors' having a positive) as the weights."""
    s, xp = ctx.saved, ctx.xp
    comm = s["comm"]
    size, n2 = comm.size, ctx.n
    a = s["lse_all"].dtype
    w_all = comm.all_gather(_global.upstream(xp, g, n2, a)).reshape(-1) * s["has"].astype(a)
    engine = _local.engine_for(xp)
    path = Path(xp)
    acc = comm.reduce_scatter(_local.nt_xent_grads(
        path, engine, s["plan"], s["zn"], s["parts"], s["scale"], s["lse_all"],
        w_all.reshape(size, n2), 1.0, s["ws"]))
    _variants.supcon_terms(xp, path, s["zn"], None, s["scale"], None, acc=acc,
                           every=(s["parts"].reshape(size * n2, -1), s["groups"], w_all,
                                  comm.rank * n2))
    dt = _global.unscale_rows(comm, xp, s["zn"], acc, s["temp"], s["root"], s["tgrad"])
    return (acc,), (dt,) if s["tgrad"] else ()


_GLOBAL = _global.Schedule(recompute=_global_acc, result=_global.rows_and_temperature,
                           scalars=_global.saved_temperature_grad)
