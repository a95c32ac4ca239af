"""The NumPy path of the functional API (``cupynce.<op>_forward/backward`` on NumPy arrays).

Checked against the float64 oracle ``cupynce.reference`` (loss AND every gradient, relative
error ``||x - ref|| / ||ref||``) for every op x dtype x reduction x normalize, odd shapes and
upstream gradients other than 1; plus output dtypes/shapes, blocking, determinism, low
temperature, NaN/inf propagation, non-contiguous inputs and torch-CPU autograd (float64); and
``*_backward_from_stats`` (inputs + O(N) row statistics) equals ``*_backward(ctx)`` (the same
comparisons on CuPy: ``test_backward_from_stats_gpu`` in ops/test_contrastive_kernels.py).

Tolerances (relative error against the oracle computed from the *same* quantised inputs):

=========  ==========================================================================
float64    1e-12
float32    loss 1e-5, gradients 1e-5  (measured max: 5.6e-7 / 4.1e-7)
float16    max(2 x torch-CPU float16 error, 1e-3); without torch a fixed 5e-3
bfloat16   max(2 x torch-CPU bfloat16 error, 1e-3); without torch a fixed 3e-2
=========  ==========================================================================

Without torch, CLIP's dlogit_scale (a sum of cancelling terms) gets the fixed tolerance times
its condition number ``sum|G_ij L_ij| / |sum G_ij L_ij|``.

Measured (this suite's cases): float64 <= 1.1e-15; float16 loss <= 1.3e-3, gradients
<= 9.5e-3; bfloat16 loss <= 4.0e-3, gradients <= 9.1e-3 except CLIP's dlogit_scale with a
random per-pair grad_loss, a sum of cancelling terms (relative error ~1 for us and ~2 for
torch).  The worst ratio to torch's own error is ~1.9 (a 2 x 3 bfloat16 case at the floor).

The torch baseline runs the textbook formulation (``F.normalize``, matmul, masked
``F.cross_entropy``) entirely in the low-precision dtype, on the same inputs, with the same
upstream gradient.
"""
from __future__ import annotations

import math
import zlib

import ml_dtypes
import numpy as np
import pytest

import cupynce
import cupynce as cpn
from cupynce import reference as ref

try:  # the low-precision baseline; CI has torch
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
DTYPES = [pytest.param(F16, id="f16"), pytest.param(BF16, id="bf16"),
          pytest.param(F32, id="f32"), pytest.param(F64, id="f64")]
REDUCTIONS = ("mean", "sum", "none")

# Fixed tolerances: float64 / float32 (loss, grads); low-precision fallbacks without torch.
TOL_FIXED = {F64: (1e-12, 1e-12), F32: (1e-5, 1e-5)}
TOL_FALLBACK = {F16: 5e-3, BF16: 3e-2}
LOW_FLOOR = 1e-3  # absolute floor on the torch-relative tolerance

NT_T = 0.5
INFO_T = 0.2
CLIP_LS = 2.5  # exactly representable in bfloat16 / float16 (scale exp(2.5) ~ 12.2)

# op, shape spec ids
NT_SHAPES = [(2, 1), (6, 5), (42, 33), (6, 33)]
INFO_SHAPES = [(2, 3), (7, 5), (41, 33)]
CLIP_SHAPES = [(2, 3), (7, 1), (7, 5), (41, 33)]
M_NEG = 3


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------
def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _randn(rng, shape, dtype):
    d = shape[-1]
    return (rng.standard_normal(shape) / math.sqrt(d)).astype(dtype)


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def rel_err(x, r):
    x, r = _f64(x), _f64(r)
    den = np.linalg.norm(r)
    num = np.linalg.norm(x - r)
    return float(num / den) if den > 0 else float(num)


def check_close(name, x, r, tol, case=""):
    """Relative error ``||x - r|| / ||r||`` <= tol, with a verbose message otherwise."""
    assert np.shape(x) == np.shape(r), f"{case} {name}: shape {np.shape(x)} != {np.shape(r)}"
    err = rel_err(x, r)
    if not err <= tol:
        xa, ra = np.atleast_1d(_f64(x)), np.atleast_1d(_f64(r))
        diff = np.abs(xa - ra)
        i = np.unravel_index(np.nanargmax(diff) if np.isfinite(diff).any() else 0, diff.shape)
        pytest.fail(f"{case} {name}: relative error {err:.3e} > tol {tol:.3e}\n"
                    f"  max |diff| {diff[i]:.3e} at {tuple(int(j) for j in i)}: "
                    f"got {xa[i]!r}, oracle {ra[i]!r}\n"
                    f"  ||ref|| {np.linalg.norm(ra):.3e}, non-finite in got: "
                    f"{int((~np.isfinite(xa)).sum())}")
    return err


def _loss_dtype(dtype):
    return F64 if dtype == F64 else F32


# ----------------------------------------------------------------------------------------
# cases: inputs, cupynce call, oracle call, torch call
# ----------------------------------------------------------------------------------------
def make_case(op, shape, dtype, negatives=None, seed=0):
    """Inputs (dict of NumPy arrays in ``dtype``) for one op."""
    n, d = shape
    rng = _rng(op, shape, str(dtype), negatives, seed)
    if op == "nt_xent":
        return {"z": _randn(rng, (n, d), dtype)}
    if op == "info_nce":
        inp = {"query": _randn(rng, (n, d), dtype), "key": _randn(rng, (n, d), dtype)}
        if negatives == "shared":
            inp["negatives"] = _randn(rng, (M_NEG, d), dtype)
        elif negatives == "paired":
            inp["negatives"] = _randn(rng, (n, M_NEG, d), dtype)
        return inp
    return {"a": _randn(rng, (n, d), dtype), "b": _randn(rng, (n, d), dtype)}


def run_cupynce(op, inp, reduction, normalize, grad_loss, *, logit_scale=CLIP_LS,
                temperature=None, **kw):
    """(loss, grads tuple) from cupynce's forward/backward."""
    if op == "nt_xent":
        loss, ctx = cupynce.nt_xent_forward(inp["z"], NT_T if temperature is None else temperature,
                                            reduction=reduction, normalize=normalize, **kw)
        return loss, (cupynce.nt_xent_backward(ctx, grad_loss),)
    if op == "info_nce":
        loss, ctx = cupynce.info_nce_forward(
            inp["query"], inp["key"], INFO_T if temperature is None else temperature,
            negatives=inp.get("negatives"), reduction=reduction, normalize=normalize, **kw)
        return loss, cupynce.info_nce_backward(ctx, grad_loss)
    loss, ctx = cupynce.clip_loss_forward(inp["a"], inp["b"], logit_scale, reduction=reduction,
                                          normalize=normalize, **kw)
    return loss, cupynce.clip_loss_backward(ctx, grad_loss)


def run_oracle(op, inp, reduction, normalize, grad_loss, *, logit_scale=CLIP_LS,
               temperature=None):
    g = None if grad_loss is None else _f64(grad_loss)
    if op == "nt_xent":
        return ref.nt_xent(inp["z"], NT_T if temperature is None else temperature,
                           reduction=reduction, normalize=normalize, grad_loss=g)
    if op == "info_nce":
        return ref.info_nce(inp["query"], inp["key"], INFO_T if temperature is None else temperature,
                            negatives=inp.get("negatives"), reduction=reduction,
                            normalize=normalize, grad_loss=g)
    return ref.clip_loss(inp["a"], inp["b"], _f64(logit_scale), reduction=reduction,
                         normalize=normalize, grad_loss=g)


_TORCH_DTYPES = {F16: "float16", BF16: "bfloat16", F32: "float32", F64: "float64"}


def _to_torch(x, dtype):
    tdt = getattr(torch, _TORCH_DTYPES[np.dtype(dtype)])
    return torch.tensor(np.asarray(x).astype(np.float64)).to(tdt).requires_grad_(True)


def torch_loss(op, leaves, reduction, normalize, *, logit_scale=None, temperature=None):
    """The textbook torch formulation of each loss, in the leaves' dtype."""
    def nrm(x):
        return F.normalize(x, dim=-1) if normalize else x

    if op == "nt_xent":
        (z,) = leaves
        n = z.shape[0]
        zn = nrm(z)
        s = zn @ zn.T / (NT_T if temperature is None else temperature)
        s = s.masked_fill(torch.eye(n, dtype=torch.bool), float("-inf"))
        return F.cross_entropy(s, (torch.arange(n) + n // 2) % n, reduction=reduction)
    if op == "info_nce":
        q, k = nrm(leaves[0]), nrm(leaves[1])
        logits = q @ k.T
        if len(leaves) == 3:
            neg = nrm(leaves[2])
            extra = q @ neg.T if neg.ndim == 2 else torch.einsum("nd,nmd->nm", q, neg)
            logits = torch.cat([logits, extra], dim=1)
        logits = logits / (INFO_T if temperature is None else temperature)
        return F.cross_entropy(logits, torch.arange(q.shape[0]), reduction=reduction)
    a, b = nrm(leaves[0]), nrm(leaves[1])
    logits = logit_scale.exp() * (a @ b.T)
    lab = torch.arange(a.shape[0])
    per = 0.5 * (F.cross_entropy(logits, lab, reduction="none")
                 + F.cross_entropy(logits.T, lab, reduction="none"))
    return {"mean": per.mean(), "sum": per.sum(), "none": per}[reduction]


def run_torch(op, inp, dtype, reduction, normalize, grad_loss, *, logit_scale=CLIP_LS,
              temperature=None):
    """(loss, grads) from torch autograd in ``dtype``, as float64 NumPy."""
    names = {"nt_xent": ["z"], "info_nce": ["query", "key", "negatives"], "clip_loss": ["a", "b"]}
    leaves = [_to_torch(inp[k], dtype) for k in names[op] if inp.get(k) is not None]
    ls = None
    if op == "clip_loss":
        ls = _to_torch(logit_scale, dtype)
        leaves.append(ls)
    loss = torch_loss(op, leaves, reduction, normalize, logit_scale=ls, temperature=temperature)
    g = torch.tensor(np.broadcast_to(_f64(1.0 if grad_loss is None else grad_loss),
                                     tuple(loss.shape)).copy()).to(loss.dtype)
    grads = torch.autograd.grad(loss, leaves, grad_outputs=g)
    out = [gr.detach().double().numpy() for gr in grads]
    if op == "info_nce" and len(out) == 2:
        out.append(None)
    return loss.detach().double().numpy(), tuple(out)


def grad_loss_for(reduction, n, dtype, rng):
    """Not 1: 0.7 (mean), a 0-d array (sum), a random (n,) vector (none)."""
    if reduction == "mean":
        return 0.7
    if reduction == "sum":
        return np.asarray(-1.3, dtype=F32)
    return rng.standard_normal(n).astype(dtype)


# The parametrised oracle cases: (op, shape, negatives)
CASES = ([pytest.param("nt_xent", s, None, id=f"nt_xent-{s[0]}x{s[1]}") for s in NT_SHAPES]
         + [pytest.param("info_nce", s, neg, id=f"info_nce-{s[0]}x{s[1]}-{neg}")
            for s in INFO_SHAPES for neg in (None, "shared", "paired")]
         + [pytest.param("clip_loss", s, None, id=f"clip-{s[0]}x{s[1]}") for s in CLIP_SHAPES])

#: measured maximum relative errors, per dtype and loss/grad (printed with -s; see report)
MEASURED = {}


def _clip_dscale_condition(inp, reduction, normalize, grad_loss, logit_scale=CLIP_LS):
    """sum |G_ij L_ij| / |sum G_ij L_ij| in float64 (see ``reference.clip_loss``)."""
    a, b = _f64(inp["a"]), _f64(inp["b"])
    if normalize:
        a, b = ref.l2_normalize(a), ref.l2_normalize(b)
    n = a.shape[0]
    logits = math.exp(logit_scale) * (a @ b.T)
    if reduction == "none":
        w = np.broadcast_to(_f64(grad_loss), (n,))
    else:
        w = np.full(n, float(_f64(grad_loss)) / (n if reduction == "mean" else 1))
    rs = np.exp(logits - logits.max(1, keepdims=True))
    rs /= rs.sum(1, keepdims=True)
    cs = np.exp(logits - logits.max(0, keepdims=True))
    cs /= cs.sum(0, keepdims=True)
    eye = np.eye(n)
    terms = 0.5 * (w[:, None] * (rs - eye) + w[None, :] * (cs - eye)) * logits
    return float(np.abs(terms).sum() / max(abs(terms.sum()), 1e-300))


def _tolerances(op, inp, dtype, reduction, normalize, grad_loss, n_outputs):
    """Per-output tolerances [loss, grad0, grad1, ...]."""
    if dtype in TOL_FIXED:
        tl, tg = TOL_FIXED[dtype]
        return [tl] + [tg] * n_outputs
    if torch is None:
        tols = [TOL_FALLBACK[dtype]] * (1 + n_outputs)
        if op == "clip_loss":  # dlogit_scale = sum_ij G_ij L_ij: scale by its condition number
            tols[3] *= _clip_dscale_condition(inp, reduction, normalize, grad_loss)
        return tols
    tloss, tgrads = run_torch(op, inp, dtype, reduction, normalize, grad_loss)
    rloss, rgrads = run_oracle(op, inp, reduction, normalize, grad_loss)
    tols = [max(2 * rel_err(tloss, rloss), LOW_FLOOR)]
    for tg, rg in zip(tgrads, rgrads):
        tols.append(None if rg is None else max(2 * rel_err(tg, rg), LOW_FLOOR))
    return tols


# ----------------------------------------------------------------------------------------
# 1. against the oracle: every op x dtype x reduction x normalize
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,shape,negatives", CASES)
def test_matches_oracle(op, shape, negatives, dtype, reduction, normalize):
    inp = make_case(op, shape, dtype, negatives)
    n = shape[0]
    g = grad_loss_for(reduction, n, dtype, _rng("g", op, shape, reduction))
    case = f"[{op} {shape} neg={negatives} {dtype} {reduction} normalize={normalize}]"

    loss, grads = run_cupynce(op, inp, reduction, normalize, g)
    rloss, rgrads = run_oracle(op, inp, reduction, normalize, g)
    assert len(grads) == len(rgrads)

    # output dtypes and shapes
    ld = _loss_dtype(dtype)
    assert loss.dtype == ld, f"{case} loss dtype {loss.dtype}, expected {ld}"
    assert np.shape(loss) == ((n,) if reduction == "none" else ()), case
    names = list(inp)
    for i, (gr, rg) in enumerate(zip(grads, rgrads)):
        if rg is None:
            assert gr is None, f"{case} grad {i} should be None"
            continue
        if op == "clip_loss" and i == 2:  # dlogit_scale for a Python float: 0-d, acc dtype
            assert gr.shape == () and gr.dtype == ld, f"{case} dlogit_scale {gr.shape} {gr.dtype}"
        else:
            assert gr.dtype == dtype, f"{case} d{names[i]} dtype {gr.dtype}, expected {dtype}"
            assert gr.shape == inp[names[i]].shape, case

    tols = _tolerances(op, inp, dtype, reduction, normalize, g, len(grads))
    errs = [check_close("loss", loss, rloss, tols[0], case)]
    for i, (gr, rg, tol) in enumerate(zip(grads, rgrads, tols[1:])):
        if rg is None:
            continue
        name = "dlogit_scale" if op == "clip_loss" and i == 2 else f"d{names[i]}"
        errs.append(check_close(name, gr, rg, tol, case))
    m = MEASURED.setdefault(str(dtype), [0.0, 0.0])
    m[0] = max(m[0], errs[0])
    m[1] = max([m[1]] + errs[1:])


def test_print_measured_errors():
    """Runs last in this module: prints the worst errors seen (visible with ``-s``)."""
    for k, (l, g) in MEASURED.items():
        print(f"max relative error {k:9s}: loss {l:.2e}, grads {g:.2e}")


# ----------------------------------------------------------------------------------------
# 2. grad_loss variants, logit_scale arrays, loss-only entry points, requires_grad=False
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss"])
@pytest.mark.parametrize("grad_loss", ["float", "0d", "1elem"])
def test_scalar_grad_loss_forms(op, grad_loss):
    g = {"float": 0.7, "0d": np.asarray(0.7), "1elem": np.asarray([0.7], np.float32)}[grad_loss]
    for reduction in ("mean", "sum"):
        inp = make_case(op, (6, 5), F64, "shared")
        loss, grads = run_cupynce(op, inp, reduction, True, g)
        rloss, rgrads = run_oracle(op, inp, reduction, True, _f64(g).reshape(()))
        check_close("loss", loss, rloss, 1e-12, op)
        for gr, rg in zip(grads, rgrads):
            if rg is not None:
                check_close("grad", gr, rg, 1e-12, f"{op} {reduction} grad_loss={grad_loss}")


@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss"])
def test_none_reduction_scalar_grad_loss_broadcasts(op):
    inp = make_case(op, (6, 5), F64, "paired")
    _, grads = run_cupynce(op, inp, "none", False, 0.7)
    _, rgrads = run_oracle(op, inp, "none", False, 0.7)
    _, vgrads = run_cupynce(op, inp, "none", False, np.full(6, 0.7))
    for gr, rg, vg in zip(grads, rgrads, vgrads):
        if rg is not None:
            check_close("grad", gr, rg, 1e-12, op)
            check_close("grad", gr, vg, 1e-12, op)


@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss"])
def test_none_reduction_vector_is_sum_of_one_hot_grads(op):
    """d(sum_i g_i loss_i) = sum_i g_i d(loss_i): each one-hot backward, weighted and summed."""
    n = 6
    inp = make_case(op, (n, 5), F64, "shared")
    g = _rng("onehot", op).standard_normal(n)
    _, ctx_grads = run_cupynce(op, inp, "none", True, g)
    total = None
    for i in range(n):
        e = np.zeros(n)
        e[i] = 1.0
        _, gi = run_cupynce(op, inp, "none", True, e)
        gi = [None if x is None else g[i] * x for x in gi]
        total = gi if total is None else [None if a is None else a + b for a, b in zip(total, gi)]
    _, rgrads = run_oracle(op, inp, "none", True, g)
    for gr, tg, rg in zip(ctx_grads, total, rgrads):
        if rg is not None:
            check_close("grad", gr, rg, 1e-12, op)
            check_close("one-hot sum", tg, rg, 1e-11, op)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ls_kind", ["0d-f32", "1elem-f64", "0d-f64", "1elem-f32"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_clip_logit_scale_array_grad_shape_and_dtype(dtype, ls_kind, reduction):
    shape, ldt = {"0d-f32": ((), F32), "1elem-f64": ((1,), F64),
                  "0d-f64": ((), F64), "1elem-f32": ((1,), F32)}[ls_kind]
    ls = np.full(shape, CLIP_LS, ldt)
    inp = make_case("clip_loss", (7, 5), dtype)
    g = grad_loss_for(reduction, 7, dtype, _rng("ls", reduction))
    loss, (da, db, dls) = run_cupynce("clip_loss", inp, reduction, True, g, logit_scale=ls)
    _, (_, _, rls) = run_oracle("clip_loss", inp, reduction, True, g, logit_scale=ls)
    assert dls.shape == shape and dls.dtype == ldt, (dls.shape, dls.dtype)
    tol = _tolerances("clip_loss", inp, dtype, reduction, True, g, 3)[3]  # torch-relative
    tol = max(tol, 4 * float(np.finfo(ldt).eps))  # the result is rounded to logit_scale's dtype
    check_close("dlogit_scale", dls, rls.reshape(shape), tol, f"clip {dtype} {ls_kind}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss"])
def test_loss_only_equals_forward(op, reduction, dtype):
    inp = make_case(op, (6, 5), dtype, "paired")
    if op == "nt_xent":
        only = cupynce.nt_xent(inp["z"], NT_T, reduction=reduction, normalize=True)
        fwd = cupynce.nt_xent_forward(inp["z"], NT_T, reduction=reduction, normalize=True)[0]
    elif op == "info_nce":
        args = (inp["query"], inp["key"], INFO_T)
        kw = dict(negatives=inp["negatives"], reduction=reduction, normalize=True)
        only = cupynce.info_nce(*args, **kw)
        fwd = cupynce.info_nce_forward(*args, **kw)[0]
    else:
        only = cupynce.clip_loss(inp["a"], inp["b"], CLIP_LS, reduction=reduction, normalize=True)
        fwd = cupynce.clip_loss_forward(inp["a"], inp["b"], CLIP_LS, reduction=reduction,
                                        normalize=True)[0]
    np.testing.assert_array_equal(only, fwd)
    assert np.asarray(only).dtype == np.asarray(fwd).dtype == _loss_dtype(dtype)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss"])
def test_backward_after_no_grad_forward_raises(op, reduction):
    inp = make_case(op, (4, 3), F32)
    if op == "nt_xent":
        _, ctx = cupynce.nt_xent_forward(inp["z"], reduction=reduction, requires_grad=False)
        bwd = cupynce.nt_xent_backward
    elif op == "info_nce":
        _, ctx = cupynce.info_nce_forward(inp["query"], inp["key"], reduction=reduction,
                                          requires_grad=False)
        bwd = cupynce.info_nce_backward
    else:
        _, ctx = cupynce.clip_loss_forward(inp["a"], inp["b"], 1.0, reduction=reduction,
                                           requires_grad=False)
        bwd = cupynce.clip_loss_backward
    with pytest.raises(ValueError, match="requires_grad"):
        bwd(ctx, np.ones(4) if reduction == "none" else 1.0)


# ----------------------------------------------------------------------------------------
# 3. blocking, determinism, low temperature, non-finite inputs, layouts
# ----------------------------------------------------------------------------------------
def _ncols(op, inp):
    if op == "nt_xent":
        return inp["z"].shape[0]
    n = inp["query" if op == "info_nce" else "a"].shape[0]
    neg = inp.get("negatives")
    return n + (neg.shape[0] if neg is not None and neg.ndim == 2 else 0)


BLOCK_CASES = [("nt_xent", (42, 33), None), ("info_nce", (41, 33), None),
               ("info_nce", (41, 33), "shared"), ("info_nce", (41, 33), "paired"),
               ("clip_loss", (41, 33), None)]


@pytest.mark.parametrize("rows_per_block", [1, 4, 5])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype,tol", [(F32, 1e-6), (F64, 1e-13), (BF16, 1e-2)],
                         ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("op,shape,negatives", BLOCK_CASES)
def test_blocked_equals_unblocked(op, shape, negatives, dtype, tol, reduction, rows_per_block):
    """A workspace of a few rows (uneven last block for N=41/42) gives the default's result."""
    inp = make_case(op, shape, dtype, negatives)
    acc_size = 8 if dtype == F64 else 4
    ws = rows_per_block * _ncols(op, inp) * acc_size + (acc_size - 1)
    g = grad_loss_for(reduction, shape[0], dtype, _rng("blk"))
    loss0, grads0 = run_cupynce(op, inp, reduction, True, g)
    loss1, grads1 = run_cupynce(op, inp, reduction, True, g, workspace_bytes=ws)
    case = f"[{op} {negatives} {dtype} {reduction} ws={ws}]"
    check_close("loss", loss1, loss0, tol, case)
    for a, b in zip(grads1, grads0):
        if b is not None:
            check_close("grad", a, b, tol, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,shape,negatives", BLOCK_CASES)
def test_deterministic(op, shape, negatives, dtype):
    inp = make_case(op, shape, dtype, negatives)
    for reduction in REDUCTIONS:
        g = grad_loss_for(reduction, shape[0], dtype, _rng("det"))
        l1, g1 = run_cupynce(op, inp, reduction, True, g, workspace_bytes=4096)
        l2, g2 = run_cupynce(op, inp, reduction, True, g, workspace_bytes=4096)
        np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
        for a, b in zip(g1, g2):
            if a is not None:
                assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("dtype", [pytest.param(F16, id="f16"), pytest.param(BF16, id="bf16")])
@pytest.mark.parametrize("op,negatives", [("nt_xent", None), ("info_nce", "shared"),
                                          ("info_nce", "paired"), ("clip_loss", None)])
def test_low_temperature_is_finite(op, negatives, dtype, normalize):
    """temperature 0.01 (logits ~ 100, exp overflows float16/float32 without the shift)."""
    inp = make_case(op, (8, 16), dtype, negatives)
    for k in inp:  # rows of norm ~ 1 (or exactly 1 with normalize): logits up to ~100
        inp[k] = (_f64(inp[k]) * 4.0).astype(dtype)
    for reduction in REDUCTIONS:
        g = grad_loss_for(reduction, 8, dtype, _rng("lowt"))
        loss, grads = run_cupynce(op, inp, reduction, normalize, g, temperature=0.01,
                                  logit_scale=math.log(100.0))
        rloss, _ = run_oracle(op, inp, reduction, normalize, g, temperature=0.01,
                              logit_scale=math.log(100.0))
        assert np.all(np.isfinite(loss)), (op, reduction, loss)
        for gr in grads:
            if gr is not None:
                assert np.all(np.isfinite(_f64(gr))), (op, reduction)
        # loose: the logits themselves carry the input's rounding times 1/0.01
        check_close("loss", loss, rloss, 0.1, f"[{op} {dtype} {reduction} T=0.01]")


def _plant_nonfinite(op, inp, value):
    """value at [0, 0] of the first input; signs arranged so that row 0 sees a +inf logit
    against a -inf positive logit when value is inf (the undefined-softmax case)."""
    first, other = {"nt_xent": ("z", "z"), "info_nce": ("query", "key"),
                    "clip_loss": ("a", "b")}[op]
    pos = inp[first].shape[0] // 2 if op == "nt_xent" else 0
    x = inp[first].copy()
    y = x if first == other else inp[other].copy()
    y[pos, 0] = -abs(y[pos, 0]) - 0.25  # the positive's logit -> -inf
    y[1, 0] = abs(y[1, 0]) + 0.25       # a negative's logit  -> +inf
    x[0, 0] = value
    inp[first], inp[other] = x, y
    return inp


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("dtype", [pytest.param(F16, id="f16"), pytest.param(F32, id="f32")])
@pytest.mark.parametrize("op,negatives", [("nt_xent", None), ("info_nce", "shared"),
                                          ("info_nce", "paired"), ("clip_loss", None)])
def test_nonfinite_input_gives_nan_loss(op, negatives, dtype, bad, normalize):
    inp = _plant_nonfinite(op, make_case(op, (6, 5), dtype, negatives),
                           np.nan if bad == "nan" else np.inf)
    with np.errstate(all="ignore"):
        for reduction in ("mean", "sum"):
            loss, _ = run_cupynce(op, inp, reduction, normalize, 1.0)
            assert np.isnan(loss), f"{op} {dtype} {bad} {reduction}: loss {loss!r}, expected NaN"
        per_row = run_cupynce(op, inp, "none", normalize, np.ones(6))[0]
        r_row = run_oracle(op, inp, "none", normalize, None)[0]
    assert np.isnan(per_row[0]), per_row
    np.testing.assert_array_equal(np.isnan(per_row), np.isnan(r_row),
                                  err_msg=f"NaN rows differ: got {per_row}, oracle {r_row}")


def test_inf_input_minimal_repro():
    """One inf entry, NT-Xent, raw inputs: NaN, as the oracle (was inf on the NumPy path)."""
    z = np.array([[np.inf], [1.0], [-1.0], [1.0]], np.float32)
    with np.errstate(all="ignore"):
        assert np.isnan(ref.nt_xent(z)[0])  # the oracle
        got = cupynce.nt_xent(z)
    assert np.isnan(got), f"nt_xent(NumPy) with an inf input gives {got!r}, not NaN"


def _layouts(x):
    """Non-contiguous / transposed views equal in value to x (2-D)."""
    n, d = x.shape
    wide = np.zeros((n, d + 3), x.dtype)
    wide[:, 1:d + 1] = x
    step = np.zeros((n, 2 * d), x.dtype)
    step[:, ::2] = x
    rows = np.zeros((2 * n, d), x.dtype)
    rows[::2] = x
    rev = np.ascontiguousarray(x[::-1])[::-1]
    return {"fortran": np.asfortranarray(x), "T.copy().T": x.T.copy().T,
            "col-slice": wide[:, 1:d + 1], "col-step-2": step[:, ::2],
            "row-stride": rows[::2], "neg-stride": rev}


@pytest.mark.parametrize("layout", ["fortran", "T.copy().T", "col-slice", "col-step-2",
                                    "row-stride", "neg-stride"])
@pytest.mark.parametrize("dtype", [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16")])
@pytest.mark.parametrize("op,negatives", [("nt_xent", None), ("info_nce", "shared"),
                                          ("info_nce", "paired"), ("clip_loss", None)])
def test_noncontiguous_inputs(op, negatives, dtype, layout):
    inp = make_case(op, (6, 5), dtype, negatives)
    views = {}
    for k, v in inp.items():
        if v.ndim == 2:
            views[k] = _layouts(v)[layout]
            assert np.array_equal(views[k], v)
        else:  # (N, M, D) negatives: a transposed-memory view
            views[k] = np.asfortranarray(v)
    if layout not in ("row-stride", "col-slice", "neg-stride"):
        assert not all(x.flags.c_contiguous for x in views.values() if x.ndim == 2)
    for reduction in REDUCTIONS:
        g = grad_loss_for(reduction, 6, dtype, _rng("nc"))
        l0, g0 = run_cupynce(op, inp, reduction, True, g)
        l1, g1 = run_cupynce(op, views, reduction, True, g)
        np.testing.assert_array_equal(np.asarray(l1), np.asarray(l0))
        for a, b in zip(g1, g0):
            if b is not None:
                assert a.shape == b.shape and a.dtype == b.dtype
                np.testing.assert_array_equal(_f64(a), _f64(b))


# ----------------------------------------------------------------------------------------
# 4. against torch-CPU autograd in float64 directly
# ----------------------------------------------------------------------------------------
TORCH_CASES = [("nt_xent", (6, 5), None), ("nt_xent", (42, 33), None),
               ("info_nce", (7, 5), None), ("info_nce", (7, 5), "shared"),
               ("info_nce", (41, 33), "paired"), ("clip_loss", (7, 5), None),
               ("clip_loss", (41, 33), None)]


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("op,shape,negatives", TORCH_CASES)
def test_matches_torch_float64(op, shape, negatives, reduction, normalize):
    pytest.importorskip("torch")
    inp = make_case(op, shape, F64, negatives)
    g = grad_loss_for(reduction, shape[0], F64, _rng("torch", op, reduction))
    loss, grads = run_cupynce(op, inp, reduction, normalize, g)
    tloss, tgrads = run_torch(op, inp, F64, reduction, normalize, g)
    case = f"[torch {op} {shape} {negatives} {reduction} normalize={normalize}]"
    check_close("loss", loss, tloss, 1e-12, case)
    for gr, tg in zip(grads, tgrads):
        if tg is None:
            assert gr is None
        else:
            check_close("grad", gr, tg, 1e-12, case)


# ----------------------------------------------------------------------------------------
# normalize=True on rows whose sum of squares overflows the accumulation dtype
# ----------------------------------------------------------------------------------------
#: a row scale whose squares overflow the accumulator (float32: > 3.4e38; float64: > 1.8e308)
HUGE = {F32: 1e20, BF16: 1e20, F64: 1e160}
HUGE_TOL = {F32: (1e-5, 1e-4), BF16: (1e-2, 3e-2), F64: (1e-12, 1e-12)}


@pytest.mark.parametrize("dtype", [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16"),
                                   pytest.param(F64, id="f64")])
@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss"])
def test_normalize_huge_rows(op, dtype):
    """Rows of norm >= ~1.8e19 (float32 / bfloat16) used to be treated as zero rows (nt_xent
    1.946 instead of 1.933, CLIP 1.79 instead of 4.12).  The norm is now m ||x / m||, as
    F.normalize gets it: loss and gradients match the float64 oracle on the same inputs."""
    rng = _rng("huge", op, str(dtype))
    n, d = 8, 16
    x = [(rng.standard_normal((n, d)) * HUGE[dtype]).astype(dtype) for _ in range(2)]
    x[0][1] = (rng.standard_normal(d)).astype(dtype)  # one ordinary row among huge ones
    g = 0.7
    tl, tg = HUGE_TOL[dtype]
    if op == "nt_xent":
        loss, ctx = cupynce.nt_xent_forward(x[0], 0.5, normalize=True)
        grads = (cupynce.nt_xent_backward(ctx, g),)
        ref_loss, ref_grads = ref.nt_xent(x[0], 0.5, normalize=True, grad_loss=g)
    elif op == "info_nce":
        loss, ctx = cupynce.info_nce_forward(x[0], x[1], 0.2, normalize=True)
        grads = cupynce.info_nce_backward(ctx, g)[:2]
        ref_loss, ref_grads = ref.info_nce(x[0], x[1], 0.2, normalize=True, grad_loss=g)
        ref_grads = ref_grads[:2]
    else:
        loss, ctx = cupynce.clip_loss_forward(x[0], x[1], 2.0, normalize=True)
        grads = cupynce.clip_loss_backward(ctx, g)
        ref_loss, ref_grads = ref.clip_loss(x[0], x[1], 2.0, normalize=True, grad_loss=g)
    check_close("loss", loss, ref_loss, tl, case=f"{op} {dtype} huge rows")
    assert all(np.isfinite(gr).all() for gr in grads)
    for name, gr, rg in zip(("g0", "g1", "dlogit_scale"), grads, ref_grads):
        # the rows' gradients scale as 1 / ||x||: compare each row relative to its own norm
        gr64, rg64 = _f64(gr), _f64(rg)
        if gr64.ndim == 2:
            scale = np.maximum(np.linalg.norm(rg64, axis=1, keepdims=True), 1e-300)
            check_close(name, gr64 / scale, rg64 / scale, tg, case=f"{op} {dtype} huge rows")
        else:
            check_close(name, gr64, rg64, tg, case=f"{op} {dtype} huge rows")


def test_reference_norm_does_not_overflow():
    x = np.array([[3e200, 4e200], [3.0, 4.0]])
    np.testing.assert_allclose(ref.l2_normalize(x), [[0.6, 0.8], [0.6, 0.8]], rtol=1e-15)


# ---- *_backward_from_stats equals *_backward(ctx) ------------------------------------------
RED = ["mean", "sum", "none"]


def _grad(rng, red, n):
    return rng.standard_normal(n) if red == "none" else 0.7


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("red", RED)
def test_nt_xent_from_stats(red, normalize):
    rng = np.random.default_rng(0)
    z = rng.standard_normal((12, 5))
    g = _grad(rng, red, 12)
    _, ctx = cpn.nt_xent_forward(z, 0.3, reduction=red, normalize=normalize)
    assert len(ctx.stats) == 1 and ctx.stats[0].shape == (12,)
    want = cpn.nt_xent_backward(ctx, g)
    got = cpn.nt_xent_backward_from_stats(z, ctx.stats[0], g, temperature=0.3, reduction=red,
                                          normalize=normalize)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("neg", [None, "shared", "paired"])
@pytest.mark.parametrize("red", RED)
def test_info_nce_from_stats(red, neg):
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 9, 6))
    negs = {None: None, "shared": rng.standard_normal((4, 6)),
            "paired": rng.standard_normal((9, 3, 6))}[neg]
    g = _grad(rng, red, 9)
    _, ctx = cpn.info_nce_forward(q, k, 0.2, negatives=negs, reduction=red, normalize=True)
    want = cpn.info_nce_backward(ctx, g)
    got = cpn.info_nce_backward_from_stats(q, k, negs, ctx.stats[0], g, temperature=0.2,
                                           reduction=red, normalize=True)
    for w, x in zip(want, got):
        if w is None:
            assert x is None
        else:
            np.testing.assert_allclose(x, w, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("red", RED)
def test_clip_from_stats(red):
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((2, 10, 4))
    ls = np.asarray(np.log(1 / 0.07))
    g = _grad(rng, red, 10)
    _, ctx = cpn.clip_loss_forward(a, b, ls, reduction=red, normalize=True)
    assert len(ctx.stats) == 2
    want = cpn.clip_loss_backward(ctx, g)
    got = cpn.clip_loss_backward_from_stats(a, b, ls, *ctx.stats, g, reduction=red,
                                            normalize=True)
    for w, x in zip(want, got):
        assert x.shape == w.shape and x.dtype == w.dtype
        np.testing.assert_allclose(x, w, rtol=1e-12, atol=1e-14)


def test_no_stats_without_grad():
    z = np.ones((4, 3))
    _, ctx = cpn.nt_xent_forward(z, requires_grad=False)
    assert ctx.stats == ()


@pytest.mark.parametrize("bad", [np.zeros(5), np.zeros((6,), np.float32), np.zeros((6, 1)), 3.0])
def test_bad_stats(bad):
    z = np.random.default_rng(3).standard_normal((6, 3))
    with pytest.raises(ValueError, match=r"nt_xent_backward_from_stats: lse must be a \(6,\) float64"):
        cpn.nt_xent_backward_from_stats(z, bad, 1.0, temperature=0.5)
