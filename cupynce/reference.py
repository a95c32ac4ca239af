"""Float64 NumPy reference implementations (the oracle) of the cupynce losses.

This module is the ground truth that the test-suite and the accuracy report
compare the fast CuPy kernels against.  It is deliberately simple: every
function builds the full dense similarity matrix in float64, uses a plain
max-shifted log-sum-exp, and writes the gradient in closed form.  There is no
blocking, no fusion and no other trick, so that each line can be checked
against the formula in its docstring.

Whatever dtype the inputs have (float16, float32, ``ml_dtypes.bfloat16``,
float64, ...), they are first cast with ``np.asarray(x).astype(np.float64)``;
all computation and all results are float64.

Every loss returns ``(loss, grads)``, where ``grads`` are the gradients of
``sum(grad_loss * loss)`` with respect to the inputs.  The SPLADE head
(:func:`splade_pool`) likewise returns ``(out, grads)``, the gradients of
``sum(grad_out * out)``, from the dense (B, L, V) logits and a dense one-hot
of the arg-max; :func:`flops_regularizer` returns ``(value, dout)``.
``grad_loss`` is the
upstream gradient: a scalar for ``reduction="mean"``/``"sum"`` and a scalar or
an ``(N,)`` array for ``reduction="none"``; ``None`` means 1.

Notation used below: ``N`` rows, ``D`` features, ``t`` temperature,
``lse`` log-sum-exp, ``softmax`` taken over the same candidates as the
``lse``.  For a cross-entropy row ``loss_i = lse_j(L_ij) - L_i,pos(i)`` the
gradient with respect to the logits is ``w_i * (softmax_ij - onehot_ij)``,
where ``w_i`` is the weight of row ``i`` in the reduction times
``grad_loss``.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "REDUCTIONS",
    "l2_normalize",
    "l2_normalize_backward",
    "nt_xent",
    "info_nce",
    "clip_loss",
    "siglip_loss",
    "SPLADE_ACTIVATIONS",
    "splade_logits",
    "splade_argmax",
    "splade_pool",
    "flops_regularizer",
]

REDUCTIONS = ("mean", "sum", "none")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")

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
