"""What the adapters share: the scale conventions, the process group, per-rank values."""
import math
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor


def log_scale(op: str, logit_scale: Any) -> Any:
    """open_clip's *exponentiated* ``logit_scale`` (a tensor or a real) as the log that
    cupynce's ops take: ``torch.log`` (the gradient reaches the caller's tensor; a
    half-precision tensor's log is taken in float32) or ``math.log``.  A real, or a one-element
    host tensor, must be finite and > 0 (a CUDA tensor is never read back: the log of a value
    <= 0 is NaN / -inf, which the op rejects or propagates)."""
    tensor = isinstance(logit_scale, Tensor)
    if not tensor and (isinstance(logit_scale, bool)
                       or not isinstance(logit_scale, (int, float))):
        raise TypeError(f"{op}: logit_scale must be a tensor or a real, got "
                        f"{type(logit_scale).__name__}")
    if not tensor or (logit_scale.device.type == "cpu" and logit_scale.numel() == 1):
        v = float(logit_scale.detach().reshape(()) if tensor else logit_scale)
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(
                f"{op}: logit_scale={v!r}: open_clip's convention passes the scale itself "
                "(logit_scale.exp(), e.g. 100 at CLIP's clamp), which must be finite and > 0")
    if not tensor:
        return math.log(float(logit_scale))
    if logit_scale.dtype in (torch.float16, torch.bfloat16):  # (open_clip's pure bf16:
        logit_scale = logit_scale.float()  # log(bf16(100)) = 4.594, a scale of 98.9)
    return torch.log(logit_scale)


def world_group(op: str, rank: int, world_size: int, group: Optional[Any] = None
                ) -> Tuple[Optional[Any], int]:
    """The process group of a library's explicit ``rank`` / ``world_size`` arguments:
    ``(None, 1)`` for one process, else ``(group or the default group, world_size)`` once
    torch.distributed is initialised with the same rank and size."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"{op}: world_size must be an int >= 1, got {world_size!r}")
    if world_size == 1:
        if group is not None:
            raise ValueError(f"{op}: group= is given but world_size=1: pass the group's "
                             "rank and world_size too (open_clip's arguments decide)")
        return None, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{op}: world_size={world_size} but torch.distributed is not "
                           "initialised (call torch.distributed.init_process_group first)")
    g = dist.group.WORLD if group is None else group
    size, me = dist.get_world_size(g), dist.get_rank(g)
    if (size, me) != (world_size, rank):
        raise ValueError(f"{op}: rank={rank}, world_size={world_size} disagree with the "
                         f"process group (rank {me} of {size})")
    return g, size


def dist_group(group: Optional[Any] = None) -> Tuple[Optional[Any], int]:
    """The group of a library that gathers over the default group when one is initialised
    (lightly's ``gather_distributed``, sentence-transformers' ``gather_across_devices``):
    ``(None, 1)`` without torch.distributed or with one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1
    g = dist.group.WORLD if group is None else group
    size = dist.get_world_size(g)
    return (g, size) if size > 1 else (None, 1)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times ``c``."""

    @staticmethod
    def forward(ctx, x: Tensor, c: float) -> Tensor:
        ctx.c = c
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g * ctx.c, None


def scale_grad(x: Tensor, c: float) -> Tensor:
    """``x`` whose gradient is multiplied by ``c`` on the way back."""
    return _ScaleGrad.apply(x, c) if x.requires_grad else x


def rank_share(rows: Tensor, size: int, denom: Optional[int] = None) -> Tensor:
    """The rank's share of a global loss from its rows of the op's ``reduction="none"``:
    value ``rows.sum() / denom`` (``rows.mean()`` by default), gradient P times the global
    loss's.  (The "none" backward, with the rank's upstream 1/n on every rank, gives P² times
    it; the share's gradient is scaled by 1/P, its value kept.)"""
    v = rows.mean() if denom is None else rows.sum() / denom
    part = v / size
    return part + (v - part).detach()
