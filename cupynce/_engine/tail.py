"""Gradient products an op may leave out of its CUDA graph, to write the caller's own arrays.

A replayed graph (``cupynce.ops._graphs``) writes into its plan's static buffers, so each
large output is copied out into fresh memory after every replay: at N = 8192, D = 512 the two
float32 gradient accumulators of CLIP take 2 x ~11 µs of copies, at 16384 NT-Xent's one ~21.
The accumulators are written by the call's last work, the cuBLAS products of the gradient
block.  :func:`products` marks those: the tile paths hand it the accumulators and a function
that issues the products into them.  Outside a capture it just runs them.  While
``_graphs`` captures, it records them instead (:func:`collecting`); each replay then issues
the same products after the graph's launch, on the same stream, straight into the outputs
the caller gets -- no copy, and their host time runs while the GPU works through the graph.
Same cuBLAS calls on the same operands: the same bits.

Only the last step of a call may be deferred: nothing the graph runs may read what ``fn``
writes.  The operands ``fn`` reads (the gradient block, the inputs) are the plan's own
buffers, which only the next replay on the same stream overwrites, after these products.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

_tls = threading.local()

#: ``(outputs, fn)``: ``fn(*outputs)`` writes ``outputs``
Deferred = Tuple[Tuple[Any, ...], Callable[..., None]]


def products(outs: Sequence[Any], fn: Callable[..., None], last: bool = True) -> None:
    """``fn(*outs)`` now, or as :func:`collecting` says (recorded, run its way or not).
    ``last`` False (not the call's last work, e.g. one of several row blocks): now, always."""
    rec: Optional[tuple] = getattr(_tls, "rec", None)
    outs = tuple(outs)
    if rec is None or not last:
        fn(*outs)
        return
    rec[0].append((outs, fn))
    if rec[1] is not None:
        rec[1](outs, fn)


@contextmanager
def collecting(run: Optional[Callable[[Tuple[Any, ...], Callable[..., None]], None]]
               ) -> Iterator[List[Deferred]]:
    """Record the :func:`products` calls made in this thread meanwhile; ``run(outs, fn)``
    runs each (a probe that learns which outputs they write), None leaves them out (a
    capture)."""
    prev = getattr(_tls, "rec", None)
    rec: List[Deferred] = []
    _tls.rec = (rec, run)
    try:
        yield rec
    finally:
        _tls.rec = prev


@contextmanager
def not_last() -> Iterator[None]:
    """The :func:`products` issued meanwhile run now, inside any capture (the caller's later
    work reads or adds to what they write: MoCo's queue fix-ups, SupCon's class terms), so
    a graph holds them and copies their outputs out as it does any other."""
    prev = getattr(_tls, "rec", None), getattr(_tls, "later", False)
    _tls.rec, _tls.later = None, True
    try:
        yield
    finally:
        _tls.rec, _tls.later = prev


def later_work() -> bool:
    """Whether the caller's later work reads what the products write (inside
    :func:`not_last`): then the products are no call's last work, and nothing may start
    beside them (``side.fork_point``: a capture gathers the small outputs on that branch,
    which would read those outputs before the later work has written them)."""
    return getattr(_tls, "later", False)
