"""The array functions the CPU path runs on: NumPy's, or torch's inside ``cupynce.torch``'s
calls on CPU tensors.

The CPU path's heavy work (the score blocks of ``_numpy.rows``, CLIP's and SigLIP's logits,
SPLADE's vocabulary chunks) is written once, against the namespace :func:`current` returns.
Its functions take and return that library's arrays; :meth:`Numpy.asarray` brings a NumPy
input in and :meth:`Numpy.host` takes a result back out as a NumPy array (zero copy both
ways on torch), so everything above the primitives sees NumPy arrays as before.

The names the CPU path uses mean the same in NumPy and in torch (``exp``, ``log``, ``log1p``,
``reciprocal``, ``nan_to_num``, ``where``, ``isfinite``, ``isnan``, ``amax`` / ``sum`` /
``argmax`` with ``axis=`` and ``keepdims=``, ``matmul`` with ``out=``, ``einsum``,
``concatenate``, ``broadcast_to``, ``arange``), or are defined by each namespace (the methods
of :class:`Numpy`): the casts, copies and constructors (dtypes are NumPy dtypes in the shared
code), ``errstate``, ``sigmoid``, ``softplus``, and the gather / scatter helpers.  A namespace
for another library implements the same methods.

Why torch's functions for torch's tensors (measured on a 2-core machine, torch 2.13, 2
threads, docs/design.md "The CPU path"): NumPy's ufuncs run on one thread and without SIMD
``exp`` / ``log1p``, 3-7x slower than torch's on an N x N block; and NumPy's BLAS keeps its own
thread pool, whose workers still spin after a product when torch's threads start the next op
of the training step, so every hand-over cost a few ms (a fixed ~5 ms at N = 256).  On
torch's functions a step runs on one thread pool, torch's.

:func:`using` is the scope ``cupynce.torch`` opens around its CPU calls (this thread only);
NumPy callers always get :data:`NUMPY`.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np


class Numpy:
    """The CPU path's namespace on NumPy (the default, and NumPy callers' only one)."""

    name = "numpy"

    def __getattr__(self, name: str) -> Any:  # (the names NumPy and torch share)
        return getattr(np, name)

    @staticmethod
    def asarray(x):
        """An input array (NumPy) in this namespace."""
        return x

    @staticmethod
    def host(x):
        """A result of this namespace as a NumPy array (None stays None)."""
        return x

    @staticmethod
    def astype(x, dtype):
        """``x`` in ``dtype`` (a NumPy dtype); ``x`` itself when it already is."""
        return x.astype(dtype, copy=False)

    @staticmethod
    def copy(x):
        """A new array holding ``x``'s values."""
        return x.copy()

    @staticmethod
    def empty(shape, dtype):
        return np.empty(shape, dtype)

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype)

    @staticmethod
    def full(shape, value, dtype):
        return np.full(shape, value, dtype)

    errstate = staticmethod(np.errstate)

    @staticmethod
    def sigmoid(x, out=None):
        """``1 / (1 + exp(-x))`` elementwise (0 / 1 at the ends, NaN for NaN)."""
        with np.errstate(over="ignore"):
            t = np.negative(x, out=out)
            np.exp(t, out=t)
        t += 1
        return np.reciprocal(t, out=t)

    @staticmethod
    def softplus(x):
        """``log(1 + exp(x))`` elementwise, finite for every finite x (a new array)."""
        with np.errstate(invalid="ignore"):  # (NaN in, NaN out)
            return np.logaddexp(x, x.dtype.type(0))

    @staticmethod
    def take_along_axis(x, idx, axis: int):
        return np.take_along_axis(x, idx, axis=axis)

    @staticmethod
    def put_along_axis(x, idx, values, axis: int) -> None:
        np.put_along_axis(x, idx, values, axis=axis)

    @staticmethod
    def add_at(x, index, values) -> None:
        """``x[index] += values`` with repeated indices accumulated in order."""
        np.add.at(x, index, values)


#: the NumPy namespace
NUMPY = Numpy()


class _Local(threading.local):
    xp: Any = NUMPY


_local = _Local()


def current():
    """The namespace of this thread's CPU work: :data:`NUMPY` outside a :func:`using` scope."""
    return _local.xp


class using:
    """``with using(xp):`` -- this thread's CPU primitives on namespace ``xp``; the previous
    one comes back on exit."""

    __slots__ = ("xp", "prev")

    def __init__(self, xp):
        self.xp, self.prev = xp, None

    def __enter__(self):
        self.prev = _local.xp
        _local.xp = self.xp
        return self.xp

    def __exit__(self, *exc) -> bool:
        _local.xp = self.prev
        return False
