"""CLIP's loss for PyTorch: op bodies, torch.compile shapes, autograd, custom ops, the public
function.
"""
import numbers
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ... import _checks
from ...ops import _base
from ...ops import clip as core
from .. import _bridge as B
from .. import _registry as R


def fwd(a: Tensor, b: Tensor, logit_scale: Optional[Tensor], logit_scale_value: float,
        reduction: str, normalize: bool, workspace_bytes: Optional[int],
        precision: Optional[str] = None, fused: bool = False
        ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse_rows, lse_cols, da_acc, db_acc, norm_a, norm_b, dscale): when ``fused``,
    the unit-upstream gradient accumulators, row norms (normalize=True) and the 0-d
    d loss / d logit_scale; placeholders otherwise.  ``logit_scale`` is the tensor, or None and
    the real ``logit_scale_value`` is used (a Python float never becomes a device tensor)."""
    with B.device_scope(a.device):
        ls = B.scalar_of(logit_scale, logit_scale_value)
        if fused:
            loss, ctx = core.clip_loss_forward(
                B.array_of(a), B.array_of(b), ls, reduction=reduction, normalize=normalize,
                workspace_bytes=workspace_bytes, requires_grad=True, precision=precision)
            s = ctx.saved
            return ((B.tensor_of(loss),) + tuple(R.fused_stat(x) for x in ctx.stats)
                    + tuple(R.opt_tensor(x, a) for x in s["acc"])
                    + tuple(R.opt_tensor(x, a) for x in s["norms"])
                    + (B.tensor_of(ctx.xp.asarray(s["dscale"])),))
        rows, ctx = core.clip_loss_forward(
            B.array_of(a), B.array_of(b), ls, reduction="none", normalize=normalize,
            workspace_bytes=workspace_bytes, requires_grad=True, precision=precision)
        loss = _base.reduce(ctx.xp, rows, reduction)
        lse_r, lse_c = ctx.stats
        return (B.tensor_of(loss), B.tensor_of(lse_r), B.tensor_of(lse_c)) + tuple(R.empty(a) for _ in range(5))


def bwd(a: Tensor, b: Tensor, logit_scale: Optional[Tensor], logit_scale_value: float,
        lse_r: Tensor, lse_c: Tensor, grad_loss: Tensor, reduction: str,
        normalize: bool, workspace_bytes: Optional[int],
        precision: Optional[str] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """(da, db, dlogit_scale); dlogit_scale has logit_scale's shape and dtype (0-d float32 /
    float64 when a real was given)."""
    with B.device_scope(a.device):
        ls = B.scalar_of(logit_scale, logit_scale_value)
        da, db, dls = core.clip_loss_backward_from_stats(
            B.array_of(a), B.array_of(b), ls, B.array_of(lse_r), B.array_of(lse_c),
            B.array_of(grad_loss), reduction=reduction, normalize=normalize,
            workspace_bytes=workspace_bytes, precision=precision)
        return B.tensor_of(da), B.tensor_of(db), B.tensor_of(dls)


def evaluate(a: Tensor, b: Tensor, logit_scale: Optional[Tensor], logit_scale_value: float,
             reduction: str, normalize: bool, workspace_bytes: Optional[int],
             precision: Optional[str] = None) -> Tuple[Tensor]:
    """The loss alone, for calls no gradient will be asked of (grad mode off, or no input
    requiring one): the core's forward keeps no context, so repeated GPU calls replay their
    graph (and, learnt, straight from the tensors: ``R.evaluate``)."""
    with B.device_scope(a.device):
        ls = B.scalar_of(logit_scale, logit_scale_value)
        loss, _ = core.clip_loss_forward(B.array_of(a), B.array_of(b), ls, reduction=reduction,
                                         normalize=normalize, workspace_bytes=workspace_bytes,
                                         requires_grad=False, precision=precision)
        return (B.tensor_of(loss),)


def fwd_fake(a, b, logit_scale, logit_scale_value, reduction, normalize,
             workspace_bytes, precision=None, fused=False):
    dscale = a.new_empty((), dtype=R.acc_dtype(a.dtype)) if fused else R.empty(a)
    return ((R.loss_like(a, reduction), R.stat_like(a), R.stat_like(a))
            + tuple(R.acc_like(x, fused, a) for x in (a, b))
            + tuple(R.norm_like(x, fused, normalize, a) for x in (a, b)) + (dscale,))


def bwd_fake(a, b, logit_scale, logit_scale_value, lse_r, lse_c, grad_loss,
             reduction, normalize, workspace_bytes, precision=None):
    dls = a.new_empty((), dtype=R.acc_dtype(a.dtype)) if logit_scale is None else \
        logit_scale.new_empty(logit_scale.shape)
    return a.new_empty(a.shape), b.new_empty(b.shape), dls


def setup_context(ctx, inputs, output) -> None:
    a, b, logit_scale, logit_scale_value, reduction, normalize, workspace_bytes = inputs[:7]
    ctx.fused = R.fused_flag(inputs, 8)
    ctx.has_ls = logit_scale is not None
    if ctx.fused:  # accumulators, norms and d loss / d logit_scale (+ inputs to normalise)
        xs = (a, b) if normalize else (None, None)
        ctx.save_for_backward(*xs, *output[3:8])
        ctx.dtypes = (a.dtype, b.dtype)
        ctx.ls_meta = None if logit_scale is None else (logit_scale.dtype, logit_scale.shape)
    else:
        ctx.save_for_backward(a, b, logit_scale, output[1], output[2])
    ctx.args = (logit_scale_value, reduction, normalize, workspace_bytes,
                R.input_at(inputs, 7))
    R.non_differentiable(ctx, *output[1:])


def backward(ctx, grad_loss, *_grad_stats):
    need = ctx.needs_input_grad
    ls_value, reduction, normalize, workspace_bytes, precision = ctx.args
    da = db = dls = None
    if ctx.fused:
        R.refuse_double_backward()  # (also when only logit_scale needs a gradient)
        xa, xb, acc_a, acc_b, norm_a, norm_b, dscale = ctx.saved_tensors
        if need[0]:
            da = R.scaled(xa, norm_a, acc_a, grad_loss, ctx.dtypes[0], normalize,
                          getattr(ctx, "direct", False))
        if need[1]:
            db = R.scaled(xb, norm_b, acc_b, grad_loss, ctx.dtypes[1], normalize,
                          getattr(ctx, "direct", False))
        if need[2] and ctx.has_ls:  # the core's dscale * g, cast to logit_scale's dtype
            dls = (dscale * grad_loss).to(ctx.ls_meta[0]).reshape(ctx.ls_meta[1])
    elif any(need[:3]):
        a, b, logit_scale, lse_r, lse_c = ctx.saved_tensors
        da, db, dls = BWD(a, b, logit_scale, ls_value, lse_r, lse_c, grad_loss.contiguous(),
                          reduction, normalize, workspace_bytes, precision)
    return (da if need[0] else None, db if need[1] else None,
            dls if need[2] and ctx.has_ls else None, None, None, None, None, None, None)


ClipLossFunction, FWD, BWD = R.register(
    "clip_loss", "ClipLossFunction", fwd, fwd_fake, bwd, bwd_fake, setup_context, backward,
    autocast=(0, 1), fast=True)


def _logit_scale(a: Any, b: Any, logit_scale: Any) -> Tuple[Optional[Tensor], float]:
    """Check the tensors and ``logit_scale``: (the tensor, 0.0) or (None, its host value)."""
    op = "clip_loss"
    if isinstance(logit_scale, Tensor):
        B.check_tensors(op, a=a, b=b, logit_scale=logit_scale)
        return logit_scale, 0.0
    if isinstance(logit_scale, numbers.Real):
        B.check_tensors(op, a=a, b=b)
        acc = np.float64 if a.dtype == torch.float64 else np.float32
        return None, _checks.check_logit_scale(op, logit_scale, None, acc)[0]
    raise TypeError(f"{op}: logit_scale must be a real number or a torch.Tensor of shape () "
                    f"or (1,), got {type(logit_scale).__module__}."
                    f"{type(logit_scale).__name__}")


def clip_loss(a: Tensor, b: Tensor, logit_scale: Any, *, reduction: str = "mean",
              normalize: bool = False, workspace_bytes: Optional[int] = None,
              group: Optional[Any] = None, precision: Optional[str] = None) -> Tensor:
    """CLIP's symmetric contrastive loss, differentiable w.r.t. a, b and a tensor logit_scale.

    Parameters
    ----------
    a, b : Tensor (N, D) — e.g. image and text embeddings; pair i is (a_i, b_i).
    logit_scale : real, or Tensor of shape () or (1,) on a's device
        Log inverse temperature: the logits are ``exp(logit_scale) · â b̂ᵀ``.  A tensor is a
        differentiable input (CLIP's learnable temperature) and is never read on the host;
        clamping it is the caller's business (:class:`ClipLoss` does it).
    reduction : "mean" (default) | "sum" | "none" (per pair: (row CE_i + column CE_i) / 2)
    normalize, workspace_bytes, precision : as for :func:`nt_xent` (``precision=None``
        follows torch's TF32 setting, then ``cupynce.get_float32_precision()``).
    group : torch.distributed process group, optional
        The loss of the group's global batch (pairs concatenated in rank order): each rank's
        images against every text and its texts against every image.  Feature gradients
        follow DDP's convention; ``logit_scale``'s gradient is the global one on every rank
        (``cupynce.torch.distributed``).

    Returns
    -------
    Tensor: 0-d (mean/sum) or (N,) (none); float32 (float64 for float64 inputs).

    Notes
    -----
    ``L = exp(logit_scale) · â b̂ᵀ``; ``loss = (CE(L, arange) + CE(Lᵀ, arange)) / 2`` as in
    CLIP / open_clip.  Forward keeps a, b, logit_scale and the row and column log-sum-exps.
    """
    op = "clip_loss"
    if group is not None:  # every check inside the group's first exchange
        from .. import distributed

        return distributed.clip_loss(a, b, logit_scale, reduction, normalize, workspace_bytes,
                                     group, _logit_scale, precision)
    reduction, workspace_bytes = R.scalars(op, reduction, workspace_bytes)
    ls_tensor, ls_value = _logit_scale(a, b, logit_scale)
    normalize = _checks.check_bool(op, "normalize", normalize)
    args = (a, b, ls_tensor, ls_value, reduction, normalize, workspace_bytes,
            R.precision_of(op, precision), R.fused(reduction, a, b, ls_tensor))
    if R.direct(a, b, ls_tensor):
        if not R.needs_grad(a, b, ls_tensor):
            return R.evaluate(evaluate, args[:-1])
        return ClipLossFunction.apply(*args)
    return FWD(*args)[0]
