"""The variant tests' numerics: the per-dtype tolerances and the error measures they are
stated in (tests/ops: labels, smoothing, hardness, SupCon, pair-wise NT-Xent, the learnable
temperature)."""
from __future__ import annotations

import numpy as np

#: relative error allowed per dtype (float64 the oracle's own agreement; 16-bit: the inputs'
#: rounding through two products)
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}


def dtype_of(name: str):
    """The NumPy dtype named ``name`` (bfloat16: ml_dtypes')."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def rel(x, r) -> float:
    """``||x - r|| / ||r||`` in float64."""
    x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
    return float(np.linalg.norm(x - r) / max(np.linalg.norm(r), 1e-300))


def scalar_err(x, r) -> float:
    """A scalar's error relative to ``max(|r|, 1)`` (a gradient that may be near 0)."""
    x, r = float(np.asarray(x, np.float64).reshape(())), float(np.asarray(r).reshape(()))
    return abs(x - r) / max(abs(r), 1.0)
