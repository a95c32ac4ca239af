"""``supcon_loss`` (issue 55: Khosla et al.'s L_out) against the float64 oracle
(``cupynce.reference.supcon_loss``, itself checked against torch autograd and finite
differences in test_reference_variants.py), on every path.

SupCon runs NT-Xent's row softmax (any path: row blocks, TF32x3 tiles, 16-bit score tiles,
kept scores) plus O(N·D) class sums (``_variants.supcon_terms``), so the GPU cases take the
sizes at which the chooser takes each path, with label patterns that reach the class sums'
cases: classes of 4 views, classes larger than the kernels' 32-row chunks and crossing them,
anchors without a positive, a single class, odd N.  NumPy on the CPU (CI); CuPy marked
``gpu``.  Relative errors ``||x - ref|| / ||ref||``: float64 1e-12, float32 1e-5, float16
5e-3, bfloat16 3e-2; the 16-bit gradient with classes of a third of the batch: that, or 2x
the plain PyTorch formula's own error in the dtype, whichever is larger.
"""
from __future__ import annotations

import numpy as np
import pytest

from cupynce import reference as ref
from cupynce.ops import _numpy, _variants
from cupynce.ops import supcon as core
# (tests/_support, on sys.path by conftest)
from numerics import TOL, dtype_of as _dtype, rel as _rel


def _labels(kind: str, n: int, rng):
    """Label patterns: "views" 4 views a class (shuffled), "big" 3 classes (larger than a
    32-row chunk, crossing chunk bounds), "lonely" views plus anchors without a positive,
    "one" a single class, "unique" no positive at all; any int values (negative too)."""
    if kind == "views":
        lab = np.repeat(np.arange(-(-n // 4)), 4)[:n]
    elif kind == "big":
        lab = rng.integers(0, 3, n)
    elif kind == "lonely":
        lab = np.repeat(np.arange(-(-n // 2)), 2)[:n]
        lab[: n // 4] = 1000 + np.arange(n // 4)  # (each its own class)
    elif kind == "one":
        lab = np.full(n, 7)
    else:
        lab = np.arange(n)
    return (rng.permutation(lab) * 3 - 5).astype(np.int64)


def _embed(rng, lab, d):
    """Rows near their class's centre: the positives' term is a large part of the loss."""
    centres = rng.standard_normal((int(lab.max() - lab.min()) + 1, d))
    return centres[lab - lab.min()] + 0.5 * rng.standard_normal((lab.size, d))


def _check(xp, dtype, n, d, reduction, normalize, kind, ws=None, t=0.2):
    dt = _dtype(dtype)
    rng = np.random.default_rng(n + d)
    lab = _labels(kind, n, rng)
    z = (_embed(rng, lab, d) / np.sqrt(d)).astype(dt)
    g = 0.7 if reduction != "none" else rng.uniform(0.2, 1.5, n)
    want, (wz,) = ref.supcon_loss(z, lab, t, reduction=reduction, normalize=normalize,
                                  grad_loss=g)
    loss, ctx = core.supcon_forward(xp.asarray(z), xp.asarray(lab), t, reduction=reduction,
                                    normalize=normalize, workspace_bytes=ws)
    acc = np.float64 if dt == np.float64 else np.float32
    gl = g if reduction != "none" else xp.asarray(g.astype(acc))
    dz = core.supcon_backward(ctx, gl)
    host = (lambda x: x) if xp is np else xp.asnumpy
    tol = TOL[dtype]
    assert loss.dtype == acc and dz.dtype == dt and dz.shape == z.shape
    if kind == "unique":  # no anchor has a positive: 0 and a zero gradient
        assert not np.asarray(host(loss)).any() and not host(dz).astype(np.float64).any()
        return
    assert _rel(host(loss), want) <= tol, "loss"
    tol_dz = tol
    if dtype in ("float16", "bfloat16") and kind == "big":
        # classes of a third of the batch: the gradient is a small difference of the
        # softmax and the positives' mean, so the 16-bit gradient block's rounding is large
        # against it; bounded by 2x the plain PyTorch formula's own error in that dtype
        tol_dz = max(tol, 2 * _formula_error(z, lab, t, dtype, reduction, g, normalize, wz))
    assert _rel(host(dz).astype(np.float64), wz) <= tol_dz, "dz"
    if reduction == "none":
        again = core.supcon_backward_from_stats(
            xp.asarray(z), ctx.stats[0], gl, labels=xp.asarray(lab), temperature=t,
            reduction=reduction, normalize=normalize, workspace_bytes=ws)
        assert _rel(host(again).astype(np.float64), wz) <= tol_dz, "dz from stats"


def _formula_error(z, lab, t, dtype, reduction, g, normalize, wz) -> float:
    """The gradient's relative error of SupCon's plain PyTorch formula
    (``torch_oracle.supcon_loss``) run on CUDA in ``dtype`` on the same values."""
    torch = pytest.importorskip("torch")
    import torch_oracle

    x = torch.tensor(np.asarray(z, np.float32), device="cuda").to(getattr(torch, dtype))
    x.requires_grad_(True)
    loss = torch_oracle.supcon_loss(x, torch.tensor(lab, device="cuda"), t,
                                    reduction=reduction, normalize=normalize)
    up = torch.tensor(np.asarray(g, np.float32), device="cuda").to(loss.dtype)
    (dz,) = torch.autograd.grad(loss, [x], up)
    return _rel(dz.double().cpu().numpy(), wz)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("kind,n", [("views", 16), ("views", 18), ("big", 77), ("lonely", 21),
                                    ("one", 9), ("unique", 6), ("views", 3)])
def test_numpy_matches_the_oracle(dtype, reduction, normalize, kind, n):
    _check(np, dtype, n, 6, reduction, normalize, kind)


def test_numpy_row_blocks_match_the_oracle():
    """A workspace of a few rows: the NumPy path's row blocks."""
    _check(np, "float64", 70, 8, "none", True, "big", ws=8 * 70 * 5)


def test_class_sums_are_the_labels_sums():
    """``_numpy.class_sums``: each row's class sum, weighted or not."""
    rng = np.random.default_rng(3)
    lab = rng.integers(-3, 4, 50)
    x = rng.standard_normal((50, 7))
    w = rng.uniform(0.5, 2.0, 50)
    groups = _variants.label_groups(np, lab)
    same = lab[:, None] == lab[None, :]
    np.testing.assert_allclose(_numpy.class_sums(x, groups), same @ x, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(_numpy.class_sums(x, groups, w), same @ (w[:, None] * x),
                               rtol=1e-13, atol=1e-13)
    assert (_variants.has_positive(groups) == (same.sum(1) > 1)).all()


def test_supcon_of_two_views_per_image_is_nt_xent_with_its_pairs():
    """One positive per anchor: SupCon is NT-Xent (the same lse, the one positive)."""
    from cupynce.ops import nt_xent as nx

    z = np.random.default_rng(5).standard_normal((12, 5))
    lab = np.concatenate([np.arange(6), np.arange(6)])
    a, ca = core.supcon_forward(z, lab, 0.3, reduction="none")
    b, cb = nx.nt_xent_forward(z, 0.3, reduction="none")
    np.testing.assert_allclose(a, b, rtol=1e-13)
    np.testing.assert_allclose(core.supcon_backward(ca, np.linspace(1, 2, 12)),
                               nx.nt_xent_backward(cb, np.linspace(1, 2, 12)), rtol=1e-12,
                               atol=1e-14)


@pytest.mark.parametrize("labels,err,match", [
    (None, TypeError, r"labels are required"),
    (np.zeros(5, np.int64), ValueError, r"labels must be an integer array of shape \(6,\), got int64 of shape \(5,\)"),
    (np.zeros(6), ValueError, r"labels must be an integer array of shape \(6,\), got float64"),
    ([0, 1, 2, 0, 1, 2], TypeError, r"labels must be a numpy array like the inputs, got list"),
])
def test_bad_labels_raise(labels, err, match):
    with pytest.raises(err, match="supcon_loss: " + match):
        core.supcon_forward(np.ones((6, 3)), labels, 0.5)


def test_bad_input_raises():
    lab = np.zeros(6, np.int64)
    with pytest.raises(ValueError, match=r"supcon_loss: temperature must be"):
        core.supcon_loss(np.ones((6, 3)), lab, -1.0)
    with pytest.raises(ValueError, match=r"supcon_loss: z needs at least 2 rows, got shape \(1, 3\)"):
        core.supcon_loss(np.ones((1, 3)), lab[:1], 0.1)
    with pytest.raises(TypeError, match=r"group must be a cupy.cuda.nccl.NcclCommunicator"):
        core.supcon_loss(np.ones((6, 3)), lab, 0.1, group=object())


# ---- the GPU: every path of the row softmax, the class-sum kernels -------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,n,d", [("float64", 64, 32), ("float32", 512, 64),
                                       ("bfloat16", 512, 64), ("float16", 512, 64),
                                       ("bfloat16", 511, 64), ("bfloat16", 256, 4096)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("kind", ["views", "big", "lonely"])
def test_cupy_matches_the_oracle_on_every_path(dtype, n, d, reduction, kind):
    cp = pytest.importorskip("cupy")
    _check(cp, dtype, n, d, reduction, True, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["one", "unique", "views"])
def test_cupy_small_workspace_and_odd_classes(kind):
    cp = pytest.importorskip("cupy")
    _check(cp, "float32", 300, 40, "sum", False, kind, ws=64 * 300 * 4)


@pytest.mark.gpu
@pytest.mark.parametrize("n,d,classes", [(1, 5, 1), (31, 3, 2), (33, 257, 5), (1000, 300, 3),
                                         (4099, 64, 1000), (2048, 40, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_class_sum_kernels_match_numpy(n, d, classes, dtype):
    """``arrays.class_sums`` (seg_partial / seg_heads) against float64 sums, strided input,
    with and without weights; the same bits on a second run."""
    cp = pytest.importorskip("cupy")
    from cupynce._engine import arrays

    dt = _dtype(dtype)
    rng = np.random.default_rng(n + d)
    lab = rng.integers(0, classes, n)
    host = rng.standard_normal((n, d + 3)).astype(dt)
    x = cp.asarray(host)[:, :d]
    w = rng.uniform(0.5, 2.0, n)
    acc = np.float64 if dt == np.float64 else np.float32
    groups = _variants.label_groups(cp, cp.asarray(lab))
    same = (lab[:, None] == lab[None, :]).astype(np.float64)
    x64 = host[:, :d].astype(np.float64)
    tol = 1e-12 if dt == np.float64 else 1e-5
    for ww in (None, w):
        got = arrays.class_sums(x, groups, None if ww is None else cp.asarray(ww.astype(acc)))
        assert got.dtype == acc and got.shape == (n, d)
        want = same @ (x64 if ww is None else ww[:, None] * x64)
        scale = np.abs(same) @ np.abs(x64 if ww is None else ww[:, None] * x64)
        assert (np.abs(cp.asnumpy(got) - want) <= tol * (scale + 1e-30)).all()
        again = arrays.class_sums(x, groups, None if ww is None else cp.asarray(ww.astype(acc)))
        assert (cp.asnumpy(again) == cp.asnumpy(got)).all()


@pytest.mark.gpu
def test_cupy_is_deterministic():
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(8)
    lab = cp.asarray(rng.integers(0, 40, 1024))
    z = cp.asarray(rng.standard_normal((1024, 128)).astype(np.float32))
    runs = []
    for _ in range(2):
        loss, ctx = core.supcon_forward(z, lab, 0.1, normalize=True)
        runs.append((cp.asnumpy(loss), cp.asnumpy(core.supcon_backward(ctx))))
    assert runs[0][0] == runs[1][0] and (runs[0][1] == runs[1][1]).all()
