"""cupynce.torch.GradientCache: gradient caching around the fused losses.

On the CPU in float64 (CI): the cached loss and parameter gradients equal the uncached step's
to 1e-12 relative (the chunks change only the order of the encoder's sums); with dropout on,
they equal a chunk-by-chunk forward with a graph under the same random stream (the replay
draws the first pass's masks) and the caller's generator ends where that forward leaves it;
the backward re-embeds under the first pass's autocast state; GradScaler and a
``torch.compile`` d encoder give the same gradients; bad input raises before any encoder runs; across 2 and 3 gloo processes under DDP, one process's uncached step on the
concatenated batch, with one all-reduce per step.  Marked ``gpu``: the same on CUDA in float64,
and CUDA dropout replayed.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import cupynce.torch as ct  # noqa: E402
from cupynce.torch import GradientCache  # noqa: E402

F64 = dict(rtol=1e-12, atol=1e-14)


def _encoder(seed=0, d_in=8, d=6, p=0.0, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, 16), torch.nn.Dropout(p), torch.nn.Tanh(),
                               torch.nn.Linear(16, d)).double().to(device)


def _batch(n=37, d_in=8, cols=2, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d_in, generator=g, dtype=torch.float64).to(device)
            for _ in range(cols)]


def _grads(params):
    out = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


def _close(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, **F64, msg=lambda m: f"{what} [{i}]: {m}")


LOSSES = {
    "info_nce": lambda: (lambda q, k: ct.info_nce(q, k, 0.1, normalize=True), ()),
    "info_nce_negatives": lambda: (lambda q, k, neg: ct.info_nce(q, k, 0.2, negatives=neg,
                                                                  normalize=True), ()),
    "nt_xent": lambda: (lambda a, b: ct.nt_xent(torch.cat([a, b]), 0.3, normalize=True), ()),
    "clip": lambda: (lambda m: (m, tuple(m.parameters())))(ct.ClipLoss(0.07).double()),
    "siglip_sum": lambda: (lambda a, b: ct.siglip_loss(a, b, 2.3, -5.0, reduction="sum"), ()),
}


@pytest.mark.parametrize("chunk", [1, 7, 37, 100])
@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_cached_equals_uncached(loss_name, chunk):
    loss_fn, extra = LOSSES[loss_name]()
    cols = 3 if loss_name == "info_nce_negatives" else 2
    enc = _encoder()
    xs = _batch(cols=cols)
    params = list(enc.parameters()) + list(extra)
    want = loss_fn(*[enc(x) for x in xs])
    want.backward()
    g_want = _grads(params)
    got = GradientCache(enc, loss_fn, chunk)(*xs)
    torch.testing.assert_close(got.detach(), want.detach(), **F64)
    got.backward()
    _close(_grads(params), g_want, f"{loss_name} chunk={chunk}")


def test_one_encoder_per_column_dict_columns_and_ranges():
    """Two towers (CLIP's image and text), dict columns (a tensor sliced, a string passed
    through), the caller's uneven ranges; an upstream gradient of 3 (GradScaler's scale)
    reaches every chunk."""
    a_enc, b_enc = _encoder(0), _encoder(1, d_in=5)
    head = ct.ClipLoss(0.05).double()
    xa, = _batch(cols=1)
    xb, = _batch(d_in=5, cols=1, seed=2)
    params = [*a_enc.parameters(), *b_enc.parameters(), *head.parameters()]
    (3 * head(a_enc(xa), b_enc(xb))).backward()
    g_want = _grads(params)

    def tower_b(f):
        assert f["name"] == "text"
        return b_enc(f["x"])

    cache = GradientCache([a_enc, tower_b], head, 10)
    loss = cache(xa, {"x": xb, "name": "text"},
                 ranges=[[(0, 5), (5, 30), (30, 37)], [(0, 37)]])
    (3 * loss).backward()
    _close(_grads(params), g_want, "two towers")


def test_padding_positions_dropped_per_chunk():
    """A dict column with an attention mask: each chunk is cut after its last used position
    (every tensor of that width), and the embeddings are the same as at the full width."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(20, 6).double()
    ids = torch.randint(1, 20, (6, 9))
    mask = torch.zeros(6, 9, dtype=torch.long)
    for i, length in enumerate([2, 3, 9, 4, 1, 2]):
        mask[i, :length] = 1
    widths = []

    def mean_pool(f):
        widths.append(f["input_ids"].shape[1])
        m = f["attention_mask"].unsqueeze(-1).double()
        return (emb(f["input_ids"]) * m).sum(1) / m.sum(1)

    feats = {"input_ids": ids, "attention_mask": mask}
    full = mean_pool(feats)
    widths.clear()
    loss = GradientCache(mean_pool, lambda a, b: ct.info_nce(a, b, 0.5), 2)(feats, feats)
    assert widths == [3, 9, 2] * 2  # (chunks 0-1, 2-3, 4-5 of both columns)
    loss.backward()
    assert widths == [3, 9, 2] * 4
    torch.testing.assert_close(loss.detach(), ct.info_nce(full, full, 0.5).detach(), **F64)


def _chunkwise_reference(enc, xs, chunk, loss_fn):
    """A forward with a graph, chunk by chunk in the cache's order (column by column): the
    random stream the cache's first pass draws, so the same dropout masks."""
    embs = [torch.cat([enc(x[b:b + chunk]) for b in range(0, x.shape[0], chunk)]) for x in xs]
    return loss_fn(*embs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dropout_masks_replay(device):
    enc = _encoder(p=0.3, device=device)
    xs = _batch(device=device)
    loss_fn = LOSSES["info_nce"]()[0]
    params = list(enc.parameters())
    torch.manual_seed(123)
    want = _chunkwise_reference(enc, xs, 8, loss_fn)
    after = (torch.get_rng_state(), torch.cuda.get_rng_state() if device == "cuda" else None)
    want.backward()
    g_want = _grads(params)
    torch.manual_seed(123)
    got = GradientCache(enc, loss_fn, 8)(*xs)
    torch.testing.assert_close(got.detach(), want.detach(), **F64)
    got.backward()
    # (the replay runs in a fork of the generators: the caller's stream is where the first
    # pass left it, as after the reference's one forward)
    assert torch.equal(torch.get_rng_state(), after[0])
    if device == "cuda":
        assert torch.equal(torch.cuda.get_rng_state(), after[1])
    _close(_grads(params), g_want, "dropout")
    # and the masks matter: another seed gives other gradients
    torch.manual_seed(124)
    GradientCache(enc, loss_fn, 8)(*xs).backward()
    assert not torch.allclose(_grads(params)[0], g_want[0])


def test_backward_outside_autocast_replays_under_it():
    """PyTorch's AMP recipe: the forward under autocast, ``backward()`` outside it. The
    re-embedding runs under the first pass's autocast state (bf16 here), not in float32."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 6)
    seen = []

    def enc(x):
        out = lin(x)
        seen.append((torch.is_grad_enabled(), out.dtype))
        return out

    x = torch.randn(12, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = GradientCache(enc, lambda a, b: ct.info_nce(a, b, 0.1, normalize=True), 5)(x, x)
    loss.backward()
    assert seen == [(False, torch.bfloat16)] * 6 + [(True, torch.bfloat16)] * 6
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32


def test_grad_scaler_and_a_compiled_encoder():
    """``scaler.scale(loss).backward()`` then ``unscale_``: the uncached step's gradients; an
    encoder under ``torch.compile`` (aot_eager: dynamo and AOT autograd, no C++ build) too."""
    loss_fn = LOSSES["info_nce"]()[0]
    xs = _batch()
    enc = _encoder()
    params = list(enc.parameters())
    loss_fn(*[enc(x) for x in xs]).backward()
    g_want = _grads(params)
    opt = torch.optim.SGD(params, lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(GradientCache(enc, loss_fn, 9)(*xs)).backward()
    scaler.unscale_(opt)
    _close(_grads(params), g_want, "GradScaler")
    compiled = torch.compile(enc, backend="aot_eager", dynamic=True)
    GradientCache(compiled, loss_fn, 9)(*xs).backward()
    _close(_grads(params), g_want, "torch.compile")


def test_evaluation_runs_in_chunks_and_keeps_nothing():
    """Grad mode off: the columns embedded chunk by chunk (4 chunks of at most 10 rows each),
    the loss of the whole batch, no graph and no random state kept."""
    enc = _encoder()
    xs = _batch()
    loss_fn = LOSSES["info_nce"]()[0]
    rows = []

    def counting(x):
        rows.append(x.shape[0])
        return enc(x)

    with torch.no_grad():
        want = loss_fn(*[enc(x) for x in xs])
        before = torch.get_rng_state()
        got = GradientCache(counting, loss_fn, 10)(*xs)
    assert rows == [10, 10, 10, 7] * 2
    assert not got.requires_grad and got.grad_fn is None
    assert torch.equal(torch.get_rng_state(), before)
    torch.testing.assert_close(got, want, **F64)


def test_the_loss_runs_without_cuda_graphs():
    """The loss (once a step) runs in ``config.scope(graphs=False)``, in training and in
    evaluation; the caller's configuration is untouched before and after."""
    import cupynce.config as cfg

    enc = _encoder()
    loss_fn = LOSSES["info_nce"]()[0]
    seen = []

    def spying(*e):
        seen.append(cfg.current().graphs)
        return loss_fn(*e)

    before = cfg.current()
    with cfg.override(graphs=True):
        GradientCache(enc, spying, 10)(*_batch()).backward()
        with torch.no_grad():
            GradientCache(enc, spying, 10)(*_batch())
        assert cfg.current().graphs
    assert seen == [False, False] and cfg.current() is before


def test_double_backward_is_refused():
    enc = _encoder()
    loss = GradientCache(enc, LOSSES["info_nce"]()[0], 10)(*_batch())
    with pytest.raises(RuntimeError):
        torch.autograd.grad(loss, list(enc.parameters()), create_graph=True)


def test_bad_input_raises_before_any_encoder_runs():
    calls = []

    def enc(x):
        calls.append(1)
        return x[:, :4]

    loss_fn = LOSSES["info_nce"]()[0]
    x = torch.randn(10, 6, dtype=torch.float64)
    for bad in (0, -3, 1.5, True, None):
        with pytest.raises(ValueError, match=rf"chunk_size must be an int >= 1, got {bad!r}"):
            GradientCache(enc, loss_fn, bad)
    with pytest.raises(TypeError, match="an encoder must be an nn.Module or a callable"):
        GradientCache([enc, 3], loss_fn, 4)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        GradientCache(enc, "info_nce", 4)
    with pytest.raises(TypeError, match="ddp= takes DistributedDataParallel"):
        GradientCache(enc, loss_fn, 4, ddp=[torch.nn.Linear(2, 2)])
    cache = GradientCache(enc, loss_fn, 4)
    cases = [
        (ValueError, r"different batch sizes \[10, 9\]", (x, x[:9]), {}),
        (TypeError, "column 1 is a list; expected a tensor or a dict", (x, ["a"] * 10), {}),
        (TypeError, "column 0 is a dict without tensors", ({"text": "a"}, x), {}),
        (ValueError, r"column 0's tensors disagree on the batch size",
         ({"a": x, "b": x[:3]}, x), {}),
        (ValueError, "no columns given", (), {}),
        (ValueError, r"ranges\[1\] = \[\(0, 4\), \(5, 10\)\] must cover rows 0..10",
         (x, x), dict(ranges=[[(0, 10)], [(0, 4), (5, 10)]])),
        (ValueError, "ranges has 1 entries for 2 columns", (x, x), dict(ranges=[[(0, 10)]])),
    ]
    for exc, match, cols, kw in cases:
        with pytest.raises(exc, match=match):
            cache(*cols, **kw)
    with pytest.raises(ValueError, match="2 encoders for 3 columns"):
        GradientCache([enc, enc], loss_fn, 4)(x, x, x)
    assert not calls
    with pytest.raises(ValueError, match=r"encoder 0 returned shape \(4, 2, 2\) for a chunk of "
                                         r"4 rows of column 0; expected a 2-D tensor \(4, D\)"):
        GradientCache(lambda t: t[:, :4].reshape(-1, 2, 2), loss_fn, 4)(x, x)
    with pytest.raises(ValueError, match=r"encoder 0 returned dict"):
        GradientCache(lambda t: {"e": t}, loss_fn, 4)(x, x)
    with pytest.raises(ValueError, match="loss_fn returned shape"):
        GradientCache(enc, lambda a, b: ct.info_nce(a, b, 0.1, reduction="none"), 4)(x, x)


def test_unused_columns_graphs_and_empty_batches_are_refused():
    enc = _encoder()
    x, y = _batch()
    with pytest.raises(ValueError, match=r"the loss does not use column\(s\) \[1\]"):
        GradientCache(enc, lambda a, b: ct.info_nce(a, a, 0.1), 8)(x, y)
    w = torch.ones(8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="column 1 carries a graph"):
        GradientCache(enc, LOSSES["info_nce"]()[0], 8)(x, y * w)
    with pytest.raises(ValueError, match=r"the batch is empty \(0 rows\)"):
        GradientCache(enc, LOSSES["info_nce"]()[0], 8)(x[:0], y[:0])
    sizes = iter([6, 6, 5])
    with pytest.raises(ValueError, match="returned embeddings of different widths 6 and 5"):
        GradientCache(lambda t: enc(t)[:, :next(sizes)], LOSSES["info_nce"]()[0], 16)(x, y)


def test_a_non_deterministic_encoder_is_named_in_the_backward():
    sizes = iter([4, 4, 2, 4, 4, 2, 3])  # (the replay's first chunk comes back with 3 rows)

    def enc(x):
        return torch.randn(next(sizes), 5, dtype=torch.float64) + 0 * x[:1, :1].sum()

    x = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    loss = GradientCache(enc, LOSSES["info_nce"]()[0], 4)(x, x)
    with pytest.raises(RuntimeError, match=r"column [01], chunk 0: the re-embedding gave shape "
                                           r"\(3, 5\) where the first pass gave \(4, 5\)"):
        loss.backward()


# ---- across processes (gloo; DDP) -----------------------------------------------------------
def _counting(model, world):
    """DDP ``model`` with a comm hook that counts its all-reduces (of the mean, as DDP's)."""
    import torch.distributed as dist

    calls = []

    def hook(state, bucket):
        calls.append(1)
        work = dist.all_reduce(bucket.buffer() / world, async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(None, hook)
    return calls


def check_grad_cache_ddp(rank, world):
    """Each rank's DDP step through the cache with the global loss equals one process's
    uncached step on the concatenated batch: one DDP encoder for both columns, two DDP towers
    (CLIP's), ranks that chunk differently, and a second backward of a retained graph; every
    module all-reduces once per backward."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = dist.group.WORLD
    n = 5
    xs = _batch(n=n * world, seed=3)
    mine = [x[rank * n:(rank + 1) * n] for x in xs]
    single = _encoder(7)
    model = DDP(_encoder(7))
    syncs = _counting(model, world)
    uneven = [[(0, 1), (1, 5)], [(0, 3), (3, 5)]] if rank == 0 else None  # (token budgets)
    for name, local, glob, ranges in [
            ("info_nce", lambda q, k: ct.info_nce(q, k, 0.2, normalize=True, group=g),
             lambda q, k: ct.info_nce(q, k, 0.2, normalize=True), None),
            ("nt_xent", lambda a, b: ct.nt_xent(torch.cat([a, b]), 0.3, group=g),
             lambda a, b: ct.nt_xent(torch.cat([a, b]), 0.3), None),
            ("uneven chunks", lambda q, k: ct.info_nce(q, k, 0.2, group=g),
             lambda q, k: ct.info_nce(q, k, 0.2), uneven)]:
        syncs.clear()
        loss = GradientCache(model, local, 2, group=g)(*mine, ranges=ranges)
        loss.backward()
        assert len(syncs) == 1, (name, len(syncs))
        want = glob(*[single(x) for x in xs])
        want.backward()
        torch.testing.assert_close(loss.detach(), want.detach(), **F64)
        _close(_grads(list(model.module.parameters())), _grads(list(single.parameters())),
               f"{name} rank {rank}")
    # a retained graph, backpropagated twice: two all-reduces, twice the gradient
    syncs.clear()
    loss = GradientCache(model, LOSSES["info_nce"]()[0], 2, group=g)(*mine)
    loss.backward(retain_graph=True)
    loss.backward()
    assert len(syncs) == 2, len(syncs)
    once = [p.grad.clone() / 2 for p in model.module.parameters()]
    _grads(list(model.module.parameters()))
    GradientCache(model, LOSSES["info_nce"]()[0], 2, group=g)(*mine).backward()
    _close(_grads(list(model.module.parameters())), once, "retain_graph")
    # two towers, two DDP modules: each all-reduced once, at its own last chunk
    a_single, b_single = _encoder(8), _encoder(9)
    a_ddp, b_ddp = DDP(_encoder(8)), DDP(_encoder(9))
    a_syncs, b_syncs = _counting(a_ddp, world), _counting(b_ddp, world)
    head = ct.ClipLoss(0.07, group=g).double()
    head_single = ct.ClipLoss(0.07).double()
    loss = GradientCache([a_ddp, b_ddp], head, 2, group=g)(*mine)
    loss.backward()
    assert (len(a_syncs), len(b_syncs)) == (1, 1), (len(a_syncs), len(b_syncs))
    head_single(a_single(xs[0]), b_single(xs[1])).backward()
    _close(_grads(list(a_ddp.module.parameters()) + list(b_ddp.module.parameters())),
           _grads(list(a_single.parameters()) + list(b_single.parameters())),
           f"two towers rank {rank}")
    with pytest.raises(NotImplementedError, match=r"static_graph=True\) is not supported"):
        GradientCache(DDP(_encoder(7), static_graph=True), LOSSES["info_nce"]()[0], 2,
                      group=g)(*mine)


def check_grad_cache_bad_rank_raises_everywhere(rank, world):
    """One rank's short column, its wrong encoder output or its encoder's exception: every
    rank raises, none hangs."""
    import torch.distributed as dist

    g = dist.group.WORLD
    x = torch.randn(6, 4, dtype=torch.float64)
    loss_fn = LOSSES["info_nce"]()[0]
    cols = (x, x[:5]) if rank == world - 1 else (x, x)
    with pytest.raises(ValueError, match=f"rank {world - 1} failed its checks|different batch"):
        GradientCache(lambda t: t, loss_fn, 4, group=g)(*cols)
    enc = (lambda t: t[:, None]) if rank == 0 else (lambda t: t)
    with pytest.raises(ValueError, match="rank 0 failed embedding its chunks|encoder 0 "
                                         "returned"):
        GradientCache(enc, loss_fn, 4, group=g)(x, x)

    def fails(t):
        if rank == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return t

    with pytest.raises((ValueError, RuntimeError), match="out of memory"):
        GradientCache(fails, loss_fn, 4, group=g)(x, x)


@pytest.mark.parametrize("world", [2, 3])
def test_grad_cache_over_gloo(world):
    from test_torch_distributed import run_ranks

    run_ranks(world, ["check_grad_cache_ddp", "check_grad_cache_bad_rank_raises_everywhere"],
              module="test_grad_cache")
