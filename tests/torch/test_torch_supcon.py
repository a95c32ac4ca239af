"""``cupynce.torch.supcon_loss``, ``SupConLoss`` and pytorch-metric-learning's drop-in
(issue 55) against the float64 oracle and the library's class: CPU tensors through the direct
Function, the registered ops and ``torch.compile`` (float64, 1e-12); CUDA marked ``gpu``
(float32 1e-5, bfloat16 3e-2, relative)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupynce.torch as ct  # noqa: E402
from cupynce import reference as ref  # noqa: E402


def _rel(x, r):
    x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
    return float(np.linalg.norm(x - r) / max(np.linalg.norm(r), 1e-300))


def _batch(n=20, d=6, seed=4):
    rng = np.random.default_rng(seed)
    lab = rng.integers(0, 6, n)
    lab[0] = 100  # (an anchor without a positive)
    return rng.standard_normal((n, d)), lab


@pytest.mark.parametrize("path", ["direct", "registered", "compile"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cpu_matches_the_oracle(path, reduction):
    from cupynce.torch import _registry

    z0, lab = _batch()
    z = torch.tensor(z0, requires_grad=True)
    labels = torch.tensor(lab)
    kw = dict(reduction=reduction, normalize=True)
    if path == "compile":
        torch._dynamo.reset()
        out = torch.compile(lambda z, y: ct.supcon_loss(z, y, 0.2, **kw), backend="aot_eager",
                            fullgraph=True)(z, labels)
    elif path == "registered":
        real = _registry.direct
        _registry.direct = lambda *tensors: False
        try:
            out = ct.supcon_loss(z, labels, 0.2, **kw)
        finally:
            _registry.direct = real
    else:
        out = ct.supcon_loss(z, labels, 0.2, **kw)
    gl = (torch.linspace(0.5, 1.5, 20, dtype=torch.float64) if reduction == "none" else
          torch.tensor(0.7, dtype=torch.float64))
    (dz,) = torch.autograd.grad(out, [z], gl)
    want, (wz,) = ref.supcon_loss(z0, lab, 0.2, grad_loss=gl.numpy(), **kw)
    assert _rel(out.detach().numpy(), want) <= 1e-12
    assert _rel(dz.numpy(), wz) <= 1e-12


@pytest.mark.parametrize("grad", [False, True])
def test_registered_mean_without_the_fused_gradient(grad):
    """The registered forward's per-row path (no fused gradient: grad mode off, or compiled
    with the gradient taken by the backward op) reduces over the anchors with a positive."""
    from cupynce.torch.ops import supcon as op

    z0, lab = _batch()
    z, labels = torch.tensor(z0), torch.tensor(lab)
    loss = op.fwd(z, None, 0.2, labels, "mean", False, None, None, False)[0]
    want, _ = ref.supcon_loss(z0, lab, 0.2)
    assert _rel(loss.numpy(), want) <= 1e-12


def test_module_layouts_and_base_temperature():
    """(N, D) with labels; (B, V, D) as the reference code (views stacked view-major, labels
    repeated; None: each sample its class); ``base_temperature`` scales the loss."""
    rng = np.random.default_rng(2)
    f = rng.standard_normal((5, 3, 4))
    lab = np.array([0, 1, 0, 2, 1])
    flat, flat_lab = np.concatenate([f[:, v] for v in range(3)]), np.tile(lab, 3)
    want = ref.supcon_loss(flat, flat_lab, 0.1, normalize=True)[0]
    m = ct.SupConLoss(0.1, normalize=True)
    assert _rel(m(torch.tensor(f), torch.tensor(lab)).numpy(), want) <= 1e-12
    assert _rel(m(torch.tensor(flat), torch.tensor(flat_lab)).numpy(), want) <= 1e-12
    simclr = ref.supcon_loss(flat, np.tile(np.arange(5), 3), 0.1, normalize=True)[0]
    assert _rel(m(torch.tensor(f)).numpy(), simclr) <= 1e-12
    scaled = ct.SupConLoss(0.1, base_temperature=0.07, normalize=True)
    assert _rel(scaled(torch.tensor(f), torch.tensor(lab)).numpy(), want * 0.1 / 0.07) <= 1e-12
    assert "base_temperature=0.07" in repr(scaled)
    with pytest.raises(ValueError, match=r"SupConLoss: with features \(B, V, D\)"):
        m(torch.tensor(f), torch.tensor(lab[:3]))
    with pytest.raises(ValueError, match="SupConLoss: temperature"):
        ct.SupConLoss(0.0)


def test_bad_input_raises():
    z = torch.ones(6, 3)
    with pytest.raises(TypeError, match="supcon_loss: labels is required"):
        ct.supcon_loss(z, None)
    with pytest.raises(ValueError, match=r"supcon_loss: labels must be an integer array"):
        ct.supcon_loss(z, torch.zeros(6))
    with pytest.raises(ValueError, match="supcon_loss: group=.* needs torch.distributed"):
        ct.supcon_loss(z, torch.zeros(6, dtype=torch.long), group=object())


def check_supcon_across_ranks(rank, world):
    """Each rank's rows and labels through ``group=``: the global loss of the concatenated
    batch, and world times its gradient for the rank's rows (DDP's convention); labels in 3
    classes, so that a row's positives sit on other ranks."""
    import torch.distributed as dist

    n = 4
    gen = torch.Generator().manual_seed(5)
    Z = torch.randn(n * world, 5, generator=gen, dtype=torch.float64)
    L = torch.randint(0, 3, (n * world,), generator=gen)
    mine = slice(rank * n, (rank + 1) * n)
    for reduction in ("mean", "none"):
        z = Z[mine].clone().requires_grad_()
        loss = ct.supcon_loss(z, L[mine], 0.3, reduction=reduction, normalize=True,
                              group=dist.group.WORLD)
        zs = Z.clone().requires_grad_()
        want = ct.supcon_loss(zs, L, 0.3, reduction=reduction, normalize=True)
        up = torch.linspace(0.5, 1.5, n * world, dtype=torch.float64) \
            if reduction == "none" else torch.tensor(0.7, dtype=torch.float64)
        loss.backward(up[mine] if reduction == "none" else up)
        want.backward(up)
        torch.testing.assert_close(loss, want[mine] if reduction == "none" else want,
                                   rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(z.grad, world * zs.grad[mine], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("world", [2, 3])
def test_supcon_across_ranks_over_gloo(world):
    from test_torch_distributed import run_ranks

    run_ranks(world, ["check_supcon_across_ranks"], module="test_torch_supcon")


# ---- pytorch-metric-learning's SupConLoss --------------------------------------------------
@pytest.mark.parametrize("n,classes", [(24, 6), (17, 3), (8, 8)])
def test_pml_supcon_drop_in(n, classes):
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    from cupynce.integrations.pytorch_metric_learning import SupConLoss

    rng = np.random.default_rng(n)
    z0, lab = rng.standard_normal((n, 5)), torch.tensor(rng.integers(0, classes, n))
    outs = []
    for cls in (pml.SupConLoss(temperature=0.15), SupConLoss(temperature=0.15)):
        z = torch.tensor(z0, requires_grad=True)
        loss = cls(z, lab)
        (dz,) = torch.autograd.grad(loss, [z])
        outs.append((loss.detach().numpy(), dz.numpy()))
    if not outs[0][0]:  # (no positive pair: both 0, zero gradients)
        assert not outs[1][0] and not outs[1][1].any() and not outs[0][1].any()
        return
    assert _rel(outs[1][0], outs[0][0]) <= 1e-12
    assert _rel(outs[1][1], outs[0][1]) <= 1e-12


@pytest.mark.parametrize("n,classes", [(24, 6), (17, 3), (8, 8), (6, 1)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pml_ntxent_drop_in(n, classes, device):
    """pytorch-metric-learning's NTXentLoss(embeddings, labels): value and gradient as the
    library's, float64 (on CUDA too: the row_pairs kernel; classes=1: no negative, 0)."""
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    from cupynce.integrations.pytorch_metric_learning import NTXentLoss

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    rng = np.random.default_rng(n + classes)
    z0 = rng.standard_normal((n, 5))
    lab = torch.tensor(rng.integers(0, classes, n), device=device)
    outs = []
    for cls in (pml.NTXentLoss(temperature=0.2), NTXentLoss(temperature=0.2)):
        z = torch.tensor(z0, requires_grad=True, device=device)
        loss = cls(z, lab)
        dz = torch.autograd.grad(loss, [z], allow_unused=True)[0] if loss.requires_grad \
            else None
        outs.append((loss.detach().cpu().numpy(),
                     np.zeros_like(z0) if dz is None else dz.cpu().numpy()))
    assert _rel(outs[1][0], outs[0][0]) <= 1e-12 if outs[0][0] else not outs[1][0]
    assert _rel(outs[1][1], outs[0][1]) <= 1e-12 if outs[0][1].any() else \
        not outs[1][1].any()


def test_pml_drop_in_refuses_other_options():
    from cupynce.integrations.pytorch_metric_learning import SupConLoss

    with pytest.raises(NotImplementedError, match="SupConLoss: distance, reducer"):
        SupConLoss(0.1, distance=object(), reducer=object())
    with pytest.raises(NotImplementedError, match="SupConLoss: indices_tuple="):
        SupConLoss()(torch.ones(4, 2), torch.zeros(4, dtype=torch.long), indices_tuple=(1,))
    from cupynce.integrations.pytorch_metric_learning import NTXentLoss

    with pytest.raises(NotImplementedError, match="NTXentLoss: distance"):
        NTXentLoss(0.1, distance=object())
    with pytest.raises(TypeError, match="NTXentLoss: labels are required"):
        NTXentLoss()(torch.ones(4, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_cuda_matches_the_oracle(dtype, tol):
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    rng = np.random.default_rng(6)
    lab = np.repeat(np.arange(128), 4)
    z0 = (rng.standard_normal((128, 64))[lab] + 0.5 * rng.standard_normal((512, 64))) / 8
    z = torch.tensor(z0, device="cuda", dtype=getattr(torch, dtype), requires_grad=True)
    labels = torch.tensor(lab, device="cuda")
    for reduction in ("mean", "none"):
        out = ct.supcon_loss(z, labels, 0.1, normalize=True, reduction=reduction)
        (dz,) = torch.autograd.grad(out.sum(), [z])
        zr = z.detach().double().cpu().numpy()
        want, (wz,) = ref.supcon_loss(zr, lab, 0.1, normalize=True, reduction=reduction,
                                      grad_loss=None if reduction == "mean" else np.ones(512))
        assert _rel(out.detach().double().cpu().numpy(), want) <= tol
        assert _rel(dz.double().cpu().numpy(), wz) <= tol


@pytest.mark.parametrize("which", ["fwd_mean", "fwd_none", "fwd_tensor_temperature", "bwd"])
def test_opcheck(which):
    """``torch.library.opcheck`` of the registered ops (schemas, fake shapes, autograd)."""
    from cupynce.torch import _registry

    if not _registry.HAS_CUSTOM_OPS:
        pytest.skip("torch without custom ops")
    from cupynce.torch.ops import supcon as op

    z0, lab = _batch(8, 3, seed=9)
    z, labels = torch.tensor(z0), torch.tensor(lab)
    leaf = z.clone().requires_grad_()
    if which == "fwd_mean":
        args = (leaf, None, 0.2, labels, "mean", True, None, None, True)
        name = "supcon_loss_fwd"
    elif which == "fwd_none":
        args = (leaf, None, 0.2, labels, "none", False, None, None, False)
        name = "supcon_loss_fwd"
    elif which == "fwd_tensor_temperature":
        args = (leaf, torch.tensor(0.2, dtype=torch.float64, requires_grad=True), 0.0, labels,
                "mean", True, None, None, True)
        name = "supcon_loss_fwd"
    else:
        lse = op.FWD(z, None, 0.2, labels, "none", False, None, None, False)[1]
        args = (z, None, 0.2, labels, lse, torch.ones(8, dtype=torch.float64), "none", False,
                None, None)
        name = "supcon_loss_bwd"
    torch.library.opcheck(getattr(torch.ops.cupynce, name).default, args)
