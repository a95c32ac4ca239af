"""GPU tests of the InfoNCE family (CuPy path): run with ``pytest -m gpu`` on a CUDA machine.

Oracles: the float64 NumPy reference (``cupynce.reference``) for small and medium sizes; for
large N (where N x N float64 does not fit on the host) an independent blocked float64
computation in torch on the GPU, written here.

Tolerances (relative, ‖x − ref‖ / ‖ref‖):

=========  =====================  ===================================================
dtype      loss                   gradients
=========  =====================  ===================================================
float64    1e-12                  1e-12
float32    1e-5                   1e-4        (the seeds' figures)
f16/bf16   ≤ 2 × the error of the same-dtype PyTorch computation against float64,
           with a floor of machine epsilon / 8 (bf16 9.8e-4, f16 1.2e-4): a scalar loss
           that torch happens to round almost exactly must not make the bound ~0;
           dlogit_scale (a scalar sum that cancels) has a floor of 4 × epsilon
=========  =====================  ===================================================
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import cupynce
from cupynce import reference as R

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), BF16]
TOL = {np.dtype(np.float64): (1e-12, 1e-12), np.dtype(np.float32): (1e-5, 1e-4)}


def rel(x, ref) -> float:
    x = np.asarray(cp.asnumpy(x) if isinstance(x, cp.ndarray) else x, np.float64)
    ref = np.asarray(ref, np.float64)
    den = np.linalg.norm(ref.ravel())
    num = np.linalg.norm((x - ref).ravel())
    if not np.isfinite(num):
        return float("inf")
    return float(num / den) if den > 0 else float(num)


def _torch():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


# ---- the same-dtype PyTorch computation, for half-precision tolerances --------------------
def torch_same_dtype(op, dtype, inputs, kw, grad_loss):
    """Loss and grads of the plain PyTorch formula computed in ``dtype`` on the GPU."""
    torch = _torch()
    if torch is None:
        return None
    import torch.nn.functional as F

    tdt = {np.dtype(np.float16): torch.float16, BF16: torch.bfloat16}[dtype]
    ts = [None if x is None else torch.tensor(np.asarray(x, np.float32), device="cuda",
                                              dtype=tdt, requires_grad=True) for x in inputs]
    norm = (lambda v: F.normalize(v, dim=-1)) if kw.get("normalize") else (lambda v: v)
    red = kw["reduction"]
    if op == "nt_xent":
        z = norm(ts[0])
        n = z.shape[0]
        s = (z @ z.T).masked_fill(torch.eye(n, dtype=torch.bool, device="cuda"), float("-inf"))
        labels = (torch.arange(n, device="cuda") + n // 2) % n
        loss = F.cross_entropy(s / kw["t"], labels, reduction=red)
    elif op == "info_nce":
        q, k = norm(ts[0]), norm(ts[1])
        cols = [q @ k.T]
        if ts[2] is not None:
            ng = norm(ts[2])
            cols.append(q @ ng.T if ng.ndim == 2 else torch.einsum("nd,nmd->nm", q, ng))
        logits = torch.cat(cols, 1) / kw["t"]
        loss = F.cross_entropy(logits, torch.arange(q.shape[0], device="cuda"), reduction=red)
    else:
        a, b = norm(ts[0]), norm(ts[1])
        ls = ts[2]
        logits = ls.exp() * a @ b.T
        lab = torch.arange(a.shape[0], device="cuda")
        loss = (F.cross_entropy(logits, lab, reduction=red)
                + F.cross_entropy(logits.T, lab, reduction=red)) / 2
    g = torch.tensor(np.asarray(grad_loss, np.float32), device="cuda", dtype=loss.dtype)
    loss.backward(g)
    return loss.detach().float().cpu().numpy(), [None if t is None else t.grad.float().cpu().numpy()
                                                for t in ts]


def tolerances(op, dtype, inputs, kw, grad_loss, ref_loss, ref_grads):
    if dtype in TOL:
        lt, gt = TOL[dtype]
        return lt, [gt] * len(ref_grads)
    got = torch_same_dtype(op, dtype, inputs, kw, grad_loss)
    if got is None:  # no torch on the GPU machine: fixed, documented fallbacks
        f = 2e-2 if dtype == BF16 else 3e-3
        return f, [f] * len(ref_grads)
    tl, tg = got
    floor = float(ml_dtypes.finfo(dtype).eps) / 8
    lt = max(2 * rel(tl, ref_loss), floor)
    gts = [None if r is None else max(2 * rel(t, r), floor) for t, r in zip(tg, ref_grads)]
    if op == "clip_loss":  # dlogit_scale = sum_ij G_ij L_ij cancels: one noisy scalar
        gts[2] = max(gts[2], 4 * float(ml_dtypes.finfo(dtype).eps))
    return lt, gts


# ---- runners: cupynce on CuPy arrays ------------------------------------------------------
def run_cupynce(op, inputs, kw, grad_loss, workspace_bytes=None):
    dev = [None if x is None else cp.asarray(x) for x in inputs]
    g = cp.asarray(grad_loss) if isinstance(grad_loss, np.ndarray) else grad_loss
    if op == "nt_xent":
        loss, ctx = cupynce.nt_xent_forward(dev[0], kw["t"], reduction=kw["reduction"],
                                            normalize=kw["normalize"],
                                            workspace_bytes=workspace_bytes)
        return loss, [cupynce.nt_xent_backward(ctx, g)]
    if op == "info_nce":
        loss, ctx = cupynce.info_nce_forward(dev[0], dev[1], kw["t"], negatives=dev[2],
                                             reduction=kw["reduction"], normalize=kw["normalize"],
                                             workspace_bytes=workspace_bytes)
        return loss, list(cupynce.info_nce_backward(ctx, g))
    loss, ctx = cupynce.clip_loss_forward(dev[0], dev[1], dev[2], reduction=kw["reduction"],
                                          normalize=kw["normalize"],
                                          workspace_bytes=workspace_bytes)
    return loss, list(cupynce.clip_loss_backward(ctx, g))


def run_reference(op, inputs, kw, grad_loss):
    if op == "nt_xent":
        loss, grads = R.nt_xent(inputs[0], kw["t"], reduction=kw["reduction"],
                                normalize=kw["normalize"], grad_loss=grad_loss)
    elif op == "info_nce":
        loss, grads = R.info_nce(inputs[0], inputs[1], kw["t"], negatives=inputs[2],
                                 reduction=kw["reduction"], normalize=kw["normalize"],
                                 grad_loss=grad_loss)
    else:
        loss, grads = R.clip_loss(inputs[0], inputs[1], inputs[2], reduction=kw["reduction"],
                                  normalize=kw["normalize"], grad_loss=grad_loss)
    return loss, list(grads)


def make_case(op, dtype, n, d, rng, neg=None, m=3, t=0.3, scale=1.0):
    def arr(*shape):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    if op == "nt_xent":
        return [arr(n, d)]
    if op == "info_nce":
        negs = None if neg is None else (arr(m, d) if neg == "shared" else arr(n, m, d))
        return [arr(n, d), arr(n, d), negs]
    # logit_scale in the inputs' dtype, as a 0-d array (CLIP's nn.Parameter)
    return [arr(n, d), arr(n, d), np.asarray(np.log(1 / 0.07) if t == 0.3 else np.log(1 / t), dtype)]


def check(op, dtype, inputs, kw, grad_loss, workspace_bytes=None, loss_floor=0.0):
    """cupynce against the float64 oracle within :func:`tolerances` (the loss's at least
    ``loss_floor``)."""
    loss, grads = run_cupynce(op, inputs, kw, grad_loss, workspace_bytes)
    ref_loss, ref_grads = run_reference(op, inputs, kw, grad_loss)
    lt, gts = tolerances(op, dtype, inputs, kw, grad_loss, ref_loss, ref_grads)
    lt = max(lt, loss_floor)
    want_loss = np.float64 if dtype == np.float64 else np.float32
    assert loss.dtype == want_loss, f"{op}: loss dtype {loss.dtype}, expected {want_loss}"
    e = rel(loss, ref_loss)
    assert e <= lt, f"{op} {dtype} {kw}: loss rel err {e:.3e} > tol {lt:.3e}"
    names = {"nt_xent": ["dz"], "info_nce": ["dquery", "dkey", "dnegatives"],
             "clip_loss": ["da", "db", "dlogit_scale"]}[op]
    for name, g, r, tol, x in zip(names, grads, ref_grads, gts, inputs):
        if r is None:
            assert g is None
            continue
        assert g.dtype == x.dtype, f"{op}: {name} dtype {g.dtype}, expected {x.dtype}"
        assert g.shape == np.shape(x), f"{op}: {name} shape {g.shape} != {np.shape(x)}"
        e = rel(g, r)
        assert e <= tol, f"{op} {dtype} {kw}: {name} rel err {e:.3e} > tol {tol:.3e}"


def grad_for(reduction, n, rng):
    return rng.standard_normal(n) if reduction == "none" else 0.7


CASES = [("nt_xent", None), ("info_nce", None), ("info_nce", "shared"), ("info_nce", "paired"),
         ("clip_loss", None)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("op,neg", CASES)
def test_every_op_dtype_reduction(op, neg, dtype, reduction, normalize):
    rng = np.random.default_rng(zlib.crc32(f"{op}{neg}{dtype}{reduction}{normalize}".encode()))
    n = 42 if op == "nt_xent" else 41
    inputs = make_case(op, dtype, n, 33, rng, neg)
    kw = dict(t=0.3 if op != "info_nce" else 0.2, reduction=reduction, normalize=normalize)
    check(op, dtype, inputs, kw, grad_for(reduction, n, rng))


@pytest.mark.parametrize("n,d", [(2, 1), (6, 3), (130, 33), (258, 129), (1000, 257),
                                 (2050, 1023), (512, 4096), (4098, 100)])
@pytest.mark.parametrize("op,neg", CASES)
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
def test_sizes(op, neg, n, d, dtype):
    rng = np.random.default_rng(n * 7 + d)
    inputs = make_case(op, dtype, n, d, rng, neg, scale=1 / np.sqrt(d))
    kw = dict(t=0.1, reduction="mean", normalize=True)
    check(op, dtype, inputs, kw, 1.0)


@pytest.mark.parametrize("t", [0.01, 0.05, 0.2, 1.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,neg", [("nt_xent", None), ("info_nce", "shared"), ("clip_loss", None)])
def test_temperatures(op, neg, dtype, t):
    rng = np.random.default_rng(int(t * 1000))
    n = 64
    inputs = make_case(op, dtype, n, 48, rng, neg, t=t)
    kw = dict(t=t, reduction="mean", normalize=True)
    loss, grads = run_cupynce(op, inputs, kw, 1.0)
    assert np.isfinite(float(loss)), f"{op} {dtype} t={t}: non-finite loss"
    for g in grads:
        if g is not None:
            assert bool(cp.isfinite(g.astype(cp.float32)).all()), f"{op} {dtype} t={t}: non-finite grad"
    check(op, dtype, inputs, kw, 1.0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16, np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("op,neg", CASES)
def test_blocked_equals_unblocked(op, neg, dtype, reduction):
    rng = np.random.default_rng(5)
    n = 300
    inputs = make_case(op, dtype, n, 40, rng, neg)
    kw = dict(t=0.2, reduction=reduction, normalize=False)
    g = grad_for(reduction, n, rng)
    full = run_cupynce(op, inputs, kw, g)
    # 37 rows of score block (fp32 + half gradient): uneven last block
    blocked = run_cupynce(op, inputs, kw, g, workspace_bytes=37 * (n + 8) * 6)
    # different block shapes let cuBLAS pick other kernels and the shared-negative gradient
    # sums the blocks in another order: agreement to fp32 rounding of cancelling sums
    tol = 1e-12 if dtype == np.float64 else (1e-4 if dtype == np.float32 else 1e-2)
    assert rel(blocked[0], cp.asnumpy(full[0])) <= tol
    for a, b in zip(blocked[1], full[1]):
        if a is not None:
            assert rel(a, cp.asnumpy(b)) <= tol


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
@pytest.mark.parametrize("op,neg", CASES)
def test_deterministic(op, neg, dtype, reduction):
    rng = np.random.default_rng(11)
    n = 1030
    inputs = make_case(op, dtype, n, 96, rng, neg)
    kw = dict(t=0.1, reduction=reduction, normalize=True)
    g = grad_for(reduction, n, rng)
    runs = [run_cupynce(op, inputs, kw, g, workspace_bytes=200 * n * 6) for _ in range(3)]
    for other in runs[1:]:
        assert cp.asnumpy(other[0]).tobytes() == cp.asnumpy(runs[0][0]).tobytes()
        for a, b in zip(other[1], runs[0][1]):
            if a is not None:
                assert cp.asnumpy(a).tobytes() == cp.asnumpy(b).tobytes(), "gradients differ bitwise"


@pytest.mark.parametrize("op,neg", CASES)
def test_non_default_stream(op, neg):
    rng = np.random.default_rng(3)
    n = 520
    inputs = make_case(op, np.float32, n, 64, rng, neg)
    kw = dict(t=0.1, reduction="mean", normalize=True)
    expect = run_cupynce(op, inputs, kw, 0.5)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        got = run_cupynce(op, inputs, kw, 0.5)
        # queue more work on the stream so a launch on the wrong stream would race
        cp.cuda.Device().synchronize()
    stream.synchronize()
    assert cp.asnumpy(got[0]).tobytes() == cp.asnumpy(expect[0]).tobytes()
    for a, b in zip(got[1], expect[1]):
        if a is not None:
            assert cp.asnumpy(a).tobytes() == cp.asnumpy(b).tobytes()


@pytest.mark.parametrize("op,neg", CASES)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_inf_give_nan_loss(op, neg, bad):
    rng = np.random.default_rng(1)
    inputs = make_case(op, np.float32, 16, 8, rng, neg)
    inputs[0][3, 2] = bad
    kw = dict(t=0.1, reduction="mean", normalize=False)
    loss, _ = run_cupynce(op, inputs, kw, 1.0)
    assert np.isnan(float(loss)), f"{op}: input with {bad} gave loss {float(loss)}"


def test_views_are_accepted():
    rng = np.random.default_rng(2)
    base = cp.asarray(rng.standard_normal((64, 50)).astype(np.float32))
    view = base[:, 3:35]  # row stride 50, unit column stride: no copy needed
    trans = cp.asfortranarray(view)  # column-major: copied once
    ref = cupynce.nt_xent(cp.ascontiguousarray(view), 0.2)
    assert rel(cupynce.nt_xent(view, 0.2), cp.asnumpy(ref)) <= 1e-6
    assert rel(cupynce.nt_xent(trans, 0.2), cp.asnumpy(ref)) <= 1e-6
    loss, ctx = cupynce.clip_loss_forward(view, trans, 2.0)
    da, db, _ = cupynce.clip_loss_backward(ctx)
    assert da.shape == view.shape and db.shape == view.shape


# ---- large N: an independent blocked float64 torch computation on the GPU ---------------
def torch_blocked_nt_xent_f64(z, t, block=4096):
    import torch

    z = z.double()
    n = z.shape[0]
    lse = torch.empty(n, dtype=torch.float64, device=z.device)
    pos = torch.empty(n, dtype=torch.float64, device=z.device)
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        s = z[r0:r1] @ z.T / t
        idx = torch.arange(r0, r1, device=z.device)
        s[idx - r0, idx] = float("-inf")
        lse[r0:r1] = torch.logsumexp(s, 1)
        pos[r0:r1] = s[idx - r0, (idx + n // 2) % n]
    dz = torch.zeros_like(z)
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        s = z[r0:r1] @ z.T / t
        idx = torch.arange(r0, r1, device=z.device)
        s[idx - r0, idx] = float("-inf")
        p = torch.exp(s - lse[r0:r1, None])
        p[idx - r0, (idx + n // 2) % n] -= 1
        p /= n * t
        dz[r0:r1] += p @ z
        dz += p.T @ z[r0:r1]
    return (lse - pos).mean(), dz


@pytest.mark.slow
@pytest.mark.parametrize("n,d,dtype", [(65536, 64, np.dtype(np.float32)), (65536, 64, BF16),
                                       (16384, 1, np.dtype(np.float32)),
                                       (8192, 4096, np.dtype(np.float32))], ids=str)
def test_large_nt_xent(n, d, dtype):
    torch = _torch()
    if torch is None:
        pytest.skip("the large-N oracle needs torch on the GPU")
    rng = cp.random.default_rng(0)
    z = rng.standard_normal((n, d), dtype=cp.float32)
    z /= cp.linalg.norm(z, axis=1, keepdims=True)
    z = z.astype(dtype)
    loss, ctx = cupynce.nt_xent_forward(z, 0.1)
    dz = cupynce.nt_xent_backward(ctx)
    zt = torch.from_dlpack(z.astype(cp.float32))
    rl, rdz = torch_blocked_nt_xent_f64(zt, 0.1)
    lt, gt = (1e-5, 1e-4) if dtype == np.float32 else (2e-3, 2e-2)
    assert rel(loss, rl.item()) <= lt
    assert rel(dz, rdz.cpu().numpy()) <= gt


@pytest.mark.slow
def test_large_clip_memory_bounded():
    """N = 65536: the N x N matrix (16 GiB in fp32) is never allocated whole."""
    n, d = 65536, 64
    rng = cp.random.default_rng(0)
    a = rng.standard_normal((n, d), dtype=cp.float32).astype(BF16)
    b = rng.standard_normal((n, d), dtype=cp.float32).astype(BF16)
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.used_bytes()
    ws = 256 << 20
    loss, ctx = cupynce.clip_loss_forward(a, b, cp.asarray(2.0, cp.float32), normalize=True,
                                          workspace_bytes=ws)
    grads = cupynce.clip_loss_backward(ctx)
    cp.cuda.Device().synchronize()
    assert np.isfinite(float(loss))
    assert all(bool(cp.isfinite(g.astype(cp.float32)).all()) for g in grads)
    # total pool size is an upper bound of the peak: workspace + O(N*D) buffers
    assert pool.total_bytes() - before <= ws + 64 * n * d * 4


# ---- the tensor-core tile path (kernels_src/losses/tiles.cu): 16-bit inputs, D % 8 == 0 --
HALF = [np.dtype(np.float16), BF16]
TILE_CASES = [("nt_xent", None), ("info_nce", None), ("info_nce", "shared"), ("clip_loss", None)]


@pytest.fixture(params=["wgmma", "mma_sync"])
def tiles_on(request, configure):
    """Force the tile kernels on for one test, with each main loop (wgmma: Hopper only)."""
    from cupynce._engine.kernels import arch_specific_build
    from cupynce._engine.losses import score_tiles

    if request.param == "wgmma" and not arch_specific_build(score_tiles.FILE):
        pytest.skip("the wgmma main loop needs a compute-capability 9.0 GPU")
    configure(tiles=True, wgmma=request.param == "wgmma")
    return request.param


def test_tile_path_is_taken_for_aligned_half_inputs(tiles_on):
    from cupynce._engine import tiling

    x = cp.zeros((64, 64), cp.float16)
    assert tiling.tiles_ok(x, x), "aligned float16 must use the tile kernels"
    assert not tiling.tiles_ok(cp.zeros((64, 33), cp.float16)), "D % 8 != 0 must fall back"
    assert not tiling.tiles_ok(cp.zeros((64, 64), cp.float32)), "float32 uses cuBLAS"


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("n,d", [(42, 64), (300, 40), (1030, 136)])
@pytest.mark.parametrize("op,neg", TILE_CASES)
def test_tiles_against_reference(op, neg, n, d, normalize, reduction, dtype, tiles_on):
    rng = np.random.default_rng(zlib.crc32(f"tiles{op}{neg}{n}{dtype}{reduction}{normalize}".encode()))
    inputs = make_case(op, dtype, n, d, rng, neg, m=130, scale=1 / np.sqrt(d))
    kw = dict(t=0.1, reduction=reduction, normalize=normalize)
    check(op, dtype, inputs, kw, grad_for(reduction, n, rng))


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("op,neg", TILE_CASES)
def test_tiles_agree_with_cublas_path(op, neg, dtype, configure):
    """Same inputs through the tile kernels and through cuBLAS + row kernels."""
    configure(tiles=True)
    rng = np.random.default_rng(3)
    n = 520
    inputs = make_case(op, dtype, n, 64, rng, neg, m=70, scale=0.125)
    kw = dict(t=0.1, reduction="mean", normalize=True)
    tiles = run_cupynce(op, inputs, kw, 1.0, workspace_bytes=200 * 1024)
    configure(tiles=False)
    plain = run_cupynce(op, inputs, kw, 1.0, workspace_bytes=200 * 1024)
    assert rel(tiles[0], cp.asnumpy(plain[0])) <= 1e-5  # fp32 statistics of the same products
    tol = 1e-2 if dtype == BF16 else 2e-3  # both round the gradient block to 16 bits
    for a, b in zip(tiles[1], plain[1]):
        if a is not None:
            assert rel(a, cp.asnumpy(b)) <= tol


def _spy_paths(monkeypatch, *targets) -> list:
    """Wrap each ``(module, function, label)`` so that a call appends its label to the list
    returned (which engine path a call took, in order)."""
    taken = []
    for mod, name, label in targets:
        def spy(*a, _real=getattr(mod, name), _label=label, **k):
            taken.append(_label)
            return _real(*a, **k)
        monkeypatch.setattr(mod, name, spy)
    return taken


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("n", [200, 198])  # (16-byte rows: cpn_grad_inplace in vectors)
def test_clip_keeps_scores_at_large_d(dtype, n, tiles_on, configure, monkeypatch):
    """The chooser by cost (``_engine.clip``): a fused 16-bit CLIP call from
    ``keep_scores_min_dim`` columns runs the row blocks that keep the whole score matrix
    where 4 N² bytes fit the workspace, the tiles otherwise (a smaller workspace, fewer
    columns, an unfused call); every choice against the float64 oracle."""
    from cupynce._engine.losses import row_blocks, score_tiles

    taken = _spy_paths(monkeypatch, (row_blocks, "clip", "row_blocks"),
                       (score_tiles, "clip", "score_tiles"))
    d = 64
    rng = np.random.default_rng(zlib.crc32(f"keep{dtype}".encode()))
    inputs = make_case("clip_loss", dtype, n, d, rng, scale=1 / np.sqrt(d))
    mean = dict(t=0.1, reduction="mean", normalize=True)
    fits, short = 4 * n * n, 4 * n * n - 1  # (float32 scores, G written over them)
    for min_dim, ws, kw, want in [
            (d, fits, mean, ["row_blocks"]),  # fused, fits: the scores kept
            (d, None, mean, ["row_blocks"]),  # the default budget
            (d, short, mean, ["score_tiles"]),  # one row short: the tiles
            (d + 8, fits, mean, ["score_tiles"]),  # below the threshold
            (d, fits, dict(mean, reduction="none"), ["score_tiles"] * 2)]:  # unfused: fwd, bwd
        configure(keep_scores_min_dim=min_dim)
        taken.clear()
        check("clip_loss", dtype, inputs, kw, grad_for(kw["reduction"], n, rng),
              workspace_bytes=ws)
        # (the fused forward computes the gradient; its backward only scales it)
        assert taken == want, (min_dim, ws, kw["reduction"], taken)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("n", [200, 198])
def test_nt_xent_keeps_scores_at_large_d(dtype, n, tiles_on, configure, monkeypatch):
    """The chooser for NT-Xent (``_engine.rows``): a fused 16-bit call from
    ``nt_xent_keep_min_dim`` columns (and ``nt_xent_keep_min_nd``) runs ``row_blocks.nt_xent_kept`` (S kept, H = G + Gᵀ
    written over it, one product) where 4 N² bytes fit the workspace, the tiles otherwise;
    every choice against the float64 oracle, and the kept path deterministic."""
    from cupynce._engine.losses import row_blocks, score_tiles

    taken = _spy_paths(monkeypatch, (row_blocks, "nt_xent_kept", "nt_xent_kept"),
                       (score_tiles, "rows", "rows"))
    d = 64
    rng = np.random.default_rng(zlib.crc32(f"keepnt{dtype}".encode()))
    inputs = make_case("nt_xent", dtype, n, d, rng, scale=1 / np.sqrt(d))
    fits, short = 4 * n * n, 4 * n * n - 1
    for min_dim, ws, red, norm, want in [
            (d, fits, "mean", True, ["nt_xent_kept"]),
            (d, None, "sum", False, ["nt_xent_kept"]),
            (d, short, "mean", True, ["rows"]),  # one row short: the tiles
            (d + 8, fits, "mean", True, ["rows"]),  # below the threshold
            (d, fits, "none", True, ["rows", "rows"])]:  # unfused: forward, backward
        configure(nt_xent_keep_min_dim=min_dim, nt_xent_keep_min_nd=0)
        taken.clear()
        kw = dict(t=0.1, reduction=red, normalize=norm)
        check("nt_xent", dtype, inputs, kw, grad_for(red, n, rng), workspace_bytes=ws)
        assert taken == want, (min_dim, ws, red, taken)
    configure(nt_xent_keep_min_dim=d, nt_xent_keep_min_nd=n * d + 1)  # (N · D too small)
    taken.clear()
    check("nt_xent", dtype, inputs, dict(t=0.1, reduction="mean", normalize=True), 1.0)
    assert taken == ["rows"], taken
    configure(nt_xent_keep_min_nd=0)
    kw = dict(t=0.1, reduction="mean", normalize=True)
    first, again = (run_cupynce("nt_xent", inputs, kw, 1.0) for _ in range(2))
    assert cp.asnumpy(first[0]).tobytes() == cp.asnumpy(again[0]).tobytes()
    assert cp.asnumpy(first[1][0]).tobytes() == cp.asnumpy(again[1][0]).tobytes()


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
@pytest.mark.parametrize("op,neg", CASES)
@pytest.mark.parametrize("tiles", [False, True])
def test_backward_from_stats_gpu(op, neg, dtype, tiles, configure):
    """The O(N)-state backward (used by cupynce.torch) equals the context backward, bitwise
    for the recompute path ("none") and to rounding for the fused mean path."""
    configure(tiles=tiles)
    rng = np.random.default_rng(17)
    n = 260
    inputs = make_case(op, dtype, n, 64, rng, neg)
    dev = [None if x is None else cp.asarray(x) for x in inputs]
    g = cp.asarray(rng.standard_normal(n).astype(np.float32))
    for red, gl in (("none", g), ("mean", 0.5)):
        if op == "nt_xent":
            _, ctx = cupynce.nt_xent_forward(dev[0], 0.2, reduction=red, normalize=True)
            want = [cupynce.nt_xent_backward(ctx, gl)]
            got = [cupynce.nt_xent_backward_from_stats(dev[0], *ctx.stats, gl, temperature=0.2,
                                                       reduction=red, normalize=True)]
        elif op == "info_nce":
            _, ctx = cupynce.info_nce_forward(dev[0], dev[1], 0.2, negatives=dev[2],
                                              reduction=red, normalize=True)
            want = cupynce.info_nce_backward(ctx, gl)
            got = cupynce.info_nce_backward_from_stats(dev[0], dev[1], dev[2], *ctx.stats, gl,
                                                       temperature=0.2, reduction=red,
                                                       normalize=True)
        else:
            _, ctx = cupynce.clip_loss_forward(dev[0], dev[1], dev[2], reduction=red,
                                               normalize=True)
            want = cupynce.clip_loss_backward(ctx, gl)
            got = cupynce.clip_loss_backward_from_stats(dev[0], dev[1], dev[2], *ctx.stats, gl,
                                                        reduction=red, normalize=True)
        for a, b in zip(got, want):
            if b is None:
                assert a is None
                continue
            if red == "none":
                assert bool((a == b).all()), f"{op} {dtype}: from_stats differs from ctx backward"
            else:
                tol = 1e-5 if dtype == np.float32 else 1e-2
                assert rel(a, cp.asnumpy(b)) <= tol


def test_tile_smem_constant_matches_kernel():
    from cupynce._engine import tiling
    from cupynce._engine.kernels import get_kernel
    from cupynce._engine.losses import score_tiles

    out = cp.zeros((2,), cp.int32)
    get_kernel(score_tiles.FILE, "tile_smem", cp.float16)((1,), (1,), (out,))
    assert int(out[0]) == tiling.TILE_SMEM
    assert int(out[1]) == tiling.WG_SMEM


@pytest.mark.parametrize("dtype", HALF)
def test_tile_args_struct_layout_matches_kernel(dtype):
    """The tile kernels' by-value TileArgs struct: the offsets of its fields (in declaration
    order) and its size, read from the kernel, match what Python's struct format packs."""
    import re
    import struct

    from cupynce._engine import tiling
    from cupynce._engine.kernels import get_kernel
    from cupynce._engine.losses import score_tiles

    fields = tiling.TILE_ARGS_FIELDS
    out = cp.full((len(fields) + 1,), -1, cp.int32)
    get_kernel(score_tiles.FILE, "tile_args_layout", dtype)((1,), (1,), (out,))
    got = [int(v) for v in cp.asnumpy(out)]
    fmt = tiling.TILE_ARGS_FORMAT  # "<16Q6q9i2f4x": the offsets the packer uses, field by field
    codes = "".join(c * int(n) for n, c in re.findall(r"(\d+)([Qqif])", fmt))
    assert len(codes) == len(fields)
    want = [struct.calcsize("<" + codes[:i]) for i in range(len(codes))]
    assert got[:-1] == want, dict(zip(fields, zip(got, want)))
    assert got[-1] == struct.calcsize(fmt) == tiling.TILE_ARGS_DTYPE.itemsize


def test_tiles_default_follows_the_main_loop(configure):
    """CUPYNCE_TILES unset: tiles exactly where the wgmma loop is built (Hopper)."""
    from cupynce._engine import tiling
    from cupynce._engine.kernels import arch_specific_build
    from cupynce._engine.losses import score_tiles

    configure(tiles=None)
    x = cp.zeros((64, 64), cp.float16)
    assert tiling.tiles_ok(x, x) == arch_specific_build(score_tiles.FILE)
    configure(tiles=False)
    assert not tiling.tiles_ok(x, x)


@pytest.mark.parametrize("op,neg", TILE_CASES)
def test_tiles_deterministic_and_nan(op, neg, tiles_on):
    rng = np.random.default_rng(23)
    n = 1030
    inputs = make_case(op, BF16, n, 96, rng, neg, m=40)
    kw = dict(t=0.1, reduction="none", normalize=True)
    g = grad_for("none", n, rng)
    runs = [run_cupynce(op, inputs, kw, g, workspace_bytes=300 * 1104 * 2) for _ in range(3)]
    for other in runs[1:]:
        assert bool((other[0] == runs[0][0]).all())
        for a, b in zip(other[1], runs[0][1]):
            if a is not None:
                assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all()), f"{op}: not bitwise"
    bad = [x.copy() if x is not None else None for x in inputs]
    bad[0][5, 3] = np.nan
    kw["reduction"] = "mean"
    loss, _ = run_cupynce(op, bad, kw, 1.0)
    assert np.isnan(float(loss)), f"{op}: NaN input must give a NaN loss on the tile path"


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("op,neg", TILE_CASES)
def test_tiles_mixed_fast_and_fallback_epilogues(op, neg, dtype, tiles_on):
    """Rows 0-99 scaled x 30, the rest unit-scale: warps whose tile holds a score above 100
    (base 2) or a column score 44 nats above that column's positive take the exact two-exp2 /
    max-shifted epilogues, the others the one-exp2 / positive-shifted fast paths, in the same
    launch.  Each group of rows is checked against the float64 reference on its own, so that
    the large rows cannot hide an error in the small ones."""
    rng = np.random.default_rng(zlib.crc32(f"mixed{op}{neg}{dtype}".encode()))
    n, d, big = 1030, 64, 100
    inputs = make_case(op, dtype, n, d, rng, neg, m=130, scale=1 / np.sqrt(d))
    x = inputs[0].astype(np.float32)
    x[:big] *= 30
    inputs[0] = x.astype(dtype)
    kw = dict(t=0.1, reduction="none", normalize=False)
    g = rng.standard_normal(n)
    s = np.asarray(inputs[0], np.float64) @ np.asarray(inputs[1 if op != "nt_xent" else 0], np.float64).T
    if op == "nt_xent":
        np.fill_diagonal(s, 0.0)  # masked out
    assert np.abs(s).max() * 10 > 100 and np.abs(s[big:, big:]).max() * 10 < 20, "case lost its mix"
    loss, grads = run_cupynce(op, inputs, kw, g)
    ref_loss, ref_grads = run_reference(op, inputs, kw, g)
    gtol = 1e-2 if dtype == BF16 else 2e-3  # the gradient block is rounded to 16 bits
    for part in (slice(0, big), slice(big, n)):
        e = rel(cp.asnumpy(loss)[part], np.asarray(ref_loss)[part])
        assert e <= 1e-4, f"{op} rows {part}: loss rel err {e:.3e}"
        for gr, r in zip(grads, ref_grads):
            if r is None:
                continue
            r = np.asarray(r)
            sub = (lambda v: v) if r.ndim == 0 or r.shape[0] != n else (lambda v: v[part])
            e = rel(sub(cp.asnumpy(gr)), sub(r))
            assert e <= gtol, f"{op} {dtype} rows {part}: grad rel err {e:.3e} > {gtol:.0e}"


@pytest.mark.parametrize("op,neg", [("nt_xent", None), ("clip_loss", None)])
def test_tiles_tiny_upstream_gradient(op, neg, tiles_on):
    """grad_loss ~ 1e-31 per row with row log-sum-exps ~ 20 nats: the one-exp2 epilogue's
    factors f = w 2^-lse fall below the smallest normal float, where this build flushes to
    zero; those rows must take the two-exp2 form, not lose their softmax terms."""
    rng = np.random.default_rng(zlib.crc32(f"tiny{op}".encode()))
    n, d = 1030, 64
    inputs = make_case(op, BF16, n, d, rng, neg, t=0.25, scale=np.sqrt(10 / d))
    kw = dict(t=0.25, reduction="none", normalize=False)
    g = rng.uniform(0.5, 1.5, n) * 1e-31
    loss, grads = run_cupynce(op, inputs, kw, g)
    ref_loss, ref_grads = run_reference(op, inputs, kw, g)
    assert rel(loss, ref_loss) <= 1e-4
    for gr, r in zip(grads, ref_grads):
        if r is not None:
            e = rel(gr, r)
            assert e <= 1e-2, f"{op}: grad rel err {e:.3e} with a tiny upstream gradient"


@pytest.mark.parametrize("n", [2, 128, 256, 384, 640, 770, 1030, 2048, 4100])
def test_nt_xent_symmetric_forward(n, tiles_on, monkeypatch, configure):
    """NT-Xent's forward computes each pair of score tiles once (row and column partials of
    the circular half schedule, ``score_tiles.tile_lse_symmetric``).  Row-tile counts 1 to 33,
    odd and even (the even case's tiles at distance CT / 2 belong to the lower tile), partial
    last tiles and column splits: the statistics match the float64 reference and the square pass,
    the path is really taken, and a workspace too small for its column partials falls back to
    the square pass."""
    from cupynce._engine.losses import score_tiles

    rng = np.random.default_rng(zlib.crc32(f"sym{n}".encode()))
    inputs = make_case("nt_xent", BF16, n, 64, rng, scale=1 / 8)
    kw = dict(t=0.1, reduction="none", normalize=False)
    g = rng.standard_normal(n)
    taken = []
    real = score_tiles.tile_lse_symmetric

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(score_tiles, "tile_lse_symmetric", spy)  # (score_tiles.rows calls it)
    configure(symmetric_lse=True, symmetric_lse_min_nd=0)  # (default: N D >= 16384 * 512)
    sym_loss, sym_grads = run_cupynce("nt_xent", inputs, kw, g)
    assert taken == [True], "the symmetric forward was not used"
    ref_loss, ref_grads = run_reference("nt_xent", inputs, kw, g)
    assert rel(sym_loss, ref_loss) <= 1e-4
    assert rel(sym_grads[0], ref_grads[0]) <= 1e-2
    again = run_cupynce("nt_xent", inputs, kw, g)
    assert bool((again[0] == sym_loss).all()), "symmetric forward not deterministic"
    configure(symmetric_lse=False)
    sq_loss, _ = run_cupynce("nt_xent", inputs, kw, g)
    assert rel(sym_loss, cp.asnumpy(sq_loss)) <= 2e-6, "symmetric and square passes disagree"
    # column partials need 8 n ceil(n / 128) bytes; below that the square pass runs
    configure(symmetric_lse=True)
    taken.clear()
    if n >= 128:  # (one byte short still holds a row of the gradient pass's 16-bit block)
        small = 8 * n * -(-n // 128) - 1
        fb_loss, _ = run_cupynce("nt_xent", inputs, kw, g, workspace_bytes=small)
        assert taken == [False]
        assert bool((fb_loss == sq_loss).all()), "the fallback is the square pass"


@pytest.mark.parametrize("n", [2, 256, 300, 1030, 2048, 4100])
def test_nt_xent_symmetric_gradient(n, tiles_on, monkeypatch, configure):
    """NT-Xent's gradient pass computes each pair of H = G + Gᵀ tiles once and writes the
    mirror too (whole H in one workspace block): the gradient matches the float64 reference
    and the square pass, run after run bit for bit, and a workspace that splits H into row
    blocks takes the square pass."""
    from cupynce._engine.losses import score_tiles

    rng = np.random.default_rng(zlib.crc32(f"symh{n}".encode()))
    inputs = make_case("nt_xent", BF16, n, 64, rng, scale=1 / 8)
    kw = dict(t=0.1, reduction="none", normalize=True)
    g = rng.standard_normal(n)
    flags = []
    real = score_tiles.tile

    def spy(stage, *args, **kwargs):
        if stage == "h":
            flags.append(kwargs.get("tri", False))
        return real(stage, *args, **kwargs)

    monkeypatch.setattr(score_tiles, "tile", spy)  # (score_tiles' passes call it)
    configure(symmetric_h=True)
    loss, (dz,) = run_cupynce("nt_xent", inputs, kw, g)
    assert flags == [True], flags
    ref_loss, (ref_dz,) = run_reference("nt_xent", inputs, kw, g)
    assert rel(dz, ref_dz) <= 1e-2
    again = run_cupynce("nt_xent", inputs, kw, g)[1][0]
    assert bool((again.view(cp.uint16) == dz.view(cp.uint16)).all()), "not deterministic"
    configure(symmetric_h=False)
    flags.clear()
    sq = run_cupynce("nt_xent", inputs, kw, g)[1][0]
    assert flags == [False]
    assert rel(dz, cp.asnumpy(sq)) <= 5e-3, "symmetric and square gradient passes disagree"
    if n >= 256:  # H in two or more row blocks: the square pass
        configure(symmetric_h=True)
        flags.clear()
        ldg = -(-n // 8) * 8
        blocked = run_cupynce("nt_xent", inputs, kw, g, workspace_bytes=128 * ldg * 2)[1][0]
        assert flags and not any(flags)
        assert rel(blocked, cp.asnumpy(sq)) <= 5e-3


@pytest.mark.parametrize("n", [300, 1030])
@pytest.mark.parametrize("stage", ["g", "h", "h_tri", "clip"])
def test_wgmma_gradient_tiles_staged_stores(stage, n, configure):
    """The wgmma loop writes its G / H / CLIP tiles through shared memory (stmatrix, then
    16-byte stores; with ``tri`` H's mirror through stmatrix.trans).  Every element of the
    block is written (NaN-filled before), partial tiles included (n = 300, 1030: last row /
    column tiles of 44 and 6; 300 is not a multiple of 8), the mirrored H is exactly symmetric,
    and the values agree with the mma.sync loop's direct stores to the 16-bit rounding (the
    two loops accumulate the products in different orders)."""
    from cupynce._engine import tiling
    from cupynce._engine.kernels import arch_specific_build
    from cupynce._engine.losses import score_tiles

    if not arch_specific_build(score_tiles.FILE):
        pytest.skip("the wgmma main loop needs a compute-capability 9.0 GPU")
    rng = cp.random.default_rng(n)
    d, s = 64, 10.0
    q = (rng.standard_normal((n, d), dtype=cp.float32) / 8).astype(BF16)
    sym = stage.startswith("h")
    k = q if sym else (rng.standard_normal((n, d), dtype=cp.float32) / 8).astype(BF16)
    shift = n // 2 if sym else 0
    lse = score_tiles.tile_lse(q, k, None, s, exclude_diag=sym, pos_shift=shift, pos_mod=n)[0]
    rt = -(-n // tiling.TILE)
    tri = stage == "h_tri"
    ldg = -(-n // 8) * 8

    def run(wgmma: bool):
        configure(wgmma=wgmma)
        g = cp.full((n, ldg), np.nan, cp.float32).astype(BF16)
        kw = dict(pos_shift=shift, pos_mod=n, lse_row=lse, lse_col=lse,
                  weights=(None, 0, 1.0 / n), g=g[:, :n])
        if stage == "clip":
            sp = tiling.grid_splits(rt, rt)
            dsp = cp.empty((sp, n), cp.float32)
            ls = cp.full((1,), np.log(s), cp.float32)
            score_tiles.tile("clip", BF16, (rt, sp), q, 0, k, None, scale_log=ls,
                             dsp=dsp.data.ptr, part=(0, 0, n), **kw)
        else:
            sp = tiling.grid_splits(rt, rt // 2 + 1 if tri else rt)
            score_tiles.tile("h" if sym else "g", BF16, (rt, sp), q, 0, k, None, scale=s,
                             exclude_diag=sym, tri=tri, **kw)
        return cp.asnumpy(g[:, :n].astype(cp.float32))

    a, b = run(True), run(False)
    assert not np.isnan(a).any(), f"wgmma {stage}: unwritten elements {np.argwhere(np.isnan(a))[:5]}"
    assert not np.isnan(b).any(), f"mma.sync {stage}: unwritten elements"
    if tri:
        assert bool((a == a.T).all()), "the mirrored H is not exactly symmetric"
    np.testing.assert_allclose(a, b, rtol=2.0 ** -7, atol=1e-4 * float(np.abs(b).max()))


# ---- arrays on two GPUs: a clear ValueError before any kernel runs ------------------------
def _two_gpus():
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")


@pytest.mark.parametrize("case", ["info_nce_key", "info_nce_negatives", "clip_b",
                                  "clip_logit_scale"])
def test_arrays_on_two_gpus_raise(case, monkeypatch):
    _two_gpus()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    with cp.cuda.Device(0):
        on0 = cp.asarray(x)
        ls0 = cp.asarray(np.float32(2.0))
    with cp.cuda.Device(1):
        on1 = cp.asarray(x)
        neg1 = cp.asarray(rng.standard_normal((3, 4)).astype(np.float32))
        ls1 = cp.asarray(np.float32(2.0))

    def boom(*args, **kwargs):
        raise AssertionError("a kernel ran before the device check")
    from cupynce._engine import kernels
    from cupynce._engine.gemm import cublas
    from cupynce._engine.losses import stats

    monkeypatch.setattr(kernels, "launch", boom)  # every engine module launches through these
    monkeypatch.setattr(kernels, "get_kernel", boom)
    monkeypatch.setattr(stats, "launch", boom)  # (stats imports kernels.launch by name)
    monkeypatch.setattr(cublas, "cublas_gemm", boom)
    with cp.cuda.Device(0):
        if case == "info_nce_key":
            with pytest.raises(ValueError, match=r"info_nce: all arrays must be on one GPU, got "
                                                 r"query on cuda:0, key on cuda:1"):
                cupynce.info_nce(on0, on1)
        elif case == "info_nce_negatives":
            with pytest.raises(ValueError, match=r"info_nce: .*negatives on cuda:1"):
                cupynce.info_nce(on0, on0, negatives=neg1)
        elif case == "clip_b":
            with pytest.raises(ValueError, match=r"clip_loss: .*a on cuda:0, b on cuda:1"):
                cupynce.clip_loss(on0, on1, ls0)
        else:
            with pytest.raises(ValueError, match=r"clip_loss: logit_scale is on cuda:1 but a is "
                                                 r"on cuda:0"):
                cupynce.clip_loss(on0, on0, ls1)


# ---- what a new user hit: huge rows under normalize=True, one-row batches, device scalars ----
@pytest.fixture(params=["cublas", "tiles"])
def gpu_path(request, configure):
    """Each test twice: the cuBLAS row-block path and the tile kernels (16-bit inputs; the
    main loop the GPU builds by default, mma.sync elsewhere)."""
    configure(tiles=request.param == "tiles")
    return request.param


#: a row scale whose sum of squares overflows the accumulator (float32: |x| >~ 1.8e19)
HUGE = {np.dtype(np.float32): 1e20, BF16: 1e20, np.dtype(np.float64): 1e160}
HUGE_TOL = {np.dtype(np.float32): (1e-5, 1e-4), BF16: (1e-2, 3e-2),
            np.dtype(np.float64): (1e-12, 1e-12)}


@pytest.mark.parametrize("dtype", list(HUGE), ids=str)
@pytest.mark.parametrize("op,neg", CASES)
def test_normalize_huge_rows(op, neg, dtype, gpu_path):
    """l2norm_fwd computes ||x|| = m ||x / m|| (m = max |x_k|) where the sum of squares
    overflows: such rows were treated as zero rows.  Fixed tolerances against the float64
    oracle (torch's own bf16 F.normalize overflows here, so it cannot set the bound); each
    gradient row is compared relative to its own size (huge rows get ~1 / ||x|| gradients)."""
    rng = np.random.default_rng(zlib.crc32(f"huge{op}{neg}{dtype}{gpu_path}".encode()))
    n, d = (42 if op == "nt_xent" else 41), 64
    inputs = make_case(op, dtype, n, d, rng, neg, scale=HUGE[dtype])
    inputs[0][1] = rng.standard_normal(d).astype(dtype)  # one ordinary row among huge ones
    kw = dict(t=0.2, reduction="mean", normalize=True)
    loss, grads = run_cupynce(op, inputs, kw, 0.7)
    ref_loss, ref_grads = run_reference(op, inputs, kw, 0.7)
    lt, gt = HUGE_TOL[dtype]
    assert rel(loss, ref_loss) <= lt, (float(loss), ref_loss)
    for g, r in zip(grads, ref_grads):
        if r is None:
            continue
        if np.ndim(r) == 0:  # dlogit_scale
            assert rel(g, r) <= gt
            continue
        g64 = cp.asnumpy(g).astype(np.float64).reshape(len(r), -1)
        r64 = np.asarray(r, np.float64).reshape(len(r), -1)
        s = np.maximum(np.linalg.norm(r64, axis=1, keepdims=True), 1e-300)
        assert np.isfinite(g64).all()
        assert rel(g64 / s, r64 / s) <= gt


#: (rows, D) of the wide-row normalisation test: 1 to 8 warps a row (arrays.norm_warps), rows
#: that leave a block's last row slots empty, D not a multiple of the group's lanes
WIDE_ROWS = [(1, 32768), (3, 8192), (9, 4099), (17, 2049), (5, 2048), (40, 300)]
#: bound on a row's relative error: a lane sums at most 64 entries, then <= 8 tree levels,
#: so ||x||^2 is within 72 u of its float64 value (the standard gamma_n bound), with room;
#: a 16-bit output is then rounded once more (its u)
WIDE_TOL = {np.dtype(np.float32): 80 * 2.0 ** -24, BF16: 2.0 ** -8 + 80 * 2.0 ** -24,
            np.dtype(np.float64): 80 * 2.0 ** -53}


@pytest.mark.parametrize("dtype", list(WIDE_TOL), ids=str)
@pytest.mark.parametrize("n,d", WIDE_ROWS, ids=str)
def test_normalize_wide_rows(n, d, dtype):
    """The row normalisation (forward ``arrays.normalize``, backward ``arrays.finish``) with
    several warps a row at wide D, against float64 row by row, the sum-of-squares overflow
    (every other row huge: rows that rescale and rows that do not share a block's barriers)
    included; the same bits twice."""
    from cupynce._engine import arrays

    # a lane sums at most 64 entries: warps a row by D (a power of 2, at most 8)
    assert arrays.norm_warps(d) == {32768: 8, 8192: 4, 4099: 4, 2049: 2, 2048: 1, 300: 1}[d]
    rng = np.random.default_rng(zlib.crc32(f"wide{n}{d}{dtype}".encode()))
    x64 = rng.standard_normal((n, d))
    if d == 8192:
        x64[::2] *= HUGE[dtype]  # rows 0, 2: the overflow path, row 1 not
    x = x64.astype(dtype)
    xr = x.astype(np.float64)
    big = np.abs(xr).max(axis=1)
    norm_ref = big * np.linalg.norm(xr / big[:, None], axis=1)  # (float64 overflows at 1e160)
    xn_ref = xr / np.maximum(norm_ref, 1e-12)[:, None]
    dxn = rng.standard_normal((n, d))
    acc = np.float64 if dtype == np.float64 else np.float32
    dxn = dxn.astype(acc).astype(np.float64)
    proj = (xn_ref * dxn).sum(axis=1, keepdims=True)
    dx_ref = (dxn - xn_ref * proj) / norm_ref[:, None]
    tol = WIDE_TOL[dtype]
    runs = []
    for _ in range(2):
        xn, norm = arrays.normalize(cp.asarray(x))
        dx = arrays.finish(cp.asarray(x), norm, cp.asarray(dxn.astype(acc)), None)
        runs.append([cp.asnumpy(a) for a in (xn, norm, dx)])
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()
    xn, norm, dx = (a.astype(np.float64) for a in runs[0])
    np.testing.assert_array_less(np.abs(norm - norm_ref) / norm_ref, tol)
    for name, got, want in (("xn", xn, xn_ref), ("dx", dx, dx_ref)):
        err = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
        assert (err <= 2 * tol).all(), f"{name}: rows {np.nonzero(err > 2 * tol)[0]}, {err.max():.2e}"


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,neg", [("info_nce", None), ("info_nce", "shared"),
                                    ("info_nce", "paired"), ("clip_loss", None)])
def test_one_row_batch(op, neg, dtype, reduction, gpu_path):
    """N = 1 (the last batch of an epoch) on every path, against the float64 oracle: info_nce
    with its negatives, and the in-batch-only losses log 1 - 0 = 0 with zero gradients (to
    rounding: the GPU's online log-sum-exp gives ~1e-8 in float32, not an exact 0; the errors
    against a zero reference are absolute).  A one-row loss is one term, with no averaging of
    the rounding over rows: its floor in 16-bit dtypes is ε/2 (one rounding of the normalised
    inputs) instead of the ε/8 of the many-row tests."""
    rng = np.random.default_rng(zlib.crc32(f"one{op}{neg}{dtype}{reduction}".encode()))
    inputs = make_case(op, dtype, 1, 64, rng, neg, m=5, scale=1 / 8)
    kw = dict(t=0.2, reduction=reduction, normalize=True)
    g = grad_for(reduction, 1, rng)
    floor = float(ml_dtypes.finfo(dtype).eps) / 2 if dtype.itemsize == 2 else 0.0
    check(op, dtype, inputs, kw, g, loss_floor=floor)


def test_device_array_temperature_is_a_device_scale():
    """A CuPy temperature is a learnable input (issue 55), never read on the host: the engine
    takes −log τ as a device scale; the loss is the real temperature's (float32, 1e-6)."""
    z = cp.asarray(np.random.default_rng(0).standard_normal((8, 3)), cp.float32)
    got = float(cupynce.nt_xent(z, cp.asarray(0.5, cp.float32)))
    assert abs(got - float(cupynce.nt_xent(z, 0.5))) <= 1e-6 * abs(got)


def _check_col_partials(pm, ps, logits, ch, tol):
    """row_col_stats' column partials against float64: chunk c's (m, s) is its column's exact
    maximum over the chunk's rows (the logits rounded once to the accumulator dtype) and the
    sum of exp(L - m) (>= 1); an all -inf column is (-inf, 0)."""
    a = pm.dtype
    pm, ps = cp.asnumpy(pm), cp.asnumpy(ps).astype(np.float64)
    for c in range(pm.shape[0]):
        blk = logits[c * ch:(c + 1) * ch]
        mx = blk.max(axis=0)
        live = np.isfinite(mx)
        assert (pm[c][~live] == -np.inf).all() and (ps[c][~live] == 0).all()
        np.testing.assert_array_equal(pm[c][live], mx[live].astype(a))
        want = np.exp(blk[:, live] - mx[live]).sum(axis=0)
        np.testing.assert_allclose(ps[c][live], want, rtol=tol)


@pytest.mark.parametrize("a_dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_row_col_stats_shared_and_exact_column_blocks(a_dtype):
    """row_col_stats adds a lane's 4 x 4 block with one exponential a score where the block's
    column maxima lie within 64 of each other, and each column's own exponentials elsewhere:
    both kinds side by side (columns < 300 narrow logits, the rest spread over ~±120), a NaN
    in each kind, against float64 -- the rows' lse (NaN only for the NaN's rows) and every
    column partial (NaN only for the NaN's column, in its chunk)."""
    from cupynce._engine.losses import stats

    a = np.dtype(a_dtype)
    rows, nc = 70, 600
    rng = np.random.default_rng(7)
    host = rng.standard_normal((rows, nc))
    host[:, 300:] *= 40.0
    host = host.astype(a).astype(np.float64)
    nan_at = [(3, 10), (40, 401)]
    for r, c in nan_at:
        host[r, c] = np.nan
    s = cp.asarray(host.astype(a))
    lse = cp.full((rows,), -1.0, a)
    ch = stats.STATS_ROWS
    chunks = -(-rows // ch)
    pm, ps = cp.empty((chunks, nc), a), cp.empty((chunks, nc), a)
    stats.row_col_stats(s, a, 0, 0, nc, 0, a.type(1.0), lse.data.ptr, 0, pm, ps)
    tol = 1e-5 if a == np.float32 else 1e-13
    bad_rows = [r for r, _ in nan_at]
    got = cp.asnumpy(lse).astype(np.float64)
    assert np.isnan(got[bad_rows]).all()
    ok = np.setdiff1d(np.arange(rows), bad_rows)
    mx = host[ok].max(axis=1, keepdims=True)
    want = (mx + np.log(np.exp(host[ok] - mx).sum(axis=1, keepdims=True)))[:, 0]
    np.testing.assert_allclose(got[ok], want, rtol=tol)
    pmh, psh = cp.asnumpy(pm).astype(np.float64), cp.asnumpy(ps).astype(np.float64)
    val = pmh + np.log(psh)
    for r, c in nan_at:
        assert np.isnan(val[r // ch, c]), f"the NaN at {(r, c)} vanished from its column"
        val[r // ch, c] = 0.0
        host[r, c] = -np.inf
    for c in range(chunks):  # (the NaNs' columns checked above, the rest here)
        blk = host[c * ch:(c + 1) * ch]
        m = blk.max(axis=0)
        w = m + np.log(np.exp(blk - m).sum(axis=0))
        keep = np.ones(nc, bool)
        keep[[cc for r, cc in nan_at if r // ch == c]] = False
        np.testing.assert_allclose(val[c][keep], w[keep], rtol=tol, atol=tol * 8)

@pytest.mark.parametrize("a_dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("rows,nc", [(1, 1), (33, 257), (100, 1000), (17, 5), (70, 600)])
def test_row_col_stats_is_row_softmax_and_the_column_partials(a_dtype, rows, nc):
    """stats.row_col_stats (CLIP's and the cross blocks' statistics in one read): each row's
    lse and loss those of the row_softmax kernel to a few roundings (a device logit scale; the
    terms merge in another order), and with an exact
    scale the rows' lse and the column partials -- each chunk's exact maximum, the sum of
    exp(L - max) -- against float64 to the accumulator's rounding, on a strided block with a
    -inf and a large logit (the large logit's block takes the kernel's per-column
    exponentials, the others its shared ones)."""
    from cupynce._engine.kernels import launch
    from cupynce._engine.losses import stats

    a = np.dtype(a_dtype)
    rng = np.random.default_rng(rows * 1000 + nc)
    host = rng.standard_normal((rows, nc + 3))
    host[0, 0] = -np.inf
    host[-1, -4] = 30.0
    buf = cp.asarray(host.astype(a))
    s = buf[:, :nc]
    ls = cp.asarray(np.array([np.log(7.0)], a))
    shift, mod = 2, nc
    lse, loss = cp.full((rows,), np.nan, a), cp.full((rows,), np.nan, a)
    lse2, loss2 = cp.full((rows,), np.nan, a), cp.full((rows,), np.nan, a)
    ch = stats.STATS_ROWS
    chunks = -(-rows // ch)
    pm, ps = cp.empty((chunks, nc), a), cp.empty((chunks, nc), a)
    row0 = 5  # (global rows 5..: the pointers shifted back, as row_blocks.clip passes them)
    off = row0 * a.itemsize
    got = stats.row_col_stats(s, a, row0, shift, mod, ls, a.type(1.0), lse.data.ptr - off,
                              loss.data.ptr - off, pm, ps)
    assert got == chunks
    launch(stats.FILE, "row_softmax", a, (rows,), (
        s, np.int64(nc + 3), np.int32(nc), 0, np.int64(0), np.int32(0), np.int32(row0),
        np.int32(0), np.int32(shift), np.int32(mod), ls, a.type(1.0), 0, lse2.data.ptr - off,
        loss2.data.ptr - off, 0, np.int64(0), 0, np.int64(0), 0, np.int64(0), a.type(0),
        0, 0, np.int32(0), a.type(0), np.int32(0), a.type(0), np.int32(0), np.int32(0),
        np.int32(1)))  # (no labels, no smoothing, no hardness)
    # (the same terms merged in another order: a few roundings apart)
    close = 4 * float(np.finfo(a).eps)
    big = close * (1.0 + float(np.nanmax(np.abs(cp.asnumpy(lse2)))))
    np.testing.assert_allclose(cp.asnumpy(lse), cp.asnumpy(lse2), rtol=close, atol=big)
    np.testing.assert_allclose(cp.asnumpy(loss), cp.asnumpy(loss2), rtol=close, atol=big)
    # the column partials, with the scale 7 exact (no exp on the device): logits rounded once
    stats.row_col_stats(s, a, row0, shift, mod, 0, a.type(7.0), lse.data.ptr - off, 0, pm, ps)
    logits = 7.0 * host[:, :nc].astype(a).astype(np.float64)
    tol = 1e-5 if a == np.float32 else 1e-13
    fin = np.where(np.isfinite(logits), logits, -np.inf)
    mx = fin.max(axis=1, keepdims=True)
    want_lse = (mx + np.log(np.exp(fin - mx).sum(axis=1, keepdims=True)))[:, 0]
    np.testing.assert_allclose(cp.asnumpy(lse).astype(np.float64), want_lse, rtol=tol)
    _check_col_partials(pm, ps, logits, ch, tol)
    if rows > 1 and nc > 2:  # a NaN score: its row's lse and its column's partial are NaN
        buf[1, 2] = np.nan
        stats.row_col_stats(s, a, row0, shift, mod, 0, a.type(7.0), lse.data.ptr - off, 0,
                            pm, ps)
        assert np.isnan(cp.asnumpy(lse)[1]) and np.isfinite(cp.asnumpy(lse)[2:]).all()
        col = cp.asnumpy(pm[0, 2]).astype(np.float64) + np.log(cp.asnumpy(ps[0, 2]))
        assert np.isnan(col)
    # a zero logit scale (exp(ls) underflows): every logit 0, the columns past n (the tile's
    # tail) still out of the sums -- each row's lse log n, each chunk's partial (0, its rows)
    buf[...] = cp.asarray(rng.standard_normal(buf.shape).astype(a))
    stats.row_col_stats(s, a, row0, shift, mod, 0, a.type(0.0), lse.data.ptr - off,
                        loss.data.ptr - off, pm, ps)
    np.testing.assert_allclose(cp.asnumpy(lse).astype(np.float64), np.log(nc), rtol=tol)
    np.testing.assert_array_equal(cp.asnumpy(loss), cp.asnumpy(lse))
    np.testing.assert_array_equal(cp.asnumpy(pm), 0)
    counts = [min(ch, rows - c * ch) for c in range(chunks)]
    np.testing.assert_array_equal(cp.asnumpy(ps), np.repeat(counts, nc).reshape(chunks, nc))
