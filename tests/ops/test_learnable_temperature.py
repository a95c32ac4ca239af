"""A learnable temperature (issue 55): a temperature array and ``temperature_grad=True`` give
dL/dτ beside the rows' gradients, against the float64 oracle's (``reference``'s
``temperature_grad=True``, itself checked against finite differences and torch autograd).

dL/dτ comes from the homogeneity dot over the gradient accumulator (``_base.dtemperature``),
so every path that computes the rows' gradient serves it.  NumPy on the CPU (CI): host
arrays of shape () and (1,) in float64 and float32, every reduction, label smoothing, the
per-row backward from the statistics, emulated ranks.  ``cupynce.torch``: a tensor
temperature through the direct Function, the registered ops and ``torch.compile``, and
``NTXentLoss(learnable=True)``.  GPU (marked ``gpu``): a CuPy temperature on the device (never
read), float64 / float32 / bfloat16.  Relative tolerances as the other variants' (float64
1e-12, float32 1e-5, bfloat16 3e-2), dτ against max(|dτ|, 1).
"""
from __future__ import annotations

import numpy as np
import pytest

import cupynce
from cupynce import reference as ref
# (tests/_support, on sys.path by conftest)
from numerics import TOL, rel as _rel, scalar_err as _scalar_err


def _check_nt_xent(xp, dtype, n, d, reduction, eps, tshape, tdtype, normalize=True):
    dt = np.dtype(dtype) if dtype != "bfloat16" else __import__("ml_dtypes").bfloat16
    rng = np.random.default_rng(n + d)
    z = (rng.standard_normal((n, d)) / np.sqrt(d)).astype(dt)
    t0 = np.asarray(0.3, tdtype).reshape(tshape)
    tau = float(t0.reshape(()))
    g = 0.7 if reduction != "none" else rng.uniform(0.2, 1.5, n)
    want, (wz, wt) = ref.nt_xent(z, tau, label_smoothing=eps, reduction=reduction,
                                 normalize=normalize, grad_loss=g, temperature_grad=True)
    acc = np.float64 if dt == np.float64 else np.float32
    gl = g if reduction != "none" else xp.asarray(g.astype(acc))
    loss, ctx = cupynce.nt_xent_forward(xp.asarray(z), xp.asarray(t0), label_smoothing=eps,
                                        reduction=reduction, normalize=normalize,
                                        temperature_grad=True)
    dz, dtau = cupynce.nt_xent_backward(ctx, gl)
    host = (lambda x: x) if xp is np else xp.asnumpy
    tol = max(TOL[dtype], 1e-6 if np.dtype(tdtype) == np.float32 else 0)
    assert _rel(host(loss), want) <= TOL[dtype], "loss"
    assert _rel(host(dz).astype(np.float64), wz) <= TOL[dtype], "dz"
    assert dtau.shape == t0.shape and dtau.dtype == t0.dtype
    assert _scalar_err(host(dtau), wt) <= tol, "dtemperature"
    if reduction == "none":
        again = cupynce.nt_xent_backward_from_stats(
            xp.asarray(z), ctx.stats[0], gl, temperature=xp.asarray(t0), label_smoothing=eps,
            reduction=reduction, normalize=normalize, temperature_grad=True)
        assert _scalar_err(host(again[1]), wt) <= tol, "dtemperature from stats"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("tshape,tdtype", [((), np.float64), ((1,), np.float64),
                                           ((), np.float32)])
@pytest.mark.parametrize("normalize", [False, True])
def test_nt_xent_numpy(reduction, eps, tshape, tdtype, normalize):
    _check_nt_xent(np, "float64", 12, 5, reduction, eps, tshape, tdtype, normalize)


def test_without_temperature_grad_the_backward_is_unchanged():
    """An array temperature alone (no ``temperature_grad``): dz as before, the same bits as
    the real's."""
    z = np.random.default_rng(1).standard_normal((8, 4))
    a, ca = cupynce.nt_xent_forward(z, np.asarray(0.4))
    b, cb = cupynce.nt_xent_forward(z, 0.4)
    assert a == b
    np.testing.assert_array_equal(cupynce.nt_xent_backward(ca), cupynce.nt_xent_backward(cb))


def test_a_real_temperature_gets_a_0d_gradient():
    z = np.random.default_rng(2).standard_normal((8, 4))
    _, ctx = cupynce.nt_xent_forward(z, 0.4, temperature_grad=True)
    dz, dt = cupynce.nt_xent_backward(ctx)
    want = ref.nt_xent(z, 0.4, temperature_grad=True)[1][1]
    assert dt.shape == () and dt.dtype == np.float64 and _scalar_err(dt, want) <= 1e-12


def test_bad_temperature_grad_raises():
    with pytest.raises(TypeError, match="nt_xent: temperature_grad must be a bool"):
        cupynce.nt_xent_forward(np.ones((4, 3)), 0.5, temperature_grad=1)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_nt_xent_across_ranks(P, reduction):
    """dτ of the global loss on every rank (the ranks' dots all-reduced; no factor P)."""
    from emulated_ranks import run

    n = 2
    rng = np.random.default_rng(3)
    Z = rng.standard_normal((2 * n * P, 5))
    rows = [np.r_[r * n:(r + 1) * n, n * P + r * n:n * P + (r + 1) * n] for r in range(P)]
    up = rng.uniform(0.5, 1.5, 2 * n * P) if reduction == "none" else 0.7

    def rank(comm):
        idx = rows[comm.rank]
        _, ctx = cupynce.nt_xent_forward(Z[idx], np.asarray(0.3), label_smoothing=0.1,
                                         reduction=reduction, normalize=True,
                                         temperature_grad=True, group=comm)
        return cupynce.nt_xent_backward(ctx, up[idx] if reduction == "none" else up)

    out = run(P, rank)
    _, (wz, wt) = ref.nt_xent(Z, 0.3, label_smoothing=0.1, reduction=reduction,
                              normalize=True, grad_loss=up, temperature_grad=True)
    for r, (dz, dt) in enumerate(out):
        assert _rel(dz / P, wz[rows[r]]) <= 1e-12
        assert _scalar_err(dt, wt) <= 1e-12
    assert len({np.asarray(x[1]).tobytes() for x in out}) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,n,d", [("float64", 64, 32), ("float32", 512, 64),
                                       ("bfloat16", 512, 64), ("bfloat16", 256, 4096)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_nt_xent_cupy_device_temperature(dtype, n, d, reduction, eps):
    cp = pytest.importorskip("cupy")
    _check_nt_xent(cp, dtype, n, d, reduction, eps, (), np.float32)


# ---- cupynce.torch ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["direct", "registered", "compile"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_nt_xent(path, reduction):
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct
    from cupynce.torch import _registry

    z0 = np.random.default_rng(4).standard_normal((10, 6))
    z = torch.tensor(z0, requires_grad=True)
    t = torch.tensor([0.25], dtype=torch.float64, requires_grad=True)
    kw = dict(label_smoothing=0.1, reduction=reduction, normalize=True)

    def f(z, t):
        return ct.nt_xent(z, t, **kw)
    if path == "compile":
        torch._dynamo.reset()
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(z, t)
    elif path == "registered":
        real = _registry.direct
        _registry.direct = lambda *tensors: False
        try:
            out = f(z, t)
        finally:
            _registry.direct = real
    else:
        out = f(z, t)
    gl = (torch.linspace(0.5, 1.5, 10, dtype=torch.float64) if reduction == "none" else
          torch.tensor(0.7, dtype=torch.float64))
    dz, dt = torch.autograd.grad(out, [z, t], gl)
    want, (wz, wt) = ref.nt_xent(z0, 0.25, grad_loss=gl.numpy(), temperature_grad=True, **kw)
    assert _rel(out.detach().numpy(), want) <= 1e-12
    assert _rel(dz.numpy(), wz) <= 1e-12
    assert dt.shape == (1,) and _scalar_err(dt.numpy(), wt) <= 1e-12


def test_torch_module_learns_its_temperature():
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct

    torch.manual_seed(0)
    m = ct.NTXentLoss(0.5, learnable=True, normalize=True)
    z = torch.randn(16, 8, dtype=torch.float64)
    assert "learnable=True" in repr(m)
    loss = m(z)
    loss.backward()
    want, (_, wt) = ref.nt_xent(z.numpy(), 0.5, normalize=True, temperature_grad=True)
    # d loss / d log τ = τ · d loss / d τ
    assert _scalar_err(m.log_temperature.grad.numpy(), 0.5 * wt) <= 1e-6
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = float(m.log_temperature)
    opt.step()
    assert float(m.log_temperature) != before
    assert ct.NTXentLoss(0.5).learnable is False and not list(ct.NTXentLoss(0.5).parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_torch_cuda_nt_xent(dtype, tol):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    import cupynce.torch as ct

    z0 = np.random.default_rng(6).standard_normal((512, 64)) / 8
    z = torch.tensor(z0, device="cuda", dtype=getattr(torch, dtype), requires_grad=True)
    t = torch.tensor(0.2, device="cuda", requires_grad=True)
    out = ct.nt_xent(z, t, normalize=True)
    dz, dt = torch.autograd.grad(out, [z, t])
    zr = z.detach().double().cpu().numpy()
    want, (wz, wt) = ref.nt_xent(zr, float(t), normalize=True, temperature_grad=True)
    assert _rel(out.detach().double().cpu().numpy(), want) <= tol
    assert _rel(dz.double().cpu().numpy(), wz) <= tol
    assert _scalar_err(dt.double().cpu().numpy(), wt) <= tol


# ---- SupCon ----------------------------------------------------------------------------------
def _check_supcon(xp, dtype, n, d, reduction, tshape, tdtype):
    dt = np.dtype(dtype) if dtype != "bfloat16" else __import__("ml_dtypes").bfloat16
    rng = np.random.default_rng(n + 2 * d)
    lab = rng.integers(0, max(2, n // 4), n)
    z = (rng.standard_normal((n, d)) / np.sqrt(d)).astype(dt)
    t0 = np.asarray(0.2, tdtype).reshape(tshape)
    tau = float(t0.reshape(()))
    g = 0.7 if reduction != "none" else rng.uniform(0.2, 1.5, n)
    want, (wz, wt) = ref.supcon_loss(z, lab, tau, reduction=reduction, normalize=True,
                                     grad_loss=g, temperature_grad=True)
    acc = np.float64 if dt == np.float64 else np.float32
    gl = g if reduction != "none" else xp.asarray(g.astype(acc))
    loss, ctx = cupynce.supcon_forward(xp.asarray(z), xp.asarray(lab), xp.asarray(t0),
                                       reduction=reduction, normalize=True,
                                       temperature_grad=True)
    dz, dtau = cupynce.supcon_backward(ctx, gl)
    host = (lambda x: x) if xp is np else xp.asnumpy
    tol = max(TOL[dtype], 1e-6 if np.dtype(tdtype) == np.float32 else 0)
    assert _rel(host(loss), want) <= TOL[dtype], "loss"
    assert _rel(host(dz).astype(np.float64), wz) <= TOL[dtype], "dz"
    assert dtau.shape == t0.shape and dtau.dtype == t0.dtype
    assert _scalar_err(host(dtau), wt) <= tol, "dtemperature"
    if reduction == "none":
        again = cupynce.supcon_backward_from_stats(
            xp.asarray(z), ctx.stats[0], gl, labels=xp.asarray(lab), temperature=xp.asarray(t0),
            reduction=reduction, normalize=True, temperature_grad=True)
        assert _scalar_err(host(again[1]), wt) <= tol, "dtemperature from stats"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("tshape,tdtype", [((), np.float64), ((1,), np.float32)])
@pytest.mark.parametrize("n", [12, 13])
def test_supcon_numpy(reduction, tshape, tdtype, n):
    _check_supcon(np, "float64", n, 5, reduction, tshape, tdtype)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_supcon_across_ranks(P, reduction):
    from emulated_ranks import run

    n = 4
    rng = np.random.default_rng(5)
    Z, L = rng.standard_normal((n * P, 5)), rng.integers(0, 3, n * P)
    up = rng.uniform(0.5, 1.5, n * P) if reduction == "none" else 0.7

    def rank(comm):
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        _, ctx = cupynce.supcon_forward(Z[sl], L[sl], np.asarray(0.3), reduction=reduction,
                                        normalize=True, temperature_grad=True, group=comm)
        return cupynce.supcon_backward(ctx, up[sl] if reduction == "none" else up)

    out = run(P, rank)
    _, (wz, wt) = ref.supcon_loss(Z, L, 0.3, reduction=reduction, normalize=True,
                                  grad_loss=up, temperature_grad=True)
    for r, (dz, dt) in enumerate(out):
        assert _rel(dz / P, wz[r * n:(r + 1) * n]) <= 1e-12
        assert _scalar_err(dt, wt) <= 1e-12


@pytest.mark.parametrize("op", ["nt_xent", "supcon_loss"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_symmetric_schedules_with_a_device_scale(op, reduction, monkeypatch):
    """NT-Xent's and SupCon's global schedules with a temperature the host does not read
    (``Temperature.scale_log``: a GPU array's; here a NumPy one stands in for it, float64):
    the rows prescaled by √(1/τ) (``_global.scaled_rows``) give the host temperature's loss,
    gradients and dL/dτ to 1e-12 (the GPU test below runs the device arrays)."""
    from emulated_ranks import run

    from cupynce.ops import _base, nt_xent as nt_mod, supcon as sc_mod

    real = _base.temperature_input

    def device_like(op_, temperature, xp, like, acc):
        if isinstance(temperature, np.ndarray):  # (as a CuPy array comes: −log τ, unread)
            return _base.Temperature(None, -np.log(temperature.astype(acc).reshape(1)), (),
                                     temperature.dtype, True)
        return real(op_, temperature, xp, like, acc)
    for mod in (nt_mod, sc_mod):
        monkeypatch.setattr(mod, "temperature_input", device_like)
    P, n = 3, 4
    rng = np.random.default_rng(9)
    Z, L = rng.standard_normal((2 * n * P, 5)), rng.integers(0, 3, 2 * n * P)
    up = rng.uniform(0.5, 1.5, 2 * n) if reduction == "none" else 0.7

    def rank(comm, temp):
        sl = slice(comm.rank * 2 * n, (comm.rank + 1) * 2 * n)
        kw = dict(reduction=reduction, normalize=True, temperature_grad=True, group=comm)
        if op == "nt_xent":
            loss, ctx = cupynce.nt_xent_forward(Z[sl], temp, **kw)
            return (loss,) + tuple(cupynce.nt_xent_backward(ctx, up))
        loss, ctx = cupynce.supcon_forward(Z[sl], L[sl], temp, **kw)
        return (loss,) + tuple(cupynce.supcon_backward(ctx, up))

    got = run(P, lambda comm: rank(comm, np.asarray(0.3)))
    want = run(P, lambda comm: rank(comm, 0.3))
    for g, w in zip(got, want):
        assert _rel(g[0], w[0]) <= 1e-12 and _rel(g[1], w[1]) <= 1e-12
        assert _scalar_err(g[2], w[2]) <= 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["info_nce", "nt_xent_pairs", "nt_xent", "supcon_loss"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_device_temperature_with_group(op, dtype, reduction):
    """Every op takes a CuPy temperature with group= (info_nce's and nt_xent_pairs' rows take
    its log scale on the device; NT-Xent's and SupCon's symmetric schedules multiply rows
    prescaled by √(1/τ), ``_global.scaled_rows``): every rank's loss, its rows' P-scaled
    gradient and dL/dτ equal the one process's with the same device temperature, or for
    NT-Xent and SupCon the same ranks' with the host temperature (float32 1e-5, bf16 2e-2:
    the prescaled rows are rounded once more)."""
    cp = pytest.importorskip("cupy")
    from emulated_ranks import run

    P, n, d = 3, 64, 32
    rng = np.random.default_rng(31)
    dt = cp.float32 if dtype == "float32" else None
    import ml_dtypes

    cast = (lambda x: cp.asarray(x.astype(np.float32))) if dt is not None else \
        (lambda x: cp.asarray(x.astype(ml_dtypes.bfloat16)))
    Q, K = cast(rng.standard_normal((P * n, d))), cast(rng.standard_normal((P * n, d)))
    L = cp.asarray(rng.integers(0, 9, P * n))
    t = cp.asarray(np.float32(0.3))
    up = cp.asarray(rng.uniform(0.5, 1.5, P * n).astype(np.float32)) if reduction == "none" \
        else 0.7
    kw = dict(reduction=reduction, normalize=True, temperature_grad=True)

    def call(rows, group=None, temp=t):
        if op == "info_nce":
            loss, ctx = cupynce.info_nce_forward(Q[rows], K[rows], temp, group=group, **kw)
            g = cupynce.info_nce_backward(ctx, up[rows] if reduction == "none" else up)
            return loss, g[0], g[-1]
        if op == "nt_xent":  # (a rank's rows: its two views, as nt_xent takes them)
            loss, ctx = cupynce.nt_xent_forward(cp.concatenate([Q[rows], K[rows]]), temp,
                                                group=group, **kw)
            return (loss,) + tuple(cupynce.nt_xent_backward(
                ctx, cp.concatenate([up[rows]] * 2) if reduction == "none" else up))
        fwd, bwd = ((cupynce.supcon_forward, cupynce.supcon_backward) if op == "supcon_loss"
                    else (cupynce.nt_xent_pairs_forward, cupynce.nt_xent_pairs_backward))
        loss, ctx = fwd(Q[rows], L[rows], temp, group=group, **kw)
        return (loss,) + tuple(bwd(ctx, up[rows] if reduction == "none" else up))

    def share(comm, temp=t):
        return call(slice(comm.rank * n, (comm.rank + 1) * n), comm, temp)

    out = run(P, share, device=0)
    tol = 1e-5 if dtype == "float32" else 2e-2
    if op in ("nt_xent", "supcon_loss"):
        # (their global batch is every rank's rows in the schedule's order: against the same
        # ranks with the host temperature, that path checked against one process elsewhere)
        want = run(P, lambda comm: share(comm, 0.3), device=0)
        for (loss, dz, dtau), (wl, wz, wt) in zip(out, want):
            assert _rel(cp.asnumpy(loss), cp.asnumpy(wl)) <= tol
            assert _rel(cp.asnumpy(dz).astype(np.float64),
                        cp.asnumpy(wz).astype(np.float64)) <= tol
            assert _scalar_err(cp.asnumpy(dtau), cp.asnumpy(wt)) <= tol
        return
    want, wq, wt = call(slice(None))
    for r, (loss, dq, dtau) in enumerate(out):
        sl = slice(r * n, (r + 1) * n)
        w = want[sl] if reduction == "none" else want
        assert _rel(cp.asnumpy(loss), cp.asnumpy(w)) <= 1e-5
        assert _rel(cp.asnumpy(dq).astype(np.float64) / P,
                    cp.asnumpy(wq[sl]).astype(np.float64)) <= tol
        assert _scalar_err(cp.asnumpy(dtau), cp.asnumpy(wt)) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,n,d", [("float64", 64, 32), ("float32", 512, 64),
                                       ("bfloat16", 512, 64), ("bfloat16", 511, 64)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_supcon_cupy_device_temperature(dtype, n, d, reduction):
    cp = pytest.importorskip("cupy")
    _check_supcon(cp, dtype, n, d, reduction, (), np.float32)


@pytest.mark.parametrize("path", ["direct", "registered", "compile"])
def test_torch_supcon(path):
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct
    from cupynce.torch import _registry

    rng = np.random.default_rng(7)
    z0, lab = rng.standard_normal((12, 5)), rng.integers(0, 3, 12)
    z = torch.tensor(z0, requires_grad=True)
    t = torch.tensor(0.25, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor(lab)

    def f(z, t):
        return ct.supcon_loss(z, labels, t, normalize=True)
    if path == "compile":
        torch._dynamo.reset()
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(z, t)
    elif path == "registered":
        real = _registry.direct
        _registry.direct = lambda *tensors: False
        try:
            out = f(z, t)
        finally:
            _registry.direct = real
    else:
        out = f(z, t)
    dz, dt = torch.autograd.grad(out, [z, t])
    want, (wz, wt) = ref.supcon_loss(z0, lab, 0.25, normalize=True, temperature_grad=True)
    assert _rel(out.detach().numpy(), want) <= 1e-12
    assert _rel(dz.numpy(), wz) <= 1e-12
    assert _scalar_err(dt.numpy(), wt) <= 1e-12


def test_torch_supcon_module_learns_its_temperature():
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct

    m = ct.SupConLoss(0.2, learnable=True, normalize=True)
    rng = np.random.default_rng(8)
    z, lab = rng.standard_normal((12, 5)), rng.integers(0, 3, 12)
    m(torch.tensor(z), torch.tensor(lab)).backward()
    _, (_, wt) = ref.supcon_loss(z, lab, 0.2, normalize=True, temperature_grad=True)
    assert _scalar_err(m.log_temperature.grad.numpy(), 0.2 * wt) <= 1e-6


# ---- InfoNCE ---------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("variant", ["plain", "negatives", "labels", "moco"])
def test_info_nce_numpy(reduction, variant):
    """dτ = −(1/τ) Σ q̂·∂L/∂q̂ (degree 1 in the queries) with every kind of candidates."""
    rng = np.random.default_rng(9)
    q, k, u = rng.standard_normal((7, 5)), rng.standard_normal((7, 5)), rng.standard_normal((4, 5))
    kw = {"plain": {}, "negatives": dict(negatives=u),
          "labels": dict(labels=rng.integers(0, 3, 7), label_smoothing=0.1),
          "moco": dict(negatives=u, labels=np.zeros(7, np.int64))}[variant]
    ours = dict(kw)
    if variant == "moco":  # (the oracle's spelling: one label for every row)
        del ours["labels"]
        ours["in_batch_negatives"] = False
    g = rng.uniform(0.5, 1.5, 7) if reduction == "none" else 0.7
    loss, ctx = cupynce.info_nce_forward(q, k, np.asarray([0.3], np.float32),
                                         reduction=reduction, normalize=True,
                                         temperature_grad=True, **ours)
    out = cupynce.info_nce_backward(ctx, g)
    t32 = float(np.float32(0.3))
    want, wg = ref.info_nce(q, k, t32, reduction=reduction, normalize=True, grad_loss=g,
                            temperature_grad=True, **kw)
    assert _rel(loss, want) <= 1e-12
    assert _rel(out[0], wg[0]) <= 1e-12 and _rel(out[1], wg[1]) <= 1e-12
    assert out[-1].shape == (1,) and out[-1].dtype == np.float32
    assert _scalar_err(out[-1], wg[-1]) <= 1e-6


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_info_nce_across_ranks(P, reduction):
    from emulated_ranks import run

    n = 3
    rng = np.random.default_rng(10)
    Q, K = rng.standard_normal((n * P, 5)), rng.standard_normal((n * P, 5))
    up = rng.uniform(0.5, 1.5, n * P) if reduction == "none" else 0.7

    def rank(comm):
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        _, ctx = cupynce.info_nce_forward(Q[sl], K[sl], np.asarray(0.3), reduction=reduction,
                                          normalize=True, temperature_grad=True, group=comm)
        return cupynce.info_nce_backward(ctx, up[sl] if reduction == "none" else up)

    out = run(P, rank)
    _, wg = ref.info_nce(Q, K, 0.3, reduction=reduction, normalize=True, grad_loss=up,
                         temperature_grad=True)
    for r, o in enumerate(out):
        assert _rel(o[0] / P, wg[0][r * n:(r + 1) * n]) <= 1e-12
        assert _scalar_err(o[-1], wg[-1]) <= 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_info_nce_cupy_device_temperature(dtype, reduction):
    cp = pytest.importorskip("cupy")
    dt = np.dtype(dtype) if dtype != "bfloat16" else __import__("ml_dtypes").bfloat16
    rng = np.random.default_rng(11)
    q, k = ((rng.standard_normal((512, 64)) / 8).astype(dt) for _ in range(2))
    g = 0.7 if reduction != "none" else rng.uniform(0.2, 1.5, 512)
    want, wg = ref.info_nce(q, k, 0.2, reduction=reduction, normalize=True, grad_loss=g,
                            temperature_grad=True)
    acc = np.float64 if dt == np.float64 else np.float32
    loss, ctx = cupynce.info_nce_forward(cp.asarray(q), cp.asarray(k), cp.asarray(0.2, acc),
                                         reduction=reduction, normalize=True,
                                         temperature_grad=True)
    out = cupynce.info_nce_backward(ctx, g if reduction != "none" else cp.asarray(g.astype(acc)))
    tol = TOL[dtype]
    assert _rel(cp.asnumpy(loss), want) <= tol
    assert _rel(cp.asnumpy(out[0]).astype(np.float64), wg[0]) <= tol
    assert _scalar_err(cp.asnumpy(out[-1]), wg[-1]) <= max(tol, 1e-6)


@pytest.mark.parametrize("path", ["direct", "registered", "compile"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_info_nce(path, reduction):
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct
    from cupynce.torch import _registry

    rng = np.random.default_rng(12)
    q0, k0, u0 = rng.standard_normal((6, 5)), rng.standard_normal((6, 5)), rng.standard_normal((4, 5))
    q, k, u = (torch.tensor(x, requires_grad=True) for x in (q0, k0, u0))
    t = torch.tensor(0.25, dtype=torch.float64, requires_grad=True)

    def f(q, k, u, t):
        return ct.info_nce(q, k, t, negatives=u, reduction=reduction, normalize=True)
    if path == "compile":
        torch._dynamo.reset()
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, u, t)
    elif path == "registered":
        real = _registry.direct
        _registry.direct = lambda *tensors: False
        try:
            out = f(q, k, u, t)
        finally:
            _registry.direct = real
    else:
        out = f(q, k, u, t)
    gl = (torch.linspace(0.5, 1.5, 6, dtype=torch.float64) if reduction == "none" else
          torch.tensor(0.7, dtype=torch.float64))
    grads = torch.autograd.grad(out, [q, k, u, t], gl)
    want, wg = ref.info_nce(q0, k0, 0.25, negatives=u0, reduction=reduction, normalize=True,
                            grad_loss=gl.numpy(), temperature_grad=True)
    assert _rel(out.detach().numpy(), want) <= 1e-12
    for x, w in zip(grads[:3], wg[:3]):
        assert _rel(x.numpy(), w) <= 1e-12
    assert _scalar_err(grads[3].numpy(), wg[3]) <= 1e-12


def test_torch_info_nce_module_learns_its_temperature():
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct

    m = ct.InfoNCE(0.2, learnable=True)
    rng = np.random.default_rng(13)
    q, k = rng.standard_normal((6, 5)), rng.standard_normal((6, 5))
    m(torch.tensor(q), torch.tensor(k)).backward()
    _, wg = ref.info_nce(q, k, 0.2, normalize=True, temperature_grad=True)
    assert _scalar_err(m.log_temperature.grad.numpy(), 0.2 * wg[-1]) <= 1e-6
    assert "learnable=True" in repr(m)


def check_tensor_temperature_with_group(rank, world):
    """A learnable (CPU tensor) temperature with group= over gloo: every rank's loss is the
    single process's on the concatenated batch, its rows' gradient P times that one's, and
    dL/dτ the global loss's on every rank (float64, 1e-12)."""
    import torch
    import torch.distributed as dist

    import cupynce.torch as ct

    n, d = 4, 3
    g = torch.Generator().manual_seed(5)  # (the same global batch on every rank)
    A, B = (torch.randn(world * n, d, generator=g, dtype=torch.float64) for _ in range(2))
    lab = torch.randint(0, 3, (world * n,), generator=g)
    mine = slice(rank * n, (rank + 1) * n)
    calls = {
        "nt_xent": (lambda a, b, y, t, **kw: ct.nt_xent(torch.cat([a, b]), t, normalize=True,
                                                          **kw)),
        "info_nce": (lambda a, b, y, t, **kw: ct.info_nce(a, b, t, normalize=True, **kw)),
        "supcon_loss": (lambda a, b, y, t, **kw: ct.supcon_loss(a, y, t, normalize=True,
                                                                **kw)),
        "nt_xent_pairs": (lambda a, b, y, t, **kw: ct.nt_xent_pairs(a, y, t, normalize=True,
                                                                    **kw)),
    }
    for name, f in calls.items():
        a, b = A[mine].clone().requires_grad_(), B[mine].clone().requires_grad_()
        t = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
        loss = f(a, b, lab[mine], t, group=dist.group.WORLD)
        loss.backward()
        a1, b1 = A.clone().requires_grad_(), B.clone().requires_grad_()
        t1 = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
        want = f(a1, b1, lab, t1)
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=0, msg=name)
        torch.testing.assert_close(a.grad, world * a1.grad[mine], rtol=1e-10, atol=1e-14,
                                   msg=name)
        torch.testing.assert_close(t.grad, t1.grad, rtol=1e-10, atol=1e-14, msg=name)
        if name in ("nt_xent", "info_nce"):
            torch.testing.assert_close(b.grad, world * b1.grad[mine], rtol=1e-10, atol=1e-14,
                                       msg=name)


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_temperature_with_group_over_gloo(world):
    pytest.importorskip("torch")
    from test_torch_distributed import run_ranks

    run_ranks(world, ["check_tensor_temperature_with_group"],
              module="test_learnable_temperature")


def test_ranks_with_different_host_temperatures_raise_on_every_rank():
    """NumPy scalars, ints and host arrays are compared across ranks like floats."""
    from emulated_ranks import run

    z = np.random.default_rng(14).standard_normal((8, 4))
    for pair in ((np.float32(0.3), np.float32(0.4)), (1, 2), (np.asarray(0.3), np.asarray(0.4))):
        def rank(comm, pair=pair):
            with pytest.raises(ValueError, match="must pass the same settings"):
                cupynce.nt_xent_forward(z[4 * comm.rank:4 * comm.rank + 4], pair[comm.rank],
                                        group=comm)
            return True

        assert run(2, rank) == [True, True]


def test_supcon_module_base_temperature_follows_the_learnt_one():
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct

    rng = np.random.default_rng(15)
    z, lab = torch.tensor(rng.standard_normal((12, 5))), torch.tensor(rng.integers(0, 3, 12))
    plain = ct.SupConLoss(0.2, normalize=True)(z, lab)
    m = ct.SupConLoss(0.2, learnable=True, base_temperature=0.1, normalize=True)
    torch.testing.assert_close(m(z, lab).double(), plain.double() * 2.0, rtol=1e-6, atol=0)
    assert "base_temperature=0.1" in repr(m)
