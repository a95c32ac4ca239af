"""GPU tests of SigLIP's sigmoid loss (CuPy path, ``cupynce._engine.blocks.siglip``).

Against the float64 oracle (``cupynce.reference.siglip_loss``) on the same quantised inputs,
relative error ``‖x − ref‖ / ‖ref‖``, the reference rounded to each output's dtype:

=========  =====================================================================================
float64    1e-12 (the scalar gradients: 1e-12 × cond)
float32    1e-5 (the scalar gradients: 1e-5 × cond)
f16/bf16   1e-5 + one ulp of the output (2⁻¹⁰ / 2⁻⁷) for da, db: the score block is a cuBLAS
           product with float32 accumulation, the gradient block is stored in the input dtype
           for the gradient products (one more rounding: bounds 2⁻⁹ / 2⁻⁶ there)
=========  =====================================================================================

with normalize, every bound × max(1, s / 10); in float16 / bfloat16 the normalised rows are
stored in the input dtype (unit roundoff u = 2⁻¹¹ / 2⁻⁸), which moves each logit by up to
s (2u + u²) (unit rows), so the loss and the scalar gradients get that perturbation's
first-order bound (:func:`_rounding_slack`, from the float64 pair weights) on top, and so do
da, db (through the normalisation's Jacobian), capped at 0.5 where that bound exceeds it
(N = 1 at s = 100 in bfloat16: one pair's gradient, nearly parallel to its unit row, is
mostly cancelled by the projection — 0.2 measured — and the cap still catches a wrong sign
or a lost term); cond as in
``test_siglip_cpu.py``.  Plus: several row blocks (a small workspace) give
the one-block bits for the losses, bitwise determinism, a non-default stream, NaN in → NaN out,
|logits| up to 1e4 finite, the torch bridge on CUDA tensors.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

import cupynce
from cupynce import reference as ref

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_siglip import _cond, _inputs, _rel, _weights  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
DTYPES = [pytest.param(F16, id="f16"), pytest.param(BF16, id="bf16"),
          pytest.param(F32, id="f32"), pytest.param(F64, id="f64")]
BASE = {F64: 1e-12, F32: 1e-5, F16: 1e-5, BF16: 1e-5}
#: the gradient block in the input dtype, then the output: two roundings (16-bit)
GRAD = {F64: 0.0, F32: 0.0, F16: 2.0 ** -9, BF16: 2.0 ** -6}
REDUCTIONS = ("mean", "sum", "none")


#: unit roundoff of the 16-bit input dtypes (the normalised rows are stored in them)
UNIT = {F16: 2.0 ** -11, BF16: 2.0 ** -8}


def _rounding_slack(a, b, ls, lb, reduction, g, dtype, ref_values):
    """Relative bounds, to first order (× 1.25 for the rest), on what storing the normalised
    rows in ``dtype`` changes in (loss, da, db, dlogit_scale, dlogit_bias).

    Every logit L_ij moves by at most δ = s (2u + u²) (unit rows); with H_ij = σ(−z_ij L_ij)
    = |∂row_i / ∂L_ij| and G_ij = −w_i z_ij H_ij: |Δrow_i| ≤ δ Σ_j H_ij,
    |ΔG_ij| ≤ |w_i| H_ij (1 − H_ij) δ, |Δ(L_ij − β)| ≤ δ.  The row gradient before the
    normalisation's Jacobian, acc_i = s Σ_j G_ij b̂_j, moves by at most
    s Σ_j (|ΔG_ij| + u |G_ij|), and the projection (I − â âᵀ) / ‖a_i‖ with â off by u
    adds 2u ‖acc_i‖ / ‖a_i‖ (which is large next to the result where acc_i is nearly
    parallel to â: the cancellation 16-bit normalised rows cannot avoid)."""
    u = UNIT[dtype]
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = np.linalg.norm(a64, axis=1), np.linalg.norm(b64, axis=1)
    an, bn = ref.l2_normalize(a), ref.l2_normalize(b)
    n = an.shape[0]
    scale = math.exp(ls)
    dots = scale * (an @ bn.T)
    z = 2 * np.eye(n) - 1
    h = 1 / (1 + np.exp(z * (dots + lb)))
    w = _weights(reduction, g, n)[:, None]
    grad = -w * z * h
    delta = scale * (2 * u + u * u)
    rows = delta * h.sum(1)
    if reduction == "none":
        dloss = np.linalg.norm(rows)
    else:
        dloss = rows.sum() / (n if reduction == "mean" else 1)
    dg = np.abs(w) * h * (1 - h) * delta
    ddls = (dg * np.abs(dots)).sum() + np.abs(grad).sum() * delta
    ddlb = dg.sum()
    acc_a, acc_b = scale * grad @ bn, scale * grad.T @ an
    dda = (scale * (dg.sum(1) + u * np.abs(grad).sum(1))
           + 2 * u * np.linalg.norm(acc_a, axis=1)) / na
    ddb = (scale * (dg.sum(0) + u * np.abs(grad).sum(0))
           + 2 * u * np.linalg.norm(acc_b, axis=1)) / nb
    out = []
    for bound, ref_value in zip((dloss, np.linalg.norm(dda), np.linalg.norm(ddb), ddls, ddlb),
                                ref_values):
        size = np.linalg.norm(np.ravel(ref_value))
        out.append(1.25 * bound / size if size > 0 else 1.25 * bound)
    return out


def _run(a, b, ls, lb, reduction, normalize, g, **kw):
    loss, ctx = cupynce.siglip_loss_forward(cp.asarray(a), cp.asarray(b), ls, lb,
                                            reduction=reduction, normalize=normalize, **kw)
    grads = cupynce.siglip_loss_backward(ctx, cp.asarray(g) if np.ndim(g) else g)
    return [cp.asnumpy(x) for x in (loss,) + tuple(grads)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("n, d", [(1, 8), (2, 1), (3, 5), (129, 64), (1000, 96)])
@pytest.mark.parametrize("ls, lb", [(math.log(10.0), -10.0), (0.0, 5.0),
                                    (math.log(100.0), -20.0)], ids=["paper", "t0-b5", "t100"])
def test_matches_oracle(dtype, reduction, normalize, n, d, ls, lb):
    a, b = _inputs(n, d, dtype)
    g = np.random.default_rng(n).standard_normal(n).astype(np.float32) \
        if reduction == "none" else 0.7
    _check_oracle(a, b, ls, lb, reduction, normalize, g)


def _check_oracle(a, b, ls, lb, reduction, normalize, g, **kw):
    """The five outputs against the oracle within the module's bounds."""
    dtype, n = a.dtype, a.shape[0]
    got = _run(a, b, ls, lb, reduction, normalize, g, **kw)
    rloss, rgrads = ref.siglip_loss(a, b, ls, lb, reduction=reduction, normalize=normalize,
                                    grad_loss=g)
    acc = F64 if dtype == F64 else F32
    s_eff = max(1.0, math.exp(ls) / 10) if normalize else 1.0
    base = BASE[dtype] * s_eff
    c_ls, c_lb = _cond(a, b, ls, lb, normalize, _weights(reduction, g, n))
    tol = [base, base + GRAD[dtype], base + GRAD[dtype], base * c_ls, base * c_lb]
    if normalize and dtype in UNIT:
        slack = _rounding_slack(a, b, ls, lb, reduction, g, dtype, (rloss,) + tuple(rgrads))
        tol = [t + sl for t, sl in zip(tol, slack)]
        for i in (1, 2):  # (see the module notes: the cap where the bound passes 0.5)
            tol[i] = min(tol[i], max(0.5, base + GRAD[dtype]))
    want = [np.asarray(rloss).astype(acc), rgrads[0].astype(dtype), rgrads[1].astype(dtype),
            rgrads[2].astype(acc), rgrads[3].astype(acc)]
    assert got[1].dtype == dtype and got[0].dtype == acc
    for name, x, y, t in zip(("loss", "da", "db", "dls", "dlb"), got, want, tol):
        assert _rel(x, y) <= t, (name, _rel(x, y), t)


@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("n, ws", [(4096, None), (700, 200 * 1024)])
def test_tiles_both_loops(monkeypatch, wgmma, dtype, n, ws):
    """SigLIP on the tensor-core tiles (MODE_SIGLIP), with the wgmma (sm_90a) and the mma.sync
    main loop, one row block and several (a small workspace), against the oracle; and the
    tile path is the one taken."""
    from cupynce._engine import tiles

    monkeypatch.setattr(tiles, "USE_TILES", True)  # (else mma.sync tiles only off Hopper)
    monkeypatch.setattr(tiles, "USE_WGMMA", wgmma)
    a, b = _inputs(n, 64, dtype)
    if not tiles.tiles_ok(cp.asarray(a), cp.asarray(b)):
        pytest.skip("tensor-core tiles need sm_80+")
    calls = []
    real = tiles.siglip
    monkeypatch.setattr(tiles, "siglip", lambda *x, **k: calls.append(1) or real(*x, **k))
    g = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    for reduction, grad in (("mean", 0.7), ("none", g)):
        _check_oracle(a, b, math.log(10.0), -10.0, reduction, False, grad, workspace_bytes=ws)
    _check_oracle(a, b, math.log(30.0), -5.0, "sum", True, 0.3, workspace_bytes=ws)
    assert calls
    # the loss alone (no gradient block, one launch over every row) against the loss of a
    # gradient pass: the same bits where that pass is one row block too (same column splits)
    a_d, b_d = cp.asarray(a), cp.asarray(b)
    alone = cp.asnumpy(cupynce.siglip_loss(a_d, b_d, 2.3, -10.0, reduction="sum"))
    with_grad = cp.asnumpy(cupynce.siglip_loss_forward(a_d, b_d, 2.3, -10.0, reduction="sum",
                                                       workspace_bytes=ws)[0])
    if ws is None:
        assert alone.tobytes() == with_grad.tobytes()
    else:
        assert _rel(alone, with_grad) <= 1e-6


@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma"])
def test_tiles_match_row_blocks(monkeypatch, wgmma):
    """The tiles against the cuBLAS row blocks on one problem of every kind at once: a rank's
    rows (row0 > 0) against more columns than rows (not a multiple of the tile), per-row
    weights read at the global rows, w_mul != 1, several row blocks on both paths.  Within
    the rounding of the 16-bit gradient block (da, db) and of float32 sums (the rest)."""
    from cupynce._engine import blocks, tiles

    monkeypatch.setattr(tiles, "USE_TILES", True)
    monkeypatch.setattr(tiles, "USE_WGMMA", wgmma)
    rng = np.random.default_rng(11)
    n, nc, d, row0 = 300, 1000, 64, 200
    a64, b64 = rng.standard_normal((n, d)) / 8, rng.standard_normal((nc, d)) / 8
    an, bn = cp.asarray(a64.astype(BF16)), cp.asarray(b64.astype(BF16))
    if not tiles.tiles_ok(an, bn):
        pytest.skip("tensor-core tiles need sm_80+")
    w = rng.uniform(0.5, 1.5, row0 + n).astype(np.float32)
    ls, lb = cp.asarray([2.3], cp.float32), cp.asarray([-10.0], cp.float32)
    kw = dict(weights=(cp.asarray(w), 1, 0.25), want_loss=True, want_grad=True,
              workspace_bytes=300_000, row0=row0)
    loss_t, grads_t = tiles.siglip(an, bn, ls, lb, **kw)
    loss_b, grads_b = blocks.siglip(an, bn, ls, lb, **kw)
    assert _rel(cp.asnumpy(loss_t), cp.asnumpy(loss_b)) <= 1e-5
    for x, y in zip(grads_t[:2], grads_b[:2]):
        assert _rel(cp.asnumpy(x), cp.asnumpy(y)) <= 2.0 ** -8
    # the scalar sums: within 1e-5 of the sums of their terms' magnitudes (float64 here)
    s = math.exp(2.3)
    raw = a64.astype(BF16).astype(np.float64) @ b64.astype(BF16).astype(np.float64).T
    z = -np.ones((n, nc))
    z[np.arange(n), row0 + np.arange(n)] = 1.0
    h = 1 / (1 + np.exp(z * (s * raw - 10.0)))
    gmag = 0.25 * w[row0:, None] * h
    for x, y, mag in zip(grads_t[2:], grads_b[2:], ((gmag * np.abs(s * raw)).sum(), gmag.sum())):
        assert abs(float(x) - float(y)) <= 1e-5 * mag


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_row_blocks_and_determinism(dtype):
    """Repeated calls give the same bits; a workspace of a few rows (many row blocks) gives
    the one-block results within rounding (cuBLAS may pick other kernels for other shapes)."""
    a, b = _inputs(300, 40, dtype)
    whole = _run(a, b, 2.3, -10.0, "mean", True, 0.5)
    again = _run(a, b, 2.3, -10.0, "mean", True, 0.5)
    for x, y in zip(whole, again):
        assert x.tobytes() == y.tobytes()
    row_bytes = 300 * 4 + (300 * 2 if dtype == BF16 else 0)
    blocked = _run(a, b, 2.3, -10.0, "mean", True, 0.5, workspace_bytes=7 * row_bytes)
    for x, y in zip(whole, blocked):
        assert _rel(x, y) <= (1e-6 if dtype == F32 else 2.0 ** -7)


def test_non_default_stream_and_extremes():
    a, b = _inputs(64, 32, F32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        got = _run(a, b, 0.0, -1e4, "none", False, np.ones(64, np.float32))
    s.synchronize()
    assert all(np.all(np.isfinite(x)) for x in got)
    want, _ = ref.siglip_loss(a, b, 0.0, -1e4, reduction="none")
    assert _rel(got[0], want) <= 1e-6
    bad = a.copy()
    bad[3, 4] = np.nan
    loss = cupynce.siglip_loss(cp.asarray(bad), cp.asarray(b), 1.0, 0.0)
    assert np.isnan(float(loss))


def test_device_scalars_never_read_and_keep_their_shapes():
    a, b = _inputs(33, 16, F32)
    ls = cp.asarray([1.5], np.float32)
    lb = cp.asarray(-3.0, np.float64)
    loss, ctx = cupynce.siglip_loss_forward(cp.asarray(a), cp.asarray(b), ls, lb)
    _, _, dls, dlb = cupynce.siglip_loss_backward(ctx)
    assert dls.shape == (1,) and dls.dtype == np.float32
    assert dlb.shape == () and dlb.dtype == np.float64
    _, (_, _, rdls, rdlb) = ref.siglip_loss(a, b, 1.5, -3.0)
    assert _rel(cp.asnumpy(dls), rdls) <= 1e-5 and _rel(cp.asnumpy(dlb), rdlb) <= 1e-5


def test_torch_bridge_on_cuda():
    """cupynce.torch on CUDA tensors gives the CuPy core's bits (the core is held to the
    oracle above)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    import cupynce.torch as ct

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(257, 64, generator=g, device="cuda").bfloat16().requires_grad_()
    b = torch.randn(257, 64, generator=g, device="cuda").bfloat16().requires_grad_()
    model = ct.SigLipLoss(normalize=True).cuda()
    loss = model(a, b)
    loss.backward()

    def arr(t):
        return cp.from_dlpack(t.detach().view(torch.int16)).view(BF16) \
            if t.dtype == torch.bfloat16 else cp.from_dlpack(t.detach())
    wl, ctx = cupynce.siglip_loss_forward(arr(a), arr(b), arr(model.logit_scale),
                                          arr(model.logit_bias), normalize=True)
    want = cupynce.siglip_loss_backward(ctx, 1.0)
    got = (loss, a.grad, b.grad, model.logit_scale.grad, model.logit_bias.grad)
    for x, y in zip(got, (wl,) + tuple(want)):
        assert cp.asnumpy(arr(x)).tobytes() == cp.asnumpy(y).tobytes()
