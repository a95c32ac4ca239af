"""The global losses over torch.distributed: on the CPU, gloo, 2, 3 and 4 processes (CI), and,
marked ``gpu``, on GPUs.

Each rank holds its slice of one seeded global batch; its loss must be the single-process op's
on the concatenated batch (its own rows for "none"), and its gradient P times the single-
process gradient of its rows (DDP's convention: DDP averages over the ranks).  A DDP training
step is compared parameter by parameter with one process on the whole batch.  Mismatched local
sizes raise the same error on every rank, without a hang.  Float64 to 1e-12, float32 to the
single-process tolerances.

On GPUs the same checks run on CUDA tensors, float64 / float32 on the cuBLAS path and bfloat16
on the tile kernels:

* one GPU: gloo with 2 processes sharing the GPU (NCCL refuses two ranks on one device), and
  NCCL with one process (its reduce-scatter path);
* several GPUs: NCCL, one process per GPU, where ``torch.cuda.device_count() >= 2``.
"""
from __future__ import annotations

import importlib
import math
import os
import tempfile
import traceback

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-4),
       torch.bfloat16: (1e-5, 1e-2), torch.float16: (1e-5, 2e-3)}  # 16-bit: against the
#: single-process op on the same 16-bit inputs (the rank blocks sum in another order)
#: where the checks put their tensors ("cpu"; "cuda" in the GPU tests at the end)
DEVICE = "cpu"
BACKEND = "gloo"
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


# ---- the per-rank checks (run in the spawned processes) -----------------------------------
def _close(got, want, tol, what):
    got, want = got.detach().double(), want.detach().double()
    den = want.norm().item() or 1.0
    err = (got - want).norm().item() / den
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


class _no_sync:
    """On NCCL: any host synchronisation torch makes inside the block raises (torch's sync
    debug mode: CuPy's own are not seen) -- the backward has none;
    with ``forward=True`` only where the group also has gloo ("cpu:gloo,cuda:nccl"), whose
    forward has none either (the agreement check's read is of host memory)."""

    def __init__(self, forward: bool = False):
        self.on = "nccl" in BACKEND and DEVICE == "cuda" and (not forward or "gloo" in BACKEND)

    def __enter__(self):
        if self.on:
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode(0)


def _nt_xent_rows(rank, n, N):
    return torch.cat([torch.arange(rank * n, (rank + 1) * n), N + torch.arange(rank * n, (rank + 1) * n)])


def check_nt_xent(rank, P):
    import cupynce.torch as ct

    n, d = (3, 5) if DEVICE == "cpu" else (40, 64)
    N = n * P
    for dtype in DTYPES:
        for reduction in ("mean", "sum", "none"):
            for normalize in (False, True):
                gen = torch.Generator().manual_seed(11)
                Z = (torch.randn(2 * N, d, generator=gen, dtype=torch.float64) / 4).to(
                    DEVICE, dtype)
                gl = torch.randn(2 * N, generator=gen, dtype=torch.float64).to(DEVICE)
                mine = _nt_xent_rows(rank, n, N).to(DEVICE)
                z = Z[mine].clone().requires_grad_(True)
                with _no_sync(forward=True):
                    loss = ct.nt_xent(z, 0.3, reduction=reduction, normalize=normalize,
                                      group=dist.group.WORLD)
                zs = Z.clone().requires_grad_(True)
                want = ct.nt_xent(zs, 0.3, reduction=reduction, normalize=normalize)
                up = gl.to(want.dtype) if reduction == "none" else \
                    torch.tensor(0.7, dtype=want.dtype, device=DEVICE)
                g_up = up[mine] if reduction == "none" else up
                with _no_sync():
                    loss.backward(g_up)
                want.backward(up)
                tl, tg = TOL[dtype]
                case = f"nt_xent P={P} {dtype} {reduction} normalize={normalize}"
                _close(loss, want[mine] if reduction == "none" else want, tl, case + " loss")
                _close(z.grad, P * zs.grad[mine], tg, case + " grad")


def check_info_nce(rank, P):
    import cupynce.torch as ct

    n, d, m = (4, 6, 2) if DEVICE == "cpu" else (40, 64, 8)
    N = n * P
    mine = torch.arange(rank * n, (rank + 1) * n, device=DEVICE)
    for dtype in DTYPES:
        for neg in (None, "shared", "paired"):
            for reduction in ("mean", "none"):
                normalize = (reduction == "mean") == (neg != "paired")  # each kind both ways
                gen = torch.Generator().manual_seed(23)
                Q, K = ((torch.randn(N, d, generator=gen, dtype=torch.float64) / 4).to(
                    DEVICE, dtype) for _ in range(2))
                S = (torch.randn(P * m, d, generator=gen, dtype=torch.float64) / 4).to(
                    DEVICE, dtype)
                Np_ = (torch.randn(N, m, d, generator=gen, dtype=torch.float64) / 4).to(
                    DEVICE, dtype)
                gl = torch.randn(N, generator=gen, dtype=torch.float64).to(DEVICE)
                q, k = (x[mine].clone().requires_grad_(True) for x in (Q, K))
                nloc = {None: None, "shared": S[rank * m:(rank + 1) * m],
                        "paired": Np_[mine]}[neg]
                nloc = None if nloc is None else nloc.clone().requires_grad_(True)
                loss = ct.info_nce(q, k, 0.2, negatives=nloc, reduction=reduction,
                                   normalize=normalize, group=dist.group.WORLD)
                qs, ks = (x.clone().requires_grad_(True) for x in (Q, K))
                nall = {None: None, "shared": S, "paired": Np_}[neg]
                nall = None if nall is None else nall.clone().requires_grad_(True)
                want = ct.info_nce(qs, ks, 0.2, negatives=nall, reduction=reduction,
                                   normalize=normalize)
                up = gl.to(want.dtype) if reduction == "none" else \
                    torch.tensor(0.7, dtype=want.dtype, device=DEVICE)
                loss.backward(up[mine] if reduction == "none" else up)
                want.backward(up)
                tl, tg = TOL[dtype]
                case = f"info_nce P={P} {dtype} {neg} {reduction}"
                _close(loss, want[mine] if reduction == "none" else want, tl, case + " loss")
                _close(q.grad, P * qs.grad[mine], tg, case + " dq")
                _close(k.grad, P * ks.grad[mine], tg, case + " dk")
                if neg == "shared":
                    _close(nloc.grad, P * nall.grad[rank * m:(rank + 1) * m], tg, case + " dneg")
                elif neg == "paired":
                    _close(nloc.grad, P * nall.grad[mine], tg, case + " dneg")


def _check_paired(rank, P, op, scalars, seed):
    """A paired loss (CLIP, SigLIP) with learnable scalars (``scalars``: their values, in
    the call's order after a and b) over the group against one process on the whole batch."""
    import cupynce.torch as ct

    fn = getattr(ct, op)
    names = ("dlogit_scale", "dlogit_bias")
    n, d = (4, 6) if DEVICE == "cpu" else (40, 64)
    N = n * P
    mine = torch.arange(rank * n, (rank + 1) * n, device=DEVICE)
    for dtype in DTYPES:
        for reduction in ("mean", "sum", "none"):
            for normalize in (False, True):
                gen = torch.Generator().manual_seed(seed)
                A, Bm = ((torch.randn(N, d, generator=gen, dtype=torch.float64) / 4).to(
                    DEVICE, dtype) for _ in range(2))
                gl = torch.randn(N, generator=gen, dtype=torch.float64).to(DEVICE)
                sc = [torch.tensor(v, dtype=torch.float32, device=DEVICE, requires_grad=True)
                      for v in scalars]
                a, b = (x[mine].clone().requires_grad_(True) for x in (A, Bm))
                with _no_sync(forward=True):
                    loss = fn(a, b, *sc, reduction=reduction, normalize=normalize,
                              group=dist.group.WORLD)
                scs = [x.detach().clone().requires_grad_(True) for x in sc]
                As, Bs = (x.clone().requires_grad_(True) for x in (A, Bm))
                want = fn(As, Bs, *scs, reduction=reduction, normalize=normalize)
                up = gl.to(want.dtype) if reduction == "none" else \
                    torch.tensor(0.7, dtype=want.dtype, device=DEVICE)
                with _no_sync():
                    loss.backward(up[mine] if reduction == "none" else up)
                want.backward(up)
                tl, tg = TOL[dtype]
                case = f"{op} P={P} {dtype} {reduction} normalize={normalize}"
                _close(loss, want[mine] if reduction == "none" else want, tl, case + " loss")
                _close(a.grad, P * As.grad[mine], tg, case + " da")
                _close(b.grad, P * Bs.grad[mine], tg, case + " db")
                for name, x, y in zip(names, sc, scs):
                    _close(x.grad, y.grad, max(tg, 1e-10) * 4, f"{case} {name}")


def check_clip_loss(rank, P):
    _check_paired(rank, P, "clip_loss", (2.3,), 31)


def check_siglip_loss(rank, P):
    _check_paired(rank, P, "siglip_loss", (2.3, -10.0), 37)


def check_autocast(rank, P):
    """Under ``torch.autocast`` a global loss casts the embeddings as the single-process op
    does (float32 → the autocast dtype) and nothing else (the temperature, ``logit_scale`` and
    ``logit_bias`` stay float32): every op's loss and gradients on float32 leaves -- the
    scalars' too, tensors that require a gradient -- equal one process's under the same
    autocast, the gradients come back float32, and the autocast result differs from the
    float32 one by more than the tolerance (so the comparison sees whether the cast
    happened); and the global loss under autocast is, bit for bit, the global loss of the
    embeddings cast to bfloat16 by hand (with the scalars as they are).

    On CUDA, NT-Xent's and SupCon's global schedules take a tensor temperature as rows
    prescaled by √(1/τ) and rounded to bfloat16 once more (``_global.scaled_rows``,
    docs/api.md): there the loss is held to one bfloat16 rounding, 2⁻⁸, of the single
    process's (measured 1.1e-4 and 7e-5 at N = 40, D = 64; a host τ: 8e-8)."""
    import cupynce.torch as ct

    n, d = (4, 6) if DEVICE == "cpu" else (40, 64)
    N = n * P
    mine = torch.arange(rank * n, (rank + 1) * n, device=DEVICE)
    every = torch.arange(N, device=DEVICE)
    gen = torch.Generator().manual_seed(41)
    A, Bm = ((torch.randn(N, d, generator=gen, dtype=torch.float64) / 4).to(DEVICE,
             torch.float32) for _ in range(2))
    S = (torch.randn(2 * P, d, generator=gen, dtype=torch.float64) / 4).to(DEVICE, torch.float32)
    gl = torch.randn(N, generator=gen, dtype=torch.float64).to(DEVICE, torch.float32)
    lab = torch.arange(N, device=DEVICE) % 3
    # op: (its call on (a, b, negatives, the rows' indices, its scalars), its scalars' values)
    ops = {
        "nt_xent": (lambda x, y, s, idx, t, **g: ct.nt_xent(torch.cat([x, y]), t, **g), (0.3,)),
        "info_nce": (lambda x, y, s, idx, t, **g: ct.info_nce(x, y, t, negatives=s, **g),
                     (0.2,)),
        "clip_loss": (lambda x, y, s, idx, ls, **g: ct.clip_loss(x, y, ls, **g), (2.3,)),
        "siglip_loss": (lambda x, y, s, idx, ls, lb, **g: ct.siglip_loss(x, y, ls, lb, **g),
                        (2.3, -10.0)),
        "supcon_loss": (lambda x, y, s, idx, t, **g: ct.supcon_loss(x, lab[idx], t, **g),
                        (0.1,)),
        "nt_xent_pairs": (lambda x, y, s, idx, t, **g: ct.nt_xent_pairs(x, lab[idx], t, **g),
                          (0.2,)),
    }
    tl, tg = TOL[torch.bfloat16]
    for name, (fn, values) in ops.items():
        for reduction in ("mean", "none") if name == "info_nce" else ("mean",):
            a, b = (x[mine].clone().requires_grad_(True) for x in (A, Bm))
            s = S[2 * rank:2 * rank + 2].clone().requires_grad_(True)
            As, Bs, Ss = (x.clone().requires_grad_(True) for x in (A, Bm, S))
            sc, scs = ([torch.tensor(v, device=DEVICE, requires_grad=True) for v in values]
                       for _ in range(2))
            a16, b16, s16 = (x.detach().to(torch.bfloat16).requires_grad_(True)
                             for x in (a, b, s))
            sc16 = [torch.tensor(v, device=DEVICE, requires_grad=True) for v in values]
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = fn(a, b, s, mine, *sc, reduction=reduction, group=dist.group.WORLD)
                want = fn(As, Bs, Ss, every, *scs, reduction=reduction)
            by_hand = fn(a16, b16, s16, mine, *sc16, reduction=reduction,
                         group=dist.group.WORLD)
            plain = fn(A, Bm, S, every, *values, reduction=reduction)
            up = gl if reduction == "none" else torch.tensor(0.7, device=DEVICE)
            loss.backward(up[mine] if reduction == "none" else up)
            by_hand.backward(up[mine] if reduction == "none" else up)
            want.backward(up)
            case = f"{name} P={P} {reduction} autocast"
            assert loss.dtype == want.dtype == torch.float32, (case, loss.dtype, want.dtype)
            same = [(loss, by_hand, "loss")] + [
                (x.grad, x16.grad.float(), "grad") for x, x16 in ((a, a16), (b, b16), (s, s16))
                if x.grad is not None] + [(x.grad, x16.grad, "scalar grad")
                                          for x, x16 in zip(sc, sc16)]
            for got, ref, what in same:
                assert torch.equal(got, ref), f"{case}: {what} differs from the cast by hand"
            prescaled = DEVICE == "cuda" and name in ("nt_xent", "supcon_loss")
            _close(loss, want[mine] if reduction == "none" else want,
                   2.0 ** -8 if prescaled else tl, case + " loss")
            err = ((want - plain).norm() / plain.norm()).item()
            assert err > tl, f"{case}: the bf16 loss is within {tl:g} of float32's ({err:.1e})"
            grads = [(a, As, "da")] + ([] if name in ("supcon_loss", "nt_xent_pairs")
                                       else [(b, Bs, "db")])
            for x, xs, what in grads:
                assert x.grad.dtype == torch.float32, (case, what, x.grad.dtype)
                _close(x.grad, P * xs.grad[mine], tg, f"{case} {what}")
            if name == "info_nce":
                _close(s.grad, P * Ss.grad[2 * rank:2 * rank + 2], tg, case + " dneg")
            for i, (x, xs) in enumerate(zip(sc, scs)):  # (the global gradient on every rank)
                assert x.grad.dtype == torch.float32, (case, i, x.grad.dtype)
                _close(x.grad, xs.grad, tg, f"{case} scalar {i}")


def check_rings_on_gpu(rank, P):
    """``config.ring_gpu`` over NCCL: SigLIP's, CLIP's and NT-Xent's ring schedules on the
    GPUs (the columns shifted through ``TorchComm.ring_shift``) against one process, every
    dtype and reduction, as the all-gather schedules are checked (the forward free of torch
    host syncs on a group with gloo)."""
    if DEVICE != "cuda" or "nccl" not in BACKEND:
        return
    import cupynce.config as cfg

    with cfg.override(ring_gpu=True):
        check_nt_xent(rank, P)
        check_clip_loss(rank, P)
        check_siglip_loss(rank, P)


def check_ddp_step(rank, P):
    """A DDP step on P ranks equals one process's step on the concatenated batch."""
    import cupynce.torch as ct
    from torch.nn.parallel import DistributedDataParallel as DDP

    n = 4
    N = n * P
    gen = torch.Generator().manual_seed(5)
    x1, x2 = (torch.randn(N, 6, generator=gen, dtype=torch.float64).to(DEVICE)
              for _ in range(2))
    for op in ("nt_xent", "info_nce", "clip_loss"):
        torch.manual_seed(0)
        single = torch.nn.Linear(6, 5, dtype=torch.float64).to(DEVICE)
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(6, 5, dtype=torch.float64).to(DEVICE))
        mine = slice(rank * n, (rank + 1) * n)
        if op == "nt_xent":
            loss = ct.nt_xent(torch.cat([model(x1[mine]), model(x2[mine])]), 0.3, normalize=True,
                              group=dist.group.WORLD)
            want = ct.nt_xent(torch.cat([single(x1), single(x2)]), 0.3, normalize=True)
        elif op == "info_nce":
            loss = ct.info_nce(model(x1[mine]), model(x2[mine]), 0.2, normalize=True,
                               group=dist.group.WORLD)
            want = ct.info_nce(single(x1), single(x2), 0.2, normalize=True)
        else:  # CLIP with its learnable temperature, outside the DDP module
            head = ct.ClipLoss(0.07, group=dist.group.WORLD).double().to(DEVICE)
            head_s = ct.ClipLoss(0.07).double().to(DEVICE)
            loss = head(model(x1[mine]), model(x2[mine]))
            want = head_s(single(x1), single(x2))
        loss.backward()
        want.backward()
        _close(loss, want, 1e-12, f"DDP {op} loss")
        for (name, p), ps in zip(model.module.named_parameters(), single.parameters()):
            _close(p.grad, ps.grad, 1e-12, f"DDP {op} P={P} {name}.grad")
        if op == "clip_loss":  # every rank holds the global gradient: the replicas stay equal
            _close(head.logit_scale.grad, head_s.logit_scale.grad, 1e-12,
                   f"DDP clip P={P} logit_scale.grad")
            # logit_scale learning: three SGD steps of model and temperature, the same
            # parameters as one process's steps on the whole batch, on every rank
            opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.5)
            opt_s = torch.optim.SGD([*single.parameters(), *head_s.parameters()], lr=0.5)
            for step in range(3):
                opt.step()
                opt_s.step()
                head.clamp_()
                head_s.clamp_()
                opt.zero_grad()
                opt_s.zero_grad()
                head(model(x1[mine]), model(x2[mine])).backward()
                head_s(single(x1), single(x2)).backward()
            _close(head.logit_scale, head_s.logit_scale, 1e-12, f"DDP clip P={P} logit_scale")
            assert abs(head.logit_scale.item() - math.log(1 / 0.07)) > 1e-3  # it learned
            for (name, p), ps in zip(model.module.named_parameters(), single.parameters()):
                _close(p, ps, 1e-12, f"DDP clip P={P} {name} after 3 steps")


def check_mismatched_sizes_raise(rank, P):
    """Unequal local batches: the same ValueError on every rank, before any kernel; no hang."""
    import cupynce.torch as ct

    z = torch.randn(2 * (3 + rank), 4, dtype=torch.float64, device=DEVICE)
    try:
        ct.nt_xent(z, 0.5, group=dist.group.WORLD)
    except ValueError as exc:
        assert "every rank of the group must pass the same local shapes" in str(exc), exc
        assert "rank 0: z (6, 4)" in str(exc), exc
    else:
        raise AssertionError("unequal local sizes were accepted")


def check_bad_inputs_raise_everywhere(rank, P):
    """One rank's bad inputs, or ranks that disagree on a setting: the same error on every
    rank (the others would otherwise wait in a collective); double backward is refused."""
    import cupynce.torch as ct

    q = torch.randn(4, 3, dtype=torch.float64, device=DEVICE)
    key = q if rank == 0 else torch.randn(5, 3, dtype=torch.float64, device=DEVICE)
    try:
        ct.info_nce(q, key, group=dist.group.WORLD)
    except ValueError as exc:  # the rank at fault names its problem, the others name it
        want = "(4, 3) and (5, 3)" if rank else "invalid inputs on rank(s) [1"
        assert want in str(exc), exc
    else:
        raise AssertionError("rank 1's mismatched key was accepted")
    z = torch.randn(6, 3, dtype=torch.float64, device=DEVICE)
    try:
        ct.nt_xent(z, 0.5, reduction="mean" if rank == 0 else "none", group=dist.group.WORLD)
    except ValueError as exc:
        assert "must pass the same settings" in str(exc), exc
    else:
        raise AssertionError("ranks with different reductions were accepted")
    # the torch-level checks too: a bad reduction, a non-tensor, a bad logit_scale on the
    # last rank only
    last = rank == P - 1
    cases = [
        ("reduction", lambda: ct.nt_xent(z, 0.5, reduction="avg" if last else "mean",
                                         group=dist.group.WORLD), ValueError),
        ("must be a torch.Tensor", lambda: ct.nt_xent(z.numpy() if last and DEVICE == "cpu"
                                                      else z, 0.5, group=dist.group.WORLD),
         TypeError if DEVICE == "cpu" else None),
        ("logit_scale", lambda: ct.clip_loss(q, q, "2.0" if last else 2.0,
                                             group=dist.group.WORLD), TypeError),
        ("precision", lambda: ct.siglip_loss(q, q, 1.0, 0.0, precision="TF32" if last else None,
                                             group=dist.group.WORLD), ValueError),
    ]
    for what, call, kind in cases:
        if kind is None:
            continue
        try:
            call()
        except (TypeError, ValueError) as exc:
            if last:
                assert isinstance(exc, kind) and what in str(exc), exc
            else:
                assert f"invalid inputs on rank(s) [{P - 1}]" in str(exc), exc
        else:
            raise AssertionError(f"rank {P - 1}'s bad {what} was accepted")
    try:  # ranks that resolve to different float32 precisions
        ct.info_nce(q, q, precision="3xtf32" if last else "fp32", group=dist.group.WORLD)
    except ValueError as exc:
        assert "must pass the same settings" in str(exc), exc
    else:
        raise AssertionError("ranks with different precisions were accepted")
    with torch.no_grad():  # no gradient wanted: the forward alone, no gradient work
        loss = ct.nt_xent(z, 0.5, group=dist.group.WORLD)
    assert loss.requires_grad is False and torch.isfinite(loss)
    zg = z.clone().requires_grad_(True)
    loss = ct.nt_xent(zg, 0.5, group=dist.group.WORLD)
    try:
        torch.autograd.grad(loss, zg, create_graph=True)
    except RuntimeError as exc:
        assert "double backward" in str(exc), exc
    else:
        raise AssertionError("double backward was accepted")


def check_precision_reaches_every_product(rank, P):
    """``precision=`` of a global loss: the rank's products, forward and the "none" backward
    (which recomputes), run in it (on the CPU: the NumPy engine's primitives are wrapped to
    record the precision in effect; the real ones run)."""
    if DEVICE != "cpu":
        return
    import cupynce.config as cfg
    import cupynce.torch as ct
    from cupynce.ops import _numpy

    seen, real = [], _numpy.rows

    def rows(*args, **kwargs):
        seen.append(cfg.current().float32_precision)
        return real(*args, **kwargs)
    _numpy.rows = rows
    try:
        for precision, tf32, want in (("3xtf32", True, "3xtf32"), (None, True, "tf32"),
                                      (None, False, "auto")):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            z = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
            loss = ct.nt_xent(z, 0.5, reduction="none", precision=precision,
                              group=dist.group.WORLD)
            n_forward = len(seen)
            torch.autograd.grad(loss.sum(), z)
            assert n_forward and len(seen) > n_forward and set(seen) == {want}, (want, seen)
            del seen[:]
    finally:
        _numpy.rows = real
        torch.backends.cuda.matmul.allow_tf32 = False


def check_exchange(rank, P):
    """TorchComm.exchange (the agreement check's all-gather of integers): every rank's list in
    rank order, through host memory wherever the group's backend has gloo (no GPU work to wait
    for), on the GPU on an NCCL-only group."""
    from cupynce.torch.distributed import TorchComm

    comm = TorchComm(dist.group.WORLD, torch.device(DEVICE))
    assert comm.exchange_device.type == ("cpu" if "gloo" in BACKEND else "cuda"), \
        (BACKEND, comm.exchange_device)
    rows = comm.exchange([rank, -rank, 2 ** 40 + rank])
    assert rows == [[r, -r, 2 ** 40 + r] for r in range(P)], rows


def check_ring_shift(rank, P):
    """TorchComm.ring_shift: after k shifts (each started, work issued, then waited) a rank
    holds rank (rank - k) mod P's array, bit for bit, for float, bfloat16 and integer arrays;
    P shifts bring every array home."""
    from cupynce.torch.distributed import TorchComm
    from cupynce.torch import _bridge as Bridge

    comm = TorchComm(dist.group.WORLD, torch.device(DEVICE))
    assert comm.ring == (("nccl" in BACKEND and DEVICE == "cuda") or
                         ("gloo" in BACKEND and DEVICE == "cpu"))  # (gloo: CPU tensors only)
    if not comm.ring:
        return
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        def of(r):
            return (torch.arange(15, device=DEVICE).reshape(3, 5) * 7 + 100 * r).to(dtype)
        with Bridge.device_scope(torch.device(DEVICE)):
            cur = Bridge.array_of(of(rank))
            for k in range(1, P + 1):
                pending = comm.ring_shift(cur)
                busy = torch.randn(64, 64, device=DEVICE) @ torch.randn(64, 64, device=DEVICE)
                cur = pending.wait()
                got = Bridge.tensor_of(cur)
                assert torch.equal(got, of((rank - k) % P)), (dtype, k, got)
                del busy


# ---- the launcher -------------------------------------------------------------------------
def _worker(rank, world, init_file, names, queue, backend="gloo", device="cpu", module=""):
    """Rank ``rank``'s process: the check functions ``names`` of this module (or of the test
    module ``module``), each called as ``f(rank, world)``."""
    global DEVICE, DTYPES, BACKEND
    import faulthandler

    faulthandler.enable()  # a crash (SIGSEGV in a gloo thread) prints every thread's stack
    BACKEND = backend
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    DEVICE = device
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        space = vars(importlib.import_module(module)) if module else globals()
        for name in names:
            space[name](rank, world)
        queue.put((rank, None))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(world, names, timeout=240, backend="gloo", device="cpu", module=""):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, world, init, names, queue, backend,
                                                    device, module))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive, f"{len(alive)} rank(s) still running after {timeout} s (a hang)"
        # (every rank has exited: what they reported is in the pipe; one that died without
        # reporting -- a crash in gloo's threads -- must fail the test, not block get())
        results = {}
        while len(results) < world and not queue.empty():
            r, tb = queue.get()
            results[r] = tb
        missing = sorted(set(range(world)) - set(results))
        assert not missing, (f"rank(s) {missing} exited without reporting (exit codes "
                             f"{[procs[r].exitcode for r in missing]}; a negative code is the "
                             f"signal, -11 a segfault: faulthandler's stacks are in the "
                             f"captured stderr)")
    failures = {r: tb for r, tb in results.items() if tb}
    assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items())


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_global_losses_over_gloo(world):
    names = ["check_nt_xent", "check_info_nce", "check_clip_loss", "check_siglip_loss",
             "check_ddp_step", "check_ring_shift", "check_exchange", "check_autocast"]
    if world > 1:
        names += ["check_mismatched_sizes_raise", "check_bad_inputs_raise_everywhere",
                  "check_precision_reaches_every_product"]
    run_ranks(world, names)


# ---- on GPUs -------------------------------------------------------------------------------
gpu = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")
CHECKS = ["check_nt_xent", "check_info_nce", "check_clip_loss", "check_siglip_loss",
          "check_ddp_step", "check_ring_shift", "check_exchange", "check_autocast"]


@gpu
@cuda
def test_gloo_two_ranks_on_one_gpu():
    run_ranks(2, CHECKS + ["check_mismatched_sizes_raise", "check_bad_inputs_raise_everywhere"],
              backend="gloo", device="cuda")


@gpu
@cuda
def test_nccl_one_rank():
    run_ranks(1, CHECKS, backend="nccl", device="cuda")


@gpu
@cuda
def test_nccl_with_gloo_one_rank():
    """A "cpu:gloo,cuda:nccl" group (torch's default): CUDA tensors through NCCL, the
    agreement check's integers through gloo."""
    run_ranks(1, CHECKS, backend="cpu:gloo,cuda:nccl", device="cuda")


@gpu
@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_one_rank_per_gpu(backend):
    run_ranks(torch.cuda.device_count(),
              CHECKS + ["check_mismatched_sizes_raise", "check_bad_inputs_raise_everywhere",
                        "check_rings_on_gpu"], backend=backend, device="cuda")
