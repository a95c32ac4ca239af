"""Plumbing between torch tensors and the cupynce core (NumPy / CuPy arrays); no autograd here.

* :func:`check_tensors` — the torch-side argument checks the functional API cannot make:
  every input a ``torch.Tensor``, all on one device (CPU or one GPU).
* :func:`device_scope` — the context every core call of a torch op runs in.  For CUDA
  tensors: the tensor's device (``cupy.cuda.Device``), torch's *current* stream on that device
  (so the kernels are ordered with the caller's torch work, no synchronisation), and a CuPy
  allocator that takes its memory from torch's caching allocator (so outputs and workspaces
  show up in ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` and CuPy's pool never
  holds memory torch could use).  For CPU tensors: the core's CPU primitives on torch's
  functions (``cupynce.ops._cpu``, ``_cpu.TORCH``), unless the config's ``cpu_torch`` is off.
* :func:`array_of` / :func:`tensor_of` — zero-copy views both ways: ``Tensor.numpy`` /
  ``torch.from_numpy`` on the CPU, DLPack on CUDA.  bfloat16 crosses as an int16 view
  (neither NumPy nor every CuPy release speaks DLPack's bfloat16), then is viewed back as
  ``ml_dtypes.bfloat16`` / ``torch.bfloat16``: same bits, no copy.  On CUDA the capsules are
  made with ``__dlpack__(stream=-1)`` ("no synchronisation": the DLPack spec's value for a
  consumer that orders the work itself): inside :func:`device_scope` producer and consumer
  are the same stream, so the event record / wait of the stream-passing protocol would be
  pure overhead (it costs 4-15 µs per tensor, the capsule 1-2 µs).

Importing this module imports torch (it is only imported by :mod:`cupynce.torch`); CuPy is
imported on the first CUDA call.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import numpy as np
import torch

from .. import _checks, config
from .._engine.kernels import BFLOAT16
from ..ops import _cpu as _cpu_path
from ._cpu import TORCH


def check_tensors(op: str, optional: tuple = (), **tensors: Any) -> torch.device:
    """The one device of ``tensors`` (None allowed only for names in ``optional``).

    ``TypeError`` for a non-tensor (NumPy / CuPy arrays belong to ``cupynce.<op>``);
    ``ValueError`` for tensors on different devices (CPU and CUDA, or two GPUs) and for
    devices other than CPU and CUDA.  Only metadata is read (no synchronisation).
    """
    devices = {}
    for name, t in tensors.items():
        if t is None:
            if name in optional:
                continue
            raise TypeError(f"{op}: {name} is required (a torch.Tensor), got None")
        if not isinstance(t, torch.Tensor):
            kind = f"{type(t).__module__}.{type(t).__name__}"
            hint = (f" (for NumPy / CuPy arrays use cupynce.{op})"
                    if kind.startswith(("numpy.", "cupy.")) else "")
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {kind}{hint}")
        devices[name] = t.device
    if len(set(devices.values())) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {desc}; move them "
                         f"explicitly (tensor.to(device))")
    device = next(iter(devices.values()))
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: tensors must be on the CPU or a CUDA GPU, got {device}")
    return device


# ------------------------------------------------------------------------------------------
# tensors <-> arrays (zero copy)
# ------------------------------------------------------------------------------------------
def array_of(t: Optional[torch.Tensor]) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) view of ``t``'s memory, or None.

    CUDA: call inside :func:`device_scope` (CuPy's current stream is then torch's, so the
    array may be used at once).
    """
    if t is None:
        return None
    t = t.detach()  # DLPack / .numpy() refuse tensors that require grad; a view, no copy
    bf16 = t.dtype == torch.bfloat16
    if bf16:
        t = t.view(torch.int16)
    if t.device.type == "cpu":
        x = t.numpy()
    else:
        import cupy

        x = cupy.from_dlpack(t.__dlpack__(stream=-1))
    return x.view(BFLOAT16) if bf16 else x


def scalar_of(t: Optional[torch.Tensor], value: float) -> Any:
    """A scalar argument as the core takes it: the Python float ``value`` where no tensor is
    given (it never becomes a device tensor), else :func:`array_of` the tensor."""
    return value if t is None else array_of(t)


def tensor_of(x: Any) -> Optional[torch.Tensor]:
    """A torch view of a NumPy / CuPy array (or None); bfloat16 through an int16 view.

    CUDA: call inside :func:`device_scope`, before leaving it (same stream, see above).
    """
    if x is None:
        return None
    cpu = isinstance(x, (np.ndarray, np.generic))
    if cpu:
        x = np.asarray(x)
    bf16 = x.dtype == BFLOAT16
    if bf16:
        x = x.view(np.int16)
    t = torch.from_numpy(x) if cpu else torch.from_dlpack(x.__dlpack__(stream=-1))
    return t.view(torch.bfloat16) if bf16 else t


# ------------------------------------------------------------------------------------------
# device, stream and allocator for CUDA calls
# ------------------------------------------------------------------------------------------
def _torch_allocator(device: torch.device):
    """A CuPy allocator (``size -> MemoryPointer``) drawing from torch's caching allocator.

    Each allocation is a ``torch.empty`` byte buffer on ``device`` and torch's current
    stream; the CuPy pointer owns the buffer, so the memory goes back to torch's cache
    (stream-ordered, like any torch tensor) when CuPy drops the last reference.
    """
    import cupy

    dev_id = device.index

    def alloc(size: int) -> "cupy.cuda.MemoryPointer":
        if size == 0:
            return cupy.cuda.MemoryPointer(cupy.cuda.memory.Memory(0), 0)
        buf = torch.empty((size,), dtype=torch.uint8, device=device)
        mem = cupy.cuda.UnownedMemory(buf.data_ptr(), size, buf, dev_id)
        return cupy.cuda.MemoryPointer(mem, 0)

    return alloc


def _cupy_stream(torch_stream: "torch.cuda.Stream", dev_id: int):
    """CuPy's view of a torch stream (``Stream.from_external`` on CuPy >= 14)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(torch_stream)
    return cupy.cuda.ExternalStream(torch_stream.cuda_stream, dev_id)


#: (device index, raw stream pointer) -> (CuPy stream wrapper, allocator): built once, as a
#: small call's host time is counted in microseconds (bounded: streams are few)
_SCOPES: dict = {}
_get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _scope(index: int):
    """CuPy's view of torch's current stream on device ``index`` and the torch allocator."""
    if _get_raw_stream is not None:
        ptr = _get_raw_stream(index)
        entry = _SCOPES.get((index, ptr))
        if entry is not None:
            return entry
    stream = torch.cuda.current_stream(index)
    entry = (_cupy_stream(stream, index), _torch_allocator(torch.device("cuda", index)))
    if _get_raw_stream is not None and len(_SCOPES) < 256:
        _SCOPES[(index, stream.cuda_stream)] = entry
    return entry


@contextlib.contextmanager
def device_scope(device: torch.device) -> Iterator[None]:
    """Run the enclosed CuPy work on ``device``, torch's current stream and torch's memory.

    For CPU tensors: the CPU path's primitives on torch's functions (``ops._cpu``; the config
    switch ``cpu_torch``).  Nothing here synchronises: the stream is only wrapped, and the
    allocator hands out torch memory on that same stream.
    """
    if device.type != "cuda":
        if not config.current().cpu_torch:
            yield
            return
        with _cpu_path.using(TORCH):
            yield
        return
    # (the first CuPy import of a CUDA call: without CuPy, say which extra installs it)
    cupy = _checks.require_module("cupy", f"cupynce.torch on {device} tensors")

    index = device.index
    if index is None:  # "cuda" without an index: torch's current device
        index = torch.cuda.current_device()
    stream, alloc = _scope(index)
    with cupy.cuda.Device(index), stream, cupy.cuda.using_allocator(alloc):
        yield
