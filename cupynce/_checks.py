"""Argument validation shared by every op: array kinds, shapes, dtypes, devices, scalars.

Every check raises before any kernel runs, with a message that names the op, the argument,
what it got and what was expected.  Nothing here synchronises with the GPU: only shapes,
dtypes and devices are inspected, never values of device arrays.
"""
from __future__ import annotations

import math
import numbers
from types import ModuleType
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ._engine.kernels import SUPPORTED_DTYPES

REDUCTIONS = ("mean", "sum", "none")


_CUPY: list = []  # [cupy or None] once looked up (the checks run on every call)


def _cupy():
    if not _CUPY:
        try:
            import cupy
        except ImportError:  # pragma: no cover - exercised only without CuPy
            cupy = None
        _CUPY.append(cupy)
    return _CUPY[0]


def is_cupy_array(x: Any) -> bool:
    cp = _cupy()
    return cp is not None and isinstance(x, cp.ndarray)


def array_module(op: str, optional: Sequence[str] = (), **arrays: Any) -> ModuleType:
    """``numpy`` or ``cupy`` for the given arrays; ``TypeError`` on anything else.

    All arrays must be NumPy arrays, or all CuPy arrays on one device.  Only the names in
    ``optional`` may be None.
    """
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
        return _cupy()
    return np


def check_float(op: str, name: str, x: Any) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{op}: {name} has dtype {x.dtype}; expected a floating dtype ({names})")


def check_matrix(op: str, name: str, x: Any, *, ndim: int = 2, min_rows: int = 1) -> None:
    """Rank, floating dtype and a minimum number of rows."""
    if x.ndim != ndim:
        want = {2: "(N, D)", 3: "(N, M, D)"}.get(ndim, f"{ndim}-D")
        raise ValueError(f"{op}: {name} must be {ndim}-D {want}, got shape {tuple(x.shape)}")
    check_float(op, name, x)
    if x.shape[0] < min_rows:
        raise ValueError(f"{op}: {name} needs at least {min_rows} rows, got shape {tuple(x.shape)}")
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


def check_temperature(op: str, temperature: Any) -> float:
    """A Python/NumPy real scalar, finite and > 0."""
    return check_positive_finite(op, "temperature", temperature)


def check_reduction(op: str, reduction: Any) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def check_logit_scale(op: str, logit_scale: Any, xp: ModuleType) -> Tuple[Any, Tuple[int, ...]]:
    """A Python real, or a 0-d / single-element 1-D floating array of the same kind as the inputs.

    Returns ``(value, shape)``: a Python float or the array, and the shape of the gradient.
    A device array is never read back to the host.
    """
    if isinstance(logit_scale, bool):
        raise TypeError(f"{op}: logit_scale must be a real scalar, got bool")
    if isinstance(logit_scale, numbers.Real):
        v = float(logit_scale)
        if not math.isfinite(v):
            raise ValueError(f"{op}: logit_scale must be finite, got {logit_scale!r}")
        return v, ()
    if isinstance(logit_scale, np.ndarray) or is_cupy_array(logit_scale):
        if (xp is np) != isinstance(logit_scale, np.ndarray):
            raise TypeError(f"{op}: logit_scale is a {type(logit_scale).__module__} array but the "
                            f"inputs are {xp.__name__} arrays")
        if logit_scale.ndim > 1 or logit_scale.size != 1:
            raise ValueError(f"{op}: logit_scale must be a scalar (shape () or (1,)), "
                             f"got shape {tuple(logit_scale.shape)}")
        check_float(op, "logit_scale", logit_scale)
        return logit_scale, tuple(logit_scale.shape)
    raise TypeError(f"{op}: logit_scale must be a real scalar or a 0-d array, "
                    f"got {type(logit_scale).__name__}")


def check_workspace(op: str, workspace_bytes: Optional[int]) -> Optional[int]:
    if workspace_bytes is None:
        return None
    if isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, numbers.Integral) \
            or workspace_bytes <= 0:
        raise ValueError(f"{op}: workspace_bytes must be a positive int or None, "
                         f"got {workspace_bytes!r}")
    return int(workspace_bytes)


def check_grad_loss(op: str, grad_loss: Any, reduction: str, n: int, xp: ModuleType) -> Any:
    """``grad_loss`` for a backward: a real scalar (mean/sum) or an (n,) array ("none").

    Scalars may be Python numbers or 0-d arrays of the same kind as the inputs (left on the
    device: never read back).
    """
    if isinstance(grad_loss, np.generic) and grad_loss.dtype in SUPPORTED_DTYPES:
        grad_loss = float(grad_loss)  # NumPy / ml_dtypes scalars (bfloat16 is no numbers.Real)
    if reduction == "none":
        if isinstance(grad_loss, numbers.Real) and not isinstance(grad_loss, bool):
            return float(grad_loss)  # broadcast: every row's loss gets the same weight
        ok = isinstance(grad_loss, np.ndarray) if xp is np else is_cupy_array(grad_loss)
        if not ok or grad_loss.shape not in ((n,), ()):
            got = tuple(grad_loss.shape) if hasattr(grad_loss, "shape") else type(grad_loss).__name__
            raise ValueError(f"{op}: with reduction='none', grad_loss must be a real or a "
                             f"{xp.__name__} array of shape ({n},), got {got}")
        check_float(op, "grad_loss", grad_loss)
        return grad_loss
    if isinstance(grad_loss, numbers.Real) and not isinstance(grad_loss, bool):
        return float(grad_loss)
    ok = isinstance(grad_loss, np.ndarray) if xp is np else is_cupy_array(grad_loss)
    if not ok or grad_loss.size != 1 or grad_loss.ndim > 1:
        got = tuple(grad_loss.shape) if hasattr(grad_loss, "shape") else type(grad_loss).__name__
        raise ValueError(f"{op}: with reduction={reduction!r}, grad_loss must be a scalar "
                         f"(real or 0-d {xp.__name__} array), got {got}")
    check_float(op, "grad_loss", grad_loss)
    return grad_loss


def check_positive_finite(op: str, name: str, value: Any) -> float:
    """A Python/NumPy real scalar, finite and > 0 (module hyper-parameters: ``init_temperature``,
    ``max_logit_scale``, and the ops' ``temperature``)."""
    if type(value) is not float and (isinstance(value, bool)
                                     or not isinstance(value, numbers.Real)):
        raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{op}: {name} must be finite and > 0, got {value!r}")
    return v
