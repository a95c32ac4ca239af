"""The public ``precision=`` argument (issue 24) on the CPU: validation, the global default,
the Context's precision and the backward's scope, the global (emulated-rank) ops (a global
forward resolves ``precision=None`` once: the mode the ranks agree on is the mode the rank runs).

The NumPy path ignores the precision in its arithmetic but runs under the same scope as the
GPU path (one ``with cupynce.config.float32_precision(p)`` around either), so the scope
itself is checked here: the NumPy engine primitives the ops call (``_numpy.rows``,
``clip.numpy_clip``, ``siglip.numpy_engine``, ``splade._np_forward``) are wrapped — the real
primitive still runs and the losses are checked — to record
``cupynce.config.current().float32_precision`` at each call.  The GPU results per mode are in
ops/test_precision_accuracy.py.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import cupynce
import cupynce.config as cfg
from cupynce.ops import _global, _numpy
from cupynce.ops import clip as clip_op
from cupynce.ops import siglip as siglip_op
from cupynce.ops import splade as splade_op
from emulated_ranks import run

MODES = cfg.FLOAT32_PRECISIONS
BAD = ["TF32", "bf16x3", "", 3, True, ("fp32",)]


@pytest.fixture
def spy(monkeypatch):
    """Every NumPy engine call of the ops as ``(primitive, precision in effect)``."""
    calls = []

    def wrap(owner, name):
        real = getattr(owner, name)

        def spied(*args, **kwargs):
            calls.append((name, cfg.current().float32_precision))
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, spied)

    for owner, name in ((_numpy, "rows"), (_numpy, "cross"), (clip_op, "numpy_clip"),
                        (siglip_op, "numpy_engine"), (splade_op, "_np_forward")):
        wrap(owner, name)
    return calls


@pytest.fixture
def default(configure):
    """The global default, restored after the test."""
    return configure


def _rng(seed=0):
    return np.random.default_rng(seed)


def _inputs(op, n=6, d=5, seed=0):
    r = _rng(seed)
    if op == "nt_xent":
        return (r.standard_normal((n, d)),)
    if op == "info_nce":
        return r.standard_normal((n, d)), r.standard_normal((n, d))
    return r.standard_normal((n, d)), r.standard_normal((n, d))


def _forward(op, xs, **kw):
    if op == "nt_xent":
        return cupynce.nt_xent_forward(xs[0], 0.5, **kw)
    if op == "info_nce":
        return cupynce.info_nce_forward(*xs, 0.2, negatives=_rng(9).standard_normal((3, 5)),
                                        **kw)
    if op == "clip_loss":
        return cupynce.clip_loss_forward(*xs, 1.5, **kw)
    return cupynce.siglip_loss_forward(*xs, 1.2, -2.0, **kw)


BACKWARD = {"nt_xent": cupynce.nt_xent_backward, "info_nce": cupynce.info_nce_backward,
            "clip_loss": cupynce.clip_loss_backward, "siglip_loss": cupynce.siglip_loss_backward}
OPS = list(BACKWARD)


# ---- validation ---------------------------------------------------------------------------
def _entry_points():
    """Every public entry point that can run float32 products, as ``(name, call(precision))``."""
    z, q, k = (_rng(i).standard_normal((4, 3)) for i in range(3))
    lse = np.zeros(4)
    x, w = _rng(3).standard_normal((2, 3, 3)), _rng(4).standard_normal((5, 3))
    return [
        ("nt_xent", lambda p: cupynce.nt_xent(z, precision=p)),
        ("nt_xent", lambda p: cupynce.nt_xent_forward(z, precision=p)),
        ("nt_xent", lambda p: cupynce.nt_xent_backward_from_stats(z, lse, precision=p)),
        ("info_nce", lambda p: cupynce.info_nce(q, k, precision=p)),
        ("info_nce", lambda p: cupynce.info_nce_forward(q, k, precision=p)),
        ("info_nce", lambda p: cupynce.info_nce_backward_from_stats(q, k, None, lse,
                                                                    precision=p)),
        ("clip_loss", lambda p: cupynce.clip_loss(q, k, 1.0, precision=p)),
        ("clip_loss", lambda p: cupynce.clip_loss_forward(q, k, 1.0, precision=p)),
        ("clip_loss", lambda p: cupynce.clip_loss_backward_from_stats(q, k, 1.0, lse, lse,
                                                                      precision=p)),
        ("siglip_loss", lambda p: cupynce.siglip_loss(q, k, 1.0, 0.0, precision=p)),
        ("siglip_loss", lambda p: cupynce.siglip_loss_forward(q, k, 1.0, 0.0, precision=p)),
        ("siglip_loss", lambda p: cupynce.siglip_loss_backward_from_inputs(q, k, 1.0, 0.0,
                                                                           precision=p)),
        ("splade_pool", lambda p: cupynce.splade_pool(x, w, precision=p)),
        ("splade_pool", lambda p: cupynce.splade_pool_forward(x, w, precision=p)),
    ]


ENTRY_IDS = [f"{i}-{name}" for i, (name, _) in enumerate(_entry_points())]


@pytest.mark.parametrize("bad", BAD, ids=repr)
@pytest.mark.parametrize("which", range(len(ENTRY_IDS)), ids=ENTRY_IDS)
def test_bad_precision_raises_before_any_engine_call(which, bad, spy):
    op, call = _entry_points()[which]
    with pytest.raises(ValueError) as err:
        call(bad)
    msg = str(err.value)
    assert msg.startswith(f"{op}: precision must be one of 'fp32', 'tf32', '3xtf32', "
                          f"'auto'"), msg
    assert msg.endswith(f"got {bad!r}") and "None (the global default" in msg, msg
    assert spy == [], "an engine primitive ran before the precision was checked"


@pytest.mark.parametrize("which", range(len(ENTRY_IDS)), ids=ENTRY_IDS)
@pytest.mark.parametrize("mode", [None, *MODES])
def test_every_entry_point_accepts_the_modes(which, mode, spy):
    _entry_points()[which][1](mode)
    assert spy and {p for _, p in spy} == {mode or "auto"}, spy


def test_numpy_results_do_not_depend_on_the_precision():
    """The NumPy path ignores the mode: the same bits in each (documented)."""
    for op in OPS:
        xs = _inputs(op)
        base = _forward(op, xs, reduction="none")
        ref_loss, ref_grads = base[0], BACKWARD[op](base[1], np.linspace(0.5, 1.5, 6))
        for mode in MODES:
            loss, ctx = _forward(op, xs, reduction="none", precision=mode)
            grads = BACKWARD[op](ctx, np.linspace(0.5, 1.5, 6))
            assert np.array_equal(loss, ref_loss), (op, mode)
            for g, r in zip(grads if isinstance(grads, tuple) else (grads,),
                            ref_grads if isinstance(ref_grads, tuple) else (ref_grads,)):
                assert (g is None and r is None) or np.array_equal(g, r), (op, mode)


def test_numpy_str_is_taken_as_str():
    _, ctx = cupynce.nt_xent_forward(_inputs("nt_xent")[0], precision=np.str_("tf32"))
    assert ctx.precision == "tf32" and type(ctx.precision) is str


# ---- the global default -------------------------------------------------------------------
def test_global_setter_and_getter(default, spy):
    assert cupynce.get_float32_precision() == "auto"  # (CI sets no CUPYNCE_FLOAT32)
    for mode in MODES:
        cupynce.set_float32_precision(mode)
        assert cupynce.get_float32_precision() == mode == cfg.get().float32_precision
        assert cfg.current().float32_precision == mode
        _, ctx = cupynce.nt_xent_forward(_inputs("nt_xent")[0], reduction="none")
        assert ctx.precision == mode and spy[-1] == ("rows", mode)
        # an explicit argument wins over the default
        _, ctx = cupynce.nt_xent_forward(_inputs("nt_xent")[0], precision="fp32")
        assert ctx.precision == "fp32" and spy[-1] == ("rows", "fp32")
    for bad in [None, "TF32", 1]:
        with pytest.raises(ValueError, match=r"set_float32_precision: precision must be one "
                                             r"of 'fp32', 'tf32', '3xtf32', 'auto', got "):
            cupynce.set_float32_precision(bad)
    assert cupynce.get_float32_precision() == MODES[-1]  # unchanged by the refused calls
    assert "set_float32_precision" in cupynce.__all__ and "get_float32_precision" in \
        cupynce.__all__


def test_global_default_is_read_at_each_call(default, spy):
    z = _inputs("nt_xent")[0]
    cupynce.set_float32_precision("tf32")
    loss, ctx = cupynce.nt_xent_forward(z, reduction="none")
    cupynce.set_float32_precision("3xtf32")
    cupynce.nt_xent(z)
    assert [p for _, p in spy] == ["tf32", "3xtf32"]
    # the context keeps the forward's, whatever the default is now
    cupynce.nt_xent_backward(ctx, np.ones(6))
    assert spy[-1] == ("rows", "tf32") and ctx.precision == "tf32"


# ---- the Context keeps the precision, the backward re-enters it --------------------------
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", OPS)
def test_backward_runs_in_the_forwards_precision(op, mode, reduction, spy, default):
    xs = _inputs(op, seed=len(op))
    loss, ctx = _forward(op, xs, reduction=reduction, precision=mode)
    assert ctx.precision == mode
    assert spy and all(p == mode for _, p in spy), spy  # the forward's products
    assert cfg.current().float32_precision == "auto"  # the scope closed with the forward
    n_forward = len(spy)
    # the backward, called under another scope and another default, runs in the forward's
    cupynce.set_float32_precision("3xtf32" if mode != "3xtf32" else "tf32")
    with cfg.float32_precision("fp32" if mode != "fp32" else "tf32"):
        g = np.linspace(0.5, 1.5, 6) if reduction == "none" else 0.7
        BACKWARD[op](ctx, g)
        outer = cfg.current().float32_precision
    assert outer != mode  # (the outer scope came back after the backward)
    if reduction == "none":  # the backward recomputes: engine calls in the forward's mode
        assert len(spy) > n_forward and all(p == mode for _, p in spy[n_forward:]), spy
    else:  # the fused forward computed the gradient: the backward only scales it
        assert len(spy) == n_forward


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", OPS)
def test_backward_from_stats_runs_in_its_precision(op, mode, spy):
    xs = _inputs(op, seed=3)
    loss, ctx = _forward(op, xs, reduction="none", precision=mode)
    g = np.linspace(0.5, 1.5, 6)
    want = BACKWARD[op](ctx, g)
    del spy[:]
    if op == "nt_xent":
        got = cupynce.nt_xent_backward_from_stats(xs[0], ctx.stats[0], g, temperature=0.5,
                                                  reduction="none", precision=mode)
    elif op == "info_nce":
        neg = _rng(9).standard_normal((3, 5))
        got = cupynce.info_nce_backward_from_stats(*xs, neg, ctx.stats[0], g, temperature=0.2,
                                                   reduction="none", precision=mode)
    elif op == "clip_loss":
        got = cupynce.clip_loss_backward_from_stats(*xs, 1.5, *ctx.stats, g, reduction="none",
                                                    precision=mode)
    else:
        got = cupynce.siglip_loss_backward_from_inputs(*xs, 1.2, -2.0, g, reduction="none",
                                                       precision=mode)
    assert spy and all(p == mode for _, p in spy), spy
    for a, b in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        assert (a is None and b is None) or np.array_equal(a, b)


def test_context_default_and_backward_without_precision(spy):
    """A Context made without one (None) opens no scope: the backward runs in whatever is in
    effect (the entry points always set it)."""
    assert cupynce.Context("nt_xent", "none", 2, np).precision is None
    loss, ctx = cupynce.nt_xent_forward(_inputs("nt_xent")[0], reduction="none",
                                        precision="tf32")
    ctx.precision = None
    with cfg.float32_precision("3xtf32"):
        cupynce.nt_xent_backward(ctx, np.ones(6))
    assert spy[-1] == ("rows", "3xtf32")


def test_backward_restores_the_scope_on_an_error(spy):
    _, ctx = cupynce.nt_xent_forward(_inputs("nt_xent")[0], reduction="none",
                                     precision="3xtf32")
    with pytest.raises(ValueError, match="grad_loss"):
        cupynce.nt_xent_backward(ctx, np.ones(5))
    assert cfg.current().float32_precision == "auto"


def test_splade_forward_runs_in_its_precision(spy):
    x, w = _rng(3).standard_normal((2, 4, 3)), _rng(4).standard_normal((7, 3))
    ref_out, _ = cupynce.splade_pool_forward(x, w)
    for mode in MODES:
        out, ctx = cupynce.splade_pool_forward(x, w, precision=mode)
        assert ctx.precision == mode and spy[-1] == ("_np_forward", mode)
        assert np.array_equal(out, ref_out)
        cupynce.splade_pool_backward(ctx, np.ones_like(out))  # (no products, no scope needed)


# ---- the global ops across (emulated) ranks ----------------------------------------------
def _global_forward(op, comm, mode, reduction="none"):
    xs = _inputs(op, n=4, seed=10 + comm.rank)
    kw = dict(reduction=reduction, group=comm, precision=mode)
    if op == "nt_xent":
        return cupynce.nt_xent_forward(xs[0], 0.5, **kw)
    if op == "info_nce":
        return cupynce.info_nce_forward(*xs, 0.2, **kw)
    if op == "clip_loss":
        return cupynce.clip_loss_forward(*xs, 1.5, **kw)
    return cupynce.siglip_loss_forward(*xs, 1.2, -2.0, **kw)


@pytest.mark.parametrize("mode", ["tf32", "3xtf32"])
@pytest.mark.parametrize("op", OPS)
def test_global_forward_and_backward_run_in_the_precision(op, mode, spy):
    def rank(comm):
        loss, ctx = _global_forward(op, comm, mode)
        n_fwd = len([c for c in spy])
        BACKWARD[op](ctx, np.ones(ctx.n))
        return ctx.precision, n_fwd

    out = run(2, rank)
    assert [p for p, _ in out] == [mode, mode]
    assert spy and all(p == mode for _, p in spy), spy  # every rank's every engine call
    assert len(spy) > max(n for _, n in out)  # ("none": the backward recomputed)


def test_global_bad_precision_raises_on_every_rank(spy):
    """Rank 1's bad precision: rank 1 raises its own error naming it, rank 0 names rank 1;
    nobody hangs (checked inside the first exchange), no engine call."""
    z = _rng(0).standard_normal((4, 3))

    def rank(comm):
        return cupynce.nt_xent(z, 0.5, group=comm, precision="TF32" if comm.rank else None)

    out = run(2, rank, catch=True)
    assert all(isinstance(e, ValueError) for e in out), out
    assert "nt_xent: precision must be one of" in str(out[1]) and "'TF32'" in str(out[1])
    assert "rank(s) [1]" in str(out[0])
    assert spy == []


def test_global_ranks_must_agree_on_the_resolved_precision(default, spy):
    z = _rng(0).standard_normal((4, 3))

    def differ(comm):
        return cupynce.clip_loss(z, z, 1.0, group=comm, precision=MODES[comm.rank])

    out = run(2, differ, catch=True)
    assert all(isinstance(e, ValueError) and "same settings" in str(e)
               and "float32 precision" in str(e) for e in out), out
    # None resolves to the global default: None on one rank, the default on the other agree
    cupynce.set_float32_precision("tf32")
    losses = run(2, lambda comm: cupynce.clip_loss(z, z, 1.0, group=comm,
                                                   precision=None if comm.rank else "tf32"))
    assert losses[0] == losses[1] and all(p == "tf32" for _, p in spy)


def test_global_settings_codes_are_distinct():
    codes = [_global._setting(v) for v in ("mean", "sum", "none", *MODES)]
    assert len(set(codes)) == len(codes) and _global._setting("bogus") == -1
    assert _global.precision_setting(None) == cfg.get().float32_precision
    assert _global.precision_setting("TF32") == "TF32"  # (raised by the local checks)


@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss", "siglip_loss"])
def test_global_forward_reads_the_default_once(monkeypatch, spy, op):
    """A second read of the global default (another thread's set_float32_precision in
    between) must not make the rank run another mode than the one it exchanged."""
    real = cfg.get  # (what reads the global default: _checks.check_precision's None)
    local = threading.local()

    def flipping():
        local.n = getattr(local, "n", 0) + 1
        # (the first read, then "changed")
        return real().replace(float32_precision="tf32" if local.n == 1 else "fp32")

    monkeypatch.setattr(cfg, "get", flipping)
    z = np.random.default_rng(0).standard_normal((4, 3))

    def rank(comm):
        local.n = 0
        if op == "nt_xent":
            loss, ctx = cupynce.nt_xent_forward(z, 0.5, group=comm, reduction="none")
        elif op == "info_nce":
            loss, ctx = cupynce.info_nce_forward(z, z, 0.5, group=comm, reduction="none")
        elif op == "clip_loss":
            loss, ctx = cupynce.clip_loss_forward(z, z, 1.0, group=comm, reduction="none")
        else:
            loss, ctx = cupynce.siglip_loss_forward(z, z, 1.0, 0.0, group=comm,
                                                    reduction="none")
        return ctx.precision, local.n

    out = run(2, rank)
    assert out == [("tf32", 1)] * 2, out
    assert spy and {p for _, p in spy} == {"tf32"}, spy
