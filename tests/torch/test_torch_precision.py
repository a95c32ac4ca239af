"""``precision=`` in ``cupynce.torch`` and the integrations, on the CPU (issue 24).

The rule for ``precision=None``: "tf32" when torch runs its own float32 CUDA matmuls in TF32
(``torch.backends.cuda.matmul.fp32_precision == "tf32"`` on torch >= 2.9, which
``allow_tf32 = True`` sets; ``allow_tf32`` before), else ``cupynce.get_float32_precision()``;
read on the host at each call.  As in ops/test_precision.py, the NumPy engine primitives are
wrapped (the real ones still run) to record the precision in effect where the products run:
in the forward and in the backward op, through the direct path, the custom ops, the
compiled graph, the modules and the integrations.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupynce  # noqa: E402
import cupynce.torch as ct  # noqa: E402
from cupynce import _checks  # noqa: E402
from cupynce.torch import _registry as R  # noqa: E402
from test_precision import MODES, spy  # noqa: E402,F401  (the fixture)

MATMUL = torch.backends.cuda.matmul


@pytest.fixture
def torch_tf32(configure):
    """Set torch's float32 matmul mode for the test (legacy ``allow_tf32`` or the new
    ``fp32_precision``), restored after it; the global default restored too (``configure``)."""
    new_api = R._FP32_PRECISION_API
    saved = MATMUL.fp32_precision if new_api else MATMUL.allow_tf32

    def set_(on: bool, api: str = "legacy"):
        if api == "legacy":
            MATMUL.allow_tf32 = on
        else:
            MATMUL.fp32_precision = "tf32" if on else "ieee"
    yield set_
    if new_api:
        MATMUL.fp32_precision = saved
    else:
        MATMUL.allow_tf32 = saved


def _t(*shape, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)


def _call(op, precision="unset", reduction="none", seed=0):
    kw = {} if precision == "unset" else dict(precision=precision)
    a, b = _t(6, 5, seed=seed), _t(6, 5, seed=seed + 1)
    if op == "nt_xent":
        loss = ct.nt_xent(a, 0.5, reduction=reduction, **kw)
        xs = (a,)
    elif op == "info_nce":
        loss = ct.info_nce(a, b, 0.2, negatives=_t(3, 5, seed=7), reduction=reduction, **kw)
        xs = (a, b)
    elif op == "clip_loss":
        ls = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
        loss = ct.clip_loss(a, b, ls, reduction=reduction, **kw)
        xs = (a, b, ls)
    else:
        ls = torch.tensor(1.2, dtype=torch.float64, requires_grad=True)
        loss = ct.siglip_loss(a, b, ls, -2.0, reduction=reduction, **kw)
        xs = (a, b, ls)
    return loss, xs


OPS = ["nt_xent", "info_nce", "clip_loss", "siglip_loss"]


def _modes(spy):
    return {p for _, p in spy}


# ---- the None rule ------------------------------------------------------------------------
def test_torch_uses_tf32_follows_both_apis(torch_tf32):
    torch_tf32(False)
    assert R.torch_uses_tf32() is False and MATMUL.allow_tf32 is False
    torch_tf32(True)
    assert R.torch_uses_tf32() is True and MATMUL.allow_tf32 is True
    torch_tf32(False)
    if R._FP32_PRECISION_API:  # torch >= 2.9: the new API, where allow_tf32 may not answer
        torch_tf32(True, api="new")
        assert R.torch_uses_tf32() is True
        torch_tf32(False, api="new")
        assert R.torch_uses_tf32() is False and MATMUL.allow_tf32 is False
        torch.set_float32_matmul_precision("high")
        assert R.torch_uses_tf32() is True
        torch.set_float32_matmul_precision("highest")
        assert R.torch_uses_tf32() is False


@pytest.mark.parametrize("default", MODES)
def test_none_rule(torch_tf32, spy, default):
    cupynce.set_float32_precision(default)
    torch_tf32(True)
    assert R.precision_of("x", None) == "tf32"
    torch_tf32(False)
    assert R.precision_of("x", None) == default
    for mode in MODES:  # an explicit mode wins over both
        torch_tf32(True)
        assert R.precision_of("x", mode) == mode
    with pytest.raises(ValueError, match=r"x: precision must be one of 'fp32', 'tf32', "
                                         r"'3xtf32', 'auto' or None .*, got 'high'"):
        R.precision_of("x", "high")


@pytest.mark.parametrize("op", OPS)
def test_functions_follow_the_rule_at_each_call(op, torch_tf32, spy):
    """precision=None: torch's TF32 flag, read at the call (forward and backward op)."""
    for tf32, want in ((True, "tf32"), (False, "auto"), (True, "tf32")):
        torch_tf32(tf32)
        loss, xs = _call(op)
        torch_tf32(not tf32)  # (the backward keeps the forward's, whatever torch says now)
        del spy[:]
        loss.sum().backward()
        assert spy and _modes(spy) == {want}, (tf32, spy)
    torch_tf32(True)
    del spy[:]
    _call(op, precision="3xtf32")[0].sum().backward()
    assert _modes(spy) == {"3xtf32"}
    torch_tf32(False)
    cupynce.set_float32_precision("3xtf32")
    del spy[:]
    _call(op, precision=None)[0].sum().backward()
    assert _modes(spy) == {"3xtf32"}


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("op", OPS)
def test_custom_ops_carry_the_precision(op, reduction, torch_tf32, spy):
    """Through the registered ops (autocast keeps them), the backward op included."""
    torch_tf32(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (float64 passes untouched)
        assert not R.direct(_t(2, 2))
        loss, xs = _call(op, precision="tf32", reduction=reduction)
    assert _modes(spy) == {"tf32"}
    del spy[:]
    loss.sum().backward()
    assert reduction == "mean" and spy == [] or _modes(spy) == {"tf32"}, spy
    assert all(x.grad is not None for x in xs)


@pytest.mark.parametrize("op", ["nt_xent_fwd", "nt_xent_bwd", "info_nce_fwd", "info_nce_bwd",
                                "clip_loss_fwd", "clip_loss_bwd", "siglip_loss_fwd",
                                "siglip_loss_bwd", "splade_pool_fwd"])
def test_schemas_take_an_optional_precision(op):
    schema = str(getattr(torch.ops.cupynce, op).default._schema)
    assert "str? precision=None" in schema, schema


def test_compiled_step_follows_the_flag(torch_tf32, spy):
    """torch.compile (fullgraph): the rule is read when the graph is traced; dynamo's
    global-state guard (which holds the TF32 flag) retraces when the flag changes, and its
    guard on the global default when that changes."""
    torch._dynamo.reset()

    def step(z):
        return ct.nt_xent(z, 0.5, reduction="none").sum()

    fn = torch.compile(step, backend="aot_eager", fullgraph=True)
    z = _t(6, 4)
    for tf32, want in ((False, "auto"), (True, "tf32"), (False, "auto")):
        torch_tf32(tf32)
        del spy[:]
        fn(z).backward()
        assert _modes(spy) == {want}, (tf32, spy)
    cupynce.set_float32_precision("3xtf32")  # (dynamo guards the global default too)
    del spy[:]
    fn(z).backward()
    assert _modes(spy) == {"3xtf32"}, spy
    torch._dynamo.reset()


def test_bad_precision_is_refused_before_any_engine_call(spy):
    a = _t(4, 3)
    calls = [
        ("nt_xent", lambda: ct.nt_xent(a, precision="TF32")),
        ("info_nce", lambda: ct.info_nce(a, a, precision="TF32")),
        ("clip_loss", lambda: ct.clip_loss(a, a, 1.0, precision="TF32")),
        ("siglip_loss", lambda: ct.siglip_loss(a, a, 1.0, 0.0, precision="TF32")),
        ("splade_pool", lambda: ct.splade_pool(_t(2, 3, 3), _t(5, 3), precision="TF32")),
        ("InfoNCEFunction", lambda: ct.InfoNCEFunction.apply(a, 0.5, False, "TF32")),
    ]
    for op, call in calls:
        with pytest.raises(ValueError, match=rf"^{op}: precision must be one of .*got 'TF32'"):
            call()
    for cls, args in ((ct.NTXentLoss, ()), (ct.InfoNCE, ()), (ct.ClipLoss, ()),
                      (ct.SigLipLoss, ()), (ct.SpladePooling, (3, 5))):
        with pytest.raises(ValueError, match="precision must be one of"):
            cls(*args, precision="TF32")
    assert spy == []


# ---- modules ------------------------------------------------------------------------------
def test_modules_pass_their_precision(torch_tf32, spy):
    torch_tf32(True)
    a, b = _t(6, 5), _t(6, 5, seed=1)
    cases = [
        (ct.NTXentLoss(reduction="none", precision="3xtf32"), (a,)),
        (ct.InfoNCE(reduction="none", precision="3xtf32"), (a, b)),
        (ct.ClipLoss(reduction="none", precision="3xtf32"), (a, b)),
        (ct.SigLipLoss(reduction="none", precision="3xtf32"), (a, b)),
    ]
    for module, xs in cases:
        assert "precision='3xtf32'" in repr(module)
        del spy[:]
        module(*xs).sum().backward()
        assert spy and _modes(spy) == {"3xtf32"}, (module, spy)
        module.precision = None  # None: the rule at each call (torch's flag is on)
        del spy[:]
        module(*xs).sum().backward()
        assert _modes(spy) == {"tf32"}, (module, spy)
    assert "precision" not in repr(ct.ClipLoss())
    # CuBlaze's Function: the optional fourth argument (forward and the backward op)
    z = _t(6, 4)
    del spy[:]
    ct.InfoNCEFunction.apply(z, 0.5, False, "3xtf32").backward()
    assert _modes(spy) == {"3xtf32"}
    torch_tf32(False)
    del spy[:]
    with torch.no_grad():
        ct.InfoNCEFunction.apply(z, 0.5, False)
    assert _modes(spy) == {"auto"}


def test_splade_pooling_passes_its_precision(torch_tf32, spy):
    torch_tf32(True)
    head = ct.SpladePooling(3, 7, dtype=torch.float64, precision="3xtf32")
    x = _t(2, 4, 3)
    head(x).sum().backward()
    assert spy == [("_np_forward", "3xtf32")] and head.weight.grad is not None
    dec = torch.nn.Linear(3, 7, dtype=torch.float64)
    tied = ct.SpladePooling.from_decoder(dec, precision="fp32")
    del spy[:]
    tied(x)
    assert spy == [("_np_forward", "fp32")]
    del spy[:]
    ct.splade_pool(x, dec.weight)  # None, torch's flag on
    assert spy == [("_np_forward", "tf32")]


# ---- integrations -------------------------------------------------------------------------
def test_integrations_pass_their_precision(torch_tf32, spy):
    from cupynce.integrations import lightly, open_clip, sentence_transformers

    torch_tf32(False)
    a, b = _t(6, 5), _t(6, 5, seed=1)
    cases = [
        (open_clip.ClipLoss(precision="tf32"), (a, b, 20.0)),
        (open_clip.SigLipLoss(precision="tf32"), (a, b, 10.0, -5.0)),
        (lightly.NTXentLoss(precision="tf32"), (a, b)),
    ]
    for loss_fn, args in cases:
        del spy[:]
        loss_fn(*args).backward()
        assert spy and _modes(spy) == {"tf32"}, (loss_fn, spy)
    for cls in (sentence_transformers.MultipleNegativesRankingLoss,
                sentence_transformers.MultipleNegativesSymmetricRankingLoss):
        loss_fn = cls(precision="3xtf32")
        del spy[:]
        loss_fn.compute_loss_from_embeddings([a, b, _t(4, 5, seed=3)]).backward()
        assert spy and _modes(spy) == {"3xtf32"}, (cls, spy)
        assert loss_fn.get_config_dict()["precision"] == "3xtf32"
    assert "precision" not in sentence_transformers.MultipleNegativesRankingLoss(
    ).get_config_dict()
    for make in (lambda: open_clip.ClipLoss(precision="x"),
                 lambda: open_clip.SigLipLoss(precision="x"),
                 lambda: lightly.NTXentLoss(precision="x"),
                 lambda: sentence_transformers.MultipleNegativesRankingLoss(precision="x")):
        with pytest.raises(ValueError, match="precision must be one of"):
            make()


def test_numpy_and_float64_results_ignore_the_precision():
    """CPU tensors run the NumPy path: every mode gives the same bits (documented)."""
    ref = {}
    for mode in (None, *MODES):
        loss, xs = _call("clip_loss", precision=mode)
        loss.sum().backward()
        got = (loss.detach(), *[x.grad for x in xs])
        if not ref:
            ref["v"] = got
        assert all(torch.equal(g, r) for g, r in zip(got, ref["v"])), mode


def test_torch_error_says_what_none_means():
    pytest.importorskip("torch")
    from cupynce.torch import _registry as R

    with pytest.raises(ValueError, match=r"^x: precision must be one of 'fp32', 'tf32', "
                                         r"'3xtf32', 'auto' or None \(torch's TF32 setting"):
        R.precision_of("x", "high")
    with pytest.raises(ValueError, match=r"or None \(the global default"):
        _checks.check_precision("x", "high")


def test_torch_getter_matches_the_attribute():
    torch = pytest.importorskip("torch")
    from cupynce.torch import _registry as R

    if R._MATMUL_FP32 is None:
        pytest.skip("no fp32_precision getter in this torch")
    mm = torch.backends.cuda.matmul
    saved = mm.fp32_precision
    try:
        for v in ("tf32", "ieee"):
            mm.fp32_precision = v
            assert R._MATMUL_FP32() == mm.fp32_precision
            assert R.torch_uses_tf32() is (v == "tf32")
    finally:
        mm.fp32_precision = saved
