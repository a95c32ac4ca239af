"""Tests of the side branch (``cupynce._engine.side``): work beside a long pass, joined.

The contract: a branch changes where work runs, never what it computes -- the same bits with
the side stream as without (``config.side_streams`` False), plain and replayed from a CUDA
graph; the forked stream waits for the branch before the op returns (what follows reads the
branch's results); without a fork point (CPU, the row blocks, a capture before the side
stream exists) the work runs in place.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from cupynce._engine import side


# ------------------------------------------------------------------------------------------
# no GPU: the in-place path
# ------------------------------------------------------------------------------------------
def test_without_a_fork_point_beside_runs_in_place():
    ran = []
    with side.branch() as br:
        with br.beside():
            ran.append(1)
        assert br.fork is None and br.done is None
    assert ran == [1]
    assert side.take_open() is None


def test_fork_point_touches_no_cuda_outside_a_branch_or_when_off(monkeypatch, configure):
    """No branch, or branches off: fork_point returns before importing CuPy (made to fail
    here), and a branch then runs its work in place."""
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)  # (import cupy raises ImportError)
    side.fork_point()
    configure(side_streams=False)
    ran = []
    with side.branch() as br:
        side.fork_point()
        with br.beside():
            ran.append(1)
    assert br.fork is None and ran == [1]
    assert getattr(side._tls, "branch", None) is None


def test_branches_nest_and_unwind_on_errors():
    with side.branch() as outer:
        with pytest.raises(KeyError):
            with side.branch() as inner:
                assert inner.depth == outer.depth + 1
                raise KeyError("x")
        assert side._tls.branch is outer
    assert getattr(side._tls, "branch", None) is None


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu


def _cp():
    return pytest.importorskip("cupy")


#: spins ~``cycles`` clocks, then writes ``value`` (a late writer on the side stream)
_SPIN = r"""
extern "C" __global__ void spin_write(float* out, float value, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    out[0] = value;
}
extern "C" __global__ void copy1(const float* src, float* dst) { dst[0] = src[0]; }
"""


@gpu
def test_the_forked_stream_waits_for_the_branch(configure):
    """A slow kernel beside; what the forked stream runs after the branch sees its write."""
    cp = _cp()
    configure(side_streams=True)
    mod = cp.RawModule(code=_SPIN)
    spin, copy1 = mod.get_function("spin_write"), mod.get_function("copy1")
    main = cp.cuda.Stream(non_blocking=True)
    with main:
        for value in (1.0, 2.0, 3.0):
            src = cp.zeros((1,), cp.float32)
            dst = cp.zeros((1,), cp.float32)
            with side.branch() as br:  # (both allocated before the fork point)
                side.fork_point()
                assert br.fork is not None
                with br.beside():
                    assert cp.cuda.get_current_stream() is not main
                    spin((1,), (1,), (src, np.float32(value), np.int64(20_000_000)))
            copy1((1,), (1,), (src, dst))  # (on main, after the join)
            assert float(dst.get(stream=main)[0]) == value
    main.synchronize()


@gpu
def test_beside_refuses_allocations(configure):
    """Work beside writes memory allocated before the fork point: an allocation raises (the
    forked stream's pool may hand back memory its later work still uses)."""
    cp = _cp()
    configure(side_streams=True)
    main = cp.cuda.Stream(non_blocking=True)
    with main:
        with side.branch() as br:
            side.fork_point()
            with pytest.raises(RuntimeError, match="allocated beside"):
                with br.beside():
                    cp.empty((1024,), cp.float32)
        out = cp.zeros((1,), cp.float32)  # (after the block: the usual allocator again)
    main.synchronize()
    assert out.shape == (1,)


@gpu
def test_no_fork_inside_a_capture_before_the_stream_exists():
    """A fresh thread whose first branch is under a capture: in place, the capture ends."""
    cp = _cp()
    errors = []

    def body():
        try:
            st = cp.cuda.Stream(non_blocking=True)
            with st:
                st.begin_capture()
                try:
                    with side.branch() as br:
                        side.fork_point()
                        assert br.fork is None
                        with br.beside():
                            pass
                finally:
                    st.end_capture()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert not errors, errors


def _bits(x):
    cp = _cp()
    if x is None:
        return None
    return np.ascontiguousarray(cp.asnumpy(x)).reshape(-1).view(np.uint8).tobytes()


def _outputs(op, args, reduction):
    import cupynce

    cp = _cp()
    g = cp.asarray(np.float32(0.75))
    if op == "nt_xent":
        loss, ctx = cupynce.nt_xent_forward(args[0], 0.2, reduction=reduction)
        grads = (cupynce.nt_xent_backward(ctx, g),)
    else:
        loss, ctx = cupynce.info_nce_forward(args[0], args[1], 0.1, reduction=reduction)
        grads = cupynce.info_nce_backward(ctx, g)
    return [_bits(loss)] + [_bits(s) for s in ctx.stats] + [_bits(x) for x in grads]


@gpu
@pytest.mark.parametrize("op", ["nt_xent", "info_nce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n,d", [(512, 64), (1030, 136)])
def test_same_bits_with_and_without_the_branch(configure, op, reduction, n, d):
    """The tile path's reduced loss beside its gradient pass, plain and from graphs: the same
    bits as in place."""
    cp = _cp()
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from cupynce._engine import tiling
    from cupynce.ops import _graphs

    rng = np.random.default_rng(n)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    args = [cp.asarray(rng.standard_normal((n, d)).astype(np.float32).astype(bf16))
            for _ in range(1 if op == "nt_xent" else 2)]
    if not tiling.tiles_ok(*args):
        pytest.skip("the tile kernels need sm_80+")
    calls = _graphs.CAPTURE_AFTER + 2
    results = {}
    for enabled in (False, True):
        configure(side_streams=enabled)
        for graphs in (False, True):
            configure(graphs=graphs)
            _graphs.clear()
            results[enabled, graphs] = [_outputs(op, args, reduction) for _ in range(calls)]
    _graphs.clear()
    want = results[False, False][0]
    for key, runs in results.items():
        for i, got in enumerate(runs):
            assert got == want, (key, i)


@gpu
@pytest.mark.parametrize("op", ["nt_xent", "info_nce"])
@pytest.mark.parametrize("blocks", ["one", "several"])
def test_replays_with_fresh_inputs(monkeypatch, configure, op, blocks):
    """New inputs every call (an early or stale read would show), replayed against plain
    runs bit for bit: one row block (the loss sum and the gather beside the gradient pass)
    and several (no fork: the first blocks' products run inside the graph, after the
    statistics, and their small outputs are gathered on the current stream)."""
    cp = _cp()
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import cupynce
    from cupynce._engine import tiling
    from cupynce.ops import _graphs

    n, d = 1024, 64
    ws = None if blocks == "one" else 256 << 10  # (2 KiB rows of G: 128-row blocks)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(11)
    probe = cp.zeros((n, d), bf16)
    if not tiling.tiles_ok(probe, probe):
        pytest.skip("the tile kernels need sm_80+")
    configure(side_streams=True)
    forks = []
    real = side.fork_point

    def spy():
        real()
        br = getattr(side._tls, "branch", None)
        forks.append(br is not None and br.fork is not None)

    monkeypatch.setattr(side, "fork_point", spy)

    def call(args):
        g = cp.asarray(np.float32(0.75))
        if op == "nt_xent":
            loss, ctx = cupynce.nt_xent_forward(args[0], 0.2, workspace_bytes=ws)
            grads = (cupynce.nt_xent_backward(ctx, g),)
        else:
            loss, ctx = cupynce.info_nce_forward(args[0], args[1], 0.1, workspace_bytes=ws)
            grads = cupynce.info_nce_backward(ctx, g)
        return [_bits(loss)] + [_bits(s) for s in ctx.stats] + [_bits(x) for x in grads]

    _graphs.clear()
    try:
        for i in range(_graphs.CAPTURE_AFTER + 4):
            args = [cp.asarray(rng.standard_normal((n, d)).astype(np.float32).astype(bf16))
                    for _ in range(1 if op == "nt_xent" else 2)]
            configure(graphs=False)
            want = call(args)
            configure(graphs=True)
            assert call(args) == want, f"call {i + 1}"
        assert _graphs.info()["plans"] == 1, _graphs.info()
    finally:
        _graphs.clear()
    if blocks == "one":
        assert forks and all(forks), forks
    else:
        assert forks == [], forks  # (score_tiles.rows forks only where one block holds G)
