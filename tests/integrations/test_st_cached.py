"""cupynce.integrations.sentence_transformers' cached losses against the library's.

A one-layer BERT SentenceTransformer (D = 16, mean pooling) built offline, float64, on the CPU:
``CachedMultipleNegativesRankingLoss`` / ``CachedMultipleNegativesSymmetricRankingLoss``
give the loss and parameter gradients of the library's cached class *and* of its uncached
class to 1e-9 relative (dropout off); with dropout on, the library's cached class's (both
chunk the same way and draw the same random stream); ``mini_batch_num_tokens`` packs as the
library does; two ``SentenceTransformerTrainer`` steps give the library's losses and weights;
unsupported options raise naming them; over gloo (2 processes, DDP, ``gather_across_devices``)
the parameter gradients are one process's on the whole batch, also under bf16 autocast (the
ranks' loss in the dtype one process's takes). Marked ``gpu``: the same model on CUDA in float32 and
under bf16 autocast, within 2x the library's own error against its float64 run.

Against the library's cached classes only from sentence-transformers 6.2 (the pinned version):
on 6.0.1 their float64 gradients are up to 3e-6 (relative) away from ours, so there the tests
compare with the library's uncached classes alone and say so.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ST = pytest.importorskip("sentence_transformers.sentence_transformer.losses",
                         reason="sentence-transformers is not installed")

from cupynce.integrations import sentence_transformers as c_st  # noqa: E402

#: The library's cached classes are compared with ours from the pinned version (6.2) on: the
#: GPU machine's 6.0.1 cached classes give float64 gradients up to 3e-6 (relative) away from
#: ours, so there only the comparison with the library's uncached classes runs.
_LIB_VERSION = __import__("sentence_transformers").__version__
LIB_CACHED_COMPARABLE = tuple(int(x) for x in _LIB_VERSION.split(".")[:2]) >= (6, 2)
_OLD_LIB = (f"sentence-transformers {_LIB_VERSION}: its cached classes are compared from 6.2 "
            f"on (the test module's docstring says why)")

TOL = dict(rtol=1e-9, atol=1e-12)
WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A one-layer BERT (D = 16) and its tokenizer, saved offline; dropout 0.1 in its config
    (the tests switch it off where they want a deterministic model)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    d = tmp_path_factory.mktemp("bert")
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                           + WORDS))
    BertTokenizerFast(vocab_file=str(d / "vocab.txt")).save_pretrained(str(d))
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=16, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=64,
                     hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    BertModel(cfg).save_pretrained(str(d))
    return str(d)


def _model(path, dropout: bool, device="cpu", dtype=torch.float64):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    t = Transformer(path)
    m = SentenceTransformer(modules=[t, Pooling(16, "mean")], device=device).to(dtype)
    m.train(dropout)
    if not dropout:
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
    return m


def _texts(n, seed, lo=1, hi=12):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(lo, hi)))) for _ in range(n)]


def _features(model, cols, n=11):
    return [dict(model.tokenize(_texts(n, seed=10 + c))) for c in range(cols)]


def _step(model, loss, feats, seed=0):
    """(loss value, parameter gradients) of one forward + backward from a fixed seed."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = loss([dict(f) for f in feats], None)
    out.backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _same(a, b, what):
    torch.testing.assert_close(a[0], b[0], **TOL, msg=lambda m: f"{what} loss: {m}")
    assert len(a[1]) == len(b[1]) > 0
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        torch.testing.assert_close(x, y, **TOL, msg=lambda m: f"{what} grad {i}: {m}")


PAIRS = {
    "MNRL": (ST.CachedMultipleNegativesRankingLoss, c_st.CachedMultipleNegativesRankingLoss,
             ST.MultipleNegativesRankingLoss),
    "MNSRL": (ST.CachedMultipleNegativesSymmetricRankingLoss,
              c_st.CachedMultipleNegativesSymmetricRankingLoss,
              ST.MultipleNegativesSymmetricRankingLoss),
}


@pytest.mark.filterwarnings("ignore:The (Cached)?MultipleNegativesSymmetricRankingLoss")
@pytest.mark.parametrize("name,cols", [("MNRL", 2), ("MNRL", 3), ("MNSRL", 2)])  # (the
@pytest.mark.parametrize("sim", ["cos_sim", "dot_score"])  # library's MNSRL takes pairs only)
@pytest.mark.parametrize("mbs", [3])
def test_cached_equals_the_library_cached_and_uncached(tiny_bert, name, cols, sim, mbs):
    from sentence_transformers import util

    lib_cached, ours, lib_plain = PAIRS[name]
    fn = getattr(util, sim)
    model = _model(tiny_bert, dropout=False)
    feats = _features(model, cols)
    ref = _step(model, lib_plain(model, scale=7.0, similarity_fct=fn), feats)
    got = _step(model, ours(model, scale=7.0, similarity_fct=fn, mini_batch_size=mbs), feats)
    _same(got, ref, f"{name} vs the library's uncached")
    if not LIB_CACHED_COMPARABLE:
        pytest.skip(_OLD_LIB + " (the uncached comparison passed)")
    lib = _step(model, lib_cached(model, scale=7.0, similarity_fct=fn, mini_batch_size=mbs), feats)
    _same(got, lib, f"{name} vs the library's cached")


@pytest.mark.parametrize("mode", ["in_batch_negatives", "hard_negatives", "all_negatives"])
def test_cached_hardness_as_the_library(tiny_bert, mode):
    """hardness_mode / hardness_strength: the cached loss's value and parameter gradients
    as the library's uncached and cached classes' (three columns: hard negatives)."""
    lib_cached, ours, lib_plain = PAIRS["MNRL"]
    model = _model(tiny_bert, dropout=False)
    feats = _features(model, 3)
    kw = dict(scale=7.0, hardness_mode=mode, hardness_strength=5.0)
    ref = _step(model, lib_plain(model, **kw), feats)
    got = _step(model, ours(model, mini_batch_size=4, **kw), feats)
    _same(got, ref, f"{mode} vs the library's uncached")
    if not LIB_CACHED_COMPARABLE:
        pytest.skip(_OLD_LIB + " (the uncached comparison passed)")
    _same(got, _step(model, lib_cached(model, mini_batch_size=4, **kw), feats),
          f"{mode} vs the library's cached")


@pytest.mark.parametrize("budget", [None, 25])
def test_dropout_and_token_budgets_as_the_library(tiny_bert, budget):
    """Dropout on: the re-embedding replays the first pass's masks, and both classes draw the
    same stream over the same mini-batches (``mini_batch_num_tokens`` packed alike)."""
    if not LIB_CACHED_COMPARABLE:
        pytest.skip(_OLD_LIB)
    model = _model(tiny_bert, dropout=True)
    feats = _features(model, 2, n=13)
    kw = dict(scale=20.0, mini_batch_size=4, mini_batch_num_tokens=budget)
    lib = _step(model, ST.CachedMultipleNegativesRankingLoss(model, **kw), feats, seed=3)
    got = _step(model, c_st.CachedMultipleNegativesRankingLoss(model, **kw), feats, seed=3)
    _same(got, lib, f"dropout, budget {budget}")
    other = _step(model, c_st.CachedMultipleNegativesRankingLoss(model, **kw), feats, seed=4)
    assert not torch.allclose(other[1][0], got[1][0])  # (the masks are in play)


def test_evaluation_and_config(tiny_bert):
    model = _model(tiny_bert, dropout=False)
    feats = _features(model, 2)
    loss = c_st.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4,
                                                   mini_batch_num_tokens=30)
    with torch.no_grad():
        want = ST.MultipleNegativesRankingLoss(model)([dict(f) for f in feats], None)
        got = loss([dict(f) for f in feats], None)
    torch.testing.assert_close(got, want, **TOL)
    reps = [[e.detach()[:5].requires_grad_(), e.detach()[5:].requires_grad_()]
            for e in (model(dict(f))["sentence_embedding"] for f in feats)]
    value = loss.calculate_loss(reps, None, with_backward=True)  # (the library's protocol)
    torch.testing.assert_close(value, want, **TOL)
    assert not value.requires_grad and all(r.grad is not None for col in reps for r in col)
    cfg = loss.get_config_dict()
    assert cfg["mini_batch_size"] == 4 and cfg["mini_batch_num_tokens"] == 30
    assert loss.uses_gradient_cache


def test_options_that_are_refused(tiny_bert):
    model = _model(tiny_bert, dropout=False)
    C = c_st.CachedMultipleNegativesRankingLoss
    with pytest.raises(ValueError, match="hardness_mode must be None"):
        C(model, hardness_mode="hardest", hardness_strength=5.0)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=rf"mini_batch_size must be an int >= 1, got {bad!r}"):
            C(model, mini_batch_size=bad)
    with pytest.raises(ValueError, match="mini_batch_num_tokens must be None or an int >= 1"):
        C(model, mini_batch_num_tokens=0)
    with pytest.raises(TypeError, match=r"sentence_features\[1\] is a list"):
        C(model)([dict(model.tokenize(["w1"])), ["w1"]], None)
    with pytest.raises(NotImplementedError, match="inside MatryoshkaLoss is not supported"):
        feats = dict(model.tokenize(["w1 w2", "w3"]))
        ST.MatryoshkaLoss(model, C(model), [16, 8])([feats, dict(feats)], None)
    with pytest.raises(ValueError, match="mini_batch_num_tokens needs the features' 2-D "
                                         "attention_mask"):
        feats = dict(model.tokenize(["w1 w2", "w3"]))
        del feats["attention_mask"]
        C(model, mini_batch_num_tokens=4)([feats, dict(feats)], None)


def test_trainer_two_steps(tiny_bert, tmp_path):
    """SentenceTransformerTrainer, two SGD steps with dropout on, the library's cached class
    and cupynce's: the same training losses and weights."""
    if not LIB_CACHED_COMPARABLE:
        pytest.skip(_OLD_LIB)
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("accelerate")
    from sentence_transformers import (SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)

    rows = _texts(16, seed=1)
    data = datasets.Dataset.from_dict({"anchor": rows, "positive": _texts(16, seed=2)})
    out = []
    for i, cls in enumerate((ST.CachedMultipleNegativesRankingLoss,
                             c_st.CachedMultipleNegativesRankingLoss)):
        m = _model(tiny_bert, dropout=True)
        args = SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path / str(i)), max_steps=2, per_device_train_batch_size=8,
            learning_rate=0.5, optim="sgd", report_to=[], save_strategy="no", seed=0,
            use_cpu=True, disable_tqdm=True, dataloader_drop_last=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = SentenceTransformerTrainer(model=m, args=args, train_dataset=data,
                                                 loss=cls(m, scale=10.0, mini_batch_size=3))
            loss = trainer.train().training_loss
        out.append((loss, [p.detach().clone() for p in m.parameters()]))
    (l0, w0), (l1, w1) = out
    assert l1 == pytest.approx(l0, rel=1e-9)
    start = [p.detach() for p in _model(tiny_bert, dropout=True).parameters()]
    assert max(float((a - b).abs().max()) for a, b in zip(w0, start)) > 1e-4  # it trained
    for i, (a, b) in enumerate(zip(w1, w0)):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"weight {i}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16"])
def test_on_cuda_within_twice_the_library_error(tiny_bert, autocast):
    """CUDA, float32 weights (and bf16 autocast): the library's cached class and cupynce's
    against the library's uncached loss in float64 on the same weights; cupynce's error at
    most twice the library's (+1e-6), for the loss and the whole gradient."""
    ref_model = _model(tiny_bert, dropout=False, device="cuda")
    feats = [{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in f.items()}
             for f in _features(ref_model, 2, n=40)]
    ref = _step(ref_model, ST.MultipleNegativesRankingLoss(ref_model, scale=20.0), feats)
    model = _model(tiny_bert, dropout=False, device="cuda", dtype=torch.float32)
    errs = []
    for cls in (ST.CachedMultipleNegativesRankingLoss, c_st.CachedMultipleNegativesRankingLoss):
        loss = cls(model, scale=20.0, mini_batch_size=16)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = loss([dict(f) for f in feats], None)
        out.backward()
        grads = torch.cat([p.grad.double().flatten() for p in model.parameters()
                           if p.grad is not None])
        want = torch.cat([g.flatten() for g in ref[1]])
        errs.append((abs(float(out) - float(ref[0])) / abs(float(ref[0])),
                     float((grads - want).norm() / want.norm())))
    (lib_loss, lib_grad), (our_loss, our_grad) = errs
    assert our_loss <= 2 * lib_loss + 1e-6, errs
    assert our_grad <= 2 * lib_grad + 1e-6, errs


# ---- across processes: DDP with gather_across_devices (gloo) -------------------------------
def _saved_bert(folder):
    """The tiny BERT of ``tiny_bert`` (the same weights: seeded), saved in ``folder`` (a
    spawned rank cannot use the fixture's)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    (Path(folder) / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                      "[MASK]"] + WORDS))
    BertTokenizerFast(vocab_file=str(Path(folder) / "vocab.txt")).save_pretrained(folder)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=16, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=64,
                     hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    BertModel(cfg).save_pretrained(folder)
    return folder


def _rank_models(rank, dtype=torch.float64):
    """(the single-process model, this rank's model): the same saved tiny BERT, dropout off.
    transformers saves on rank 0 alone once torch.distributed is up: rank 0 saves, every rank
    loads from its folder."""
    import shutil
    import tempfile

    import torch.distributed as dist

    name = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    if rank == 0:
        _saved_bert(name[0])
    dist.barrier()
    single = _model(name[0], dropout=False, dtype=dtype)
    model = _model(name[0], dropout=False, dtype=dtype)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(name[0], ignore_errors=True)
    return single, model


def check_st_cached_ddp(rank, world):
    """Each rank's shard through DDP and the cached loss with ``gather_across_devices``: after
    DDP's average the parameter gradients are one process's on the whole batch, and the mean
    of the ranks' losses is its loss."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    n = 4
    single, model = _rank_models(rank)
    texts = [_texts(n * world, seed=20 + c) for c in range(2)]
    whole = [dict(single.tokenize(t)) for t in texts]
    want = _step(single, ST.MultipleNegativesRankingLoss(single, scale=20.0), whole)
    mine = [dict(model.tokenize(t[rank * n:(rank + 1) * n])) for t in texts]
    ddp = DDP(model, find_unused_parameters=True)  # (mean pooling leaves BERT's pooler unused)
    loss = c_st.CachedMultipleNegativesRankingLoss(ddp, scale=20.0, mini_batch_size=3,
                                                   gather_across_devices=True)
    out = loss([dict(f) for f in mine], None)
    out.backward()
    total = out.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total / world, want[0], **TOL)
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(got) == len(want[1])
    for i, (a, b) in enumerate(zip(got, want[1])):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"rank {rank} grad {i}: {m}")


def check_st_cached_ddp_autocast(rank, world):
    """The bf16 AMP loop (forward under ``torch.autocast``, ``backward()`` outside it) on a
    float32 model: the ranks' cached loss with ``gather_across_devices`` computes in the dtype
    one process's does (the global loss casts its embeddings as the single-process op), so
    the mean of the ranks' losses and DDP's averaged gradients are one process's cached step
    on the whole batch under the same autocast, to bf16's rounding of the rank blocks' sums."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    n = 4
    single, model = _rank_models(rank, torch.float32)
    texts = [_texts(n * world, seed=30 + c) for c in range(2)]
    whole = [dict(single.tokenize(t)) for t in texts]
    mine = [dict(model.tokenize(t[rank * n:(rank + 1) * n])) for t in texts]
    one = c_st.CachedMultipleNegativesRankingLoss(single, scale=20.0, mini_batch_size=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = one([dict(f) for f in whole], None)
    want.backward()
    ddp = DDP(model, find_unused_parameters=True)
    loss = c_st.CachedMultipleNegativesRankingLoss(ddp, scale=20.0, mini_batch_size=3,
                                                   gather_across_devices=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss([dict(f) for f in mine], None)
    out.backward()
    total = out.detach().clone()
    dist.all_reduce(total)
    # (measured on the CPU: loss 0 and gradients 8e-5 apart; with the ranks' loss in float32
    # instead -- no cast -- 3.9e-4 and 7.2e-3)
    torch.testing.assert_close(total / world, want.detach(), rtol=1e-5, atol=1e-7)
    got = [p.grad for p in model.parameters() if p.grad is not None]
    ref = [p.grad for p in single.parameters() if p.grad is not None]
    assert len(got) == len(ref) > 0
    # (norm-wise over all parameters: the encoder's own bf16 backward runs other chunks on a
    # rank than in one process, which moves small elements by a few per cent)
    a, b = (torch.cat([g.double().flatten() for g in gs]) for gs in (got, ref))
    err = ((a - b).norm() / b.norm()).item()
    assert err <= 1e-3, f"rank {rank}: gradients' relative error {err:.2e} > 1e-3"


@pytest.mark.parametrize("world", [2])  # (3 ranks: the helper's own test, test_grad_cache)
def test_cached_over_gloo(world):
    from test_torch_distributed import run_ranks

    run_ranks(world, ["check_st_cached_ddp", "check_st_cached_ddp_autocast"],
              module="test_st_cached")
