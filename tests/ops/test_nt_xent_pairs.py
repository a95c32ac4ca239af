"""``nt_xent_pairs`` (issue 55: pytorch-metric-learning's ``NTXentLoss(embeddings, labels)``)
against the float64 oracle (``cupynce.reference.nt_xent_pairs``, pair by pair), and the oracle
against the library's class under torch autograd.

NumPy on the CPU (CI); CuPy and CUDA tensors marked ``gpu`` (the row blocks' ``row_pairs``
kernel: one block and several).  Relative errors ``||x - ref|| / ||ref||``: float64 1e-12,
float32 1e-5, float16 5e-3, bfloat16 3e-2.  The drop-in class against the library:
tests/integrations/test_pml.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from cupynce import reference as ref
from cupynce.ops import nt_xent_pairs as core
# (tests/_support, on sys.path by conftest)
from numerics import TOL, dtype_of as _dtype

#: labels: classes of several sizes, a singleton (no pair), all one class (no negative)
LABELS = {"mixed": np.array([3, 1, 3, 0, 1, 3, 7, 1, 0, 2]),
          "singletons": np.arange(6), "one_class": np.zeros(5, np.int64)}


def _rel(x, r):
    x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
    nr = np.linalg.norm(r)
    return float(np.linalg.norm(x - r) / nr) if nr else float(np.linalg.norm(x))


@pytest.mark.parametrize("kind", ["mixed", "one_class"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_oracle_is_the_library_under_autograd(kind, reduction):
    """pytorch-metric-learning's NTXentLoss (its MeanReducer: "mean"; its per-pair losses
    summed by anchor for the others), float64, with a tensor temperature for dL/dτ."""
    torch = pytest.importorskip("torch")
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    from pytorch_metric_learning.reducers import DoNothingReducer

    lab = LABELS[kind]
    z = np.random.default_rng(2).standard_normal((lab.size, 5))
    g = np.random.default_rng(3).uniform(0.2, 1.5, lab.size) if reduction == "none" else 0.7
    want, (wz, wt) = ref.nt_xent_pairs(z, lab, 0.1, reduction=reduction, normalize=True,
                                       grad_loss=g, temperature_grad=True)
    Z = torch.tensor(z, requires_grad=True)
    T = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    if reduction == "mean":
        out = pml.NTXentLoss(temperature=T)(Z, torch.tensor(lab))
        (out * g).backward()
        got = out.item()
    else:
        d = pml.NTXentLoss(temperature=T, reducer=DoNothingReducer())(Z, torch.tensor(lab))
        per_row = torch.zeros(lab.size, dtype=torch.float64)
        if isinstance(d, dict) and torch.is_tensor(d["loss"]["losses"]) and \
                d["loss"]["losses"].numel():
            per_row = per_row.index_add(0, d["loss"]["indices"][0], d["loss"]["losses"])
        total = per_row.sum() * g if reduction == "sum" else \
            (per_row * torch.as_tensor(g)).sum()
        if total.requires_grad:  # (no negative anywhere: the library's constant zero)
            total.backward()
        got = per_row.sum().item() if reduction == "sum" else per_row.detach().numpy()
    assert _rel(want, got) <= 1e-12
    assert _rel(wz, Z.grad if Z.grad is not None else np.zeros_like(z)) <= 1e-12
    assert _rel(wt, T.grad if T.grad is not None else 0.0) <= 1e-12


def _check(xp, dtype, kind, reduction, normalize=True, ws=None, labels=None, n_d=None):
    lab = LABELS[kind] if labels is None else labels
    d = 6 if n_d is None else n_d
    z = np.random.default_rng(4).standard_normal((lab.size, d)).astype(_dtype(dtype))
    acc = np.float64 if dtype == "float64" else np.float32
    g = 0.7 if reduction != "none" else np.random.default_rng(5).uniform(0.2, 1.5, lab.size)
    want, (wz,) = ref.nt_xent_pairs(z, lab, 0.2, reduction=reduction, normalize=normalize,
                                    grad_loss=g)
    kw = dict(reduction=reduction, normalize=normalize, workspace_bytes=ws)
    loss, ctx = core.nt_xent_pairs_forward(xp.asarray(z), xp.asarray(lab), 0.2, **kw)
    gl = g if reduction != "none" else xp.asarray(g.astype(acc))
    dz = core.nt_xent_pairs_backward(ctx, gl)
    host = (lambda x: x) if xp is np else xp.asnumpy
    tol = TOL[dtype]
    assert _rel(host(loss), want) <= tol, "loss"
    assert dz.dtype == z.dtype
    assert _rel(host(dz).astype(np.float64), wz) <= tol, "dz"
    again = core.nt_xent_pairs_backward_from_stats(xp.asarray(z), ctx.stats[0], gl,
                                                   labels=xp.asarray(lab), temperature=0.2,
                                                   **kw)
    assert _rel(host(again).astype(np.float64), wz) <= tol, "dz from stats"
    assert core.nt_xent_pairs(xp.asarray(z), xp.asarray(lab), 0.2, **kw).shape == \
        (() if reduction != "none" else (lab.size,))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", list(LABELS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
def test_numpy_matches_the_oracle(dtype, kind, reduction, normalize):
    _check(np, dtype, kind, reduction, normalize)


def test_numpy_row_blocks():
    _check(np, "float64", "mixed", "mean", ws=3 * 10 * 8)


@pytest.mark.parametrize("g", [1.0, 0.5, np.asarray(0.5)])
def test_none_with_a_scalar_upstream_gradient(g):
    """reduction="none" with a real (the default) or 0-d upstream gradient: every row's
    weight (from the context and from the statistics alike)."""
    lab = LABELS["mixed"]
    z = np.random.default_rng(12).standard_normal((lab.size, 4))
    want, (wz,) = ref.nt_xent_pairs(z, lab, 0.5, reduction="none", normalize=True,
                                    grad_loss=np.full(lab.size, float(g)))
    loss, ctx = core.nt_xent_pairs_forward(z, lab, 0.5, reduction="none", normalize=True)
    assert _rel(core.nt_xent_pairs_backward(ctx, g), wz) <= 1e-12
    got = core.nt_xent_pairs_backward_from_stats(z, ctx.stats[0], g, labels=lab,
                                                 temperature=0.5, reduction="none",
                                                 normalize=True)
    assert _rel(got, wz) <= 1e-12


def test_temperature_gradient():
    z = np.random.default_rng(6).standard_normal((10, 4))
    lab = LABELS["mixed"]
    want, (wz, wt) = ref.nt_xent_pairs(z, lab, 0.3, normalize=True, temperature_grad=True)
    loss, ctx = core.nt_xent_pairs_forward(z, lab, np.asarray(0.3), normalize=True,
                                           temperature_grad=True)
    dz, dt = core.nt_xent_pairs_backward(ctx)
    assert _rel(loss, want) <= 1e-12 and _rel(dz, wz) <= 1e-12 and _rel(dt, wt) <= 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", list(LABELS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cupy_matches_the_oracle(dtype, kind, reduction):
    import cupy as cp

    _check(cp, dtype, kind, reduction)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cupy_large_rows_several_blocks(dtype):
    import cupy as cp

    lab = np.random.default_rng(7).integers(0, 60, 400)
    _check(cp, dtype, "mixed", "mean", ws=50 * 400 * 6, labels=lab, n_d=64)


def test_torch_matches_the_oracle():
    torch = pytest.importorskip("torch")
    import cupynce.torch as C

    lab = LABELS["mixed"]
    z = np.random.default_rng(8).standard_normal((lab.size, 5))
    want, (wz, wt) = ref.nt_xent_pairs(z, lab, 0.1, normalize=True, temperature_grad=True)
    Z = torch.tensor(z, requires_grad=True)
    T = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    loss = C.nt_xent_pairs(Z, torch.tensor(lab), T, normalize=True)
    loss.backward()
    assert _rel(loss.item(), want) <= 1e-12
    assert _rel(Z.grad, wz) <= 1e-12 and _rel(T.grad, wt) <= 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_cuda_matches_the_oracle(dtype):
    torch = pytest.importorskip("torch")
    import cupynce.torch as C

    lab = np.random.default_rng(9).integers(0, 16, 96)
    Z = torch.randn(96, 32, device="cuda", dtype=getattr(torch, dtype), requires_grad=True)
    want, (wz,) = ref.nt_xent_pairs(Z.detach().double().cpu().numpy(), lab, 0.07,
                                    normalize=True)
    loss = C.nt_xent_pairs(Z, torch.tensor(lab, device="cuda"), normalize=True)
    loss.backward()
    assert _rel(loss.item(), want) <= TOL[dtype]
    assert _rel(Z.grad.double().cpu(), wz) <= TOL[dtype]


@pytest.mark.parametrize("call,err,match", [
    (lambda z: core.nt_xent_pairs(z, None), TypeError, "labels are required"),
    (lambda z: core.nt_xent_pairs(z, np.zeros(3, np.int64)), ValueError, "labels"),
    (lambda z: core.nt_xent_pairs(z, np.zeros(4), 0.1), ValueError,
     "labels must be an integer array"),
    (lambda z: core.nt_xent_pairs(z, np.zeros(4, np.int64), 0.0), ValueError, "temperature"),
    (lambda z: core.nt_xent_pairs(z, np.zeros(4, np.int64), group=object()),
     TypeError, "group"),
])
def test_bad_input_raises(call, err, match):
    with pytest.raises(err, match=match):
        call(np.ones((4, 3)))


@pytest.mark.parametrize("path", ["direct", "registered", "compile"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_torch_paths_match_the_oracle(path, reduction):
    """The direct Function, the registered custom ops and ``torch.compile`` (aot_eager,
    fullgraph), float64 on the CPU, with an upstream gradient."""
    torch = pytest.importorskip("torch")
    import cupynce.torch as C
    from cupynce.torch import _registry

    lab = LABELS["mixed"]
    z0 = np.random.default_rng(10).standard_normal((lab.size, 4))
    z, labels = torch.tensor(z0, requires_grad=True), torch.tensor(lab)
    kw = dict(reduction=reduction, normalize=True)
    if path == "compile":
        torch._dynamo.reset()
        out = torch.compile(lambda z, y: C.nt_xent_pairs(z, y, 0.2, **kw), backend="aot_eager",
                            fullgraph=True)(z, labels)
    elif path == "registered":
        real = _registry.direct
        _registry.direct = lambda *tensors: False
        try:
            out = C.nt_xent_pairs(z, labels, 0.2, **kw)
        finally:
            _registry.direct = real
    else:
        out = C.nt_xent_pairs(z, labels, 0.2, **kw)
    gl = (torch.linspace(0.5, 1.5, lab.size, dtype=torch.float64) if reduction == "none"
          else torch.tensor(0.7, dtype=torch.float64))
    (dz,) = torch.autograd.grad(out, [z], gl)
    want, (wz,) = ref.nt_xent_pairs(z0, lab, 0.2, grad_loss=gl.numpy(), **kw)
    assert _rel(out.detach().numpy(), want) <= 1e-12
    assert _rel(dz.numpy(), wz) <= 1e-12


@pytest.mark.parametrize("which", ["fwd_mean", "fwd_tensor_temperature", "bwd"])
def test_opcheck(which):
    """``torch.library.opcheck`` of the registered ops (schemas, fake shapes, autograd)."""
    torch = pytest.importorskip("torch")
    from cupynce.torch import _registry

    if not _registry.HAS_CUSTOM_OPS:
        pytest.skip("torch without custom ops")
    from cupynce.torch.ops import nt_xent_pairs as op

    lab = torch.tensor(LABELS["mixed"])
    z = torch.tensor(np.random.default_rng(11).standard_normal((lab.numel(), 3)))
    leaf = z.clone().requires_grad_()
    if which == "fwd_mean":
        args, name = (leaf, None, 0.2, lab, "mean", True, None, None, True), "fwd"
    elif which == "fwd_tensor_temperature":
        t = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
        args, name = (leaf, t, 0.0, lab, "sum", True, None, None, True), "fwd"
    else:
        lse = op.FWD(z, None, 0.2, lab, "none", False, None, None, False)[1]
        args = (z, None, 0.2, lab, lse, torch.ones(lab.numel(), dtype=torch.float64), "none",
                False, None, None)
        name = "bwd"
    torch.library.opcheck(getattr(torch.ops.cupynce, f"nt_xent_pairs_{name}").default, args)
