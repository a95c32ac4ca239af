"""``info_nce(labels=, label_smoothing=)`` (issue 55) against the float64 oracle.

NumPy on the CPU (CI) and CuPy on the GPU (marked ``gpu``): every dtype, reduction and kind of
negatives, normalised or not, the fused gradient (mean / sum) and the recomputing one
("none", ``info_nce_backward_from_stats``). Relative errors ``||x - ref|| / ||ref||``: float64
1e-12, float32 1e-5, float16 5e-3, bfloat16 3e-2 (the low-precision bounds of
tests/ops/test_contrastive.py's fallback). Distinct labels are no labels (bit for bit on the
CPU, where both take one path); bad labels and smoothing raise naming the argument; ranks
that disagree on labels raise on every rank (the global loss with labels:
tests/distributed/test_global_emulated.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from cupynce import reference as ref
from cupynce.ops import info_nce as core

LABELS = np.array([0, 1, 0, 2, 1, 0, 3, 1, 2, 4])
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}
N, D, M = 10, 6, 3


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _inputs(negatives, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((N, D)), rng.standard_normal((N, D))
    neg = {None: None, "shared": rng.standard_normal((M, D)),
           "paired": rng.standard_normal((N, M, D))}[negatives]
    return q, k, neg


def _rel(x, r):
    x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
    return float(np.linalg.norm(x - r) / max(np.linalg.norm(r), 1e-300))


def _check(xp, dtype, negatives, reduction, normalize, eps, labels=LABELS):
    q, k, neg = _inputs(negatives)
    dt = _dtype(dtype)
    cast = [None if x is None else x.astype(dt) for x in (q, k, neg)]
    dev = [None if x is None else xp.asarray(x) for x in cast]
    lab = None if labels is None else xp.asarray(labels)
    g = 0.7 if reduction != "none" else np.random.default_rng(1).standard_normal(N)
    want, wgrads = ref.info_nce(*cast[:2], 0.3, negatives=cast[2], labels=labels,
                                label_smoothing=eps, reduction=reduction,
                                normalize=normalize, grad_loss=g)
    loss, ctx = core.info_nce_forward(dev[0], dev[1], 0.3, negatives=dev[2], labels=lab,
                                      label_smoothing=eps, reduction=reduction,
                                      normalize=normalize)
    gl = g if reduction != "none" else xp.asarray(g.astype(np.float64 if dt == np.float64
                                                            else np.float32))
    grads = core.info_nce_backward(ctx, gl)
    host = (lambda x: x) if xp is np else (lambda x: xp.asnumpy(x))
    tol = TOL[dtype]
    assert _rel(host(loss), want) <= tol, ("loss", _rel(host(loss), want))
    for name, got, r in zip(("dquery", "dkey", "dnegatives"), grads, wgrads):
        if r is None:
            assert got is None
            continue
        assert got.dtype == dt
        assert _rel(host(got).astype(np.float64), r) <= tol, (name, _rel(host(got), r))
    if reduction == "none":  # the O(N) path of the PyTorch ops: the same gradients
        again = core.info_nce_backward_from_stats(
            dev[0], dev[1], dev[2], ctx.stats[0], gl, temperature=0.3, labels=lab,
            label_smoothing=eps, reduction=reduction, normalize=normalize)
        for got, r in zip(again, wgrads):
            if r is not None:
                assert _rel(host(got).astype(np.float64), r) <= tol


CASES = [pytest.param(neg, red, norm, eps, id=f"{neg}-{red}-{'norm' if norm else 'raw'}-e{eps}")
         for neg in (None, "shared", "paired") for red in ("mean", "sum", "none")
         for norm in (False, True) for eps in (0.0, 0.1)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("negatives,reduction,normalize,eps", CASES)
def test_numpy_matches_the_oracle(dtype, negatives, reduction, normalize, eps):
    _check(np, dtype, negatives, reduction, normalize, eps)


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_numpy_smoothing_without_labels(eps):
    _check(np, "float64", "shared", "mean", False, eps, labels=None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("negatives,reduction,normalize,eps", CASES)
def test_cupy_matches_the_oracle(dtype, negatives, reduction, normalize, eps):
    cp = pytest.importorskip("cupy")
    _check(cp, dtype, negatives, reduction, normalize, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cupy_large_rows_cross_row_blocks(dtype):
    """N = 1000 over a small workspace: several row blocks, each with its labels' slice."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(5)
    n, d = 1000, 32
    q, k = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    labels = rng.integers(0, 50, n)
    dt = _dtype(dtype)
    want, (wq, wk, _) = ref.info_nce(q.astype(dt), k.astype(dt), 0.1, labels=labels,
                                     label_smoothing=0.05, normalize=True)
    loss, ctx = core.info_nce_forward(cp.asarray(q.astype(dt)), cp.asarray(k.astype(dt)), 0.1,
                                      labels=cp.asarray(labels), label_smoothing=0.05,
                                      normalize=True, workspace_bytes=64 << 10)
    dq, dk, _ = core.info_nce_backward(ctx)
    tol = TOL[dtype]
    assert _rel(cp.asnumpy(loss), want) <= tol
    assert _rel(cp.asnumpy(dq).astype(np.float64), wq) <= tol
    assert _rel(cp.asnumpy(dk).astype(np.float64), wk) <= tol


def test_distinct_labels_are_no_labels_bit_for_bit():
    q, k, neg = _inputs("shared")
    a = core.info_nce_forward(q, k, 0.3, negatives=neg)
    b = core.info_nce_forward(q, k, 0.3, negatives=neg, labels=np.arange(N) * 3)
    assert a[0] == b[0]
    for x, y in zip(core.info_nce_backward(a[1]), core.info_nce_backward(b[1])):
        np.testing.assert_array_equal(x, y)


def test_same_bits_every_call():
    q, k, neg = _inputs("paired")
    runs = [core.info_nce_forward(q, k, 0.3, negatives=neg, labels=LABELS,
                                  label_smoothing=0.1) for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    for x, y in zip(core.info_nce_backward(runs[0][1]), core.info_nce_backward(runs[1][1])):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("labels,err,match", [
    (LABELS[:-1], ValueError, r"labels must be an integer array of shape \(10,\), got int64 "
                              r"of shape \(9,\)"),
    (LABELS.astype(np.float32), ValueError, r"labels must be an integer array of shape "
                                            r"\(10,\), got float32"),
    (LABELS.tolist(), TypeError, r"labels must be a numpy array like the inputs, got list"),
    (LABELS[:, None], ValueError, r"labels must be an integer array of shape \(10,\), got "
                                  r"int64 of shape \(10, 1\)"),
])
def test_bad_labels_raise(labels, err, match):
    q, k, _ = _inputs(None)
    with pytest.raises(err, match="info_nce: " + match):
        core.info_nce_forward(q, k, 0.3, labels=labels)


@pytest.mark.parametrize("eps,err", [(-0.1, ValueError), (1.0, ValueError), (2, ValueError),
                                     (float("nan"), ValueError), (True, TypeError),
                                     ("0.1", TypeError)])
def test_bad_smoothing_raises(eps, err):
    q, k, _ = _inputs(None)
    with pytest.raises(err, match=r"info_nce: label_smoothing must be (a real )?in \[0, 1\)"):
        core.info_nce_forward(q, k, 0.3, label_smoothing=eps)


def test_group_needs_labels_on_every_rank_or_none():
    """One rank with labels, another without: both raise (their settings differ)."""
    from emulated_ranks import run

    q, k, _ = _inputs(None)

    def rank(comm):
        with pytest.raises(ValueError, match=r"every rank of the group must pass the same "
                                             r"settings"):
            core.info_nce_forward(q[:5], k[:5], 0.3, group=comm,
                                  labels=LABELS[:5] if comm.rank == 0 else None)
        return True

    assert run(2, rank) == [True, True]
