"""Supervised contrastive loss (SupCon) for PyTorch: the op's table entry (op bodies,
torch.compile shapes, autograd, custom ops: ``_skeleton``) and the public function.
"""
from typing import Any, Optional

from torch import Tensor

from ... import _checks
from ...ops import supcon as core
from .. import _bridge as B
from .. import _registry as R
from .. import _skeleton as S

#: the op: z's rows and their (N,) labels, the temperature, the (N,) row log-sum-exps; the
#: fused forward's gradient accumulator and norms are the core context's ``dz`` / ``norm``
SPEC = S.Loss("supcon_loss", "SupConFunction", __name__, core,
              inputs=(S.Rows("z"), S.Scalar("temperature"), S.Labels("labels")),
              stats=("lse",), forward="_torch_forward", backward="_torch_backward",
              unit_grads=lambda saved: ((saved["dz"],), (saved["norm"],), (saved["dt"],)))
fwd, bwd, evaluate = SPEC.fwd, SPEC.bwd, SPEC.evaluate
fwd_fake, bwd_fake, setup_context, backward = (SPEC.fwd_fake, SPEC.bwd_fake,
                                               SPEC.setup_context, SPEC.backward)
SupConFunction, FWD, BWD = SPEC.Function, SPEC.FWD, SPEC.BWD


def supcon_loss(z: Tensor, labels: Tensor, temperature: Any = 0.1, *,
                reduction: str = "mean", normalize: bool = False,
                workspace_bytes: Optional[int] = None, group: Optional[Any] = None,
                precision: Optional[str] = None) -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020, ``L_out``), differentiable w.r.t. z.

    Parameters
    ----------
    z : Tensor (N, D), float16 / bfloat16 / float32 / float64, CPU or CUDA, N >= 2
        Every view of the batch stacked (any order); usually L2-normalised
        (``normalize=True`` does it, the gradient through it).
    labels : integer Tensor (N,), on z's device
        The rows' classes: rows with equal labels are positives of each other.  The
        backward reads them again (as it reads z): do not change them in place before it.
    temperature : float > 0, or a Tensor of shape () or (1,) on z's device, default 0.1
        A tensor is a differentiable input (a learnable temperature), never read on the
        host (as :func:`cupynce.torch.nt_xent`'s).
    reduction : "mean" (default) | "sum" | "none"
        Anchors without a positive are left out: "mean" averages over those with one (0,
        with a zero gradient, when none has), "none" gives the others 0.
    normalize, workspace_bytes, precision : as for :func:`cupynce.torch.nt_xent`.
    group : torch.distributed process group, optional
        The loss of the group's global batch: each rank passes its own (n, D) z and (n,)
        labels (n even, equal on every rank); the global batch is every rank's rows in rank
        order, each row's positives every same-label row of every rank.  Every rank returns
        the global loss (its own rows of it for "none"); the gradient follows DDP's
        convention (``cupynce.torch.distributed``).

    Returns
    -------
    Tensor: 0-d (mean/sum) or (N,) (none); float32 (float64 for float64 z).

    Notes
    -----
    With S = ẑ ẑᵀ / τ and P(i) = {p ≠ i : labels_p = labels_i}:
    ``loss_i = log Σ_{a≠i} exp(S_ia) − (1/|P(i)|) Σ_{p∈P(i)} S_ip`` -- pytorch-metric-learning's
    ``SupConLoss(temperature)`` and the SupCon reference code's ``L_out`` with
    ``base_temperature = temperature``.  Memory O(N·D): NT-Xent's row softmax plus O(N·D)
    class sums (``cupynce.supcon_loss``); no N × N mask.
    """
    if group is not None:  # every check inside the group's first exchange
        from .. import distributed

        return distributed.supcon_loss(z, labels, temperature, reduction, normalize,
                                       workspace_bytes, group, precision)
    t_tensor, t_value = R.temperature("supcon_loss", temperature)
    reduction, workspace_bytes = R.scalars("supcon_loss", reduction, workspace_bytes)
    B.check_tensors("supcon_loss", optional=("temperature",), z=z, labels=labels,
                    temperature=t_tensor)
    normalize = _checks.check_bool("supcon_loss", "normalize", normalize)
    return SPEC(z, t_tensor, t_value, labels, reduction, normalize, workspace_bytes,
                R.precision_of("supcon_loss", precision))
