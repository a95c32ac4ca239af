"""The InfoNCE family in float64 (the oracle): NT-Xent, SupCon, InfoNCE, CLIP and SigLIP."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike

from ._common import (Loss, _check_reduction, _f64, _logsumexp, _reduce, _row_weights,
                      l2_normalize, l2_normalize_backward)


# --------------------------------------------------------------------------
# cross-entropy rows over candidate sets (labels=, label_smoothing=, SupCon)
# --------------------------------------------------------------------------


def _check_smoothing(label_smoothing: float) -> float:
    e = float(label_smoothing)
    if not 0.0 <= e < 1.0:  # (NaN fails too)
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    return e


def _same_label(labels: Optional[ArrayLike], n: int) -> Optional[np.ndarray]:
    """``labels_i == labels_j`` as an (n, n) bool matrix (None: no labels)."""
    if labels is None:
        return None
    lab = np.asarray(labels)
    if lab.shape != (n,) or lab.dtype.kind not in "iu":
        raise ValueError(f"labels must be an integer array of shape ({n},), got "
                         f"{lab.dtype} of shape {lab.shape}")
    return lab[:, None] == lab[None, :]


def _target(keep: np.ndarray, pos: np.ndarray, eps: float) -> np.ndarray:
    """Each row's target distribution: ``1 - eps`` on its positive column ``pos[i]`` and
    ``eps`` spread evenly over its candidates ``keep[i]`` (the positive among them), as
    ``F.cross_entropy(label_smoothing=eps)`` spreads it over the classes."""
    t = eps * keep / keep.sum(axis=1, keepdims=True)
    t[np.arange(len(pos)), pos] += 1.0 - eps
    return t


def _ce_rows(logits: np.ndarray, keep: np.ndarray, target: np.ndarray,
             w: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Cross entropy of each row over its candidates against a target distribution::

        per_row_i = lse_{j : keep_ij} L_ij - sum_j T_ij L_ij
        G_ij      = w_i (softmax_ij - T_ij)         (0 where not keep_ij)

    (``T`` is 0 outside ``keep``.)  Returns ``(per_row, G)``."""
    masked = np.where(keep, logits, -np.inf)
    lse = _logsumexp(masked, axis=1)
    # (only where the target has mass: a zero-target column adds nothing, an infinite logit
    # there included)
    with np.errstate(invalid="ignore"):
        per_row = lse - np.sum(np.where(keep & (target != 0), target * logits, 0.0), axis=1)
    g = w[:, None] * (np.exp(masked - lse[:, None]) - target)
    return per_row, g


def _dtemperature(g: np.ndarray, logits: np.ndarray, keep: np.ndarray,
                  temperature: ArrayLike) -> np.ndarray:
    """dL/dt for logits ``L = S / t``: ``-sum_ij G_ij L_ij / t``, in the shape of ``t``."""
    t = _f64(temperature)
    with np.errstate(invalid="ignore"):
        total = np.sum(np.where(keep & (g != 0), g * logits, 0.0))
    return np.full(t.shape, -total / float(t.reshape(())))


# --------------------------------------------------------------------------
# NT-Xent (SimCLR)
# --------------------------------------------------------------------------


def nt_xent(
    z: ArrayLike,
    temperature: ArrayLike = 0.5,
    *,
    reduction: str = "mean",
    normalize: bool = False,
    label_smoothing: float = 0.0,
    grad_loss: Optional[ArrayLike] = None,
    temperature_grad: bool = False,
) -> Tuple[Loss, Tuple[np.ndarray, ...]]:
    """NT-Xent (normalised temperature-scaled cross entropy) loss of SimCLR.

    ``z`` stacks two views: rows ``i`` and ``i + B`` (mod ``2B``) are a
    positive pair.  With ``zn = l2_normalize(z)`` if ``normalize`` else ``z``::

        S_ij   = zn_i . zn_j / t            (S_ii excluded, i.e. -inf)
        loss_i = lse_{j != i} S_ij - sum_j T_ij S_ij

    where ``T_i`` is the one-hot of ``pos(i) = (i + B) mod 2B`` smoothed by
    ``eps = label_smoothing``: ``(1 - eps)`` on ``pos(i)`` plus ``eps / (2B - 1)`` on
    every ``j != i`` (``F.cross_entropy``'s smoothing over the row's candidates).

    Gradient::

        G_ij = w_i (softmax_ij - T_ij),  G_ii = 0
        dzn  = (G + G^T) zn / t
        dz   = l2_normalize_backward(z, dzn)   if normalize else dzn
        dt   = -sum_ij G_ij S_ij / t

    Parameters
    ----------
    z : array_like, shape (2B, D)
    temperature : float or array_like of size 1
    reduction : {"mean", "sum", "none"}
        Mean or sum over the 2B rows, or the (2B,) per-row losses.
    normalize : bool
        L2-normalise the rows first (``F.normalize`` semantics, eps 1e-12).
    label_smoothing : float in [0, 1)
    grad_loss : float or array_like of shape (2B,), optional
        Upstream gradient; ``None`` means 1.
    temperature_grad : bool
        Also return ``dt`` (an array of the temperature's shape).

    Returns
    -------
    loss : float64 scalar, or ndarray of shape (2B,) for ``"none"``
    grads : tuple ``(dz,)``, or ``(dz, dt)`` with ``temperature_grad``
    """
    _check_reduction(reduction)
    eps = _check_smoothing(label_smoothing)
    z = _f64(z)
    if z.ndim != 2 or z.shape[0] % 2 != 0:
        raise ValueError(f"z must have shape (2B, D), got {z.shape}")
    n = z.shape[0]
    b = n // 2
    t = float(_f64(temperature).reshape(()))
    rows = np.arange(n)
    pos = (rows + b) % n

    zn = l2_normalize(z) if normalize else z
    s = zn @ zn.T / t
    keep = ~np.eye(n, dtype=bool)
    w = _row_weights(reduction, grad_loss, n)
    per_row, g = _ce_rows(s, keep, _target(keep, pos, eps), w)
    loss = _reduce(per_row, reduction)

    dzn = (g + g.T) @ zn / t
    dz = l2_normalize_backward(z, dzn) if normalize else dzn
    if temperature_grad:
        return loss, (dz, _dtemperature(g, s, keep, temperature))
    return loss, (dz,)


# --------------------------------------------------------------------------
# SupCon (Khosla et al. 2020, L_out)
# --------------------------------------------------------------------------


def supcon_loss(
    z: ArrayLike,
    labels: ArrayLike,
    temperature: ArrayLike = 0.1,
    *,
    reduction: str = "mean",
    normalize: bool = False,
    grad_loss: Optional[ArrayLike] = None,
    temperature_grad: bool = False,
) -> Tuple[Loss, Tuple[np.ndarray, ...]]:
    """Supervised contrastive loss (Khosla et al. 2020, ``L_out``).

    ``z`` stacks every view, ``labels`` (N,) integers.  With ``zn`` as in :func:`nt_xent`,
    ``S_ij = zn_i . zn_j / t`` and ``P(i) = {p != i : labels_p == labels_i}``::

        loss_i = lse_{a != i} S_ia - (1 / |P(i)|) sum_{p in P(i)} S_ip

    Anchors without a positive (``|P(i)| = 0``) are left out: ``"mean"`` averages over the
    anchors that have one (0, with a zero gradient, when none has), ``"sum"`` sums those,
    ``"none"`` gives the others 0.

    Gradient, ``T_ij = [j in P(i)] / |P(i)|`` and ``w_i`` the row weight (0 for an anchor
    without a positive)::

        G_ij = w_i (softmax_ij - T_ij),  G_ii = 0
        dzn  = (G + G^T) zn / t,   dt = -sum_ij G_ij S_ij / t

    Parameters
    ----------
    z : array_like, shape (N, D)
    labels : integer array_like, shape (N,)
    temperature : float or array_like of size 1
    reduction : {"mean", "sum", "none"}
    normalize : bool
    grad_loss : float or array_like of shape (N,), optional
    temperature_grad : bool
        Also return ``dt``.

    Returns
    -------
    loss : float64 scalar, or ndarray of shape (N,) for ``"none"``
    grads : tuple ``(dz,)``, or ``(dz, dt)`` with ``temperature_grad``
    """
    _check_reduction(reduction)
    z = _f64(z)
    if z.ndim != 2:
        raise ValueError(f"z must have shape (N, D), got {z.shape}")
    n = z.shape[0]
    same = _same_label(labels, n)
    t = float(_f64(temperature).reshape(()))

    zn = l2_normalize(z) if normalize else z
    s = zn @ zn.T / t
    keep = ~np.eye(n, dtype=bool)
    positive = same & keep
    count = positive.sum(axis=1)
    has = count > 0
    target = positive / np.maximum(count, 1)[:, None]
    if reduction == "mean":
        w = _row_weights("sum", grad_loss, n) / max(int(has.sum()), 1)
    else:
        w = _row_weights(reduction, grad_loss, n)
    w = np.where(has, w, 0.0)
    per_row, g = _ce_rows(s, keep, target, w)
    per_row = np.where(has, per_row, 0.0)
    if reduction == "mean":
        loss: Loss = np.float64(per_row.sum() / max(int(has.sum()), 1))
    else:
        loss = _reduce(per_row, reduction)

    dzn = (g + g.T) @ zn / t
    dz = l2_normalize_backward(z, dzn) if normalize else dzn
    if temperature_grad:
        return loss, (dz, _dtemperature(g, s, keep, temperature))
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
    labels: Optional[ArrayLike] = None,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    normalize: bool = False,
    grad_loss: Optional[ArrayLike] = None,
    temperature_grad: bool = False,
    hardness_mode: Optional[str] = None,
    hardness_strength: float = 0.0,
) -> Tuple[Loss, Tuple[Optional[np.ndarray], ...]]:
    """InfoNCE loss with in-batch negatives and optional extra negatives.

    Query ``i`` is scored against every key (key ``i`` is its positive, the
    others are in-batch negatives) and, if given, against extra negatives:

    - ``negatives`` of shape (M, D) ("shared"): the same M negatives for all
      queries, ``Ln_im = q_i . n_m / t``;
    - ``negatives`` of shape (N, M, D) ("paired"): query ``i`` gets its own
      ``negatives[i]``, ``Ln_im = q_i . n_im / t``.

    With ``Lk_ij = q_i . k_j / t`` and ``L_i = [Lk_i, Ln_i]`` (N + M logits)::

        loss_i = lse_{C(i)} L_i - sum_j T_ij L_ij

    over row i's candidates ``C(i)``: every key and negative, less (with ``labels``) the keys
    ``j != i`` whose label is row i's (not negatives of row i; the explicit negatives stay).
    ``T_i``: the one-hot of key i, smoothed by ``eps = label_smoothing`` over ``C(i)`` (as
    :func:`nt_xent`'s).

    Hardness weighting (sentence-transformers' ``hardness_mode``, strength ``a``): a
    penalised logit is ``L_ij + a * S_ij`` with the penalty held constant (its gradient
    dropped), ``S_ij`` the unscaled score.  Own candidates of row i: shared negatives
    ``m`` with ``m % N == i`` and every paired negative; penalised are, for
    "in_batch_negatives", the candidates that are neither key i nor own; for
    "hard_negatives" the own ones; for "all_negatives" all but key i.

    Gradient, with ``G = w_i (softmax_{C(i)}(L_i) - T_i)`` (0 outside ``C(i)``) split as
    ``[Gk (N, N), Gn (N, M)]``, and ``dt = -sum_ij G_ij L_ij / t``::

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
    labels : integer array_like, shape (N,), optional
        The rows' labels (query i and key i share label i).
    label_smoothing : float in [0, 1)
    reduction : {"mean", "sum", "none"}
    normalize : bool
        L2-normalise query, key and negatives along D first.
    grad_loss : float or array_like of shape (N,), optional
        Upstream gradient; ``None`` means 1.
    temperature_grad : bool
        Also return ``dt``.

    Returns
    -------
    loss : float64 scalar, or ndarray of shape (N,) for ``"none"``
    grads : tuple ``(dquery, dkey, dnegatives)``, ``+ (dt,)`` with ``temperature_grad``;
        ``dnegatives`` is ``None`` when ``negatives`` is ``None``, else it has the shape of
        ``negatives``.
    """
    _check_reduction(reduction)
    eps = _check_smoothing(label_smoothing)
    q = _f64(query)
    k = _f64(key)
    n = q.shape[0]
    t = float(_f64(temperature).reshape(()))
    rows = np.arange(n)
    same = _same_label(labels, n)

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

    keep = np.ones(logits.shape, dtype=bool)
    if same is not None:
        keep[:, :n] = ~same | np.eye(n, dtype=bool)
    w = _row_weights(reduction, grad_loss, n)
    scored = logits
    if hardness_mode is not None and hardness_strength > 0:
        col = np.arange(logits.shape[1])[None, :]
        own = (col >= n) & (paired | ((col - n) % n == rows[:, None]))
        not_pos = col != rows[:, None]
        pen = {"in_batch_negatives": not_pos & ~own, "hard_negatives": own,
               "all_negatives": not_pos}[hardness_mode]
        scored = logits + np.where(pen, hardness_strength * logits * t, 0.0)
    per_row, g = _ce_rows(scored, keep, _target(keep, rows, eps), w)
    loss = _reduce(per_row, reduction)
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
    if temperature_grad:
        return loss, (dq, dk, dneg, _dtemperature(g, logits, keep, temperature))
    return loss, (dq, dk, dneg)


def nt_xent_pairs(z: ArrayLike, labels: ArrayLike, temperature: ArrayLike = 0.07, *,
                  reduction: str = "mean", normalize: bool = False,
                  grad_loss: Optional[ArrayLike] = None, temperature_grad: bool = False
                  ) -> Tuple[Loss, Tuple[np.ndarray, ...]]:
    """NT-Xent over every positive pair of labels (pytorch-metric-learning's NTXentLoss),
    pair by pair.  With ``L = zn zn^T / t``, each pair (i, p), p != i, labels equal::

        l_ip = -log( exp(L_ip) / (exp(L_ip) + sum_{n: y_n != y_i} exp(L_in)) )

    "mean" over the pairs (0 without one), "sum", "none": each row's sum over its pairs.
    Gradient pair by pair: with q = the pair's softmax over [p, negatives],
    ``dl_ip/dL_ip = q_p - 1``, ``dl_ip/dL_in = q_n``.

    Returns ``loss, (dz,)`` (``+ (dt,)`` with ``temperature_grad``).
    """
    _check_reduction(reduction)
    z0 = _f64(z)
    y = np.asarray(labels).reshape(-1)
    n = z0.shape[0]
    t = float(_f64(temperature).reshape(()))
    zn = l2_normalize(z0) if normalize else z0
    logits = zn @ zn.T / t
    rows = np.zeros(n)
    g = np.zeros((n, n))
    count = 0
    gl = None if grad_loss is None else np.asarray(grad_loss, np.float64)
    for i in range(n):
        negs = np.flatnonzero(y != y[i])
        for p in np.flatnonzero(y == y[i]):
            if p == i:
                continue
            count += 1
            cand = np.concatenate([[logits[i, p]], logits[i, negs]])
            m = cand.max()
            lse = m + np.log(np.exp(cand - m).sum())
            rows[i] += lse - logits[i, p]
            q = np.exp(cand - lse)
            w = 1.0 if gl is None or reduction != "none" else gl[i]
            g[i, p] += w * (q[0] - 1.0)
            g[i, negs] += w * q[1:]
    if reduction == "none":
        loss: Loss = rows
    else:
        loss = rows.sum() / (max(count, 1) if reduction == "mean" else 1.0)
        scale = (1.0 / max(count, 1) if reduction == "mean" else 1.0) * \
            (1.0 if gl is None else float(gl))
        g = g * scale
    dzn = (g + g.T) @ zn / t
    dz = l2_normalize_backward(z0, dzn) if normalize else dzn
    if temperature_grad:
        keep = np.ones((n, n), dtype=bool)
        return loss, (dz, _dtemperature(g, logits, keep, temperature))
    return loss, (dz,)


# --------------------------------------------------------------------------
# CLIP
# --------------------------------------------------------------------------


def clip_loss(
    a: ArrayLike,
    b: ArrayLike,
    logit_scale: ArrayLike,
    *,
    labels: Optional[ArrayLike] = None,
    label_smoothing: float = 0.0,
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
    With ``labels``, a pair ``i != j`` of equal labels is no negative in either direction:
    ``L_ij`` leaves row i's and column j's log-sum-exp.  ``label_smoothing = eps``: each
    cross entropy's target is ``1 - eps`` on the diagonal plus ``eps`` spread evenly over
    that row's (column's) candidates, as ``F.cross_entropy(label_smoothing=eps)``.

    Gradient, with ``R`` / ``C`` the row-wise / column-wise softmax of L over the candidates
    and ``T^R`` / ``T^C`` the targets (without labels and smoothing: the identity)::

        G_ij          = (w_i (R_ij - T^R_ij) + w_j (C_ij - T^C_ij)) / 2
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
    labels : integer array_like, shape (N,), optional
        The pairs' labels.
    label_smoothing : float in [0, 1)
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
    eps = _check_smoothing(label_smoothing)
    a = _f64(a)
    b = _f64(b)
    ls = _f64(logit_scale)
    if ls.size != 1:
        raise ValueError(f"logit_scale must have size 1, got shape {ls.shape}")
    n = a.shape[0]
    rows = np.arange(n)
    same = _same_label(labels, n)
    keep = np.ones((n, n), dtype=bool) if same is None else ~same | np.eye(n, dtype=bool)

    an = l2_normalize(a) if normalize else a
    bn = l2_normalize(b) if normalize else b
    s = float(np.exp(ls.reshape(())))
    logits = s * (an @ bn.T)

    w = _row_weights(reduction, grad_loss, n)
    row, g_row = _ce_rows(logits, keep, _target(keep, rows, eps), w)  # over j, each row i
    col, g_col = _ce_rows(logits.T, keep.T, _target(keep.T, rows, eps), w)  # over i, each j
    per_pair = 0.5 * (row + col)
    loss = _reduce(per_pair, reduction)
    g = 0.5 * (g_row + g_col.T)

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
    labels: Optional[ArrayLike] = None,
    reduction: str = "mean",
    normalize: bool = False,
    grad_loss: Optional[ArrayLike] = None,
) -> Tuple[Loss, Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """SigLIP's pairwise sigmoid loss with a learnable log-scale and bias.

    With ``s = exp(logit_scale)``, ``β = logit_bias`` and ``L = s a b^T + β`` (after optional
    L2-normalisation of ``a`` and ``b``), targets ``z_ij = +1`` for ``i == j`` (with
    ``labels``: for ``labels_i == labels_j``) and ``-1`` otherwise::

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
    labels : integer array_like, shape (N,), optional
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
    same = _same_label(labels, n)
    z = 2.0 * (np.eye(n) if same is None else same) - 1.0

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
