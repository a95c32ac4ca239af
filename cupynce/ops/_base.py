"""What the InfoNCE-family ops share: the context, the reductions, the backend switch, and
the float32 precision's global default (``set_float32_precision``) and backward scope.

Each op module (nt_xent, info_nce, clip) checks its arguments, lays out its inputs and
describes its problem to :class:`Path`, which hands it the primitives of the arrays' side:
the GPU engine (``cupynce._engine``) for CuPy arrays, the NumPy path (``_numpy``) for NumPy
arrays.  The two never mix.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

import numpy as np

from .. import _checks, _engine
from .. import config
from .._engine import arrays
from .._engine.kernels import acc_dtype
from . import _memo, _numpy


@dataclass
class Context:
    """What ``*_backward`` needs from ``*_forward``; treat as opaque.

    ``saved`` holds O(N·D) arrays only: either the unit-weight gradients (mean/sum) or the
    (normalised) inputs and row statistics needed to recompute them (none).
    """

    op: str
    reduction: str
    n: int
    xp: ModuleType
    saved: Dict[str, Any] = field(default_factory=dict)
    #: The O(N) row statistics of the forward (set when ``requires_grad``): ``(lse,)`` for
    #: nt_xent / info_nce, ``(lse_rows, lse_cols)`` for clip_loss; float32 (float64 for
    #: float64 inputs); ``(argmax,)`` for splade_pool.  With the inputs they are all
    #: ``*_backward_from_stats`` needs.
    stats: Tuple[Any, ...] = ()
    #: The float32 precision the forward ran its products in ("fp32" | "tf32" | "3xtf32" |
    #: "auto", resolved from its ``precision=``); ``*_backward`` runs in the same (None: no scope).
    precision: Optional[str] = None


def set_float32_precision(precision: str) -> None:
    """Set the global default of every entry point's ``precision=None``: how float32 products
    run on the GPU.

    Parameters
    ----------
    precision : "fp32" | "tf32" | "3xtf32" | "auto"
        "auto" (the default; env ``CUPYNCE_FLOAT32`` sets the initial value): float32
        accuracy on the fastest path cupynce has for the call -- NT-Xent on one Hopper GPU
        (compute capability 9.0) with 2B >= 4096 rows of D >= 64 runs the TF32x3 tiles
        (each operand split x = hi + lo, three TF32 products per 32 of K promoted to an fp32
        register sum, an fp32-accurate epilogue; per-row losses and gradients measured at
        or below the "fp32" path's errors from those sizes on, not below them:
        ``cupynce.config``'s ``tf32x3_min_rows``), everything else true fp32 cuBLAS.  "fp32": true fp32
        cuBLAS products (``CUBLAS_COMPUTE_32F``) everywhere, the path before "auto" existed.
        "tf32": the tensor cores on TF32-rounded operands (10 mantissa bits, ~1e-3 relative
        error per product, several times faster).  "3xtf32": the TF32x3 tiles where "auto"
        takes them, elsewhere cuBLAS's 3xTF32 (three TF32 products of the split operands in
        one long accumulation): ~100x more accurate than "tf32" per product but not
        fp32-accurate on Hopper (measured on an H100: products 3-13x fp32's error, NT-Xent /
        CLIP gradients 11-27x; ~1.35x fp32's speed; the splits take 2x the split operands'
        size in scratch, the score block's included, which the row-block planning counts in
        the workspace).

    Notes
    -----
    Process-wide (every thread without a ``precision=`` of its own); read at each call.  It
    affects float32 inputs on the GPU only: float16 / bfloat16 / float64 inputs and the NumPy
    path ignore it.  ``cupynce.torch`` with ``precision=None`` first follows torch's own TF32
    setting (see :func:`cupynce.torch.nt_xent`).
    """
    config.set(float32_precision=_checks.check_precision("set_float32_precision", precision,
                                                         allow_none=False))


def get_float32_precision() -> str:
    """The global default of ``precision=None`` (see :func:`set_float32_precision`)."""
    return config.get().float32_precision


F = TypeVar("F", bound=Callable[..., Any])


def in_ctx_precision(backward: F) -> F:
    """A ``*_backward(ctx, ...)`` run in the float32 precision its forward ran in
    (``ctx.precision``)."""
    @functools.wraps(backward)
    def run(ctx, *args, **kwargs):
        p = getattr(ctx, "precision", None)
        if p is None:
            return backward(ctx, *args, **kwargs)
        with config.float32_precision(p):
            return backward(ctx, *args, **kwargs)
    return run  # type: ignore[return-value]


class Path:
    """The per-backend primitives, chosen once per call from the array module.

    Looked up on their modules at every call (not bound at import), so tests can replace a
    primitive in one place.
    """

    def __init__(self, xp):
        self.gpu = xp is not np
        self.rows = _engine.rows if self.gpu else _numpy.rows
        self.normalize = arrays.normalize if self.gpu else _numpy.normalize
        self.finish = arrays.finish if self.gpu else _numpy.finish
        self.grad_scale = arrays.grad_scale if self.gpu else _numpy.grad_scale
        self.class_sums = arrays.class_sums if self.gpu else _numpy.class_sums
        self.owned_copy = (arrays.owned_copy if self.gpu
                           else lambda x, dtype: np.asarray(x).astype(dtype, copy=True))


def reduce(xp, per_row, reduction: str, out=None):
    """The reduced loss: a 0-d array (mean/sum) or the per-row array (none).

    On the GPU one single-block kernel (``sum_rows``: a fixed-order sum, then / n for the
    mean) instead of CuPy's reduction, whose host time is several launches'.  ``out``: the
    0-d result array (:func:`reduce_out`; None: a new one).
    """
    if reduction == "none":
        return per_row
    if xp is np:
        return np.asarray(per_row.mean() if reduction == "mean" else per_row.sum())
    return arrays.fixed_sum(per_row, per_row.size if reduction == "mean" else 1, out)


def reduce_out(xp, reduction: str, dtype):
    """The GPU's 0-d array for :func:`reduce`'s result, allocated ahead (work beside a long
    pass may not allocate: ``_engine/side.py``); None where nothing is allocated."""
    if reduction == "none" or xp is np:
        return None
    return xp.empty((), dtype)


def row_weight(reduction: str, n: int) -> float:
    return 1.0 / n if reduction == "mean" else 1.0


def weights(xp, grad_loss, reduction: str, n: int, a):
    """Row weights for the gradient: ``(w_ptr_array_or_None, stride, multiplier)``."""
    if grad_loss is None:
        return None, 0, row_weight(reduction, n)
    if isinstance(grad_loss, float):
        return None, 0, grad_loss * row_weight(reduction, n)
    g = xp.ascontiguousarray(grad_loss.astype(a, copy=False)).reshape(-1)
    return g, (1 if g.size == n and reduction == "none" else 0), row_weight(reduction, n)


def contig_inputs(xp, *xs):
    """Inputs as the finishing kernels need them (row-major; 3-D contiguous)."""
    return [None if x is None
            else (arrays.rowmajor(xp, x) if x.ndim == 2 else xp.ascontiguousarray(x))
            for x in xs]


def contig_remembered(xp, sig: Optional[tuple], hit: bool, *xs):
    """:func:`contig_inputs` for a forward whose argument signature is ``sig`` (``_memo``):
    a remembered one (``hit``) was laid out as given; otherwise the signature is remembered
    where no input was copied.  Returns ``(inputs, sig)``, sig None where an input was copied
    (it describes the inputs as given, not the copies, so it cannot stand for their layout)."""
    if hit:
        return list(xs), sig
    laid = contig_inputs(xp, *xs)
    if all(a is b for a, b in zip(laid, xs)):
        _memo.remember(sig)
        return laid, sig
    return laid, None


def prep(path: Path, x, normalize: bool):
    """(array the products use, its norms or None): normalised when asked.

    ``x`` has already been laid out by :func:`contig_inputs`.
    """
    if x is None:
        return None, None
    if not normalize:
        return x, None
    if x.ndim == 3:  # (N, M, D) negatives: normalise their rows as a 2-D view
        xn, norm = path.normalize(x.reshape(-1, x.shape[-1]))
        return xn.reshape(x.shape), norm.reshape(x.shape[:2])
    return path.normalize(x)


def finish_all(path: Path, originals, norms, accs, g):
    """Each input's gradient in its dtype: ``g * acc``, through its normalisation if any
    (None for an absent input, or one whose gradient was not asked for: acc None)."""
    out = []
    for x, nrm, acc in zip(originals, norms, accs):
        if x is None or acc is None:
            out.append(None)
            continue
        if x.ndim == 3:
            flat = path.finish(x.reshape(-1, x.shape[-1]),
                               None if nrm is None else nrm.reshape(-1),
                               acc.reshape(-1, x.shape[-1]), g)
            out.append(flat.reshape(x.shape))
        else:
            out.append(path.finish(x, nrm, acc, g))
    return out


def check_stats(op: str, xp, n: int, dtype, **stats) -> None:
    """Row statistics handed to ``*_backward_from_stats``: (n,) arrays of the accumulator dtype."""
    want = acc_dtype(dtype)
    for name, v in stats.items():
        if not isinstance(v, xp.ndarray) or v.shape != (n,) or v.dtype != want:
            got = f"{type(v).__name__} {getattr(v, 'shape', '')} {getattr(v, 'dtype', '')}"
            raise ValueError(f"{op}_backward_from_stats: {name} must be a ({n},) {want} "
                             f"{xp.__name__} array (ctx.stats of {op}_forward), got {got}")


def require(ctx, op: str) -> None:
    """``ctx`` is the Context of ``op``'s forward, run with ``requires_grad=True``."""
    if not isinstance(ctx, Context) or ctx.op != op:
        raise TypeError(f"{op}_backward: ctx must be the Context returned by {op}_forward")
    if not ctx.saved:
        raise ValueError(f"{op}_backward: the forward ran with requires_grad=False; "
                         f"run {op}_forward(..., requires_grad=True)")


@dataclass(frozen=True)
class Temperature:
    """A loss's temperature τ as the engine takes it (:func:`temperature_input`).

    ``value``: τ on the host (a real, or a NumPy array's value), else None; ``scale_log``: for
    a device array, −log τ as a (1,) array of the accumulator dtype (the engine's logits are
    then ``exp(scale_log) · q·c``; never read on the host), else None; ``shape`` /
    ``dtype``: its gradient's (a real's: 0-d of the accumulator dtype); ``array``: given as
    an array (its gradient is computed, ``dtemperature``)."""

    value: Optional[float]
    scale_log: Any
    shape: Tuple[int, ...]
    dtype: Any
    array: bool

    @property
    def scale(self) -> float:
        """The engine's real scale: 1/τ on the host, 1 with a device ``scale_log``."""
        return 1.0 / self.value if self.value is not None else 1.0

    def inverse(self, xp):
        """1/τ as a multiplier: a real, or a 0-d device array (never read)."""
        if self.value is not None:
            return 1.0 / self.value
        return xp.exp(self.scale_log.reshape(()))


def temperature_input(op: str, temperature: Any, xp, like, acc) -> Temperature:
    """``temperature`` checked: a real > 0 (a Python / NumPy number, a 0-d host array), or a
    0-d / (1,) floating array of the inputs' kind -- a NumPy one is read (> 0, finite), a CuPy
    one on ``like``'s device is never read (a value ≤ 0 or non-finite makes the loss NaN
    or infinite on the device)."""
    if type(temperature) is float:
        return Temperature(_checks.check_temperature(op, temperature), None, (), acc, False)
    cp = _checks.cupy_module()
    if cp is not None and _checks.is_cupy_array(temperature):
        value, shape = _checks.check_scalar_input(op, "temperature", temperature, xp)
        _checks.check_scalar_device(op, "temperature", value, like, xp)
        with value.device:
            log = -cp.log(value.astype(acc).reshape(1))
        return Temperature(None, log, shape, value.dtype, True)
    if isinstance(temperature, np.ndarray):
        if xp is not np:
            raise TypeError(f"{op}: temperature is a numpy array but the inputs are "
                            f"{xp.__name__} arrays (a real, or an array on their device)")
        one = temperature.reshape(()) if temperature.shape == (1,) else temperature
        value = _checks.check_temperature(op, one)  # (a real scalar's checks and messages)
        floating = temperature.dtype in _checks.SUPPORTED_DTYPES
        return Temperature(value, None, tuple(temperature.shape),
                           temperature.dtype if floating else acc, True)
    return Temperature(_checks.check_temperature(op, temperature), None, (), acc, False)


def dtemperature(xp, xn, acc, temp: Temperature, degree: int):
    """dL/dτ from the gradient the backward has anyway: the logits are homogeneous of degree
    −1 in τ and ``degree`` in the rows ``xn`` (NT-Xent, SupCon: 2 in ẑ; InfoNCE: 1 in the
    queries), so ``Σ_ij G_ij L_ij = (1/degree) Σ_i x̂_i · ∂L/∂x̂_i`` and
    ``dL/dτ = −(1/(degree τ)) Σ_i x̂_i · acc_i`` -- ``acc`` the accumulator of ∂L/∂x̂
    (before the normalisation's backward).  A 0-d array of the accumulator dtype, summed
    in the array module's fixed order."""
    a = acc.dtype
    dot = (acc * xn.astype(a, copy=False)).sum()
    return xp.asarray(-(dot * temp.inverse(xp)) / a.type(degree), dtype=a)  # (NumPy 1: f64)


def temperature_result(path: "Path", xp, dt, temp: Temperature):
    """dτ in the temperature's shape and dtype (a real's: 0-d of the accumulator dtype)."""
    return path.owned_copy(xp.asarray(dt), temp.dtype).reshape(temp.shape)


