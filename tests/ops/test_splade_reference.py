"""Tests of the float64 SPLADE oracle ``cupynce.reference.splade_pool`` / ``flops_regularizer``.

All on CPU:

1. agreement with torch autograd in float64 on the textbook formula
   ``act(masked_fill(x @ W.T + b, ~mask, -inf).max(dim=1))`` (continuous random data: no ties);
2. central finite differences (float64, h = 1e-6) for x, weight and bias, on data built so
   that no top-two logits are within 1e-3 of each other and no pre-activation is within 1e-3
   of the ReLU kink (a finite difference across a kink would be meaningless);
3. the semantics the fast paths must reproduce: all-masked rows, L = 1, ties to the lowest l,
   the ``argmax=`` override, NaN propagation, low-precision inputs cast to float64.

Tolerances: against torch rtol 1e-10 (atol 1e-12 x the largest magnitude); against finite
differences 1e-6 relative to the largest magnitude (the truncation error of a central
difference is O(h^2 |f'''|) and the rounding error O(eps |f| / h) ~ 1e-10 here).
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from cupynce import reference as ref

ACTIVATIONS = ("relu", "log1p_relu")
TORCH_RTOL = 1e-10
FD_TOL = 1e-6
FD_H = 1e-6
MARGIN = 1e-3  # no near-ties / near-kinks closer than this in the finite-difference data


def _mask(kind, b, l, rng):
    """None, or a random 0/1 int mask whose row 0 is all zero and every other row has a 1."""
    if kind is None:
        return None
    m = (rng.random((b, l)) < 0.6).astype(np.int64)
    m[np.arange(1, b), rng.integers(l, size=b - 1)] = 1  # rows 1.. keep a position
    m[0] = 0
    if kind == "bool":
        return m.astype(bool)
    return m


def _data(shape, *, bias, mask, seed, bias_shift=0.0):
    b, l, d, v = shape
    rng = np.random.default_rng(seed)
    # x has a positive mean and the even rows of w are negative: those columns are mostly
    # inactive (max_l < 0) even without a bias, so relu's zero branch is exercised too.
    x = 0.5 * rng.standard_normal((b, l, d)) + 0.7
    w = rng.standard_normal((v, d)) / math.sqrt(d)
    w[::2] = -np.abs(w[::2])
    bb = rng.standard_normal(v) * 0.5 + bias_shift if bias else None
    return x, w, bb, _mask(mask, b, l, rng), rng


def _assert_close(actual, expected, name, rtol=TORCH_RTOL):
    expected = np.asarray(expected, np.float64)
    assert np.shape(actual) == expected.shape, f"{name}: {np.shape(actual)} != {expected.shape}"
    scale = max(1.0, float(np.abs(expected).max())) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=1e-12 * scale, err_msg=name)


# ----------------------------------------------------------------------------
# 1. torch autograd (float64)
# ----------------------------------------------------------------------------
def _torch_splade(torch, x, w, b, mask, activation, grad_out):
    """The textbook formula: logits = x @ W.T + b, masked_fill(-inf), max over L, act."""
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    bt = None if b is None else torch.tensor(b, requires_grad=True)
    logits = xt @ wt.T
    if bt is not None:
        logits = logits + bt
    if mask is not None:
        keep = torch.tensor(np.asarray(mask) != 0)
        logits = logits.masked_fill(~keep[:, :, None], float("-inf"))
    m = logits.max(dim=1).values  # (B, V); -inf on all-masked rows
    act = torch.relu(m) if activation == "relu" else torch.log1p(torch.relu(m))
    if mask is not None:  # all-masked rows give 0 (relu(-inf) is already 0; be explicit)
        empty = ~keep.any(dim=1, keepdim=True)
        act = torch.where(empty, torch.zeros_like(act), act)
    act.backward(torch.tensor(grad_out))
    return (act.detach().numpy(), xt.grad.numpy(), wt.grad.numpy(),
            None if bt is None else bt.grad.numpy())


SHAPES = [pytest.param((3, 5, 4, 7), id="B3L5D4V7"),
          pytest.param((2, 1, 3, 6), id="L1"),
          pytest.param((4, 6, 5, 37), id="B4L6D5V37")]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mask", [None, "int", "bool"], ids=["nomask", "mask01", "maskbool"])
def test_matches_torch(shape, activation, bias, mask):
    torch = pytest.importorskip("torch")
    seed = zlib.crc32(repr((shape, bias)).encode())
    x, w, b, m, rng = _data(shape, bias=bias, mask=mask, seed=seed)
    go = rng.standard_normal((shape[0], shape[3]))  # upstream gradient, not ones
    out, (dx, dw, db) = ref.splade_pool(x, w, b, m, activation, go)
    t_out, t_dx, t_dw, t_db = _torch_splade(torch, x, w, b, m, activation, go)

    assert out.dtype == dx.dtype == dw.dtype == np.float64
    assert (out > 0).any() and (out == 0).any(), "data must have active and inactive entries"
    _assert_close(out, t_out, "out")
    _assert_close(dx, t_dx, "dx")
    _assert_close(dw, t_dw, "dweight")
    if bias:
        _assert_close(db, t_db, "dbias")
    else:
        assert db is None


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_grad_out_none_means_ones(activation):
    torch = pytest.importorskip("torch")
    x, w, b, m, _ = _data((3, 4, 3, 5), bias=True, mask="int", seed=7)
    out, grads = ref.splade_pool(x, w, b, m, activation)
    t_out, *t_grads = _torch_splade(torch, x, w, b, m, activation, np.ones((3, 5)))
    _assert_close(out, t_out, "out")
    for name, g, tg in zip(("dx", "dweight", "dbias"), grads, t_grads):
        _assert_close(g, tg, name)


# ----------------------------------------------------------------------------
# 2. finite differences
# ----------------------------------------------------------------------------
def _separated(x, w, b, mask):
    """True if every (b, v) has a top-1 / top-2 gap and a |pre-activation| of at least MARGIN."""
    z = ref.splade_logits(x, w, mask)
    keep = np.ones(x.shape[:2], bool) if mask is None else np.asarray(mask) != 0
    rows = keep.any(axis=1)
    zs = np.sort(z[rows], axis=1)  # ascending over l
    top = zs[:, -1, :]
    if zs.shape[1] > 1:
        second = zs[:, -2, :]
        gap = top - second  # inf when only one position is unmasked: no tie possible
        if np.nanmin(gap) < MARGIN:
            return False
    pre = top + (0.0 if b is None else b[None, :])
    return bool(np.abs(pre).min() >= MARGIN)


def _central_difference(f, arr, h=FD_H):
    num = np.zeros_like(arr)
    for idx in np.ndindex(arr.shape):
        old = arr[idx]
        arr[idx] = old + h
        fp = f()
        arr[idx] = old - h
        fm = f()
        arr[idx] = old
        num[idx] = (fp - fm) / (2 * h)
    return num


@pytest.mark.parametrize("shape", [(2, 3, 3, 4), (3, 1, 2, 5)], ids=["B2L3D3V4", "L1"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mask", [None, "int"], ids=["nomask", "mask"])
def test_gradients_match_finite_differences(shape, activation, bias, mask):
    # the first seed whose data has no near-tie, no near-kink, and active entries (out > 0)
    for seed in range(100):
        x, w, b, m, rng = _data(shape, bias=bias, mask=mask, seed=seed)
        if _separated(x, w, b, m) and (ref.splade_pool(x, w, b, m, "relu")[0] > 0).sum() >= 3:
            break
    else:
        pytest.fail("no well-separated data with active entries in 100 seeds")
    go = rng.standard_normal((shape[0], shape[3]))
    out, grads = ref.splade_pool(x, w, b, m, activation, go)

    def f():
        return float(np.sum(go * ref.splade_pool(x, w, b, m, activation)[0]))

    for name, arr, g in zip(("x", "weight", "bias"), (x, w, b), grads):
        if arr is None:
            assert g is None
            continue
        num = _central_difference(f, arr)
        scale = max(float(np.abs(num).max()), 1e-3)
        np.testing.assert_allclose(g, num, rtol=0, atol=FD_TOL * scale, err_msg=name)
    if m is not None:  # masked positions of x never matter
        assert np.all(grads[0][np.asarray(m) == 0] == 0.0)


# ----------------------------------------------------------------------------
# 3. semantics
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_all_masked_row_gives_zeros(activation):
    x, w, b, _, rng = _data((3, 4, 3, 6), bias=True, mask=None, seed=3, bias_shift=5.0)
    m = np.ones((3, 4))
    m[1] = 0.0  # a float 0/1 mask with an all-masked middle row
    go = rng.standard_normal((3, 6))
    out, (dx, dw, db) = ref.splade_pool(x, w, b, m, activation, go)
    assert np.all(out[1] == 0.0)
    assert np.all(out[[0, 2]] > 0)  # bias_shift 5: the other rows are all active
    assert np.all(dx[1] == 0.0)
    np.testing.assert_array_equal(ref.splade_argmax(x, w, m)[1], 0)
    # the other rows alone give the same dweight / dbias
    _, (dx02, dw02, db02) = ref.splade_pool(x[[0, 2]], w, b, m[[0, 2]], activation, go[[0, 2]])
    np.testing.assert_allclose(dw, dw02, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(db, db02, rtol=1e-14, atol=1e-15)
    np.testing.assert_array_equal(dx[[0, 2]], dx02)


def test_every_row_masked():
    x, w, b, _, _ = _data((2, 3, 4, 5), bias=True, mask=None, seed=4, bias_shift=3.0)
    out, (dx, dw, db) = ref.splade_pool(x, w, b, np.zeros((2, 3), bool))
    for a in (out, dx, dw, db):
        assert np.all(a == 0.0)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_L1_is_the_plain_formula(activation):
    x, w, b, _, rng = _data((4, 1, 3, 5), bias=True, mask=None, seed=5)
    go = rng.standard_normal((4, 5))
    out, (dx, dw, db) = ref.splade_pool(x, w, b, None, activation, go)
    m = x[:, 0] @ w.T + b
    act = np.maximum(m, 0)
    dact = (m > 0).astype(float)
    if activation == "log1p_relu":
        act, dact = np.log1p(act), dact / (1 + act)
    g = go * dact
    np.testing.assert_allclose(out, act, rtol=1e-14)
    np.testing.assert_allclose(dx[:, 0], g @ w, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(dw, g.T @ x[:, 0], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(db, g.sum(0), rtol=1e-13, atol=1e-15)


def test_ties_go_to_the_lowest_position():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 5, 3))
    x[:, 3] = x[:, 1] = 10.0 * np.abs(x[:, 1])  # positions 1 and 3 tie and dominate
    w = np.abs(rng.standard_normal((4, 3)))  # positive weights: 1 and 3 win for every v
    am = ref.splade_argmax(x, w)
    np.testing.assert_array_equal(am, 1)
    _, (dx, dw, _) = ref.splade_pool(x, w, activation="relu")
    assert np.all(dx[:, 1] != 0) and np.all(dx[:, 3] == 0)
    np.testing.assert_allclose(dw, np.tile(x[:, 1].sum(0), (4, 1)), rtol=1e-14)
    # masking position 1 moves the win to position 3
    m = np.ones((2, 5), bool)
    m[:, 1] = False
    np.testing.assert_array_equal(ref.splade_argmax(x, w, m), 3)


def test_argmax_override():
    x, w, b, m, rng = _data((3, 4, 3, 5), bias=True, mask="int", seed=8)
    go = rng.standard_normal((3, 5))
    am = ref.splade_argmax(x, w, m)
    assert am.dtype.kind == "i" and am.shape == (3, 5)
    base = ref.splade_pool(x, w, b, m, "relu", go)
    same = ref.splade_pool(x, w, b, m, "relu", go, argmax=am.astype(np.int16))
    np.testing.assert_array_equal(base[0], same[0])
    for g0, g1 in zip(base[1], same[1]):
        np.testing.assert_array_equal(g0, g1)
    # another (unmasked) winner: out and gradients are evaluated at that position
    other = am.copy()
    keep = np.asarray(m) != 0
    bb, vv = 2, 1
    alt = [l for l in range(4) if keep[bb, l] and l != am[bb, vv]]
    if alt:
        other[bb, vv] = alt[0]
        out, _ = ref.splade_pool(x, w, b, m, "relu", go, argmax=other)
        z = x[bb, alt[0]] @ w[vv] + b[vv]
        assert out[bb, vv] == max(z, 0.0)
    bad = am.copy()
    bad[1, 0] = np.flatnonzero(~keep[1])[0] if (~keep[1]).any() else 99
    with pytest.raises(ValueError, match="argmax"):
        ref.splade_pool(x, w, b, m, "relu", go, argmax=bad)


def test_nan_reaches_the_output_only_when_unmasked():
    x, w, b, _, _ = _data((2, 3, 4, 5), bias=True, mask=None, seed=9)
    x[0, 1, 2] = np.nan
    with np.errstate(invalid="ignore"):
        out, _ = ref.splade_pool(x, w, b)
    assert np.all(np.isnan(out[0])) and np.all(np.isfinite(out[1]))
    m = np.ones((2, 3))
    m[0, 1] = 0
    out, (dx, dw, db) = ref.splade_pool(x, w, b, m)
    for a in (out, dx, dw, db):
        assert np.all(np.isfinite(a))


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_low_precision_inputs_are_cast_to_float64(dtype):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x, w, b, m, rng = _data((2, 3, 4, 5), bias=True, mask="int", seed=10)
    go = rng.standard_normal((2, 5))
    low = [a.astype(dt) for a in (x, w, b, go)]
    up = [a.astype(np.float64) for a in low]
    r_low = ref.splade_pool(*low[:3], m, "log1p_relu", low[3])
    r_up = ref.splade_pool(*up[:3], m, "log1p_relu", up[3])
    assert r_low[0].dtype == np.float64
    np.testing.assert_array_equal(r_low[0], r_up[0])
    for g0, g1 in zip(r_low[1], r_up[1]):
        assert g0.dtype == np.float64
        np.testing.assert_array_equal(g0, g1)


def test_bad_activation_raises():
    x, w, *_ = _data((2, 3, 4, 5), bias=False, mask=None, seed=11)
    with pytest.raises(ValueError, match="activation"):
        ref.splade_pool(x, w, activation="gelu")


# ----------------------------------------------------------------------------
# FLOPS regulariser
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 3), (5, 7), (4, 37)])
@pytest.mark.parametrize("grad", [None, 0.7])
def test_flops_regularizer_matches_torch(shape, grad):
    torch = pytest.importorskip("torch")
    out = np.abs(np.random.default_rng(12).standard_normal(shape))
    value, dout = ref.flops_regularizer(out, grad)
    ot = torch.tensor(out, requires_grad=True)
    vt = (ot.mean(dim=0) ** 2).sum()
    vt.backward(torch.tensor(1.0 if grad is None else grad, dtype=torch.float64))
    assert np.ndim(value) == 0 and dout.shape == shape and dout.dtype == np.float64
    _assert_close(value, vt.detach().numpy(), "value")
    _assert_close(dout, ot.grad.numpy(), "dout")


def test_flops_regularizer_finite_differences():
    out = np.abs(np.random.default_rng(13).standard_normal((3, 4)))
    _, dout = ref.flops_regularizer(out, 1.3)
    num = _central_difference(lambda: 1.3 * float(ref.flops_regularizer(out)[0]), out)
    np.testing.assert_allclose(dout, num, rtol=0, atol=FD_TOL * np.abs(num).max())


def test_flops_regularizer_hand_computed():
    out = np.array([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]])
    value, dout = ref.flops_regularizer(out)
    assert value == 2.0 ** 2 + 0.0 + 1.0 ** 2
    np.testing.assert_array_equal(dout, [[2.0, 0.0, 1.0], [2.0, 0.0, 1.0]])
