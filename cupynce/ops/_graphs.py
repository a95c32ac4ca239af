"""CUDA graphs for repeated small calls: an op's forward captured once per problem, replayed.

A small call's kernels take tens of microseconds while the host spends ~5-10 µs on each
launch, allocation and copy, plus the Python that plans them.  :func:`run` captures the
GPU work of ``compute(*inputs)`` into a CUDA graph the third time (``CAPTURE_AFTER``) it
sees the same problem, and from then on replays it:

1. copy each input into the plan's static input buffer (``cudaMemcpyAsync``, device to
   device, on the caller's stream) -- or, where the same input pointers come again (a
   training step's tensors from torch's caching allocator, a benchmark's), replay a
   *variant*: the same capture made on the caller's memory, which reads the inputs in place
   (captured on a pointer set's second replay, ``MAX_VARIANTS`` a plan; pointers 256-byte
   aligned like the statics; ``CUPYNCE_GRAPH_VARIANTS=0`` turns them off);
2. launch the graph on the caller's stream (one launch for every kernel and cuBLAS call);
3. copy the outputs out of the plan's static buffers into fresh memory from the current
   allocator (torch's under ``cupynce.torch``), so that what the caller gets is its own:
   a later call of the same problem never overwrites it.  The graph itself gathers the
   small outputs (loss, statistics, scalars: ``PACK_BYTES``) into one block, copied out
   in one piece; the large ones are copied one by one -- except the gradient accumulators
   that the tile paths write with their last products (``_engine/tail.py``): those products
   are left out of the graph and issued after its launch, on the same stream, straight into
   the caller's fresh arrays (no copy; their host time runs while the GPU runs the graph).

The graph (and its deferred products) runs the very kernels, launch configurations and
buffers layout of the plain call, on the same bits: the results are bit-identical
(``tests/engine/test_graphs.py``), and as deterministic. What keys a problem (``key``): the op's
own arguments (flags, Python scalars, which are baked into the graph), every input's shape,
dtype and strides, the device, the caller's stream (a plan is used by one stream, so replays
are ordered by it), and the engine's configuration (``cupynce.config.current()``, the
float32 precision scope included). A problem
is replayed only where every input is C-contiguous and 16-byte aligned (the tile path's
condition, so the plain call would take the same path); otherwise, and when graphs are off
(``CUPYNCE_GRAPHS=0``, ``config.graphs``), ``compute`` just runs.

Memory: a plan holds its static inputs, outputs and the workspace of the captured call for
as long as it is cached.  A plan above ``MAX_PLAN_BYTES`` is dropped after its capture (the
problem then runs uncaptured: calls that large are bound by their kernels, not the host);
an op may say so beforehand (``run``'s ``est_bytes``: CLIP's float32 score block,
NT-Xent's gradient block), and its
calls then skip the key.  The cache holds at most ``CACHE_BYTES`` and ``MAX_PLANS`` plans,
least recently used out first; :func:`clear` empties it.  Under ``cupynce.torch`` the memory
comes from torch's caching allocator (it shows in ``torch.cuda.memory_allocated``).

Threads: the cache is guarded by a lock, and a plan's copy-in / launch / copy-out is one
critical section, so two threads sharing a stream cannot interleave their inputs.
Capture runs on a private non-blocking stream in relaxed mode and allocates nothing: the
buffers are those a plain run of the same call allocated just before (kept by the plan).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from .._checks import cupy_module  # (the cupy module, looked up once)
from .. import config
from .._engine import compat, kernels, side as _side, tail
from .._engine.arrays import FILE
from .._engine.gemm import cublas, same_stream

# ``config.graphs`` (``CUPYNCE_GRAPHS=0``: False) turns graphs off (every call runs its
# kernels one by one).
#: A problem is captured on its ``CAPTURE_AFTER + 1``-th call (one-off shapes never pay for a
#: capture, and the first calls load the kernels and pick the paths outside any capture).
CAPTURE_AFTER = 2
#: A captured plan holding more device memory than this is dropped (its calls run uncaptured).
#: 768 MiB takes in NT-Xent at N = 16384 in 16 bits (its 512 MiB H + 32 MiB accumulator +
#: the 16 MiB input): ~0.1 ms of host time before its first kernel, measured -0.06 to -0.2 ms
#: a call on an H100; a float32 score block capped at 1 GiB stays out.
MAX_PLAN_BYTES = 768 << 20
#: The cache's bounds: bytes held by all plans (two of the largest), and plans.
CACHE_BYTES = 2 << 30
MAX_PLANS = 64
#: Problem keys seen this many times without a plan stop being counted (bounded memory).
MAX_SEEN = 4096
# ``config.graph_variants`` (``CUPYNCE_GRAPH_VARIANTS=0``: False) turns variants off: every
# replay copies its inputs in.
#: A plan captures a variant reading the inputs in place on the ``VARIANT_AFTER + 1``-th
#: replay with the same input pointers; it keeps at most ``MAX_VARIANTS`` (least recently
#: used out first) and counts at most ``MAX_VARIANT_SEEN`` pointer sets.
VARIANT_AFTER = 1
MAX_VARIANTS = 4
MAX_VARIANT_SEEN = 64

_D2D = 3  # cudaMemcpyDeviceToDevice

_lock = threading.RLock()
#: the plans by key; least recently used (lowest ``_Plan.used``) out first.  (A tick per use
#: instead of an OrderedDict's move_to_end: one hash of the key a replay, not two.)
_plans: Dict[tuple, "_Plan"] = {}
_ticks = itertools.count()
_seen: Dict[tuple, int] = {}
#: keys whose capture failed or whose plan was too large: never captured again
_refused: Dict[tuple, str] = {}
_held = 0  # bytes held by the cached plans


#: Outputs up to this size are gathered by the graph into one static block, copied out in
#: one piece (one allocation, one copy per call for all of them: the loss, the row
#: statistics, scalars); larger ones are copied out one by one.
PACK_BYTES = 1 << 20


class _Plan:
    __slots__ = ("graph", "statics", "outs", "pack", "pack_bytes", "layout", "keep", "nbytes",
                 "lock", "tails", "compute", "device", "variants", "seen", "table",
                 "precision", "evicted", "used", "__weakref__")

    def __init__(self, graph, statics, outs, pack, pack_bytes, layout, keep, nbytes, tails,
                 compute, device, table, precision):
        self.graph, self.statics, self.outs, self.keep = graph, statics, outs, keep
        self.pack, self.pack_bytes = pack, pack_bytes
        self.layout = layout  # layout[i]: the output's offset in the pack, or None
        self.nbytes = nbytes
        self.lock = threading.Lock()
        self.tails = tails  # the products left out of the graph (see _tails)
        self.compute, self.device = compute, device  # (for the variants' captures)
        self.table = table  # the pack's gather table (device), or None
        # the float32 precision of the capture (a key switch): the variants' captures and the
        # deferred products run in it (cupynce.torch's fast path replays outside the op's
        # precision scope)
        self.precision = precision
        self.evicted = 0  # variants evicted: past MAX_VARIANTS * 2, no new ones (no churn)
        self.used = next(_ticks)  # (the cache's LRU order)
        # input pointers -> (graph, tails) of a capture reading them in place (no copy in)
        self.variants: "OrderedDict[tuple, tuple]" = OrderedDict()
        self.seen: Dict[tuple, int] = {}

    def replay(self, inputs: Sequence[Any], stream,
               ptrs: Optional[Sequence[int]] = None) -> Tuple[Any, ...]:
        """Copy ``inputs`` in (or read them in place: a variant), launch, and return the
        outputs in fresh memory from the current allocator (the small ones as views of one
        copied-out pack).  ``ptrs``: the inputs' device pointers, where known."""
        cp = cupy_module()

        res: list = []

        def outputs():  # (after the launch: the GPU starts before these allocations)
            packed = cp.cuda.alloc(self.pack_bytes) if self.pack is not None else None
            res.extend(None if o is None else cp.ndarray(o.shape, o.dtype, memptr=packed + off)
                       if off is not None else cp.empty(o.shape, o.dtype)
                       for o, off in zip(self.outs, self.layout))
            large = [(k, r.data.ptr) for k, (r, off) in enumerate(zip(res, self.layout))
                     if r is not None and off is None]
            return (packed.ptr if packed is not None else 0), large

        self.replay_raw([x.data.ptr for x in inputs] if ptrs is None else ptrs, outputs,
                        stream)
        return tuple(res)

    def replay_raw(self, in_ptrs: Sequence[int],
                   outputs: Callable[[], Tuple[int, Sequence[Tuple[int, int]]]],
                   stream) -> None:
        """:meth:`replay` on raw device pointers, for a caller that allocates the outputs
        itself (``cupynce.torch``'s fast path): ``in_ptrs`` the inputs (same layout as the
        statics); ``outputs()``, called once the graph is launched (its allocations' host
        time then runs beside the GPU's work instead of before it), gives ``(pack_ptr,
        out_ptrs)``: where the pack goes (``pack_bytes``; ignored without one) and the
        ``(output index, destination)`` of the large outputs wanted."""
        runtime = (cupy_module()).cuda.runtime
        sp = stream.ptr
        ptrs = tuple(in_ptrs)
        with self.lock:
            found = self.variants.get(ptrs) if config.current().graph_variants else None
            if found is None:
                found = self._variant(ptrs)
            if found is not None:
                self.variants.move_to_end(ptrs)
                graph, tails = found
            else:
                for st, p in zip(self.statics, ptrs):
                    runtime.memcpyAsync(st.data.ptr, p, st.nbytes, _D2D, sp)
                graph, tails = self.graph, self.tails
            graph.launch(stream)
            pack_ptr, out_ptrs = outputs()
            if self.pack is not None:
                runtime.memcpyAsync(pack_ptr, self.pack.ptr, self.pack_bytes, _D2D, sp)
            written = set()
            if tails:
                dest = dict(out_ptrs)
                handle = None
                for ks, fn, arrays, calls in tails:
                    if calls is None:  # (the products' Python, on CuPy's current stream, in
                        with stream, config.float32_precision(self.precision):  # the precision
                            fn(*(a if k is None or k not in dest else  # of the capture)
                                 _wrap(dest[k], self.outs[k], self.device)
                                 for k, a in zip(ks, arrays)))
                    else:  # the recorded cuBLAS calls, C at the caller's array
                        if handle is None:
                            with stream:  # (this thread's handle, bound to the stream)
                                handle = cublas.thread_handle()
                        for args, j, off, _keep in calls:
                            k = ks[j]
                            base = dest[k] if k is not None and k in dest else arrays[j].data.ptr
                            cublas.issue(handle, args, base + off)
                    written.update(ks)
            for k, p in out_ptrs:
                if k not in written:
                    o = self.outs[k]
                    runtime.memcpyAsync(p, o.data.ptr, o.nbytes, _D2D, sp)

    def _variant(self, ptrs: tuple) -> Optional[tuple]:
        """A variant for these input pointers, captured on their second replay (None: not
        yet, not aligned as the statics are, or the capture failed)."""
        if not config.current().graph_variants or self.evicted > 2 * MAX_VARIANTS or any(p % 256 for p in ptrs):
            return None
        seen = self.seen.get(ptrs, 0) + 1
        if seen <= VARIANT_AFTER:
            if len(self.seen) >= MAX_VARIANT_SEEN:
                self.seen.clear()
            self.seen[ptrs] = seen
            return None
        self.seen.pop(ptrs, None)
        inputs = [_wrap(p, st, self.device) for p, st in zip(ptrs, self.statics)]
        try:
            with config.float32_precision(self.precision):
                graph, outs, tails = _capture_graph(inputs, self.compute, self.keep, self.pack,
                                                    self.layout, self.table, fill=False)
            if any((a is None) != (b is None) or (a is not None and a.data.ptr != b.data.ptr)
                   for a, b in zip(outs, self.outs)):
                raise RuntimeError("the variant's outputs are not the plan's")
        except Exception:  # noqa: BLE001 - no variant: this pointer set copies in, as before
            self.seen[ptrs] = float("-inf")  # (never tried again while counted)
            return None
        self.variants[ptrs] = (graph, _tails(tails, self.outs))
        while len(self.variants) > MAX_VARIANTS:
            self.variants.popitem(last=False)
            self.evicted += 1
        return self.variants[ptrs]


def _wrap(ptr: int, like, device: int):
    """A CuPy array of ``like``'s shape and dtype (C order) on the memory at ``ptr``."""
    import cupy as cp

    mem = cp.cuda.UnownedMemory(ptr, like.nbytes, None, device)
    return cp.ndarray(like.shape, like.dtype, cp.cuda.MemoryPointer(mem, 0))


def _tails(recorded, outs) -> tuple:
    """The capture's deferred products as ``(output index or None per array, fn, arrays,
    calls)``: an array that is exactly one output is written straight into the caller's (when
    asked for); the others (not an output, or several: copied out from the plan's own
    afterwards, as are outputs not asked for) into the plan's own.  ``calls``: ``fn``'s cuBLAS
    calls recorded once (``cublas.recording``) as ``(args, array index, byte offset of C,
    host scalars)``, which a replay issues without ``fn``'s Python (~15 µs of host time a
    product, where the host is the bound at N = 8192); None where they cannot be (``fn``
    then runs at each replay)."""
    found = []
    for arrays, fn in recorded:
        ks = []
        for a in arrays:
            hits = [k for k, o in enumerate(outs) if o is not None
                    and o.data.ptr == a.data.ptr and o.nbytes == a.nbytes
                    and o.shape == a.shape and o.dtype == a.dtype]
            ks.append(hits[0] if len(hits) == 1 else None)
        calls = []
        try:
            with cublas.recording() as rec:
                fn(*arrays)
            for args, keep in rec:
                c = args[cublas.GEMM_C_AT]
                j = next(j for j, a in enumerate(arrays)
                         if a.data.ptr <= c < a.data.ptr + max(a.nbytes, 1))
                # (keep: the host scalars alpha / beta point to, kept alive with the call)
                calls.append((args, j, c - arrays[j].data.ptr, keep))
        except (cublas.NotRecordable, StopIteration):
            calls = None
        found.append((tuple(ks), fn, arrays, None if calls is None else tuple(calls)))
    return tuple(found)


#: per thread: while ``events`` is a list, :func:`run` appends ``(key, plan, inputs, outputs)``
#: for each replay (``cupynce.torch``'s fast path learns from them, :func:`trace`)
class _Local(threading.local):
    #: class-level defaults: a thread that never set them reads these without the
    #: AttributeError that ``getattr(local, name, None)`` raises and catches (~1 µs a call)
    events: Optional[list] = None
    token: Optional[int] = None


_tls = _Local()
_thread_tokens = itertools.count()


def thread_token() -> int:
    """This thread's number, never given to another thread of the process: the plans of the
    per-thread default stream are keyed by it.  (``threading.get_ident`` values are reused
    once a thread has exited: a new thread would replay a dead one's plan, whose static
    buffers that thread's stream may still be using -- and two threads in turn shared one plan,
    the flaky test_per_thread_default_streams_have_their_own_plans.)"""
    tok = _tls.token
    if tok is None:
        tok = _tls.token = next(_thread_tokens)  # (atomic under the GIL)
    return tok


class trace:
    """``with trace() as events:`` — the replays :func:`run` makes in this thread inside the
    block, as ``(key, plan, inputs, outputs)``; ``events`` also holds ``None`` for each call
    that ran its kernels one by one."""

    def __enter__(self) -> list:
        self.before = _tls.events
        _tls.events = []
        return _tls.events

    def __exit__(self, *exc) -> None:
        _tls.events = self.before


def live(key: tuple, plan: "_Plan") -> bool:
    """Whether ``plan`` is still the cached plan of ``key`` (marked as just used if so)."""
    if _plans.get(key) is not plan:
        return False
    plan.used = next(_ticks)
    return True


def switches() -> config.Config:
    """What changes which kernels a call runs: this thread's configuration (the float32
    precision scope's included), one object with its hash computed once."""
    return config.current()


_PER_THREAD = 2  # cudaStreamPerThread


def _capturing(stream) -> bool:
    """Whether ``stream`` is being captured (by torch.cuda.graph, a CuPy capture, ...): a
    plan's copies and graph launch would then be recorded into the caller's graph, which
    would outlive the plan's memory.  An error from the query counts as capturing."""
    try:
        return bool(stream.is_capturing())
    except Exception:  # noqa: BLE001 - e.g. the legacy stream while another captures
        return True


def _contiguous(inputs: Sequence[Any]) -> bool:
    """Every input C-contiguous (their alignment :func:`run` checks on every call)."""
    return all(x.flags.c_contiguous for x in inputs)


def run(op_key: tuple, inputs: Sequence[Any], compute: Callable[..., Tuple[Any, ...]], *,
        est_bytes: int = 0, layout: Optional[tuple] = None) -> Tuple[Any, ...]:
    """``compute(*inputs)`` — a tuple of CuPy arrays (or None) — through a cached CUDA graph
    where the problem has been seen before (see the module notes).

    ``op_key``: everything besides the inputs' layout that decides what ``compute`` launches
    (the op, its flags and Python scalars).  ``compute`` must launch work only on CuPy's
    current stream, never synchronise, never read device memory on the host, and return
    arrays it allocated (not views of its inputs).  ``est_bytes``: the op's estimate of what
    a plan of this problem would hold (its kept score block); above ``MAX_PLAN_BYTES`` the
    call runs uncaptured at once, without building its key (tens of µs of host time before
    its first kernel), as its capture would be refused.  ``layout``: the inputs' shapes,
    dtypes and strides as the caller already read them (``_memo.signature`` of the call's
    arguments, which covers every input), used in the key instead of reading them again.
    """
    events = _tls.events
    if events is not None:
        slot = len(events)
        events.append(None)  # (replaced by the replay's record below, if one is made)
    if est_bytes > MAX_PLAN_BYTES or not config.current().graphs:
        return compute(*inputs)
    cp = cupy_module()
    ptrs = []
    for x in inputs:
        p = x.data.ptr
        if p % 16:  # (the tile paths' condition: the plain call would take another path)
            return compute(*inputs)
        ptrs.append(p)
    stream = cp.cuda.get_current_stream()
    if _capturing(stream):  # the caller's own graph: its kernels go in there, plainly
        return compute(*inputs)
    sp = stream.ptr
    # (the per-thread default stream has one handle value for a different stream per thread)
    skey = (sp, thread_token()) if sp == _PER_THREAD else sp
    # (strides in the key: an input laid out as a captured one -- C-contiguous -- is too; the
    # contiguity itself, ~0.5 µs an input, is checked only where no plan is found)
    if layout is None:
        layout = tuple((x.shape, x.dtype.char, x.strides) for x in inputs)
    key = (op_key, layout, cp.cuda.runtime.getDevice(), skey, switches())
    plan = _plans.get(key)
    if plan is None:
        if not _contiguous(inputs):
            return compute(*inputs)
        with _lock:
            plan = _plans.get(key)
            if plan is None:
                if key in _refused:
                    return compute(*inputs)
                seen = _seen.get(key, 0) + 1
                if seen <= CAPTURE_AFTER:
                    if len(_seen) >= MAX_SEEN and key not in _seen:
                        _seen.clear()  # (bounded: many one-off problems start the count over)
                    _seen[key] = seen
                    return compute(*inputs)
                _seen.pop(key, None)
                plan = _capture(key, inputs, compute)
                if plan is None:
                    return compute(*inputs)
    else:  # (least recently used goes first; evicted by another thread meanwhile: this
        plan.used = next(_ticks)  # replay still holds it)
    res = plan.replay(inputs, stream, ptrs)
    if events is not None:
        events[slot] = (key, plan, tuple(inputs), res)
    return res


def _capture(key: tuple, inputs: Sequence[Any], compute) -> Optional[_Plan]:
    """Capture ``compute`` on static copies of ``inputs``; cache and return the plan (None:
    refused, the key is remembered).  Called with ``_lock`` held.

    Nothing is allocated during the capture: a first, plain run of ``compute`` on the static
    inputs records its allocations (all kept by the plan: the graph's buffers), and the
    capture is handed the same buffers in the same order.
    """
    global _held
    import cupy as cp

    base = cp.cuda.get_allocator()
    keep = []

    def recording(size: int):
        mem = base(size)
        keep.append((size, mem))
        return mem

    def run_plainly(outs, fn):  # (the probe's deferred products, outside the recording)
        with cp.cuda.using_allocator(base):
            fn(*outs)

    statics = [cp.empty(x.shape, x.dtype) for x in inputs]
    try:
        sp = cp.cuda.get_current_stream().ptr
        for st, x in zip(statics, inputs):  # (the probe computes on this call's values)
            cp.cuda.runtime.memcpyAsync(st.data.ptr, x.data.ptr, x.nbytes, _D2D, sp)
        # (no side-stream splits in the probe or the capture: both allocate alike)
        with cp.cuda.using_allocator(recording), same_stream(), \
                tail.collecting(run_plainly) as deferred:
            # (on the caller's stream: loads the kernels, picks the paths, gives the layout)
            probe = tuple(compute(*statics))
        if any(o is not None and not o.flags.c_contiguous for o in probe):
            raise ValueError("an output is not C-contiguous (copied out as raw bytes)")
        # what the deferred products write is never packed: they write the caller's arrays
        late = {a.data.ptr for arrays, _ in deferred for a in arrays}
        layout, off = [], 0
        for o in probe:
            small = o is not None and o.nbytes <= PACK_BYTES and o.data.ptr not in late
            layout.append(off if small else None)
            if small:
                off += (o.nbytes + 255) & ~255
        del probe, deferred
        pack = base(off) if off else None
        nsmall = sum(at is not None for at in layout)
        table = cp.empty((3 * nsmall,), np.int64) if nsmall else None  # (base allocator)
        graph, outs, recorded = _capture_graph(statics, compute, keep, pack, layout, table)
    except Exception as exc:  # noqa: BLE001 - a capture that fails falls back, remembered
        if not _out_of_memory(exc):  # (out of memory may pass: counted again from zero)
            _refuse(key, f"capture failed: {type(exc).__name__}: {exc}"[:300])
        return None
    nbytes = sum(size for size, _ in keep) + sum(x.nbytes for x in statics) + off
    if nbytes > MAX_PLAN_BYTES:
        _refuse(key, f"plan of {nbytes} bytes > MAX_PLAN_BYTES")
        return None
    plan = _Plan(graph, statics, outs, pack, off, layout, keep, nbytes,
                 _tails(recorded, outs), compute, cp.cuda.runtime.getDevice(), table,
                 config.current().float32_precision)
    _plans[key] = plan
    _held += nbytes
    while _plans and (_held > CACHE_BYTES or len(_plans) > MAX_PLANS):
        _held -= _plans.pop(min(_plans, key=lambda k: _plans[k].used)).nbytes
    return plan if key in _plans else None


def _capture_graph(inputs, compute, keep, pack, layout, table, fill: bool = True):
    """``compute(*inputs)`` captured on a private stream, handed the buffers ``keep``
    (``(size, memory)`` in allocation order), the small outputs gathered into ``pack`` at
    ``layout`` by one ``gather_bytes`` launch reading the device ``table`` (written here
    after the capture when ``fill``: a variant's outputs are the plan's, its table the same);
    returns ``(graph, outputs, deferred products)``."""
    import cupy as cp

    order = iter(keep)
    gather = (kernels.get_function(FILE, "cpn_gather_bytes")  # (loaded before the capture)
              if any(at is not None for at in layout) else None)
    small: list = []

    def replaying(size: int):
        want, mem = next(order, (None, None))
        if want != size:
            raise RuntimeError(f"allocation sequence changed ({want} -> {size} bytes)")
        return mem

    cap = cp.cuda.Stream(non_blocking=True)
    try:
        with cap, cp.cuda.using_allocator(replaying), same_stream(), \
                tail.collecting(None) as recorded:
            cublas.bind_stream()  # (cuBLAS's stream cannot be set once the capture runs)
            cap.begin_capture()
            try:
                with _side.open_join():
                    outs = tuple(compute(*inputs))
                    # the small outputs into the pack: one launch, the table filled below;
                    # on the op's side branch where it left one open (_engine/side.py: the
                    # small outputs are final there, beside its long pass)
                    small = [(o.data.ptr, at, o.nbytes) for o, at in zip(outs, layout)
                             if at is not None]
                    br = _side.take_open()
                    try:
                        if small:
                            most = max(nb for _, _, nb in small)
                            grid = (min(64, max(1, -(-most // (16 * kernels.BLOCK)))),
                                    len(small))
                            with br.beside() if br is not None else contextlib.nullcontext():
                                gather(grid, (kernels.BLOCK,), (table, np.uint64(pack.ptr)))
                    finally:  # (joined before the capture ends, even on an error)
                        if br is not None:
                            br.join()
            finally:
                graph = cap.end_capture()
    finally:
        cublas.unbind_stream()  # (the capture stream is gone: never skip the next setStream)
    if small and fill:
        table.set(np.array(small, np.int64).reshape(-1))
    return graph, outs, recorded


def _refuse(key: tuple, why: str) -> None:
    if len(_refused) >= MAX_SEEN:
        _refused.clear()
    _refused[key] = why


def _out_of_memory(exc: BaseException) -> bool:
    import cupy as cp

    if isinstance(exc, cp.cuda.memory.OutOfMemoryError):
        return True
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


def clear() -> None:
    """Drop every cached plan (their memory goes back to the allocator) and the counts."""
    global _held
    with _lock:
        _plans.clear()
        _seen.clear()
        _refused.clear()
        _held = 0


def info() -> Dict[str, Any]:
    """The cache's state: plans, bytes held, keys refused (with why)."""
    with _lock:
        return dict(plans=len(_plans), bytes=_held, refused=dict(_refused),
                    counting=len(_seen))


compat.legacy_switches(__name__, {"ENABLED": "graphs", "VARIANTS": "graph_variants"})
