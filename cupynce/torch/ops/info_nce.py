"""Query/key InfoNCE for PyTorch: the op's table entry (op bodies, torch.compile shapes,
autograd, custom ops: ``_skeleton``) and the public function.
"""
from typing import Any, Optional

from torch import Tensor

from ... import _checks
from ...ops import info_nce as core
from .. import _bridge as B
from .. import _registry as R
from .. import _skeleton as S

#: the op: query, key, the optional (M, D) / (N, M, D) negatives and (N,) labels, the
#: temperature, the label smoothing and the hardness weighting (its mode as
#: ``_checks.HARDNESS_MODES``' code), in_batch_negatives and replicated_negatives (1.0 /
#: 0.0: which negatives are a query's own), negatives_grad (1.0 / 0.0: the negatives
#: require a gradient; a detached queue's product is skipped), the (N,) row log-sum-exps
SPEC = S.Loss("info_nce", "InfoNCEFunction", __name__, core,
              inputs=(S.Rows("query"), S.Rows("key"), S.Scalar("temperature"),
                      S.Rows("negatives", optional=True, grad_param="negatives_grad"),
                      S.Labels("labels")),
              params=("label_smoothing", "hardness_mode", "hardness_strength",
                      "in_batch_negatives", "replicated_negatives", "negatives_grad"),
              stats=("lse",),
              forward="_torch_forward", backward="_torch_backward",
              unit_grads=lambda saved: (saved["acc"], saved["norms"], (saved["dt"],)))
fwd, bwd, evaluate = SPEC.fwd, SPEC.bwd, SPEC.evaluate
fwd_fake, bwd_fake, setup_context, backward = (SPEC.fwd_fake, SPEC.bwd_fake,
                                               SPEC.setup_context, SPEC.backward)
InfoNCEFunction, FWD, BWD = SPEC.Function, SPEC.FWD, SPEC.BWD


def info_nce(query: Tensor, key: Tensor, temperature: Any = 0.1, *,
             negatives: Optional[Tensor] = None, labels: Optional[Tensor] = None,
             label_smoothing: float = 0.0, in_batch_negatives: bool = True,
             replicated_negatives: bool = False, reduction: str = "mean",
             normalize: bool = False, workspace_bytes: Optional[int] = None,
             group: Optional[Any] = None, precision: Optional[str] = None,
             hardness_mode: Optional[str] = None, hardness_strength: float = 0.0) -> Tensor:
    """Query/key InfoNCE with in-batch negatives (and optional explicit ones).

    Parameters
    ----------
    query, key : Tensor (N, D), paired by row: key i is query i's positive, the other N − 1
        keys its in-batch negatives.
    temperature : float > 0, or a Tensor of shape () or (1,) on the inputs' device, default 0.1
        A tensor is a differentiable input (a learnable temperature), never read on the
        host (as :func:`nt_xent`'s).
    negatives : Tensor, optional
        (M, D) shared by every query, or (N, M, D) per query; differentiable.
    labels : integer Tensor (N,), optional
        Row i's label (query i's and key i's), on the inputs' device: a key j != i of query
        i's label is no negative of query i (duplicates, false negatives); the explicit
        negatives stay negatives.
    label_smoothing : float in [0, 1), default 0
        ``F.cross_entropy``'s label smoothing over each query's candidates (those left after
        ``labels``).  With ``labels`` or a smoothing the CUDA call takes the row blocks and no
        CUDA-graph replay (``cupynce.info_nce``).  With ``group``, each rank passes its rows'
        labels (every rank, or none).  With ``reduction="none"`` the backward reads the
        labels again (as it reads the inputs): do not change them in place before it.
    in_batch_negatives : bool, default True
        False: query i's candidates are key i and the explicit negatives alone (MoCo against
        its queue: ``negatives=queue.negatives()``, :class:`NegativeQueue`); one label for
        every row underneath (``labels`` must be None).
    replicated_negatives : bool, default False
        With ``group``: the shared negatives are the same on every rank (a
        :class:`NegativeQueue`'s): they join the candidates once, not once per rank.
    hardness_mode, hardness_strength : sentence-transformers' hardness weighting (None /
        "in_batch_negatives" / "hard_negatives" / "all_negatives", α >= 0): penalised
        candidates' logits + α·stopgrad(q̂·ĉ); query i's own negatives are shared negatives
        i, i + N, ... (the library's layout) and its per-query ones
        (``cupynce.info_nce_forward``).
    reduction, normalize, workspace_bytes, precision : as for :func:`nt_xent` (``normalize``
        applies to query, key and negatives alike; ``precision=None`` follows torch's TF32
        setting, then ``cupynce.get_float32_precision()``).
    group : torch.distributed process group, optional
        The loss of the group's global batch (queries and keys concatenated in rank order):
        every rank's keys are candidates of every query, shared (M, D) negatives of every rank
        join every query's candidates, per-query (n, M, D) negatives stay with their query.
        Gradient convention: DDP's (``cupynce.torch.distributed``).

    Returns
    -------
    Tensor: 0-d (mean/sum) or (N,) (none); float32 (float64 for float64 inputs).

    Notes
    -----
    ``loss_i = log Σ_{c ∈ C_i} exp(q̂_i·ĉ/τ) − q̂_i·k̂_i/τ`` with C_i = all keys, the shared
    negatives and query i's own negatives.  (info-nce-pytorch drops the in-batch keys when
    explicit negatives are given; here they always count.)
    """
    if group is not None:  # every check inside the group's first exchange
        from .. import distributed

        return distributed.info_nce(query, key, negatives, temperature, reduction, normalize,
                                    workspace_bytes, group, precision, labels=labels,
                                    label_smoothing=label_smoothing,
                                    in_batch_negatives=in_batch_negatives,
                                    replicated_negatives=replicated_negatives,
                                    hardness_mode=hardness_mode,
                                    hardness_strength=hardness_strength)
    t_tensor, t_value = R.temperature("info_nce", temperature)
    eps = _checks.check_smoothing("info_nce", label_smoothing)
    hard = _checks.check_hardness("info_nce", hardness_mode, hardness_strength)
    reduction, workspace_bytes = R.scalars("info_nce", reduction, workspace_bytes)
    B.check_tensors("info_nce", optional=("negatives", "labels", "temperature"), query=query,
                     key=key, negatives=negatives, labels=labels, temperature=t_tensor)
    normalize = _checks.check_bool("info_nce", "normalize", normalize)
    replicated = _checks.check_bool("info_nce", "replicated_negatives", replicated_negatives)
    in_batch = _checks.check_bool("info_nce", "in_batch_negatives", in_batch_negatives)
    if not in_batch and labels is not None:
        raise ValueError("info_nce: labels= with in_batch_negatives=False: no in-batch key "
                         "is a candidate, so there is nothing to mask; pass one of them")
    return SPEC(query, key, t_tensor, t_value, negatives, labels, eps, float(hard[0]),
                hard[1], float(in_batch), float(replicated),
                float(negatives is not None and negatives.requires_grad), reduction, normalize,
                workspace_bytes,
                R.precision_of("info_nce", precision))
