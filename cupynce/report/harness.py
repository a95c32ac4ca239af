"""The one timing / memory harness shared by cupynce's benchmarks (and its ``python -m`` report).

Lives in the package so that ``benchmarks/`` and ``python -m cupynce`` share it (no second copy);
it uses cupynce only for the free-memory query of ``_blas``.  CuPy is imported lazily (``import`` of this module needs no
GPU); torch is never imported here — it is used only when the caller already imported it.

Timing (:func:`time_cuda`)
    For every repeat: ``cudaDeviceSynchronize``, record a CUDA event on CuPy's current stream,
    call ``fn``, record a second event, synchronise the device, read the elapsed time.  The
    device is idle when the start event is recorded, so the span covers all GPU work ``fn``
    issues *and* any host-side gaps between its launches (Python overhead that starves the GPU
    counts, as it does in training).

    Stream semantics: CuPy's current stream is, by default, the legacy default ("null")
    stream, and PyTorch's default stream is the legacy default stream too.  An event recorded
    on the legacy stream is ordered after all earlier work of every blocking stream, so the
    events time torch (eager, torch.compile/Triton) work as well as CuPy work.  Work on a
    user-created *non-blocking* stream would escape the events; the host wall time between the
    two device synchronisations (``wall_*_ms``, always correct but including launch overhead
    of the first call) is reported next to the event times as a cross-check.

Clocks (:func:`time_cuda`)
    Where NVML is importable (``pynvml``, from the ``nvidia-ml-py`` package; optional), each
    repeat also reads the GPU's SM clock and its clock-throttle reasons after the device
    synchronisation, outside the timed span: ``sm_mhz`` (per repeat), ``sm_mhz_median`` and
    ``throttle`` (the reasons seen during the repeats, by NVML's names: "power cap", ...).  A
    long tensor-core run can lower the clock under the board's power limit as it goes (a
    run's later calls slower than its first), which timings of different implementations
    must be read against.

Memory (:func:`peak_extra_bytes`, :func:`measure_peak`)
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

import datetime as _dt
import gc
import importlib.metadata as _md
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "time_cuda", "measure_peak", "peak_extra_bytes", "run_case", "free_memory",
    "free_device_bytes", "is_oom", "device_info", "device_header", "markdown_table",
    "fmt_ms", "fmt_mib", "fmt_ratio", "time_cpu", "measure_peak_host", "Progress",
    "load_torch", "torch_reference", "to_torch", "torch_step",
]

MiB = 1 << 20
GiB = 1 << 30


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
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


def _percentile(sorted_vals: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (as ``numpy.percentile``'s default) of sorted values."""
    if not sorted_vals:
        return float("nan")
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return float(sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo))


def _stats(prefix: str, vals: Sequence[float]) -> Dict[str, float]:
    s = sorted(vals)
    return {f"{prefix}median_ms": _percentile(s, 50), f"{prefix}p20_ms": _percentile(s, 20),
            f"{prefix}p80_ms": _percentile(s, 80), f"{prefix}min_ms": float(s[0]) if s else float("nan")}


def _synchronize() -> None:
    import cupy

    cupy.cuda.Device().synchronize()  # cudaDeviceSynchronize: every stream, torch's included


# ------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------
def time_cuda(fn: Callable[[], Any], *, warmup: int = 3, repeat: int = 10,
              burst: int = 1) -> Dict[str, Any]:
    """Time ``fn()`` with CUDA events; see the module notes for what the span covers.

    Returns ``median_ms, p20_ms, p80_ms, min_ms`` (event times), ``wall_median_ms,
    wall_min_ms`` (host time between device synchronisations), ``times_ms`` (every repeat),
    ``warmup`` and ``repeat``; with NVML, ``sm_mhz``, ``sm_mhz_median`` and ``throttle`` (see
    the module notes).  ``fn``'s return value is dropped after each call, outside the timed
    span.  ``burst`` > 1: each timed span holds that many calls back to back and the times are
    per call -- the GPU's time with the host's hidden behind the queue (a kernel's own time,
    not an isolated call's; the first call's host time before its first kernel stays in the
    span, spread over the burst); the return values are dropped inside the span then, and
    the result records ``burst``.
    """
    import cupy

    if repeat < 1:
        raise ValueError(f"time_cuda: repeat must be >= 1, got {repeat}")
    if burst < 1:
        raise ValueError(f"time_cuda: burst must be >= 1, got {burst}")
    for _ in range(max(warmup, 0)):
        out = fn()
        del out
    _synchronize()
    clock = _clock_reader()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    ev_ms: List[float] = []
    wall_ms: List[float] = []
    mhz: List[int] = []
    reasons = 0
    for _ in range(repeat):
        _synchronize()
        stream = cupy.cuda.get_current_stream()
        t0 = time.perf_counter()
        start.record(stream)
        out = fn()
        for _ in range(burst - 1):
            del out
            out = fn()
        end.record(stream)
        _synchronize()
        t1 = time.perf_counter()
        del out
        ev_ms.append(float(cupy.cuda.get_elapsed_time(start, end)) / burst)
        wall_ms.append((t1 - t0) * 1e3 / burst)
        if clock is not None:
            m, why = clock()
            mhz.append(m)
            reasons |= why
    res = _timing(ev_ms, wall_ms, warmup, repeat)
    if burst > 1:
        res["burst"] = burst
    if mhz:
        res.update(sm_mhz=mhz, sm_mhz_median=_percentile(sorted(mhz), 50),
                   throttle=throttle_names(reasons))
    return res


#: NVML's clock-throttle reason bits (nvml.h ``nvmlClocksThrottleReason*``) by name; idle and
#: the applications-clocks setting are not throttling a run
_THROTTLE = (("power cap", 0x4), ("HW slowdown", 0x8), ("sync boost", 0x10),
             ("SW thermal", 0x20), ("HW thermal", 0x40), ("HW power brake", 0x80),
             ("display clocks", 0x100))


def throttle_names(bits: int) -> List[str]:
    """The names of NVML's throttle reasons set in ``bits`` (see :data:`_THROTTLE`)."""
    return [name for name, bit in _THROTTLE if bits & bit]


def _clock_reader() -> Optional[Callable[[], Tuple[int, int]]]:
    """``() -> (SM clock in MHz, throttle-reason bits)`` of the current CuPy device through
    NVML (matched by PCI bus id: NVML's numbering need not be CUDA's), or None where
    ``pynvml`` is missing or NVML fails (the clocks are then simply not reported)."""
    try:
        import cupy
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(cupy.cuda.Device().pci_bus_id)
        sm = pynvml.NVML_CLOCK_SM
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons

        def read() -> Tuple[int, int]:
            return int(pynvml.nvmlDeviceGetClockInfo(handle, sm)), int(reasons(handle))
        read()
        return read
    except Exception:  # noqa: BLE001 - optional: no pynvml, no NVML, a virtual device
        return None


def _timing(times_ms: List[float], wall_ms: List[float], warmup: int,
            repeat: int) -> Dict[str, Any]:
    """The result of :func:`time_cuda` / :func:`time_cpu` from the per-repeat times."""
    res: Dict[str, Any] = _stats("", times_ms)
    ws = sorted(wall_ms)
    res.update(wall_median_ms=_percentile(ws, 50), wall_min_ms=ws[0], times_ms=times_ms,
               warmup=warmup, repeat=repeat)
    return res


def time_cpu(fn: Callable[[], Any], *, warmup: int = 1, repeat: int = 5) -> Dict[str, Any]:
    """Time ``fn()`` on the host with ``time.perf_counter`` (the NumPy path; torch on the CPU).

    Same keys as :func:`time_cuda`; the event times and the wall times are the same numbers.
    """
    if repeat < 1:
        raise ValueError(f"time_cpu: repeat must be >= 1, got {repeat}")
    for _ in range(max(warmup, 0)):
        out = fn()
        del out
    wall_ms: List[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        del out
        wall_ms.append((t1 - t0) * 1e3)
    return _timing(wall_ms, wall_ms, warmup, repeat)


# ------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------
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
    from cupynce._engine.blas import free_device_bytes as cupy_free_bytes

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


# ------------------------------------------------------------------------------------------
# OOM-tolerant case runner
# ------------------------------------------------------------------------------------------
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


def _short(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


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


# ------------------------------------------------------------------------------------------
# environment
# ------------------------------------------------------------------------------------------
def _version(dist: str) -> Optional[str]:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info() -> Dict[str, Any]:
    """GPU, CUDA and package versions, and the date; never raises (errors are recorded)."""
    info: Dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": _version("numpy"),
        "ml_dtypes": _version("ml_dtypes"),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "memeff": _version("memeff"),
        "inf_cl": _version("inf-cl"),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception as exc:  # noqa: BLE001
        info["cupy"] = None
        info["error"] = _short(exc)
        return info
    try:
        import cupynce  # optional: the harness does not depend on it

        info["cupynce"] = getattr(cupynce, "__version__", None)
        # (the global default of precision=None: how float32 products ran)
        info["cupynce_float32_precision"] = cupynce.get_float32_precision()
    except Exception:  # noqa: BLE001
        info["cupynce"] = None
    try:
        rt = cupy.cuda.runtime
        dev = cupy.cuda.Device()
        props = rt.getDeviceProperties(dev.id)
        name = props.get("name", b"?")
        info.update(
            gpu=name.decode() if isinstance(name, bytes) else str(name),
            device_id=dev.id,
            compute_capability=f"{props.get('major')}.{props.get('minor')}",
            multiprocessors=props.get("multiProcessorCount"),
            memory_bytes=int(props.get("totalGlobalMem", 0)),
            memory_gib=round(int(props.get("totalGlobalMem", 0)) / GiB, 1),
            cuda_runtime=_cuda_version(rt.runtimeGetVersion()),
            cuda_driver=_cuda_version(rt.driverGetVersion()),
            cupy_per_thread_default_stream=os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM"),
        )
        try:
            from cupy_backends.cuda.libs import cublas

            info["cublas"] = cublas.getVersion(dev.cublas_handle)
        except Exception:  # noqa: BLE001
            pass
    except Exception as exc:  # noqa: BLE001 - no device here
        info["gpu"] = None
        info["error"] = _short(exc)
    torch = sys.modules.get("torch")
    if torch is not None:
        # each field on its own: torch >= 2.9 refuses to read allow_tf32 and
        # get_float32_matmul_precision() once the new fp32_precision API set TF32, which must
        # not lose the rest (the TF32 runs are the ones whose record matters)
        def mm_tf32():
            mm = torch.backends.cuda.matmul
            new = getattr(mm, "fp32_precision", None)
            return new == "tf32" if new else bool(mm.allow_tf32)

        for key, read in (("torch_cuda", lambda: torch.version.cuda),
                          ("torch_allow_tf32_matmul", mm_tf32),
                          ("torch_float32_matmul_precision",
                           torch.get_float32_matmul_precision),
                          ("torch_alloc_conf",
                           lambda: os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))):
            try:
                info[key] = read()
            except Exception:  # noqa: BLE001
                pass
    return info


def device_header(info: Dict[str, Any]) -> str:
    """One line naming the device and versions, for the top of a report."""
    gpu = info.get("gpu") or "no GPU"
    mem = f" ({info['memory_gib']} GiB)" if info.get("memory_gib") else ""
    parts = [f"{gpu}{mem}"]
    if info.get("cuda_runtime"):
        parts.append(f"CUDA runtime {info['cuda_runtime']} / driver {info.get('cuda_driver')}")
    for key in ("cupynce", "cupy", "numpy", "torch", "triton"):
        if info.get(key):
            parts.append(f"{key} {info[key]}")
    parts.append(f"python {info.get('python')}")
    parts.append(str(info.get("date")))
    return " · ".join(parts)


# ------------------------------------------------------------------------------------------
# formatting
# ------------------------------------------------------------------------------------------
def fmt_ms(x: Optional[float]) -> str:
    """Milliseconds with about three significant digits ("—" for None)."""
    if x is None:
        return "—"
    if x != x:  # NaN
        return "nan"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def fmt_mib(nbytes: Optional[float]) -> str:
    """Bytes as MiB ("—" for None)."""
    if nbytes is None:
        return "—"
    mib = nbytes / MiB
    return f"{mib:.0f}" if mib >= 10 else f"{mib:.1f}"


def fmt_ratio(x: Optional[float]) -> str:
    """A speedup / ratio as ``1.23×`` ("—" for None)."""
    if x is None or x != x:
        return "—"
    return f"{x:.2f}×" if x < 100 else f"{x:.0f}×"


def _numeric(cell: str) -> bool:
    c = cell.strip().rstrip("×").replace(",", "")
    if c in ("", "—", "-", "nan", "OOM", "skip", "error"):
        return True
    try:
        float(c)
        return True
    except ValueError:
        return False


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                   align: Optional[str] = None) -> str:
    """A GitHub-flavoured markdown table, padded so that it also reads well as plain text.

    ``align``: one character per column, ``l`` / ``r`` / ``c``; by default numeric columns
    (cells that are numbers, ratios like ``1.5×``, or placeholders) are right-aligned.
    """
    cells = [[str(c) for c in row] for row in rows]
    ncol = len(headers)
    for row in cells:
        if len(row) != ncol:
            raise ValueError(f"markdown_table: row has {len(row)} cells, expected {ncol}: {row}")
    if align is None:
        align = "".join("r" if cells and all(_numeric(r[j]) for r in cells) else "l"
                        for j in range(ncol))
    if len(align) != ncol:
        raise ValueError(f"markdown_table: align {align!r} does not match {ncol} columns")
    widths = [max([len(headers[j])] + [len(r[j]) for r in cells] + [3]) for j in range(ncol)]

    def line(vals: Sequence[str]) -> str:
        out = []
        for v, w, a in zip(vals, widths, align):
            out.append(v.rjust(w) if a == "r" else v.center(w) if a == "c" else v.ljust(w))
        return "| " + " | ".join(out) + " |"

    rule = []
    for w, a in zip(widths, align):
        rule.append(("-" * (w - 1) + ":") if a == "r" else
                    (":" + "-" * (w - 2) + ":") if a == "c" else "-" * w)
    return "\n".join([line(headers), "| " + " | ".join(rule) + " |"] + [line(r) for r in cells])


if __name__ == "__main__":  # pragma: no cover - manual check of the environment
    import json

    print(json.dumps(device_info(), indent=2))


# ------------------------------------------------------------------------------------------
# the PyTorch reference users run today
# ------------------------------------------------------------------------------------------
def load_torch(device: str = "cuda", *, quiet: bool = False):
    """torch ready for ``device``, or None (with the reason printed unless ``quiet``).

    ``"cuda"``: torch with CUDA on CuPy's current device, its CUDA state initialised (the
    harness reads its allocator statistics); ``"cpu"``: torch as imported.
    """
    def say(msg: str) -> None:
        if not quiet:
            print(msg, flush=True)

    try:
        import torch
    except ImportError as exc:
        say(f"torch not importable ({exc}); measuring cupynce and cuBLAS only")
        return None
    if device == "cpu":
        return torch
    if not torch.cuda.is_available():
        say("torch has no CUDA; measuring cupynce and cuBLAS only")
        return None
    import cupy as cp

    torch.cuda.set_device(cp.cuda.Device().id)
    torch.zeros(1, device="cuda")  # initialise torch's CUDA state (the harness reads its stats)
    return torch


def torch_reference(torch, op: str, temperature: float = 0.1) -> Callable[..., Any]:
    """The plain PyTorch formula users run today (the seeds' / open_clip's / SPLADE's).

    Arguments of the returned function: ``nt_xent(z)``, ``info_nce(query, key)`` (in-batch
    negatives), ``clip_loss(a, b, logit_scale)`` (logit_scale a 0-d tensor),
    ``siglip_loss(a, b, logit_scale, logit_bias)`` (open_clip's SigLipLoss, 0-d scalars),
    ``splade_pool(x, weight, bias, mask)`` (SPLADE's ``max_l log(1 + relu(x Wᵀ + b)) * mask``,
    the (B, V) output).
    """
    F = torch.nn.functional

    if op == "nt_xent":
        def nt_xent_ref(z):
            n = z.shape[0]
            eye = torch.eye(n, dtype=torch.bool, device=z.device)
            labels = (torch.arange(n, device=z.device) + n // 2) % n
            s = (z @ z.T).masked_fill(eye, float("-inf")) / temperature
            return F.cross_entropy(s, labels)
        return nt_xent_ref

    if op == "info_nce":
        def info_nce_ref(q, k):
            labels = torch.arange(q.shape[0], device=q.device)
            return F.cross_entropy(q @ k.T / temperature, labels)
        return info_nce_ref

    if op == "splade_pool":
        def splade_ref(x, weight, bias, mask):
            logits = x @ weight.T
            if bias is not None:
                logits = logits + bias
            act = torch.log1p(torch.relu(logits)) * mask.unsqueeze(-1).to(logits.dtype)
            return torch.max(act, dim=1).values
        return splade_ref

    if op == "siglip_loss":  # open_clip's SigLipLoss on one GPU
        def siglip_ref(a, b, logit_scale, logit_bias):
            logits = logit_scale.exp() * a @ b.T + logit_bias
            labels = 2 * torch.eye(a.shape[0], device=a.device, dtype=logits.dtype) - 1
            return -F.logsigmoid(labels * logits).sum() / a.shape[0]
        return siglip_ref

    if op != "clip_loss":
        raise ValueError(f"torch_reference: unknown op {op!r}")

    def clip_ref(a, b, logit_scale):
        labels = torch.arange(a.shape[0], device=a.device)
        logits = logit_scale.exp() * a @ b.T
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    return clip_ref


def to_torch(torch, x):
    """A torch view of a CuPy (or NumPy) array, bit for bit (bfloat16 through an int16 view)."""
    from cupynce._engine.kernels import BFLOAT16

    if type(x).__module__.startswith("numpy"):
        import numpy as np

        x = np.asarray(x, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        if BFLOAT16 is not None and x.dtype == BFLOAT16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)
    if BFLOAT16 is not None and x.dtype == BFLOAT16:
        import cupy as cp

        return torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


def torch_step(torch, fn: Callable[..., Any], leaves: Sequence[Any], *, extra: Sequence[Any] = (),
               grad_output: Any = None) -> Callable[[], Any]:
    """A step computing ``out = fn(*leaves, *extra)`` and the gradients of ``leaves``.

    ``grad_output`` (a tensor like ``out``) for a non-scalar ``out``; returns ``(out, grads)``.
    """
    def step():
        loss = fn(*leaves, *extra)
        grads = torch.autograd.grad(loss, leaves, grad_outputs=grad_output)
        return loss, grads
    return step


# ------------------------------------------------------------------------------------------
# progress
# ------------------------------------------------------------------------------------------
class Progress:
    """The report's progress on stderr, drawn by tqdm (the ``report`` extra).

    On a terminal: tqdm's bar, redrawn in place, with what runs now.  Otherwise (a log file,
    CI): one line per finished step, ``tqdm.format_meter``'s bar and counts followed by the
    step's label, so that the log shows where a long run is.  Without tqdm: the same log lines
    with the counts alone.
    """

    def __init__(self, total: int, *, stream: Any = None, enabled: bool = True) -> None:
        self.total = max(int(total), 0)
        self.done = 0
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.t0 = time.perf_counter()
        try:
            tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            tty = False
        try:
            import tqdm
        except ImportError:  # the light install: no bar
            tqdm = None
        self._tqdm = tqdm
        self._live = enabled and tty and tqdm is not None  # a bar redrawn in place
        self._bar = None

    def _ensure_bar(self):
        """The terminal bar (a new one, from the current count, after :meth:`close`)."""
        if self._bar is None:
            self._bar = self._tqdm.tqdm(total=self.total or None, initial=self.done,
                                        file=self.stream, leave=True, dynamic_ncols=True)
        return self._bar

    def _line(self, label: str) -> str:
        if self._tqdm is None:
            return f"{self.done}/{self.total}  {label}"
        meter = self._tqdm.tqdm.format_meter(self.done, self.total or None,
                                             time.perf_counter() - self.t0, ncols=60)
        return f"{meter}  {label}"

    def update(self, label: str = "", advance: int = 1) -> None:
        """Count ``advance`` steps done and show ``label`` (what runs next or just ran)."""
        self.done = min(self.done + advance, self.total) if self.total else self.done + advance
        if not self.enabled:
            return
        if self._live:
            bar = self._ensure_bar()
            bar.set_description_str(label, refresh=False)
            bar.update(advance)
        else:  # a log: one line per finished step, not per start
            self.stream.write(self._line(label) + "\n")
            self.stream.flush()

    def show(self, label: str = "") -> None:
        """Show what runs now (on a terminal; nothing in a log)."""
        if self._live:
            self._ensure_bar().set_description_str(label)

    def close(self) -> None:
        """End the terminal bar's line (a later step starts a new bar)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
