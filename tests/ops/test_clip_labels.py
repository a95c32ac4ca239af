"""``clip_loss(labels=)`` (issue 55: same-label pairs are no negatives, in both directions)
against the float64 oracle (``cupynce.reference.clip_loss(labels=)``, itself checked against
torch autograd below).

NumPy on the CPU (CI); CuPy and CUDA tensors marked ``gpu`` (the cuBLAS row blocks: the mask
kernel after each score product; one block and several, every float32 product mode).
Relative errors ``||x - ref|| / ||ref||``: float64 1e-12, float32 1e-5, float16 5e-3,
bfloat16 3e-2 (logit_scale's gradient: that times max(|ref|, 1)).  Across ranks:
tests/distributed/test_global_emulated.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from cupynce import reference as ref
from cupynce.ops import clip as core
# (tests/_support, on sys.path by conftest)
from numerics import TOL, dtype_of as _dtype, rel as _rel, scalar_err as _scalar_err

LABELS = np.array([0, 1, 0, 2, 1, 0, 3, 1, 2, 4])


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_oracle_is_autograd_of_the_masked_formula(eps):
    """The oracle against torch autograd of CLIP's two cross entropies with the same-label
    pairs (off the diagonal) at -inf -- with smoothing, the target 1 − ε on the pair plus ε
    spread over the candidates left --, float64, logit_scale's gradient included."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((10, 6)), rng.standard_normal((10, 6))
    g = rng.uniform(0.2, 1.5, 10)
    want, (wa, wb, wls) = ref.clip_loss(a, b, 1.2, labels=LABELS, label_smoothing=eps,
                                        reduction="none", normalize=True, grad_loss=g)
    A, B = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    ls = torch.tensor(1.2, dtype=torch.float64, requires_grad=True)
    L = ls.exp() * F.normalize(A, dim=1) @ F.normalize(B, dim=1).T
    lab = torch.tensor(LABELS)
    mask = (lab[:, None] == lab[None, :]) & ~torch.eye(10, dtype=torch.bool)
    L = L.masked_fill(mask, -torch.inf)
    keep = (~mask).double()
    target = (1 - eps) * torch.eye(10, dtype=torch.float64) + eps * keep / keep.sum(1,
                                                                               keepdim=True)

    def ce(logits):  # (−Σ_j T_ij log softmax_ij over the candidates: masked terms left out)
        logp = torch.log_softmax(logits, dim=1)
        return -(target * torch.where(keep > 0, logp, torch.zeros_like(logp))).sum(1)
    rows = (ce(L) + ce(L.T)) / 2
    (rows * torch.tensor(g)).sum().backward()
    assert _rel(want, rows.detach()) <= 1e-13
    assert _rel(wa, A.grad) <= 1e-12 and _rel(wb, B.grad) <= 1e-12
    assert _scalar_err(wls, ls.grad) <= 1e-12


def _check(xp, dtype, reduction, normalize, learnable, n=10, d=6, labels=LABELS, ws=None,
           eps=0.0):
    rng = np.random.default_rng(n + d)
    dt = _dtype(dtype)
    a, b = (rng.standard_normal((n, d)).astype(dt) for _ in range(2))
    acc = np.float64 if dt == np.float64 else np.float32
    g = 0.7 if reduction != "none" else rng.uniform(0.2, 1.5, n)
    want, (wa, wb, wls) = ref.clip_loss(a, b, 1.2, labels=labels, label_smoothing=eps,
                                        reduction=reduction, normalize=normalize, grad_loss=g)
    ls = xp.asarray(np.asarray([1.2], acc)) if learnable else 1.2
    kw = dict(labels=xp.asarray(labels), label_smoothing=eps, reduction=reduction,
              normalize=normalize, workspace_bytes=ws)
    loss, ctx = core.clip_loss_forward(xp.asarray(a), xp.asarray(b), ls, **kw)
    gl = g if reduction != "none" else xp.asarray(g.astype(acc))
    da, db, dls = core.clip_loss_backward(ctx, gl)
    host = (lambda x: x) if xp is np else xp.asnumpy
    tol = TOL[dtype]
    assert _rel(host(loss), want) <= tol, "loss"
    assert da.dtype == dt and db.dtype == dt
    assert _rel(host(da).astype(np.float64), wa) <= tol, "da"
    assert _rel(host(db).astype(np.float64), wb) <= tol, "db"
    assert _scalar_err(host(dls), wls) <= tol, "dlogit_scale"
    again = core.clip_loss_backward_from_stats(xp.asarray(a), xp.asarray(b), ls, *ctx.stats,
                                               gl, **kw)
    assert _rel(host(again[0]).astype(np.float64), wa) <= tol, "da from stats"
    assert _scalar_err(host(again[2]), wls) <= tol, "dlogit_scale from stats"
    if dtype in ("float64", "float32"):  # (the labels move the loss well past the tolerance)
        plain = ref.clip_loss(a, b, 1.2, label_smoothing=eps, reduction=reduction,
                              normalize=normalize)[0]
        assert _rel(want, plain) > 10 * tol


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("learnable", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.15])
def test_numpy_matches_the_oracle(dtype, reduction, normalize, learnable, eps):
    _check(np, dtype, reduction, normalize, learnable, eps=eps)


def test_distinct_labels_are_no_labels():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((6, 4)), rng.standard_normal((6, 4))
    assert core.clip_loss(a, b, 1.0, labels=np.arange(6)) == core.clip_loss(a, b, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("learnable", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.15])
def test_cupy_matches_the_oracle(dtype, reduction, learnable, eps):
    import cupy as cp

    _check(cp, dtype, reduction, True, learnable, eps=eps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("precision", ["fp32", "3xtf32", "auto"])
@pytest.mark.parametrize("ws", [None, 64 * 1024])
def test_cupy_large_rows_and_blocks(dtype, precision, ws):
    """Wider than a block of threads, in several row blocks (ws), every float32 product
    mode (the F16x3 gradient halves, the TF32x3 tiles, cuBLAS)."""
    import cupy as cp

    from cupynce import config

    lab = np.random.default_rng(3).integers(0, 50, 300)
    with config.float32_precision(precision):
        _check(cp, dtype, "mean", True, True, n=300, d=64, labels=lab, ws=ws)


def test_torch_matches_the_oracle():
    torch = pytest.importorskip("torch")
    import cupynce.torch as C

    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((10, 5)), rng.standard_normal((10, 5))
    want, (wa, wb, wls) = ref.clip_loss(a, b, 1.1, labels=LABELS, normalize=True)
    A, B = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    ls = torch.tensor(1.1, dtype=torch.float64, requires_grad=True)
    loss = C.clip_loss(A, B, ls, labels=torch.tensor(LABELS), normalize=True)
    loss.backward()
    assert _rel(loss.item(), want) <= 1e-12
    assert _rel(A.grad, wa) <= 1e-12 and _rel(B.grad, wb) <= 1e-12
    assert _scalar_err(ls.grad, wls) <= 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_cuda_matches_the_oracle(dtype):
    torch = pytest.importorskip("torch")
    import cupynce.torch as C

    lab = np.random.default_rng(5).integers(0, 30, 256)
    A, B = (torch.randn(256, 64, device="cuda", dtype=getattr(torch, dtype),
                        requires_grad=True) for _ in range(2))
    want, (wa, wb, _) = ref.clip_loss(A.detach().double().cpu().numpy(),
                                      B.detach().double().cpu().numpy(), 2.0, labels=lab,
                                      normalize=True)
    loss = C.clip_loss(A, B, 2.0, labels=torch.tensor(lab, device="cuda"), normalize=True)
    loss.backward()
    assert _rel(loss.item(), want) <= TOL[dtype]
    assert _rel(A.grad.double().cpu(), wa) <= TOL[dtype]
    assert _rel(B.grad.double().cpu(), wb) <= TOL[dtype]


@pytest.mark.parametrize("labels,err,match", [
    (np.zeros(3, np.int64), ValueError, "labels"),
    (np.zeros(4), ValueError, "labels must be an integer array"),
])
def test_bad_labels_raise(labels, err, match):
    a = np.ones((4, 3))
    with pytest.raises(err, match=match):
        core.clip_loss(a, a, 1.0, labels=labels)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("loop", ["ws", "wgmma", "mma"])
@pytest.mark.parametrize("n,classes", [(300, "4"), (300, "280"), (1000, "40"), (1000, "grouped"),
                                       (777, "negative"), (500, "high")])
@pytest.mark.parametrize("ws", [None, 256 * 1024])
@pytest.mark.parametrize("on_tiles", [True, False])
def test_cupy_labels_on_the_score_tiles(dtype, loop, n, classes, ws, on_tiles, monkeypatch):
    """The score tiles' label epilogues (``config.clip_labels_tiles``) on every main loop
    (warp-specialised, cp.async wgmma, mma.sync), N not a multiple of the 128-row tile, few
    random classes (a masked pair in every tile) and many, grouped labels (most tiles skip
    the labels: their 128-block key ranges are disjoint), negative ones, labels equal in
    their low 32 bits (the ranges' keys) but not above; one column block and several
    (``ws``); ``on_tiles=False``: the row blocks, the A/B.  The route taken is asserted."""
    import cupy as cp

    from cupynce import config
    from cupynce._engine.losses import row_blocks, score_tiles

    calls = {"tiles": 0, "rows": 0}
    for mod, key in ((score_tiles, "tiles"), (row_blocks, "rows")):
        orig = mod.clip

        def spy(*args, _orig=orig, _key=key, **kw):
            calls[_key] += kw.get("labels") is not None
            return _orig(*args, **kw)
        monkeypatch.setattr(mod, "clip", spy)
    rng = np.random.default_rng(n)
    lab = {"grouped": np.arange(n) // 3, "negative": np.arange(n) // 5 - 100,
           "high": (rng.integers(0, 3, n) << 32) + np.arange(n) // 4,
           }.get(classes) if not classes.isdigit() else rng.integers(0, int(classes), n)
    loops = {"ws": {}, "wgmma": dict(ws_tiles=False), "mma": dict(wgmma=False)}[loop]
    with config.override(tiles=True, clip_labels_tiles=on_tiles, **loops):
        _check(cp, dtype, "mean", True, True, n=n, d=64, labels=lab, ws=ws)
    taken, other = ("tiles", "rows") if on_tiles else ("rows", "tiles")
    assert calls[taken] > 0 and calls[other] == 0
