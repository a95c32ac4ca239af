"""The direct eager path's replays straight from tensors: a small CUDA call, once its
problem is captured (``cupynce.ops._graphs``), without the core's Python.

On the H100 hosts the forward of a small call through the bridge cost ~250 µs of host time
above the core's own: DLPack views both ways, the device / stream / allocator scope, the
core's checks and planning, the graph key — all of it to reach one graph replay whose result
is fixed by the call's arguments.  :func:`call` keys a direct Function's forward by what
decides that replay — the op body, every argument (tensors by shape, dtype, strides and
requires_grad; the rest by value), the device, torch's current stream, the thread and the
engine's switches — and learns, from a call that ran the body and made exactly one replay,
where each graph input comes from (which argument, by its memory) and where each output of
the body goes (which graph output, by its memory).  The next call with the same key copies
the arguments into the plan's inputs by pointer, launches the graph, and copies the outputs
into fresh ``torch.empty`` tensors: the same graph on the same bits, so the same results as
the body (``tests/engine/test_graphs.py`` holds them bitwise equal), with no CuPy array or DLPack
capsule made.

What a learnt entry cannot see, the key or the checks keep out: a body that does GPU work
of its own besides the one replay (its outputs would then not be the graph's: nothing is
learnt), an argument whose pointer is not 16-byte aligned (the plain path would not replay
either), a call inside the caller's own stream capture, a plan evicted from the cache (the
entry holds it weakly and is dropped).  Only the op bodies that opt in use it (their
outputs are views of the core's and they run nothing after it).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import config
from ..ops import _graphs
from . import _bridge as B

#: learnt entries kept (then all dropped and learnt again: bounded, like the plan cache)
MAX_ENTRIES = 256
_entries: Dict[tuple, "_Entry"] = {}
_stats = dict(hits=0, learnt=0)


class _Entry:
    __slots__ = ("gkey", "plan", "ins", "pack_bytes", "outs", "large", "stream")

    def __init__(self, gkey, plan, ins, pack_bytes, outs, large, stream):
        self.gkey, self.plan = gkey, weakref.ref(plan)
        self.ins = ins  # the argument position of each graph input
        self.pack_bytes = pack_bytes
        # per output of the body: None, ("p", byte offset, shape, dtype) or ("o", k, shape,
        # dtype) for the plan's k-th output
        self.outs = outs
        self.large = large  # the plan outputs copied one by one, in order
        self.stream = stream  # CuPy's wrapper of the key's torch stream


def _key(fwd: Callable, args: Sequence[Any], index: int, stream: int) -> tuple:
    return (fwd, index, stream, _graphs.thread_token(), _graphs.switches(),
            tuple((a.shape, a.dtype, a.stride(), a.requires_grad) if isinstance(a, Tensor)
                  else a for a in args))


def call(fwd: Callable[..., Tuple[Any, ...]], args: Sequence[Any]) -> Tuple[Any, ...]:
    """``fwd(*args)`` — an op body whose GPU work is one ``_graphs.run`` — replayed from the
    tensors where a call with the same key was learnt (see the module notes)."""
    first = next((a for a in args if isinstance(a, Tensor)), None)
    if (not config.current().graphs or B._get_raw_stream is None or first is None or not first.is_cuda
            or torch.cuda.is_current_stream_capturing()):
        return fwd(*args)
    index = first.get_device()
    if index != torch.cuda.current_device():  # (the raw copies run in the current context)
        return fwd(*args)
    try:
        key = _key(fwd, args, index, B._get_raw_stream(index))
        entry = _entries.get(key)
    except TypeError:  # an unhashable argument: no key
        return fwd(*args)
    if entry is not None:
        plan = entry.plan()
        if plan is not None and _graphs.live(entry.gkey, plan):
            out = _replay(entry, plan, args, first.device)
            if out is not None:
                return out
        else:
            _entries.pop(key, None)
    with _graphs.trace() as events:
        out = fwd(*args)
    if len(events) == 1 and events[0] is not None:
        learnt = _learn(events[0], args, out, index)
        if learnt is not None:
            if len(_entries) >= MAX_ENTRIES:
                _entries.clear()
            _entries[key] = learnt
            _stats["learnt"] += 1
    return out


def _replay(entry: _Entry, plan, args: Sequence[Any], device: torch.device
            ) -> Optional[Tuple[Any, ...]]:
    ins = []
    for i in entry.ins:
        p = args[i].data_ptr()
        if p % 16:  # (the plain path would not replay a misaligned input either)
            return None
        ins.append(p)
    pack, large = None, {}

    def outputs():  # (after the graph's launch: see replay_raw)
        nonlocal pack
        pack = (torch.empty(entry.pack_bytes, dtype=torch.uint8, device=device)
                if entry.pack_bytes else None)
        large.update((k, torch.empty(shape, dtype=dtype, device=device))
                     for k, shape, dtype in entry.large)
        return (pack.data_ptr() if pack is not None else 0,
                [(k, t.data_ptr()) for k, t in large.items()])

    plan.replay_raw(ins, outputs, entry.stream)
    typed: Dict[torch.dtype, Tensor] = {}
    out = []
    for spec in entry.outs:
        if spec is None:
            out.append(None)
        elif spec[0] == "o":
            out.append(large[spec[1]])
        else:
            _, off, shape, dtype = spec
            view = typed.get(dtype)
            if view is None:
                view = typed[dtype] = pack.view(dtype)
            item = view.element_size()
            out.append(view.as_strided(shape, _contiguous_strides(shape), off // item))
    _stats["hits"] += 1
    return tuple(out)


def _contiguous_strides(shape) -> Tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _learn(event, args: Sequence[Any], out: Any, index: int) -> Optional[_Entry]:
    """The entry for a call whose body made the one replay ``event``, or None where its
    inputs are not the arguments themselves or an output is not the graph's own."""
    gkey, plan, inputs, res = event
    if not isinstance(out, tuple):
        return None
    ins = []
    for x in inputs:
        # (exactly one argument: a key does not say which arguments share memory)
        at = [i for i, a in enumerate(args) if isinstance(a, Tensor)
              and a.data_ptr() == x.data.ptr]
        if len(at) != 1:
            return None
        a = args[at[0]]
        if not a.is_contiguous() or a.numel() * a.element_size() != x.nbytes:
            return None
        ins.append(at[0])
    outs, large = [], {}
    for o in out:
        if o is None:
            outs.append(None)
            continue
        if not isinstance(o, Tensor) or not o.is_contiguous():
            return None
        nbytes = o.numel() * o.element_size()
        k = next((k for k, r in enumerate(res) if r is not None
                  and r.data.ptr == o.data_ptr() and r.nbytes == nbytes), None)
        if k is None:
            return None
        off = plan.layout[k]
        if off is not None:
            if off % o.element_size():
                return None
            outs.append(("p", off, tuple(o.shape), o.dtype))
        else:
            large[k] = (k, tuple(o.shape), o.dtype)
            outs.append(("o", k))
    stream = B._scope(index)[0]
    return _Entry(gkey, plan, tuple(ins), plan.pack_bytes, tuple(outs), tuple(large.values()),
                  stream)


def info() -> Dict[str, int]:
    """Entries learnt, replays made from them (since import / :func:`clear`)."""
    return dict(entries=len(_entries), **_stats)


def clear() -> None:
    _entries.clear()
    _stats.update(hits=0, learnt=0)
