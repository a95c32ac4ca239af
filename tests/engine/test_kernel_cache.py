"""The host-side kernel caches under threads (CPU: fakes for the module and the kernels).

Emulated ranks (tests/emulated_ranks.py) and multi-threaded callers launch the same kernels
from several threads.  ``kernels.get_kernel`` / ``get_function`` must hand every thread one
Function object per key, and ``tiling``'s shared-memory opt-in records (keyed by ``id``) must
never take a new kernel for an opted-in one that was dropped and whose id was reused: such a
kernel would be launched with more dynamic shared memory than it was opted in to
(CUDA_ERROR_INVALID_VALUE).
"""
from __future__ import annotations

import threading
import time

import pytest

cupy = pytest.importorskip("cupy")

from cupynce._engine import kernels, tiling  # noqa: E402


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
    monkeypatch.setattr(tiling, "_WS_SMEM", {})
    k = _Kern()
    assert tiling.ws_smem(k) == (2048, smem_max)
    assert tiling._WS_SMEM[id(k)][2] is k and k.max_dynamic_shared_size_bytes == smem_max - 2048
    fresh = _Kern()
    tiling._WS_SMEM[id(fresh)] = (2048, smem_max, object())  # a stale record under its id
    assert tiling.ws_smem(fresh) == (2048, smem_max)
    assert fresh.max_dynamic_shared_size_bytes == smem_max - 2048

    monkeypatch.setattr(tiling, "_SMEM_OPTED", {})
    monkeypatch.setattr(tiling, "wgmma", lambda: True)
    other = _Kern()
    monkeypatch.setattr(tiling.kernels, "get_kernel", lambda f, st, t: other)
    tiling._SMEM_OPTED[id(other)] = object()  # stale
    tiling.tile_launch("losses/tiles.cu", "lse", "float32", (1,), ())
    assert other.calls == [tiling.WG_SMEM] and tiling._SMEM_OPTED[id(other)] is other


def _hold_lock(args):
    """One process: take the build lock, note when it held it (for the overlap check)."""
    import os as _os
    import time as _time

    cache, log = args
    _os.environ["CUPY_CACHE_DIR"] = cache
    from cupynce._engine import kernels as k

    with k._build_lock("module_x"):
        start = _time.monotonic()
        _time.sleep(0.15)
        end = _time.monotonic()
    with open(log, "a") as f:
        f.write(f"{start} {end}\n")


def test_build_lock_serialises_processes(tmp_path):
    """Processes starting together (DDP ranks sharing a cache folder) hold a module's build
    lock one at a time, so the first compiles and the others load what it wrote."""
    import multiprocessing as mp

    log = tmp_path / "log"
    with mp.get_context("spawn").Pool(4) as pool:
        pool.map(_hold_lock, [(str(tmp_path / "cache"), str(log))] * 4)
    spans = sorted(tuple(map(float, line.split())) for line in log.read_text().splitlines())
    assert len(spans) == 4
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end, spans


def test_build_lock_without_a_writable_cache_folder(tmp_path, monkeypatch):
    """An unwritable cache folder: no lock, and no error (each process compiles alone)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(blocker / "sub"))  # below a file: mkdir fails
    with kernels._build_lock("module_x"):
        pass


def test_prebuilt_names_follow_the_source(monkeypatch):
    """A prebuilt cubin is named by the hash of the source the loader would compile, its
    options and its arch: an edited kernel (or header) never matches an old cubin."""
    name = kernels.prebuilt_name("products/blas.cu", "sm_90")
    assert name.startswith("blas_sm_90_") and name.endswith(".cubin")
    assert (kernels.module_key("products/blas.cu", "sm_80")
            != kernels.module_key("products/blas.cu", "sm_90"))
    edited = kernels.read_source("products/blas.cu") + "\n// an edit\n"
    assert kernels.prebuilt_name("products/blas.cu", "sm_90", edited) != name
    assert kernels.build_arch("losses/tiles.cu", "90") == "sm_90a"
    assert kernels.build_arch("losses/stats.cu", "90") == "sm_90"
    assert kernels.build_arch("losses/tiles.cu", "80") == "sm_80"
