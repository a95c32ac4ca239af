"""SigLIP's sigmoid loss (``cupynce.siglip_loss*``): the NumPy path (NumPy arrays) and, marked
``gpu``, the CuPy path (CuPy arrays: ``cupynce._engine.losses.row_blocks.siglip`` and the
tiles).

The NumPy path.  Against the float64 oracle (``cupynce.reference.siglip_loss``, itself checked
against finite differences and open_clip's formula under torch autograd in
``ops/test_reference.py``),
evaluated on the *same* quantised inputs: loss and every gradient, relative error
``‖x − ref‖ / ‖ref‖``.

Tolerances (the NumPy path accumulates 16- and 32-bit inputs in float32; with normalize the
normalised rows are stored in the input dtype, as on the GPU; the input gradients are rounded
to the input dtype once):

=========  =====================================================================================
float64    1e-12 (the two scalar gradients: 1e-12 × cond)
float32    1e-5 (the two scalar gradients: 1e-5 × cond)
f16/bf16   the float32 bound plus one ulp of the output (2⁻¹⁰ / 2⁻⁷) for da, db, compared with
           the oracle rounded to the dtype; with normalize, max(that, 2 × the error of
           open_clip's formula run by torch in that dtype on the same inputs, 2 u s)
with normalize, every bound × max(1, s / 10), s = exp(logit_scale): the normalised rows are
stored in the input dtype, and their rounding moves each logit by up to ~2 u s
=========  =====================================================================================

cond = ``Σ|t_ij| / |Σ t_ij|`` of the summed terms (a sum that cancels cannot be more exact).

The CuPy path (the GPU tests below).  Against the float64 oracle on the same quantised inputs,
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
or a lost term); cond as above.  Plus: several row blocks (a small workspace) give
the one-block bits for the losses, bitwise determinism, a non-default stream, NaN in → NaN out,
|logits| up to 1e4 finite, the torch bridge on CUDA tensors.
"""
from __future__ import annotations

import math
import zlib

import ml_dtypes
import numpy as np
import pytest

import cupynce
from cupynce import reference as ref

try:
    import cupy as cp
except ImportError:  # (the gpu tests are skipped without it: conftest)
    cp = None

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
DTYPES = [pytest.param(F16, id="f16"), pytest.param(BF16, id="bf16"),
          pytest.param(F32, id="f32"), pytest.param(F64, id="f64")]
REDUCTIONS = ("mean", "sum", "none")
BASE = {F64: 1e-12, F32: 1e-5, F16: 1e-5, BF16: 1e-5}
UNIT = {F64: 2.0 ** -53, F32: 2.0 ** -24, F16: 2.0 ** -11, BF16: 2.0 ** -8}
#: two roundings to the output dtype (ours from float32, the oracle's from float64) may
#: differ by one ulp (2 u)
ROUNDING = {F64: 0.0, F32: 0.0, F16: 2.0 ** -10, BF16: 2.0 ** -7}


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _rel(x, y) -> float:
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    den = np.linalg.norm(y.ravel())
    num = np.linalg.norm((x - y).ravel())
    return float(num / den) if den > 0 else float(num)


def _inputs(n, d, dtype, seed=0):
    rng = _rng(n, d, str(dtype), seed)
    a = (rng.standard_normal((n, d)) / math.sqrt(d)).astype(dtype)
    b = (0.7 * a.astype(np.float64) + 0.7 * rng.standard_normal((n, d)) / math.sqrt(d)
         ).astype(dtype)
    return a, b


def _cond(a, b, ls, lb, normalize, grad_w):
    """Condition numbers of the two scalar gradients' sums (float64, from the oracle's G)."""
    a64 = ref.l2_normalize(a) if normalize else np.asarray(a, np.float64)
    b64 = ref.l2_normalize(b) if normalize else np.asarray(b, np.float64)
    n = a64.shape[0]
    s = math.exp(float(np.asarray(ls, np.float64).reshape(())))
    beta = float(np.asarray(lb, np.float64).reshape(()))
    logits = s * (a64 @ b64.T) + beta
    z = 2 * np.eye(n) - 1
    g = -grad_w[:, None] * z / (1 + np.exp(z * logits))
    out = []
    for t in (g * (logits - beta), g):
        total = abs(t.sum())
        out.append(np.abs(t).sum() / total if total > 0 else 1.0)
    return out


def _torch_low_precision(a, b, ls, lb, reduction, g, ref_values):
    """Relative errors of open_clip's formula run by torch in a's dtype (normalize=True), on
    the same inputs and upstream gradient, against the oracle's values; without torch, the
    fixed bounds 5e-3 (float16) / 3e-2 (bfloat16)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - CI has torch
        return [5e-3 if a.dtype == F16 else 3e-2] * 5
    F = torch.nn.functional
    tdt = torch.float16 if a.dtype == F16 else torch.bfloat16
    at = torch.tensor(a.astype(np.float32)).to(tdt).requires_grad_()
    bt = torch.tensor(b.astype(np.float32)).to(tdt).requires_grad_()
    lst = torch.tensor(float(ls), dtype=tdt, requires_grad=True)
    lbt = torch.tensor(float(lb), dtype=tdt, requires_grad=True)
    n = a.shape[0]
    logits = lst.exp() * (F.normalize(at, dim=1) @ F.normalize(bt, dim=1).T) + lbt
    labels = 2 * torch.eye(n, dtype=tdt) - 1
    rows = -F.logsigmoid(labels * logits).sum(dim=1)
    loss = {"mean": rows.sum() / n, "sum": rows.sum(), "none": rows}[reduction]
    loss.backward(torch.as_tensor(np.asarray(g, np.float32)).to(tdt))
    got = [loss.detach().float().numpy(), at.grad.float().numpy(), bt.grad.float().numpy(),
           lst.grad.float().numpy(), lbt.grad.float().numpy()]
    return [_rel(x, y) for x, y in zip(got, ref_values)]


def _grad(reduction, n, rng):
    return rng.standard_normal(n).astype(np.float32) if reduction == "none" else 0.7


def _weights(reduction, g, n):
    if reduction == "none":
        return np.asarray(g, np.float64)
    return np.full(n, g / n if reduction == "mean" else g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("n, d", [(1, 5), (2, 1), (3, 5), (129, 33)])
@pytest.mark.parametrize("ls, lb", [(math.log(10.0), -10.0), (0.0, 5.0),
                                    (math.log(100.0), -20.0), (math.log(2.0), 0.5)],
                         ids=["paper", "t0-b5", "t100-b-20", "t2-b0.5"])
def test_matches_oracle(dtype, reduction, normalize, n, d, ls, lb):
    a, b = _inputs(n, d, dtype)
    rng = _rng("g", n, reduction)
    g = _grad(reduction, n, rng)
    loss, ctx = cupynce.siglip_loss_forward(a, b, ls, lb, reduction=reduction,
                                            normalize=normalize)
    da, db, dls, dlb = cupynce.siglip_loss_backward(ctx, g)
    rloss, (rda, rdb, rdls, rdlb) = ref.siglip_loss(a, b, ls, lb, reduction=reduction,
                                                    normalize=normalize, grad_loss=g)
    acc = F64 if dtype == F64 else F32
    assert np.asarray(loss).dtype == acc
    assert np.asarray(loss).shape == ((n,) if reduction == "none" else ())
    assert da.dtype == dtype and db.dtype == dtype and da.shape == a.shape
    assert dls.shape == () and dlb.shape == () and dls.dtype == acc and dlb.dtype == acc
    # with normalize the normalised rows are stored in the input dtype: each logit moves by
    # up to ~2 u s (u the dtype's unit roundoff), so the bounds scale with s = exp(ls)
    s_eff = max(1.0, math.exp(ls) / 10) if normalize else 1.0
    base = BASE[dtype] * s_eff
    c_ls, c_lb = _cond(a, b, ls, lb, normalize, _weights(reduction, g, n))
    tol = [base, base + ROUNDING[dtype], base + ROUNDING[dtype], base * c_ls, base * c_lb]
    if normalize and dtype in (F16, BF16):
        low = _torch_low_precision(a, b, ls, lb, reduction, g, (rloss, rda, rdb, rdls, rdlb))
        floor = 2 * UNIT[dtype] * max(1.0, math.exp(ls))
        tol = [max(t, 2 * e, floor) for t, e in zip(tol, low)]
    got = (loss, da, db, dls, dlb)
    # against the oracle rounded to each output's dtype (values below its range are 0 there:
    # a relative error against the unrounded values would be 1)
    want = (np.asarray(rloss).astype(acc), rda.astype(dtype), rdb.astype(dtype),
            rdls.astype(acc), rdlb.astype(acc))
    for name, x, y, t in zip(("loss", "da", "db", "dlogit_scale", "dlogit_bias"), got, want,
                             tol):
        assert _rel(x, y) <= t, (name, _rel(x, y), t)


@pytest.mark.parametrize("kind", ["float", "0d", "shape1", "f64-0d"])
def test_scalar_inputs_and_their_gradients(kind):
    a, b = _inputs(7, 5, F32)
    make = {"float": lambda v: v, "0d": lambda v: np.asarray(v, np.float32),
            "shape1": lambda v: np.asarray([v], np.float32),
            "f64-0d": lambda v: np.asarray(v, np.float64)}[kind]
    ls, lb = make(1.5), make(-3.0)
    loss, ctx = cupynce.siglip_loss_forward(a, b, ls, lb)
    _, _, dls, dlb = cupynce.siglip_loss_backward(ctx)
    want_shape = np.asarray(ls).shape
    want_dtype = np.float32 if kind in ("float", "0d", "shape1") else np.float64
    for grad in (dls, dlb):
        assert grad.shape == want_shape and grad.dtype == want_dtype
    _, (_, _, rdls, rdlb) = ref.siglip_loss(a, b, 1.5, -3.0)
    c_ls, c_lb = _cond(a, b, 1.5, -3.0, False, np.full(7, 1 / 7))
    assert _rel(dls, rdls) <= 1e-5 * c_ls and _rel(dlb, rdlb) <= 1e-5 * c_lb


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_fused_and_recomputed_backward_agree(reduction):
    """reduction "none" (the recompute path) with a uniform upstream gradient gives the
    fused path's gradients ("sum")."""
    a, b = _inputs(9, 4, F64)
    _, ctx = cupynce.siglip_loss_forward(a, b, 0.3, -1.0, reduction="sum")
    fused = cupynce.siglip_loss_backward(ctx, 1.0)
    _, ctx = cupynce.siglip_loss_forward(a, b, 0.3, -1.0, reduction="none")
    recomputed = cupynce.siglip_loss_backward(ctx, np.ones(9))
    for x, y in zip(fused, recomputed):
        np.testing.assert_allclose(x, y, rtol=1e-13, atol=1e-15)


def test_no_grad_forward_matches_and_is_deterministic():
    a, b = _inputs(33, 8, BF16)
    first = cupynce.siglip_loss(a, b, 2.3, -10.0)
    for _ in range(3):
        again, ctx = cupynce.siglip_loss_forward(a, b, 2.3, -10.0)
        assert np.asarray(again).tobytes() == np.asarray(first).tobytes()
    assert cupynce.siglip_loss_forward(a, b, 2.3, -10.0, requires_grad=False)[1].saved == {}


def test_extreme_logits_finite_nan_propagates():
    a = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    for bias in (-1e4, 1e4):
        loss, ctx = cupynce.siglip_loss_forward(a, a, 0.0, bias, reduction="none")
        grads = cupynce.siglip_loss_backward(ctx, np.ones(2, np.float32))
        assert np.all(np.isfinite(loss)) and all(np.all(np.isfinite(g)) for g in grads)
    bad = a.copy()
    bad[0, 1] = np.nan
    with np.errstate(invalid="ignore"):
        assert np.isnan(cupynce.siglip_loss(bad, a, 0.0, 0.0))


def test_non_contiguous_inputs():
    a, b = _inputs(6, 10, F32)
    got = cupynce.siglip_loss(a[:, ::2], b[:, ::2], 1.0, -2.0)
    want, _ = ref.siglip_loss(a[:, ::2], b[:, ::2], 1.0, -2.0)
    assert _rel(got, want) <= 1e-5


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(b=np.zeros((3, 4), np.float32)), ValueError, r"same shape"),
    (dict(b=np.zeros((4, 5), np.float64)), (TypeError, ValueError), r"dtype"),
    (dict(logit_bias=float("nan")), ValueError, r"logit_bias must be finite"),
    (dict(logit_bias=np.zeros(2, np.float32)), ValueError,
     r"logit_bias must be a scalar \(shape \(\) or \(1,\)\), got shape \(2,\)"),
    (dict(logit_bias="x"), TypeError, r"logit_bias must be a real scalar or a 0-d array"),
    (dict(logit_bias=True), TypeError, r"logit_bias must be a real scalar, got bool"),
    (dict(logit_scale=float("inf")), ValueError, r"logit_scale must be finite"),
    (dict(logit_scale=1e4), ValueError, r"logit_scale"),
    (dict(reduction="avg"), ValueError, r"reduction"),
    (dict(normalize=1), TypeError, r"normalize"),
])
def test_bad_inputs_name_the_argument(kwargs, exc, match):
    args = dict(a=np.zeros((4, 5), np.float32), b=np.zeros((4, 5), np.float32),
                logit_scale=1.0, logit_bias=-1.0)
    args.update(kwargs)
    a, b, ls, lb = (args.pop(k) for k in ("a", "b", "logit_scale", "logit_bias"))
    with pytest.raises(exc, match=match):
        cupynce.siglip_loss(a, b, ls, lb, **args)


def test_backward_checks():
    a, b = _inputs(4, 3, F32)
    _, ctx = cupynce.siglip_loss_forward(a, b, 0.0, 0.0, requires_grad=False)
    with pytest.raises(ValueError, match="requires_grad=True"):
        cupynce.siglip_loss_backward(ctx)
    _, ctx = cupynce.nt_xent_forward(np.zeros((4, 3), np.float32), 0.5)
    with pytest.raises(TypeError, match="siglip_loss_backward: ctx must be"):
        cupynce.siglip_loss_backward(ctx)


def test_gpu_engine_is_wired():
    """The CuPy path reaches the engine's SigLIP (no GPU needed to check the wiring)."""
    from cupynce import _engine
    from cupynce.ops import siglip as op

    assert op._engine is _engine and callable(_engine.siglip)
    assert op._engine_for(np) is op.numpy_engine
    assert op._engine_for(object()) is op.gpu_engine


# ---- the CuPy path (GPU) -------------------------------------------------------------------
gpu = pytest.mark.gpu
#: the gradient block in the input dtype, then the output: two roundings (16-bit)
GRAD = {F64: 0.0, F32: 0.0, F16: 2.0 ** -9, BF16: 2.0 ** -6}


#: unit roundoff of the 16-bit input dtypes (the normalised rows are stored in them)
HALF_UNIT = {F16: 2.0 ** -11, BF16: 2.0 ** -8}


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
    u = HALF_UNIT[dtype]
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


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("n, d", [(1, 8), (2, 1), (3, 5), (129, 64), (1000, 96)])
@pytest.mark.parametrize("ls, lb", [(math.log(10.0), -10.0), (0.0, 5.0),
                                    (math.log(100.0), -20.0)], ids=["paper", "t0-b5", "t100"])
def test_matches_oracle_on_gpu(dtype, reduction, normalize, n, d, ls, lb):
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
    if normalize and dtype in HALF_UNIT:
        slack = _rounding_slack(a, b, ls, lb, reduction, g, dtype, (rloss,) + tuple(rgrads))
        tol = [t + sl for t, sl in zip(tol, slack)]
        for i in (1, 2):  # (see the module notes: the cap where the bound passes 0.5)
            tol[i] = min(tol[i], max(0.5, base + GRAD[dtype]))
    want = [np.asarray(rloss).astype(acc), rgrads[0].astype(dtype), rgrads[1].astype(dtype),
            rgrads[2].astype(acc), rgrads[3].astype(acc)]
    assert got[1].dtype == dtype and got[0].dtype == acc
    for name, x, y, t in zip(("loss", "da", "db", "dls", "dlb"), got, want, tol):
        assert _rel(x, y) <= t, (name, _rel(x, y), t)


@gpu
@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("n, ws", [(4096, None), (700, 200 * 1024)])
def test_tiles_both_loops(monkeypatch, configure, wgmma, dtype, n, ws):
    """SigLIP on the tensor-core tiles (MODE_SIGLIP), with the wgmma (sm_90a) and the mma.sync
    main loop, one row block and several (a small workspace), against the oracle; and the
    tile path is the one taken."""
    from cupynce._engine import tiling
    from cupynce._engine.losses import score_tiles

    configure(tiles=True, wgmma=wgmma)  # (tiles: else mma.sync tiles only off Hopper)
    a, b = _inputs(n, 64, dtype)
    if not tiling.tiles_ok(cp.asarray(a), cp.asarray(b)):
        pytest.skip("tensor-core tiles need sm_80+")
    calls = []
    real = score_tiles.siglip  # (cupynce._engine.siglip calls it through the module)
    monkeypatch.setattr(score_tiles, "siglip",
                        lambda *x, **k: calls.append(1) or real(*x, **k))
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


@gpu
@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma"])
def test_tiles_match_row_blocks(configure, wgmma):
    """The tiles against the cuBLAS row blocks on one problem of every kind at once: a rank's
    rows (row0 > 0) against more columns than rows (not a multiple of the tile), per-row
    weights read at the global rows, w_mul != 1, several row blocks on both paths.  Within
    the rounding of the 16-bit gradient block (da, db) and of float32 sums (the rest)."""
    from cupynce._engine import tiling
    from cupynce._engine.losses import row_blocks, score_tiles

    configure(tiles=True, wgmma=wgmma)
    rng = np.random.default_rng(11)
    n, nc, d, row0 = 300, 1000, 64, 200
    a64, b64 = rng.standard_normal((n, d)) / 8, rng.standard_normal((nc, d)) / 8
    an, bn = cp.asarray(a64.astype(BF16)), cp.asarray(b64.astype(BF16))
    if not tiling.tiles_ok(an, bn):
        pytest.skip("tensor-core tiles need sm_80+")
    w = rng.uniform(0.5, 1.5, row0 + n).astype(np.float32)
    ls, lb = cp.asarray([2.3], cp.float32), cp.asarray([-10.0], cp.float32)
    kw = dict(weights=(cp.asarray(w), 1, 0.25), want_loss=True, want_grad=True,
              workspace_bytes=300_000, row0=row0)
    loss_t, grads_t = score_tiles.siglip(an, bn, ls, lb, **kw)
    loss_b, grads_b = row_blocks.siglip(an, bn, ls, lb, **kw)
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


@gpu
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


@gpu
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


@gpu
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


@gpu
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
