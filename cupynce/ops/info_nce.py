"""Query/key InfoNCE with in-batch negatives and optional explicit negatives, on CuPy and NumPy.

query, key (N, D) are paired by row: key i is query i's positive, the other N − 1 keys its
in-batch negatives; ``negatives`` adds (M, D) shared or (N, M, D) per-query negatives.
Entry points as for NT-Xent (:mod:`cupynce.ops.nt_xent`): :func:`info_nce`,
:func:`info_nce_forward`, :func:`info_nce_backward`, :func:`info_nce_backward_from_stats`.

Reference: van den Oord et al., "Representation Learning with Contrastive Predictive
Coding", 2018.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from .. import _checks, config
from .._engine import side, tail, tiling
from .._engine.kernels import acc_dtype
from .._engine.losses.row_blocks import Hardness
from . import _comm, _global, _graphs, _local, _memo
from ._base import (Context, Path, check_stats, contig_inputs, contig_remembered,
                    dtemperature, finish_all, in_ctx_precision, prep, reduce,
                    reduce_out, require, temperature_input, temperature_result, weights)
from ._comm import Comm
from ._info_nce_ring import ring_share

__all__ = ["info_nce", "info_nce_forward", "info_nce_backward",
           "info_nce_backward_from_stats"]


def _check(query, key, negatives, temperature, reduction, workspace_bytes,
           normalize, precision):
    op = "info_nce"
    xp = _checks.array_module(op, query=query, key=key, negatives=negatives,
                              optional=("negatives",))
    _checks.check_matrix(op, "query", query)
    _checks.check_matrix(op, "key", key)
    if key.shape[0] != query.shape[0]:
        raise ValueError(f"info_nce: query and key must have the same number of rows "
                         f"(paired by row), got {tuple(query.shape)} and {tuple(key.shape)}")
    _checks.check_same(op, ("query", "key"), (query.shape[1], key.shape[1]), "feature sizes D")
    if negatives is not None:
        if negatives.ndim not in (2, 3):
            raise ValueError(f"info_nce: negatives must be (M, D) shared or (N, M, D) per query, "
                             f"got shape {tuple(negatives.shape)}")
        _checks.check_float(op, "negatives", negatives)
        if negatives.shape[-1] != query.shape[1]:
            raise ValueError(f"info_nce: negatives must have D={query.shape[1]} features like "
                             f"query, got shape {tuple(negatives.shape)}")
        if negatives.ndim == 3 and negatives.shape[0] != query.shape[0]:
            raise ValueError(f"info_nce: per-query negatives must be (N={query.shape[0]}, M, D), "
                             f"got shape {tuple(negatives.shape)}")
    _checks.check_same_dtype(op, query=query, key=key, negatives=negatives)
    t = temperature_input(op, temperature, xp, query, acc_dtype(query.dtype))
    return xp, t, _checks.check_flags(op, reduction, workspace_bytes, normalize, precision)


def _prep_all(xp, path, query, key, negatives, normalize: bool):
    """(laid-out inputs, their norms, (q̂, k̂, shared negatives, per-query negatives))."""
    query, key, negatives = contig_inputs(xp, query, key, negatives)
    qn, nq = prep(path, query, normalize)
    kn, nk = prep(path, key, normalize)
    negn, nneg = prep(path, negatives, normalize)
    neg_s = negn if negatives is not None and negatives.ndim == 2 else None
    neg_p = negn if negatives is not None and negatives.ndim == 3 else None
    return (query, key, negatives), (nq, nk, nneg), (qn, kn, neg_s, neg_p)


def _hardness(op: str, hardness_mode: Any, hardness_strength: Any, negatives, n: int,
              replicated: bool, rank: int = 0, size: int = 1) -> Optional[Hardness]:
    """The row kernel's :class:`Hardness` (None without a weighting), after the checks: row
    i's own columns are its hard negatives in sentence-transformers' layout -- the rank's
    shared negatives i, i + n, i + 2n, ... (the library concatenates each negative column's n
    rows), which follow every rank's keys -- and its per-query negatives; replicated
    negatives (a queue) are nobody's own.  The in-batch and hard-negative modes need the
    shared negatives' count a multiple of n (ValueError)."""
    code, alpha = _checks.check_hardness(op, hardness_mode, hardness_strength)
    if not code:
        return None
    shared = negatives is not None and negatives.ndim == 2 and not replicated
    m = negatives.shape[0] if shared else 0
    if code in (1, 2) and m % n:
        name = {c: m for m, c in _checks.HARDNESS_MODES.items()}[code]
        raise ValueError(f"{op}: hardness_mode={name!r} finds each query's own hard "
                         f"negatives in sentence-transformers' layout (shared negatives of "
                         f"k * N rows, query i's at rows i, i + N, ...): got negatives of "
                         f"shape {tuple(negatives.shape)} for N = {n}")
    return Hardness(code, alpha, n * size + rank * m, m, n)


def _queue_path(in_batch_negatives: Any, eps: float, hard, negatives, n: int,
                temp) -> bool:
    """MoCo's rows (``in_batch_negatives=False``, no labels -- the forward refuses both --,
    no smoothing or hardness, shared negatives at least as many as the rows, a host scale)
    take :func:`_queue_rows`: the engine's plain row softmax over the queue alone (the score
    tiles where they apply) instead of the labelled row blocks."""
    return (not in_batch_negatives and not eps and hard is None and negatives is not None
            and negatives.ndim == 2 and negatives.shape[0] >= n and temp.scale_log is None)


def _queue_plan_bytes(query, negatives, workspace_bytes, neg_grad: bool = True) -> int:
    """What a graph plan of the queue rows holds beside its O(N·D) outputs, at most: the
    queue's static copy, its float32 gradient (unless ``neg_grad`` is False and the score
    tiles run, which then skip it) and the gradient block (under the tiles' budget,
    :func:`_queue_rows`) -- ``_graphs.run``'s ``est_bytes``, so that a queue too large for a
    plan runs uncaptured at once instead of after a refused capture."""
    n, (m, d) = query.shape[0], negatives.shape
    block = min(n * m * query.dtype.itemsize, config.current().tile_workspace_bytes
                if workspace_bytes is None else workspace_bytes)
    skipped = not neg_grad and tiling.tiles_ok(query, negatives)
    return negatives.nbytes + (0 if skipped else 4 * m * d) + block


def _queue_rows(xp, path, qn, kn, neg_s, scale: float, w, want_grad: bool, ws, lse_in=None,
                neg_grad: bool = True):
    """MoCo's rows: query i's candidates are key i and the M >= N shared negatives.

    The queue's log-sum-exps are the engine's row softmax over the negatives alone with a
    stand-in positive (column i, its loss unused); the key's logit joins them O(N)
    (lse_i = logaddexp(lse_queue_i, l_ii)).  The gradient pass takes that full lse, so its
    softmax is right at every negative; the stand-in's "−1 at column i" is undone and the
    key's column added, O(N·D): dq_i += w_i s (neg_i + (p_i − 1) k_i), dneg_i += w_i s q_i,
    dk_i = w_i s (p_i − 1) q_i, with w_i s the row's weight times the scale and p_i the key's
    probability.  Deterministic (each fix-up touches one row).  On the GPU the workspace
    defaults to ``config.tile_workspace_bytes`` (the gradient block in row blocks).
    ``neg_grad=False`` (a detached queue, MoCo's): no dneg -- the score tiles skip the
    queue's product Gᵀ q̂, a third of the gradient pass's products.  Returns the engine's
    ``lse, loss, (dq, dk, dneg, None)``."""
    n, m = qn.shape[0], neg_s.shape[0]
    a = acc_dtype(qn.dtype)
    if ws is None and xp is not np:
        # (the N x M gradient block under the CLIP / SigLIP tiles' default budget, not the
        # general cap: a 4096 x 65536 bf16 queue's whole block is 512 MiB, eager PyTorch's
        # logits and their gradient ~1.5 GiB)
        ws = config.current().tile_workspace_bytes
    dots = _local.engine_for(xp).pair_dots(qn, kn)
    pos = dots * a.type(scale)
    kw = dict(exclude_diag=False, pos_shift=0, pos_mod=m, workspace_bytes=ws, op="info_nce")
    lse = lse_in
    if lse is None:
        lse_q, _, _ = path.rows(qn, neg_s, None, None, scale, lse_in=None,
                                weights=(None, 0, 0.0), want_grad=False, **kw)
        lse = xp.logaddexp(xp.asarray(lse_q), pos)
    loss = lse - pos
    if not want_grad:
        return lse, loss, (None, None, None, None)
    with tail.not_last():  # (the fix-ups below add to what the products write)
        _, _, (dq, dneg, _, _) = path.rows(qn, neg_s, None, None, scale, lse_in=lse,
                                           weights=w, want_grad=True, col_grads=neg_grad,
                                           **kw)
    w_arr, stride, mul = w
    wv = (xp.full((n,), mul * scale, a) if w_arr is None else
          (xp.asarray(w_arr, dtype=a).reshape(-1)[xp.arange(n) * stride] * a.type(mul * scale)))
    c = wv * (xp.exp(pos - lse) - 1)
    qa, ka = qn.astype(a, copy=False), kn.astype(a, copy=False)
    dq += wv[:, None] * neg_s[:n].astype(a) + c[:, None] * ka
    if not neg_grad:
        dneg = None
    else:
        dneg[:n] += wv[:, None] * qa
    return lse, loss, (dq, c[:, None] * qa, dneg, None)


def _batch_labels(xp, labels, in_batch_negatives: Any, n: int, like):
    """``labels`` as the forward takes them: ``in_batch_negatives=False`` (only key i and the
    explicit negatives are query i's candidates: MoCo's queue, lightly's memory bank) is one
    label for every row -- every other key leaves every query's candidates."""
    if _checks.check_bool("info_nce", "in_batch_negatives", in_batch_negatives):
        return labels
    if labels is not None:
        raise ValueError("info_nce: labels= with in_batch_negatives=False: no in-batch key is "
                         "a candidate, so there is nothing to mask; pass one of them")
    if xp is np:
        return np.zeros((n,), np.int64)
    with like.device:  # (the inputs' GPU)
        return xp.zeros((n,), np.int64)


def info_nce_forward(query, key, temperature: Any = 0.1, *, negatives=None, labels=None,
                     label_smoothing: float = 0.0, in_batch_negatives: bool = True,
                     replicated_negatives: bool = False, reduction: str = "mean",
                     normalize: bool = False, workspace_bytes: Optional[int] = None,
                     requires_grad: bool = True, temperature_grad: bool = False, group=None,
                     precision: Optional[str] = None, hardness_mode: Optional[str] = None,
                     hardness_strength: float = 0.0,
                     negatives_grad: bool = True) -> Tuple[Any, Context]:
    """Query/key InfoNCE with in-batch negatives (and optional explicit ones).

    Parameters
    ----------
    query, key : (N, D) arrays, paired by row; key i is query i's positive and the other
        N − 1 keys are its in-batch negatives.
    negatives : None, (M, D) or (N, M, D)
        Extra negatives added to the candidates: shared by every query (M, D), or
        per query (N, M, D).
    labels : None or an integer (N,) array of the inputs' kind
        Row i's label (query i's and key i's): a key j != i of row i's label is no negative
        of query i (left out of its log-sum-exp); the explicit negatives stay negatives.
        Equal labels mark duplicates or false negatives in the batch.
    label_smoothing : float in [0, 1), default 0
        ``F.cross_entropy``'s label smoothing over each query's candidates (those left
        after ``labels``): the target is 1 - ε on key i plus ε spread evenly over them.
        With ``labels`` or ε > 0 the GPU call takes the row blocks (the score tiles do not
        take them yet) and no CUDA-graph replay.  With ``group``: each rank's rows' labels,
        gathered with the keys (every rank passes labels, or none does).
    in_batch_negatives : bool, default True
        False: the other rows' keys are no candidates; query i's are key i and the explicit
        negatives alone (MoCo's loss against its queue, lightly's memory bank).  Computed as
        one label for every row (``labels`` must be None): the row blocks, as with labels.
    replicated_negatives : bool, default False
        With ``group``: the shared (M, D) negatives are the same on every rank (a queue
        gathered at its enqueue, :class:`cupynce.torch.NegativeQueue`), so they join the
        candidates once, not once per rank; their gradient is the global loss's (summed
        over the ranks, no factor P: the same on every rank).  Without ``group``: no effect.
    temperature, reduction, normalize, workspace_bytes, requires_grad, temperature_grad : as
        for nt_xent (a temperature array: its gradient; dL/dτ = ``−(1/τ) Σ_i q̂_i · ∂L/∂q̂_i``,
        the logits being of degree 1 in the queries).  ``normalize`` applies to query, key
        and negatives alike.
    group : communicator, optional
        The loss of the global batch across ranks: a ``cupy.cuda.nccl.NcclCommunicator``
        (or a ``cupyx.distributed`` NCCL backend) for CuPy arrays, or a
        :class:`cupynce.ops._comm.Comm`.  Every rank passes its local rows (equal counts); every
        rank's keys and shared negatives are candidates of every query;
        the gradients from ``*_backward`` are P times those of the global loss with respect
        to the local rows (the data-parallel convention, see ``cupynce.ops._global``).
    precision : "auto" | "fp32" | "tf32" | "3xtf32", optional
        float32 products on the GPU; as for :func:`cupynce.nt_xent_forward`.
    hardness_mode, hardness_strength : None / "in_batch_negatives" / "hard_negatives" /
        "all_negatives", and a real α >= 0 (default None, 0: none)
        sentence-transformers' hardness weighting (Lan et al. 2025): a penalised candidate's
        logit is ``q̂·ĉ/τ + α·stopgrad(q̂·ĉ)`` -- the softmax sees it, the gradient keeps
        the factor 1/τ.  Query i's *own* candidates are its hard negatives in the library's
        layout: shared negatives i, i + N, i + 2N, ... (M a multiple of N; with ``group``,
        the rank's own) and all its per-query negatives; replicated negatives (a queue) are
        nobody's, with or without ``group``.
        Penalised: "in_batch_negatives" every candidate but key i and the own ones,
        "hard_negatives" the own ones, "all_negatives" every candidate but key i.  On the GPU
        the row blocks, as with labels.
    negatives_grad : bool, default True
        False: the negatives need no gradient (MoCo's queue is detached), and
        :func:`info_nce_backward` returns None for them.  On MoCo's queue rows
        (``in_batch_negatives=False``, 2-D negatives, M >= N) on the score tiles the gradient
        pass then skips their product (a third of its products); elsewhere their gradient
        is computed and dropped.  The ``cupynce.torch`` op passes
        ``negatives.requires_grad``.  With ``group``: ignored (computed).

    Notes
    -----
    ``loss_i = log Σ_{c ∈ C_i} exp(q̂_i·ĉ/τ) − q̂_i·k̂_i/τ`` with candidates C_i = all keys,
    plus the shared negatives, plus query i's own negatives (less, with ``labels``, the keys
    of query i's label but its own; with smoothing ε the last term is
    ``(1 − ε) q̂_i·k̂_i/τ + ε/|C_i| Σ_{c ∈ C_i} q̂_i·ĉ/τ``).  (info-nce-pytorch drops the
    in-batch keys when explicit negatives are given; here they are always candidates.)
    """
    neg_grad = _checks.check_bool("info_nce", "negatives_grad", negatives_grad)
    if group is not None:
        return _global_forward(
            _comm.wrap(group), query, key, temperature, negatives=negatives, labels=labels,
            label_smoothing=label_smoothing, in_batch_negatives=in_batch_negatives,
            replicated_negatives=replicated_negatives, reduction=reduction,
            normalize=normalize, workspace_bytes=workspace_bytes, requires_grad=requires_grad,
            temperature_grad=temperature_grad, precision=precision,
            hardness_mode=hardness_mode, hardness_strength=hardness_strength)
    _checks.check_bool("info_nce", "replicated_negatives", replicated_negatives)
    sig = _memo.signature("info_nce", query, key, negatives, temperature)
    hit = _memo.known(sig)
    if hit:  # the arrays and temperature passed these checks before, laid out (_memo)
        xp = _checks.cupy_module()
        temp = temperature_input("info_nce", temperature, xp, query, acc_dtype(query.dtype))
        p = _checks.check_flags("info_nce", reduction, workspace_bytes, normalize, precision)
    else:
        xp, temp, p = _check(query, key, negatives, temperature, reduction, workspace_bytes,
                             normalize, precision)
    _checks.check_bool("info_nce", "requires_grad", requires_grad)
    tgrad = _checks.check_bool("info_nce", "temperature_grad", temperature_grad)
    neg_grad = neg_grad and negatives is not None
    want_dt = requires_grad and (temp.array or tgrad)
    t = temp.value
    n = query.shape[0]
    labels = _batch_labels(xp, _checks.check_labels("info_nce", labels, n, xp, query),
                           in_batch_negatives, n, query)
    eps = _checks.check_smoothing("info_nce", label_smoothing)
    hard = _hardness("info_nce", hardness_mode, hardness_strength, negatives, n,
                     replicated_negatives is True)
    path = Path(xp)
    (query, key, negatives), sig = contig_remembered(xp, sig, hit, query, key, negatives)
    fused = requires_grad and reduction != "none"
    queue = _queue_path(in_batch_negatives, eps, hard, negatives, n, temp)
    masks = dict(labels=None if labels is None or queue else (labels, labels), smoothing=eps,
                 hardness=hard)

    def compute(query, key, negatives=None):
        _, norms, (qn, kn, neg_s, neg_p) = _prep_all(xp, path, query, key, negatives,
                                                     normalize)
        # the reduced loss needs only the statistics: beside the gradient pass (_engine/side;
        # its output allocated before the fork)
        with side.branch() as br:
            out = reduce_out(xp, reduction, acc_dtype(query.dtype))
            w = weights(xp, None, reduction, n, acc_dtype(query.dtype))
            if queue:
                lse, loss, grads = _queue_rows(xp, path, qn, kn, neg_s, temp.scale, w, fused,
                                               workspace_bytes, neg_grad=neg_grad)
            else:
                lse, loss, grads = path.rows(
                    qn, kn, neg_s, neg_p, temp.scale, exclude_diag=False, pos_shift=0,
                    pos_mod=n, lse_in=None, weights=w, want_grad=fused,
                    workspace_bytes=workspace_bytes, op="info_nce", scale_log=temp.scale_log,
                    **masks)
            with br.beside():
                total = reduce(xp, loss, reduction, out)
        dq, dk, dns, dnp = grads
        return ((total, lse, dq, dk, (dns if dns is not None else dnp) if neg_grad else None)
                + tuple(norms)), (qn, kn, neg_s, neg_p)

    with config.float32_precision(p):  # (the graph key carries it too)
        # (a graph replays only the inputs it was given: labels are not among them -- the
        # queue path reads none)
        if path.gpu and (fused or not requires_grad) and (labels is None or queue) \
                and not eps and hard is None and temp.scale_log is None and not want_dt:
            inputs = (query, key) + (() if negatives is None else (negatives,))
            outs = _graphs.run(
                ("info_nce", t, reduction, normalize, workspace_bytes, fused,
                 None if negatives is None else negatives.ndim, queue, neg_grad), inputs,
                lambda *xs: compute(*xs)[0], layout=sig,
                est_bytes=_queue_plan_bytes(query, negatives, workspace_bytes, neg_grad)
                if queue else 0)
        else:
            outs, xn = compute(query, key, negatives)
    loss, lse, dq, dk, dneg, nq, nk, nneg = outs
    ctx = Context("info_nce", reduction, n, xp, stats=(lse,) if requires_grad else (),
                  precision=p)
    base = dict(x=(query, key, negatives), norms=(nq, nk, nneg), temp=temp, tgrad=tgrad)
    if fused:
        ctx.saved = dict(base, acc=(dq, dk, dneg),
                         dt=dtemperature(xp, xn[0], dq, temp, 1) if want_dt else None)
    elif requires_grad:
        ctx.saved = dict(base, xn=xn, lse=lse, ws=workspace_bytes, masks=masks, queue=queue,
                         neg_grad=neg_grad)
    return loss, ctx


@in_ctx_precision
def info_nce_backward(ctx: Context, grad_loss: Any = 1.0):
    """Gradients ``(dquery, dkey, dnegatives)`` of :func:`info_nce_forward`'s loss.

    ``dnegatives`` is None when no negatives were given (or the forward had
    ``negatives_grad=False``).  Dtypes follow the inputs.  For a
    forward with ``temperature_grad=True``: ``(dquery, dkey, dnegatives, dtemperature)``.
    The products run in the forward's float32 precision (``ctx.precision``).
    """
    require(ctx, "info_nce")
    if "global" in ctx.saved:
        return _global.backward(ctx, grad_loss)
    xp, s = ctx.xp, ctx.saved
    path = Path(xp)
    g = _checks.check_grad_loss("info_nce_backward", grad_loss, ctx.reduction, ctx.n, xp)
    a = acc_dtype(s["x"][0].dtype)
    temp = s["temp"]
    if "acc" in s:
        grads = tuple(finish_all(path, s["x"], s["norms"], s["acc"], path.grad_scale(g, a)))
        if not s["tgrad"]:
            return grads
        return grads + (temperature_result(path, xp, s["dt"] * g, temp),)
    qn, kn, neg_s, neg_p = s["xn"]
    w = weights(xp, g, ctx.reduction, ctx.n, a)
    neg_grad = s.get("neg_grad", True)
    if s.get("queue"):
        _, _, (dq, dk, dns, dnp) = _queue_rows(xp, path, qn, kn, neg_s, temp.scale, w, True,
                                               s["ws"], lse_in=s["lse"], neg_grad=neg_grad)
    else:
        _, _, (dq, dk, dns, dnp) = path.rows(
            qn, kn, neg_s, neg_p, temp.scale, exclude_diag=False, pos_shift=0, pos_mod=ctx.n,
            lse_in=s["lse"], weights=w, want_grad=True, workspace_bytes=s["ws"], op="info_nce",
            scale_log=temp.scale_log, **s["masks"])
    dt = dtemperature(xp, qn, dq, temp, 1) if s["tgrad"] else None
    accs = (dq, dk, (dns if dns is not None else dnp) if neg_grad else None)
    grads = tuple(finish_all(path, s["x"], s["norms"], accs, None))
    return grads + (temperature_result(path, xp, dt, temp),) if s["tgrad"] else grads


def info_nce_backward_from_stats(query, key, negatives, lse, grad_loss: Any = 1.0, *,
                                 temperature: Any = 0.1, labels=None,
                                 label_smoothing: float = 0.0,
                                 in_batch_negatives: bool = True, reduction: str = "mean",
                                 normalize: bool = False, workspace_bytes: Optional[int] = None,
                                 temperature_grad: bool = False,
                                 precision: Optional[str] = None,
                                 hardness_mode: Optional[str] = None,
                                 hardness_strength: float = 0.0,
                                 replicated_negatives: bool = False):
    """``(dquery, dkey, dnegatives)`` from the inputs and ``ctx.stats[0]`` (row lse) alone.

    See :func:`nt_xent_backward_from_stats` (``precision`` too); ``dnegatives`` is None
    without negatives; ``labels``, ``label_smoothing``, ``in_batch_negatives``, the hardness
    and ``replicated_negatives`` (whose queue has no owner) as the forward's; with
    ``temperature_grad``, ``dtemperature`` last.
    """
    xp, t, p = _check(query, key, negatives, temperature, reduction, workspace_bytes,
                      normalize, precision)
    tgrad = _checks.check_bool("info_nce", "temperature_grad", temperature_grad)
    n = query.shape[0]
    labels = _batch_labels(xp, _checks.check_labels("info_nce", labels, n, xp, query),
                           in_batch_negatives, n, query)
    eps = _checks.check_smoothing("info_nce", label_smoothing)
    hard = _hardness("info_nce", hardness_mode, hardness_strength, negatives, n,
                     _checks.check_bool("info_nce", "replicated_negatives",
                                        replicated_negatives))
    queue = _queue_path(in_batch_negatives, eps, hard, negatives, n, t)
    masks = dict(labels=None if labels is None or queue else (labels, labels), smoothing=eps,
                 hardness=hard)
    check_stats("info_nce", xp, n, query.dtype, lse=lse)
    path = Path(xp)
    (query, key, negatives), (nq, nk, nneg), (qn, kn, neg_s, neg_p) = _prep_all(
        xp, path, query, key, negatives, normalize)
    ctx = Context("info_nce", reduction, n, xp, stats=(lse,), precision=p, saved=dict(
        x=(query, key, negatives), norms=(nq, nk, nneg), xn=(qn, kn, neg_s, neg_p), lse=lse,
        temp=t, tgrad=tgrad, ws=workspace_bytes, masks=masks, queue=queue))
    return info_nce_backward(ctx, grad_loss)


def _torch_forward(query, key, temperature, *, in_batch_negatives: float = 1.0,
                   replicated_negatives: float = 0.0, negatives_grad: float = 1.0, **kw):
    """``cupynce.torch``'s forward: :func:`info_nce_forward` with the schema's
    ``in_batch_negatives``, ``replicated_negatives`` and ``negatives_grad`` (reals, 1.0 /
    0.0)."""
    return info_nce_forward(query, key, temperature, in_batch_negatives=bool(in_batch_negatives),
                            replicated_negatives=bool(replicated_negatives),
                            negatives_grad=bool(negatives_grad), **kw)


def _torch_backward(query, key, temperature, negatives, lse, grad_loss, *, labels=None,
                    label_smoothing: float = 0.0, hardness_mode: Any = None,
                    hardness_strength: float = 0.0, in_batch_negatives: float = 1.0,
                    replicated_negatives: float = 0.0, negatives_grad: float = 1.0,
                    reduction: str = "mean", normalize: bool = False,
                    workspace_bytes: Optional[int] = None, precision: Optional[str] = None):
    """``cupynce.torch``'s backward op: ``(dquery, dkey, dtemperature, dnegatives)``, the op's
    input order (a zero 0-d placeholder for a real temperature: no such input needs
    one).  ``negatives_grad`` is the forward's; this recompute returns dnegatives anyway
    (autograd drops what no input needs)."""
    kw = dict(temperature=temperature, labels=labels, label_smoothing=label_smoothing,
              hardness_mode=hardness_mode, hardness_strength=hardness_strength,
              in_batch_negatives=bool(in_batch_negatives),
              replicated_negatives=bool(replicated_negatives), reduction=reduction,
              normalize=normalize, workspace_bytes=workspace_bytes, precision=precision)
    if isinstance(temperature, float):
        xp = _checks.array_module("info_nce", query=query)
        dq, dk, dn = info_nce_backward_from_stats(query, key, negatives, lse, grad_loss, **kw)
        return dq, dk, xp.zeros((), acc_dtype(query.dtype)), dn
    dq, dk, dn, dt = info_nce_backward_from_stats(query, key, negatives, lse, grad_loss,
                                                  temperature_grad=True, **kw)
    return dq, dk, dt, dn


def info_nce(query, key, temperature: Any = 0.1, *, negatives=None, labels=None,
             label_smoothing: float = 0.0, in_batch_negatives: bool = True,
             replicated_negatives: bool = False, reduction: str = "mean",
             normalize: bool = False, workspace_bytes: Optional[int] = None, group=None,
             precision: Optional[str] = None, hardness_mode: Optional[str] = None,
             hardness_strength: float = 0.0):
    """Query/key InfoNCE loss; see :func:`info_nce_forward`."""
    return info_nce_forward(query, key, temperature, negatives=negatives, labels=labels,
                            label_smoothing=label_smoothing, hardness_mode=hardness_mode,
                            hardness_strength=hardness_strength,
                            in_batch_negatives=in_batch_negatives,
                            replicated_negatives=replicated_negatives, reduction=reduction,
                            normalize=normalize, workspace_bytes=workspace_bytes,
                            requires_grad=False, group=group, precision=precision)[0]


# ---- across ranks: this op's schedule for cupynce.ops._global ----------------------------
def _global_forward(comm: Comm, query, key, temperature=0.1, *, negatives=None, labels=None,
                    label_smoothing=0.0, in_batch_negatives=True, replicated_negatives=False,
                    reduction="mean", normalize=False, workspace_bytes=None,
                    requires_grad=True, temperature_grad=False, precision=None,
                    hardness_mode=None, hardness_strength=0.0):
    """:func:`info_nce_forward` over ``comm``'s global batch (see :mod:`cupynce.ops._global`).

    Every rank's keys and shared (M, D) negatives join every query's candidates (replicated
    ones: once); per-query (n, M, D) negatives stay with their query.
    """
    op = "info_nce"
    precision = _global.precision_setting(precision)
    kind = 0 if negatives is None else getattr(negatives, "ndim", 0) - 1
    def checks():
        xp, t, p = _check(query, key, negatives, temperature, reduction, workspace_bytes,
                          normalize, precision)
        _checks.check_bool(op, "requires_grad", requires_grad)
        _checks.check_bool(op, "temperature_grad", temperature_grad)
        _checks.check_bool(op, "replicated_negatives", replicated_negatives)
        lab = _batch_labels(xp, _checks.check_labels(op, labels, query.shape[0], xp, query),
                            in_batch_negatives, query.shape[0], query)
        _hardness(op, hardness_mode, hardness_strength, negatives, query.shape[0],
                  replicated_negatives is True)
        # (a device temperature too: the rank's rows take its log scale on the device)
        return xp, t, p, lab, _checks.check_smoothing(op, label_smoothing)

    # (every rank with labels or none: their presence is a setting the ranks agree on)
    host_t = _global.host_setting(temperature)  # (the ranks compare the host values)
    (xp, temp, p, labels, eps), ring = _global.agree(
        comm, op, checks, [query, key, negatives], ["query", "key", "negatives"],
        [host_t, reduction, normalize, requires_grad, kind, precision,
         labels is not None, label_smoothing, in_batch_negatives is True,
         replicated_negatives is True, temperature_grad is True,
         hardness_mode if isinstance(hardness_mode, str) else 0, hardness_strength],
        ring_wish=lambda: (not (hardness_mode and hardness_strength and label_smoothing)
                           and in_batch_negatives is True
                           and _global.ring_possible(comm, query, requires_grad, reduction,
                                                     gpu=negatives is None and labels is None
                                                     and not label_smoothing
                                                     and not hardness_mode)))
    t, tgrad = temp.value, bool(temperature_grad) and requires_grad
    with config.float32_precision(p):  # every product of the rank's share (and graph keys)
        path = Path(xp)
        rank, size = comm.rank, comm.size
        n = query.shape[0]
        (query, key, negatives), (nq, nk, nneg), (qn, kn, neg_s, neg_p) = _prep_all(
            xp, path, query, key, negatives, normalize)
        a = acc_dtype(query.dtype)
        fused = requires_grad and reduction != "none"
        hard = _hardness(op, hardness_mode, hardness_strength, negatives, n,
                         replicated_negatives is True, rank, size)
        base = dict(x=(query, key, negatives), norms=(nq, nk, nneg), size=size, temp=temp,
                    tgrad=tgrad)
        rep = bool(replicated_negatives)
        w = weights(xp, None, reduction, n * size, a)
        if ring:  # (_info_nce_ring; hardness without smoothing)
            lse, rows, acc = ring_share(comm, path, qn, kn, temp, w, fused, workspace_bytes,
                                         neg_s, neg_p, rep, labels, eps, hard)
            ctx = Context(op, reduction, n, xp, stats=(lse,) if requires_grad else (),
                          precision=p)
            if fused:
                ctx.saved = dict(base, acc=acc, dt=_global.dtemperature(
                    comm, xp, qn, acc[0], temp, 1) if tgrad else None)
            return _global.loss(comm, xp, rows, reduction, n * size), _global.tag(ctx, _GLOBAL)
        if _queue_path(in_batch_negatives, eps, hard, negatives, n, temp):
            # MoCo's rows: no other rank's key is a candidate (none gathered); the queue's
            # rows (every rank's negatives, or the replicated queue once) beside the own key
            every = neg_s if rep else comm.all_gather(neg_s).reshape(-1, neg_s.shape[1])
            lse, rows, grads = _queue_rows(xp, path, qn, kn, every, temp.scale, w, fused,
                                           workspace_bytes)
            kept = dict(xn=(qn, kn, every, None), queue=True)
        else:
            others = _global.others(xp, comm.all_gather(kn), rank)
            if neg_s is not None:  # every rank's shared negatives, in rank order, after the
                # keys (replicated ones, the same on every rank: once)
                every = neg_s if rep else comm.all_gather(neg_s).reshape(-1, neg_s.shape[1])
                others = every if others is None else xp.concatenate([others, every])
            masks = dict(smoothing=eps, labels=None, hardness=hard)
            if labels is not None:  # the columns' labels: this rank's keys', then the others'
                every_lab = _global.others(xp, comm.all_gather(labels)[:, :, None], rank)
                masks["labels"] = (labels, labels if every_lab is None else
                                   xp.concatenate([labels, every_lab.reshape(-1)]))
            lse, rows, grads = _local.info_nce_block(
                path, qn, kn, others, neg_p, temp.scale, scale_log=temp.scale_log, lse_in=None,
                weights=w, want_grad=fused, workspace_bytes=workspace_bytes, **masks)
            kept = dict(xn=(qn, kn, others, neg_p), masks=masks)
        ctx = Context(op, reduction, n, xp, stats=(lse,) if requires_grad else (),
                      precision=p)
        if fused:
            acc = (_queue_scatter(comm, grads, neg_s, rep) if kept.get("queue") else
                   _global_scatter(comm, xp, grads, n, neg_s, rep))
            ctx.saved = dict(base, acc=acc, dt=_global.dtemperature(comm, xp, qn, grads[0],
                                                                    temp, 1) if tgrad else None)
        elif requires_grad:
            ctx.saved = dict(base, neg_s=neg_s, lse=lse, t=t, ws=workspace_bytes, comm=comm,
                             replicated=rep, **kept)
        return _global.loss(comm, xp, rows, reduction, n * size), _global.tag(ctx, _GLOBAL)


def _global_scatter(comm: Comm, xp, grads, n: int, neg_s, replicated: bool = False):
    """The rank's (dq, dk, dneg) accumulators: the keys' and shared negatives' column-side
    gradients summed at their owners; replicated negatives': every rank's summed, over P
    (``_global.backward`` finishes every accumulator with the factor P: theirs is then the
    global loss's gradient, the same on every rank)."""
    dq, dk, do, dnp = grads
    n_keys = n * (comm.size - 1)
    dk = comm.reduce_scatter(_global.stack_own(xp, dk, do[:n_keys] if n_keys else None, comm.rank))
    if neg_s is not None and replicated:
        return dq, dk, comm.all_reduce(xp.ascontiguousarray(do[n_keys:])) / do.dtype.type(
            comm.size)
    if neg_s is not None:
        return dq, dk, comm.reduce_scatter(do[n_keys:].reshape(comm.size, *neg_s.shape))
    return dq, dk, dnp


def _queue_scatter(comm: Comm, grads, neg_s, replicated: bool):
    """MoCo's rows' (dq, dk, dneg) accumulators: the rank's own query and key rows stay (no
    other rank scores them); the negatives' as :func:`_global_scatter` sends them (a
    replicated queue's: every rank's summed, over P; else each rank's summed at its owner)."""
    dq, dk, dneg, _ = grads
    if replicated:
        return dq, dk, comm.all_reduce(dneg) / dneg.dtype.type(comm.size)
    return dq, dk, comm.reduce_scatter(dneg.reshape(comm.size, *neg_s.shape))


def _global_acc(ctx: Context, g):
    """The "none" backward's accumulators: the rank's rows weighted by their upstream
    gradients."""
    s, xp = ctx.saved, ctx.xp
    qn, kn, others, neg_p = s["xn"]
    w = weights(xp, g, "none", ctx.n, s["lse"].dtype)
    if s.get("queue"):
        grads = _queue_rows(xp, Path(xp), qn, kn, others, s["temp"].scale, w, True, s["ws"],
                            lse_in=s["lse"])[2]
        return _queue_scatter(s["comm"], grads, s["neg_s"], s["replicated"]), (
            (_global.dtemperature(s["comm"], xp, qn, grads[0], s["temp"], 1),)
            if s["tgrad"] else ())
    _, _, grads = _local.info_nce_block(
        Path(xp), qn, kn, others, neg_p, s["temp"].scale, scale_log=s["temp"].scale_log,
        lse_in=s["lse"], weights=w,
        want_grad=True, workspace_bytes=s["ws"], **s["masks"])
    accs = _global_scatter(s["comm"], xp, grads, ctx.n, s["neg_s"], s["replicated"])
    return accs, ((_global.dtemperature(s["comm"], xp, qn, grads[0], s["temp"], 1),)
                  if s["tgrad"] else ())


def _global_result(path, xp, saved, grads, scalars):
    """``(dq, dk, dnegatives)``, and ``dtemperature`` last for a forward with
    ``temperature_grad``."""
    if not saved.get("tgrad"):
        return tuple(grads)
    return tuple(grads) + (temperature_result(path, xp, scalars[0], saved["temp"]),)


_GLOBAL = _global.Schedule(recompute=_global_acc, result=_global_result,
                          scalars=_global.saved_temperature_grad)
