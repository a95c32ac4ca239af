"""The float32 products of the row-block path on the TF32x3 tiles (``gemm.plan``, issue 24):
CLIP's, SigLIP's and InfoNCE's score and gradient products on Hopper under the float32
precisions "auto" (from ``config.tf32x3_min_rows`` x ``config.tf32x3_min_dim``, or
``tf32x3_min_dim_scale`` for CLIP and SigLIP) and "3xtf32".

* ``mm`` of a transposed A (the ``mmt`` kernel, G read as stored) is, bit for bit, ``mm``
  of a transposed copy (the same hi / lo in the same products), whatever the shapes' tails;
  the accumulating product is the plain product added in float32 (the same bits).
* :meth:`TilesPlan.gemm` is, bit for bit, ``tf32x3.mm`` on the operands it builds (A Bᵀ,
  G B, Gᵀ A reading G as stored, which it leaves unchanged) and cuBLAS fp32 on what the tiles
  do not take (``beta`` not 0 / 1, G without 16-byte rows, a refused launch).  Against
  float64 these products are held to ``MM_TOL`` (engine/test_tf32_tiles.py's bound of the
  promoted products).
* The ops route there under "auto" / "3xtf32" only; a CLIP in row blocks (dB accumulated
  over blocks) stays within the float32 tolerances of
  ops/test_contrastive_kernels.py.  The accuracy bar against "fp32" is
  ops/test_precision_accuracy.py's (``test_auto_row_block_ops_as_accurate_as_fp32``).

CPU tests at the end (the routing rule, with the device check stubbed).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cupynce.config as cfg  # noqa: E402
from cupynce._engine.gemm import (CUBLAS, TilesPlan, cublas, plan, same_stream,  # noqa: E402
                                  tf32x3)
from cupynce._engine.gemm.chooser import applies, f16_applies  # noqa: E402
# (its folder is on sys.path, conftest: the tiles' fixture and error measure)
from test_tf32_tiles import MM_FACTOR, MM_TOL, _rel, tf32  # noqa: E402,F401

gpu = pytest.mark.gpu
FP32_TOL = (1e-5, 1e-4)  # loss, gradients: ops/test_contrastive_kernels.py's float32
LS = math.log(1 / 0.07)  # CLIP's logit_scale


def _bits(x):
    return cp.asnumpy(x).view(np.uint32)


def _fp32(a, b, out, **kw):
    with cfg.float32_precision("fp32"):
        cublas.gemm(a, b, out, **kw)
    return out


@gpu
@pytest.mark.parametrize("k,m,ld", [(32, 128, 128), (100, 36, 40), (1030, 300, 304),
                                    (4100, 1024, 1024), (7, 4, 4)])
@pytest.mark.parametrize("interleave", [True, False])
def test_mm_trans_a_is_mm_of_the_transposed_copy(tf32, k, m, ld, interleave, configure):
    """``mm(trans_a=True)`` on a stored (k, m) view (leading dimension ld: a wider buffer)
    gives the bits of ``mm`` on its contiguous transposed copy, plain and accumulating, with
    the consumers interleaved or ping-ponging; the view's buffer is left as it was."""
    configure(mm_interleave=interleave)
    rng = np.random.default_rng(k + m)
    buf = cp.asarray(rng.standard_normal((k, ld)).astype(np.float32))
    before = _bits(buf)
    a = buf[:, :m]
    c = 330  # (3 column tiles, one CTA a row of them: an interleaved pair, then a lone tile)
    b = cp.asarray(rng.standard_normal((c, k)).astype(np.float32))
    parts = tf32x3.split(b)
    at = tf32x3.padded(cp.ascontiguousarray(a.T))  # (K padded with zeros: 16-byte rows)
    got = tf32x3.mm(a, parts, cp.empty((m, c), np.float32), alpha=0.75, trans_a=True,
                    splits=1)
    want = tf32x3.mm(at, parts, cp.empty((m, c), np.float32), alpha=0.75, splits=1)
    assert np.array_equal(_bits(got), _bits(want))
    base = cp.asarray(rng.standard_normal((m, c)).astype(np.float32))
    acc = base.copy()
    tf32x3.mm(a, parts, acc, trans_a=True, accumulate=True, splits=1)
    plain = tf32x3.mm(at, parts, cp.empty((m, c), np.float32), splits=1)
    assert np.array_equal(_bits(acc), _bits(plain + base))
    assert np.array_equal(_bits(buf), before)
    ref = cp.asnumpy(a).astype(np.float64).T @ cp.asnumpy(b).astype(np.float64).T
    assert _rel(cp.asnumpy(plain), ref) <= MM_TOL


@gpu
@pytest.mark.parametrize("rows,d,ld", [(1, 1, 1), (37, 70, 72), (1030, 64, 64), (64, 33, 40)])
def test_split_t_is_the_split_of_the_transposed_copy(tf32, rows, d, ld):
    """split_t (one kernel, no transposed copy) gives split(xᵀ)'s bits, padding included, on
    a row-strided view and on a transposed (column-strided) one."""
    rng = np.random.default_rng(rows + d)
    buf = cp.asarray(rng.standard_normal((rows, ld)).astype(np.float32))
    x = buf[:, :d]
    for v in (x, cp.ascontiguousarray(x.T).T):
        got = tf32x3.split_t(v)
        want = tf32x3.split(cp.ascontiguousarray(x.T))
        for g_, w_ in zip(got, want):
            assert g_.shape == w_.shape
            assert np.array_equal(_bits(g_), _bits(w_))


@gpu
@pytest.mark.parametrize("c", [4096, 3900])
@pytest.mark.parametrize("trans_a", [False, True])
def test_interleaved_consumers_repeat_the_ping_pong_bits(tf32, trans_a, c, configure):
    """The interleaved ring (both consumers on the tensor cores, ring slots passing from one
    consumer to the other through the producer's barriers) against the ping-pong schedule, on
    a short K (2 ring steps a tile) and many tiles a CTA -- the most slot hand-overs -- 20
    times: the same bits every time (a consumer reading a slot before the other is done
    with it would show as a changed value).  c = 3900: 31 column tiles, the last partial,
    so a lone tile (ring stride 1) follows 15 pairs."""
    rng = np.random.default_rng(5)
    k, m = 64, 1024
    a = cp.asarray(rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32))
    parts = tf32x3.split(cp.asarray(rng.standard_normal((c, k)).astype(np.float32)))
    configure(mm_interleave=False)
    want = _bits(tf32x3.mm(a, parts, cp.empty((m, c), np.float32), trans_a=trans_a))
    configure(mm_interleave=True)
    out = cp.empty((m, c), np.float32)
    for _ in range(20):
        out.fill(np.nan)
        tf32x3.mm(a, parts, out, trans_a=trans_a, splits=1)
        assert np.array_equal(_bits(out), want)


@gpu
def test_mm_accumulate_adds_in_float32(tf32):
    rng = np.random.default_rng(7)
    a = cp.asarray(rng.standard_normal((300, 520)).astype(np.float32))
    b = cp.asarray(rng.standard_normal((200, 520)).astype(np.float32))
    base = cp.asarray(rng.standard_normal((300, 200)).astype(np.float32))
    plain = tf32x3.mm(a, tf32x3.split(b), cp.empty((300, 200), np.float32), alpha=0.5)
    acc = base.copy()
    tf32x3.mm(a, tf32x3.split(b), acc, alpha=0.5, accumulate=True)
    assert np.array_equal(_bits(acc), _bits(plain + base))


def _operands(n, nc, d, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, d)).astype(np.float32)
    b = rng.standard_normal((nc, d)).astype(np.float32)
    g = (rng.standard_normal((n, nc)) / nc).astype(np.float32)
    return a, b, g


@gpu
@pytest.mark.parametrize("n,nc,d", [(1024, 1024, 64), (1100, 2 * 1100 + 300, 72)])
def test_products_are_the_tiles_and_cublas_fp32(tf32, n, nc, d):
    """Each product bit for bit as the tiles' mm on the operands it builds (Gᵀ A: as mm of
    G's transposed copy); all within MM_TOL of float64."""
    a, b, g = _operands(n, nc, d)
    ad, bd, gd = cp.asarray(a), cp.asarray(b), cp.asarray(g)
    pr = TilesPlan()
    # S = A Bᵀ
    s = cp.empty((n, nc), np.float32)
    pr.gemm(ad, bd, s, trans_b=True)
    want = tf32x3.mm(ad, tf32x3.split(bd), cp.empty((n, nc), np.float32))
    assert np.array_equal(_bits(s), _bits(want))
    assert _rel(cp.asnumpy(s), a.astype(np.float64) @ b.astype(np.float64).T) <= MM_TOL
    # dA = G B (alpha as SigLIP passes w_mul)
    da = cp.empty((n, d), np.float32)
    pr.gemm(gd, bd, da, alpha=0.25)
    want = tf32x3.mm(gd, tf32x3.split(cp.ascontiguousarray(bd.T)),
                     cp.empty((n, d), np.float32), alpha=0.25)
    assert np.array_equal(_bits(da), _bits(want))
    assert _rel(4 * cp.asnumpy(da), g.astype(np.float64) @ b.astype(np.float64)) <= MM_TOL
    # dB += Gᵀ A: G read as stored (mmt), left unchanged
    base = cp.asarray(np.random.default_rng(1).standard_normal((nc, d)).astype(np.float32))
    db = base.copy()
    g_before = _bits(gd)
    pr.gemm(gd, ad, db, trans_a=True, beta=1.0)
    assert np.array_equal(_bits(gd), g_before)
    at = tf32x3.split(cp.ascontiguousarray(ad.T))
    want = tf32x3.mm(tf32x3.padded(cp.ascontiguousarray(gd.T)), at, base.copy(),
                     accumulate=True)
    assert np.array_equal(_bits(db), _bits(want))
    # against float64: the product's error (MM_TOL of its size) plus the rounding of the sum
    want = g.astype(np.float64).T @ a.astype(np.float64)
    ref = cp.asnumpy(base).astype(np.float64) + want
    bound = MM_TOL * np.linalg.norm(want) / np.linalg.norm(ref) + 2.0 ** -24
    assert _rel(cp.asnumpy(db), ref) <= bound


@gpu
def test_products_fall_back_to_cublas_fp32(tf32, monkeypatch):
    """With beta not 0 / 1, with G's rows not 16-byte multiples and after a refused launch:
    cuBLAS fp32's bits, and G as it was."""
    n, nc, d = 1024, 2048, 64
    a, b, g = _operands(n, nc, d, seed=2)
    ad, bd, gd = cp.asarray(a), cp.asarray(b), cp.asarray(g)
    pr = TilesPlan()
    want = _fp32(gd, ad, cp.zeros((nc, d), np.float32), trans_a=True)
    base = cp.ones((nc, d), np.float32)
    got = base.copy()
    pr.gemm(gd, ad, got, trans_a=True, beta=0.5)
    assert np.array_equal(_bits(got), _bits(_fp32(gd, ad, base.copy(), trans_a=True, beta=0.5)))
    odd = cp.ascontiguousarray(gd[:, :nc - 2])  # rows of 2046 floats: no tensor map
    got = cp.empty((n, d), np.float32)
    pr.gemm(odd, bd[:nc - 2], got)
    assert np.array_equal(_bits(got), _bits(_fp32(odd, bd[:nc - 2], cp.empty((n, d), np.float32))))
    got = cp.empty((nc - 2, d), np.float32)
    pr.gemm(odd, ad, got, trans_a=True)
    assert np.array_equal(_bits(got), _bits(_fp32(odd, ad, cp.empty((nc - 2, d), np.float32),
                                                  trans_a=True)))

    def refuse(*args, **kw):
        raise tf32x3.TF32TilesUnavailable("refused")
    monkeypatch.setattr(tf32x3, "launch", refuse)
    g2 = gd.copy()
    got = cp.zeros((nc, d), np.float32)
    pr.gemm(g2, ad, got, trans_a=True)
    assert np.array_equal(_bits(got), _bits(want)) and np.array_equal(_bits(g2), _bits(gd))
    got = cp.empty((n, nc), np.float32)
    pr.gemm(ad, bd, got, trans_b=True)
    assert np.array_equal(_bits(got), _bits(_fp32(ad, bd, cp.empty((n, nc), np.float32),
                                                  trans_b=True)))


def _clip_inputs(n, d, seed):
    rng = np.random.default_rng(seed)
    return [cp.asarray(rng.standard_normal((n, d)).astype(np.float32)) for _ in range(2)]


@gpu
@pytest.mark.parametrize("mode", ["auto", "3xtf32", "fp32", "tf32"])
def test_ops_route_here(tf32, mode, monkeypatch, configure):
    """CLIP, SigLIP and InfoNCE (forward and backward) issue their float32 products on the
    tiles (TF32x3 under "3xtf32"; "auto" on Hopper: F16x3 where plan.f16_applies)
    under "3xtf32" and, from tf32x3_min_rows x tf32x3_min_dim (InfoNCE) or
    tf32x3_min_dim_scale (CLIP, SigLIP) on, "auto"; never under "fp32" / "tf32", for 16-bit
    inputs or with CUPYNCE_TILES=0."""
    import cupynce
    from cupynce.ops import _graphs

    from cupynce._engine.gemm import f16x3

    calls = []
    real = tf32x3.mm
    monkeypatch.setattr(tf32x3, "mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    real16 = f16x3.mm  # ("auto" on Hopper: the F16x3 tiles, engine/test_f16x3.py)
    monkeypatch.setattr(f16x3, "mm", lambda *a, **k: calls.append(2) or real16(*a, **k))
    n0 = cfg.current().tf32x3_min_rows
    for op in ("clip", "siglip", "info_nce"):
        d0 = (cfg.current().tf32x3_min_dim if op == "info_nce"
              else cfg.current().tf32x3_min_dim_scale)
        for n, d in [(n0, d0), (n0 - 4, d0), (n0, d0 - 4)]:
            x, y = _clip_inputs(n, d, seed=n + d)
            on = mode == "3xtf32" or (mode == "auto" and (n, d) == (n0, d0))
            _graphs.clear()
            if op == "clip":
                loss, ctx = cupynce.clip_loss_forward(x, y, LS, precision=mode)
                cupynce.clip_loss_backward(ctx)
            elif op == "siglip":
                loss, ctx = cupynce.siglip_loss_forward(x, y, math.log(10.0), -10.0,
                                                        precision=mode)
                cupynce.siglip_loss_backward(ctx)
            else:
                loss, ctx = cupynce.info_nce_forward(x, y, 0.1, precision=mode)
                cupynce.info_nce_backward(ctx)
            assert bool(calls) == on, (op, n, d, mode, len(calls))
            if on and mode == "3xtf32":
                assert 2 not in calls, (op, calls)
            if on and mode == "auto" and f16_applies():
                assert 2 in calls, (op, calls)
            del calls[:]
    big = (n0, cfg.current().tf32x3_min_dim_scale)
    x, y = _clip_inputs(*big, seed=1)
    _graphs.clear()
    cupynce.clip_loss(x.astype(cp.float16), y.astype(cp.float16), LS, precision=mode)
    configure(tiles=False)
    _graphs.clear()
    cupynce.clip_loss(x, y, LS, precision=mode)
    assert calls == []


_NAP = r"""extern "C" __global__ void nap(long long cycles) {
    const long long t0 = clock64(); while (clock64() - t0 < cycles) {} }"""


def _fused(op, x, y, **kw):
    """A fused forward + backward of ``op`` on the tiles ("3xtf32"): [loss, gradients...]."""
    import cupynce

    if op == "clip":
        loss, ctx = cupynce.clip_loss_forward(x, y, LS, precision="3xtf32", **kw)
        return [loss] + list(cupynce.clip_loss_backward(ctx))
    loss, ctx = cupynce.siglip_loss_forward(x, y, math.log(10.0), -10.0, precision="3xtf32",
                                            **kw)
    return [loss] + list(cupynce.siglip_loss_backward(ctx))


@gpu
@pytest.mark.parametrize("op", ["clip", "siglip"])
def test_prefetched_splits_on_a_side_stream(tf32, op, monkeypatch):
    """CLIP and SigLIP in one block split the gradient products' B operands (b, then a) on a
    side stream beside S's product: the halves allocated on the current stream (before the
    side stream is told to start), the two splits issued on another stream, none on the
    current one; the halves filled with NaN and each split made slow (a ~10 ms nap queued
    before it on the side stream) so that a product not waiting for it would read NaN --
    the same bits as without the side stream.  The CLIP gradient-only call (reduction "none": the backward
    recomputes S) prefetches too; a non-fused call's forward (no gradient) does not."""
    from cupynce.ops import _graphs

    nap = cp.RawKernel(_NAP, "nap")
    launches = []
    real = tf32x3.split_t

    def spy(x, name="x", out=None):
        cur = cp.cuda.get_current_stream().ptr
        launches.append((cur, out is not None))
        if out is not None:
            nap((1,), (1,), (np.int64(20_000_000),))  # (on the side stream)
        return real(x, name, out)
    monkeypatch.setattr(tf32x3, "split_t", spy)
    real_mark = TilesPlan.mark
    mark_streams = []

    def mark(self, *bs):  # (the halves NaN first: a product that reads them unsplit fails)
        pre = real_mark(self, *bs)
        if pre is not None:
            cur = cp.cuda.get_current_stream()
            mark_streams.append(cur.ptr)
            for _b, out in pre[0]:
                for h in out:
                    h.fill(np.nan)
            after = cp.cuda.Event(disable_timing=True)
            after.record(cur)
            pre = (pre[0], after)
        return pre
    monkeypatch.setattr(TilesPlan, "mark", mark)
    x, y = _clip_inputs(1000, 96, seed=3)
    main = cp.cuda.get_current_stream().ptr
    _graphs.clear()
    got = _fused(op, x, y)
    assert mark_streams == [main]
    assert len(launches) == 2 and all(s_ != main and pre for s_, pre in launches), (launches,
                                                                                   main)
    monkeypatch.setattr(TilesPlan, "mark", lambda self, *bs: None)
    del launches[:]
    _graphs.clear()
    want = _fused(op, x, y)
    assert launches == [(main, False), (main, False)]
    for g_, w_ in zip(got, want):
        assert np.array_equal(_bits(g_), _bits(w_))
    if op == "clip":  # the gradient-only pass: S recomputed in the backward
        import cupynce

        monkeypatch.setattr(TilesPlan, "mark", mark)
        del launches[:]
        _graphs.clear()
        loss, ctx = cupynce.clip_loss_forward(x, y, LS, precision="3xtf32", reduction="none")
        assert launches == []  # (the forward: no gradient, no split)
        g_side = cupynce.clip_loss_backward(ctx, cp.ones(loss.shape, cp.float32))
        assert len(launches) == 2 and all(s_ != main for s_, _ in launches)
        monkeypatch.setattr(TilesPlan, "mark", lambda self, *bs: None)
        _graphs.clear()
        loss, ctx = cupynce.clip_loss_forward(x, y, LS, precision="3xtf32", reduction="none")
        g_main = cupynce.clip_loss_backward(ctx, cp.ones(loss.shape, cp.float32))
        for g_, w_ in zip(g_side, g_main):
            assert np.array_equal(_bits(g_), _bits(w_))


@gpu
@pytest.mark.parametrize("op", ["clip", "siglip"])
def test_side_splits_under_torch_allocator(tf32, op, monkeypatch, configure):
    """Through ``cupynce.torch`` (CuPy allocating from torch's caching allocator on torch's
    current stream, here a non-default one): the side-stream splits run (NaN-filled halves,
    a nap before each split) and the loss and gradients are bit for bit those without them,
    over several calls that hand the same cached blocks around (graphs off: each call
    uncaptured)."""
    torch = pytest.importorskip("torch")
    import cupynce.torch as ct

    configure(graphs=False)  # (every call uncaptured: splits on the side)
    nap = cp.RawKernel(_NAP, "nap")
    real = tf32x3.split_t
    sides = []

    def spy(x, name="x", out=None):
        if out is not None:
            sides.append(1)
            nap((1,), (1,), (np.int64(20_000_000),))
        return real(x, name, out)
    monkeypatch.setattr(tf32x3, "split_t", spy)
    real_mark = TilesPlan.mark

    def mark(self, *bs):
        pre = real_mark(self, *bs)
        if pre is not None:
            for _b, out in pre[0]:
                for h in out:
                    h.fill(np.nan)
            after = cp.cuda.Event(disable_timing=True)
            after.record(cp.cuda.get_current_stream())
            pre = (pre[0], after)
        return pre
    monkeypatch.setattr(TilesPlan, "mark", mark)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1000, 96, generator=g).cuda()
    y = torch.randn(1000, 96, generator=g).cuda()

    def run():
        outs = []
        for _ in range(3):
            a = x.clone().requires_grad_(True)
            b = y.clone().requires_grad_(True)
            if op == "clip":
                loss = ct.clip_loss(a, b, LS, precision="3xtf32")
            else:
                loss = ct.siglip_loss(a, b, math.log(10.0), -10.0, precision="3xtf32")
            loss.backward()
            outs.append([t.detach().cpu().numpy().view(np.uint32) for t in (loss, a.grad, b.grad)])
        return outs
    st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        got = run()
        assert len(sides) == 6, sides
        configure(side_splits=False)
        want = run()
    torch.cuda.synchronize()
    for g_, w_ in zip(got, want):
        for a_, b_ in zip(g_, w_):
            assert np.array_equal(a_, b_)

@gpu
def test_side_splits_stay_off_under_capture_and_in_graph_probes(tf32):
    """:meth:`TilesPlan.mark` gives None while the current stream is being captured and
    inside :func:`gemm.same_stream` (a graph probe / capture), and makes its halves
    otherwise; one operand given twice is split once; settle() leaves nothing behind."""
    x = cp.ones((64, 32), cp.float32)
    prods = TilesPlan()
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        st.begin_capture()
        try:
            marked = prods.mark(x)
        finally:
            st.end_capture()
    assert marked is None
    with same_stream():
        assert prods.mark(x) is None
    pre = prods.mark(x, x)
    assert pre is not None and len(pre[0]) == 1
    assert pre[0][0][1][0].shape == tf32x3.split_t_shape(x)
    prods.prefetch(pre)
    hi, lo = prods._split_t(x)
    want = tf32x3.split_t(x)
    assert np.array_equal(_bits(hi), _bits(want[0])) and np.array_equal(_bits(lo), _bits(want[1]))
    prods.settle()
    assert prods._ready == {}


@gpu
@pytest.mark.parametrize("op", ["clip", "siglip"])
def test_side_splits_keep_the_graph_capture(tf32, op):
    """A fused float32 CLIP / SigLIP on the tiles small enough for a CUDA graph (one block,
    side splits when uncaptured) is still captured on its CAPTURE_AFTER + 1-th call (the probe
    and the capture allocate alike: no side splits in either), and the replay gives the
    uncaptured call's bits."""
    from cupynce.ops import _graphs

    x, y = _clip_inputs(1000, 96, seed=5)
    _graphs.clear()
    outs = [_fused(op, x, y) for _ in range(_graphs.CAPTURE_AFTER + 2)]
    assert _graphs._plans and not _graphs._refused, dict(_graphs._refused)
    for later in outs[1:]:
        for g_, w_ in zip(later, outs[0]):
            assert np.array_equal(_bits(g_), _bits(w_))


@gpu
def test_clip_row_blocks_and_determinism(tf32, monkeypatch):
    """A CLIP whose score matrix comes in row blocks on the tiles ("3xtf32"; a small
    workspace_bytes: blocks of 1920, 1920 and 960 rows, each block's Gᵀ A on the tiles
    reading G as stored, dB accumulated over the blocks) within the float32 tolerances of the
    oracle and of the one-block call; the same bits twice."""
    import cupynce
    from cupynce import reference as R
    from cupynce.ops import _graphs

    mms = []
    real_mm = tf32x3.mm
    monkeypatch.setattr(tf32x3, "mm", lambda *a, **k: mms.append(
        (a[0].shape, bool(k.get("trans_a")))) or real_mm(*a, **k))
    n, d = 4800, 64
    x, y = _clip_inputs(n, d, seed=11)
    ref_loss, ref_grads = R.clip_loss(cp.asnumpy(x), cp.asnumpy(y), math.log(1 / 0.07),
                                      normalize=True)
    ls = cp.asarray(np.float32(math.log(1 / 0.07)))

    def run(**kw):
        _graphs.clear()
        loss, ctx = cupynce.clip_loss_forward(x, y, ls, normalize=True, precision="3xtf32",
                                              **kw)
        return [loss] + list(cupynce.clip_loss_backward(ctx))
    whole = run()
    assert [s_ for s_, t in mms if t] == [(n, n)], mms
    del mms[:]
    blocks = run(workspace_bytes=1920 * n * 4)
    assert [s_ for s_, t in mms if t] == [(1920, n), (1920, n), (960, n)], mms
    again = run(workspace_bytes=1920 * n * 4)
    for name, w, b_, c, r in zip(["loss", "da", "db", "dscale"], whole, blocks, again,
                                 [ref_loss] + list(ref_grads)):
        assert np.array_equal(_bits(b_), _bits(c)), f"{name} not deterministic"
        tol = FP32_TOL[0] if name == "loss" else FP32_TOL[1]
        if name == "dscale":  # (a cancelling sum: as test_precision_accuracy, scaled by its κ)
            continue
        assert _rel(cp.asnumpy(b_), r) <= tol, name
        assert _rel(cp.asnumpy(b_), cp.asnumpy(w).astype(np.float64)) <= tol, name


@gpu
def test_info_nce_shared_negatives_on_the_tiles(tf32, monkeypatch):
    """InfoNCE with shared negatives (G's columns [keys | negatives]: two products a side,
    each Gᵀ product reading its columns of G as stored) on the tiles, in row blocks, within
    the float32 tolerances of the oracle."""
    import cupynce
    from cupynce import reference as R
    from cupynce.ops import _graphs

    mms = []
    real_mm = tf32x3.mm
    monkeypatch.setattr(tf32x3, "mm", lambda *a, **k: mms.append(1) or real_mm(*a, **k))
    rng = np.random.default_rng(21)
    n, m, d = 4100, 1500, 128
    q, k, neg = (rng.standard_normal(s).astype(np.float32) for s in ((n, d), (n, d), (m, d)))
    ref_loss, ref_grads = R.info_nce(q, k, 0.1, negatives=neg, normalize=True)
    _graphs.clear()
    loss, ctx = cupynce.info_nce_forward(cp.asarray(q), cp.asarray(k), 0.1,
                                         negatives=cp.asarray(neg), normalize=True,
                                         workspace_bytes=1088 * (n + m) * 4)
    grads = cupynce.info_nce_backward(ctx)
    assert len(mms) >= 4 * 4, len(mms)  # (4 blocks, 4 products each at least on the tiles)
    assert _rel(cp.asnumpy(loss), ref_loss) <= FP32_TOL[0]
    for name, g_, r in zip(("dq", "dk", "dneg"), grads, ref_grads):
        assert _rel(cp.asnumpy(g_), r) <= FP32_TOL[1], name


@gpu
@pytest.mark.parametrize("m,c,k", [(300, 384, 65536 + 96), (1024, 130, 8200), (5, 7, 4100)])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("interleave", [True, False])
def test_k_split_is_its_slices_products_summed_in_order(tf32, m, c, k, trans_a, interleave,
                                                         configure, monkeypatch):
    """``config.mm_k_splits`` > 1: a long K runs in ``k_splits`` slices of whole K steps
    (grid z), each CTA's partial tile into its own slice, summed in z order.  Bit for bit,
    the unsplit products of the K slices added in float32 in that order (plain and
    accumulating), the same bits run after run, and within ``MM_TOL`` of float64."""
    configure(mm_interleave=interleave)
    monkeypatch.setattr(tf32x3, "K_SPLIT_MIN_K", 0)  # (K = 4100 and 8200 split too)
    rng = np.random.default_rng(m + k)

    def view(rows, cols, fill=np.nan, mult=2):  # (rows, cols) of a buffer whose leading
        ld = -(-cols // mult) * mult  # dimension the kernels take (even; A: 4 floats)
        return cp.full((rows, ld), fill, np.float32)[:, :cols]

    a = view(*((k, m) if trans_a else (m, k)), mult=4)
    a[...] = cp.asarray(rng.standard_normal(a.shape).astype(np.float32))
    b = cp.asarray(rng.standard_normal((c, k)).astype(np.float32))
    steps = -(-k // tf32x3.KSTEP)
    configure(mm_k_splits=8)
    ks = tf32x3.k_splits(steps)
    assert ks == min(8, steps // tf32x3.K_SPLIT_STEPS) > 1
    parts = tf32x3.split(b)
    got = tf32x3.mm(a, parts, view(m, c), alpha=0.75, trans_a=trans_a, k_split=True)
    again = tf32x3.mm(a, parts, view(m, c), alpha=0.75, trans_a=trans_a, k_split=True)
    assert np.array_equal(_bits(got), _bits(again))
    base = cp.asarray(rng.standard_normal((m, c)).astype(np.float32))
    acc = view(m, c)
    acc[...] = base
    tf32x3.mm(a, parts, acc, alpha=0.75, trans_a=trans_a, accumulate=True, k_split=True)
    whole = tf32x3.mm(a, parts, view(m, c), alpha=0.75, trans_a=trans_a)  # (not opted in)
    configure(mm_k_splits=1)
    want = None
    for z in range(ks):  # (the kernel's slices: K steps kt0 .. kt1 - 1 of z)
        k0, k1 = (tf32x3.KSTEP * (steps * j // ks) for j in (z, z + 1))
        k1 = min(k1, k)
        az = tf32x3.padded(cp.ascontiguousarray(a[k0:k1].T if trans_a else a[:, k0:k1]))
        pz = tf32x3.mm(az, tf32x3.split(b[:, k0:k1]), view(m, c), alpha=0.75)
        want = pz if want is None else want + pz
    assert np.array_equal(_bits(got), _bits(want))
    assert np.array_equal(_bits(acc), _bits(base + want))
    unsplit = tf32x3.mm(a, parts, view(m, c), alpha=0.75, trans_a=trans_a, k_split=True)
    assert np.array_equal(_bits(whole), _bits(unsplit))  # (mm_k_splits = 1: K whole)
    assert not np.array_equal(_bits(whole), _bits(got))
    ref = 0.75 * (cp.asnumpy(a).astype(np.float64).T if trans_a
                  else cp.asnumpy(a).astype(np.float64)) @ cp.asnumpy(b).astype(np.float64).T
    # (MM_TOL is the kernel's bound at K <= 4096; at K = 65632 float32 accumulation's own
    # error outgrows it -- measured on an H200: split 3.1e-7, unsplit 8.2e-7, cuBLAS fp32
    # 1.1e-6 -- so the bound there is test_mm_against_float64_and_fp32's, against cuBLAS)
    fp32 = cp.asnumpy((a.T if trans_a else a) @ b.T) * 0.75
    assert _rel(cp.asnumpy(got), ref) <= max(MM_TOL, MM_FACTOR["zero-mean"] * _rel(fp32, ref))


@gpu
def test_info_nce_with_k_splits(tf32, configure, monkeypatch):
    """InfoNCE in row blocks under "3xtf32" with ``config.mm_k_splits`` = 8 (its dA = G·B
    products split over K): within the float32 tolerances of the oracle and of the unsplit
    run, and the same bits run after run."""
    import cupynce
    from cupynce import reference as R
    from cupynce.ops import _graphs

    rng = np.random.default_rng(23)
    n, d = 8200, 64
    q, k = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(2))
    ref_loss, ref_grads = R.info_nce(q, k, 0.1, normalize=True)
    runs, split = [], []
    monkeypatch.setattr(tf32x3, "K_SPLIT_MIN_K", 0)  # (K = 8200 splits too)
    real = tf32x3.k_splits
    monkeypatch.setattr(tf32x3, "k_splits", lambda s: split.append(real(s)) or split[-1])
    for ks in (1, 8, 8):
        configure(mm_k_splits=ks)
        _graphs.clear()
        del split[:]
        loss, ctx = cupynce.info_nce_forward(cp.asarray(q), cp.asarray(k), 0.1,
                                             normalize=True, precision="3xtf32",
                                             workspace_bytes=512 * n * 4)
        grads = [g_ for g_ in cupynce.info_nce_backward(ctx) if g_ is not None]
        runs.append([cp.asnumpy(loss)] + [cp.asnumpy(g_) for g_ in grads])
        # (the dA products of the blocks asked, and split where allowed)
        assert split and max(split) == (1 if ks == 1 else 4), (ks, split)
    for x, y in zip(runs[1], runs[2]):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
    assert _rel(runs[1][0], ref_loss) <= FP32_TOL[0]
    assert _rel(runs[1][0], runs[0][0]) <= FP32_TOL[0]
    for name, g_, g1, r in zip(("dq", "dk"), runs[1][1:], runs[0][1:], ref_grads):
        assert _rel(g_, r) <= FP32_TOL[1], name
        assert _rel(g_, g1) <= FP32_TOL[1], name


@gpu
def test_tiny_products_keep_small_gemm(tf32, monkeypatch):
    """Products within config.small_gemm_macs take cublas.gemm's fp32 small_gemm route under
    "3xtf32" too (as docs/api.md says of every mode), not the tiles."""
    mms = []
    real_mm = tf32x3.mm
    monkeypatch.setattr(tf32x3, "mm", lambda *a, **k: mms.append(1) or real_mm(*a, **k))
    a = cp.asarray(np.random.default_rng(3).standard_normal((64, 32)).astype(np.float32))
    out = cp.empty((64, 64), np.float32)
    TilesPlan().gemm(a, a, out, trans_b=True)
    assert mms == []
    assert np.array_equal(_bits(out), _bits(_fp32(a, a, cp.empty((64, 64), np.float32),
                                                  trans_b=True)))


# ---- CPU ---------------------------------------------------------------------------------

def test_side_splits_only_where_the_gradient_products_take_the_tiles(monkeypatch):
    """Side-stream splits only for a call that wants the gradient, in one row block, with its
    products on the tiles (device check stubbed)."""
    monkeypatch.setattr(tf32x3, "available", lambda: True)
    with cfg.float32_precision("3xtf32"):
        g = plan(np.empty((8, 4), np.float32), np.empty((8, 4), np.float32))
    assert g.side_splits(True, True)
    assert not g.side_splits(False, True)
    assert not g.side_splits(True, False)
    assert not CUBLAS.side_splits(True, True)


def test_applies_thresholds(monkeypatch, configure):
    """The routing rule (device check stubbed): float32 under "3xtf32" at every size, under
    "auto" from tf32x3_min_rows rows on both sides and config.tf32x3_min_dim columns
    (tf32x3_min_dim_scale with a scale gradient: CLIP, SigLIP); never
    "fp32" / "tf32", other dtypes, or config.tiles False; the planner counts no gradient-block
    split on the tiles."""
    monkeypatch.setattr(tf32x3, "available", lambda: True)
    n0, d0 = cfg.current().tf32x3_min_rows, cfg.current().tf32x3_min_dim
    ds = cfg.current().tf32x3_min_dim_scale

    def ok(n, nc, d, mode, dtype=np.float32, scale_grad=False):
        with cfg.float32_precision(mode):
            return applies(np.empty((n, d), dtype), np.empty((nc, d), dtype), scale_grad)

    assert ok(n0, n0, d0, "auto") and ok(2 * n0, 3 * n0, 8 * d0, "auto")
    assert ok(n0, n0, ds, "auto", scale_grad=True) and not ok(n0, n0, ds - 4, "auto",
                                                              scale_grad=True)
    assert ok(5, 7, 3, "3xtf32", scale_grad=True)
    assert not ok(n0 - 1, n0, d0, "auto") and not ok(n0, n0 - 1, d0, "auto")
    assert not ok(n0, n0, d0 - 1, "auto")
    assert ok(5, 7, 3, "3xtf32")
    assert not ok(n0, n0, d0, "fp32") and not ok(n0, n0, d0, "tf32")
    assert not ok(n0, n0, d0, "auto", np.float64) and not ok(n0, n0, d0, "3xtf32", np.float16)
    with cfg.float32_precision("3xtf32"):
        g = plan(np.empty((8, 4), np.float32), np.empty((8, 4), np.float32))
        assert g.tiles
        assert g.split_row_bytes(np.float32, 100) == 0
        assert CUBLAS.split_row_bytes(np.float32, 100) == 800
    configure(tiles=False)
    assert not ok(n0, n0, d0, "auto") and not ok(5, 7, 3, "3xtf32")
    monkeypatch.setattr(tf32x3, "available", lambda: False)
    configure(tiles=None)
    assert not ok(5, 7, 3, "3xtf32")
    assert not CUBLAS.tiles


def test_k_splits_from_k_alone(configure, monkeypatch):
    """The K split is chosen from K alone: 1 below ``K_SPLIT_MIN_K`` or unless
    ``config.mm_k_splits`` allows more, then as many slices of at least ``K_SPLIT_STEPS`` K
    steps as K holds, up to the setting (default 8)."""
    first = tf32x3.K_SPLIT_MIN_K // tf32x3.KSTEP  # (the fewest K steps split: 2048)
    assert [tf32x3.k_splits(s) for s in (first - 1, first, 10 ** 6)] == [1, 8, 8]
    configure(mm_k_splits=1)
    assert tf32x3.k_splits(10 ** 6) == 1
    monkeypatch.setattr(tf32x3, "K_SPLIT_MIN_K", 0)
    configure(mm_k_splits=8)
    S = tf32x3.K_SPLIT_STEPS
    assert [tf32x3.k_splits(s) for s in (0, 1, S - 1, S, 2 * S - 1, 2 * S, 5 * S, 8 * S,
                                          10 ** 6)] == [1, 1, 1, 1, 1, 2, 5, 8, 8]
    configure(mm_k_splits=0)
    assert tf32x3.k_splits(10 ** 6) == 1
