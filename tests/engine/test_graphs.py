"""The CUDA-graph replay of small calls (``cupynce.ops._graphs``).

Without a GPU: the early exit for problems too large to capture (no stream, device or key
touched), the estimates of what a call keeps, the per-thread tokens, deferred products outside
graphs.  Marked ``gpu``, the captures and replays; the contract: a replayed call gives the
same bits as the same call run kernel by kernel (which the other GPU tests hold to the float64
oracle), for every op, dtype and flag; the inputs of each call are read afresh; what a call
returns is its own (a later call never changes it); streams and threads keep their plans
apart; problems the plan cannot take (non-contiguous or misaligned inputs, too large, a
capture that fails) run uncaptured.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import cupynce
import cupynce.config as cfg
from cupynce.ops import _graphs
from cupynce.ops import clip as clip_op
from cupynce.ops import nt_xent as nt_xent_op

try:
    import cupy as cp
except ImportError:  # (the gpu tests are skipped without it: conftest)
    cp = None
ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
CALLS = _graphs.CAPTURE_AFTER + 2  # plain calls, the capture, one more replay


@pytest.fixture(autouse=True)
def fresh_cache(configure):
    configure(graphs=True)
    _graphs.clear()
    yield
    _graphs.clear()


# ---- without a GPU ------------------------------------------------------------------------
def test_est_bytes_past_the_limit_runs_compute_without_a_key():
    """No stream, device or key is touched (NumPy inputs would fail there): ``compute`` runs,
    a trace records the call as uncaptured, nothing is counted."""
    x = np.arange(4.0)
    for _ in range(_graphs.CAPTURE_AFTER + 2):
        with _graphs.trace() as events:
            (y,) = _graphs.run(("test",), (x,), lambda x: (x + 1,),
                               est_bytes=_graphs.MAX_PLAN_BYTES + 1)
        np.testing.assert_array_equal(y, x + 1)
        assert events == [None]
    info = _graphs.info()
    assert info["plans"] == 0 and info["counting"] == 0 and not info["refused"]


@pytest.mark.parametrize("dtype, n, ws, want", [
    (np.float32, 16384, None, cfg.current().default_workspace_bytes),  # capped: 1 GiB of 1 GiB
    (np.float32, 8192, None, 8192 * 8192 * 4),
    (np.float32, 16384, 64 << 20, 64 << 20),  # the caller's workspace
    (np.float64, 100, None, 100 * 100 * 8),
    (np.float16, 16384, None, 0),  # 16-bit: the tiles keep no score block
])
def test_clip_score_block_estimate(dtype, n, ws, want):
    a = np.zeros((n, 1), dtype)
    acc = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    assert clip_op._score_block_bytes(a, acc, ws) == want
    # a float32 CLIP at N = 16384 (1 GiB) skips the key; at 8192 (256 MiB) it is captured
    assert (want > _graphs.MAX_PLAN_BYTES) == (n == 16384 and dtype != np.float16
                                               and ws is None)


@pytest.mark.parametrize("dtype, n, d, ws, want", [
    # 16-bit: the whole H (N x N, z's dtype) + the float32 accumulator: 16384 is captured
    # (544 MiB), a float32 one at 16384 (1 GiB + the accumulator) skips the key
    ("bfloat16", 16384, 512, None, 16384 * 16384 * 2 + 16384 * 512 * 4),
    (np.float16, 8192, 512, None, 8192 * 8192 * 2 + 8192 * 512 * 4),
    (np.float16, 16384, 512, 64 << 20, (64 << 20) + 16384 * 512 * 4),  # capped
    (np.float32, 16384, 128, None, cfg.current().default_workspace_bytes + 16384 * 128 * 4),
    (np.float64, 100, 8, None, 100 * 100 * 8 + 100 * 8 * 8),
])
def test_nt_xent_kept_bytes(dtype, n, d, ws, want):
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dtype = ml_dtypes.bfloat16
    z = np.zeros((n, d), dtype)
    assert nt_xent_op._kept_bytes(z, ws) == want
    assert (want > _graphs.MAX_PLAN_BYTES) == (dtype == np.float32)


def test_thread_tokens_are_never_reused():
    """The per-thread default stream's plans are keyed by a token per thread that no later
    thread gets, even once the first has exited (``threading.get_ident`` may be reused)."""
    import threading

    mine = _graphs.thread_token()
    assert _graphs.thread_token() == mine
    seen = []
    for _ in range(4):  # one after the other: each exits before the next starts
        t = threading.Thread(target=lambda: seen.append(_graphs.thread_token()))
        t.start()
        t.join()
    assert len(set(seen + [mine])) == 5


def test_deferred_products_run_plainly_outside_graphs():
    from cupynce._engine import tail

    out = []
    tail.products((1, 2), lambda a, b: out.append((a, b)))
    with tail.collecting(None) as rec:
        tail.products((3,), lambda a: out.append(a))
    with tail.collecting(lambda o, f: f(*o)) as rec2:
        tail.products((4,), lambda a: out.append(a))
    assert out == [(1, 2), 4] and len(rec) == 1 and len(rec2) == 1
    with tail.collecting(None) as rec3:  # (not the call's last work: run now, not recorded)
        tail.products((5,), lambda a: out.append(a), last=False)
    assert out == [(1, 2), 4, 5] and not rec3


# ---- captures and replays (GPU) -----------------------------------------------------------
gpu = pytest.mark.gpu


def bits(x):
    """The bytes of an array (or None), for bitwise comparisons."""
    if x is None:
        return None
    return np.ascontiguousarray(cp.asnumpy(x)).reshape(-1).view(np.uint8).tobytes()


def inputs(op, n, d, dtype, seed=0, ls_kind="array"):
    rng = np.random.default_rng(seed)

    def mat(rows):
        return cp.asarray(rng.standard_normal((rows, d)).astype(np.float32).astype(dtype))

    if op == "nt_xent":
        return (mat(n),), {}
    if op == "supcon":  # (the labels an input of the graph)
        return (mat(n),), {"labels": cp.asarray(rng.integers(0, n // 4, n))}
    if op == "info_nce_queue":  # (MoCo: the queue rows, their fix-ups after the products)
        return (mat(n), mat(n)), {"negatives": mat(2 * n), "in_batch_negatives": False}
    if op == "info_nce":
        return (mat(n), mat(n)), {}
    if op == "info_nce_neg":
        return (mat(n), mat(n)), {"negatives": mat(n // 2)}
    ls = cp.asarray(np.float32(2.3 + 0.1 * seed)) if ls_kind == "array" else 2.3 + 0.1 * seed
    if op == "siglip_loss":
        lb = cp.asarray(np.float32(-10.0 + seed)) if ls_kind == "array" else -10.0 + seed
        return (mat(n), mat(n), ls, lb), {}
    if op == "clip_labels":  # (the labels an input of the graph: a seed's own values)
        return (mat(n), mat(n), ls), {"labels": cp.asarray(rng.integers(0, n // 3, n))}
    return (mat(n), mat(n), ls), {}


def step(op, args, kw, *, normalize=False, reduction="mean", requires_grad=True):
    """Forward (+ backward with a non-unit upstream gradient): every output's bits."""
    g = cp.asarray(np.float32(0.75))
    if op == "nt_xent":
        loss, ctx = cupynce.nt_xent_forward(args[0], 0.2, normalize=normalize,
                                            reduction=reduction, requires_grad=requires_grad)
        grads = (cupynce.nt_xent_backward(ctx, g),) if requires_grad else ()
    elif op == "supcon":
        loss, ctx = cupynce.supcon_forward(args[0], kw["labels"], 0.2, normalize=normalize,
                                           reduction=reduction, requires_grad=requires_grad)
        grads = (cupynce.supcon_backward(ctx, g),) if requires_grad else ()
    elif op.startswith("info_nce"):
        loss, ctx = cupynce.info_nce_forward(args[0], args[1], 0.1, normalize=normalize,
                                             reduction=reduction, requires_grad=requires_grad,
                                             **kw)
        grads = cupynce.info_nce_backward(ctx, g) if requires_grad else ()
    elif op == "siglip_loss":
        loss, ctx = cupynce.siglip_loss_forward(*args, normalize=normalize,
                                                reduction=reduction,
                                                requires_grad=requires_grad)
        grads = cupynce.siglip_loss_backward(ctx, g) if requires_grad else ()
    else:
        loss, ctx = cupynce.clip_loss_forward(*args, normalize=normalize, reduction=reduction,
                                              requires_grad=requires_grad, **kw)
        grads = cupynce.clip_loss_backward(ctx, g) if requires_grad else ()
    return [bits(loss)] + [bits(s) for s in ctx.stats] + [bits(x) for x in grads]


def _run_threads(targets) -> None:
    """Run each callable on its own thread; wait for all."""
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def plain(fn):
    """``fn()`` with graphs off."""
    with cfg.override(graphs=False):
        return fn()


OPS = ["nt_xent", "info_nce", "info_nce_neg", "info_nce_queue", "clip_loss", "clip_labels",
       "siglip_loss", "supcon"]


@gpu
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16), np.dtype(np.float32),
                                   np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("normalize", [False, True])
def test_replay_is_bit_identical(op, dtype, normalize):
    args, kw = inputs(op, 256, 64, dtype)
    want = plain(lambda: step(op, args, kw, normalize=normalize))
    for i in range(CALLS):
        assert step(op, args, kw, normalize=normalize) == want, f"call {i + 1}"
    assert _graphs.info()["plans"] == 1, _graphs.info()


@gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("reduction,requires_grad", [("sum", True), ("mean", False),
                                                     ("none", False)])
def test_replay_other_modes(op, reduction, requires_grad):
    args, kw = inputs(op, 384, 128, BF16)
    want = plain(lambda: step(op, args, kw, reduction=reduction, requires_grad=requires_grad))
    for _ in range(CALLS):
        got = step(op, args, kw, reduction=reduction, requires_grad=requires_grad)
        assert got == want
    assert _graphs.info()["plans"] == 1


@gpu
def test_host_logit_scale_is_part_of_the_key():
    """A Python-float logit_scale is baked into the graph: another value is another plan."""
    for seed in (0, 1):
        args, kw = inputs("clip_loss", 256, 64, BF16, seed=0, ls_kind="float")
        args = args[:2] + (2.3 + 0.1 * seed,)
        want = plain(lambda: step("clip_loss", args, kw))
        for _ in range(CALLS):
            assert step("clip_loss", args, kw) == want
    assert _graphs.info()["plans"] == 2


@gpu
@pytest.mark.parametrize("op", OPS)
def test_inputs_read_afresh_and_outputs_kept(op):
    """Replays read each call's inputs (the graph copies them in), and the arrays a call
    returned keep their values through later calls of the same problem."""
    batches = [inputs(op, 256, 64, BF16, seed=s) for s in range(CALLS + 2)]
    want = [plain(lambda a=a, k=k: step(op, a, k)) for a, k in batches]
    outs = []
    for (args, kw), w in zip(batches, want):
        loss, ctx = (cupynce.nt_xent_forward(args[0], 0.2) if op == "nt_xent" else
                     cupynce.supcon_forward(args[0], kw["labels"], 0.2) if op == "supcon" else
                     cupynce.info_nce_forward(args[0], args[1], 0.1, **kw)
                     if op.startswith("info_nce") else cupynce.siglip_loss_forward(*args)
                     if op == "siglip_loss" else cupynce.clip_loss_forward(*args, **kw))
        outs.append((loss, ctx.stats))
    assert _graphs.info()["plans"] == 1
    for (loss, stats), w in zip(outs, want):
        assert [bits(loss)] + [bits(s) for s in stats] == w[:1 + len(stats)]


def _plan():
    (plan,) = _graphs._plans.values()
    return plan


@gpu
@pytest.mark.parametrize("op", OPS)
def test_variants_read_the_inputs_in_place(op):
    """The same input pointers on a plan's second replay get a variant that reads them in
    place: same bits, new values written into the same memory are read, other pointers
    still copy in."""
    args, kw = inputs(op, 256, 64, BF16)
    want = plain(lambda: step(op, args, kw))
    for i in range(CALLS + 2):
        assert step(op, args, kw) == want, f"call {i + 1}"
    assert len(_plan().variants) == 1
    # new values in the same memory: the variant reads them
    fresh, _ = inputs(op, 256, 64, BF16, seed=5)
    for x, y in zip(args[:2], fresh[:2]):
        x[...] = y
    want = plain(lambda: step(op, args, kw))
    assert step(op, args, kw) == want
    # other pointers (a copy): copied in, a variant only on their second replay
    other = tuple(x.copy() for x in args[:2]) + tuple(args[2:])
    assert step(op, other, kw) == want
    assert len(_plan().variants) == 1
    assert step(op, other, kw) == want
    assert len(_plan().variants) == 2 and _graphs.info()["plans"] == 1


@gpu
def test_variants_bounded_and_switchable(monkeypatch, configure):
    monkeypatch.setattr(_graphs, "MAX_VARIANTS", 2)
    sets = [inputs("nt_xent", 256, 64, BF16, seed=s) for s in range(4)]
    want = [plain(lambda a=a, k=k: step("nt_xent", a, k)) for a, k in sets]
    for _ in range(CALLS):
        for (a, k), w in zip(sets, want):
            assert step("nt_xent", a, k) == w
    assert len(_plan().variants) == 2
    configure(graph_variants=False)
    _graphs.clear()
    for _ in range(CALLS + 2):
        assert step("nt_xent", *sets[0]) == want[0]
    assert len(_plan().variants) == 0


@gpu
def test_variants_stop_where_pointer_sets_churn(monkeypatch):
    """More recurring pointer sets than MAX_VARIANTS: after 2 x MAX_VARIANTS evictions the
    plan makes no new variants (each capture costs a call's host time), results unchanged."""
    monkeypatch.setattr(_graphs, "MAX_VARIANTS", 1)
    sets = [inputs("nt_xent", 256, 64, BF16, seed=s) for s in range(3)]
    want = [plain(lambda a=a, k=k: step("nt_xent", a, k)) for a, k in sets]
    for _ in range(12):
        for (a, k), w in zip(sets, want):
            assert step("nt_xent", a, k) == w
    plan = _plan()
    assert plan.evicted == 2 * _graphs.MAX_VARIANTS + 1 and len(plan.variants) == 1


@gpu
def test_tiny_deferred_products_run_their_python(configure):
    """A product the recording cannot hold (here every product is "tiny": the small-product
    kernel) runs its Python at each replay: same bits."""
    configure(small_gemm_macs=1 << 40)
    args, kw = inputs("clip_loss", 256, 64, BF16)
    want = plain(lambda: step("clip_loss", args, kw))
    for _ in range(CALLS + 1):
        assert step("clip_loss", args, kw) == want
    plan = _plan()
    assert plan.tails and all(calls is None for _, _, _, calls in plan.tails)


@gpu
def test_misaligned_pointers_get_no_variant():
    """A 16-byte aligned input that is not 256-byte aligned (a row offset) is copied in."""
    base = inputs("nt_xent", 257, 64, BF16)[0][0]
    z = base[1:]  # 128 bytes past the allocation's start: 16-byte aligned
    assert z.data.ptr % 16 == 0 and z.data.ptr % 256
    z = cp.ndarray(z.shape, z.dtype, z.data)  # (C-contiguous view)
    want = plain(lambda: step("nt_xent", (z,), {}))
    for _ in range(CALLS + 2):
        assert step("nt_xent", (z,), {}) == want
    assert len(_plan().variants) == 0


@gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)], ids=str)
def test_gradient_products_left_out_of_the_graph(op, dtype):
    """On the 16-bit tiles the accumulators' products run after the graph, into the
    caller's arrays (no copy out); the float32 row blocks copy theirs out, and so do the ops
    whose later work adds to the products' output (``tail.not_last``: MoCo's queue
    fix-ups, SupCon's class terms) -- the bits equal to a plain call's show it."""
    from cupynce._engine import tiling

    args, kw = inputs(op, 256, 64, dtype)
    want = plain(lambda: step(op, args, kw))
    for _ in range(CALLS):
        assert step(op, args, kw) == want
    plan = _plan()
    on_tiles = (dtype != np.float32 and tiling.tiles_ok(args[0])
                and op not in ("supcon", "info_nce_queue"))
    written = {k for ks, _, _, _ in plan.tails for k in ks}
    if on_tiles:
        assert written and None not in written
        assert all(plan.layout[k] is None for k in written)  # (never in the pack)
        # recorded once: a replay issues the cuBLAS calls, not the products' Python
        assert all(calls for _, _, _, calls in plan.tails)
    else:
        assert not plan.tails


@gpu
def test_streams_have_their_own_plans():
    args, kw = inputs("clip_loss", 256, 64, BF16)
    want = plain(lambda: step("clip_loss", args, kw))
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    for _ in range(CALLS):
        for s in (s1, s2):
            with s:
                got = step("clip_loss", args, kw)
            assert got == want
    assert _graphs.info()["plans"] == 2


@gpu
def test_threads_sharing_a_stream():
    """Threads replaying one plan on one stream never mix their inputs."""
    batches = [inputs("info_nce", 256, 64, BF16, seed=s) for s in range(4)]
    want = [plain(lambda a=a, k=k: step("info_nce", a, k)) for a, k in batches]
    for args, kw in batches[:1] * CALLS:  # capture first
        step("info_nce", args, kw)
    errors = []

    def worker(i):
        try:
            for _ in range(20):
                got = step("info_nce", *batches[i])
                if got != want[i]:
                    errors.append(f"thread {i}: wrong bits")
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    _run_threads([lambda i=i: worker(i) for i in range(4)])
    assert not errors, errors
    assert _graphs.info()["plans"] == 1


@gpu
def test_layouts_the_plan_cannot_take_run_uncaptured():
    base = cp.asarray(np.random.default_rng(0).standard_normal(257 * 64).astype(BF16))
    views = {"misaligned": base[1:1 + 256 * 64].reshape(256, 64), "strided": cp.asarray(
        np.random.default_rng(1).standard_normal((256, 128)).astype(BF16))[:, ::2]}
    for name, z in views.items():
        want = plain(lambda: step("nt_xent", (z,), {}))
        for _ in range(CALLS):
            assert step("nt_xent", (z,), {}) == want, name
    # the strided view is copied to a contiguous array first, which may be replayed
    assert _graphs.info()["plans"] <= 1


@gpu
def test_large_plans_refused_and_cache_bounded(monkeypatch):
    monkeypatch.setattr(_graphs, "MAX_PLAN_BYTES", 1 << 10)
    # (InfoNCE passes no est_bytes: its capture is made, then dropped)
    args, kw = inputs("info_nce", 256, 64, BF16)
    want = plain(lambda: step("info_nce", args, kw))
    for _ in range(CALLS):
        assert step("info_nce", args, kw) == want
    info = _graphs.info()
    assert info["plans"] == 0 and "MAX_PLAN_BYTES" in next(iter(info["refused"].values()))
    monkeypatch.setattr(_graphs, "MAX_PLAN_BYTES", 1 << 30)
    monkeypatch.setattr(_graphs, "MAX_PLANS", 2)
    _graphs.clear()
    for n in (128, 256, 384):
        args, kw = inputs("nt_xent", n, 64, BF16)
        for _ in range(CALLS):
            step("nt_xent", args, kw)
    assert _graphs.info()["plans"] == 2


@gpu
def test_failed_capture_falls_back(monkeypatch):
    """A call that cannot be captured (here: one that reads a device value on the host) is
    remembered as refused and keeps running uncaptured, with the right result."""
    x = cp.arange(8, dtype=cp.float32)

    def compute(x):
        return (x * float(x.sum()),)  # a device-to-host copy: not capturable

    for _ in range(CALLS + 1):
        (y,) = _graphs.run(("test",), (x,), compute)
        cp.testing.assert_array_equal(y, x * 28.0)
    info = _graphs.info()
    assert info["plans"] == 0 and "capture failed" in next(iter(info["refused"].values()))


@gpu
def test_estimated_large_problem_runs_uncaptured(monkeypatch):
    """``est_bytes`` past MAX_PLAN_BYTES: every call runs ``compute``, nothing is counted,
    captured or refused (no key built); CLIP's float32 calls pass their score block, NT-Xent's
    fused calls their gradient block."""
    x = cp.arange(8, dtype=cp.float32)
    ran = []

    def compute(x):
        ran.append(1)
        return (x * 2,)

    for _ in range(CALLS + 1):
        (y,) = _graphs.run(("test",), (x,), compute, est_bytes=_graphs.MAX_PLAN_BYTES + 1)
        cp.testing.assert_array_equal(y, x * 2)
    info = _graphs.info()
    assert len(ran) == CALLS + 1
    assert info["plans"] == 0 and info["counting"] == 0 and not info["refused"]
    rng = np.random.default_rng(0)
    a, b = (cp.asarray(rng.standard_normal((64, 32)).astype(np.float32)) for _ in range(2))
    ls = cp.asarray(np.float32(2.0))
    want = plain(lambda: step("clip_loss", (a, b, ls), {}))
    monkeypatch.setattr(_graphs, "MAX_PLAN_BYTES", 64 * 64 * 4 - 1)  # the 64 x 64 scores'
    for _ in range(CALLS):
        assert step("clip_loss", (a, b, ls), {}) == want
    info = _graphs.info()
    assert info["plans"] == 0 and info["counting"] == 0 and not info["refused"]
    # NT-Xent's fused calls pass their gradient block + accumulator (16-bit: 256² · 2 +
    # 256 · 64 · 4 bytes here); one byte more of room and the call is captured
    args, kw = inputs("nt_xent", 256, 64, BF16)
    want = plain(lambda: step("nt_xent", args, kw))
    est = 256 * 256 * 2 + 256 * 64 * 4
    monkeypatch.setattr(_graphs, "MAX_PLAN_BYTES", est - 1)
    for _ in range(CALLS):
        assert step("nt_xent", args, kw) == want
    info = _graphs.info()
    assert info["plans"] == 0 and info["counting"] == 0 and not info["refused"]
    monkeypatch.setattr(_graphs, "MAX_PLAN_BYTES", 1 << 30)
    for _ in range(CALLS):
        assert step("nt_xent", args, kw) == want
    assert _graphs.info()["plans"] == 1


@gpu
def test_torch_bridge_replays_bit_identically():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    import cupynce.torch as ct

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 128, generator=g, device="cuda").bfloat16().requires_grad_()
    b = torch.randn(512, 128, generator=g, device="cuda").bfloat16().requires_grad_()
    ls = torch.tensor(2.5, device="cuda", requires_grad=True)

    def run():
        loss = ct.clip_loss(a, b, ls)
        return [loss.detach().clone()] + list(torch.autograd.grad(loss * 0.5, (a, b, ls)))

    want = plain(run)
    before = torch.cuda.memory_allocated()
    for _ in range(CALLS):
        got = run()
        for x, y in zip(got, want):
            assert torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8)
                               if y.dim() else y)
    assert _graphs.info()["plans"] == 1
    # the plan's static buffers come from torch's caching allocator
    assert torch.cuda.memory_allocated() - before >= _graphs.info()["bytes"] > 0


@gpu
def test_calls_inside_a_callers_capture_run_plainly():
    """Inside the caller's own stream capture (torch.cuda.graph, a CuPy capture) nothing is
    captured or replayed by cupynce: the work goes into the caller's graph as plain kernels."""
    x = cp.arange(8, dtype=cp.float32)
    outs = []
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        for _ in range(CALLS + 1):
            outs.append(_graphs.run(("test",), (x,), lambda x: (x * 2,))[0])
        graph = s.end_capture()
    assert _graphs.info()["plans"] == 0 and not _graphs.info()["counting"]
    graph.launch(s)
    s.synchronize()
    for y in outs:
        cp.testing.assert_array_equal(y, x * 2)


@gpu
def test_per_thread_default_streams_have_their_own_plans():
    """cudaStreamPerThread is one handle value for a different stream in each thread."""
    x = cp.arange(8, dtype=cp.float32)
    errors = []

    def worker():
        try:
            with cp.cuda.Stream.ptds:
                for _ in range(CALLS):
                    (y,) = _graphs.run(("test",), (x,), lambda x: (x * 3,))
                cp.cuda.Stream.ptds.synchronize()
                if not bool((y == x * 3).all()):
                    errors.append("wrong values")
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    _run_threads([worker, worker])
    assert not errors, errors
    assert _graphs.info()["plans"] == 2


@gpu
def test_out_of_memory_during_capture_is_not_remembered():
    """Running out of memory while capturing falls back without refusing the problem for
    good: it is counted again and captured later."""
    x = cp.arange(8, dtype=cp.float32)

    class OutOfMemoryError(Exception):
        pass

    fail = [True]

    def compute(x):
        if fail[0] and cp.cuda.get_current_stream().is_capturing():
            raise OutOfMemoryError("out of memory (planted)")
        return (x + 1,)

    for _ in range(CALLS):
        (y,) = _graphs.run(("test",), (x,), compute)
        cp.testing.assert_array_equal(y, x + 1)
    assert _graphs.info()["plans"] == 0 and not _graphs.info()["refused"]
    fail[0] = False
    for _ in range(CALLS):
        (y,) = _graphs.run(("test",), (x,), compute)
        cp.testing.assert_array_equal(y, x + 1)
    assert _graphs.info()["plans"] == 1
