"""The InfoNCE family in float64 (the oracle): NT-Xent, InfoNCE, CLIP and SigLIP."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike

from ._common import (Loss, _check_reduction, _f64, _logsumexp, _reduce, _row_weights,
                      l2_normalize, l2_normalize_backward)


# --------------------------------------------------------------------------
# NT-Xent (SimCLR)
# --------------------------------------------------------------------------


def nt_xent(
    z: ArrayLike,
    temperature: float = 0.5,
    *,
    reduction: str = "mean",
    normalize: bool = False,
    grad_loss: Optional[ArrayLike] = None,
) -> Tuple[Loss, Tuple[np.ndarray]]:
    """NT-Xent (normalised temperature-scaled cross entropy) loss of SimCLR.

    ``z`` stacks two views: rows ``i`` and ``i + B`` (mod ``2B``) are a
    positive pair.  With ``zn = l2_normalize(z)`` if ``normalize`` else ``z``::

        S_ij   = zn_i . zn_j / t            (S_ii excluded, i.e. -inf)
        loss_i = lse_{j != i} S_ij - S_{i, pos(i)},   pos(i) = (i + B) mod 2B

    Gradient::

        G_ij = w_i (softmax_ij - [j == pos(i)]),  G_ii = 0
        dzn  = (G + G^T) zn / t
        dz   = l2_normalize_backward(z, dzn)   if normalize else dzn

    Parameters
    ----------
    z : array_like, shape (2B, D)
    temperature : float
    reduction : {"mean", "sum", "none"}
        Mean or sum over the 2B rows, or the (2B,) per-row losses.
    normalize : bool
        L2-normalise the rows first (``F.normalize`` semantics, eps 1e-12).
    grad_loss : float or array_like of shape (2B,), optional
        Upstream gradient; ``None`` means 1.

    Returns
    -------
    loss : float64 scalar, or ndarray of shape (2B,) for ``"none"``
    grads : tuple ``(dz,)`` with ``dz`` of shape (2B, D)
    """
    _check_reduction(reduction)
    z = _f64(z)
    if z.ndim != 2 or z.shape[0] % 2 != 0:
        raise ValueError(f"z must have shape (2B, D), got {z.shape}")
    n = z.shape[0]
    b = n // 2
    t = float(temperature)
    rows = np.arange(n)
    pos = (rows + b) % n

    zn = l2_normalize(z) if normalize else z
    s = zn @ zn.T / t
    s[rows, rows] = -np.inf

    lse = _logsumexp(s, axis=1)
    per_row = lse - s[rows, pos]
    loss = _reduce(per_row, reduction)

    w = _row_weights(reduction, grad_loss, n)
    g = np.exp(s - lse[:, None])  # softmax, exactly 0 on the diagonal
    g[rows, pos] -= 1.0
    g *= w[:, None]
    dzn = (g + g.T) @ zn / t
    dz = l2_normalize_backward(z, dzn) if normalize else dzn
    return loss, (dz,)


# --------------------------------------------------------------------------
# InfoNCE
# --------------------------------------------------------------------------


def info_nce(
    query: ArrayLike,
    key: ArrayLike,
    temperature: float = 0.1,
    *,
    negatives: Optional[ArrayLike] = None,
    reduction: str = "mean",
    normalize: bool = False,
    grad_loss: Optional[ArrayLike] = None,
) -> Tuple[Loss, Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]:
    """InfoNCE loss with in-batch negatives and optional extra negatives.

    Query ``i`` is scored against every key (key ``i`` is its positive, the
    others are in-batch negatives) and, if given, against extra negatives:

    - ``negatives`` of shape (M, D) ("shared"): the same M negatives for all
      queries, ``Ln_im = q_i . n_m / t``;
    - ``negatives`` of shape (N, M, D) ("paired"): query ``i`` gets its own
      ``negatives[i]``, ``Ln_im = q_i . n_im / t``.

    With ``Lk_ij = q_i . k_j / t`` and ``L_i = [Lk_i, Ln_i]`` (N + M logits)::

        loss_i = lse(L_i) - Lk_ii

    Gradient, with ``G = w_i (softmax(L_i) - onehot(i))`` split as
    ``[Gk (N, N), Gn (N, M)]``::

        dq = (Gk k + Gn n) / t            (paired: dq_i += sum_m Gn_im n_im / t)
        dk = Gk^T q / t
        dn = Gn^T q / t                    (paired: dn_im = Gn_im q_i / t)

    followed by :func:`l2_normalize_backward` for each input if ``normalize``.

    Parameters
    ----------
    query, key : array_like, shape (N, D)
        Paired by row.
    temperature : float
    negatives : array_like, shape (M, D) or (N, M, D), optional
    reduction : {"mean", "sum", "none"}
    normalize : bool
        L2-normalise query, key and negatives along D first.
    grad_loss : float or array_like of shape (N,), optional
        Upstream gradient; ``None`` means 1.

    Returns
    -------
    loss : float64 scalar, or ndarray of shape (N,) for ``"none"``
    grads : tuple ``(dquery, dkey, dnegatives)``; ``dnegatives`` is ``None``
        when ``negatives`` is ``None``, else it has the shape of ``negatives``.
    """
    _check_reduction(reduction)
    q = _f64(query)
    k = _f64(key)
    n = q.shape[0]
    t = float(temperature)
    rows = np.arange(n)

    neg = None if negatives is None else _f64(negatives)
    if neg is not None and neg.ndim not in (2, 3):
        raise ValueError(
            f"negatives must have shape (M, D) or (N, M, D), got {neg.shape}"
        )
    paired = neg is not None and neg.ndim == 3

    qn = l2_normalize(q) if normalize else q
    kn = l2_normalize(k) if normalize else k
    negn = None
    if neg is not None:
        negn = l2_normalize(neg) if normalize else neg

    logits_k = qn @ kn.T / t  # (N, N)
    if negn is None:
        logits = logits_k
    elif paired:
        logits = np.concatenate(
            [logits_k, np.einsum("nd,nmd->nm", qn, negn) / t], axis=1
        )
    else:
        logits = np.concatenate([logits_k, qn @ negn.T / t], axis=1)

    lse = _logsumexp(logits, axis=1)
    per_row = lse - logits_k[rows, rows]
    loss = _reduce(per_row, reduction)

    w = _row_weights(reduction, grad_loss, n)
    g = np.exp(logits - lse[:, None])  # softmax over the N + M candidates
    g[rows, rows] -= 1.0
    g *= w[:, None]
    g_k, g_n = g[:, :n], g[:, n:]

    dqn = g_k @ kn / t
    dkn = g_k.T @ qn / t
    dnegn = None
    if negn is not None:
        if paired:
            dqn += np.einsum("nm,nmd->nd", g_n, negn) / t
            dnegn = g_n[:, :, None] * qn[:, None, :] / t
        else:
            dqn += g_n @ negn / t
            dnegn = g_n.T @ qn / t

    if normalize:
        dq = l2_normalize_backward(q, dqn)
        dk = l2_normalize_backward(k, dkn)
        dneg = None if neg is None else l2_normalize_backward(neg, dnegn)
    else:
        dq, dk, dneg = dqn, dkn, dnegn
    return loss, (dq, dk, dneg)


# --------------------------------------------------------------------------
# CLIP
# --------------------------------------------------------------------------


def clip_loss(
    a: ArrayLike,
    b: ArrayLike,
    logit_scale: ArrayLike,
    *,
    reduction: str = "mean",
    normalize: bool = False,
    grad_loss: Optional[ArrayLike] = None,
) -> Tuple[Loss, Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Symmetric CLIP loss with a learnable log-scale.

    With ``s = exp(logit_scale)`` and ``L = s a b^T`` (after optional
    L2-normalisation of ``a`` and ``b``)::

        row_i  = lse_j L_ij - L_ii          (CE of row i, label i)
        col_j  = lse_i L_ij - L_jj          (CE of column j, label j)
        loss_i = (row_i + col_i) / 2

    so the ``"mean"`` loss equals
    ``(F.cross_entropy(L, arange(N)) + F.cross_entropy(L.T, arange(N))) / 2``.

    Gradient, with ``R`` / ``C`` the row-wise / column-wise softmax of L::

        G_ij          = (w_i (R_ij - [i == j]) + w_j (C_ij - [i == j])) / 2
        da            = s G b,   db = s G^T a
        dlogit_scale  = sum_ij G_ij L_ij

    followed by :func:`l2_normalize_backward` for ``a`` and ``b`` if
    ``normalize``.

    Parameters
    ----------
    a, b : array_like, shape (N, D)
        Paired by row (e.g. image and text embeddings).
    logit_scale : float or array_like of size 1
        Log of the logit scale (the scale is ``exp(logit_scale)``).
    reduction : {"mean", "sum", "none"}
        Over the N per-pair losses.
    normalize : bool
    grad_loss : float or array_like of shape (N,), optional
        Upstream gradient; ``None`` means 1.

    Returns
    -------
    loss : float64 scalar, or ndarray of shape (N,) for ``"none"``
    grads : tuple ``(da, db, dlogit_scale)``; ``dlogit_scale`` is a float64
        array of the shape of ``np.asarray(logit_scale)``.
    """
    _check_reduction(reduction)
    a = _f64(a)
    b = _f64(b)
    ls = _f64(logit_scale)
    if ls.size != 1:
        raise ValueError(f"logit_scale must have size 1, got shape {ls.shape}")
    n = a.shape[0]
    rows = np.arange(n)
    eye = np.eye(n)

    an = l2_normalize(a) if normalize else a
    bn = l2_normalize(b) if normalize else b
    s = float(np.exp(ls.reshape(())))
    logits = s * (an @ bn.T)

    lse_row = _logsumexp(logits, axis=1)  # over j, for each row i
    lse_col = _logsumexp(logits, axis=0)  # over i, for each column j
    diag = logits[rows, rows]
    per_pair = 0.5 * ((lse_row - diag) + (lse_col - diag))
    loss = _reduce(per_pair, reduction)

    w = _row_weights(reduction, grad_loss, n)
    soft_row = np.exp(logits - lse_row[:, None])
    soft_col = np.exp(logits - lse_col[None, :])
    g = 0.5 * (w[:, None] * (soft_row - eye) + w[None, :] * (soft_col - eye))

    dan = s * (g @ bn)
    dbn = s * (g.T @ an)
    dlogit_scale = np.full(ls.shape, np.sum(g * logits))

    if normalize:
        da = l2_normalize_backward(a, dan)
        db = l2_normalize_backward(b, dbn)
    else:
        da, db = dan, dbn
    return loss, (da, db, dlogit_scale)


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    """``log σ(x) = −softplus(−x)``, stable for any finite x (NaN stays NaN)."""
    return -np.logaddexp(0.0, -x)


def siglip_loss(
    a: ArrayLike,
    b: ArrayLike,
    logit_scale: ArrayLike,
    logit_bias: ArrayLike,
    *,
    reduction: str = "mean",
    normalize: bool = False,
    grad_loss: Optional[ArrayLike] = None,
) -> Tuple[Loss, Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """SigLIP's pairwise sigmoid loss with a learnable log-scale and bias.

    With ``s = exp(logit_scale)``, ``β = logit_bias`` and ``L = s a b^T + β`` (after optional
    L2-normalisation of ``a`` and ``b``), labels ``z_ij = +1`` for ``i == j`` and ``-1``
    otherwise::

        row_i = sum_j -log σ(z_ij L_ij)          (the pairs of row i)

    ``"mean"`` is ``sum_i row_i / N`` (open_clip's and big_vision's normalisation: the sum over
    all N² pairs divided by the batch size), ``"sum"`` is ``sum_i row_i``, ``"none"`` the rows.

    Gradient, with ``w_i`` the weight of row i (:func:`_row_weights`)::

        G_ij          = -w_i z_ij σ(-z_ij L_ij)
        da            = s G b,   db = s G^T a
        dlogit_scale  = sum_ij G_ij (L_ij - β)
        dlogit_bias   = sum_ij G_ij

    followed by :func:`l2_normalize_backward` for ``a`` and ``b`` if ``normalize``.

    Parameters
    ----------
    a, b : array_like, shape (N, D)
        Paired by row (e.g. image and text embeddings).
    logit_scale, logit_bias : float or array_like of size 1
    reduction : {"mean", "sum", "none"}
    normalize : bool
    grad_loss : float or array_like of shape (N,), optional
        Upstream gradient; ``None`` means 1.

    Returns
    -------
    loss : float64 scalar, or ndarray of shape (N,) for ``"none"``
    grads : tuple ``(da, db, dlogit_scale, dlogit_bias)``; the last two are float64 arrays of
        the shapes of ``np.asarray(logit_scale)`` and ``np.asarray(logit_bias)``.
    """
    _check_reduction(reduction)
    a = _f64(a)
    b = _f64(b)
    ls = _f64(logit_scale)
    lb = _f64(logit_bias)
    for name, v in (("logit_scale", ls), ("logit_bias", lb)):
        if v.size != 1:
            raise ValueError(f"{name} must have size 1, got shape {v.shape}")
    n = a.shape[0]
    z = 2.0 * np.eye(n) - 1.0

    an = l2_normalize(a) if normalize else a
    bn = l2_normalize(b) if normalize else b
    s = float(np.exp(ls.reshape(())))
    beta = float(lb.reshape(()))
    logits = s * (an @ bn.T) + beta

    per_row = -np.sum(_log_sigmoid(z * logits), axis=1)
    loss = _reduce(per_row, reduction)

    w = _row_weights(reduction, grad_loss, n)
    g = -w[:, None] * z * np.exp(_log_sigmoid(-z * logits))

    dan = s * (g @ bn)
    dbn = s * (g.T @ an)
    dlogit_scale = np.full(ls.shape, np.sum(g * (logits - beta)))
    dlogit_bias = np.full(lb.shape, np.sum(g))

    if normalize:
        da = l2_normalize_backward(a, dan)
        db = l2_normalize_backward(b, dbn)
    else:
        da, db = dan, dbn
    return loss, (da, db, dlogit_scale, dlogit_bias)
