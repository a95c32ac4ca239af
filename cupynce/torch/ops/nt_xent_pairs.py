"""NT-Xent over every positive pair of labels (pytorch-metric-learning's ``NTXentLoss``) for
PyTorch: the op's table entry (op bodies, torch.compile shapes, autograd, custom ops:
``_skeleton``) and the public function.
"""
from typing import Any, Optional

from torch import Tensor

from ... import _checks
from ...ops import nt_xent_pairs as core
from .. import _bridge as B
from .. import _registry as R
from .. import _skeleton as S

#: the op: z's rows and their (N,) labels, the temperature, the (N,) row log-sum-exps over
#: each row's negatives; the fused forward's accumulator and norms: the context's dz / norm
SPEC = S.Loss("nt_xent_pairs", "NTXentPairsFunction", __name__, core,
              inputs=(S.Rows("z"), S.Scalar("temperature"), S.Labels("labels")),
              stats=("lse",), forward="_torch_forward", backward="_torch_backward",
              unit_grads=lambda saved: ((saved["dz"],), (saved["norm"],), (saved["dt"],)))
fwd, bwd, evaluate = SPEC.fwd, SPEC.bwd, SPEC.evaluate
fwd_fake, bwd_fake, setup_context, backward = (SPEC.fwd_fake, SPEC.bwd_fake,
                                               SPEC.setup_context, SPEC.backward)
NTXentPairsFunction, FWD, BWD = SPEC.Function, SPEC.FWD, SPEC.BWD


def nt_xent_pairs(z: Tensor, labels: Tensor, temperature: Any = 0.07, *,
                  reduction: str = "mean", normalize: bool = False,
                  workspace_bytes: Optional[int] = None, group: Optional[Any] = None,
                  precision: Optional[str] = None) -> Tensor:
    """NT-Xent over every positive pair of labels, differentiable w.r.t. z (and a tensor
    temperature): each pair (i, p), p ≠ i of row i's label, its own softmax over p and row
    i's negatives (the rows of another label) -- pytorch-metric-learning's
    ``NTXentLoss(embeddings, labels)`` with ``normalize=True``
    (:class:`cupynce.integrations.pytorch_metric_learning.NTXentLoss`).

    z (N, D) float16 / bfloat16 / float32 / float64, CPU or CUDA; labels (N,) integers on z's
    device (read again by the backward: do not change them in place before it); temperature
    a real or a tensor of shape () / (1,) (learnable), default 0.07; reduction "mean" (over
    the positive pairs; 0 with a zero gradient when there is none) | "sum" | "none" ((N,):
    each row's sum over its pairs); normalize, workspace_bytes, precision as for
    :func:`cupynce.torch.nt_xent`.  ``group``: a torch.distributed process group -- the loss
    of the group's global batch (every rank's rows in rank order; DDP's gradient convention,
    ``cupynce.torch.distributed``).
    Formulas: :func:`cupynce.nt_xent_pairs_forward`.
    """
    if group is not None:  # every check inside the group's first exchange
        from .. import distributed

        return distributed.nt_xent_pairs(z, labels, temperature, reduction, normalize,
                                         workspace_bytes, group, precision)
    t_tensor, t_value = R.temperature("nt_xent_pairs", temperature)
    reduction, workspace_bytes = R.scalars("nt_xent_pairs", reduction, workspace_bytes)
    B.check_tensors("nt_xent_pairs", optional=("temperature",), z=z, labels=labels,
                    temperature=t_tensor)
    normalize = _checks.check_bool("nt_xent_pairs", "normalize", normalize)
    return SPEC(z, t_tensor, t_value, labels, reduction, normalize, workspace_bytes,
                R.precision_of("nt_xent_pairs", precision))
