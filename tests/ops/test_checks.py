"""Argument validation: every bad input raises before any work is done.

Each test checks the exception type and, with a regex, that the message names the op, the
argument and the offending value (or shape / dtype / type).  The ``no_work`` fixture replaces
every compute primitive (NumPy and GPU paths) with a function that fails the test, so a check
that fires only after computation started is caught.
"""
from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

import cupynce
from cupynce import _engine
from cupynce._engine import arrays, kernels, workspace
from cupynce._engine.gemm import cublas
from cupynce._engine.losses import nt_xent_tf32, row_blocks, score_tiles, stats
from cupynce.ops import _numpy
from cupynce.ops import clip as clip_op

N, D = 4, 3
OPS = ["nt_xent", "info_nce", "clip_loss"]


def _arr(shape, dtype=np.float32, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * x
    return np.asarray(x).astype(dtype)  # a 0-d ndarray, never a NumPy scalar


def _default_args(op):
    if op == "nt_xent":
        return dict(z=_arr((N, D)), temperature=0.5)
    if op == "info_nce":
        return dict(query=_arr((N, D)), key=_arr((N, D), seed=1), temperature=0.1)
    return dict(a=_arr((N, D)), b=_arr((N, D), seed=1), logit_scale=2.0)


_FUNCS = {
    "nt_xent": (cupynce.nt_xent, cupynce.nt_xent_forward, cupynce.nt_xent_backward),
    "info_nce": (cupynce.info_nce, cupynce.info_nce_forward, cupynce.info_nce_backward),
    "clip_loss": (cupynce.clip_loss, cupynce.clip_loss_forward, cupynce.clip_loss_backward),
    "siglip_loss": (cupynce.siglip_loss, cupynce.siglip_loss_forward,
                    cupynce.siglip_loss_backward),
}


def call(op, entry="forward", **overrides):
    """Call ``op`` (entry "loss" or "forward") with valid defaults, some replaced."""
    kw = _default_args(op)
    kw.update(overrides)
    fn = _FUNCS[op][0 if entry == "loss" else 1]
    if op == "nt_xent":
        return fn(kw.pop("z"), kw.pop("temperature"), **kw)
    if op == "info_nce":
        return fn(kw.pop("query"), kw.pop("key"), kw.pop("temperature"), **kw)
    if op == "siglip_loss":
        return fn(kw.pop("a"), kw.pop("b"), kw.pop("logit_scale"), kw.pop("logit_bias", -10.0),
                  **kw)
    return fn(kw.pop("a"), kw.pop("b"), kw.pop("logit_scale"), **kw)


def _first(op):
    return {"nt_xent": "z", "info_nce": "query", "clip_loss": "a"}[op]


def _shape_re(shape):
    return re.escape(str(tuple(shape)))


def no_work_again(monkeypatch):
    """Replace every compute primitive with one that fails the test (after a real forward)."""
    def boom(*args, **kwargs):
        raise AssertionError("work started before the argument checks finished")

    for mod, names in ((_numpy, ("rows", "normalize", "finish", "grad_scale")),
                       (clip_op, ("numpy_clip",)), (_engine, ("rows", "clip")),
                       (arrays, ("normalize", "finish", "grad_scale", "scalar", "fixed_sum",
                                  "fixed_sums")),
                       (kernels, ("launch", "get_kernel")), (cublas, ("gemm",)),
                       (workspace, ("plan_rows",)),
                       # (the names their callers import: patched where they are looked up)
                       (stats, ("launch",)), (row_blocks, ("plan_rows",)),
                       (score_tiles, ("plan_rows",)), (nt_xent_tf32, ("plan_rows",))):
        for name in names:
            monkeypatch.setattr(mod, name, boom)
    return boom


@pytest.fixture
def no_work(monkeypatch):
    """While active, any compute primitive fails the test."""
    return no_work_again(monkeypatch)


def test_valid_defaults_run():
    """Sanity: the defaults used below are valid (so each test varies exactly one thing)."""
    for op in OPS:
        for entry in ("loss", "forward"):
            call(op, entry)


def test_no_work_fixture_is_effective(no_work):
    with pytest.raises(AssertionError, match="work started"):
        call("nt_xent")


# ----------------------------------------------------------------------------------------
# shapes
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["loss", "forward"])
@pytest.mark.parametrize("shape", [(N,), (N, D, 1), ()])
@pytest.mark.parametrize("arg", ["z", "query", "key", "a", "b"])
def test_wrong_rank(arg, shape, entry, no_work):
    op = {"z": "nt_xent", "query": "info_nce", "key": "info_nce", "a": "clip_loss",
          "b": "clip_loss"}[arg]
    x = _arr(shape)
    with pytest.raises(ValueError, match=rf"{op}: {arg} must be 2-D.*got shape {_shape_re(shape)}"):
        call(op, entry, **{arg: x})


def test_info_nce_feature_sizes_differ(no_work):
    with pytest.raises(ValueError, match=r"info_nce: feature sizes D must match.*query: 3, key: 5"):
        call("info_nce", key=_arr((N, 5)))


def test_info_nce_row_counts_differ(no_work):
    with pytest.raises(ValueError, match=r"info_nce: query and key.*\(4, 3\) and \(6, 3\)"):
        call("info_nce", key=_arr((6, D)))


@pytest.mark.parametrize("b_shape", [(N, 5), (N + 2, D)])
def test_clip_shapes_differ(b_shape, no_work):
    with pytest.raises(ValueError, match=rf"clip_loss: a and b must have the same shape.*"
                                         rf"\(4, 3\) and {_shape_re(b_shape)}"):
        call("clip_loss", b=_arr(b_shape))


@pytest.mark.parametrize("n", [3, 5, 7])
def test_nt_xent_odd_rows(n, no_work):
    with pytest.raises(ValueError, match=rf"nt_xent: z must have an even number of rows.*"
                                         rf"\({n}, 3\)"):
        call("nt_xent", z=_arr((n, D)))


@pytest.mark.parametrize("arg,rows", [("z", 0), ("z", 1), ("query", 0), ("key", 0), ("a", 0),
                                      ("b", 0)])
def test_too_few_rows(arg, rows, no_work):
    """nt_xent needs two rows (a pair of views); info_nce and clip_loss need one (N = 1 is a
    batch: test_one_row_is_a_batch)."""
    op = {"z": "nt_xent", "query": "info_nce", "key": "info_nce", "a": "clip_loss",
          "b": "clip_loss"}[arg]
    need = 2 if op == "nt_xent" else 1
    kw = {arg: _arr((rows, D))}
    if arg in ("query", "a"):  # keep the partner the same shape: only the row count is bad
        kw[{"query": "key", "a": "b"}[arg]] = _arr((rows, D))
    want = "2 rows" if need == 2 else "1 row"
    with pytest.raises(ValueError, match=rf"{op}: {arg} needs at least {want}.*\({rows}, 3\)"):
        call(op, **kw)


@pytest.mark.parametrize("op", OPS)
def test_zero_features(op, no_work):
    arg = _first(op)
    kw = {arg: _arr((N, 0))}
    if op != "nt_xent":
        kw[{"query": "key", "a": "b"}[arg]] = _arr((N, 0))
    with pytest.raises(ValueError, match=rf"{op}: {arg} needs D >= 1.*\(4, 0\)"):
        call(op, **kw)


@pytest.mark.parametrize("shape,pattern", [
    ((2, D + 1), r"negatives must have D=3.*\(2, 4\)"),
    ((N, 2, D + 1), r"negatives must have D=3.*\(4, 2, 4\)"),
    ((N + 1, 2, D), r"per-query negatives must be \(N=4, M, D\).*\(5, 2, 3\)"),
    ((N, 2, D, 1), r"negatives must be \(M, D\) shared or \(N, M, D\).*\(4, 2, 3, 1\)"),
    ((D,), r"negatives must be \(M, D\) shared or \(N, M, D\).*\(3,\)"),
])
def test_negatives_wrong_shape(shape, pattern, no_work):
    with pytest.raises(ValueError, match="info_nce: " + pattern):
        call("info_nce", negatives=_arr(shape))


# ----------------------------------------------------------------------------------------
# dtypes and array kinds
# ----------------------------------------------------------------------------------------
BAD_DTYPES = ["int32", "int64", "bool", "complex64", "complex128", "uint8"]


@pytest.mark.parametrize("dtype", BAD_DTYPES)
@pytest.mark.parametrize("arg", ["z", "query", "key", "negatives", "a", "b"])
def test_non_float_dtype(arg, dtype, no_work):
    op = {"z": "nt_xent", "query": "info_nce", "key": "info_nce", "negatives": "info_nce",
          "a": "clip_loss", "b": "clip_loss"}[arg]
    shape = (2, D) if arg == "negatives" else (N, D)
    x = _arr(shape, dtype)
    with pytest.raises(TypeError, match=rf"{op}: {arg} has dtype {dtype}; expected a floating"):
        call(op, **{arg: x})


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_logit_scale_non_float_array(dtype, no_work):
    with pytest.raises(TypeError, match=rf"clip_loss: logit_scale has dtype {dtype}"):
        call("clip_loss", logit_scale=_arr((), dtype))


@pytest.mark.parametrize("pair", [("float32", "float64"), ("float16", "bfloat16"),
                                  ("bfloat16", "float32")])
@pytest.mark.parametrize("op,args", [("info_nce", ("query", "key")), ("clip_loss", ("a", "b"))])
def test_mixed_float_dtypes(op, args, pair, no_work):
    dt = [np.dtype(ml_dtypes.bfloat16) if p == "bfloat16" else np.dtype(p) for p in pair]
    kw = {args[0]: _arr((N, D), dt[0]), args[1]: _arr((N, D), dt[1])}
    with pytest.raises(TypeError, match=rf"{op}: inputs must share one dtype.*"
                                        rf"{args[0]}: {pair[0]}, {args[1]}: {pair[1]}"):
        call(op, **kw)


def test_negatives_dtype_differs(no_work):
    with pytest.raises(TypeError, match=r"info_nce: inputs must share one dtype.*"
                                        r"negatives: float64"):
        call("info_nce", negatives=_arr((2, D), np.float64))


@pytest.mark.parametrize("arg", ["z", "query", "key", "negatives", "a", "b"])
def test_torch_tensor_rejected(arg, no_work):
    torch = pytest.importorskip("torch")
    op = {"z": "nt_xent", "query": "info_nce", "key": "info_nce", "negatives": "info_nce",
          "a": "clip_loss", "b": "clip_loss"}[arg]
    x = torch.zeros((2, D) if arg == "negatives" else (N, D))
    with pytest.raises(TypeError, match=rf"{op}: {arg} must be a numpy.ndarray or cupy.ndarray, "
                                        rf"got torch\.Tensor.*cupynce\.torch"):
        call(op, **{arg: x})


@pytest.mark.parametrize("value,tname", [([[1.0, 2.0]] * 4, "builtins.list"),
                                         (3.0, "builtins.float")])
@pytest.mark.parametrize("arg", ["z", "query", "key", "a", "b"])
def test_non_array_rejected(arg, value, tname, no_work):
    op = {"z": "nt_xent", "query": "info_nce", "key": "info_nce", "a": "clip_loss",
          "b": "clip_loss"}[arg]
    with pytest.raises(TypeError, match=rf"{op}: {arg} must be a numpy.ndarray.*got {tname}"):
        call(op, **{arg: value})


@pytest.mark.parametrize("arg", ["z", "query", "key", "a", "b"])
def test_required_input_none_rejected(arg, no_work):
    op = {"z": "nt_xent", "query": "info_nce", "key": "info_nce", "a": "clip_loss",
          "b": "clip_loss"}[arg]
    with pytest.raises(TypeError, match=rf"{op}: {arg} is required.*got None"):
        call(op, **{arg: None})


def _cupy_with_device():
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver (CuPy says "CUDA driver version is insufficient") / no device
        count = 0
    if count == 0:
        pytest.skip("needs a CUDA GPU (none here)")
    return cupy


@pytest.mark.parametrize("op,args", [("info_nce", ("query", "key")),
                                     ("info_nce", ("query", "negatives")),
                                     ("clip_loss", ("a", "b"))])
def test_numpy_cupy_mixed(op, args, no_work):
    cupy = _cupy_with_device()
    shape = (2, D) if args[1] == "negatives" else (N, D)
    kw = {args[1]: cupy.asarray(_arr(shape))}
    with pytest.raises(TypeError, match=rf"{op}: cannot mix NumPy and CuPy arrays.*"
                                        rf"{args[0]} is numpy.*{args[1]} is cupy"):
        call(op, **kw)


def test_clip_logit_scale_cupy_with_numpy_inputs(no_work):
    cupy = _cupy_with_device()
    with pytest.raises(TypeError, match=r"clip_loss: logit_scale is a cupy array but the "
                                        r"inputs are numpy arrays"):
        call("clip_loss", logit_scale=cupy.asarray(2.0))


# ----------------------------------------------------------------------------------------
# scalars: temperature, logit_scale, reduction, workspace_bytes
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["loss", "forward"])
@pytest.mark.parametrize("value,shown", [(0.0, r"0\.0"), (0, r"0"), (-1.0, r"-1\.0"),
                                         (-1e-30, r"-1e-30"), (float("nan"), r"nan"),
                                         (float("inf"), r"inf"), (float("-inf"), r"-inf"),
                                         (np.float32(-2), r"-2")])
@pytest.mark.parametrize("op", ["nt_xent", "info_nce"])
def test_temperature_bad_value(op, value, shown, entry, no_work):
    with pytest.raises(ValueError, match=rf"{op}: temperature must be finite and > 0, got .*{shown}"):
        call(op, entry, temperature=value)


@pytest.mark.parametrize("value,tname", [("0.5", "str"), (None, "NoneType"), (True, "bool"),
                                         (np.array(True), "bool"), (1 + 0j, "complex"),
                                         (np.array(1 + 0j), "complex"), ([0.5], "list")])
@pytest.mark.parametrize("op", ["nt_xent", "info_nce"])
def test_temperature_not_a_number(op, value, tname, no_work):
    with pytest.raises(TypeError, match=rf"{op}: temperature must be a real number, got {tname}"):
        call(op, temperature=value)


@pytest.mark.parametrize("value", [0.5, 1, np.float32(0.5), np.float64(2.0), np.int64(1),
                                   np.array(0.5), np.array(0.5, np.float32),
                                   np.array(0.5).astype(ml_dtypes.bfloat16),
                                   np.float32(0.5).astype(ml_dtypes.bfloat16)])
def test_temperature_accepted_forms(value):
    """Every real scalar on the host: Python, NumPy scalars and 0-d arrays (bfloat16 too)."""
    call("nt_xent", temperature=value)
    call("info_nce", temperature=value)


@pytest.mark.parametrize("shape", [(2,), (1, 1), (3, 1), (0,)])
def test_logit_scale_not_scalar(shape, no_work):
    with pytest.raises(ValueError, match=rf"clip_loss: logit_scale must be a scalar.*"
                                         rf"got shape {_shape_re(shape)}"):
        call("clip_loss", logit_scale=np.full(shape, 2.0, np.float32))


@pytest.mark.parametrize("value,shown", [(float("nan"), "nan"), (float("inf"), "inf"),
                                         (float("-inf"), "-inf")])
def test_logit_scale_not_finite(value, shown, no_work):
    with pytest.raises(ValueError, match=rf"clip_loss: logit_scale must be finite, got {shown}"):
        call("clip_loss", logit_scale=value)


@pytest.mark.parametrize("value,tname", [(True, "bool"), ("2.0", "str"), (None, "NoneType"),
                                         ([2.0], "list")])
def test_logit_scale_wrong_type(value, tname, no_work):
    with pytest.raises(TypeError, match=rf"clip_loss: logit_scale must be a real scalar.*{tname}"):
        call("clip_loss", logit_scale=value)


@pytest.mark.parametrize("entry", ["loss", "forward"])
@pytest.mark.parametrize("value", ["avg", "MEAN", None, "", 1])
@pytest.mark.parametrize("op", OPS)
def test_bad_reduction(op, value, entry, no_work):
    with pytest.raises(ValueError, match=rf"{op}: reduction must be one of .*got {re.escape(repr(value))}"):
        call(op, entry, reduction=value)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, False, "1024", 1024.0])
@pytest.mark.parametrize("op", OPS)
def test_bad_workspace_bytes(op, value, no_work):
    with pytest.raises(ValueError, match=rf"{op}: workspace_bytes must be a positive int or None, "
                                         rf"got {re.escape(repr(value))}"):
        call(op, workspace_bytes=value)


@pytest.mark.parametrize("value", [None, 1, 1 << 20, np.int64(4096)])
def test_workspace_bytes_accepted_forms(value):
    for op in OPS:
        call(op, workspace_bytes=value)


# ----------------------------------------------------------------------------------------
# backward: grad_loss and ctx
# ----------------------------------------------------------------------------------------
def _ctx(op, reduction):
    return call(op, reduction=reduction)[1]


@pytest.mark.parametrize("value,got", [(np.ones(2), r"\(2,\)"), (np.ones((1, 1)), r"\(1, 1\)"),
                                       (np.ones(N), r"\(4,\)"), ("x", "str"),
                                       (None, "NoneType"), (True, "bool"), ([1.0], "list")])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("op", OPS)
def test_grad_loss_not_scalar(op, reduction, value, got, monkeypatch):
    ctx = _ctx(op, reduction)
    no_work_again(monkeypatch)
    with pytest.raises(ValueError, match=rf"{op}_backward: with reduction='{reduction}', "
                                         rf"grad_loss must be a scalar.*got .*{got}"):
        _FUNCS[op][2](ctx, value)


@pytest.mark.parametrize("value,got", [(np.ones(N + 1), r"\(5,\)"), (np.ones(N - 1), r"\(3,\)"),
                                       (np.ones((N, 1)), r"\(4, 1\)"),
                                       (np.ones((1, N)), r"\(1, 4\)"),
                                       ([1.0] * N, "list"), (None, "NoneType"),
                                       (True, "bool")])
@pytest.mark.parametrize("op", OPS)
def test_grad_loss_wrong_shape_none(op, value, got, monkeypatch):
    ctx = _ctx(op, "none")
    no_work_again(monkeypatch)
    with pytest.raises(ValueError, match=rf"{op}_backward: with reduction='none', grad_loss must "
                                         rf"be a real or a numpy array of shape \(4,\), got .*{got}"):
        _FUNCS[op][2](ctx, value)


@pytest.mark.parametrize("dtype", ["int64", "bool", "complex64"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("op", OPS)
def test_grad_loss_non_float(op, reduction, dtype, monkeypatch):
    ctx = _ctx(op, reduction)
    no_work_again(monkeypatch)
    g = _arr((N,) if reduction == "none" else (), dtype)
    with pytest.raises(TypeError, match=rf"{op}_backward: grad_loss has dtype {dtype}"):
        _FUNCS[op][2](ctx, g)


def test_grad_loss_bfloat16_numpy_scalar_accepted():
    ctx = _ctx("nt_xent", "mean")
    cupynce.nt_xent_backward(ctx, ml_dtypes.bfloat16(0.5))


@pytest.mark.parametrize("g", [np.float16(0.5), np.float32(0.5), np.float64(0.5), 1])
def test_grad_loss_numpy_scalars_accepted(g):
    for op in OPS:
        _FUNCS[op][2](_ctx(op, "mean"), g)


@pytest.mark.parametrize("op", OPS)
def test_backward_wrong_ctx(op, monkeypatch):
    other = "info_nce" if op != "info_nce" else "nt_xent"
    ctx = _ctx(other, "mean")
    no_work_again(monkeypatch)
    with pytest.raises(TypeError, match=rf"{op}_backward: ctx must be the Context returned by "
                                        rf"{op}_forward"):
        _FUNCS[op][2](ctx, 1.0)
    with pytest.raises(TypeError, match=rf"{op}_backward: ctx must be the Context"):
        _FUNCS[op][2]({"not": "a ctx"}, 1.0)


@pytest.mark.parametrize("op", OPS)
def test_backward_without_saved_state(op, monkeypatch):
    ctx = call(op, requires_grad=False)[1]
    no_work_again(monkeypatch)
    with pytest.raises(ValueError, match=rf"{op}_backward: the forward ran with "
                                         rf"requires_grad=False"):
        _FUNCS[op][2](ctx, 1.0)



# ----------------------------------------------------------------------------------------
# flags, host scalars, the logit-scale convention, one-row batches (what a new user hit)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["no", "", 1, 0, None, 1.0, np.array(True)])
@pytest.mark.parametrize("entry", ["loss", "forward"])
@pytest.mark.parametrize("op", OPS)
def test_normalize_must_be_a_bool(op, entry, value, no_work):
    """normalize="no" used to switch normalisation on (any truthy value did)."""
    with pytest.raises(TypeError, match=rf"{op}: normalize must be a bool \(True or False\), "
                                        rf"got .*{re.escape(type(value).__name__)}"):
        call(op, entry, normalize=value)


@pytest.mark.parametrize("value", ["yes", 1, None])
@pytest.mark.parametrize("op", OPS)
def test_requires_grad_must_be_a_bool(op, value, no_work):
    with pytest.raises(TypeError, match=rf"{op}: requires_grad must be a bool"):
        call(op, "forward", requires_grad=value)


@pytest.mark.parametrize("flag", [True, False, np.bool_(True), np.bool_(False)])
def test_bool_flags_accepted(flag):
    for op in OPS:
        call(op, normalize=flag)
        call(op, requires_grad=flag)


@pytest.mark.parametrize("value", [np.array([[0.5]]), np.array([0.5, 0.5])])
def test_temperature_array_must_be_0d_or_one(value, no_work):
    """A temperature array is 0-d or (1,) (its gradient's shape, as a logit scale's)."""
    with pytest.raises(ValueError, match=r"nt_xent: temperature must be a scalar, got a "
                                         r"numpy\.ndarray of shape"):
        call("nt_xent", temperature=value)


@pytest.mark.parametrize("make", [float, np.float32, lambda v: np.asarray(v, np.float32),
                                  lambda v: np.asarray([v], np.float64)])
@pytest.mark.parametrize("value", [100.0, 88.8, 1e4])
@pytest.mark.parametrize("op", ["clip_loss", "siglip_loss"])
def test_logit_scale_overflow_names_both_conventions(op, make, value, no_work):
    """exp(logit_scale) must be finite in float32: a value past it is the scale itself
    (open_clip's convention) where cupynce takes its log.  NaN (float32) or 1.5e44 (float64)
    used to come back silently."""
    with pytest.raises(ValueError, match=rf"{op}: logit_scale=.* is too large: cupynce takes "
                                         r"the \*log\* of the logit scale.*open_clip.*"
                                         r"math\.log\(scale\).*cupynce\.integrations"):
        call(op, logit_scale=make(value))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_logit_scale_limit_is_the_same_for_every_dtype(dtype, no_work):
    """One limit, float32's exp range, for every dtype: a call that runs in float64 runs in
    float32, and exp(100) = 2.7e43 in float64 (open_clip's clamped scale passed as a log) is
    refused there too."""
    a, b = _arr((N, D), dtype), _arr((N, D), dtype, 1)
    for value in (88.8, 100.0, 710.0):
        with pytest.raises(ValueError, match=r"overflows float32 \(the limit for every dtype"):
            call("clip_loss", a=a, b=b, logit_scale=value)


def test_large_but_finite_logit_scale_runs():
    """Below the limit the log convention runs as asked (exp(88) = 1.7e38)."""
    loss, ctx = call("clip_loss", a=_arr((N, D), np.float64), b=_arr((N, D), np.float64, 1),
                     logit_scale=88.0, normalize=True)
    assert np.isfinite(loss) and all(np.isfinite(g).all() for g in cupynce.clip_loss_backward(ctx))
    loss, _ = call("clip_loss", logit_scale=30.0, normalize=True)
    assert np.isfinite(loss)


def test_grad_loss_error_names_the_type(monkeypatch):
    """A torch tensor given to the NumPy API's backward: the message says what it is."""
    torch = pytest.importorskip("torch")
    ctx = _ctx("nt_xent", "mean")
    no_work_again(monkeypatch)
    with pytest.raises(ValueError, match=r"grad_loss must be a scalar \(real or 0-d numpy array\)"
                                         r", got torch\.Tensor of shape \(\)"):
        cupynce.nt_xent_backward(ctx, torch.tensor(1.0))


@pytest.mark.parametrize("neg", [None, "shared", "paired"])
def test_one_row_is_a_batch(neg):
    """info_nce and clip_loss take N = 1 (a last batch of one): the loss is defined."""
    q, k = _arr((1, D)), _arr((1, D), seed=1)
    negatives = {None: None, "shared": _arr((5, D), seed=2), "paired": _arr((1, 5, D), seed=2)}[neg]
    loss, ctx = cupynce.info_nce_forward(q, k, 0.1, negatives=negatives)
    grads = cupynce.info_nce_backward(ctx)
    assert grads[0].shape == (1, D) and grads[1].shape == (1, D)
    if neg is None:  # the positive is the only candidate: log 1 - 0
        assert loss == 0 and not grads[0].any() and not grads[1].any()
    else:
        assert loss > 0 and np.isfinite(loss)
    loss, ctx = cupynce.clip_loss_forward(q, k, 2.0)
    da, db, dls = cupynce.clip_loss_backward(ctx)
    assert loss == 0 and not da.any() and not db.any() and dls == 0


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("op", ["clip_loss", "siglip_loss"])
def test_device_logit_scale_past_the_limit_gives_nan(op, dtype):
    """A device logit_scale is never read on the host: past the host check's limit
    (log of float32's largest value) the loss and every gradient are NaN, in every dtype —
    float64's exp(100) would otherwise give a finite, meaningless loss (issue 22).  Also
    through cupynce.torch with CUDA tensors."""
    cupy = _cupy_with_device()
    a, b = cupy.asarray(_arr((N, D), dtype)), cupy.asarray(_arr((N, D), dtype, 1))
    acc = np.float64 if dtype == np.float64 else np.float32
    for value, finite in ((100.0, False), (89.0, False), (math.log(100.0), True)):
        ls = cupy.asarray(value, acc)
        loss, ctx = call(op, a=a, b=b, logit_scale=ls, normalize=True)
        grads = _FUNCS[op][2](ctx)
        outs = [cupy.asnumpy(x) for x in (loss, *grads)]
        assert all(np.isfinite(x).all() == finite for x in outs), (value, outs)
        assert finite or all(np.isnan(x).all() for x in outs), (value, outs)
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct

    ta, tb = (torch.as_tensor(x, device="cuda").requires_grad_(True) for x in (a, b))
    ls = torch.tensor(100.0, dtype=torch.float64 if dtype == np.float64 else torch.float32,
                      device="cuda", requires_grad=True)
    extra = (-10.0,) if op == "siglip_loss" else ()
    loss = getattr(ct, op)(ta, tb, ls, *extra, normalize=True)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(ta.grad).all() and torch.isnan(ls.grad)
