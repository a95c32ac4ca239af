"""MoCo's queue (issue 55): ``info_nce(in_batch_negatives=False)`` against the plain PyTorch
formula (the positive's logit beside the queue's, cross entropy at 0), ``NegativeQueue``'s
ring, and across ranks the queue gathered at its enqueue (the same on every rank) and taken
once by the loss (``replicated_negatives=True``): equal to one process on the concatenated
batch with the queue once.  NumPy / CPU tensors in float64 (1e-12); CUDA marked ``gpu``
(float32 1e-5, bfloat16 3e-2, relative)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupynce  # noqa: E402
import cupynce.torch as ct  # noqa: E402
from numerics import dtype_of, rel  # noqa: E402


def moco_formula(q, k, queue, temperature, reduction="mean", smoothing=0.0):
    """MoCo's loss as its code writes it: logits [q̂·k̂, q̂ queuêᵀ] / τ, the target 0."""
    qn, kn, un = (torch.nn.functional.normalize(x, dim=1) for x in (q, k, queue))
    logits = torch.cat([(qn * kn).sum(1, keepdim=True), qn @ un.T], 1) / temperature
    return torch.nn.functional.cross_entropy(
        logits, torch.zeros(q.shape[0], dtype=torch.long, device=q.device),
        reduction=reduction, label_smoothing=smoothing)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("m", [10, 4])  # (a queue shorter than the batch: the labelled rows)
def test_numpy_moco_is_the_formula(reduction, eps, m):
    rng = np.random.default_rng(0)
    q, k, u = rng.standard_normal((6, 4)), rng.standard_normal((6, 4)), rng.standard_normal((m, 4))
    loss, ctx = cupynce.info_nce_forward(q, k, 0.2, negatives=u, in_batch_negatives=False,
                                         label_smoothing=eps, reduction=reduction,
                                         normalize=True)
    g = np.linspace(0.5, 1.5, 6) if reduction == "none" else 0.7
    grads = cupynce.info_nce_backward(ctx, g)
    tq, tk, tu = (torch.tensor(x, requires_grad=True) for x in (q, k, u))
    want = moco_formula(tq, tk, tu, 0.2, reduction, eps)
    want.backward(torch.tensor(g) if reduction == "none" else torch.tensor(0.7,
                                                                         dtype=torch.float64))
    assert rel(loss, want.detach().numpy()) <= 1e-12
    for x, t in zip(grads, (tq, tk, tu)):
        assert rel(x, t.grad.numpy()) <= 1e-12
    again = cupynce.info_nce_backward_from_stats(
        q, k, u, ctx.stats[0], g, temperature=0.2, label_smoothing=eps,
        in_batch_negatives=False, reduction=reduction, normalize=True)
    assert rel(again[0], tq.grad.numpy()) <= 1e-12


def test_moco_with_labels_raises():
    q = np.ones((4, 3))
    with pytest.raises(ValueError, match="info_nce: labels= with in_batch_negatives=False"):
        cupynce.info_nce(q, q, 0.1, negatives=q, labels=np.zeros(4, np.int64),
                         in_batch_negatives=False)
    with pytest.raises(TypeError, match="info_nce: in_batch_negatives must be a bool"):
        cupynce.info_nce(q, q, 0.1, in_batch_negatives="no")


@pytest.mark.parametrize("in_batch", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_numpy_negatives_grad_false_drops_only_the_negatives(in_batch, reduction):
    """``negatives_grad=False``: dnegatives None, dq and dk the same bits as with it."""
    rng = np.random.default_rng(2)
    q, k, u = rng.standard_normal((6, 4)), rng.standard_normal((6, 4)), rng.standard_normal((9, 4))
    g = np.linspace(0.5, 1.5, 6) if reduction == "none" else 0.7
    out = []
    for flag in (True, False):
        loss, ctx = cupynce.info_nce_forward(q, k, 0.2, negatives=u, in_batch_negatives=in_batch,
                                             reduction=reduction, normalize=True,
                                             negatives_grad=flag)
        out.append((loss, cupynce.info_nce_backward(ctx, g)))
    (l1, (dq1, dk1, du1)), (l2, (dq2, dk2, du2)) = out
    assert du1 is not None and du2 is None
    np.testing.assert_array_equal(l1, l2)
    np.testing.assert_array_equal(dq1, dq2)
    np.testing.assert_array_equal(dk1, dk2)
    with pytest.raises(TypeError, match="info_nce: negatives_grad must be a bool"):
        cupynce.info_nce_forward(q, k, 0.2, negatives=u, negatives_grad="no")


def test_torch_queue_requiring_grad_gets_it():
    """A queue that requires a gradient gets the formula's (negatives_grad follows
    ``requires_grad``); a detached one leaves q's and k's gradients unchanged."""
    gen = torch.Generator().manual_seed(4)
    q, k, u = (torch.randn(n, 5, generator=gen, dtype=torch.float64, requires_grad=True)
               for n in (8, 8, 12))
    out = ct.info_nce(q, k, 0.3, negatives=u, in_batch_negatives=False, normalize=True)
    got = torch.autograd.grad(out, [q, k, u])
    want = moco_formula(q, k, u, 0.3)
    for g, w in zip(got, torch.autograd.grad(want, [q, k, u])):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-14)
    detached = ct.info_nce(q, k, 0.3, negatives=u.detach(), in_batch_negatives=False,
                           normalize=True)
    for g, w in zip(torch.autograd.grad(detached, [q, k]), got[:2]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["direct", "registered", "compile"])
def test_torch_moco_is_the_formula(path):
    from cupynce.torch import _registry

    gen = torch.Generator().manual_seed(1)
    q, k, u = (torch.randn(n, 5, generator=gen, dtype=torch.float64) for n in (8, 8, 12))
    q.requires_grad_()
    k.requires_grad_()

    def f(q, k):
        return ct.info_nce(q, k, 0.3, negatives=u, in_batch_negatives=False, normalize=True)
    if path == "compile":
        torch._dynamo.reset()
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k)
    elif path == "registered":
        real = _registry.direct
        _registry.direct = lambda *tensors: False
        try:
            out = f(q, k)
        finally:
            _registry.direct = real
    else:
        out = f(q, k)
    got = torch.autograd.grad(out, [q, k])
    q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    want = moco_formula(q2, k2, u, 0.3)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-14)
    for g, w in zip(got, torch.autograd.grad(want, [q2, k2])):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("normalize", [True, False])
def test_enqueue_between_loss_and_backward(normalize):
    """The queue is written in place by the enqueue: the fused forward keeps nothing of a
    detached queue, so enqueueing before backward leaves the gradients as they were."""
    gen = torch.Generator().manual_seed(6)
    q, k = (torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    qu = ct.NegativeQueue(6, 3, dtype=torch.float64)
    qu.enqueue(torch.randn(6, 3, generator=gen, dtype=torch.float64))
    want = torch.autograd.grad(moco_formula(q, k, qu.negatives().clone(), 0.3), [q, k])
    loss = ct.info_nce(q, k, 0.3, negatives=qu.negatives(), in_batch_negatives=False,
                       normalize=normalize)
    if not normalize:
        want = torch.autograd.grad(ct.info_nce(q, k, 0.3, negatives=qu.negatives().clone(),
                                               in_batch_negatives=False), [q, k])
    qu.enqueue(k.detach())
    for g, w in zip(torch.autograd.grad(loss, [q, k]), want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


def test_queue_is_a_ring():
    qu = ct.NegativeQueue(5, 2, dtype=torch.float64)
    assert qu.negatives().shape == (0, 2)
    qu.enqueue(torch.arange(6.0).reshape(3, 2))
    assert qu.negatives().tolist() == [[0, 1], [2, 3], [4, 5]]
    qu.enqueue(torch.arange(6.0, 12.0).reshape(3, 2))  # wraps: rows 3, 4, then 0
    assert qu.count == 5 and qu.position == 1
    assert qu.negatives()[:, 0].tolist() == [10, 2, 4, 6, 8]
    qu.enqueue(torch.arange(100.0, 114.0).reshape(7, 2))  # more than it holds: the last 5
    assert qu.negatives()[:, 0].tolist() == [104, 106, 108, 110, 112] and qu.position == 0
    state = qu.state_dict()
    other = ct.NegativeQueue(5, 2, dtype=torch.float64)
    other.load_state_dict(state)
    assert other.count == 5 and torch.equal(other.negatives(), qu.negatives())
    assert not qu.negatives().requires_grad
    with pytest.raises(ValueError, match=r"NegativeQueue.enqueue: keys must be a tensor of "
                                         r"shape \(n, 2\)"):
        qu.enqueue(torch.ones(3, 4))
    with pytest.raises(ValueError, match="NegativeQueue: size must be a positive int"):
        ct.NegativeQueue(0, 2)


def check_queue_across_ranks(rank, world):
    """MoCo across ranks: each rank's queries and keys, one queue enqueued with the group (the
    same on every rank), the loss with the queue once: equal to one process on the
    concatenated batch against that queue; world times its query/key gradients."""
    import torch.distributed as dist

    n, dim = 3, 4
    group = dist.group.WORLD
    qu = ct.NegativeQueue(2 * n * world + 1, dim, dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    for step in range(3):
        Q, K = (torch.randn(n * world, dim, generator=gen, dtype=torch.float64)
                for _ in range(2))
        mine = slice(rank * n, (rank + 1) * n)
        q, k = Q[mine].clone().requires_grad_(), K[mine].clone().requires_grad_()
        negs = qu.negatives()
        every = [torch.empty_like(negs) for _ in range(world)]
        dist.all_gather(every, negs.contiguous(), group=group)
        assert all(torch.equal(x, negs) for x in every)  # the same queue on every rank
        if negs.shape[0]:
            loss = ct.info_nce(q, k, 0.3, negatives=negs, in_batch_negatives=False,
                               replicated_negatives=True, normalize=True, group=group)
            qs, ks = Q.clone().requires_grad_(), K.clone().requires_grad_()
            want = moco_formula(qs, ks, negs, 0.3)
            loss.backward()
            want.backward()
            torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(q.grad, world * qs.grad[mine], rtol=1e-10, atol=1e-14)
            torch.testing.assert_close(k.grad, world * ks.grad[mine], rtol=1e-10, atol=1e-14)
        qu.enqueue(K[mine], group=group)
        if step == 0:  # every rank's keys, in rank order
            assert torch.equal(qu.negatives(), K)


@pytest.mark.parametrize("world", [2, 3])
def test_queue_across_ranks_over_gloo(world):
    from test_torch_distributed import run_ranks

    run_ranks(world, ["check_queue_across_ranks"], module="test_queue")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_moco_is_the_formula(dtype, tol, reduction):
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    gen = torch.Generator(device="cuda").manual_seed(3)
    dt = getattr(torch, dtype)
    q, k = (torch.randn(512, 64, device="cuda", generator=gen).to(dt).requires_grad_()
            for _ in range(2))
    qu = ct.NegativeQueue(4096, 64, dtype=dt, device="cuda")
    qu.enqueue(torch.randn(4096, 64, device="cuda", generator=gen))
    out = ct.info_nce(q, k, 0.2, negatives=qu.negatives(), in_batch_negatives=False,
                      normalize=True, reduction=reduction)
    up = torch.linspace(0.5, 1.5, 512, device="cuda") if reduction == "none" else None
    gq, gk = torch.autograd.grad(out, [q, k], up)
    q64, k64 = (x.detach().double().requires_grad_() for x in (q, k))
    want = moco_formula(q64, k64, qu.negatives().double(), 0.2, reduction)
    wq, wk = torch.autograd.grad(want, [q64, k64], None if up is None else up.double())
    assert rel(out.detach().double().cpu(), want.detach().cpu()) <= tol
    assert rel(gq.double().cpu(), wq.cpu()) <= tol
    assert rel(gk.double().cpu(), wk.cpu()) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("ws", [None, 1 << 20], ids=["one_block", "row_blocks"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_negatives_grad_false_skips_the_queue_product(dtype, ws, monkeypatch):
    """The score tiles skip Gᵀ q̂ for a detached queue (spied: col_grads False, no dk, over one
    block and over several row blocks): dq and dk keep their bits, and the queue's gradient
    (asked for) is the float64 formula's."""
    cp = pytest.importorskip("cupy")
    from cupynce._engine.losses import score_tiles

    seen = []
    real = score_tiles.rows

    def spy(*a, **kw):
        out = real(*a, **kw)
        if kw.get("want_grad"):
            seen.append((kw.get("col_grads", True), out[2][1] is None))
        return out
    monkeypatch.setattr(score_tiles, "rows", spy)
    rng = np.random.default_rng(5)
    n, m, d = 512, 4096, 64
    q, k, u = (cp.asarray(rng.standard_normal(s).astype(dtype_of(dtype)))
               for s in ((n, d), (n, d), (m, d)))
    got = []
    with cupynce.config.scope(graphs=False):  # (each call runs the engine: the spy sees it)
        for flag in (True, False):
            loss, ctx = cupynce.info_nce_forward(q, k, 0.2, negatives=u,
                                                 in_batch_negatives=False, normalize=True,
                                                 negatives_grad=flag, workspace_bytes=ws)
            got.append((loss, cupynce.info_nce_backward(ctx, 1.0)))
    if not seen:
        pytest.skip("the score tiles do not run here (config.tiles / not Hopper)")
    assert seen == [(True, False), (False, True)], seen
    (l1, (dq1, dk1, du1)), (l2, (dq2, dk2, du2)) = got
    assert du2 is None
    for a, b in ((l1, l2), (dq1, dq2), (dk1, dk2)):
        assert cp.asnumpy(a).tobytes() == cp.asnumpy(b).tobytes()
    tq, tk, tu = (torch.tensor(cp.asnumpy(x).astype(np.float64), requires_grad=True)
                  for x in (q, k, u))
    want = moco_formula(tq, tk, tu, 0.2)
    wu = torch.autograd.grad(want, [tu])[0]
    assert rel(cp.asnumpy(du1).astype(np.float64), wu.numpy()) <= 3e-2
