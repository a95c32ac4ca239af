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
* :func:`clip_loss` — CLIP's symmetric loss; ``logit_scale`` a real or a tensor (learnable)
* :func:`splade_pool` — SPLADE's max-pooled vocabulary representation, x (B, L, D), weight
  (V, D), bias (V,), mask (B, L) → (B, V); :func:`flops_regularizer` (plain torch ops)

Modules: :class:`InfoNCELoss` (= :class:`NTXentLoss`, CuBlaze's interface),
:class:`InfoNCEFunction` (its autograd Function), :class:`InfoNCE` (info-nce-pytorch's
query/key interface), :class:`ClipLoss` (= :class:`SymmetricInfoNCE`, learnable temperature),
:class:`SpladePooling` (SPLADE's head, owning its weight or tied to an MLM decoder).

How it is wired
---------------
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
  full Python backward cost ~1.7x its main-thread time (benchmarks/NOTES.md); this halved
  the host time per call (N = 64: nt_xent 1846 -> 802 µs, clip_loss 2005 -> 1140 µs above
  the kernels on the H100 host).
* reduction "none" (a per-row upstream gradient): ``cupynce::<op>_fwd`` returns the loss and
  the O(N) row log-sum-exps, the forward saves the inputs (references, no copy) and those
  statistics, and ``cupynce::<op>_bwd`` rebuilds the gradients from them
  (``cupynce.<op>_backward_from_stats``).

Plain eager calls (no ``torch.compile`` / tracing, no autocast, no torch-function or
dispatch mode, no functorch transform, plain tensors) skip the dispatcher: the same forward,
setup and backward functions run as plain ``torch.autograd.Function`` s (``_direct``), which
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

Synchronisation
---------------
None in forward or backward: only shapes, dtypes and devices are read on the host; device
scalars (``logit_scale``, ``grad_output``) stay on the device.
"""
import math
import numbers
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from . import _checks, contrastive, splade
from . import _torch_bridge as _b

__all__ = [
    "nt_xent", "info_nce", "clip_loss", "splade_pool", "flops_regularizer",
    "InfoNCELoss", "NTXentLoss", "InfoNCEFunction", "InfoNCE", "ClipLoss", "SymmetricInfoNCE",
    "SpladePooling", "HAS_CUSTOM_OPS", "MIN_TORCH_CUSTOM_OPS",
]

#: torch.library.custom_op / register_fake / register_autograd / get_autocast_dtype.
MIN_TORCH_CUSTOM_OPS = "2.4"
#: True when the losses are torch custom ops (torch >= 2.4); False: autograd.Function fallback.
HAS_CUSTOM_OPS = all(hasattr(torch.library, f) for f in ("custom_op", "register_fake")) \
    and hasattr(torch, "get_autocast_dtype")


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The loss / statistics dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------
# kernels on tensors: one core call each, no autograd (the bodies of the custom ops)
# ------------------------------------------------------------------------------------------
# Two ways to a gradient (``fused``, chosen by the public functions):
#
# * fused (a gradient is required and reduction is "mean" or "sum"): the forward op runs the
#   core's fused forward, which also computes the gradient for a unit upstream gradient in
#   the forward's own pass over the scores, and returns its fp32 / fp64 accumulators (and the
#   row norms for normalize=True).  The backward only scales them by grad_output and casts:
#   ``(acc * g).to(dtype)`` in torch (the core's scale_cast, bit for bit), or the
#   ``grad_finish`` op through the normalisation.  Why: autograd runs a CUDA backward on its
#   own device thread, where the Python of a full backward (checks, DLPack, a dozen launches)
#   cost ~1.7x its main-thread time on the H100 host (benchmarks/NOTES.md), and the kernels
#   are the same either way.  Cost: the (N, D) accumulators live from forward to backward.
# * otherwise ("none", whose upstream gradient is a vector): the forward returns the O(N)
#   row statistics, and the backward op rebuilds the gradient from them and the inputs.
#   These forwards call the core with reduction="none" and reduce here
#   (``contrastive._reduce``, the core's own reduction).
# Unused outputs are (0,) placeholders (custom ops return tensors, never None).

def _empty(x: Tensor) -> Tensor:
    return x.new_empty((0,), dtype=_acc(x.dtype))


def _opt_tensor(arr: Any, like: Tensor) -> Tensor:
    return _empty(like) if arr is None else _b.tensor_of(arr)


def _nt_xent_fwd(z: Tensor, temperature: float, reduction: str, normalize: bool,
                 workspace_bytes: Optional[int],
                 fused: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, dz_acc, norm): the loss (0-d, or (2B,) for "none"), the (2B,) row
    log-sum-exps and, when ``fused``, the unit-upstream gradient accumulator (2B, D) and the
    row norms (2B,) (normalize=True; else a placeholder)."""
    with _b.device_scope(z.device):
        zx = _b.array_of(z)
        if fused:
            loss, ctx = contrastive.nt_xent_forward(
                zx, temperature, reduction=reduction, normalize=normalize,
                workspace_bytes=workspace_bytes, requires_grad=True)
            s = ctx.saved
            return (_b.tensor_of(loss), _b.tensor_of(ctx.stats[0]), _b.tensor_of(s["dz"]),
                    _opt_tensor(s["norm"], z))
        rows, ctx = contrastive.nt_xent_forward(
            zx, temperature, reduction="none", normalize=normalize,
            workspace_bytes=workspace_bytes, requires_grad=True)
        loss = contrastive._reduce(ctx.xp, rows, reduction)
        return _b.tensor_of(loss), _b.tensor_of(ctx.stats[0]), _empty(z), _empty(z)


def _nt_xent_bwd(z: Tensor, lse: Tensor, grad_loss: Tensor, temperature: float, reduction: str,
                 normalize: bool, workspace_bytes: Optional[int]) -> Tensor:
    """dz (2B, D) in z's dtype, for the upstream gradient ``grad_loss`` (0-d or (2B,))."""
    with _b.device_scope(z.device):
        dz = contrastive.nt_xent_backward_from_stats(
            _b.array_of(z), _b.array_of(lse), _b.array_of(grad_loss), temperature=temperature,
            reduction=reduction, normalize=normalize, workspace_bytes=workspace_bytes)
        return _b.tensor_of(dz)


def _info_nce_fwd(query: Tensor, key: Tensor, negatives: Optional[Tensor], temperature: float,
                  reduction: str, normalize: bool, workspace_bytes: Optional[int],
                  fused: bool = False
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, dq_acc, dk_acc, dn_acc, norm_q, norm_k, norm_n): the loss (0-d, or (N,)
    for "none"), the (N,) row log-sum-exps and, when ``fused``, the unit-upstream gradient
    accumulators and the row norms (normalize=True) of query, key and negatives
    (placeholders where there is none)."""
    with _b.device_scope(query.device):
        args = (_b.array_of(query), _b.array_of(key), temperature)
        if fused:
            loss, ctx = contrastive.info_nce_forward(
                *args, negatives=_b.array_of(negatives), reduction=reduction,
                normalize=normalize, workspace_bytes=workspace_bytes, requires_grad=True)
            s = ctx.saved
            return ((_b.tensor_of(loss), _b.tensor_of(ctx.stats[0]))
                    + tuple(_opt_tensor(x, query) for x in s["acc"])
                    + tuple(_opt_tensor(x, query) for x in s["norms"]))
        rows, ctx = contrastive.info_nce_forward(
            *args, negatives=_b.array_of(negatives), reduction="none", normalize=normalize,
            workspace_bytes=workspace_bytes, requires_grad=True)
        loss = contrastive._reduce(ctx.xp, rows, reduction)
        return (_b.tensor_of(loss), _b.tensor_of(ctx.stats[0])) + tuple(_empty(query) for _ in range(6))


def _info_nce_bwd(query: Tensor, key: Tensor, negatives: Optional[Tensor], lse: Tensor,
                  grad_loss: Tensor, temperature: float, reduction: str, normalize: bool,
                  workspace_bytes: Optional[int]) -> Tuple[Tensor, Tensor, Tensor]:
    """(dquery, dkey, dnegatives); dnegatives is an empty (0,) tensor without negatives."""
    with _b.device_scope(query.device):
        dq, dk, dn = contrastive.info_nce_backward_from_stats(
            _b.array_of(query), _b.array_of(key), _b.array_of(negatives), _b.array_of(lse),
            _b.array_of(grad_loss), temperature=temperature, reduction=reduction,
            normalize=normalize, workspace_bytes=workspace_bytes)
        dn = query.new_empty((0,)) if dn is None else _b.tensor_of(dn)  # ops return tensors
        return _b.tensor_of(dq), _b.tensor_of(dk), dn


def _clip_loss_fwd(a: Tensor, b: Tensor, logit_scale: Optional[Tensor], logit_scale_value: float,
                   reduction: str, normalize: bool, workspace_bytes: Optional[int],
                   fused: bool = False
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse_rows, lse_cols, da_acc, db_acc, norm_a, norm_b, dscale): when ``fused``,
    the unit-upstream gradient accumulators, row norms (normalize=True) and the 0-d
    d loss / d logit_scale; placeholders otherwise.  ``logit_scale`` is the tensor, or None and
    the real ``logit_scale_value`` is used (a Python float never becomes a device tensor)."""
    with _b.device_scope(a.device):
        ls = logit_scale_value if logit_scale is None else _b.array_of(logit_scale)
        if fused:
            loss, ctx = contrastive.clip_loss_forward(
                _b.array_of(a), _b.array_of(b), ls, reduction=reduction, normalize=normalize,
                workspace_bytes=workspace_bytes, requires_grad=True)
            s = ctx.saved
            return ((_b.tensor_of(loss),) + tuple(_b.tensor_of(x) for x in ctx.stats)
                    + tuple(_opt_tensor(x, a) for x in s["acc"])
                    + tuple(_opt_tensor(x, a) for x in s["norms"])
                    + (_b.tensor_of(ctx.xp.asarray(s["dscale"])),))
        rows, ctx = contrastive.clip_loss_forward(
            _b.array_of(a), _b.array_of(b), ls, reduction="none", normalize=normalize,
            workspace_bytes=workspace_bytes, requires_grad=True)
        loss = contrastive._reduce(ctx.xp, rows, reduction)
        lse_r, lse_c = ctx.stats
        return (_b.tensor_of(loss), _b.tensor_of(lse_r), _b.tensor_of(lse_c)) + tuple(_empty(a) for _ in range(5))


def _clip_loss_bwd(a: Tensor, b: Tensor, logit_scale: Optional[Tensor], logit_scale_value: float,
                   lse_r: Tensor, lse_c: Tensor, grad_loss: Tensor, reduction: str,
                   normalize: bool,
                   workspace_bytes: Optional[int]) -> Tuple[Tensor, Tensor, Tensor]:
    """(da, db, dlogit_scale); dlogit_scale has logit_scale's shape and dtype (0-d float32 /
    float64 when a real was given)."""
    with _b.device_scope(a.device):
        ls = logit_scale_value if logit_scale is None else _b.array_of(logit_scale)
        da, db, dls = contrastive.clip_loss_backward_from_stats(
            _b.array_of(a), _b.array_of(b), ls, _b.array_of(lse_r), _b.array_of(lse_c),
            _b.array_of(grad_loss), reduction=reduction, normalize=normalize,
            workspace_bytes=workspace_bytes)
        return _b.tensor_of(da), _b.tensor_of(db), _b.tensor_of(dls)


def _grad_finish(x: Tensor, norm: Tensor, acc: Tensor, grad_loss: Tensor) -> Tensor:
    """The gradient w.r.t. ``x`` (x's dtype) of a fused forward: ``grad_loss`` times the
    accumulator ``acc`` taken back through the row normalisation of ``x`` (row norms ``norm``)
    -- the core's own finish (``l2norm_bwd`` / ``_np_finish``), so bit for bit the functional
    API's backward."""
    with _b.device_scope(x.device):
        xa = _b.array_of(x)
        if isinstance(xa, np.ndarray):
            xp = np
        else:
            import cupy as xp
        path = contrastive._Path(xp)
        acc_a = _b.array_of(acc)
        gs = path.grad_scale(_b.array_of(grad_loss), acc_a.dtype)
        out = contrastive._finish_all(path, contrastive._contig_inputs(xp, xa),
                                      [_b.array_of(norm)], [acc_a], gs)
        return _b.tensor_of(out[0])


def _mask_array(mask: Optional[Tensor]) -> Any:
    """The core's view of an attention mask: bool crosses as a uint8 view (same bytes, nonzero
    = counts; DLPack's bool is not spoken by every CuPy release), other dtypes as they are."""
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return _b.array_of(mask)


def _argmax_dtype(seq_len: int) -> torch.dtype:
    """The dtype of the winning positions, the core's choice (int16 while every l < L fits)."""
    return torch.int16 if splade._index_dtype(seq_len) == np.int16 else torch.int32


def _splade_pool_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
                     activation: str, workspace_bytes: Optional[int],
                     requires_grad: bool) -> Tuple[Tensor, Tensor]:
    """(out, argmax): out (B, V) in x's dtype and the (B, V) winning positions
    (``ctx.stats[0]``); argmax is an empty (0, 0) tensor when ``requires_grad`` is False (the
    core then skips it)."""
    with _b.device_scope(x.device):
        out, ctx = splade.splade_pool_forward(
            _b.array_of(x), _b.array_of(weight), _b.array_of(bias), _mask_array(mask),
            activation=activation, workspace_bytes=workspace_bytes, requires_grad=requires_grad)
        argmax = _b.tensor_of(ctx.stats[0]) if requires_grad else \
            x.new_empty((0, 0), dtype=_argmax_dtype(x.shape[1]))
        return _b.tensor_of(out), argmax


def _splade_pool_bwd(x: Tensor, weight: Tensor, out: Tensor, argmax: Tensor, grad_out: Tensor,
                     has_bias: bool, activation: str) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) in the inputs' dtype (x, weight and bias share one); dbias is an
    empty (0,) tensor without a bias.  Only x, weight, out and argmax are needed: the core
    reads ``bias`` for its presence, shape (V,) and dtype alone, and ``out[0]`` has all three
    (x's dtype, which the bias shares), so the bias itself is never saved."""
    with _b.device_scope(x.device):
        out_a = _b.array_of(out)
        dx, dw, db = splade.splade_pool_backward_from_stats(
            _b.array_of(x), _b.array_of(weight), out_a, _b.array_of(argmax),
            _b.array_of(grad_out), bias=out_a[0] if has_bias else None, activation=activation)
        db = x.new_empty((0,)) if db is None else _b.tensor_of(db)
        return _b.tensor_of(dx), _b.tensor_of(dw), db


# ------------------------------------------------------------------------------------------
# shapes for torch.compile (FakeTensor): must match what the kernels return (contiguous)
# ------------------------------------------------------------------------------------------
def _loss_like(x: Tensor, reduction: str) -> Tensor:
    return x.new_empty((x.shape[0],) if reduction == "none" else (), dtype=_acc(x.dtype))


def _stat_like(x: Tensor) -> Tensor:
    return x.new_empty((x.shape[0],), dtype=_acc(x.dtype))


def _acc_like(x: Optional[Tensor], fused: bool, like: Tensor) -> Tensor:
    """A fused forward's gradient accumulator: x's shape in the accumulation dtype."""
    return x.new_empty(x.shape, dtype=_acc(x.dtype)) if fused and x is not None else _empty(like)


def _norm_like(x: Optional[Tensor], fused: bool, normalize: bool, like: Tensor) -> Tensor:
    """A fused forward's row norms: x's shape without D (normalize=True)."""
    if fused and normalize and x is not None:
        return x.new_empty(x.shape[:-1], dtype=_acc(x.dtype))
    return _empty(like)


def _nt_xent_fwd_fake(z, temperature, reduction, normalize, workspace_bytes, fused=False):
    return (_loss_like(z, reduction), _stat_like(z), _acc_like(z, fused, z),
            _norm_like(z, fused, normalize, z))


def _nt_xent_bwd_fake(z, lse, grad_loss, temperature, reduction, normalize, workspace_bytes):
    return z.new_empty(z.shape)


def _info_nce_fwd_fake(query, key, negatives, temperature, reduction, normalize,
                       workspace_bytes, fused=False):
    xs = (query, key, negatives)
    return ((_loss_like(query, reduction), _stat_like(query))
            + tuple(_acc_like(x, fused, query) for x in xs)
            + tuple(_norm_like(x, fused, normalize, query) for x in xs))


def _info_nce_bwd_fake(query, key, negatives, lse, grad_loss, temperature, reduction,
                       normalize, workspace_bytes):
    dn = query.new_empty((0,)) if negatives is None else negatives.new_empty(negatives.shape)
    return query.new_empty(query.shape), key.new_empty(key.shape), dn


def _clip_loss_fwd_fake(a, b, logit_scale, logit_scale_value, reduction, normalize,
                        workspace_bytes, fused=False):
    dscale = a.new_empty((), dtype=_acc(a.dtype)) if fused else _empty(a)
    return ((_loss_like(a, reduction), _stat_like(a), _stat_like(a))
            + tuple(_acc_like(x, fused, a) for x in (a, b))
            + tuple(_norm_like(x, fused, normalize, a) for x in (a, b)) + (dscale,))


def _grad_finish_fake(x, norm, acc, grad_loss):
    return x.new_empty(x.shape)


def _clip_loss_bwd_fake(a, b, logit_scale, logit_scale_value, lse_r, lse_c, grad_loss,
                        reduction, normalize, workspace_bytes):
    dls = a.new_empty((), dtype=_acc(a.dtype)) if logit_scale is None else \
        logit_scale.new_empty(logit_scale.shape)
    return a.new_empty(a.shape), b.new_empty(b.shape), dls


def _splade_pool_fwd_fake(x, weight, bias, mask, activation, workspace_bytes, requires_grad):
    argmax_shape = (x.shape[0], weight.shape[0]) if requires_grad else (0, 0)
    return (x.new_empty((x.shape[0], weight.shape[0])),
            x.new_empty(argmax_shape, dtype=_argmax_dtype(x.shape[1])))


def _splade_pool_bwd_fake(x, weight, out, argmax, grad_out, has_bias, activation):
    db = x.new_empty((weight.shape[0],) if has_bias else (0,))
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


# ------------------------------------------------------------------------------------------
# autograd: setup_context / backward, shared by the custom ops and the fallback Functions
# ------------------------------------------------------------------------------------------
# ``backward`` calls ``_BWD[op]``: the backward custom op (so torch.compile traces it into the
# backward graph) or, on old torch, the plain function.  grad_output may be an expanded
# (stride-0) tensor; the kernels get it contiguous.
_BWD = {"nt_xent": _nt_xent_bwd, "info_nce": _info_nce_bwd, "clip_loss": _clip_loss_bwd,
        "splade_pool": _splade_pool_bwd}


def _fused_flag(inputs, n_args: int) -> bool:
    """The ``fused`` input (absent from a fallback Function's inputs when not passed)."""
    return bool(inputs[n_args]) if len(inputs) > n_args else False


def _compiling() -> bool:
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(fn()) if fn is not None else False


def _scaled(x: Optional[Tensor], norm: Optional[Tensor], acc: Tensor, grad_loss: Tensor,
            dtype: torch.dtype, normalize: bool) -> Tensor:
    """A fused forward's gradient for upstream ``grad_loss``: ``acc * g`` cast to the input
    dtype (= the core's scale_cast: one fp32 / fp64 product, one rounding), or through the
    normalisation by the ``grad_finish`` op.

    Double backward is not supported: ``acc`` does not depend on the inputs in autograd's
    eyes, so a graph built here (``create_graph=True``) would silently drop the gradient's own
    dependence on them; raise instead (the per-row path's backward op has no autograd formula
    and fails the same way)."""
    if torch.is_grad_enabled() and not _compiling():
        raise RuntimeError("cupynce.torch: double backward (create_graph=True) is not supported")
    if normalize:
        return _FINISH(x, norm, acc, grad_loss.contiguous())
    return (acc * grad_loss).to(dtype)


def _nt_xent_setup(ctx, inputs, output) -> None:
    z, temperature, reduction, normalize, workspace_bytes = inputs[:5]
    ctx.fused = _fused_flag(inputs, 5)
    if ctx.fused:  # the gradient accumulator (and z and its norms to normalise through)
        ctx.save_for_backward(z if normalize else None, output[2], output[3])
        ctx.dtype = z.dtype
    else:
        ctx.save_for_backward(z, output[1])
    ctx.args = (temperature, reduction, normalize, workspace_bytes)
    ctx.mark_non_differentiable(*output[1:])


def _nt_xent_backward(ctx, grad_loss, *_grad_stats):
    dz = None
    if ctx.needs_input_grad[0]:
        if ctx.fused:
            z, acc, norm = ctx.saved_tensors
            dz = _scaled(z, norm, acc, grad_loss, ctx.dtype, ctx.args[2])
        else:
            z, lse = ctx.saved_tensors
            dz = _BWD["nt_xent"](z, lse, grad_loss.contiguous(), *ctx.args)
    return dz, None, None, None, None, None


def _info_nce_setup(ctx, inputs, output) -> None:
    query, key, negatives, temperature, reduction, normalize, workspace_bytes = inputs[:7]
    ctx.fused = _fused_flag(inputs, 7)
    ctx.has_neg = negatives is not None
    if ctx.fused:  # accumulators and norms of query, key, negatives (+ inputs to normalise)
        xs = (query, key, negatives) if normalize else (None, None, None)
        ctx.save_for_backward(*xs, *output[2:8])
        ctx.dtypes = tuple(None if x is None else x.dtype for x in (query, key, negatives))
    else:
        ctx.save_for_backward(query, key, negatives, output[1])
    ctx.args = (temperature, reduction, normalize, workspace_bytes)
    ctx.mark_non_differentiable(*output[1:])


def _info_nce_backward(ctx, grad_loss, *_grad_stats):
    need = ctx.needs_input_grad
    dq = dk = dn = None
    if ctx.fused:
        saved = ctx.saved_tensors
        xs, accs, norms = saved[:3], saved[3:6], saved[6:9]
        grads = [_scaled(xs[i], norms[i], accs[i], grad_loss, ctx.dtypes[i], ctx.args[2])
                 if need[i] and (i < 2 or ctx.has_neg) else None for i in range(3)]
        dq, dk, dn = grads
    elif any(need[:3]):
        query, key, negatives, lse = ctx.saved_tensors
        dq, dk, dn = _BWD["info_nce"](query, key, negatives, lse, grad_loss.contiguous(),
                                      *ctx.args)
    return (dq if need[0] else None, dk if need[1] else None,
            dn if need[2] and ctx.has_neg else None, None, None, None, None, None)


def _clip_loss_setup(ctx, inputs, output) -> None:
    a, b, logit_scale, logit_scale_value, reduction, normalize, workspace_bytes = inputs[:7]
    ctx.fused = _fused_flag(inputs, 7)
    ctx.has_ls = logit_scale is not None
    if ctx.fused:  # accumulators, norms and d loss / d logit_scale (+ inputs to normalise)
        xs = (a, b) if normalize else (None, None)
        ctx.save_for_backward(*xs, *output[3:8])
        ctx.dtypes = (a.dtype, b.dtype)
        ctx.ls_meta = None if logit_scale is None else (logit_scale.dtype, logit_scale.shape)
    else:
        ctx.save_for_backward(a, b, logit_scale, output[1], output[2])
    ctx.args = (logit_scale_value, reduction, normalize, workspace_bytes)
    ctx.mark_non_differentiable(*output[1:])


def _clip_loss_backward(ctx, grad_loss, *_grad_stats):
    need = ctx.needs_input_grad
    ls_value, reduction, normalize, workspace_bytes = ctx.args
    da = db = dls = None
    if ctx.fused:
        xa, xb, acc_a, acc_b, norm_a, norm_b, dscale = ctx.saved_tensors
        if need[0]:
            da = _scaled(xa, norm_a, acc_a, grad_loss, ctx.dtypes[0], normalize)
        if need[1]:
            db = _scaled(xb, norm_b, acc_b, grad_loss, ctx.dtypes[1], normalize)
        if need[2] and ctx.has_ls:  # the core's dscale * g, cast to logit_scale's dtype
            dls = (dscale * grad_loss).to(ctx.ls_meta[0]).reshape(ctx.ls_meta[1])
    elif any(need[:3]):
        a, b, logit_scale, lse_r, lse_c = ctx.saved_tensors
        da, db, dls = _BWD["clip_loss"](a, b, logit_scale, ls_value, lse_r, lse_c,
                                        grad_loss.contiguous(), reduction, normalize,
                                        workspace_bytes)
    return (da if need[0] else None, db if need[1] else None,
            dls if need[2] and ctx.has_ls else None, None, None, None, None, None)


def _splade_pool_setup(ctx, inputs, output) -> None:
    x, weight, bias, mask, activation, workspace_bytes, requires_grad = inputs
    out, argmax = output
    ctx.mark_non_differentiable(argmax)
    ctx.args = (bias is not None, activation)
    ctx.has_stats = requires_grad
    if requires_grad:  # x and weight by reference; out and argmax are O(B·V)
        ctx.save_for_backward(x, weight, out, argmax)


def _splade_pool_backward(ctx, grad_out, _grad_argmax):
    need = ctx.needs_input_grad
    nones = (None,) * 4  # mask, activation, workspace_bytes, requires_grad
    if not ctx.has_stats or not any(need[:3]):
        # only the mask required a gradient (it never gets one) or nothing at all did
        return (None, None, None) + nones
    x, weight, out, argmax = ctx.saved_tensors
    has_bias, activation = ctx.args
    dx, dw, db = _BWD["splade_pool"](x, weight, out, argmax, grad_out.contiguous(), has_bias,
                                     activation)
    return (dx if need[0] else None, dw if need[1] else None,
            db if need[2] and has_bias else None) + nones


def _fallback(name: str, fwd, setup, backward) -> type:
    """A ``torch.autograd.Function`` over the same kernels (torch < 2.4, and tests)."""
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(fwd), "setup_context": staticmethod(setup),
        "backward": staticmethod(backward), "__doc__": f"Eager autograd for {fwd.__name__}."})


_NTXentFunction = _fallback("_NTXentFunction", _nt_xent_fwd, _nt_xent_setup, _nt_xent_backward)
_InfoNCEFunction = _fallback("_InfoNCEFunction", _info_nce_fwd, _info_nce_setup,
                             _info_nce_backward)
_ClipLossFunction = _fallback("_ClipLossFunction", _clip_loss_fwd, _clip_loss_setup,
                              _clip_loss_backward)
_SpladePoolFunction = _fallback("_SpladePoolFunction", _splade_pool_fwd, _splade_pool_setup,
                                _splade_pool_backward)

# ------------------------------------------------------------------------------------------
# custom ops (torch >= 2.4)
# ------------------------------------------------------------------------------------------
_autocast_lib = None  # keeps the Autocast* kernel registrations alive


def _register_autocast(qualname: str, cast_positions: Tuple[int, ...]) -> None:
    """AutocastCPU / AutocastCUDA kernels for ``qualname``: the embeddings at
    ``cast_positions`` go to the *current* autocast dtype (``torch.library.register_autocast``
    fixes one dtype at registration and would also cast logit_scale), then the op runs with
    autocast excluded, as torch's own ``register_autocast`` kernel does."""
    global _autocast_lib
    if _autocast_lib is None:
        _autocast_lib = torch.library.Library("cupynce", "FRAGMENT")
    op = torch._library.utils.lookup_op(qualname)
    for device_type, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
        exclude = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, *args, _device_type=device_type, _exclude=exclude):
            dtype = torch.get_autocast_dtype(_device_type)
            args = tuple(
                a.to(dtype) if i in cast_positions and isinstance(a, Tensor)
                and a.is_floating_point() and a.dtype != torch.float64
                and a.device.type == _device_type else a
                for i, a in enumerate(args))
            with torch._C._ExcludeDispatchKeyGuard(_exclude):
                return op(*args)

        _autocast_lib.impl(qualname.split("::")[1], kernel, key, with_keyset=True)


def _custom_op(name: str, fn, fake, *, setup=None, backward=None, autocast=()):
    op = torch.library.custom_op(f"cupynce::{name}", fn, mutates_args=())
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup)
    if autocast:
        _register_autocast(f"cupynce::{name}", autocast)
    return op


if HAS_CUSTOM_OPS:
    _BWD = {
        "nt_xent": _custom_op("nt_xent_bwd", _nt_xent_bwd, _nt_xent_bwd_fake),
        "info_nce": _custom_op("info_nce_bwd", _info_nce_bwd, _info_nce_bwd_fake),
        "clip_loss": _custom_op("clip_loss_bwd", _clip_loss_bwd, _clip_loss_bwd_fake),
        "splade_pool": _custom_op("splade_pool_bwd", _splade_pool_bwd, _splade_pool_bwd_fake),
    }
    _FINISH = _custom_op("grad_finish", _grad_finish, _grad_finish_fake)
    _NT_XENT = _custom_op("nt_xent_fwd", _nt_xent_fwd, _nt_xent_fwd_fake, setup=_nt_xent_setup,
                          backward=_nt_xent_backward, autocast=(0,))
    _INFO_NCE = _custom_op("info_nce_fwd", _info_nce_fwd, _info_nce_fwd_fake,
                           setup=_info_nce_setup, backward=_info_nce_backward, autocast=(0, 1, 2))
    _CLIP_LOSS = _custom_op("clip_loss_fwd", _clip_loss_fwd, _clip_loss_fwd_fake,
                            setup=_clip_loss_setup, backward=_clip_loss_backward,
                            autocast=(0, 1))
    _SPLADE_POOL = _custom_op("splade_pool_fwd", _splade_pool_fwd, _splade_pool_fwd_fake,
                              setup=_splade_pool_setup, backward=_splade_pool_backward,
                              autocast=(0, 1, 2))
else:  # pragma: no cover - exercised only on torch < 2.4
    _FINISH = _grad_finish
    _NT_XENT = _NTXentFunction.apply
    _INFO_NCE = _InfoNCEFunction.apply
    _CLIP_LOSS = _ClipLossFunction.apply
    _SPLADE_POOL = _SpladePoolFunction.apply


# ------------------------------------------------------------------------------------------
# public functions
# ------------------------------------------------------------------------------------------
_TRANSFORMS_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)
_PLAIN_TYPES = (Tensor, nn.Parameter)


def _direct(*tensors: Optional[Tensor]) -> bool:
    """Whether a call may take the direct eager path: the ops' bodies through plain
    ``torch.autograd.Function`` s (the ``_*Function`` classes, same forward, setup and
    backward functions, so the same kernels and bits) instead of the custom-op dispatcher.

    The dispatcher, its autograd wrapper and its output checks cost ~100-250 µs of host time
    per forward + backward on the H100 host (N = 64), as much as the kernels' own launches.
    Everything that needs the registered ops keeps them: ``torch.compile`` / dynamo and
    ``torch.jit`` tracing, torch-function and dispatch modes (FakeTensor, functionalisation,
    ``with torch.device(...)``), functorch transforms (vmap, grad), autocast (the ops carry
    the autocast casts), tensor subclasses; and torch < 2.4, where the Functions are the
    only path anyway.
    """
    if not HAS_CUSTOM_OPS:
        return True
    if _compiling() or torch.jit.is_tracing() or torch._C._is_torch_function_mode_enabled() \
            or torch._C._len_torch_dispatch_stack() \
            or (_TRANSFORMS_ACTIVE is not None and _TRANSFORMS_ACTIVE()) \
            or torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"):
        return False
    return all(t is None or type(t) in _PLAIN_TYPES for t in tensors)


def _fused(reduction: str, *tensors: Optional[Tensor]) -> bool:
    """Compute the gradient in the forward (see "Two ways to a gradient"): a gradient will be
    asked for (grad mode on and an input requires one) and the upstream gradient is a scalar
    (reduction "mean" / "sum")."""
    return reduction != "none" and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors)


def _scalars(op: str, reduction: str, workspace_bytes: Optional[int]) -> Tuple[str, Optional[int]]:
    """The functional API's checks of the non-tensor arguments (same messages)."""
    return _checks.check_reduction(op, reduction), _checks.check_workspace(op, workspace_bytes)


def nt_xent(z: Tensor, temperature: float = 0.5, *, reduction: str = "mean",
            normalize: bool = False, workspace_bytes: Optional[int] = None) -> Tensor:
    """SimCLR's NT-Xent loss of ``z`` (2B, D), differentiable w.r.t. ``z``.

    Parameters
    ----------
    z : Tensor (2B, D), float16 / bfloat16 / float32 / float64, CPU or CUDA
        The two views stacked: rows ``i`` and ``(i + B) mod 2B`` are a positive pair.
    temperature : float > 0, default 0.5
    reduction : "mean" (default) | "sum" | "none"
    normalize : bool, default False
        L2-normalise the rows first (as ``F.normalize``); the gradient goes through it.
    workspace_bytes : int, optional
        Cap on the score-block workspace (CUDA); default ``min(1 GiB, half the free memory)``.

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
    t = _checks.check_temperature("nt_xent", temperature)
    reduction, workspace_bytes = _scalars("nt_xent", reduction, workspace_bytes)
    _b.check_tensors("nt_xent", z=z)
    fn = _NTXentFunction.apply if _direct(z) else _NT_XENT
    return fn(z, t, reduction, bool(normalize), workspace_bytes, _fused(reduction, z))[0]


def info_nce(query: Tensor, key: Tensor, temperature: float = 0.1, *,
             negatives: Optional[Tensor] = None, reduction: str = "mean",
             normalize: bool = False, workspace_bytes: Optional[int] = None) -> Tensor:
    """Query/key InfoNCE with in-batch negatives (and optional explicit ones).

    Parameters
    ----------
    query, key : Tensor (N, D), paired by row: key i is query i's positive, the other N − 1
        keys its in-batch negatives.
    temperature : float > 0, default 0.1
    negatives : Tensor, optional
        (M, D) shared by every query, or (N, M, D) per query; differentiable.
    reduction, normalize, workspace_bytes : as for :func:`nt_xent` (``normalize`` applies to
        query, key and negatives alike).

    Returns
    -------
    Tensor: 0-d (mean/sum) or (N,) (none); float32 (float64 for float64 inputs).

    Notes
    -----
    ``loss_i = log Σ_{c ∈ C_i} exp(q̂_i·ĉ/τ) − q̂_i·k̂_i/τ`` with C_i = all keys, the shared
    negatives and query i's own negatives.  (info-nce-pytorch drops the in-batch keys when
    explicit negatives are given; here they always count.)
    """
    t = _checks.check_temperature("info_nce", temperature)
    reduction, workspace_bytes = _scalars("info_nce", reduction, workspace_bytes)
    _b.check_tensors("info_nce", optional=("negatives",), query=query, key=key,
                     negatives=negatives)
    fn = _InfoNCEFunction.apply if _direct(query, key, negatives) else _INFO_NCE
    return fn(query, key, negatives, t, reduction, bool(normalize), workspace_bytes,
              _fused(reduction, query, key, negatives))[0]


def clip_loss(a: Tensor, b: Tensor, logit_scale: Any, *, reduction: str = "mean",
              normalize: bool = False, workspace_bytes: Optional[int] = None) -> Tensor:
    """CLIP's symmetric contrastive loss, differentiable w.r.t. a, b and a tensor logit_scale.

    Parameters
    ----------
    a, b : Tensor (N, D) — e.g. image and text embeddings; pair i is (a_i, b_i).
    logit_scale : real, or Tensor of shape () or (1,) on a's device
        Log inverse temperature: the logits are ``exp(logit_scale) · â b̂ᵀ``.  A tensor is a
        differentiable input (CLIP's learnable temperature) and is never read on the host;
        clamping it is the caller's business (:class:`ClipLoss` does it).
    reduction : "mean" (default) | "sum" | "none" (per pair: (row CE_i + column CE_i) / 2)
    normalize, workspace_bytes : as for :func:`nt_xent`.

    Returns
    -------
    Tensor: 0-d (mean/sum) or (N,) (none); float32 (float64 for float64 inputs).

    Notes
    -----
    ``L = exp(logit_scale) · â b̂ᵀ``; ``loss = (CE(L, arange) + CE(Lᵀ, arange)) / 2`` as in
    CLIP / open_clip.  Forward keeps a, b, logit_scale and the row and column log-sum-exps.
    """
    op = "clip_loss"
    reduction, workspace_bytes = _scalars(op, reduction, workspace_bytes)
    if isinstance(logit_scale, Tensor):
        _b.check_tensors(op, a=a, b=b, logit_scale=logit_scale)
        ls_tensor, ls_value = logit_scale, 0.0
    elif isinstance(logit_scale, numbers.Real):
        _b.check_tensors(op, a=a, b=b)
        ls_tensor, ls_value = None, _checks.check_logit_scale(op, logit_scale, None)[0]
    else:
        raise TypeError(f"{op}: logit_scale must be a real number or a torch.Tensor of shape () "
                        f"or (1,), got {type(logit_scale).__module__}."
                        f"{type(logit_scale).__name__}")
    fn = _ClipLossFunction.apply if _direct(a, b, ls_tensor) else _CLIP_LOSS
    return fn(a, b, ls_tensor, ls_value, reduction, bool(normalize), workspace_bytes,
              _fused(reduction, a, b, ls_tensor))[0]


def _check_activation(op: str, activation: Any) -> str:
    """The core's check (same message), made before tracing / dispatch."""
    if not isinstance(activation, str) or activation not in splade.ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {splade.ACTIVATIONS}, "
                         f"got {activation!r}")
    return activation


def splade_pool(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                mask: Optional[Tensor] = None, *, activation: str = "log1p_relu",
                workspace_bytes: Optional[int] = None) -> Tensor:
    """SPLADE's max-pooled vocabulary representation, differentiable w.r.t. x, weight and bias.

    Parameters
    ----------
    x : Tensor (B, L, D), float16 / bfloat16 / float32 / float64, CPU or CUDA
        Hidden states (for a BERT MLM head: after the head's transform, i.e. what the decoder
        multiplies).
    weight : Tensor (V, D), x's dtype
        The vocabulary projection in ``nn.Linear`` / Hugging Face decoder layout (a decoder's
        ``weight`` as is).  A (D, V) matrix is passed as its transpose ``w.T`` (a view, never
        copied; the gradient reaches ``w`` through the view).
    bias : Tensor (V,), x's dtype, optional
    mask : Tensor (B, L), optional
        Attention mask, bool or 0/1 of any real dtype (nonzero = the position counts); None:
        every position counts.  Not differentiable.
    activation : "log1p_relu" (default, SPLADE's log(1 + ReLU)) | "relu"
    workspace_bytes : int, optional
        Cap on the logit-tile workspace (CUDA); the core's default when None.

    Returns
    -------
    Tensor (B, V) in x's dtype.

    Notes
    -----
    ``out[b, v] = act(max_{l : mask[b, l] ≠ 0} x[b, l, :] · weight[v, :] + bias[v])``, with
    act = ``max(m, 0)`` (relu) or ``log(1 + max(m, 0))`` (log1p_relu); a row whose mask is all
    zero gives 0; ties go to the lowest l.  The (B, L, V) logits are never allocated: the forward
    keeps x, weight (references), out and the (B, V) winning positions l* (int16, int32 for
    very long L: the core's ``ctx.stats[0]``), and only when a gradient is required.  The backward touches only
    the active entries (out > 0), with g = grad_out · act'(m):
    ``dW[v] = Σ_b g[b, v] x[b, l*]``, ``dx[b, l*] += g[b, v] W[v]``, ``dbias[v] = Σ_b g[b, v]``;
    deterministic (no floating-point atomics).  Under ``torch.autocast`` x, weight and bias
    are cast to the autocast dtype (as ``F.linear``'s operands; float16/bfloat16 pass as they
    are) and out is in that dtype.
    """
    op = "splade_pool"
    activation = _check_activation(op, activation)
    workspace_bytes = _checks.check_workspace(op, workspace_bytes)
    _b.check_tensors(op, optional=("bias", "mask"), x=x, weight=weight, bias=bias, mask=mask)
    # argmax is computed and kept only when autograd will need it (read from metadata only)
    requires_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))
    fn = _SpladePoolFunction.apply if _direct(x, weight, bias, mask) else _SPLADE_POOL
    return fn(x, weight, bias, mask, activation, workspace_bytes, requires_grad)[0]


def flops_regularizer(out: Tensor) -> Tensor:
    """SPLADE's FLOPS regulariser ``Σ_v (mean_b out[b, v])²`` of ``out`` (B, V).

    Returns a 0-d tensor, float32 (float64 for float64 ``out``), differentiable:
    ``d/d out[b, v] = 2 · mean_b(out[:, v]) / B``.  Plain torch ops (a mean over b
    accumulated in float32/float64, a square, a sum — torch's reductions use no atomics, so it
    is deterministic), so autograd, autocast and ``torch.compile`` treat it as any torch code;
    equal to ``cupynce.flops_regularizer`` on the same values (to rounding).  Cost O(B·V).
    """
    if not isinstance(out, Tensor):
        kind = f"{type(out).__module__}.{type(out).__name__}"
        raise TypeError(f"flops_regularizer: out must be a torch.Tensor, got {kind}")
    if out.dim() != 2:
        raise ValueError(f"flops_regularizer: out must be 2-D (B, V), got shape "
                         f"{tuple(out.shape)}")
    if not out.is_floating_point():
        raise TypeError(f"flops_regularizer: out has dtype {out.dtype}; expected a floating dtype")
    if out.shape[0] == 0:
        raise ValueError(f"flops_regularizer: out needs B >= 1, got shape {tuple(out.shape)}")
    return out.mean(dim=0, dtype=_acc(out.dtype)).square().sum()


# ------------------------------------------------------------------------------------------
# modules
# ------------------------------------------------------------------------------------------
def _check_bool(op: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")
    return value


class InfoNCEFunction(torch.autograd.Function):
    """CuBlaze's autograd Function: ``InfoNCEFunction.apply(features, temperature, use_cublas)``.

    features (2B, D) → the mean NT-Xent loss (0-d float32 / float64), as :func:`nt_xent`
    without normalisation (CuBlaze expects L2-normalised features).  ``use_cublas``: see
    :class:`InfoNCELoss`.  Forward and backward call the same ops as :func:`nt_xent`.
    """

    @staticmethod
    def forward(ctx, features: Tensor, temperature: float = 0.5,
                use_cublas: bool = False) -> Tensor:
        t = _checks.check_temperature("InfoNCEFunction", temperature)
        _check_bool("InfoNCEFunction", "use_cublas", use_cublas)
        _b.check_tensors("InfoNCEFunction", features=features)
        # gradient in the forward when one will be needed (as nt_xent; inside forward grad
        # mode is off, so requires_grad alone decides)
        ctx.fused = features.requires_grad
        fwd = _nt_xent_fwd if _direct(features) else _NT_XENT  # (no autograd inside forward)
        loss, lse, acc, _norm = fwd(features, t, "mean", False, None, ctx.fused)
        ctx.save_for_backward(acc if ctx.fused else features, lse)
        ctx.temperature, ctx.dtype = t, features.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        saved, lse = ctx.saved_tensors
        if ctx.fused:
            return _scaled(None, None, saved, grad_loss, ctx.dtype, False), None, None
        dz = _BWD["nt_xent"](saved, lse, grad_loss.contiguous(), ctx.temperature, "mean",
                             False, None)
        return dz, None, None


class InfoNCELoss(nn.Module):
    """SimCLR's NT-Xent loss as CuBlaze's module: ``InfoNCELoss(temperature=0.5, use_cublas=False)``.

    ``forward(features)``: features (2B, D), rows i and (i + B) mod 2B the two views of one
    sample; returns the loss of :func:`nt_xent` (0-d for "mean"/"sum").  CuBlaze expects
    L2-normalised features; pass ``normalize=True`` to have the loss normalise them (the
    gradient goes through the normalisation).  Also exported as :class:`NTXentLoss`.

    ``use_cublas`` is accepted for compatibility with CuBlaze, where it switched between
    hand-written similarity kernels and cuBLAS.  cupynce has one path: every N×N×D product is
    a cuBLAS GEMM (``cublasGemmEx``, fp32 accumulation, no TF32; NumPy's matmul on the CPU)
    or, for float16/bfloat16 where the core selects them, its tensor-core tile kernels, with
    the fused row kernels in between.  Both values run exactly the same code and give
    bit-identical results; the flag is validated (a bool), stored and shown in ``repr``.

    Parameters
    ----------
    temperature : float > 0, default 0.5
    use_cublas : bool, default False — no effect (see above)
    reduction : "mean" (default) | "sum" | "none" (keyword-only)
    normalize : bool, default False (keyword-only)
    """

    def __init__(self, temperature: float = 0.5, use_cublas: bool = False, *,
                 reduction: str = "mean", normalize: bool = False) -> None:
        super().__init__()
        name = type(self).__name__
        self.temperature = _checks.check_temperature(name, temperature)
        self.use_cublas = _check_bool(name, "use_cublas", use_cublas)
        self.reduction = _checks.check_reduction(name, reduction)
        self.normalize = _check_bool(name, "normalize", normalize)

    def forward(self, features: Tensor) -> Tensor:
        return nt_xent(features, self.temperature, reduction=self.reduction,
                       normalize=self.normalize)

    def extra_repr(self) -> str:
        return (f"temperature={self.temperature}, use_cublas={self.use_cublas}, "
                f"reduction={self.reduction!r}, normalize={self.normalize}")


#: SimCLR's name for :class:`InfoNCELoss`.
NTXentLoss = InfoNCELoss


class InfoNCE(nn.Module):
    """Query/key InfoNCE, info-nce-pytorch's interface: ``InfoNCE(temperature=0.1,
    reduction="mean", negative_mode="unpaired")``, ``forward(query, key, negatives=None)``.

    query, key (N, D) paired by row (in-batch negatives: the other keys).  ``negatives``:
    with ``negative_mode="unpaired"`` an (M, D) set shared by every query, with ``"paired"``
    (N, M, D), query i's own M negatives.  Rows are L2-normalised (``normalize=True``, as
    info-nce-pytorch and the tutorial do); unlike info-nce-pytorch the in-batch keys stay
    candidates when explicit negatives are given.  See :func:`info_nce`.
    """

    _MODES = {"unpaired": (2, "(M, D)"), "paired": (3, "(N, M, D)")}

    def __init__(self, temperature: float = 0.1, reduction: str = "mean",
                 negative_mode: str = "unpaired", *, normalize: bool = True) -> None:
        super().__init__()
        self.temperature = _checks.check_temperature("InfoNCE", temperature)
        self.reduction = _checks.check_reduction("InfoNCE", reduction)
        if negative_mode not in self._MODES:
            raise ValueError(f"InfoNCE: negative_mode must be one of {tuple(self._MODES)}, "
                             f"got {negative_mode!r}")
        self.negative_mode = negative_mode
        self.normalize = _check_bool("InfoNCE", "normalize", normalize)

    def forward(self, query: Tensor, key: Tensor, negatives: Optional[Tensor] = None) -> Tensor:
        if isinstance(negatives, Tensor):
            ndim, shape = self._MODES[self.negative_mode]
            if negatives.dim() != ndim:
                raise ValueError(f"InfoNCE: negative_mode={self.negative_mode!r} expects "
                                 f"negatives of shape {shape}, got {tuple(negatives.shape)}")
        return info_nce(query, key, self.temperature, negatives=negatives,
                        reduction=self.reduction, normalize=self.normalize)

    def extra_repr(self) -> str:
        return (f"temperature={self.temperature}, reduction={self.reduction!r}, "
                f"negative_mode={self.negative_mode!r}, normalize={self.normalize}")


class ClipLoss(nn.Module):
    """CLIP's symmetric loss with a learnable temperature (the tutorial's LearnableTemperature).

    ``ClipLoss(init_temperature=0.07, learnable=True, max_logit_scale=100.0)``,
    ``forward(a, b)`` with a, b (N, D).  Also exported as :class:`SymmetricInfoNCE`.

    ``logit_scale`` is an ``nn.Parameter`` (0-d float32) initialised to log(1/τ₀); with
    ``learnable=False`` it is still a Parameter (same ``state_dict``) with
    ``requires_grad=False``.  The logits are ``exp(logit_scale) · â b̂ᵀ``.

    Clamping, as CLIP: the forward uses ``logit_scale.clamp(0, log(max_logit_scale))`` — the
    scale stays in [1, max_logit_scale] (temperature in [1/max_logit_scale, 1]) whatever the
    optimiser did, and the gradient is zero while the value is clamped (``torch.clamp``'s).
    To also keep the stored parameter in range, call :meth:`clamp_` after
    ``optimizer.step()`` (open_clip's ``logit_scale.clamp_(0, math.log(100))`` under no_grad).

    Parameters
    ----------
    init_temperature : float in [1/max_logit_scale, 1], default 0.07
    learnable : bool, default True
    max_logit_scale : float > 1, default 100.0 (CLIP's)
    reduction : "mean" (default) | "sum" | "none" (keyword-only)
    normalize : bool, default True (keyword-only) — L2-normalise a and b first, as the
        tutorial's SymmetricInfoNCE; pass False for embeddings the model already normalised.
    """

    def __init__(self, init_temperature: float = 0.07, learnable: bool = True,
                 max_logit_scale: float = 100.0, *, reduction: str = "mean",
                 normalize: bool = True) -> None:
        super().__init__()
        name = type(self).__name__
        tau = _checks.check_positive_finite(name, "init_temperature", init_temperature)
        max_scale = _checks.check_positive_finite(name, "max_logit_scale", max_logit_scale)
        if max_scale <= 1.0:
            raise ValueError(f"{name}: max_logit_scale must be > 1, got {max_logit_scale!r}")
        if not 1.0 / max_scale <= tau <= 1.0:
            raise ValueError(f"{name}: init_temperature must be in [1/max_logit_scale, 1] = "
                             f"[{1.0 / max_scale:.6g}, 1] (the clamped range), "
                             f"got {init_temperature!r}")
        self.max_logit_scale = max_scale
        self.reduction = _checks.check_reduction(name, reduction)
        self.normalize = _check_bool(name, "normalize", normalize)
        learnable = _check_bool(name, "learnable", learnable)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / tau), dtype=torch.float32),
                                        requires_grad=learnable)

    @property
    def learnable(self) -> bool:
        return self.logit_scale.requires_grad

    def clamped_logit_scale(self) -> Tensor:
        """``logit_scale.clamp(0, log(max_logit_scale))``: what the forward uses (differentiable)."""
        return self.logit_scale.clamp(0.0, math.log(self.max_logit_scale))

    @property
    def temperature(self) -> Tensor:
        """The current temperature ``exp(-clamped logit_scale)``: a detached 0-d tensor on the
        parameter's device (no host synchronisation; ``float(loss_fn.temperature)`` to log)."""
        return torch.exp(-self.clamped_logit_scale().detach())

    @torch.no_grad()
    def clamp_(self) -> "ClipLoss":
        """Clamp the stored ``logit_scale`` in place to [0, log(max_logit_scale)] (after a step)."""
        self.logit_scale.clamp_(0.0, math.log(self.max_logit_scale))
        return self

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return clip_loss(a, b, self.clamped_logit_scale(), reduction=self.reduction,
                         normalize=self.normalize)

    def extra_repr(self) -> str:
        return (f"learnable={self.learnable}, max_logit_scale={self.max_logit_scale}, "
                f"reduction={self.reduction!r}, normalize={self.normalize}")


#: The tutorial's name for :class:`ClipLoss`.
SymmetricInfoNCE = ClipLoss


class SpladePooling(nn.Module):
    """SPLADE's vocabulary head: ``out = act(max_l (hidden_states @ weight.T + bias))``, (B, V).

    ``SpladePooling(hidden_size, vocab_size, *, activation="log1p_relu", bias=True,
    weight=None, dtype=None, device=None)`` owns an ``nn.Parameter`` ``weight`` (V, D) and,
    with ``bias=True``, ``bias`` (V,), initialised as ``nn.Linear(D, V)`` initialises its own
    (same random draws: under one seed the two are equal).  Or it is *tied* — it shares, never
    copies, an existing Parameter, and the gradients flow into it:

    * ``SpladePooling.from_decoder(decoder)`` shares an MLM decoder's (``nn.Linear(D, V)``)
      ``weight`` and ``bias`` (None if it has none);
    * ``SpladePooling(D, V, weight=param)`` shares ``param`` (V, D) (e.g. the input
      embeddings, as BERT ties them) and owns a new bias (``bias=True``).

    Only the Parameter objects are shared: if the owner later *replaces* its Parameter (rather
    than updating it in place) the tie is broken; tie again.

    ``forward(hidden_states, attention_mask=None)``: hidden_states (B, L, D) — for a BERT MLM
    head, after the head's transform (dense, activation, LayerNorm), i.e. the decoder's input
    — and attention_mask (B, L) (bool or 0/1; nonzero counts), giving (B, V) in
    hidden_states' dtype (the autocast dtype under ``torch.autocast``)::

        out[b, v] = act(max_{l : mask[b, l] ≠ 0} hidden_states[b, l] · weight[v] + bias[v])

    act = ``log(1 + max(m, 0))`` ("log1p_relu", default) or ``max(m, 0)`` ("relu"); all-masked
    rows give 0.  See :func:`splade_pool` (memory, backward, determinism) and
    :func:`flops_regularizer` for SPLADE's sparsity term.

    Parameters
    ----------
    hidden_size : int ≥ 1 — D
    vocab_size : int ≥ 1 — V
    activation : "log1p_relu" (default) | "relu" (keyword-only, as the rest)
    bias : bool, default True — own a bias (V,)
    weight : nn.Parameter (V, D), optional — share it instead of owning a weight
    dtype, device : the owned parameters' dtype and device (as ``nn.Linear``'s); with ``weight``
        given, they default to the weight's and must agree with it.
    """

    def __init__(self, hidden_size: int, vocab_size: int, *, activation: str = "log1p_relu",
                 bias: bool = True, weight: Optional[nn.Parameter] = None,
                 dtype: Optional[torch.dtype] = None,
                 device: Optional[Any] = None) -> None:
        super().__init__()
        name = type(self).__name__
        for arg, value in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
        self.hidden_size, self.vocab_size = int(hidden_size), int(vocab_size)
        self.activation = _check_activation(name, activation)
        _check_bool(name, "bias", bias)
        shape = (self.vocab_size, self.hidden_size)
        if weight is None:
            self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
            self._owns_weight = True
        else:
            if not isinstance(weight, nn.Parameter):
                raise TypeError(f"{name}: weight must be an nn.Parameter (V, D) to share (a "
                                f"plain tensor would be copied into a new Parameter and the "
                                f"tie lost), got {type(weight).__module__}."
                                f"{type(weight).__name__}")
            if tuple(weight.shape) != shape:
                raise ValueError(f"{name}: weight must have shape (vocab_size, hidden_size) = "
                                 f"{shape}, got {tuple(weight.shape)}")
            if dtype is not None and dtype != weight.dtype:
                raise ValueError(f"{name}: dtype={dtype} differs from the shared weight's "
                                 f"{weight.dtype}")
            dev = None if device is None else torch.device(device)
            if dev is not None and (dev.type != weight.device.type
                                    or dev.index not in (None, weight.device.index)):
                raise ValueError(f"{name}: device={device} differs from the shared weight's "
                                 f"{weight.device}")
            self.weight = weight
            self._owns_weight = False
        if bias:
            self.bias = nn.Parameter(torch.empty((self.vocab_size,), dtype=self.weight.dtype,
                                                 device=self.weight.device))
        else:
            self.register_parameter("bias", None)
        self._owns_bias = bias
        self.reset_parameters()

    @classmethod
    def from_decoder(cls, decoder: nn.Linear, *,
                     activation: str = "log1p_relu") -> "SpladePooling":
        """A head tied to ``decoder`` (``nn.Linear(D, V)``, e.g. a Hugging Face MLM head's
        ``cls.predictions.decoder``): its ``weight`` and ``bias`` Parameters are shared (no
        copy; ``decoder.weight.grad`` and ``decoder.bias.grad`` receive the gradients)."""
        if not isinstance(decoder, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_decoder: decoder must be an nn.Linear "
                            f"(V = out_features, D = in_features), got "
                            f"{type(decoder).__module__}.{type(decoder).__name__}")
        head = cls(decoder.in_features, decoder.out_features, activation=activation, bias=False,
                   weight=decoder.weight)
        if decoder.bias is not None:
            head.bias = decoder.bias  # the same Parameter object
        return head

    @property
    def tied(self) -> bool:
        """True when the weight is shared with another module (not owned)."""
        return not self._owns_weight

    def reset_parameters(self) -> None:
        """Initialise the *owned* parameters as ``nn.Linear.reset_parameters`` does (a shared
        weight or bias is left alone): weight ~ kaiming_uniform(a=√5) = U(±1/√D), bias
        ~ U(±1/√D)."""
        if self._owns_weight:
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self._owns_bias and self.bias is not None:
            bound = 1.0 / math.sqrt(self.hidden_size)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        """hidden_states (B, L, D), attention_mask (B, L) or None → (B, V)."""
        return splade_pool(hidden_states, self.weight, self.bias, attention_mask,
                           activation=self.activation)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, "
                f"activation={self.activation!r}, bias={self.bias is not None}, "
                f"tied={self.tied}")
