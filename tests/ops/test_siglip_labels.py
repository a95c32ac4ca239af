"""``siglip_loss(labels=)`` (issue 55: pairs of one label are positives) against the float64
oracle (``cupynce.reference.siglip_loss(labels=)``), on every path.

The labels are an O(N·D) difference from the plain loss (``cupynce.ops._variants.
siglip_labels``: −log σ(x) = −log σ(−x) − x, class sums in a fixed order), so the GPU cases
take the sizes at which the plain loss takes each path: the row blocks (float64), the float32
products, the 16-bit score tiles (N = 512).  NumPy on the CPU (CI); CuPy and CUDA tensors
marked ``gpu``.  Across ranks: tests/distributed/test_global_emulated.py.  Relative errors ``||x - ref|| / ||ref||``: float64 1e-12, float32 1e-5,
float16 5e-3, bfloat16 3e-2 (the scale's and bias's gradients: that times max(|ref|, 1)).
"""
from __future__ import annotations

import numpy as np
import pytest

from cupynce import reference as ref
from cupynce.ops import siglip as core
# (tests/_support, on sys.path by conftest)
from numerics import TOL, dtype_of as _dtype, rel as _rel, scalar_err as _scalar_err


def _check(xp, dtype, n, d, reduction, normalize, classes, learnable):
    dt = _dtype(dtype)
    rng = np.random.default_rng(n + d + classes)
    lab = rng.integers(0, classes, n) * 7 - 3
    centre = rng.standard_normal((classes, d))
    a = (centre[(lab + 3) // 7] + rng.standard_normal((n, d))) / np.sqrt(d)
    b = (centre[(lab + 3) // 7] + rng.standard_normal((n, d))) / np.sqrt(d)
    a, b = a.astype(dt), b.astype(dt)
    acc = np.float64 if dt == np.float64 else np.float32
    ls0, lb0 = np.log(10.0), -5.0
    g = 0.7 if reduction != "none" else rng.uniform(0.2, 1.5, n)
    want, (wa, wb, wls, wlb) = ref.siglip_loss(a, b, ls0, lb0, labels=lab, reduction=reduction,
                                               normalize=normalize, grad_loss=g)
    ls = xp.asarray(np.asarray([ls0], acc)) if learnable else float(ls0)
    lb = xp.asarray(np.asarray(lb0, acc)) if learnable else lb0
    loss, ctx = core.siglip_loss_forward(xp.asarray(a), xp.asarray(b), ls, lb,
                                         labels=xp.asarray(lab), reduction=reduction,
                                         normalize=normalize)
    gl = g if reduction != "none" else xp.asarray(g.astype(acc))
    da, db, dls, dlb = core.siglip_loss_backward(ctx, gl)
    host = (lambda x: x) if xp is np else xp.asnumpy
    tol = TOL[dtype]
    assert _rel(host(loss), want) <= tol, "loss"
    plain = ref.siglip_loss(a, b, ls0, lb0, reduction=reduction, normalize=normalize)[0]
    if dtype in ("float64", "float32"):  # (the labels move the loss well past the tolerance;
        assert _rel(want, plain) > 10 * tol  # bf16 / fp16's bound need not be below their share)
    assert da.dtype == dt and db.dtype == dt
    assert _rel(host(da).astype(np.float64), wa) <= tol, "da"
    assert _rel(host(db).astype(np.float64), wb) <= tol, "db"
    assert _scalar_err(host(dls), wls) <= tol, "dlogit_scale"
    assert _scalar_err(host(dlb), wlb) <= tol, "dlogit_bias"
    again = core.siglip_loss_backward_from_inputs(
        xp.asarray(a), xp.asarray(b), ls, lb, gl, labels=xp.asarray(lab), reduction=reduction,
        normalize=normalize)
    assert _rel(host(again[0]).astype(np.float64), wa) <= tol, "da from inputs"
    assert _scalar_err(host(again[3]), wlb) <= tol, "dlogit_bias from inputs"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("classes", [3, 8])
@pytest.mark.parametrize("learnable", [False, True])
def test_numpy_matches_the_oracle(dtype, reduction, normalize, classes, learnable):
    _check(np, dtype, 24, 6, reduction, normalize, classes, learnable)


def test_distinct_labels_are_the_plain_loss():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((10, 4)), rng.standard_normal((10, 4))
    x, cx = core.siglip_loss_forward(a, b, 1.0, -1.0, labels=np.arange(10) * 5)
    y, cy = core.siglip_loss_forward(a, b, 1.0, -1.0)
    assert x == y
    for u, v in zip(core.siglip_loss_backward(cx), core.siglip_loss_backward(cy)):
        np.testing.assert_array_equal(u, v)


def test_bad_labels_raise():
    a = np.ones((4, 3))
    with pytest.raises(ValueError, match=r"siglip_loss: labels must be an integer array of "
                                         r"shape \(4,\), got float64"):
        core.siglip_loss(a, a, 1.0, 0.0, labels=np.zeros(4))


def test_ranks_with_and_without_labels_raise_on_every_rank():
    """``group=`` with labels is the global batch's (tests/distributed); a rank without them
    beside one with them: every rank raises."""
    from emulated_ranks import run

    a = np.random.default_rng(2).standard_normal((8, 4))

    def rank(comm):
        match = r"every rank of the group must pass the same settings"
        with pytest.raises(ValueError, match=match):
            core.siglip_loss_forward(a[4 * comm.rank:4 * comm.rank + 4],
                                     a[4 * comm.rank:4 * comm.rank + 4], 1.0, 0.0, group=comm,
                                     labels=np.zeros(4, np.int64) if comm.rank == 0 else None)
        return True

    assert run(2, rank) == [True, True]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,n,d", [("float64", 64, 32), ("float32", 512, 64),
                                       ("bfloat16", 512, 64), ("float16", 512, 64),
                                       ("bfloat16", 1000, 128)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("learnable", [False, True])
def test_cupy_matches_the_oracle_on_every_path(dtype, n, d, reduction, learnable):
    cp = pytest.importorskip("cupy")
    _check(cp, dtype, n, d, reduction, True, 16, learnable)


# ---- cupynce.torch ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["direct", "registered", "compile"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_cpu_matches_the_oracle(path, reduction):
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct
    from cupynce.torch import _registry

    rng = np.random.default_rng(4)
    a0, b0, lab = rng.standard_normal((10, 6)), rng.standard_normal((10, 6)), rng.integers(0, 3, 10)
    a, b = torch.tensor(a0, requires_grad=True), torch.tensor(b0, requires_grad=True)
    ls = torch.tensor(1.2, dtype=torch.float64, requires_grad=True)
    lb = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor(lab)
    kw = dict(reduction=reduction, normalize=True)

    def f(a, b, ls, lb, labels):
        return ct.siglip_loss(a, b, ls, lb, labels=labels, **kw)
    if path == "compile":
        torch._dynamo.reset()
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(a, b, ls, lb, labels)
    elif path == "registered":
        real = _registry.direct
        _registry.direct = lambda *tensors: False
        try:
            out = f(a, b, ls, lb, labels)
        finally:
            _registry.direct = real
    else:
        out = f(a, b, ls, lb, labels)
    gl = (torch.linspace(0.5, 1.5, 10, dtype=torch.float64) if reduction == "none" else
          torch.tensor(0.7, dtype=torch.float64))
    grads = torch.autograd.grad(out, [a, b, ls, lb], gl)
    want, wgrads = ref.siglip_loss(a0, b0, 1.2, -2.0, labels=lab, grad_loss=gl.numpy(), **kw)
    assert _rel(out.detach().numpy(), want) <= 1e-12
    for g, w in zip(grads, wgrads):
        assert _rel(g.numpy(), w) <= 1e-12


@pytest.mark.gpu
def test_torch_cuda_matches_the_oracle():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    import cupynce.torch as ct

    rng = np.random.default_rng(6)
    lab = rng.integers(0, 32, 512)
    a0, b0 = rng.standard_normal((512, 64)) / 8, rng.standard_normal((512, 64)) / 8
    a = torch.tensor(a0, device="cuda", dtype=torch.float32, requires_grad=True)
    b = torch.tensor(b0, device="cuda", dtype=torch.float32, requires_grad=True)
    out = ct.siglip_loss(a, b, 2.3, -10.0, labels=torch.tensor(lab, device="cuda"),
                         normalize=True)
    da, db = torch.autograd.grad(out, [a, b])
    want, (wa, wb, _, _) = ref.siglip_loss(a0, b0, 2.3, -10.0, labels=lab, normalize=True)
    assert _rel(out.detach().double().cpu().numpy(), want) <= 1e-5
    assert _rel(da.double().cpu().numpy(), wa) <= 1e-5
    assert _rel(db.double().cpu().numpy(), wb) <= 1e-5
