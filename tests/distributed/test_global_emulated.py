"""The per-rank code of the global losses (``cupynce.ops._global``) on P emulated ranks in one
process (``emulated_ranks``: threads and a test communicator with the same collectives).

Each rank holds its slice of one seeded global batch; its loss must be the single-process op's
on the concatenated batch (its own rows for "none"), its gradients P times the single-process
gradients of its rows (the data-parallel convention), CLIP's d loss / d logit_scale the global
one on every rank.  NumPy here (CI); the CuPy paths (tiles, cuBLAS; bf16 / fp16 / fp32) below,
on a GPU.  Tolerances: float64 1e-12; float32 1e-5 (loss) / 1e-4 (gradients); 16-bit inputs
against the single-process op on the same 16-bit inputs, 1e-5 / 2e-2 (the gradient is
rounded to the input dtype, and the rank blocks' sums run in another order).
"""
from __future__ import annotations

import numpy as np
import pytest

import cupynce
from emulated_ranks import run

TOL = {"float64": (1e-12, 1e-12), "float32": (1e-5, 1e-4), "bfloat16": (1e-5, 2e-2),
       "float16": (1e-5, 2e-2)}


def _err(got, want) -> float:
    got, want = (np.asarray(_host(x), np.float64) for x in (got, want))
    return float(np.linalg.norm(got - want) / (np.linalg.norm(want) or 1.0))


def _host(x):
    return x.get() if hasattr(x, "get") else x


def _batch(xp, dtype, shape, seed, scale=0.5):
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    if dtype in ("bfloat16",):
        import ml_dtypes

        x = x.astype(ml_dtypes.bfloat16)
    else:
        x = x.astype(dtype)
    return xp.asarray(x)


def _upstream(xp, reduction, count, seed, acc):
    if reduction == "none":
        return xp.asarray(np.random.default_rng(seed).uniform(0.2, 1.5, count).astype(acc))
    return 0.7


def _check_nt_xent(xp, dtype, P, n, d, reduction, normalize, device=None, ws=None, eps=0.0):
    N = n * P
    Z = _batch(xp, dtype, (2 * N, d), 1)
    acc = np.float64 if dtype == "float64" else np.float32
    up = _upstream(xp, reduction, 2 * N, 2, acc)
    rows = [np.r_[r * n:(r + 1) * n, N + r * n:N + (r + 1) * n] for r in range(P)]

    def rank(comm):
        idx = xp.asarray(rows[comm.rank])
        loss, ctx = cupynce.nt_xent_forward(Z[idx], 0.3, label_smoothing=eps,
                                            reduction=reduction, normalize=normalize,
                                            workspace_bytes=ws, group=comm)
        g = up[idx] if reduction == "none" else up
        return loss, cupynce.nt_xent_backward(ctx, g)

    out = run(P, rank, device=device)
    want, ctx = cupynce.nt_xent_forward(Z, 0.3, label_smoothing=eps, reduction=reduction,
                                        normalize=normalize)
    dz = cupynce.nt_xent_backward(ctx, up)
    tl, tg = TOL[dtype]
    for r, (loss, g) in enumerate(out):
        idx = rows[r]
        assert _err(loss, want[xp.asarray(idx)] if reduction == "none" else want) <= tl
        assert _err(_host(g).astype(np.float64) / P, _host(dz)[idx]) <= tg
    if reduction != "none":  # the global loss: the same bits on every rank
        assert len({float(_host(x[0])) for x in out}) == 1


def _check_info_nce(xp, dtype, P, n, d, reduction, normalize, negatives, device=None, ws=None,
                    labeled=False, eps=0.0, hard=None):
    # hard: (hardness_mode, strength); its shared negatives two columns of n a rank (the
    # library's layout), which the single process takes column by column: [every rank's
    # first; every rank's second]
    N, M = n * P, (2 * n if hard else 3)
    kw = {} if hard is None else dict(hardness_mode=hard[0], hardness_strength=hard[1])
    # labels: few classes, so that a query's same-label keys sit on other ranks too
    L = xp.asarray(np.random.default_rng(8).integers(0, 3, N)) if labeled else None
    Q, K = _batch(xp, dtype, (N, d), 3), _batch(xp, dtype, (N, d), 4)
    NS = _batch(xp, dtype, (P * M, d), 5) if negatives == "shared" else None
    NP = _batch(xp, dtype, (N, M, d), 6) if negatives == "per_query" else None
    acc = np.float64 if dtype == "float64" else np.float32
    up = _upstream(xp, reduction, N, 7, acc)

    def rank(comm):
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        neg = NS[comm.rank * M:(comm.rank + 1) * M] if NS is not None else \
            (NP[sl] if NP is not None else None)
        loss, ctx = cupynce.info_nce_forward(Q[sl], K[sl], 0.2, negatives=neg,
                                             labels=None if L is None else L[sl],
                                             label_smoothing=eps, reduction=reduction,
                                             normalize=normalize, workspace_bytes=ws,
                                             group=comm, **kw)
        return loss, cupynce.info_nce_backward(ctx, up[sl] if reduction == "none" else up)

    out = run(P, rank, device=device)
    neg = NS if NS is not None else NP
    order = np.arange(P * M)  # (the single process's row of each rank-order negative)
    if hard and NS is not None:
        order = np.concatenate([np.arange(r * M + c * n, r * M + (c + 1) * n)
                                for c in range(M // n) for r in range(P)])
        neg = NS[xp.asarray(order)]
    want, ctx = cupynce.info_nce_forward(Q, K, 0.2, negatives=neg, labels=L,
                                         label_smoothing=eps, reduction=reduction,
                                         normalize=normalize, **kw)
    gq, gk, gn = cupynce.info_nce_backward(ctx, up)
    if hard and NS is not None:
        back = np.empty_like(_host(gn))
        back[order] = _host(gn)
        gn = back
    tl, tg = TOL[dtype]
    for r, (loss, (a, b, c)) in enumerate(out):
        sl = slice(r * n, (r + 1) * n)
        assert _err(loss, want[sl] if reduction == "none" else want) <= tl
        assert _err(_host(a).astype(np.float64) / P, _host(gq)[sl]) <= tg
        assert _err(_host(b).astype(np.float64) / P, _host(gk)[sl]) <= tg
        if neg is None:
            assert c is None
        else:
            own = slice(r * M, (r + 1) * M) if NS is not None else sl
            assert _err(_host(c).astype(np.float64) / P, _host(gn)[own]) <= tg


def _check_supcon(xp, dtype, P, n, d, reduction, normalize, device=None, ws=None,
                  classes=4):
    """SupCon across ranks: each rank's n rows and labels; few classes, so that a row's
    positives sit on other ranks too (and with ``classes`` > the rows, some have none)."""
    N = n * P
    rng = np.random.default_rng(12)
    L = xp.asarray(rng.integers(0, classes, N))
    Z = _batch(xp, dtype, (N, d), 13, 1.0)
    acc = np.float64 if dtype == "float64" else np.float32
    up = _upstream(xp, reduction, N, 14, acc)

    def rank(comm):
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        loss, ctx = cupynce.supcon_forward(Z[sl], L[sl], 0.3, reduction=reduction,
                                           normalize=normalize, workspace_bytes=ws, group=comm)
        return loss, cupynce.supcon_backward(ctx, up[sl] if reduction == "none" else up)

    out = run(P, rank, device=device)
    want, ctx = cupynce.supcon_forward(Z, L, 0.3, reduction=reduction, normalize=normalize)
    dz = cupynce.supcon_backward(ctx, up)
    tl, tg = TOL[dtype]
    for r, (loss, g) in enumerate(out):
        sl = slice(r * n, (r + 1) * n)
        assert _err(loss, want[sl] if reduction == "none" else want) <= tl
        assert _err(_host(g).astype(np.float64) / P, _host(dz)[sl]) <= tg
    if reduction != "none":  # the global loss: the same bits on every rank
        assert len({float(_host(x[0])) for x in out}) == 1


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_ring_shift_emulated(P):
    """The test communicator's ring_shift (what the ring schedules run on in these tests): k
    shifts bring rank (rank - k) mod P's array, P shifts every array home."""
    def body(comm):
        cur = np.full((3, 2), comm.rank, np.int64)
        seen = []
        for _ in range(P):
            cur = comm.ring_shift(cur).wait()
            seen.append(int(cur[0, 0]))
        return seen
    for rank, seen in enumerate(run(P, body)):
        assert seen == [(rank - k) % P for k in range(1, P + 1)]


def _ring_op(op, a, b, reduction, requires_grad, comm, **kw):
    """(loss, gradients or ()) of SigLIP (scale 1.1, bias −2), CLIP (scale 1.1), InfoNCE or
    NT-Xent (τ = 0.3) over comm; ``kw`` the op's other arguments (a variant)."""
    kw.update(reduction=reduction, requires_grad=requires_grad, group=comm)
    if op == "siglip":
        loss, ctx = cupynce.siglip_loss_forward(a, b, 1.1, -2.0, **kw)
        return loss, cupynce.siglip_loss_backward(ctx, 0.7) if requires_grad else ()
    if op == "nt_xent":  # (a, b: the rank's two views; the labels kw: a callable of rank)
        loss, ctx = cupynce.nt_xent_forward(np.concatenate([a, b]), 0.3, **kw)
        return loss, (cupynce.nt_xent_backward(ctx, 0.7),) if requires_grad else ()
    if op == "supcon":  # (a, b: the rank's two views; labels for both)
        loss, ctx = cupynce.supcon_forward(np.concatenate([a, b]), kw.pop("labels"), 0.3, **kw)
        return loss, (cupynce.supcon_backward(ctx, 0.7),) if requires_grad else ()
    if op == "nt_xent_pairs":  # (pytorch-metric-learning's rows; labels for both views)
        loss, ctx = cupynce.nt_xent_pairs_forward(np.concatenate([a, b]), kw.pop("labels"),
                                                  0.3, **kw)
        return loss, (cupynce.nt_xent_pairs_backward(ctx, 0.7),) if requires_grad else ()
    if op == "info_nce":
        loss, ctx = cupynce.info_nce_forward(a, b, 0.3, **kw)
        return loss, cupynce.info_nce_backward(ctx, 0.7) if requires_grad else ()
    loss, ctx = cupynce.clip_loss_forward(a, b, 1.1, **kw)
    return loss, cupynce.clip_loss_backward(ctx, 0.7) if requires_grad else ()


@pytest.mark.parametrize("op", ["siglip", "clip", "info_nce", "nt_xent"])
@pytest.mark.parametrize("P", [2, 3, 4, 5])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("requires_grad", [True, False])
def test_ring_schedule_numpy(op, P, reduction, requires_grad):
    """The ring schedules (issue 57: each chunk of texts' block while the next travels, the
    texts' gradients summed along the ring; CLIP in two passes, its column states all-gathered
    between them) against the all-gather schedules on the same float64 ranks: the same loss
    and gradients to rounding (the sums run in another order), the ring taken exactly where it
    applies (not for "none" with a gradient: its recompute keeps the gathered texts), the same
    bits run to run, and the global values' bits on every rank."""
    _check_ring_numpy(op, P, reduction, requires_grad)


def _check_ring_numpy(op, P, reduction, requires_grad, **kw):
    """test_ring_schedule_numpy's comparison for ``op`` with the arguments ``kw`` (values
    that are callables of the rank: that rank's value)."""
    from emulated_ranks import run as run_ranks

    n, d = 3, 5
    A, B = _batch(np, "float64", (n * P, d), 31, 1.0), _batch(np, "float64", (n * P, d), 32, 1.0)

    def rank(ring):
        def body(comm):
            comm.ring = ring
            sl = slice(comm.rank * n, (comm.rank + 1) * n)
            mine = {k: v(comm.rank) if callable(v) else v for k, v in kw.items()}
            return _ring_op(op, A[sl], B[sl], reduction, requires_grad, comm, **mine)
        out = run_ranks(P, body)
        return out, [list(log) for log in run_ranks.log]

    ring, log = rank(True)
    again, _ = rank(True)
    gathered, glog = rank(False)
    takes = not (requires_grad and reduction == "none")
    assert all(("ring_shift" in lg) == takes for lg in log), log[0]
    assert not any("ring_shift" in lg for lg in glog)
    assert len(ring) == len(again) == len(gathered) == P
    for (l1, g1), (l2, g2), (l3, g3) in zip(ring, again, gathered):
        assert _err(l1, l3) <= 1e-13
        assert len(g1) == len(g2) == len(g3) == (len(g3) if requires_grad else 0), (g1, g3)
        if requires_grad:
            assert len(g3) >= 1
        for x, y, z in zip(g1, g2, g3):
            if x is None:  # (InfoNCE's dnegatives without negatives)
                assert y is None and z is None
                continue
            assert _err(x, z) <= 1e-13
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
        assert np.asarray(l1).tobytes() == np.asarray(l2).tobytes()
    if reduction != "none":
        assert len({np.asarray(x[0]).tobytes() for x in ring}) == 1
    if requires_grad:  # (the scalars' gradients: InfoNCE's dτ with temperature_grad)
        dt = (3,) if kw.get("temperature_grad") else ()
        for k in {"siglip": (2, 3), "clip": (2,), "info_nce": dt}.get(op, ()):
            assert len({np.asarray(x[1][k]).tobytes() for x in ring}) == 1


def _ring_labels(rank, n=3):
    """The rank's labels of a global batch with duplicates within and across ranks."""
    return (np.arange(rank * n, (rank + 1) * n) * 5) % 4


def _ring_negatives(shape, rank=0):
    """A rank's explicit negatives (float64), ``rank`` seeding them."""
    return np.random.default_rng(40 + rank).standard_normal(shape)


#: the variants on the rings: (op, its arguments; callables of the rank give that rank's)
RING_VARIANTS = {
    "info_nce-shared": ("info_nce", dict(negatives=lambda r: _ring_negatives((4, 5), r))),
    "info_nce-replicated": ("info_nce", dict(negatives=_ring_negatives((4, 5)),
                                             replicated_negatives=True)),
    "info_nce-per-query": ("info_nce", dict(negatives=lambda r: _ring_negatives((3, 2, 5), r))),
    "info_nce-labels": ("info_nce", dict(labels=_ring_labels)),
    "info_nce-smoothing": ("info_nce", dict(label_smoothing=0.1)),
    "info_nce-smoothing-dt": ("info_nce", dict(label_smoothing=0.1, temperature_grad=True)),
    "info_nce-smoothing-shared": ("info_nce", dict(
        label_smoothing=0.1, negatives=lambda r: _ring_negatives((4, 5), r))),
    "info_nce-smoothing-replicated": ("info_nce", dict(
        label_smoothing=0.1, negatives=_ring_negatives((4, 5)), replicated_negatives=True)),
    "info_nce-smoothing-per-query": ("info_nce", dict(
        label_smoothing=0.1, negatives=lambda r: _ring_negatives((3, 2, 5), r))),
    "info_nce-smoothing-labels": ("info_nce", dict(label_smoothing=0.1, labels=_ring_labels)),
    "info_nce-smoothing-labels-shared": ("info_nce", dict(
        label_smoothing=0.1, labels=_ring_labels,
        negatives=lambda r: _ring_negatives((4, 5), r))),
    "info_nce-smoothing-labels-replicated": ("info_nce", dict(
        label_smoothing=0.1, labels=_ring_labels, negatives=_ring_negatives((4, 5)),
        replicated_negatives=True)),
    "info_nce-smoothing-labels-per-query": ("info_nce", dict(
        label_smoothing=0.1, labels=_ring_labels,
        negatives=lambda r: _ring_negatives((3, 2, 5), r))),
    "info_nce-labels-shared": ("info_nce", dict(labels=_ring_labels,
                                                negatives=lambda r: _ring_negatives((4, 5), r))),
    "info_nce-hard-in-batch": ("info_nce", dict(hardness_mode="in_batch_negatives",
                                                hardness_strength=0.7)),
    "info_nce-hard-all-dt": ("info_nce", dict(hardness_mode="all_negatives",
                                              hardness_strength=0.7, temperature_grad=True)),
    "info_nce-hard-in-batch-shared": ("info_nce", dict(
        hardness_mode="in_batch_negatives", hardness_strength=0.7,
        negatives=lambda r: _ring_negatives((6, 5), r))),
    "info_nce-hard-negatives-shared": ("info_nce", dict(
        hardness_mode="hard_negatives", hardness_strength=0.7,
        negatives=lambda r: _ring_negatives((6, 5), r))),
    "info_nce-hard-all-shared": ("info_nce", dict(
        hardness_mode="all_negatives", hardness_strength=0.7,
        negatives=lambda r: _ring_negatives((4, 5), r))),
    "info_nce-hard-all-replicated": ("info_nce", dict(
        hardness_mode="all_negatives", hardness_strength=0.7, negatives=_ring_negatives((4, 5)),
        replicated_negatives=True)),
    "info_nce-hard-in-batch-replicated": ("info_nce", dict(
        hardness_mode="in_batch_negatives", hardness_strength=0.7,
        negatives=_ring_negatives((6, 5)), replicated_negatives=True)),
    "info_nce-hard-in-batch-per-query": ("info_nce", dict(
        hardness_mode="in_batch_negatives", hardness_strength=0.7,
        negatives=lambda r: _ring_negatives((3, 2, 5), r))),
    "info_nce-hard-negatives-per-query": ("info_nce", dict(
        hardness_mode="hard_negatives", hardness_strength=0.7,
        negatives=lambda r: _ring_negatives((3, 2, 5), r))),
    "info_nce-hard-negatives-labels-shared": ("info_nce", dict(
        hardness_mode="hard_negatives", hardness_strength=0.7, labels=_ring_labels,
        negatives=lambda r: _ring_negatives((6, 5), r))),
    "siglip-labels": ("siglip", dict(labels=_ring_labels)),
    "nt_xent-smoothing": ("nt_xent", dict(label_smoothing=0.1)),
    "clip-smoothing": ("clip", dict(label_smoothing=0.1)),
    "clip-labels": ("clip", dict(labels=_ring_labels)),
    "clip-smoothing-labels": ("clip", dict(label_smoothing=0.1, labels=_ring_labels)),
    "clip-smoothing-labels-rank-classes": ("clip", dict(label_smoothing=0.2,
                                                        labels=lambda r: np.full(3, r % 2))),
    "clip-smoothing-labels-singletons": ("clip", dict(
        label_smoothing=0.1, labels=lambda r: np.arange(3 * r, 3 * r + 3))),
    "supcon": ("supcon", dict(labels=lambda r: _ring_labels(r, 6))),
    "supcon-singletons": ("supcon", dict(labels=lambda r: np.arange(6 * r, 6 * r + 6) % 9)),
    "nt_xent_pairs": ("nt_xent_pairs", dict(labels=lambda r: _ring_labels(r, 6))),
    "nt_xent_pairs-singletons": ("nt_xent_pairs",
                                 dict(labels=lambda r: np.arange(6 * r, 6 * r + 6) % 9)),
    "nt_xent_pairs-one-class": ("nt_xent_pairs", dict(labels=lambda r: np.zeros(6, int))),
}


@pytest.mark.parametrize("variant", sorted(RING_VARIANTS))
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("requires_grad", [True, False])
def test_ring_variants_numpy(variant, P, reduction, requires_grad):
    """The variants' rings (label smoothing over the global row sums, ...) against their
    all-gather schedules, as :func:`test_ring_schedule_numpy` checks the plain ops."""
    op, kw = RING_VARIANTS[variant]
    _check_ring_numpy(op, P, reduction, requires_grad, **kw)


def test_ring_hardness_with_smoothing_gathers():
    """InfoNCE's hardness weighting together with label smoothing stays on the all-gather
    schedule (the ring's smoothing term takes the candidates' logits unpenalised), and its
    result is the one-process loss's."""
    from emulated_ranks import run as run_ranks

    P, n, d = 3, 3, 5
    A, B = _batch(np, "float64", (n * P, d), 31, 1.0), _batch(np, "float64", (n * P, d), 32, 1.0)
    kw = dict(hardness_mode="all_negatives", hardness_strength=0.7, label_smoothing=0.1)

    def body(comm):
        comm.ring = True
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        return _ring_op("info_nce", A[sl], B[sl], "mean", False, comm, **dict(kw))[0]
    out = run_ranks(P, body)
    assert not any("ring_shift" in lg for lg in run_ranks.log)
    whole, _ = cupynce.info_nce_forward(A, B, 0.3, requires_grad=False, **kw)
    for loss in out:
        assert _err(loss, whole) <= 1e-13


@pytest.mark.parametrize("op", ["siglip", "clip", "info_nce", "nt_xent"])
def test_ring_bad_argument_raises_on_every_rank(op):
    """With the ring possible, one rank's argument that the ring's wish would read (an array
    for requires_grad) fails inside the agreement like any bad argument: every rank raises,
    none waits in the exchange (the wish is asked only once the checks pass)."""
    from emulated_ranks import run as run_ranks

    P, n, d = 3, 2, 4
    A, B = _batch(np, "float64", (n * P, d), 61, 1.0), _batch(np, "float64", (n * P, d), 62, 1.0)

    def body(comm):
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        rg = np.array([True, False]) if comm.rank == 1 else True
        try:
            if op == "nt_xent":
                cupynce.nt_xent_forward(np.concatenate([A[sl], B[sl]]), 0.3, requires_grad=rg,
                                        group=comm)
            elif op == "info_nce":
                cupynce.info_nce_forward(A[sl], B[sl], 0.3, requires_grad=rg, group=comm)
            elif op == "clip":
                cupynce.clip_loss_forward(A[sl], B[sl], 1.1, requires_grad=rg, group=comm)
            else:
                cupynce.siglip_loss_forward(A[sl], B[sl], 1.1, -2.0, requires_grad=rg,
                                            group=comm)
        except (TypeError, ValueError) as exc:
            return str(exc)
        return None
    out = run_ranks(P, body)
    assert "requires_grad" in out[1], out
    assert all(out[r] and "invalid inputs on rank(s) [1]" in out[r] for r in (0, 2)), out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the ranks' threads: inf − inf)
@pytest.mark.parametrize("op", ["siglip"])
def test_ring_scale_gradient_of_an_infinite_row(op):
    """An infinite input: the ring's d loss / d logit_scale is the all-gather schedule's (inf
    stays inf: the scale's dot is taken once from the summed row gradients, not added over
    the chunks, where inf − inf would make NaN).  (CLIP's ring takes its scale's dot the same
    way, but there an infinite row's softmax makes NaN in both schedules: nothing to compare.)"""
    from emulated_ranks import run as run_ranks

    P, n, d = 3, 2, 3
    A, B = _batch(np, "float32", (n * P, d), 71, 1.0), _batch(np, "float32", (n * P, d), 72, 1.0)
    A[n, 0] = np.inf

    def rank(ring):
        def body(comm):
            comm.ring = ring
            sl = slice(comm.rank * n, (comm.rank + 1) * n)
            return _ring_op(op, A[sl], B[sl], "mean", True, comm)
        return run_ranks(P, body)
    ring, gathered = rank(True), rank(False)
    assert len(ring) == len(gathered) == P
    for (_, g1), (_, g3) in zip(ring, gathered):
        for k in {"siglip": (2, 3)}[op]:
            x, z = np.asarray(g1[k], np.float64), np.asarray(g3[k], np.float64)
            assert not np.isnan(z), (k, z)  # (else the comparison below could not fail)
            assert x == z or abs(x - z) <= 1e-5 * abs(z), (k, x, z)


def test_siglip_ring_is_every_rank_or_none():
    """The schedule is agreed (``_global.agree``'s ring wish): one rank whose communicator
    cannot shift makes every rank gather (no rank shifts while another gathers: a hang), with
    the same results."""
    from emulated_ranks import run as run_ranks

    P, n, d = 3, 2, 4
    A, B = _batch(np, "float64", (n * P, d), 51, 1.0), _batch(np, "float64", (n * P, d), 52, 1.0)

    def body(comm):
        comm.ring = comm.rank != 1
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        loss, ctx = cupynce.siglip_loss_forward(A[sl], B[sl], 1.1, -2.0, group=comm)
        return loss, cupynce.siglip_loss_backward(ctx, 0.7)
    out = run_ranks(P, body)
    assert not any("ring_shift" in log for log in run_ranks.log), run_ranks.log[0]
    want, ctx = cupynce.siglip_loss_forward(A, B, 1.1, -2.0)
    # (the single process's gradients at the same upstream: a rank's rows' P times theirs --
    # for DDP's average --, the scalars' the global values)
    da, db, ds, dbias = cupynce.siglip_loss_backward(ctx, 0.7)
    assert len(out) == P
    for r, (loss, (ga, gb, gs, gbias)) in enumerate(out):
        assert _err(loss, want) <= 1e-13
        sl = slice(r * n, (r + 1) * n)
        assert _err(ga / P, da[sl]) <= 1e-12 and _err(gb / P, db[sl]) <= 1e-12
        assert _err(gs, ds) <= 1e-12 and _err(gbias, dbias) <= 1e-12


def test_a_communicator_without_the_ring_says_so():
    """The interface's default: ring False, ring_shift raising (the schedules then keep the
    all-gathers)."""
    from cupynce.ops._comm import Comm

    assert Comm.ring is False
    with pytest.raises(NotImplementedError, match="ring_shift"):
        Comm().ring_shift(np.zeros(2))


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("learnable", [False, True])
def test_siglip_labels_numpy(P, reduction, learnable):
    """SigLIP's labels across ranks: the labels gathered with the texts; every text's
    gradient and this rank's share of the scale's and bias's from the global class sums."""
    _check_siglip(np, "float64", P, 4, 5, reduction, True, learnable, labeled=True)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("learnable", [False, True])
def test_clip_smoothing_numpy(P, reduction, learnable):
    """CLIP's label_smoothing= across ranks: Σ â gathered, Σ b̂ from the gathered texts, the
    scale's gradient from every rank's share."""
    _check_clip(np, "float64", P, 3, 5, reduction, True, learnable, eps=0.2)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nt_xent_smoothing_numpy(P, reduction):
    """label_smoothing= across ranks: the O(N·D) difference over the global sums."""
    _check_nt_xent(np, "float64", P, 3, 5, reduction, True, eps=0.2)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("classes", [3, 40])
def test_supcon_numpy(P, reduction, normalize, classes):
    _check_supcon(np, "float64", P, 6, 5, reduction, normalize, classes=classes)


def _check_pairs(xp, dtype, P, n, d, reduction, device=None, ws=None, classes=4,
                 learnable=False):
    """nt_xent_pairs across ranks: every rank's rows and labels gathered; few classes, so
    that a row's pairs and negatives sit on other ranks too (many: some rows have no pair);
    a learnable (host array) temperature's gradient the global one on every rank."""
    N = n * P
    rng = np.random.default_rng(17)
    L = xp.asarray(rng.integers(0, classes, N))
    Z = _batch(xp, dtype, (N, d), 18, 1.0)
    acc = np.float64 if dtype == "float64" else np.float32
    up = _upstream(xp, reduction, N, 19, acc)
    t = np.asarray(0.3) if learnable else 0.3
    kw = dict(reduction=reduction, normalize=True, temperature_grad=learnable)

    def rank(comm):
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        loss, ctx = cupynce.nt_xent_pairs_forward(Z[sl], L[sl], t, workspace_bytes=ws,
                                                  group=comm, **kw)
        return loss, cupynce.nt_xent_pairs_backward(ctx, up[sl] if reduction == "none"
                                                    else up)

    out = run(P, rank, device=device)
    want, ctx = cupynce.nt_xent_pairs_forward(Z, L, t, **kw)
    wg = cupynce.nt_xent_pairs_backward(ctx, up)
    dz, dt = wg if learnable else (wg, None)
    tl, tg = TOL[dtype]
    for r, (loss, g) in enumerate(out):
        sl = slice(r * n, (r + 1) * n)
        gz, gt = g if learnable else (g, None)
        assert _err(loss, want[sl] if reduction == "none" else want) <= tl
        assert _err(_host(gz).astype(np.float64) / P, _host(dz)[sl]) <= tg
        if learnable:
            assert _err(gt, dt) <= tg
    if reduction != "none":  # the global loss: the same bits on every rank
        assert len({float(_host(x[0])) for x in out}) == 1


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("classes", [3, 40])
@pytest.mark.parametrize("learnable", [False, True])
def test_nt_xent_pairs_numpy(P, reduction, classes, learnable):
    _check_pairs(np, "float64", P, 5, 4, reduction, classes=classes, learnable=learnable)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_nt_xent_pairs_one_row_a_rank_numpy(reduction):
    """A rank's share may be one row (the global batch has the pairs)."""
    _check_pairs(np, "float64", 4, 1, 3, reduction, classes=2)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("m", [5, 2])  # (M >= n: MoCo's queue rows; M < n: the labelled rows)
@pytest.mark.parametrize("learnable", [False, True])
def test_moco_each_rank_own_negatives_numpy(P, reduction, m, learnable):
    """in_batch_negatives=False across ranks with each rank's own (not replicated) shared
    negatives: query i's candidates are key i and every rank's negatives -- one process on
    the concatenated batch (negatives in rank order); dL/dτ the global one on every rank."""
    n, d = 4, 5
    N = n * P
    Q, K = _batch(np, "float64", (N, d), 41), _batch(np, "float64", (N, d), 42)
    NS = _batch(np, "float64", (P * m, d), 43)
    up = _upstream(np, reduction, N, 44, np.float64)
    t = np.asarray(0.3) if learnable else 0.3
    kw = dict(in_batch_negatives=False, reduction=reduction, normalize=True,
              temperature_grad=learnable)

    def rank(comm):
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        loss, ctx = cupynce.info_nce_forward(Q[sl], K[sl], t, group=comm,
                                             negatives=NS[comm.rank * m:(comm.rank + 1) * m],
                                             **kw)
        return loss, cupynce.info_nce_backward(ctx, up[sl] if reduction == "none" else up)

    out = run(P, rank)
    want, ctx = cupynce.info_nce_forward(Q, K, t, negatives=NS, **kw)
    wg = cupynce.info_nce_backward(ctx, up)
    for r, (loss, g) in enumerate(out):
        sl, own = slice(r * n, (r + 1) * n), slice(r * m, (r + 1) * m)
        assert _err(loss, want[sl] if reduction == "none" else want) <= 1e-12
        assert _err(g[0] / P, wg[0][sl]) <= 1e-12
        assert _err(g[1] / P, wg[1][sl]) <= 1e-12
        assert _err(g[2] / P, wg[2][own]) <= 1e-12
        if learnable:
            assert _err(g[3], wg[3]) <= 1e-12


def test_supcon_odd_rows_raise_on_every_rank():
    from cupynce.ops import supcon

    z, lab = np.ones((5, 3)), np.zeros(5, np.int64)

    def rank(comm):
        with pytest.raises(ValueError, match="even number of rows|invalid inputs on rank"):
            supcon.supcon_forward(z, lab, 0.1, group=comm)
        return True

    assert run(2, rank) == [True, True]


def _check_replicated(xp, dtype, P, n, d, reduction, in_batch, device=None):
    """Shared negatives that are the same on every rank (a queue) with
    ``replicated_negatives=True``: taken once; their gradient the global loss's on every rank
    (the same bits), the rows' P times theirs."""
    N, M = n * P, 7
    Q, K = _batch(xp, dtype, (N, d), 15), _batch(xp, dtype, (N, d), 16)
    U = _batch(xp, dtype, (M, d), 17)
    acc = np.float64 if dtype == "float64" else np.float32
    up = _upstream(xp, reduction, N, 18, acc)

    def rank(comm):
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        loss, ctx = cupynce.info_nce_forward(Q[sl], K[sl], 0.2, negatives=U,
                                             in_batch_negatives=in_batch,
                                             replicated_negatives=True, reduction=reduction,
                                             normalize=True, group=comm)
        return loss, cupynce.info_nce_backward(ctx, up[sl] if reduction == "none" else up)

    out = run(P, rank, device=device)
    want, ctx = cupynce.info_nce_forward(Q, K, 0.2, negatives=U, in_batch_negatives=in_batch,
                                         reduction=reduction, normalize=True)
    gq, gk, gu = cupynce.info_nce_backward(ctx, up)
    tl, tg = TOL[dtype]
    for r, (loss, (a, b, c)) in enumerate(out):
        sl = slice(r * n, (r + 1) * n)
        assert _err(loss, want[sl] if reduction == "none" else want) <= tl
        assert _err(_host(a).astype(np.float64) / P, _host(gq)[sl]) <= tg
        assert _err(_host(b).astype(np.float64) / P, _host(gk)[sl]) <= tg
        assert _err(_host(c).astype(np.float64), _host(gu)) <= tg
    assert len({_host(x[1][2]).tobytes() for x in out}) == 1


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("in_batch", [True, False])
def test_replicated_negatives_numpy(P, reduction, in_batch):
    _check_replicated(np, "float64", P, 3, 5, reduction, in_batch)


def _check_clip(xp, dtype, P, n, d, reduction, normalize, learnable, device=None, ws=None,
                eps=0.0, labeled=False):
    N = n * P
    A, B = _batch(xp, dtype, (N, d), 8, 1.0), _batch(xp, dtype, (N, d), 9, 1.0)
    # labels: few classes, so that a pair's same-label pairs sit on other ranks too
    L = xp.asarray(np.random.default_rng(21).integers(0, 4, N)) if labeled else None
    acc = np.float64 if dtype == "float64" else np.float32
    ls = xp.asarray(np.array([1.3], acc)) if learnable else 1.3
    up = _upstream(xp, reduction, N, 10, acc)

    def rank(comm):
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        loss, ctx = cupynce.clip_loss_forward(A[sl], B[sl], ls, label_smoothing=eps,
                                              labels=None if L is None else L[sl],
                                              reduction=reduction, normalize=normalize,
                                              workspace_bytes=ws, group=comm)
        return loss, cupynce.clip_loss_backward(ctx, up[sl] if reduction == "none" else up)

    out = run(P, rank, device=device)
    want, ctx = cupynce.clip_loss_forward(A, B, ls, label_smoothing=eps, labels=L,
                                          reduction=reduction, normalize=normalize)
    da, db, dls = cupynce.clip_loss_backward(ctx, up)
    tl, tg = TOL[dtype]
    for r, (loss, (ga, gb, gl)) in enumerate(out):
        sl = slice(r * n, (r + 1) * n)
        assert _err(loss, want[sl] if reduction == "none" else want) <= tl
        assert _err(_host(ga).astype(np.float64) / P, _host(da)[sl]) <= tg
        assert _err(_host(gb).astype(np.float64) / P, _host(db)[sl]) <= tg
        assert gl.shape == dls.shape and gl.dtype == dls.dtype
        assert _err(gl, dls) <= tg
    assert len({_host(x[1][2]).tobytes() for x in out}) == 1  # the same bits on every rank


def _check_siglip(xp, dtype, P, n, d, reduction, normalize, learnable, device=None,
                  ws=None, labeled=False):
    N = n * P
    A, B = _batch(xp, dtype, (N, d), 11, 1.0), _batch(xp, dtype, (N, d), 12, 1.0)
    # labels: few classes, so that a row's same-label texts sit on other ranks too
    L = xp.asarray(np.random.default_rng(19).integers(0, 3, N)) if labeled else None
    acc = np.float64 if dtype == "float64" else np.float32
    ls = xp.asarray(np.array([1.1], acc)) if learnable else 1.1
    lb = xp.asarray(np.array(-2.0, acc)) if learnable else -2.0
    up = _upstream(xp, reduction, N, 13, acc)

    def rank(comm):
        sl = slice(comm.rank * n, (comm.rank + 1) * n)
        loss, ctx = cupynce.siglip_loss_forward(A[sl], B[sl], ls, lb,
                                                labels=None if L is None else L[sl],
                                                reduction=reduction, normalize=normalize,
                                                workspace_bytes=ws, group=comm)
        return loss, cupynce.siglip_loss_backward(ctx, up[sl] if reduction == "none" else up)

    out = run(P, rank, device=device)
    want, ctx = cupynce.siglip_loss_forward(A, B, ls, lb, labels=L, reduction=reduction,
                                            normalize=normalize)
    da, db, dls, dlb = cupynce.siglip_loss_backward(ctx, up)
    tl, tg = TOL[dtype]
    for r, (loss, (ga, gb, gl, gbias)) in enumerate(out):
        sl = slice(r * n, (r + 1) * n)
        assert _err(loss, want[sl] if reduction == "none" else want) <= tl
        assert _err(_host(ga).astype(np.float64) / P, _host(da)[sl]) <= tg
        assert _err(_host(gb).astype(np.float64) / P, _host(db)[sl]) <= tg
        for x, y in ((gl, dls), (gbias, dlb)):
            assert x.shape == y.shape and x.dtype == y.dtype
            assert _err(x, y) <= tg
    for k in (2, 3):  # the global scalar gradients: the same bits on every rank
        assert len({_host(x[1][k]).tobytes() for x in out}) == 1
    if reduction != "none":
        assert len({_host(x[0]).tobytes() for x in out}) == 1


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("learnable", [False, True])
def test_siglip_numpy(P, dtype, reduction, normalize, learnable):
    _check_siglip(np, dtype, P, 3, 5, reduction, normalize, learnable)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("ws", [None, 1 << 17])
def test_siglip_gpu(P, dtype, reduction, ws):
    cp = _gpu()
    _check_siglip(cp, dtype, P, 136, 64, reduction, True, True, device=0, ws=ws)


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
def test_nt_xent_numpy(P, dtype, reduction, normalize):
    _check_nt_xent(np, dtype, P, 3, 5, reduction, normalize)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("negatives", [None, "shared", "per_query"])
@pytest.mark.parametrize("normalize", [False, True])
def test_info_nce_numpy(P, dtype, reduction, negatives, normalize):
    _check_info_nce(np, dtype, P, 3, 5, reduction, normalize, negatives)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("negatives", [None, "shared", "per_query"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_info_nce_labels_numpy(P, reduction, negatives, eps):
    """labels= and label_smoothing= across ranks: each key carries its label to every rank."""
    _check_info_nce(np, "float64", P, 3, 5, reduction, True, negatives, labeled=True, eps=eps)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("negatives", [None, "shared", "per_query"])
@pytest.mark.parametrize("mode", ["in_batch_negatives", "hard_negatives", "all_negatives"])
def test_info_nce_hardness_numpy(P, reduction, negatives, mode):
    """hardness_mode across ranks: a query's own hard negatives are its rank's (labels too:
    the masks meet in one kernel)."""
    _check_info_nce(np, "float64", P, 3, 5, reduction, True, negatives, labeled=True,
                    hard=(mode, 4.0))


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("learnable", [False, True])
def test_clip_numpy(P, dtype, reduction, normalize, learnable):
    _check_clip(np, dtype, P, 3, 5, reduction, normalize, learnable)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("learnable", [False, True])
def test_clip_labels_numpy(P, reduction, learnable):
    """CLIP's labels= across ranks: every pair's label gathered with the texts; a pair's
    same-label pairs on any rank leave both directions' softmaxes."""
    _check_clip(np, "float64", P, 4, 5, reduction, True, learnable, labeled=True)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("learnable", [False, True])
def test_clip_labels_with_smoothing_numpy(P, reduction, learnable):
    """labels= and label_smoothing= together across ranks: ε over each pair's candidates
    left after the mask, from the class sums of every rank's images (gathered) and texts."""
    _check_clip(np, "float64", P, 4, 5, reduction, True, learnable, eps=0.15, labeled=True)


def test_one_rank_bad_input_raises_on_every_rank():
    """Rank 1's z has an odd row count: rank 1 raises its own error, the others a ValueError
    naming rank 1; nobody hangs (the emulated barrier would time out)."""
    Z = np.random.default_rng(0).standard_normal((12, 4))

    def rank(comm):
        z = Z[:5] if comm.rank == 1 else Z[:6]
        return cupynce.nt_xent(z, 0.5, group=comm)

    out = run(3, rank, catch=True)
    assert all(isinstance(e, ValueError) for e in out), out
    assert "even number of rows" in str(out[1])
    assert "rank(s) [1]" in str(out[0]) and "rank(s) [1]" in str(out[2])


def test_unequal_local_sizes_and_settings_raise_on_every_rank():
    A = np.random.default_rng(0).standard_normal((12, 4))

    def sizes(comm):
        n = 4 if comm.rank == 0 else 3
        return cupynce.clip_loss(A[:n], A[:n], 0.5, group=comm)

    out = run(2, sizes, catch=True)
    assert all(isinstance(e, ValueError) and "equal local batch sizes" in str(e) for e in out)

    def temps(comm):
        return cupynce.info_nce(A[:3], A[3:6], 0.1 + 0.1 * comm.rank, group=comm)

    out = run(2, temps, catch=True)
    assert all(isinstance(e, ValueError) and "same settings" in str(e) for e in out)


def test_group_of_the_wrong_kind():
    with pytest.raises(TypeError, match="group must be"):
        cupynce.nt_xent(np.ones((4, 3)), group=object())


def test_clip_sends_only_the_texts():
    """The one-block CLIP's collectives: one feature gather (b) where two blocks need two;
    on the ring, the pairs' dots are gathered (the tile path's column shift), the texts'
    chunks shift once a step but the last (P − 1), the column states are gathered, and the
    texts' gradients shift once a step (P)."""
    A = np.random.default_rng(1).standard_normal((8, 4))

    def body(ring):
        def f(comm):
            comm.ring = ring
            return cupynce.clip_loss_forward(A[4 * comm.rank:][:4], A[:4], 0.0, group=comm)
        return f
    run(2, body(False))
    # the check; b, the dots, the column states; db to its owners, dlogit_scale, the loss
    assert run.log[0] == ["exchange", "all_gather", "all_gather", "all_gather",
                          "reduce_scatter", "all_reduce", "all_reduce"], run.log[0]
    run(2, body(True))
    assert run.log[0] == ["exchange", "all_gather", "ring_shift", "all_gather", "ring_shift",
                          "ring_shift", "all_reduce", "all_reduce"], run.log[0]


@pytest.mark.parametrize("P", range(1, 10))
@pytest.mark.parametrize("ring", [False, True])
def test_nt_xent_plan_covers_each_pair_of_blocks_once(P, ring):
    """The symmetric NT-Xent schedule (and the ring's mirrored one, blocks (r, r − k)): every
    entry of the global score matrix is computed exactly once (in one orientation), and each
    rank finds its rows' column states where the computing rank put them."""
    from cupynce.ops._local import NtXentPlan

    n2 = 6
    h = n2 // 2
    seen = np.zeros((P * n2, P * n2), int)
    plans = [NtXentPlan(r, P, n2, ring=ring) for r in range(P)]
    layout = {}  # (computing rank, state column) -> (owner rank, owner row)
    for r, pl in enumerate(plans):
        own = np.arange(r * n2, (r + 1) * n2)
        seen[np.ix_(own, own)] += 1
        blocks = [(own, pl.cols, 0)]
        if pl.lead:
            blocks.append((own[:h], [(pl.opp, slice(0, n2))], pl.main_width))
        for rows, cols, off in blocks:
            for c, sl in cols:
                cidx = c * n2 + np.arange(sl.start, sl.stop)
                seen[np.ix_(rows, cidx)] += 1
                seen[np.ix_(cidx, rows)] += 1
                for j in range(sl.start, sl.stop):
                    layout[(r, off)] = (c, j)
                    off += 1
        assert (pl.main_width + (n2 if pl.lead else 0)) <= pl.width
    assert (seen == 1).all()
    for r, pl in enumerate(plans):  # every other block's columns of r's rows, found once
        got = set()
        for src, off, rows in pl.sources():
            for i, row in enumerate(range(rows.start, rows.stop)):
                assert layout[(src, off + i)] == (r, row)
                got.add((src, row))
        want = {(layout_src, row) for (layout_src, _), (owner, row) in layout.items()
                if owner == r}
        assert got == want


@pytest.mark.parametrize("P", [2, 3])
def test_nt_xent_collectives(P):
    """The symmetric NT-Xent's collectives: the rows, their dots, the column states and the
    rows' lse gathered (O(N·D) + O(N)), the gradients reduce-scattered, the loss reduced; on
    the ring, the rows shift P // 2 times (the chunks of the mirrored plan's blocks), the
    column states and the lse are gathered, the gradients shift P times, the loss reduced."""
    Z = np.random.default_rng(1).standard_normal((8 * P, 4))

    def body(ring):
        def f(comm):
            comm.ring = ring
            r = comm.rank
            return cupynce.nt_xent_forward(
                np.concatenate([Z[4 * r:4 * r + 4], Z[4 * P + 4 * r:][:4]]), 0.5, group=comm)
        return f
    run(P, body(False))
    assert run.log[0] == ["exchange", "all_gather", "all_gather", "all_gather", "all_gather",
                          "reduce_scatter", "all_reduce"], run.log[0]
    run(P, body(True))
    assert run.log[0] == (["exchange"] + ["ring_shift"] * (P // 2) + ["all_gather"] * 2
                          + ["ring_shift"] * P + ["all_reduce"]), run.log[0]


# ---- GPU: the CuPy paths -------------------------------------------------------------------
def _gpu():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError
    except Exception:  # noqa: BLE001
        pytest.skip("needs a CUDA GPU (none here)")
    return cp


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ws", [None, 1 << 16])
def test_siglip_engine_column_chunks_gpu(dtype, weighted, ws):
    """The GPU SigLIP engine (tiles for 16-bit, cuBLAS row blocks for float32; a small
    workspace: several row and column blocks) on column chunks (``col0``, the ring schedule's
    step) adds up to the call on every column: the rows' losses and da and the scalar parts
    summed over the chunks, db chunk by chunk; per-row weights (reduction "none") shifted with
    the chunk.  Rows of rank 1 of 3, chunks of every rank.  Both sides sum in fp32, in other
    orders (a chunk's partials, then the chunks): 1e-4 relative, far above that reordering
    (~1e-6) and far below a misplaced positive or weight (O(1))."""
    cp = _gpu()
    from cupynce.ops import siglip as S

    P, n, d = 3, 40, 64
    r = 1
    acc = np.float32
    A, B = _batch(cp, dtype, (n * P, d), 41, 0.3), _batch(cp, dtype, (n * P, d), 42, 0.3)
    an = A[r * n:(r + 1) * n]
    w = ((cp.asarray(np.random.default_rng(43).standard_normal(n * P).astype(acc)), 1, 1.0)
         if weighted else (None, 0, 1.0 / (n * P)))
    kw = dict(weights=w, want_loss=True, want_grad=True, workspace_bytes=ws, row0=r * n)
    whole_rows, (wda, wdb, wsc, wbi) = S.gpu_engine(an, B, 1.1, -2.0, **kw)
    rows = da = sc = bi = 0
    for q in range(P):
        cr, (cda, cdb, csc, cbi) = S.gpu_engine(an, B[q * n:(q + 1) * n], 1.1, -2.0, col0=q * n,
                                                **kw)
        rows, da, sc, bi = rows + cr, da + cda, sc + csc, bi + cbi
        assert _err(cdb, wdb[q * n:(q + 1) * n]) <= 1e-4, q
    for got, want in ((rows, whole_rows), (da, wda), (sc, wsc), (bi, wbi)):
        assert _err(got, want) <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["siglip", "clip", "nt_xent", "info_nce", "clip-smoothing",
                                "nt_xent-smoothing"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_ring_schedule_gpu(op, dtype, P, configure):
    """``config.ring_gpu``: SigLIP's, CLIP's, NT-Xent's and InfoNCE's rings on CuPy arrays (the
    engines on column chunks; CLIP's and InfoNCE's other chunks on their blocks with
    ``positives=False``; the label
    smoothing over the global sums: ``-smoothing``) against the all-gather schedules on the
    same emulated ranks: the ring taken, the loss to fp32 reordering (1e-4 relative), the
    gradients too in float32; in bfloat16 to 2e-3: the 16-bit gradient blocks round from
    fp32 values that differ by reordering, so an element at a rounding boundary rounds apart
    (2.2e-4 and 4.6e-4 measured on an H200 when CLIP's other chunks ran on ``cross``'s
    epilogue); the global values' bits the same on every rank."""
    cp = _gpu()
    from emulated_ranks import run as run_ranks

    n, d = 40, 64
    A, B = _batch(cp, dtype, (n * P, d), 81, 0.3), _batch(cp, dtype, (n * P, d), 82, 0.3)
    op, kw = RING_VARIANTS[op] if op in RING_VARIANTS else (op, {})

    def rank(ring):
        configure(ring_gpu=ring)

        def body(comm):
            sl = slice(comm.rank * n, (comm.rank + 1) * n)
            return _ring_op(op, A[sl], B[sl], "mean", True, comm, **kw)
        out = run_ranks(P, body)
        return out, [list(log) for log in run_ranks.log]
    ring, log = rank(True)
    gathered, glog = rank(False)
    assert all("ring_shift" in lg for lg in log) and not any("ring_shift" in lg for lg in glog)
    tol = 1e-4 if dtype == "float32" else 2e-3
    for (l1, g1), (l3, g3) in zip(ring, gathered):
        assert _err(l1, l3) <= 1e-4
        for x, z in zip(g1, g3):
            if x is None:  # (InfoNCE's dnegatives without negatives)
                assert z is None
                continue
            assert _err(x, z) <= tol
    assert len({cp.asnumpy(x[0]).tobytes() for x in ring}) == 1


GPU_DTYPES = ["bfloat16", "float16", "float32"]


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("ws", [None, 1 << 17])
def test_clip_gpu(P, dtype, reduction, ws):
    cp = _gpu()
    _check_clip(cp, dtype, P, 136, 64, reduction, True, True, device=0, ws=ws)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("ws", [None, 1 << 17])
@pytest.mark.parametrize("eps", [0.0, 0.15])
def test_clip_labels_gpu(P, dtype, reduction, ws, eps):
    cp = _gpu()
    _check_clip(cp, dtype, P, 136, 64, reduction, True, True, device=0, ws=ws, labeled=True,
                eps=eps)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("ws", [None, 1 << 17])
def test_nt_xent_gpu(P, dtype, reduction, ws):
    """Every block of the symmetric schedule (the split pair of even P), tiles and cuBLAS
    paths, one row group or several (a small workspace)."""
    cp = _gpu()
    _check_nt_xent(cp, dtype, P, 200, 64, reduction, True, device=0, ws=ws)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("negatives", [None, "shared", "per_query"])
def test_info_nce_gpu(P, dtype, negatives):
    cp = _gpu()
    _check_info_nce(cp, dtype, P, 72, 64, "mean", False, negatives, device=0)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_info_nce_labels_gpu(P, dtype, reduction):
    cp = _gpu()
    _check_info_nce(cp, dtype, P, 72, 64, reduction, True, "shared", device=0, labeled=True,
                    eps=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_nt_xent_pairs_gpu(P, dtype, reduction):
    cp = _gpu()
    _check_pairs(cp, dtype, P, 72, 64, reduction, device=0, classes=12, ws=72 * 216 * 4)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("mode", ["in_batch_negatives", "hard_negatives", "all_negatives"])
def test_info_nce_hardness_gpu(P, dtype, mode):
    cp = _gpu()
    _check_info_nce(cp, dtype, P, 72, 64, "mean", True, "shared", device=0, hard=(mode, 5.0))


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_nt_xent_smoothing_gpu(P, dtype, reduction):
    cp = _gpu()
    _check_nt_xent(cp, dtype, P, 72, 64, reduction, True, device=0, eps=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_clip_smoothing_gpu(P, dtype, reduction):
    cp = _gpu()
    _check_clip(cp, dtype, P, 72, 64, reduction, True, True, device=0, eps=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_siglip_labels_gpu(P, dtype, reduction):
    cp = _gpu()
    _check_siglip(cp, dtype, P, 72, 64, reduction, True, True, device=0, labeled=True)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_replicated_negatives_gpu(P, dtype):
    cp = _gpu()
    _check_replicated(cp, dtype, P, 72, 64, "mean", False, device=0)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_supcon_gpu(P, dtype, reduction):
    cp = _gpu()
    _check_supcon(cp, dtype, P, 72, 64, reduction, True, device=0, classes=8)


@pytest.mark.gpu
def test_clip_gpu_one_rank_same_bits_as_single_process():
    """P = 1: the one-block path (column state, merge of one state) gives the single-process
    op's bits, tiles and cuBLAS paths."""
    cp = _gpu()
    for dtype in ("bfloat16", "float32"):
        A, B = _batch(cp, dtype, (256, 64), 1, 1.0), _batch(cp, dtype, (256, 64), 2, 1.0)
        got = run(1, lambda comm: cupynce.clip_loss(A, B, 1.1, group=comm), device=0)[0]
        want = cupynce.clip_loss(A, B, 1.1)
        assert got.get().tobytes() == want.get().tobytes(), dtype


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["clip", "siglip"])
@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_tile_gradient_in_row_and_column_blocks(monkeypatch, configure, op, P, dtype,
                                                reduction):
    """The tile path's CLIP / SigLIP gradient in row × column blocks (``score_tiles._plan_2d``,
    issue 23's workspace), forced to 128 × 128 so that the shifted numbering of a block's rows
    (row0 + r0 − c0, negative right of the diagonal) and the shifted per-index arrays (row
    and column lse, the weights) meet every case: the diagonal inside, left and right of a
    block, a short last block, the ranks' global rows; against the float64 oracle."""
    cp = _gpu()
    from cupynce._engine.losses import score_tiles

    configure(graphs=False)  # (a cached graph would replay old blocks)
    plans = []

    def plan(op_name, rows, cols, itemsize, ws):
        plans.append((rows, cols))
        return min(rows, 128), min(cols, 128)

    monkeypatch.setattr(score_tiles, "_plan_2d", plan)  # (score_tiles.clip / siglip call it)
    check = _check_clip if op == "clip" else _check_siglip
    check(cp, dtype, P, 136, 64, reduction, True, True, device=0, ws=None)
    assert plans and all(c == 136 * P for _, c in plans), plans


def test_tile_gradient_block_plan_and_shifted_weights():
    """CPU: ``score_tiles._plan_2d``'s blocks (whole rows when they fit; the docstring's
    N = 65536 case: 8 x 4 blocks of 8192 x 16384 at 256 MiB) and ``tiling.shifted``, the
    column block's weight pointer that CLIP and SigLIP share."""
    from cupynce._engine import tiling
    from cupynce._engine.losses import score_tiles

    assert score_tiles._plan_2d("clip_loss", 1000, 1000, 2, None) == (1000, 1000)
    assert score_tiles._plan_2d("clip_loss", 65536, 65536, 2, 256 << 20) == (8192, 16384)
    assert tiling.shifted(None, 1, 5) is None
    assert tiling.shifted(4096, 3, 2) == 4096 + 4 * 3 * 2  # (float32 weights, stride 3)


def test_ring_blocks_refuse_what_they_cannot_compute():
    """The rings' internal blocks refuse the calls whose results they could not give: CLIP's
    block without pairs with row weights (G's rows would take another weight than its
    columns) or statistics without column states (no row losses), NT-Xent's smoothing over
    global sums with per-row weights."""
    from cupynce.ops import _variants
    from cupynce.ops.clip import numpy_clip

    a = np.ones((3, 2))
    kw = dict(lse_r=np.zeros(3), lse_c=np.zeros(3), workspace_bytes=None, positives=False)
    with pytest.raises(ValueError, match="uniform weights"):
        numpy_clip(a, a, np.full(1, 1.1), weights=(np.full(3, 5.0), 1, 1.0), want_loss=False,
                   want_grad=True, **kw)
    with pytest.raises(ValueError, match="col_state"):
        numpy_clip(a, a, np.full(1, 1.1), weights=None, want_loss=True, want_grad=False, **kw)
    with pytest.raises(ValueError, match="one weight for every row"):
        _variants.nt_xent_smoothing(np, np.ones((4, 2)), 2.0, 0.1, np.ones(4),
                                    sums=(np.ones(2), 8))
