"""The global InfoNCE family over ``torch.distributed``: every rank gets the loss of the whole batch.

``cupynce.torch.nt_xent(z, ..., group=g)``, ``info_nce(..., group=g)``, ``clip_loss(...,
group=g)`` (and the modules' ``group=``) route here.  The protocol is the core's,
:mod:`cupynce.ops._global` (one implementation for CuPy, NumPy and torch); this module adapts a
``torch.distributed`` group to its :class:`~cupynce.ops._comm.Comm` (:class:`TorchComm`: the
arrays cross as DLPack / ``from_numpy`` views, no copy) and wraps it in one autograd function.
With P ranks in ``g``, each holding n local rows (the same n everywhere; the global batch is
the concatenation in rank order):

* forward: the column-side rows are all-gathered (on gloo with CPU tensors: shifted around
  the ring chunk by chunk while each chunk's block is computed, ``cupynce.ops._global``),
  O(N·D) bytes per rank; each rank computes
  its share with the single-process engine — never an n × N logits matrix in memory (NT-Xent:
  each unordered pair of ranks' blocks once; CLIP: one n × N block for both directions); the
  loss of the mean / sum is all-reduced, so every rank returns the global loss;
  ``reduction="none"`` returns the rank's own rows of the global per-row loss;
* the column-side gradients are reduce-scattered (NCCL; all-reduce and slice on backends
  without reduce-scatter, such as gloo) to the ranks that own those rows, in float32 (float64
  for float64 inputs).  With mean / sum and a gradient wanted this happens in the forward and
  the backward is local; ``"none"`` recomputes in the backward, which then holds collectives.

**Autocast.** Inside ``torch.autocast`` the embeddings are cast as the single-process ops
cast them (float32 and the other 16-bit type → the autocast dtype; inputs already in it pass
as they are; float64, the temperature, ``logit_scale`` and ``logit_bias`` untouched) and the
rank's share runs with autocast off, so P ranks compute in the dtype one process would.

**Gradient convention (DDP).** ``DistributedDataParallel`` averages the parameter gradients
over the ranks, so each rank's backward returns P times the gradient of the global loss with
respect to its local rows: after DDP's average the parameter gradients equal those of one
process training on the whole batch.  ``logit_scale``'s gradient is the global one on every
rank (its average is itself).  Every rank of the group must run the forward (and, for
``"none"``, the backward), as under DDP.

Checks: every argument check runs inside the first collective (a small all-gather of every
rank's problems, local shapes, dtypes and settings, the float32 precision resolved), so one
rank's bad input (``precision`` included), mismatched local
sizes or dtypes, CPU tensors on an NCCL group, or ranks that disagree on a setting raise a
``ValueError`` / ``TypeError`` on every rank — never a hang or a wrong number.  Deterministic
for a fixed world size.  Eager autograd: ``torch.compile`` graph-breaks at these calls (the
collectives run outside the traced graph).
"""
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks
from ..ops import _global
from ..ops import clip as clip_op
from ..ops import info_nce as info_nce_op
from ..ops import nt_xent as nt_xent_op
from ..ops import nt_xent_pairs as pairs_op
from ..ops import siglip as siglip_op
from ..ops import supcon as supcon_op
from ..ops._comm import Comm, Pending
from . import _bridge as B
from . import _registry as R


def world(group) -> Tuple[int, int]:
    """(this rank's index in ``group``, the group's size)."""
    return dist.get_rank(group), dist.get_world_size(group)


def _nccl(group) -> bool:
    """Whether the group's collectives go through NCCL (also a "cpu:gloo,cuda:nccl" group)."""
    return "nccl" in str(dist.get_backend(group))


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


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


class TorchComm(Comm):
    """A ``torch.distributed`` group as a :class:`cupynce.ops._comm.Comm`: the arrays go to
    the collectives as torch tensors (DLPack views, no copy; call inside
    ``_bridge.device_scope``), NCCL on CUDA tensors, gloo on CPU or CUDA ones.

    ``pending``: this rank's error from the torch-level argument checks, raised (on this
    rank; the others raise naming it) by the first exchange instead of the core's checks.
    """

    def __init__(self, group, device: torch.device, pending: Optional[BaseException] = None):
        self.group = group
        self.rank, self.size = world(group)
        self.nccl = _nccl(group)
        self.pending = pending
        backend = str(dist.get_backend(group))
        # where the agreement check's integers travel: host memory on a group whose backend
        # carries CPU tensors (gloo; also "cpu:gloo,cuda:nccl", torch's default when
        # init_process_group is given no backend): the check's read then waits for no GPU
        # work.  On an NCCL-only group they travel on the inputs' GPU (the current one for
        # CPU inputs), and reading the result waits for the work queued before it -- the
        # step's one synchronisation (docs/distributed.md); other backends: the inputs' device.
        self.device = device if not self.nccl or device.type == "cuda" else \
            torch.device("cuda", torch.cuda.current_device())
        self.exchange_device = torch.device("cpu") if "gloo" in backend else self.device
        # point-to-point: NCCL's on CUDA tensors, gloo's on CPU ones only (gloo has no send /
        # recv of CUDA tensors); other backends: the all-gather schedules
        self.ring = ("nccl" in backend and device.type == "cuda") or \
            ("gloo" in backend and device.type == "cpu")

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

    def ring_shift(self, x):
        """``batch_isend_irecv`` of x to rank + 1 and from rank − 1 (the group's global ranks):
        NCCL runs it on its own stream, which ``wait()`` makes torch's current stream wait
        for; gloo's transfer runs on its threads and ``wait()`` blocks until it is done."""
        t = B.tensor_of(_xp(x).ascontiguousarray(x))
        out = torch.empty_like(t)
        if self.size == 1:
            out.copy_(t)
            return Pending(B.array_of(out))
        peer = (lambda r: r) if self.group is None else \
            (lambda r: dist.get_global_rank(self.group, r))
        ops = [dist.P2POp(dist.isend, t, peer((self.rank + 1) % self.size), group=self.group),
               dist.P2POp(dist.irecv, out, peer((self.rank - 1) % self.size), group=self.group)]
        if t.is_cuda:  # (NCCL's point-to-point needs the tensors' GPU current in torch)
            with torch.cuda.device(t.device):
                works = dist.batch_isend_irecv(ops)
        else:
            works = dist.batch_isend_irecv(ops)
        held = [t]

        def finish():
            for w in works:
                w.wait()
            held.clear()
        return Pending(B.array_of(out), finish)

    def exchange(self, ints):
        mine = torch.tensor(list(ints), dtype=torch.int64, device=self.exchange_device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        return torch.stack(every).cpu().tolist()  # (the check's one host read)

    def problem(self, arrays):
        if self.nccl and any(isinstance(x, np.ndarray) for x in arrays):
            return "the group's backend is NCCL, which carries CUDA tensors only"
        return None


def _no_autocast(device: torch.device):
    """A region with autocast off for ``device``'s type."""
    return torch.autocast(device.type, enabled=False)


class _GlobalLoss(torch.autograd.Function):
    """One rank's share of a global loss: ``fwd(comm, *arrays, requires_grad=...)`` (an op's
    forward with ``group=comm``: its schedule on :mod:`cupynce.ops._global`) on the tensors'
    memory; the backward is :func:`cupynce.ops._global.backward`."""

    # (forward and backward with autocast off, as the ops' Autocast kernels run theirs: the
    # inputs come cast already, and the NumPy engine's torch products on CPU tensors must
    # keep their dtypes)
    @staticmethod
    def forward(ctx, fwd: Callable, comm: TorchComm, *tensors: Optional[Tensor]) -> Tensor:
        with B.device_scope(comm.device), _no_autocast(comm.device):
            arrs = [None if t is None else B.array_of(t.detach()) for t in tensors]
            loss, core = fwd(comm, *arrs, requires_grad=any(ctx.needs_input_grad[2:]))
            out = B.tensor_of(loss)
        ctx.core = core
        ctx.present = tuple(t is not None for t in tensors)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        R.refuse_double_backward()
        with B.device_scope(g.device), _no_autocast(g.device):
            grads = _global.backward(ctx.core, B.array_of(g.contiguous()))
            grads = grads if isinstance(grads, tuple) else (grads,)
            out = [B.tensor_of(x) if keep and x is not None else None
                   for x, keep in zip(grads, ctx.present)]
        # (an input without a gradient of its own -- a real temperature's None slot -- gets
        # None: one gradient for every input)
        out += [None] * (len(ctx.present) - len(out))
        return (None, None, *out)


def _temperature(op: str, temperature: Any, out: List[Any]) -> None:
    """``out[:] = (tensor or None, host value)`` as ``_registry.temperature`` resolves it: a
    tensor temperature is an input of the global op (a CPU one is read on the host, a CUDA
    one never is: its log scale on the device; its gradient the global loss's on every
    rank)."""
    out[:] = R.temperature(op, temperature)


def _temperature_arg(t_arr: Any, resolved: List[Any]) -> Any:
    """What the core's forward takes: the tensor's array, else the host value."""
    return resolved[1] if t_arr is None else t_arr


def _tensor(temperature: Any) -> Optional[Tensor]:
    """A temperature tensor as an input of :class:`_GlobalLoss` (its gradient, if asked for,
    comes back through it); a real: None.  (A CPU tensor without grad is read on the host as
    well -- a constant, its gradient None.)"""
    return temperature if isinstance(temperature, Tensor) and (
        temperature.requires_grad or temperature.device.type != "cpu") else None


def _run(op: str, group, checks: Callable[[], Any], fwd: Callable,
         tensors: Sequence[Any], rows: int) -> Tensor:
    """Run ``checks()`` (the torch-level argument checks; an error there is exchanged, not
    raised here, so that no rank is left waiting), then the global forward ``fwd`` on
    ``tensors`` through :class:`_GlobalLoss`.  The first ``rows`` tensors are the
    embeddings: inside ``torch.autocast`` they are cast as the single-process ops cast them
    (``_registry.autocast_rows``), so a rank computes in the dtype one process would."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{op}: group={group!r} needs torch.distributed to be initialised "
                         f"(torch.distributed.init_process_group)")
    like = next((t for t in tensors if isinstance(t, Tensor)), None)
    device = like.device if like is not None else torch.device("cpu")
    try:
        checks()
    except (TypeError, ValueError) as exc:
        comm = TorchComm(group, device, exc)
        fwd(comm, *(None for _ in tensors), requires_grad=False)  # raises on every rank
        raise AssertionError("unreachable: the exchange raises") from exc  # pragma: no cover
    tensors = R.autocast_rows(tensors[:rows]) + list(tensors[rows:])
    return _GlobalLoss.apply(fwd, TorchComm(group, device), *tensors)


def nt_xent(z: Any, temperature: Any, reduction: Any, normalize: Any, workspace_bytes: Any,
            group, precision: Any = None, *, label_smoothing: Any = 0.0) -> Tensor:
    """``cupynce.torch.nt_xent(..., group=group)`` (see the module notes; a label smoothing
    is the global batch's)."""
    op = "nt_xent"
    p: List[Any] = [None]
    tt: List[Any] = [None, 0.0]

    def checks():
        _temperature(op, temperature, tt)
        R.scalars(op, reduction, workspace_bytes)
        _checks.check_bool(op, "normalize", normalize)
        B.check_tensors(op, z=z)
        p[0] = R.precision_of(op, precision)

    def fwd(comm, z_, t_arr, requires_grad):
        return nt_xent_op.nt_xent_forward(z_, _temperature_arg(t_arr, tt),
                                          temperature_grad=t_arr is not None and requires_grad,
                                          label_smoothing=label_smoothing, reduction=reduction,
                                          normalize=normalize, workspace_bytes=workspace_bytes,
                                          requires_grad=requires_grad, group=comm,
                                          precision=p[0])
    return _run(op, group, checks, fwd, [z, _tensor(temperature)], rows=1)


def info_nce(query: Any, key: Any, negatives: Any, temperature: Any, reduction: Any,
             normalize: Any, workspace_bytes: Any, group, precision: Any = None, *,
             labels: Any = None, label_smoothing: Any = 0.0, in_batch_negatives: Any = True,
             replicated_negatives: Any = False, hardness_mode: Any = None,
             hardness_strength: Any = 0.0) -> Tensor:
    """``cupynce.torch.info_nce(..., group=group)`` (see the module notes; ``labels`` are
    each rank's rows', gathered with its keys)."""
    op = "info_nce"
    p: List[Any] = [None]
    tt: List[Any] = [None, 0.0]

    def checks():
        _temperature(op, temperature, tt)
        R.scalars(op, reduction, workspace_bytes)
        _checks.check_bool(op, "normalize", normalize)
        B.check_tensors(op, optional=("negatives", "labels"), query=query, key=key,
                        negatives=negatives, labels=labels)
        p[0] = R.precision_of(op, precision)

    def fwd(comm, q, k, neg, t_arr, requires_grad):
        lab = B.array_of(labels) if isinstance(labels, Tensor) else labels
        return info_nce_op.info_nce_forward(q, k, _temperature_arg(t_arr, tt), negatives=neg,
                                            labels=lab,
                                            temperature_grad=t_arr is not None and requires_grad,
                                            label_smoothing=label_smoothing,
                                            in_batch_negatives=in_batch_negatives,
                                            replicated_negatives=replicated_negatives,
                                            hardness_mode=hardness_mode,
                                            hardness_strength=hardness_strength,
                                            reduction=reduction, normalize=normalize,
                                            workspace_bytes=workspace_bytes,
                                            requires_grad=requires_grad, group=comm,
                                            precision=p[0])
    return _run(op, group, checks, fwd, [query, key, negatives, _tensor(temperature)],
                rows=3)


def _labelled_rows(op: str, forward: Callable, z: Any, labels: Any, temperature: Any,
                   reduction: Any, normalize: Any, workspace_bytes: Any, group,
                   precision: Any) -> Tensor:
    """A global loss of one side of rows with their (n,) labels (SupCon, the pair-wise
    NT-Xent): ``forward`` the core's ``*_forward(z, labels, temperature, ...)``; the labels are
    each rank's rows', gathered with them by the core."""
    p: List[Any] = [None]
    tt: List[Any] = [None, 0.0]

    def checks():
        _temperature(op, temperature, tt)
        R.scalars(op, reduction, workspace_bytes)
        _checks.check_bool(op, "normalize", normalize)
        B.check_tensors(op, z=z, labels=labels)
        p[0] = R.precision_of(op, precision)

    def fwd(comm, z_, t_arr, requires_grad):
        lab = B.array_of(labels) if isinstance(labels, Tensor) else labels
        return forward(z_, lab, _temperature_arg(t_arr, tt),
                       temperature_grad=t_arr is not None and requires_grad,
                       reduction=reduction, normalize=normalize,
                       workspace_bytes=workspace_bytes, requires_grad=requires_grad,
                       group=comm, precision=p[0])
    return _run(op, group, checks, fwd, [z, _tensor(temperature)], rows=1)


def supcon_loss(z: Any, labels: Any, temperature: Any, reduction: Any, normalize: Any,
                workspace_bytes: Any, group, precision: Any = None) -> Tensor:
    """``cupynce.torch.supcon_loss(..., group=group)`` (see the module notes)."""
    return _labelled_rows("supcon_loss", supcon_op.supcon_forward, z, labels, temperature,
                          reduction, normalize, workspace_bytes, group, precision)


def nt_xent_pairs(z: Any, labels: Any, temperature: Any, reduction: Any, normalize: Any,
                  workspace_bytes: Any, group, precision: Any = None) -> Tensor:
    """``cupynce.torch.nt_xent_pairs(..., group=group)`` (see the module notes)."""
    return _labelled_rows("nt_xent_pairs", pairs_op.nt_xent_pairs_forward, z, labels,
                          temperature, reduction, normalize, workspace_bytes, group, precision)


def clip_loss(a: Any, b: Any, logit_scale: Any, reduction: Any, normalize: Any,
              workspace_bytes: Any, group, resolve: Callable, precision: Any = None, *,
              label_smoothing: Any = 0.0, labels: Any = None) -> Tensor:
    """``cupynce.torch.clip_loss(..., group=group)`` (see the module notes); ``resolve``
    is the single-process op's check of ``logit_scale`` → (tensor or None, host value); a
    label smoothing is the global batch's."""
    op = "clip_loss"
    ls: List[Any] = [None, 0.0]
    p: List[Any] = [None]

    def checks():
        R.scalars(op, reduction, workspace_bytes)
        _checks.check_bool(op, "normalize", normalize)
        ls[:] = resolve(a, b, logit_scale)
        p[0] = R.precision_of(op, precision)

    def fwd(comm, a_, b_, ls_arr, requires_grad):
        return clip_op.clip_loss_forward(a_, b_, ls[1] if ls_arr is None else ls_arr,
                                         label_smoothing=label_smoothing,
                                         labels=B.array_of(labels)
                                         if isinstance(labels, Tensor) else labels,
                                         reduction=reduction, normalize=normalize,
                                         workspace_bytes=workspace_bytes,
                                         requires_grad=requires_grad, group=comm,
                                         precision=p[0])
    tensors = [a, b, logit_scale if isinstance(logit_scale, Tensor) else None]
    return _run(op, group, checks, fwd, tensors, rows=2)


def siglip_loss(a: Any, b: Any, logit_scale: Any, logit_bias: Any, reduction: Any,
                normalize: Any, workspace_bytes: Any, group, resolve: Callable,
                precision: Any = None, labels: Any = None) -> Tensor:
    """``cupynce.torch.siglip_loss(..., group=group)`` (see the module notes); ``resolve``
    is the single-process op's check of a scalar → (tensor or None, host value)."""
    op = "siglip_loss"
    ls: List[Any] = [None, 0.0]
    lb: List[Any] = [None, 0.0]
    p: List[Any] = [None]

    def checks():
        R.scalars(op, reduction, workspace_bytes)
        _checks.check_bool(op, "normalize", normalize)
        B.check_tensors(op, a=a, b=b)
        ls[:] = resolve("logit_scale", logit_scale, a)
        lb[:] = resolve("logit_bias", logit_bias, a)
        p[0] = R.precision_of(op, precision)

    def fwd(comm, a_, b_, ls_arr, lb_arr, requires_grad):
        return siglip_op.siglip_loss_forward(
            a_, b_, ls[1] if ls_arr is None else ls_arr, lb[1] if lb_arr is None else lb_arr,
            labels=B.array_of(labels) if isinstance(labels, Tensor) else labels,
            reduction=reduction, normalize=normalize, workspace_bytes=workspace_bytes,
            requires_grad=requires_grad, group=comm, precision=p[0])
    tensors = [a, b] + [v if isinstance(v, Tensor) else None for v in (logit_scale, logit_bias)]
    return _run(op, group, checks, fwd, tensors, rows=2)
