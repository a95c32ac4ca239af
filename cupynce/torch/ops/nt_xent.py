"""NT-Xent for PyTorch: the op's table entry (its bodies on tensors, their shapes for
torch.compile, autograd and the registered custom ops follow from it: ``_skeleton``) and the
public function.
"""
from typing import Any, Optional

from torch import Tensor

from ... import _checks
from ...ops import nt_xent as core
from .. import _bridge as B
from .. import _registry as R
from .. import _skeleton as S

#: the op: z's rows and the temperature (a tensor or a real), the label smoothing, the (2B,)
#: row log-sum-exps; the fused forward's gradient accumulator, norms and dτ are the core
#: context's ``dz`` / ``norm`` / ``dt`` (None for a real temperature)
SPEC = S.Loss("nt_xent", "NTXentFunction", __name__, core,
              inputs=(S.Rows("z"), S.Scalar("temperature")), params=("label_smoothing",),
              stats=("lse",), backward="_torch_backward",
              unit_grads=lambda saved: ((saved["dz"],), (saved["norm"],), (saved["dt"],)))
fwd, bwd, evaluate = SPEC.fwd, SPEC.bwd, SPEC.evaluate
fwd_fake, bwd_fake, setup_context, backward = (SPEC.fwd_fake, SPEC.bwd_fake,
                                               SPEC.setup_context, SPEC.backward)
NTXentFunction, FWD, BWD = SPEC.Function, SPEC.FWD, SPEC.BWD


def nt_xent(z: Tensor, temperature: Any = 0.5, *, label_smoothing: float = 0.0,
            reduction: str = "mean", normalize: bool = False,
            workspace_bytes: Optional[int] = None, group: Optional[Any] = None,
            precision: Optional[str] = None) -> Tensor:
    """SimCLR's NT-Xent loss of ``z`` (2B, D), differentiable w.r.t. ``z``.

    Parameters
    ----------
    z : Tensor (2B, D), float16 / bfloat16 / float32 / float64, CPU or CUDA
        The two views stacked: rows ``i`` and ``(i + B) mod 2B`` are a positive pair.
    temperature : float > 0, or a Tensor of shape () or (1,) on z's device, default 0.5
        A tensor is a differentiable input (a learnable temperature: dL/dτ from the
        gradient the backward computes anyway), never read on the host; a real is a
        constant of the call.
    label_smoothing : float in [0, 1), default 0
        ``F.cross_entropy``'s label smoothing over each row's 2B − 1 candidates (an O(N·D)
        difference from the plain loss: every path serves it; with ``group``, over the global
        batch).
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
                                   group, precision, label_smoothing=label_smoothing)
    t_tensor, t_value = R.temperature("nt_xent", temperature)
    eps = _checks.check_smoothing("nt_xent", label_smoothing)
    reduction, workspace_bytes = R.scalars("nt_xent", reduction, workspace_bytes)
    B.check_tensors("nt_xent", optional=("temperature",), z=z, temperature=t_tensor)
    normalize = _checks.check_bool("nt_xent", "normalize", normalize)
    return SPEC(z, t_tensor, t_value, eps, reduction, normalize, workspace_bytes,
                R.precision_of("nt_xent", precision))

