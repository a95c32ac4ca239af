"""pytorch-metric-learning's ``SupConLoss`` (``pytorch_metric_learning.losses``) on cupynce's
kernels; the library is not imported."""
from typing import Any, Optional

from torch import Tensor, nn

from .. import _checks
from .. import torch as C

__all__ = ["SupConLoss"]


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
        if kwargs:
            raise NotImplementedError(
                f"SupConLoss: {', '.join(sorted(kwargs))} (pytorch-metric-learning's "
                f"{'options' if len(kwargs) > 1 else 'option'}): only the library's defaults "
                f"(cosine similarity, AvgNonZeroReducer) run on cupynce; use the library's "
                f"class for others")
        self.temperature = _checks.check_temperature("SupConLoss", temperature)
        self.workspace_bytes, self.precision = workspace_bytes, precision

    def forward(self, embeddings: Tensor, labels: Optional[Tensor] = None,
                indices_tuple: Any = None, ref_emb: Optional[Tensor] = None,
                ref_labels: Optional[Tensor] = None) -> Tensor:
        """embeddings (N, D), labels (N,) integers → the 0-d loss.  ``indices_tuple`` (mined
        pairs) and ``ref_emb`` / ``ref_labels`` (a separate reference set) raise
        ``NotImplementedError``."""
        for name, value in (("indices_tuple", indices_tuple), ("ref_emb", ref_emb),
                            ("ref_labels", ref_labels)):
            if value is not None:
                raise NotImplementedError(f"SupConLoss: {name}= (mined pairs / a reference "
                                          f"set) has no cupynce equivalent yet")
        if labels is None:
            raise TypeError("SupConLoss: labels are required (an integer tensor of shape "
                            "(N,))")
        return C.supcon_loss(embeddings, labels, self.temperature, normalize=True,
                             workspace_bytes=self.workspace_bytes, precision=self.precision)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"
