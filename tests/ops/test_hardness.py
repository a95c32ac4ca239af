"""``info_nce(hardness_mode=, hardness_strength=)`` (issue 55: sentence-transformers' hardness
weighting, Lan et al. 2025) against the float64 oracle, and the oracle against torch autograd
of the library's formula written out here.

A penalised candidate's logit is ``q̂·ĉ/τ + α·stopgrad(q̂·ĉ)``; query i's own candidates are
the shared negatives i, i + N, ... (the library's layout) and its per-query negatives.
NumPy on the CPU (CI); CuPy and CUDA tensors marked ``gpu`` (the row blocks: one block and
several).  Relative errors ``||x - ref|| / ||ref||``: float64 1e-12, float32 1e-5, float16
5e-3, bfloat16 3e-2 (as tests/ops/test_info_nce_labels.py).  The sentence-transformers
adapters against the library: tests/integrations (uncached, cached, over gloo); across ranks:
tests/distributed/test_global_emulated.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from cupynce import reference as ref
from cupynce.ops import info_nce as core
# (tests/_support, on sys.path by conftest)
from numerics import TOL, dtype_of as _dtype, rel as _rel

MODES = ["in_batch_negatives", "hard_negatives", "all_negatives"]
N, D = 8, 6


def _inputs(negatives, n=N, d=D, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    neg = {None: None, "shared": rng.standard_normal((2 * n, d)),
           "paired": rng.standard_normal((n, 3, d))}[negatives]
    return q, k, neg


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("negatives", [None, "shared", "paired"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_oracle_is_the_library_formula_under_autograd(mode, negatives, reduction):
    """The library's construction (penalty = α·sim.detach() on the masked query-to-document
    logits, then cross entropy), by torch autograd in float64: loss, every input's gradient
    and dL/dτ."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    q, k, neg = _inputs(negatives)
    g = np.random.default_rng(3).uniform(0.2, 1.5, N) if reduction == "none" else 1.0
    want, (wq, wk, wn, wt) = ref.info_nce(q, k, 0.05, negatives=neg, normalize=True,
                                          reduction=reduction, grad_loss=g,
                                          hardness_mode=mode, hardness_strength=3.0,
                                          temperature_grad=True)
    Q, K = (torch.tensor(x, requires_grad=True) for x in (q, k))
    NG = None if neg is None else torch.tensor(neg, requires_grad=True)
    T = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    qn, kn = F.normalize(Q, dim=1), F.normalize(K, dim=1)
    sims = [qn @ kn.T]
    if NG is not None:
        nn_ = F.normalize(NG, dim=-1)
        sims.append(qn @ nn_.T if neg.ndim == 2 else torch.einsum("nd,nmd->nm", qn, nn_))
    S = torch.cat(sims, 1)
    c, i = torch.arange(S.shape[1])[None, :], torch.arange(N)[:, None]
    own = (c >= N) & (((c - N) % N == i) if neg is None or neg.ndim == 2
                      else torch.ones_like(c, dtype=torch.bool))
    pen = {"in_batch_negatives": (c != i) & ~own, "hard_negatives": own,
           "all_negatives": c != i}[mode]
    L = S / T + torch.where(pen, 3.0 * S.detach(), torch.zeros_like(S))
    rows = F.cross_entropy(L, torch.arange(N), reduction="none")
    (rows * torch.as_tensor(g)).sum().backward() if reduction == "none" else \
        rows.mean().backward()
    out = rows.detach().numpy() if reduction == "none" else rows.mean().item()
    assert _rel(want, out) <= 1e-13
    assert _rel(wq, Q.grad) <= 1e-12 and _rel(wk, K.grad) <= 1e-12
    if NG is not None:
        assert _rel(wn, NG.grad) <= 1e-12
    assert _rel(wt, T.grad) <= 1e-12
    plain = ref.info_nce(q, k, 0.05, negatives=neg, normalize=True, reduction=reduction)[0]
    if mode != "hard_negatives" or neg is not None:  # (else nothing is penalised)
        assert _rel(want, plain) > 1e-3


def _check(xp, dtype, negatives, reduction, mode, *, n=N, d=D, labels=None, eps=0.0,
           ws=None, normalize=True):
    q, k, neg = _inputs(negatives, n, d)
    dt = _dtype(dtype)
    cast = [None if x is None else x.astype(dt) for x in (q, k, neg)]
    dev = [None if x is None else xp.asarray(x) for x in cast]
    lab = None if labels is None else xp.asarray(labels)
    acc = np.float64 if dt == np.float64 else np.float32
    g = 0.7 if reduction != "none" else np.random.default_rng(1).uniform(0.2, 1.5, n)
    hard = dict(hardness_mode=mode, hardness_strength=5.0)
    want, (wq, wk, wn) = ref.info_nce(*cast[:2], 0.3, negatives=cast[2], labels=labels,
                                      label_smoothing=eps, reduction=reduction,
                                      normalize=normalize, grad_loss=g, **hard)
    kw = dict(labels=lab, label_smoothing=eps, reduction=reduction, normalize=normalize,
              workspace_bytes=ws, **hard)
    loss, ctx = core.info_nce_forward(dev[0], dev[1], 0.3, negatives=dev[2], **kw)
    gl = g if reduction != "none" else xp.asarray(g.astype(acc))
    host = (lambda x: x) if xp is np else xp.asnumpy
    tol = TOL[dtype]
    assert _rel(host(loss), want) <= tol, "loss"
    for got, ref_, what in zip(core.info_nce_backward(ctx, gl), (wq, wk, wn), "qkn"):
        if ref_ is None:
            assert got is None
            continue
        assert got.dtype == dt
        assert _rel(host(got).astype(np.float64), ref_) <= tol, what
    again = core.info_nce_backward_from_stats(dev[0], dev[1], dev[2], ctx.stats[0], gl,
                                              temperature=0.3, **kw)
    assert _rel(host(again[0]).astype(np.float64), wq) <= tol, "dq from stats"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("negatives", [None, "shared", "paired"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_numpy_matches_the_oracle(dtype, mode, negatives, reduction):
    _check(np, dtype, negatives, reduction, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_numpy_with_labels_smoothing_and_row_blocks(mode, eps):
    """With labels (a same-label key leaves the softmax first) and smoothing, in blocks of
    two rows (the penalised columns located by the global row)."""
    lab = np.array([0, 1, 0, 2, 1, 0, 3, 1])
    _check(np, "float64", "shared", "none", mode, labels=lab, eps=eps, ws=2 * 3 * N * 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("negatives", [None, "shared", "paired"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cupy_matches_the_oracle(dtype, mode, negatives, reduction):
    import cupy as cp

    _check(cp, dtype, negatives, reduction, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_cupy_large_rows_several_blocks(dtype, mode):
    """A batch wider than a thread block's columns, in several row blocks, with labels."""
    import cupy as cp

    lab = np.random.default_rng(5).integers(0, 40, 300)
    _check(cp, dtype, "shared", "mean", mode, n=300, d=64, labels=lab, eps=0.05,
           ws=64 * 3 * 300 * 4)


def test_torch_matches_the_oracle():
    """cupynce.torch.info_nce: the hardness through the op's schema (a learnable temperature
    too), float64 on the CPU."""
    torch = pytest.importorskip("torch")
    import cupynce.torch as C

    q, k, neg = _inputs("shared")
    for mode in MODES:
        want, (wq, wk, wn, wt) = ref.info_nce(q, k, 0.2, negatives=neg, normalize=True,
                                              hardness_mode=mode, hardness_strength=5.0,
                                              temperature_grad=True)
        xs = [torch.tensor(x, requires_grad=True) for x in (q, k, neg)]
        t = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
        loss = C.info_nce(xs[0], xs[1], t, negatives=xs[2], normalize=True,
                          hardness_mode=mode, hardness_strength=5.0)
        loss.backward()
        assert _rel(loss.item(), want) <= 1e-12
        for x, w in zip(xs, (wq, wk, wn)):
            assert _rel(x.grad, w) <= 1e-12
        assert _rel(t.grad, wt) <= 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_cuda_matches_the_oracle(dtype):
    torch = pytest.importorskip("torch")
    import cupynce.torch as C

    q, k, neg = _inputs("shared", 64, 32)
    tdt = getattr(torch, dtype)
    xs = [torch.tensor(x, device="cuda").to(tdt).requires_grad_() for x in (q, k, neg)]
    cast = [x.detach().float().cpu().double().numpy() for x in xs]
    want, grads = ref.info_nce(*cast[:2], 0.2, negatives=cast[2], normalize=True,
                               hardness_mode="in_batch_negatives", hardness_strength=9.0)
    loss = C.info_nce(xs[0], xs[1], 0.2, negatives=xs[2], normalize=True,
                      hardness_mode="in_batch_negatives", hardness_strength=9.0)
    loss.backward()
    assert _rel(loss.item(), want) <= TOL[dtype]
    for x, w in zip(xs, grads):
        assert _rel(x.grad.double().cpu(), w) <= TOL[dtype]


def test_zero_strength_or_no_mode_is_the_plain_loss_bit_for_bit():
    q, k, neg = _inputs("shared")
    plain = core.info_nce(q, k, 0.3, negatives=neg)
    for kw in (dict(hardness_mode="all_negatives", hardness_strength=0.0),
               dict(hardness_mode=None, hardness_strength=5.0)):
        assert core.info_nce(q, k, 0.3, negatives=neg, **kw) == plain


@pytest.mark.parametrize("kw,err,match", [
    (dict(hardness_mode="hardest", hardness_strength=1.0), ValueError, "hardness_mode must be"),
    (dict(hardness_mode="all_negatives", hardness_strength=-1.0), ValueError,
     "hardness_strength must be finite and >= 0, got -1.0"),
    (dict(hardness_mode="all_negatives", hardness_strength=float("nan")), ValueError,
     "hardness_strength must be finite"),
    (dict(hardness_mode="all_negatives", hardness_strength="5"), TypeError,
     "hardness_strength must be a real"),
    (dict(hardness_mode="hard_negatives", hardness_strength=1.0, negatives=np.ones((5, D))),
     ValueError, r"got negatives of shape \(5, 6\) for N = 8"),
])
def test_bad_hardness_raises(kw, err, match):
    q, k, _ = _inputs(None)
    with pytest.raises(err, match=match):
        core.info_nce(q, k, 0.3, **kw)


def test_a_replicated_queue_is_nobodys_own():
    """replicated_negatives=True (a queue): no query owns a row of it, with or without
    group= -- "hard_negatives" weights nothing there, "in_batch_negatives" all of it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_support"))
    from emulated_ranks import run

    rng = np.random.default_rng(9)
    q, k, u = rng.standard_normal((4, 5)), rng.standard_normal((4, 5)), rng.standard_normal((8, 5))
    kw = dict(negatives=u, replicated_negatives=True, hardness_strength=4.0)
    plain = core.info_nce(q, k, 0.3, negatives=u)
    assert core.info_nce(q, k, 0.3, hardness_mode="hard_negatives", **kw) == plain
    every = core.info_nce(q, k, 0.3, hardness_mode="in_batch_negatives", **kw)
    assert abs(every - core.info_nce(q, k, 0.3, hardness_mode="all_negatives", **kw)) < 1e-13
    for mode in MODES:
        one = run(1, lambda comm: core.info_nce(q, k, 0.3, hardness_mode=mode, group=comm,
                                                **kw))[0]
        assert abs(float(one) - float(core.info_nce(q, k, 0.3, hardness_mode=mode, **kw))) \
            <= 1e-12 * abs(float(one))
