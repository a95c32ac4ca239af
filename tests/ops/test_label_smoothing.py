"""``nt_xent(label_smoothing=)`` and ``clip_loss(label_smoothing=)`` (issue 55) against the
float64 oracle, on every path.

The smoothing is an O(N·D) difference added to whichever path computes the plain loss
(``cupynce.ops._variants``), so the GPU cases cover the paths the chooser takes at their
sizes: the row blocks (float64), the TF32x3 tiles (float32), the 16-bit score tiles (N = 512,
D = 64) and the kept scores (bf16, D = 4096; CLIP's at D = 2048). NumPy on the CPU (CI);
CuPy and CUDA tensors marked ``gpu``. Relative errors ``||x - ref|| / ||ref||``: float64
1e-12, float32 1e-5, float16 5e-3, bfloat16 3e-2 (CLIP's d logit_scale, a sum of cancelling
terms: that tolerance times max(|d logit_scale|, 1)). ``cupynce.torch`` through the direct Function, the registered ops
and ``torch.compile``; ranks that pass different smoothings raise on every rank (``group=``
with a smoothing: tests/distributed/test_global_emulated.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from cupynce import reference as ref
from cupynce.ops import nt_xent as core
# (tests/_support, on sys.path by conftest)
from numerics import TOL, dtype_of as _dtype, rel as _rel


def _views(rng, b, d):
    """Two views of b rows, close to each other: the positives dominate, so the smoothing
    moves the loss by a large part of itself (a dropped difference fails every tolerance)."""
    x = rng.standard_normal((b, d)) / np.sqrt(d)
    return x, x + 0.1 * rng.standard_normal((b, d)) / np.sqrt(d)


def _check(xp, dtype, n, d, reduction, normalize, eps, ws=None):
    dt = _dtype(dtype)
    z = np.concatenate(_views(np.random.default_rng(n + d), n // 2, d)).astype(dt)
    g = 0.7 if reduction != "none" else np.random.default_rng(1).uniform(0.2, 1.5, n)
    want, (wz,) = ref.nt_xent(z, 0.2, label_smoothing=eps, reduction=reduction,
                              normalize=normalize, grad_loss=g)
    loss, ctx = core.nt_xent_forward(xp.asarray(z), 0.2, label_smoothing=eps,
                                     reduction=reduction, normalize=normalize,
                                     workspace_bytes=ws)
    gl = g if reduction != "none" else xp.asarray(g.astype(np.float64 if dt == np.float64
                                                            else np.float32))
    dz = core.nt_xent_backward(ctx, gl)
    host = (lambda x: x) if xp is np else xp.asnumpy
    assert _rel(host(loss), want) <= TOL[dtype], "loss"
    plain = ref.nt_xent(z, 0.2, reduction=reduction, normalize=normalize)[0]
    assert _rel(want, plain) > 3 * TOL[dtype]  # (the smoothing's part is well measurable)
    assert dz.dtype == dt
    assert _rel(host(dz).astype(np.float64), wz) <= TOL[dtype], "dz"
    if reduction == "none":
        again = core.nt_xent_backward_from_stats(
            xp.asarray(z), ctx.stats[0], gl, temperature=0.2, label_smoothing=eps,
            reduction=reduction, normalize=normalize)
        assert _rel(host(again).astype(np.float64), wz) <= TOL[dtype], "dz from stats"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("eps", [0.05, 0.3])
def test_numpy_matches_the_oracle(dtype, reduction, normalize, eps):
    _check(np, dtype, 10, 6, reduction, normalize, eps)


def test_zero_smoothing_is_the_plain_loss_bit_for_bit():
    z = np.random.default_rng(0).standard_normal((8, 5))
    a, ca = core.nt_xent_forward(z, 0.3)
    b, cb = core.nt_xent_forward(z, 0.3, label_smoothing=0.0)
    assert a == b
    np.testing.assert_array_equal(core.nt_xent_backward(ca), core.nt_xent_backward(cb))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,n,d", [("float64", 64, 32), ("float32", 512, 64),
                                       ("bfloat16", 512, 64), ("float16", 512, 64),
                                       ("bfloat16", 256, 4096)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("normalize", [False, True])
def test_cupy_matches_the_oracle_on_every_path(dtype, n, d, reduction, normalize):
    cp = pytest.importorskip("cupy")
    _check(cp, dtype, n, d, reduction, normalize, 0.1)


@pytest.mark.parametrize("eps,err,match", [
    (-0.1, ValueError, r"must be in \[0, 1\), got -0.1"),
    (1.0, ValueError, r"must be in \[0, 1\), got 1.0"),
    (float("nan"), ValueError, r"must be in \[0, 1\), got nan"),
    (None, TypeError, r"must be a real in \[0, 1\), got None"),
])
def test_bad_smoothing_raises(eps, err, match):
    with pytest.raises(err, match="nt_xent: label_smoothing " + match):
        core.nt_xent_forward(np.ones((4, 3)), 0.5, label_smoothing=eps)


def test_ranks_with_different_smoothings_raise_on_every_rank():
    """``group=`` with a smoothing is the global batch's (tests/distributed); ranks that pass
    different smoothings raise, every one of them."""
    from emulated_ranks import run

    z = np.random.default_rng(2).standard_normal((8, 4))

    def rank(comm):
        with pytest.raises(ValueError, match=r"nt_xent: every rank of the group must pass the "
                                             r"same settings"):
            core.nt_xent_forward(z[4 * comm.rank:4 * comm.rank + 4], 0.5, group=comm,
                                 label_smoothing=0.1 if comm.rank == 0 else 0.0)
        return True

    assert run(2, rank) == [True, True]


# ---- cupynce.torch ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["direct", "registered", "compile"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_cpu_matches_the_oracle(path, reduction):
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct
    from cupynce.torch import _registry

    z0 = np.random.default_rng(4).standard_normal((10, 6))
    z = torch.tensor(z0, requires_grad=True)
    kw = dict(label_smoothing=0.1, reduction=reduction, normalize=True)
    if path == "compile":
        torch._dynamo.reset()
        out = torch.compile(lambda z: ct.nt_xent(z, 0.2, **kw), backend="aot_eager",
                            fullgraph=True)(z)
    elif path == "registered":
        real = _registry.direct
        _registry.direct = lambda *tensors: False
        try:
            out = ct.nt_xent(z, 0.2, **kw)
        finally:
            _registry.direct = real
    else:
        out = ct.nt_xent(z, 0.2, **kw)
    gl = torch.linspace(0.5, 1.5, 10, dtype=torch.float64) if reduction == "none" else \
        torch.tensor(0.7, dtype=torch.float64)
    (dz,) = torch.autograd.grad(out, [z], gl)
    want, (wz,) = ref.nt_xent(z0, 0.2, grad_loss=gl.numpy(), **kw)
    assert _rel(out.detach().numpy(), want) <= 1e-12
    assert _rel(dz.numpy(), wz) <= 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_torch_cuda_matches_the_oracle(dtype, tol):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    import cupynce.torch as ct

    z0 = np.random.default_rng(6).standard_normal((512, 64)) / 8
    z = torch.tensor(z0, device="cuda", dtype=getattr(torch, dtype), requires_grad=True)
    out = ct.nt_xent(z, 0.2, label_smoothing=0.1, normalize=True)
    (dz,) = torch.autograd.grad(out, [z])
    zr = z.detach().double().cpu().numpy()
    want, (wz,) = ref.nt_xent(zr, 0.2, label_smoothing=0.1, normalize=True)
    assert _rel(out.detach().double().cpu().numpy(), want) <= tol
    assert _rel(dz.double().cpu().numpy(), wz) <= tol


# ---- CLIP's label smoothing: the same O(N·D) difference, both directions -------------------
def _check_clip(xp, dtype, n, d, reduction, normalize, eps, learnable):
    from cupynce.ops import clip as clip_core

    dt = _dtype(dtype)
    rng = np.random.default_rng(n + 3 * d)
    a, b = (x.astype(dt) for x in _views(rng, n, d))
    ls0 = 2.3
    g = 0.7 if reduction != "none" else rng.uniform(0.2, 1.5, n)
    want, (wa, wb, ws) = ref.clip_loss(a, b, ls0, label_smoothing=eps, reduction=reduction,
                                       normalize=normalize, grad_loss=g)
    acc = np.float64 if dt == np.float64 else np.float32
    ls = xp.asarray(np.asarray([ls0], acc)) if learnable else ls0
    loss, ctx = clip_core.clip_loss_forward(xp.asarray(a), xp.asarray(b), ls,
                                            label_smoothing=eps, reduction=reduction,
                                            normalize=normalize)
    gl = g if reduction != "none" else xp.asarray(g.astype(acc))
    da, db, dls = clip_core.clip_loss_backward(ctx, gl)
    host = (lambda x: x) if xp is np else xp.asnumpy
    tol = TOL[dtype]
    assert _rel(host(loss), want) <= tol, "loss"
    assert _rel(host(da).astype(np.float64), wa) <= tol, "da"
    assert _rel(host(db).astype(np.float64), wb) <= tol, "db"
    # (d logit_scale sums cancelling terms: its error is bounded against its size or 1, the
    # order of the loss it differentiates)
    err = abs(float(host(dls).astype(np.float64).reshape(())) - float(ws.reshape(())))
    assert err <= tol * max(abs(float(ws.reshape(()))), 1.0), "dlogit_scale"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("learnable", [False, True])
def test_clip_numpy_matches_the_oracle(dtype, reduction, normalize, learnable):
    _check_clip(np, dtype, 10, 6, reduction, normalize, 0.1, learnable)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,n,d", [("float64", 64, 32), ("float32", 512, 64),
                                       ("bfloat16", 512, 64), ("bfloat16", 256, 2048)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("learnable", [False, True])
def test_clip_cupy_matches_the_oracle_on_every_path(dtype, n, d, reduction, learnable):
    cp = pytest.importorskip("cupy")
    _check_clip(cp, dtype, n, d, reduction, True, 0.1, learnable)


@pytest.mark.parametrize("path", ["direct", "compile"])
def test_clip_torch_cpu_matches_the_oracle(path):
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct

    rng = np.random.default_rng(9)
    a0, b0 = rng.standard_normal((10, 6)), rng.standard_normal((10, 6))
    a, b = (torch.tensor(x, requires_grad=True) for x in (a0, b0))
    ls = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)
    fn = (lambda a, b, ls: ct.clip_loss(a, b, ls, label_smoothing=0.1, normalize=True))
    if path == "compile":
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = fn(a, b, ls)
    grads = torch.autograd.grad(out, [a, b, ls])
    want, wgrads = ref.clip_loss(a0, b0, 1.7, label_smoothing=0.1, normalize=True)
    assert _rel(out.detach().numpy(), want) <= 1e-12
    for got, w in zip(grads, wgrads):
        assert _rel(got.numpy(), w) <= 1e-12


def test_modules_take_the_smoothing():
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct

    g = torch.Generator().manual_seed(1)
    z = torch.randn(8, 5, generator=g, dtype=torch.float64)
    a, b = (torch.randn(6, 5, generator=g, dtype=torch.float64) for _ in range(2))
    for cls in (ct.InfoNCELoss, ct.NTXentLoss):
        mod = cls(0.3, label_smoothing=0.2)
        assert "label_smoothing=0.2" in repr(mod)
        assert torch.equal(mod(z), ct.nt_xent(z, 0.3, label_smoothing=0.2))
    clip = ct.ClipLoss(0.1, label_smoothing=0.2)
    assert "label_smoothing=0.2" in repr(clip)
    assert torch.equal(clip(a, b), ct.clip_loss(a, b, clip.clamped_logit_scale(),
                                                label_smoothing=0.2, normalize=True))
    with pytest.raises(ValueError, match=r"ClipLoss: label_smoothing must be in \[0, 1\)"):
        ct.ClipLoss(label_smoothing=1.0)


def check_smoothing_across_ranks(rank, world):
    """``cupynce.torch.nt_xent`` / ``clip_loss`` with a smoothing through ``group=``: the
    global loss of the concatenated batch, and world times its gradients for the rank's rows
    (DDP's convention; the learnable scale's: the global one)."""
    import torch
    import torch.distributed as dist

    import cupynce.torch as ct

    n = 3
    gen = torch.Generator().manual_seed(9)
    V1, V2, A, B = (torch.randn(n * world, 5, generator=gen, dtype=torch.float64)
                    for _ in range(4))
    mine = slice(rank * n, (rank + 1) * n)
    for reduction in ("mean", "none"):
        up = torch.linspace(0.5, 1.5, 2 * n * world, dtype=torch.float64)
        # NT-Xent: the rank's [view 1; view 2]; the global batch [every view 1; every view 2]
        z = torch.cat([V1[mine], V2[mine]]).requires_grad_()
        zs = torch.cat([V1, V2]).requires_grad_()
        loss = ct.nt_xent(z, 0.3, label_smoothing=0.2, reduction=reduction, normalize=True,
                          group=dist.group.WORLD)
        want = ct.nt_xent(zs, 0.3, label_smoothing=0.2, reduction=reduction, normalize=True)
        idx = torch.cat([torch.arange(rank * n, (rank + 1) * n),
                         n * world + torch.arange(rank * n, (rank + 1) * n)])
        if reduction == "none":
            loss.backward(up[idx])
            want.backward(up)
            torch.testing.assert_close(loss, want[idx], rtol=1e-12, atol=1e-14)
        else:
            loss.backward()
            want.backward()
            torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(z.grad, world * zs.grad[idx], rtol=1e-10, atol=1e-14)
        # CLIP with a learnable log scale
        a, b = A[mine].clone().requires_grad_(), B[mine].clone().requires_grad_()
        a_s, b_s = A.clone().requires_grad_(), B.clone().requires_grad_()
        ls, ls_s = (torch.tensor(1.1, dtype=torch.float64, requires_grad=True)
                    for _ in range(2))
        loss = ct.clip_loss(a, b, ls, label_smoothing=0.2, reduction=reduction,
                            normalize=True, group=dist.group.WORLD)
        want = ct.clip_loss(a_s, b_s, ls_s, label_smoothing=0.2, reduction=reduction,
                            normalize=True)
        g = up[:n * world]
        loss.backward(g[mine] if reduction == "none" else None)
        want.backward(g if reduction == "none" else None)
        torch.testing.assert_close(loss, want[mine] if reduction == "none" else want,
                                   rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(a.grad, world * a_s.grad[mine], rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(b.grad, world * b_s.grad[mine], rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(ls.grad, ls_s.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("world", [2, 3])
def test_smoothing_across_ranks_over_gloo(world):
    pytest.importorskip("torch")
    from test_torch_distributed import run_ranks

    run_ranks(world, ["check_smoothing_across_ranks"], module="test_label_smoothing")
