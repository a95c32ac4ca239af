"""The rank-local block of a global (multi-rank) loss: the rank's rows against every column.

With P ranks each holding n rows, the global batch is the concatenation in rank order.  A rank
computes the softmax of its own rows over *all* columns: its own keys first (so that each row's
positive, and for NT-Xent its own excluded column, sit at a fixed local offset) followed by the
columns of every other rank (``others``, in any order: a log-sum-exp does not depend on it).
(CLIP's block, one for both directions, is ``_global.clip_loss_forward`` on the engine's
rectangular ``clip``.)  The results are the rank's rows of the global per-row loss and
log-sum-exps, the row-side gradient of its rows, and the column-side gradients of its own keys and of ``others``.  The
column-side gradients of ``others`` belong to the ranks that own those rows: a collective sums
them there (reduce-scatter), which is how the global gradient is assembled without any rank
ever holding the n × N logits or an N × N matrix.

This module holds no communication; it runs on one device (CuPy) or the CPU (NumPy) through the
same engine as the single-process ops (:class:`_base.Path`), and is what the distributed ops
and their emulated-rank tests call.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from ._base import Path


def nt_xent_block(path: Path, z, others, scale: float, *, lse_in, weights, want_grad: bool,
                  workspace_bytes: Optional[int]) -> Tuple[Any, Any, Tuple[Any, Any, Any]]:
    """A rank's rows of the global NT-Xent.

    ``z`` (2n, D): the rank's [view 1 of its n images; view 2 of them] (normalised if asked);
    ``others`` (2N − 2n, D) or None: every other rank's rows.  Row i's positive is local row
    (i + n) mod 2n, its own row is no candidate, every other row of every rank is.
    ``weights``: as :func:`_base.weights` for the *global* row count (2N for the mean).
    Returns ``lse (2n,), loss (2n,), (d_rows, d_keys, d_others)``: the gradient of the weighted
    global loss with respect to z as rows, z as columns (sum the two for z's own share), and
    ``others`` as columns (accumulators in float32 / float64; None without ``want_grad``).
    """
    n2 = z.shape[0]
    lse, loss, (dq, dk, dns, _) = path.rows(
        z, z, others, None, scale, exclude_diag=True, pos_shift=n2 // 2, pos_mod=n2,
        lse_in=lse_in, weights=weights, want_grad=want_grad, workspace_bytes=workspace_bytes,
        op="nt_xent")
    return lse, loss, (dq, dk, dns)


def info_nce_block(path: Path, q, k, others, neg_p, scale: float, *, lse_in, weights,
                   want_grad: bool, workspace_bytes: Optional[int], scale_log=None
                   ) -> Tuple[Any, Any, Tuple[Any, Any, Any, Any]]:
    """A rank's rows of the global InfoNCE.

    ``q``, ``k`` (n, D): the rank's queries and their keys; ``others`` (M, D) or None: the keys
    of every other rank and every rank's shared negatives; ``neg_p`` (n, Mp, D) or None: the
    rank's per-query negatives.  Row i's positive is key i.  Returns ``lse, loss,
    (dq, dk, d_others, d_neg_p)`` as :func:`nt_xent_block`.  ``scale_log``: a learnable log
    scale t (a (1,) array); the logits are then ``scale · exp(t) · q·c``.
    """
    lse, loss, grads = path.rows(
        q, k, others, neg_p, scale, exclude_diag=False, pos_shift=0, pos_mod=q.shape[0],
        lse_in=lse_in, weights=weights, want_grad=want_grad, workspace_bytes=workspace_bytes,
        op="info_nce", scale_log=scale_log)
    return lse, loss, grads
