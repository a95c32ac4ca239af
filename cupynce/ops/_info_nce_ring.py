"""InfoNCE's ring schedule across ranks (issue 57; ``cupynce.ops._global.ring_blocks``): the
rank's queries against each rank's chunk of keys while the next travels, with its explicit
negatives, labels, label smoothing and hardness weighting (:func:`ring_share`,
:class:`_RingSmoothing`, :func:`_chunk_hardness`), split
from ``info_nce.py`` (its all-gather schedule and its single-process op) by size."""
from __future__ import annotations

from typing import Any, List

import numpy as np

from .._engine.kernels import acc_dtype
from .._engine.losses.row_blocks import Hardness
from . import _global, _local, _variants
from ._comm import Comm

__all__ = ["ring_share"]


def ring_share(comm: Comm, path, qn, kn, temp, w, fused: bool, ws, neg_s=None, neg_p=None,
               replicated: bool = False, labels=None, eps: float = 0.0, hard=None):
    """The rank's queries against every rank's keys on the ring (``_global.ring_blocks``;
    the ranks agreed on it: in-batch negatives; hardness ``hard`` -- the rank's
    :class:`Hardness` in the gathered layout -- without smoothing), in two passes:
    each chunk of keys' rows log-sum-exps while the next chunk travels (the positive logits
    from the rank's own chunk), merged in rank order; then, for a gradient, each kept chunk's
    gradient block with the full log-sum-exps, the keys' gradients summed along the ring to
    their owners.  Shared negatives ``neg_s`` travel with their rank's keys (one chunk: the
    keys then the negatives; their gradients come back the same way); replicated ones (the
    same on every rank) and per-query ``neg_p`` join the own chunk's block; ``labels`` (the
    rank's, gathered once: n integers a rank) leave every same-label key but the positive
    out of a row's candidates; the label smoothing ``eps`` is the plain loss's O(N·D)
    difference from the global column sums (:class:`_RingSmoothing`).  Returns ``(lse, the
    rows' losses, (dq, dk, dneg) or None)`` as ``info_nce._global_scatter``'s (dq adds the
    steps' parts in step order, own chunk first).  On CuPy arrays (``config.ring_gpu``)
    the plain op's alone: another rank's chunk's gradient block on
    ``_engine.rows(positives=False)``."""
    if hard is not None and eps:  # (the smoothing term takes the logits unpenalised)
        raise ValueError("ring_share: hardness with label smoothing is the all-gather "
                         "schedule's (the ring wish refuses it)")
    xp = np if isinstance(qn, np.ndarray) else _local._cupy()
    engine = _local.engine_for(xp)
    n, rank, size = qn.shape[0], comm.rank, comm.size
    chunks: List[Any] = [None] * size
    parts: List[Any] = [None] * size
    own, extra = [], {}
    travel = neg_s is not None and not replicated
    labs = None if labels is None else comm.all_gather(labels)  # (P, n)
    kw = dict(exclude_diag=False, pos_shift=0, pos_mod=n, op="info_nce",
              scale_log=temp.scale_log, workspace_bytes=ws)

    def block(q, chunk, grad: bool, **more):
        """path.rows of chunk q: its keys and travelling negatives, the own chunk's
        replicated and per-query negatives, the labels; the positives in the own chunk (the
        GPU's statistics pass takes another chunk's diagonal as its positive: a row loss
        never read, its log-sum-exp the same)."""
        mine = q == rank
        ns = chunk[n:] if travel else (neg_s if mine else None)
        lab = None if labs is None else (labels, labs[q])
        opt = dict(labels=lab) if lab is not None else {}
        if hard is not None:
            opt["hardness"] = _chunk_hardness(hard, n, ns.shape[0] if mine and travel else 0,
                                              mine)
        if xp is np or grad:
            opt["positives"] = mine
        return path.rows(qn, chunk[:n], ns, neg_p if mine else None, temp.scale,
                         **opt, **kw, **more)

    smooth = _RingSmoothing(comm, xp, path, qn, kn, neg_s, neg_p, travel, temp, eps, labels,
                            labs) if eps else None

    def stats(k, q, chunk):
        chunks[q] = chunk
        parts[q], loss, _ = block(q, chunk, False, lse_in=None, weights=w,
                                  want_grad=False)  # (w unread: the engine takes a triple)
        if q == rank:
            own.append(parts[q] - loss)  # the positive logits
        if smooth is not None:
            smooth.chunk(q, chunk[:n])
        return None, None

    cols = xp.concatenate([kn, neg_s]) if travel else kn
    _global.ring_blocks(comm, cols, stats, col_grads=False)
    lse = _global.merge_lse(engine, parts)
    rows = lse - own[0]
    if smooth is not None:
        rows = rows + smooth.finish(own[0])
    if not fused:
        return lse, rows, None
    if smooth is not None:
        smooth.weigh(_variants.row_weights(w))

    def grads(k, q, _):
        _, _, (dq, dk, dns, dnp) = block(q, chunks[q], True, lse_in=lse, weights=w,
                                         want_grad=True)
        if smooth is not None and labs is not None:  # (the chunk's keys' U_y: home with dk)
            dk = dk + smooth.chunk_grad(q, chunks[q][:n])
        if travel:
            return dq, xp.concatenate([dk, dns])
        if q == rank:  # (the replicated or per-query negatives' gradients: this chunk's)
            extra["dneg"] = dns if dns is not None else dnp
        return dq, dk

    steps, dcols = _global.ring_blocks(comm, None, grads, col_grads=True)
    dq = _global.sum_steps(steps)
    dk, dneg = (dcols[:n], dcols[n:]) if travel else (dcols, extra.get("dneg"))
    if smooth is not None:  # (the replicated negatives' part: this rank's rows', summed below)
        smooth.add_grads(dq, dk, dneg, neg_p is not None)
    if neg_s is not None and not travel:  # replicated: every rank's part summed, over P
        dneg = comm.all_reduce(xp.ascontiguousarray(dneg)) / dneg.dtype.type(size)
    return lse, rows, (dq, dk, dneg)


def _chunk_hardness(hard: Hardness, n: int, m_own: int, mine: bool):
    """A chunk's block's :class:`Hardness` (``row_softmax``'s rule, renumbered from the
    gathered layout to the block's columns): the own chunk holds the rank's keys, then its
    ``m_own`` travelling shared negatives (row i's own at n + i, n + i + n, ...; replicated
    negatives are nobody's) and its per-query negatives (own); another rank's chunk holds no
    positive and nothing of row i's own, so "in_batch_negatives" and "all_negatives" penalise
    every column of it and "hard_negatives" none (None)."""
    if mine:
        return Hardness(hard.mode, hard.alpha, n, m_own, n)
    return None if hard.mode == 2 else Hardness(hard.mode, hard.alpha, 0, 0, 1)


class _RingSmoothing:
    """InfoNCE's label smoothing ε on the ring: row i's target moves ε from its positive
    evenly over its K_i candidates (every rank's keys but those of its label other than its
    positive, the shared negatives -- every rank's, or the replicated ones once -- and its
    own per-query negatives), so with the logits s_ij = s q̂_i · c_j, u_i = w q̂_i / K_i::

        Δloss_i = ε (s_{i,pos} − (s / K_i) q̂_i · C_i)
        C_i     = Σ_keys k̂ − B_{y_i} + k̂_i + Σ_shared n̂ + Σ_m n̂_im   (B_y: the keys of label y)
        Δ∂/∂q̂_i = s ε (w k̂_i − u_i K_i C_i / K_i)   (= s ε w (k̂_i − C_i / K_i))
        Δ∂/∂k̂_j = s ε (w q̂_j − u_j − U + U_{y_j}),   U = Σ_all u,  U_y = Σ_{y_i = y} u_i
        Δ∂/∂n̂ (shared) = −s ε U,   Δ∂/∂n̂_im = −s ε u_i

    (without labels B_{y_i} = k̂_i and U_{y_j} = u_j).  The global sums come from
    ``_variants.global_sums`` (the ranks' sums in rank order); the class sums across ranks
    chunk by chunk: each arriving chunk's keys' sums for this rank's rows (:meth:`chunk`),
    and in the gradient pass this rank's rows' U_y for the chunk's keys, which travel home
    with their gradient (:meth:`chunk_grad`).  The replicated negatives get this rank's
    rows' part, which the caller all-reduces."""

    def __init__(self, comm: Comm, xp, path, qn, kn, neg_s, neg_p, travel: bool, temp,
                 eps: float, labels, labs):
        a = acc_dtype(qn.dtype)
        self.xp, self.path, self.a, self.comm, self.travel = xp, path, a, comm, travel
        # (NumPy arrays alone -- ring_possible keeps CuPy ones, whose τ may be a device
        # array, off this ring --: τ is a host value)
        assert temp.scale_log is None, "the smoothing / hardness ring takes NumPy arrays"
        self.scale, self.eps = temp.scale, eps
        self.q, self.k = qn.astype(a, copy=False), kn.astype(a, copy=False)
        self.labels, self.labs, self.groups = labels, labs, {}
        n = qn.shape[0]
        sums = _variants.global_sums(comm, xp, qn, kn, *([neg_s] if travel else []))
        self.q_all = sums[0]
        c = sums[1] + (sums[2] if travel else 0.0)
        count = kn.shape[0] * comm.size
        if neg_s is not None:
            c = c + (0.0 if travel else neg_s.astype(a, copy=False).sum(axis=0))
            count += neg_s.shape[0] * (comm.size if travel else 1)
        c = xp.broadcast_to(c, self.q.shape)
        if neg_p is not None:
            c = c + neg_p.astype(a, copy=False).sum(axis=1)
            count += neg_p.shape[1]
        self.c = xp.array(c)
        self.count = xp.full(n, count, a)
        if labels is not None:  # (each row's other keys of its label leave its candidates)
            self.count -= (labs.reshape(-1)[None, :] == labels[:, None]).sum(axis=1) - 1
            self.c += self.k  # (+ k̂_i; − B_{y_i}: chunk by chunk)

    def chunk(self, q: int, keys) -> None:
        """Chunk q's keys of each row's label out of its candidates' sum."""
        if self.labels is not None:
            self.c -= self._cross(q, keys.astype(self.a, copy=False), rows=True)

    def _cross(self, q: int, y, rows: bool, u=None):
        """Class sums across this rank's rows and chunk q's keys ``y``: each row's sum of the
        chunk's keys of its label (``rows``), or each key's sum of ``u`` (this rank's rows'
        values) over the rows of its label (the chunk's grouping kept for both passes)."""
        xp, a, n = self.xp, self.a, self.q.shape[0]
        m = y.shape[0]
        if q not in self.groups:
            self.groups[q] = _variants.cross_groups(xp, self.labels, self.labs[q])
        both = xp.concatenate([xp.zeros_like(self.q) if rows else u, y])
        keep = xp.concatenate([xp.zeros(n, a), xp.ones(m, a)]) if rows else \
            xp.concatenate([xp.ones(n, a), xp.zeros(m, a)])
        out = self.path.class_sums(both, self.groups[q], keep)
        return out[:n] if rows else out[n:]

    def finish(self, pos):
        """Δloss from the positive logits s_{i,pos} the ring computed."""
        return self.eps * (pos - (self.scale / self.count) * (self.q * self.c).sum(axis=1))

    def weigh(self, w) -> None:
        """The gradient's row values u_i = w q̂_i / K_i and U (``w``: the rows' weight)."""
        self.w = w
        self.u = (w / self.count)[:, None] * self.q
        self.u_all = _variants.global_sums(self.comm, self.xp, self.u)[0]

    def chunk_grad(self, q: int, keys):
        """s ε U_{y_j} of this rank's rows for chunk q's keys (labels: else None)."""
        if self.labels is None:
            return None
        return (self.scale * self.eps) * self._cross(q, keys.astype(self.a, copy=False),
                                                     rows=False, u=self.u)

    def add_grads(self, dq, dk, dneg, per_query: bool) -> None:
        """The rest of the differences, added into the ring's accumulators."""
        f = self.scale * self.eps
        dq += f * (self.w * self.k - (self.w / self.count)[:, None] * self.c)
        dk += f * (self.w * self.q - self.u_all)
        if self.labels is not None:  # (without labels U_{y_j} = u_j cancels − u_j)
            dk -= f * self.u
        if dneg is None:
            return
        if per_query:
            dneg -= f * self.u[:, None, :]
        else:  # (shared: every rank's rows; replicated: this rank's rows, all-reduced after)
            dneg -= f * (self.u_all if self.travel else self.u.sum(axis=0))
