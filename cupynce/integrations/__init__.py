"""Drop-in losses for the libraries people train with: one import instead of theirs.

* :mod:`cupynce.integrations.open_clip` — ``ClipLoss``, ``SigLipLoss`` (open_clip's
  constructor arguments and call; ``logit_scale`` is the *exponentiated* scale, as open_clip
  passes it);
* :mod:`cupynce.integrations.sentence_transformers` — ``MultipleNegativesRankingLoss``,
  ``MultipleNegativesSymmetricRankingLoss`` and their ``Cached`` forms (gradient caching),
  ``SpladePooling`` (``SentenceTransformerTrainer`` / ``SparseEncoder`` modules);
* :mod:`cupynce.integrations.lightly` — ``NTXentLoss``;
* :mod:`cupynce.integrations.pytorch_metric_learning` — ``SupConLoss``.

Each module needs torch; none imports its library at import time (sentence-transformers is
imported inside the loss's forward, to embed the batch's columns as the library does; the
open_clip, lightly and pytorch-metric-learning adapters never need theirs).  The values and
gradients are the library's, on cupynce's kernels: no N × N logits in memory, the exact global losses of
:mod:`cupynce.torch.distributed` across ranks.  Where a library option has no cupynce
equivalent yet, the constructor raises ``NotImplementedError`` naming it.

**Per-rank values.**  Across ranks these libraries return each rank's share of the loss (its
own rows against every rank's columns, averaged over its rows) while the gradients through
their gathers are P times the global loss's — cupynce's data-parallel convention.  The adapters
reproduce both: the loss of the rank's rows comes from the op's ``reduction="none"`` (whose
backward holds the collectives again, so every rank must run it, as with DDP).  Scalar
parameters (a learnable ``logit_scale`` / ``logit_bias``) get the global loss's gradient on
every rank, where the libraries give each rank its share's: the two agree after DDP's average
over the ranks, not rank by rank (each adapter's docstring says where this applies).
"""
import importlib
from typing import Any

from .. import _checks

# (every adapter needs torch: without it, say which extra installs it)
_checks.require_module("torch", "cupynce.integrations")

__all__ = ["open_clip", "sentence_transformers", "lightly", "pytorch_metric_learning"]


def __getattr__(name: str) -> Any:  # lazy: ``cupynce.integrations.open_clip`` imports torch
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
