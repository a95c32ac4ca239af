"""``cupynce.torch`` on CPU tensors: the core's CPU primitives run on torch's functions
(``cupynce.ops._cpu``, ``cupynce.torch._cpu.TORCH``; config ``cpu_torch``).

* the same bits with 1 and 2 torch threads, and on a repeated call, for every loss (fused
  "mean" and the per-row backward) and SPLADE, at sizes whose N x N passes torch splits
  across threads (the products are torch's: MKL's sgemm gave other bits with 3 threads on
  the 2-core machine, plain PyTorch's products too);
* the torch namespace against the NumPy one and the float64 reference: the same losses and
  gradients within the float32 tolerance, in one row block and in several (a small
  ``workspace_bytes``), and the same NaN pattern for non-finite inputs;
* the switch: which namespace the primitives see inside a torch call, with ``cpu_torch`` on
  and off.

(The bridge's bit-exactness against the functional API on each namespace is in
test_torch_contrastive / test_torch_siglip / test_torch_splade.)
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupynce  # noqa: E402
import cupynce.config as cfg  # noqa: E402
import cupynce.torch as ct  # noqa: E402
from cupynce import reference as ref  # noqa: E402
from cupynce.ops import _cpu, _numpy  # noqa: E402
from cupynce.torch._cpu import TORCH  # noqa: E402

N, D = 302, 40  # (N x N = 91204 elements: torch splits an elementwise pass across threads)


def _inputs(seed=0, n=N, d=D, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype)
            .requires_grad_() for _ in range(2)]


def _loss_and_grads(op: str, reduction: str, seed=0):
    """(loss, grads) of one op on fresh leaves; "none" takes an upstream gradient != 1."""
    a, b = _inputs(seed)
    if op == "nt_xent":
        leaves, loss = (a,), ct.nt_xent(a, 0.2, reduction=reduction)
    elif op == "info_nce":
        leaves, loss = (a, b), ct.info_nce(a, b, 0.1, reduction=reduction)
    elif op == "clip_loss":
        ls = torch.tensor(2.6, requires_grad=True)
        leaves, loss = (a, b, ls), ct.clip_loss(a, b, ls, reduction=reduction)
    else:
        ls, lb = torch.tensor(2.3, requires_grad=True), torch.tensor(-5.0, requires_grad=True)
        leaves, loss = (a, b, ls, lb), ct.siglip_loss(a, b, ls, lb, reduction=reduction)
    up = (torch.linspace(0.5, 1.5, N) if reduction == "none" else torch.tensor(0.7))
    return loss, torch.autograd.grad(loss, leaves, up)


def _splade(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 37, 24, generator=g).requires_grad_()
    w = (torch.randn(1500, 24, generator=g) / 5).requires_grad_()
    bias = (torch.randn(1500, generator=g) * 0.1).requires_grad_()
    mask = torch.rand(3, 37, generator=g) < 0.8
    out = ct.splade_pool(x, w, bias, mask, activation="log1p_relu")
    return out, torch.autograd.grad(out, (x, w, bias), torch.randn(3, 1500, generator=g))


def _bits(ts):
    return [t.detach().numpy().tobytes() for t in ts]


OPS = ["nt_xent", "info_nce", "clip_loss", "siglip_loss"]


@pytest.fixture
def threads():
    """Set torch's intra-op thread count for the test; the previous one comes back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("op,reduction", [(op, red) for op in OPS for red in ("mean", "none")]
                         + [("splade_pool", None)])
def test_same_bits_for_every_call_at_a_thread_count(op, reduction, threads):
    """Every reduction the CPU path runs itself has a fixed order, so repeated calls at one
    thread count give one result, at 1 and at 2 threads.  Across thread counts the bits are
    the BLAS's to keep: MKL's sgemm split SPLADE's 1500-long contraction differently for 1
    and 2 threads on a 16-core host (not on 2 cores), as it does under plain PyTorch
    (docs/design.md, "The CPU path")."""
    for count in (1, 2):
        threads(count)
        results = []
        for _ in range(3):
            loss, grads = _splade() if op == "splade_pool" else _loss_and_grads(op, reduction)
            results.append(_bits([loss, *grads]))
        for other in results[1:]:
            assert other == results[0], f"{op} {reduction}: two calls at {count} threads differ"


def _functional(op, xs, *, workspace_bytes=None):
    """The functional API's loss (mean) and unit-upstream gradients on NumPy arrays."""
    a, b = xs
    kw = dict(workspace_bytes=workspace_bytes)
    if op == "nt_xent":
        loss, ctx = cupynce.nt_xent_forward(a, 0.2, **kw)
        return loss, [cupynce.nt_xent_backward(ctx)]
    if op == "info_nce":
        loss, ctx = cupynce.info_nce_forward(a, b, 0.1, **kw)
        return loss, list(cupynce.info_nce_backward(ctx)[:2])
    if op == "clip_loss":
        loss, ctx = cupynce.clip_loss_forward(a, b, np.float32(2.6), **kw)
        return loss, list(cupynce.clip_loss_backward(ctx))
    loss, ctx = cupynce.siglip_loss_forward(a, b, np.float32(2.3), np.float32(-5.0), **kw)
    return loss, list(cupynce.siglip_loss_backward(ctx))


def _reference(op, xs):
    a, b = (x.astype(np.float64) for x in xs)
    if op == "nt_xent":
        return ref.nt_xent(a, 0.2)
    if op == "info_nce":
        return ref.info_nce(a, b, 0.1)
    if op == "clip_loss":
        return ref.clip_loss(a, b, 2.6)
    return ref.siglip_loss(a, b, 2.3, -5.0)


@pytest.mark.parametrize("workspace_bytes", [None, 64 * N * 4], ids=["one-block", "blocks"])
@pytest.mark.parametrize("op", OPS)
def test_torch_namespace_matches_numpy_and_the_reference(op, workspace_bytes):
    """The same algorithm on either namespace: both within float32 rounding of the float64
    reference (loss and every gradient), in one row block and in several."""
    xs = [t.detach().numpy() for t in _inputs(3)]
    want_loss, want_grads = _reference(op, xs)
    for ns in (_cpu.NUMPY, TORCH):
        with _cpu.using(ns):
            loss, grads = _functional(op, xs, workspace_bytes=workspace_bytes)
        np.testing.assert_allclose(float(loss), want_loss, rtol=2e-6, err_msg=f"{ns.name} loss")
        for got, want in zip(grads, want_grads):
            want = np.asarray(want, np.float64)
            scale = np.abs(want).max()
            np.testing.assert_allclose(np.asarray(got, np.float64) / scale, want / scale,
                                       atol=2e-6, err_msg=f"{ns.name} {op} gradient")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (NumPy's BLAS)
@pytest.mark.parametrize("op", OPS)
def test_nonfinite_inputs_give_the_same_nan_pattern(op):
    """NaN and inf inputs: the per-row losses and the gradients are NaN at the same places on
    both namespaces (a NaN / +inf row's statistics are NaN, as the CUDA kernels')."""
    a, b = (t.detach().numpy().copy() for t in _inputs(5, n=12, d=6))
    a[2, 1], a[7, 0], b[4, 3] = np.nan, np.inf, -np.inf
    got = {}
    for ns in (_cpu.NUMPY, TORCH):
        with _cpu.using(ns):
            if op == "nt_xent":
                loss, ctx = cupynce.nt_xent_forward(a, 0.2, reduction="none")
                grads = [cupynce.nt_xent_backward(ctx, np.ones(12, np.float32))]
            elif op == "info_nce":
                loss, ctx = cupynce.info_nce_forward(a, b, 0.1, reduction="none")
                grads = cupynce.info_nce_backward(ctx, np.ones(12, np.float32))[:2]
            elif op == "clip_loss":
                loss, ctx = cupynce.clip_loss_forward(a, b, 2.6, reduction="none")
                grads = cupynce.clip_loss_backward(ctx, np.ones(12, np.float32))
            else:
                loss, ctx = cupynce.siglip_loss_forward(a, b, 2.3, -5.0, reduction="none")
                grads = cupynce.siglip_loss_backward(ctx, np.ones(12, np.float32))
        got[ns.name] = [np.isnan(np.asarray(x)) for x in (loss, *ctx.stats, *grads)]
    assert any(m.any() for m in got["numpy"])  # (the case does reach the NaN paths)
    for x, y in zip(got["numpy"], got["torch"]):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("cpu_torch", [True, False])
def test_the_switch_picks_the_namespace(cpu_torch, monkeypatch):
    """Inside a torch call on CPU tensors the primitives see torch's namespace, or NumPy's
    with ``cpu_torch`` off; outside one, always NumPy's."""
    seen = []
    real = _numpy.rows

    def spy(*args, **kw):
        seen.append(_cpu.current().name)
        return real(*args, **kw)

    monkeypatch.setattr(_numpy, "rows", spy)
    a, _ = _inputs()
    with cfg.override(cpu_torch=cpu_torch):
        torch.autograd.grad(ct.nt_xent(a, 0.2), (a,))
        cupynce.nt_xent(a.detach().numpy(), 0.2)
    assert seen == ["torch" if cpu_torch else "numpy", "numpy"]
    assert _cpu.current() is _cpu.NUMPY
