"""``cupynce.torch.siglip_loss`` and ``SigLipLoss`` on CPU tensors (the NumPy path).

* float64 against the oracle (``cupynce.reference.siglip_loss``) and torch's gradcheck, every
  reduction and normalize, scale / bias as tensors of shape () and (1,) or as reals;
* both ways into the kernels — the direct eager Function and the registered custom ops
  (``cupynce::siglip_loss_fwd`` / ``_bwd``) — give the functional API's bits in every dtype;
* torch.compile(fullgraph=True) of a training step (aot_eager) and torch.autocast;
* ``SigLipLoss``: the paper's initialisation, learnable / frozen, a training step moves both
  parameters; the checks.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch._dynamo.testing  # noqa: E402  (CompileCounterWithBackend)

import cupynce  # noqa: E402
import cupynce.config as cfg  # noqa: E402
import cupynce.torch as ct  # noqa: E402
from cupynce import reference as ref  # noqa: E402
from cupynce.ops import _cpu  # noqa: E402
from cupynce.torch._cpu import TORCH  # noqa: E402
from test_torch_contrastive import _registered  # noqa: E402  (the custom ops, not the direct path)

REDUCTIONS = ("mean", "sum", "none")


PATHS = {"direct": ct.siglip_loss, "registered": _registered(ct.siglip_loss)}


def _leaves(n, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return a, b


def _np(t):
    return t.detach().numpy()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("kind", ["0d", "shape1", "real"])
def test_float64_matches_oracle(path, reduction, normalize, kind):
    n = 7
    a, b = _leaves(n, 5)
    if kind == "real":
        ls, lb = math.log(10.0), -3.0
        scalars = ()
    else:
        shape = () if kind == "0d" else (1,)
        ls = torch.full(shape, math.log(10.0), dtype=torch.float64, requires_grad=True)
        lb = torch.full(shape, -3.0, dtype=torch.float64, requires_grad=True)
        scalars = (ls, lb)
    g = torch.randn(n, dtype=torch.float64) if reduction == "none" else \
        torch.tensor(0.7, dtype=torch.float64)
    loss = PATHS[path](a, b, ls, lb, reduction=reduction, normalize=normalize)
    grads = torch.autograd.grad(loss, (a, b) + scalars, g)
    rl, rg = ref.siglip_loss(_np(a), _np(b), _np(ls) if scalars else ls,
                             _np(lb) if scalars else lb, reduction=reduction,
                             normalize=normalize, grad_loss=g.numpy())
    np.testing.assert_allclose(_np(loss), rl, rtol=1e-12, atol=1e-14)
    for x, y in zip(grads, rg):
        assert x.shape == torch.Size(np.shape(y))
        np.testing.assert_allclose(_np(x), y, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
def test_gradcheck(path, normalize):
    a, b = _leaves(5, 3)
    ls = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    lb = torch.tensor(-1.0, dtype=torch.float64, requires_grad=True)
    fn = PATHS[path]
    assert torch.autograd.gradcheck(
        lambda a, b, ls, lb: fn(a, b, ls, lb, normalize=normalize), (a, b, ls, lb))


@pytest.mark.parametrize("cpu_torch", [True, False], ids=["on-torch", "on-numpy"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_same_bits_as_the_functional_api(path, dtype, reduction, cpu_torch):
    """The torch op runs the core: the same bits as cupynce.siglip_loss_* on the arrays, on
    the namespace the torch op's CPU primitives run on (config ``cpu_torch``)."""
    n = 9
    a, b = _leaves(n, 6, dtype)
    ls = torch.tensor(2.3, requires_grad=True)
    lb = torch.tensor(-10.0, requires_grad=True)
    g = torch.rand(n) if reduction == "none" else torch.tensor(0.5)
    with cfg.override(cpu_torch=cpu_torch):
        loss = PATHS[path](a, b, ls, lb, reduction=reduction, normalize=True)
        grads = torch.autograd.grad(loss, (a, b, ls, lb), g)

    def arr(t):
        t = t.detach()
        return t.view(torch.int16).numpy().view(ml_bf16()) if t.dtype == torch.bfloat16 \
            else t.numpy()
    with _cpu.using(TORCH if cpu_torch else _cpu.NUMPY):
        wl, ctx = cupynce.siglip_loss_forward(arr(a), arr(b), arr(ls), arr(lb),
                                              reduction=reduction, normalize=True)
        want = cupynce.siglip_loss_backward(ctx, g.numpy())
    assert arr(loss).tobytes() == np.asarray(wl).tobytes()
    for x, y in zip(grads, want):
        assert arr(x).tobytes() == np.asarray(y).tobytes()


def ml_bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_training_step_one_graph(reduction):
    """The forward traces into one graph (fullgraph=True) and autograd through it gives the
    eager gradients: mean (the gradient in the forward) and "none" (the backward op)."""
    torch._dynamo.reset()
    a, b = _leaves(8, 4, torch.float64)
    model = ct.SigLipLoss(reduction=reduction).double()
    params = [a, b, model.logit_scale, model.logit_bias]
    g = torch.rand(8, dtype=torch.float64) if reduction == "none" else None

    def step(a, b):
        return model(a, b)

    eager = step(a, b)
    want = torch.autograd.grad(eager, params, g)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    loss = compiled(a, b)
    got = torch.autograd.grad(loss, params, g)
    assert counter.frame_count == 1
    torch.testing.assert_close(loss, eager, rtol=1e-12, atol=0)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-14)


def test_autocast_casts_the_embeddings_not_the_scalars():
    a, b = _leaves(6, 4, torch.float32)
    ls = torch.tensor(1.0, requires_grad=True)
    lb = torch.tensor(-2.0, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ct.siglip_loss(a, b, ls, lb)
    want = ct.siglip_loss(a.detach().bfloat16(), b.detach().bfloat16(), 1.0, -2.0)
    assert loss.dtype == torch.float32 and torch.equal(loss.detach(), want)
    ga, gls = torch.autograd.grad(loss, (a, ls))
    assert ga.dtype == torch.float32 and gls.dtype == torch.float32


def test_module_initialisation_and_training_step():
    model = ct.SigLipLoss()
    assert math.isclose(float(model.logit_scale.detach()), math.log(10.0), rel_tol=1e-7)
    assert float(model.logit_bias.detach()) == -10.0
    assert math.isclose(float(model.temperature), 0.1, rel_tol=1e-6)
    assert set(model.state_dict()) == {"logit_scale", "logit_bias"}
    frozen = ct.SigLipLoss(learnable=False)
    assert not frozen.learnable and not frozen.logit_bias.requires_grad
    a, b = _leaves(8, 4, torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model(a, b).backward()
    opt.step()
    for p, q in zip(model.parameters(), before):
        assert not torch.equal(p.detach(), q)


@pytest.mark.parametrize("call, exc, match", [
    (lambda a, b: ct.siglip_loss(a, b, 1.0, "x"), TypeError,
     r"siglip_loss: logit_bias must be a real number or a torch.Tensor"),
    (lambda a, b: ct.siglip_loss(a, b, float("nan"), 0.0), ValueError,
     r"siglip_loss: logit_scale must be finite"),
    (lambda a, b: ct.siglip_loss(a, b, 1.0, float("inf")), ValueError,
     r"siglip_loss: logit_bias must be finite"),
    (lambda a, b: ct.siglip_loss(a.numpy(), b, 1.0, 0.0), TypeError,
     r"siglip_loss: a must be a torch.Tensor"),
    (lambda a, b: ct.siglip_loss(a, b, 1.0, 0.0, reduction="avg"), ValueError, r"reduction"),
    (lambda a, b: ct.siglip_loss(a, b, 1.0, 0.0, group=object()), ValueError,
     r"siglip_loss: group=.* needs torch.distributed to be initialised"),
    (lambda a, b: ct.SigLipLoss(init_logit_bias=float("nan")), ValueError,
     r"SigLipLoss: init_logit_bias must be finite"),
])
def test_bad_inputs(call, exc, match):
    a = torch.zeros(4, 3)
    b = torch.zeros(4, 3)
    with pytest.raises(exc, match=match):
        call(a, b)
