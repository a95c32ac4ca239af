"""GPU tests of the SPLADE head (CuPy path): run with ``pytest -m gpu`` on a CUDA machine.

Oracle, tolerances and the way errors are measured are those of ``tests/ops/test_splade.py``
(imported from it: ``TOL``, ``make_inputs``, ``check_against_reference``): every comparison
is element-wise against the magnitude of the terms that make the value, with

=========  ==========  =========  (u = unit roundoff: 2^-11 float16, 2^-8 bfloat16)
dtype      out         gradients
=========  ==========  =========
float64    1e-10       1e-10
float32    1e-5        1e-4
float16    2u          8u
bfloat16   2u          8u
=========  ==========  =========

and the oracle evaluated on the inputs as the op sees them (rounded to the dtype), at the op's
own winners once these are checked to be maximisers within rounding (exactly the oracle's on
grid data with exact ties).  The one case too large for the dense float64 oracle (B·L·V > 2^31)
compares a sample of vocabulary columns (out, dweight, dbias) and of batch rows (out, dx).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import cupynce
from cupynce import reference as ref

import test_splade as C  # noqa: E402  (its folder is on sys.path: conftest)

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

DTYPES = C.DTYPES
F16, BF16, F32, F64 = C.F16, C.BF16, C.F32, C.F64
ACTIVATIONS = C.ACTIVATIONS
MASKS = C.MASKS
TOL = C.TOL


@pytest.fixture(autouse=True, params=["ws", "tiles", "cublas"])
def forward_path(request, configure):
    """Every test runs three times: with the fused forward (the max in the epilogue of the
    tensor-core product: 16-bit x and W with D, leading dimensions and pointers multiples of
    8 elements / 16 bytes) of splade_wgmma.cu ("ws": Hopper's default; elsewhere the same as
    "tiles") and of splade_tiles.cu MODE_SPMAX ("tiles"), and with the cuBLAS logit tiles + max
    kernel ("cublas").  Other cases take the cuBLAS path under all three."""
    configure(tiles=request.param != "cublas", splade_ws=request.param == "ws")
    return request.param


def run(inp, activation, **kw):
    """(out, argmax, grads) of the CuPy path on the NumPy inputs ``inp`` (moved to the GPU)."""
    out, am, grads = C.run_op(inp, activation, to=cp.asarray, **kw)
    for a in (out, am, *grads):
        assert a is None or isinstance(a, cp.ndarray), type(a)
    return out, am, grads


def assert_bitwise(r1, r2, what=""):
    """Two (out, argmax, grads) results are identical bit for bit."""
    names = ("out", "argmax", "dx", "dweight", "dbias")
    for name, a, b in zip(names, (r1[0], r1[1], *r1[2]), (r2[0], r2[1], *r2[2])):
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        a, b = C.host(a), C.host(b)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what} {name}"
        diff = a.view(np.uint8) != b.view(np.uint8)
        assert not diff.any(), f"{what} {name}: {int(diff.sum())} bytes differ"


# ----------------------------------------------------------------------------------------
# 1. every dtype x activation x mask pattern x bias, tiny and odd shapes
# ----------------------------------------------------------------------------------------
GPU_SHAPES = [pytest.param((3, 7, 5, 37), id="B3L7D5V37"),
              pytest.param((2, 1, 5, 37), id="L1"),
              pytest.param((1, 4, 1, 9), id="B1D1V9"),
              pytest.param((2, 5, 8, 1001), id="V1001"),
              pytest.param((3, 17, 33, 3001), id="B3L17D33V3001"),
              # D % 8 == 0: the fused path for 16-bit dtypes (L, V not multiples of 128,
              # D not of 64)
              pytest.param((3, 130, 24, 1001), id="B3L130D24V1001"),
              pytest.param((2, 300, 72, 259), id="B2L300D72V259")]


@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mask", MASKS, ids=["nomask", "rand01", "bool", "float"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, activation, mask, bias, shape):
    inp = C.make_inputs(shape, dtype, mask, bias, seed=1)
    out, am, grads = run(inp, activation)
    C.check_against_reference(inp, activation, out, am, grads, case=f"gpu {shape} {mask}")
    assert (C.f64(out) > 0).any()


@pytest.mark.parametrize("dtype", [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16")])
def test_bert_sized_vocabulary(dtype):
    """V = 30522 (BERT's; not a multiple of 8), a padded mask, modest B, L, D."""
    inp = C.make_inputs((2, 16, 64, 30522), dtype, "rand01", True, seed=2)
    for act in ACTIVATIONS:
        out, am, grads = run(inp, act)
        C.check_against_reference(inp, act, out, am, grads, case="V30522")


@pytest.mark.parametrize("grid", [False, True], ids=["continuous", "ties"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_split_over_blocks(dtype, grid):
    """Long L, narrow vocabulary: the max kernel splits the sequence over blocks (nz > 1) and a
    second kernel merges the partial maxima in order; ties still go to the lowest l."""
    from cupynce._engine import splade

    shape = (2, 1000, 16, 300)
    blocks = -(-300 // (32 * (8 // np.dtype(dtype).itemsize))) * 2
    assert splade._position_chunks(blocks, 1000) > 1  # the case under test
    inp = C.make_inputs(shape, dtype, "rand01", True, seed=12, grid=grid)
    for act in ACTIVATIONS:
        out, am, grads = run(inp, act)
        C.check_against_reference(inp, act, out, am, grads, exact_argmax=grid,
                                  case=f"split {grid}")
        again = run(inp, act)
        assert_bitwise((out, am, grads), again, "split determinism")


@pytest.mark.parametrize("mask", [None, "bool"], ids=["nomask", "bool"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_ties_go_to_the_lowest_position(dtype, activation, mask):
    inp = C.make_inputs((4, 12, 2, 23), dtype, mask, True, grid=True, bias_shift=0.5)
    out, am, grads = run(inp, activation)
    C.check_against_reference(inp, activation, out, am, grads, exact_argmax=True,
                              case=f"gpu grid {mask}")


@pytest.mark.parametrize("mask", [None, "bool"], ids=["nomask", "bool"])
@pytest.mark.parametrize("dtype", [pytest.param(F16, id="f16"), pytest.param(BF16, id="bf16")])
def test_exact_ties_across_position_tiles(dtype, mask):
    """Grid data with D = 8 and L = 300 (three 128-position tiles of the fused path): exact
    ties within and across tiles go to the lowest l."""
    inp = C.make_inputs((4, 300, 8, 300), dtype, mask, True, grid=True, bias_shift=0.5)
    for act in ACTIVATIONS:
        out, am, grads = run(inp, act)
        C.check_against_reference(inp, act, out, am, grads, exact_argmax=True,
                                  case=f"gpu grid L300 {mask}")


@pytest.mark.parametrize("dtype", [pytest.param(F16, id="f16"), pytest.param(BF16, id="bf16")])
def test_half_logits_are_rounded_before_the_max(dtype):
    tiny = 2.0 ** -10 if dtype == F16 else 2.0 ** -7
    pad = [0.0] * 6  # D = 8: the fused path takes it too
    x = cp.asarray(np.array([[[1.0, 0.0] + pad, [1.0, tiny] + pad]], dtype))
    w = cp.asarray(np.array([[1.0, 0.125] + pad], dtype))
    out, ctx = cupynce.splade_pool_forward(x, w, activation="relu")
    assert int(ctx.stats[0][0, 0]) == 0, "the rounded logits tie: the lowest l must win"
    assert float(out[0, 0]) == 1.0


@pytest.mark.parametrize("dtype", [pytest.param(C.F16, id="f16"), pytest.param(C.BF16, id="bf16")])
def test_half_logits_are_rounded_after_the_bias(dtype, forward_path, configure):
    """Every forward path (the forward_path fixture) rounds x.W + bias once: logits distinct in
    the dtype tie after the bias, the lowest l wins (test_splade.tie_after_the_bias).  On the
    cuBLAS path with cuBLAS itself (no small-product kernel) and with the small-product
    kernel."""
    x, w, b = C.tie_after_the_bias(dtype, cp, pad=6)
    for small in ((0, None) if forward_path == "cublas" else (None,)):
        if small is not None:
            configure(small_gemm_macs=small)
        out, ctx = cupynce.splade_pool_forward(x, w, b, activation="relu")
        assert int(ctx.stats[0][0, 0]) == 0, f"{forward_path} small_gemm_macs={small}: l* must be 0"
        assert float(out[0, 0]) == 5.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_rows_masked_and_L1_edge(dtype):
    """Every row masked: zeros everywhere; L = 1 with that one position masked in one row."""
    inp = C.make_inputs((3, 4, 6, 17), dtype, None, True, seed=3)
    inp["mask"] = np.zeros((3, 4), bool)
    out, am, grads = run(inp, "log1p_relu")
    assert not C.host(out).astype(np.float64).any() and not C.host(am).any()
    for g in grads:
        assert not C.f64(g).any()
    inp1 = C.make_inputs((3, 1, 6, 17), dtype, None, True, seed=4)
    inp1["mask"] = np.array([[1], [0], [1]], np.int8)
    out, am, grads = run(inp1, "relu")
    C.check_against_reference(inp1, "relu", out, am, grads, exact_argmax=True, case="L1 mask")


# ----------------------------------------------------------------------------------------
# 2. layouts, determinism, streams, workspace tiling
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_weight_view(dtype):
    """A (D, V) matrix passed as its transpose ``w_dv.T`` gives the (V, D) result."""
    inp = C.make_inputs((3, 9, 24, 1003), dtype, "rand01", True, seed=5)
    w_dv = cp.asarray(np.ascontiguousarray(inp["weight"].T))
    view = w_dv.T
    assert not view.flags.c_contiguous
    for act in ACTIVATIONS:
        r0 = run(inp, act)
        out, ctx = cupynce.splade_pool_forward(
            cp.asarray(inp["x"]), view, cp.asarray(inp["bias"]), cp.asarray(inp["mask"]),
            activation=act)
        grads = cupynce.splade_pool_backward(ctx, cp.asarray(inp["grad_out"]))
        r1 = (out, ctx.stats[0], grads)
        assert grads[1].shape == (1003, 24)
        C.check_against_reference(inp, act, *r1, case="w_dv.T")
        np.testing.assert_array_equal(C.host(r1[1]), C.host(r0[1]))


def test_transposed_weight_view_is_not_copied():
    """The issue: the (D, V) matrix is read in place.  With a 1 MiB workspace and a 128 MiB
    weight, the forward's pool growth (out, arg-max, workspace; a cuBLAS workspace if CuPy
    takes it from the pool, <= 32 MiB) stays below half the size of a copy of the weight."""
    b, l, d, v = 2, 4, 256, 131072
    rng = np.random.default_rng(6)
    x = cp.asarray(rng.standard_normal((b, l, d)).astype(np.float32))
    w_dv = cp.asarray(rng.standard_normal((d, v)).astype(np.float32))
    pool = cp.get_default_memory_pool()
    cupynce.splade_pool(x, w_dv.T, workspace_bytes=1 << 20)  # warm-up: compile, cuBLAS handle
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    cupynce.splade_pool(x, w_dv.T, workspace_bytes=1 << 20)
    cp.cuda.Device().synchronize()
    grown = pool.total_bytes() - before
    assert grown < w_dv.nbytes // 2, f"the forward allocated {grown} B (weight: {w_dv.nbytes} B)"


def _backward_misaligned(inp, out, am):
    """The backward from (out, arg-max) with copies of x and W one element past a 16-byte
    boundary (2, 4 or 8 bytes): the element-wise gradient kernels' access."""
    dtype = inp["x"].dtype
    shift = max(1, 2 // dtype.itemsize)
    xs, ws = (cp.zeros(inp[k].size + shift, dtype)[shift:].reshape(inp[k].shape)
              for k in ("x", "weight"))
    xs[...] = cp.asarray(inp["x"])
    ws[...] = cp.asarray(inp["weight"])
    assert xs.data.ptr % 16 and ws.data.ptr % 16
    return cupynce.splade_pool_backward_from_stats(
        xs, ws, out, am, cp.asarray(inp["grad_out"]), bias=cp.asarray(inp["bias"]),
        activation="log1p_relu")


@pytest.mark.parametrize("d", [1032, 1030, 516], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_kernels_row_access(dtype, d, forward_path, monkeypatch):
    """The gradient kernels' column chunks (32 lanes x 4 chunks of 16 bytes, or of one element
    where rows are not 16-byte aligned) and vocabulary tiles (16 rows a CTA element-wise, 8
    with 16-byte rows): D over one chunk (several CTAs along D), D not a multiple of 16 bytes
    (the scalar access), V not a multiple of 8 or 16; then the backward from the same (out, arg-max) with x and W one element past a
    16-byte boundary (the scalar access): the same bits as the aligned call, each gradient
    element being one sum in a fixed order either way."""
    from cupynce._engine import splade

    seen = []
    real = splade._rows_aligned
    monkeypatch.setattr(splade, "_rows_aligned", lambda *a: seen.append(real(*a)) or seen[-1])
    inp = C.make_inputs((3, 9, d, 37), dtype, "bool", True, seed=23, bias_shift=0.3)
    for act in ACTIVATIONS:
        r0 = run(inp, act)
        C.check_against_reference(inp, act, *r0, case=f"D={d}")
    # x's rows (dW), then W's (dx): 16-byte access exactly where D fills whole 16-byte chunks
    whole = d * np.dtype(dtype).itemsize % 16 == 0
    assert seen[-2:] == [whole, whole], seen
    if forward_path != "cublas":
        return  # (the backward below does not depend on the forward's path)
    out, am, grads = run(inp, "log1p_relu")
    again = _backward_misaligned(inp, out, am)
    assert seen[-2:] == [False, False], seen
    assert_bitwise((out, am, grads), (out, am, again), "misaligned x / W")


@pytest.mark.parametrize("shape", [(70, 3, 40, 300), (4, 2, 264, 2500)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_kernels_ring(dtype, shape, forward_path, monkeypatch):
    """The 16-byte gradient kernels gather their rows through a per-warp ring (SPL_RING rows in
    flight): (70, 3, ..) has B over one dW staging chunk (64 batches) and (b, l) runs of ~50
    entries; (4, 2, 264, 2500) runs of ~600 entries, over many of dx's 32-entry chunks, and D
    over one CTA's columns for float64.  Checked against the float64 oracle, and bitwise against
    the element-wise kernels (x and W one element past a 16-byte boundary): each gradient
    element is the same sum in the same order either way."""
    if forward_path != "cublas":
        pytest.skip("the backward does not depend on the forward's path (run once, cublas)")
    inp = C.make_inputs(shape, dtype, "bool", True, seed=29, bias_shift=0.5)
    out, am, grads = run(inp, "log1p_relu")
    C.check_against_reference(inp, "log1p_relu", out, am, grads, case=f"ring {shape}")
    assert (cp.asnumpy(out) > 0).mean() > 0.3  # dense enough for long runs
    again = _backward_misaligned(inp, out, am)
    assert_bitwise((out, am, grads), (out, am, again), f"ring vs element-wise {shape}")
    # a device where the ring does not fit (Turing): the element-wise kernels, aligned rows
    from cupynce._engine import splade
    monkeypatch.setattr(splade, "_ring_kernel", lambda *a: None)
    plain = cupynce.splade_pool_backward_from_stats(
        cp.asarray(inp["x"]), cp.asarray(inp["weight"]), out, am, cp.asarray(inp["grad_out"]),
        bias=cp.asarray(inp["bias"]), activation="log1p_relu")
    assert_bitwise((out, am, grads), (out, am, plain), f"no ring {shape}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_noncontiguous_x_and_mask(dtype):
    inp = C.make_inputs((3, 6, 10, 301), dtype, "bool", True, seed=7)
    r0 = run(inp, "log1p_relu")
    xw = cp.zeros((3, 12, 10), dtype)
    xw[:, ::2] = cp.asarray(inp["x"])
    mw = cp.zeros((3, 6, 2), bool)
    mw[:, :, 0] = cp.asarray(inp["mask"])
    out, ctx = cupynce.splade_pool_forward(xw[:, ::2], cp.asarray(inp["weight"]),
                                           cp.asarray(inp["bias"]), mw[:, :, 0])
    grads = cupynce.splade_pool_backward(ctx, cp.asarray(inp["grad_out"]))
    assert_bitwise(r0, (out, ctx.stats[0], grads), "strided x / mask")


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic(dtype):
    """Bitwise identical twice, on a size where many blocks share work (no float atomics)."""
    inp = C.make_inputs((8, 64, 96, 5003), dtype, "rand01", True, seed=8)
    for act in ACTIVATIONS:
        assert_bitwise(run(inp, act), run(inp, act), f"{dtype} {act}")


@pytest.mark.parametrize("dtype", [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16")])
def test_non_default_stream(dtype):
    inp = C.make_inputs((4, 16, 32, 2001), dtype, "float", True, seed=9)
    r0 = run(inp, "log1p_relu")
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        r1 = run(inp, "log1p_relu")
    s.synchronize()
    assert_bitwise(r0, r1, "non-default stream")
    C.check_against_reference(inp, "log1p_relu", *r1, case="stream")


@pytest.mark.parametrize("tiles", ["columns", "batches"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_workspace_agrees_with_the_default(dtype, tiles):
    """A workspace that forces many (batch x vocabulary) tiles gives the default's result.

    Not bitwise: cuBLAS may pick another kernel (another summation order) for another tile
    shape, so the logits can differ in the last bit.  Both runs are checked against the
    reference at the dtype's tolerance; the arg-max must agree except where the logits are
    within that rounding of each other (the data here has no such near-ties).
    """
    b, l, d, v = 4, 16, 32, 1000
    item = max(np.dtype(dtype).itemsize, 4)  # the workspace's: the products in fp32 / fp64
    # "columns": one batch x 37 columns per tile; "batches": 2 batches x 256 columns
    ws = l * item * 37 if tiles == "columns" else 2 * l * 256 * item
    inp = C.make_inputs((b, l, d, v), dtype, "rand01", True, seed=10)
    for act in ACTIVATIONS:
        r0 = run(inp, act)
        r1 = run(inp, act, workspace_bytes=ws)
        np.testing.assert_array_equal(C.host(r0[1]), C.host(r1[1]), err_msg=f"ws={ws} argmax")
        C.check_against_reference(inp, act, *r0, case="default workspace")
        C.check_against_reference(inp, act, *r1, case=f"ws={ws}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_in_x_gives_nan_out(dtype):
    inp = C.make_inputs((2, 4, 3, 77), dtype, None, True, seed=11)
    x = C.f64(inp["x"])
    x[0, 2, 1] = np.nan
    inp["x"] = x.astype(dtype)
    out, _, _ = run(inp, "log1p_relu")
    assert np.all(np.isnan(C.f64(out)[0])), "a NaN logit that reaches the max must give NaN"
    assert np.all(np.isfinite(C.f64(out)[1]))
    mask = np.ones((2, 4), bool)
    mask[0, 2] = False
    out, _, grads = run(dict(inp, mask=mask), "log1p_relu")
    for a in (out, *grads):
        assert np.all(np.isfinite(C.f64(a))), "a masked NaN must not reach out or gradients"


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_sparsity(dtype, activation):
    """dweight / dbias rows of a v that is never active are exactly 0, as are dx rows of
    positions that never win an active entry."""
    inp = C.make_inputs((4, 12, 16, 513), dtype, "rand01", True, seed=12)
    bias = C.f64(inp["bias"])
    bias[::3] = -100.0
    inp["bias"] = bias.astype(dtype)
    out, am, (dx, dw, db) = run(inp, activation)
    dead = np.arange(513) % 3 == 0
    outh = C.f64(out)
    assert np.all(outh[:, dead] == 0)
    assert np.all(C.f64(dw)[dead] == 0) and np.all(C.f64(db)[dead] == 0)
    assert np.any(C.f64(dw)[~dead] != 0)
    won = np.zeros((4, 12), bool)
    amh = C.host(am)
    for bb, vv in zip(*np.nonzero(outh > 0)):
        won[bb, int(amh[bb, vv])] = True
    assert not won.all(), "the data should leave some positions without an active win"
    assert np.all(C.f64(dx)[~won] == 0)


@pytest.mark.parametrize("dtype", [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16")])
def test_density_does_not_change_the_result_of_active_entries(dtype):
    """1% and 50% density (bias shifts) both match the oracle (the sparse backward's lists)."""
    for shift in (-2.0, 0.0):
        inp = C.make_inputs((4, 32, 32, 4099), dtype, "rand01", True, seed=13, bias_shift=shift)
        out, am, grads = run(inp, "log1p_relu")
        C.check_against_reference(inp, "log1p_relu", out, am, grads, case=f"shift={shift}")


def test_float64_finite_differences():
    """gradcheck-style: central differences of the GPU forward against the GPU backward."""
    for seed in range(50):
        inp = C.make_inputs((2, 3, 3, 5), F64, "rand01", True, seed=seed)
        if C.separated(inp):
            break
    else:
        pytest.fail("no well-separated data")
    for act in ACTIVATIONS:
        out, am, grads = run(inp, act)
        assert (C.f64(out) > 0).sum() >= 2

        def forward(i, act=act):
            return cupynce.splade_pool(*(None if i[k] is None else cp.asarray(i[k])
                                         for k in ("x", "weight", "bias", "mask")),
                                       activation=act)

        C.finite_difference_check(inp, act, forward, [C.host(g) for g in grads])


@pytest.mark.parametrize("dtype", [pytest.param(F16, id="f16"), pytest.param(BF16, id="bf16")])
def test_grad_out_of_another_float_dtype_is_cast(dtype):
    """Spec: grad_out of any floating dtype is cast to out's dtype first."""
    inp = C.make_inputs((3, 6, 5, 37), dtype, None, True, seed=19)
    _, ctx = cupynce.splade_pool_forward(*(cp.asarray(inp[k]) for k in ("x", "weight", "bias")))
    g64 = np.random.default_rng(19).standard_normal((3, 37))
    a = cupynce.splade_pool_backward(ctx, cp.asarray(g64))
    b = cupynce.splade_pool_backward(ctx, cp.asarray(g64.astype(dtype)))
    for name, u, w in zip(("dx", "dweight", "dbias"), a, b):
        assert u.dtype == w.dtype == dtype, name
        np.testing.assert_array_equal(C.f64(u), C.f64(w), err_msg=name)


# ----------------------------------------------------------------------------------------
# 3. large vocabularies and 32-bit index overflow
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, mask", [(F32, None), (BF16, None), (BF16, "bool")],
                         ids=["f32", "bf16", "bf16-mask"])
def test_xlmr_vocabulary(dtype, mask):
    """V = 250002 (XLM-R), B = 2, L = 8, D = 64."""
    inp = C.make_inputs((2, 8, 64, 250002), dtype, mask, True, seed=14)
    out, am, grads = run(inp, "log1p_relu")
    C.check_against_reference(inp, "log1p_relu", out, am, grads, case="V250002")


def _near_kink_on_device(x, w, bias, keep, dtype):
    """Entries whose pre-activation is within rounding of 0, from float32 products on the GPU
    one batch row at a time (the float64 (B, L, V) logits would not fit on the host)."""
    slack_u = C.U[dtype] + x.shape[2] * C.U[F32]
    xd, wd = cp.asarray(x, np.float32), cp.asarray(w, np.float32)
    ad, awd = cp.abs(xd), cp.abs(wd)
    bd = cp.asarray(bias, np.float32)
    near = np.zeros((x.shape[0], w.shape[0]), bool)
    for b in range(x.shape[0]):
        k = cp.asarray(keep[b])
        if not bool(k.any()):
            continue
        z = xd[b][k] @ wd.T
        m = z.max(axis=0) + bd
        s = (ad[b][k] @ awd.T).max(axis=0) + cp.abs(bd)
        near[b] = C.host(cp.abs(m) <= 4 * slack_u * s + 1e-5 * s)
    return near


@pytest.mark.slow
def test_index_arithmetic_beyond_32_bits():
    """B·L·V = 64·512·70000 = 2.29e9 > 2^31 (float16): a sample of the output and of every
    gradient against the float64 oracle evaluated on that sample."""
    b, l, d, v = 64, 512, 8, 70000
    assert b * l * v > 2 ** 31
    dtype = F16
    rng = np.random.default_rng(15)
    x = (0.5 * rng.standard_normal((b, l, d)) + 0.3).astype(dtype)
    w = (rng.standard_normal((v, d)) / math.sqrt(d)).astype(dtype)
    bias = (0.5 * rng.standard_normal(v) - 1.0).astype(dtype)
    lengths = rng.integers(1, l + 1, b)
    lengths[-1] = 0  # an all-masked row
    lengths[0] = l  # a full row: positions up to L - 1
    keep = np.arange(l)[None, :] < lengths[:, None]
    go = rng.standard_normal((b, v)).astype(dtype)
    go[_near_kink_on_device(x, w, bias, keep, dtype)] = 0
    inp = dict(x=x, weight=w, bias=bias, mask=keep, grad_out=go)
    for act in ACTIVATIONS:
        out, am, (dx, dw, db) = run(inp, act)
        # vocabulary columns (all rows): out, argmax, dweight, dbias
        cols = np.unique(np.concatenate([rng.choice(v, 48, replace=False), [0, v - 1]]))
        sub = dict(inp, weight=w[cols], bias=bias[cols], grad_out=go[:, cols])
        C.check_against_reference(sub, act, C.host(out)[:, cols], C.host(am)[:, cols],
                                  (None, C.host(dw)[cols], C.host(db)[cols]),
                                  parts=("out", "dweight", "dbias"), case=f"cols {act}")
        # batch rows (every column): out, argmax, dx
        for r in (0, b // 2):
            row = dict(inp, x=x[r:r + 1], mask=keep[r:r + 1], grad_out=go[r:r + 1])
            C.check_against_reference(row, act, C.host(out[r:r + 1]), C.host(am[r:r + 1]),
                                      (C.host(dx[r:r + 1]), None, None),
                                      parts=("out", "dx"), case=f"row {r} {act}")
        # the all-masked last row: zeros
        assert not C.f64(out[-1]).any() and not C.host(am[-1]).any()
        assert not C.f64(dx[-1]).any()


@pytest.mark.slow
def test_weight_beyond_2_31_elements():
    """V·D = 262144·8200 > 2^31 (float16 weight of 4.3 GB): out and dx over every column, and
    dweight / dbias on a sample of columns, against float64 computed here (the dense oracle
    on the sampled columns; out and dx in float64 cuBLAS products, V in chunks)."""
    b, l, d, v = 2, 4, 8200, 262144
    assert v * d > 2 ** 31
    if cp.cuda.runtime.memGetInfo()[0] < (16 << 30):
        pytest.skip("needs 16 GiB of free GPU memory")
    dtype = F16
    rng = np.random.default_rng(17)
    x = rng.standard_normal((b, l, d)).astype(dtype)
    bias = (0.5 * rng.standard_normal(v) - 1.0).astype(dtype)
    go = rng.standard_normal((b, v)).astype(dtype)
    crng = cp.random.default_rng(18)
    w = cp.empty((v, d), dtype)
    chunk = 16384
    for c0 in range(0, v, chunk):
        w[c0:c0 + chunk] = (crng.standard_normal((min(chunk, v - c0), d), dtype=np.float32)
                            / math.sqrt(d)).astype(dtype)

    # float64 logits z (B, L, V) and S = |x| |W|^T, V in chunks
    x64 = cp.asarray(x, np.float64).reshape(b * l, d)
    z = cp.empty((b * l, v), np.float64)
    s_abs = cp.empty((b * l, v), np.float64)
    for c0 in range(0, v, chunk):
        wc = w[c0:c0 + chunk].astype(np.float64)
        z[:, c0:c0 + chunk] = x64 @ wc.T
        s_abs[:, c0:c0 + chunk] = cp.abs(x64) @ cp.abs(wc).T
    z, s_abs = z.reshape(b, l, v), s_abs.reshape(b, l, v)
    bias64 = cp.asarray(bias, np.float64)
    slack_u = C.U[dtype] + d * C.U[F32]
    m_ref = z.max(axis=1) + bias64
    near = cp.abs(m_ref) <= 4 * slack_u * (s_abs.max(axis=1) + cp.abs(bias64))
    go[C.host(near)] = 0  # ReLU kink within rounding: same active set (see ops/test_splade.py)

    xd, bd, gd = cp.asarray(x), cp.asarray(bias), cp.asarray(go)
    for act in ACTIVATIONS:
        out, ctx = cupynce.splade_pool_forward(xd, w, bd, activation=act)
        dx, dw, db = cupynce.splade_pool_backward(ctx, gd)
        am = ctx.stats[0].astype(np.int64)
        # the winners are maximisers within rounding
        z_got = cp.take_along_axis(z, am[:, None, :], 1)[:, 0]
        s_got = cp.take_along_axis(s_abs, am[:, None, :], 1)[:, 0]
        zmax = z.max(axis=1)
        smax = cp.take_along_axis(s_abs, z.argmax(axis=1)[:, None, :], 1)[:, 0]
        assert bool((z_got >= zmax - 2 * slack_u * (s_got + smax)).all())
        # out over every column, at the op's winners
        m = z_got + bias64
        r = cp.maximum(m, 0)
        out_r = cp.log1p(r) if act == "log1p_relu" else r
        dact = (m > 0) * (1 / (1 + r) if act == "log1p_relu" else 1.0)
        C.check_elementwise("out", out, C.host(out_r), C.host(out_r + s_got + cp.abs(bias64)),
                            TOL[dtype]["out"], f"float16 {act} V*D>2^31")
        # dx over every column: sum_v [l* = l] g' W[v], float64 in V chunks
        g = cp.asarray(go, np.float64) * dact
        onehot = cp.arange(l)[None, :, None] == am[:, None, :]
        pg = cp.where(onehot, g[:, None, :], 0.0).reshape(b * l, v)
        pa = cp.abs(pg)
        dx_r = cp.zeros((b * l, d), np.float64)
        dx_a = cp.zeros((b * l, d), np.float64)
        for c0 in range(0, v, chunk):
            wc = w[c0:c0 + chunk].astype(np.float64)
            dx_r += pg[:, c0:c0 + chunk] @ wc
            dx_a += pa[:, c0:c0 + chunk] @ cp.abs(wc)
        C.check_elementwise("dx", dx, C.host(dx_r).reshape(b, l, d),
                            C.host(dx_a).reshape(b, l, d), TOL[dtype]["grad"],
                            f"float16 {act} V*D>2^31")
        # dweight / dbias on sampled columns (including the last rows of W)
        cols = np.unique(np.concatenate([rng.choice(v, 32, replace=False), [0, v - 1]]))
        sub = dict(x=x, weight=C.host(w[cols]), bias=bias[cols], mask=None,
                   grad_out=go[:, cols])
        C.check_against_reference(sub, act, C.host(out)[:, cols], C.host(ctx.stats[0])[:, cols],
                                  (None, C.host(dw[cols]), C.host(db)[cols]),
                                  parts=("out", "dweight", "dbias"), case="V*D>2^31 cols")
        del out, ctx, dx, dw, db


# ----------------------------------------------------------------------------------------
# 4. devices and array kinds
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["x", "weight", "bias", "mask"])
def test_mixing_numpy_and_cupy_raises(which):
    kw = {k: cp.asarray(a) for k, a in C._valid().items()}
    kw[which] = C.host(kw[which])
    with pytest.raises(TypeError, match=r"splade_pool" + C._names(which)):
        cupynce.splade_pool(kw["x"], kw["weight"], kw["bias"], kw["mask"])


def test_numpy_grad_out_for_a_cupy_forward_raises():
    kw = {k: cp.asarray(a) for k, a in C._valid().items()}
    _, ctx = cupynce.splade_pool_forward(kw["x"], kw["weight"], kw["bias"], kw["mask"])
    with pytest.raises((TypeError, ValueError), match=C._names("grad_out")):
        cupynce.splade_pool_backward(ctx, np.ones((2, 5), np.float32))


def test_arrays_on_two_gpus_raise():
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    kw = C._valid()
    with cp.cuda.Device(0):
        x = cp.asarray(kw["x"])
    with cp.cuda.Device(1):
        w = cp.asarray(kw["weight"])
    with pytest.raises(ValueError, match=r"splade_pool" + C._names("x", "weight")):
        cupynce.splade_pool(x, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flops_regularizer_on_gpu(dtype):
    out = np.abs(np.random.default_rng(16).standard_normal((16, 1001))).astype(dtype)
    out[:, ::3] = 0
    val_r, dout_r = ref.flops_regularizer(out)
    val = cupynce.flops_regularizer(cp.asarray(out))
    assert isinstance(val, cp.ndarray) and val.shape == ()
    assert val.dtype == (F64 if dtype == F64 else F32)
    np.testing.assert_allclose(float(val), val_r, rtol=C.TOL_FLOPS[dtype])
    g = np.float32(0.7)  # a device scalar; its float32 value is the upstream gradient
    gv = float(g)
    d = cupynce.flops_regularizer_backward(cp.asarray(out), cp.asarray(g))
    assert isinstance(d, cp.ndarray) and d.dtype == dtype
    C.check_elementwise("dout", d, gv * dout_r, gv * np.abs(dout_r), TOL[dtype]["grad"],
                        f"{np.dtype(dtype).name} gpu flops")


@pytest.mark.parametrize("shape", [(2, 9000, 4, 50), (1, 40000, 2, 7)], ids=["L9000", "L40000"])
def test_long_sequences(shape):
    """Long L: the backward's counters and cursors live in global memory (4 L bytes > 32 KiB),
    and beyond L = 32768 the mask row is read in place and the arg-max is int32."""
    inp = C.make_inputs(shape, F32, "rand01", True, seed=13)
    for act in ACTIVATIONS:
        out, am, grads = run(inp, act)
        assert C.host(am).dtype == (np.int16 if shape[1] <= 32768 else np.int32)
        C.check_against_reference(inp, act, out, am, grads, case=f"long {shape}")


def test_from_stats_with_non_contiguous_out_and_argmax():
    """Views of out / argmax with another row stride give the same gradients (copied first)."""
    inp = C.make_inputs((3, 7, 5, 40), F32, "rand01", True, seed=14)
    x, w, b, g = (cp.asarray(inp[k]) for k in ("x", "weight", "bias", "grad_out"))
    out, ctx = cupynce.splade_pool_forward(x, w, b, cp.asarray(inp["mask"]))
    want = cupynce.splade_pool_backward(ctx, g)
    buf = cp.zeros((3, 80), out.dtype)
    buf[:, :40] = out
    abuf = cp.zeros((3, 80), ctx.stats[0].dtype)
    abuf[:, 40:] = ctx.stats[0]
    got = cupynce.splade_pool_backward_from_stats(x, w, buf[:, :40], abuf[:, 40:], g, bias=b)
    for a, c in zip(want, got):
        assert bool((a == c).all())


@pytest.mark.parametrize("b,n", [(1, 1), (3, 31), (2, 256), (5, 257), (4, 4099), (2, 40_000)])
@pytest.mark.parametrize("cursors", [False, True])
def test_scan_kernel(b, n, cursors):
    """``cpn_splade_scan``: each row's inclusive and exclusive prefix sums of int32 counts
    (and the cursors' copy of the exclusive ones), exact, nothing written past n."""
    from cupynce._engine import kernels, splade

    rng = np.random.default_rng(b * 1000 + n)
    counts = rng.integers(0, 300, size=(b, n)).astype(np.int32)
    counts[0, : min(n, 7)] = 0
    d_counts = cp.asarray(counts)
    pad = 16
    incl, excl, cur = (cp.full((b, n + pad), -5, np.int32) for _ in range(3))
    kernels.get_function(splade.GRAD_FILE, "cpn_splade_scan")(
        (b,), (splade._SCAN_BLOCK,), (d_counts, np.int32(n), incl, excl, cur if cursors else 0))
    # (rows laid out with stride n: view the written region as (b, n))
    flat = lambda a: cp.asnumpy(a).reshape(-1)[: b * n].reshape(b, n)  # noqa: E731
    want = np.cumsum(counts, axis=1, dtype=np.int64)
    np.testing.assert_array_equal(flat(incl), want)
    np.testing.assert_array_equal(flat(excl), want - counts)
    if cursors:
        np.testing.assert_array_equal(flat(cur), want - counts)
    else:
        assert (cp.asnumpy(cur) == -5).all()
    assert (cp.asnumpy(incl).reshape(-1)[b * n:] == -5).all()
