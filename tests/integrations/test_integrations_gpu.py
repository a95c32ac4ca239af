"""cupynce.integrations on the GPU: bf16 and float32 CUDA tensors against the libraries' classes
run in float64 on the same values (open_clip's ClipLoss / SigLipLoss, lightly's NTXentLoss,
sentence-transformers' MNRL and its symmetric form, and its SpladePooling in a SparseEncoder —
the latter 10x looser: the output is rounded to the dtype after a one-layer BERT in it).  Tolerances, relative (gradients:
||x − ref|| / ||ref|| of the whole tensor): float32 loss 1e-5, gradients 1e-4; bf16 loss 1e-3
(the ops accumulate in float32: measured ≤ 2e-5) and gradients 1e-2 (rounded to bf16 on the way
out: measured ≤ 3.4e-3 on an H100, where the libraries' own bf16 runs give 3–5e-3)."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (none here)", allow_module_level=True)

import library_losses as LL  # noqa: E402
from cupynce.integrations import lightly as c_lightly  # noqa: E402
from cupynce.integrations import open_clip as c_oc  # noqa: E402
from cupynce.integrations import sentence_transformers as c_st  # noqa: E402
from test_integrations import (SENTS, _sparse_encoder, distributed_checks,  # noqa: E402
                                   tiny_mlm)  # noqa: F401

pytestmark = pytest.mark.gpu
OC, LIGHTLY = LL.open_clip_loss(), LL.lightly_ntxent()
try:
    from sentence_transformers.losses import MultipleNegativesRankingLoss as STMNRL  # noqa
except ImportError:  # pragma: no cover
    STMNRL = None
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-3, 1e-2)}


def _unit(n, d, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.functional.normalize(torch.randn(n, d, device="cuda", generator=g), dim=-1)
            for _ in range(k)]


def _grads(fn, xs, scalars, dtype):
    xs = [x.to(dtype).requires_grad_(True) for x in xs]
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    ss = [torch.tensor(v, dtype=sdt, device="cuda", requires_grad=True) for v in scalars]
    loss = fn(xs, ss)
    return loss.detach().double(), [g.double() for g in torch.autograd.grad(loss, [*xs, *ss])]


def _check(lib, ours, call, xs, scalars, dtype):
    ref_loss, ref = _grads(lambda x, s: call(lib, x, s), xs, scalars, torch.float64)
    loss, got = _grads(lambda x, s: call(ours, x, s), xs, scalars, dtype)
    tl, tg = TOL[dtype]
    assert float(abs(loss - ref_loss) / max(float(abs(ref_loss)), 1.0)) <= tl  # (N = 1: 0)
    for i, (g, r) in enumerate(zip(got, ref)):
        if i >= len(xs):  # scalar gradients: relative to their size or 1
            assert float(abs(g - r) / max(float(abs(r)), 1.0)) <= tg, i
        else:
            assert float((g - r).norm() / max(float(r.norm()), 1e-3)) <= tg, i  # (N = 1: 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 129, 4096])
@pytest.mark.parametrize("siglip", [False, True])
def test_open_clip(dtype, n, siglip):
    if OC is None:
        pytest.skip("open_clip_torch is not installed")
    name = "SigLipLoss" if siglip else "ClipLoss"
    scalars = [math.log(10.0), -10.0] if siglip else [math.log(1 / 0.07)]

    def call(fn, x, s):
        return fn(x[0], x[1], s[0].exp(), *s[1:])

    _check(getattr(OC, name)(), getattr(c_oc, name)(), call, _unit(n, 256, 2, n), scalars, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [2, 1000])
def test_lightly(dtype, n):
    if LIGHTLY is None:
        pytest.skip("lightly is not installed")
    xs = [x * 3 for x in _unit(n, 128, 2, n)]
    _check(LIGHTLY(0.1), c_lightly.NTXentLoss(0.1), lambda fn, x, s: fn(x[0], x[1]), xs, [],
           dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [2, 3])
@pytest.mark.parametrize("symmetric", [False, True])
def test_sentence_transformers(dtype, cols, symmetric):
    if STMNRL is None:
        pytest.skip("sentence-transformers is not installed")
    kw = dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction") \
        if symmetric else {}

    def call(fn, x, s):
        return fn.compute_loss_from_embeddings(list(x), None)

    _check(STMNRL(None, **kw), c_st.MultipleNegativesRankingLoss(None, **kw), call,
           _unit(700, 384, cols, cols), [], dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sentence_transformers_splade_pooling(tiny_mlm, dtype):
    """A SparseEncoder (one-layer BERT masked LM) with cupynce's fused SpladePooling, in
    ``dtype`` on the GPU, against the library's pooling with the model in float64."""
    pytest.importorskip("sentence_transformers.sparse_encoder")
    res = []
    for ours, dt in ((False, torch.float64), (True, dtype)):
        model, t = _sparse_encoder(tiny_mlm, ours)
        model.to("cuda", dt)
        model.train()
        feats = {k: v.to("cuda") if torch.is_tensor(v) else v  # (6.0 adds a text field)
                 for k, v in model.preprocess(SENTS).items()}
        out = model(feats)["sentence_embedding"]
        out.double().square().sum().backward()
        am = t.auto_model
        res.append([out.detach().double(), am.bert.embeddings.word_embeddings.weight.grad.double(),
                    am.cls.predictions.bias.grad.double()])
    tl, tg = TOL[dtype]
    for i, (g, r) in enumerate(zip(res[1], res[0])):
        assert float((g - r).norm() / r.norm()) <= (tl if i == 0 else tg) * 10, i


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_integrations_over_nccl_one_rank_per_gpu():
    """The gloo comparisons of test_integrations_cpu.py with NCCL, one process per GPU."""
    from test_torch_distributed import run_ranks

    run_ranks(torch.cuda.device_count(), distributed_checks(), backend="nccl", device="cuda",
              module="test_integrations")
