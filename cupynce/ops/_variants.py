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

SupCon (Khosla et al.'s L_out, ``ops/supcon.py``) on NT-Xent's row softmax, whose positive
is p(i) = (i + h) mod N, h = N // 2 (q = p⁻¹: q(i) = (i − h) mod N).  With C_i = Σ_{y_j = y_i}
ẑ_j (row i's class sum, ẑ_i included), c_i = |P(i)| = (class size − 1), u_i = w_i / max(c_i, 1) and
W_i = Σ_{y_k = y_i} u_k ẑ_k::

    loss_i        = [c_i > 0] (lse_i − (ẑ_i·C_i − ‖ẑ_i‖²) / (c_i τ))
    ΔG_ij         = w_i ([j = p(i)] − [j ∈ P(i)] / c_i)      (G's positive undone, P(i)'s mean)
    Δ(∂/∂ẑ_i)     = (ΔG ẑ + ΔGᵀ ẑ)_i / τ
                  = (w_i ẑ_{p(i)} + w_{q(i)} ẑ_{q(i)} − u_i C_i − W_i + 2 u_i ẑ_i) / τ

(w_i = 0 for an anchor without a positive).  The class sums run in a fixed order
(``arrays.class_sums`` / ``_numpy.class_sums``).

SigLIP's labels (pairs (i, j ≠ i) of one label are positives): −log σ(x) = −log σ(−x) − x, so
with B_y = Σ_{y_j = y} b̂_j, A^w_y = Σ_{y_i = y} w_i â_i, c_i = |P(i)| and σ = exp(t)::

    Δrow_i  = −Σ_{j ∈ P(i)} L_ij = −(σ â_i·(B_{y_i} − b̂_i) + β c_i)
    Δ∂/∂â_i = −σ w_i (B_{y_i} − b̂_i),   Δ∂/∂b̂_j = −σ (A^w_{y_j} − w_j â_j)
    Δ∂/∂t   = −σ Σ_i w_i â_i·(B_{y_i} − b̂_i),   Δ∂/∂β = −Σ_i w_i c_i

The sums run in the accumulator dtype over the rows in order (the array module's
reductions); a device scale is never read on the host.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

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
                      want_loss: bool = True, every=None,
                      sums=None) -> Tuple[Optional[Any], Optional[Any]]:
    """``(Δloss (N,) or None, Δ∂/∂ẑ (N, D) or None)`` of NT-Xent's label smoothing ε (module
    notes) for the rows ``zn`` (ẑ, as the products use them) and ``scale`` = 1/τ; ``w``: the
    row weights of the gradient (:func:`row_weights`), None for the loss alone;
    ``want_loss=False``: the gradient alone (a backward).  ``every``: ``(rows, weights)`` of
    the whole batch when ``zn`` is a rank's [view 1; view 2] of the global batch (its
    positives its own rows): s and s_w run over every rank's rows (in one fixed order, the
    same on every rank), K = the global count − 1; ``w`` is then ``zn``'s rows' weights.
    ``sums``: ``(s, global count)`` in place of ``every`` (:func:`global_sums`: a ring
    schedule's, which gathers no rows), the weights then one real for every row."""
    a = acc_dtype(zn.dtype)
    n = zn.shape[0]
    b = n // 2
    z = zn.astype(a, copy=False)
    zp = xp.concatenate([z[b:], z[:b]])  # ẑ_{p(i)}
    if sums is not None:
        if getattr(w, "ndim", 0) != 0:
            raise ValueError("nt_xent_smoothing: sums= takes one weight for every row")
        s, count = sums
        k, w_all = count - 1, w
    else:
        z_all, w_all = every if every is not None else (z, w)
        z_all = z_all.astype(a, copy=False)
        k = z_all.shape[0] - 1
        s = z_all.sum(axis=0)
    dloss = None
    if want_loss:
        other = z @ s - (z * z).sum(axis=1)  # ẑ_i · Σ_{j≠i} ẑ_j
        dloss = (eps * scale) * ((z * zp).sum(axis=1) - other / k)
    if w is None:
        return dloss, None
    wi, wp = _rows(xp, w, b)
    s_w = s * w_all if getattr(w_all, "ndim", 0) == 0 else (w_all[:, None] * z_all).sum(axis=0)
    dacc = (eps * scale) * ((wi + wp) * zp - (wi * (s - z) + (s_w - wi * z)) / k)
    return dloss, dacc


def cross_groups(xp, lab_a, lab_b) -> Tuple[Any, ...]:
    """The :func:`label_groups` of two row sets stacked (a rank's rows, then a ring's chunk),
    for class sums across them: ``path.class_sums(x, groups, w)`` with ``x`` (n + m, D) the
    two sets' rows stacked and ``w`` (n + m,) their weights (0 leaves a row out) gives each
    row the sum of the weighted rows of its label, in a fixed order -- with the first set's
    weights 0, the first n results are each row's same-label sum over the second set, and
    the other way round."""
    return label_groups(xp, xp.concatenate([lab_a, lab_b]))


def siglip_labels_block(xp, path, an, bn, lab_a, lab_b, ls, lb, w=None, *,
                        want_loss: bool = True, same: bool = False):
    """:func:`siglip_labels`'s terms of one block, the images ``an`` (n, D; labels ``lab_a``)
    against the texts ``bn`` (m, D; ``lab_b``): a ring's chunk of texts.  ``same``: bn are
    an's own pairs (pair i's own text is its positive already: left out).  ``w``: one real
    for every row (the rings': no per-row weights).  Returns ``(Δrow part (n,), (Δ∂/∂â part,
    Δ∂/∂b̂ of these texts, Δ∂/∂β part) or None)``; the parts of every chunk add up to
    :func:`siglip_labels`' values (every term is linear in the class sums; Δ∂/∂t, which the
    rings take from the summed Δ∂/∂â, is not returned)."""
    a = acc_dtype(an.dtype)
    n, m = an.shape[0], bn.shape[0]
    x, y = an.astype(a, copy=False), bn.astype(a, copy=False)
    sigma = xp.exp(xp.asarray(ls, dtype=a).reshape(()))
    beta = xp.asarray(lb, dtype=a).reshape(())
    both = xp.concatenate([x, y])
    groups = cross_groups(xp, lab_a, lab_b)
    texts = xp.concatenate([xp.zeros(n, a), xp.ones(m, a)])
    other = path.class_sums(both, groups, texts)[:n]  # B_{y_i} over bn
    cnt = path.class_sums(xp.ones((n + m, 1), a), groups, texts)[:n, 0]
    if same:
        other -= y
        cnt -= 1
    dot = (x * other).sum(axis=1)
    drow = -(sigma * dot + beta * cnt) if want_loss else None
    if w is None:
        return drow, None
    da = other
    da *= -sigma * w
    images = xp.concatenate([xp.full(n, w, a), xp.zeros(m, a)])
    db = path.class_sums(both, groups, images)[n:]  # A^w_{y_j} over an
    if same:
        db -= w * x
    db *= -sigma
    return drow, (da, db, -w * cnt.sum())


def global_sums(comm, xp, *rows) -> List[Any]:
    """Each of ``rows``' column sums over every rank's rows, in the accumulator dtype: the
    ranks' own sums all-gathered (one call, D floats each a rank) and added in rank order --
    the same bits on every rank, without gathering the rows (the rings' label smoothing)."""
    own = xp.stack([r.astype(acc_dtype(r.dtype), copy=False).sum(axis=0) for r in rows])
    every = comm.all_gather(own)  # (P, len(rows), D)
    return [every[:, i].sum(axis=0) for i in range(len(rows))]


def clip_smoothing(xp, an, bn, ls, eps: float, w: Optional[Any] = None, *,
                   want_loss: bool = True, sums=None):
    """``(Δloss (N,) or None, (Δ∂/∂â, Δ∂/∂b̂, Δ∂/∂logit_scale) or None)`` of CLIP's label
    smoothing ε (module notes) for ``an``, ``bn`` (â, b̂ as the products use them) and ``ls``
    (the (1,) log scale array, or a real); ``w`` and ``want_loss`` as
    :func:`nt_xent_smoothing`'s.  ``sums``: ``(A, B, N, A_w, B_w)`` of the global batch when
    ``an``, ``bn`` are a rank's pairs of it (A_w, B_w only with ``w``); Δ∂/∂logit_scale is
    then this rank's share (its pairs' terms: the shares add up to the global value)."""
    a = acc_dtype(an.dtype)
    n = an.shape[0]
    x, y = an.astype(a, copy=False), bn.astype(a, copy=False)
    sigma = xp.exp(xp.asarray(ls, dtype=a).reshape(()))
    sa_own, sb_own = x.sum(axis=0), y.sum(axis=0)
    sa, sb, n_all = sums[:3] if sums is not None else (sa_own, sb_own, n)
    diag = (x * y).sum(axis=1)
    dloss = sigma * (eps * diag - (eps / (2 * n_all)) * (x @ sb + y @ sa)) if want_loss else None
    if w is None:
        return dloss, None
    scalar = getattr(w, "ndim", 0) == 0
    wc = w if scalar else w[:, None]
    aw_own = sa_own * w if scalar else (wc * x).sum(axis=0)
    bw_own = sb_own * w if scalar else (wc * y).sum(axis=0)
    aw, bw = sums[3:5] if sums is not None else (aw_own, bw_own)
    da = (sigma * eps / 2) * (2 * wc * y - (wc * sb + bw) / n_all)
    db = (sigma * eps / 2) * (2 * wc * x - (aw + wc * sa) / n_all)
    wd = (w * diag).sum() if not scalar else w * diag.sum()
    dscale = sigma * (eps * wd - (eps / (2 * n_all)) * (aw_own @ sb + bw_own @ sa))
    return dloss, (da, db, dscale)


def clip_smoothing_labels(xp, path, an, bn, ls, eps: float, groups, w: Optional[Any] = None,
                          *, want_loss: bool = True, every=None, ring=None):
    """:func:`clip_smoothing` with CLIP's labels: pair i's candidates in either direction are
    i and the pairs of another label, K_i = N − c_i + 1 of them (c_i its class's size), so the
    smoothing term's sums lose the class: Σ_{C_i} L_ij = σ â_i · (B − B_{y_i} + b̂_i), the
    class sums B_y = Σ_{y_j = y} b̂_j (and A_y) from ``path.class_sums`` (fixed order)::

        Δ_i = εσ â_i·b̂_i − (εσ / 2K_i) [â_i·(B − B_{y_i} + b̂_i) + b̂_i·(A − A_{y_i} + â_i)]

    and with u_i = w_i εσ / 2K_i: Δ∂/∂â_k = εσ w_k b̂_k − u_k (B − B_{y_k} + 2 b̂_k) − U_b +
    U_b,{y_k} (U_b = Σ u_i b̂_i, its class sum U_b,{y_k}), Δ∂/∂b̂_k likewise, Δ∂/∂logit_scale
    = Σ w_i Δ_i (Δ is linear in σ).  ``groups``: :func:`label_groups` of the pairs' labels.
    ``every``: ``(â of every pair, b̂ of every pair, every pair's weight or None, row0)`` when
    ``an``, ``bn`` are a rank's pairs row0 .. of the global batch (``groups`` then the global
    labels'; ``w`` this rank's pairs' weights): the sums and class sums over every pair, in
    one fixed order on every rank; Δ∂/∂logit_scale is then this rank's share.  ``ring``:
    ``(K of this rank's pairs (n,), A, B, A_{y_i}, B_{y_i} (n, D) of this rank's pairs,
    U)`` -- the sums over every pair and the class sums a ring brought chunk by chunk
    (``groups`` unused), ``U(u)`` the sums ``(Σ u_i â_i, Σ u_i b̂_i)`` over every pair,
    each rank giving its own pairs' u; ``w`` one real then (the rings' reductions): a
    class's pairs share u, so U_b,{y_k} = u_k B_{y_k}."""
    a = acc_dtype(an.dtype)
    x, y = an.astype(a, copy=False), bn.astype(a, copy=False)
    n = x.shape[0]
    sigma = xp.exp(xp.asarray(ls, dtype=a).reshape(()))
    if ring is not None:
        k, sa, sb, ca, cb, usums = ring
        ra, rb = sa[None, :] - ca + x, sb[None, :] - cb + y
    else:
        xa, ya, w_all, row0 = every if every is not None else (x, y, w, 0)
        xa, ya = xa.astype(a, copy=False), ya.astype(a, copy=False)
        n_all, own = xa.shape[0], slice(row0, row0 + n)
        k_all = (n_all + 1 - (groups[4] - groups[3])).astype(a)  # (each pair's candidates)
        k = k_all[own]
        # A − A_{y_i} + â_i, B − B_{y_i} + b̂_i
        ra = xa.sum(axis=0)[None, :] - path.class_sums(xa, groups)[own] + x
        rb = ya.sum(axis=0)[None, :] - path.class_sums(ya, groups)[own] + y
    diag = (x * y).sum(axis=1)
    delta = sigma * (eps * diag - (eps / (2 * k)) * ((x * rb).sum(axis=1)
                                                     + (y * ra).sum(axis=1)))
    if w is None:
        return (delta if want_loss else None), None
    wv = xp.broadcast_to(xp.asarray(w, dtype=a), (n,))
    if ring is not None:
        if getattr(w, "ndim", 0):
            raise ValueError("clip_smoothing_labels: a ring's weight is one real")
        u = wv * (sigma * eps / 2) / k
        uy, ux = u[:, None] * cb, u[:, None] * ca
        sx, sy = usums(u)
    else:
        u_all = (xp.broadcast_to(xp.asarray(w_all, dtype=a), (n_all,)) * (sigma * eps / 2)
                 / k_all)
        u = u_all[own]
        uy = path.class_sums(ya, groups, u_all)[own]
        ux = path.class_sums(xa, groups, u_all)[own]
        sy, sx = (u_all[:, None] * ya).sum(axis=0), (u_all[:, None] * xa).sum(axis=0)
    da = (sigma * eps) * wv[:, None] * y - u[:, None] * (rb + y) - sy[None, :] + uy
    db = (sigma * eps) * wv[:, None] * x - u[:, None] * (ra + x) - sx[None, :] + ux
    return (delta if want_loss else None), (da, db, (wv * delta).sum())


def label_groups(xp, labels) -> Tuple[Any, ...]:
    """The rows grouped by label, for the class sums: ``(order, sorted labels, each sorted
    position's class end, each row's class start, each row's class end)`` -- int64 arrays on
    the labels' device (a stable sort and binary searches: no host read, no atomics)."""

    labels = xp.asarray(labels, dtype=np.int64)
    order = (np.argsort(labels, kind="stable") if xp is np else xp.argsort(labels))
    order = order.astype(np.int64, copy=False)
    sl = labels[order]
    start = xp.searchsorted(sl, labels, side="left").astype(np.int64, copy=False)
    stop = xp.searchsorted(sl, labels, side="right").astype(np.int64, copy=False)
    end = stop[order]  # (sorted position k's class end: its row's)
    return order, sl, end, start, stop


def has_positive(groups):
    """(N,) bool: the rows whose class has another row."""
    return groups[4] - groups[3] > 1


def supcon_terms(xp, path, zn, groups, scale, lse, w=None, *, acc=None, every=None,
                 scale_log=None):
    """SupCon from NT-Xent's row softmax (module notes): the (N,) loss from the row
    log-sum-exps ``lse`` (None: no loss), and with the (N,) row weights ``w`` the gradient's
    difference added into ``acc`` (N, D) (the engine's accumulator for the same weights,
    including 1/τ = ``scale``).  ``every``: ``(rows, their groups, their weights or None,
    row0)`` of the whole batch when ``zn`` is its rows ``row0 ..`` (a rank's rows of the
    global batch: the class sums run over every rank's rows; ``groups`` and ``w`` are then
    unused); the positive p(i) = (i + N//2) mod N is among ``zn``'s rows either way.
    ``scale_log``: a (1,) device array, 1/τ then ``scale · exp(scale_log)`` (the GPU's
    device temperature; never read)."""
    n = zn.shape[0]
    z_all, g_all, w_all, row0 = every if every is not None else (zn, groups, w, 0)
    want_grad = w_all is not None and acc is not None
    a = acc_dtype(zn.dtype)
    u_all = None
    if want_grad:
        w_all = xp.ascontiguousarray(w_all, dtype=a)
        u_all = w_all / xp.maximum(g_all[4] - g_all[3] - 1, 1).astype(a)
        w = w_all[row0:row0 + n]
    start, stop = g_all[3][row0:row0 + n], g_all[4][row0:row0 + n]
    if path.gpu:  # (one kernel pass over the rows: arrays.supcon_rows)
        from .._engine import arrays

        pc = arrays.class_sums(z_all, g_all, per_row=False)
        pw = arrays.class_sums(z_all, g_all, u_all, per_row=False) if want_grad else None
        return arrays.supcon_rows(zn, start, stop, pc, pw, scale, lse, w if want_grad else None,
                                  acc if want_grad else None, scale_log)
    if scale_log is not None:  # (on the host here: the value can be read)
        scale = scale * float(np.exp(np.asarray(scale_log).reshape(())))
    cnt = (stop - start - 1).astype(a)
    inv = 1 / xp.maximum(cnt, 1)
    z = zn.astype(a, copy=False)
    c = path.class_sums(z_all, g_all)[row0:row0 + n]
    loss = None
    if lse is not None:
        t = (z * c).sum(axis=1) - (z * z).sum(axis=1)  # Σ_{p∈P(i)} ẑ_i·ẑ_p
        loss = xp.where(cnt > 0, lse - (scale * inv) * t, 0).astype(a, copy=False)
    if not want_grad:
        return loss
    h = n // 2
    u = (w * inv)[:, None]
    c *= -u                                                   # − u_i C_i
    c -= path.class_sums(z_all, g_all, u_all)[row0:row0 + n]  # − W_i
    c += (2 * u) * z
    c += w[:, None] * xp.roll(z, -h, axis=0)                  # w_i ẑ_{p(i)}
    c += xp.roll(w[:, None] * z, h, axis=0)                   # w_{q(i)} ẑ_{q(i)}
    c *= scale
    acc += c
    return loss


def siglip_labels(xp, path, an, bn, groups, ls, lb, w=None, *, want_loss: bool = True,
                  row0: int = 0):
    """``(Δrow (n,) or None, (Δ∂/∂â, Δ∂/∂b̂, Δ∂/∂t, Δ∂/∂β) or None)`` of SigLIP's labels
    (module notes) for ``an`` (n, D) and ``bn`` (Nc, D) (â, b̂ as the products use them), the
    log scale ``ls`` and the bias ``lb`` (reals, or device arrays never read on the host),
    ``groups`` (:func:`label_groups` of the Nc texts' labels); ``w`` the gradient's row
    weights (a real, 0-d, or one per text row; None: the loss alone).  ``an`` holds the image
    rows ``row0 ..`` of the batch (a rank's share of the global one: Nc = every rank's texts,
    gathered): Δ∂/∂b̂ is then (Nc, D), every text's, and Δ∂/∂t, Δ∂/∂β this rank's share (the
    shares add up to the global values)."""
    a = acc_dtype(an.dtype)
    n, nc = an.shape[0], bn.shape[0]
    own = slice(row0, row0 + n)
    x, y = an.astype(a, copy=False), bn[own].astype(a, copy=False)
    sigma = xp.exp(xp.asarray(ls, dtype=a).reshape(()))
    beta = xp.asarray(lb, dtype=a).reshape(())
    cnt = (groups[4][own] - groups[3][own] - 1).astype(a)
    other = path.class_sums(bn, groups)[own]
    other -= y                                       # B_{y_i} − b̂_i
    dot = (x * other).sum(axis=1)                    # â_i·(B_{y_i} − b̂_i)
    drow = -(sigma * dot + beta * cnt) if want_loss else None
    if w is None:
        return drow, None
    scalar = getattr(w, "ndim", 0) == 0
    wo = w if scalar else xp.asarray(w, dtype=a)[own]
    wc = wo if scalar else wo[:, None]
    da = other
    da *= -sigma * wc
    wa = x * wc                                      # w_i â_i of this rank's images
    if nc != n:  # (the texts' rows: this rank's images' terms at their global rows)
        full = xp.zeros((nc, x.shape[1]), a)
        full[own] = wa
        wa = full
    aw = path.class_sums(wa, groups)                 # A^w_{y_j}, this rank's images
    aw[own] -= wa[own] if nc != n else wa
    db = aw
    db *= -sigma
    dt = -sigma * ((wo * dot).sum() if not scalar else wo * dot.sum())
    dbias = -((wo * cnt).sum() if not scalar else wo * cnt.sum())
    return drow, (da, db, dt, dbias)
