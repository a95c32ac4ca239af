"""The one timing / memory harness shared by cupynce's benchmarks (and its ``python -m`` report).

Lives in the package so that ``benchmarks/`` and ``python -m cupynce`` share it (no second
copy).  This module measures one case (:func:`run_case`: a first call, its peak memory, then
its times) out of the pieces below it, which import nothing from here:

=================  =======================================================================
timing.py          CUDA-event and host timing, medians and quantiles, the SM clock
memory.py          peak memory above the baseline (CuPy's pool, torch's allocator, the
                   host), releasing cached memory
environment.py     the GPU, CUDA and package versions, the date; the header of a report
formatting.py      table cells (ms, MiB, ratios), markdown tables
torch_baseline.py  the PyTorch formulas users run today, arrays as tensors, a training step
progress.py        the progress bar on stderr
=================  =======================================================================

Every name the benchmark scripts use is importable from here, so that a script needs one
import line; the modules of :mod:`cupynce.report` import each name from where it is defined.

Host (NumPy path, no GPU)
    ``run_case(..., device="cpu")`` times with :func:`time_cpu` (``time.perf_counter`` around
    each call; same keys as :func:`time_cuda`) and measures memory with :func:`measure_peak_host`
    (``tracemalloc``: the peak of the bytes NumPy and Python allocate above the baseline; memory
    that other libraries allocate, torch's CPU tensors included, is not seen, so callers pass
    ``memory=False`` for them).

Out-of-memory
    :func:`run_case` treats device OOM (CuPy's ``OutOfMemoryError``, ``torch.OutOfMemoryError``,
    cuBLAS allocation failures, anything whose message says "out of memory") as a *result*:
    it frees memory and returns ``{"oom": True, ...}``.
"""
from __future__ import annotations

import gc
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from cupynce.report.environment import device_header, device_info
from cupynce.report.formatting import _short, fmt_mib, fmt_ms, fmt_ratio, markdown_table
from cupynce.report.memory import (free_device_bytes, free_memory, measure_peak,
                                   measure_peak_host, peak_extra_bytes)
from cupynce.report.progress import Progress
from cupynce.report.timing import time_cpu, time_cuda
from cupynce.report.torch_baseline import load_torch, to_torch, torch_reference, torch_step

# not in __all__, yet imported from here by scripts in benchmarks/
from cupynce.report.formatting import GiB, MiB  # noqa: F401
from cupynce.report.timing import _stats, throttle_names  # noqa: F401

__all__ = [
    "time_cuda", "measure_peak", "peak_extra_bytes", "run_case", "free_memory",
    "free_device_bytes", "is_oom", "device_info", "device_header", "markdown_table",
    "fmt_ms", "fmt_mib", "fmt_ratio", "time_cpu", "measure_peak_host", "Progress",
    "load_torch", "torch_reference", "to_torch", "torch_step",
]


_OOM_MARKERS = ("out of memory", "cublas_status_alloc_failed", "cudaerrormemoryallocation",
                "cuda_error_out_of_memory", "outofmemoryerror")


def _oom_types() -> Tuple[type, ...]:
    types: List[type] = []
    try:
        import cupy

        types.append(cupy.cuda.memory.OutOfMemoryError)
    except Exception:
        pass
    torch = sys.modules.get("torch")
    if torch is not None:
        for holder, name in ((torch, "OutOfMemoryError"), (getattr(torch, "cuda", None),
                                                           "OutOfMemoryError")):
            t = getattr(holder, name, None) if holder is not None else None
            if isinstance(t, type):
                types.append(t)
    return tuple(types)


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a device out-of-memory error."""
    types = _oom_types()
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if types and isinstance(e, types):
            return True
        text = f"{type(e).__name__}: {e}".lower()
        if any(m in text for m in _OOM_MARKERS):
            return True
        e = e.__cause__ or e.__context__
    return False


def run_case(fn: Callable[[], Any], *, warmup: int = 3, repeat: int = 10, memory: bool = True,
             keep_result: bool = False, catch_errors: bool = False,
             free_first: bool = True, device: str = "cuda") -> Dict[str, Any]:
    """Measure one implementation: first call, peak extra memory, then :func:`time_cuda`.

    1. ``fn()`` once, untimed (lazy initialisation: kernel loading, cuBLAS heuristics, ...);
    2. with ``memory``: one more call under :func:`measure_peak` (``peak_extra_bytes``,
       ``peak_cupy_bytes``, ``peak_torch_bytes``); its return value is kept under ``"result"``
       when ``keep_result`` (e.g. for a correctness check; pop it before serialising);
    3. :func:`time_cuda` with ``warmup`` / ``repeat``.

    ``device="cpu"``: host timing (:func:`time_cpu`) and host memory (:func:`measure_peak_host`,
    ``peak_extra_bytes`` and ``peak_host_bytes``) for the NumPy path; nothing touches CuPy.

    ``free_first``: release cached memory (:func:`free_memory`) before starting.  Device OOM
    at any step is a result: ``{"oom": True, "stage": ..., "error": ...}`` after freeing
    memory.  Other exceptions propagate, or with ``catch_errors`` are returned as
    ``{"error": ..., "stage": ...}``.
    """
    out: Dict[str, Any] = {}
    failure: Optional[Dict[str, Any]] = None
    stage = "setup"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"run_case: device must be 'cuda' or 'cpu', got {device!r}")
    host = device == "cpu"
    try:
        if free_first:
            if host:
                gc.collect(1)
            else:
                free_memory()
        stage = "first call"
        first = fn()
        if keep_result and not memory:
            out["result"] = first
        del first
        if memory:
            stage = "memory"
            if host:
                peaks, result = measure_peak_host(fn)
                out.update(peak_extra_bytes=peaks["total"], peak_host_bytes=peaks["host"])
            else:
                peaks, result = measure_peak(fn, free_first=False)  # peaks are logical bytes
                out.update(peak_extra_bytes=peaks["total"], peak_cupy_bytes=peaks["cupy"],
                           peak_torch_bytes=peaks["torch"])
            if keep_result:
                out["result"] = result
            del result
        stage = "timing"
        timer = time_cpu if host else time_cuda
        out.update(timer(fn, warmup=warmup, repeat=repeat))
    except Exception as exc:  # noqa: BLE001 - classified below
        if is_oom(exc):
            failure = {"oom": True, "stage": stage, "error": _short(exc)}
        elif catch_errors:
            failure = {"error": _short(exc), "stage": stage}
        else:
            raise
    if failure is not None:  # the exception (and the frames holding tensors) is gone by now
        out.clear()
        if host:
            gc.collect()
        else:
            free_memory(full_gc=True)
        return failure
    return out


if __name__ == "__main__":  # pragma: no cover - manual check of the environment
    import json

    print(json.dumps(device_info(), indent=2))
