"""The machinery every op of ``cupynce.torch`` shares: custom-op registration (with autocast),
the direct eager path, the fused-gradient helpers, the FakeTensor shapes, argument checks.

Two ways to a gradient (``fused``, chosen by the public functions):

* fused (a gradient is required and reduction is "mean" or "sum"): the forward op runs the
  core's fused forward, which also computes the gradient for a unit upstream gradient in
  the forward's own pass over the scores, and returns its fp32 / fp64 accumulators (and the
  row norms for normalize=True).  The backward only scales them by grad_output and casts:
  ``(acc * g).to(dtype)`` in torch (the core's scale_cast, bit for bit), or the
  ``grad_finish`` op through the normalisation.  Why: autograd runs a CUDA backward on its
  own device thread, where the Python of a full backward (checks, DLPack, a dozen launches)
  cost ~1.7x its main-thread time on the H100 host (docs/design.md), and the kernels
  are the same either way.  Cost: the (N, D) accumulators live from forward to backward.
* otherwise ("none", whose upstream gradient is a vector): the forward returns the O(N)
  row statistics, and the backward op rebuilds the gradient from them and the inputs.
  These forwards call the core with reduction="none" and reduce here
  (``cupynce.ops._base.reduce``, the core's own reduction).
Unused outputs are (0,) placeholders (custom ops return tensors, never None).
"""
import threading
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from .. import _checks
from ..ops import _base
from . import _bridge as B
from . import _fast

#: torch.library.custom_op / register_fake / register_autograd / get_autocast_dtype.
MIN_TORCH_CUSTOM_OPS = "2.4"
#: True when the losses are torch custom ops (torch >= 2.4); False: autograd.Function fallback.
HAS_CUSTOM_OPS = all(hasattr(torch.library, f) for f in ("custom_op", "register_fake")) \
    and hasattr(torch, "get_autocast_dtype")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The loss / statistics dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: set while a direct Function's forward runs: its unused outputs need no placeholder tensor
_DIRECT = threading.local()


def scalar_placeholder(x: Tensor) -> Optional[Tensor]:
    """A zero 0-d accumulator-dtype placeholder for a scalar's unused gradient output (the
    fake shows a 0-d); None inside a direct Function's forward (as :func:`empty`).  Zero, not
    unwritten: an op's outputs are the same bits on every call (torch.library.opcheck compares
    them between eager and traced runs; an unwritten one held whatever the allocator had)."""
    if getattr(_DIRECT, "on", False):
        return None
    return x.new_zeros((), dtype=acc_dtype(x.dtype))


def empty(x: Tensor) -> Optional[Tensor]:
    """A (0,) placeholder for an unused output (custom ops return tensors, never None); None
    inside a direct Function's forward, whose extra outputs are only saved for backward."""
    if getattr(_DIRECT, "on", False):
        return None
    return x.new_empty((0,), dtype=acc_dtype(x.dtype))


def fused_stat(arr: Any) -> Optional[Tensor]:
    """A fused forward's row statistics as a tensor (an output of the custom op; the fused
    backward does not read them, so a direct Function's forward skips the view: None)."""
    return None if getattr(_DIRECT, "on", False) else B.tensor_of(arr)


def opt_tensor(arr: Any, like: Tensor) -> Tensor:
    return empty(like) if arr is None else B.tensor_of(arr)


def grad_finish(x: Tensor, norm: Tensor, acc: Tensor, grad_loss: Tensor) -> Tensor:
    """The gradient w.r.t. ``x`` (x's dtype) of a fused forward: ``grad_loss`` times the
    accumulator ``acc`` taken back through the row normalisation of ``x`` (row norms ``norm``)
    -- the core's own finish (``l2norm_bwd`` / ``ops._numpy.finish``), so bit for bit the functional
    API's backward."""
    with B.device_scope(x.device):
        xa = B.array_of(x)
        if isinstance(xa, np.ndarray):
            xp = np
        else:
            import cupy as xp
        path = _base.Path(xp)
        acc_a = B.array_of(acc)
        gs = path.grad_scale(B.array_of(grad_loss), acc_a.dtype)
        out = _base.finish_all(path, _base.contig_inputs(xp, xa), [B.array_of(norm)], [acc_a],
                               gs)
        return B.tensor_of(out[0])


def loss_like(x: Tensor, reduction: str) -> Tensor:
    return x.new_empty((x.shape[0],) if reduction == "none" else (), dtype=acc_dtype(x.dtype))


def stat_like(x: Tensor) -> Tensor:
    return x.new_empty((x.shape[0],), dtype=acc_dtype(x.dtype))


def acc_like(x: Optional[Tensor], fused: bool, like: Tensor) -> Tensor:
    """A fused forward's gradient accumulator: x's shape in the accumulation dtype."""
    return x.new_empty(x.shape, dtype=acc_dtype(x.dtype)) if fused and x is not None else empty(like)


def norm_like(x: Optional[Tensor], fused: bool, normalize: bool, like: Tensor) -> Tensor:
    """A fused forward's row norms: x's shape without D (normalize=True)."""
    if fused and normalize and x is not None:
        return x.new_empty(x.shape[:-1], dtype=acc_dtype(x.dtype))
    return empty(like)


def grad_finish_fake(x, norm, acc, grad_loss):
    return x.new_empty(x.shape)


def fused_flag(inputs, n_args: int) -> bool:
    """The ``fused`` input (absent from a fallback Function's inputs when not passed)."""
    return bool(inputs[n_args]) if len(inputs) > n_args else False


def input_at(inputs, i: int, default: Any = None) -> Any:
    """An op's optional input ``i`` (``precision``): absent from a fallback Function's inputs
    when not passed; the dispatcher fills the schema's default."""
    return inputs[i] if len(inputs) > i else default


def compiling() -> bool:
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(fn()) if fn is not None else False


def refuse_double_backward() -> None:
    """Raise inside a backward taken with ``create_graph=True`` (the gradients here are not
    differentiable; a graph built from them would silently drop their dependence on the
    inputs).  Under ``torch.compile`` the traced backward runs with grad mode on: allowed."""
    if torch.is_grad_enabled() and not compiling():
        raise RuntimeError("cupynce.torch: double backward (create_graph=True) is not supported")


def scaled(x: Optional[Tensor], norm: Optional[Tensor], acc: Tensor, grad_loss: Tensor,
           dtype: torch.dtype, normalize: bool, direct: bool = False) -> Tensor:
    """A fused forward's gradient for upstream ``grad_loss``: ``acc * g`` cast to the input
    dtype (= the core's scale_cast: one fp32 / fp64 product, one rounding), or through the
    normalisation by the ``grad_finish`` op.

    Double backward is not supported: ``acc`` does not depend on the inputs in autograd's
    eyes, so a graph built here (``create_graph=True``) would silently drop the gradient's own
    dependence on them; raise instead (the per-row path's backward op has no autograd formula
    and fails the same way)."""
    refuse_double_backward()
    if normalize:  # (direct: plain eager, no transform or mode to meet -- the op's body
        # itself, without the dispatcher's host time)
        return (grad_finish if direct else FINISH)(x, norm, acc, grad_loss.contiguous())
    if not direct:  # (out= is for plain tensors: the registered ops meet transforms, modes)
        return (acc * grad_loss).to(dtype)
    # one kernel: the product in acc's dtype, rounded once into the output's (as .to(dtype))
    return torch.mul(acc, grad_loss, out=torch.empty(acc.shape, dtype=dtype, device=acc.device))


def fallback(name: str, fwd, setup, backward, fast: bool = False) -> type:
    """A ``torch.autograd.Function`` over the same kernels: the direct eager path (see
    :func:`direct`), and torch < 2.4.  ``apply`` returns the op's first output alone (the
    loss, or SPLADE's pooled output).

    Its ``forward(ctx, *args)`` runs ``fwd`` then ``setup`` (the custom op's set-up, the same
    function) and returns ``fwd``'s first output: the other outputs (row statistics, gradient
    accumulators) are saved for backward as intermediates, not returned, since autograd's
    bookkeeping costs host time per output (~9 µs here, ~25 µs on the H100 hosts).  The
    old-style signature, because a Function that defines ``setup_context`` has ``apply``
    bind its arguments with ``inspect.signature`` on every call (40-130 µs there).

    ``fast``: ``fwd``'s GPU work is one graph replay and its outputs are views of the core's
    (no work after it): repeated calls replay from the tensors (:mod:`cupynce.torch._fast`)."""
    def forward(ctx, *args):
        before = getattr(_DIRECT, "on", False)
        _DIRECT.on = True
        try:
            out = _fast.call(fwd, args) if fast else fwd(*args)
        finally:
            _DIRECT.on = before
        ctx.direct = True
        setup(ctx, args, out)
        return out[0]

    forward.__name__ = fwd.__name__
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward),
        "__doc__": f"Eager autograd for {fwd.__name__}."})


def register(op: str, function_name: str, fwd, fwd_fake, bwd, bwd_fake, setup, backward, *,
             autocast: Tuple[int, ...] = (), fast: bool = False):
    """An op's three faces: ``(Function, FWD, BWD)``.

    ``Function`` is the direct eager path (:func:`fallback`; ``fast`` as there); ``FWD`` the
    forward custom op ``cupynce::<op>_fwd`` with ``backward`` as its autograd formula and
    autocast casts at ``autocast``; ``BWD`` the backward op ``cupynce::<op>_bwd``, so that
    torch.compile traces it into the backward graph.  On torch < 2.4: the Function (``FWD``
    returns its output as a one-tuple, like the op) and the plain ``bwd``."""
    function = fallback(function_name, fwd, setup, backward, fast=fast)
    if not HAS_CUSTOM_OPS:  # pragma: no cover - exercised only on torch < 2.4
        def fwd_op(*args):
            return (function.apply(*args),)
        return function, fwd_op, bwd
    bwd_op = custom_op(f"{op}_bwd", bwd, bwd_fake)
    fwd_op = custom_op(f"{op}_fwd", fwd, fwd_fake, setup=setup, backward=backward,
                       autocast=autocast)
    return function, fwd_op, bwd_op


def non_differentiable(ctx, *outputs: Tensor) -> None:
    """``ctx.mark_non_differentiable`` for the custom op's extra outputs (the direct
    Function returns only the first output: nothing to mark there)."""
    if not getattr(ctx, "direct", False):
        ctx.mark_non_differentiable(*outputs)


_autocast_lib = None  # keeps the Autocast* kernel registrations alive


def autocast_row(a: Any, device_type: str, dtype: torch.dtype) -> Any:
    """The autocast cast of one embedding input: a floating tensor on ``device_type``, not
    float64, goes to ``dtype`` (one already in it is returned as it is, no copy; a 16-bit
    input of the other type is cast); anything else as it is.  One rule for the ops'
    Autocast kernels (:func:`register_autocast`) and the global losses
    (:func:`autocast_rows`)."""
    if isinstance(a, Tensor) and a.is_floating_point() and a.dtype != torch.float64 \
            and a.device.type == device_type:
        return a.to(dtype)
    return a


def autocast_rows(rows: Sequence[Any]) -> List[Any]:
    """``rows`` (embedding inputs, or None) as the single-process ops' Autocast kernels cast
    them, for a call that does not go through the dispatcher (the global losses of
    ``cupynce.torch.distributed``): inside an autocast region for a tensor's device type it
    goes to that region's dtype; outside one, or on torch without
    ``torch.get_autocast_dtype`` (< 2.4: no casts there either), unchanged."""
    if not HAS_CUSTOM_OPS:
        return list(rows)
    out = []
    for a in rows:
        if isinstance(a, Tensor) and torch.is_autocast_enabled(a.device.type):
            a = autocast_row(a, a.device.type, torch.get_autocast_dtype(a.device.type))
        out.append(a)
    return out


def register_autocast(qualname: str, cast_positions: Tuple[int, ...]) -> None:
    """AutocastCPU / AutocastCUDA kernels for ``qualname``: the embeddings at
    ``cast_positions`` go to the *current* autocast dtype (``torch.library.register_autocast``
    fixes one dtype at registration and would also cast logit_scale), then the op runs with
    autocast excluded, as torch's own ``register_autocast`` kernel does."""
    global _autocast_lib
    if _autocast_lib is None:
        _autocast_lib = torch.library.Library("cupynce", "FRAGMENT")
    op = torch._library.utils.lookup_op(qualname)
    for device_type, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
        exclude = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, *args, _device_type=device_type, _exclude=exclude):
            dtype = torch.get_autocast_dtype(_device_type)
            args = tuple(autocast_row(a, _device_type, dtype) if i in cast_positions else a
                         for i, a in enumerate(args))
            with torch._C._ExcludeDispatchKeyGuard(_exclude):
                return op(*args)

        _autocast_lib.impl(qualname.split("::")[1], kernel, key, with_keyset=True)


def custom_op(name: str, fn, fake, *, setup=None, backward=None, autocast=()):
    op = torch.library.custom_op(f"cupynce::{name}", fn, mutates_args=())
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup)
    if autocast:
        register_autocast(f"cupynce::{name}", autocast)
    return op

TRANSFORMS_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)
PLAIN_TYPES = (Tensor, nn.Parameter)


def direct(*tensors: Optional[Tensor]) -> bool:
    """Whether a call may take the direct eager path: the ops' bodies through plain
    ``torch.autograd.Function`` s (each op's ``Function``: same forward, setup and
    backward functions, so the same kernels and bits) instead of the custom-op dispatcher.

    The dispatcher, its autograd wrapper and its output checks cost ~100-250 µs of host time
    per forward + backward on the H100 host (N = 64), as much as the kernels' own launches.
    Everything that needs the registered ops keeps them: ``torch.compile`` / dynamo and
    ``torch.jit`` tracing, torch-function and dispatch modes (FakeTensor, functionalisation,
    ``with torch.device(...)``), functorch transforms (vmap, grad), autocast (the ops carry
    the autocast casts), tensor subclasses; and torch < 2.4, where the Functions are the
    only path anyway.
    """
    if not HAS_CUSTOM_OPS:
        return True
    if compiling() or torch.jit.is_tracing() or torch._C._is_torch_function_mode_enabled() \
            or torch._C._len_torch_dispatch_stack() \
            or (TRANSFORMS_ACTIVE is not None and TRANSFORMS_ACTIVE()) \
            or torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"):
        return False
    return all(t is None or type(t) in PLAIN_TYPES for t in tensors)


def fused(reduction: str, *tensors: Optional[Tensor]) -> bool:
    """Compute the gradient in the forward (see "Two ways to a gradient"): a gradient will be
    asked for (grad mode on and an input requires one) and the upstream gradient is a scalar
    (reduction "mean" / "sum")."""
    return reduction != "none" and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors)


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """A gradient may be asked of the result: grad mode on and an input requires one."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def evaluate(body, args) -> Tensor:
    """A direct call no gradient will be asked of: ``body(*args)`` (an op's ``evaluate``: the
    loss alone, one graph replay on the GPU) through :func:`cupynce.torch._fast.call`, no
    autograd Function around it."""
    return _fast.call(body, args)[0]


def scalars(op: str, reduction: str, workspace_bytes: Optional[int]) -> Tuple[str, Optional[int]]:
    """The functional API's checks of the non-tensor arguments (same messages)."""
    return _checks.check_reduction(op, reduction), _checks.check_workspace(op, workspace_bytes)


def temperature(op: str, value: Any) -> Tuple[Optional[Tensor], float]:
    """A temperature as the ops take it (a ``Scalar`` input's two arguments): a tensor that
    requires grad or lives on a GPU → (tensor, 0.0) (an input, never read on the host; its
    shape and dtype are checked by the core), a real or a CPU tensor without grad → (None,
    its value) (read on the host: a constant of the call)."""
    if isinstance(value, Tensor) and (value.requires_grad or value.device.type != "cpu"):
        return value, 0.0
    return None, _checks.check_temperature(op, value)


def _matmul_fp32_precision_api() -> bool:
    """Whether this torch has ``torch.backends.cuda.matmul.fp32_precision`` (torch >= 2.9)."""
    try:
        torch.backends.cuda.matmul.fp32_precision
    except (AttributeError, RuntimeError):
        return False
    return True


_FP32_PRECISION_API = _matmul_fp32_precision_api()


def _matmul_fp32_getter():
    """What ``torch.backends.cuda.matmul.fp32_precision`` calls (torch >= 2.9), taken once:
    the attribute goes through ``cuBLASModule.__getattr__`` (~0.8 us a read against ~0.1
    for the getter; read at every call with ``precision=None``).  None where this torch has
    no such getter or it disagrees with the attribute (the attribute is then read)."""
    if not _FP32_PRECISION_API:
        return None
    fn = getattr(torch._C, "_get_fp32_precision_getter", None)
    if fn is None:
        return None
    try:
        if fn("cuda", "matmul") != torch.backends.cuda.matmul.fp32_precision:
            return None
    except (RuntimeError, TypeError):
        return None
    return lambda: fn("cuda", "matmul")


_MATMUL_FP32 = _matmul_fp32_getter()
_assume_constant = getattr(getattr(torch, "compiler", None), "assume_constant_result",
                           lambda fn: fn)


@_assume_constant  # (dynamo cannot trace the getter; its global-state guard has the flag)
def torch_uses_tf32() -> bool:
    """Whether torch runs its float32 CUDA matmuls in TF32, read on the host (no GPU sync).

    torch >= 2.9: ``torch.backends.cuda.matmul.fp32_precision == "tf32"`` -- what
    ``torch.backends.cuda.matmul.allow_tf32 = True``, ``torch.set_float32_matmul_precision
    ("high")`` (or "medium") and ``torch.backends.fp32_precision = "tf32"`` give; it equals
    ``allow_tf32`` wherever that is readable (torch 2.13 refuses to read ``allow_tf32`` once
    the new API set TF32).  Older torch: ``torch.backends.cuda.matmul.allow_tf32``.
    """
    if _MATMUL_FP32 is not None:
        return _MATMUL_FP32() == "tf32"
    matmul = torch.backends.cuda.matmul
    if _FP32_PRECISION_API:
        return matmul.fp32_precision == "tf32"
    return bool(matmul.allow_tf32)


def precision_of(op: str, precision: Any) -> str:
    """``cupynce.torch``'s ``precision=``: a mode as given (validated: ``_checks``' message);
    None: "tf32" where torch's float32 CUDA matmuls use TF32 (:func:`torch_uses_tf32`), else
    the global default (``cupynce.get_float32_precision()``).  Evaluated at each call."""
    if precision is None and torch_uses_tf32():
        return "tf32"
    return _checks.check_precision(op, precision, none_means=NONE_MEANS)


#: what precision=None means in cupynce.torch, for the error message
NONE_MEANS = ("torch's TF32 setting (torch.backends.cuda.matmul.fp32_precision), then "
              "cupynce.get_float32_precision()")


def module_precision(name: str, precision: Optional[str]) -> Optional[str]:
    """A module's (or an integration's) ``precision``: checked at construction, kept as given
    (None stays None: torch's TF32 setting and the global default are read at each call)."""
    if precision is not None:
        _checks.check_precision(name, precision, none_means=NONE_MEANS)
    return precision


#: the flag check of the core (one message for both layers)
check_bool = _checks.check_bool



#: ``cupynce::grad_finish``: a fused forward's accumulator through the row normalisation
#: (the plain function on torch < 2.4).
FINISH = custom_op("grad_finish", grad_finish, grad_finish_fake) if HAS_CUSTOM_OPS \
    else grad_finish
