"""NT-Xent for PyTorch: the op bodies on tensors, their shapes for torch.compile, autograd,
the registered custom ops and the public function.
"""
from typing import Any, Optional, Tuple

from torch import Tensor

from ... import _checks
from ...ops import _base
from ...ops import nt_xent as core
from .. import _bridge as B
from .. import _registry as R


def fwd(z: Tensor, temperature: float, reduction: str, normalize: bool,
        workspace_bytes: Optional[int], precision: Optional[str] = None,
        fused: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, dz_acc, norm): the loss (0-d, or (2B,) for "none"), the (2B,) row
    log-sum-exps and, when ``fused``, the unit-upstream gradient accumulator (2B, D) and the
    row norms (2B,) (normalize=True; else a placeholder)."""
    with B.device_scope(z.device):
        zx = B.array_of(z)
        if fused:
            loss, ctx = core.nt_xent_forward(
                zx, temperature, reduction=reduction, normalize=normalize,
                workspace_bytes=workspace_bytes, requires_grad=True, precision=precision)
            s = ctx.saved
            return (B.tensor_of(loss), R.fused_stat(ctx.stats[0]), B.tensor_of(s["dz"]),
                    R.opt_tensor(s["norm"], z))
        rows, ctx = core.nt_xent_forward(
            zx, temperature, reduction="none", normalize=normalize,
            workspace_bytes=workspace_bytes, requires_grad=True, precision=precision)
        loss = _base.reduce(ctx.xp, rows, reduction)
        return B.tensor_of(loss), B.tensor_of(ctx.stats[0]), R.empty(z), R.empty(z)


def bwd(z: Tensor, lse: Tensor, grad_loss: Tensor, temperature: float, reduction: str,
        normalize: bool, workspace_bytes: Optional[int],
        precision: Optional[str] = None) -> Tensor:
    """dz (2B, D) in z's dtype, for the upstream gradient ``grad_loss`` (0-d or (2B,))."""
    with B.device_scope(z.device):
        dz = core.nt_xent_backward_from_stats(
            B.array_of(z), B.array_of(lse), B.array_of(grad_loss), temperature=temperature,
            reduction=reduction, normalize=normalize, workspace_bytes=workspace_bytes,
            precision=precision)
        return B.tensor_of(dz)


def evaluate(z: Tensor, temperature: float, reduction: str, normalize: bool,
             workspace_bytes: Optional[int], precision: Optional[str] = None
             ) -> Tuple[Tensor]:
    """The loss alone, for calls no gradient will be asked of (grad mode off, or no input
    requiring one): the core's forward keeps no context, so repeated GPU calls replay their
    graph (and, learnt, straight from the tensors: ``R.evaluate``)."""
    with B.device_scope(z.device):
        loss, _ = core.nt_xent_forward(B.array_of(z), temperature, reduction=reduction,
                                       normalize=normalize, workspace_bytes=workspace_bytes,
                                       requires_grad=False, precision=precision)
        return (B.tensor_of(loss),)


def fwd_fake(z, temperature, reduction, normalize, workspace_bytes, precision=None,
             fused=False):
    return (R.loss_like(z, reduction), R.stat_like(z), R.acc_like(z, fused, z),
            R.norm_like(z, fused, normalize, z))


def bwd_fake(z, lse, grad_loss, temperature, reduction, normalize, workspace_bytes,
             precision=None):
    return z.new_empty(z.shape)


def setup_context(ctx, inputs, output) -> None:
    z, temperature, reduction, normalize, workspace_bytes = inputs[:5]
    ctx.fused = R.fused_flag(inputs, 6)
    if ctx.fused:  # the gradient accumulator (and z and its norms to normalise through)
        ctx.save_for_backward(z if normalize else None, output[2], output[3])
        ctx.dtype = z.dtype
    else:
        ctx.save_for_backward(z, output[1])
    # (precision: the backward op recomputes in the forward's)
    ctx.args = (temperature, reduction, normalize, workspace_bytes, R.input_at(inputs, 5))
    R.non_differentiable(ctx, *output[1:])


def backward(ctx, grad_loss, *_grad_stats):
    dz = None
    if ctx.needs_input_grad[0]:
        if ctx.fused:
            z, acc, norm = ctx.saved_tensors
            dz = R.scaled(z, norm, acc, grad_loss, ctx.dtype, ctx.args[2],
                          getattr(ctx, "direct", False))
        else:
            z, lse = ctx.saved_tensors
            dz = BWD(z, lse, grad_loss.contiguous(), *ctx.args)
    return dz, None, None, None, None, None, None


NTXentFunction, FWD, BWD = R.register(
    "nt_xent", "NTXentFunction", fwd, fwd_fake, bwd, bwd_fake, setup_context, backward,
    autocast=(0,), fast=True)


def nt_xent(z: Tensor, temperature: float = 0.5, *, reduction: str = "mean",
            normalize: bool = False, workspace_bytes: Optional[int] = None,
            group: Optional[Any] = None, precision: Optional[str] = None) -> Tensor:
    """SimCLR's NT-Xent loss of ``z`` (2B, D), differentiable w.r.t. ``z``.

    Parameters
    ----------
    z : Tensor (2B, D), float16 / bfloat16 / float32 / float64, CPU or CUDA
        The two views stacked: rows ``i`` and ``(i + B) mod 2B`` are a positive pair.
    temperature : float > 0, default 0.5
    reduction : "mean" (default) | "sum" | "none"
    normalize : bool, default False
        L2-normalise the rows first (as ``F.normalize``); the gradient goes through it.
    workspace_bytes : int, optional
        Cap on the score-block workspace (CUDA); default ``min(1 GiB, half the free memory)``.
    group : torch.distributed process group, optional
        The loss of the group's *global* batch: each rank passes its own (2n, D)
        ``z = [view 1 of its n images; view 2 of them]``; the global batch is [every rank's
        view 1 in rank order; every rank's view 2 in rank order], each row's positive its
        image's other view, every other row of every rank a negative.  Every rank returns the
        global loss (its own rows of it for "none"); the gradient follows DDP's convention
        (``cupynce.torch.distributed``).  None (default): this process alone.
    precision : "auto" | "fp32" | "tf32" | "3xtf32", optional
        How float32 products run on CUDA (see :func:`cupynce.set_float32_precision`; the
        backward runs in the same).  None (default), evaluated at each call on the host:
        "tf32" when torch runs its own float32 CUDA matmuls in TF32 --
        ``torch.backends.cuda.matmul.fp32_precision == "tf32"`` on torch >= 2.9 (set by
        ``torch.backends.cuda.matmul.allow_tf32 = True``,
        ``torch.set_float32_matmul_precision("high")`` or ``torch.backends.fp32_precision =
        "tf32"``), ``torch.backends.cuda.matmul.allow_tf32`` before -- else the global default
        ``cupynce.get_float32_precision()`` ("fp32" unless set).  float16 / bfloat16 / float64
        inputs and CPU tensors ignore it.

    Returns
    -------
    Tensor: 0-d (mean/sum) or (2B,) (none); float32 (float64 for float64 ``z``).

    Notes
    -----
    With S = ẑ ẑᵀ / τ and p(i) = (i + B) mod 2B: ``loss_i = log Σ_{j≠i} exp(S_ij) − S_{i,p(i)}``,
    i.e. ``F.cross_entropy(masked_fill(ẑ ẑᵀ, eye, -inf) / τ, p)``.  Forward keeps z and the
    (2B,) row log-sum-exps for the backward; memory stays O(N·D) (the score matrix is
    processed in row blocks).
    """
    if group is not None:  # every check inside the group's first exchange
        from .. import distributed

        return distributed.nt_xent(z, temperature, reduction, normalize, workspace_bytes,
                                   group, precision)
    t = _checks.check_temperature("nt_xent", temperature)
    reduction, workspace_bytes = R.scalars("nt_xent", reduction, workspace_bytes)
    B.check_tensors("nt_xent", z=z)
    normalize = _checks.check_bool("nt_xent", "normalize", normalize)
    args = (z, t, reduction, normalize, workspace_bytes, R.precision_of("nt_xent", precision),
            R.fused(reduction, z))
    if R.direct(z):
        if not R.needs_grad(z):
            return R.evaluate(evaluate, args[:-1])
        return NTXentFunction.apply(*args)
    return FWD(*args)[0]
