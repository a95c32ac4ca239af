"""The oracle's label-aware variants (issue 55): ``supcon_loss``, ``labels=`` (InfoNCE, CLIP,
SigLIP), ``label_smoothing=`` (NT-Xent, InfoNCE, CLIP) and the temperature's gradient
(``temperature_grad=``: NT-Xent, SupCon, InfoNCE).

Each is checked three ways on the CPU, in float64: its closed-form gradients against central
finite differences; its loss and gradients against an independent PyTorch formula through
autograd (``F.cross_entropy(label_smoothing=)`` where torch has the loss, a row-by-row
formula where it does not, Khosla et al.'s masked log-probabilities for SupCon); and its
special cases (distinct labels are no labels; SupCon with one positive per anchor is
NT-Xent). Bad labels and smoothing raise naming the argument.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from cupynce import reference as ref

REDUCTIONS = ("mean", "sum", "none")
FD_TOL = dict(rtol=1e-6, atol=1e-8)
TORCH_TOL = dict(rtol=1e-10, atol=1e-12)
#: labels with repeats, a singleton (no positive in SupCon) and, for n = 8, four classes
LABELS = np.array([0, 1, 0, 2, 1, 0, 3, 1])


def _grad_loss(reduction, n, rng):
    return rng.standard_normal(n) if reduction == "none" else 0.7


def _fd(f, x, h=1e-6):
    """Central differences of the scalar f at x (any shape)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        out[idx] = (f(xp) - f(xm)) / (2 * h)
    return out


def _objective(loss, gl):
    return float(np.sum(np.asarray(gl) * loss))


# ---- the cases: name -> (fn(inputs, **kw) -> (loss, grads), inputs, names of the grads) ----
def _cases(rng, n=8, d=5):
    z = rng.standard_normal((n, d))
    q, k = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    shared, paired = rng.standard_normal((3, d)), rng.standard_normal((n, 2, d))
    a, b = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    return {
        "nt_xent-smooth": (
            lambda x, **kw: ref.nt_xent(x["z"], x["t"], label_smoothing=0.2,
                                        temperature_grad=True, **kw),
            {"z": z, "t": np.asarray(0.4)}, ["z", "t"]),
        "supcon": (
            lambda x, **kw: ref.supcon_loss(x["z"], LABELS[:n], x["t"], temperature_grad=True,
                                            **kw),
            {"z": z, "t": np.asarray(0.3)}, ["z", "t"]),
        "info_nce-labels-smooth": (
            lambda x, **kw: ref.info_nce(x["q"], x["k"], x["t"], labels=LABELS[:n],
                                         label_smoothing=0.1, temperature_grad=True, **kw),
            {"q": q, "k": k, "t": np.asarray(0.3)}, ["q", "k", None, "t"]),
        "info_nce-shared-labels": (
            lambda x, **kw: ref.info_nce(x["q"], x["k"], x["t"], negatives=x["neg"],
                                         labels=LABELS[:n], label_smoothing=0.05,
                                         temperature_grad=True, **kw),
            {"q": q, "k": k, "neg": shared, "t": np.asarray(0.5)}, ["q", "k", "neg", "t"]),
        "info_nce-paired-labels": (
            lambda x, **kw: ref.info_nce(x["q"], x["k"], x["t"], negatives=x["neg"],
                                         labels=LABELS[:n], temperature_grad=True, **kw),
            {"q": q, "k": k, "neg": paired, "t": np.asarray(0.5)}, ["q", "k", "neg", "t"]),
        "clip-labels-smooth": (
            lambda x, **kw: ref.clip_loss(x["a"], x["b"], x["s"], labels=LABELS[:n],
                                          label_smoothing=0.1, **kw),
            {"a": a, "b": b, "s": np.asarray(math.log(1 / 0.4))}, ["a", "b", "s"]),
        "siglip-labels": (
            lambda x, **kw: ref.siglip_loss(x["a"], x["b"], x["s"], x["beta"],
                                            labels=LABELS[:n], **kw),
            {"a": a, "b": b, "s": np.asarray(math.log(1 / 0.4)), "beta": np.asarray(-1.0)},
            ["a", "b", "s", "beta"]),
    }


CASES = list(_cases(np.random.default_rng(0)))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
def test_gradients_match_finite_differences(case, reduction, normalize):
    rng = np.random.default_rng(1)
    fn, inputs, names = _cases(rng)[case]
    gl = _grad_loss(reduction, 8, rng)
    kw = dict(reduction=reduction, normalize=normalize)
    _, grads = fn(inputs, grad_loss=gl, **kw)
    assert len(grads) == len(names)
    for name, g in zip(names, grads):
        if name is None:
            assert g is None
            continue
        num = _fd(lambda v: _objective(fn({**inputs, name: v}, **kw)[0], gl), inputs[name])
        np.testing.assert_allclose(g, num, **FD_TOL, err_msg=f"{case} d{name}")


# ---- against independent PyTorch formulas ---------------------------------------------------
torch = pytest.importorskip("torch")
F = torch.nn.functional


def _t(x, grad=True):
    return torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=grad)


def _norm(x, normalize):
    return F.normalize(x, dim=-1) if normalize else x


def _reduce(per_row, reduction):
    return {"mean": per_row.mean(), "sum": per_row.sum(), "none": per_row}[reduction]


def _torch_grads(loss, gl, leaves):
    torch.autograd.backward(loss, torch.as_tensor(np.asarray(gl, dtype=np.float64))
                            .expand_as(loss))
    return [x.grad.numpy() for x in leaves]


def _rows_ce(logits, keep, pos, eps):
    """Row-by-row ``F.cross_entropy`` over each row's kept columns (torch has no masked
    smoothing: a -inf column would enter its smoothing term)."""
    out = []
    for i in range(logits.shape[0]):
        cols = np.flatnonzero(keep[i])
        target = int(np.flatnonzero(cols == pos[i])[0])
        out.append(F.cross_entropy(logits[i, cols][None], torch.tensor([target]),
                                   label_smoothing=eps))
    return torch.stack(out)


def _keep(labels, n, extra=0):
    same = labels[:, None] == labels[None, :]
    keep = ~same | np.eye(n, dtype=bool)
    return np.concatenate([keep, np.ones((n, extra), dtype=bool)], axis=1)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_nt_xent_smoothing_and_temperature_match_torch(reduction, normalize, eps):
    rng = np.random.default_rng(2)
    n, d = 8, 5
    z0, gl = rng.standard_normal((n, d)), _grad_loss(reduction, n, rng)
    loss, (dz, dt) = ref.nt_xent(z0, np.asarray(0.4), reduction=reduction,
                                 normalize=normalize, label_smoothing=eps, grad_loss=gl,
                                 temperature_grad=True)
    z, t = _t(z0), _t(0.4)
    zn = _norm(z, normalize)
    s = zn @ zn.T / t
    off = ~torch.eye(n, dtype=torch.bool)
    logits = s[off].reshape(n, n - 1)  # (row i without column i)
    pos = (torch.arange(n) + n // 2) % n
    target = pos - (pos > torch.arange(n)).long()
    got = _reduce(F.cross_entropy(logits, target, reduction="none", label_smoothing=eps),
                  reduction)
    np.testing.assert_allclose(loss, got.detach().numpy(), **TORCH_TOL)
    gz, gt = _torch_grads(got, gl, [z, t])
    np.testing.assert_allclose(dz, gz, **TORCH_TOL)
    np.testing.assert_allclose(dt, gt, **TORCH_TOL)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
def test_supcon_matches_khosla_formula(reduction, normalize):
    """Khosla et al.'s formulation: log-probabilities over a != i, their mean over the
    positives; anchors without a positive dropped from the mean (0 for "none")."""
    rng = np.random.default_rng(3)
    n, d = 8, 5
    z0, gl = rng.standard_normal((n, d)), _grad_loss(reduction, n, rng)
    loss, (dz, dt) = ref.supcon_loss(z0, LABELS, np.asarray(0.3), reduction=reduction,
                                     normalize=normalize, grad_loss=gl, temperature_grad=True)
    z, t = _t(z0), _t(0.3)
    zn = _norm(z, normalize)
    s = zn @ zn.T / t
    self_mask = torch.eye(n, dtype=torch.bool)
    log_prob = s - torch.logsumexp(s.masked_fill(self_mask, float("-inf")), 1, keepdim=True)
    lab = torch.as_tensor(LABELS)
    pos = (lab[:, None] == lab[None, :]) & ~self_mask
    has = pos.any(1)
    mean_pos = (log_prob * pos).sum(1) / pos.sum(1).clamp(min=1)
    per_row = torch.where(has, -mean_pos, torch.zeros(()))
    got = per_row.sum() / has.sum() if reduction == "mean" else _reduce(per_row, reduction)
    np.testing.assert_allclose(loss, got.detach().numpy(), **TORCH_TOL)
    gz, gt = _torch_grads(got, gl, [z, t])
    np.testing.assert_allclose(dz, gz, **TORCH_TOL)
    np.testing.assert_allclose(dt, gt, **TORCH_TOL)


@pytest.mark.parametrize("negatives", [None, "shared", "paired"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_info_nce_labels_smoothing_and_temperature_match_torch(negatives, reduction,
                                                               normalize, eps):
    rng = np.random.default_rng(4)
    n, d, m = 8, 5, 3
    q0, k0 = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    neg0 = {None: None, "shared": rng.standard_normal((m, d)),
            "paired": rng.standard_normal((n, m, d))}[negatives]
    gl = _grad_loss(reduction, n, rng)
    loss, (dq, dk, dneg, dt) = ref.info_nce(
        q0, k0, np.asarray(0.3), negatives=neg0, labels=LABELS, label_smoothing=eps,
        reduction=reduction, normalize=normalize, grad_loss=gl, temperature_grad=True)
    q, k, t = _t(q0), _t(k0), _t(0.3)
    qn, kn = _norm(q, normalize), _norm(k, normalize)
    logits = qn @ kn.T / t
    leaves = [q, k]
    if neg0 is not None:
        neg = _t(neg0)
        nn_ = _norm(neg, normalize)
        ln = (qn @ nn_.T if neg0.ndim == 2 else torch.einsum("nd,nmd->nm", qn, nn_)) / t
        logits = torch.cat([logits, ln], 1)
        leaves.append(neg)
    keep = _keep(LABELS, n, 0 if neg0 is None else m)
    got = _reduce(_rows_ce(logits, keep, np.arange(n), eps), reduction)
    np.testing.assert_allclose(loss, got.detach().numpy(), **TORCH_TOL)
    want = _torch_grads(got, gl, leaves + [t])
    for name, mine, theirs in zip(["q", "k", "neg", "t"][:len(want) - 1] + ["t"],
                                  [dq, dk] + ([dneg] if neg0 is not None else []) + [dt], want):
        np.testing.assert_allclose(mine, theirs, **TORCH_TOL, err_msg=name)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_clip_labels_and_smoothing_match_torch(reduction, normalize, eps):
    rng = np.random.default_rng(5)
    n, d = 8, 5
    a0, b0, gl = rng.standard_normal((n, d)), rng.standard_normal((n, d)), \
        _grad_loss(reduction, n, rng)
    loss, (da, db, ds) = ref.clip_loss(a0, b0, np.asarray(1.1), labels=LABELS,
                                       label_smoothing=eps, reduction=reduction,
                                       normalize=normalize, grad_loss=gl)
    a, b, ls = _t(a0), _t(b0), _t(1.1)
    logits = ls.exp() * _norm(a, normalize) @ _norm(b, normalize).T
    keep = _keep(LABELS, n)
    rows = _rows_ce(logits, keep, np.arange(n), eps)
    cols = _rows_ce(logits.T, keep.T, np.arange(n), eps)
    got = _reduce((rows + cols) / 2, reduction)
    np.testing.assert_allclose(loss, got.detach().numpy(), **TORCH_TOL)
    for mine, theirs in zip([da, db, ds], _torch_grads(got, gl, [a, b, ls])):
        np.testing.assert_allclose(mine, theirs, **TORCH_TOL)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_siglip_labels_match_torch(reduction):
    rng = np.random.default_rng(6)
    n, d = 8, 5
    a0, b0, gl = rng.standard_normal((n, d)), rng.standard_normal((n, d)), \
        _grad_loss(reduction, n, rng)
    loss, grads = ref.siglip_loss(a0, b0, np.asarray(0.7), np.asarray(-1.5), labels=LABELS,
                                  reduction=reduction, grad_loss=gl)
    a, b, ls, lb = _t(a0), _t(b0), _t(0.7), _t(-1.5)
    logits = ls.exp() * a @ b.T + lb
    lab = torch.as_tensor(LABELS)
    z = 2.0 * (lab[:, None] == lab[None, :]).double() - 1.0
    per_row = -F.logsigmoid(z * logits).sum(1)
    got = per_row.sum() / n if reduction == "mean" else _reduce(per_row, reduction)
    np.testing.assert_allclose(loss, got.detach().numpy(), **TORCH_TOL)
    for mine, theirs in zip(grads, _torch_grads(got, gl, [a, b, ls, lb])):
        np.testing.assert_allclose(mine, theirs, **TORCH_TOL)


# ---- special cases ---------------------------------------------------------------------------
def test_distinct_labels_are_no_labels():
    rng = np.random.default_rng(7)
    n, d = 6, 4
    q, k, neg = (rng.standard_normal(s) for s in ((n, d), (n, d), (3, d)))
    distinct = np.arange(n) * 7
    for without, with_ in [
        (ref.info_nce(q, k, 0.3, negatives=neg), ref.info_nce(q, k, 0.3, negatives=neg,
                                                              labels=distinct)),
        (ref.clip_loss(q, k, 1.2), ref.clip_loss(q, k, 1.2, labels=distinct)),
        (ref.siglip_loss(q, k, 1.2, -1.0), ref.siglip_loss(q, k, 1.2, -1.0, labels=distinct)),
    ]:
        assert without[0] == with_[0]
        for x, y in zip(without[1], with_[1]):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("normalize", [False, True])
def test_supcon_with_one_positive_per_anchor_is_nt_xent(normalize):
    z = np.random.default_rng(8).standard_normal((10, 4))
    labels = np.tile(np.arange(5), 2)  # (row i and row i + 5: NT-Xent's pairs)
    a = ref.supcon_loss(z, labels, 0.2, normalize=normalize, temperature_grad=True)
    b = ref.nt_xent(z, 0.2, normalize=normalize, temperature_grad=True)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-13)
    for x, y in zip(a[1], b[1]):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-15)


def test_supcon_without_any_positive_is_zero():
    z = np.random.default_rng(9).standard_normal((4, 3))
    for reduction in REDUCTIONS:
        loss, (dz,) = ref.supcon_loss(z, np.arange(4), reduction=reduction)
        assert np.all(loss == 0) and np.all(dz == 0)


@pytest.mark.parametrize("eps", [-0.1, 1.0, 1.5, float("nan")])
def test_bad_smoothing_raises(eps):
    z = np.ones((4, 3))
    for call in (lambda: ref.nt_xent(z, 0.5, label_smoothing=eps),
                 lambda: ref.info_nce(z, z, 0.5, label_smoothing=eps),
                 lambda: ref.clip_loss(z, z, 1.0, label_smoothing=eps)):
        with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
            call()


@pytest.mark.parametrize("labels", [np.arange(3), np.zeros((4, 1), int), np.zeros(4),
                                    np.array(["a", "b", "c", "d"])],
                         ids=["short", "2-d", "float", "str"])
def test_bad_labels_raise(labels):
    z = np.ones((4, 3))
    for call in (lambda: ref.supcon_loss(z, labels),
                 lambda: ref.info_nce(z, z, 0.5, labels=labels),
                 lambda: ref.clip_loss(z, z, 1.0, labels=labels),
                 lambda: ref.siglip_loss(z, z, 1.0, 0.0, labels=labels)):
        with pytest.raises(ValueError, match=r"labels must be an integer array of shape \(4,\)"):
            call()
