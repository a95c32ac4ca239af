"""cupynce: exact, deterministic, memory-bounded contrastive losses on CuPy, NumPy (and torch).

Functional API (CuPy arrays run the CUDA kernels + cuBLAS, NumPy arrays a vectorised NumPy
path; ``cupynce.torch`` wraps them for PyTorch):

* :func:`nt_xent` — SimCLR's NT-Xent, z (2B, D), positive i <-> (i + B) mod 2B
* :func:`info_nce` — query/key InfoNCE with in-batch and optional explicit negatives
* :func:`supcon_loss` — supervised contrastive (SupCon's L_out), z (N, D) with labels (N,)
* :func:`nt_xent_pairs` — NT-Xent over every positive pair of labels (pytorch-metric-learning's
  ``NTXentLoss``)
* :func:`clip_loss` — CLIP's symmetric loss with a learnable ``logit_scale``
* :func:`splade_pool` — SPLADE's max-pooled vocabulary head (+ :func:`flops_regularizer`)

Each has ``*_forward`` (loss and a context) and ``*_backward(ctx, grad_loss)`` (gradients);
``*_backward_from_stats`` rebuilds the gradients from the inputs and the O(N) ``ctx.stats``.

float32 products on the GPU run in "auto" (the default: float32 accuracy, NT-Xent on Hopper's
tensor cores through TF32x3 tiles, everything else true fp32), "fp32", "tf32" or "3xtf32": per
call with
``precision=`` (every entry point; kept in the context for the backward), or for every call
without one with :func:`set_float32_precision` (:func:`get_float32_precision`; env
``CUPYNCE_FLOAT32``).  Other dtypes and the NumPy path ignore it.  Every engine switch (the
tiles, the F16x3 products, side streams, CUDA graphs, ...) is a field of one immutable
configuration, :mod:`cupynce.config` (``cupynce.config.set(f16x3=False)``; env ``CUPYNCE_*``).
``import cupynce`` needs neither CuPy, nor torch, nor a GPU.

Layout (each layer imports only the ones below it; no import cycle): ``cupynce.ops`` (one
module per op: checks, NumPy path, its schedule across ranks) → ``cupynce._engine`` (the GPU
engine: ``losses/`` the loss paths, ``gemm/`` the products, the loader) → ``kernels_src/``
(CUDA C); ``cupynce.torch`` (autograd, custom ops, modules) and ``cupynce.report``
(``python -m cupynce``) sit on top; ``cupynce.config`` is read by all of them.
"""
from . import config  # noqa: F401 - (cupynce.config with the package)
from ._version import __version__
from ._engine.kernels import SUPPORTED_DTYPES, KernelCompileError
from .ops._base import Context, get_float32_precision, set_float32_precision
from .ops.clip import (
    clip_loss,
    clip_loss_backward,
    clip_loss_backward_from_stats,
    clip_loss_forward,
)
from .ops.info_nce import (
    info_nce,
    info_nce_backward,
    info_nce_backward_from_stats,
    info_nce_forward,
)
from .ops.nt_xent import (
    nt_xent,
    nt_xent_backward,
    nt_xent_backward_from_stats,
    nt_xent_forward,
)
from .ops.siglip import (
    siglip_loss,
    siglip_loss_backward,
    siglip_loss_backward_from_inputs,
    siglip_loss_forward,
)
from .ops.nt_xent_pairs import (
    nt_xent_pairs,
    nt_xent_pairs_backward,
    nt_xent_pairs_backward_from_stats,
    nt_xent_pairs_forward,
)
from .ops.supcon import (
    supcon_backward,
    supcon_backward_from_stats,
    supcon_forward,
    supcon_loss,
)
from .ops.splade import (
    flops_regularizer,
    flops_regularizer_backward,
    splade_pool,
    splade_pool_backward,
    splade_pool_backward_from_stats,
    splade_pool_forward,
)

__all__ = [
    "__version__", "Context", "KernelCompileError", "SUPPORTED_DTYPES",
    "set_float32_precision", "get_float32_precision",
    "nt_xent", "nt_xent_forward", "nt_xent_backward", "nt_xent_backward_from_stats",
    "info_nce", "info_nce_forward", "info_nce_backward", "info_nce_backward_from_stats",
    "supcon_loss", "supcon_forward", "supcon_backward", "supcon_backward_from_stats",
    "nt_xent_pairs", "nt_xent_pairs_forward", "nt_xent_pairs_backward",
    "nt_xent_pairs_backward_from_stats",
    "clip_loss", "clip_loss_forward", "clip_loss_backward", "clip_loss_backward_from_stats",
    "siglip_loss", "siglip_loss_forward", "siglip_loss_backward",
    "siglip_loss_backward_from_inputs",
    "splade_pool", "splade_pool_forward", "splade_pool_backward",
    "splade_pool_backward_from_stats", "flops_regularizer", "flops_regularizer_backward",
]
