"""The oracle's shared pieces: the float64 cast, the reductions and their row weights, the
max-shifted log-sum-exp, and L2 normalisation with its backward (``F.normalize`` semantics)."""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
from numpy.typing import ArrayLike

REDUCTIONS = ("mean", "sum", "none")

Loss = Union[np.float64, np.ndarray]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def _f64(x: ArrayLike) -> np.ndarray:
    """Cast anything array-like (including bfloat16 / float16) to float64."""
    return np.asarray(x).astype(np.float64)


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduction must be one of {REDUCTIONS}, got {reduction!r}"
        )


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    """Max-shifted log-sum-exp along ``axis`` (``-inf`` entries contribute 0)."""
    m = np.max(x, axis=axis, keepdims=True)
    s = np.sum(np.exp(x - m), axis=axis, keepdims=True)
    return np.squeeze(m + np.log(s), axis=axis)


def _reduce(per_row: np.ndarray, reduction: str) -> Loss:
    """Apply ``reduction`` to the per-row losses, shape (N,)."""
    if reduction == "mean":
        return np.float64(per_row.mean())
    if reduction == "sum":
        return np.float64(per_row.sum())
    return per_row


def _row_weights(
    reduction: str, grad_loss: Optional[ArrayLike], n: int
) -> np.ndarray:
    """Weight ``w_i = d(sum(grad_loss * loss)) / d(loss_i)``, shape (n,).

    ``mean``: ``grad_loss / n``; ``sum``: ``grad_loss``;
    ``none``: ``grad_loss[i]`` (a scalar ``grad_loss`` is broadcast).
    """
    if reduction == "none":
        if grad_loss is None:
            return np.ones(n)
        return np.broadcast_to(_f64(grad_loss), (n,)).copy()
    g = 1.0 if grad_loss is None else float(_f64(grad_loss).reshape(()))
    if reduction == "mean":
        g = g / n
    return np.full(n, g)


# --------------------------------------------------------------------------
# L2 normalisation (F.normalize semantics)
# --------------------------------------------------------------------------


def l2_normalize(x: ArrayLike, eps: float = 1e-12) -> np.ndarray:
    """Normalise along the last axis exactly like ``torch.nn.functional.normalize``.

    ``y = x / max(||x||_2, eps)``, row-wise over the last axis.  An all-zero
    row maps to an all-zero row (no NaN).

    Parameters
    ----------
    x : array_like, shape (..., D)
    eps : float
        Lower clamp of the norm.

    Returns
    -------
    y : ndarray, shape (..., D), float64
    """
    x = _f64(x)
    norm = _row_norm(x)
    return x / np.maximum(norm, eps)


def _row_norm(x: np.ndarray) -> np.ndarray:
    """``||x||_2`` over the last axis (keepdims), without overflow: ``m ||x / m||`` with
    ``m = max |x_k|`` where the plain sum of squares would overflow (``|x| >~ 1e154``)."""
    with np.errstate(over="ignore"):
        norm = np.linalg.norm(x, axis=-1, keepdims=True)
    big = np.isinf(norm) & np.all(np.isfinite(x), axis=-1, keepdims=True)
    if big.any():
        m = np.max(np.abs(x), axis=-1, keepdims=True)
        safe = np.where(big, m, 1.0)
        norm = np.where(big, safe * np.linalg.norm(x / safe, axis=-1, keepdims=True), norm)
    return norm


def l2_normalize_backward(
    x: ArrayLike, grad_y: ArrayLike, eps: float = 1e-12
) -> np.ndarray:
    """Backward of :func:`l2_normalize` (vector-Jacobian product).

    With ``n = ||x||_2`` and ``y = x / max(n, eps)``:

    - if ``n >= eps``: ``dx = (dy - y * sum(y * dy)) / n``
    - otherwise (the clamp is active, ``y = x / eps`` is linear):
      ``dx = dy / eps``

    This matches autograd through ``x / norm(x).clamp_min(eps)``.

    Parameters
    ----------
    x : array_like, shape (..., D)
        The input of the forward pass.
    grad_y : array_like, shape (..., D)
        Gradient with respect to the output ``y``.
    eps : float

    Returns
    -------
    dx : ndarray, shape (..., D), float64
    """
    x = _f64(x)
    dy = _f64(grad_y)
    norm = _row_norm(x)
    denom = np.maximum(norm, eps)
    y = x / denom
    radial = y * np.sum(y * dy, axis=-1, keepdims=True)
    through_norm = norm >= eps  # where the clamp is inactive, n depends on x
    return (dy - np.where(through_norm, radial, 0.0)) / denom
