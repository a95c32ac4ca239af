"""The CPU path's namespace on torch (``cupynce.ops._cpu``): the functions the NumPy path's
primitives call, on CPU tensors, so that a ``cupynce.torch`` call on CPU tensors runs on
torch's kernels and torch's one thread pool (``_bridge.device_scope`` opens it; the config
switch ``cpu_torch`` turns it off).

The inputs come in as zero-copy views of the core's NumPy arrays (``torch.from_numpy``) and the
results go back out as zero-copy NumPy views (``Tensor.numpy``); bfloat16 crosses as an int16
view, as in ``_bridge`` (which imports this module).
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .._engine.kernels import BFLOAT16

_DTYPES = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
           np.dtype(np.float64): torch.float64, np.dtype(np.int16): torch.int16,
           np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
           np.dtype(np.bool_): torch.bool}
if BFLOAT16 is not None:
    _DTYPES[BFLOAT16] = torch.bfloat16


def _dtype(dtype) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else _DTYPES[np.dtype(dtype)]


class Torch:
    """The CPU path's namespace on torch (the methods of ``cupynce.ops._cpu.Numpy``)."""

    name = "torch"

    def __getattr__(self, name: str) -> Any:  # (the names NumPy and torch share)
        return getattr(torch, name)

    @staticmethod
    def asarray(x):
        x = np.asarray(x)
        if x.dtype == BFLOAT16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)

    @staticmethod
    def host(x):
        if x is None:
            return None
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(BFLOAT16)
        return x.numpy()

    @staticmethod
    def astype(x, dtype):
        return x.to(_dtype(dtype))

    @staticmethod
    def copy(x):
        return x.clone()

    @staticmethod
    def empty(shape, dtype):
        return torch.empty(shape, dtype=_dtype(dtype))

    @staticmethod
    def zeros(shape, dtype):
        return torch.zeros(shape, dtype=_dtype(dtype))

    @staticmethod
    def full(shape, value, dtype):
        return torch.full(shape, value, dtype=_dtype(dtype))

    @staticmethod
    def errstate(**_kwargs):  # (torch's kernels do not warn)
        return contextlib.nullcontext()

    @staticmethod
    def sigmoid(x, out=None):
        return torch.sigmoid(x, out=out)

    @staticmethod
    def softplus(x):
        # (threshold: x itself above it, as exact as log1p(exp(x)) in float32 / float64 there)
        return F.softplus(x, threshold=40.0 if x.dtype == torch.float64 else 20.0)

    @staticmethod
    def take_along_axis(x, idx, axis: int):
        return torch.take_along_dim(x, idx, dim=axis)

    @staticmethod
    def put_along_axis(x, idx, values, axis: int) -> None:
        x.scatter_(axis, idx, values.expand(idx.shape) if torch.is_tensor(values)
                   else torch.full(idx.shape, values, dtype=x.dtype))

    @staticmethod
    def add_at(x, index, values) -> None:
        if not torch.is_tensor(values):
            values = torch.tensor(values, dtype=x.dtype)
        x.index_put_(index, values, accumulate=True)


#: the torch namespace
TORCH = Torch()
