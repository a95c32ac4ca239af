"""CLIP's loss for PyTorch: the op's table entry (op bodies, torch.compile shapes, autograd,
custom ops: ``_skeleton``) and the public function.
"""
import numbers
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ... import _checks
from ...ops import clip as core
from .. import _bridge as B
from .. import _registry as R
from .. import _skeleton as S

#: the op: a, b, logit_scale (a tensor or a real) and the pairs' optional (N,) labels, the
#: (N,) row and column log-sum-exps; the fused forward's d loss / d logit_scale is the core
#: context's ``dscale``
SPEC = S.Loss("clip_loss", "ClipLossFunction", __name__, core,
              inputs=(S.Rows("a"), S.Rows("b"), S.Scalar("logit_scale"), S.Labels("labels")),
              params=("label_smoothing",), stats=("lse_r", "lse_c"),
              unit_grads=lambda saved: (saved["acc"], saved["norms"], (saved["dscale"],)))
fwd, bwd, evaluate = SPEC.fwd, SPEC.bwd, SPEC.evaluate
fwd_fake, bwd_fake, setup_context, backward = (SPEC.fwd_fake, SPEC.bwd_fake,
                                               SPEC.setup_context, SPEC.backward)
ClipLossFunction, FWD, BWD = SPEC.Function, SPEC.FWD, SPEC.BWD


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


def clip_loss(a: Tensor, b: Tensor, logit_scale: Any, *, label_smoothing: float = 0.0,
              labels: Optional[Tensor] = None, reduction: str = "mean",
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
    labels : integer Tensor (N,), optional
        Pair i's label, on a's device: a pair (i, j), j ≠ i, of one label is no negative in
        either direction (``cupynce.clip_loss_forward``); with ``label_smoothing`` ε spreads
        over each pair's candidates left (not yet with ``group``).
        Read again by a "none" backward: do not change them in place before it.
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
                                     group, _logit_scale, precision,
                                     label_smoothing=label_smoothing, labels=labels)
    eps = _checks.check_smoothing(op, label_smoothing)
    reduction, workspace_bytes = R.scalars(op, reduction, workspace_bytes)
    ls_tensor, ls_value = _logit_scale(a, b, logit_scale)
    normalize = _checks.check_bool(op, "normalize", normalize)
    if labels is not None:
        B.check_tensors(op, optional=("labels",), a=a, labels=labels)
    return SPEC(a, b, ls_tensor, ls_value, labels, eps, reduction, normalize, workspace_bytes,
                R.precision_of(op, precision))
