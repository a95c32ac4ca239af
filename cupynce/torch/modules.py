"""The ``nn.Module`` s (and CuBlaze's autograd Function) over the ops of ``cupynce.torch``.

* :class:`InfoNCELoss` (and :class:`NTXentLoss`, the same) and :class:`InfoNCEFunction`:
  CuBlaze's NT-Xent interface;
* :class:`InfoNCE`: info-nce-pytorch's query/key interface;
* :class:`ClipLoss` (and :class:`SymmetricInfoNCE`, the same): CLIP's loss owning its
  learnable temperature;
* :class:`SpladePooling`: SPLADE's head, owning its weight or tied to an MLM decoder.
"""
import math
import numbers
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor, nn

from .. import _checks
from . import _bridge as B
from . import _registry as R
from .ops import nt_xent as nt_xent_ops
from .ops import splade as splade_ops
from .ops.clip import clip_loss
from .ops.info_nce import info_nce
from .ops.nt_xent import nt_xent
from .ops.siglip import siglip_loss
from .ops.splade import splade_pool
from .ops.supcon import supcon_loss

__all__ = ["InfoNCEFunction", "InfoNCELoss", "NTXentLoss", "InfoNCE", "ClipLoss",
           "SymmetricInfoNCE", "SpladePooling"]


def _precision_repr(precision: Optional[str]) -> str:
    return "" if precision is None else f", precision={precision!r}"


def _own_temperature(module: nn.Module, name: str, learnable: Any) -> bool:
    """``learnable=True``: the module owns its temperature as ``log_temperature``, a 0-d
    float32 Parameter initialised to log ``module.temperature`` (the loss takes its exp, so
    τ stays positive).  Returns the checked flag."""
    learnable = R.check_bool(name, "learnable", learnable)
    if learnable:
        module.log_temperature = nn.Parameter(
            torch.tensor(math.log(module.temperature), dtype=torch.float32))
    return learnable


def _current_temperature(module: nn.Module) -> Any:
    """The temperature the loss takes: ``exp(log_temperature)`` (a 0-d tensor) when
    learnable, else the float."""
    return module.log_temperature.exp() if module.learnable else module.temperature


class InfoNCEFunction(torch.autograd.Function):
    """CuBlaze's autograd Function: ``InfoNCEFunction.apply(features, temperature, use_cublas)``.

    features (2B, D) → the mean NT-Xent loss (0-d float32 / float64), as :func:`nt_xent`
    without normalisation (CuBlaze expects L2-normalised features).  ``use_cublas``: see
    :class:`InfoNCELoss`.  An optional fourth argument, ``precision``, is :func:`nt_xent`'s.
    Forward and backward call the same ops as :func:`nt_xent`.
    """

    @staticmethod
    def forward(ctx, features: Tensor, temperature: float = 0.5,
                use_cublas: bool = False, precision: Optional[str] = None) -> Tensor:
        t = _checks.check_temperature("InfoNCEFunction", temperature)
        R.check_bool("InfoNCEFunction", "use_cublas", use_cublas)
        B.check_tensors("InfoNCEFunction", features=features)
        p = R.precision_of("InfoNCEFunction", precision)
        # gradient in the forward when one will be needed (as nt_xent; inside forward grad
        # mode is off, so requires_grad alone decides)
        ctx.fused = features.requires_grad
        fwd = nt_xent_ops.fwd if R.direct(features) else nt_xent_ops.FWD  # (no autograd inside forward)
        loss, lse, acc, _norm, _dt = fwd(features, None, t, 0.0, "mean", False, None, p,
                                         ctx.fused)
        ctx.save_for_backward(acc if ctx.fused else features, lse)
        ctx.temperature, ctx.dtype, ctx.precision = t, features.dtype, p
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        saved, lse = ctx.saved_tensors
        if ctx.fused:
            return R.scaled(None, None, saved, grad_loss, ctx.dtype, False), None, None, None
        dz, _ = nt_xent_ops.BWD(saved, None, ctx.temperature, lse, grad_loss.contiguous(), 0.0,
                                "mean", False, None, ctx.precision)
        return dz, None, None, None


class InfoNCELoss(nn.Module):
    """SimCLR's NT-Xent loss as CuBlaze's module: ``InfoNCELoss(temperature=0.5, use_cublas=False)``.

    ``forward(features)``: features (2B, D), rows i and (i + B) mod 2B the two views of one
    sample; returns the loss of :func:`nt_xent` (0-d for "mean"/"sum").  CuBlaze expects
    L2-normalised features; pass ``normalize=True`` to have the loss normalise them (the
    gradient goes through the normalisation).  Also exported as :class:`NTXentLoss`.

    ``use_cublas`` is accepted for compatibility with CuBlaze, where it switched between
    hand-written similarity kernels and cuBLAS.  cupynce has one path: every N×N×D product is
    a cuBLAS GEMM (``cublasGemmEx``, fp32 accumulation, no TF32 unless ``precision`` says so;
    NumPy's matmul on the CPU) or, for float16/bfloat16 where the core selects them, its
    tensor-core tile kernels, with the fused row kernels in between.  Both values run exactly the same code and give
    bit-identical results; the flag is validated (a bool), stored and shown in ``repr``.

    Parameters
    ----------
    temperature : float > 0, default 0.5 (with ``learnable``: the initial value)
    use_cublas : bool, default False — no effect (see above)
    learnable : bool, default False (keyword-only) — the module owns the temperature as a
        Parameter, ``log_temperature`` (0-d float32, initialised to log ``temperature``; the
        loss takes ``exp(log_temperature)``, so τ stays positive), trained with the model
    reduction : "mean" (default) | "sum" | "none" (keyword-only)
    normalize : bool, default False (keyword-only)
    label_smoothing : float in [0, 1), default 0 (keyword-only) — as :func:`nt_xent`'s
    group : torch.distributed process group, optional (keyword-only) — the loss of the group's
        global batch (see :func:`nt_xent`)
    precision : "auto" | "fp32" | "tf32" | "3xtf32", optional (keyword-only) — float32 products on
        CUDA; None (default) follows torch's TF32 setting at each call, then
        ``cupynce.get_float32_precision()`` (see :func:`nt_xent`)
    """

    def __init__(self, temperature: float = 0.5, use_cublas: bool = False, *,
                 learnable: bool = False, reduction: str = "mean", normalize: bool = False,
                 label_smoothing: float = 0.0, group: Any = None,
                 precision: Optional[str] = None) -> None:
        super().__init__()
        name = type(self).__name__
        self.temperature = _checks.check_temperature(name, temperature)
        self.learnable = _own_temperature(self, name, learnable)
        self.use_cublas = R.check_bool(name, "use_cublas", use_cublas)
        self.reduction = _checks.check_reduction(name, reduction)
        self.normalize = R.check_bool(name, "normalize", normalize)
        self.label_smoothing = _checks.check_smoothing(name, label_smoothing)
        self.group = group  # a torch.distributed group: the global batch's loss (nt_xent)
        self.precision = R.module_precision(name, precision)

    def forward(self, features: Tensor, *others: Tensor) -> Tensor:
        """features (2B, D) → the loss (0-d, or (2B,) for "none").  One tensor only: a second
        one (query/key pairs) raises ``TypeError`` pointing at :class:`InfoNCE`."""
        if others:  # (the seeds' InfoNCELoss()(q, k): say what this class takes, and where to go)
            name = type(self).__name__
            raise TypeError(
                f"{name}.forward takes one tensor, features (2B, D): the two views stacked "
                f"(torch.cat([view1, view2])), rows i and (i + B) mod 2B a positive pair; got "
                f"{1 + len(others)} tensors. For query/key pairs use cupynce.torch.InfoNCE "
                f"(or cupynce.torch.info_nce(query, key)), or stack the two views")
        return nt_xent(features, self.current_temperature(),
                       label_smoothing=self.label_smoothing, reduction=self.reduction,
                       normalize=self.normalize, group=self.group, precision=self.precision)

    current_temperature = _current_temperature

    def extra_repr(self) -> str:
        return (f"temperature={self.temperature}, use_cublas={self.use_cublas}, "
                + ("learnable=True, " if self.learnable else "")
                + f"reduction={self.reduction!r}, normalize={self.normalize}"
                + (f", label_smoothing={self.label_smoothing}" if self.label_smoothing else "")
                + _precision_repr(self.precision))


class NTXentLoss(InfoNCELoss):
    """SimCLR's name for :class:`InfoNCELoss` (the same module: arguments, state, results).
    A subclass rather than an alias, so that its messages and ``repr`` name the class used."""


class InfoNCE(nn.Module):
    """Query/key InfoNCE, info-nce-pytorch's interface: ``InfoNCE(temperature=0.1,
    reduction="mean", negative_mode="unpaired")``, ``forward(query, key, negatives=None)``.

    query, key (N, D) paired by row (in-batch negatives: the other keys).  ``negatives``:
    with ``negative_mode="unpaired"`` an (M, D) set shared by every query, with ``"paired"``
    (N, M, D), query i's own M negatives.  Rows are L2-normalised (``normalize=True``, as
    info-nce-pytorch and the tutorial do); unlike info-nce-pytorch the in-batch keys stay
    candidates when explicit negatives are given.  See :func:`info_nce` (``precision``,
    ``label_smoothing``, keyword only, too); ``forward(..., labels=)`` takes the rows' labels
    (a key of query i's label other than key i is no negative of it).  ``learnable=True``
    (keyword only): the module owns the temperature as ``log_temperature``, as
    :class:`NTXentLoss` does.
    """

    _MODES = {"unpaired": (2, "(M, D)"), "paired": (3, "(N, M, D)")}

    def __init__(self, temperature: float = 0.1, reduction: str = "mean",
                 negative_mode: str = "unpaired", *, learnable: bool = False,
                 normalize: bool = True, label_smoothing: float = 0.0, group: Any = None,
                 precision: Optional[str] = None) -> None:
        super().__init__()
        name = type(self).__name__
        self.temperature = _checks.check_temperature(name, temperature)
        self.learnable = _own_temperature(self, name, learnable)
        self.reduction = _checks.check_reduction(name, reduction)
        if negative_mode not in self._MODES:
            raise ValueError(f"{name}: negative_mode must be one of {tuple(self._MODES)}, "
                             f"got {negative_mode!r}")
        self.negative_mode = negative_mode
        self.normalize = R.check_bool(name, "normalize", normalize)
        self.label_smoothing = _checks.check_smoothing(name, label_smoothing)
        self.group = group  # a torch.distributed group: the global batch's loss (info_nce)
        self.precision = R.module_precision(name, precision)

    def forward(self, query: Tensor, key: Optional[Tensor] = None,
                negatives: Optional[Tensor] = None, *,
                labels: Optional[Tensor] = None) -> Tensor:
        """query, key (N, D), negatives (M, D) / (N, M, D) or None, labels (N,) or None → the
        loss.  ``key`` is required: without it (one stacked (2B, D) tensor of two views)
        ``TypeError`` points at :class:`NTXentLoss`."""
        name = type(self).__name__
        if key is None:
            raise TypeError(f"{name}.forward takes query and key (N, D), paired by row; got "
                            f"query alone. For one tensor of two stacked views (2B, D) use "
                            f"cupynce.torch.NTXentLoss (or cupynce.torch.nt_xent(z))")
        if isinstance(negatives, Tensor):
            ndim, shape = self._MODES[self.negative_mode]
            if negatives.dim() != ndim:
                raise ValueError(f"{name}: negative_mode={self.negative_mode!r} expects "
                                 f"negatives of shape {shape}, got {tuple(negatives.shape)}")
        return info_nce(query, key, _current_temperature(self), negatives=negatives, labels=labels,
                        label_smoothing=self.label_smoothing, reduction=self.reduction,
                        normalize=self.normalize, group=self.group, precision=self.precision)

    def extra_repr(self) -> str:
        return (f"temperature={self.temperature}, "
                + ("learnable=True, " if self.learnable else "")
                + f"reduction={self.reduction!r}, "
                f"negative_mode={self.negative_mode!r}, normalize={self.normalize}"
                + (f", label_smoothing={self.label_smoothing}" if self.label_smoothing else "")
                + _precision_repr(self.precision))


class SupConLoss(nn.Module):
    """Supervised contrastive loss (Khosla et al. 2020, ``L_out``) as a module.

    ``forward(features, labels=None)``:

    * features (N, D) and labels (N,): every view stacked, as pytorch-metric-learning's
      ``SupConLoss()(embeddings, labels)``;
    * features (B, V, D) and labels (B,) or None: the SupCon reference code's layout (V views
      of B samples; its ``contrast_mode="all"``): the views are stacked view-major
      (``torch.cat(features.unbind(1))``) and the labels repeated; labels None: each sample
      its own class (SimCLR's loss over V views).

    Returns :func:`supcon_loss`'s loss times ``temperature / base_temperature``.

    Parameters
    ----------
    temperature : float > 0, default 0.1 (with ``learnable``: the initial value)
    learnable : bool, default False (keyword-only) — own the temperature as a Parameter,
        ``log_temperature`` (as :class:`NTXentLoss`'s); ``base_temperature`` then scales by
        the current temperature
    base_temperature : float > 0, optional (keyword-only)
        The reference code's loss scale (its default 0.07); None (default): the temperature
        (a factor of 1, as pytorch-metric-learning's).
    reduction : "mean" (default) | "sum" | "none" (keyword-only) — anchors without a
        positive are left out of the mean (see :func:`supcon_loss`)
    normalize : bool, default False (keyword-only) — L2-normalise the rows first
    group : torch.distributed process group, optional (keyword-only) — the loss of the
        group's global batch (see :func:`supcon_loss`)
    precision : as for :class:`NTXentLoss` (keyword-only)
    """

    def __init__(self, temperature: float = 0.1, *, learnable: bool = False,
                 base_temperature: Optional[float] = None, reduction: str = "mean",
                 normalize: bool = False, group: Any = None,
                 precision: Optional[str] = None) -> None:
        super().__init__()
        name = type(self).__name__
        self.temperature = _checks.check_temperature(name, temperature)
        self.learnable = _own_temperature(self, name, learnable)
        self.base_temperature = (self.temperature if base_temperature is None else
                                 _checks.check_positive_finite(name, "base_temperature",
                                                               base_temperature))
        self._scaled = base_temperature is not None and (learnable or
                                                         self.base_temperature != self.temperature)
        self.reduction = _checks.check_reduction(name, reduction)
        self.normalize = R.check_bool(name, "normalize", normalize)
        self.group = group  # a torch.distributed group: the global batch's loss
        self.precision = R.module_precision(name, precision)

    def forward(self, features: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        """features (N, D) with labels (N,), or (B, V, D) with labels (B,) / None → the loss
        (0-d, or per stacked row for "none")."""
        name = type(self).__name__
        if not isinstance(features, Tensor) or features.ndim not in (2, 3):
            raise ValueError(f"{name}: features must be a tensor (N, D) with labels (N,), or "
                             f"(B, V, D) with labels (B,) or None; got "
                             f"{getattr(features, 'shape', type(features).__name__)}")
        if features.ndim == 3:
            b, v = features.shape[:2]
            if labels is None:
                labels = torch.arange(b, device=features.device)
            elif not isinstance(labels, Tensor) or labels.shape != (b,):
                raise ValueError(f"{name}: with features (B, V, D) = {tuple(features.shape)}, "
                                 f"labels must be a ({b},) tensor or None, got "
                                 f"{getattr(labels, 'shape', type(labels).__name__)}")
            features = torch.cat(features.unbind(1))
            labels = labels.repeat(v)
        tau = _current_temperature(self)
        loss = supcon_loss(features, labels, tau, reduction=self.reduction,
                           normalize=self.normalize, group=self.group,
                           precision=self.precision)
        if self._scaled:  # (the reference code's τ / base_temperature, τ the current one)
            loss = loss * (tau / self.base_temperature)
        return loss

    def extra_repr(self) -> str:
        return (f"temperature={self.temperature}"
                + (", learnable=True" if self.learnable else "")
                + (f", base_temperature={self.base_temperature}" if self._scaled else "")
                + f", reduction={self.reduction!r}, normalize={self.normalize}"
                + _precision_repr(self.precision))


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
    label_smoothing : float in [0, 1), default 0 (keyword-only) — each direction's, as
        :func:`clip_loss`'s
    group, precision : keyword-only, as for :func:`clip_loss`.
    """

    def __init__(self, init_temperature: float = 0.07, learnable: bool = True,
                 max_logit_scale: float = 100.0, *, reduction: str = "mean",
                 normalize: bool = True, label_smoothing: float = 0.0, group: Any = None,
                 precision: Optional[str] = None) -> None:
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
        self.label_smoothing = _checks.check_smoothing(name, label_smoothing)
        self.reduction = _checks.check_reduction(name, reduction)
        self.normalize = R.check_bool(name, "normalize", normalize)
        self.group = group  # a torch.distributed group: the global batch's loss (clip_loss)
        self.precision = R.module_precision(name, precision)
        learnable = R.check_bool(name, "learnable", learnable)
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

    def forward(self, a: Tensor, b: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        """a, b (N, D); ``labels`` (N,) optional: same-label pairs are no negatives
        (:func:`cupynce.torch.clip_loss`'s ``labels``)."""
        return clip_loss(a, b, self.clamped_logit_scale(), label_smoothing=self.label_smoothing,
                         labels=labels, reduction=self.reduction, normalize=self.normalize,
                         group=self.group, precision=self.precision)

    def extra_repr(self) -> str:
        return (f"learnable={self.learnable}, max_logit_scale={self.max_logit_scale}, "
                f"reduction={self.reduction!r}, normalize={self.normalize}"
                + (f", label_smoothing={self.label_smoothing}" if self.label_smoothing else "")
                + _precision_repr(self.precision))


class SymmetricInfoNCE(ClipLoss):
    """The tutorial's name for :class:`ClipLoss` (the same module: arguments, state,
    results).  A subclass rather than an alias, so that its messages and ``repr`` name the
    class used."""


class SigLipLoss(nn.Module):
    """SigLIP's sigmoid loss owning its learnable log-scale and bias.

    ``SigLipLoss(init_logit_scale=log(10), init_logit_bias=-10.0, learnable=True)``,
    ``forward(a, b)`` with a, b (N, D): :func:`siglip_loss` with the module's parameters.
    The defaults are the paper's initialisation (t' = log 10, b = −10).

    ``logit_scale`` and ``logit_bias`` are ``nn.Parameter`` s (0-d float32); with
    ``learnable=False`` they are still Parameters (same ``state_dict``) with
    ``requires_grad=False``.  No clamping (SigLIP trains both freely).

    Parameters
    ----------
    init_logit_scale : finite real, default log(10)
    init_logit_bias : finite real, default -10.0
    learnable : bool, default True
    reduction : "mean" (default) | "sum" | "none" (keyword-only)
    normalize : bool, default False (keyword-only) — L2-normalise a and b first (SigLIP's
        towers already output normalised embeddings).
    group, precision : keyword-only, as for :func:`siglip_loss`.
    """

    def __init__(self, init_logit_scale: float = math.log(10.0),
                 init_logit_bias: float = -10.0, learnable: bool = True, *,
                 reduction: str = "mean", normalize: bool = False, group: Any = None,
                 precision: Optional[str] = None) -> None:
        super().__init__()
        name = type(self).__name__
        ls, lb = (float(_checks.check_scalar_input(
            name, arg, _checks.host_scalar(name, arg, v), np)[0])
            for arg, v in (("init_logit_scale", init_logit_scale),
                           ("init_logit_bias", init_logit_bias)))
        self.reduction = _checks.check_reduction(name, reduction)
        self.normalize = R.check_bool(name, "normalize", normalize)
        self.group = group
        self.precision = R.module_precision(name, precision)
        learnable = R.check_bool(name, "learnable", learnable)
        self.logit_scale = nn.Parameter(torch.tensor(ls, dtype=torch.float32),
                                        requires_grad=learnable)
        self.logit_bias = nn.Parameter(torch.tensor(lb, dtype=torch.float32),
                                       requires_grad=learnable)

    @property
    def learnable(self) -> bool:
        return self.logit_scale.requires_grad

    @property
    def temperature(self) -> Tensor:
        """``exp(-logit_scale)``: a detached 0-d tensor (no host synchronisation)."""
        return torch.exp(-self.logit_scale.detach())

    @property
    def bias(self) -> Tensor:
        """The current logit bias, detached."""
        return self.logit_bias.detach()

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return siglip_loss(a, b, self.logit_scale, self.logit_bias, reduction=self.reduction,
                           normalize=self.normalize, group=self.group, precision=self.precision)

    def extra_repr(self) -> str:
        return (f"learnable={self.learnable}, reduction={self.reduction!r}, "
                f"normalize={self.normalize}" + _precision_repr(self.precision))


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
    — and attention_mask (B, L) (bool or 0/1: see :func:`splade_pool`), giving (B, V) in
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
    precision : "auto" | "fp32" | "tf32" | "3xtf32", optional — float32 logit products on
        CUDA, as for :func:`splade_pool` (None: torch's TF32 setting, then the global default)
    """

    def __init__(self, hidden_size: int, vocab_size: int, *, activation: str = "log1p_relu",
                 bias: bool = True, weight: Optional[nn.Parameter] = None,
                 dtype: Optional[torch.dtype] = None,
                 device: Optional[Any] = None, precision: Optional[str] = None) -> None:
        super().__init__()
        name = type(self).__name__
        for arg, value in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
        self.hidden_size, self.vocab_size = int(hidden_size), int(vocab_size)
        self.activation = splade_ops.check_activation(name, activation)
        self.precision = R.module_precision(name, precision)
        R.check_bool(name, "bias", bias)
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
    def from_decoder(cls, decoder: nn.Linear, *, activation: str = "log1p_relu",
                     precision: Optional[str] = None) -> "SpladePooling":
        """A head tied to ``decoder`` (``nn.Linear(D, V)``, e.g. a Hugging Face MLM head's
        ``cls.predictions.decoder``): its ``weight`` and ``bias`` Parameters are shared (no
        copy; ``decoder.weight.grad`` and ``decoder.bias.grad`` receive the gradients)."""
        if not isinstance(decoder, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_decoder: decoder must be an nn.Linear "
                            f"(V = out_features, D = in_features), got "
                            f"{type(decoder).__module__}.{type(decoder).__name__}")
        head = cls(decoder.in_features, decoder.out_features, activation=activation, bias=False,
                   weight=decoder.weight, precision=precision)
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
                           activation=self.activation, precision=self.precision)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, "
                f"activation={self.activation!r}, bias={self.bias is not None}, "
                f"tied={self.tied}" + _precision_repr(self.precision))
