"""Peak memory above the baseline while a function runs, and releasing cached memory.

CuPy is imported lazily (importing this module needs no GPU); torch is never imported here --
it is used only when the caller already imported it.

Device (:func:`peak_extra_bytes`, :func:`measure_peak`)
    Peak device memory *above the baseline* while ``fn`` runs, counted the same way for every
    implementation and both allocators at once:

    * CuPy: a :class:`cupy.cuda.MemoryHook` on the default memory pool tracks the bytes handed
      out by the pool (``malloc`` / ``free``; rounded sizes) and their running maximum.  Arrays
      that existed before ``fn`` started are the baseline and are not counted.  (Allocations
      that bypass CuPy's pool — another allocator, cuBLAS' own workspace — are not seen.)
    * torch (only if already imported and CUDA-initialised): ``max_memory_allocated()`` after
      ``reset_peak_memory_stats()``, minus ``memory_allocated()`` before.

    The reported value is the sum of the two peaks (an upper bound on the joint peak when both
    allocate, exact when only one does).  Caches are emptied first (:func:`free_memory`).

Host (:func:`measure_peak_host`, the NumPy path)
    ``tracemalloc``: the peak of the bytes NumPy and Python allocate above the baseline; memory
    that other libraries allocate, torch's CPU tensors included, is not seen.
"""
from __future__ import annotations

import gc
import sys
from typing import Any, Callable, Dict, Optional, Tuple

from cupynce.report.timing import _synchronize

__all__ = ["free_memory", "free_device_bytes", "measure_peak", "peak_extra_bytes",
           "measure_peak_host"]


def _torch_cuda():
    """The torch module if the caller already imported it and CUDA is initialised, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch
    except Exception:  # pragma: no cover - a broken torch install must not break timing
        return None
    return None


_HOOK_CLASS = None


def _pool_peak_hook():
    """A fresh CuPy memory hook counting live pool allocations and their peak (bytes)."""
    global _HOOK_CLASS
    if _HOOK_CLASS is None:
        from cupy.cuda import memory_hook

        class _PoolPeakHook(memory_hook.MemoryHook):
            name = "cupynce_bench_pool_peak"

            def __init__(self) -> None:
                self.live: Dict[int, int] = {}
                self.current = 0
                self.peak = 0

            def malloc_postprocess(self, **kw: Any) -> None:
                ptr, size = kw.get("mem_ptr", 0), int(kw.get("mem_size", 0))
                if not ptr:
                    return
                self.live[ptr] = size
                self.current += size
                if self.current > self.peak:
                    self.peak = self.current

            def free_postprocess(self, **kw: Any) -> None:
                size = self.live.pop(kw.get("mem_ptr", 0), None)
                if size is not None:  # frees of pre-existing (baseline) arrays are ignored
                    self.current -= size

        _HOOK_CLASS = _PoolPeakHook
    return _HOOK_CLASS()


def free_memory(full_gc: bool = False) -> None:
    """Collect garbage, then release CuPy's pools and torch's cache back to the device.

    Device memory is released by reference counting as soon as the last reference goes; the
    garbage collection here only catches reference cycles.  A full collection costs ~0.2 s
    once torch.compile is loaded, so by default only the young generations are collected;
    pass ``full_gc=True`` between cases and after failures.
    """
    if full_gc:
        gc.collect()
    else:
        gc.collect(1)
    try:
        import cupy

        _synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    except Exception:  # no CuPy / no device: nothing to free
        pass
    torch = _torch_cuda()
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def free_device_bytes() -> int:
    """Device memory available to a new computation: free + CuPy's and torch's idle caches."""
    from cupynce._engine.workspace import free_device_bytes as cupy_free_bytes

    free = cupy_free_bytes()
    torch = _torch_cuda()
    if torch is not None:
        free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return int(free)


def measure_peak(fn: Callable[[], Any], *, free_first: bool = True) -> Tuple[Dict[str, int], Any]:
    """Run ``fn()`` once; return ``({"cupy": b, "torch": b, "total": b}, fn's result)``.

    Bytes are peaks above the baseline present when ``fn`` starts (module notes).
    """
    if free_first:
        free_memory()
    torch = _torch_cuda()
    t_base = 0
    if torch is not None:
        torch.cuda.synchronize()
        t_base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    hook = _pool_peak_hook()
    with hook:
        result = fn()
        _synchronize()
    t_peak = 0
    if torch is None:
        torch = _torch_cuda()  # fn may have initialised torch's CUDA state itself
        if torch is not None:
            t_peak = torch.cuda.max_memory_allocated()
    else:
        t_peak = max(torch.cuda.max_memory_allocated() - t_base, 0)
    peaks = {"cupy": int(hook.peak), "torch": int(t_peak)}
    peaks["total"] = peaks["cupy"] + peaks["torch"]
    return peaks, result


def peak_extra_bytes(fn: Callable[[], Any]) -> int:
    """Peak device memory (bytes) above the baseline while ``fn()`` runs, CuPy + torch."""
    peaks, result = measure_peak(fn)
    del result
    return peaks["total"]


def _tracemalloc_toggle_unsafe() -> Optional[str]:
    """Why ``tracemalloc.start()`` / ``stop()`` must not run in this process, or None.

    ``torch.distributed``'s worker threads (gloo's, NCCL's watchdog) take the GIL from C++
    whenever they drop the last reference to a tensor (a ``from_numpy`` / DLPack tensor's
    deleter, or a tensor's preserved Python object): a thread state is allocated through
    ``PyMem_RawMalloc``, and with tracing on that goes through tracemalloc's raw-memory hook,
    which waits for the GIL.  If ``tracemalloc.stop()`` runs meanwhile, the hook carries on
    after it with the freed traceback buffer and the process dies with SIGSEGV (CPython
    gh-128679: fixed in 3.13.2, present in 3.11; gh-143143 reports a segfault in the same
    race test on a later version).  ``test_bench_multigpu`` lost a gloo rank (exit code -11)
    to this under load.
    """
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return ("torch.distributed is initialised: its threads may be entering the "
                    "allocator, and stopping tracemalloc then can crash the interpreter")
    except Exception:  # pragma: no cover - a broken torch install must not break timing
        return None
    return None


def measure_peak_host(fn: Callable[[], Any]) -> Tuple[Dict[str, int], Any]:
    """Run ``fn()`` once; return ``({"host": b, "total": b}, fn's result)`` (``tracemalloc``).

    Bytes are the peak of host memory traced by ``tracemalloc`` (NumPy's array data and Python
    objects) above the amount traced when ``fn`` starts.

    Refused (``RuntimeError``) in a process with an initialised ``torch.distributed`` process
    group, unless tracing is already on: turning tracing on and off there can kill the process
    (see :func:`_tracemalloc_toggle_unsafe`).
    """
    import tracemalloc

    gc.collect(1)
    started = not tracemalloc.is_tracing()
    if started:
        why = _tracemalloc_toggle_unsafe()
        if why:
            raise RuntimeError(f"measure_peak_host: not in this process ({why}); pass "
                               f"memory=False to run_case, or start tracemalloc first")
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if started:
            tracemalloc.stop()
    extra = max(int(peak) - int(base), 0)
    return {"host": extra, "total": extra}, result
