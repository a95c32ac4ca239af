"""SPLADE's head for PyTorch: op bodies, torch.compile shapes, autograd, the op's table entry
(custom ops, the direct Function, the dispatch: ``_skeleton.Op``), the public functions
(splade_pool, flops_regularizer).
"""
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ... import _checks
from ..._engine.splade import index_dtype
from ...ops import splade as core
from .. import _bridge as B
from .. import _registry as R
from .. import _skeleton as S


def _mask_array(mask: Optional[Tensor]) -> Any:
    """The core's view of an attention mask: bool crosses as a uint8 view (same bytes, nonzero
    = counts; DLPack's bool is not spoken by every CuPy release); a CUDA mask of another dtype
    (a tokenizer's int64) is compared with 0 by torch first (a precompiled kernel, where the
    core's comparison would compile a CuPy one at the first call); CPU masks as they are."""
    if mask is not None and mask.is_cuda and mask.dtype not in (torch.bool, torch.uint8):
        mask = mask != 0
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return B.array_of(mask)


def argmax_dtype(seq_len: int) -> torch.dtype:
    """The dtype of the winning positions, the core's choice (int16 while every l < L fits)."""
    return torch.int16 if index_dtype(seq_len) == np.int16 else torch.int32


def fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
        activation: str, workspace_bytes: Optional[int], requires_grad: bool,
        precision: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """(out, argmax): out (B, V) in x's dtype and the (B, V) winning positions
    (``ctx.stats[0]``); argmax is an empty (0, 0) tensor when ``requires_grad`` is False (the
    core then skips it)."""
    with B.device_scope(x.device):
        out, ctx = core.splade_pool_forward(
            B.array_of(x), B.array_of(weight), B.array_of(bias), _mask_array(mask),
            activation=activation, workspace_bytes=workspace_bytes, requires_grad=requires_grad,
            precision=precision)
        argmax = B.tensor_of(ctx.stats[0]) if requires_grad else \
            x.new_empty((0, 0), dtype=argmax_dtype(x.shape[1]))
        return B.tensor_of(out), argmax


def bwd(x: Tensor, weight: Tensor, out: Tensor, argmax: Tensor, grad_out: Tensor,
        has_bias: bool, activation: str) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) in the inputs' dtype (x, weight and bias share one); dbias is an
    empty (0,) tensor without a bias.  Only x, weight, out and argmax are needed: the core
    reads ``bias`` for its presence, shape (V,) and dtype alone, and ``out[0]`` has all three
    (x's dtype, which the bias shares), so the bias itself is never saved."""
    with B.device_scope(x.device):
        out_a = B.array_of(out)
        dx, dw, db = core.splade_pool_backward_from_stats(
            B.array_of(x), B.array_of(weight), out_a, B.array_of(argmax),
            B.array_of(grad_out), bias=out_a[0] if has_bias else None, activation=activation)
        db = x.new_empty((0,)) if db is None else B.tensor_of(db)
        return B.tensor_of(dx), B.tensor_of(dw), db


def fwd_fake(x, weight, bias, mask, activation, workspace_bytes, requires_grad,
             precision=None):
    argmax_shape = (x.shape[0], weight.shape[0]) if requires_grad else (0, 0)
    return (x.new_empty((x.shape[0], weight.shape[0])),
            x.new_empty(argmax_shape, dtype=argmax_dtype(x.shape[1])))


def bwd_fake(x, weight, out, argmax, grad_out, has_bias, activation):
    db = x.new_empty((weight.shape[0],) if has_bias else (0,))
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def setup_context(ctx, inputs, output) -> None:
    x, weight, bias, mask, activation, workspace_bytes, requires_grad = inputs[:7]
    out, argmax = output
    R.non_differentiable(ctx, argmax)
    ctx.args = (bias is not None, activation)
    ctx.has_stats = requires_grad
    if requires_grad:  # x and weight by reference; out and argmax are O(B·V)
        ctx.save_for_backward(x, weight, out, argmax)


def backward(ctx, grad_out, *_grad_argmax):
    need = ctx.needs_input_grad
    nones = (None,) * 5  # mask, activation, workspace_bytes, requires_grad, precision
    if not ctx.has_stats or not any(need[:3]):
        # only the mask required a gradient (it never gets one) or nothing at all did
        return (None, None, None) + nones
    x, weight, out, argmax = ctx.saved_tensors
    has_bias, activation = ctx.args
    dx, dw, db = BWD(x, weight, out, argmax, grad_out.contiguous(), has_bias,
                                     activation)
    return (dx if need[0] else None, dw if need[1] else None,
            db if need[2] and has_bias else None) + nones


#: the op: its own bodies above; x, weight and bias cast under autocast, the mask a tensor
#: argument too
SPEC = S.Op("splade_pool", "SpladePoolFunction", __name__, fwd, fwd_fake, bwd, bwd_fake,
            setup_context, backward, autocast=(0, 1, 2), direct=(0, 1, 2, 3))
SpladePoolFunction, FWD, BWD = SPEC.Function, SPEC.FWD, SPEC.BWD


def check_activation(op: str, activation: Any) -> str:
    """The core's check (same message), made before tracing / dispatch."""
    if not isinstance(activation, str) or activation not in core.ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {core.ACTIVATIONS}, "
                         f"got {activation!r}")
    return activation


def splade_pool(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                mask: Optional[Tensor] = None, *, activation: str = "log1p_relu",
                workspace_bytes: Optional[int] = None, precision: Optional[str] = None) -> Tensor:
    """SPLADE's max-pooled vocabulary representation, differentiable w.r.t. x, weight and bias.

    Parameters
    ----------
    x : Tensor (B, L, D), float16 / bfloat16 / float32 / float64, CPU or CUDA
        Hidden states (for a BERT MLM head: after the head's transform, i.e. what the decoder
        multiplies).
    weight : Tensor (V, D), x's dtype
        The vocabulary projection in ``nn.Linear`` / Hugging Face decoder layout (a decoder's
        ``weight`` as is).  A (D, V) matrix is passed as its transpose ``w.T`` (a view, never
        copied; the gradient reaches ``w`` through the view).
    bias : Tensor (V,), x's dtype, optional
    mask : Tensor (B, L), optional
        Attention mask, bool or 0/1 of any real dtype; None: every position counts.  Not
        differentiable (as ``masked_fill(mask == 0, -inf)``: a mask that requires grad gets
        no gradient).  A CPU mask holding another value (2, -1, 0.5, NaN) raises
        ``ValueError``; a CUDA mask is not scanned (that would synchronise with the GPU):
        there any nonzero value counts as 1.
    activation : "log1p_relu" (default, SPLADE's log(1 + ReLU)) | "relu"
    workspace_bytes : int, optional
        Cap on the logit-tile workspace (CUDA); the core's default when None.
    precision : "auto" | "fp32" | "tf32" | "3xtf32", optional
        How float32 logit products run on CUDA; None follows torch's TF32 setting, then
        ``cupynce.get_float32_precision()`` (see :func:`nt_xent`).  The backward runs no
        products.

    Returns
    -------
    Tensor (B, V) in x's dtype.

    Notes
    -----
    ``out[b, v] = act(max_{l : mask[b, l] ≠ 0} x[b, l, :] · weight[v, :] + bias[v])``, with
    act = ``max(m, 0)`` (relu) or ``log(1 + max(m, 0))`` (log1p_relu); a row whose mask is all
    zero gives 0; ties go to the lowest l.  The (B, L, V) logits are never allocated: the forward
    keeps x, weight (references), out and the (B, V) winning positions l* (int16, int32 for
    very long L: the core's ``ctx.stats[0]``), and only when a gradient is required.  The backward touches only
    the active entries (out > 0), with g = grad_out · act'(m):
    ``dW[v] = Σ_b g[b, v] x[b, l*]``, ``dx[b, l*] += g[b, v] W[v]``, ``dbias[v] = Σ_b g[b, v]``;
    deterministic (no floating-point atomics).  Under ``torch.autocast`` x, weight and bias
    are cast to the autocast dtype (as ``F.linear``'s operands; float16/bfloat16 pass as they
    are) and out is in that dtype.
    """
    op = "splade_pool"
    activation = check_activation(op, activation)
    workspace_bytes = _checks.check_workspace(op, workspace_bytes)
    B.check_tensors(op, optional=("bias", "mask"), x=x, weight=weight, bias=bias, mask=mask)
    # argmax is computed and kept only when autograd will need it (read from metadata only)
    requires_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))
    return SPEC(x, weight, bias, mask, activation, workspace_bytes, requires_grad,
                R.precision_of(op, precision))


def flops_regularizer(out: Tensor) -> Tensor:
    """SPLADE's FLOPS regulariser ``Σ_v (mean_b out[b, v])²`` of ``out`` (B, V).

    Returns a 0-d tensor, float32 (float64 for float64 ``out``), differentiable:
    ``d/d out[b, v] = 2 · mean_b(out[:, v]) / B``.  Plain torch ops (a mean over b
    accumulated in float32/float64, a square, a sum — torch's reductions use no atomics, so it
    is deterministic), so autograd, autocast and ``torch.compile`` treat it as any torch code;
    equal to ``cupynce.flops_regularizer`` on the same values (to rounding).  Cost O(B·V).
    """
    if not isinstance(out, Tensor):
        kind = f"{type(out).__module__}.{type(out).__name__}"
        raise TypeError(f"flops_regularizer: out must be a torch.Tensor, got {kind}")
    if out.dim() != 2:
        raise ValueError(f"flops_regularizer: out must be 2-D (B, V), got shape "
                         f"{tuple(out.shape)}")
    if not out.is_floating_point():
        raise TypeError(f"flops_regularizer: out has dtype {out.dtype}; expected a floating dtype")
    if out.shape[0] == 0:
        raise ValueError(f"flops_regularizer: out needs B >= 1, got shape {tuple(out.shape)}")
    return out.mean(dim=0, dtype=R.acc_dtype(out.dtype)).square().sum()
