"""The global InfoNCE family over ``torch.distributed``: every rank gets the loss of the whole batch.

``cupynce.torch.nt_xent(z, ..., group=g)`` and ``info_nce(query, key, ..., group=g)`` (and the
modules' ``group=``) route here.  With P ranks in ``g``, each holding n local rows (the same n
everywhere; the global batch is the concatenation in rank order):

* forward: the column-side rows (NT-Xent: z; InfoNCE: the keys and the shared negatives) are
  all-gathered, O(N·D) bytes per rank; each rank computes its rows against every column with
  the single-process engine (``cupynce.ops._local``) — never an n × N logits matrix in memory;
  the loss of the mean / sum is all-reduced (a scalar), so every rank returns the global loss;
  ``reduction="none"`` returns the rank's own rows of the global per-row loss;
* backward: the column-side gradients are reduce-scattered (NCCL; all-reduce and slice on
  backends without reduce-scatter, such as gloo) to the ranks that own those rows, in float32
  (float64 for float64 inputs).

**Gradient convention (DDP).** ``DistributedDataParallel`` averages the parameter gradients
over the ranks, so each rank's backward returns P times the gradient of the global loss with
respect to its local rows: after DDP's average the parameter gradients equal those of one
process training on the whole batch.  Every rank of the group must run the backward (as under
DDP), since it holds a collective.

Checks: every rank exchanges its local shapes, dtype and device first (a small all-gather), so
that mismatched local sizes, dtypes or devices raise the same ``ValueError`` on every rank —
never a hang or a wrong number.  Deterministic for a fixed world size (fixed-order products,
the backend's fixed-order collectives).  Eager autograd (``torch.compile`` graph-breaks here).
"""
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..ops import _base, _global, _local
from ..ops._comm import Comm
from . import _bridge as B
from . import _registry as R

_DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def world(group) -> Tuple[int, int]:
    """(this rank's index in ``group``, the group's size)."""
    return dist.get_rank(group), dist.get_world_size(group)


def _nccl(group) -> bool:
    """Whether the group's collectives go through NCCL (also a "cpu:gloo,cuda:nccl" group)."""
    return "nccl" in str(dist.get_backend(group))


def _comm_device(group, like: Tensor) -> torch.device:
    """Where the group's collectives run: the inputs' GPU (the current one if they are on the
    CPU) for NCCL, else the inputs' device."""
    if _nccl(group):
        return like.device if like.device.type == "cuda" else \
            torch.device("cuda", torch.cuda.current_device())
    return like.device


def check_group(op: str, group, tensors: Sequence[Optional[Tensor]],
                names: Sequence[str], settings: Sequence[float] = (),
                problem: Optional[str] = None) -> Tuple[int, int]:
    """Exchange every rank's local shapes, dtype, device, settings and input problems; raise the
    same error on every rank if any rank has a problem or they differ.

    ``settings``: numbers every rank must agree on (temperature, reduction, normalize, ...:
    a difference would send the ranks down different collectives); ``problem``: this rank's
    own input error (shapes, dtypes), raised on every rank.  Returns (rank, P).  The first
    collective of each call: a rank whose inputs are wrong still takes part, so the others
    never wait on it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{op}: group={group!r} needs torch.distributed to be initialised "
                         f"(torch.distributed.init_process_group)")
    rank, size = world(group)
    nccl = _nccl(group)
    first = next(t for t in tensors if t is not None)
    bad_device = any(t is not None and (t.device.type != "cuda") == nccl for t in tensors) \
        if nccl else False
    dev = _comm_device(group, first)
    meta: List[int] = [int(bad_device), int(problem is not None)]
    for v in settings:  # float64 bits as two int32 halves: exact comparison
        bits = int(np.array(float(v), np.float64).view(np.int64))
        meta += [bits >> 32, bits & 0xFFFFFFFF]
    base = len(meta)
    for t in tensors:  # 5 integers a tensor: rank of the array, its shape (padded), dtype
        shape = [int(s) for s in t.shape[:3]] + [0] * (3 - min(t.dim(), 3)) if t is not None \
            else [0, 0, 0]
        meta += [-1, 0, 0, 0, 0] if t is None else \
            [t.dim()] + shape + [_DTYPE_CODE.get(t.dtype, 0)]
    mine = torch.tensor(meta, dtype=torch.int64, device=dev)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    rows = torch.stack(every).cpu().tolist()  # (one host read of a few integers: the check)
    if any(r[1] for r in rows):
        where = [i for i, r in enumerate(rows) if r[1]]
        raise ValueError(f"{op}: invalid inputs on rank(s) {where}"
                         + (f"; here: {problem}" if problem else ""))
    if any(r[2:base] != rows[0][2:base] for r in rows):
        raise ValueError(f"{op}: every rank of the group must pass the same temperature / "
                         f"logit_scale kind, reduction and normalize")
    if any(r[0] for r in rows):
        where = [i for i, r in enumerate(rows) if r[0]]
        raise ValueError(f"{op}: the group's backend is NCCL, which carries CUDA tensors only; "
                         f"rank(s) {where} passed CPU tensors")
    if any(r != rows[0] for r in rows):
        desc = "; ".join(
            f"rank {i}: " + ", ".join(
                f"{n} {tuple(r[base + 1 + 5 * j:base + 1 + 5 * j + min(r[base + 5 * j], 3)])}"
                for j, n in enumerate(names) if r[base + 5 * j] >= 0)
            for i, r in enumerate(rows))
        raise ValueError(f"{op}: every rank of the group must pass the same local shapes and "
                         f"dtypes (equal local batch sizes), got {desc}")
    return rank, size


def all_gather_rows(x: Tensor, group, size: int) -> List[Tensor]:
    """Every rank's ``x`` (same shape everywhere), in rank order."""
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(out, x, group=group)
    return out


def reduce_scatter_rows(full: Tensor, group, rank: int, size: int) -> Tensor:
    """``sum over ranks of full[rank]`` for ``full`` (P, ...): NCCL's reduce-scatter, else an
    all-reduce of the whole and this rank's slice (gloo has no reduce-scatter)."""
    full = full.contiguous()
    if _nccl(group) and full.device.type == "cuda":
        out = torch.empty_like(full[0])
        dist.reduce_scatter_tensor(out, full, group=group)
        return out
    dist.all_reduce(full, group=group)
    return full[rank].clone()


def _stack_own(own: Tensor, other: Optional[Tensor], rank: int) -> Tensor:
    """(P, rows, D): the other ranks' blocks of ``other`` (rank order, this rank left out) with
    ``own`` at this rank's place (slices and a cat: no index tensor, no host synchronisation)."""
    if other is None:
        return own[None]
    blocks = other.reshape(-1, *own.shape)
    return torch.cat([blocks[:rank], own[None], blocks[rank:]])


def _finish(x: Tensor, norm: Optional[Tensor], acc: Tensor, normalize: bool,
            scale: int) -> Tensor:
    """``scale`` × the float32 accumulator ``acc`` as x's gradient (x's dtype), through the
    row normalisation when the rows were normalised (the core's finish, 3-D negatives too)."""
    if normalize:
        return R.grad_finish(x, norm, acc, acc.new_full((), scale))
    return (acc * scale).to(x.dtype)


def _global_loss(rows: Tensor, reduction: str, count: int, group) -> Tensor:
    """The reduced loss of every rank's rows (``count`` of them): an all-reduced scalar; for
    "none" this rank's own rows."""
    if reduction == "none":
        return rows
    loss = rows.sum() if reduction == "sum" else rows.sum() / count
    dist.all_reduce(loss, group=group)
    return loss


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


class _NTXentGlobal(torch.autograd.Function):
    """NT-Xent over the group's global batch (see the module notes)."""

    @staticmethod
    def forward(ctx, z: Tensor, t: float, reduction: str, normalize: bool,
                workspace_bytes: Optional[int], group, rank: int, size: int) -> Tensor:
        n2 = z.shape[0]
        with B.device_scope(z.device):
            za = B.array_of(z.detach())
            xp = _xp(za)
            path = _base.Path(xp)
            zn, norm = _base.prep(path, _base.contig_inputs(xp, za)[0], normalize)
            zn_t = B.tensor_of(zn)
        parts = all_gather_rows(zn_t, group, size)
        others_t = torch.cat([p for i, p in enumerate(parts) if i != rank]) if size > 1 else None
        with B.device_scope(z.device):
            others = None if others_t is None else B.array_of(others_t)
            a = np.dtype(np.float64) if z.dtype == torch.float64 else np.dtype(np.float32)
            fused = reduction != "none" and any(ctx.needs_input_grad)
            w = _base.weights(xp, None, reduction, n2 * size, a)
            lse, rows, grads = _local.nt_xent_block(
                path, zn, others, 1.0 / t, lse_in=None, weights=w, want_grad=fused,
                workspace_bytes=workspace_bytes)
            rows_t = B.tensor_of(rows)
            acc = None
            if fused:
                dq, dk, do = (B.tensor_of(g) if g is not None else None for g in grads)
                acc = (dq, dk, do)
        loss = _global_loss(rows_t, reduction, n2 * size, group)
        ctx.args = (t, reduction, normalize, workspace_bytes, group, rank, size, fused)
        norm_t = None if norm is None else B.tensor_of(norm)
        if fused:
            ctx.save_for_backward(z, norm_t, *acc)
        else:
            ctx.save_for_backward(z, norm_t, zn_t, others_t, B.tensor_of(lse))
        return loss

    @staticmethod
    def backward(ctx, g: Tensor):
        R.refuse_double_backward()
        t, reduction, normalize, workspace_bytes, group, rank, size, fused = ctx.args
        saved = ctx.saved_tensors
        z, norm = saved[0], saved[1]
        n2 = z.shape[0]
        if fused:
            dq, dk, do = saved[2:]
            gs = g.to(dq.dtype)
            own = (dq + dk) * gs
            other = None if do is None else do * gs
        else:
            zn_t, others_t, lse_t = saved[2:]
            with B.device_scope(z.device):
                zn, lse = B.array_of(zn_t), B.array_of(lse_t)
                xp = _xp(zn)
                a = lse.dtype
                w = _base.weights(xp, B.array_of(g.contiguous().to(lse_t.dtype)), "none", n2, a)
                _, _, (dq, dk, do) = _local.nt_xent_block(
                    _base.Path(xp), zn, None if others_t is None else B.array_of(others_t),
                    1.0 / t, lse_in=lse, weights=w, want_grad=True,
                    workspace_bytes=workspace_bytes)
                own = B.tensor_of(dq) + B.tensor_of(dk)
                other = None if do is None else B.tensor_of(do)
        full = _stack_own(own, other, rank)
        mine = reduce_scatter_rows(full, group, rank, size)
        dz = _finish(z, norm, mine, normalize, size)  # DDP: P x the gradient
        return dz, None, None, None, None, None, None, None


class _InfoNCEGlobal(torch.autograd.Function):
    """InfoNCE over the group's global batch (see the module notes)."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, negatives: Optional[Tensor], t: float,
                reduction: str, normalize: bool, workspace_bytes: Optional[int], group,
                rank: int, size: int) -> Tensor:
        n = query.shape[0]
        shared = negatives is not None and negatives.dim() == 2
        with B.device_scope(query.device):
            arrs = [B.array_of(x.detach()) if x is not None else None
                    for x in (query, key, negatives)]
            xp = _xp(arrs[0])
            path = _base.Path(xp)
            laid = _base.contig_inputs(xp, *arrs)
            prepped = [_base.prep(path, x, normalize) for x in laid]
            (qn, nq), (kn, nk), (negn, nneg) = prepped
            kn_t = B.tensor_of(kn)
            negn_t = None if negn is None else B.tensor_of(negn)
        cols = [kn_t] + ([negn_t] if shared else [])
        gathered = [all_gather_rows(c, group, size) for c in cols]
        others_parts = [p for i, p in enumerate(gathered[0]) if i != rank]
        if shared:
            others_parts += gathered[1]  # every rank's shared negatives, in rank order
        others_t = torch.cat(others_parts) if others_parts else None
        with B.device_scope(query.device):
            others = None if others_t is None else B.array_of(others_t)
            neg_p = negn if negatives is not None and not shared else None
            a = np.dtype(np.float64) if query.dtype == torch.float64 else np.dtype(np.float32)
            fused = reduction != "none" and any(ctx.needs_input_grad)
            w = _base.weights(xp, None, reduction, n * size, a)
            lse, rows, grads = _local.info_nce_block(
                path, qn, kn, others, neg_p, 1.0 / t, lse_in=None, weights=w, want_grad=fused,
                workspace_bytes=workspace_bytes)
            rows_t = B.tensor_of(rows)
            acc = tuple(None if x is None else B.tensor_of(x) for x in grads) if fused else None
            norms = tuple(None if x is None else B.tensor_of(x) for x in (nq, nk, nneg))
        loss = _global_loss(rows_t, reduction, n * size, group)
        ctx.args = (t, reduction, normalize, workspace_bytes, group, rank, size, fused, shared)
        ctx.has_neg = negatives is not None
        if fused:
            ctx.save_for_backward(query, key, negatives, *norms, *acc)
        else:
            ctx.save_for_backward(query, key, negatives, *norms, B.tensor_of(qn), kn_t,
                                  others_t, None if neg_p is None else B.tensor_of(neg_p),
                                  B.tensor_of(lse))
        return loss

    @staticmethod
    def backward(ctx, g: Tensor):
        R.refuse_double_backward()
        t, reduction, normalize, workspace_bytes, group, rank, size, fused, shared = ctx.args
        saved = ctx.saved_tensors
        query, key, negatives, nq, nk, nneg = saved[:6]
        n = query.shape[0]
        if fused:
            dq, dk, do, dnp = saved[6:]
            gs = g.to(dq.dtype)
            dq, dk = dq * gs, dk * gs
            do = None if do is None else do * gs
            dnp = None if dnp is None else dnp * gs
        else:
            qn_t, kn_t, others_t, negp_t, lse_t = saved[6:]
            with B.device_scope(query.device):
                qn, lse = B.array_of(qn_t), B.array_of(lse_t)
                xp = _xp(qn)
                w = _base.weights(xp, B.array_of(g.contiguous().to(lse_t.dtype)), "none", n,
                                  lse.dtype)
                _, _, grads = _local.info_nce_block(
                    _base.Path(xp), qn, B.array_of(kn_t),
                    None if others_t is None else B.array_of(others_t),
                    None if negp_t is None else B.array_of(negp_t), 1.0 / t, lse_in=lse,
                    weights=w, want_grad=True, workspace_bytes=workspace_bytes)
                dq, dk, do, dnp = (None if x is None else B.tensor_of(x) for x in grads)
        # the keys' column-side gradients, and the shared negatives', back to their owners
        n_other_keys = n * (size - 1)
        full_k = _stack_own(dk, do[:n_other_keys] if do is not None and n_other_keys else None,
                            rank)
        dk = reduce_scatter_rows(full_k, group, rank, size)
        dneg = None
        if shared:
            m = negatives.shape[0]
            dneg = reduce_scatter_rows(do[n_other_keys:].reshape(size, m, -1), group, rank,
                                       size)
        elif negatives is not None:
            dneg = dnp
        outs = []
        for x, nrm, acc in ((query, nq, dq), (key, nk, dk), (negatives, nneg, dneg)):
            if x is None:
                outs.append(None)
                continue
            outs.append(_finish(x, nrm, acc, normalize, size))  # DDP: P x the gradient
        return (*outs, None, None, None, None, None, None, None)


class TorchComm(Comm):
    """A ``torch.distributed`` group as a :class:`cupynce.ops._comm.Comm`: the arrays go to
    the collectives as torch tensors (DLPack views, no copy; call inside
    ``_bridge.device_scope``), NCCL on CUDA tensors, gloo on CPU or CUDA ones."""

    def __init__(self, group, like: Tensor):
        self.group = group
        self.rank, self.size = world(group)
        self.nccl = _nccl(group)
        self.device = _comm_device(group, like)

    def all_gather(self, x):
        t = B.tensor_of(_xp(x).ascontiguousarray(x))
        out = t.new_empty((self.size,) + tuple(t.shape))
        dist.all_gather(list(out.unbind(0)), t, group=self.group)
        return B.array_of(out)

    def all_reduce(self, x):
        t = B.tensor_of(_xp(x).ascontiguousarray(x))
        dist.all_reduce(t, group=self.group)
        return B.array_of(t)

    def reduce_scatter(self, x):
        t = B.tensor_of(_xp(x).ascontiguousarray(x))
        return B.array_of(reduce_scatter_rows(t, self.group, self.rank, self.size))

    def exchange(self, ints):
        mine = torch.tensor(list(ints), dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        return torch.stack(every).cpu().tolist()  # (the check's one host read)

    def problem(self, arrays):
        if self.nccl and any(isinstance(x, np.ndarray) for x in arrays):
            return "the group's backend is NCCL, which carries CUDA tensors only"
        return None


class _ClipGlobal(torch.autograd.Function):
    """CLIP's loss over the group's global batch: ``cupynce.ops._global``'s one n × N block a
    rank for both directions (the texts gathered, the column states exchanged), on a
    :class:`TorchComm`.  ``logit_scale``'s gradient is the global one on every rank."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, logit_scale: Optional[Tensor], ls_value: float,
                reduction: str, normalize: bool, workspace_bytes: Optional[int],
                group) -> Tensor:
        with B.device_scope(a.device):
            comm = TorchComm(group, a)
            ls = ls_value if logit_scale is None else B.array_of(logit_scale.detach())
            loss, core = _global.clip_loss_forward(
                comm, B.array_of(a.detach()), B.array_of(b.detach()), ls, reduction=reduction,
                normalize=normalize, workspace_bytes=workspace_bytes,
                requires_grad=any(ctx.needs_input_grad[:3]))
            out = B.tensor_of(loss)
        ctx.core, ctx.has_ls = core, logit_scale is not None
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        R.refuse_double_backward()
        with B.device_scope(g.device):
            da, db, dls = _global.backward(ctx.core, B.array_of(g.contiguous()))
            da, db, dls = B.tensor_of(da), B.tensor_of(db), B.tensor_of(dls)
        return (da, db, dls if ctx.has_ls else None, None, None, None, None, None)


_REDUCTION_CODE = {"mean": 0, "sum": 1, "none": 2}


def _matrix_problem(name: str, x: Tensor, *, d: Optional[int] = None) -> Optional[str]:
    if x.dim() != 2:
        return f"{name} must be 2-D (n, D), got shape {tuple(x.shape)}"
    if x.dtype not in _DTYPE_CODE:
        return f"{name} has dtype {x.dtype}; expected float16, bfloat16, float32 or float64"
    if d is not None and x.shape[1] != d:
        return f"{name} must have D={d} features, got shape {tuple(x.shape)}"
    return None


def nt_xent(z: Tensor, t: float, reduction: str, normalize: bool,
            workspace_bytes: Optional[int], group) -> Tensor:
    problem = _matrix_problem("z", z)
    if problem is None and (z.shape[0] < 2 or z.shape[0] % 2):
        problem = (f"z must have an even number of rows, at least 2 (2n views), got shape "
                   f"{tuple(z.shape)}")
    rank, size = check_group("nt_xent", group, [z], ["z"],
                             [t, _REDUCTION_CODE[reduction], normalize], problem)
    return _NTXentGlobal.apply(z, t, reduction, normalize, workspace_bytes, group, rank, size)


def info_nce(query: Tensor, key: Tensor, negatives: Optional[Tensor], t: float,
             reduction: str, normalize: bool, workspace_bytes: Optional[int], group) -> Tensor:
    problem = _matrix_problem("query", query)
    d = query.shape[-1]
    if problem is None and tuple(key.shape) != tuple(query.shape):
        problem = (f"key must have query's shape {tuple(query.shape)} (paired by row), got "
                   f"{tuple(key.shape)}")
    problem = problem or _matrix_problem("key", key, d=d)
    if problem is None and negatives is not None:
        if negatives.dim() not in (2, 3) or negatives.shape[-1] != d or \
                (negatives.dim() == 3 and negatives.shape[0] != query.shape[0]):
            problem = (f"negatives must be (M, {d}) shared or ({query.shape[0]}, M, {d}) per "
                       f"query, got shape {tuple(negatives.shape)}")
    dts = {x.dtype for x in (query, key, negatives) if x is not None}
    if problem is None and len(dts) > 1:
        problem = f"query, key and negatives must share one dtype, got {sorted(map(str, dts))}"
    kind = 0 if negatives is None else negatives.dim() - 1
    rank, size = check_group("info_nce", group, [query, key, negatives],
                             ["query", "key", "negatives"],
                             [t, _REDUCTION_CODE[reduction], normalize, kind], problem)
    return _InfoNCEGlobal.apply(query, key, negatives, t, reduction, normalize,
                                workspace_bytes, group, rank, size)


def clip_loss(a: Tensor, b: Tensor, logit_scale: Optional[Tensor], ls_value: float,
              reduction: str, normalize: bool, workspace_bytes: Optional[int], group) -> Tensor:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"clip_loss: group={group!r} needs torch.distributed to be initialised "
                         f"(torch.distributed.init_process_group)")
    return _ClipGlobal.apply(a, b, logit_scale, ls_value, reduction, normalize,
                             workspace_bytes, group)
