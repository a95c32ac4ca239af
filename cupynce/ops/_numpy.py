"""The NumPy path of the InfoNCE family: the GPU engine's primitives, vectorised per row block.

Same algorithm and accumulation dtypes as ``cupynce._engine`` (float32 scores and
accumulators, float64 for float64 inputs); results agree with the GPU to rounding.  The score
blocks of :func:`rows` run on ``_cpu.current()``: NumPy, or torch inside ``cupynce.torch``'s
CPU calls (``_cpu``).  CLIP's
NumPy path lives in ``clip.py`` (it keeps the N x N matrix: CPU memory, small N).
"""
from __future__ import annotations

import numpy as np

from .._engine.arrays import NORM_EPS
from .._engine.kernels import acc_dtype
from . import _cpu

#: Workspace for the NumPy path's score blocks when the caller gives none (bytes).
NUMPY_WORKSPACE_BYTES = 256 << 20


def exp_lse(xp, s, axis: int = 1):
    """In place: ``s <- exp(s - m)``, m the max along ``axis`` (rows: 1, columns: 0), on
    namespace ``xp`` (``_cpu``).

    Returns ``(lse, inv)``: the log-sum-exps along ``axis`` -- NaN for a row (column) holding
    NaN or +inf, -inf for one of -inf only, as the CUDA kernels -- and ``inv``, ``1 / sum
    exp(s - m)`` with the reduced axis kept (NaN for those rows), so that ``s * inv`` is the
    softmax (no second exponential)."""
    m = xp.nan_to_num(xp.amax(s, axis=axis, keepdims=True), nan=0.0, posinf=0.0, neginf=0.0)
    s -= m
    with xp.errstate(over="ignore", invalid="ignore", divide="ignore"):
        xp.exp(s, out=s)
        total = xp.sum(s, axis=axis, keepdims=True)  # in [1, n] for a finite max; 0 for -inf
        total = xp.where(total == float("inf"), float("nan"), total)  # (a +inf score: NaN)
        inv = xp.reciprocal(total)
        lse = xp.log(total, out=total)
    lse += m
    return (lse[:, 0] if axis == 1 else lse[0]), inv


def row_lse(x):
    """Row log-sum-exp of a NumPy array; NaN for a row holding NaN or +inf (as the CUDA
    kernel)."""
    return exp_lse(_cpu.NUMPY, x.copy())[0]


def col_state(x):
    """The columns' (m, s) state (2, Nc) of a logits block x (rows × Nc): m the column max,
    s = Σ exp(x − m) (as the GPU's Lse state; NaN / +inf columns give NaN)."""
    m = np.max(x, axis=0)
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.sum(np.exp(x - np.where(np.isfinite(m), m, 0)[None, :]), axis=0)
    s = np.where(np.isfinite(m), s, np.where(np.isnan(m) | (m > 0), np.nan, 0))
    return np.stack([m, s]).astype(x.dtype, copy=False)


def col_lse(states):
    """The column log-sum-exps (Nc,) of P row sets' states (P, 2, Nc), merged in set order."""
    m, s = states[:, 0], states[:, 1]
    top = np.max(m, axis=0)
    shift = np.where(np.isfinite(top), top, 0)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        total = np.zeros_like(top)
        for p in range(states.shape[0]):  # fixed order, as the kernel
            total = total + s[p] * np.exp(m[p] - shift)
        out = shift + np.log(total)
    bad = np.isnan(top) | np.isnan(total) | (np.isinf(top) & (top > 0))
    return np.where(bad, np.nan, out).astype(states.dtype, copy=False)


def pair_dots(an, bn):
    """The raw dots a_i · b_i (n,) in the accumulator dtype."""
    a = acc_dtype(an.dtype)
    return np.einsum("ij,ij->i", an.astype(a), bn.astype(a))


def rows(q, k, neg_s, neg_p, scale: float, *, exclude_diag: bool, pos_shift: int,
         pos_mod: int, lse_in, weights, want_grad: bool, workspace_bytes, op: str,
         self_pair: bool = False, scale_log=None, labels=None, smoothing: float = 0.0,
         hardness=None, pair_labels=None, pair_row0: int = 0, col_grads: bool = True,
         positives: bool = True):
    """``cupynce._engine.rows`` on the CPU: the same arguments and results, the score
    matrix in row blocks of at most ``workspace_bytes`` (default ``NUMPY_WORKSPACE_BYTES``),
    one block buffer reused in place (scores, their exponentials, the gradient block), on the
    namespace of ``_cpu.current()``.  ``labels`` / ``smoothing``: as the engine's (the
    masked key columns -inf before the log-sum-exp, the smoothing over what is left);
    ``hardness``: the penalised columns' logits times scale + α (the gradient keeps scale);
    ``pair_labels``: pytorch-metric-learning's NTXentLoss rows (:func:`_pair_rows`).
    ``col_grads`` is accepted and ignored: the column gradients come from the same block.
    ``positives=False``: the columns hold no row's positive (a ring chunk of another rank's
    keys; no smoothing or pairs): no −w target in the gradient, every same-label column
    left out with ``labels``, no column spared by ``hardness`` as the positive (the row loss
    it returns is then meaningless)."""
    if not positives and (smoothing or pair_labels is not None):
        raise ValueError("rows: positives=False takes no smoothing or pair_labels")
    if weights is None or len(weights) != 3:  # (the GPU engine unpacks it on every call)
        raise TypeError(f"rows: weights is a (w, stride, multiplier) triple, got {weights!r}")
    xp = _cpu.current()
    a = acc_dtype(q.dtype)
    if scale_log is not None:  # (on the host here: the value can be read)
        scale = scale * float(np.exp(np.asarray(scale_log, a).reshape(())))
    scale = float(scale)
    qa, ka = xp.astype(xp.asarray(q), a), xp.astype(xp.asarray(k), a)
    nsa = None if neg_s is None else xp.astype(xp.asarray(neg_s), a)
    npa = None if neg_p is None else xp.astype(xp.asarray(neg_p), a)
    n, d = qa.shape
    nk = ka.shape[0]
    ncols = nk + (0 if nsa is None else nsa.shape[0])
    cap = workspace_bytes or NUMPY_WORKSPACE_BYTES
    rb = max(1, min(n, cap // max(1, ncols * a.itemsize)))
    lse = None if lse_in is None else xp.astype(xp.asarray(lse_in), a)
    if pair_labels is not None:
        return _pair_rows(xp, qa, ka, scale, xp.asarray(pair_labels), weights, want_grad,
                          rb, a, pair_row0, self_pair)
    dq = dk = dns = dnp = None
    if want_grad:
        dq = xp.zeros((n, d), a) if self_pair and rb < n else xp.empty((n, d), a)
        dk = dq if self_pair else xp.empty((nk, d), a)
        dns = None if nsa is None else xp.zeros(nsa.shape, a)
        dnp = None if npa is None else xp.empty(npa.shape, a)
        w_arr, w_stride, w_mul = weights
        w_all = w_mul * scale  # the rows' gradient weights (times the scale)
        if w_arr is not None:
            w_all = xp.asarray(w_arr)[xp.arange(n) * w_stride] * w_all
    every = xp.arange(n)
    pos_all = every if pos_shift == 0 and pos_mod == n else (every + pos_shift) % pos_mod
    block = xp.empty((rb, ncols), a) if nsa is None and npa is None else None
    lse_parts, loss_parts = [], []
    for r0 in range(0, n, rb):
        r1 = min(n, r0 + rb)
        one = r1 - r0 == n  # (one block: whole arrays, no slices)
        at = every if one else every[:r1 - r0]
        pos = pos_all if one else pos_all[r0:r1]
        qb = qa if one else qa[r0:r1]
        if block is not None:  # (the common case: the one product straight into the block)
            s = xp.matmul(qb, ka.T, out=block if one else block[:r1 - r0])
        else:
            parts = [qb @ ka.T] + ([] if nsa is None else [qb @ nsa.T])
            if npa is not None:
                parts.append(xp.einsum("rd,rmd->rm", qb, npa[r0:r1]))
            s = xp.concatenate(parts, axis=1)
        if hardness is None:
            s *= scale
        else:
            s *= xp.where(_penalised(xp, hardness, r0, r1, pos if positives else None,
                                     ncols, s.shape[1]), scale + hardness.alpha, scale)
        if smoothing:  # each row's candidates (the columns not left out): as F.cross_entropy's
            cand = xp.ones(s.shape, dtype=bool)  # classes, a -inf logit among them included
        if exclude_diag:
            s[at, every[r0:r1]] = -float("inf")
            if smoothing:
                cand[at, every[r0:r1]] = False
        if labels is not None:  # a labelled column j != pos of row i's label: no candidate
            lab_r, lab_c = labels
            same = xp.asarray(lab_r)[r0:r1, None] == xp.asarray(lab_c)[None, :]
            if positives:
                same[at, pos] = False
            s[:, :same.shape[1]][same] = -float("inf")
            if smoothing:
                cand[:, :same.shape[1]][same] = False
        s_pos = s[at, pos]
        if smoothing:  # their count and their logits' sum
            count = xp.astype(xp.sum(cand, axis=1), a)  # (torch: int / int64 is float32)
            with xp.errstate(invalid="ignore"):
                s_sum = xp.sum(xp.where(cand, s, 0.0), axis=1)
        if lse_in is None:
            lse_b, inv = exp_lse(xp, s)  # s: exp(s - m), the softmax times 1 / inv
            lse_parts.append(lse_b)
        else:
            lse_b, inv = lse if one else lse[r0:r1], None
            s -= lse_b[:, None]
            with xp.errstate(over="ignore", invalid="ignore"):
                xp.exp(s, out=s)  # s: the softmax
        with xp.errstate(invalid="ignore"):
            if smoothing:
                loss_parts.append(lse_b - (1.0 - smoothing) * s_pos
                                  - smoothing * s_sum / count)
            else:
                loss_parts.append(lse_b - s_pos)
        if not want_grad:
            continue
        # the gradient block in place: g = w (softmax - target) scale, target = onehot(pos)
        # (smoothed: (1 - eps) onehot(pos) + eps / count over the row's candidates)
        w = w_all if one or isinstance(w_all, float) else w_all[r0:r1]
        w_rows = w if isinstance(w, float) else w[:, None]
        with xp.errstate(invalid="ignore"):
            s *= w_rows if inv is None else w_rows * inv
        if smoothing:
            with xp.errstate(invalid="ignore"):
                s -= xp.where(cand, w_rows * (smoothing / count)[:, None], 0.0)
            xp.add_at(s, (at, pos), -w * (1.0 - smoothing))
        elif positives:
            xp.add_at(s, (at, pos), -w)
        g = s if s.shape[1] == nk else s[:, :nk]
        if self_pair and rb < n:  # (dk is dq: every block adds to every row)
            dq[r0:r1] += g @ ka
        else:
            xp.matmul(g, ka, out=dq if one else dq[r0:r1])
        if r0 == 0 and not self_pair:  # (dk gathers every block's part)
            xp.matmul(g.T, qb, out=dk)
        else:
            dk += g.T @ qb
        if nsa is not None:
            dq[r0:r1] += s[:, nk:ncols] @ nsa
            dns += s[:, nk:ncols].T @ qb
        if npa is not None:
            gp = s[:, ncols:]
            dq[r0:r1] += xp.einsum("rm,rmd->rd", gp, npa[r0:r1])
            dnp[r0:r1] = gp[:, :, None] * qb[:, None, :]
    if lse is None:
        lse = lse_parts[0] if len(lse_parts) == 1 else xp.concatenate(lse_parts)
    loss = loss_parts[0] if len(loss_parts) == 1 else xp.concatenate(loss_parts)
    host = xp.host
    return host(lse), host(loss), (host(dq), host(dq) if self_pair else host(dk),
                                    host(dns), host(dnp))


def _pair_rows(xp, q, k, scale: float, lab, weights, want_grad: bool, rb: int, a,
               row0: int = 0, self_pair: bool = True):
    """The engine's ``row_pairs`` on the CPU (``stats.cu``): q's rows are k's rows row0 ..
    (labels: k's); each row's log-sum-exp over the rows of another label, its loss the sum
    over its positive pairs of softplus(lse - l_ip), and the gradient accumulators dq = G k,
    dk = Gᵀ q (one array, their sum, for ``self_pair``) in row blocks of ``rb``."""
    n, d = q.shape
    m = k.shape[0]
    dq = xp.zeros((n, d), a) if want_grad else None
    dk = dq if self_pair else (xp.zeros((m, d), a) if want_grad else None)
    if want_grad:
        w_arr, w_stride, w_mul = weights
        w_all = w_mul * scale
        if w_arr is not None:
            w_all = xp.asarray(w_arr)[xp.arange(n) * w_stride] * w_all
    lse_parts, loss_parts = [], []
    for r0 in range(0, n, rb):
        r1 = min(n, r0 + rb)
        at = xp.arange(r1 - r0)
        s = (q[r0:r1] @ k.T) * scale
        same = lab[row0 + r0:row0 + r1, None] == lab[None, :]
        pos = same & (xp.arange(m)[None, :] != (at + row0 + r0)[:, None])
        neg = xp.where(same, -float("inf"), s)
        top = xp.amax(neg, axis=1)
        top = xp.where(xp.isfinite(top), top, 0.0)
        with xp.errstate(divide="ignore"):
            lse = xp.log(xp.sum(xp.exp(neg - top[:, None]), axis=1)) + top
        x = lse[:, None] - s
        loss_parts.append(xp.sum(xp.where(pos, xp.softplus(x), 0.0), axis=1))
        lse_parts.append(lse)
        if not want_grad:
            continue
        sg = xp.where(pos, xp.sigmoid(x), 0.0)
        with xp.errstate(invalid="ignore", over="ignore"):
            p_neg = xp.where(same, 0.0, xp.exp(s - lse[:, None]))
        w = w_all if isinstance(w_all, float) else w_all[r0:r1][:, None]
        g = w * (xp.sum(sg, axis=1)[:, None] * p_neg - sg)
        dq[r0:r1] += g @ k
        dk += g.T @ q[r0:r1]
    cat = (lambda parts: parts[0] if len(parts) == 1 else xp.concatenate(parts))
    host = xp.host
    return host(cat(lse_parts)), host(cat(loss_parts)), (host(dq), host(dk), None, None)


def _penalised(xp, hardness, r0: int, r1: int, pos, ncols: int, width: int):
    """(r1 - r0, width) bool (or a row of it that broadcasts so: ``pos`` None with
    "all_negatives"): the columns hardness weighting penalises in rows r0..r1
    (``row_softmax``'s rule: own = row i's hard negatives and the per-query ones; ``pos``
    None: no positive among the columns)."""
    i = xp.arange(r0, r1)[:, None]
    c = xp.arange(width)[None, :]
    h = hardness
    own = (c >= h.own_start) & (c < h.own_start + h.own_count) & \
        ((c - h.own_start) % max(1, h.own_mod) == i)
    own = own | (c >= ncols)
    not_pos = (c >= 0) if pos is None else c != xp.asarray(pos)[:, None]
    if h.mode == 1:
        return not_pos & ~own
    return own if h.mode == 2 else not_pos


def cross(q, k, scale: float, *, lse_r, lse_c, weights, want_stats: bool, want_grad: bool,
          workspace_bytes=None, col_shift=None, scale_log=None):
    """``cupynce._engine.cross`` on the CPU (same arguments and results; keeps the n × m
    logits of the block: CPU memory, small sizes; ``col_shift`` is required with
    ``want_stats``, as there, and not read)."""
    if want_stats and col_shift is None:
        raise ValueError("cross: want_stats needs col_shift, the raw positive dots of k's rows")
    a = acc_dtype(q.dtype)
    if scale_log is not None:
        scale = a.type(scale) * np.exp(np.asarray(scale_log, a).reshape(()))
    qa, ka = q.astype(a), k.astype(a)
    s = (qa @ ka.T) * a.type(scale)
    lse_q = state = grads = None
    if want_stats:
        lse_q, state = row_lse(s), col_state(s)
    if want_grad:
        w_r, w_c, mul = weights
        n, m = s.shape
        wr = a.type(mul) * (np.ones(n, a) if w_r is None else np.asarray(w_r, a))
        wc = a.type(mul) * (np.ones(m, a) if w_c is None else np.asarray(w_c, a))
        with np.errstate(over="ignore", invalid="ignore"):
            h = (wr[:, None] * np.exp(s - lse_r[:, None])
                 + wc[None, :] * np.exp(s - lse_c[None, :]))
        h *= a.type(scale)
        grads = (h @ ka, h.T @ qa)
    return lse_q, state, grads


def normalize(x):
    """``(x / max(||x_i||, NORM_EPS), ||x_i||)`` of the rows, the norms in the accumulator dtype."""
    a = acc_dtype(x.dtype)
    xa = x.astype(a)
    with np.errstate(over="ignore"):
        norm = np.sqrt(np.sum(xa * xa, axis=-1))
    big = np.isinf(norm)
    if big.any():  # the sum of squares overflowed: ||x|| = m ||x / m||, m = max |x_k| (kernel's)
        m = np.max(np.abs(xa[big]), axis=-1)
        fin = np.isfinite(m)  # an inf entry keeps ||x|| = inf
        scaled = xa[big][fin] / m[fin][:, None]
        sub = norm[big]
        sub[fin] = m[fin] * np.sqrt(np.sum(scaled * scaled, axis=-1))
        norm[big] = sub
    return (xa / np.maximum(norm, NORM_EPS)[..., None]).astype(x.dtype), norm


def finish(x, norm, acc, g):
    """The input-dtype gradient ``g * acc``, through the normalisation when ``norm`` is given."""
    a = acc.dtype
    gs = a.type(1) if g is None else np.asarray(g, a).reshape(())
    if norm is None:
        return (acc * gs).astype(x.dtype)
    xa = x.astype(a)
    den = np.maximum(norm, NORM_EPS)[..., None]
    xn = xa / den
    proj = np.where(norm > NORM_EPS, np.sum(xn * acc, axis=-1), 0)[..., None]
    return (gs * (acc - xn * proj) / den).astype(x.dtype)


def grad_scale(grad_loss, a):
    if isinstance(grad_loss, float):
        return None if grad_loss == 1.0 else np.asarray(grad_loss, a)
    return np.asarray(grad_loss, a).reshape(())


def class_sums(x, groups, w=None):
    """``arrays.class_sums`` on NumPy: each row's class sum ``Σ_{j: labels_j = labels_i}
    w_j x_j`` (N, D) in the accumulator dtype, the rows of a class added in sorted order."""
    order, sl = groups[:2]
    start = groups[3]
    a = acc_dtype(x.dtype)
    xs = x[order].astype(a)
    if w is not None:
        xs *= np.asarray(w, dtype=a)[order][:, None]
    head = np.ones(sl.shape[0], bool)
    head[1:] = sl[1:] != sl[:-1]
    sums = np.add.reduceat(xs, np.flatnonzero(head), axis=0)
    return sums[(np.cumsum(head) - 1)[start]]
