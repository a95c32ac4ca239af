"""The machine a measurement ran on: GPU, CUDA, the packages' versions, the CPU and the date
(:func:`device_info`), and the one line that heads a report (:func:`device_header`).

Nothing here raises for a missing GPU or package: what cannot be read is recorded as None, or
under ``"error"``.  CuPy is imported lazily; torch is read only if the caller imported it.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import os
import platform
import sys
from typing import Any, Dict, Optional

from cupynce.report.formatting import GiB, _short

__all__ = ["device_info", "device_header"]


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
