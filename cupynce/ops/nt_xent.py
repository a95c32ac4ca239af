"""SimCLR's NT-Xent (normalized temperature-scaled cross entropy) on CuPy and NumPy arrays.

z (2B, D) stacks the two views: rows i and (i + B) mod 2B are a positive pair, every other row
a negative.  Entry points: :func:`nt_xent` (the loss), :func:`nt_xent_forward` → ``(loss,
ctx)``, :func:`nt_xent_backward` → dz, :func:`nt_xent_backward_from_stats` (dz from z and the
O(N) row log-sum-exps alone).

How the gradient is computed: for ``reduction="mean"`` / ``"sum"`` the forward computes it
for a unit upstream gradient in the same pass over the score tiles (one product fewer than
recomputing) and keeps the O(N·D) float32 (float64) result, which the backward scales; for
``"none"`` the forward keeps the inputs and the row log-sum-exps and the backward recomputes
the scores.  The N × N matrix never exists unless it fits the workspace.

Reference: Chen et al., "A Simple Framework for Contrastive Learning of Visual
Representations" (SimCLR), ICML 2020.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from .. import _checks, _engine, config
from .._engine import side, workspace
from .._engine.kernels import acc_dtype
from . import _comm, _global, _graphs, _local, _memo, _variants
from ._base import (Context, Path, check_stats, contig_inputs, contig_remembered,
                    in_ctx_precision, prep, reduce, reduce_out, require, row_weight,
                    dtemperature, temperature_input, temperature_result,
                    weights)
from ._comm import Comm

__all__ = ["nt_xent", "nt_xent_forward", "nt_xent_backward",
           "nt_xent_backward_from_stats"]


def _check(z, temperature, reduction, workspace_bytes, normalize, precision):
    op = "nt_xent"
    xp = _checks.array_module(op, z=z)
    _checks.check_matrix(op, "z", z, min_rows=2)
    if z.shape[0] % 2:
        raise ValueError(f"nt_xent: z must have an even number of rows (2B views), "
                         f"got shape {tuple(z.shape)}")
    t = temperature_input(op, temperature, xp, z, acc_dtype(z.dtype))
    return xp, t, _checks.check_flags(op, reduction, workspace_bytes, normalize, precision)


def _kept_bytes(z, workspace_bytes) -> int:
    """What a fused GPU call keeps beside its O(N·D) outputs, at most: the N × N gradient
    block (16-bit H on the tiles, the float32 / float64 score block on the row blocks and on
    the kept scores of 16-bit inputs from ``config.nt_xent_keep_min_dim`` columns), capped
    by the workspace without its free-memory bound (no driver query), plus the float32
    gradient accumulator: ``_graphs.run``'s ``est_bytes``, so that a problem whose plan would
    be refused (a float32 one at N = 16384: a 1 GiB score block) starts its first kernel
    without building a graph key first."""
    n, d = z.shape
    acc = acc_dtype(z.dtype).itemsize
    item = z.dtype.itemsize if z.dtype.itemsize == 2 and not _engine.nt_xent_wide(n, d) else acc
    return min(n * n * item, workspace.workspace_bound(workspace_bytes)) + n * d * acc


def nt_xent_forward(z, temperature: Any = 0.5, *, label_smoothing: float = 0.0,
                    reduction: str = "mean", normalize: bool = False,
                    workspace_bytes: Optional[int] = None, requires_grad: bool = True,
                    temperature_grad: bool = False, group=None,
                    precision: Optional[str] = None) -> Tuple[Any, Context]:
    """SimCLR's NT-Xent loss and a context for :func:`nt_xent_backward`.

    Parameters
    ----------
    z : (2B, D) array (numpy or cupy), float16 / bfloat16 / float32 / float64
        The two views stacked: row ``i`` and row ``(i + B) mod 2B`` are a positive pair.
    temperature : float > 0, or a 0-d / (1,) array
        A real, or an array of z's kind: a NumPy one is read; a CuPy one on z's device is
        never read on the host (the logits take it as a device scale; the NT-Xent-specific
        symmetric tiles and TF32x3 kernels take a host scale only, so the call runs the
        general paths).  An array's gradient is computed (``temperature_grad``).
    label_smoothing : float in [0, 1), default 0
        ``F.cross_entropy``'s label smoothing over each row's 2B − 1 candidates: the target
        is 1 − ε on the positive plus ε spread evenly over them.  Computed as an O(N·D)
        difference from the plain loss (``cupynce.ops._variants``), so every path serves
        it; the call makes no CUDA-graph replay.  With ``group`` its sums run over the
        global batch.
    reduction : "mean" | "sum" | "none"
    normalize : bool
        L2-normalise the rows first (as ``F.normalize``, eps 1e-12); gradients go through it.
    workspace_bytes : int, optional
        Cap on the score-block workspace; default ``min(1 GiB, half the free memory)``.
    requires_grad : bool
        Also prepare the gradient (see the module notes).
    temperature_grad : bool, default False
        :func:`nt_xent_backward` also returns dL/dτ (in the temperature's shape and dtype;
        0-d float32 / float64 for a real): ``−(1/(2τ)) Σ_i ẑ_i · ∂L/∂ẑ_i`` (the logits are
        homogeneous of degree 2 in ẑ and −1 in τ), one O(N·D) dot.
    group : communicator, optional
        The loss of the global batch across ranks: a ``cupy.cuda.nccl.NcclCommunicator``
        (or a ``cupyx.distributed`` NCCL backend) for CuPy arrays, or a
        :class:`cupynce.ops._comm.Comm`.  Every rank passes its own (2n, D) z = [view 1 of its n images; view 2 of
        them] (equal counts); the global batch is [every rank's view 1; every rank's view 2];
        the gradients from ``*_backward`` are P times those of the global loss with respect
        to the local rows (the data-parallel convention, see ``cupynce.ops._global``).
    precision : "auto" | "fp32" | "tf32" | "3xtf32", optional
        How float32 products run on the GPU (see :func:`cupynce.set_float32_precision`);
        None (default): the global default, ``cupynce.get_float32_precision()``.  Kept in the
        context: the backward runs in the same.  Ignored (validated) for float16 / bfloat16 /
        float64 inputs and on the NumPy path.

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
    if group is not None:
        return _global_forward(
            _comm.wrap(group), z, temperature, label_smoothing=label_smoothing,
            reduction=reduction, normalize=normalize, workspace_bytes=workspace_bytes,
            requires_grad=requires_grad, temperature_grad=temperature_grad,
            precision=precision)
    sig = _memo.signature("nt_xent", z, temperature)
    hit = _memo.known(sig)
    if hit:  # z and temperature passed these checks before, z laid out as given (_memo)
        xp = _checks.cupy_module()
        temp = temperature_input("nt_xent", temperature, xp, z, acc_dtype(z.dtype))
        p = _checks.check_flags("nt_xent", reduction, workspace_bytes, normalize, precision)
    else:
        xp, temp, p = _check(z, temperature, reduction, workspace_bytes, normalize, precision)
    _checks.check_bool("nt_xent", "requires_grad", requires_grad)
    tgrad = _checks.check_bool("nt_xent", "temperature_grad", temperature_grad)
    want_dt = requires_grad and (temp.array or tgrad)
    t = temp.value
    eps = _checks.check_smoothing("nt_xent", label_smoothing)
    path = Path(xp)
    n = z.shape[0]
    (z,), sig = contig_remembered(xp, sig, hit, z)
    fused = requires_grad and reduction != "none"

    def compute(z):
        zn, norm = prep(path, z, normalize)
        w = weights(xp, None, reduction, n, acc_dtype(z.dtype))
        if eps or temp.scale_log is not None or want_dt:
            # plain loss + the O(N·D) difference (every path serves it), then the
            # reduction: after the difference, so no side branch (side.py's notes)
            lse, loss, (dz, *_rest) = path.rows(
                zn, zn, None, None, temp.scale, exclude_diag=True, pos_shift=n // 2,
                pos_mod=n, lse_in=None, weights=w, want_grad=fused,
                workspace_bytes=workspace_bytes, op="nt_xent", self_pair=True,
                scale_log=temp.scale_log)
            if eps:
                dloss, dacc = _variants.nt_xent_smoothing(
                    xp, zn, temp.inverse(xp), eps, _variants.row_weights(w) if fused else None)
                loss += dloss
                if fused:
                    dz += dacc
            return reduce(xp, loss, reduction), lse, dz, norm, zn
        # the reduced loss needs only the statistics: beside the gradient pass (_engine/side;
        # its output allocated before the fork)
        with side.branch() as br:
            out = reduce_out(xp, reduction, acc_dtype(z.dtype))
            lse, loss, (dz, *_rest) = path.rows(
                zn, zn, None, None, 1.0 / t, exclude_diag=True, pos_shift=n // 2, pos_mod=n,
                lse_in=None, weights=w, want_grad=fused, workspace_bytes=workspace_bytes,
                op="nt_xent", self_pair=True)
            with br.beside():
                total = reduce(xp, loss, reduction, out)
        return total, lse, dz, norm, zn

    with config.float32_precision(p):  # (the graph key carries it too)
        # (nothing kept that aliases z; the smoothing's array ops are no graph's)
        if path.gpu and (fused or not requires_grad) and not eps and temp.scale_log is None \
                and not want_dt:
            loss, lse, dz, norm = _graphs.run(
                ("nt_xent", t, reduction, normalize, workspace_bytes, fused), (z,),
                lambda z: compute(z)[:4],
                est_bytes=_kept_bytes(z, workspace_bytes) if fused else 0, layout=sig)
        else:
            loss, lse, dz, norm, zn = compute(z)
    ctx = Context("nt_xent", reduction, n, xp, stats=(lse,) if requires_grad else (),
                  precision=p)
    if fused:
        # (dτ for a unit upstream gradient: the homogeneity dot over the accumulator)
        dt = dtemperature(xp, zn, dz, temp, 2) if want_dt else None
        ctx.saved = dict(z=z, norm=norm, dz=dz, dt=dt, temp=temp, tgrad=tgrad)
    elif requires_grad:
        ctx.saved = dict(z=z, zn=zn, norm=norm, lse=lse, temp=temp, ws=workspace_bytes,
                         eps=eps, tgrad=tgrad)
    return loss, ctx


@in_ctx_precision
def nt_xent_backward(ctx: Context, grad_loss: Any = 1.0):
    """Gradient of :func:`nt_xent_forward`'s loss w.r.t. ``z``, times ``grad_loss``.

    ``grad_loss``: a real or 0-d array (mean/sum), or a (2B,) array (none).  Returns dz (2B, D)
    in z's dtype, or ``(dz, dtemperature)`` for a forward with ``temperature_grad=True``.
    Its products run in the forward's float32 precision (``ctx.precision``).
    """
    require(ctx, "nt_xent")
    if "global" in ctx.saved:
        return _global.backward(ctx, grad_loss)
    xp, s = ctx.xp, ctx.saved
    path = Path(xp)
    g = _checks.check_grad_loss("nt_xent_backward", grad_loss, ctx.reduction, ctx.n, xp)
    a = acc_dtype(s["z"].dtype)
    temp = s["temp"]
    if "dz" in s:
        dz = path.finish(s["z"], s["norm"], s["dz"], path.grad_scale(g, a))
        if not s["tgrad"]:
            return dz
        return dz, temperature_result(path, xp, s["dt"] * g, temp)
    n = ctx.n
    w = weights(xp, g, ctx.reduction, n, a)
    _, _, (dz, *_rest) = path.rows(
        s["zn"], s["zn"], None, None, temp.scale, exclude_diag=True, pos_shift=n // 2,
        pos_mod=n, lse_in=s["lse"], weights=w, want_grad=True,
        workspace_bytes=s["ws"], op="nt_xent", self_pair=True, scale_log=temp.scale_log)
    if s.get("eps"):
        dz += _variants.nt_xent_smoothing(xp, s["zn"], temp.inverse(xp), s["eps"],
                                          _variants.row_weights(w), want_loss=False)[1]
    dt = dtemperature(xp, s["zn"], dz, temp, 2) if s["tgrad"] else None
    dz = path.finish(s["z"], s["norm"], dz, None)
    return (dz, temperature_result(path, xp, dt, temp)) if s["tgrad"] else dz


def nt_xent_backward_from_stats(z, lse, grad_loss: Any = 1.0, *, temperature: Any = 0.5,
                                label_smoothing: float = 0.0, reduction: str = "mean",
                                normalize: bool = False,
                                workspace_bytes: Optional[int] = None,
                                temperature_grad: bool = False,
                                precision: Optional[str] = None):
    """``dz`` from the input and the forward's row log-sum-exps (``ctx.stats[0]``) alone.

    For callers that keep only O(N) state between forward and backward (the PyTorch ops):
    the score blocks and the normalisation are recomputed.  Same result as
    :func:`nt_xent_backward` on the forward's context when given the forward's
    ``precision`` (None: the global default); ``(dz, dtemperature)`` with
    ``temperature_grad``.
    """
    xp, temp, p = _check(z, temperature, reduction, workspace_bytes, normalize, precision)
    check_stats("nt_xent", xp, z.shape[0], z.dtype, lse=lse)
    z = contig_inputs(xp, z)[0]
    zn, norm = prep(Path(xp), z, normalize)
    eps = _checks.check_smoothing("nt_xent", label_smoothing)
    tgrad = _checks.check_bool("nt_xent", "temperature_grad", temperature_grad)
    ctx = Context("nt_xent", reduction, z.shape[0], xp, stats=(lse,), precision=p,
                  saved=dict(z=z, zn=zn, norm=norm, lse=lse, temp=temp, ws=workspace_bytes,
                             eps=eps, tgrad=tgrad))
    return nt_xent_backward(ctx, grad_loss)


def _torch_backward(z, temperature, lse, grad_loss, *, label_smoothing: float = 0.0,
                    reduction: str = "mean", normalize: bool = False,
                    workspace_bytes: Optional[int] = None, precision: Optional[str] = None):
    """``cupynce.torch``'s backward op: ``(dz, dtemperature)`` from the inputs and the row
    log-sum-exps, the temperature an array (its gradient) or a real (a zero 0-d
    placeholder: no such input needs one)."""
    if isinstance(temperature, float):
        dz = nt_xent_backward_from_stats(z, lse, grad_loss, temperature=temperature,
                                         label_smoothing=label_smoothing, reduction=reduction,
                                         normalize=normalize, workspace_bytes=workspace_bytes,
                                         precision=precision)
        xp = _checks.array_module("nt_xent", z=z)
        return dz, xp.zeros((), acc_dtype(z.dtype))
    return nt_xent_backward_from_stats(z, lse, grad_loss, temperature=temperature,
                                       label_smoothing=label_smoothing, reduction=reduction,
                                       normalize=normalize, workspace_bytes=workspace_bytes,
                                       temperature_grad=True, precision=precision)


def nt_xent(z, temperature: Any = 0.5, *, label_smoothing: float = 0.0,
            reduction: str = "mean", normalize: bool = False,
            workspace_bytes: Optional[int] = None, group=None,
            precision: Optional[str] = None):
    """SimCLR's NT-Xent loss of ``z`` (2B, D); see :func:`nt_xent_forward`."""
    return nt_xent_forward(z, temperature, label_smoothing=label_smoothing,
                           reduction=reduction, normalize=normalize,
                           workspace_bytes=workspace_bytes, requires_grad=False,
                           group=group, precision=precision)[0]


# ---- across ranks: this op's schedule for cupynce.ops._global ----------------------------
def _global_forward(comm: Comm, z, temperature=0.5, *, label_smoothing=0.0, reduction="mean",
                    normalize=False, workspace_bytes=None, requires_grad=True,
                    temperature_grad=False, precision=None):
    """:func:`nt_xent_forward` over ``comm``'s global batch (see :mod:`cupynce.ops._global`).

    ``z`` (2n, D): this rank's [view 1 of its n images; view 2 of them].  Returns the global
    loss (this rank's 2n rows of it for "none") and a context for
    :func:`cupynce.ops._global.backward`.
    """
    op = "nt_xent"
    precision = _global.precision_setting(precision)
    def checks():
        xp, temp, p = _check(z, temperature, reduction, workspace_bytes, normalize, precision)
        _checks.check_bool(op, "requires_grad", requires_grad)
        _checks.check_bool(op, "temperature_grad", temperature_grad)
        _checks.check_smoothing(op, label_smoothing)
        return xp, temp, p  # (a device one too: _global.scaled_rows)

    host_t = _global.host_setting(temperature)  # (the ranks compare the host values)
    (xp, temp, p), ring = _global.agree(
        comm, op, checks, [z], ["z"],
        [host_t, reduction, normalize, requires_grad, precision, label_smoothing,
         temperature_grad is True],
        ring_wish=lambda: _global.ring_possible(comm, z, requires_grad, reduction, gpu=True))
    eps = float(label_smoothing)
    tgrad = bool(temperature_grad) and requires_grad
    with config.float32_precision(p):  # every product of the rank's share (and graph keys)
        path = Path(xp)
        engine = _local.engine_for(xp)
        rank, size = comm.rank, comm.size
        n2 = z.shape[0]
        z = contig_inputs(xp, z)[0]
        zn, norm = prep(path, z, normalize)
        zn, root, scale = _global.scaled_rows(xp, zn, temp)  # (a device τ: √s ẑ, scale 1)
        base = dict(x=(z,), norms=(norm,), size=size)
        if ring:  # (no "none" recompute: _ring_share)
            fused = requires_grad and reduction != "none"
            w_mul = row_weight(reduction, n2 * size) if fused else None
            lse, rows, acc = _ring_share(comm, path, engine, zn, scale, w_mul, workspace_bytes)
            if eps:  # the smoothing's O(N·D) difference over the global row sum (no rows)
                sums = (_variants.global_sums(comm, xp, zn)[0], n2 * size)
                drow, dacc = _variants.nt_xent_smoothing(xp, zn, scale, eps, w_mul, sums=sums)
                rows += drow
                if fused:
                    acc += dacc
            ctx = Context(op, reduction, n2, xp, stats=(lse,) if requires_grad else (),
                          precision=p)
            if fused:
                dt = _global.unscale_rows(comm, xp, zn, acc, temp, root, tgrad)
                ctx.saved = dict(base, acc=(acc,), temp=temp, tgrad=tgrad, dt=dt)
            return _global.loss(comm, xp, rows, reduction, n2 * size), _global.tag(ctx, _GLOBAL)
        plan = _local.NtXentPlan(rank, size, n2)
        parts = comm.all_gather(zn)
        dots = engine.pair_dots(zn[:n2 // 2], zn[n2 // 2:])  # the rows' raw positive dots
        dots = comm.all_gather(xp.concatenate([dots, dots]))
        lse_d, loss_d, partial, state = _local.nt_xent_stats(path, engine, plan, zn, parts, dots,
                                                             scale, workspace_bytes)
        states = comm.all_gather(state) if plan.width else None
        lse = _local.nt_xent_lse(plan, engine, lse_d, partial, states)
        rows = loss_d + (lse - lse_d)
        every = parts.reshape(size * n2, -1)
        if eps:  # the smoothing's O(N·D) difference over the global sums (_variants)
            rows += _variants.nt_xent_smoothing(xp, zn, scale, eps, every=(every, None))[0]
        ctx = Context(op, reduction, n2, xp, stats=(lse,) if requires_grad else (),
                      precision=p)
        if requires_grad:
            lse_all = comm.all_gather(lse) if size > 1 else lse[None]
            if reduction != "none":
                w_mul = row_weight(reduction, n2 * size)
                acc = _local.nt_xent_grads(path, engine, plan, zn, parts, scale, lse_all, None,
                                           w_mul, workspace_bytes)
                acc = comm.reduce_scatter(acc)
                if eps:
                    acc += _variants.nt_xent_smoothing(
                        xp, zn, scale, eps, w_mul, want_loss=False, every=(every, w_mul))[1]
                dt = _global.unscale_rows(comm, xp, zn, acc, temp, root, tgrad)
                ctx.saved = dict(base, acc=(acc,), temp=temp, tgrad=tgrad, dt=dt)
            else:
                ctx.saved = dict(base, plan=plan, zn=zn, parts=parts, lse_all=lse_all,
                                 scale=scale, ws=workspace_bytes, comm=comm, eps=eps,
                                 temp=temp, tgrad=tgrad, root=root)
        return _global.loss(comm, xp, rows, reduction, n2 * size), _global.tag(ctx, _GLOBAL)


def _ring_share(comm: Comm, path, engine, zn, scale: float, w_mul: Optional[float], ws,
                w_all=None, classes=None):
    """The rank's blocks of the global NT-Xent on the ring (``_global.ring_blocks``; the
    ranks agreed on it): the plan mirrored (``NtXentPlan(ring=True)``: blocks (r, r − k), the
    chunks the ring brings first), so the rows travel only P // 2 steps.  First the diagonal
    block and each arriving chunk's block (the split pair's half at step P / 2 for even P)
    while the next chunk travels: the rank's rows' partials, and the chunks' column states
    all-gathered (the other ranks' rows' partials) and merged in a fixed order; then, with
    ``w_mul`` (a gradient wanted), the same blocks' gradients from every row's log-sum-exp
    (all-gathered, 2n floats a rank), the kept chunks' rows' gradients summed along the ring
    to their owners (a full circle: ranks that computed no block of a chunk add nothing).

    ``w_all`` (P, 2n): every row's gradient weight (times ``w_mul``; None: all 1).
    ``classes``: SupCon's class terms (``supcon.RingClasses``), which every block feeds
    (its rows' class sums over the block's columns and the other way round); the column
    rows' dot terms travel in the gathered states, their gradient terms with the chunk's.

    Returns ``(lse, the rows' losses, ∂L/∂(scaled rows) or None)`` (with ``classes``: the
    class terms of the rank's own rows not yet in it, ``classes.finish`` adds them)."""
    xp = np if isinstance(zn, np.ndarray) else _local._cupy()
    rank, size, n2 = comm.rank, comm.size, zn.shape[0]
    h = n2 // 2
    plan = _local.NtXentPlan(rank, size, n2, ring=True)
    a = acc_dtype(zn.dtype)
    half = size // 2 if plan.even else None  # the step of the split pair's chunk (opp's)
    lse_d, loss_d, _ = path.rows(
        zn, zn, None, None, scale, exclude_diag=True, pos_shift=h, pos_mod=n2, lse_in=None,
        weights=(None, 0, 0.0), want_grad=False, workspace_bytes=ws, op="nt_xent",
        self_pair=True)
    if classes is not None:
        classes.diag()
    chunks = {}
    partial = _local._empty_states(xp, plan.k + plan.even, n2, a)  # a block's rows each
    # the column states (m, s) and, with classes, the column rows' class dots (zeros: none)
    state = xp.zeros((2 if classes is None else 3, plan.width), a)
    state[0] = -np.inf

    def block_of(k):
        """(rows, columns of the chunk, state offset) of step k's block."""
        if k <= plan.k:
            return slice(0, n2), slice(0, n2), (k - 1) * n2
        return (slice(0, h), slice(0, n2), plan.k * n2) if plan.lead else \
            (slice(0, n2), slice(h, n2), plan.k * n2)

    def stats(k, q, chunk):
        if k == 0:
            return None, None
        chunks[q] = chunk
        rows, cols, off = block_of(k)
        # the chunk's rows' raw positive dots (the tile path's column shift), as its owner
        # computes them for the all-gather schedule: the same bits
        dots = engine.pair_dots(chunk[:h], chunk[h:])
        lse_b, st, _ = engine.cross(zn[rows], chunk[cols], scale, lse_r=None, lse_c=None,
                                    weights=None, want_stats=True, want_grad=False,
                                    workspace_bytes=ws,
                                    col_shift=xp.concatenate([dots, dots])[cols])
        partial[k - 1, 0, rows] = lse_b
        partial[k - 1, 1, rows] = 1
        state[:2, off:off + st.shape[1]] = st
        if classes is not None:
            state[2, off:off + st.shape[1]] = classes.block(q, rows, cols, chunk)
        return None, None

    _global.ring_blocks(comm, zn, stats, col_grads=False,
                        steps=plan.k + 1 + (1 if plan.even else 0))
    states = comm.all_gather(state)
    lse = _local.nt_xent_lse(plan, engine, lse_d, partial, states[:, :2])
    if classes is not None:
        classes.gathered(plan.sources(), states[:, 2])
    rows = loss_d + (lse - lse_d)
    if w_mul is None:
        return lse, rows, None
    lse_all = comm.all_gather(lse)
    w_own = None if w_all is None else w_all[rank]

    def grads(k, q, _):
        if k == 0:  # the diagonal block: its rows' and columns' parts are both this rank's
            _, _, (dd, _, _, _) = path.rows(
                zn, zn, None, None, scale, exclude_diag=True, pos_shift=h, pos_mod=n2,
                lse_in=lse, weights=(w_own, 1, w_mul), want_grad=True, workspace_bytes=ws,
                op="nt_xent", self_pair=True)
            return dd, xp.zeros_like(dd)
        dq, dk = xp.zeros(zn.shape, a), xp.zeros(zn.shape, a)
        if k <= plan.k or k == half:
            rows, cols, _ = block_of(k)
            _, _, (gq, gk) = engine.cross(
                zn[rows], chunks[q][cols], scale, lse_r=lse[rows], lse_c=lse_all[q][cols],
                weights=(None if w_own is None else w_own[rows],
                         None if w_all is None else w_all[q][cols], w_mul),
                want_stats=False, want_grad=True, workspace_bytes=ws)
            dq[rows], dk[cols] = gq, gk
            if classes is not None:  # (the chunk's rows' class terms travel home with gk)
                dk[cols] += classes.col_grad(q)
        return dq, dk

    steps, dk = _global.ring_blocks(comm, None, grads, col_grads=True)
    return lse, rows, _global.sum_steps(steps) + dk


def _global_acc(ctx: Context, g):
    """The "none" backward's accumulator: every rank's upstream gradients as the weights."""
    s, xp = ctx.saved, ctx.xp
    comm = s["comm"]
    w_all = comm.all_gather(_global.upstream(xp, g, ctx.n, s["lse_all"].dtype))
    engine = _local.engine_for(xp)
    acc = comm.reduce_scatter(_local.nt_xent_grads(
        Path(xp), engine, s["plan"], s["zn"], s["parts"], s["scale"], s["lse_all"], w_all, 1.0,
        s["ws"]))
    if s["eps"]:
        size, n2 = comm.size, ctx.n
        w_flat = w_all.reshape(-1)
        acc += _variants.nt_xent_smoothing(
            xp, s["zn"], s["scale"], s["eps"], w_flat[comm.rank * n2:(comm.rank + 1) * n2],
            want_loss=False, every=(s["parts"].reshape(size * n2, -1), w_flat))[1]
    dt = _global.unscale_rows(comm, xp, s["zn"], acc, s["temp"], s["root"], s["tgrad"])
    return (acc,), (dt,) if s["tgrad"] else ()


_GLOBAL = _global.Schedule(recompute=_global_acc, result=_global.rows_and_temperature,
                          scalars=_global.saved_temperature_grad)
