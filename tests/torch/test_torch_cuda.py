"""``cupynce.torch`` on CUDA tensors (DLPack to the CuPy kernels); every test is marked ``gpu``.

Checked on the GPU:

* loss and every gradient against torch autograd of the plain formula (``torch_oracle``) in
  float64 on the GPU, every reduction (non-unit / per-row grad_output), normalize on/off,
  negatives none/shared/paired, logit_scale real / 0-d / (1,); odd shapes up to N ~ 1000;
* float16 / bfloat16: error against the float64 oracle at most 2x the error of the same
  computation in PyTorch at that dtype, floor eps/8 (4 eps for the cancelling dlogit_scale),
  as tests/ops/test_contrastive_kernels.py;
* gradcheck (float64) for every function and tensor input; bit-exact against the functional
  API on the same CuPy arrays; zero copy (the core sees the tensor's pointer);
* streams: the kernels run on torch's current stream (a non-default stream whose input is
  written after a GPU spin: any other stream would read stale data); no host
  synchronisation in forward or backward (the host returns while the GPU still spins);
* memory: workspaces come from torch's caching allocator (``max_memory_allocated`` sees them,
  CuPy's pool stays untouched); 50 training steps keep the peak flat (step 10 == step 50);
* devices: CPU mixed with CUDA is an error; cuda:1 runs on cuda:1 (skipped with one GPU);
* torch.autocast (bfloat16, float16); torch.compile (inductor, fullgraph) of a training step.

Tolerances (relative norm error): float64 1e-12; float32 loss 1e-5, gradients 1e-4.
"""
from __future__ import annotations

import math
import time
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupynce  # noqa: E402
import cupynce.torch as ct  # noqa: E402
from cupynce.ops import _base  # noqa: E402
from cupynce.ops import clip as core_clip  # noqa: E402
from cupynce.ops import info_nce as core_info_nce  # noqa: E402
from cupynce.ops import nt_xent as core_nt_xent  # noqa: E402
from cupynce.torch import _bridge  # noqa: E402

#: the core module of each op (its public functions; ``_base`` for the shared finish)
CORE = {"nt_xent": core_nt_xent, "info_nce": core_info_nce, "clip_loss": core_clip}

import torch_oracle as oracle  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")]

DEV = "cuda"
REDUCTIONS = ("mean", "sum", "none")
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-4)}  # (loss, gradients)
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
NT_T, INFO_T, CLIP_LS = 0.3, 0.2, 2.5


def _gen(*key) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(zlib.crc32(repr(key).encode()))


def _randn(g, shape, dtype=torch.float64) -> torch.Tensor:
    x = torch.randn(shape, generator=g, dtype=torch.float64, device=DEV) / math.sqrt(shape[-1])
    return x.to(dtype)


def _leaf(x, dtype=None):
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().to(dtype or x.dtype).requires_grad_(True)


def _grad_output(g, reduction, n):
    if reduction == "none":
        return torch.randn(n, generator=g, dtype=torch.float64, device=DEV)
    return torch.tensor(0.7, dtype=torch.float64, device=DEV)


def _case(op, shape, neg=None, ls_kind="0d", seed=0):
    """(cupynce fn, oracle fn, float64 inputs, names) for one op."""
    g = _gen(op, shape, neg, ls_kind, seed)
    n, d = shape
    if op == "nt_xent":
        return (lambda z, **kw: ct.nt_xent(z, NT_T, **kw),
                lambda z, **kw: oracle.nt_xent(z, NT_T, **kw), [_randn(g, shape)], ["z"])
    if op == "info_nce":
        negs = {None: None, "shared": (7, d), "paired": (n, 3, d)}[neg]
        inputs = [_randn(g, shape), _randn(g, shape), None if negs is None else _randn(g, negs)]
        return (lambda q, k, x=None, **kw: ct.info_nce(q, k, INFO_T, negatives=x, **kw),
                lambda q, k, x=None, **kw: oracle.info_nce(q, k, INFO_T, negatives=x, **kw),
                inputs, ["query", "key", "negatives"])
    ls = {"float": CLIP_LS, "0d": torch.tensor(CLIP_LS, device=DEV),
          "1d": torch.tensor([CLIP_LS], device=DEV)}[ls_kind]
    return (ct.clip_loss, oracle.clip_loss, [_randn(g, shape), _randn(g, shape), ls],
            ["a", "b", "logit_scale"])


CASES = [("nt_xent", (6, 5), None, "0d"), ("nt_xent", (1030, 77), None, "0d"),
         ("info_nce", (41, 33), None, "0d"), ("info_nce", (517, 65), "shared", "0d"),
         ("info_nce", (203, 17), "paired", "0d"),
         ("clip_loss", (41, 33), None, "float"), ("clip_loss", (1031, 129), None, "0d"),
         ("clip_loss", (64, 8), None, "1d")]
CASE_IDS = [f"{c[0]}-{c[1][0]}x{c[1][1]}-{c[2] or c[3]}" for c in CASES]


def _inputs_as(inputs, dtype):
    """Embeddings in ``dtype`` (leaves); logit_scale stays a float32 leaf (a Parameter)."""
    out = []
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            out.append(x)
        elif x.dim() <= 1:  # logit_scale
            out.append(_leaf(x, torch.float32))
        else:
            out.append(_leaf(x, dtype))
    return out


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_matches_torch_on_gpu(case, dtype, reduction, normalize):
    op, shape, neg, ls_kind = case
    fn, ref_fn, inputs, names = _case(op, shape, neg, ls_kind)
    go = _grad_output(_gen("go", case, reduction), reduction, shape[0])
    kw = dict(reduction=reduction, normalize=normalize)
    xs = _inputs_as(inputs, dtype)
    loss, grads = oracle.loss_and_grads(lambda *a: fn(*a, **kw), xs, go.to(_acc(dtype)))
    rloss, rgrads = oracle.loss_and_grads(lambda *a: ref_fn(*a, **kw),
                                          [_leaf(x, torch.float64) for x in xs], go)
    tl, tg = TOL[dtype]
    assert loss.dtype == _acc(dtype) and loss.shape == rloss.shape
    err = oracle.rel_err(loss, rloss)
    assert err <= tl, f"{case} {dtype} {kw}: loss rel err {err:.3e}"
    for name, x, gx, rx in zip(names, xs, grads, rgrads):
        if rx is None:
            assert gx is None
            continue
        assert gx.shape == x.shape and gx.dtype == x.dtype, (name, gx.shape, gx.dtype)
        err = oracle.rel_err(gx, rx)
        tol = max(tg, 1e-4) if name == "logit_scale" else tg  # float32 Parameter
        assert err <= tol, f"{case} {dtype} {kw}: d{name} rel err {err:.3e}"


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4], CASES[6]],
                         ids=[CASE_IDS[i] for i in (1, 3, 4, 6)])
def test_half_precision_vs_same_dtype_torch(case, dtype, reduction):
    op, shape, neg, ls_kind = case
    fn, ref_fn, inputs, names = _case(op, shape, neg, ls_kind, seed=1)
    go = _grad_output(_gen("go-half", case, reduction), reduction, shape[0])
    kw = dict(reduction=reduction, normalize=True)
    xs = _inputs_as(inputs, dtype)  # the quantised inputs every computation starts from
    loss, grads = oracle.loss_and_grads(lambda *a: fn(*a, **kw), xs, go.float())
    hloss, hgrads = oracle.loss_and_grads(lambda *a: ref_fn(*a, **kw),
                                          [_leaf(x) for x in xs], go.to(dtype))
    rloss, rgrads = oracle.loss_and_grads(lambda *a: ref_fn(*a, **kw),
                                          [_leaf(x, torch.float64) for x in xs], go)
    eps = EPS[dtype]
    report = []
    for name, got, half, ref, floor in (
            [("loss", loss, hloss, rloss, eps / 8)]
            + [(n, g, h, r, 4 * eps if n == "logit_scale" else eps / 8)
               for n, g, h, r in zip(names, grads, hgrads, rgrads) if r is not None]):
        e, eh = oracle.rel_err(got, ref), oracle.rel_err(half, ref)
        report.append(f"{name}: cupynce {e:.2e}, torch-{dtype} {eh:.2e}")
        assert e <= max(2 * eh, floor), "; ".join(report)


@pytest.mark.parametrize("case", [("nt_xent", (6, 4), None, "0d"), ("info_nce", (5, 3), None, "0d"),
                                  ("info_nce", (5, 3), "shared", "0d"),
                                  ("info_nce", (5, 3), "paired", "0d"),
                                  ("clip_loss", (5, 3), None, "0d"),
                                  ("clip_loss", (5, 3), None, "1d")], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck_cuda(case, reduction):
    op, shape, neg, ls_kind = case
    fn, _, inputs, _ = _case(op, shape, neg, ls_kind)
    if op == "info_nce" and neg is None:
        inputs = inputs[:2]
    xs = [_leaf(x, torch.float64) for x in inputs]
    assert torch.autograd.gradcheck(lambda *a: fn(*a, reduction=reduction, normalize=True), xs)


def test_bit_exact_against_functional_api_and_zero_copy(monkeypatch):
    import cupy as cp

    seen = []
    real = core_nt_xent.nt_xent_forward

    def spy(z, *a, **k):
        seen.append(z.data.ptr)
        return real(z, *a, **k)

    monkeypatch.setattr(core_nt_xent, "nt_xent_forward", spy)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        z = _leaf(_randn(_gen("bits", dtype), (64, 24), dtype))
        go = torch.randn(64, device=DEV, dtype=_acc(dtype))
        loss = ct.nt_xent(z, NT_T, reduction="none", normalize=True)
        assert seen[-1] == z.data_ptr()  # the kernels read the tensor itself
        (dz,) = torch.autograd.grad(loss, z, go)
        zc = _bridge.array_of(z)
        want, ctx = real(zc, NT_T, reduction="none", normalize=True)
        dwant = cupynce.nt_xent_backward_from_stats(zc, ctx.stats[0], cp.from_dlpack(go),
                                                    temperature=NT_T, reduction="none",
                                                    normalize=True)
        assert torch.equal(loss, _bridge.tensor_of(want))
        bits = (lambda t: t.view(torch.int16)) if dtype == torch.bfloat16 else (lambda t: t)
        assert torch.equal(bits(dz), bits(_bridge.tensor_of(dwant)))


# ----------------------------------------------------------------------------------------
# streams and synchronisation
# ----------------------------------------------------------------------------------------
def _cycles(seconds: float) -> int:
    import cupy as cp

    khz = cp.cuda.runtime.getDeviceProperties(torch.cuda.current_device())["clockRate"]
    return int(seconds * khz * 1e3)


def _streams_seen(monkeypatch, *targets):
    """Record the current CuPy stream at each call of ``(module, name)`` in ``targets``."""
    import cupy as cp

    seen = []
    for mod, name in targets:
        real = getattr(mod, name)

        def spy(*a, _real=real, **k):
            seen.append(cp.cuda.get_current_stream().ptr)
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, spy)
    return seen


@pytest.mark.parametrize("op", ["nt_xent", "clip_loss"])
def test_runs_on_torch_current_stream(op, monkeypatch):
    fn, ref_fn, inputs, _ = _case(op, (512, 64))
    src = [x.float() if isinstance(x, torch.Tensor) else x for x in inputs]
    want = ref_fn(*[x.double() if isinstance(x, torch.Tensor) else x for x in src])
    fn(*src)  # compile the kernels outside the timed part
    torch.cuda.synchronize()
    seen = _streams_seen(monkeypatch, (CORE[op], f"{op}_forward"),
                         (CORE[op], f"{op}_backward_from_stats"),
                         (_base, "finish_all"))  # (the fused backward's grad_finish op)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x0 = torch.zeros_like(src[0])
        torch.cuda._sleep(_cycles(0.05))  # keep s busy, then write the input on s
        x0.copy_(src[0])
        x0.requires_grad_(True)
        loss = fn(x0, *src[1:])
        (dx,) = torch.autograd.grad(loss, x0)
        out = loss.double().clone()  # consumed on s
    s.synchronize()
    assert seen and all(p == s.cuda_stream for p in seen), (seen, s.cuda_stream)
    # a kernel on any other stream would have read the zeros
    assert oracle.rel_err(out, want) <= 1e-5
    assert torch.isfinite(dx).all()


@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_host_synchronisation(op, reduction):
    fn, _, inputs, _ = _case(op, (256, 64), "paired" if op == "info_nce" else None)
    xs = _inputs_as(inputs, torch.float32)
    leaves = [x for x in xs if isinstance(x, torch.Tensor)]

    def step():
        loss = fn(*xs, reduction=reduction)
        return torch.autograd.grad(loss, leaves, torch.ones_like(loss))

    step()
    torch.cuda.synchronize()
    torch.cuda._sleep(_cycles(1.0))  # the GPU is busy for ~1 s
    t0 = time.perf_counter()
    out = step()
    host = time.perf_counter() - t0
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy and host < 0.5, f"forward+backward waited for the GPU ({host:.3f} s)"
    assert all(torch.isfinite(g).all() for g in out)


# ----------------------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------------------
def test_workspace_comes_from_torch_caching_allocator():
    import cupy as cp

    pool = cp.get_default_memory_pool()
    pool_before = pool.total_bytes()
    n, d = 4096, 64
    z = _leaf(_randn(_gen("mem"), (n, d), torch.float32))
    ct.nt_xent(z, workspace_bytes=16 << 20).backward()  # warm-up (kernels, cuBLAS)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ct.nt_xent(z, workspace_bytes=16 << 20).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak >= 8 << 20, f"torch saw only {peak} bytes: the score block is not torch's"
    assert pool.total_bytes() == pool_before, "CuPy's own pool allocated"


@pytest.mark.parametrize("loss_name", ["nt_xent", "info_nce", "clip_loss"])
def test_training_memory_stays_flat(loss_name):
    torch.manual_seed(0)
    enc = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                              torch.nn.Linear(128, 32)).to(DEV)
    losses = {"nt_xent": ct.NTXentLoss(0.5, normalize=True), "info_nce": ct.InfoNCE(0.1),
              "clip_loss": ct.ClipLoss()}
    loss_fn = losses[loss_name].to(DEV)
    opt = torch.optim.AdamW(list(enc.parameters()) + list(loss_fn.parameters()), lr=1e-3)
    x = torch.randn(512, 64, device=DEV)
    peaks, live = {}, {}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # earlier tests' peaks must not mask a growth
    for step in range(1, 51):
        v1, v2 = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
        if loss_name == "nt_xent":
            loss = loss_fn(torch.cat([enc(v1), enc(v2)]))
        else:
            loss = loss_fn(enc(v1), enc(v2))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if loss_name == "clip_loss":
            loss_fn.clamp_()
        if step in (10, 50):
            torch.cuda.synchronize()
            peaks[step] = torch.cuda.max_memory_allocated()
            live[step] = torch.cuda.memory_allocated()
    assert peaks[10] == peaks[50], peaks
    assert live[10] == live[50], live


# ----------------------------------------------------------------------------------------
# devices
# ----------------------------------------------------------------------------------------
def test_cpu_mixed_with_cuda_is_an_error():
    z = torch.ones(4, 3, device=DEV)
    with pytest.raises(ValueError, match=r"info_nce: all tensors must be on one device, got "
                                         r"query on cuda:\d, key on cpu"):
        ct.info_nce(z, z.cpu())
    with pytest.raises(ValueError, match=r"logit_scale on cpu"):
        ct.ClipLoss()(z, z)  # the module was not moved to the GPU


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_gpu(monkeypatch):
    import cupy as cp

    seen = []
    real = core_clip.clip_loss_forward
    monkeypatch.setattr(core_clip, "clip_loss_forward",
                        lambda *a, **k: seen.append(cp.cuda.Device().id) or real(*a, **k))
    g = _gen("dev1")
    a0, b0 = _randn(g, (33, 16), torch.float32), _randn(g, (33, 16), torch.float32)
    ls0 = torch.tensor(CLIP_LS, device="cuda:0")
    leaves0 = [_leaf(x) for x in (a0, b0, ls0)]
    leaves1 = [_leaf(x.to("cuda:1")) for x in (a0, b0, ls0)]
    torch.cuda.set_device(0)
    before = torch.cuda.memory_allocated(1)
    loss0 = ct.clip_loss(*leaves0, normalize=True)
    loss1 = ct.clip_loss(*leaves1, normalize=True)
    assert seen == [0, 1] and loss1.device == torch.device("cuda:1")
    assert torch.cuda.memory_allocated(1) > before
    assert torch.equal(loss1.cpu(), loss0.cpu())
    g0 = torch.autograd.grad(loss0, leaves0)
    g1 = torch.autograd.grad(loss1, leaves1)
    for x, y in zip(g0, g1):
        assert y.device == torch.device("cuda:1") and torch.equal(x.cpu(), y.cpu())
    with pytest.raises(ValueError, match=r"got a on cuda:0, b on cuda:1"):
        ct.clip_loss(leaves0[0], leaves1[1], 1.0)


# ----------------------------------------------------------------------------------------
# autocast and torch.compile
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_autocast(dtype, monkeypatch):
    seen = []
    real = core_clip.clip_loss_forward
    monkeypatch.setattr(core_clip, "clip_loss_forward",
                        lambda a, b, ls, **k: seen.append((str(a.dtype), str(b.dtype),
                                                           str(ls.dtype))) or real(a, b, ls, **k))
    g = _gen("autocast", dtype)
    a, b = _leaf(_randn(g, (96, 40), torch.float32)), _leaf(_randn(g, (96, 40), dtype))
    ls = _leaf(torch.tensor(CLIP_LS, device=DEV))
    with torch.autocast("cuda", dtype=dtype):
        loss = ct.clip_loss(a, b, ls, normalize=True)
    half = "bfloat16" if dtype == torch.bfloat16 else "float16"
    assert seen == [(half, half, "float32")]
    da, db, dls = torch.autograd.grad(loss, (a, b, ls))
    assert loss.dtype == torch.float32
    assert (da.dtype, db.dtype, dls.dtype) == (torch.float32, dtype, torch.float32)
    want = ct.clip_loss(a.detach().to(dtype), b, ls, normalize=True)
    assert torch.equal(loss, want)


@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss"])
def test_compiled_training_step_inductor(op, monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    enc = torch.nn.Linear(48, 32).to(DEV)
    clip = ct.ClipLoss(0.1).to(DEV)
    info = ct.InfoNCE(0.2)
    x, y = torch.randn(256, 48, device=DEV), torch.randn(256, 48, device=DEV)

    def step(x, y):
        if op == "nt_xent":
            return ct.nt_xent(torch.cat([enc(x), enc(y)]), 0.3, normalize=True)
        if op == "info_nce":
            return info(enc(x), enc(y))
        return clip(enc(x), enc(y))

    params = [enc.weight, enc.bias] + ([clip.logit_scale] if op == "clip_loss" else [])
    eager = step(x, y)
    want = torch.autograd.grad(eager, params)
    calls, finish = [], []
    real = getattr(CORE[op], f"{op}_backward_from_stats")
    monkeypatch.setattr(CORE[op], f"{op}_backward_from_stats",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    real_finish = _base.finish_all
    monkeypatch.setattr(_base, "finish_all",
                        lambda *a, **k: finish.append(1) or real_finish(*a, **k))
    compiled = torch.compile(step, fullgraph=True)  # inductor
    for _ in range(2):
        loss = compiled(x, y)
        got = torch.autograd.grad(loss, params)
    # mean: the gradient is computed in the forward; the compiled backward graph scales it
    # through the grad_finish op, once per normalised input and step
    assert len(calls) == 0
    assert len(finish) == 2 * {"nt_xent": 1, "info_nce": 2, "clip_loss": 2}[op]
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_module_bf16_training_step():
    torch.manual_seed(0)
    m = ct.ClipLoss().to(DEV)
    a = _leaf(torch.randn(300, 64, device=DEV, dtype=torch.bfloat16))
    b = _leaf(torch.randn(300, 64, device=DEV, dtype=torch.bfloat16))
    loss = m(a, b)
    loss.backward()
    assert a.grad.dtype == torch.bfloat16 and m.logit_scale.grad.dtype == torch.float32
    assert torch.isfinite(m.logit_scale.grad) and np.isfinite(float(loss))


def test_cuda_tensor_temperature_is_an_input():
    """A CUDA 0-d tensor temperature is an input of the op, never read back (issue 55: a
    device scale); a CPU one without grad is taken as a float, as before."""
    z = torch.randn(4, 3, device="cuda")
    torch.testing.assert_close(ct.nt_xent(z, torch.tensor(0.5, device="cuda")),
                               ct.nt_xent(z, 0.5), rtol=1e-6, atol=1e-6)
    assert torch.equal(ct.nt_xent(z, torch.tensor(0.5)), ct.nt_xent(z, 0.5))
