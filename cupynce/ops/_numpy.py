"""The NumPy path of the InfoNCE family: the GPU engine's primitives, vectorised per row block.

Same algorithm and accumulation dtypes as ``cupynce._engine`` (float32 scores and
accumulators, float64 for float64 inputs); results agree with the GPU to rounding.  CLIP's
NumPy path lives in ``clip.py`` (it keeps the N x N matrix: CPU memory, small N).
"""
from __future__ import annotations

import numpy as np

from .._engine.arrays import NORM_EPS
from .._engine.kernels import acc_dtype

#: Workspace for the NumPy path's score blocks when the caller gives none (bytes).
NUMPY_WORKSPACE_BYTES = 256 << 20


def row_lse(x):
    """Row log-sum-exp; NaN for a row holding NaN or +inf (as the CUDA kernel)."""
    m = np.max(x, axis=1, keepdims=True)
    bad = ~np.isfinite(m) & (m > 0) | np.isnan(m)
    m = np.where(np.isfinite(m), m, 0)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        out = (np.log(np.sum(np.exp(x - m), axis=1, keepdims=True)) + m)[:, 0]
    return np.where(bad[:, 0], np.nan, out).astype(x.dtype, copy=False)


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
         self_pair: bool = False, scale_log=None):
    """``cupynce._engine.rows`` on the CPU: the same arguments and results, the score
    matrix in row blocks of at most ``workspace_bytes`` (default ``NUMPY_WORKSPACE_BYTES``)."""
    a = acc_dtype(q.dtype)
    if scale_log is not None:  # (on the host here: the value can be read)
        scale = scale * float(np.exp(np.asarray(scale_log, a).reshape(())))
    qa, ka = q.astype(a), k.astype(a)
    nsa = None if neg_s is None else neg_s.astype(a)
    npa = None if neg_p is None else neg_p.astype(a)
    n, d = q.shape
    nk = k.shape[0]
    ncols = nk + (0 if nsa is None else nsa.shape[0])
    cap = workspace_bytes or NUMPY_WORKSPACE_BYTES
    rb = max(1, min(n, cap // max(1, ncols * a.itemsize)))
    lse = np.empty((n,), a) if lse_in is None else lse_in
    loss = np.empty((n,), a)
    dq = dk = dns = dnp = None
    if want_grad:
        dq = np.zeros((n, d), a)
        dk = dq if self_pair else np.zeros((nk, d), a)
        dns = None if nsa is None else np.zeros_like(nsa)
        dnp = None if npa is None else np.empty_like(npa)
    w_arr, w_stride, w_mul = weights
    for r0 in range(0, n, rb):
        r1 = min(n, r0 + rb)
        rows = np.arange(r0, r1)
        qb = qa[r0:r1]
        blocks = [qb @ ka.T]
        if nsa is not None:
            blocks.append(qb @ nsa.T)
        if npa is not None:
            blocks.append(np.einsum("rd,rmd->rm", qb, npa[r0:r1]))
        s = np.concatenate(blocks, axis=1) * a.type(scale)
        if exclude_diag:
            s[np.arange(r1 - r0), rows] = -np.inf
        pos = (rows + pos_shift) % pos_mod
        if lse_in is None:
            lse[r0:r1] = row_lse(s)
        with np.errstate(invalid="ignore"):
            loss[r0:r1] = lse[r0:r1] - s[np.arange(r1 - r0), pos]
        if not want_grad:
            continue
        w = a.type(w_mul) * (w_arr[rows * w_stride] if w_arr is not None else a.type(1))
        with np.errstate(invalid="ignore", over="ignore"):
            p = np.exp(s - lse[r0:r1, None])
        p[np.arange(r1 - r0), pos] -= 1
        g = p * (np.asarray(w, a) * a.type(scale)).reshape(-1, 1)
        dq[r0:r1] += g[:, :nk] @ ka
        dk += g[:, :nk].T @ qb
        if nsa is not None:
            dq[r0:r1] += g[:, nk:ncols] @ nsa
            dns += g[:, nk:ncols].T @ qb
        if npa is not None:
            gp = g[:, ncols:]
            dq[r0:r1] += np.einsum("rm,rmd->rd", gp, npa[r0:r1])
            dnp[r0:r1] = gp[:, :, None] * qb[:, None, :]
    return lse, loss, (dq, dk, dns, dnp)


def cross(q, k, scale: float, *, lse_r, lse_c, weights, want_stats: bool, want_grad: bool,
          workspace_bytes=None, col_shift=None):
    """``cupynce._engine.cross`` on the CPU (same arguments and results; keeps the n × m
    logits of the block: CPU memory, small sizes)."""
    a = acc_dtype(q.dtype)
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
            h = (wr[:, None] * np.exp(s - lse_r[:, None]) + wc[None, :] * np.exp(s - lse_c[None, :]))
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
