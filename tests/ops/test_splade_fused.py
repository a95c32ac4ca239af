"""GPU tests specific to SPLADE's fused forward (the max over the sequence in the epilogue of
the tensor-core product: kernels_src/splade/splade_wgmma.cu on Hopper, splade_tiles.cu
MODE_SPMAX elsewhere).  Every test of ops/test_splade_kernels.py also runs on both (its
``forward_path`` fixture); these check what those cannot: that the paths are really taken,
that they agree bit for bit, and the sm_80 main loop that Hopper does not use by default.
Oracle and tolerances: those of ops/test_splade_kernels.py."""
from __future__ import annotations

import pytest

import cupynce

import test_splade as C  # noqa: E402  (its folder is on sys.path: conftest)

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
HALF = [pytest.param(C.F16, id="f16"), pytest.param(C.BF16, id="bf16")]


@pytest.fixture
def tiles(configure):
    from cupynce._engine import tiling

    configure(tiles=True)
    return tiling


@pytest.mark.parametrize("dtype", HALF)
def test_fused_forward_issues_no_gemm(dtype, tiles, monkeypatch):
    """Aligned 16-bit inputs never reach cuBLAS (nor a logits workspace) in the forward."""
    from cupynce._engine import splade

    def no_gemm(*a, **k):
        raise AssertionError("the fused forward must not call cuBLAS")

    monkeypatch.setattr(splade.cublas, "gemm", no_gemm)
    inp = C.make_inputs((2, 40, 16, 300), dtype, "bool", True, seed=5)
    out = cupynce.splade_pool(*(cp.asarray(inp[k]) for k in ("x", "weight", "bias", "mask")),
                              activation="relu")
    assert out.shape == (2, 300)


@pytest.mark.parametrize("mask", [None, "rand01"], ids=["nomask", "rand01"])
@pytest.mark.parametrize("dtype", HALF)
def test_fused_forward_with_the_mma_sync_loop(dtype, mask, tiles, configure):
    """The fused max on the sm_80 main loop (mma.sync), which Hopper otherwise skips."""
    configure(wgmma=False)
    for shape, grid in (((3, 130, 24, 1001), False), ((4, 300, 8, 300), True)):
        inp = C.make_inputs(shape, dtype, mask, True, seed=9, grid=grid)
        for act in C.ACTIVATIONS:
            out, am, grads = C.run_op(inp, act, to=cp.asarray)
            C.check_against_reference(inp, act, out, am, grads, exact_argmax=grid,
                                      case=f"mma.sync {shape} {mask}")


def _on_hopper():
    from cupynce._engine import tiling

    return tiling.wgmma()


@pytest.mark.parametrize("use_ws", [True, False], ids=["ws", "tiles"])
@pytest.mark.parametrize("dtype", HALF)
def test_fused_schedules_agree_bitwise(dtype, use_ws, tiles, monkeypatch, configure):
    """Batches per CTA and the grouped CTA order (a last group of fewer batch groups
    included) change only who computes an entry, not how: bitwise the same results."""
    from cupynce._engine import splade, tiling

    if use_ws and not _on_hopper():
        pytest.skip("splade_wgmma.cu runs on Hopper only")
    configure(splade_ws=use_ws)
    inp = C.make_inputs((5, 140, 16, 700), dtype, "rand01", True, seed=21)
    results = {}
    tile = splade._WS_BN if use_ws else tiling.TILE
    spb = -(-140 // tile)  # product steps per batch (one K step)
    # (min steps, x bytes) -> (per, group): (1, 1), (1, 2) [groups 2+2+1], (2, 2), (5, 1)
    for steps, xbytes in ((1, 1), (1, 2 * 140 * 16 * 2), (2 * spb, 4 * 140 * 16 * 2),
                          (10 ** 6, 1)):
        monkeypatch.setattr(splade, "_SPMAX_MIN_STEPS", steps)
        monkeypatch.setattr(splade, "_SPMAX_X_BYTES", xbytes)
        sched = splade._spmax_schedule(5, 140, 16, 2, tile)
        out, am, grads = C.run_op(inp, "log1p_relu", to=cp.asarray)
        results[sched] = (out, am)
    assert set(results) == {(1, 1), (1, 2), (2, 2), (5, 1)}, results.keys()
    first = results[(1, 1)]
    C.check_against_reference(inp, "log1p_relu", *C.run_op(inp, "log1p_relu", to=cp.asarray),
                              case="schedules")
    for sched, (out, am) in results.items():
        assert bool((out.view(cp.uint16) == first[0].view(cp.uint16)).all()), sched
        assert bool((am == first[1]).all()), sched


@pytest.mark.parametrize("dtype", HALF)
def test_warp_specialised_kernel_is_taken_and_agrees_with_tiles(dtype, tiles, monkeypatch,
                                                                configure):
    """On Hopper the default fused forward is splade_wgmma.cu (TMA, 128 x 256 tiles): it is
    really launched (tiles.cu's kernel is not), and it gives the bits of tiles.cu's
    MODE_SPMAX over shapes with partial vocabulary / position / K tiles, several position
    tiles per batch, masks, and positions of the next batch inside a tile."""
    from cupynce._engine import tiling

    if not _on_hopper():
        pytest.skip("splade_wgmma.cu runs on Hopper only")
    for shape, mask in (((3, 700, 72, 1001), "rand01"), ((2, 256, 64, 384), None),
                        ((5, 33, 8, 130), "bool"), ((1, 1, 16, 7), None)):
        inp = C.make_inputs(shape, dtype, mask, True, seed=33)
        for act in C.ACTIVATIONS:
            configure(splade_ws=True)
            calls = []
            real = tiling.tile_launch  # (splade calls it through the module)
            monkeypatch.setattr(tiling, "tile_launch", lambda *a: calls.append(a) or real(*a))
            ws = C.run_op(inp, act, to=cp.asarray)
            assert not calls, "splade_tiles.cu ran instead of splade_wgmma.cu"
            configure(splade_ws=False)
            ref = C.run_op(inp, act, to=cp.asarray)
            assert len(calls) == 1
            monkeypatch.setattr(tiling, "tile_launch", real)
            assert bool((ws[0].view(cp.uint16) == ref[0].view(cp.uint16)).all()), (shape, act)
            assert bool((ws[1] == ref[1]).all()), (shape, act)
            C.check_against_reference(inp, act, *ws, case=f"ws {shape} {mask}")


def test_warp_specialised_shared_memory_matches_python():
    """_engine/splade.py's _WS_SMEM is the kernel's SW_SMEM_BYTES."""
    from cupynce._engine import splade
    from cupynce._engine.kernels import get_kernel

    if not _on_hopper():
        pytest.skip("splade_wgmma.cu runs on Hopper only")
    got = cp.zeros((1,), cp.int32)
    get_kernel(splade._WS_FILE, "spmax_ws_smem", C.BF16)((1,), (1,), (got,))
    assert int(got[0]) == splade._WS_SMEM


@pytest.mark.parametrize("rows", [1, 7, 1000])
def test_tensor_maps_are_encoded_into_aligned_buffers(rows):
    """The driver encodes each CUtensorMap into a 64-byte-aligned host buffer (its documented
    requirement), also for one-row and strided matrices."""
    from cupynce._engine import tma as _tma

    if not _tma.available():
        pytest.skip("no cuTensorMapEncodeTiled in this driver")
    a = cp.zeros((rows, 72), C.BF16)
    for m in (a, a[:, :64]):
        tm = _tma.matrix_map(m, 128, 64)
        assert tm is not None and tm.shape == (1,) and tm.ctypes.data % 64 == 0
        assert tm["opaque"].any()  # the driver wrote it
