"""Query/key InfoNCE for PyTorch: op bodies, torch.compile shapes, autograd, custom ops, the
public function.
"""
from typing import Any, Optional, Tuple

from torch import Tensor

from ... import _checks
from ...ops import _base
from ...ops import info_nce as core
from .. import _bridge as B
from .. import _registry as R


def fwd(query: Tensor, key: Tensor, negatives: Optional[Tensor], temperature: float,
        reduction: str, normalize: bool, workspace_bytes: Optional[int],
        precision: Optional[str] = None, fused: bool = False
        ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, dq_acc, dk_acc, dn_acc, norm_q, norm_k, norm_n): the loss (0-d, or (N,)
    for "none"), the (N,) row log-sum-exps and, when ``fused``, the unit-upstream gradient
    accumulators and the row norms (normalize=True) of query, key and negatives
    (placeholders where there is none)."""
    with B.device_scope(query.device):
        args = (B.array_of(query), B.array_of(key), temperature)
        if fused:
            loss, ctx = core.info_nce_forward(
                *args, negatives=B.array_of(negatives), reduction=reduction,
                normalize=normalize, workspace_bytes=workspace_bytes, requires_grad=True,
                precision=precision)
            s = ctx.saved
            return ((B.tensor_of(loss), R.fused_stat(ctx.stats[0]))
                    + tuple(R.opt_tensor(x, query) for x in s["acc"])
                    + tuple(R.opt_tensor(x, query) for x in s["norms"]))
        rows, ctx = core.info_nce_forward(
            *args, negatives=B.array_of(negatives), reduction="none", normalize=normalize,
            workspace_bytes=workspace_bytes, requires_grad=True, precision=precision)
        loss = _base.reduce(ctx.xp, rows, reduction)
        return (B.tensor_of(loss), B.tensor_of(ctx.stats[0])) + tuple(R.empty(query) for _ in range(6))


def bwd(query: Tensor, key: Tensor, negatives: Optional[Tensor], lse: Tensor,
        grad_loss: Tensor, temperature: float, reduction: str, normalize: bool,
        workspace_bytes: Optional[int],
        precision: Optional[str] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """(dquery, dkey, dnegatives); dnegatives is an empty (0,) tensor without negatives."""
    with B.device_scope(query.device):
        dq, dk, dn = core.info_nce_backward_from_stats(
            B.array_of(query), B.array_of(key), B.array_of(negatives), B.array_of(lse),
            B.array_of(grad_loss), temperature=temperature, reduction=reduction,
            normalize=normalize, workspace_bytes=workspace_bytes, precision=precision)
        dn = query.new_empty((0,)) if dn is None else B.tensor_of(dn)  # ops return tensors
        return B.tensor_of(dq), B.tensor_of(dk), dn


def evaluate(query: Tensor, key: Tensor, negatives: Optional[Tensor], temperature: float,
             reduction: str, normalize: bool, workspace_bytes: Optional[int],
             precision: Optional[str] = None) -> Tuple[Tensor]:
    """The loss alone, for calls no gradient will be asked of (grad mode off, or no input
    requiring one): the core's forward keeps no context, so repeated GPU calls replay their
    graph (and, learnt, straight from the tensors: ``R.evaluate``)."""
    with B.device_scope(query.device):
        loss, _ = core.info_nce_forward(
            B.array_of(query), B.array_of(key), temperature, negatives=B.array_of(negatives),
            reduction=reduction, normalize=normalize, workspace_bytes=workspace_bytes,
            requires_grad=False, precision=precision)
        return (B.tensor_of(loss),)


def fwd_fake(query, key, negatives, temperature, reduction, normalize,
             workspace_bytes, precision=None, fused=False):
    xs = (query, key, negatives)
    return ((R.loss_like(query, reduction), R.stat_like(query))
            + tuple(R.acc_like(x, fused, query) for x in xs)
            + tuple(R.norm_like(x, fused, normalize, query) for x in xs))


def bwd_fake(query, key, negatives, lse, grad_loss, temperature, reduction,
             normalize, workspace_bytes, precision=None):
    dn = query.new_empty((0,)) if negatives is None else negatives.new_empty(negatives.shape)
    return query.new_empty(query.shape), key.new_empty(key.shape), dn


def setup_context(ctx, inputs, output) -> None:
    query, key, negatives, temperature, reduction, normalize, workspace_bytes = inputs[:7]
    ctx.fused = R.fused_flag(inputs, 8)
    ctx.has_neg = negatives is not None
    if ctx.fused:  # accumulators and norms of query, key, negatives (+ inputs to normalise)
        xs = (query, key, negatives) if normalize else (None, None, None)
        ctx.save_for_backward(*xs, *output[2:8])
        ctx.dtypes = tuple(None if x is None else x.dtype for x in (query, key, negatives))
    else:
        ctx.save_for_backward(query, key, negatives, output[1])
    ctx.args = (temperature, reduction, normalize, workspace_bytes, R.input_at(inputs, 7))
    R.non_differentiable(ctx, *output[1:])


def backward(ctx, grad_loss, *_grad_stats):
    need = ctx.needs_input_grad
    dq = dk = dn = None
    if ctx.fused:
        saved = ctx.saved_tensors
        xs, accs, norms = saved[:3], saved[3:6], saved[6:9]
        grads = [R.scaled(xs[i], norms[i], accs[i], grad_loss, ctx.dtypes[i], ctx.args[2],
                           getattr(ctx, "direct", False))
                 if need[i] and (i < 2 or ctx.has_neg) else None for i in range(3)]
        dq, dk, dn = grads
    elif any(need[:3]):
        query, key, negatives, lse = ctx.saved_tensors
        dq, dk, dn = BWD(query, key, negatives, lse, grad_loss.contiguous(),
                                      *ctx.args)
    return (dq if need[0] else None, dk if need[1] else None,
            dn if need[2] and ctx.has_neg else None, None, None, None, None, None, None)


InfoNCEFunction, FWD, BWD = R.register(
    "info_nce", "InfoNCEFunction", fwd, fwd_fake, bwd, bwd_fake, setup_context, backward,
    autocast=(0, 1, 2), fast=True)


def info_nce(query: Tensor, key: Tensor, temperature: float = 0.1, *,
             negatives: Optional[Tensor] = None, reduction: str = "mean",
             normalize: bool = False, workspace_bytes: Optional[int] = None,
             group: Optional[Any] = None, precision: Optional[str] = None) -> Tensor:
    """Query/key InfoNCE with in-batch negatives (and optional explicit ones).

    Parameters
    ----------
    query, key : Tensor (N, D), paired by row: key i is query i's positive, the other N − 1
        keys its in-batch negatives.
    temperature : float > 0, default 0.1
    negatives : Tensor, optional
        (M, D) shared by every query, or (N, M, D) per query; differentiable.
    reduction, normalize, workspace_bytes, precision : as for :func:`nt_xent` (``normalize``
        applies to query, key and negatives alike; ``precision=None`` follows torch's TF32
        setting, then ``cupynce.get_float32_precision()``).
    group : torch.distributed process group, optional
        The loss of the group's global batch (queries and keys concatenated in rank order):
        every rank's keys are candidates of every query, shared (M, D) negatives of every rank
        join every query's candidates, per-query (n, M, D) negatives stay with their query.
        Gradient convention: DDP's (``cupynce.torch.distributed``).

    Returns
    -------
    Tensor: 0-d (mean/sum) or (N,) (none); float32 (float64 for float64 inputs).

    Notes
    -----
    ``loss_i = log Σ_{c ∈ C_i} exp(q̂_i·ĉ/τ) − q̂_i·k̂_i/τ`` with C_i = all keys, the shared
    negatives and query i's own negatives.  (info-nce-pytorch drops the in-batch keys when
    explicit negatives are given; here they always count.)
    """
    if group is not None:  # every check inside the group's first exchange
        from .. import distributed

        return distributed.info_nce(query, key, negatives, temperature, reduction, normalize,
                                    workspace_bytes, group, precision)
    t = _checks.check_temperature("info_nce", temperature)
    reduction, workspace_bytes = R.scalars("info_nce", reduction, workspace_bytes)
    B.check_tensors("info_nce", optional=("negatives",), query=query, key=key,
                     negatives=negatives)
    normalize = _checks.check_bool("info_nce", "normalize", normalize)
    args = (query, key, negatives, t, reduction, normalize, workspace_bytes,
            R.precision_of("info_nce", precision), R.fused(reduction, query, key, negatives))
    if R.direct(query, key, negatives):
        if not R.needs_grad(query, key, negatives):
            return R.evaluate(evaluate, args[:-1])
        return InfoNCEFunction.apply(*args)
    return FWD(*args)[0]
