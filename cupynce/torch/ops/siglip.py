"""SigLIP's sigmoid loss for PyTorch: op bodies, torch.compile shapes, autograd, custom ops,
the public function.
"""
import numbers
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ... import _checks
from ...ops import siglip as core
from .. import _bridge as B
from .. import _registry as R

OP = "siglip_loss"


def fwd(a: Tensor, b: Tensor, logit_scale: Optional[Tensor], logit_scale_value: float,
        logit_bias: Optional[Tensor], logit_bias_value: float, reduction: str,
        normalize: bool, workspace_bytes: Optional[int], precision: Optional[str] = None,
        fused: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, da_acc, db_acc, norm_a, norm_b, dscale, dbias): when ``fused``, the
    unit-upstream gradient accumulators, row norms (normalize=True) and the 0-d
    d loss / d logit_scale and d loss / d logit_bias; placeholders otherwise.  A scalar given
    as None is the real ``*_value`` (a Python float never becomes a device tensor)."""
    with B.device_scope(a.device):
        ls = B.scalar_of(logit_scale, logit_scale_value)
        lb = B.scalar_of(logit_bias, logit_bias_value)
        loss, ctx = core.siglip_loss_forward(
            B.array_of(a), B.array_of(b), ls, lb, reduction=reduction, normalize=normalize,
            workspace_bytes=workspace_bytes, requires_grad=fused, precision=precision)
        if not fused:
            return (B.tensor_of(loss),) + tuple(R.empty(a) for _ in range(6))
        s = ctx.saved
        return ((B.tensor_of(loss),) + tuple(R.opt_tensor(x, a) for x in s["acc"])
                + tuple(R.opt_tensor(x, a) for x in s["norms"])
                + tuple(B.tensor_of(ctx.xp.asarray(x)) for x in s["dscalars"]))


def bwd(a: Tensor, b: Tensor, logit_scale: Optional[Tensor], logit_scale_value: float,
        logit_bias: Optional[Tensor], logit_bias_value: float, grad_loss: Tensor,
        reduction: str, normalize: bool, workspace_bytes: Optional[int],
        precision: Optional[str] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(da, db, dlogit_scale, dlogit_bias) recomputed from the inputs; the scalar gradients
    have the tensor's shape and dtype (0-d float32 / float64 when a real was given)."""
    with B.device_scope(a.device):
        ls = B.scalar_of(logit_scale, logit_scale_value)
        lb = B.scalar_of(logit_bias, logit_bias_value)
        grads = core.siglip_loss_backward_from_inputs(
            B.array_of(a), B.array_of(b), ls, lb, B.array_of(grad_loss), reduction=reduction,
            normalize=normalize, workspace_bytes=workspace_bytes, precision=precision)
        return tuple(B.tensor_of(x) for x in grads)


def evaluate(a: Tensor, b: Tensor, logit_scale: Optional[Tensor], logit_scale_value: float,
             logit_bias: Optional[Tensor], logit_bias_value: float, reduction: str,
             normalize: bool, workspace_bytes: Optional[int],
             precision: Optional[str] = None) -> Tuple[Tensor]:
    """The loss alone, for calls no gradient will be asked of (grad mode off, or no input
    requiring one): the core's forward keeps no context, so repeated GPU calls replay their
    graph (and, learnt, straight from the tensors: ``R.evaluate``)."""
    with B.device_scope(a.device):
        ls = B.scalar_of(logit_scale, logit_scale_value)
        lb = B.scalar_of(logit_bias, logit_bias_value)
        loss, _ = core.siglip_loss_forward(
            B.array_of(a), B.array_of(b), ls, lb, reduction=reduction, normalize=normalize,
            workspace_bytes=workspace_bytes, requires_grad=False, precision=precision)
        return (B.tensor_of(loss),)


def fwd_fake(a, b, logit_scale, logit_scale_value, logit_bias, logit_bias_value, reduction,
             normalize, workspace_bytes, precision=None, fused=False):
    scalars = tuple(a.new_empty((), dtype=R.acc_dtype(a.dtype)) if fused else R.empty(a)
                    for _ in range(2))  # (two tensors: outputs never alias each other)
    return ((R.loss_like(a, reduction),) + tuple(R.acc_like(x, fused, a) for x in (a, b))
            + tuple(R.norm_like(x, fused, normalize, a) for x in (a, b)) + scalars)


def bwd_fake(a, b, logit_scale, logit_scale_value, logit_bias, logit_bias_value, grad_loss,
             reduction, normalize, workspace_bytes, precision=None):
    def scalar_like(t):
        return a.new_empty((), dtype=R.acc_dtype(a.dtype)) if t is None else \
            t.new_empty(t.shape)
    return (a.new_empty(a.shape), b.new_empty(b.shape), scalar_like(logit_scale),
            scalar_like(logit_bias))


def setup_context(ctx, inputs, output) -> None:
    a, b, ls, ls_value, lb, lb_value, reduction, normalize, workspace_bytes = inputs[:9]
    ctx.fused = R.fused_flag(inputs, 10)
    ctx.has = (ls is not None, lb is not None)
    ctx.meta = tuple(None if t is None else (t.dtype, t.shape) for t in (ls, lb))
    if ctx.fused:  # accumulators, norms, the scalar gradients (+ inputs to normalise)
        xs = (a, b) if normalize else (None, None)
        ctx.save_for_backward(*xs, *output[1:7])
        ctx.dtypes = (a.dtype, b.dtype)
    else:
        ctx.save_for_backward(a, b, ls, lb)
    ctx.args = (ls_value, lb_value, reduction, normalize, workspace_bytes,
                R.input_at(inputs, 9))
    R.non_differentiable(ctx, *output[1:])


def backward(ctx, grad_loss, *_grad_rest):
    need = ctx.needs_input_grad
    ls_value, lb_value, reduction, normalize, workspace_bytes, precision = ctx.args
    da = db = dls = dlb = None
    direct = getattr(ctx, "direct", False)
    if ctx.fused:
        R.refuse_double_backward()  # (also when only the scalars need a gradient)
        xa, xb, acc_a, acc_b, norm_a, norm_b, dscale, dbias = ctx.saved_tensors
        if need[0]:
            da = R.scaled(xa, norm_a, acc_a, grad_loss, ctx.dtypes[0], normalize, direct)
        if need[1]:
            db = R.scaled(xb, norm_b, acc_b, grad_loss, ctx.dtypes[1], normalize, direct)
        if need[2] and ctx.has[0]:  # the core's d(scalar) * g, cast to the tensor's dtype
            dls = (dscale * grad_loss).to(ctx.meta[0][0]).reshape(ctx.meta[0][1])
        if need[4] and ctx.has[1]:
            dlb = (dbias * grad_loss).to(ctx.meta[1][0]).reshape(ctx.meta[1][1])
    elif any(need[:5]):
        R.refuse_double_backward()
        a, b, ls, lb = ctx.saved_tensors
        da, db, dls, dlb = BWD(a, b, ls, ls_value, lb, lb_value, grad_loss.contiguous(),
                               reduction, normalize, workspace_bytes, precision)
    return (da if need[0] else None, db if need[1] else None,
            dls if need[2] and ctx.has[0] else None, None,
            dlb if need[4] and ctx.has[1] else None, None, None, None, None, None, None)


SigLipLossFunction, FWD, BWD = R.register(
    "siglip_loss", "SigLipLossFunction", fwd, fwd_fake, bwd, bwd_fake, setup_context, backward,
    autocast=(0, 1), fast=True)


def _scalar(name: str, value: Any, a: Tensor) -> Tuple[Optional[Tensor], float]:
    """A tensor scalar (differentiable) -> (tensor, 0.0); a real -> (None, its value)."""
    if isinstance(value, Tensor):
        return value, 0.0
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        acc = np.float64 if a.dtype == torch.float64 else np.float32
        if name == "logit_scale":
            return None, _checks.check_logit_scale(OP, value, None, acc)[0]
        return None, _checks.check_scalar_input(OP, name, value, None)[0]
    raise TypeError(f"{OP}: {name} must be a real number or a torch.Tensor of shape () or "
                    f"(1,), got {type(value).__module__}.{type(value).__name__}")


def siglip_loss(a: Tensor, b: Tensor, logit_scale: Any, logit_bias: Any, *,
                reduction: str = "mean", normalize: bool = False,
                workspace_bytes: Optional[int] = None, group: Optional[Any] = None,
                precision: Optional[str] = None) -> Tensor:
    """SigLIP's pairwise sigmoid loss, differentiable w.r.t. a, b and tensor scale / bias.

    Parameters
    ----------
    a, b : Tensor (N, D) — e.g. image and text embeddings; pair i is (a_i, b_i).
    logit_scale : real, or Tensor of shape () or (1,) on a's device
        Log scale t: the logits are ``exp(t) · â b̂ᵀ + logit_bias`` (SigLIP starts at
        log 10).  A tensor is a differentiable input, never read on the host.
    logit_bias : real, or Tensor of shape () or (1,) (SigLIP starts at −10).
    reduction : "mean" (default: the sum over the N² pairs divided by N, as open_clip) |
        "sum" | "none" (the (N,) per-row sums)
    normalize, workspace_bytes, precision : as for :func:`nt_xent` (``precision=None``
        follows torch's TF32 setting, then ``cupynce.get_float32_precision()``).
    group : torch.distributed process group, optional
        The loss of the group's global batch (pairs concatenated in rank order): each rank's
        images against every text.  Feature gradients follow DDP's convention; the scale's
        and bias's gradients are the global ones on every rank
        (``cupynce.torch.distributed``).

    Returns
    -------
    Tensor: 0-d (mean/sum) or (N,) (none); float32 (float64 for float64 inputs).

    Notes
    -----
    ``L = exp(t) · â b̂ᵀ + β``, labels ``z = 2 I − 1``,
    ``loss = Σ_ij −log σ(z_ij L_ij) / N`` (open_clip's ``SigLipLoss`` on one GPU).
    """
    if group is not None:  # every check inside the group's first exchange
        from .. import distributed

        return distributed.siglip_loss(a, b, logit_scale, logit_bias, reduction, normalize,
                                       workspace_bytes, group, _scalar, precision)
    reduction, workspace_bytes = R.scalars(OP, reduction, workspace_bytes)
    B.check_tensors(OP, a=a, b=b)
    ls_tensor, ls_value = _scalar("logit_scale", logit_scale, a)
    lb_tensor, lb_value = _scalar("logit_bias", logit_bias, a)
    tensors = dict(a=a, b=b)
    if ls_tensor is not None:
        tensors["logit_scale"] = ls_tensor
    if lb_tensor is not None:
        tensors["logit_bias"] = lb_tensor
    B.check_tensors(OP, **tensors)
    normalize = _checks.check_bool(OP, "normalize", normalize)
    args = (a, b, ls_tensor, ls_value, lb_tensor, lb_value, reduction, normalize,
            workspace_bytes, R.precision_of(OP, precision),
            R.fused(reduction, a, b, ls_tensor, lb_tensor))
    if R.direct(a, b, ls_tensor, lb_tensor):
        if not R.needs_grad(a, b, ls_tensor, lb_tensor):
            return R.evaluate(evaluate, args[:-1])
        return SigLipLossFunction.apply(*args)
    return FWD(*args)[0]
