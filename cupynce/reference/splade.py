"""SPLADE's max-pooling head and the FLOPS regulariser in float64 (the oracle)."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike

from ._common import _f64

SPLADE_ACTIVATIONS = ("relu", "log1p_relu")


# --------------------------------------------------------------------------
# SPLADE max-pooling head and the FLOPS regulariser
# --------------------------------------------------------------------------


def _splade_inputs(x, weight, mask):
    """float64 ``x`` (B, L, D), ``weight`` (V, D), boolean keep-mask (B, L)."""
    x = _f64(x)
    w = _f64(weight)
    if x.ndim != 3:
        raise ValueError(f"x must have shape (B, L, D), got {x.shape}")
    if w.ndim != 2 or w.shape[1] != x.shape[2]:
        raise ValueError(
            f"weight must have shape (V, D) with D = {x.shape[2]}, "
            f"got {w.shape}"
        )
    if mask is None:
        keep = np.ones(x.shape[:2], dtype=bool)
    else:
        keep = np.asarray(mask) != 0
        if keep.shape != x.shape[:2]:
            raise ValueError(
                f"mask must have shape (B, L) = {x.shape[:2]}, "
                f"got {keep.shape}"
            )
    return x, w, keep


def splade_logits(
    x: ArrayLike, weight: ArrayLike, mask: Optional[ArrayLike] = None
) -> np.ndarray:
    """The dense (B, L, V) logits ``x[b, l] . weight[v]``; ``-inf`` if masked.

    The bias is not included (it is constant over ``l`` and added after the
    max, see :func:`splade_pool`).

    Parameters
    ----------
    x : array_like, shape (B, L, D)
    weight : array_like, shape (V, D)
    mask : array_like, shape (B, L), optional
        Nonzero (or True) positions count; ``None`` means all do.

    Returns
    -------
    logits : ndarray, shape (B, L, V), float64
    """
    return _masked_logits(*_splade_inputs(x, weight, mask))


def _masked_logits(
    x: np.ndarray, w: np.ndarray, keep: np.ndarray
) -> np.ndarray:
    logits = x @ w.T  # (B, L, V)
    logits[~keep] = -np.inf
    return logits


def splade_argmax(
    x: ArrayLike, weight: ArrayLike, mask: Optional[ArrayLike] = None
) -> np.ndarray:
    """The winner ``l*(b, v) = argmax_l logits[b, l, v]`` over unmasked ``l``.

    Ties go to the lowest ``l`` (``np.argmax``); a row whose mask is all zero
    gives 0.  A NaN logit wins (``np.argmax`` returns the first NaN), so it
    reaches the output.

    Returns
    -------
    argmax : ndarray, shape (B, V), int64
    """
    return np.argmax(splade_logits(x, weight, mask), axis=1)


def splade_pool(
    x: ArrayLike,
    weight: ArrayLike,
    bias: Optional[ArrayLike] = None,
    mask: Optional[ArrayLike] = None,
    activation: str = "log1p_relu",
    grad_out: Optional[ArrayLike] = None,
    *,
    argmax: Optional[ArrayLike] = None,
) -> Tuple[np.ndarray, Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]:
    """SPLADE's max-pooled vocabulary head, dense, with its gradients.

    With ``z[b, l, v] = x[b, l] . weight[v]`` (``-inf`` where
    ``mask[b, l] == 0``)::

        l*(b, v)  = argmax_l z[b, l, v]   (ties: lowest l; 0 if all masked)
        m[b, v]   = z[b, l*, v] + bias[v]          (bias 0 when None)
        out[b, v] = act(m[b, v]),  act = relu:        max(m, 0)
                                         log1p_relu:  log(1 + max(m, 0))
        out[b, v] = 0                              where row b is all masked

    Gradient of ``sum(grad_out * out)``, with ``g[b, v] = grad_out[b, v] *
    act'(m[b, v])``, ``act' = [m > 0]`` (relu) or ``[m > 0] / (1 + m)``
    (log1p_relu), and ``g = 0`` on all-masked rows; with the one-hot
    ``P[b, l, v] = [l == l*(b, v)]``::

        dx[b, l]    = sum_v P[b, l, v] g[b, v] weight[v]
        dweight[v]  = sum_b g[b, v] x[b, l*(b, v)]
        dbias[v]    = sum_b g[b, v]

    A term with ``g[b, v] = 0`` contributes exactly 0 (not ``0 * NaN``), as in
    a backward that touches only the active entries: a NaN or inf in a masked
    or losing position never reaches the gradients.

    The full (B, L, V) logits and one-hot and the (B, V, D) contributions
    are built in float64 (about ``2 B L V + B V D + 2 V D`` doubles at the
    peak): this is an oracle for small sizes, not a memory-bounded
    implementation.

    Parameters
    ----------
    x : array_like, shape (B, L, D)
    weight : array_like, shape (V, D)
    bias : array_like, shape (V,), optional
    mask : array_like, shape (B, L), optional
        Nonzero (or True) positions count; ``None`` means all do.
    activation : {"relu", "log1p_relu"}
    grad_out : array_like, shape (B, V), optional
        Upstream gradient; ``None`` means ones.
    argmax : array_like of ints, shape (B, V), optional
        Use these winners instead of this function's own argmax (out and
        gradients are then evaluated at ``z[b, argmax[b, v], v]``).  For
        checking a low-precision implementation whose rounded logits tie or
        swap where the float64 ones do not: its winner is a valid choice when
        its float64 logit is within rounding of the maximum.  Entries of
        all-masked rows are ignored.

    Returns
    -------
    out : ndarray, shape (B, V), float64
    grads : tuple ``(dx, dweight, dbias)``, float64, of the shapes of ``x``,
        ``weight`` and ``bias``; ``dbias`` is ``None`` without a ``bias``.
    """
    if activation not in SPLADE_ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {SPLADE_ACTIVATIONS}, "
            f"got {activation!r}"
        )
    x, w, keep = _splade_inputs(x, weight, mask)
    nb, nl, _ = x.shape
    nv = w.shape[0]
    b = np.zeros(nv) if bias is None else _f64(bias)
    if b.shape != (nv,):
        raise ValueError(f"bias must have shape (V,) = ({nv},), got {b.shape}")

    logits = _masked_logits(x, w, keep)
    if argmax is None:
        lstar = np.argmax(logits, axis=1)  # (B, V); ties -> lowest l
    else:
        lstar = np.asarray(argmax).astype(np.int64)
        if lstar.shape != (nb, nv):
            raise ValueError(f"argmax must have shape (B, V) = {(nb, nv)}, "
                             f"got {lstar.shape}")
    empty = ~keep.any(axis=1)  # (B,): all-masked rows
    lstar = np.where(empty[:, None], 0, lstar)
    if np.any((lstar < 0) | (lstar >= nl)):
        raise ValueError("argmax out of range [0, L)")
    if np.any(~keep[np.arange(nb)[:, None], lstar] & ~empty[:, None]):
        raise ValueError("argmax points at a masked position")

    z = np.take_along_axis(logits, lstar[:, None, :], axis=1)[:, 0, :]
    m = z + b[None, :]
    m = np.where(empty[:, None], 0.0, m)  # all-masked rows: out = 0
    with np.errstate(invalid="ignore"):
        r = np.maximum(m, 0.0)  # NaN propagates
        active = m > 0.0
    if activation == "relu":
        out = r
        dact = active.astype(np.float64)
    else:
        out = np.log1p(r)
        with np.errstate(divide="ignore", invalid="ignore"):
            dact = np.where(active, 1.0 / (1.0 + r), 0.0)

    go = np.ones((nb, nv)) if grad_out is None else _f64(grad_out)
    go = np.broadcast_to(go, (nb, nv))
    g = go * dact  # (B, V); 0 where inactive or all-masked

    # Per-entry contributions g[b, v] * weight[v] and g[b, v] * x[b, l*]: an
    # entry with g = 0 contributes exactly 0 (as in a backward that touches
    # only the active entries), so a NaN / inf in a masked or losing position
    # never leaks into the gradients.
    dead = g == 0.0  # (B, V)
    onehot = np.arange(nl)[None, :, None] == lstar[:, None, :]  # (B, L, V)
    onehot = onehot.astype(np.float64)
    with np.errstate(invalid="ignore"):
        c = g[:, :, None] * w[None, :, :]  # (B, V, D): g[b, v] * weight[v]
        c[dead] = 0.0
        dx = onehot @ c  # (B, L, V) @ (B, V, D): to the winning positions
        del c, onehot
        c = x[np.arange(nb)[:, None], lstar]  # (B, V, D): x[b, l*(b, v)]
        c *= g[:, :, None]
        c[dead] = 0.0
    dw = c.sum(axis=0)
    db = None if bias is None else g.sum(axis=0)
    return out, (dx, dw, db)


def flops_regularizer(
    out: ArrayLike, grad: Optional[ArrayLike] = None
) -> Tuple[np.float64, np.ndarray]:
    """SPLADE's FLOPS regulariser and its gradient.

    ::

        value        = sum_v (mean_b out[b, v])^2
        dvalue/dout  = grad * 2 * mean_b(out[:, v]) / B      (broadcast over b)

    Parameters
    ----------
    out : array_like, shape (B, V)
    grad : float or 0-d array_like, optional
        Upstream gradient of the scalar; ``None`` means 1.

    Returns
    -------
    value : float64 scalar
    dout : ndarray, shape (B, V), float64
    """
    o = _f64(out)
    if o.ndim != 2:
        raise ValueError(f"out must have shape (B, V), got {o.shape}")
    nb = o.shape[0]
    mean = o.mean(axis=0)  # (V,)
    value = np.float64(np.sum(mean * mean))
    g = 1.0 if grad is None else float(_f64(grad).reshape(()))
    dout = np.broadcast_to(g * 2.0 * mean / nb, o.shape).copy()
    return value, dout
