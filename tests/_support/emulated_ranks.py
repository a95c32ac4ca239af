"""P emulated ranks in one process: a test communicator with the collectives of
``cupynce.ops._comm.Comm``, each rank a thread, on NumPy arrays (CPU) or CuPy arrays (one GPU).

``run(P, fn)`` calls ``fn(comm)`` on P threads, one :class:`EmulatedComm` each, and returns
their results in rank order (re-raising the first rank's exception).  Every collective is a
rendezvous: each rank posts its array, all wait, each computes its result from every rank's
post in rank order (sums in rank order: deterministic), all wait again before the posts are
reused.  A rank that never reaches a collective makes the others time out with an error
instead of hanging.  CuPy work is synchronised around each rendezvous (this communicator's
host syncs are the tests', not the library's).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, List

import numpy as np

from cupynce.ops._comm import Comm, Pending

TIMEOUT_S = 120.0


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


class _Barrier:
    """A reusable barrier whose ``abort`` breaks only the waits not yet released (a rank
    that raises after a rendezvous must not break the others' completed one)."""

    def __init__(self, n: int):
        self.n, self.count, self.gen, self.broken = n, 0, 0, False
        self.cv = threading.Condition()

    def wait(self) -> None:
        with self.cv:
            gen = self.gen
            self.count += 1
            if self.count == self.n:
                self.gen, self.count = self.gen + 1, 0
                self.cv.notify_all()
                return
            while gen == self.gen:
                if self.broken or not self.cv.wait(timeout=TIMEOUT_S):
                    self.broken = True
                    self.cv.notify_all()
                    raise threading.BrokenBarrierError

    def abort(self) -> None:
        with self.cv:
            self.broken = True
            self.cv.notify_all()


class _Shared:
    def __init__(self, size: int):
        self.size = size
        self.barrier = _Barrier(size)
        self.posts: List[Any] = [None] * size
        #: what each collective was called, per rank (tests read it)
        self.log: List[List[str]] = [[] for _ in range(size)]


class EmulatedComm(Comm):
    def __init__(self, shared: _Shared, rank: int):
        self.shared, self.rank, self.size = shared, rank, shared.size

    def _sync(self, x):
        if hasattr(x, "device") and not isinstance(x, np.ndarray):
            import cupy

            cupy.cuda.get_current_stream().synchronize()

    def _rendezvous(self, name: str, x):
        self.shared.log[self.rank].append(name)
        self._sync(x)
        self.shared.posts[self.rank] = x
        self.shared.barrier.wait()
        posts = list(self.shared.posts)
        return posts

    def _done(self):
        self.shared.barrier.wait()

    def all_gather(self, x):
        xp = _xp(x)
        posts = self._rendezvous("all_gather", xp.ascontiguousarray(x))
        shapes = {(p.shape, str(p.dtype)) for p in posts}
        assert len(shapes) == 1, f"all_gather of different shapes / dtypes: {shapes}"
        out = xp.stack([xp.asarray(p) for p in posts])
        self._sync(out)
        self._done()
        return out

    def all_reduce(self, x):
        xp = _xp(x)
        posts = self._rendezvous("all_reduce", xp.ascontiguousarray(x))
        out = posts[0].copy()
        for p in posts[1:]:
            out = out + p
        self._sync(out)
        self._done()
        return out

    def reduce_scatter(self, x):
        xp = _xp(x)
        posts = self._rendezvous("reduce_scatter", xp.ascontiguousarray(x))
        assert posts[0].shape[0] == self.size
        out = posts[0][self.rank].copy()
        for p in posts[1:]:
            out = out + p[self.rank]
        self._sync(out)
        self._done()
        return out

    ring = True

    def ring_shift(self, x):
        """Rank − 1's array (a rendezvous now; ``wait()`` hands it over)."""
        xp = _xp(x)
        posts = self._rendezvous("ring_shift", xp.ascontiguousarray(x))
        got = posts[(self.rank - 1) % self.size]
        assert got.shape == x.shape and got.dtype == x.dtype, (got.shape, x.shape)
        out = got.copy()
        self._sync(out)
        self._done()
        return Pending(out)

    def exchange(self, ints):
        posts = self._rendezvous("exchange", [int(v) for v in ints])
        lengths = {len(p) for p in posts}
        assert len(lengths) == 1, f"exchange of different lengths: {lengths}"
        self._done()
        return [list(p) for p in posts]


def run(size: int, fn: Callable[[EmulatedComm], Any], device: int = None,
        catch: bool = False) -> List[Any]:
    """``fn(comm)`` on ``size`` emulated ranks; their results in rank order (``catch``: each
    rank's exception in place of its result, nothing raised)."""
    shared = _Shared(size)
    results: List[Any] = [None] * size
    errors: List[BaseException] = [None] * size

    def body(rank: int):
        try:
            if device is not None:
                import cupy

                with cupy.cuda.Device(device):
                    results[rank] = fn(EmulatedComm(shared, rank))
            else:
                results[rank] = fn(EmulatedComm(shared, rank))
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            errors[rank] = e
            shared.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.log = shared.log
    if catch:
        return [e if e is not None else r for e, r in zip(errors, results)]
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    if any(errors):
        raise next(e for e in errors if e is not None)
    return results
