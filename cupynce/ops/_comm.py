"""The collectives the global (multi-rank) losses need, over engines that exist.

:mod:`cupynce.ops._global` runs each rank's share of a global loss against one small
interface, :class:`Comm`; this module adapts CuPy's NCCL to it (``cupynce.torch.distributed``
adapts ``torch.distributed``; the tests adapt an in-process emulation of P ranks):

* ``rank``, ``size``: this rank's index and the number of ranks;
* ``all_gather(x)`` → (P, *x.shape): every rank's x (same shape and dtype everywhere), in
  rank order;
* ``all_reduce(x)`` → the elementwise sum over the ranks (a new array or x itself);
* ``reduce_scatter(x)`` for x (P, *s) → (*s): the sum over the ranks of their x[rank];
* ``exchange(ints)`` → every rank's list of Python ints (the host-side agreement check that
  comes before any other collective, so that bad input raises on every rank, never a hang);
* ``problem(arrays)``: this rank's reason the engine cannot carry these arrays, or None;
* ``ring_shift(x)`` → a :class:`Pending`: x starts towards rank + 1 (mod P) while rank − 1's
  array of x's shape and dtype comes in; ``wait()`` gives it.  What the caller issues between
  the two overlaps the transfer -- the point-to-point step of the ring schedules, which
  compute on one column chunk while the next travels.  Only where ``ring`` is True; a
  communicator without it keeps the all-gather schedules.

Every collective is issued on the current CuPy stream (device arrays) and is deterministic
for a fixed world size: NCCL's and gloo's reductions add in a fixed order for a given
topology, and every rank receives the same bits.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence


class Pending:
    """An array on its way (:meth:`Comm.ring_shift`): ``wait()`` returns it, ordered before
    the caller's later work (on the current stream for device arrays: a stream wait, not a
    host one) and releases what the transfer held.  A Pending dropped without ``wait()`` (an
    error between the two) still orders the transfer before its buffers can be reused."""

    def __init__(self, out, finish: Optional[Callable[[], None]] = None):
        self.out, self._finish = out, finish

    def wait(self):
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return self.out

    def __del__(self):
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - (interpreter shutdown: nothing left to order)
            pass


class Comm:
    """The interface (see the module notes); adapters subclass it."""

    rank: int = 0
    size: int = 1
    #: whether :meth:`ring_shift` is implemented (the ring schedules need it)
    ring: bool = False

    def ring_shift(self, x) -> Pending:
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point ring_shift")

    def all_gather(self, x):
        raise NotImplementedError

    def all_reduce(self, x):
        raise NotImplementedError

    def reduce_scatter(self, x):
        raise NotImplementedError

    def exchange(self, ints: Sequence[int]) -> List[List[int]]:
        raise NotImplementedError

    def problem(self, arrays: Sequence[Any]) -> Optional[str]:
        return None


def _nccl():
    from cupy.cuda import nccl

    return nccl


class NcclComm(Comm):
    """A ``cupy.cuda.nccl.NcclCommunicator`` (or a ``cupyx.distributed`` NCCL backend, through
    the communicator it holds) as a :class:`Comm`: CuPy arrays on the communicator's GPU,
    collectives on the current CuPy stream, no host synchronisation (``exchange`` aside).

    Gathers move raw bytes (any dtype, bfloat16 included); the reductions run on the
    float32 / float64 accumulators and int64 metadata only.
    """

    ring = True

    def __init__(self, comm):
        self.comm = comm
        self.rank = int(comm.rank_id())
        self.size = int(comm.size())

    def _stream(self) -> int:
        import cupy

        return cupy.cuda.get_current_stream().ptr

    def _type(self, dtype):
        nccl = _nccl()
        kinds = {"float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64,
                 "int64": nccl.NCCL_INT64}
        if dtype.name not in kinds:  # pragma: no cover - callers reduce accumulators only
            raise TypeError(f"NcclComm: no reduction for dtype {dtype}")
        return kinds[dtype.name]

    def all_gather(self, x):
        import cupy

        x = cupy.ascontiguousarray(x)
        out = cupy.empty((self.size,) + x.shape, x.dtype)
        self.comm.allGather(x.data.ptr, out.data.ptr, x.nbytes, _nccl().NCCL_UINT8,
                            self._stream())
        return out

    def all_reduce(self, x):
        import cupy

        x = cupy.ascontiguousarray(x)
        out = cupy.empty_like(x)
        self.comm.allReduce(x.data.ptr, out.data.ptr, x.size, self._type(x.dtype),
                            _nccl().NCCL_SUM, self._stream())
        return out

    def reduce_scatter(self, x):
        import cupy

        x = cupy.ascontiguousarray(x)
        out = cupy.empty(x.shape[1:], x.dtype)
        self.comm.reduceScatter(x.data.ptr, out.data.ptr, out.size, self._type(x.dtype),
                                _nccl().NCCL_SUM, self._stream())
        return out

    def ring_shift(self, x) -> Pending:
        """NCCL send to rank + 1 and receive from rank − 1 (one group) on the GPU's ring
        stream, which first waits for the issuing stream (x written): the issuing stream runs
        on meanwhile.  x and the received buffer come from the issuing stream's pool, so at
        ``wait()`` (or when the Pending is dropped) the issuing stream -- and the stream then
        current, if another -- waits for the transfer before x is released and anything
        there reuses either buffer."""
        import cupy

        nccl = _nccl()
        x = cupy.ascontiguousarray(x)
        out = cupy.empty_like(x)
        if self.size == 1:
            out[...] = x
            return Pending(out)
        cur, side = cupy.cuda.get_current_stream(), _ring_stream(int(self.comm.device_id()))
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cur)
        side.wait_event(ready)
        nccl.groupStart()
        try:
            self.comm.send(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, (self.rank + 1) % self.size,
                           side.ptr)
            self.comm.recv(out.data.ptr, out.nbytes, nccl.NCCL_UINT8,
                           (self.rank - 1) % self.size, side.ptr)
        finally:
            nccl.groupEnd()
        done = cupy.cuda.Event(disable_timing=True)
        done.record(side)
        held = [x]

        def finish():
            cur.wait_event(done)
            now = cupy.cuda.get_current_stream()
            if now.ptr != cur.ptr:
                now.wait_event(done)
            held.clear()
        return Pending(out, finish)

    def exchange(self, ints: Sequence[int]) -> List[List[int]]:
        import cupy

        mine = cupy.asarray(list(ints), dtype=cupy.int64)
        return self.all_gather(mine).get().tolist()  # (the check's one host read)

    def problem(self, arrays: Sequence[Any]) -> Optional[str]:
        import cupy

        dev = int(self.comm.device_id())
        for x in arrays:
            if x is None:
                continue
            if not isinstance(x, cupy.ndarray):
                return (f"a NCCL communicator carries CuPy arrays only, got "
                        f"{type(x).__module__}.{type(x).__name__}")
            if x.device.id != dev:
                return f"the communicator is on cuda:{dev}, an input is on cuda:{x.device.id}"
        return None


_RING_STREAMS: dict = {}


def _ring_stream(device: int):
    """The stream the NCCL ring shifts of ``device`` run on (one a GPU, made on it once: the
    adapters are made per call)."""
    import cupy

    s = _RING_STREAMS.get(device)
    if s is None:
        with cupy.cuda.Device(device):
            s = _RING_STREAMS[device] = cupy.cuda.Stream(non_blocking=True)
    return s


def wrap(group) -> Comm:
    """``group`` as a :class:`Comm`: a Comm as it is; a ``cupy.cuda.nccl.NcclCommunicator``;
    a ``cupyx.distributed`` NCCL backend (its communicator)."""
    if isinstance(group, Comm):
        return group
    inner = getattr(group, "_comm", group)  # cupyx.distributed.NCCLBackend holds one
    if all(hasattr(inner, m) for m in ("allGather", "reduceScatter", "rank_id", "size")):
        return NcclComm(inner)
    raise TypeError(f"group must be a cupy.cuda.nccl.NcclCommunicator, a cupyx.distributed "
                    f"NCCL backend or a cupynce Comm (torch.distributed groups go through "
                    f"cupynce.torch), got {type(group).__module__}.{type(group).__name__}")
