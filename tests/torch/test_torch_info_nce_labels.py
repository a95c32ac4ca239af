"""``cupynce.torch.info_nce(labels=, label_smoothing=)`` (issue 55) against the float64 oracle.

Every way a call runs: the direct eager Function, the registered custom ops (forced), and
``torch.compile`` (aot_eager, fullgraph); fused ("mean" / "sum") and per-row ("none", the
backward op recomputing from the row statistics with the labels). CPU tensors in float64 to
1e-12 (relative); CUDA (marked ``gpu``) float32 to 1e-5 and bfloat16 to 3e-2. Bad labels are
refused before any kernel; over gloo (2 and 3 processes) ``group=`` gives the loss of the
concatenated batch and DDP's convention of its gradients.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupynce.torch as ct  # noqa: E402
from cupynce import reference as ref  # noqa: E402
from cupynce.torch import _registry  # noqa: E402

LABELS = [0, 1, 0, 2, 1, 0, 3, 1, 2, 4]
N, D = 10, 6


def _rel(x, r):
    x = x.detach().double().cpu().numpy()
    return float(np.linalg.norm(x - r) / np.linalg.norm(r))


def _run(path, q, k, neg, labels, eps, reduction):
    kw = dict(negatives=neg, labels=labels, label_smoothing=eps, reduction=reduction,
              normalize=True)
    if path == "compile":
        torch._dynamo.reset()  # (one lambda for every case: past dynamo's recompile limit)
        fn = torch.compile(lambda q, k, neg: ct.info_nce(q, k, 0.3, **{**kw, "negatives": neg}),
                           backend="aot_eager", fullgraph=True)
        return fn(q, k, neg)
    if path == "registered":
        real = _registry.direct
        _registry.direct = lambda *tensors: False
        try:
            return ct.info_nce(q, k, 0.3, **kw)
        finally:
            _registry.direct = real
    return ct.info_nce(q, k, 0.3, **kw)


def _case(device, dtype, path, negatives, reduction, eps, tol):
    g = torch.Generator().manual_seed(0)
    q0, k0 = torch.randn(N, D, generator=g), torch.randn(N, D, generator=g)
    neg0 = {None: None, "shared": torch.randn(3, D, generator=g),
            "paired": torch.randn(N, 3, D, generator=g)}[negatives]
    leaves = [x.to(device, dtype).requires_grad_() for x in (q0, k0)]
    if neg0 is not None:
        leaves.append(neg0.to(device, dtype).requires_grad_())
    labels = torch.tensor(LABELS, device=device)
    out = _run(path, leaves[0], leaves[1], leaves[2] if neg0 is not None else None, labels,
               eps, reduction)
    gl = torch.full_like(out, 0.7) if reduction != "none" else \
        torch.linspace(-1, 1, N, dtype=out.dtype, device=device)
    grads = torch.autograd.grad(out, leaves, gl)
    to64 = [x.detach().to(dtype).double().cpu().numpy() for x in leaves]
    want, wgrads = ref.info_nce(to64[0], to64[1], 0.3, negatives=to64[2] if neg0 is not None
                                else None, labels=np.array(LABELS), label_smoothing=eps,
                                reduction=reduction, normalize=True,
                                grad_loss=gl.double().cpu().numpy())
    assert _rel(out, want) <= tol
    for got, r in zip(grads, wgrads):
        assert got.dtype == dtype
        assert _rel(got, r) <= tol


@pytest.mark.parametrize("path", ["direct", "registered", "compile"])
@pytest.mark.parametrize("negatives", [None, "shared", "paired"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cpu_matches_the_oracle(path, negatives, reduction, eps):
    _case("cpu", torch.float64, path, negatives, reduction, eps, 1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["direct", "compile"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("negatives", [None, "shared"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_matches_the_oracle(path, dtype, tol, negatives, reduction):
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    _case("cuda", dtype, path, negatives, reduction, 0.1, tol)


def test_the_module_takes_labels_and_smoothing():
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(N, D, generator=g, dtype=torch.float64) for _ in range(2))
    lab = torch.tensor(LABELS)
    mod = ct.InfoNCE(0.3, label_smoothing=0.1)
    assert "label_smoothing=0.1" in repr(mod)
    torch.testing.assert_close(mod(q, k, labels=lab),
                               ct.info_nce(q, k, 0.3, labels=lab, label_smoothing=0.1,
                                           normalize=True), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"InfoNCE: label_smoothing must be in \[0, 1\)"):
        ct.InfoNCE(label_smoothing=-0.5)


def test_bad_labels_are_refused():
    q = torch.randn(N, D, requires_grad=True)
    with pytest.raises(ValueError, match=r"info_nce: labels must be an integer array of "
                                         r"shape \(10,\), got float32"):
        ct.info_nce(q, q, 0.3, labels=torch.zeros(N))
    with pytest.raises(TypeError, match=r"info_nce: labels must be a torch.Tensor, got "
                                        r"builtins.list"):
        ct.info_nce(q, q, 0.3, labels=LABELS)
    with pytest.raises(ValueError, match=r"info_nce: label_smoothing must be in \[0, 1\), "
                                         r"got 1.0"):
        ct.info_nce(q, q, 0.3, label_smoothing=1.0)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="info_nce: all tensors must be on one device"):
            ct.info_nce(q, q, 0.3, labels=torch.tensor(LABELS, device="cuda"))


def check_labels_across_ranks(rank, world):
    """Each rank's rows, their labels and its shared negatives through ``group=``: the global
    loss of the concatenated batch, and world times its gradients for the rank's rows (DDP's
    convention); labels in 3 classes, so that same-label keys sit on other ranks."""
    import torch.distributed as dist

    n, m = 4, 2
    gen = torch.Generator().manual_seed(5)
    Q, K = (torch.randn(n * world, D, generator=gen, dtype=torch.float64) for _ in range(2))
    S = torch.randn(world * m, D, generator=gen, dtype=torch.float64)
    L = torch.randint(0, 3, (n * world,), generator=gen)
    mine = slice(rank * n, (rank + 1) * n)
    for reduction in ("mean", "none"):
        q, k, neg = (x.clone().requires_grad_() for x in (Q[mine], K[mine],
                                                           S[rank * m:(rank + 1) * m]))
        loss = ct.info_nce(q, k, 0.3, negatives=neg, labels=L[mine], label_smoothing=0.1,
                           reduction=reduction, normalize=True, group=dist.group.WORLD)
        qs, ks, ns = (x.clone().requires_grad_() for x in (Q, K, S))
        want = ct.info_nce(qs, ks, 0.3, negatives=ns, labels=L, label_smoothing=0.1,
                           reduction=reduction, normalize=True)
        up = torch.linspace(0.5, 1.5, n * world, dtype=torch.float64) \
            if reduction == "none" else torch.tensor(0.7, dtype=torch.float64)
        loss.backward(up[mine] if reduction == "none" else up)
        want.backward(up)
        torch.testing.assert_close(loss, want[mine] if reduction == "none" else want,
                                   rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(q.grad, world * qs.grad[mine], rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(k.grad, world * ks.grad[mine], rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(neg.grad, world * ns.grad[rank * m:(rank + 1) * m],
                                   rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("world", [2, 3])
def test_labels_across_ranks_over_gloo(world):
    from test_torch_distributed import run_ranks

    run_ranks(world, ["check_labels_across_ranks"], module="test_torch_info_nce_labels")
