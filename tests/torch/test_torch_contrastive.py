"""``cupynce.torch`` on CPU tensors (the NumPy path behind the torch ops); runs in CI.

What is checked, for every function (nt_xent, info_nce, clip_loss) and module:

* loss and the gradient of every tensor input against torch autograd of the plain formula
  (``tests/torch_oracle.py``) in float64, every reduction (a ``grad_output`` that is not 1,
  and a random per-row one for "none"), normalize on/off, negatives none/shared/paired,
  logit_scale as a real, a 0-d and a (1,) tensor — through the custom ops and through the
  ``autograd.Function`` fallback used on torch < 2.4;
* ``torch.autograd.gradcheck`` (float64) for every function and every tensor input;
* the bridge is bit-exact: the same bits as the functional API on the same NumPy arrays, for
  float16 / bfloat16 / float32 / float64, and zero-copy (the core sees the tensor's memory);
* the forward saves only the inputs and the O(N) row statistics, and nothing without grad;
* bad input: the functional API's exceptions and messages, plus the torch-only ones;
* torch.autocast (CPU, bfloat16); torch.compile(fullgraph=True) of a training step (forward
  and backward ops traced, no graph break); ``torch.library.opcheck`` of every op;
* the modules: defaults, attributes, the temperature property, clamping, state_dict.

Tolerances (relative norm error against the float64 oracle on the same inputs):
float64 1e-12; float32 1e-5 (the NumPy path measures ~5e-7, see ops/test_contrastive.py).
"""
from __future__ import annotations

import math
import types
import zlib

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch._dynamo.testing  # noqa: E402  (CompileCounterWithBackend)

import cupynce  # noqa: E402
import cupynce.torch as ct  # noqa: E402
import cupynce.config as cfg  # noqa: E402
from cupynce.ops import _cpu  # noqa: E402
from cupynce.ops import clip as core_clip  # noqa: E402
from cupynce.ops import nt_xent as core_nt_xent  # noqa: E402
from cupynce.torch import _registry  # noqa: E402
from cupynce.torch._cpu import TORCH  # noqa: E402
from cupynce.torch.ops import clip as tclip  # noqa: E402
from cupynce.torch.ops import info_nce as tinfo_nce  # noqa: E402
from cupynce.torch.ops import nt_xent as tnt_xent  # noqa: E402

import torch_oracle as oracle  # noqa: E402  (its folder is on sys.path: conftest)

REDUCTIONS = ("mean", "sum", "none")
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]
#: op: the public function (eager: the direct autograd.Function path); registered: the same
#: function through the registered custom ops (what torch.compile / autocast / modes take);
#: fallback: the Functions called as on torch < 2.4
PATHS = ("op", "registered", "fallback")
NT_T, INFO_T, CLIP_LS = 0.3, 0.2, 2.5
M_NEG = 3


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------
def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(g, shape, dtype=torch.float64) -> torch.Tensor:
    return (torch.randn(shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-1])).to(dtype)


def _grad_output(g, reduction, n, dtype):
    if reduction == "none":
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.tensor(0.7, dtype=dtype)


def _leaf(x, dtype=None):
    if x is None or not isinstance(x, torch.Tensor):
        return x
    return x.detach().to(dtype or x.dtype).requires_grad_(True)


@pytest.fixture
def plain_backward(monkeypatch):
    """The fallback exactly as on torch < 2.4: backward calls the plain functions, no ops."""
    for mod in (tnt_xent, tinfo_nce, tclip):
        monkeypatch.setattr(mod, "BWD", mod.bwd)


def _registered(fn):
    """``fn`` with the direct eager path switched off: the call runs the custom ops."""
    def call(*args, **kwargs):
        real = _registry.direct
        _registry.direct = lambda *tensors: False
        try:
            return fn(*args, **kwargs)
        finally:
            _registry.direct = real
    return call


def _nt_xent(path):
    if path == "registered":
        return _registered(ct.nt_xent)
    if path == "op":
        return ct.nt_xent
    return lambda z, t=0.5, *, reduction="mean", normalize=False: \
        tnt_xent.NTXentFunction.apply(z, None, t, 0.0, reduction, normalize, None)


def _info_nce(path):
    if path == "registered":
        return _registered(ct.info_nce)
    if path == "op":
        return ct.info_nce
    return lambda q, k, t=0.1, *, negatives=None, reduction="mean", normalize=False: \
        tinfo_nce.InfoNCEFunction.apply(q, k, None, t, negatives, None, 0.0, 0.0, 0.0, 1.0,
                                        0.0, float(negatives is not None), reduction,
                                        normalize, None)


def _clip_loss(path):
    if path == "registered":
        return _registered(ct.clip_loss)
    if path == "op":
        return ct.clip_loss

    def fallback(a, b, ls, *, reduction="mean", normalize=False):
        tensor = isinstance(ls, torch.Tensor)
        return tclip.ClipLossFunction.apply(a, b, ls if tensor else None,
                                            0.0 if tensor else float(ls), None, 0.0,
                                            reduction, normalize, None)
    return fallback


def _compare(what, got, ref, dtype, *, names):
    """got / ref: (loss, [grads]) — same shapes, output dtypes, errors within TOL[dtype]."""
    tol = TOL[dtype]
    loss, grads = got
    rloss, rgrads = ref
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), what
    assert loss.shape == rloss.shape, (what, loss.shape, rloss.shape)
    err = oracle.rel_err(loss, rloss)
    assert err <= tol, f"{what}: loss rel err {err:.3e} > {tol:.0e}"
    for name, gx, rx in zip(names, grads, rgrads):
        if rx is None:
            assert gx is None, (what, name)
            continue
        assert gx.shape == rx.shape and gx.dtype == dtype, (what, name, gx.shape, gx.dtype)
        err = oracle.rel_err(gx, rx)
        assert err <= tol, f"{what}: d{name} rel err {err:.3e} > {tol:.0e}"


# ----------------------------------------------------------------------------------------
# loss and gradients against torch autograd of the plain formula (float64 oracle)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 5), (42, 33)], ids=str)
def test_nt_xent_matches_torch(shape, dtype, reduction, normalize, path, plain_backward):
    g = _gen("nt", shape, reduction, normalize)
    z = _randn(g, shape, dtype)
    go = _grad_output(g, reduction, shape[0], dtype)
    kw = dict(reduction=reduction, normalize=normalize)
    got = oracle.loss_and_grads(lambda z: _nt_xent(path)(z, NT_T, **kw), [_leaf(z)], go)
    ref = oracle.loss_and_grads(lambda z: oracle.nt_xent(z, NT_T, **kw),
                                [_leaf(z, torch.float64)], go.double())
    _compare(f"nt_xent {shape} {dtype} {kw} {path}", got, ref, dtype, names=["z"])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neg", [None, "shared", "paired"])
def test_info_nce_matches_torch(neg, dtype, reduction, normalize, path, plain_backward):
    n, d = 41, 33
    g = _gen("info", neg, reduction, normalize)
    q, k = _randn(g, (n, d), dtype), _randn(g, (n, d), dtype)
    negs = {None: None, "shared": (M_NEG, d), "paired": (n, M_NEG, d)}[neg]
    negs = None if negs is None else _randn(g, negs, dtype)
    go = _grad_output(g, reduction, n, dtype)
    kw = dict(reduction=reduction, normalize=normalize)
    fn = _info_nce(path)
    got = oracle.loss_and_grads(lambda q, k, x: fn(q, k, INFO_T, negatives=x, **kw),
                                [_leaf(q), _leaf(k), _leaf(negs)], go)
    ref = oracle.loss_and_grads(lambda q, k, x: oracle.info_nce(q, k, INFO_T, negatives=x, **kw),
                                [_leaf(x, torch.float64) for x in (q, k, negs)], go.double())
    _compare(f"info_nce {neg} {dtype} {kw} {path}", got, ref, dtype,
             names=["query", "key", "negatives"])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ls_kind", ["float", "0d", "1d"])
def test_clip_loss_matches_torch(ls_kind, dtype, reduction, normalize, path, plain_backward):
    n, d = 41, 33
    g = _gen("clip", ls_kind, reduction, normalize)
    a, b = _randn(g, (n, d), dtype), _randn(g, (n, d), dtype)
    go = _grad_output(g, reduction, n, dtype)
    kw = dict(reduction=reduction, normalize=normalize)
    # logit_scale stays float32 (a Parameter's usual dtype) whatever a and b are
    ls = {"float": CLIP_LS, "0d": torch.tensor(CLIP_LS), "1d": torch.tensor([CLIP_LS])}[ls_kind]
    fn = _clip_loss(path)
    got = oracle.loss_and_grads(lambda a, b, s: fn(a, b, s, **kw), [_leaf(a), _leaf(b), _leaf(ls)],
                                go)
    ref = oracle.loss_and_grads(lambda a, b, s: oracle.clip_loss(a, b, s, **kw),
                                [_leaf(a, torch.float64), _leaf(b, torch.float64),
                                 _leaf(ls, torch.float64)], go.double())
    loss, (da, db, dls) = got
    _compare(f"clip_loss {ls_kind} {dtype} {kw} {path}", (loss, [da, db]),
             (ref[0], ref[1][:2]), dtype, names=["a", "b"])
    if isinstance(ls, torch.Tensor):  # dlogit_scale: logit_scale's shape and dtype
        assert dls.shape == ls.shape and dls.dtype == ls.dtype
        err = oracle.rel_err(dls, ref[1][2])
        tol = 1e-5 if ls.dtype == torch.float32 else TOL[dtype]  # float32 output
        assert err <= max(tol, TOL[dtype]), f"dlogit_scale rel err {err:.3e}"
    else:
        assert dls is None


def test_none_reduction_with_expanded_grad_output():
    """``loss.sum().backward()`` hands the op a stride-0 grad_output; same as reduction="sum"."""
    g = _gen("expanded")
    z = _leaf(_randn(g, (10, 4)))
    (d_none,) = torch.autograd.grad(ct.nt_xent(z, reduction="none").sum(), z)
    (d_sum,) = torch.autograd.grad(ct.nt_xent(z, reduction="sum"), z)
    torch.testing.assert_close(d_none, d_sum, rtol=1e-13, atol=0)


def test_non_contiguous_inputs():
    g = _gen("views")
    base = _randn(g, (12, 10))
    z_view = base.T.contiguous().T[:, ::2]  # column-major, every other column
    z_copy = z_view.contiguous()
    for z in (z_view, z_copy):
        assert z.shape == (12, 5)
    za, zb = _leaf(z_view), _leaf(z_copy)
    la, lb = ct.nt_xent(za, normalize=True), ct.nt_xent(zb, normalize=True)
    torch.testing.assert_close(la, lb, rtol=1e-14, atol=0)
    torch.testing.assert_close(torch.autograd.grad(la, za)[0], torch.autograd.grad(lb, zb)[0],
                               rtol=1e-13, atol=0)


# ----------------------------------------------------------------------------------------
# gradcheck: every function, every tensor input (float64)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck_nt_xent(reduction, normalize, path, plain_backward):
    z = _leaf(_randn(_gen("gc-nt"), (6, 4)))
    fn = _nt_xent(path)
    assert torch.autograd.gradcheck(
        lambda z: fn(z, NT_T, reduction=reduction, normalize=normalize), (z,))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("neg", [None, "shared", "paired"])
def test_gradcheck_info_nce(neg, normalize, path, plain_backward):
    g = _gen("gc-info", neg)
    n, d = 5, 3
    q, k = _leaf(_randn(g, (n, d))), _leaf(_randn(g, (n, d)))
    negs = {None: None, "shared": (2, d), "paired": (n, 2, d)}[neg]
    inputs = (q, k) if negs is None else (q, k, _leaf(_randn(g, negs)))
    fn = _info_nce(path)
    red = "sum" if normalize else "none"
    assert torch.autograd.gradcheck(
        lambda q, k, x=None: fn(q, k, INFO_T, negatives=x, reduction=red, normalize=normalize),
        inputs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("ls_shape", [(), (1,)], ids=["0d", "1d"])
def test_gradcheck_clip_loss(ls_shape, normalize, path, plain_backward):
    g = _gen("gc-clip", ls_shape)
    a, b = _leaf(_randn(g, (5, 3))), _leaf(_randn(g, (5, 3)))
    ls = _leaf(torch.full(ls_shape, 1.3, dtype=torch.float64))
    fn = _clip_loss(path)
    red = "mean" if normalize else "none"
    assert torch.autograd.gradcheck(
        lambda a, b, s: fn(a, b, s, reduction=red, normalize=normalize), (a, b, ls))


def test_gradcheck_modules_and_function():
    g = _gen("gc-mod")
    z = _leaf(_randn(g, (6, 4)))
    assert torch.autograd.gradcheck(lambda z: ct.InfoNCEFunction.apply(z, 0.5, False), (z,))
    assert torch.autograd.gradcheck(ct.NTXentLoss(0.4, normalize=True), (z,))
    q, k, x = (_leaf(_randn(g, s)) for s in ((4, 3), (4, 3), (4, 2, 3)))
    assert torch.autograd.gradcheck(ct.InfoNCE(0.3, negative_mode="paired"), (q, k, x))
    clip = ct.ClipLoss(0.2).double()
    a, b = _leaf(_randn(g, (4, 3))), _leaf(_randn(g, (4, 3)))
    assert torch.autograd.gradcheck(clip, (a, b))
    # ... and the Parameter: the module's gradient is the function's at the same value
    loss = clip(a, b)
    (dls,) = torch.autograd.grad(loss, clip.logit_scale)
    s = _leaf(clip.logit_scale.detach())
    (dref,) = torch.autograd.grad(oracle.clip_loss(a, b, s, normalize=True), s)
    torch.testing.assert_close(dls, dref, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------
# the bridge: bit-exact against the functional API, zero copy, minimal saved state
# ----------------------------------------------------------------------------------------
def _to_torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def _bits(t) -> np.ndarray:
    t = torch.as_tensor(t) if not isinstance(t, torch.Tensor) else t
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.detach().numpy()


@pytest.mark.parametrize("cpu_torch", [True, False], ids=["on-torch", "on-numpy"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "registered"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64],
                         ids=["f16", "bf16", "f32", "f64"])
def test_bridge_is_bit_exact(dtype, reduction, direct, cpu_torch, monkeypatch):
    """The torch ops hand the core the tensors' bits and return the core's bits: for "mean"
    the core's fused forward and its backward (the gradient computed in the forward, scaled
    in the backward), for "none" the O(N)-state backward.  Both eager routes (the direct
    Functions and the registered custom ops) give the same bits.  The core's CPU primitives
    run on torch's functions in a torch call (config ``cpu_torch``), so the functional API is
    called on the same namespace here (``ops._cpu.using``)."""
    if not direct:
        monkeypatch.setattr(_registry, "direct", lambda *tensors: False)
    # (the scope for the functional calls; the torch ops open their own)
    with cfg.override(cpu_torch=cpu_torch), _cpu.using(TORCH if cpu_torch else _cpu.NUMPY):
        _bit_exact(dtype, reduction)


def _bit_exact(dtype, reduction):
    rng = np.random.default_rng(7)
    n, d = 10, 6
    arr = {k: (rng.standard_normal(s) / 3).astype(dtype)
           for k, s in dict(z=(n, d), q=(n, d), k=(n, d), neg=(n, 2, d), a=(n, d), b=(n, d)).items()}
    t = {k: _to_torch(v).requires_grad_(True) for k, v in arr.items()}
    acc = np.float64 if dtype == np.float64 else np.float32
    go = rng.standard_normal(n).astype(acc) if reduction == "none" else acc(0.7)
    kw = dict(reduction=reduction, normalize=True)

    def check(loss_t, leaves, loss_np, want_grads):
        np.testing.assert_array_equal(_bits(loss_t), np.asarray(loss_np))
        grads = torch.autograd.grad(loss_t, leaves, torch.as_tensor(go))
        for gt, gn in zip(grads, want_grads):
            np.testing.assert_array_equal(_bits(gt), _bits(_to_torch(np.asarray(gn))))

    fused = reduction == "mean"
    loss, ctx = cupynce.nt_xent_forward(arr["z"], NT_T, **kw)
    check(ct.nt_xent(t["z"], NT_T, **kw), [t["z"]], loss,
          [cupynce.nt_xent_backward(ctx, go)] if fused else
          [cupynce.nt_xent_backward_from_stats(arr["z"], ctx.stats[0], go, temperature=NT_T,
                                               **kw)])
    loss, ctx = cupynce.info_nce_forward(arr["q"], arr["k"], INFO_T, negatives=arr["neg"], **kw)
    check(ct.info_nce(t["q"], t["k"], INFO_T, negatives=t["neg"], **kw),
          [t["q"], t["k"], t["neg"]], loss,
          cupynce.info_nce_backward(ctx, go) if fused else
          cupynce.info_nce_backward_from_stats(arr["q"], arr["k"], arr["neg"], ctx.stats[0], go,
                                               temperature=INFO_T, **kw))
    ls_np = np.asarray(CLIP_LS, np.float32)
    ls_t = torch.tensor(CLIP_LS, requires_grad=True)
    loss, ctx = cupynce.clip_loss_forward(arr["a"], arr["b"], ls_np, **kw)
    check(ct.clip_loss(t["a"], t["b"], ls_t, **kw), [t["a"], t["b"], ls_t], loss,
          cupynce.clip_loss_backward(ctx, go) if fused else
          cupynce.clip_loss_backward_from_stats(arr["a"], arr["b"], ls_np, *ctx.stats, go, **kw))


def test_zero_copy_on_cpu(monkeypatch):
    """The core reads the tensor's own memory (no host copy), bfloat16 included."""
    seen = []
    real = core_nt_xent.nt_xent_forward

    def spy(z, *args, **kw):
        seen.append((z.dtype, z.__array_interface__["data"][0]))
        return real(z, *args, **kw)

    monkeypatch.setattr(core_nt_xent, "nt_xent_forward", spy)
    for dtype in (torch.float32, torch.bfloat16):
        z = torch.randn(8, 4).to(dtype).requires_grad_(True)
        ct.nt_xent(z)
        assert seen[-1][1] == z.data_ptr()
    assert seen[-1][0] == ml_dtypes.bfloat16


def test_forward_saves_only_what_backward_needs():
    """reduction="none": the inputs (by reference) and the O(N) row / column statistics.
    "mean" / "sum" (gradient in the forward): the (N, D) gradient accumulators, and the
    inputs and row norms only to normalise through (normalize=True) -- never N x N."""
    n, d = 10, 4
    g = _gen("saved")
    a, b = _leaf(_randn(g, (n, d))), _leaf(_randn(g, (n, d)))
    ls = _leaf(torch.tensor(2.0, dtype=torch.float64))
    inputs = {a.data_ptr(), b.data_ptr(), ls.data_ptr()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        ct.clip_loss(a, b, ls, normalize=True, reduction="none")
    stats = [x for x in saved if x.data_ptr() not in inputs]
    assert {x.data_ptr() for x in saved} >= inputs
    assert [tuple(x.shape) for x in stats] == [(n,), (n,)], [x.shape for x in saved]
    for normalize in (True, False):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x,
                                                      lambda x: x):
            ct.clip_loss(a, b, ls, normalize=normalize)
        shapes = sorted(tuple(x.shape) for x in saved if x.data_ptr() not in inputs
                        and x.numel() > 0)
        want = [(), (n,), (n,), (n, d), (n, d)] if normalize else [(), (n, d), (n, d)]
        assert shapes == want, shapes
        assert ({x.data_ptr() for x in saved} >= {a.data_ptr(), b.data_ptr()}) == normalize
        assert ls.data_ptr() not in {x.data_ptr() for x in saved}
    # nothing at all without a gradient to compute
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        with torch.no_grad():
            ct.nt_xent(a)
        ct.info_nce(a.detach(), b.detach())
    assert saved == []


# ----------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------
def _np(*shape, dtype=np.float32):
    return np.ones(shape, dtype)


def _tt(*shape, dtype=np.float32):
    return torch.from_numpy(_np(*shape, dtype=dtype))


# (id, call(make)) — make(*shape, dtype=...) builds a NumPy array or a tensor
SAME_ERRORS = [
    ("nt-3d", lambda m: cupynce_or_torch(m).nt_xent(m(2, 4, 3))),
    ("nt-odd", lambda m: cupynce_or_torch(m).nt_xent(m(5, 3))),
    ("nt-1row", lambda m: cupynce_or_torch(m).nt_xent(m(1, 3))),
    ("nt-int", lambda m: cupynce_or_torch(m).nt_xent(m(4, 3, dtype=np.int64))),
    ("nt-t0", lambda m: cupynce_or_torch(m).nt_xent(m(4, 3), 0.0)),
    ("nt-tnan", lambda m: cupynce_or_torch(m).nt_xent(m(4, 3), float("nan"))),
    ("nt-tstr", lambda m: cupynce_or_torch(m).nt_xent(m(4, 3), "0.5")),
    ("nt-red", lambda m: cupynce_or_torch(m).nt_xent(m(4, 3), reduction="avg")),
    ("nt-ws", lambda m: cupynce_or_torch(m).nt_xent(m(4, 3), workspace_bytes=0)),
    ("info-rows", lambda m: cupynce_or_torch(m).info_nce(m(4, 3), m(5, 3))),
    ("info-d", lambda m: cupynce_or_torch(m).info_nce(m(4, 3), m(4, 2))),
    ("info-neg4d", lambda m: cupynce_or_torch(m).info_nce(m(4, 3), m(4, 3),
                                                          negatives=m(1, 4, 2, 3))),
    ("info-negd", lambda m: cupynce_or_torch(m).info_nce(m(4, 3), m(4, 3), negatives=m(2, 5))),
    ("info-negn", lambda m: cupynce_or_torch(m).info_nce(m(4, 3), m(4, 3),
                                                         negatives=m(3, 2, 3))),
    ("info-mixed", lambda m: cupynce_or_torch(m).info_nce(m(4, 3), m(4, 3, dtype=np.float64))),
    ("clip-shape", lambda m: cupynce_or_torch(m).clip_loss(m(4, 3), m(5, 3), 1.0)),
    ("clip-ls2", lambda m: cupynce_or_torch(m).clip_loss(m(4, 3), m(4, 3), m(2))),
    ("clip-lsint", lambda m: cupynce_or_torch(m).clip_loss(m(4, 3), m(4, 3),
                                                           m(1, dtype=np.int64))),
    ("clip-lsnan", lambda m: cupynce_or_torch(m).clip_loss(m(4, 3), m(4, 3), float("inf"))),
    ("clip-lsbool", lambda m: cupynce_or_torch(m).clip_loss(m(4, 3), m(4, 3), True)),
    ("clip-mixed", lambda m: cupynce_or_torch(m).clip_loss(m(4, 3, dtype=np.float16), m(4, 3), 1.)),
]


def cupynce_or_torch(make):
    return ct if make is _tt else cupynce


@pytest.mark.parametrize("case", SAME_ERRORS, ids=[c[0] for c in SAME_ERRORS])
def test_same_errors_as_functional_api(case):
    _, call = case
    with pytest.raises((TypeError, ValueError)) as want:
        call(_np)
    with pytest.raises(want.type) as got:
        call(_tt)
    assert str(got.value) == str(want.value)


def test_torch_only_errors():
    z = torch.ones(4, 3)
    with pytest.raises(TypeError, match=r"nt_xent: z must be a torch\.Tensor, got numpy\.ndarray "
                                        r"\(for NumPy / CuPy arrays use cupynce\.nt_xent\)"):
        ct.nt_xent(np.ones((4, 3), np.float32))
    with pytest.raises(TypeError, match=r"info_nce: key is required"):
        ct.info_nce(z, None)
    with pytest.raises(TypeError, match=r"info_nce: negatives must be a torch\.Tensor, got builtins"):
        ct.info_nce(z, z, negatives=[[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match=r"info_nce: all tensors must be on one device, got "
                                         r"query on cpu, key on meta"):
        ct.info_nce(z, torch.ones(4, 3, device="meta"))
    with pytest.raises(ValueError, match=r"clip_loss: all tensors must be on one device, got a on "
                                         r"cpu, b on cpu, logit_scale on meta"):
        ct.clip_loss(z, z, torch.ones((), device="meta"))
    with pytest.raises(ValueError, match=r"nt_xent: tensors must be on the CPU or a CUDA GPU, got "
                                         r"meta"):
        ct.nt_xent(torch.ones(4, 3, device="meta"))
    with pytest.raises(TypeError, match=r"clip_loss: logit_scale must be a real number or a "
                                        r"torch\.Tensor"):
        ct.clip_loss(z, z, np.asarray(1.0))
    with pytest.raises(TypeError, match=r"InfoNCEFunction: use_cublas must be a bool"):
        ct.InfoNCEFunction.apply(z, 0.5, "yes")


# ----------------------------------------------------------------------------------------
# torch.autocast (CPU, bfloat16)
# ----------------------------------------------------------------------------------------
def test_autocast_casts_embeddings_not_logit_scale(monkeypatch):
    seen = {}
    real = core_clip.clip_loss_forward

    def spy(a, b, ls, **kw):
        seen.update(a=(a.dtype, a.__array_interface__["data"][0]), b=b.dtype, ls=ls.dtype)
        return real(a, b, ls, **kw)

    monkeypatch.setattr(core_clip, "clip_loss_forward", spy)
    g = _gen("autocast")
    a = _leaf(_randn(g, (8, 4), torch.float32))
    b = _leaf(_randn(g, (8, 4), torch.bfloat16))
    ls = _leaf(torch.tensor(CLIP_LS))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ct.clip_loss(a, b, ls, normalize=True)
    assert seen["a"][0] == ml_dtypes.bfloat16 and seen["b"] == ml_dtypes.bfloat16
    assert seen["ls"] == np.float32  # logit_scale is never cast
    assert loss.dtype == torch.float32
    da, db, dls = torch.autograd.grad(loss, (a, b, ls))
    assert (da.dtype, db.dtype, dls.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    # same as casting by hand; bfloat16 inputs reach the core without a copy
    a16 = _leaf(a.detach().bfloat16())
    want = ct.clip_loss(a16, b, ls, normalize=True)
    assert seen["a"][1] == a16.data_ptr()
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    torch.testing.assert_close(da, torch.autograd.grad(want, a16)[0].float(), rtol=0, atol=0)
    # float64 is left alone; outside autocast nothing is cast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ct.nt_xent(torch.ones(4, 3, dtype=torch.float64)).dtype == torch.float64


# ----------------------------------------------------------------------------------------
# torch.compile: a training step, forward and backward ops in the graphs, no graph break
# ----------------------------------------------------------------------------------------
OP_MODULE = {"nt_xent": "nt_xent", "info_nce": "info_nce", "clip_loss": "clip"}


def _count_calls(monkeypatch, module, name):
    """Count the calls of ``cupynce.ops.<module>.<name>``."""
    import importlib

    calls = []
    mod = importlib.import_module(f"cupynce.ops.{module}")
    real = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss"])
def test_compiled_training_step(op, monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    enc = torch.nn.Linear(6, 5, dtype=torch.float64)
    clip = ct.ClipLoss(0.1, normalize=True).double()
    info = ct.InfoNCE(0.2, negative_mode="paired")
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 6, dtype=torch.float64)
    negs = torch.randn(8, 3, 5, dtype=torch.float64, requires_grad=True)

    def step(x, y):
        if op == "nt_xent":
            return ct.nt_xent(torch.cat([enc(x), enc(y)]), 0.3, normalize=True)
        if op == "info_nce":
            return info(enc(x), enc(y), negs)
        return clip(enc(x), enc(y))

    params = [enc.weight, enc.bias, clip.logit_scale, negs]
    eager = step(x, y)
    want = torch.autograd.grad(eager, params, allow_unused=True)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    bwd_calls = _count_calls(monkeypatch, OP_MODULE[op], f"{op}_backward_from_stats")
    finish_calls = _count_calls(monkeypatch, "_base", "finish_all")
    loss = compiled(x, y)
    got = torch.autograd.grad(loss, params, allow_unused=True)
    assert counter.frame_count == 1  # one graph: fullgraph=True would have raised on a break
    # mean: gradient in the forward; the backward graph scales it (torch ops), through the
    # grad_finish op where the rows are normalised (nt_xent: z; clip: a and b)
    assert len(bwd_calls) == 0
    assert len(finish_calls) == {"nt_xent": 1, "info_nce": 3, "clip_loss": 2}[op]
    torch.testing.assert_close(loss, eager, rtol=1e-12, atol=0)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss"])
def test_compiled_training_step_per_row(op, monkeypatch):
    """reduction="none": the backward graph runs the O(N)-state backward op."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    enc = torch.nn.Linear(6, 5, dtype=torch.float64)
    clip = ct.ClipLoss(0.1, normalize=True, reduction="none").double()
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 6, dtype=torch.float64)
    w = torch.rand(8, dtype=torch.float64)

    def step(x, y):
        u, v = enc(x), enc(y)
        if op == "nt_xent":
            per_row = ct.nt_xent(torch.cat([u, v]), 0.3, reduction="none", normalize=True)
            return (per_row * torch.cat([w, w])).sum()
        if op == "info_nce":
            return (ct.info_nce(u, v, 0.2, reduction="none") * w).sum()
        return (clip(u, v) * w).sum()

    params = [enc.weight, enc.bias, clip.logit_scale]
    want = torch.autograd.grad(step(x, y), params, allow_unused=True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    bwd_calls = _count_calls(monkeypatch, OP_MODULE[op], f"{op}_backward_from_stats")
    got = torch.autograd.grad(compiled(x, y), params, allow_unused=True)
    assert counter.frame_count == 1
    assert len(bwd_calls) == 1
    for g, r in zip(got, want):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-14)


def test_compiled_step_under_autocast():
    torch._dynamo.reset()
    enc = torch.nn.Linear(6, 4)
    loss_fn = ct.NTXentLoss(0.5, normalize=True)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(enc(x))

    x = torch.randn(10, 6)
    eager = step(x)
    loss = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(loss, eager, rtol=1e-2, atol=1e-2)  # bf16 matmul, fused or not
    loss.backward()
    assert enc.weight.grad is not None and enc.weight.grad.dtype == torch.float32


def _opcheck_cases():
    g = _gen("opcheck")
    z = _randn(g, (6, 3))
    q, k, neg = _randn(g, (5, 3)), _randn(g, (5, 3)), _randn(g, (5, 2, 3))
    a, b = _randn(g, (5, 3)), _randn(g, (5, 3))
    ls = torch.tensor(1.5, dtype=torch.float64)
    lse5 = torch.logsumexp(torch.randn(5, 5, generator=g, dtype=torch.float64), 1)
    one = torch.tensor(1.0, dtype=torch.float64)
    lab5 = torch.tensor([0, 1, 0, 2, 1])
    t3 = torch.tensor(0.3, dtype=torch.float64)
    queue = torch.randn(7, 3, generator=g, dtype=torch.float64)  # (MoCo's: in_batch 0.0)
    r = _leaf
    return [
        ("nt_xent_fwd", (r(z), None, 0.3, 0.0, "mean", True, None)),
        ("nt_xent_fwd", (r(z), None, 0.3, 0.1, "sum", False, None)),
        ("nt_xent_fwd", (r(z), r(t3), 0.0, 0.1, "mean", True, None)),
        ("nt_xent_bwd", (z, None, 0.3, tnt_xent.FWD(z, None, 0.3, 0.0, "none", True, None)[1], torch.ones(6, dtype=torch.float64), 0.0, "none", True, None)),
        ("nt_xent_bwd", (z, None, 0.3, tnt_xent.FWD(z, None, 0.3, 0.1, "none", True, None)[1], torch.ones(6, dtype=torch.float64), 0.1, "none", True, None)),
        ("nt_xent_bwd", (z, t3, 0.0, tnt_xent.FWD(z, t3, 0.0, 0.1, "none", True, None)[1], torch.ones(6, dtype=torch.float64), 0.1, "none", True, None)),
        ("info_nce_fwd", (r(q), r(k), None, 0.2, r(neg), None, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, "none", False, None)),
        ("info_nce_fwd", (r(q), r(k), None, 0.2, None, None, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, "sum", True, None)),
        ("info_nce_fwd", (r(q), r(k), None, 0.2, r(neg), lab5, 0.1, 0.0, 0.0, 1.0, 0.0, 1.0, "mean", False, None)),
        ("info_nce_fwd", (r(q), r(k), r(t3), 0.0, r(neg), None, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, "mean", True, None)),
        ("info_nce_fwd", (r(q), r(k), None, 0.2, r(neg), lab5, 0.0, 3.0, 4.0, 1.0, 0.0, 1.0, "mean", True, None)),  # (hardness)
        ("info_nce_fwd", (r(q), r(k), None, 0.2, r(queue), None, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, "mean", True, None)),
        # (a detached queue: negatives_grad 0.0, the fused forward skips its accumulator)
        ("info_nce_fwd", (r(q), r(k), None, 0.2, queue, None, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "mean", True, None, None, True)),
        ("info_nce_bwd", (q, k, None, 0.2, queue, None, tinfo_nce.FWD(q, k, None, 0.2, queue, None, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, "none", False, None)[1], torch.ones(5, dtype=torch.float64), 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, "none", False, None)),
        ("info_nce_bwd", (q, k, None, 0.2, None, None, tinfo_nce.FWD(q, k, None, 0.2, None, None, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, "mean", False, None)[1], one, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, "mean", False, None)),
        ("info_nce_bwd", (q, k, None, 0.2, None, lab5, tinfo_nce.FWD(q, k, None, 0.2, None, lab5, 0.1, 0.0, 0.0, 1.0, 0.0, 1.0, "none", False, None)[1], torch.ones(5, dtype=torch.float64), 0.1, 0.0, 0.0, 1.0, 0.0, 1.0, "none", False, None)),
        ("info_nce_bwd", (q, k, t3, 0.0, r(neg).detach(), None, tinfo_nce.FWD(q, k, t3, 0.0, neg, None, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, "none", False, None)[1], torch.ones(5, dtype=torch.float64), 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, "none", False, None)),
        ("clip_loss_fwd", (r(a), r(b), r(ls), 0.0, None, 0.0, "mean", True, None)),
        ("clip_loss_fwd", (r(a), r(b), None, 2.0, None, 0.0, "none", False, None)),
        ("clip_loss_fwd", (r(a), r(b), r(ls), 0.0, None, 0.1, "sum", True, None)),
        ("clip_loss_fwd", (r(a), r(b), r(ls), 0.0, lab5, 0.0, "mean", True, None)),
        ("clip_loss_bwd", (a, b, ls, 0.0, None, lse5, lse5, one, 0.0, "mean", False, None)),
        ("clip_loss_bwd", (a, b, ls, 0.0, None, lse5, lse5, one, 0.1, "mean", False, None)),
        ("clip_loss_bwd", (a, b, ls, 0.0, lab5, lse5, lse5, one, 0.0, "mean", False, None)),
    ]


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0] if isinstance(c, tuple) else "")
def test_opcheck(case):
    name, args = case
    torch.library.opcheck(getattr(torch.ops.cupynce, name).default, args)


def test_direct_path_only_in_plain_eager(monkeypatch):
    """Eager calls on plain tensors skip the dispatcher; autocast, torch-function / dispatch
    modes, functorch transforms and subclasses keep the registered ops (compile: the
    fullgraph tests above)."""
    z = torch.randn(6, 4, dtype=torch.float64)
    assert _registry.direct(z, None) and _registry.direct(torch.nn.Parameter(z))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _registry.direct(z)
    with torch.device("cpu"):  # a TorchFunctionMode
        assert not _registry.direct(z)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not _registry.direct(z)

    class Sub(torch.Tensor):
        pass
    assert not _registry.direct(z.as_subclass(Sub))
    seen = []
    torch.func.vmap(lambda r: seen.append(_registry.direct(r)) or r)(z)
    assert seen == [False]
    # and the public functions follow it: no custom-op call in plain eager
    calls = []
    real = tnt_xent.FWD
    monkeypatch.setattr(tnt_xent, "FWD", lambda *a: calls.append(1) or real(*a))
    zl = z.clone().requires_grad_(True)
    torch.autograd.grad(ct.nt_xent(zl, 0.5), zl)
    assert not calls
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ct.nt_xent(zl, 0.5)
    assert calls == [1]
    # InfoNCEFunction's forward takes the same switch
    torch.autograd.grad(ct.InfoNCEFunction.apply(zl, 0.5, False), zl)
    assert calls == [1]
    with torch.device("cpu"):
        ct.InfoNCEFunction.apply(zl, 0.5, False)
    assert calls == [1, 1]


# ----------------------------------------------------------------------------------------
# modules
# ----------------------------------------------------------------------------------------
def test_exports():
    assert ct.HAS_CUSTOM_OPS  # CI's torch is >= 2.4
    # subclasses (not aliases), so that messages and repr name the class used
    assert issubclass(ct.NTXentLoss, ct.InfoNCELoss) and issubclass(ct.SymmetricInfoNCE,
                                                                     ct.ClipLoss)
    for name in ct.__all__:
        assert hasattr(ct, name), name


def test_info_nce_loss_module():
    m = ct.InfoNCELoss()
    assert (m.temperature, m.use_cublas, m.reduction, m.normalize) == (0.5, False, "mean", False)
    assert list(m.parameters()) == [] and m.state_dict() == {}
    assert "use_cublas=False" in repr(m)
    g = _gen("ntmod")
    z = torch.nn.functional.normalize(_randn(g, (10, 7)), dim=1)
    want = ct.nt_xent(z, 0.5)
    same = [ct.InfoNCELoss(0.5, use_cublas=u)(z) for u in (False, True)]
    same.append(ct.InfoNCEFunction.apply(z, 0.5, True))
    for loss in same:  # use_cublas selects nothing: bit-identical
        assert torch.equal(loss, want)
    za, zb = _leaf(z), _leaf(z)
    (ga,) = torch.autograd.grad(ct.InfoNCEFunction.apply(za, 0.5, False), za)
    (gb,) = torch.autograd.grad(ct.NTXentLoss(0.5, use_cublas=True)(zb), zb)
    assert torch.equal(ga, gb)
    with pytest.raises(TypeError, match="InfoNCELoss: use_cublas must be a bool"):
        ct.InfoNCELoss(0.5, use_cublas=1)
    with pytest.raises(ValueError, match=r"InfoNCELoss: temperature must be finite and > 0"):
        ct.InfoNCELoss(-1.0)


def test_info_nce_module():
    m = ct.InfoNCE()
    assert (m.temperature, m.reduction, m.negative_mode, m.normalize) == (0.1, "mean",
                                                                           "unpaired", True)
    g = _gen("infomod")
    q, k = _randn(g, (6, 4)), _randn(g, (6, 4))
    shared, paired = _randn(g, (3, 4)), _randn(g, (6, 3, 4))
    assert torch.equal(m(q, k, shared), ct.info_nce(q, k, 0.1, negatives=shared, normalize=True))
    p = ct.InfoNCE(0.2, "none", "paired")
    assert torch.equal(p(q, k, paired), ct.info_nce(q, k, 0.2, negatives=paired,
                                                    reduction="none", normalize=True))
    assert torch.equal(p(q, k), ct.info_nce(q, k, 0.2, reduction="none", normalize=True))
    with pytest.raises(ValueError, match=r"negative_mode='unpaired' expects negatives of shape "
                                         r"\(M, D\), got \(6, 3, 4\)"):
        m(q, k, paired)
    with pytest.raises(ValueError, match=r"negative_mode='paired' expects .*\(N, M, D\)"):
        p(q, k, shared)
    with pytest.raises(ValueError, match="InfoNCE: negative_mode must be one of"):
        ct.InfoNCE(negative_mode="both")


def test_clip_loss_module_parameter_and_temperature():
    m = ct.ClipLoss()
    assert isinstance(m.logit_scale, torch.nn.Parameter) and m.logit_scale.requires_grad
    assert m.logit_scale.shape == () and m.logit_scale.dtype == torch.float32
    torch.testing.assert_close(m.logit_scale.detach(), torch.tensor(math.log(1 / 0.07)))
    t = m.temperature
    assert isinstance(t, torch.Tensor) and not t.requires_grad
    assert math.isclose(float(t), 0.07, rel_tol=1e-6)
    assert [n for n, _ in m.named_parameters()] == ["logit_scale"]
    fixed = ct.ClipLoss(0.5, learnable=False)
    assert not fixed.logit_scale.requires_grad and not fixed.learnable
    assert "logit_scale" in fixed.state_dict()
    g = _gen("clipmod")
    a, b = _leaf(_randn(g, (6, 4), torch.float32)), _leaf(_randn(g, (6, 4), torch.float32))
    loss = fixed(a, b)
    assert torch.equal(loss, ct.clip_loss(a, b, math.log(2.0), normalize=True))
    assert fixed.logit_scale.grad is None
    assert "learnable=False" in repr(fixed)


def test_clip_loss_module_clamps_like_clip():
    m = ct.SymmetricInfoNCE(0.07, max_logit_scale=100.0)
    g = _gen("clamp")
    a, b = _randn(g, (6, 4), torch.float32), _randn(g, (6, 4), torch.float32)
    with torch.no_grad():
        m.logit_scale.fill_(10.0)  # an optimiser overshoot: the forward uses log(100)
    loss = m(a, b)
    torch.testing.assert_close(loss, ct.clip_loss(a, b, torch.tensor(math.log(100.0)),
                                                  normalize=True), rtol=1e-6, atol=0)
    loss.backward()
    assert m.logit_scale.grad == 0  # clamped: no gradient (torch.clamp's)
    assert math.isclose(float(m.temperature), 0.01, rel_tol=1e-6)
    assert m.clamp_() is m and math.isclose(float(m.logit_scale.detach()), math.log(100.0), rel_tol=1e-6)
    with torch.no_grad():
        m.logit_scale.fill_(-3.0)  # below: scale 1, temperature 1
    assert math.isclose(float(m.temperature), 1.0)
    # inside the range the gradient flows and an optimiser step changes the temperature
    m = ct.ClipLoss(0.1)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    before = float(m.temperature)
    m(a, b).backward()
    assert m.logit_scale.grad != 0
    opt.step()
    m.clamp_()
    assert float(m.temperature) != before


def test_clip_loss_module_state_dict_round_trip():
    m = ct.ClipLoss(0.2, max_logit_scale=50.0)
    with torch.no_grad():
        m.logit_scale.add_(0.3)
    sd = m.state_dict()
    assert list(sd) == ["logit_scale"]
    m2 = ct.ClipLoss(0.07, max_logit_scale=50.0)
    m2.load_state_dict(sd)
    assert torch.equal(m2.logit_scale, m.logit_scale)
    g = _gen("sd")
    a, b = _randn(g, (5, 3), torch.float32), _randn(g, (5, 3), torch.float32)
    assert torch.equal(m(a, b), m2(a, b))


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(init_temperature=0.0), ValueError, "init_temperature must be finite and > 0"),
    (dict(init_temperature="0.1"), TypeError, "init_temperature must be a real number"),
    (dict(init_temperature=2.0), ValueError, r"init_temperature must be in \[1/max_logit_scale"),
    (dict(init_temperature=0.001), ValueError, r"init_temperature .* = \[0\.01, 1\]"),
    (dict(max_logit_scale=1.0), ValueError, "max_logit_scale must be > 1"),
    (dict(max_logit_scale=float("inf")), ValueError, "max_logit_scale must be finite"),
    (dict(learnable=1), TypeError, "learnable must be a bool"),
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
])
def test_clip_loss_module_errors(kwargs, exc, msg):
    with pytest.raises(exc, match=f"ClipLoss: {msg}"):
        ct.ClipLoss(**kwargs)


@pytest.mark.parametrize("op,normalize,reduction", [
    (op, nz, red) for op in ("nt_xent", "info_nce", "clip_loss")
    for nz in (False, True) for red in ("mean", "none")] + [("InfoNCEFunction", False, "mean")])
def test_double_backward_raises(op, normalize, reduction):
    """create_graph=True: an error, never a gradient that silently drops its own dependence on
    the inputs (the fused path's backward scales accumulators autograd cannot see into)."""
    g = _gen(f"dbl{op}{normalize}{reduction}")
    a, b = _leaf(_randn(g, (8, 4))), _leaf(_randn(g, (8, 4)))
    ls = _leaf(torch.tensor(2.0, dtype=torch.float64))
    kw = dict(reduction=reduction, normalize=normalize)
    if op == "nt_xent":
        loss, leaves = ct.nt_xent(a, 0.5, **kw), [a]
    elif op == "info_nce":
        loss, leaves = ct.info_nce(a, b, 0.2, **kw), [a, b]
    elif op == "clip_loss":
        loss, leaves = ct.clip_loss(a, b, ls, **kw), [a, b, ls]
    else:
        loss, leaves = ct.InfoNCEFunction.apply(a, 0.5, False), [a]
    grads = None
    with pytest.raises(RuntimeError):
        grads = torch.autograd.grad(loss.sum(), leaves, create_graph=True)
        sum(x.pow(2).sum() for x in grads).backward()


# ----------------------------------------------------------------------------------------
# what a new user hit: flags, host scalars, a last batch of one row, the exported names
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["no", 1, None])
def test_normalize_flag_is_checked(value):
    """normalize="no" used to turn normalisation on (the functions passed bool(normalize))."""
    z = torch.randn(4, 3, dtype=torch.float64)
    for name, call in (("nt_xent", lambda: ct.nt_xent(z, normalize=value)),
                       ("info_nce", lambda: ct.info_nce(z, z, normalize=value)),
                       ("clip_loss", lambda: ct.clip_loss(z, z, 1.0, normalize=value)),
                       ("InfoNCELoss", lambda: ct.InfoNCELoss(normalize=value)),
                       ("InfoNCE", lambda: ct.InfoNCE(normalize=value)),
                       ("ClipLoss", lambda: ct.ClipLoss(normalize=value))):
        with pytest.raises(TypeError, match=rf"{name}: normalize must be a bool"):
            call()


def test_temperature_as_a_0d_tensor():
    """A 0-d CPU tensor (or NumPy array) is a temperature like a float: the same loss."""
    z = torch.randn(6, 3, dtype=torch.float64)
    want = ct.nt_xent(z, 0.25)
    for t in (torch.tensor(0.25), torch.tensor(0.25, dtype=torch.float64), np.asarray(0.25)):
        assert torch.equal(ct.nt_xent(z, t), want)
        assert torch.equal(ct.NTXentLoss(t)(z), want)
    with pytest.raises(ValueError, match=r"temperature must be a scalar"):
        ct.nt_xent(z, torch.tensor([0.25, 0.5]))


_GRAD_T = r"pass a float or a tensor without grad \(\.detach\(\)\); a learnable temperature"


def test_temperature_that_requires_grad_is_refused():
    """A tensor temperature that requires grad used to be read as a float: a loss with no
    gradient to it (issue 52).  Refused everywhere a temperature is a constant (the legacy
    Function, the modules' constructors, the NumPy ops); the message names the op, the
    argument, its value and what to do.  The torch functions take it as a differentiable
    input (issue 55: tests/ops/test_learnable_temperature.py)."""
    z = torch.randn(6, 3, dtype=torch.float64)
    t = torch.tensor(0.5, requires_grad=True)
    msg = r"temperature is tensor\(0\.5, requires_grad=True\), but temperature is a constant"
    for name, call in (("InfoNCEFunction", lambda: ct.InfoNCEFunction.apply(z, t)),
                       ("InfoNCELoss", lambda: ct.InfoNCELoss(t)),
                       ("NTXentLoss", lambda: ct.NTXentLoss(t)),
                       ("InfoNCE", lambda: ct.InfoNCE(t)),
                       ("nt_xent", lambda: cupynce.nt_xent(z.numpy(), t))):
        with pytest.raises(TypeError, match=rf"^{name}: {msg}.*{_GRAD_T}.*learnable=True"):
            call()
    for call in (lambda: ct.nt_xent(z, t), lambda: ct.info_nce(z, z, t)):
        assert torch.autograd.grad(call(), [t])[0].shape == ()
    with pytest.raises(TypeError, match=r"ClipLoss: init_temperature is tensor\(0\.07"):
        ct.ClipLoss(torch.tensor(0.07, requires_grad=True))
    with pytest.raises(TypeError, match=r"SigLipLoss: init_logit_bias is tensor\(-10,"):
        ct.SigLipLoss(init_logit_bias=torch.tensor(-10.0, requires_grad=True))
    # without grad (or detached) it is a temperature like a float
    want = ct.nt_xent(z, 0.5)
    assert torch.equal(ct.nt_xent(z, t.detach()), want)
    with torch.no_grad():  # (grad mode off: the loss alone, as with a float)
        assert torch.equal(ct.nt_xent(z, t), want)


def test_learnable_scalars_keep_their_gradient():
    """What *is* differentiable stays so: clip_loss's and siglip_loss's logit_scale /
    logit_bias tensors, and the modules' parameters."""
    g = _gen("learnable")
    a, b = _randn(g, (5, 3)), _randn(g, (5, 3))
    ls = torch.tensor(CLIP_LS, dtype=torch.float64, requires_grad=True)
    lb = torch.tensor(-1.0, dtype=torch.float64, requires_grad=True)
    (dls,) = torch.autograd.grad(ct.clip_loss(a, b, ls), (ls,))
    want = oracle.clip_loss(a, b, ls)
    (wls,) = torch.autograd.grad(want, (ls,))
    torch.testing.assert_close(dls, wls, rtol=1e-12, atol=1e-14)
    dls, dlb = torch.autograd.grad(ct.siglip_loss(a, b, ls, lb), (ls, lb))
    assert dls.item() != 0.0 and dlb.item() != 0.0
    for m in (ct.ClipLoss(), ct.SymmetricInfoNCE(), ct.SigLipLoss()):
        m(a.float(), b.float()).backward()
        assert all(p.grad is not None and p.grad.item() != 0.0 for p in m.parameters())


def test_module_messages_name_the_class_used():
    """NTXentLoss / SymmetricInfoNCE say their own name (they used to report InfoNCELoss /
    ClipLoss); two tensors to the NT-Xent module, or one to InfoNCE, say where to go."""
    z = torch.randn(6, 3)
    with pytest.raises(ValueError, match=r"^NTXentLoss: temperature must be finite and > 0"):
        ct.NTXentLoss(0.0)
    with pytest.raises(ValueError, match=r"^SymmetricInfoNCE: max_logit_scale must be > 1"):
        ct.SymmetricInfoNCE(max_logit_scale=1.0)
    assert repr(ct.NTXentLoss()).startswith("NTXentLoss(")
    for cls in (ct.InfoNCELoss, ct.NTXentLoss):
        with pytest.raises(TypeError, match=rf"^{cls.__name__}\.forward takes one tensor, "
                                            r"features \(2B, D\).*got 2 tensors\. For "
                                            r"query/key pairs use cupynce\.torch\.InfoNCE"):
            cls(temperature=0.5)(z, z)
    with pytest.raises(TypeError, match=r"^InfoNCE\.forward takes query and key.*got query "
                                        r"alone.*cupynce\.torch\.NTXentLoss"):
        ct.InfoNCE()(z)
    # the functional forms: a matrix where the temperature goes
    with pytest.raises(ValueError, match=r"nt_xent: temperature must be a scalar, got a "
                                         r"torch\.Tensor of shape \(6, 3\) \(nt_xent takes one "
                                         r"z \(2B, D\).*use info_nce\(query, key\)"):
        ct.nt_xent(z, z)
    with pytest.raises(ValueError, match=r"info_nce: temperature must be a scalar.*negatives "
                                         r"are keyword-only"):
        ct.info_nce(z, z, z)
    # still one module: same state and same loss
    torch.testing.assert_close(ct.NTXentLoss(0.3)(z), ct.InfoNCELoss(0.3)(z), rtol=0, atol=0)


_NO_DEPS = """
import sys
sys.modules["torch"] = None  # (import torch now raises ModuleNotFoundError, name "torch")
sys.modules["cupy"] = None
import cupynce, numpy as np
assert float(cupynce.nt_xent(np.ones((4, 3)), 0.5)) > 0
for mod in ("cupynce.torch", "cupynce.integrations"):
    try:
        __import__(mod)
    except ModuleNotFoundError as exc:
        assert exc.name == "torch", exc.name
        print(exc)
"""


def test_missing_torch_or_cupy_names_the_extra(monkeypatch):
    """Without torch, ``import cupynce.torch`` (and the adapters) say which extra installs it;
    ``import cupynce`` works with neither; a CUDA tensor's call without CuPy names the CUDA
    extras (issue 52)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _NO_DEPS], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ['cupynce.torch needs torch, which is not installed: pip install '
                   '"cupynce[torch]"',
                   'cupynce.integrations needs torch, which is not installed: pip install '
                   '"cupynce[torch]"']
    from cupynce import _checks
    from cupynce.torch import _bridge
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ModuleNotFoundError, match=r'^cupynce\.torch on cuda:0 tensors needs '
                                                  r'cupy, which is not installed: pip install '
                                                  r'"cupynce\[cuda12\]" \(CUDA 12\) or '
                                                  r'"cupynce\[cuda13\]"'):
        with _bridge.device_scope(torch.device("cuda", 0)):
            pass
    # an installed CuPy's own import error (a missing piece inside it) is raised as it is
    def broken(name):
        raise ModuleNotFoundError("No module named 'cupy_backends.cuda'", name="cupy_backends.cuda")

    monkeypatch.setattr(_checks, "importlib", types.SimpleNamespace(import_module=broken))
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'cupy_backends\.cuda'$"):
        _checks.require_module("cupy", "x")


def test_modules_take_a_last_batch_of_one_row():
    """InfoNCE and ClipLoss on one row (the end of an epoch): defined, finite, the gradient of
    the in-batch-only loss is zero (log 1), negatives still count."""
    q = torch.randn(1, 5, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 5, dtype=torch.float64, requires_grad=True)
    clip = ct.ClipLoss().double()
    loss = clip(q, k)
    assert loss.item() == 0.0
    dq, dk, dls = torch.autograd.grad(loss, (q, k, clip.logit_scale))
    assert not dq.any() and not dk.any() and dls.item() == 0.0
    neg = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    loss = ct.InfoNCE()(q, k, neg)
    want = oracle.info_nce(q, k, 0.1, negatives=neg, normalize=True)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    assert ct.InfoNCE()(q, k).item() == 0.0


def test_exports_only_the_api():
    """``cupynce.torch`` holds its API, its submodules and nothing borrowed."""
    public = {n for n in dir(ct) if not n.startswith("_")}
    submodules = {"modules", "ops", "distributed", "grad_cache", "queue"}  # (distributed: once imported)
    assert set(ct.__all__) <= public and public - set(ct.__all__) <= submodules, public


def test_double_backward_raises_for_logit_scale_alone():
    """create_graph=True through CLIP's fused path with only logit_scale requiring a
    gradient: still an error (the accumulators' dependence on the inputs is invisible)."""
    g = _gen("dbl-ls")
    a, b = _randn(g, (8, 4)), _randn(g, (8, 4))
    ls = _leaf(torch.tensor(2.0, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(ct.clip_loss(a, b, ls), [ls], create_graph=True)


def _no_grad_case(op, dtype):
    g = torch.Generator().manual_seed(3)
    x = [torch.randn(12, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]
    fns = {"nt_xent": (lambda kw: ct.nt_xent(x[0], 0.3, **kw)),
           "info_nce": (lambda kw: ct.info_nce(x[0], x[1], 0.2, **kw)),
           "info_nce_neg": (lambda kw: ct.info_nce(x[0], x[1], 0.2, negatives=x[2], **kw)),
           "clip_loss": (lambda kw: ct.clip_loss(x[0], x[1], torch.tensor(2.0), **kw)),
           "siglip_loss": (lambda kw: ct.siglip_loss(x[0], x[1], torch.tensor(2.0),
                                                     torch.tensor(-3.0), **kw))}
    return x, fns[op]


@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "info_nce_neg", "clip_loss",
                                "siglip_loss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
def test_calls_without_gradient_run_the_loss_alone(op, dtype, reduction, normalize):
    """Under no_grad, or with no input requiring a gradient, a direct call runs the op's
    ``evaluate`` (the loss alone, no autograd node): the custom ops' bits."""
    x, fn = _no_grad_case(op, dtype)
    kw = dict(reduction=reduction, normalize=normalize)
    calls = []
    real = _registry.evaluate
    _registry.evaluate = lambda body, args: calls.append(body) or real(body, args)
    try:
        plain = fn(kw)  # (nothing requires a gradient)
        with torch.no_grad():
            for t in x:
                t.requires_grad_(True)
            under = fn(kw)
    finally:
        _registry.evaluate = real
        for t in x:
            t.requires_grad_(False)
    assert len(calls) == 2 and plain.grad_fn is None and under.grad_fn is None
    want = _registered(fn)(kw)
    for got in (plain, under):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op", ["clip_loss", "siglip_loss"])
def test_logit_scale_convention_guard(op, dtype):
    """open_clip's scale (100) passed where cupynce takes its log: a clear error naming both
    conventions, for a real and for a host tensor, in every dtype (issue 22)."""
    a = torch.randn(4, 3, dtype=dtype)
    extra = (-10.0,) if op == "siglip_loss" else ()
    for v in (100.0, torch.tensor(100.0, dtype=dtype, requires_grad=True)):
        with pytest.raises(ValueError, match=r"is too large: cupynce takes the \*log\*.*"
                                             r"open_clip.*math\.log\(scale\)"):
            getattr(ct, op)(a, a, v, *extra)
    assert torch.isfinite(getattr(ct, op)(a, a, math.log(100.0), *extra))
