"""SigLIP's sigmoid loss on the NumPy path (``cupynce.siglip_loss*`` on NumPy arrays).

Against the float64 oracle (``cupynce.reference.siglip_loss``, itself checked against
finite differences and open_clip's formula under torch autograd in ``test_reference.py``),
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
"""
from __future__ import annotations

import math
import zlib

import ml_dtypes
import numpy as np
import pytest

import cupynce
from cupynce import reference as ref

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
