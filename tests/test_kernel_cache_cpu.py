"""The host-side kernel caches under threads (CPU: fakes for the module and the kernels).

Emulated ranks (tests/emulated_ranks.py) and multi-threaded callers launch the same kernels
from several threads.  ``kernels.get_kernel`` / ``get_function`` must hand every thread one
Function object per key, and ``tiles``' shared-memory opt-in records (keyed by ``id``) must
never take a new kernel for an opted-in one that was dropped and whose id was reused: such a
kernel would be launched with more dynamic shared memory than it was opted in to
(CUDA_ERROR_INVALID_VALUE).
"""
from __future__ import annotations

import threading
import time

import pytest

cupy = pytest.importorskip("cupy")

from cupynce._engine import kernels, tiles  # noqa: E402


class _Kern:
    """A Function stand-in: the shared-memory attributes the opt-in reads and sets."""

    attributes = {"shared_size_bytes": 2048}

    def __init__(self):
        self.max_dynamic_shared_size_bytes = 48 << 10
        self.calls = []

    def __call__(self, grid, block, args, shared_mem=0):
        assert shared_mem <= self.max_dynamic_shared_size_bytes, "launched without the opt-in"
        self.calls.append(shared_mem)


def test_racing_threads_get_one_function(monkeypatch):
    """Threads that miss the cache together all get the one Function stored first."""
    made = []

    class Module:
        def get_function(self, name):
            time.sleep(0.02)  # (every thread misses before any stores)
            k = _Kern()
            made.append(k)
            return k

    monkeypatch.setattr(kernels, "_loader", lambda filename: (lambda: Module()))
    monkeypatch.setattr(kernels, "_FUNCTIONS", {})
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    got = [None] * 6
    barrier = threading.Barrier(6)

    def body(i):
        barrier.wait()
        got[i] = (kernels.get_kernel("x.cu", "stage", "float32") if i % 2
                  else kernels.get_function("y.cu", "cpn_thing"))

    threads = [threading.Thread(target=body, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) >= 2  # (the race happened: several threads built one)
    odd, even = {id(g) for g in got[1::2]}, {id(g) for g in got[0::2]}
    assert len(odd) == 1 and len(even) == 1
    assert got[1] is kernels.get_kernel("x.cu", "stage", "float32")


def test_opt_in_records_hold_their_kernel(monkeypatch):
    """ws_smem and tile_launch record each kernel with the kernel itself: a record whose id
    now names another object (the recorded kernel dropped, its id reused) is not taken for
    the new kernel, which is opted in before its launch."""
    smem_max = 227 << 10

    class Device:
        attributes = {"MaxSharedMemoryPerBlockOptin": smem_max}

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(tiles, "_WS_SMEM", {})
    k = _Kern()
    assert tiles.ws_smem(k) == (2048, smem_max)
    assert tiles._WS_SMEM[id(k)][2] is k and k.max_dynamic_shared_size_bytes == smem_max - 2048
    fresh = _Kern()
    tiles._WS_SMEM[id(fresh)] = (2048, smem_max, object())  # a stale record under its id
    assert tiles.ws_smem(fresh) == (2048, smem_max)
    assert fresh.max_dynamic_shared_size_bytes == smem_max - 2048

    monkeypatch.setattr(tiles, "_SMEM_OPTED", {})
    monkeypatch.setattr(tiles, "wgmma", lambda: True)
    other = _Kern()
    monkeypatch.setattr(tiles.kernels, "get_kernel", lambda f, st, t: other)
    tiles._SMEM_OPTED[id(other)] = object()  # stale
    tiles.tile_launch("tiles.cu", "lse", "float32", (1,), ())
    assert other.calls == [tiles.WG_SMEM] and tiles._SMEM_OPTED[id(other)] is other
