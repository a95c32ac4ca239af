"""The NumPy path of the SPLADE head (``cupynce.splade_pool*``, ``cupynce.flops_regularizer*``).

Everything is checked against the float64 oracle ``cupynce.reference.splade_pool`` evaluated
on the inputs *as the op sees them* (already rounded to the dtype): out, the arg-max, dx,
dweight, dbias, for float64 / float32 / float16 / bfloat16 x relu / log1p_relu x mask (none,
random int 0/1, bool, float 0/1; one all-masked row) x bias / no bias, with L = 1, B = 1,
D = 1 and odd V; plus exact ties, the transposed weight view, determinism, workspace tiling,
NaN propagation, int16 / int32 arg-max, and every bad input of the spec.

How errors are measured
-----------------------
Every comparison is element-wise against the magnitude of the terms that make the value
(the standard forward-error bound of a sum), ``|got - ref| <= TOL[dtype][kind] * A``:

* out:      ``A = |out| + S + |bias|``, ``S = sum_d |x[b, l*, d]| |W[v, d]|`` (the logit's
            own rounding is ``<= u S``, and act is 1-Lipschitz);
* dweight:  ``A = sum_b |g'| |x[b, l*]|``;  dx: ``A = sum_{v: l*=l} |g'| |W[v]|``;
  dbias:    ``A = sum_b |g'|``, with ``|g'| = |grad_out| act'(out)``.

An entry with no term (a dweight row of a never-active v, a dx row that never wins) must
then be exactly 0.  The tolerances (``TOL`` below):

* float64 1e-10, float32 1e-5 (out) / 1e-4 (gradients): the figures asked for, far above
  the measured errors (float64 <= 4.4e-16, float32 <= 2.3e-7 in units of A);
* float16 / bfloat16, with the unit roundoff u (2^-11 / 2^-8): out 2u -- the logit plus the
  bias is rounded to the dtype before the max (<= u (S + |bias|)) and out once more at the
  end (<= u |out|), the fp32
  accumulation adds ~D 2^-24 S; gradients 8u -- g' = grad_out exp(-out) is formed from the
  rounded out (relative error <= u (|out| + S + |bias|)) <= ~5u for this data), the
  sum is accumulated in fp32 (negligible) and rounded once (u).  Measured on the NumPy path
  (``pytest -s -k measured``): float16 out 3.4e-4 (tol 9.8e-4), gradients <= 8.9e-4 (tol
  3.9e-3); bfloat16 out 2.7e-3 (tol 7.8e-3), gradients <= 8.2e-3 (tol 3.1e-2).
  A 16-bit gradient also gets an absolute allowance of half its dtype's subnormal spacing
  (float16 2^-25): a tiny gradient stored as a subnormal cannot be closer than that.

Arg-max.  With continuous data the low-precision logits can tie or swap where the float64
ones do not; the op's winner l' is accepted iff its float64 logit is within the rounding of
both logits of the float64 maximum: ``z[l'] >= z[l_ref] - delta(l') - delta(l_ref)``,
``delta = u_round (S + |bias|) + D u_acc S`` (u_round = u of the dtype for half inputs, whose
logits are rounded after the bias, else 0; u_acc = 2^-24, or 2^-53 for float64).  out and the gradients are then compared
with the oracle evaluated at the op's winners (``reference.splade_pool(..., argmax=)``), so the
check of the gradients is not loosened by a legitimate swap.  Separately, data on a coarse grid
(every logit exact in every dtype, many exact ties) must give exactly the oracle's arg-max
(ties to the lowest l) in every dtype, and a float16 / bfloat16 case where two logits differ in
float64 but round to the same value must pick the lower l (the spec: ties judged on the
rounded logits), and one where they tie only once the bias is added (the spec: the logits
rounded after the bias, as ``F.linear`` gives them).

ReLU kink.  Where the float64 pre-activation is within rounding of 0 the op may see it on the
other side; the data generator sets grad_out = 0 at those entries (``make_inputs``), so that
the gradients compare the same active set.  Nothing else is excluded.
"""
from __future__ import annotations

import math
import re
import zlib

import ml_dtypes
import numpy as np
import pytest

import cupynce
from cupynce import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
DTYPES = [pytest.param(F64, id="f64"), pytest.param(F32, id="f32"),
          pytest.param(F16, id="f16"), pytest.param(BF16, id="bf16")]
ACTIVATIONS = ("relu", "log1p_relu")
MASKS = [None, "rand01", "bool", "float"]

#: unit roundoff of each dtype
U = {F64: 2.0 ** -53, F32: 2.0 ** -24, F16: 2.0 ** -11, BF16: 2.0 ** -8}
#: element-wise tolerance in units of the term magnitude A (module docstring)
TOL = {
    F64: {"out": 1e-10, "grad": 1e-10},
    F32: {"out": 1e-5, "grad": 1e-4},
    F16: {"out": 2 * U[F16], "grad": 8 * U[F16]},
    BF16: {"out": 2 * U[BF16], "grad": 8 * U[BF16]},
}
#: FLOPS regulariser: relative error of the value (accumulated in fp32 / fp64)
TOL_FLOPS = {F64: 1e-12, F32: 1e-5, F16: 1e-5, BF16: 1e-5}

SHAPES = [pytest.param((3, 7, 5, 37), id="B3L7D5V37"),
          pytest.param((2, 1, 5, 37), id="L1"),
          pytest.param((1, 4, 1, 9), id="B1D1V9")]

# worst errors seen, per (dtype, quantity), for test_print_measured_errors
MEASURED: dict = {}


# ----------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------
def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def make_mask(kind, b, l, rng):
    """None, or a (B, L) 0/1 mask of the given kind; for B >= 2 the last row is all masked and
    every other row keeps at least one position."""
    if kind is None:
        return None
    m = rng.random((b, l)) < 0.6
    m[np.arange(b), rng.integers(l, size=b)] = True
    if b >= 2:
        m[-1] = False
    return {"rand01": m.astype(np.int32), "bool": m, "float": m.astype(np.float32)}[kind]


def make_inputs(shape, dtype, mask=None, bias=True, *, seed=0, grid=False, bias_shift=0.0):
    """x (B, L, D), weight (V, D), bias (V,) or None, mask, grad_out (B, V) as NumPy arrays.

    Continuous data: x has a positive mean, the even rows of W are negative and rows 3, 7, ...
    positive, so columns are active (out > 0) and inactive alike.  ``grid=True``: x, W in
    {-3..3}/4 and the bias in {-8..8}/16, so that every logit and every ``m + bias`` is exact
    in every dtype (many exact ties).  grad_out is never all ones.
    """
    b, l, d, v = shape
    rng = _rng("splade", shape, str(dtype), mask, bias, seed, grid)
    if grid:
        x = rng.integers(-3, 4, (b, l, d)) / 4.0
        w = rng.integers(-3, 4, (v, d)) / 4.0
        bb = rng.integers(-8, 9, v) / 16.0 + bias_shift
    else:
        x = 0.5 * rng.standard_normal((b, l, d)) + 0.7
        w = rng.standard_normal((v, d)) / math.sqrt(d)
        w[::2] = -np.abs(w[::2])
        w[3::4] = np.abs(w[3::4])
        bb = 0.5 * rng.standard_normal(v) + bias_shift
    go = rng.standard_normal((b, v))
    inp = {"x": x.astype(dtype), "weight": w.astype(dtype),
           "bias": bb.astype(dtype) if bias else None,
           "mask": make_mask(mask, b, l, rng), "grad_out": go.astype(dtype)}
    # Where the float64 pre-activation m is within rounding of the ReLU kink, the op may
    # legitimately see it on the other side (its logits are rounded): g' jumps between 0 and
    # grad_out there.  Such entries get grad_out = 0, so the gradient checks compare the same
    # active set; out itself is still checked there (act is 1-Lipschitz, see A of out).
    near = np.abs(pre_activation(inp)) <= kink_slack(inp)
    inp["grad_out"][near] = 0
    return inp


def pre_activation(inp):
    """Float64 m[b, v] = max_l z[b, l, v] + bias[v] of the (rounded) inputs; 0 if all masked."""
    keep = _keep(inp)
    z = ref.splade_logits(f64(inp["x"]), f64(inp["weight"]), keep)
    with np.errstate(invalid="ignore"):
        m = z.max(axis=1) + (0.0 if inp["bias"] is None else f64(inp["bias"])[None, :])
    return np.where(keep.any(axis=1)[:, None], m, 0.0)


def kink_slack(inp):
    """How far rounding may move m: (u_round + D u_acc) (max_l S + |bias|), times 4."""
    dtype = np.dtype(inp["x"].dtype)
    u_round = U[dtype] if dtype.itemsize == 2 else 0.0
    u_acc = U[F64] if dtype == F64 else U[F32]
    s = np.einsum("bld,vd->blv", np.abs(f64(inp["x"])), np.abs(f64(inp["weight"]))).max(axis=1)
    bias = 0.0 if inp["bias"] is None else np.abs(f64(inp["bias"]))[None, :]
    return 4.0 * (u_round + inp["x"].shape[2] * u_acc) * (s + bias)


# ----------------------------------------------------------------------------------------
# running the op (NumPy or CuPy arrays alike) and checking it against the oracle
# ----------------------------------------------------------------------------------------
def host(a):
    """A NumPy array (from NumPy or CuPy), or None."""
    if a is None:
        return None
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def f64(a):
    return None if a is None else host(a).astype(np.float64)


def run_op(inp, activation, *, workspace_bytes=None, to=None):
    """(out, argmax, (dx, dweight, dbias)) from splade_pool_forward / splade_pool_backward.

    ``to`` maps each NumPy input to the array kind to run on (None: NumPy)."""
    conv = (lambda a: a) if to is None else (lambda a: None if a is None else to(a))
    out, ctx = cupynce.splade_pool_forward(
        conv(inp["x"]), conv(inp["weight"]), conv(inp["bias"]), conv(inp["mask"]),
        activation=activation, workspace_bytes=workspace_bytes)
    assert ctx.op == "splade_pool" and len(ctx.stats) == 1
    grads = cupynce.splade_pool_backward(ctx, conv(inp["grad_out"]))
    return out, ctx.stats[0], grads


def _keep(inp):
    b, l = inp["x"].shape[:2]
    return np.ones((b, l), bool) if inp["mask"] is None else host(inp["mask"]) != 0


def term_magnitudes(inp, activation, argmax, out_ref):
    """The magnitudes A of out, dx, dweight, dbias at the winners ``argmax`` (docstring)."""
    x, w = np.abs(f64(inp["x"])), np.abs(f64(inp["weight"]))
    bias = np.zeros(w.shape[0]) if inp["bias"] is None else np.abs(f64(inp["bias"]))
    am = host(argmax).astype(np.int64)
    l = x.shape[1]
    dact = (out_ref > 0) * (np.exp(-out_ref) if activation == "log1p_relu" else 1.0)
    ga = np.abs(f64(inp["grad_out"])) * dact  # (B, V), 0 on all-masked rows
    x_win = np.take_along_axis(x, am[:, :, None], axis=1)  # (B, V, D)
    s = np.einsum("bvd,vd->bv", x_win, w)  # sum_d |x||W| at the winner
    a_out = np.abs(out_ref) + s + bias[None, :]  # act is 1-Lipschitz: |d out| <= |d m|
    onehot = (np.arange(l)[None, :, None] == am[:, None, :]).astype(np.float64)
    a_dx = np.einsum("blv,bv,vd->bld", onehot, ga, w)
    a_dw = np.einsum("bv,bvd->vd", ga, x_win)
    a_db = ga.sum(axis=0)
    return a_out, (a_dx, a_dw, a_db), s


#: half the spacing of the subnormals (the rounding error of a result stored there)
SUBNORMAL_HALF_STEP = {np.dtype(np.float16): 2.0 ** -25, np.dtype(BF16): 2.0 ** -134}


def check_elementwise(name, got, want, mag, tol, case, atol=0.0):
    """``|got - want| <= tol * mag + atol`` element-wise; a verbose failure otherwise."""
    got = f64(got)
    assert got.shape == want.shape, f"{case} {name}: shape {got.shape} != {want.shape}"
    err = np.abs(got - want)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / (tol * mag + atol))
    ratio = np.where(np.isnan(got) | np.isnan(want), np.inf, ratio)
    worst = float(ratio.max()) if ratio.size else 0.0
    key = (case.split()[0], name)
    MEASURED[key] = max(MEASURED.get(key, 0.0), float((err / np.maximum(mag, 1e-300)).max())
                        if err.size and np.isfinite(err).all() else 0.0)
    if not worst <= 1.0:
        i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        pytest.fail(f"{case} {name}: error {err[i]:.3e} at {tuple(int(j) for j in i)} exceeds "
                    f"{tol:.1e} x magnitude {mag[i]:.3e} (x{worst:.2f}); got {got[i]!r}, "
                    f"oracle {want[i]!r}; {int((ratio > 1).sum())} of {ratio.size} entries over")


def argmax_slack(inp, dtype, s):
    """delta(b, v) of the winner's logit (module docstring): how far rounding may move it --
    a 16-bit logit is rounded after the bias, so its rounding scales with S + |bias|."""
    u_round = U[dtype] if np.dtype(dtype).itemsize == 2 else 0.0
    u_acc = U[F64] if dtype == F64 else U[F32]
    d = inp["x"].shape[2]
    bias = 0.0 if inp["bias"] is None else np.abs(f64(inp["bias"]))[None, :]
    # x2: safety for the few-term accumulation
    return 2.0 * (u_round * (s + bias) + d * u_acc * s)


ALL_PARTS = ("out", "dx", "dweight", "dbias")


def check_against_reference(inp, activation, out, argmax, grads, *, exact_argmax=False,
                            case="", parts=ALL_PARTS):
    """out / argmax / grads of the op (any array kind) against the float64 oracle.

    ``parts`` limits the value checks (a caller that holds the op's result on a subset of the
    batch or of the vocabulary can compare only what that subset determines); the gradients
    left out may be None."""
    dtype = np.dtype(inp["x"].dtype)
    tol = TOL[dtype]
    case = f"{dtype.name} {activation} {case}"
    b, l, d = inp["x"].shape
    v = inp["weight"].shape[0]
    out_h, am = host(out), host(argmax)
    dx, dw, db = (host(g) for g in grads)
    if not isinstance(inp["mask"], (np.ndarray, type(None))):
        raise TypeError("inp holds NumPy arrays; only the op's results may be on the device")

    # dtypes and shapes
    assert out_h.dtype == dtype and out_h.shape == (b, v), f"{case}: out {out_h.dtype}{out_h.shape}"
    want_idx = np.int16 if l <= 32768 else np.int32
    assert am.dtype == want_idx and am.shape == (b, v), f"{case}: argmax {am.dtype}{am.shape}"
    if "dx" in parts:
        assert dx.dtype == dtype and dx.shape == (b, l, d), f"{case}: dx {dx.dtype}{dx.shape}"
    wdt = np.dtype(inp["weight"].dtype)
    if "dweight" in parts:
        assert dw.dtype == wdt and dw.shape == (v, d), f"{case}: dweight {dw.dtype}{dw.shape}"
    if inp["bias"] is None:
        assert db is None, f"{case}: dbias must be None without a bias"
    elif "dbias" in parts:
        assert db.dtype == dtype and db.shape == (v,), f"{case}: dbias {db.dtype}{db.shape}"

    # arg-max: in range, unmasked, 0 on all-masked rows, and a valid winner
    keep = _keep(inp)
    empty = ~keep.any(axis=1)
    am64 = am.astype(np.int64)
    assert np.all((am64 >= 0) & (am64 < l)), f"{case}: argmax out of [0, L)"
    assert np.all(am64[empty] == 0), f"{case}: argmax of an all-masked row must be 0"
    rows = ~empty
    assert np.all(keep[np.arange(b)[:, None], am64][rows]), f"{case}: argmax at a masked l"
    am_ref = ref.splade_argmax(f64(inp["x"]), f64(inp["weight"]), keep)
    if exact_argmax:
        bad = np.argwhere(am64 != am_ref)
        assert bad.size == 0, (f"{case}: argmax differs from the oracle's (ties -> lowest l) at "
                               f"{len(bad)} entries, first (b, v) = {tuple(bad[0])}: got "
                               f"{am64[tuple(bad[0])]}, oracle {am_ref[tuple(bad[0])]}")
    else:
        z = ref.splade_logits(f64(inp["x"]), f64(inp["weight"]), keep)
        x_abs, w_abs = np.abs(f64(inp["x"])), np.abs(f64(inp["weight"]))
        s_all = np.einsum("bld,vd->blv", x_abs, w_abs)
        z_got = np.take_along_axis(z, am64[:, None, :], 1)[:, 0]
        z_max = np.take_along_axis(z, am_ref[:, None, :], 1)[:, 0]
        s_got = np.take_along_axis(s_all, am64[:, None, :], 1)[:, 0]
        s_max = np.take_along_axis(s_all, am_ref[:, None, :], 1)[:, 0]
        slack = argmax_slack(inp, dtype, s_got) + argmax_slack(inp, dtype, s_max)
        with np.errstate(invalid="ignore"):
            bad = np.argwhere(rows[:, None] & ~(z_got >= z_max - slack) & ~np.isnan(z_max))
        assert bad.size == 0, (
            f"{case}: argmax is not a maximiser within rounding at {len(bad)} entries, first "
            f"(b, v) = {tuple(bad[0])}: l = {am64[tuple(bad[0])]} with logit "
            f"{z_got[tuple(bad[0])]!r}, oracle l = {am_ref[tuple(bad[0])]} with "
            f"{z_max[tuple(bad[0])]!r}, slack {slack[tuple(bad[0])]:.2e}")
        if dtype == F64:
            assert np.array_equal(am64, am_ref), f"{case}: float64 argmax differs from oracle"

    # values and gradients, at the op's winners
    out_r, (dx_r, dw_r, db_r) = ref.splade_pool(
        f64(inp["x"]), f64(inp["weight"]), f64(inp["bias"]), inp["mask"], activation,
        f64(inp["grad_out"]), argmax=am64)
    a_out, (a_dx, a_dw, a_db), _ = term_magnitudes(inp, activation, am64, out_r)
    assert np.all(out_h[empty] == 0), f"{case}: out of an all-masked row must be 0"
    if "out" in parts:
        check_elementwise("out", out_h, out_r, a_out, tol["out"], case)
    # a gradient stored in a 16-bit dtype cannot be closer than half its subnormal spacing
    sub = SUBNORMAL_HALF_STEP.get(np.dtype(dtype), 0.0)
    if "dx" in parts:
        check_elementwise("dx", dx, dx_r, a_dx, tol["grad"], case, sub)
    if "dweight" in parts:
        check_elementwise("dweight", dw, dw_r, a_dw, tol["grad"], case, sub)
    if "dbias" in parts and db is not None:
        check_elementwise("dbias", db, db_r, a_db, tol["grad"], case, sub)


# ----------------------------------------------------------------------------------------
# 1. against the oracle
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mask", MASKS, ids=["nomask", "rand01", "bool", "float"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, activation, mask, bias, shape):
    inp = make_inputs(shape, dtype, mask, bias)
    out, am, grads = run_op(inp, activation)
    check_against_reference(inp, activation, out, am, grads, case=f"{shape} {mask} bias={bias}")
    # data sanity: the case exercises active and (for B > 1 or with bias) inactive entries
    assert (host(out).astype(np.float64) > 0).any()


@pytest.mark.parametrize("mask", [None, "bool"], ids=["nomask", "bool"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_ties_go_to_the_lowest_position(dtype, activation, mask):
    """Grid data: every logit exact in every dtype, many exact ties; the arg-max must be the
    oracle's exactly (lowest l), in every dtype."""
    inp = make_inputs((4, 12, 2, 23), dtype, mask, True, grid=True, bias_shift=0.5)
    z = ref.splade_logits(f64(inp["x"]), f64(inp["weight"]), _keep(inp))
    top = np.sort(z, axis=1)
    n_ties = int(((top[:, -1] == top[:, -2]) & np.isfinite(top[:, -1])).sum())
    assert n_ties >= 10, f"the grid data should hold exact ties, has {n_ties}"
    out, am, grads = run_op(inp, activation)
    check_against_reference(inp, activation, out, am, grads, exact_argmax=True,
                            case=f"grid {mask}")


@pytest.mark.parametrize("dtype", [pytest.param(F16, id="f16"), pytest.param(BF16, id="bf16")])
def test_half_logits_are_rounded_before_the_max(dtype):
    """Spec: for float16/bfloat16 the logits are rounded to the dtype before the max, so two
    logits that differ in float64 but round to the same value tie, and the lower l wins."""
    tiny = 2.0 ** -10 if dtype == F16 else 2.0 ** -7  # ulp of 1.0 in the dtype
    x = np.array([[[1.0, 0.0], [1.0, tiny]]], dtype)  # logits 1 and 1 + tiny/8: both round to 1
    w = np.array([[1.0, 0.125]], dtype)
    out, ctx = cupynce.splade_pool_forward(x, w, activation="relu")
    assert ref.splade_argmax(x, w)[0, 0] == 1  # in float64 position 1 is larger
    assert int(ctx.stats[0][0, 0]) == 0, "the rounded logits tie: the lowest l must win"
    assert float(out[0, 0]) == 1.0


def tie_after_the_bias(dtype, xp=np, pad=0):
    """(x, w, bias): logits 1 and 1 + ulp(1), distinct in the dtype, plus a bias of 4: 5 and
    5 + ulp(1), which round to the same 5 (ulp(4) = 4 ulp(1)).  Rounded after the bias (as
    ``F.linear``) the logits tie and position 0 wins; rounded before it, position 1 would.
    ``pad`` zero columns widen D (D = 8 lets the fused GPU paths take it)."""
    tiny = 2.0 ** -10 if dtype == F16 else 2.0 ** -7  # ulp of 1.0 in the dtype
    z = [0.0] * pad
    x = xp.asarray(np.array([[[1.0, 0.0] + z, [1.0, tiny] + z]], dtype))
    w = xp.asarray(np.array([[1.0, 1.0] + z], dtype))
    return x, w, xp.asarray(np.array([4.0], dtype))


@pytest.mark.parametrize("dtype", [pytest.param(F16, id="f16"), pytest.param(BF16, id="bf16")])
def test_half_logits_are_rounded_after_the_bias(dtype):
    """Spec: a 16-bit logit is x.W + bias rounded once (F.linear's), so two logits that differ
    in the dtype tie once the bias is added, and the lower l wins; out is act of that logit."""
    x, w, b = tie_after_the_bias(dtype)
    assert float((x.astype(np.float64) @ w[0].astype(np.float64))[0, 1]) > 1.0  # distinct
    out, ctx = cupynce.splade_pool_forward(x, w, b, activation="relu")
    assert int(ctx.stats[0][0, 0]) == 0, "logit + bias ties: the lowest l must win"
    assert float(out[0, 0]) == 5.0


def test_argmax_int32_when_L_exceeds_int16():
    b, l, d, v = 1, 40000, 1, 3
    x = np.full((b, l, d), 0.5, np.float32)
    x[0, l - 1, 0] = 2.0  # the winner of the v with W > 0 is the last position
    x[0, 35000, 0] = -3.0  # the winner of the v with W < 0
    w = np.array([[1.0], [-1.0], [0.5]], np.float32)
    out, ctx = cupynce.splade_pool_forward(x, w, activation="relu")
    am = ctx.stats[0]
    assert am.dtype == np.int32
    np.testing.assert_array_equal(am, [[l - 1, 35000, l - 1]])
    np.testing.assert_array_equal(out, np.array([[2.0, 3.0, 1.0]], np.float32))
    _, ctx2 = cupynce.splade_pool_forward(x[:, :32767], w, activation="relu")
    assert ctx2.stats[0].dtype == np.int16


def test_argmax_dtype_boundary():
    """int16 while every index fits (L <= 32768: indices 0..32767), int32 from L = 32769."""
    x = np.zeros((1, 32768, 1), np.float32)
    x[0, -1, 0] = 1.0
    _, ctx = cupynce.splade_pool_forward(x, np.ones((1, 1), np.float32), activation="relu")
    assert ctx.stats[0].dtype == np.int16, f"L = 32768 gave {ctx.stats[0].dtype}"
    assert int(ctx.stats[0][0, 0]) == 32767
    x = np.zeros((1, 32769, 1), np.float32)
    x[0, -1, 0] = 1.0
    _, ctx = cupynce.splade_pool_forward(x, np.ones((1, 1), np.float32), activation="relu")
    assert ctx.stats[0].dtype == np.int32, f"L = 32769 gave {ctx.stats[0].dtype}"
    assert int(ctx.stats[0][0, 0]) == 32768


@pytest.mark.parametrize("mdtype", [np.float32, np.float64, np.float16, BF16, np.int64,
                                    np.int8, np.uint8], ids=lambda d: np.dtype(d).name)
def test_mask_values_other_than_0_1_are_refused(mdtype):
    """A host mask holding anything but 0 and 1 (2, -1, 0.5, NaN) used to count as "keep"
    where the docstring says 0/1 (issue 52): refused before any work, naming the argument,
    the value and where it is.  0/1 of every real dtype and bool give the same result."""
    inp = make_inputs((3, 5, 4, 11), F32, None, True)
    keep = np.array([[1, 0, 1, 1, 0], [0] * 5, [0, 0, 0, 0, 1]])
    want = run_op(dict(inp, mask=keep.astype(bool)), "log1p_relu")
    got = run_op(dict(inp, mask=keep.astype(mdtype)), "log1p_relu")
    for a, c in zip((want[0], want[1]) + tuple(want[2]), (got[0], got[1]) + tuple(got[2])):
        np.testing.assert_array_equal(f64(a), f64(c))
    bad = [2, -1] + ([0.5, np.nan] if np.dtype(mdtype).kind in "fV" else [])
    if np.dtype(mdtype).kind == "u":
        bad = [2, 255]
    for value in bad:
        mask = keep.astype(mdtype)
        mask[2, 3] = value
        shown = re.escape(repr(mask[2, 3].item()))
        for fn in (cupynce.splade_pool, cupynce.splade_pool_forward):
            with pytest.raises(ValueError, match=rf"^splade_pool: mask must hold only 0 and 1 "
                                                 rf"\(or be bool\), got {shown} at \(2, 3\)"):
                fn(inp["x"], inp["weight"], inp["bias"], mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_splade_pool_equals_forward(dtype):
    inp = make_inputs((3, 6, 5, 37), dtype, "rand01", True)
    for act in ACTIVATIONS:
        only = cupynce.splade_pool(inp["x"], inp["weight"], inp["bias"], inp["mask"],
                                   activation=act)
        fwd, _ = cupynce.splade_pool_forward(inp["x"], inp["weight"], inp["bias"], inp["mask"],
                                             activation=act, requires_grad=False)
        assert only.dtype == dtype
        np.testing.assert_array_equal(f64(only), f64(run_op(inp, act)[0]))
        np.testing.assert_array_equal(f64(fwd), f64(only))


def test_backward_after_no_grad_forward_raises():
    inp = make_inputs((2, 3, 4, 5), F32, None, True)
    _, ctx = cupynce.splade_pool_forward(inp["x"], inp["weight"], requires_grad=False)
    assert ctx.stats == ()
    with pytest.raises(ValueError, match="requires_grad"):
        cupynce.splade_pool_backward(ctx, inp["grad_out"])


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_from_stats(dtype, activation, bias):
    inp = make_inputs((3, 6, 5, 37), dtype, "bool", bias)
    out, am, grads = run_op(inp, activation)
    again = cupynce.splade_pool_backward_from_stats(
        inp["x"], inp["weight"], out, am, inp["grad_out"], bias=inp["bias"],
        activation=activation)
    for name, a, c in zip(("dx", "dweight", "dbias"), again, grads):
        if c is None:
            assert a is None, name
        else:
            assert a.dtype == c.dtype and a.shape == c.shape, name
            np.testing.assert_array_equal(f64(a), f64(c), err_msg=name)
    check_against_reference(inp, activation, out, am, again, case="from_stats")


# ----------------------------------------------------------------------------------------
# 2. layouts, determinism, tiling, grad_out forms, non-finite values
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_weight_view(dtype):
    """A (D, V) matrix passed as its transpose: same result as the (V, D) copy."""
    inp = make_inputs((3, 6, 5, 37), dtype, "rand01", True)
    w_dv = np.ascontiguousarray(inp["weight"].T)  # the seeds' (D, V) layout
    view = w_dv.T
    assert view.base is w_dv and not view.flags.c_contiguous
    for act in ACTIVATIONS:
        out0, am0, g0 = run_op(inp, act)
        out1, am1, g1 = run_op(dict(inp, weight=view), act)
        check_against_reference(dict(inp, weight=view), act, out1, am1, g1, case="w_dv.T")
        assert g1[1].shape == (37, 5)
        # same winners; values equal to the contiguous run within the dtype's tolerance
        # (BLAS may order a transposed product's sums differently)
        np.testing.assert_array_equal(host(am1), host(am0))
        check_elementwise("out vs contiguous", out1, f64(out0),
                          np.abs(f64(out0)) + 1.0, TOL[dtype]["out"], f"{dtype.name} {act}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic(dtype):
    inp = make_inputs((4, 9, 6, 37), dtype, "rand01", True)
    for act in ACTIVATIONS:
        r1 = run_op(inp, act, workspace_bytes=2048)
        r2 = run_op(inp, act, workspace_bytes=2048)
        for a, c in zip((r1[0], r1[1], *r1[2]), (r2[0], r2[1], *r2[2])):
            assert a.dtype == c.dtype
            np.testing.assert_array_equal(host(a).view(np.uint8), host(c).view(np.uint8))


@pytest.mark.parametrize("workspace_bytes", [64, 1000, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_workspace_matches(dtype, workspace_bytes):
    inp = make_inputs((3, 5, 4, 37), dtype, "float", True)
    for act in ACTIVATIONS:
        out, am, grads = run_op(inp, act, workspace_bytes=workspace_bytes)
        check_against_reference(inp, act, out, am, grads, case=f"ws={workspace_bytes}")
        out0, am0, _ = run_op(inp, act)
        np.testing.assert_array_equal(host(am), host(am0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_out_of_another_float_dtype_is_cast(dtype):
    inp = make_inputs((2, 4, 3, 9), dtype, None, True)
    out, ctx = cupynce.splade_pool_forward(inp["x"], inp["weight"], inp["bias"])
    # spec: grad_out of any floating dtype is cast to out's dtype first
    other = F64 if dtype != F64 else F32
    go_other = _rng("grad_out", str(dtype)).standard_normal((2, 9)).astype(other)
    g_other = cupynce.splade_pool_backward(ctx, go_other)
    g_same = cupynce.splade_pool_backward(ctx, go_other.astype(dtype))
    for a, c in zip(g_other, g_same):
        assert a.dtype == c.dtype
        np.testing.assert_array_equal(f64(a), f64(c))


def test_zero_grad_out_gives_zero_gradients():
    inp = make_inputs((3, 5, 4, 9), F32, "rand01", True)
    _, ctx = cupynce.splade_pool_forward(inp["x"], inp["weight"], inp["bias"], inp["mask"])
    for g in cupynce.splade_pool_backward(ctx, np.zeros((3, 9), np.float32)):
        assert not np.any(g)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_inactive_columns_have_exactly_zero_gradients(dtype, activation):
    """A v that is never active (bias very negative) gets dweight[v] = 0 and dbias[v] = 0
    exactly; x positions that never win get dx = 0 exactly."""
    inp = make_inputs((3, 6, 4, 21), dtype, "rand01", True)
    bias = f64(inp["bias"])
    bias[::3] = -100.0
    inp["bias"] = bias.astype(dtype)
    out, am, (dx, dw, db) = run_op(inp, activation)
    dead = np.arange(21) % 3 == 0
    assert np.all(f64(out)[:, dead] == 0)
    assert np.all(f64(dw)[dead] == 0) and np.all(f64(db)[dead] == 0)
    assert np.any(f64(dw)[~dead] != 0)
    won = np.zeros(inp["x"].shape[:2], bool)
    live = f64(out) > 0
    for bb, vv in zip(*np.nonzero(live)):
        won[bb, int(host(am)[bb, vv])] = True
    assert np.all(f64(dx)[~won] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_reaches_out_only_when_unmasked(dtype):
    inp = make_inputs((2, 4, 3, 7), dtype, None, True)
    x = f64(inp["x"])
    x[0, 2, 1] = np.nan
    inp["x"] = x.astype(dtype)
    with np.errstate(invalid="ignore"):
        out, am, _ = run_op(inp, "log1p_relu")
    assert np.all(np.isnan(f64(out)[0])), "a NaN logit that reaches the max must give NaN"
    assert np.all(np.isfinite(f64(out)[1]))
    mask = np.ones((2, 4), bool)
    mask[0, 2] = False
    with np.errstate(invalid="ignore"):
        out, am, grads = run_op(dict(inp, mask=mask), "log1p_relu")
    for a in (out, *grads):
        if a is not None:
            assert np.all(np.isfinite(f64(a))), "a masked NaN must not reach out or gradients"


def test_inf_in_weight_never_gives_a_finite_looking_zero():
    x = np.ones((1, 2, 2), np.float32)
    w = np.array([[np.inf, -np.inf], [1.0, 1.0]], np.float32)  # logit inf - inf = NaN
    with np.errstate(invalid="ignore"):
        out = cupynce.splade_pool(x, w, activation="relu")
    assert np.isnan(out[0, 0]) and out[0, 1] == 2.0


# ----------------------------------------------------------------------------------------
# 3. finite differences of the NumPy path itself (float64)
# ----------------------------------------------------------------------------------------
def separated(inp, margin=1e-3):
    """No top-1 / top-2 gap nor |m| (pre-activation) below ``margin``: no kink within reach."""
    keep = _keep(inp)
    z = ref.splade_logits(f64(inp["x"]), f64(inp["weight"]), keep)
    zs = np.sort(z[keep.any(axis=1)], axis=1)
    if zs.shape[1] > 1 and np.nanmin(zs[:, -1] - zs[:, -2]) < margin:
        return False
    pre = zs[:, -1] + (0 if inp["bias"] is None else f64(inp["bias"])[None])
    return bool(np.abs(pre).min() >= margin)


def finite_difference_check(inp, activation, forward, grads, h=1e-6, tol=1e-6):
    """Central differences of ``sum(grad_out * forward(inp))`` against ``grads``."""
    go = f64(inp["grad_out"])
    for name, g in zip(("x", "weight", "bias"), grads):
        if inp[name] is None:
            assert g is None
            continue
        base = f64(inp[name])
        num = np.zeros_like(base)
        for idx in np.ndindex(base.shape):
            vals = []
            for step in (h, -h):
                arr = base.copy()
                arr[idx] += step
                vals.append(float(np.sum(go * f64(forward(dict(inp, **{name: arr}))))))
            num[idx] = (vals[0] - vals[1]) / (2 * h)
        scale = max(float(np.abs(num).max()), 1e-3)
        np.testing.assert_allclose(f64(g), num, rtol=0, atol=tol * scale, err_msg=name)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_finite_differences_float64(activation):
    for seed in range(50):
        inp = make_inputs((2, 3, 3, 5), F64, "rand01", True, seed=seed)
        if separated(inp):
            break
    else:
        pytest.fail("no well-separated data")
    out, am, grads = run_op(inp, activation)
    assert (f64(out) > 0).sum() >= 2

    def forward(i):
        return cupynce.splade_pool(i["x"], i["weight"], i["bias"], i["mask"],
                                   activation=activation)

    finite_difference_check(inp, activation, forward, grads)


# ----------------------------------------------------------------------------------------
# 4. FLOPS regulariser
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 7), (5, 37), (16, 9)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flops_regularizer(dtype, shape):
    out = np.abs(_rng("flops", shape, str(dtype)).standard_normal(shape)).astype(dtype)
    out[:, ::4] = 0  # sparse columns, as SPLADE's
    val_r, dout_r = ref.flops_regularizer(out)
    val = cupynce.flops_regularizer(out)
    assert isinstance(val, np.ndarray) and val.shape == ()
    assert val.dtype == (F64 if dtype == F64 else F32)
    np.testing.assert_allclose(float(val), val_r, rtol=TOL_FLOPS[dtype])
    mag = np.abs(dout_r) + 1e-300
    for grad in (1.0, 0.7, np.asarray(-1.3, np.float32), np.asarray(2.0, dtype)):
        gval = float(np.asarray(grad, np.float64))
        d = cupynce.flops_regularizer_backward(out, grad)
        assert d.dtype == dtype and d.shape == shape
        check_elementwise("dout", d, gval * dout_r, abs(gval) * mag, TOL[dtype]["grad"],
                          f"{dtype.name} flops grad={gval}")
    d_default = cupynce.flops_regularizer_backward(out)
    np.testing.assert_array_equal(f64(d_default), f64(cupynce.flops_regularizer_backward(out, 1.0)))


def test_flops_regularizer_matches_torch():
    torch = pytest.importorskip("torch")
    out = np.abs(_rng("flops-torch").standard_normal((6, 11)))
    ot = torch.tensor(out, requires_grad=True)
    vt = (ot.mean(0) ** 2).sum()
    vt.backward(torch.tensor(0.7, dtype=torch.float64))
    np.testing.assert_allclose(cupynce.flops_regularizer(out), vt.item(), rtol=1e-13)
    np.testing.assert_allclose(cupynce.flops_regularizer_backward(out, 0.7), ot.grad.numpy(),
                               rtol=1e-13)


# ----------------------------------------------------------------------------------------
# 5. bad input: the right exception, a message naming the op and the argument
# ----------------------------------------------------------------------------------------
def _valid(dtype=F32):
    rng = np.random.default_rng(0)
    return dict(x=rng.standard_normal((2, 3, 4)).astype(dtype),
                weight=rng.standard_normal((5, 4)).astype(dtype),
                bias=rng.standard_normal(5).astype(dtype),
                mask=np.ones((2, 3), bool))


def _names(*names):
    """A regex that requires every name as a whole word, in any order."""
    return "".join(rf"(?=[\s\S]*\b{re.escape(n)}\b)" for n in names)


BAD = [
    # (id, overrides, exception, names in the message)
    ("x-2d", dict(x=np.zeros((2, 4), np.float32)), ValueError, ["x"]),
    ("x-4d", dict(x=np.zeros((1, 2, 3, 4), np.float32)), ValueError, ["x"]),
    ("weight-1d", dict(weight=np.zeros(4, np.float32)), ValueError, ["weight"]),
    ("weight-3d", dict(weight=np.zeros((1, 5, 4), np.float32)), ValueError, ["weight"]),
    ("bias-2d", dict(bias=np.zeros((5, 1), np.float32)), ValueError, ["bias"]),
    ("mask-1d", dict(mask=np.ones(6, bool)), ValueError, ["mask"]),
    ("D-mismatch", dict(weight=np.zeros((5, 3), np.float32)), ValueError, ["x", "weight"]),
    ("bias-length", dict(bias=np.zeros(4, np.float32)), ValueError, ["bias"]),
    ("mask-shape", dict(mask=np.ones((3, 2), bool)), ValueError, ["mask"]),
    ("mask-B", dict(mask=np.ones((1, 3), bool)), ValueError, ["mask"]),
    ("weight-dtype", dict(weight=np.zeros((5, 4), np.float64)), TypeError, ["x", "weight"]),
    ("bias-dtype", dict(bias=np.zeros(5, np.float16)), TypeError, ["bias"]),
    ("x-int", dict(x=np.zeros((2, 3, 4), np.int32), weight=np.zeros((5, 4), np.int32),
                   bias=None), TypeError, ["x"]),
    ("x-bool", dict(x=np.zeros((2, 3, 4), bool), weight=np.zeros((5, 4), bool), bias=None),
     TypeError, ["x"]),
    ("x-complex", dict(x=np.zeros((2, 3, 4), np.complex64),
                       weight=np.zeros((5, 4), np.complex64), bias=None), TypeError, ["x"]),
    ("weight-int", dict(weight=np.zeros((5, 4), np.int64)), TypeError, ["weight"]),
    ("x-list", dict(x=[[[1.0] * 4] * 3] * 2), TypeError, ["x"]),
    ("B-0", dict(x=np.zeros((0, 3, 4), np.float32), mask=None), ValueError, ["x"]),
    ("L-0", dict(x=np.zeros((2, 0, 4), np.float32), mask=None), ValueError, ["x"]),
    ("D-0", dict(x=np.zeros((2, 3, 0), np.float32), weight=np.zeros((5, 0), np.float32)),
     ValueError, []),  # either x or weight may be named
    ("V-0", dict(weight=np.zeros((0, 4), np.float32), bias=None), ValueError, ["weight"]),
    ("activation", dict(activation="gelu"), ValueError, ["activation"]),
    ("activation-None", dict(activation=None), ValueError, ["activation"]),
    ("workspace-0", dict(workspace_bytes=0), ValueError, ["workspace_bytes"]),
    ("workspace-neg", dict(workspace_bytes=-5), ValueError, ["workspace_bytes"]),
    ("workspace-float", dict(workspace_bytes=1024.0), ValueError, ["workspace_bytes"]),
    ("workspace-bool", dict(workspace_bytes=True), ValueError, ["workspace_bytes"]),
]


@pytest.mark.parametrize("entry", ["splade_pool", "splade_pool_forward"])
@pytest.mark.parametrize("case, overrides, exc, names", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises(case, overrides, exc, names, entry):
    kw = _valid()
    kw.update(overrides)
    fn = getattr(cupynce, entry)
    args = [kw.pop(k) for k in ("x", "weight", "bias", "mask")]
    if names:
        pattern = r"splade_pool" + _names(*names)
    else:  # D = 0: either argument may be named
        pattern = r"splade_pool(?=[\s\S]*\b(x|weight)\b)"
    with pytest.raises(exc, match=pattern):
        fn(*args, **kw)


@pytest.mark.parametrize("grad_out, exc, what", [
    (np.zeros((2, 6), np.float32), ValueError, "shape"),
    (np.zeros((5, 2), np.float32), ValueError, "transposed"),
    (np.zeros((2, 5), np.int32), TypeError, "int"),
    ([[0.0] * 5] * 2, ValueError, "list"),
], ids=["shape", "transposed", "int", "list"])
def test_bad_grad_out_raises(grad_out, exc, what):
    kw = _valid()
    _, ctx = cupynce.splade_pool_forward(kw["x"], kw["weight"], kw["bias"], kw["mask"])
    with pytest.raises((exc, TypeError) if what == "list" else exc,
                       match=r"splade_pool\w*" + _names("grad_out")):
        cupynce.splade_pool_backward(ctx, grad_out)


def test_bad_context_raises():
    _, ctx = cupynce.nt_xent_forward(np.ones((4, 3), np.float32))
    with pytest.raises(TypeError, match="ctx"):
        cupynce.splade_pool_backward(ctx, np.zeros((2, 5), np.float32))


def test_backward_from_stats_bad_stats_raise():
    kw = _valid()
    out, ctx = cupynce.splade_pool_forward(kw["x"], kw["weight"], kw["bias"], kw["mask"])
    g = np.ones((2, 5), np.float32)
    fn = cupynce.splade_pool_backward_from_stats
    with pytest.raises(ValueError, match=_names("argmax")):
        fn(kw["x"], kw["weight"], out, ctx.stats[0][:1], g, bias=kw["bias"])
    with pytest.raises(ValueError, match=_names("out")):
        fn(kw["x"], kw["weight"], out[:, :3], ctx.stats[0], g, bias=kw["bias"])
    with pytest.raises(ValueError, match=_names("activation")):
        fn(kw["x"], kw["weight"], out, ctx.stats[0], g, activation="tanh")


@pytest.mark.parametrize("bad, exc", [(np.zeros(5, np.float32), ValueError),
                                      (np.zeros((2, 3, 4), np.float32), ValueError),
                                      (np.zeros((2, 5), np.int32), TypeError)],
                         ids=["1d", "3d", "int"])
def test_flops_bad_input_raises(bad, exc):
    for fn in (cupynce.flops_regularizer, cupynce.flops_regularizer_backward):
        with pytest.raises(exc, match=r"flops_regularizer\w*" + _names("out")):
            fn(bad)


def test_torch_tensor_input_raises():
    torch = pytest.importorskip("torch")
    kw = _valid()
    with pytest.raises(TypeError, match=r"splade_pool" + _names("x") + "(?=[\\s\\S]*torch)"):
        cupynce.splade_pool(torch.zeros(2, 3, 4), kw["weight"])


def _cupy_or_skip():
    cp = pytest.importorskip("cupy")
    try:
        cp.zeros(1)
    except Exception:  # CuPy without a usable GPU
        pytest.skip("needs a CUDA GPU (none here)")
    return cp


@pytest.mark.parametrize("which", ["weight", "bias", "mask"])
def test_mixing_numpy_and_cupy_raises(which):
    cp = _cupy_or_skip()
    kw = _valid()
    kw[which] = cp.asarray(kw[which])
    with pytest.raises(TypeError, match=r"splade_pool" + _names("x", which)):
        cupynce.splade_pool(kw["x"], kw["weight"], kw["bias"], kw["mask"])


def test_mixing_numpy_grad_out_with_cupy_raises():
    cp = _cupy_or_skip()
    kw = {k: cp.asarray(v) for k, v in _valid().items()}
    _, ctx = cupynce.splade_pool_forward(kw["x"], kw["weight"], kw["bias"], kw["mask"])
    with pytest.raises((TypeError, ValueError), match=_names("grad_out")):
        cupynce.splade_pool_backward(ctx, np.ones((2, 5), np.float32))


# ----------------------------------------------------------------------------------------
def test_print_measured_errors():
    """Not a check: prints the worst error / magnitude seen per dtype and quantity (-s)."""
    for (dt, name), e in sorted(MEASURED.items()):
        print(f"  {dt:9s} {name:18s} {e:.2e}")


def test_warp_specialised_forward_row_limit():
    """splade_wgmma.cu's TMA row coordinate is a 32-bit int: x with B·L + 256 >= 2^31 rows
    goes to splade_tiles.cu instead (``_ws_fits``); the tensor-map struct is CUtensorMap's 128
    bytes."""
    from cupynce._engine import splade
    from cupynce._engine import tma as _tma

    assert splade._ws_fits(2 ** 31 - 1 - splade._WS_BN)
    assert not splade._ws_fits(2 ** 31 - splade._WS_BN)
    assert not splade._ws_fits(32769 * 65536)  # B = 32769, L = 65536
    assert _tma.TENSOR_MAP_DTYPE.itemsize == 128


def test_gradient_kernel_constants_match_the_source():
    """The launch side's copies of splade_grad.cu's constants (grids, block sizes, the rings'
    dynamic shared memory) are the kernel's own (a CPU check: the source is read, not built)."""
    from cupynce._engine import kernels, splade

    src = (kernels.kernels_dir() / splade.GRAD_FILE).read_text()

    def define(name):
        m = re.search(rf"^#define {name} (\d+)$", src, re.M)
        assert m, f"#define {name} not found in {splade.GRAD_FILE}"
        return int(m.group(1))
    assert define("SPL_RING") == splade._RING
    assert define("SPL_GRAD_NV") == splade._GRAD_NV
    assert define("SPL_DW_TV") == splade._DW_TV
    assert define("SPL_SCAN_BLOCK") == splade._SCAN_BLOCK
    assert "#define SPL_DWV_TV (CPN_BLOCK / 32)" in src and splade._DWV_TV == kernels.BLOCK // 32
    # SPL_DWV_SMEM = SPL_DXV_SMEM = warps x SPL_RING x SPL_GRAD_NV x 32 lanes x 16 bytes
    assert "#define SPL_RING_BYTES (SPL_RING * SPL_GRAD_NV * 32 * 16)" in src
    assert src.count("((CPN_BLOCK / 32) * SPL_RING_BYTES)") == 2
    assert splade._RING_SMEM == kernels.BLOCK // 32 * splade._RING * splade._GRAD_NV * 32 * 16
