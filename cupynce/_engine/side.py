"""Small work beside a long kernel: a fork of the current stream, joined before the op ends.

A tile path's gradient pass fills most of the GPU for hundreds of microseconds (NT-Xent's
``h`` at N = 16384, D = 512: ~345 µs on 128 of an H100's 132 SMs, one CTA an SM).  Work
issued after it on the same stream that needs only what came *before* it -- the reduced
loss (one ``sum_rows`` launch) and, in a CUDA graph, the gather of the small outputs
(``ops._graphs``) -- then waits for it for nothing: ~7 µs a call there.  A branch runs such
work on a side stream, on the SMs the long kernel leaves free:

.. code-block:: python

    with side.branch() as br:
        out = reduce_out(xp, "mean", f32)  # what the branch writes: allocated before the fork
        lse, loss, grads = path.rows(...)  # tiles.rows: side.fork_point() before its h pass
        with br.beside():                  # after the fork point, on the side stream
            total = reduce(xp, loss, "mean", out)
    # the current stream waits for the branch here (or, in a capture, after the gather)

* **Where it forks**: :func:`fork_point` records an event on the current stream, once per
  branch, where the engine knows the statistics are final and a long pass follows
  (``tiles.rows``, where one row block holds the gradient pass: with several, the first
  blocks' products write outputs inside the graph after that point).  No fork point
  (another path: the row blocks, the CPU): ``beside`` runs its work in place, on the
  current stream -- the same work, the same bits.
* **Memory**: the work beside writes only memory allocated *before* the fork point (an
  allocation inside ``beside`` raises).  Memory allocated later on the forked stream may be
  a block that stream's pool took back from work issued after the fork point and still
  running -- ordered for that stream, not for the side stream, which waits only for the fork
  point (an InfoNCE test at N = 1 under eight test workers got a wrong loss and gradients
  that way before this rule).  What it reads must stay alive until the join.  The side
  stream only runs kernels (no cuBLAS: its handle is bound to the op's stream).
* **The join**: at the end of the ``branch`` block the current stream waits for the side
  stream's last event, before the op returns or frees anything the branch reads.  While
  ``ops._graphs`` captures (:func:`open_join`), the branch is left open instead, and the
  capture issues its gather on it (the gather reads only small outputs, which an op computes
  beside or before the fork point: an op that computes a small output on the current stream
  after its fork point must not open a branch) and joins it before the capture ends: the
  graph's two paths run concurrently, every replay.
* The side stream is this thread's own, per device: a capture in one thread never sees
  another thread's work.  Same kernels on the same operands, in the same order within each
  stream: the same bits (the side-stream tests).  ``config.side_streams`` False (or
  ``CUPYNCE_SIDE=0``) runs every branch in place; it is part of ``_graphs``' key (the config).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Optional

from .. import config
from . import compat


_tls = threading.local()


class Branch:
    """One op's branch (see the module notes): the stream it forked from, its fork event and,
    once :meth:`beside` ran, the side stream's event after that work."""

    __slots__ = ("depth", "main", "fork", "done", "side", "events", "waited")

    def __init__(self, depth: int):
        self.depth = depth  # (nesting: which of this thread's event pairs it records)
        self.events = None  # that pair: (fork, done)
        self.main = None  # the stream forked from (the op's current stream)
        self.fork = None  # the event recorded on it at the fork point
        self.done = None  # the side stream's event after the beside() work, until joined
        self.side = None  # this thread's side stream on the forked stream's device
        self.waited = False  # (whether the side stream waits for the fork already)

    @contextmanager
    def beside(self) -> Iterator[None]:
        """Issue the block's work on the side stream after the fork point (no allocation: see
        the module notes); in place where there is no fork point."""
        if self.fork is None:
            yield
            return
        import cupy as cp

        side = self.side
        if not self.waited:
            side.wait_event(self.fork)
            self.waited = True
        try:
            with side, cp.cuda.using_allocator(_no_allocation):
                yield
        finally:
            done = self.events[1]
            done.record(side)
            self.done = done

    def join(self) -> None:
        """The forked stream waits for the side stream's work (nothing when none ran)."""
        if self.done is not None:
            done, self.done = self.done, None
            self.main.wait_event(done)


@contextmanager
def branch() -> Iterator[Branch]:
    """A branch for the block's :func:`fork_point` and ``beside`` work; joined at its end,
    or left for :func:`take_open` inside :func:`open_join`."""
    prev: Optional[Branch] = getattr(_tls, "branch", None)
    br = _tls.branch = Branch(0 if prev is None else prev.depth + 1)
    ok = False
    try:
        yield br
        ok = True
    finally:
        _tls.branch = prev
        if ok and br.done is not None and prev is None and getattr(_tls, "leave_open", False):
            _tls.opened = br
        else:
            br.join()


def _no_allocation(size: int):
    raise RuntimeError(
        f"cupynce internal error: {size} bytes allocated beside the current stream (work "
        "on a side branch must write memory allocated before its fork point)")


def fork_point() -> None:
    """Where work of the current :func:`branch` may start beside the current stream: an event
    recorded on it (the first call per branch; nothing outside a branch or when disabled).
    The side stream and the events are this thread's, made once, outside any capture (a
    stream being captured forks only once they exist: a capture of the caller's may not
    allow their creation)."""
    br: Optional[Branch] = getattr(_tls, "branch", None)
    if br is None or br.fork is not None or not config.current().side_streams:
        return
    import cupy as cp

    main = cp.cuda.get_current_stream()
    dev = cp.cuda.runtime.getDevice()
    per_dev = getattr(_tls, "per_dev", None)
    if per_dev is None:
        per_dev = _tls.per_dev = {}
    got = per_dev.get(dev)
    if got is None or len(got[1]) <= br.depth:
        if main.is_capturing():
            return
        if got is None:  # (the stream and events on the current device)
            got = per_dev[dev] = (cp.cuda.Stream(non_blocking=True), [])
        while len(got[1]) <= br.depth:
            got[1].append((cp.cuda.Event(disable_timing=True),
                           cp.cuda.Event(disable_timing=True)))
    br.side, br.events = got[0], got[1][br.depth]
    br.fork = br.events[0]
    br.fork.record(main)
    br.main = main


@contextmanager
def open_join() -> Iterator[None]:
    """Inside, a branch that ran work beside is left open at its end, for :func:`take_open`
    (``ops._graphs``' capture: its gather goes on the branch, then the join)."""
    prev = getattr(_tls, "leave_open", False)
    _tls.leave_open, _tls.opened = True, None
    try:
        yield
    finally:
        _tls.leave_open = prev
        left, _tls.opened = getattr(_tls, "opened", None), None
        if left is not None:  # (not taken: joined here, before the capture can end)
            left.join()


def take_open() -> Optional[Branch]:
    """The branch left open inside :func:`open_join` (None: none); the taker joins it."""
    br, _tls.opened = getattr(_tls, "opened", None), None
    return br


compat.legacy_switches(__name__, {"ENABLED": "side_streams"})
