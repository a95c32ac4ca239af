"""Timing: CUDA-event spans and host wall times, their medians and quantiles, the SM clock.

CuPy is imported lazily (importing this module needs no GPU); NVML is optional.

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

Host (:func:`time_cpu`)
    ``time.perf_counter`` around each call (the NumPy path; torch on the CPU), with the same
    keys as :func:`time_cuda`.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["time_cuda", "time_cpu", "throttle_names"]


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
    """The one device synchronisation of the harness (also memory.py's and the runner's)."""
    import cupy

    cupy.cuda.Device().synchronize()  # cudaDeviceSynchronize: every stream, torch's included


def time_cuda(fn: Callable[[], Any], *, warmup: int = 3, repeat: int = 10,
              burst: int = 1) -> Dict[str, Any]:
    """Time ``fn()`` with CUDA events; see the module notes for what the span covers.

    Returns ``median_ms, p20_ms, p80_ms, min_ms`` (event times), ``wall_median_ms,
    wall_min_ms`` (host time between device synchronisations), ``issue_median_ms`` (the host's
    time to issue the calls, until ``fn`` returns: where it reaches the event time, the host
    and not the GPU sets the pace), ``times_ms`` (every repeat),
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
    issue_ms: List[float] = []
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
        issue_ms.append((time.perf_counter() - t0) * 1e3 / burst)
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
    res["issue_median_ms"] = _percentile(sorted(issue_ms), 50)
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
