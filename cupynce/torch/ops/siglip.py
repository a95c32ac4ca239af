"""SigLIP's sigmoid loss for PyTorch: the op's table entry (op bodies, torch.compile shapes,
autograd, custom ops: ``_skeleton``) and the public function.
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
from .. import _skeleton as S

OP = "siglip_loss"

#: the op: a, b, logit_scale and logit_bias (tensors or reals), the optional (N,) labels;
#: no row statistics (the backward recomputes from the inputs); the fused forward's scalar
#: gradients are the core context's ``dscalars``
SPEC = S.Loss(OP, "SigLipLossFunction", __name__, core,
              inputs=(S.Rows("a"), S.Rows("b"), S.Scalar("logit_scale"),
                      S.Scalar("logit_bias"), S.Labels("labels")),
              stats=(), backward="siglip_loss_backward_from_inputs",
              unit_grads=lambda saved: (saved["acc"], saved["norms"], saved["dscalars"]),
              strict_double_backward=True)
fwd, bwd, evaluate = SPEC.fwd, SPEC.bwd, SPEC.evaluate
fwd_fake, bwd_fake, setup_context, backward = (SPEC.fwd_fake, SPEC.bwd_fake,
                                               SPEC.setup_context, SPEC.backward)
SigLipLossFunction, FWD, BWD = SPEC.Function, SPEC.FWD, SPEC.BWD


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
                labels: Optional[Tensor] = None, reduction: str = "mean",
                normalize: bool = False,
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
    labels : integer Tensor (N,), optional
        Pairs (i, j) with equal labels are positives too (duplicates, same-class pairs); an
        O(N·D) difference from the plain loss (``cupynce.siglip_loss``); with ``group``, each
        rank's rows' labels (gathered with the texts).  With ``reduction="none"`` the backward reads them again: do not change
        them in place before it.
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
                                       workspace_bytes, group, _scalar, precision,
                                       labels=labels)
    reduction, workspace_bytes = R.scalars(OP, reduction, workspace_bytes)
    B.check_tensors(OP, optional=("labels",), a=a, b=b, labels=labels)
    ls_tensor, ls_value = _scalar("logit_scale", logit_scale, a)
    lb_tensor, lb_value = _scalar("logit_bias", logit_bias, a)
    tensors = dict(a=a, b=b)
    if ls_tensor is not None:
        tensors["logit_scale"] = ls_tensor
    if lb_tensor is not None:
        tensors["logit_bias"] = lb_tensor
    B.check_tensors(OP, **tensors)
    normalize = _checks.check_bool(OP, "normalize", normalize)
    return SPEC(a, b, ls_tensor, ls_value, lb_tensor, lb_value, labels, reduction, normalize,
                workspace_bytes, R.precision_of(OP, precision))
