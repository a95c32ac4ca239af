"""Argument validation shared by every op: array kinds, shapes, dtypes, devices, scalars.

Every check raises before any kernel runs, with a message that names the op, the argument,
what it got and what was expected.  Nothing here synchronises with the GPU: only shapes,
dtypes and devices are inspected, never values of device arrays.  Also here:
:func:`require_module`, the optional dependencies (torch, CuPy) or an error naming the extra
that installs them.
"""
from __future__ import annotations

import importlib
import math
import numbers
from types import ModuleType
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import config
from ._engine.kernels import SUPPORTED_DTYPES

REDUCTIONS = ("mean", "sum", "none")
#: (a set: one hash lookup where the tuple compares dtypes one by one; the tuple decides)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


_CUPY: list = []  # [cupy or None] once looked up (the checks run on every call)


def cupy_module():
    """The ``cupy`` module, or None where CuPy is not installed (looked up once)."""
    if not _CUPY:
        try:
            import cupy
        except ImportError:  # pragma: no cover - exercised only without CuPy
            cupy = None
        _CUPY.append(cupy)
    return _CUPY[0]


#: how to install each optional dependency (setup.cfg's extras)
_EXTRAS = {
    "torch": 'pip install "cupynce[torch]"',
    "cupy": 'pip install "cupynce[cuda12]" (CUDA 12) or "cupynce[cuda13]" (CUDA 13)',
}


def require_module(name: str, needed_by: str) -> ModuleType:
    """``import name`` (``"torch"`` or ``"cupy"``) for ``needed_by`` (``cupynce.torch``, a
    CUDA tensor's call, ...); if it is not installed, a ``ModuleNotFoundError`` that says which
    extra installs it.  ``import cupynce`` itself needs neither.

    Only the module's own absence is translated: an import error from inside an installed
    torch / CuPy (a missing CUDA library, a broken build) is raised as it is.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        raise ModuleNotFoundError(f"{needed_by} needs {name}, which is not installed: "
                                  f"{_EXTRAS[name]}", name=name) from exc


def is_cupy_array(x: Any) -> bool:
    cp = cupy_module()
    return cp is not None and isinstance(x, cp.ndarray)


def array_module(op: str, optional: Sequence[str] = (), **arrays: Any) -> ModuleType:
    """``numpy`` or ``cupy`` for the given arrays; ``TypeError`` on anything else.

    All arrays must be NumPy arrays, or all CuPy arrays on one device.  Only the names in
    ``optional`` may be None.
    """
    cp = cupy_module()
    if cp is not None:  # the common case first: CuPy arrays on one device (~0.3 µs)
        device = -1
        for x in arrays.values():
            if type(x) is not cp.ndarray:
                break
            d = x.data.device_id
            if d != device:
                if device >= 0:
                    break
                device = d
        else:
            if device >= 0:
                return cp
    kinds = {}
    for name, x in arrays.items():
        if x is None:
            if name in optional:
                continue
            raise TypeError(f"{op}: {name} is required (a numpy.ndarray or cupy.ndarray), got None")
        if isinstance(x, np.ndarray):
            kinds[name] = "numpy"
        elif is_cupy_array(x):
            kinds[name] = "cupy"
        else:
            hint = ""
            if type(x).__module__.startswith("torch"):
                hint = " (for torch tensors use cupynce.torch)"
            raise TypeError(f"{op}: {name} must be a numpy.ndarray or cupy.ndarray, "
                            f"got {type(x).__module__}.{type(x).__name__}{hint}")
    if len(set(kinds.values())) > 1:
        desc = ", ".join(f"{n} is {k}" for n, k in kinds.items())
        raise TypeError(f"{op}: cannot mix NumPy and CuPy arrays ({desc}); "
                        f"move them explicitly with cupy.asarray / cupy.asnumpy")
    if "cupy" in kinds.values():
        devices = {n: arrays[n].device.id for n in kinds}
        if len(set(devices.values())) > 1:
            desc = ", ".join(f"{n} on cuda:{d}" for n, d in devices.items())
            raise ValueError(f"{op}: all arrays must be on one GPU, got {desc}")
        return cupy_module()
    return np


def check_float(op: str, name: str, x: Any) -> None:
    if x.dtype not in _SUPPORTED and x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{op}: {name} has dtype {x.dtype}; expected a floating dtype ({names})")


def check_matrix(op: str, name: str, x: Any, *, ndim: int = 2, min_rows: int = 1) -> None:
    """Rank, floating dtype and a minimum number of rows."""
    if x.ndim != ndim:
        want = {2: "(N, D)", 3: "(N, M, D)"}.get(ndim, f"{ndim}-D")
        raise ValueError(f"{op}: {name} must be {ndim}-D {want}, got shape {tuple(x.shape)}")
    check_float(op, name, x)
    if x.shape[0] < min_rows:
        rows = "1 row" if min_rows == 1 else f"{min_rows} rows"
        raise ValueError(f"{op}: {name} needs at least {rows}, got shape {tuple(x.shape)}")
    if x.shape[-1] < 1:
        raise ValueError(f"{op}: {name} needs D >= 1, got shape {tuple(x.shape)}")


def check_same(op: str, names: Sequence[str], values: Sequence[Any], what: str) -> None:
    if len(set(values)) > 1:
        desc = ", ".join(f"{n}: {v}" for n, v in zip(names, values))
        raise ValueError(f"{op}: {what} must match ({desc})")


def check_same_dtype(op: str, **arrays: Any) -> None:
    items = [(n, a) for n, a in arrays.items() if a is not None]
    dts = {a.dtype for _, a in items}
    if len(dts) > 1:
        desc = ", ".join(f"{n}: {a.dtype}" for n, a in items)
        raise TypeError(f"{op}: inputs must share one dtype ({desc}); cast them explicitly")


def check_pairs(op: str, a: Any, b: Any) -> ModuleType:
    """Paired (N, D) rows (CLIP, SigLIP): matrices of one shape and dtype; returns the module."""
    cp = cupy_module()
    if cp is not None and type(a) is cp.ndarray and type(b) is cp.ndarray:  # the common case
        shape = a.shape  # (in one pass; anything else takes the checks below, which say why)
        if len(shape) == 2 and shape[0] >= 1 and shape[1] >= 1 and b.shape == shape \
                and a.dtype == b.dtype and a.dtype in _SUPPORTED \
                and a.data.device_id == b.data.device_id:
            return cp
    xp = array_module(op, a=a, b=b)
    check_matrix(op, "a", a)
    check_matrix(op, "b", b)
    if a.shape != b.shape:
        raise ValueError(f"{op}: a and b must have the same shape (N pairs, D), "
                         f"got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        check_same_dtype(op, a=a, b=b)
    return xp


def check_mask(op: str, name: str, mask: Any, xp: ModuleType) -> None:
    """A 0/1 mask: its values, when it is on the host (a NumPy array, a CPU tensor's view);
    ``ValueError`` naming the first value that is neither 0 nor 1 (2, -1, 0.5, NaN), which
    would otherwise count as "keep".  Bool masks need no scan.  A device mask is not read:
    scanning it would synchronise with the GPU, so there any nonzero value counts as 1."""
    if xp is not np or mask.dtype == np.bool_ or mask.size == 0:
        return
    bad = (mask != 0) & (mask != 1)  # (NaN included: it is neither)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{op}: {name} must hold only 0 and 1 (or be bool), got "
                         f"{mask[at].item()!r} at {at} (dtype {mask.dtype}); cast it with "
                         f"mask != 0 if nonzero means keep")


def check_scalar_device(op: str, name: str, value: Any, a: Any, xp: ModuleType) -> None:
    """A device scalar input (``logit_scale``, ``logit_bias``) on ``a``'s GPU."""
    if xp is not np and not isinstance(value, float) and \
            value.data.device_id != a.data.device_id:
        raise ValueError(f"{op}: {name} is on cuda:{value.device.id} but a is on "
                         f"cuda:{a.device.id}")


def check_bool(op: str, name: str, value: Any) -> bool:
    """A flag (``normalize``, ``requires_grad``, ...): a Python or NumPy bool, nothing truthy.

    ``normalize="no"`` would otherwise switch normalisation *on*; 0 / 1 are refused too, so that
    a misplaced positional argument cannot pass as a flag.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{op}: {name} must be a bool (True or False), got "
                    f"{_type_name(value)} {value!r}")


def _type_name(value: Any) -> str:
    """``module.Class`` of a value (``float``, ``numpy.ndarray``, ``torch.Tensor``, ...)."""
    t = type(value)
    mod = t.__module__
    return t.__name__ if mod == "builtins" else f"{mod.split('.')[0]}.{t.__name__}"


def _described(value: Any) -> str:
    """``torch.Tensor of shape ()``, ``numpy.ndarray of shape (3,)``, ``str``: what was given."""
    shape = getattr(value, "shape", None)
    return _type_name(value) if shape is None else f"{_type_name(value)} of shape {tuple(shape)}"


#: what to do instead, per argument, when a tensor that requires grad is given
_GRAD_HINTS = {
    "temperature": "pass a float or a tensor without grad (.detach()); a learnable temperature "
                   "is a tensor given to cupynce.torch's nt_xent / info_nce / supcon_loss, or "
                   "the modules' learnable=True (ClipLoss: its logit_scale)",
}


#: what a matrix in a scalar's place usually means: a tensor passed positionally, one too many
_ARRAY_HINTS = {
    ("nt_xent", "temperature"): " (nt_xent takes one z (2B, D), the two views stacked; for "
                                "query/key pairs use info_nce(query, key))",
    ("info_nce", "temperature"): " (negatives are keyword-only: info_nce(query, key, "
                                 "temperature, negatives=...))",
}


def check_no_grad(op: str, name: str, value: Any) -> None:
    """Refuse a tensor that requires grad where the op takes a constant (``temperature``, a
    module's hyper-parameter): read as a number, its gradient would be dropped without a
    word.

    Only metadata is read (``requires_grad``, shape, device: no synchronisation); the value
    is shown for a one-element CPU tensor.
    """
    if getattr(value, "requires_grad", False) is not True:
        return
    shape, device = tuple(value.shape), getattr(value, "device", None)
    on_cpu = getattr(device, "type", None) == "cpu"
    what = f"tensor({value.item():.8g}, requires_grad=True)" if on_cpu and value.numel() == 1 \
        else f"a tensor of shape {shape} on {device} with requires_grad=True"
    todo = _GRAD_HINTS.get(name, "pass a float or a tensor without grad (.detach())")
    raise TypeError(f"{op}: {name} is {what}, but {name} is a constant here and no gradient "
                    f"would reach it; {todo}")


def host_scalar(op: str, name: str, value: Any) -> Any:
    """A real scalar given as a Python / NumPy number or a 0-d host array, as a Python number.

    0-d NumPy arrays and 0-d CPU torch tensors are accepted (``np.float32(0.1)``,
    ``np.asarray(0.1)``, ``torch.tensor(0.1)``); a GPU array is refused with a ``TypeError``:
    reading it would synchronise with the GPU.  A tensor that requires grad is refused with a
    ``TypeError`` (:func:`check_no_grad`): taken as a number, its gradient would be lost.
    Anything else is returned unchanged for the caller's own check.
    """
    if isinstance(value, (float, int)):  # the common case first (and torch.compile traces it)
        return value
    check_no_grad(op, name, value)  # (a tensor's value taken as a float: its gradient lost)
    if is_cupy_array(value) or (type(value).__module__.startswith("torch")
                                and getattr(getattr(value, "device", None), "type", "cpu")
                                != "cpu"):
        raise TypeError(f"{op}: {name} must be a real number on the host, got a GPU "
                        f"{_type_name(value)} (reading it would synchronise with the GPU); "
                        f"pass a Python float")
    if isinstance(value, np.generic) and value.dtype in SUPPORTED_DTYPES:
        return float(value)  # (ml_dtypes' bfloat16 scalars are no numbers.Real)
    ndim = getattr(value, "ndim", None)
    if ndim is not None and not isinstance(value, np.generic):
        if ndim != 0:
            hint = _ARRAY_HINTS.get((op, name), "") if ndim >= 2 else ""
            raise ValueError(f"{op}: {name} must be a scalar, got a {_type_name(value)} of "
                             f"shape {tuple(value.shape)}{hint}")
        return value.item()
    return value


def check_temperature(op: str, temperature: Any) -> float:
    """A Python/NumPy real scalar, finite and > 0."""
    return check_positive_finite(op, "temperature", temperature)


def check_reduction(op: str, reduction: Any) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def check_precision(op: str, precision: Any, *, allow_none: bool = True,
                    none_means: str = "the global default, cupynce.get_float32_precision()"
                    ) -> str:
    """An entry point's ``precision=`` (its float32 products): "fp32" | "tf32" | "3xtf32" |
    "auto", or None for the global default (:func:`cupynce.get_float32_precision`, read now).

    Returns the resolved mode, which the entry point runs its engine work under
    (``config.float32_precision``) and keeps in its Context for the backward.  ``none_means``:
    what None stands for, in the error message (``cupynce.torch``'s differs).
    """
    if precision is None and allow_none:
        return config.get().float32_precision
    if not isinstance(precision, str) or precision not in config.FLOAT32_PRECISIONS:
        modes = ", ".join(map(repr, config.FLOAT32_PRECISIONS))
        default = f" or None ({none_means})" if allow_none else ""
        raise ValueError(f"{op}: precision must be one of {modes}{default}, "
                         f"got {precision!r}")
    return str(precision)  # (a str subclass, e.g. numpy.str_, as a plain str: graph keys)


#: the largest logit_scale (a log) for every dtype: exp of it is float32's largest value
LOG_SCALE_LIMIT = math.log(float(np.finfo(np.float32).max))


def _scale_overflow(op: str, value: float, acc: Optional[np.dtype]) -> None:
    """exp(logit_scale) must be finite in float32, whatever the dtype: a larger value is almost
    surely the scale itself passed where its log is expected (open_clip's convention), and one
    limit for every dtype means a call that runs in float64 also runs in float32 (the float64
    exponent would let exp(100) = 2.7e43 through, and a meaningless loss with it)."""
    limit = LOG_SCALE_LIMIT
    if value > limit:
        raise ValueError(
            f"{op}: logit_scale={value!r} is too large: cupynce takes the *log* of the logit "
            f"scale (CLIP's learnable log(1/temperature): logits = exp(logit_scale) * a.b, "
            f"log(100) = 4.605 at CLIP's clamp), and exp({value!r}) overflows float32 (the "
            f"limit for every dtype: logit_scale <= {limit:.2f}). open_clip's convention passes "
            f"the scale itself (logit_scale.exp(), e.g. 100): pass math.log(scale) here, or use "
            f"cupynce.integrations.open_clip, which takes open_clip's.")


def check_logit_scale(op: str, logit_scale: Any, xp: ModuleType,
                      acc: Optional[np.dtype] = None) -> Tuple[Any, Tuple[int, ...]]:
    """A Python real, or a 0-d / single-element 1-D floating array of the same kind as the inputs.

    Returns ``(value, shape)``: a Python float or the array, and the shape of the gradient.
    A value on the host (a real, a NumPy array, a CPU tensor through cupynce.torch) must be
    finite with ``exp(value)`` finite in float32, for every dtype (``acc`` is unused: one
    limit everywhere, ``LOG_SCALE_LIMIT``); a device array is never read back to the host (no
    synchronisation): the GPU ops turn a device value past the limit into NaN there
    (``arrays.guard_log_scale``), so the loss and gradients are NaN in every dtype.
    """
    return check_scalar_input(op, "logit_scale", logit_scale, xp,
                              lambda v: _scale_overflow(op, v, acc))


def check_scalar_input(op: str, name: str, value: Any, xp: ModuleType,
                       host_check=None) -> Tuple[Any, Tuple[int, ...]]:
    """A differentiable scalar input (``logit_scale``, ``logit_bias``): a Python real, or a
    0-d / single-element 1-D floating array of the same kind as the inputs.

    Returns ``(value, shape)``: a Python float or the array, and the shape of its gradient.
    A value on the host must be finite (and pass ``host_check(value)``); a device array is
    never read back to the host.
    """
    if type(value) is float:  # (the common cases first: a Python float, a device array)
        if not math.isfinite(value):
            raise ValueError(f"{op}: {name} must be finite, got {value!r}")
        if host_check is not None:
            host_check(value)
        return value, ()
    cp = cupy_module()
    if cp is not None and type(value) is cp.ndarray and xp is cp and value.ndim <= 1 \
            and value.size == 1 and value.dtype in _SUPPORTED:
        return value, value.shape
    if isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a real scalar, got bool")
    if isinstance(value, np.generic) and value.dtype in SUPPORTED_DTYPES:
        value = float(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        if not math.isfinite(v):
            raise ValueError(f"{op}: {name} must be finite, got {value!r}")
        if host_check is not None:
            host_check(v)
        return v, ()
    if isinstance(value, np.ndarray) or is_cupy_array(value):
        if (xp is np) != isinstance(value, np.ndarray):
            raise TypeError(f"{op}: {name} is a {type(value).__module__} array but the "
                            f"inputs are {xp.__name__} arrays")
        if value.ndim > 1 or value.size != 1:
            raise ValueError(f"{op}: {name} must be a scalar (shape () or (1,)), "
                             f"got shape {tuple(value.shape)}")
        check_float(op, name, value)
        if isinstance(value, np.ndarray):  # on the host: the value can be checked
            v = float(value.reshape(()))
            if not math.isfinite(v):
                raise ValueError(f"{op}: {name} must be finite, got {v!r}")
            if host_check is not None:
                host_check(v)
        return value, tuple(value.shape)
    raise TypeError(f"{op}: {name} must be a real scalar or a 0-d array, "
                    f"got {_type_name(value)}")


def check_workspace(op: str, workspace_bytes: Optional[int]) -> Optional[int]:
    if workspace_bytes is None:
        return None
    if isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, numbers.Integral) \
            or workspace_bytes <= 0:
        raise ValueError(f"{op}: workspace_bytes must be a positive int or None, "
                         f"got {workspace_bytes!r}")
    return int(workspace_bytes)


def check_flags(op: str, reduction: Any, workspace_bytes: Any, normalize: Any,
                precision: Any) -> str:
    """The flags every InfoNCE-family entry point takes (reduction, workspace_bytes,
    normalize, precision); returns the resolved precision (:func:`check_precision`)."""
    check_reduction(op, reduction)
    check_workspace(op, workspace_bytes)
    check_bool(op, "normalize", normalize)
    return check_precision(op, precision)


def check_grad_loss(op: str, grad_loss: Any, reduction: str, n: int, xp: ModuleType) -> Any:
    """``grad_loss`` for a backward: a real scalar (mean/sum) or an (n,) array ("none").

    Scalars may be Python numbers or 0-d arrays of the same kind as the inputs (left on the
    device: never read back).
    """
    if type(grad_loss) is float:  # (the common case: a unit or scaled upstream gradient)
        return grad_loss
    if isinstance(grad_loss, np.generic) and grad_loss.dtype in SUPPORTED_DTYPES:
        grad_loss = float(grad_loss)  # NumPy / ml_dtypes scalars (bfloat16 is no numbers.Real)
    if reduction == "none":
        if isinstance(grad_loss, numbers.Real) and not isinstance(grad_loss, bool):
            return float(grad_loss)  # broadcast: every row's loss gets the same weight
        ok = isinstance(grad_loss, np.ndarray) if xp is np else is_cupy_array(grad_loss)
        if not ok or grad_loss.shape not in ((n,), ()):
            raise ValueError(f"{op}: with reduction='none', grad_loss must be a real or a "
                             f"{xp.__name__} array of shape ({n},), got {_described(grad_loss)}")
        check_float(op, "grad_loss", grad_loss)
        return grad_loss
    if isinstance(grad_loss, numbers.Real) and not isinstance(grad_loss, bool):
        return float(grad_loss)
    ok = isinstance(grad_loss, np.ndarray) if xp is np else is_cupy_array(grad_loss)
    if not ok or grad_loss.size != 1 or grad_loss.ndim > 1:
        raise ValueError(f"{op}: with reduction={reduction!r}, grad_loss must be a scalar "
                         f"(real or 0-d {xp.__name__} array), got {_described(grad_loss)}")
    check_float(op, "grad_loss", grad_loss)
    return grad_loss


def check_labels(op: str, labels: Any, n: int, xp: ModuleType, like: Any) -> Any:
    """``labels`` (None, or an integer array of shape (n,) of the inputs' kind, on ``like``'s
    device) as int64 laid out in order (a copy only where it is not already), or ``ValueError``
    / ``TypeError`` naming what it got.  Its values are never read (a device array stays
    there): any integers are labels."""
    if labels is None:
        return None
    ok = isinstance(labels, np.ndarray) if xp is np else is_cupy_array(labels)
    if not ok:
        raise TypeError(f"{op}: labels must be a {xp.__name__} array like the inputs, got "
                        f"{_described(labels)}")
    if labels.shape != (n,) or labels.dtype.kind not in "iu":
        raise ValueError(f"{op}: labels must be an integer array of shape ({n},), got "
                         f"{labels.dtype} of shape {tuple(labels.shape)}")
    if xp is not np and labels.data.device_id != like.data.device_id:
        raise ValueError(f"{op}: labels are on cuda:{labels.device.id} but the inputs are on "
                         f"cuda:{like.device.id}")
    return xp.ascontiguousarray(labels, dtype=np.int64)


def check_smoothing(op: str, label_smoothing: Any) -> float:
    """``label_smoothing`` as a float in [0, 1), or ``ValueError`` naming its value."""
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"{op}: label_smoothing must be a real in [0, 1), got "
                        f"{_described(label_smoothing)}")
    eps = float(label_smoothing)
    if not 0.0 <= eps < 1.0:  # (NaN fails too)
        raise ValueError(f"{op}: label_smoothing must be in [0, 1), got {label_smoothing!r}")
    return eps


#: sentence-transformers' hardness modes, by the code ``row_softmax`` (stats.cu) takes
HARDNESS_MODES = {"in_batch_negatives": 1, "hard_negatives": 2, "all_negatives": 3}


def check_hardness(op: str, hardness_mode: Any, hardness_strength: Any) -> Tuple[int, float]:
    """``(code, alpha)`` of a hardness weighting (code 0: none; also when the strength is 0),
    or an exception naming the argument.  ``hardness_mode``: None, a name of
    :data:`HARDNESS_MODES`, or its code (the torch ops' schema carries the code, 0 for None);
    ``hardness_strength``: a finite real >= 0."""
    if isinstance(hardness_strength, bool) or not isinstance(hardness_strength, numbers.Real):
        raise TypeError(f"{op}: hardness_strength must be a real >= 0, got "
                        f"{_described(hardness_strength)}")
    alpha = float(hardness_strength)
    if not (math.isfinite(alpha) and alpha >= 0.0):
        raise ValueError(f"{op}: hardness_strength must be finite and >= 0, got "
                         f"{hardness_strength!r}")
    if hardness_mode is None:
        code = 0
    elif isinstance(hardness_mode, str) and hardness_mode in HARDNESS_MODES:
        code = HARDNESS_MODES[hardness_mode]
    elif isinstance(hardness_mode, numbers.Real) and not isinstance(hardness_mode, bool) \
            and float(hardness_mode) in (0.0, 1.0, 2.0, 3.0):
        code = int(hardness_mode)
    else:
        raise ValueError(f"{op}: hardness_mode must be None, 'in_batch_negatives', "
                         f"'hard_negatives' or 'all_negatives', got {hardness_mode!r}")
    return (code, alpha) if code and alpha > 0.0 else (0, 0.0)


def check_positive_finite(op: str, name: str, value: Any) -> float:
    """A real scalar, finite and > 0 (module hyper-parameters: ``init_temperature``,
    ``max_logit_scale``, and the ops' ``temperature``): a Python / NumPy number or a 0-d host
    array (:func:`host_scalar`)."""
    value = host_scalar(op, name, value)
    if type(value) is not float and (isinstance(value, bool)
                                     or not isinstance(value, numbers.Real)):
        raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{op}: {name} must be finite and > 0, got {value!r}")
    return v
