"""GPU tests specific to SPLADE's fused forward (the max over the sequence in the epilogue of
the tensor-core tiles, kernels_src/tiles.cu MODE_SPMAX).  Every test of test_gpu_splade.py
also runs on that path (its ``forward_path`` fixture); these check what those cannot: that
the path is really taken, and the sm_80 main loop that Hopper does not use by default.
Oracle and tolerances: those of test_gpu_splade.py."""
from __future__ import annotations

import pytest

import cupynce

import test_splade_cpu as C  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
HALF = [pytest.param(C.F16, id="f16"), pytest.param(C.BF16, id="bf16")]


@pytest.fixture
def tiles(monkeypatch):
    from cupynce import contrastive

    monkeypatch.setattr(contrastive, "USE_TILES", True)
    return contrastive


@pytest.mark.parametrize("dtype", HALF)
def test_fused_forward_issues_no_gemm(dtype, tiles, monkeypatch):
    """Aligned 16-bit inputs never reach cuBLAS (nor a logits workspace) in the forward."""
    from cupynce import splade

    def no_gemm(*a, **k):
        raise AssertionError("the fused forward must not call cuBLAS")

    monkeypatch.setattr(splade._blas, "gemm", no_gemm)
    inp = C.make_inputs((2, 40, 16, 300), dtype, "bool", True, seed=5)
    out = cupynce.splade_pool(*(cp.asarray(inp[k]) for k in ("x", "weight", "bias", "mask")),
                              activation="relu")
    assert out.shape == (2, 300)


@pytest.mark.parametrize("mask", [None, "rand01"], ids=["nomask", "rand01"])
@pytest.mark.parametrize("dtype", HALF)
def test_fused_forward_with_the_mma_sync_loop(dtype, mask, tiles, monkeypatch):
    """The fused max on the sm_80 main loop (mma.sync), which Hopper otherwise skips."""
    monkeypatch.setattr(tiles, "USE_WGMMA", False)
    for shape, grid in (((3, 130, 24, 1001), False), ((4, 300, 8, 300), True)):
        inp = C.make_inputs(shape, dtype, mask, True, seed=9, grid=grid)
        for act in C.ACTIVATIONS:
            out, am, grads = C.run_op(inp, act, to=cp.asarray)
            C.check_against_reference(inp, act, out, am, grads, exact_argmax=grid,
                                      case=f"mma.sync {shape} {mask}")


@pytest.mark.parametrize("dtype", HALF)
def test_fused_schedules_agree_bitwise(dtype, tiles, monkeypatch):
    """Batches per CTA and the grouped CTA order (a last group of fewer batch groups
    included) change only who computes an entry, not how: bitwise the same results."""
    from cupynce import splade

    inp = C.make_inputs((5, 140, 16, 700), dtype, "rand01", True, seed=21)
    results = {}
    # (min steps, x bytes) -> (per, group): (1, 1), (1, 2) [groups 2+2+1], (2, 2), (5, 1)
    for steps, xbytes in ((1, 1), (1, 2 * 140 * 16 * 2), (4, 4 * 140 * 16 * 2), (10 ** 6, 1)):
        monkeypatch.setattr(splade, "_SPMAX_MIN_STEPS", steps)
        monkeypatch.setattr(splade, "_SPMAX_X_BYTES", xbytes)
        sched = splade._spmax_schedule(5, 140, 16, 2)
        out, am, grads = C.run_op(inp, "log1p_relu", to=cp.asarray)
        results[sched] = (out, am)
    assert set(results) == {(1, 1), (1, 2), (2, 2), (5, 1)}, results.keys()
    first = results[(1, 1)]
    C.check_against_reference(inp, "log1p_relu", *C.run_op(inp, "log1p_relu", to=cp.asarray),
                              case="schedules")
    for sched, (out, am) in results.items():
        assert bool((out.view(cp.uint16) == first[0].view(cp.uint16)).all()), sched
        assert bool((am == first[1]).all()), sched
