"""SPLADE's sparse max-pool head and its FLOPS regularizer.

``out[b, v] = act(max_{l : mask[b, l]} (x[b, l, :] · W[v, :] + bias[v]))`` with
``act = relu`` or ``log1p∘relu``, computed without ever holding the (B, L, V) logits; each
logit is rounded to the inputs' dtype after the bias, as ``F.linear(x, W, bias)`` gives it.

Entry points (as for the InfoNCE ops):

* :func:`splade_pool` — the output only;
* :func:`splade_pool_forward` → ``(out, ctx)``; :func:`splade_pool_backward` →
  ``(dx, dweight, dbias)``; :func:`splade_pool_backward_from_stats` rebuilds the same gradients
  from ``x``, ``weight``, ``out`` and the arg-max (``ctx.stats[0]``) alone;
* :func:`flops_regularizer` / :func:`flops_regularizer_backward` — SPLADE's FLOPS term.

How it is computed on the GPU (the fused max on the tensor-core tiles, or cuBLAS tiles and a max
kernel; the sparse, deterministic backward) is described in ``cupynce._engine.splade``.  The
NumPy path below runs the same algorithm, vectorised in vocabulary chunks.

Reference: Formal et al., "SPLADE: Sparse Lexical and Expansion Model for First Stage
Ranking", SIGIR 2021.
"""
from __future__ import annotations

import numbers
from typing import Any, Optional, Tuple

import numpy as np

from .. import _checks
from .. import config
from .._engine import splade as _gpu
from .._engine.kernels import SUPPORTED_DTYPES, acc_dtype
from .._engine.splade import DEFAULT_WORKSPACE_BYTES, index_dtype
from . import _cpu
from ._base import Context, require

__all__ = [
    "splade_pool", "splade_pool_forward", "splade_pool_backward",
    "splade_pool_backward_from_stats", "flops_regularizer", "flops_regularizer_backward",
    "ACTIVATIONS", "DEFAULT_WORKSPACE_BYTES", "NUMPY_WORKSPACE_BYTES",
]

#: Workspace of the NumPy path when the caller gives none (bytes).
NUMPY_WORKSPACE_BYTES = 64 << 20
ACTIVATIONS = ("relu", "log1p_relu")


def _act_code(activation: str) -> int:
    return ACTIVATIONS.index(activation)


# ----------------------------------------------------------------------------------------
# validation (shapes, dtypes, devices; never values of device arrays)
# ----------------------------------------------------------------------------------------
def _check(x, weight, bias, mask, activation, workspace_bytes, op="splade_pool"):
    xp = _checks.array_module(op, optional=("bias", "mask"), x=x, weight=weight, bias=bias,
                              mask=mask)
    for name, arr, nd, want in (("x", x, 3, "(B, L, D)"), ("weight", weight, 2, "(V, D)"),
                                ("bias", bias, 1, "(V,)"), ("mask", mask, 2, "(B, L)")):
        if arr is not None and arr.ndim != nd:
            raise ValueError(f"{op}: {name} must be {nd}-D {want}, got shape {tuple(arr.shape)}")
    for name, arr in (("x", x), ("weight", weight), ("bias", bias)):
        if arr is not None:
            _checks.check_float(op, name, arr)
    _checks.check_same_dtype(op, x=x, weight=weight, bias=bias)
    b, l, d = x.shape
    v = weight.shape[0]
    for name, size in (("B", b), ("L", l), ("D", d)):
        if size < 1:
            raise ValueError(f"{op}: x must have {name} >= 1, got shape {tuple(x.shape)}")
    if v < 1:
        raise ValueError(f"{op}: weight must have V >= 1 rows, got shape {tuple(weight.shape)}")
    if weight.shape[1] != d:
        raise ValueError(f"{op}: D must match: x has D={d} (shape {tuple(x.shape)}), weight has "
                         f"D={weight.shape[1]} (shape {tuple(weight.shape)}); weight is (V, D), "
                         f"pass a (D, V) matrix as its transpose .T")
    if bias is not None and bias.shape != (v,):
        raise ValueError(f"{op}: bias must have shape ({v},) (V of weight), "
                         f"got {tuple(bias.shape)}")
    if mask is not None:
        if mask.shape != (b, l):
            raise ValueError(f"{op}: mask must have shape ({b}, {l}) (B, L of x), "
                             f"got {tuple(mask.shape)}")
        if mask.dtype.kind not in "biuf" and mask.dtype not in SUPPORTED_DTYPES:  # + bfloat16
            raise TypeError(f"{op}: mask must be bool or a real 0/1 array, got dtype {mask.dtype}")
        _checks.check_mask(op, "mask", mask, xp)  # (values on the host only: no GPU sync)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    workspace_bytes = _checks.check_workspace(op, workspace_bytes)
    itemsize = acc_dtype(x.dtype).itemsize  # the workspace holds the unrounded products
    if workspace_bytes is not None and workspace_bytes < l * itemsize:
        raise ValueError(f"{op}: workspace_bytes={workspace_bytes} is smaller than one column of "
                         f"logits over the sequence (L * {itemsize} bytes, the products kept "
                         f"in {acc_dtype(x.dtype).name} = {l * itemsize} bytes); give at least "
                         f"that")
    if xp is not np and b > _gpu.MAX_GRID_Y:
        raise ValueError(f"{op}: x has B={b} rows; the GPU path takes at most "
                         f"{_gpu.MAX_GRID_Y} per call (split the batch)")
    return xp, workspace_bytes


def _check_grad_out(op, xp, grad_out, shape, x):
    ok = isinstance(grad_out, np.ndarray) if xp is np else _checks.is_cupy_array(grad_out)
    if not ok or tuple(grad_out.shape) != shape:
        got = tuple(grad_out.shape) if hasattr(grad_out, "shape") else type(grad_out).__name__
        raise ValueError(f"{op}: grad_out must be a {xp.__name__} array of shape {shape} "
                         f"(the shape of out), got {got}")
    _checks.check_float(op, "grad_out", grad_out)
    if xp is not np and grad_out.device.id != x.device.id:
        raise ValueError(f"{op}: grad_out is on cuda:{grad_out.device.id} but the inputs are on "
                         f"cuda:{x.device.id}")


# ----------------------------------------------------------------------------------------
# NumPy path (the same algorithm, vectorised, in vocabulary chunks)
# ----------------------------------------------------------------------------------------
def _np_act(xp, m, act):
    r = xp.where(m > 0, m, 0)
    r = xp.where(xp.isnan(m), m, r)
    return xp.log1p(r) if act == 1 else r


def _np_gprime(xp, out, g, act):
    out = xp.astype(out, g.dtype)
    gp = xp.where(out > 0, g * xp.exp(-out) if act == 1 else g, 0)
    return xp.where(xp.isnan(out), out, gp)


def _np_step(per_column: int, workspace_bytes) -> int:
    """Vocabulary columns per chunk of the NumPy path."""
    cap = NUMPY_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    return max(1, cap // max(per_column, 1))


def _np_forward(x, weight, bias, mask, act, workspace_bytes):
    """The forward on the CPU, in vocabulary chunks, on the namespace of ``_cpu.current()``."""
    xp = _cpu.current()
    b, l, d = x.shape
    v = weight.shape[0]
    dt = x.dtype
    a = acc_dtype(dt)
    half = dt.itemsize == 2
    xa = xp.astype(xp.asarray(x), a).reshape(b * l, d)
    wt = xp.asarray(weight)
    keep = None if mask is None else (np.asarray(mask) != 0)
    drop = None if keep is None or keep.all() else xp.asarray(~keep)  # masked positions
    idt = index_dtype(l)
    out = xp.empty((b, v), dt)
    arg = xp.empty((b, v), idt)
    step = _np_step(2 * b * l * a.itemsize, workspace_bytes)  # the logits (and a rounded copy)
    empty = None if keep is None else xp.asarray(~keep.any(axis=1)[:, None])  # all-masked: 0
    for v0 in range(0, v, step):
        v1 = min(v, v0 + step)
        # (vc, B, L): the max over the sequence reduces the contiguous last axis
        logits = xp.astype(wt[v0:v1], a) @ xa.T
        if bias is not None:  # before the rounding and the max, as F.linear and the GPU paths
            logits += xp.astype(xp.asarray(bias[v0:v1]), a)[:, None]
        if half:  # rounded to the input dtype, then the max (ties judged on these values)
            logits = xp.astype(xp.astype(logits, dt), a)
        logits = logits.reshape(v1 - v0, b, l)
        if drop is not None:
            logits[:, drop] = -float("inf")  # (in place: the chunk's own buffer)
        idx = xp.argmax(logits, axis=2)  # first occurrence: ties go to the lowest l; NaN wins
        m = xp.take_along_axis(logits, idx[:, :, None], axis=2)[:, :, 0].T
        idx = idx.T
        val = _np_act(xp, m, act)
        if empty is not None:
            val, idx = xp.where(empty, 0, val), xp.where(empty, 0, idx)
        out[:, v0:v1] = xp.astype(val, dt)
        arg[:, v0:v1] = xp.astype(idx, idt)
    return xp.host(out), xp.host(arg)


def _np_backward(x, weight, out, arg, g, has_bias, act, workspace_bytes=None):
    """The sparse backward on the CPU, in vocabulary chunks, on the namespace of
    ``_cpu.current()``.

    Finite x and W (the usual case): each chunk's g' goes into a one-hot (B, L, vc) block
    G[b, l*(b, v), v] = g'[b, v], and two BLAS products give dx += G W_chunk and
    dW_chunk = Gᵀ x, as PyTorch's CPU autograd of the formula does (an order of magnitude
    faster than scattering).  Where x or the chunk's W holds inf / NaN, a zero of G would
    multiply it into the result, so such chunks take the exact sparse form, which touches only
    the active entries.  Deterministic either way (fixed-order products, no atomics).
    """
    xp = _cpu.current()
    b, l, d = x.shape
    v = weight.shape[0]
    dt = x.dtype
    a = acc_dtype(dt)
    xa = xp.astype(xp.asarray(x), a)
    wt = xp.asarray(weight)
    x_finite = bool(xp.isfinite(xa).all())
    # grad_out in out's dtype, as on the GPU
    gp = _np_gprime(xp, xp.asarray(out), xp.astype(xp.astype(xp.asarray(g), dt), a), act)
    arg = xp.astype(xp.asarray(arg), np.int64)
    dxa = xp.zeros((b, l, d), a)
    dw = xp.empty((v, d), dt)
    bi = xp.arange(b)[:, None]
    step = _np_step(max(b * l, 2 * b * d) * a.itemsize, workspace_bytes)
    x2, dx2 = xa.reshape(b * l, d), dxa.reshape(b * l, d)
    onehot = None  # the (B, L, vc) block, zeroed once and cleared entry by entry after use
    for v0 in range(0, v, step):
        v1 = min(v, v0 + step)
        idx = arg[:, v0:v1]
        w = gp[:, v0:v1]
        wc = xp.astype(wt[v0:v1], a)
        if x_finite and bool(xp.isfinite(wc).all()):
            if onehot is None:
                onehot = xp.zeros((b, l, min(step, v)), a)
            blk = onehot[:, :, :v1 - v0]
            xp.put_along_axis(blk, idx[:, None, :], w[:, None, :], axis=1)
            flat = blk.reshape(b * l, v1 - v0)  # (a copy where the last chunk is narrower)
            dx2 += flat @ wc  # one (B L x vc) (vc x D) product
            dw[v0:v1] = xp.astype(flat.T @ x2, dt)
            xp.put_along_axis(blk, idx[:, None, :], 0.0, axis=1)
            continue
        on = (w != 0)[..., None]  # inactive entries contribute exactly nothing (not 0 * inf)
        rows = xp.where(on, xa[bi, idx], 0)  # (B, vc, D): the winning x row of every (b, v)
        dw[v0:v1] = xp.astype(xp.einsum("bv,bvd->vd", w, rows), dt)
        contrib = xp.where(on, w[..., None] * wc[None], 0)
        xp.add_at(dxa, (xp.broadcast_to(bi, idx.shape), idx), contrib)  # in order: deterministic
    dbias = xp.astype(xp.sum(gp, axis=0), dt) if has_bias else None
    return xp.host(xp.astype(dxa, dt)), xp.host(dw), xp.host(dbias)


# ----------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------
def splade_pool_forward(x, weight, bias=None, mask=None, *, activation: str = "log1p_relu",
                        workspace_bytes: Optional[int] = None,
                        requires_grad: bool = True,
                        precision: Optional[str] = None) -> Tuple[Any, Context]:
    """SPLADE's max-pooled vocabulary representation and a context for the backward.

    Parameters
    ----------
    x : (B, L, D) array (numpy or cupy), float16 / bfloat16 / float32 / float64
        Hidden states.
    weight : (V, D) array, x's dtype
        The vocabulary projection in ``nn.Linear`` / Hugging Face decoder layout.  A (D, V)
        matrix ``w`` is passed as ``w.T`` (a view; it is read in place, never copied).
    bias : (V,) array or None
    mask : (B, L) bool or 0/1 array, or None (every position counts)
        A NumPy mask holding another value (2, -1, 0.5, NaN) raises ``ValueError``.  A CuPy
        mask is not scanned (that would synchronise with the GPU): there any nonzero value
        counts as 1.
    activation : "relu" | "log1p_relu"
    workspace_bytes : int, optional
        Cap on the logit workspace of the cuBLAS-tile forward, default 64 MiB: the logits of
        (batches × vocabulary) tiles are computed one tile at a time; (B, L, V) never exists.
        The workspace holds the unrounded products in the accumulator type (4 bytes a logit
        for 16-bit inputs), so it must hold at least L of them.
        The fused forward (16-bit inputs where the tensor-core tiles run, see the module
        docstring) holds no logits and ignores it.
    requires_grad : bool
        Keep what :func:`splade_pool_backward` needs (x, weight, out, the arg-max).
    precision : "auto" | "fp32" | "tf32" | "3xtf32", optional
        How the float32 logit products run on the GPU (the cuBLAS-tile forward; see
        :func:`cupynce.set_float32_precision`); None: the global default.  In TF32 a logit
        near a tie may pick another position l*.  Ignored (validated) for other dtypes and on
        the NumPy path; the backward runs no products (sparse kernels).

    Returns
    -------
    out : (B, V) array, x's dtype
        ``act(max_{l: mask[b,l]} round(x[b,l]·W[v] + bias[v]))``; 0 for a row whose mask is
        all zero.
    ctx : Context
        ``ctx.stats == (argmax,)``: (B, V) int16 (int32 when L > 32768), the winning l; ties
        go to the lowest l; 0 for all-masked rows.

    Notes
    -----
    For float16 / bfloat16 the logits are accumulated in float32, the bias added in float32,
    and the sum rounded to the input dtype once before the max -- the logits
    ``F.linear(x, W, bias)`` gives (the library's SPLADE head takes its max over those), so
    ties and the arg-max are judged on the same values as the library's; every path (the
    fused tiles, the cuBLAS tiles, NumPy) rounds alike (docs/decisions.md).  A NaN logit
    that reaches the max gives a NaN output (its arg-max is then unspecified, and the NaN
    reaches the gradients).
    """
    xp, workspace_bytes = _check(x, weight, bias, mask, activation, workspace_bytes)
    _checks.check_bool("splade_pool", "requires_grad", requires_grad)
    p = _checks.check_precision("splade_pool", precision)
    act = _act_code(activation)
    if xp is np:
        with config.float32_precision(p):  # (no effect on NumPy's products)
            out, arg = _np_forward(x, weight, bias, mask, act, workspace_bytes)
    else:
        # launches and cuBLAS on the arrays' GPU, whatever the current one is
        with x.device, config.float32_precision(p):
            out, arg = _gpu.forward(x, weight, bias, mask, act, workspace_bytes)
    ctx = Context("splade_pool", "none", x.shape[0], xp, stats=(arg,) if requires_grad else (),
                  precision=p)
    if requires_grad:
        ctx.saved = dict(x=x, weight=weight, out=out, arg=arg, bias=bias, act=act,
                         ws=workspace_bytes)
    return out, ctx


def splade_pool_backward(ctx: Context, grad_out) -> Tuple[Any, Any, Optional[Any]]:
    """Gradients of ``Σ grad_out · out`` w.r.t. x, weight and bias (None without a bias).

    ``grad_out``: (B, V) array of the same kind (cast to out's dtype).  Returns ``dx`` (B, L, D),
    ``dweight`` (V, D) and ``dbias`` (V,) in the inputs' dtype; only the entries with
    ``g' = grad_out · act'(out) != 0`` are touched (see the module notes).
    """
    require(ctx, "splade_pool")
    s = ctx.saved
    op = "splade_pool_backward"
    _check_grad_out(op, ctx.xp, grad_out, tuple(s["out"].shape), s["x"])
    if ctx.xp is np:
        return _np_backward(s["x"], s["weight"], s["out"], s["arg"], grad_out,
                            s["bias"] is not None, s["act"], s["ws"])
    with s["x"].device:
        return _gpu.backward(s["x"], s["weight"], s["out"], s["arg"], grad_out,
                             s["bias"] is not None, s["act"])


def splade_pool_backward_from_stats(x, weight, out, argmax, grad_out, *, bias=None,
                                    activation: str = "log1p_relu"):
    """The gradients from ``x``, ``weight``, the forward's ``out`` and arg-max (``ctx.stats[0]``).

    For callers that keep only these between forward and backward (the PyTorch op).  ``bias``
    is used only for its presence, shape and dtype: ``dbias`` is returned iff it is given.
    Same result as :func:`splade_pool_backward` on the forward's context.
    """
    op = "splade_pool_backward_from_stats"
    xp, _ = _check(x, weight, bias, None, activation, None, op=op)
    b, l, _d = x.shape
    v = weight.shape[0]
    want = index_dtype(l)
    for name, arr, dtype in (("out", out, x.dtype), ("argmax", argmax, want)):
        ok = isinstance(arr, np.ndarray) if xp is np else _checks.is_cupy_array(arr)
        if not ok or tuple(arr.shape) != (b, v) or arr.dtype != dtype:
            got = f"{type(arr).__name__} {getattr(arr, 'shape', '')} {getattr(arr, 'dtype', '')}"
            raise ValueError(f"{op}: {name} must be a ({b}, {v}) {dtype} {xp.__name__} array "
                             f"(from splade_pool_forward), got {got}")
        if xp is not np and arr.device.id != x.device.id:
            raise ValueError(f"{op}: {name} is on cuda:{arr.device.id} but x is on "
                             f"cuda:{x.device.id}")
    if xp is np and argmax.size and (argmax.min() < 0 or argmax.max() >= l):
        raise ValueError(f"{op}: argmax values must be positions in [0, {l}), got "
                         f"[{argmax.min()}, {argmax.max()}]")
    # (on the GPU values are not read back; an out-of-range position makes its entry inactive)
    ctx = Context("splade_pool", "none", b, xp, stats=(argmax,),
                  saved=dict(x=x, weight=weight, out=out, arg=argmax, bias=bias,
                             act=_act_code(activation), ws=None))
    return splade_pool_backward(ctx, grad_out)


def splade_pool(x, weight, bias=None, mask=None, *, activation: str = "log1p_relu",
                workspace_bytes: Optional[int] = None, precision: Optional[str] = None):
    """SPLADE's (B, V) representation of ``x`` (B, L, D); see :func:`splade_pool_forward`."""
    return splade_pool_forward(x, weight, bias, mask, activation=activation,
                               workspace_bytes=workspace_bytes, requires_grad=False,
                               precision=precision)[0]


def _check_out(op, out):
    xp = _checks.array_module(op, out=out)
    if out.ndim != 2:
        raise ValueError(f"{op}: out must be 2-D (B, V), got shape {tuple(out.shape)}")
    _checks.check_float(op, "out", out)
    if out.shape[0] < 1:
        raise ValueError(f"{op}: out needs B >= 1 rows, got shape {tuple(out.shape)}")
    return xp


def flops_regularizer(out):
    """SPLADE's FLOPS regularizer ``Σ_v (mean_b out[b, v])²`` of a (B, V) representation.

    Returns a 0-d float32 array (float64 for float64 ``out``); the column means are
    accumulated in that type without a widened copy of ``out``.
    """
    xp = _check_out("flops_regularizer", out)
    a = acc_dtype(out.dtype)
    mean = out.mean(axis=0, dtype=a)
    return xp.asarray((mean * mean).sum())


def flops_regularizer_backward(out, grad: Any = 1.0):
    """``d/d out`` of ``grad · flops_regularizer(out)``: ``grad · 2 · mean_b(out[:, v]) / B``.

    ``grad`` is a real or a 0-d array of the same kind (never read back from the device).
    Returns a (B, V) array of out's dtype.
    """
    op = "flops_regularizer_backward"
    xp = _check_out(op, out)
    g = _checks.check_grad_loss(op, grad, "sum", out.shape[0], xp)
    a = acc_dtype(out.dtype)
    col = out.mean(axis=0, dtype=a) * a.type(2.0 / out.shape[0])
    if not isinstance(g, numbers.Real):
        col = col * g.astype(a).reshape(())
    elif g != 1.0:
        col = col * a.type(g)
    return xp.broadcast_to(col.astype(out.dtype)[None, :], out.shape).copy()
