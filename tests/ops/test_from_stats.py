"""``*_backward_from_stats`` (inputs + O(N) row statistics) equals ``*_backward(ctx)``.

NumPy path here (CI); the GPU file runs the same comparisons on CuPy.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupynce as cpn

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
