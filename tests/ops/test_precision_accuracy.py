"""GPU tests of the public ``precision=`` argument (issue 24): the four contrastive ops on
float32 CuPy arrays in each mode, loss and every gradient against the float64 oracle
(``cupynce.reference``), run with ``pytest -m gpu`` on a CUDA machine.

Relative errors ‖x − ref‖ / ‖ref‖ (inputs rounded to float32 first; the oracle on them):

=========  =========================================================================
"fp32"     the float32 tolerances of ops/test_contrastive_kernels.py: loss 1e-5, gradients
           1e-4; and bit for bit the call without ``precision`` (the default)
"tf32"     2e-2 (TF32 keeps 10 mantissa bits: ~2e-4 measured by a float64 emulation
           of the rounded operands at these shapes, up to 1e-3 for SigLIP's scale)
"auto"     the default: "fp32"'s very call, bit for bit, at every shape here (below
           config ``tf32x3_min_rows`` x ``tf32x3_min_dim``); NT-Xent from there on, on
           Hopper, is "3xtf32"'s call (the TF32x3 tiles), and
           ``test_auto_nt_xent_as_accurate_as_fp32`` holds it to the issue's bar: per-row
           losses and dz no less accurate than "fp32"'s; the mean loss, one float32 number
           whose error is one draw of its last roundings, within ``SCALAR_SLACK`` (two
           float32 ulps, 2 × 2⁻²⁴ relative) of "fp32"'s.  CLIP, SigLIP and InfoNCE
           from the same sizes run their products on the tiles
           (``gemm.plan``: on Hopper the F16x3 tiles, ``gemm.f16x3``, for CLIP's
           products and the others' score products; the TF32x3 tiles for SigLIP's and
           InfoNCE's gradient products), ``test_auto_row_block_ops_as_accurate_as_fp32``
           holds them to the same bar (their scalar gradients and mean loss, single
           numbers whose error is a draw with a wide spread, as the rms over
           ``SCALAR_DRAWS`` draws, within ``SCALAR_SLACK`` · κ)
"3xtf32"   ≤ 2 × fp32's error + the tensor cores' truncation bias over the longest
           reduction, K = max(N, D) (the gradient products reduce over N):
           ``test_float32_precision.truncation_bound`` = (K / 8) 2⁻²⁴.  (No
           "better than tf32" here: a loss or a scalar gradient's error is mostly
           not the products', and small products stay fp32 in every mode; the
           bits check below shows the mode took effect, engine/test_blas.py the
           products' own errors.)  Hopper's tensor cores accumulate with truncation toward
           zero: measured on an H200, 3xtf32's gradients at N = 1000 came out 2.4e-6
           against fp32's 2.5e-7 (0.3 of the bias bound); its products alone 3-13×
           fp32's error (docs/decisions.md, issue 24)
=========  =========================================================================

The scalar gradients (CLIP's dlogit_scale, SigLIP's dlogit_scale and dlogit_bias) are sums
whose terms cancel: every bound of theirs above (the 3xtf32 truncation term
included) is multiplied by their condition κ ≥ 1, estimated as the float64 oracle's relative
response to a one-ulp float32 perturbation of the inputs, divided by 2⁻²⁴ (as
ops/test_siglip.py scales its float32 bound by the sums' condition: a sum that cancels cannot
be more exact, and a single number may come out of fp32 almost exact by chance).  Every
message records fp32's error beside the mode's.

Where the products go through cuBLAS (N²·D above config ``small_gemm_macs``; smaller ones run
``small_gemm`` in fp32 in every mode), "tf32" and "3xtf32" must also change the gradients'
bits: a mode that silently did nothing would pass the bounds above.
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

import cupynce
import cupynce.config as cfg
from cupynce import reference as R
from cupynce._engine.gemm import tf32x3
from cupynce._engine.gemm.chooser import f16_applies
import test_float32_precision as P  # (its folder is on sys.path: conftest)

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

MODES = cfg.FLOAT32_PRECISIONS
FP32_TOL = (1e-5, 1e-4)  # loss, gradients (ops/test_contrastive_kernels.py's float32)
TF32_TOL = 2e-2
X3_FACTOR = 2.0
SCALAR_SLACK = 2 * 2.0 ** -24
#: NT-Xent shapes at and above "auto"'s TF32x3 threshold (tf32x3_min_rows x tf32x3_min_dim)
AUTO_SHAPES = [(4096, 64), (4096, 256), (4096, 512), (6144, 256)]
SHAPES = [(64, 32), (64, 256), (300, 32), (300, 256), (1000, 32), (1000, 256)]
OPS = ["nt_xent", "info_nce", "clip_loss", "siglip_loss"]
NAMES = {"nt_xent": ["dz"], "info_nce": ["dquery", "dkey"],
         "clip_loss": ["da", "db", "dlogit_scale"],
         "siglip_loss": ["da", "db", "dlogit_scale", "dlogit_bias"]}
SCALARS = {"dlogit_scale", "dlogit_bias"}
CLIP_SCALE, SIGLIP_SCALE, SIGLIP_BIAS = np.log(1 / 0.07), np.log(10.0), -10.0


def rel(x, ref) -> float:
    x = np.asarray(cp.asnumpy(x) if isinstance(x, cp.ndarray) else x, np.float64)
    ref = np.asarray(ref, np.float64)
    num = np.linalg.norm((x - ref).ravel())
    den = np.linalg.norm(ref.ravel())
    if not np.isfinite(num):
        return float("inf")
    return float(num / den) if den > 0 else float(num)


def _inputs(op, n, d, rng):
    """float32 host arrays: the embeddings, then CLIP's / SigLIP's 0-d scalars."""
    def emb():
        return rng.standard_normal((n, d)).astype(np.float32)
    if op == "nt_xent":
        return [emb()]
    if op == "info_nce":
        return [emb(), emb()]
    if op == "clip_loss":
        return [emb(), emb(), np.asarray(CLIP_SCALE, np.float32)]
    return [emb(), emb(), np.asarray(SIGLIP_SCALE, np.float32),
            np.asarray(SIGLIP_BIAS, np.float32)]


def run_cupynce(op, xs, reduction, g, **kw):
    """(loss, gradients, ctx) of ``op`` on the GPU; ``kw`` holds ``precision`` if given."""
    dev = [cp.asarray(x) for x in xs]
    gl = cp.asarray(g) if isinstance(g, np.ndarray) else g
    common = dict(reduction=reduction, normalize=True, **kw)
    if op == "nt_xent":
        loss, ctx = cupynce.nt_xent_forward(dev[0], 0.1, **common)
        return loss, [cupynce.nt_xent_backward(ctx, gl)], ctx
    if op == "info_nce":
        loss, ctx = cupynce.info_nce_forward(dev[0], dev[1], 0.1, **common)
        return loss, list(cupynce.info_nce_backward(ctx, gl)[:2]), ctx
    if op == "clip_loss":
        loss, ctx = cupynce.clip_loss_forward(*dev, **common)
        return loss, list(cupynce.clip_loss_backward(ctx, gl)), ctx
    loss, ctx = cupynce.siglip_loss_forward(*dev, **common)
    return loss, list(cupynce.siglip_loss_backward(ctx, gl)), ctx


def run_reference(op, xs, reduction, g):
    kw = dict(reduction=reduction, normalize=True, grad_loss=g)
    if op == "nt_xent":
        loss, grads = R.nt_xent(xs[0], 0.1, **kw)
    elif op == "info_nce":
        loss, grads = R.info_nce(xs[0], xs[1], 0.1, **kw)
        grads = grads[:2]
    elif op == "clip_loss":
        loss, grads = R.clip_loss(*xs, **kw)
    else:
        loss, grads = R.siglip_loss(*xs, **kw)
    return loss, list(grads)


def _conditions(op, xs, reduction, g, ref_grads):
    """κ of each gradient: 1 for the feature gradients; for the scalar ones the oracle's
    relative response to a one-ulp float32 perturbation of the inputs, over 2⁻²⁴."""
    names = NAMES[op]
    if not SCALARS & set(names):
        return [1.0] * len(names)
    rng = np.random.default_rng(1)
    ulp = 2.0 ** -24
    moved = [np.asarray(x, np.float64) * (1 + ulp * rng.choice([-1.0, 1.0], np.shape(x)))
             for x in xs]
    _, grads = run_reference(op, moved, reduction, g)
    return [max(1.0, rel(m, r) / ulp) if name in SCALARS else 1.0
            for name, m, r in zip(names, grads, ref_grads)]


def _cublas_route(n: int, d: int) -> bool:
    """Whether the N × N × D products go through cuBLAS (else ``small_gemm``: fp32 always)."""
    c = cfg.current()
    return n * n * d > c.small_gemm_macs or d > c.small_gemm_max_k


def _auto_tiles(n: int, d: int) -> bool:
    """Whether "auto" runs NT-Xent (n, d) on the TF32x3 tiles (``nt_xent_tf32.applies``)."""
    c = cfg.current()
    return (n >= c.tf32x3_min_rows and d >= c.tf32x3_min_dim
            and tf32x3.available())


def _same_bits(x, y) -> bool:
    return x.shape == y.shape and x.dtype == y.dtype and bool(
        cp.array_equal(x.view(cp.uint32) if x.dtype == cp.float32 else x,
                       y.view(cp.uint32) if y.dtype == cp.float32 else y))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("n,d", SHAPES)
@pytest.mark.parametrize("op", OPS)
def test_modes_against_float64(op, n, d, reduction):
    rng = np.random.default_rng(zlib.crc32(f"{op}{n}{d}{reduction}".encode()))
    xs = _inputs(op, n, d, rng)
    g = rng.standard_normal(n) if reduction == "none" else 0.7
    ref_loss, ref_grads = run_reference(op, xs, reduction, g)
    conds = _conditions(op, xs, reduction, g, ref_grads)
    names = ["loss"] + NAMES[op]
    refs = [ref_loss] + ref_grads
    kappa = [1.0] + conds
    default = run_cupynce(op, xs, reduction, g)
    assert default[2].precision == cupynce.get_float32_precision()
    got, err = {}, {}
    for mode in MODES:
        loss, grads, ctx = run_cupynce(op, xs, reduction, g, precision=mode)
        assert ctx.precision == mode
        got[mode] = [loss] + grads
        err[mode] = [rel(x, r) for x, r in zip(got[mode], refs)]
    case = f"{op} N={n} D={d} {reduction}"
    for i, (name, k) in enumerate(zip(names, kappa)):
        e32, etf, e3 = err["fp32"][i], err["tf32"][i], err["3xtf32"][i]
        tol32 = (FP32_TOL[0] if name == "loss" else FP32_TOL[1]) * k
        assert e32 <= tol32, f"{case} fp32: {name} rel err {e32:.3e} > {tol32:.1e} (κ {k:.3g})"
        assert etf <= TF32_TOL * k, (f"{case} tf32: {name} rel err {etf:.3e} > "
                                     f"{TF32_TOL * k:.1e} (κ {k:.3g}, fp32's {e32:.3e})")
        bound = X3_FACTOR * e32 + P.truncation_bound(max(n, d)) * k
        assert e3 <= bound, (f"{case} 3xtf32: {name} rel err {e3:.3e} > {bound:.3e} "
                             f"(fp32's {e32:.3e}, κ {k:.3g}, tf32's {etf:.3e})")
        ea = err["auto"][i]
        assert ea <= e32, f"{case} auto: {name} rel err {ea:.3e} > fp32's {e32:.3e}"
    # "auto" is "3xtf32" where the TF32x3 tiles apply, "fp32" elsewhere, bit for bit
    same_as = "3xtf32" if op == "nt_xent" and _auto_tiles(n, d) else "fp32"
    for name, x, y in zip(names, got["auto"], got[same_as]):
        assert _same_bits(x, y), f"{case}: precision='auto' is not {same_as!r} for {name}"
    # the default ("auto" unless CUPYNCE_FLOAT32 says otherwise) is that mode's very call
    dmode = cupynce.get_float32_precision()
    for name, x, y in zip(names, got[dmode], [default[0]] + default[1]):
        assert _same_bits(x, y), f"{case}: precision={dmode!r} changed {name}'s bits"
    if _cublas_route(n, d):  # the modes took effect (the bounds alone would not see it)
        for mode in ("tf32", "3xtf32"):
            assert not all(_same_bits(x, y) for x, y in zip(got[mode][1:], got["fp32"][1:])), \
                f"{case}: precision={mode!r} gave fp32's gradients bit for bit"


def test_backward_keeps_the_forwards_precision():
    """The "none" backward recomputes the products: in the forward's mode, whatever the
    global default or the caller's scope is by then."""
    rng = np.random.default_rng(3)
    z = cp.asarray(rng.standard_normal((600, 256)).astype(np.float32))
    g = cp.asarray(rng.standard_normal(600).astype(np.float32))
    _, ctx = cupynce.nt_xent_forward(z, 0.1, reduction="none", precision="tf32")
    want = cupynce.nt_xent_backward(ctx, g)
    before = cupynce.get_float32_precision()
    try:
        cupynce.set_float32_precision("3xtf32")
        with cfg.float32_precision("fp32"):
            got = cupynce.nt_xent_backward(ctx, g)
    finally:
        cupynce.set_float32_precision(before)
    assert _same_bits(got, want)
    _, ctx32 = cupynce.nt_xent_forward(z, 0.1, reduction="none", precision="fp32")
    assert not _same_bits(cupynce.nt_xent_backward(ctx32, g), want)


def test_global_default_applies_without_an_argument():
    rng = np.random.default_rng(4)
    a, b = (cp.asarray(rng.standard_normal((512, 128)).astype(np.float32)) for _ in range(2))
    explicit = cupynce.clip_loss(a, b, 2.0, reduction="none", precision="3xtf32")
    before = cupynce.get_float32_precision()
    try:
        cupynce.set_float32_precision("3xtf32")
        implicit = cupynce.clip_loss(a, b, 2.0, reduction="none")
    finally:
        cupynce.set_float32_precision(before)
    assert _same_bits(implicit, explicit)


def test_other_dtypes_ignore_the_precision():
    """float64 and bfloat16 inputs: the same bits in every mode."""
    import ml_dtypes

    rng = np.random.default_rng(5)
    for dtype in (np.float64, ml_dtypes.bfloat16):
        z = cp.asarray(rng.standard_normal((512, 96)).astype(dtype))
        outs = [cupynce.nt_xent_forward(z, 0.1, reduction="none", precision=m) for m in MODES]
        grads = [cupynce.nt_xent_backward(ctx, 1.0) for _, ctx in outs]
        for (loss, _), grad in zip(outs[1:], grads[1:]):
            assert bool(cp.array_equal(loss, outs[0][0])) and bool(cp.array_equal(
                grad.view(cp.uint16) if grad.dtype.itemsize == 2 else grad,
                grads[0].view(cp.uint16) if grad.dtype.itemsize == 2 else grads[0]))


def test_splade_forward_modes():
    """SPLADE's float32 logit products (the cuBLAS-tile forward): fp32 = the default's bits,
    tf32 / 3xtf32 within their bounds of the float64 oracle's pooled output."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 48, 256)).astype(np.float32)
    w = (rng.standard_normal((3000, 256)) / 16).astype(np.float32)
    ref_out = R.splade_pool(x, w)[0]
    default = cupynce.splade_pool(cp.asarray(x), cp.asarray(w))
    errs = {}
    for mode in MODES:
        out = cupynce.splade_pool(cp.asarray(x), cp.asarray(w), precision=mode)
        errs[mode] = rel(out, ref_out)
        if mode == cupynce.get_float32_precision():
            assert _same_bits(out, default)
    assert errs["fp32"] <= 1e-5 and errs["tf32"] <= TF32_TOL, errs
    assert errs["3xtf32"] <= X3_FACTOR * errs["fp32"] + P.truncation_bound(256), errs


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def test_torch_follows_its_tf32_flag():
    """cupynce.torch, precision=None: "tf32" when torch's float32 CUDA matmuls use TF32, else
    the global default; an explicit mode wins."""
    torch = _torch_cuda()
    if torch is None:
        pytest.skip("needs torch with CUDA")
    import cupynce.torch as ct
    from cupynce.torch import _registry

    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision if _registry._FP32_PRECISION_API else matmul.allow_tf32
    z = torch.randn(700, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def loss(**kw):
        return ct.nt_xent(z, 0.1, reduction="none", **kw)
    try:
        matmul.allow_tf32 = True
        assert torch.equal(loss(), loss(precision="tf32"))
        assert not torch.equal(loss(precision="3xtf32"), loss())
        matmul.allow_tf32 = False
        assert torch.equal(loss(), loss(precision=cupynce.get_float32_precision()))
        assert not torch.equal(loss(precision="fp32"), loss(precision="tf32"))
    finally:
        if _registry._FP32_PRECISION_API:
            matmul.fp32_precision = saved
        else:
            matmul.allow_tf32 = saved


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("n,d", AUTO_SHAPES)
def test_auto_nt_xent_as_accurate_as_fp32(n, d, reduction):
    """NT-Xent at and above "auto"'s TF32x3 threshold: "auto" is "3xtf32"'s call there (on
    Hopper; "fp32"'s elsewhere), and its per-row losses and dz are no less accurate against
    float64 than "fp32"'s; the mean loss within SCALAR_SLACK (module doc)."""
    rng = np.random.default_rng(zlib.crc32(f"auto{n}{d}{reduction}".encode()))
    xs = _inputs("nt_xent", n, d, rng)
    g = rng.standard_normal(n) if reduction == "none" else 0.7
    ref = run_reference("nt_xent", xs, reduction, g)
    ref = [ref[0]] + ref[1]
    got = {m: run_cupynce("nt_xent", xs, reduction, g, precision=m) for m in
           ("auto", "fp32", "3xtf32")}
    got = {m: [v[0]] + v[1] for m, v in got.items()}
    same_as = "3xtf32" if _auto_tiles(n, d) else "fp32"
    for name, x, y in zip(["loss", "dz"], got["auto"], got[same_as]):
        assert _same_bits(x, y), f"N={n} D={d}: precision='auto' is not {same_as!r} for {name}"
    case = f"nt_xent N={n} D={d} {reduction}"
    for i, name in enumerate(["loss", "dz"]):
        ea, e32 = rel(got["auto"][i], ref[i]), rel(got["fp32"][i], ref[i])
        slack = SCALAR_SLACK if name == "loss" and reduction == "mean" else 0.0
        assert ea <= e32 + slack, (f"{case} auto: {name} rel err {ea:.3e} > fp32's "
                                   f"{e32:.3e} + {slack:.1e}")


def _auto_products(op: str, n: int, d: int) -> bool:
    """Whether "auto" runs the products of an (n, d) x (n, d) row-block op (CLIP, SigLIP,
    InfoNCE) on the TF32x3 tiles (``gemm.chooser.applies``)."""
    c = cfg.current()
    min_dim = (c.tf32x3_min_dim if op == "info_nce"
               else c.tf32x3_min_dim_scale)
    return n >= c.tf32x3_min_rows and d >= min_dim and tf32x3.available()


#: draws of the single numbers (a mean loss, a scalar gradient) compared in rms below.  Their
#: errors are heavy-tailed, so the rms needs enough draws to be a property of the mode and not
#: of one draw: on an H200 (2026-11-30), SigLIP N = 4096, D = 512, "none", dlogit_bias's 12
#: draws were 0.2-5.8e-7 for both modes but one "auto" draw of 1.5e-6 -- the first 4 draws'
#: rms 8.6e-7 against "fp32"'s 4.4e-7 (+ 2.9e-7 slack: failed), the 12 draws' 5.3e-7 against
#: 3.2e-7 (passed); at the same shape dlogit_scale's rms was 2.7e-7 for "auto", 1.0e-6 for
#: "fp32" (one "fp32" draw of 2.7e-6).  The row normalisation's summation order (it changed
#: that session) moves every draw's last bits, so a 4-draw bar passed or failed by chance.
SCALAR_DRAWS = 12


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("n,d", AUTO_SHAPES)
@pytest.mark.parametrize("op", ["clip_loss", "siglip_loss", "info_nce"])
def test_auto_row_block_ops_as_accurate_as_fp32(op, n, d, reduction):
    """CLIP, SigLIP and InfoNCE at and above "auto"'s threshold: "auto" is "3xtf32"'s call
    there (their products on the TF32x3 tiles, ``gemm.plan``; "fp32"'s off Hopper; on
    Hopper with ``gemm.chooser.f16_applies()`` the F16x3 tiles instead, whose bits are
    neither), and
    its per-row losses and feature gradients are no less accurate against float64 than
    "fp32"'s.  The single numbers -- the mean loss, the scalar gradients -- are one draw
    each of their last roundings, amplified by the sums' cancellation more than κ sees:
    measured on an H100 (SigLIP N = 4096, D = 512, "none"), dlogit_scale's error over three
    draws was 7e-8 / 2.5e-7 / 2.6e-6 for "fp32", 1.7e-6 / 2.5e-8 / 2.8e-8 for "auto", and
    1.3e-6 for scores rounded exactly from float64 in the first draw.  So they are compared
    as the rms of their errors over SCALAR_DRAWS draws (inputs and upstream gradient),
    within SCALAR_SLACK · κ (κ of the first draw)."""
    names = ["loss"] + NAMES[op]
    single = [name in SCALARS or (name == "loss" and reduction == "mean") for name in names]
    sq = {"auto": np.zeros(len(names)), "fp32": np.zeros(len(names))}
    for draw in range(SCALAR_DRAWS if any(single) else 1):
        rng = np.random.default_rng(zlib.crc32(f"auto{op}{n}{d}{reduction}".encode()) + draw)
        xs = _inputs(op, n, d, rng)
        g = rng.standard_normal(n) if reduction == "none" else 0.7
        ref_loss, ref_grads = run_reference(op, xs, reduction, g)
        refs = [ref_loss] + ref_grads
        got = {}
        for m in ("auto", "fp32", "3xtf32") if draw == 0 else ("auto", "fp32"):
            loss, grads, _ = run_cupynce(op, xs, reduction, g, precision=m)
            got[m] = [loss] + grads
        case = f"{op} N={n} D={d} {reduction}"
        if draw == 0:
            kappa = [1.0] + _conditions(op, xs, reduction, g, ref_grads)
            if _auto_products(op, n, d) and f16_applies():
                # "auto" on Hopper: the F16x3 tiles (engine/test_f16x3.py), neither "3xtf32"'s
                # bits nor "fp32"'s: the mode took effect
                assert not all(_same_bits(x, y) for x, y in zip(got["auto"], got["fp32"])), case
            else:
                same_as = "3xtf32" if _auto_products(op, n, d) else "fp32"
                for name, x, y in zip(names, got["auto"], got[same_as]):
                    assert _same_bits(x, y), (f"{case}: precision='auto' is not {same_as!r} "
                                              f"for {name}")
            for i, name in enumerate(names):
                if single[i]:
                    continue
                ea, e32 = rel(got["auto"][i], refs[i]), rel(got["fp32"][i], refs[i])
                assert ea <= e32, f"{case} auto: {name} rel err {ea:.3e} > fp32's {e32:.3e}"
        for m in sq:
            sq[m] += [rel(x, r) ** 2 for x, r in zip(got[m], refs)]
    for i, name in enumerate(names):
        if not single[i]:
            continue
        ea, e32 = (math.sqrt(sq[m][i] / SCALAR_DRAWS) for m in ("auto", "fp32"))
        slack = SCALAR_SLACK * kappa[i]
        assert ea <= e32 + slack, (f"{case} auto: {name} rms rel err over {SCALAR_DRAWS} draws "
                                   f"{ea:.3e} > fp32's {e32:.3e} + {slack:.1e}")
