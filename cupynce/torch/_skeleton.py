"""The skeleton every op of ``cupynce.torch`` shares: an op is its math (the core's functions,
its argument checks) plus one table entry in its module.

A loss of the InfoNCE family is a :class:`Loss` entry -- its inputs, its scalar parameters,
its row statistics and the core functions it runs -- from which this module makes the rest:

* ``fwd``, the custom op ``cupynce::<op>_fwd``: the loss, the row statistics and, when
  ``fused``, the unit-upstream gradient accumulators, row norms and scalar gradients of the
  core's fused forward; unused outputs are placeholders (``_registry``'s "Two ways to a
  gradient");
* ``bwd``, the custom op ``cupynce::<op>_bwd``: the gradients rebuilt from the inputs and the
  row statistics (the core's ``*_backward_from_stats``);
* ``evaluate``: the loss alone, for calls no gradient will be asked of;
* ``fwd_fake`` / ``bwd_fake``: their FakeTensor shapes (``torch.compile``);
* ``setup_context`` / ``backward``: autograd, for the custom op and the direct Function alike;
* the public function's dispatch (:meth:`Loss.__call__`): the evaluation path, the direct eager
  Function or the registered op (``_registry.direct``).

The bodies' signatures, and so the custom ops' schemas (which compiled graphs show), follow
from the entry::

    fwd(<inputs>, <params>, reduction, normalize, workspace_bytes, precision=None, fused=False)
    bwd(<inputs>, <stats>, grad_loss, <params>, reduction, normalize, workspace_bytes,
        precision=None)

where an input is a tensor of rows (:class:`Rows`: the embeddings, cast under autocast; an
optional one is ``Tensor?``) or a learnable scalar, a tensor or a real (:class:`Scalar`: two
arguments, ``<name>: Tensor?`` and ``<name>_value: float``, so that a real never becomes a
device tensor), and a param is a real (``temperature``).  The core module's functions are
called as its functional API spells them, on arrays (a scalar as its array or its real)::

    <op>_forward(<required inputs>, <params>, <optional input>=, reduction=, normalize=,
                 workspace_bytes=, requires_grad=, precision=)
    <op>_backward_from_stats(<inputs>, <stats>, grad_loss, <param>=, reduction=,
                             normalize=, workspace_bytes=, precision=)

The labels of the label-aware losses are a third kind of input, :class:`Labels`: an optional
integer tensor, never differentiable nor cast, given to the core by keyword (its backward
too); a keyword param (``label_smoothing``) is a param like the temperature (every param is
passed by name).

An op whose bodies are its own (SPLADE's head) is an :class:`Op` entry of them: the
registration and the dispatch.

The registered ops are read from the op's module at each call (``<module>.FWD`` /
``<module>.BWD``), and the core's functions from the core module: those names are the ones
torch < 2.4 and the tests replace (the plain ``bwd`` as ``BWD``, a spy as the core's forward).
"""
import inspect
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional, Sequence, Tuple

from torch import Tensor

from ..ops import _base
from . import _bridge as B
from . import _registry as R


@dataclass(frozen=True)
class Rows:
    """An input of rows, (N, D) or (N, M, D), such as the embeddings: differentiable, cast to
    the autocast dtype under autocast; the fused forward returns its gradient accumulator and
    its row norms.  ``optional``: may be None (InfoNCE's negatives).  ``grad_param``: the
    name of a real param (1.0 / 0.0) saying whether the fused forward computes this input's
    accumulator at all (InfoNCE's ``negatives_grad``: a detached queue's product is skipped;
    0.0 gives the (0,) placeholder, and the backward refuses to use it)."""

    name: str
    optional: bool = False
    grad_param: Optional[str] = None


@dataclass(frozen=True)
class Scalar:
    """A learnable scalar given as a tensor of shape () or (1,) (differentiable, never read
    on the host) or as a real (a constant of the call): the arguments ``<name>`` (the tensor,
    or None) and ``<name>_value`` (the real; 0.0 with a tensor).  The fused forward returns
    its 0-d gradient."""

    name: str


@dataclass(frozen=True)
class Labels:
    """An optional (N,) integer input (the rows' labels): not differentiable, not cast under
    autocast, passed to the core's forward and backward by keyword; its "gradient" is an empty
    placeholder in the backward op's outputs and None in autograd's."""

    name: str


def _parameter(name: str, annotation: Any = inspect.Parameter.empty,
               default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                             annotation=annotation, default=default)


def _function(name: str, module: str, parameters: Sequence[inspect.Parameter], returns: Any,
              body: Callable[[tuple], Any], doc: str) -> Callable[..., Any]:
    """A function ``name(<parameters>)`` of that signature (``inspect.signature``, and so
    ``torch.library.infer_schema``, read it) that runs ``body(args)`` on its arguments as one
    positional tuple, defaults filled; a full positional call is not bound again."""
    signature = inspect.Signature(list(parameters), return_annotation=returns)
    count = len(parameters)

    def function(*args, **kwargs):
        if kwargs or len(args) != count:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = bound.args
        return body(args)

    function.__name__ = function.__qualname__ = name
    function.__module__, function.__doc__ = module, doc
    function.__signature__ = signature  # type: ignore[attr-defined]
    function.__annotations__ = {p.name: p.annotation for p in parameters
                                if p.annotation is not inspect.Parameter.empty}
    if returns is not inspect.Signature.empty:
        function.__annotations__["return"] = returns
    return function


class Op:
    """The table entry of an op with bodies of its own: its three faces (``Function``, the
    direct eager path; ``FWD`` / ``BWD``, the registered custom ops: ``_registry.register``)
    and the public function's last step (:meth:`__call__`).

    ``direct``: the positions of ``fwd``'s tensor arguments (what ``_registry.direct``
    looks at); ``module``: the op module's ``__name__`` (its ``FWD`` is read there)."""

    def __init__(self, name: str, function: str, module: str, fwd, fwd_fake, bwd, bwd_fake,
                 setup_context, backward, *, autocast: Tuple[int, ...],
                 direct: Tuple[int, ...], fast: bool = False):
        self.name = name
        self.home = sys.modules[module]
        self.direct_at = tuple(direct)
        self.Function, self.FWD, self.BWD = R.register(
            name, function, fwd, fwd_fake, bwd, bwd_fake, setup_context, backward,
            autocast=autocast, fast=fast)

    def __call__(self, *args: Any) -> Tensor:
        """The op on its checked arguments (``fwd``'s): the direct Function in plain eager
        mode, else the registered op."""
        if R.direct(*(args[i] for i in self.direct_at)):
            return self.Function.apply(*args)
        return self.home.FWD(*args)[0]


def _unit_grads(saved: dict) -> Tuple[Sequence[Any], Sequence[Any], Sequence[Any]]:
    return saved["acc"], saved["norms"], ()


class Loss(Op):
    """The table entry of a loss of the InfoNCE family (see the module notes).

    Parameters
    ----------
    name, function, module : the custom ops' prefix (``cupynce::<name>_fwd`` / ``_bwd``), the
        direct Function's class name, the op module's ``__name__``.
    core : the core op module (``cupynce.ops.<op>``); a ``reduce_rows(ctx, rows,
        reduction)`` there reduces its per-row ("none") forward where the mean is not over
        every row (SupCon's anchors with a positive).
    inputs : the :class:`Rows` and :class:`Scalar` inputs, in order.
    params : the names of the real parameters that follow them (``("temperature",)``).
    stats : the names of the core's row statistics (``ctx.stats``), the backward op's
        arguments; none: the backward recomputes from the inputs alone, and the forward of a
        per-row ("none") call is the loss alone.
    forward, backward : the names of the core module's forward and its backward from the
        inputs and statistics (default ``<name>_forward``, ``<name>_backward_from_stats``),
        called as the module notes say.
    unit_grads : the core context's ``saved`` -> (the rows' unit-upstream gradient
        accumulators, their row norms, the scalars' gradients) of a fused forward; default
        ``saved["acc"]``, ``saved["norms"]`` and no scalar.
    strict_double_backward : raise on ``create_graph=True`` in the per-row backward too (the
        fused backward always does; elsewhere the backward op, which has no autograd formula,
        fails when the graph built on it is used).
    """

    def __init__(self, name: str, function: str, module: str, core: ModuleType, *,
                 inputs: Sequence[Any], params: Sequence[str] = (), stats: Sequence[str],
                 forward: Optional[str] = None, backward: Optional[str] = None,
                 unit_grads: Callable[[dict], Tuple[Sequence[Any], Sequence[Any],
                                                    Sequence[Any]]] = _unit_grads,
                 strict_double_backward: bool = False):
        self.core = core
        self.forward_name = forward or f"{name}_forward"
        self.backward_name = backward or f"{name}_backward_from_stats"
        self.unit_grads, self.strict = unit_grads, strict_double_backward
        self.inputs, self.params, self.stats = tuple(inputs), tuple(params), tuple(stats)
        #: the inputs the core's forward takes by keyword (the optional ones), by index
        self.by_name = tuple(j for j, x in enumerate(self.inputs)
                             if (isinstance(x, Rows) and x.optional) or isinstance(x, Labels))
        self.is_labels = tuple(isinstance(x, Labels) for x in self.inputs)
        # the forward's argument positions: each input's tensor (a scalar's real after it)
        at, i = [], 0
        for x in self.inputs:
            at.append(i)
            i += 2 if isinstance(x, Scalar) else 1
        self.n_in = i  # the inputs' arguments; then params, reduction, normalize, ws, ...
        self.input_at = tuple(at)
        self.is_scalar = tuple(isinstance(x, Scalar) for x in self.inputs)
        self.rows_at = tuple(p for p, x in zip(at, self.inputs) if isinstance(x, Rows))
        self.scalar_at = tuple(p for p, x in zip(at, self.inputs) if isinstance(x, Scalar))
        self.reduction_at = self.n_in + len(self.params)
        self.fused_at = self.reduction_at + 4  # (after normalize, workspace_bytes, precision)
        #: the backward's grads (one per input) come back as a tensor, not a tuple
        self.single = len(self.inputs) == 1
        #: the outputs after the loss and the statistics: accumulators, norms, scalars' grads
        self.n_extra = 2 * len(self.rows_at) + len(self.scalar_at)
        self.no_rows = (None,) * len(self.rows_at)
        # the bodies, as functions of the op's signatures (the custom ops' schemas)
        fwd_params, bwd_params, fake_params, bfake_params = self._parameters()
        n_out = 1 + len(self.stats) + self.n_extra
        self.fwd = _function("fwd", module, fwd_params, Tuple[(Tensor,) * n_out], self._fwd,
                             self._fwd_doc())
        self.evaluate = _function("evaluate", module, fwd_params[:-1], Tuple[Tensor],
                                  self._evaluate, _EVALUATE_DOC)
        grads = Tensor if self.single else Tuple[(Tensor,) * len(self.inputs)]
        self.bwd = _function("bwd", module, bwd_params, grads, self._bwd, self._bwd_doc())
        self.fwd_fake = _function("fwd_fake", module, fake_params, inspect.Signature.empty,
                                  self._fwd_fake, "``fwd``'s output shapes (FakeTensors).")
        self.bwd_fake = _function("bwd_fake", module, bfake_params, inspect.Signature.empty,
                                  self._bwd_fake, "``bwd``'s output shapes (FakeTensors).")
        super().__init__(name, function, module, self.fwd, self.fwd_fake, self.bwd,
                         self.bwd_fake, self.setup_context, self.backward,
                         autocast=self.rows_at, direct=self.input_at, fast=True)

    # ---- the signatures -----------------------------------------------------------------
    def _parameters(self):
        """(fwd's, bwd's, fwd_fake's, bwd_fake's) parameters, as the module notes say."""
        ins = []
        for x in self.inputs:
            if isinstance(x, Scalar):
                ins += [_parameter(x.name, Optional[Tensor]),
                        _parameter(f"{x.name}_value", float)]
            else:
                optional = isinstance(x, Labels) or x.optional
                ins.append(_parameter(x.name, Optional[Tensor] if optional else Tensor))
        params = [_parameter(p, float) for p in self.params]
        flags = [_parameter("reduction", str), _parameter("normalize", bool),
                 _parameter("workspace_bytes", Optional[int]),
                 _parameter("precision", Optional[str], None)]
        fwd = ins + params + flags + [_parameter("fused", bool, False)]
        bwd = (ins + [_parameter(s, Tensor) for s in self.stats]
               + [_parameter("grad_loss", Tensor)] + params + flags)

        def plain(ps):  # (the fakes: the same names and defaults, no annotations)
            return [p.replace(annotation=inspect.Parameter.empty) for p in ps]
        return fwd, bwd, plain(fwd), plain(bwd)

    def _fwd_doc(self) -> str:
        rows = [x.name for x in self.inputs if isinstance(x, Rows)]
        scalars = [x.name for x in self.inputs if isinstance(x, Scalar)]
        names = (["loss", *self.stats] + [f"d{r}_acc" for r in rows]
                 + [f"norm_{r}" for r in rows] + [f"d{s}" for s in scalars])
        return (f"({', '.join(names)}): the loss (0-d, or (N,) for \"none\")"
                + (", the (N,) row statistics" if self.stats else "")
                + " and, when ``fused``, the unit-upstream gradient accumulators, the row "
                "norms (normalize=True)" + (" and the 0-d scalar gradients" if scalars else "")
                + "; placeholders otherwise (and for an input given as None).")

    def _bwd_doc(self) -> str:
        doc = (f"({', '.join(f'd{x.name}' for x in self.inputs)}) for the upstream gradient "
               f"``grad_loss`` (0-d, or (N,) for \"none\"), in the inputs' dtypes")
        if self.scalar_at:
            doc += ("; a scalar's in the tensor's shape and dtype (0-d float32 / float64 for "
                    "a real)")
        if self.by_name:
            doc += "; an empty (0,) tensor for an optional input given as None"
        return doc + "."

    # ---- the bodies ---------------------------------------------------------------------
    def _arrays(self, args) -> list:
        """The core's view of the inputs: arrays (a scalar: its array, or its real)."""
        return [B.scalar_of(args[i], args[i + 1]) if scalar else B.array_of(args[i])
                for i, scalar in zip(self.input_at, self.is_scalar)]

    def _core_forward(self, args, reduction, normalize, workspace_bytes, requires_grad,
                      precision):
        """The core's forward (the core module's current function) on ``args``' inputs and
        params (by name)."""
        xs = self._arrays(args)
        params = dict(zip(self.params, args[self.n_in:self.reduction_at]))
        forward = getattr(self.core, self.forward_name)
        named = {self.inputs[j].name: xs[j] for j in self.by_name}
        return forward(*(x for j, x in enumerate(xs) if j not in self.by_name), **params,
                       **named, reduction=reduction, normalize=normalize,
                       workspace_bytes=workspace_bytes, requires_grad=requires_grad,
                       precision=precision)

    def _fwd(self, args):
        x0 = args[0]
        reduction, normalize, workspace_bytes, precision, fused = args[self.reduction_at:]
        with B.device_scope(x0.device):
            if fused:
                loss, ctx = self._core_forward(args, reduction, normalize, workspace_bytes,
                                               True, precision)
                accs, norms, scalars = self.unit_grads(ctx.saved)
                out = [B.tensor_of(loss)]
                for x in ctx.stats:
                    out.append(R.fused_stat(x))
                for x in (*accs, *norms):
                    out.append(R.opt_tensor(x, x0))
                for x in scalars:  # (None: a real scalar's, never read: a zero 0-d for the
                    # custom op, None in the direct Function, whose replay learns it)
                    out.append(B.tensor_of(ctx.xp.asarray(x)) if x is not None else
                               R.scalar_placeholder(x0))
                return tuple(out)
            if not self.stats:  # (the backward needs nothing from the forward: the loss alone)
                loss, _ = self._core_forward(args, reduction, normalize, workspace_bytes,
                                             False, precision)
                out = [B.tensor_of(loss)]
            else:
                rows, ctx = self._core_forward(args, "none", normalize, workspace_bytes, True,
                                               precision)
                # (a core whose mean is not over every row reduces its own: SupCon's)
                reduce = getattr(self.core, "reduce_rows", None)
                out = [B.tensor_of(reduce(ctx, rows, reduction) if reduce else
                                   _base.reduce(ctx.xp, rows, reduction))]
                for x in ctx.stats:
                    out.append(B.tensor_of(x))
            for _ in range(self.n_extra):
                out.append(R.empty(x0))
            return tuple(out)

    def _evaluate(self, args):
        x0 = args[0]
        reduction, normalize, workspace_bytes, precision = args[self.reduction_at:]
        with B.device_scope(x0.device):
            loss, _ = self._core_forward(args, reduction, normalize, workspace_bytes, False,
                                         precision)
            return (B.tensor_of(loss),)

    def _bwd(self, args):
        x0 = args[0]
        at = self.n_in + len(self.stats)  # grad_loss
        params = dict(zip(self.params, args[at + 1:at + 1 + len(self.params)]))
        reduction, normalize, workspace_bytes, precision = args[at + 1 + len(self.params):]
        with B.device_scope(x0.device):
            xs = self._arrays(args)
            labels = {self.inputs[j].name: xs[j] for j, lab in enumerate(self.is_labels) if lab}
            grads = getattr(self.core, self.backward_name)(
                *(x for x, lab in zip(xs, self.is_labels) if not lab),
                *(B.array_of(s) for s in args[self.n_in:at]), B.array_of(args[at]), **params,
                **labels, reduction=reduction, normalize=normalize,
                workspace_bytes=workspace_bytes, precision=precision)
            if self.single:
                return B.tensor_of(grads)
            # (custom ops return tensors: an absent optional input's gradient is empty, and
            # so is the labels' placeholder)
            grads = iter(grads if isinstance(grads, tuple) else (grads,))  # (one array: z's)
            return tuple(x0.new_empty((0,)) if lab else
                         (lambda g: x0.new_empty((0,)) if g is None else B.tensor_of(g))(
                             next(grads)) for lab in self.is_labels)

    def _fwd_fake(self, args):
        x0 = args[0]
        reduction, normalize, _, _, fused = args[self.reduction_at:]
        params = args[self.n_in:self.reduction_at]
        rows = [args[i] for i in self.rows_at]
        accs = [None if self._skipped(params, i) else args[i] for i in self.rows_at]
        # (one tensor each: outputs never alias each other)
        scalars = tuple(x0.new_empty((), dtype=R.acc_dtype(x0.dtype)) if fused else R.empty(x0)
                        for _ in self.scalar_at)
        return ((R.loss_like(x0, reduction),) + tuple(R.stat_like(x0) for _ in self.stats)
                + tuple(R.acc_like(x, fused, x0) for x in accs)
                + tuple(R.norm_like(x, fused, normalize, x0) for x in rows) + scalars)

    def _skipped(self, params, i: int) -> bool:
        """Whether the fused forward skips the accumulator of the row input at argument
        ``i`` (its ``grad_param``'s value in ``params`` is 0.0)."""
        x = self.inputs[self.input_at.index(i)]
        return bool(x.grad_param) and not params[self.params.index(x.grad_param)]

    def _bwd_fake(self, args):
        x0 = args[0]
        out = []
        for i, x in zip(self.input_at, self.inputs):
            t = args[i]
            if isinstance(x, Labels):
                out.append(x0.new_empty((0,)))
            elif t is not None:
                out.append(t.new_empty(t.shape))
            elif isinstance(x, Scalar):  # (a real: 0-d in the accumulation dtype)
                out.append(x0.new_empty((), dtype=R.acc_dtype(x0.dtype)))
            else:
                out.append(x0.new_empty((0,)))
        return out[0] if self.single else tuple(out)

    # ---- autograd -----------------------------------------------------------------------
    def setup_context(self, ctx, inputs, output) -> None:
        """What the backward needs: with ``fused``, the accumulators, norms and scalar
        gradients (and the inputs, only to normalise through); otherwise the inputs (by
        reference) and the row statistics.  ``fused`` and ``precision`` may be absent from a
        direct Function's inputs (not passed)."""
        ctx.fused = R.fused_flag(inputs, self.fused_at)
        n_stats = len(self.stats)
        if ctx.fused:  # (+ the inputs, only to normalise through; not one whose gradient
            # the forward skipped: a detached queue may be written in place before backward)
            params = inputs[self.n_in:self.reduction_at]
            rows = [None if self._skipped(params, i) else inputs[i] for i in self.rows_at]
            ctx.dtypes = [None if x is None else x.dtype for x in rows]
            if not inputs[self.reduction_at + 1]:
                rows = self.no_rows
            ctx.save_for_backward(*rows, *output[1 + n_stats:])
        else:
            ctx.save_for_backward(*[inputs[i] for i in self.input_at], *output[1:1 + n_stats])
        if self.scalar_at:  # (their dtypes and shapes; their reals, for the backward op)
            ctx.meta = [None if inputs[i] is None else (inputs[i].dtype, inputs[i].shape)
                        for i in self.scalar_at]
            ctx.values = [inputs[i + 1] for i in self.scalar_at]
        # the backward op's other arguments: the params, the flags and the precision (the
        # backward op recomputes in the forward's)
        ctx.args = (*inputs[self.n_in:self.reduction_at + 3],
                    R.input_at(inputs, self.fused_at - 1))
        R.non_differentiable(ctx, *output[1:])

    def backward(self, ctx, grad_loss, *_grad_rest):
        """The inputs' gradients: the fused accumulators scaled by ``grad_loss``, or the
        backward op (``<module>.BWD``) on the saved inputs and statistics."""
        need = ctx.needs_input_grad
        grads = [None] * (self.fused_at + 1)
        if ctx.fused:
            R.refuse_double_backward()  # (also when only a scalar needs a gradient)
            saved = ctx.saved_tensors
            n = len(self.rows_at)
            normalize = ctx.args[len(self.params) + 1]
            direct = getattr(ctx, "direct", False)
            for j, i in enumerate(self.rows_at):
                if need[i]:
                    if self._skipped(ctx.args, i):  # (the op passes requires_grad: never)
                        raise RuntimeError(f"{self.name}: the forward skipped the gradient of "
                                           f"{self.inputs[self.input_at.index(i)].name} "
                                           "(it required none then); run the forward again")
                    grads[i] = R.scaled(saved[j], saved[2 * n + j], saved[n + j], grad_loss,
                                        ctx.dtypes[j], normalize, direct)
            for j, i in enumerate(self.scalar_at):
                if need[i]:  # the core's d(scalar) * g, cast to the tensor's dtype
                    dtype, shape = ctx.meta[j]
                    grads[i] = (saved[3 * n + j] * grad_loss).to(dtype).reshape(shape)
        elif any(need[i] for i in self.input_at):
            if self.strict:
                R.refuse_double_backward()
            saved = ctx.saved_tensors
            head, values = [], iter(getattr(ctx, "values", ()))
            for t, scalar in zip(saved, self.is_scalar):
                head.append(t)
                if scalar:
                    head.append(next(values))
            out = self.home.BWD(*head, *saved[len(self.inputs):], grad_loss.contiguous(),
                                *ctx.args)
            for j, i in enumerate(self.input_at):
                if need[i]:
                    grads[i] = out if self.single else out[j]
        return tuple(grads)

    def __call__(self, *args: Any) -> Tensor:
        """The public function's last step, on the checked arguments (``fwd``'s without
        ``fused``): the loss alone where no gradient will be asked of it, the direct Function
        in plain eager mode, else the registered op; ``fused`` (the gradient in the forward)
        where a gradient will be asked for and the reduction is "mean" / "sum"."""
        tensors = [args[i] for i in self.input_at]
        fused = R.fused(args[self.reduction_at], *tensors)
        if R.direct(*tensors):
            if not R.needs_grad(*tensors):
                return R.evaluate(self.evaluate, args)
            return self.Function.apply(*args, fused)
        return self.home.FWD(*args, fused)[0]


_EVALUATE_DOC = """The loss alone, for calls no gradient will be asked of (grad mode off,
or no input requiring one): the core's forward keeps no context, so repeated GPU calls replay
their graph (and, learnt, straight from the tensors: ``R.evaluate``)."""
