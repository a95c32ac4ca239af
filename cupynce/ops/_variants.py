"""The label-aware variants' differences from the plain losses that are O(N·D), not N × N
(docs/design.md, "Label-aware variants"): computed from the rows alone on either array
module, so that every path of the plain loss -- the score tiles included -- serves the
variant unchanged.

NT-Xent's label smoothing (``label_smoothing=ε``): row i's target moves ε from its positive
p(i) = (i + B) mod 2B evenly over its K = 2B − 1 candidates j ≠ i, so with S = ẑ ẑᵀ / τ::

    Δloss_i = ε (S_{i,p(i)} − (1/K) Σ_{j≠i} S_ij)
    ΔG_ij   = w_i (ε [j = p(i)] − (ε/K) [j ≠ i])
    Δ(∂/∂ẑ) = (ΔG + ΔGᵀ) ẑ / τ
            = ε/τ ((w_i + w_{p(i)}) ẑ_{p(i)} − (1/K) (w_i (s − ẑ_i) + s_w − w_i ẑ_i))

with s = Σ_j ẑ_j and s_w = Σ_j w_j ẑ_j (p is its own inverse).

CLIP's label smoothing: each direction's target moves ε from the diagonal evenly over its N
candidates, so with L = σ â b̂ᵀ (σ = exp(logit_scale)), A = Σ â_i, B = Σ b̂_j and
A_w = Σ w_i â_i, B_w = Σ w_j b̂_j::

    Δloss_i        = σ (ε â_i·b̂_i − (ε/2N) (â_i·B + A·b̂_i))
    ΔG_ij          = (ε/2) ((w_i + w_j) [i = j] − (w_i + w_j)/N)
    Δ∂/∂â_i        = σ (ΔG b̂)_i = σ (ε/2) (2 w_i b̂_i − (w_i B + B_w)/N)
    Δ∂/∂b̂_j        = σ (ΔGᵀ â)_j = σ (ε/2) (2 w_j â_j − (A_w + w_j A)/N)
    Δ∂/∂logit_scale = Σ_ij ΔG_ij L_ij = σ (ε Σ_i w_i â_i·b̂_i − (ε/2N) (A_w·B + B_w·A))

The sums run in the accumulator dtype over the rows in order (the array module's
reductions); a device scale is never read on the host.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from .._engine.kernels import acc_dtype


def row_weights(weights) -> Any:
    """The gradient's row weights of a ``weights`` triple (``_base.weights``): a real, a 0-d
    array (a device upstream gradient: never read on the host) or an (N,) array."""
    w_arr, stride, mul = weights
    if w_arr is None:
        return mul
    return (w_arr.reshape(()) if stride == 0 else w_arr) * mul


def _rows(xp, w, b: int):
    """(w as a column, w of each row's positive as a column): scalars stay scalars."""
    if getattr(w, "ndim", 0) == 0:
        return w, w
    return w[:, None], xp.concatenate([w[b:], w[:b]])[:, None]


def nt_xent_smoothing(xp, zn, scale: float, eps: float, w: Optional[Any] = None, *,
                      want_loss: bool = True) -> Tuple[Optional[Any], Optional[Any]]:
    """``(Δloss (N,) or None, Δ∂/∂ẑ (N, D) or None)`` of NT-Xent's label smoothing ε (module
    notes) for the rows ``zn`` (ẑ, as the products use them) and ``scale`` = 1/τ; ``w``: the
    row weights of the gradient (:func:`row_weights`), None for the loss alone;
    ``want_loss=False``: the gradient alone (a backward)."""
    a = acc_dtype(zn.dtype)
    n = zn.shape[0]
    b, k = n // 2, n - 1
    z = zn.astype(a, copy=False)
    zp = xp.concatenate([z[b:], z[:b]])  # ẑ_{p(i)}
    s = z.sum(axis=0)
    dloss = None
    if want_loss:
        other = z @ s - (z * z).sum(axis=1)  # ẑ_i · Σ_{j≠i} ẑ_j
        dloss = (eps * scale) * ((z * zp).sum(axis=1) - other / k)
    if w is None:
        return dloss, None
    wi, wp = _rows(xp, w, b)
    s_w = s * w if getattr(w, "ndim", 0) == 0 else (wi * z).sum(axis=0)
    dacc = (eps * scale) * ((wi + wp) * zp - (wi * (s - z) + (s_w - wi * z)) / k)
    return dloss, dacc


def clip_smoothing(xp, an, bn, ls, eps: float, w: Optional[Any] = None, *,
                   want_loss: bool = True):
    """``(Δloss (N,) or None, (Δ∂/∂â, Δ∂/∂b̂, Δ∂/∂logit_scale) or None)`` of CLIP's label
    smoothing ε (module notes) for ``an``, ``bn`` (â, b̂ as the products use them) and ``ls``
    (the (1,) log scale array, or a real); ``w`` and ``want_loss`` as
    :func:`nt_xent_smoothing`'s."""
    a = acc_dtype(an.dtype)
    n = an.shape[0]
    x, y = an.astype(a, copy=False), bn.astype(a, copy=False)
    sigma = xp.exp(xp.asarray(ls, dtype=a).reshape(()))
    sa, sb = x.sum(axis=0), y.sum(axis=0)
    diag = (x * y).sum(axis=1)
    dloss = sigma * (eps * diag - (eps / (2 * n)) * (x @ sb + y @ sa)) if want_loss else None
    if w is None:
        return dloss, None
    scalar = getattr(w, "ndim", 0) == 0
    wc = w if scalar else w[:, None]
    aw = sa * w if scalar else (wc * x).sum(axis=0)
    bw = sb * w if scalar else (wc * y).sum(axis=0)
    da = (sigma * eps / 2) * (2 * wc * y - (wc * sb + bw) / n)
    db = (sigma * eps / 2) * (2 * wc * x - (aw + wc * sa) / n)
    wd = (w * diag).sum() if not scalar else w * diag.sum()
    dscale = sigma * (eps * wd - (eps / (2 * n)) * (aw @ sb + bw @ sa))
    return dloss, (da, db, dscale)
