"""The argument checks of a repeated GPU forward, remembered: what passed once passes again.

A forward checks its arrays (types, ranks, shapes, dtypes, devices) and its scalar values
(temperature, logit scale and bias), then lays its inputs out, before its first kernel: on
the H100 hosts 10-40 µs of Python a call with a cold cache, while the GPU waits -- ~5-10 %
of a CLIP / SigLIP / NT-Xent call at N = 8192 whose kernels replay from a CUDA graph.  Those
checks depend on nothing but the arguments' :func:`signature` (each CuPy array's shape,
dtype, strides and device; each scalar's value), so the GPU forwards (``nt_xent``,
``info_nce``, ``clip_loss``, ``siglip_loss``) remember the signatures whose checks passed
with every input already laid out (no copy made), and skip both for a call with a signature
seen before.  The cheap checks of the flags (reduction, workspace, normalize,
requires_grad, precision) run on every call.

Only what the signature pins down is remembered: arrays that are exactly ``cupy.ndarray``
(no NumPy array: the checks read host arrays' values, which may change), scalars that are
exactly Python floats (no bool, int or NumPy scalar), None.  Any other argument gives no
signature, and the call is checked in full, as is every call that fails a check (a failure
is never remembered).  ``MAX_KNOWN`` signatures are kept, then all forgotten and learnt
again.  ``clear()`` forgets them.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from .._checks import cupy_module  # (the ``cupy`` module or None, looked up once)

#: signatures remembered (then all dropped: bounded, like the graph cache)
MAX_KNOWN = 1024
_known: Dict[tuple, bool] = {}


def signature(op: str, *args: Any) -> Optional[tuple]:
    """``(op, per argument: (shape, dtype, strides, device) of a cupy.ndarray | a float's
    value | None)``, or None where an argument is anything else."""
    cp = cupy_module()
    if cp is None:
        return None
    sig = [op]
    for x in args:
        t = type(x)
        if t is cp.ndarray:
            sig.append((x.shape, x.dtype, x.strides, x.data.device_id))
        elif t is float or x is None:
            sig.append(x)
        else:
            return None
    return tuple(sig)


def known(sig: Optional[tuple]) -> bool:
    """Whether a call with this signature passed its checks before, its inputs laid out."""
    return sig is not None and sig in _known


def remember(sig: Optional[tuple]) -> None:
    """Remember a signature whose call passed its checks, no input copied (None: nothing)."""
    if sig is None:
        return
    if len(_known) >= MAX_KNOWN:
        _known.clear()
    _known[sig] = True


def clear() -> None:
    _known.clear()
