"""GPU tests of ``cupynce.torch``'s replays straight from tensors (``cupynce.torch._fast``).

The contract is ``tests/engine/test_graphs.py``'s, through the bridge: once a direct call is
learnt, its forward + backward give the same bits as the same call with graphs off, for every
op, dtype and flag; arguments are read afresh; what a call returns is its own; calls whose
arguments the entry cannot take (misaligned, sharing memory where the learnt call did not,
on another stream) still give the plain bits.
"""
from __future__ import annotations

import pytest

from cupynce.ops import _graphs

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs torch with CUDA", allow_module_level=True)
pytest.importorskip("cupy")

import cupynce.torch as ct  # noqa: E402
from cupynce.torch import _fast  # noqa: E402
from test_graphs import plain  # noqa: E402  (fn() with graphs off)

CALLS = _graphs.CAPTURE_AFTER + 4  # plain calls, the capture (learnt), then replays


@pytest.fixture(autouse=True)
def fresh(configure):
    configure(graphs=True)
    _graphs.clear()
    _fast.clear()
    yield
    _graphs.clear()
    _fast.clear()


def leaves(op, n, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mat(rows):
        return torch.randn(rows, d, generator=g, device="cuda").to(dtype).requires_grad_()

    if op == "nt_xent":
        return [mat(n)]
    if op == "info_nce":
        return [mat(n), mat(n)]
    if op == "info_nce_neg":
        return [mat(n), mat(n), mat(n // 2)]
    if op == "clip_loss":
        return [mat(n), mat(n), torch.tensor(2.3, device="cuda", requires_grad=True)]
    if op == "siglip_loss":
        return [mat(n), mat(n), torch.tensor(2.3, device="cuda", requires_grad=True),
                torch.tensor(-10.0, device="cuda", requires_grad=True)]
    return [mat(n), mat(n)]  # clip_loss with a float logit_scale


def loss_fn(op, normalize=False, reduction="mean"):
    kw = dict(normalize=normalize, reduction=reduction)
    return {"nt_xent": lambda z: ct.nt_xent(z, 0.2, **kw),
            "info_nce": lambda q, k: ct.info_nce(q, k, 0.1, **kw),
            "info_nce_neg": lambda q, k, n: ct.info_nce(q, k, 0.1, negatives=n, **kw),
            "clip_loss": lambda a, b, s: ct.clip_loss(a, b, s, **kw),
            "clip_float": lambda a, b: ct.clip_loss(a, b, 2.7, **kw),
            "siglip_loss": lambda a, b, s, c: ct.siglip_loss(a, b, s, c, **kw)}[op]


def step(fn, xs, scale=0.75):
    """The loss and the gradients for a non-unit upstream gradient, as bytes."""
    loss = fn(*xs)
    grads = torch.autograd.grad(loss * scale, xs)
    return [bytes(t.detach().reshape(-1).view(torch.uint8).cpu().numpy())
            for t in (loss,) + grads]


OPS = ["nt_xent", "info_nce", "info_nce_neg", "clip_loss", "clip_float", "siglip_loss"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float64], ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("normalize", [False, True])
def test_fast_replay_is_bit_identical(op, dtype, normalize):
    xs = leaves(op, 256, 64, dtype)
    fn = loss_fn(op, normalize)
    want = plain(lambda: step(fn, xs))
    for i in range(CALLS):
        assert step(fn, xs) == want, f"call {i + 1}"
    info = _fast.info()
    assert info["learnt"] == 1 and info["hits"] >= CALLS - _graphs.CAPTURE_AFTER - 1, info


@pytest.mark.parametrize("op", OPS)
def test_arguments_read_afresh_and_outputs_kept(op):
    xs = leaves(op, 384, 128, torch.bfloat16)
    fn = loss_fn(op)
    for _ in range(CALLS):
        step(fn, xs)
    assert _fast.info()["hits"] > 0
    kept = fn(*xs)
    first = kept.detach().clone()
    with torch.no_grad():
        for x in xs:
            x.mul_(0.5)
    want = plain(lambda: step(fn, xs))
    hits = _fast.info()["hits"]
    assert step(fn, xs) == want
    assert _fast.info()["hits"] == hits + 1
    assert torch.equal(kept.detach(), first)  # a later call did not touch it


def test_entries_do_not_keep_evicted_plans():
    xs = leaves("clip_loss", 256, 64, torch.float32)
    fn = loss_fn("clip_loss")
    want = plain(lambda: step(fn, xs))
    for _ in range(CALLS):
        step(fn, xs)
    _graphs.clear()  # the entry's plan is gone: plain calls, a new capture, a new entry
    for i in range(CALLS):
        assert step(fn, xs) == want, f"call {i + 1}"
    assert _fast.info()["learnt"] == 2


def test_misaligned_and_shared_arguments_take_the_plain_path():
    g = torch.Generator(device="cuda").manual_seed(3)
    buf = torch.randn(257 * 64 + 1, generator=g, device="cuda").bfloat16()
    fn = loss_fn("info_nce")
    q, k = leaves("info_nce", 256, 64, torch.bfloat16)
    for _ in range(CALLS):
        step(fn, [q, k])
    hits = _fast.info()["hits"]
    # q 2 bytes past a 16-byte boundary: same key, but no replay of it
    q2 = buf[1:1 + 256 * 64].view(256, 64).detach().requires_grad_()
    assert q2.data_ptr() % 16
    assert step(fn, [q2, k]) == plain(lambda: step(fn, [q2, k]))
    # the same tensor twice (learnt with two): copied in twice, still the plain bits
    assert step(fn, [q, q]) == plain(lambda: step(fn, [q, q]))
    assert _fast.info()["hits"] == hits + 1


def test_streams_have_their_own_entries():
    xs = leaves("nt_xent", 256, 64, torch.float32)
    fn = loss_fn("nt_xent")
    want = plain(lambda: step(fn, xs))
    s = torch.cuda.Stream()
    for _ in range(CALLS):
        assert step(fn, xs) == want
        with torch.cuda.stream(s):
            got = step(fn, xs)
        assert got == want
    assert _fast.info()["learnt"] == 2


def test_inside_a_callers_capture_nothing_is_replayed():
    xs = leaves("nt_xent", 256, 64, torch.float32)
    z = xs[0]
    for _ in range(CALLS):
        step(loss_fn("nt_xent"), xs)
    hits = _fast.info()["hits"]
    static = z.detach().clone()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # (warm-up on the side stream, as torch's docs do)
        ct.nt_xent(static, 0.2)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        out = ct.nt_xent(static, 0.2)
    graph.replay()
    torch.cuda.synchronize()
    assert _fast.info()["hits"] == hits
    assert torch.equal(out, plain(lambda: ct.nt_xent(static, 0.2)))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_calls_without_gradient_replay_from_tensors(op, reduction):
    """Evaluation calls (no_grad, or nothing requiring a gradient) run the loss alone, learnt
    and replayed from the tensors too: graphs-off bits."""
    xs = [x.detach() for x in leaves(op, 256, 64, torch.bfloat16)]
    fn = loss_fn(op, reduction=reduction)

    def run():
        with torch.no_grad():
            return bytes(fn(*xs).reshape(-1).view(torch.uint8).cpu().numpy())

    want = plain(run)
    for i in range(CALLS):
        assert run() == want, f"call {i + 1}"
    info = _fast.info()
    assert info["learnt"] == 1 and info["hits"] >= CALLS - _graphs.CAPTURE_AFTER - 1, info


def test_variants_keep_the_calls_float32_precision():
    """A variant captured on a fast replay (outside the op's precision scope) runs in the
    plan's float32 precision: a TF32 call's products stay TF32."""
    xs = leaves("clip_loss", 512, 128, torch.float32)
    fn = lambda a, b, s: ct.clip_loss(a, b, s, precision="tf32")  # noqa: E731
    want = plain(lambda: step(fn, xs))
    fp32 = plain(lambda: step(lambda a, b, s: ct.clip_loss(a, b, s, precision="fp32"), xs))
    assert fp32 != want  # (else this test could not tell the precisions apart)
    for i in range(CALLS + 2):
        assert step(fn, xs) == want, f"call {i + 1}"
    (plan,) = _graphs._plans.values()
    assert plan.variants and _fast.info()["hits"] > 0
