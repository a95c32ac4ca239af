"""pytorch-metric-learning's ``SupConLoss`` and ``NTXentLoss`` (``pytorch_metric_learning.
losses``) on cupynce's kernels; the library is not imported."""
from typing import Any, Optional

from torch import Tensor, nn

from .. import _checks
from .. import torch as C

__all__ = ["SupConLoss", "NTXentLoss"]


def _defaults_only(name: str, kwargs) -> None:
    if kwargs:
        raise NotImplementedError(
            f"{name}: {', '.join(sorted(kwargs))} (pytorch-metric-learning's "
            f"{'options' if len(kwargs) > 1 else 'option'}): only the library's defaults "
            f"(cosine similarity, its default reducer) run on cupynce; use the library's "
            f"class for others")


def _no_mining(name: str, indices_tuple, ref_emb, ref_labels, labels) -> None:
    for arg, value in (("indices_tuple", indices_tuple), ("ref_emb", ref_emb),
                       ("ref_labels", ref_labels)):
        if value is not None:
            raise NotImplementedError(f"{name}: {arg}= (mined pairs / a reference set) has no "
                                      f"cupynce equivalent yet")
    if labels is None:
        raise TypeError(f"{name}: labels are required (an integer tensor of shape (N,))")


class SupConLoss(nn.Module):
    """Supervised contrastive loss as pytorch-metric-learning computes it:
    ``SupConLoss(temperature=0.1)(embeddings, labels)``.

    The library's defaults are the only ones supported: cosine similarity (the embeddings
    L2-normalised inside, the gradient through it) and its ``AvgNonZeroReducer`` (the mean
    over the anchors with a non-zero loss; here over the anchors with a positive -- the same
    unless a positive anchor's loss is exactly 0, which needs every candidate of it to be a
    positive at one equal similarity).  No positive pair in the batch: 0 with a zero gradient,
    as the library.  Equal to :func:`cupynce.torch.supcon_loss` with ``normalize=True``.

    Parameters (the library's)
    --------------------------
    temperature : float > 0, default 0.1
    distance, reducer, embedding_regularizer, ... : any other keyword raises
        ``NotImplementedError`` naming it (the library's defaults only).

    Keyword-only extras: ``workspace_bytes`` (the op's scratch cap) and ``precision`` (float32
    products on CUDA, as :func:`cupynce.torch.nt_xent`'s).  The loss is float32 for 16-bit
    embeddings.
    """

    def __init__(self, temperature: float = 0.1, *, workspace_bytes: Optional[int] = None,
                 precision: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__()
        _defaults_only("SupConLoss", kwargs)
        self.temperature = _checks.check_temperature("SupConLoss", temperature)
        self.workspace_bytes, self.precision = workspace_bytes, precision

    def forward(self, embeddings: Tensor, labels: Optional[Tensor] = None,
                indices_tuple: Any = None, ref_emb: Optional[Tensor] = None,
                ref_labels: Optional[Tensor] = None) -> Tensor:
        """embeddings (N, D), labels (N,) integers → the 0-d loss.  ``indices_tuple`` (mined
        pairs) and ``ref_emb`` / ``ref_labels`` (a separate reference set) raise
        ``NotImplementedError``."""
        _no_mining("SupConLoss", indices_tuple, ref_emb, ref_labels, labels)
        return C.supcon_loss(embeddings, labels, self.temperature, normalize=True,
                             workspace_bytes=self.workspace_bytes, precision=self.precision)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"


class NTXentLoss(nn.Module):
    """pytorch-metric-learning's ``NTXentLoss(temperature=0.07)(embeddings, labels)``: every
    positive pair (a, p) of equal labels, a ≠ p, is a softmax over p and a's negatives (the
    rows of another label), averaged over the pairs (its ``MeanReducer``; no pair: 0 with a
    zero gradient, as the library).  Cosine similarity (the embeddings L2-normalised inside,
    the gradient through it).  Equal to :func:`cupynce.torch.nt_xent_pairs` with
    ``normalize=True``: one pass over row blocks of the score matrix, the pairs never listed
    (the library builds a pairs × negatives matrix).

    Parameters: ``temperature`` (float > 0, default 0.07); any other keyword of the library's
    (``distance``, ``reducer``, ...) raises ``NotImplementedError`` naming it.  Keyword-only
    extras: ``workspace_bytes``, ``precision``.  ``forward(embeddings, labels)``; mined
    ``indices_tuple`` and ``ref_emb`` / ``ref_labels`` raise ``NotImplementedError``.  The
    loss is float32 for 16-bit embeddings.
    """

    def __init__(self, temperature: float = 0.07, *, workspace_bytes: Optional[int] = None,
                 precision: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__()
        _defaults_only("NTXentLoss", kwargs)
        self.temperature = _checks.check_temperature("NTXentLoss", temperature)
        self.workspace_bytes, self.precision = workspace_bytes, precision

    def forward(self, embeddings: Tensor, labels: Optional[Tensor] = None,
                indices_tuple: Any = None, ref_emb: Optional[Tensor] = None,
                ref_labels: Optional[Tensor] = None) -> Tensor:
        _no_mining("NTXentLoss", indices_tuple, ref_emb, ref_labels, labels)
        return C.nt_xent_pairs(embeddings, labels, self.temperature, normalize=True,
                               workspace_bytes=self.workspace_bytes, precision=self.precision)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"
