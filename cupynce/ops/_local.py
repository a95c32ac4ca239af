"""The rank-local blocks of a global (multi-rank) loss.

With P ranks each holding n rows, the global batch is the concatenation in rank order.

* InfoNCE (:func:`info_nce_block`): a rank computes the softmax of its own rows over *all*
  columns: its own keys first (so that each row's positive sits at a fixed local offset)
  followed by the columns of every other rank (``others``, in any order: a log-sum-exp does not
  depend on it).
* NT-Xent (:class:`NtXentPlan`, :func:`nt_xent_stats`, :func:`nt_xent_lse`,
  :func:`nt_xent_grads`): S = Z Zᵀ is symmetric, so each unordered pair of rank blocks is
  computed once, by one of its ranks, for both sides' statistics and gradients.
* CLIP's block, one for both directions, is the global forward of ``clip`` (its schedule,
  ``clip._global_forward``) on the engine's rectangular ``clip``.

The column-side gradients belong to the ranks that own those rows: a collective sums them there
(reduce-scatter), which is how the global gradient is assembled without any rank ever holding
the n × N logits or an N × N matrix.  This module holds no communication; it runs on one device
(CuPy) or the CPU (NumPy) through the same engine as the single-process ops
(:class:`_base.Path`), and is what the distributed ops and their emulated-rank tests call.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from .. import _engine
from . import _numpy
from ._base import Path


def engine_for(xp):
    """The primitives the blocks run on (``cross``, ``col_lse``, ``pair_dots``): the GPU
    engine (``cupynce._engine``) for CuPy arrays, their NumPy counterparts (``_numpy``) for
    NumPy arrays."""
    return _numpy if xp is np else _engine


class NtXentPlan:
    """Which blocks of the global NT-Xent score matrix a rank computes.

    The global S = Z Zᵀ / τ over the P ranks' row blocks R_0 .. R_{P−1} (2n rows each: the
    rank's view 1 and view 2 rows) is symmetric and every positive lies in a diagonal block,
    so each unordered pair of rank blocks is computed once, by one of its two ranks, which
    takes the row statistics of its rows and the column statistics of the other's (the
    CLIP one-block idea applied to S's symmetry): rank r takes its diagonal block (on the
    single-process engine's symmetric NT-Xent), the blocks (r, r + k) for k = 1 .. (P − 1) / 2,
    and for even P the block (r, r + P/2) is split between its two ranks: the lower rank
    takes its first n rows against all 2n rows of the other, the upper rank all its rows
    against the other's last n rows.  Every rank computes about (P + 1) / 2 of its P blocks.

    ``cols``: the main block's columns as (owner rank, row slice); ``lead``: this rank also
    computes rows [0, n) × R_opp (the split pair's half); ``width``: the length of the
    column-state buffer every rank sends; :meth:`sources`: where this rank's own rows sit
    among the gathered column states.  ``ring=True``: the mirrored plan, blocks (r, r − k)
    (the chunks a ring brings first: rank r − k's at step k).
    """

    def __init__(self, rank: int, size: int, n2: int, ring: bool = False):
        self.rank, self.size, self.n2, self.h = rank, size, n2, n2 // 2
        self.k = (size - 1) // 2
        self.even = size % 2 == 0
        self.opp = (rank + size // 2) % size if self.even else None
        self.lead = self.even and rank < size // 2
        self.dir = -1 if ring else 1
        self.cols = [((rank + self.dir * k) % size, slice(0, n2)) for k in range(1, self.k + 1)]
        if self.even and not self.lead:
            self.cols.append((self.opp, slice(self.h, n2)))
        self.width = self.k * n2 + (n2 if self.even else 0)

    @property
    def main_width(self) -> int:
        return sum(sl.stop - sl.start for _, sl in self.cols)

    def sources(self):
        """(rank, column offset, this rank's rows) of every column state over this rank's
        rows in the gathered (P, 2, width) states, in a fixed order."""
        out = [((self.rank - self.dir * k) % self.size, (k - 1) * self.n2, slice(0, self.n2))
               for k in range(1, self.k + 1)]
        if self.even:  # the split pair: the other rank's extra columns / its half block
            rows = slice(self.h, self.n2) if self.lead else slice(0, self.n2)
            out.append((self.opp, self.k * self.n2, rows))
        return out


def nt_xent_stats(path: Path, engine, plan: NtXentPlan, z, parts, dots, scale: float,
                  workspace_bytes: Optional[int]):
    """A rank's statistics pass of the global NT-Xent.

    ``z`` (2n, D) the rank's rows, ``parts`` (P, 2n, D) every rank's, ``dots`` (P, 2n) their
    raw positive dots (the tile path's column shift).  Returns ``lse_d, loss_d, partial,
    state``: the diagonal block's row log-sum-exps and losses, the (2, 2n) (m, s) state of
    this rank's other row partials (its main and half blocks), and the (2, width) column
    state it sends (main block's columns, then the half block's).
    """
    xp = np if not path.gpu else _cupy()
    n2, h = plan.n2, plan.h
    a = np.float64 if z.dtype == np.float64 else np.float32
    lse_d, loss_d, _ = path.rows(
        z, z, None, None, scale, exclude_diag=True, pos_shift=h, pos_mod=n2, lse_in=None,
        weights=(None, 0, 0.0), want_grad=False, workspace_bytes=workspace_bytes,
        op="nt_xent", self_pair=True)
    partial = _empty_states(xp, 2, n2, a)
    state = _empty_states(xp, 1, plan.width, a)[0]
    if plan.cols:
        cols, shift = _columns(xp, plan.cols, parts, dots)
        lse_m, st, _ = engine.cross(z, cols, scale, lse_r=None, lse_c=None,
                                    weights=None, want_stats=True, want_grad=False,
                                    workspace_bytes=workspace_bytes, col_shift=shift)
        partial[0, 0] = lse_m
        partial[0, 1] = 1
        state[:, :plan.main_width] = st
    if plan.lead:
        lse_h, st, _ = engine.cross(z[:h], parts[plan.opp], scale, lse_r=None, lse_c=None,
                                    weights=None, want_stats=True, want_grad=False,
                                    workspace_bytes=workspace_bytes, col_shift=dots[plan.opp])
        partial[1, 0, :h] = lse_h
        partial[1, 1, :h] = 1
        state[:, plan.k * n2:] = st
    return lse_d, loss_d, partial, state


def nt_xent_lse(plan: NtXentPlan, engine, lse_d, partial, states):
    """The rank's rows' global log-sum-exps: its diagonal block's, its own blocks' and the
    other ranks' column states of its rows (``states`` (P, 2, width)), merged in a fixed
    order (the same bits for the same inputs and world size)."""
    xp = np if isinstance(lse_d, np.ndarray) else _cupy()
    src = plan.sources()
    own = 1 + partial.shape[0]  # (the all-gather schedule's 2 partials, the ring's one a block)
    stack = _empty_states(xp, own + len(src), plan.n2, lse_d.dtype)
    stack[0, 0] = lse_d
    stack[0, 1] = 1
    stack[1:own] = partial
    for i, (r, off, rows) in enumerate(src):
        stack[own + i, :, rows] = states[r, :, off:off + rows.stop - rows.start]
    return engine.col_lse(stack)


def nt_xent_grads(path: Path, engine, plan: NtXentPlan, z, parts, scale: float, lse_all,
                  w_all, w_mul: float, workspace_bytes: Optional[int]):
    """The gradient pass of a rank's blocks: ``(P, 2n, D)`` accumulators of the weighted
    global loss with respect to every rank's rows (this rank's slot: its own rows; zeros
    where it computed nothing) — what the reduce-scatter sums at the owners.

    ``lse_all`` (P, 2n): every row's global log-sum-exp; ``w_all`` (P, 2n) the rows'
    weights (None: all ``w_mul``)."""
    xp = np if not path.gpu else _cupy()
    rank, n2, h = plan.rank, plan.n2, plan.h
    a = lse_all.dtype
    out = xp.zeros((plan.size, n2, z.shape[1]), a)
    w_own = None if w_all is None else w_all[rank]
    _, _, (dd, _, _, _) = path.rows(
        z, z, None, None, scale, exclude_diag=True, pos_shift=h, pos_mod=n2,
        lse_in=lse_all[rank], weights=(w_own, 1, w_mul), want_grad=True,
        workspace_bytes=workspace_bytes, op="nt_xent", self_pair=True)
    out[rank] = dd
    pairs = []
    if plan.cols:
        pairs.append((slice(0, n2), plan.cols))
    if plan.lead:
        pairs.append((slice(0, h), [(plan.opp, slice(0, n2))]))
    for rows, cols in pairs:
        k, lse_c = _columns(xp, cols, parts, lse_all)
        w_c = None if w_all is None else _columns(xp, cols, None, w_all)[1]
        _, _, (dq, dk) = engine.cross(
            z[rows], k, scale, lse_r=lse_all[rank][rows], lse_c=lse_c,
            weights=(None if w_own is None else w_own[rows], w_c, w_mul), want_stats=False,
            want_grad=True, workspace_bytes=workspace_bytes)
        out[rank, rows] += dq
        off = 0
        for r, sl in cols:
            width = sl.stop - sl.start
            out[r, sl] += dk[off:off + width]
            off += width
    return out


def _columns(xp, cols, parts, per_row):
    """The rows ``cols`` ((owner, slice) list) of ``parts`` (P, 2n, D) and of the per-row
    ``per_row`` (P, 2n), concatenated in order (either may be None)."""
    def cat(src):
        if src is None:
            return None
        pieces = [src[r, sl] for r, sl in cols]
        return pieces[0] if len(pieces) == 1 else xp.concatenate(pieces)
    return cat(parts), cat(per_row)


def _empty_states(xp, count: int, width: int, dtype):
    """``count`` empty (m, s) states (count, 2, width): m = −inf, s = 0 (merging adds nothing)."""
    out = xp.zeros((count, 2, width), dtype)
    out[:, 0] = -np.inf
    return out


def _cupy():
    import cupy

    return cupy


def info_nce_block(path: Path, q, k, others, neg_p, scale: float, *, lse_in, weights,
                   want_grad: bool, workspace_bytes: Optional[int], scale_log=None,
                   labels=None, smoothing: float = 0.0, hardness=None
                   ) -> Tuple[Any, Any, Tuple[Any, Any, Any, Any]]:
    """A rank's rows of the global InfoNCE.

    ``q``, ``k`` (n, D): the rank's queries and their keys; ``others`` (M, D) or None: the keys
    of every other rank and every rank's shared negatives; ``neg_p`` (n, Mp, D) or None: the
    rank's per-query negatives.  Row i's positive is key i.  Returns ``lse, loss,
    (dq, dk, d_others, d_neg_p)`` as :func:`nt_xent_block`.  ``scale_log``: a learnable log
    scale t (a (1,) array); the logits are then ``scale · exp(t) · q·c``.  ``labels``: (the
    rank's row labels, the labels of its keys then of the other ranks' keys) and
    ``smoothing``, as the engine's ``rows``; ``hardness``: its :class:`Hardness` (row i's own
    columns among ``others``: this rank's shared negatives).
    """
    lse, loss, grads = path.rows(
        q, k, others, neg_p, scale, exclude_diag=False, pos_shift=0, pos_mod=q.shape[0],
        lse_in=lse_in, weights=weights, want_grad=want_grad, workspace_bytes=workspace_bytes,
        op="info_nce", scale_log=scale_log, labels=labels, smoothing=smoothing,
        hardness=hardness)
    return lse, loss, grads
