"""The global InfoNCE family across ranks: every rank gets the loss of the whole batch.

With P ranks of a :class:`~cupynce.ops._comm.Comm`, each holding n local rows (the same n
everywhere; the global batch is the concatenation in rank order), each rank computes its
rows' share with the single-process engine (``_local`` blocks, CLIP's rectangular block) and
the collectives assemble the rest.  Never an n × N logits matrix; the bytes sent are O(N·D).

This module is the protocol, the same for every op: agree on the checks and settings across
the ranks (:func:`agree`), run the rank's share in the agreed float32 precision, assemble the
loss (:func:`loss`), and in the backward scale or recompute the accumulators and finish the
gradients (:func:`backward`).  It imports no op: each op module (``nt_xent``, ``info_nce``,
``clip``, ``siglip``) holds its schedule -- its global forward (``_global_forward``: what is
gathered, the rank's share, what is scattered), and the :class:`Schedule` of its backward
(the "none" recompute, its scalar gradients, what its ``*_backward`` returns), which it hands
here by tagging the forward's context with it (:func:`tag`).  The schedules:

* **NT-Xent** (z = [view 1; view 2] of the rank's n images; the global batch is [every
  rank's view 1; every rank's view 2], lightly's ``gather_distributed`` semantics, exactly):
  z and its rows' positive dots are all-gathered.  S = Z Zᵀ is symmetric and every positive
  sits in a diagonal rank block, so each unordered pair of rank blocks is computed once
  (``_local.NtXentPlan``): a rank takes its diagonal block (the single-process symmetric
  NT-Xent) and about (P − 1) / 2 of its off-diagonal blocks (``engine.cross``: its rows'
  statistics and the other rows' column (m, s) states in one pass); the (2, ~N) states are
  all-gathered and each rank merges its rows' partials in a fixed order, then gathers every
  row's lse (2n floats a rank) for the gradient pass over the same blocks.  About half the
  products of computing each rank's rows against every column.
* **InfoNCE**: keys (and shared (M, D) negatives) all-gathered; per-query negatives stay.
* **SigLIP**: only b is all-gathered; the rank's n × N block against every text, no softmax
  so no statistics to exchange; the scale's and bias's gradients are all-reduced.
* **CLIP, one block for both directions**: only b is all-gathered.  The rank computes the
  n × N block of its images against every text once: its rows' log-sum-exps (image → text,
  complete) and every column's partial (m, s) state over its n rows; the (2, N) states are
  all-gathered and merged in rank order into each text's column log-sum-exp (the same bits
  on every rank); the gradient pass reuses the block's recompute for both directions.  Half
  the products of computing the rows of both directions separately (open_clip's
  ``local_loss=True``), and half its gather.
* **Ring schedules** (:func:`ring_blocks`, where every rank's communicator can shift:
  ``agree``'s ``ring_wish``; on NumPy arrays every op and most variants, on CuPy arrays
  the plain ops under ``config.ring_gpu``: docs/distributed.md lists them): the column
  side is not gathered first but shifted chunk by chunk around the ring while each chunk's
  block is computed, and the column gradients travel back the same way (a fixed order of
  adds).
* The loss of the mean / sum is all-reduced (a scalar): every rank returns the global loss;
  ``reduction="none"`` returns the rank's own rows of the global per-row loss.
* Gradients: the column-side gradients are reduce-scattered to the ranks that own those rows,
  in float32 (float64 for float64 inputs).  With ``reduction`` mean / sum and a gradient
  wanted, this happens in the forward (the backward is then local: it scales the rank's
  O(n·D) accumulators); ``"none"`` recomputes in the backward, which then holds collectives
  (all ranks must run it).

**Gradient convention (data parallel).**  DDP (and any data-parallel loop) averages the
parameter gradients over the ranks, so each rank's backward returns P times the gradient of
the global loss with respect to its local rows: after the average, the parameter gradients
equal those of one process training on the whole batch.  ``logit_scale``'s gradient is the
global one on every rank (its average is itself).

**Checks.**  Every rank runs the single-process op's checks, then exchanges its problems,
local shapes, dtypes and settings (one small all-gather; the settings hold the float32
``precision`` resolved, which the rank's share and its backward then run in): one rank's bad
input, unequal local sizes or disagreeing settings raise on every rank (the rank at fault
re-raises its own error), never a hang or a wrong number.  That exchange is the one host read
of the forward; the backward has none.  Deterministic for a fixed world size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .. import _checks, config
from .._engine import arrays
from .._engine.kernels import acc_dtype
from ._base import Context, Path, finish_all, in_ctx_precision, require, temperature_result
from ._base import dtemperature as _local_dtemperature
from ._comm import Comm

_DTYPE_CODE = {"float16": 1, "bfloat16": 2, "float32": 3, "float64": 4}
#: the string settings (reduction, float32 precision) as numbers to compare across ranks
_STR_CODE = {"mean": 0, "sum": 1, "none": 2, "fp32": 10, "tf32": 11, "3xtf32": 12,
             "auto": 13, **{m: 20 + c for m, c in _checks.HARDNESS_MODES.items()}}


def _setting(v: Any) -> float:
    """A setting as a float to compare across ranks (NaN where it has none: the local
    checks reject such a value before it matters)."""
    if isinstance(v, str):
        return float(_STR_CODE.get(v, -1))
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def precision_setting(precision: Any) -> Any:
    """``precision=`` resolved (None → the global default) as the ranks compare it; a bad
    value as given (the local checks raise it, on every rank through the exchange).  Each
    forward resolves once and hands the result to both its local checks and the exchange, so
    the mode the ranks agreed on is the one the rank runs (a ``set_float32_precision`` from
    another thread between two reads cannot split them)."""
    try:
        return _checks.check_precision("", precision)
    except ValueError:
        return precision


def _dtype_name(code: int) -> str:
    return {c: n for n, c in _DTYPE_CODE.items()}.get(code, "?")


def host_setting(value: Any) -> Any:
    """A scalar argument as the ranks compare it: a host value as a float (a NumPy scalar or
    array, an int); a device array (never read: the ranks cannot compare it, so every rank
    must pass the same value, as DDP keeps a parameter) or anything unreadable as 0.0 (its
    own check raises)."""
    if type(value) is float or _checks.is_cupy_array(value):
        return value if type(value) is float else 0.0
    try:
        return float(np.asarray(value, dtype=np.float64).reshape(-1)[0])
    except Exception:  # noqa: BLE001 - (a tensor with grad, ...: never raise before the exchange)
        return 0.0


def agree(comm: Comm, op: str, local_checks: Callable[[], Any], arrays_: Sequence[Any],
          names: Sequence[str], settings: Sequence[Any],
          ring_wish: Optional[Callable[[], Any]] = None):
    """Run ``local_checks`` and exchange its outcome, the arrays' shapes / dtypes and the
    ``settings`` (numbers, bools, the reduction) with every rank; raise on every rank if any
    rank failed or they differ.

    Returns ``local_checks()``'s result; with ``ring_wish`` (a callable: whether this rank
    could run the op's ring schedule -- it depends on the rank's communicator and arrays, not
    only on the compared settings -- asked only once the checks passed, inside them, so that
    an argument it cannot read fails like any bad argument), ``(result, every rank wishes
    it)``: the schedule every rank then takes, so that no rank shifts while another gathers.
    The first collective of every call, of the same length on every rank: a rank whose
    inputs are wrong still takes part, so the others never wait on it.
    """
    err: Optional[BaseException] = None
    result = None
    wish = False
    pending = getattr(comm, "pending", None)  # an adapter's own argument check failed
    try:
        if pending is not None:
            raise pending
        result = local_checks()
        problem = comm.problem(arrays_)
        if problem is not None:
            err = ValueError(f"{op}: {problem}")
        elif ring_wish is not None:
            wish = bool(ring_wish())
    except (TypeError, ValueError) as e:
        err = e
    meta: List[int] = [int(err is not None)]
    for v in settings:  # float64 bits as two int32 halves: exact comparison
        bits = int(np.array(_setting(v), np.float64).view(np.int64))
        meta += [bits >> 32, bits & 0xFFFFFFFF]
    base = len(meta)
    for x in arrays_:  # 5 integers an array: its ndim, shape (padded to 3), dtype
        shape = getattr(x, "shape", None)
        if x is None or not isinstance(shape, tuple):
            meta += [-1, 0, 0, 0, 0]
            continue
        meta += [len(shape)] + [int(d) for d in shape[:3]] + [0] * (3 - min(len(shape), 3)) \
            + [_DTYPE_CODE.get(str(getattr(x, "dtype", "")), 0)]
    extra = [] if ring_wish is None else [int(wish)]
    rows = comm.exchange(meta + extra)
    ring = bool(extra) and all(r[-1] for r in rows)
    rows = [r[:len(meta)] for r in rows]
    if err is not None:
        raise err
    bad = [i for i, r in enumerate(rows) if r[0]]
    if bad:
        raise ValueError(f"{op}: invalid inputs on rank(s) {bad} of the group (the error is "
                         f"raised there too)")
    if any(r[1:base] != rows[0][1:base] for r in rows):
        raise ValueError(f"{op}: every rank of the group must pass the same settings "
                         f"(temperature or logit_scale kind, reduction, normalize, "
                         f"requires_grad, float32 precision, labels or none, label "
                         f"smoothing), got {[r[1:base] for r in rows]}")
    if any(r != rows[0] for r in rows):
        desc = "; ".join(
            f"rank {i}: " + ", ".join(
                f"{nm} {tuple(r[base + 1 + 5 * j:base + 1 + 5 * j + min(r[base + 5 * j], 3)])}"
                f" {_dtype_name(r[base + 5 * j + 4])}"
                for j, nm in enumerate(names) if r[base + 5 * j] >= 0)
            for i, r in enumerate(rows))
        raise ValueError(f"{op}: every rank of the group must pass the same local shapes and "
                         f"dtypes (equal local batch sizes), got {desc}")
    return result if ring_wish is None else (result, ring)


# ---- the pieces every schedule uses --------------------------------------------------------
def others(xp, parts, rank: int):
    """The rows of every rank but this one, in rank order ((P, r, D) → ((P − 1) r, D)), or
    None for one rank."""
    if parts.shape[0] == 1:
        return None
    return xp.concatenate([parts[:rank], parts[rank + 1:]]).reshape(-1, parts.shape[-1])


def stack_own(xp, own, other, rank: int):
    """(P, rows, D): the other ranks' blocks of ``other`` (rank order, this rank left out)
    with ``own`` at this rank's place: what the reduce-scatter sends."""
    if other is None:
        return own[None]
    blocks = other.reshape(-1, *own.shape)
    return xp.concatenate([blocks[:rank], own[None], blocks[rank:]])


def loss(comm: Comm, xp, rows, reduction: str, count: int):
    """The reduced loss of every rank's rows (``count`` in all): the sum or the mean as an
    all-reduced 0-d array (each rank adds its rows in a fixed order first); for "none" this
    rank's rows."""
    if reduction == "none":
        return rows
    div = count if reduction == "mean" else 1
    local = np.asarray(rows.sum() / rows.dtype.type(div)) if xp is np else \
        arrays.fixed_sum(rows, div)
    return comm.all_reduce(local.reshape(1)).reshape(())


def ring_blocks(comm: Comm, cols, block: Callable[[int, int, Any], Tuple[Any, Any]], *,
                col_grads: bool, steps: Optional[int] = None) -> Tuple[List[Any], Any]:
    """The ring schedule of a rank's rows against every rank's columns (``comm.ring``): for
    k = 0 .. P − 1, ``block(k, q, chunk)`` with ``chunk`` rank q = (rank − k) mod P's ``cols``
    (this rank's own at k = 0), while chunk k + 1 travels (:meth:`Comm.ring_shift`: the
    exchange overlaps the compute instead of an all-gather before it).

    ``block`` returns ``(result, dcols)``: anything the caller sums over the steps (in step
    order), and -- with ``col_grads`` -- this rank's rows' gradient of chunk q's columns.
    Those travel the ring too: rank q + 1 adds its part to rank q's, q + 2 to that, ...
    (a fixed order for a fixed P, whichever rank computes), and a last shift hands each
    column owner its total.  Returns ``(the steps' results, this rank's columns' gradient
    or None)``.  The same number of shifts on every rank, in the same order.  ``cols=None``:
    the chunks do not travel (a second pass over chunks the caller kept; ``block`` gets
    None), only the gradients do.  ``steps``: the first ``steps`` chunks only (a schedule
    that needs the nearest ranks' chunks: NT-Xent's; without ``col_grads``)."""
    size, rank = comm.size, comm.rank
    steps = size if steps is None else steps
    if not 1 <= steps <= size or (col_grads and steps != size):
        raise ValueError(f"ring_blocks: steps must be in [1, {size}] and {size} with column "
                         f"gradients (they travel the whole ring), got {steps}")
    cur, results, partial, nxt = cols, [], None, None
    try:
        for k in range(steps):
            nxt = comm.ring_shift(cur) if k < steps - 1 and cols is not None else None
            res, dcols = block(k, (rank - k) % size, cur)
            results.append(res)
            if col_grads:  # (the partial of chunk q from rank − 1, then this rank's part)
                partial = comm.ring_shift(dcols if partial is None else partial.wait() + dcols)
            if nxt is not None:
                cur, nxt = nxt.wait(), None
        own, partial = (partial.wait() if col_grads else None), None
        return results, own
    finally:  # (an error in a block: the transfers in flight end before their buffers go;
        # a transfer failing too -- its peer gone -- must not hide that error)
        for p in (nxt, partial):
            if p is not None:
                try:
                    p.wait()
                except Exception:  # noqa: BLE001
                    pass


def ring_possible(comm: Comm, x, requires_grad: bool, reduction: str, gpu: bool = False) -> bool:
    """What every op's ring wish (``agree``) holds: a communicator with ``ring_shift``,
    several ranks, NumPy arrays -- or, for an op whose GPU engines take column chunks
    (``gpu``), CuPy arrays under ``config.ring_gpu`` (off until measured: issue 57) -- and no
    "none" with a gradient (its recompute keeps the gathered columns)."""
    arrays = isinstance(x, np.ndarray) or (gpu and config.current().ring_gpu
                                           and _checks.is_cupy_array(x))
    return bool(comm.ring and comm.size > 1 and arrays
                and not (requires_grad and reduction == "none"))


def sum_steps(steps: Sequence[Any]):
    """The ring steps' parts added in step order (own chunk first): arrays, or tuples of them
    element by element."""
    total = steps[0]
    for part in steps[1:]:
        total = tuple(t + p for t, p in zip(total, part)) if isinstance(total, tuple) else \
            total + part
    return total


def merge_lse(engine, parts: Sequence[Any]):
    """Log-sum-exps over disjoint column sets (one array a chunk) merged into one, in the
    order given (``engine.col_lse`` of the states (lse, 1)): the same bits for the same
    parts and order."""
    xp = np if isinstance(parts[0], np.ndarray) else _checks.cupy_module()
    return engine.col_lse(xp.stack([xp.stack([x, xp.ones_like(x)]) for x in parts]))


def dtemperature(comm: Comm, xp, xn, acc, temp, degree: int):
    """dL/dτ of the global loss (``_base.dtemperature``): each rank's rows' homogeneity dot,
    all-reduced -- the same value on every rank, no factor P."""
    return comm.all_reduce(xp.asarray(_local_dtemperature(xp, xn, acc, temp, degree)).reshape(1)
                           ).reshape(())


def scaled_rows(xp, zn, temp) -> Tuple[Any, Any, float]:
    """The rows a symmetric schedule (NT-Xent's, SupCon's) multiplies, their root factor and
    the host scale: ``(zn, None, 1/τ)`` for a host τ; for a device one (``temp.scale_log``,
    never read) ``(√s ẑ, √s, 1)`` with s = exp(scale_log) = 1/τ -- the products at scale 1
    then give ``s ẑ_i·ẑ_j``, and the schedule's gradient ∂L/∂(√s ẑ) times √s is ∂L/∂ẑ
    (the dτ dot ``ẑ · ∂L/∂ẑ`` is the same on either side).  The prescaled rows are rounded to
    the rows' dtype once more (16-bit: one more rounding of each logit's factors than a host τ
    gets, within the dtype's tolerance; float16 rows past 65504 / √s overflow -- unnormalised
    rows that large); the schedules' cross blocks take no device scale."""
    if temp.scale_log is None:
        return zn, None, 1.0 / temp.value
    a = acc_dtype(zn.dtype)
    root = xp.exp(xp.asarray(temp.scale_log, dtype=a).reshape(()) * a.type(0.5))
    return (zn.astype(a) * root).astype(zn.dtype, copy=False), root, 1.0


def unscale_rows(comm: Comm, xp, zn, acc, temp, root, tgrad: bool):
    """A symmetric schedule's gradient back from :func:`scaled_rows`' rows: dL/dτ (with
    ``tgrad``, else None) from the schedule's rows and ``acc`` -- the same dot as ẑ · ∂L/∂ẑ --,
    then ``acc`` (∂L/∂(√s ẑ)) times √s in place: ∂L/∂ẑ.  Returns dL/dτ."""
    dt = dtemperature(comm, xp, zn, acc, temp, 2) if tgrad else None
    if root is not None:
        acc *= root
    return dt


def rows_and_temperature(path, xp, saved, grads, scalars):
    """A one-input op's ``Schedule.result``: dz, or ``(dz, dtemperature)`` for a forward with
    ``temperature_grad`` (the temperature's shape and dtype)."""
    if not saved.get("tgrad"):
        return grads[0]
    return grads[0], temperature_result(path, xp, scalars[0], saved["temp"])


def saved_temperature_grad(saved):
    """``Schedule.scalars`` of an op whose fused forward kept dτ (``saved["dt"]``)."""
    return (saved["dt"],) if saved.get("tgrad") else ()


def upstream(xp, g, n: int, acc):
    """This rank's rows' upstream gradients as an (n,) array (a float broadcast)."""
    if isinstance(g, float):
        return xp.full((n,), g, acc)
    out = xp.ascontiguousarray(xp.broadcast_to(g.astype(acc, copy=False), (n,)))
    # (NumPy: an (n,) input comes back as its broadcast view, read-only, which torch's
    # from_numpy on the gloo path warns about and may not write: a copy, O(n))
    return out.copy() if xp is np and not out.flags.writeable else out


def _scale(path: Path, g, size: int, a):
    """``size · g`` as the finishing kernels take it (the data-parallel factor P)."""
    if isinstance(g, float):
        return path.grad_scale(g * size, a)
    return path.grad_scale(g, a) * a.type(size)


def _no_scalars(saved) -> Tuple[Any, ...]:
    return ()


@dataclass(frozen=True)
class Schedule:
    """What an op hands :func:`backward` (through :func:`tag`): the parts of its global
    backward that depend on the op.

    * ``recompute(ctx, g) -> (accumulators, scalar gradients)``: reduction "none"'s backward,
      the upstream gradient ``g`` as the row weights; it holds collectives (every rank runs it).
    * ``result(path, xp, saved, grads, scalars)``: what the op's ``*_backward`` returns, from
      the inputs' finished gradients and the scalar gradients.
    * ``scalars(saved)``: the fused forward's unit-upstream scalar gradients (global values,
      scaled by the upstream gradient, no factor P); none by default.
    * ``own_unscaled``: copy those scalar gradients when they are returned unscaled (the
      caller may change the array it gets) -- for an op whose ``result`` does not copy them.
    """

    recompute: Callable[[Context, Any], Tuple[Sequence[Any], Sequence[Any]]]
    result: Callable[..., Any]
    scalars: Callable[[dict], Sequence[Any]] = _no_scalars
    own_unscaled: bool = False


def tag(ctx: Context, schedule: Schedule) -> Context:
    """``ctx`` marked as a global forward's, with the op's backward ``schedule`` (its
    ``*_backward`` routes it to :func:`backward`)."""
    ctx.saved["global"] = schedule
    return ctx


# ---- backward -----------------------------------------------------------------------------
@in_ctx_precision
def backward(ctx: Context, grad_loss: Any = 1.0):
    """The gradients of a global forward's loss (its op's ``*_backward`` routes here):
    P times the gradient of the global loss with respect to this rank's inputs (see the
    module notes), and for CLIP the global d loss / d logit_scale; in the forward's float32
    precision (``ctx.precision``).  The op's part comes from the :class:`Schedule` its
    forward tagged the context with."""
    op = ctx.op
    require(ctx, op)
    xp, s = ctx.xp, ctx.saved
    schedule = s["global"]
    path = Path(xp)
    g = _checks.check_grad_loss(f"{op}_backward", grad_loss, ctx.reduction, ctx.n, xp)
    a = acc_dtype(s["x"][0].dtype)
    size = s["size"]
    if "acc" in s:  # the unit-upstream accumulators of the forward (mean / sum): scale them
        accs, gs = s["acc"], _scale(path, g, size, a)
        scalars = schedule.scalars(s)
        if scalars:  # (the global values: no factor P)
            gd = path.grad_scale(g, a)
            if gd is not None:
                scalars = [x * gd.reshape(()) for x in scalars]
            elif schedule.own_unscaled:  # (owned: the caller may change what it gets)
                scalars = [path.owned_copy(x, x.dtype) for x in scalars]
    else:  # reduction "none": recompute with the upstream gradient as the row weights
        accs, scalars = schedule.recompute(ctx, g)
        gs = path.grad_scale(float(size), a)
    grads = finish_all(path, s["x"], s["norms"], accs, gs)
    return schedule.result(path, xp, s, grads, scalars)
