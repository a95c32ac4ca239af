"""cupynce for PyTorch: the InfoNCE family and SPLADE's head as torch custom ops, autograd and
``nn.Module`` s.

``import cupynce.torch`` (``import cupynce`` alone never imports torch).  CUDA tensors run
cupynce's CUDA kernels and cuBLAS products through DLPack — zero copy, on the tensors' device
and torch's current stream, with memory from torch's caching allocator; CPU tensors run the
NumPy path.  No compiled extension, no torch build to match.

Functions (same names and arguments as the functional API; tensors in, tensors out;
autograd through every tensor input):

* :func:`nt_xent` — SimCLR's NT-Xent, z (2B, D)
* :func:`info_nce` — query/key InfoNCE, shared (M, D) or per-query (N, M, D) negatives
* :func:`supcon_loss` — supervised contrastive (SupCon's L_out), z (N, D), labels (N,);
  :class:`SupConLoss`
* :func:`nt_xent_pairs` — NT-Xent over every positive pair of labels, z (N, D), labels (N,)
* :func:`clip_loss` — CLIP's symmetric loss; ``logit_scale`` a real or a tensor (learnable)
* :func:`siglip_loss` — SigLIP's sigmoid loss; ``logit_scale`` and ``logit_bias`` reals or
  tensors (learnable); :class:`SigLipLoss` owns both
* :func:`splade_pool` — SPLADE's max-pooled vocabulary representation, x (B, L, D), weight
  (V, D), bias (V,), mask (B, L) → (B, V); :func:`flops_regularizer` (plain torch ops)

A queue of negatives (MoCo): :class:`NegativeQueue`, with ``info_nce(...,
in_batch_negatives=False, replicated_negatives=True)``.

Gradient caching: :class:`GradientCache` — a loss over a big batch whose encoders run in
chunks (GradCache), for batches whose activations do not fit (``grad_cache.py``).

Modules: :class:`InfoNCELoss` (= :class:`NTXentLoss`, CuBlaze's interface),
:class:`InfoNCEFunction` (its autograd Function), :class:`InfoNCE` (info-nce-pytorch's
query/key interface), :class:`ClipLoss` (= :class:`SymmetricInfoNCE`, learnable temperature),
:class:`SpladePooling` (SPLADE's head, owning its weight or tied to an MLM decoder).

How it is wired
---------------
Layout: ``_bridge.py`` (DLPack, streams, the torch allocator), ``_registry.py`` (custom-op
registration, autocast, the direct eager path), ``_skeleton.py`` (an op's bodies on tensors,
their FakeTensor shapes, autograd and the public function's dispatch, from its table entry),
``ops/<op>.py`` (one module per op: its table entry and the public function),
``modules.py`` (the ``nn.Module`` s).

Each loss is torch custom ops (``torch.library.custom_op``, torch >= 2.4), connected by
``register_autograd``, with ``register_fake`` shapes so that a ``torch.compile`` d training
step traces the forward and the backward without a graph break.  Nothing is saved when no
gradient is required.  Two ways to the gradient:

* reduction "mean" / "sum" with a gradient required (the usual training step):
  ``cupynce::<op>_fwd`` runs the core's fused forward, which computes the gradient for a unit
  upstream gradient in the same pass, and returns its fp32 (fp64) accumulators; the forward
  saves them (O(N·D), never N×N) and the backward only scales them by ``grad_output`` and
  casts (two torch ops, the core's own rounding), through ``cupynce::grad_finish`` where the
  rows were normalised.  Why: autograd runs a CUDA backward on its own device thread, where a
  full Python backward cost ~1.7x its main-thread time (docs/design.md); this halved
  the host time per call (N = 64: nt_xent 1846 -> 802 µs, clip_loss 2005 -> 1140 µs above
  the kernels on the H100 host; docs/design.md).
* reduction "none" (a per-row upstream gradient): ``cupynce::<op>_fwd`` returns the loss and
  the O(N) row log-sum-exps, the forward saves the inputs (references, no copy) and those
  statistics, and ``cupynce::<op>_bwd`` rebuilds the gradients from them
  (``cupynce.<op>_backward_from_stats``).

Plain eager calls (no ``torch.compile`` / tracing, no autocast, no torch-function or
dispatch mode, no functorch transform, plain tensors) skip the dispatcher: the same forward,
setup and backward functions run as plain ``torch.autograd.Function`` s (``_registry.direct``), which
saves the custom-op machinery's host time and gives the same bits.  Everything else goes
through the registered ops.  On torch < 2.4 the Functions are the only path (eager only).
Double backward (``create_graph=True``) is not supported and raises a RuntimeError.

``splade_pool`` is wired the same way: ``cupynce::splade_pool_fwd`` returns out (B, V) and the
winning positions l* (B, V) (``ctx.stats[0]`` of the core, int16 or int32 for long L), and
``cupynce::splade_pool_bwd`` calls ``cupynce.splade_pool_backward_from_stats``.  The forward
saves x and weight (references), out and l* — never the (B, L, V) logits — and computes l*
at all only when x, weight or bias requires a gradient (and grad mode is on).  The mask is
not differentiable.

torch.autocast
--------------
Inside an autocast region for the inputs' device type, the embeddings (z; query, key,
negatives; a, b; splade_pool's x, weight and bias — not its mask) are cast to the autocast
dtype before the kernels run, as autocast casts the operands of a matmul: float16 / bfloat16
inputs pass through untouched (no copy), float32 ones are cast down once (O(N·D)); float64 is
left alone.  ``logit_scale`` is never cast.  The loss is float32 (splade_pool's out: the
autocast dtype) and the gradients return in each input's dtype (autograd casts back through
the ``.to``).  Registered as the ops' AutocastCPU / AutocastCUDA kernels, which read the
*current* autocast dtype; on the torch < 2.4 fallback the inputs go to the kernels as they come.

float32 precision
-----------------
Every function and module takes ``precision="auto" | "fp32" | "tf32" | "3xtf32"`` (float32 CUDA
products; see :func:`cupynce.set_float32_precision`).  ``precision=None`` (the default) is
"tf32" when torch runs its own float32 CUDA matmuls in TF32 --
``torch.backends.cuda.matmul.fp32_precision == "tf32"`` on torch >= 2.9, which
``torch.backends.cuda.matmul.allow_tf32 = True``, ``torch.set_float32_matmul_precision("high")``
and ``torch.backends.fp32_precision = "tf32"`` set (it equals ``allow_tf32`` wherever torch
lets that be read: torch 2.13 refuses once the new API set TF32); ``allow_tf32`` on older
torch -- else ``cupynce.get_float32_precision()``.  Read on the host at each call
(``_registry.precision_of``); under ``torch.compile`` when the graph is traced, and dynamo's
global-state guard (which holds the TF32 flag) retraces when it changes.  The resolved mode is
an argument of the custom ops (``str? precision``), so the backward op recomputes in the
forward's.  CPU tensors (the NumPy path) and non-float32 dtypes ignore it.

Synchronisation
---------------
None in forward or backward: only shapes, dtypes and devices are read on the host; device
scalars (``logit_scale``, ``grad_output``) stay on the device.
"""

from .. import _checks

_checks.require_module("torch", "cupynce.torch")  # (without torch: say which extra installs it)

from ._registry import HAS_CUSTOM_OPS, MIN_TORCH_CUSTOM_OPS  # noqa: E402
from .grad_cache import GradientCache  # noqa: E402
from .modules import (ClipLoss, InfoNCE, InfoNCEFunction, InfoNCELoss,  # noqa: E402
                      NTXentLoss, SigLipLoss, SpladePooling, SupConLoss,
                      SymmetricInfoNCE)
from .ops.clip import clip_loss  # noqa: E402
from .ops.info_nce import info_nce  # noqa: E402
from .ops.nt_xent import nt_xent  # noqa: E402
from .ops.siglip import siglip_loss  # noqa: E402
from .ops.splade import flops_regularizer, splade_pool  # noqa: E402
from .ops.nt_xent_pairs import nt_xent_pairs  # noqa: E402
from .ops.supcon import supcon_loss  # noqa: E402
from .queue import NegativeQueue  # noqa: E402

__all__ = [
    "nt_xent", "info_nce", "supcon_loss", "nt_xent_pairs", "clip_loss", "siglip_loss", "splade_pool",
    "flops_regularizer",
    "InfoNCELoss", "NTXentLoss", "InfoNCEFunction", "InfoNCE", "SupConLoss", "ClipLoss",
    "SymmetricInfoNCE", "SigLipLoss", "GradientCache", "NegativeQueue",
    "SpladePooling", "HAS_CUSTOM_OPS", "MIN_TORCH_CUSTOM_OPS",
]
