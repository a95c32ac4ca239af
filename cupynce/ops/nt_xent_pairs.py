"""NT-Xent over every positive pair (pytorch-metric-learning's ``NTXentLoss(embeddings,
labels)``) on CuPy and NumPy arrays.

z (N, D) stacks the batch's rows, labels (N,) their classes.  Each positive pair (i, p) --
p ≠ i of row i's label -- is its own softmax over p and row i's negatives (the rows of
another label): ``ℓ_ip = −log(e^{S_ip} / (e^{S_ip} + Σ_{n: y_n ≠ y_i} e^{S_in}))``, S = ẑ ẑᵀ / τ.
Unlike SupCon, the other positives are no candidates of a pair's softmax, so the loss is not
linear in the logits of a row: it runs in the row blocks' ``row_pairs`` kernel
(``kernels_src/losses/stats.cu``), which sums each row's pairs in one pass over its scores:
``ℓ_ip = softplus(lse_i − S_ip)`` with lse_i over row i's negatives.  The N × N matrix exists
in row blocks of the workspace only; the labels are read on the device only; no CUDA-graph
replay.  Entry points as for NT-Xent: :func:`nt_xent_pairs`, :func:`nt_xent_pairs_forward`,
:func:`nt_xent_pairs_backward`, :func:`nt_xent_pairs_backward_from_stats`.

Reference: Chen et al. 2020 (SimCLR's NT-Xent); the labelled, pair-wise form is
pytorch-metric-learning's ``NTXentLoss``.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from .. import _checks, config
from .._engine.kernels import acc_dtype
from . import _comm, _cpu, _global, _variants
from ._base import (Context, Path, Temperature, check_stats, contig_inputs, dtemperature,
                    in_ctx_precision, prep, reduce, require, temperature_input,
                    temperature_result)
from ._comm import Comm

__all__ = ["nt_xent_pairs", "nt_xent_pairs_forward", "nt_xent_pairs_backward",
           "nt_xent_pairs_backward_from_stats"]

OP = "nt_xent_pairs"


def _check(z, labels, temperature, reduction, workspace_bytes, normalize, precision,
           min_rows: int = 2):
    xp = _checks.array_module(OP, z=z)
    _checks.check_matrix(OP, "z", z)
    if z.shape[0] < min_rows:  # (a rank's share of a global batch: one row will do)
        raise ValueError(f"{OP}: z needs at least {min_rows} rows, got shape "
                         f"{tuple(z.shape)}")
    labels = _checks.check_labels(OP, labels, z.shape[0], xp, z)
    if labels is None:
        raise TypeError(f"{OP}: labels are required (an integer array of shape "
                        f"({z.shape[0]},))")
    t = temperature_input(OP, temperature, xp, z, acc_dtype(z.dtype))
    p = _checks.check_flags(OP, reduction, workspace_bytes, normalize, precision)
    return xp, xp.asarray(labels, dtype=np.int64), t, p


def _pairs(xp, labels, a):
    """The number of positive pairs Σ_i (|class(y_i)| − 1), a device scalar (a stable sort
    and binary searches: never read on the host)."""
    groups = _variants.label_groups(xp, labels)
    return (groups[4] - groups[3] - 1).sum().astype(a)


def _weights(xp, reduction: str, pairs, a, grad_loss=None):
    """The rows' gradient weights as the engine takes them ``(array, stride, multiplier)``:
    "mean" 1 / (number of pairs) (a device scalar; 0 pairs: weight 0 -- the loss is 0 and so
    is its gradient), "sum" 1, "none" the upstream gradient per row (a real or a 0-d array:
    the same for every row, stride 0)."""
    if reduction == "none":
        if grad_loss is None:
            return None, 0, 1.0
        if isinstance(grad_loss, float):
            return None, 0, grad_loss
        g = xp.asarray(grad_loss, dtype=a).reshape(-1)
        return g, (1 if g.size > 1 else 0), 1.0
    if reduction == "sum" and grad_loss is None:
        return None, 0, 1.0
    w = xp.ones((1,), a) if reduction == "sum" else \
        (1 / xp.maximum(pairs, 1)).reshape(1).astype(a)
    if grad_loss is not None:  # (a real or a 0-d array: never read on the host)
        w = w * xp.asarray(grad_loss, dtype=a)
    return w, 0, 1.0


def _rows(path, zn, labels, t: Temperature, w, want_grad: bool, workspace_bytes):
    lse, loss, (dz, *_rest) = path.rows(
        zn, zn, None, None, t.scale, exclude_diag=False, pos_shift=0, pos_mod=zn.shape[0],
        lse_in=None, weights=w, want_grad=want_grad, workspace_bytes=workspace_bytes, op=OP,
        self_pair=True, scale_log=t.scale_log, pair_labels=labels)
    return lse, loss, dz


def _reduce(xp, loss, pairs, reduction: str):
    if reduction == "none":
        return loss
    total = reduce(xp, loss, "sum")
    if reduction == "mean":
        total = total / xp.maximum(pairs, 1).astype(total.dtype)
    return xp.asarray(total)


def nt_xent_pairs_forward(z, labels, temperature: Any = 0.07, *, reduction: str = "mean",
                          normalize: bool = False, workspace_bytes: Optional[int] = None,
                          requires_grad: bool = True, temperature_grad: bool = False,
                          group=None, precision: Optional[str] = None
                          ) -> Tuple[Any, Context]:
    """The pair-wise labelled NT-Xent loss and a context for :func:`nt_xent_pairs_backward`.

    Parameters
    ----------
    z : (N, D) array (numpy or cupy), float16 / bfloat16 / float32 / float64, N >= 2
    labels : integer (N,) array of the same kind (on z's device), required
        Rows with equal labels are positive pairs (both orders); the rows of other labels are
        a row's negatives.
    temperature : float > 0, or a 0-d / (1,) array, default 0.07 (pytorch-metric-learning's)
        As :func:`cupynce.nt_xent_forward`'s (an array: dL/dτ with ``temperature_grad``).
    reduction : "mean" | "sum" | "none"
        "mean": over the positive pairs (pytorch-metric-learning's ``MeanReducer``; 0, with
        a zero gradient, when the batch has none), "sum": their sum, "none": (N,) each row's
        sum over its pairs (0 for a row without one).
    normalize, workspace_bytes, requires_grad, temperature_grad, precision
        As :func:`cupynce.nt_xent_forward`'s.  ``normalize=True`` is the library's cosine
        similarity.
    group : communicator, optional
        The loss of the global batch across ranks (every rank's rows in rank order, equal
        counts): each rank passes its own z and labels; the normalised rows and the labels
        are all-gathered, each rank computes its rows against all of them (its pairs and
        negatives on every rank), the column-side gradients are reduce-scattered to their
        owners, "mean" divides by the global number of pairs.  The gradients from
        ``*_backward`` are P times those of the global loss (the data-parallel convention,
        ``cupynce.ops._global``); dL/dτ the global one on every rank.

    Returns
    -------
    loss : 0-d array (mean/sum) or (N,) array (none); float32, float64 for float64 input.
    ctx : Context

    Notes
    -----
    With S = ẑ ẑᵀ / τ, P(i) = {p ≠ i : y_p = y_i}, lse_i = log Σ_{n: y_n ≠ y_i} e^{S_in}::

        loss_i = Σ_{p∈P(i)} softplus(lse_i − S_ip)
        ∂loss_i/∂S_ip = −σ(lse_i − S_ip),  ∂loss_i/∂S_in = c_i softmax_neg(S_i)_n,
        c_i = Σ_{p∈P(i)} σ(lse_i − S_ip);  ∂L/∂ẑ = (G + Gᵀ) ẑ / τ

    A row without negatives has lse = −inf: its pairs' losses are 0 (the library's too).
    The library adds its smallest normal number inside the log; the difference is below
    one rounding of the loss unless a pair's probability is below ~1e-38 (float32).
    """
    if group is not None:
        return _global_forward(_comm.wrap(group), z, labels, temperature, reduction=reduction,
                               normalize=normalize, workspace_bytes=workspace_bytes,
                               requires_grad=requires_grad, temperature_grad=temperature_grad,
                               precision=precision)
    xp, labels, t, p = _check(z, labels, temperature, reduction, workspace_bytes, normalize,
                              precision)
    _checks.check_bool(OP, "requires_grad", requires_grad)
    tgrad = _checks.check_bool(OP, "temperature_grad", temperature_grad)
    want_dt = requires_grad and (t.array or tgrad)
    path = Path(xp)
    n = z.shape[0]
    z = contig_inputs(xp, z)[0]
    a = acc_dtype(z.dtype)
    fused = requires_grad and reduction != "none"
    with config.float32_precision(p):
        zn, norm = prep(path, z, normalize)
        pairs = _pairs(xp, labels, a)
        w = _weights(xp, reduction, pairs, a) if fused else (None, 0, 1.0)
        lse, loss, dz = _rows(path, zn, labels, t, w, fused, workspace_bytes)
    ctx = Context(OP, reduction, n, xp, stats=(lse,) if requires_grad else (), precision=p)
    if fused:
        ctx.saved = dict(z=z, norm=norm, dz=dz, temp=t, tgrad=tgrad,
                         dt=dtemperature(xp, zn, dz, t, 2) if want_dt else None)
    elif requires_grad:
        ctx.saved = dict(z=z, zn=zn, norm=norm, t=t, ws=workspace_bytes, tgrad=tgrad,
                         labels=labels, pairs=pairs)
    return _reduce(xp, loss, pairs, reduction), ctx


@in_ctx_precision
def nt_xent_pairs_backward(ctx: Context, grad_loss: Any = 1.0):
    """Gradient of :func:`nt_xent_pairs_forward`'s loss w.r.t. ``z``, times ``grad_loss`` (a
    real or 0-d array for mean/sum, an (N,) array for none): dz (N, D) in z's dtype, or
    ``(dz, dtemperature)`` for a forward with ``temperature_grad=True``."""
    require(ctx, OP)
    if "global" in ctx.saved:
        return _global.backward(ctx, grad_loss)
    xp, s = ctx.xp, ctx.saved
    path = Path(xp)
    g = _checks.check_grad_loss("nt_xent_pairs_backward", grad_loss, ctx.reduction, ctx.n, xp)
    a = acc_dtype(s["z"].dtype)
    if "dz" in s:
        dz = path.finish(s["z"], s["norm"], s["dz"], path.grad_scale(g, a))
        if not s["tgrad"]:
            return dz
        return dz, temperature_result(path, xp, s["dt"] * g, s["temp"])
    t = s["t"]
    w = _weights(xp, ctx.reduction, s["pairs"], a, g)
    _, _, dz = _rows(path, s["zn"], s["labels"], t, w, True, s["ws"])
    dt = dtemperature(xp, s["zn"], dz, t, 2) if s["tgrad"] else None
    dz = path.finish(s["z"], s["norm"], dz, None)
    return (dz, temperature_result(path, xp, dt, t)) if s["tgrad"] else dz


def nt_xent_pairs_backward_from_stats(z, lse, grad_loss: Any = 1.0, *, labels,
                                      temperature: Any = 0.07, reduction: str = "mean",
                                      normalize: bool = False,
                                      workspace_bytes: Optional[int] = None,
                                      temperature_grad: bool = False,
                                      precision: Optional[str] = None):
    """``dz`` from the input and the labels (the statistics recomputed: ``lse``, the forward's
    ``ctx.stats[0]``, is checked, not needed), as :func:`nt_xent_pairs_backward` gives it;
    ``(dz, dtemperature)`` with ``temperature_grad``."""
    xp, labels, t, p = _check(z, labels, temperature, reduction, workspace_bytes, normalize,
                              precision)
    tgrad = _checks.check_bool(OP, "temperature_grad", temperature_grad)
    check_stats(OP, xp, z.shape[0], z.dtype, lse=lse)
    z = contig_inputs(xp, z)[0]
    zn, norm = prep(Path(xp), z, normalize)
    ctx = Context(OP, reduction, z.shape[0], xp, stats=(lse,), precision=p,
                  saved=dict(z=z, zn=zn, norm=norm, t=t, ws=workspace_bytes, tgrad=tgrad,
                             labels=labels, pairs=_pairs(xp, labels, acc_dtype(z.dtype))))
    return nt_xent_pairs_backward(ctx, grad_loss)


def _torch_forward(z, temperature, *, labels, **kw):
    """``cupynce.torch``'s forward: the op's argument order (the temperature an input after z,
    the labels by keyword)."""
    return nt_xent_pairs_forward(z, labels, temperature, **kw)


def _torch_backward(z, temperature, lse, grad_loss, *, labels, reduction: str = "mean",
                    normalize: bool = False, workspace_bytes: Optional[int] = None,
                    precision: Optional[str] = None):
    """``cupynce.torch``'s backward op: ``(dz, dtemperature)`` (a zero 0-d placeholder
    for a real temperature)."""
    kw = dict(labels=labels, temperature=temperature, reduction=reduction,
              normalize=normalize, workspace_bytes=workspace_bytes, precision=precision)
    if isinstance(temperature, float):
        xp = _checks.array_module(OP, z=z)
        return nt_xent_pairs_backward_from_stats(z, lse, grad_loss, **kw), \
            xp.zeros((), acc_dtype(z.dtype))
    return nt_xent_pairs_backward_from_stats(z, lse, grad_loss, temperature_grad=True, **kw)


def nt_xent_pairs(z, labels, temperature: Any = 0.07, *, reduction: str = "mean",
                  normalize: bool = False, workspace_bytes: Optional[int] = None, group=None,
                  precision: Optional[str] = None):
    """The pair-wise labelled NT-Xent loss of ``z`` (N, D) with ``labels`` (N,); see
    :func:`nt_xent_pairs_forward`."""
    return nt_xent_pairs_forward(z, labels, temperature, reduction=reduction,
                                 normalize=normalize, workspace_bytes=workspace_bytes,
                                 requires_grad=False, group=group, precision=precision)[0]


# ---- across ranks: this op's schedule for cupynce.ops._global ----------------------------
def _global_rows(comm: Comm, xp, path, zn, every, every_lab, t: Temperature, w,
                 want_grad: bool, workspace_bytes):
    """The rank's rows against every rank's (``every``, gathered): its lse and row losses,
    and the accumulator of its rows' gradient (its rows' side plus every rank's column-side
    gradients of them, reduce-scattered)."""
    n = zn.shape[0]
    lse, loss, (dq, dk, *_rest) = path.rows(
        zn, every, None, None, t.scale, exclude_diag=False, pos_shift=0, pos_mod=n,
        lse_in=None, weights=w, want_grad=want_grad, workspace_bytes=workspace_bytes, op=OP,
        self_pair=False, scale_log=t.scale_log, pair_labels=every_lab,
        pair_row0=comm.rank * n)
    if not want_grad:
        return lse, loss, None
    return lse, loss, dq + comm.reduce_scatter(dk.reshape(comm.size, *dq.shape))


def _ring_rows(comm: Comm, zn, labs, t: Temperature, w, want_grad: bool):
    """:func:`_global_rows` on the ring (``_global.ring_blocks``; NumPy arrays): the rank's
    rows against each rank's chunk of rows while the next travels, in three passes over the
    chunks -- each row's log-sum-exp over its negatives (the rows of another label: merged
    over the chunks in rank order), then its pairs' losses softplus(lse_i − l_ip) and
    γ_i = Σ_p sigmoid(lse_i − l_ip) over the kept chunks, then the gradient blocks
    G_ij = w_i (γ_i p_ij [j a negative] − sigmoid(lse_i − l_ij) [j a positive]) with the
    chunks' rows' gradients summed along the ring to their owners.  ``labs`` (P, n): every
    rank's labels.  Returns :func:`_global_rows`' ``lse, loss, dz``."""
    rank, size, n = comm.rank, comm.size, zn.shape[0]
    a = acc_dtype(zn.dtype)
    # (NumPy arrays alone: τ is a host value)
    assert t.scale_log is None, "the pairs' ring takes NumPy arrays"
    scale = t.scale
    z = zn.astype(a, copy=False)
    chunks: List[Any] = [None] * size
    parts: List[Any] = [None] * size

    def block(q):
        """Chunk q's scores, same-label mask and positive pairs with this rank's rows."""
        s = (z @ chunks[q].astype(a, copy=False).T) * a.type(scale)
        same = labs[rank][:, None] == labs[q][None, :]
        pos = same.copy()
        if q == rank:  # (a row is no pair of itself)
            np.fill_diagonal(pos, False)
        return s, same, pos

    def stats(k, q, chunk):
        chunks[q] = chunk
        s, same, _ = block(q)
        parts[q] = np.logaddexp.reduce(np.where(same, -np.inf, s), axis=1)
        return None, None

    _global.ring_blocks(comm, zn, stats, col_grads=False)
    lse = np.logaddexp.reduce(np.stack(parts), axis=0)  # (rank order; no negative: −inf)
    loss, gamma = np.zeros(n, a), np.zeros(n, a)
    for q in range(size):
        s, _, pos = block(q)
        x = lse[:, None] - s
        loss += np.where(pos, _cpu.NUMPY.softplus(x), 0.0).sum(axis=1)
        gamma += np.where(pos, _cpu.NUMPY.sigmoid(x), 0.0).sum(axis=1)
    if not want_grad:
        return lse, loss, None
    w_arr, w_stride, w_mul = w
    w_rows = a.type(w_mul * scale) * (np.ones(n, a) if w_arr is None else
                                      np.asarray(w_arr, a)[np.arange(n) * w_stride])

    def grads(k, q, _):
        s, same, pos = block(q)
        with np.errstate(over="ignore", invalid="ignore"):
            p_neg = np.where(same, 0.0, np.exp(s - lse[:, None]))
        g = w_rows[:, None] * (gamma[:, None] * p_neg
                               - np.where(pos, _cpu.NUMPY.sigmoid(lse[:, None] - s), 0.0))
        return g @ chunks[q].astype(a, copy=False), g.T @ z

    steps, dk = _global.ring_blocks(comm, None, grads, col_grads=True)
    return lse, loss, _global.sum_steps(steps) + dk


def _global_forward(comm: Comm, z, labels, temperature=0.07, *, reduction="mean",
                    normalize=False, workspace_bytes=None, requires_grad=True,
                    temperature_grad=False, precision=None):
    """:func:`nt_xent_pairs_forward` over ``comm``'s global batch (see its ``group``)."""
    precision = _global.precision_setting(precision)

    def checks():
        xp, lab, t, p = _check(z, labels, temperature, reduction, workspace_bytes, normalize,
                               precision, min_rows=1)
        _checks.check_bool(OP, "requires_grad", requires_grad)
        _checks.check_bool(OP, "temperature_grad", temperature_grad)
        return xp, lab, t, p  # (a device temperature too: row_pairs takes its log scale)

    host_t = _global.host_setting(temperature)
    (xp, labels, temp, p), ring = _global.agree(
        comm, OP, checks, [z, labels], ["z", "labels"],
        [host_t, reduction, normalize, requires_grad, precision, temperature_grad is True],
        ring_wish=lambda: _global.ring_possible(comm, z, requires_grad, reduction))
    tgrad = bool(temperature_grad) and requires_grad
    with config.float32_precision(p):
        path = Path(xp)
        n = z.shape[0]
        z = contig_inputs(xp, z)[0]
        a = acc_dtype(z.dtype)
        zn, norm = prep(path, z, normalize)
        labs = comm.all_gather(labels)  # (P, n)
        every_lab = labs.reshape(-1)
        pairs = _pairs(xp, every_lab, a)  # (the global count: the same on every rank)
        fused = requires_grad and reduction != "none"
        w = _weights(xp, reduction, pairs, a) if fused else (None, 0, 1.0)
        if ring:  # (NumPy arrays, no "none" with a gradient: _ring_rows)
            lse, rows, dz = _ring_rows(comm, zn, labs, temp, w, fused)
        else:
            every = comm.all_gather(zn).reshape(-1, zn.shape[1])
            lse, rows, dz = _global_rows(comm, xp, path, zn, every, every_lab, temp, w, fused,
                                         workspace_bytes)
        ctx = Context(OP, reduction, n, xp, stats=(lse,) if requires_grad else (),
                      precision=p)
        base = dict(x=(z,), norms=(norm,), size=comm.size, temp=temp, tgrad=tgrad)
        if fused:
            ctx.saved = dict(base, acc=(dz,),
                             dt=_global.dtemperature(comm, xp, zn, dz, temp, 2)
                             if tgrad else None)
        elif requires_grad:
            ctx.saved = dict(base, zn=zn, every=every, every_lab=every_lab, pairs=pairs,
                             ws=workspace_bytes, comm=comm)
        if reduction == "none":
            total = rows
        else:
            total = _global.loss(comm, xp, rows, "sum", n * comm.size)
            if reduction == "mean":
                total = xp.asarray(total / xp.maximum(pairs, 1).astype(total.dtype))
        return total, _global.tag(ctx, _GLOBAL)


def _global_acc(ctx: Context, g):
    """The "none" backward's accumulators: the rank's rows weighted by their upstream
    gradients (collectives: every rank runs it)."""
    s, xp = ctx.saved, ctx.xp
    a = acc_dtype(s["z"].dtype) if "z" in s else acc_dtype(s["x"][0].dtype)
    w = _weights(xp, "none", s["pairs"], a, g)
    _, _, dz = _global_rows(s["comm"], xp, Path(xp), s["zn"], s["every"], s["every_lab"],
                            s["temp"], w, True, s["ws"])
    return (dz,), ((_global.dtemperature(s["comm"], xp, s["zn"], dz, s["temp"], 2),)
                   if s["tgrad"] else ())


_GLOBAL = _global.Schedule(recompute=_global_acc, result=_global.rows_and_temperature,
                           scalars=_global.saved_temperature_grad)
