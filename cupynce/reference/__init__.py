"""Float64 NumPy reference implementations (the oracle) of the cupynce losses.

This module is the ground truth that the test-suite and the accuracy report
compare the fast CuPy kernels against.  It is deliberately simple: every
function builds the full dense similarity matrix in float64, uses a plain
max-shifted log-sum-exp, and writes the gradient in closed form.  There is no
blocking, no fusion and no other trick, so that each line can be checked
against the formula in its docstring.

Whatever dtype the inputs have (float16, float32, ``ml_dtypes.bfloat16``,
float64, ...), they are first cast with ``np.asarray(x).astype(np.float64)``;
all computation and all results are float64.

Every loss returns ``(loss, grads)``, where ``grads`` are the gradients of
``sum(grad_loss * loss)`` with respect to the inputs.  The SPLADE head
(:func:`splade_pool`) likewise returns ``(out, grads)``, the gradients of
``sum(grad_out * out)``, from the dense (B, L, V) logits and a dense one-hot
of the arg-max; :func:`flops_regularizer` returns ``(value, dout)``.
``grad_loss`` is the
upstream gradient: a scalar for ``reduction="mean"``/``"sum"`` and a scalar or
an ``(N,)`` array for ``reduction="none"``; ``None`` means 1.

Notation used below: ``N`` rows, ``D`` features, ``t`` temperature,
``lse`` log-sum-exp, ``softmax`` taken over the same candidates as the
``lse``.  For a cross-entropy row ``loss_i = lse_j(L_ij) - L_i,pos(i)`` the
gradient with respect to the logits is ``w_i * (softmax_ij - onehot_ij)``,
where ``w_i`` is the weight of row ``i`` in the reduction times
``grad_loss``.
"""

from __future__ import annotations

from ._common import REDUCTIONS, l2_normalize, l2_normalize_backward
from .contrastive import clip_loss, info_nce, nt_xent, nt_xent_pairs, siglip_loss, supcon_loss
from .splade import (SPLADE_ACTIVATIONS, flops_regularizer, splade_argmax, splade_logits,
                     splade_pool)

__all__ = [
    "REDUCTIONS",
    "l2_normalize",
    "l2_normalize_backward",
    "nt_xent",
    "supcon_loss",
    "nt_xent_pairs",
    "info_nce",
    "clip_loss",
    "siglip_loss",
    "SPLADE_ACTIVATIONS",
    "splade_logits",
    "splade_argmax",
    "splade_pool",
    "flops_regularizer",
]
