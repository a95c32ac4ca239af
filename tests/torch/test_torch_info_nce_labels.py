"""``cupynce.torch.info_nce(labels=, label_smoothing=)`` (issue 55) against the float64 oracle.

Every way a call runs: the direct eager Function, the registered custom ops (forced), and
``torch.compile`` (aot_eager, fullgraph); fused ("mean" / "sum") and per-row ("none", the
backward op recomputing from the row statistics with the labels). CPU tensors in float64 to
1e-12 (relative); CUDA (marked ``gpu``) float32 to 1e-5 and bfloat16 to 3e-2. Bad labels are
refused before any kernel; with ``group=`` they are refused on every rank (gloo).
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


def check_labels_refused_with_group(rank, world):
    import torch.distributed as dist

    q = torch.randn(4, D, requires_grad=True)
    with pytest.raises(ValueError, match="not supported with group= yet|invalid inputs on "
                                         r"rank\(s\)"):
        ct.info_nce(q, q, 0.3, labels=torch.arange(4) if rank == 0 else None,
                    group=dist.group.WORLD)


def test_group_refuses_labels_on_every_rank():
    from test_torch_distributed import run_ranks

    run_ranks(2, ["check_labels_refused_with_group"], module="test_torch_info_nce_labels")
