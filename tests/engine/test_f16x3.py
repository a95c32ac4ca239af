"""The F16x3 float32 products (``kernels_src/products/tiles_ws_f16x3.cu``, ``gemm.f16x3``,
issue 24; a prototype no op takes yet) on Hopper, against a float64 oracle and cuBLAS fp32.

* The split (any GPU): hi + lo = x 2^e to ~2^-22 of the row's largest |x| (float16 halves,
  per-row / per-column / whole-matrix powers of two), the inverse scales exact, zero pads,
  inf and NaN kept, rows of very different sizes each scaled on their own.
* The products (compute capability 9.0 and tensor maps): ``mm`` and ``mmt`` against float64
  at most MM_TOL and at most MM_FACTOR x cuBLAS fp32's error (the bounds of the TF32x3 tiles'
  test_mm_against_float64_and_fp32, whose promotion this kernel shares: chunks of 64 of K
  here, the mean truncation loss compensated, ``config.f16x3_trunc``; ONE_CHUNK_FACTOR for
  K <= 64), ``mmt`` the same bits as ``mm`` of a transposed copy, the scales applied exactly
  (rows 1e-20 and 1e12 x the others), ``accumulate``, determinism.

Skips without CuPy / a GPU (the split) or without compute capability 9.0 (the products).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cupynce.config as cfg  # noqa: E402
from cupynce._engine.gemm import cublas, f16x3 as F  # noqa: E402
from cupynce._engine.gemm.chooser import f16_applies  # noqa: E402

gpu = pytest.mark.gpu
MM_TOL = 3e-7
MM_FACTOR = {"positive": 2.5, "zero-mean": 1.25}
#: K <= 64, one promoted chunk: 12 truncating MMA steps against fp32's chain of K
#: round-to-nearest FMAs (measured on an H100 at K = 64: 1.32x zero-mean; all-positive data
#: 2.16x, its mean truncation loss under-compensated by ~1.1e-7 -- MM_FACTOR's 2.5 holds;
#: the TF32x3 tiles' one-chunk bound is 2x)
ONE_CHUNK_FACTOR = 1.5


@pytest.fixture
def dev():
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cp.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")


@pytest.fixture
def f16x3(dev):
    if not F.available():
        pytest.skip("the F16x3 tiles need a compute-capability 9.0 GPU and TMA")


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    num = np.linalg.norm((x - ref).ravel())
    return math.inf if not np.isfinite(num) else float(num / np.linalg.norm(ref.ravel()))


def _recon(hi, lo, inv_rows=None, inv_cols=None):
    x = cp.asnumpy(hi).astype(np.float64) + cp.asnumpy(lo).astype(np.float64)
    if inv_rows is not None:
        x = x * cp.asnumpy(inv_rows).astype(np.float64)[:, None]
    if inv_cols is not None:
        x = x * cp.asnumpy(inv_cols).astype(np.float64)[None, :]
    return x


def _out(m, c):
    """float32 (m, c) with an even leading dimension, NaN-filled (unwritten shows)."""
    return cp.full((m, c + (c & 1)), np.nan, np.float32)[:, :c]


@gpu
def test_split_rows_scales_each_row(dev):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 37)).astype(np.float32)
    x[1] *= 1e-20
    x[2] *= 1e12
    x[3] = 0
    x[4, 5] = np.inf
    x[5, 6] = np.nan
    hi, lo, inv = F.split_rows(cp.asarray(x))
    assert hi.shape == (40, 40) and lo.shape == (40, 40) and inv.shape == (40,)
    h, l_ = cp.asnumpy(hi), cp.asnumpy(lo)
    assert not h[:, 37:].any() and not l_[:, 37:].any()  # pads zero
    inv = cp.asnumpy(inv)
    assert np.all(np.frexp(inv)[0] == 0.5)  # powers of two
    big = np.abs(h).astype(np.float64).max(axis=1)
    finite = [r for r in range(40) if r not in (3, 4, 5)]
    assert np.all((big[finite] >= 2.0 ** 14) & (big[finite] <= 2.0 ** 15))
    rec = _recon(hi, lo, inv)[:, :37]
    for r in finite:  # ~22 bits of each row's largest
        assert np.abs(rec[r] - x[r]).max() <= 2.0 ** -22 * np.abs(x[r]).max(), r
    assert inv[4] == 1 and inv[5] == 1  # not scaled
    assert np.isinf(h[4, 5]) and np.isnan(h[5, 6]) and l_[4, 5] == 0
    assert not rec[3].any()


@gpu
def test_split_cols_t_and_scaled(dev):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((301, 20)).astype(np.float32)
    x[:, 3] *= 1e-15
    hi, lo, inv = F.split_cols_t(cp.asarray(x))
    assert hi.shape == (20, 304) and inv.shape == (20,)
    rec = _recon(hi, lo, inv)
    assert not rec[:, 301:].any()
    for c in range(20):
        assert np.abs(rec[c, :301] - x[:, c]).max() <= 2.0 ** -22 * np.abs(x[:, c]).max(), c
    g = (rng.random((50, 13)) - 0.5).astype(np.float32) / 64  # |g| <= 2^-7
    gh, gl = F.split_scaled(cp.asarray(g), 21)
    rec = _recon(gh, gl) * 2.0 ** -21
    assert gh.shape == (50, 16) and not rec[:, 13:].any()
    assert np.abs(rec[:, :13] - g).max() <= 2.0 ** -22 * 2.0 ** -7


@gpu
@pytest.mark.parametrize("data", ["positive", "zero-mean"])
@pytest.mark.parametrize("m,k,c", [(300, 520, 200), (129, 1030, 130), (257, 4096, 512),
                                   (130, 64, 129)])
def test_mm_against_float64_and_fp32(f16x3, m, k, c, data):
    rng = np.random.default_rng(m + k)
    if data == "positive":
        a = rng.random((m, k)).astype(np.float32)
        b = rng.random((c, k)).astype(np.float32)
    else:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((c, k)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    ad, bd = cp.asarray(a), cp.asarray(b)
    ah, al, ia = F.split_rows(ad)
    bh, bl, ib = F.split_rows(bd)
    out = _out(m, c)
    F.mm((ah, al), (bh, bl), out, alpha=0.5, rowf=ia, colf=ib, k=k)
    got = 2.0 * cp.asnumpy(out)
    fp32 = cp.empty((m, c), np.float32)
    with cfg.float32_precision("fp32"):
        cublas.gemm(ad, bd, fp32, trans_b=True)
    e_k, e_f = _rel(got, ref), _rel(cp.asnumpy(fp32), ref)
    msg = f"f16x3 mm {e_k:.3g} against cuBLAS fp32 {e_f:.3g}"
    factor = max(ONE_CHUNK_FACTOR, MM_FACTOR[data]) if k <= F.KSTEP else MM_FACTOR[data]
    assert e_k <= factor * e_f, msg
    assert e_k <= MM_TOL, msg
    again = _out(m, c)
    F.mm((ah, al), (bh, bl), again, alpha=0.5, rowf=ia, colf=ib, k=k)
    assert np.array_equal(cp.asnumpy(again).view(np.uint32), cp.asnumpy(out).view(np.uint32))


@gpu
@pytest.mark.parametrize("m,k,c", [(300, 200, 260), (1000, 513, 777), (128, 4096, 64)])
def test_mmt_is_mm_of_the_transpose(f16x3, m, k, c):
    """G (k x m) stored, one scale for all of it (a gradient block); B's halves per column
    of b (c x k as G B's operand: split_cols_t of b (k x c))."""
    rng = np.random.default_rng(k)
    g = (rng.random((k, m)) - 0.3).astype(np.float32) / k  # |g| < 1 / k
    b = rng.standard_normal((k, c)).astype(np.float32)
    e = 15 + int(math.ceil(math.log2(k))) - 1
    gh, gl = F.split_scaled(cp.asarray(g), e)
    bh, bl, ib = F.split_cols_t(cp.asarray(b))
    out = _out(m, c)
    F.mm((gh, gl), (bh, bl), out, alpha=2.0 ** -e, colf=ib, trans_a=True, k=k)
    gt = np.ascontiguousarray(g.T)
    th, tl = F.split_scaled(cp.asarray(gt), e)
    out2 = _out(m, c)
    F.mm((th, tl), (bh, bl), out2, alpha=2.0 ** -e, colf=ib, k=k)
    assert np.array_equal(cp.asnumpy(out).view(np.uint32), cp.asnumpy(out2).view(np.uint32))
    ref = gt.astype(np.float64) @ b.astype(np.float64)
    fp32 = cp.asnumpy(cp.asarray(gt) @ cp.asarray(b))
    e_k, e_f = _rel(cp.asnumpy(out), ref), _rel(fp32, ref)
    assert e_k <= MM_TOL and e_k <= 1.25 * e_f, f"f16x3 mmt {e_k:.3g}, fp32 {e_f:.3g}"
    acc = _out(m, c)
    acc[...] = out
    F.mm((gh, gl), (bh, bl), acc, alpha=2.0 ** -e, colf=ib, trans_a=True, k=k,
         accumulate=True)
    assert np.array_equal(cp.asnumpy(acc), cp.asnumpy(out) + cp.asnumpy(out))
    # the halves interleaved in place in G's own float32 buffer: the same bits, either way
    for stored, ta, want in ((g, True, out), (gt, False, out2)):
        rows, cols = stored.shape
        buf = cp.full((rows, -(-cols // 64) * 64 + 64), np.nan, np.float32)[:, :cols]
        buf[...] = cp.asarray(stored)
        il = F.split_scaled_il(buf, e)
        o = _out(m, c)
        F.mm(il, (bh, bl), o, alpha=2.0 ** -e, colf=ib, trans_a=ta, k=k)
        assert np.array_equal(cp.asnumpy(o).view(np.uint32), cp.asnumpy(want).view(np.uint32)), ta


@gpu
def test_rows_of_any_size_keep_their_accuracy(f16x3):
    """Rows 1e-20 and 1e12 x the others, each scaled on its own: every score accurate
    relative to its own rows' norms (a whole-matrix scale would lose the small rows)."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((200, 300)).astype(np.float32)
    b = rng.standard_normal((150, 300)).astype(np.float32)
    a[3] *= 1e-20
    b[7] *= 1e12
    a[9] = 0
    ah, al, ia = F.split_rows(cp.asarray(a))
    bh, bl, ib = F.split_rows(cp.asarray(b))
    out = _out(200, 150)
    F.mm((ah, al), (bh, bl), out, rowf=ia, colf=ib)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = a64 @ b64.T
    norms = np.linalg.norm(a64, axis=1)[:, None] * np.linalg.norm(b64, axis=1)[None, :]
    got = cp.asnumpy(out).astype(np.float64)
    assert not got[9].any()
    rel = np.abs(got - ref)[norms > 0] / norms[norms > 0]
    assert rel.max() <= 2e-7, rel.max()


@gpu
def test_nonfinite_stay_nonfinite(f16x3):
    a = np.ones((130, 64), np.float32)
    b = np.ones((140, 64), np.float32)
    a[5, 3] = np.nan
    b[6, 2] = np.inf
    ah, al, ia = F.split_rows(cp.asarray(a))
    bh, bl, ib = F.split_rows(cp.asarray(b))
    out = cp.asnumpy(F.mm((ah, al), (bh, bl), _out(130, 140), rowf=ia, colf=ib))
    assert np.isnan(out[5]).all()
    # (inf, or NaN from 0 inf in a cross term: never a finite number)
    assert not np.isfinite(out[:, 6]).any()
    keep = np.ones_like(out, bool)
    keep[5] = False
    keep[:, 6] = False
    assert np.abs(out[keep] - 64).max() <= 64 * 2e-7  # (times 1 + f16x3_trunc: 64.00001)


@gpu
def test_split_scaled_il_layout(dev):
    rng = np.random.default_rng(3)
    x = (rng.random((5, 130)) - 0.5).astype(np.float32)
    buf = cp.full((5, 192), np.nan, np.float32)[:, :130]
    buf[...] = cp.asarray(x)
    F.split_scaled_il(buf, 14)
    raw = cp.asnumpy(buf.base).view(np.float16).reshape(5, 3, 2, 64)  # row, group, hi|lo
    hi = raw[:, :, 0].reshape(5, 192)
    lo = raw[:, :, 1].reshape(5, 192)
    h2, l2 = F.split_scaled(cp.asarray(x), 14)
    assert np.array_equal(hi[:, :130], cp.asnumpy(h2)[:, :130])
    assert np.array_equal(lo[:, :130], cp.asnumpy(l2)[:, :130])
    assert not hi[:, 130:].any() and not lo[:, 130:].any()
    with pytest.raises(ValueError, match="multiple of 64"):
        F.split_scaled_il(cp.zeros((4, 100), np.float32), 0)


@gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("ws", [None, 1920 * 4100 * 4])
@pytest.mark.parametrize("n,d", [(4100, 512), (4099, 512), (4100, 514)])
def test_clip_on_f16x3(f16x3, monkeypatch, reduction, ws, n, d):
    """CLIP under "auto" (config.f16x3): every product on the F16x3 tiles (the
    gradient block as G's halves written in place by cpn_clip_grad_f16x3: G Bᵀ and Gᵀ A
    read it interleaved), one block and row blocks (1892, 1892, 316 rows: score rows padded
    to 4160 columns), reduction "none" (per-pair weights on the device: G's exponent from
    f16x3.bound_exp; the statistics pass and the backward's recompute the same score
    product, odd N included); loss and gradients within fp32's errors against float64
    (x 1.25, + 2^-24 for the one-number loss), deterministic."""
    import cupynce
    from cupynce import reference as R
    from cupynce.ops import _graphs

    if not f16_applies():
        pytest.skip("F16x3 switched off (CUPYNCE_F16X3=0)")
    seen = []
    real = F.mm
    monkeypatch.setattr(F, "mm", lambda *a, **k: seen.append(
        (isinstance(a[0], F.Interleaved), bool(k.get("trans_a")))) or real(*a, **k))
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = (x + 0.6 * rng.standard_normal((n, d))).astype(np.float32)
    ls = math.log(1 / 0.07)
    up = rng.random(n).astype(np.float32) + 0.5 if reduction == "none" else None
    ref_loss, ref_grads = R.clip_loss(x, y, ls, normalize=True, reduction=reduction,
                                      grad_loss=up)

    def run(precision):
        _graphs.clear()
        loss, ctx = cupynce.clip_loss_forward(cp.asarray(x), cp.asarray(y),
                                              cp.asarray(np.float32(ls)), normalize=True,
                                              reduction=reduction, workspace_bytes=ws,
                                              precision=precision)
        grads = (cupynce.clip_loss_backward(ctx) if up is None
                 else cupynce.clip_loss_backward(ctx, cp.asarray(up)))
        return [cp.asnumpy(v) for v in (loss, *grads)]

    got = run("auto")
    assert (False, False) in seen and (True, False) in seen and (True, True) in seen, seen
    again = run("auto")
    del seen[:]
    fp32 = run("fp32")
    assert not seen
    for name, g_, a_, f_, r in zip(("loss", "da", "db", "dscale"), got, again, fp32,
                                   [ref_loss, *ref_grads]):
        assert np.array_equal(np.asarray(g_).view(np.uint32), np.asarray(a_).view(np.uint32)), name
        if name == "dscale":  # (a cancelling sum: ops/test_precision_accuracy holds it to fp32's)
            continue
        e_k, e_f = _rel(g_, r), _rel(f_, r)
        assert e_k <= 1.25 * e_f + 2.0 ** -24, f"{name}: f16x3 {e_k:.3g} fp32 {e_f:.3g}"


@gpu
def test_clip_odd_d_keeps_float32_g(f16x3, monkeypatch):
    """D odd: the gradient products' outputs (rows of D floats) cannot take the F16x3
    stores, so G stays float32 (clip_grad) and its products go where the float32 path sends
    them (cuBLAS fp32: the TF32x3 tiles want D a multiple of 4); the score product is
    F16x3's in both passes; no error, fp32's accuracy."""
    import cupynce
    from cupynce import reference as R
    from cupynce._engine.gemm import tf32x3
    from cupynce.ops import _graphs

    if not f16_applies():
        pytest.skip("F16x3 switched off (CUPYNCE_F16X3=0)")
    seen = []
    real, real32 = F.mm, tf32x3.mm
    monkeypatch.setattr(F, "mm", lambda *a, **k: seen.append(16) or real(*a, **k))
    monkeypatch.setattr(tf32x3, "mm", lambda *a, **k: seen.append(32) or real32(*a, **k))
    rng = np.random.default_rng(8)
    n, d = 4100, 513
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = (x + 0.6 * rng.standard_normal((n, d))).astype(np.float32)
    ref_loss, ref_grads = R.clip_loss(x, y, 2.0, normalize=True)
    out = {}
    for p in ("auto", "fp32"):
        _graphs.clear()
        loss, ctx = cupynce.clip_loss_forward(cp.asarray(x), cp.asarray(y), 2.0,
                                              normalize=True, precision=p)
        out[p] = [cp.asnumpy(v) for v in (loss, *cupynce.clip_loss_backward(ctx))]
    assert 16 in seen and 32 not in seen, seen
    for name, a_, f_, r in zip(("loss", "da", "db"), out["auto"], out["fp32"],
                               [ref_loss, *ref_grads]):
        e_k, e_f = _rel(a_, r), _rel(f_, r)
        assert e_k <= 1.25 * e_f + 2.0 ** -24, f"{name}: auto {e_k:.3g} fp32 {e_f:.3g}"


def test_mm_checks_its_operands(monkeypatch):
    class Fake:
        def __init__(self, shape, dtype, strides=None):
            self.shape, self.dtype, self.ndim = shape, np.dtype(dtype), len(shape)
            self.size = shape[0] * shape[1]
            self.strides = strides or (shape[1] * self.dtype.itemsize, self.dtype.itemsize)

            class D:
                ptr = 0
            self.data = D()

    h = Fake((128, 64), np.float16)
    with pytest.raises(ValueError, match="A_hi must be float16"):
        F.mm((Fake((128, 64), np.float32), h), (h, h), Fake((128, 128), np.float32))
    with pytest.raises(ValueError, match="more rows than op"):
        F.mm((h, h), (h, h), Fake((256, 128), np.float32))
    with pytest.raises(ValueError, match="even leading"):
        F.mm((h, h), (h, h), Fake((128, 127), np.float32))
