"""A sweep of odd inputs through every public op, NumPy arrays and CPU tensors (issue 52).

A newcomer's trial (221 odd inputs, CPU) found no crash and no silent wrong number; this keeps
it so.  Each case runs one op -- ``cupynce.<op>`` on NumPy arrays ("np") or
``cupynce.torch.<op>`` on CPU tensors ("torch") -- on inputs a user may well pass by mistake
or on purpose: empty arrays, one row, D = 0, NaN / inf, the wrong rank, mismatched shapes,
integer / bool / complex / 16-bit dtypes, strided views, bad temperatures and logit scales,
SPLADE masks that are not 0/1, bad flags.  The contract, per case, is one of:

* **raise**: ``ValueError`` or ``TypeError`` (the exact type is given) whose message starts
  with the op's name and names the offending argument as a word;
* **agree**: the result agrees with the float64 oracle (:mod:`cupynce.reference`) evaluated
  on the inputs as the op sees them (already rounded to their dtype), element by element,
  ``|got - want| <= rtol * (|want| + max |want|) + tiny`` with ``rtol`` from ``RTOL`` by the
  inputs' dtype and ``tiny`` its smallest normal number (a subnormal result, e.g. a gradient
  scaled by exp(-100), has no relative precision); NaN / ±inf exactly where the oracle has
  them (NaN and inf inputs are not scanned -- that would synchronise on the GPU -- they
  propagate as in the oracle, never into a finite number).  On the torch backend the
  gradients of every floating input that requires one (logit_scale / logit_bias tensors
  included) are compared the same way wherever the result and the oracle's gradients are
  finite (a NaN result's gradients are the op's business: SPLADE lets the NaN reach them, as
  its docstring says, where the oracle's zero terms stop it), SPLADE's only for float32 /
  float64 inputs (in 16 bits the arg-max may legitimately move to a position that ties after
  rounding; ``ops/test_splade.py`` checks that case with its own criterion).

``RTOL``: float64 1e-10, float32 1e-5 (the NumPy path measures ~5e-7 relative, see
``ops/test_contrastive.py``), float16 5e-3 and bfloat16 3e-2 (its fallbacks: a few
units of the dtype's rounding of the scores; the oracle sees the rounded inputs, not the
rounded scores).

About 330 cases: each op's ~30-40 inputs, on both backends (the torch one has its own checks
of scalars, flags and tensors before the core's, and adds the gradients).  Every case is tiny
(N <= 8, D <= 6): the sweep takes about ten seconds on two cores.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import ml_dtypes
import numpy as np
import pytest

import cupynce
from cupynce import _checks
from cupynce import reference as R

torch = pytest.importorskip("torch")
import cupynce.torch as ct  # noqa: E402

#: NaN / inf inputs make NumPy warn ("invalid value encountered in matmul"), as they should
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
RTOL = {F64: 1e-10, F32: 1e-5, F16: 5e-3, BF16: 3e-2}
BACKENDS = ("np", "torch")

#: each op's array arguments and scalar arguments, in call order, with valid defaults
ARRAYS = {"nt_xent": ("z",), "info_nce": ("query", "key"), "clip_loss": ("a", "b"),
          "siglip_loss": ("a", "b"), "splade_pool": ("x", "weight", "bias", "mask"),
          "flops_regularizer": ("out",)}
SCALARS = {"nt_xent": {"temperature": 0.5}, "info_nce": {"temperature": 0.2},
           "clip_loss": {"logit_scale": 2.0},
           "siglip_loss": {"logit_scale": 2.0, "logit_bias": -1.0},
           "splade_pool": {}, "flops_regularizer": {}}
LOSSES = ("nt_xent", "info_nce", "clip_loss", "siglip_loss")


def _x(shape, dtype=F32, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed + 7919 * len(shape) + sum(shape))
    d = shape[-1] if shape and shape[-1] else 1
    return (rng.standard_normal(shape) / math.sqrt(d)).astype(dtype)


def _arrays(op: str, dtype=F32, n: int = 4, d: int = 3) -> Dict[str, Any]:
    if op == "splade_pool":
        mask = np.ones((2, 4), bool)
        mask[1, 2:] = False
        return dict(x=_x((2, 4, d), dtype), weight=_x((5, d), dtype, 1), bias=_x((5,), dtype, 2),
                    mask=mask)
    if op == "flops_regularizer":
        return dict(out=np.abs(_x((3, 5), dtype)))
    return {name: _x((n, d), dtype, i) for i, name in enumerate(ARRAYS[op])}


@dataclass
class Case:
    op: str
    what: str
    arrays: Dict[str, Any]
    scalars: Dict[str, Any] = field(default_factory=dict)
    kw: Dict[str, Any] = field(default_factory=dict)
    #: None: agree with the oracle; else (exception type, names the message must hold)
    raises: Optional[Tuple[type, Tuple[str, ...]]] = None
    backends: Tuple[str, ...] = BACKENDS


def ok(op, what, arrays=None, scalars=None, **kw) -> Case:
    return Case(op, what, _arrays(op) if arrays is None else arrays,
                dict(SCALARS[op], **(scalars or {})), kw)


def bad(op, what, exc, names, arrays=None, scalars=None, backends=BACKENDS, **kw) -> Case:
    names = (names,) if isinstance(names, str) else tuple(names)
    return Case(op, what, _arrays(op) if arrays is None else arrays,
                dict(SCALARS[op], **(scalars or {})), kw, (exc, names), backends)


def _with(op, **changes) -> Dict[str, Any]:
    """The op's default arrays with some replaced (by a value, or a function of the old)."""
    arrs = _arrays(op)
    for k, v in changes.items():
        arrs[k] = v(arrs[k]) if callable(v) else v
    return arrs


def _set(x, index, value):
    x = x.copy()
    x[index] = value
    return x


# ------------------------------------------------------------------------------------------
# the cases
# ------------------------------------------------------------------------------------------
def _loss_cases(op):
    first = ARRAYS[op][0]
    paired = len(ARRAYS[op]) == 2
    n_min = 2 if op == "nt_xent" else 1
    yield ok(op, "f32")
    for dt in (F64, F16, BF16):
        yield ok(op, dt.name, _arrays(op, dt))
    yield ok(op, "normalize-none", normalize=True, reduction="none")
    yield ok(op, f"N={n_min}", _arrays(op, n=n_min))
    yield ok(op, "nan", _with(op, **{first: lambda x: _set(x, (1, 0), np.nan)}))
    yield ok(op, "inf", _with(op, **{first: lambda x: _set(x, (0, 2), np.inf)}))
    yield ok(op, "strided-cols", _with(op, **{first: lambda x: _x((4, 6), F32, 5)[:, ::2]}))
    if op == "siglip_loss":  # (its arrays go through clip_loss's checks: check_pairs)
        return
    # sizes
    if op == "nt_xent":
        yield bad(op, "N=3-odd", ValueError, "z", _arrays(op, n=3))
        yield bad(op, "N=1", ValueError, "z", _arrays(op, n=1))
    yield bad(op, "N=0", ValueError, first, _arrays(op, n=0))
    yield bad(op, "D=0", ValueError, first, _arrays(op, d=0))
    yield bad(op, "1-D", ValueError, first, _with(op, **{first: lambda x: x[:, 0]}))
    # dtypes
    yield bad(op, "int32", TypeError, first,
              {k: v.astype(np.int32) for k, v in _arrays(op).items()})
    yield bad(op, "complex64", TypeError, first, _with(op, **{first: lambda x: x + 1j * x}))
    if paired:
        second = ARRAYS[op][1]
        yield bad(op, "mixed-dtype", TypeError, (first, second),
                  _with(op, **{second: lambda x: x.astype(F64)}))
        yield bad(op, "rows-differ", ValueError, (first, second),
                  _with(op, **{second: _x((5, 3), F32, 9)}))
        yield bad(op, "D-differs", ValueError, (first, second),
                  _with(op, **{second: _x((4, 2), F32, 9)}))
        yield bad(op, "list", TypeError, second, _with(op, **{second: lambda x: x.tolist()}))
    yield ok(op, "fortran", _with(op, **{first: lambda x: np.asfortranarray(x)}))
    yield ok(op, "huge-normalized", _with(op, **{first: lambda x: x * np.float32(1e30)}),
             normalize=True)
    yield ok(op, "zero-row-normalized", _with(op, **{first: lambda x: _set(x, 1, 0.0)}),
             normalize=True)
    # flags
    yield bad(op, "reduction", ValueError, "reduction", reduction="avg")
    yield bad(op, "normalize-str", TypeError, "normalize", normalize="yes")
    if op == "info_nce":
        yield ok(op, "negatives-shared", negatives=_x((3, 3), F32, 4))
        yield ok(op, "negatives-paired", negatives=_x((4, 2, 3), F32, 4))
        yield bad(op, "negatives-N", ValueError, "negatives", negatives=_x((5, 2, 3), F32, 4))
        yield bad(op, "negatives-D", ValueError, "negatives", negatives=_x((3, 2), F32, 4))
        yield bad(op, "negatives-1D", ValueError, "negatives", negatives=_x((3,), F32, 4))
        yield bad(op, "negatives-f64", TypeError, "negatives", negatives=_x((3, 3), F64, 4))


def _temperature_cases(op):
    for v in (0.0, -0.5, float("nan"), float("inf")):
        yield bad(op, f"t={v}", ValueError, "temperature", scalars=dict(temperature=v))
    for v in ("0.5", None, True):
        yield bad(op, f"t={v!r}", TypeError, "temperature", scalars=dict(temperature=v))
    yield bad(op, "t-shape2", ValueError, "temperature",
              scalars=dict(temperature=np.array([0.5, 0.5])))
    yield ok(op, "t-np.float32", scalars=dict(temperature=np.float32(0.25)))
    yield ok(op, "t-0d-array", scalars=dict(temperature=np.asarray(0.25)))
    yield ok(op, "t=1e-3", scalars=dict(temperature=1e-3), normalize=True)


def _logit_scale_cases(op):
    # exp(logit_scale) must be finite in float32, for every dtype (float64 included): above
    # log(float32 max) = 88.72 (test_logit_scale_limit) is refused
    for v in (88.73, float("nan"), float("-inf")):
        yield bad(op, f"ls={v}", ValueError, "logit_scale", scalars=dict(logit_scale=v))
    yield bad(op, "ls=88.73-f64", ValueError, "logit_scale", _arrays(op, F64),
              scalars=dict(logit_scale=88.73))
    yield bad(op, "ls=100-f64-0d", ValueError, "logit_scale", _arrays(op, F64),
              scalars=dict(logit_scale=np.asarray(100.0)), backends=("np",))
    for v in ("2", True):
        yield bad(op, f"ls={v!r}", TypeError, "logit_scale", scalars=dict(logit_scale=v))
    # (no lower limit: exp(-100) underflows to 0 in float32, every logit is 0 (SigLIP: the
    # bias), the loss log N (SigLIP: the bias's), as the oracle's -- nothing to refuse)
    yield ok(op, "ls=-100", scalars=dict(logit_scale=-100.0))
    yield ok(op, "ls=88.7-f64", _arrays(op, F64), scalars=dict(logit_scale=88.7),
             normalize=True)
    yield ok(op, "ls-np.float64", scalars=dict(logit_scale=np.float64(1.5)))
    if op == "siglip_loss":
        yield bad(op, "lb=nan", ValueError, "logit_bias", scalars=dict(logit_bias=float("nan")))
        yield bad(op, "lb=str", TypeError, "logit_bias", scalars=dict(logit_bias="x"))
        yield ok(op, "lb=1e4", scalars=dict(logit_bias=1e4))


def _splade_cases():
    op = "splade_pool"
    yield ok(op, "f32")
    for dt in (F64, F16, BF16):
        yield ok(op, dt.name, _arrays(op, dt))
    yield ok(op, "relu", activation="relu")
    yield ok(op, "no-bias-no-mask", _with(op, bias=None, mask=None))
    for mdt in (np.uint8, np.float32, np.int64):
        yield ok(op, f"mask-{np.dtype(mdt).name}", _with(op, mask=lambda m: m.astype(mdt)))
    yield ok(op, "mask-all-zero-row", _with(op, mask=lambda m: _set(m, 0, False)))
    for v in (2.0, -1.0, 0.5, np.nan):
        yield bad(op, f"mask={v}", ValueError, "mask",
                  _with(op, mask=lambda m: _set(m.astype(F32), (0, 1), v)))
    yield bad(op, "mask-shape", ValueError, "mask", _with(op, mask=np.ones((4, 2), bool)))
    yield bad(op, "mask-complex", TypeError, "mask",
              _with(op, mask=lambda m: m.astype(np.complex64)))
    yield bad(op, "B=0", ValueError, "x", _with(op, x=_x((0, 4, 3)), mask=None))
    yield bad(op, "L=0", ValueError, "x", _with(op, x=_x((2, 0, 3)), mask=None))
    yield bad(op, "V=0", ValueError, "weight", _with(op, weight=_x((0, 3)), bias=None))
    yield bad(op, "x-2D", ValueError, "x", _with(op, x=_x((2, 3))))
    yield bad(op, "weight-DxV", ValueError, "weight", _with(op, weight=lambda w: w.T.copy()))
    yield bad(op, "bias-shape", ValueError, "bias", _with(op, bias=_x((4,))))
    yield ok(op, "weight-T-view", _with(op, weight=lambda w: w.T.copy().T))
    yield ok(op, "x-strided", _with(op, x=lambda x: _x((2, 4, 6), F32, 3)[:, :, ::2]))
    yield bad(op, "x-int", TypeError, "x",
              _with(op, x=lambda x: x.astype(np.int32), weight=lambda w: w.astype(np.int32),
                    bias=None))
    yield bad(op, "mixed-dtype", TypeError, "weight", _with(op, weight=lambda w: w.astype(F64)))
    yield ok(op, "x-nan", _with(op, x=lambda x: _set(x, (0, 1, 0), np.nan)))
    yield ok(op, "x-nan-masked", _with(op, x=lambda x: _set(x, (1, 3, 0), np.nan)))
    yield bad(op, "activation", ValueError, "activation", activation="gelu")
    op = "flops_regularizer"
    yield ok(op, "f32")
    yield ok(op, "f64", dict(out=np.abs(_x((3, 5), F64))))
    yield ok(op, "nan", dict(out=_set(np.abs(_x((3, 5))), (1, 1), np.nan)))
    yield bad(op, "1-D", ValueError, "out", dict(out=_x((5,))))
    yield bad(op, "B=0", ValueError, "out", dict(out=_x((0, 5))))
    yield bad(op, "int", TypeError, "out", dict(out=np.ones((3, 5), np.int32)))


def _torch_only_cases():
    """Arguments only cupynce.torch takes: tensors as scalars."""
    for op in ("nt_xent", "info_nce"):
        yield ok(op, "t-tensor", scalars=dict(temperature=torch.tensor(0.25)))
        yield ok(op, "t-tensor-grad",  # (a learnable temperature: its gradient too)
                 scalars=dict(temperature=torch.tensor(0.25, requires_grad=True)))
    for op in ("clip_loss", "siglip_loss"):
        yield ok(op, "ls-tensor-grad",
                 scalars=dict(logit_scale=torch.tensor(1.5, requires_grad=True)))
        yield ok(op, "ls-tensor-(1,)", scalars=dict(logit_scale=torch.tensor([1.5])))
        yield bad(op, "ls-tensor-88.73", ValueError, "logit_scale",
                  scalars=dict(logit_scale=torch.tensor(88.73)))
        yield bad(op, "ls-tensor-f64-100", ValueError, "logit_scale", _arrays(op, F64),
                  scalars=dict(logit_scale=torch.tensor(100.0, dtype=torch.float64)))
        yield bad(op, "ls-tensor-(2,)", ValueError, "logit_scale",
                  scalars=dict(logit_scale=torch.tensor([1.0, 2.0])))
    yield ok("siglip_loss", "lb-tensor-grad",
             scalars=dict(logit_bias=torch.tensor(-2.0, requires_grad=True)))


def _all_cases():
    out = []
    for op in LOSSES:
        out += list(_loss_cases(op))
        out += list(_temperature_cases(op) if op in ("nt_xent", "info_nce")
                    else _logit_scale_cases(op))
    out += list(_splade_cases())
    params = [pytest.param(c, b, id=f"{b}-{c.op}-{c.what}") for c in out for b in c.backends]
    params += [pytest.param(c, "torch", id=f"torch-{c.op}-{c.what}")
               for c in _torch_only_cases()]
    return params


CASES = _all_cases()


# ------------------------------------------------------------------------------------------
# running a case
# ------------------------------------------------------------------------------------------
def _tensor(x: Any, grad: bool) -> Any:
    """A NumPy input as a CPU tensor (bfloat16 through float32: the same values); a leaf that
    requires grad for floating arrays when ``grad``."""
    if not isinstance(x, np.ndarray):
        return x
    if x.dtype == BF16:
        t = torch.from_numpy(x.astype(F32)).to(torch.bfloat16)
    else:
        t = torch.from_numpy(x)  # (a strided NumPy view stays a strided tensor)
    if grad and t.is_floating_point() and t.numel():
        t.requires_grad_(True)
    return t


def _run(case: Case, backend: str):
    """(result as float64, {name: grad as float64}) of the op on ``backend``."""
    names = ARRAYS[case.op]
    if backend == "np":
        fn = getattr(cupynce, case.op)
        args = [case.arrays[k] for k in names] + list(case.scalars.values())
        return np.asarray(fn(*args, **case.kw), dtype=np.float64), {}
    want_grad = case.raises is None
    leaves = {k: _tensor(case.arrays[k], want_grad and k != "mask") for k in names}
    kw = {k: _tensor(v, want_grad) for k, v in case.kw.items()}
    if isinstance(kw.get("negatives"), torch.Tensor):
        leaves["negatives"] = kw["negatives"]
    args = [leaves[k] for k in names] + list(case.scalars.values())
    out = getattr(ct, case.op)(*args, **kw)
    for k, v in case.scalars.items():
        if isinstance(v, torch.Tensor) and v.requires_grad:
            leaves[k] = v
    wrt = {k: t for k, t in leaves.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    grads = {}
    if wrt:
        gs = torch.autograd.grad(out.sum(), list(wrt.values()), allow_unused=True)
        grads = {k: g.double().numpy() for k, g in zip(wrt, gs) if g is not None}
    return out.detach().double().numpy(), grads


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def _scalar(v):
    return float(v.detach()) if isinstance(v, torch.Tensor) else float(np.asarray(v))


def _oracle(case: Case):
    """(the float64 oracle's result, {name: its gradient}) on the inputs as given."""
    a = {k: _f64(v) for k, v in case.arrays.items()}
    s = {k: _scalar(v) for k, v in case.scalars.items()}
    kw = dict(case.kw)
    if case.op == "splade_pool":
        out, (dx, dw, db) = R.splade_pool(a["x"], a["weight"], a["bias"], a["mask"],
                                          kw.get("activation", "log1p_relu"))
        return out, {"x": dx, "weight": dw, "bias": db}
    if case.op == "flops_regularizer":
        value, dout = R.flops_regularizer(a["out"])
        return value, {"out": dout}
    if "negatives" in kw:
        kw["negatives"] = _f64(kw["negatives"])
    t = case.scalars.get("temperature")
    if isinstance(t, torch.Tensor) and t.requires_grad:
        kw["temperature_grad"] = True  # (the oracle's dτ, last)
    fn = getattr(R, case.op)
    loss, grads = fn(*(a[k] for k in ARRAYS[case.op]), *s.values(), **kw)
    names = list(ARRAYS[case.op]) + (["negatives"] if case.op == "info_nce" else []) \
        + list(case.scalars)
    return loss, dict(zip(names, grads))


def _agree(got, want, rtol, tiny, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, oracle {want.shape}"
    same_nan = np.isnan(got) == np.isnan(want)
    assert same_nan.all(), f"{what}: NaN at {np.argwhere(~same_nan)[:4].tolist()} " \
                           f"(got {got}, oracle {want})"
    inf = np.isinf(want)
    assert np.array_equal(got[inf], want[inf]), f"{what}: inf differs (got {got}, {want})"
    fin = np.isfinite(want)
    assert np.isfinite(got[fin]).all(), f"{what}: non-finite where the oracle is finite"
    if not fin.any():
        return
    g, w = got[fin], want[fin]
    bound = rtol * (np.abs(w) + np.abs(w).max()) + tiny
    err = np.abs(g - w)
    worst = int(np.argmax(err - bound))
    assert (err <= bound).all(), (f"{what}: |got - oracle| = {err[worst]:.3g} > "
                                  f"{bound[worst]:.3g} (got {g[worst]!r}, oracle {w[worst]!r})")


def _dtype(case: Case) -> np.dtype:
    first = case.arrays[ARRAYS[case.op][0]]
    return np.dtype(first.dtype)


@pytest.mark.parametrize("case, backend", CASES)
def test_odd_input(case: Case, backend: str):
    if case.raises is not None:
        exc, names = case.raises
        with pytest.raises((TypeError, ValueError)) as info:
            _run(case, backend)
        msg = str(info.value)
        assert info.type is exc, f"{info.type.__name__} (not {exc.__name__}): {msg}"
        assert msg.startswith(f"{case.op}: "), msg
        for name in names:
            assert re.search(rf"\b{re.escape(name)}\b", msg), f"{name!r} not named: {msg}"
        return
    got, grads = _run(case, backend)
    want, want_grads = _oracle(case)
    dt = _dtype(case)
    rtol, tiny = RTOL[dt], float(ml_dtypes.finfo(dt).tiny)
    _agree(got, want, rtol, tiny, f"{case.op} {case.what} ({backend})")
    if case.op == "splade_pool" and rtol > RTOL[F32]:
        return  # (16-bit arg-max: see the module notes)
    if not np.isfinite(got).all():
        return  # (a NaN / inf result: see the module notes)
    for name, g in grads.items():
        w = want_grads[name]
        if np.isfinite(w).all():
            _agree(g, w, rtol, tiny, f"{case.op} {case.what} ({backend}): d{name}")


def test_the_sweep_is_a_sweep():
    """The parametrisation holds what the module notes promise (and not a handful)."""
    ops = {c.values[0].op for c in CASES}
    assert ops == set(ARRAYS), ops
    assert 150 <= len(CASES) <= 350, len(CASES)
    assert {p.values[1] for p in CASES} == set(BACKENDS)


def test_logit_scale_limit():
    """One limit for every dtype: exp(logit_scale) finite in float32 (88.72, not float64's
    709.78); the sweep's ls=88.73 cases are just above it, ls=88.7 just below."""
    assert _checks.LOG_SCALE_LIMIT == math.log(float(np.finfo(np.float32).max))
    assert 88.7 < _checks.LOG_SCALE_LIMIT < 88.73
