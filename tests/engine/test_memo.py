"""``cupynce.ops._memo``: a GPU forward called again with the same argument signature skips
the array and scalar checks (and the layout) that passed before -- and only then."""
from __future__ import annotations

import numpy as np
import pytest

import cupynce
from cupynce.ops import _memo
from cupynce.ops import clip as clip_op
from cupynce.ops import info_nce as info_nce_op
from cupynce.ops import nt_xent as nt_xent_op
from cupynce.ops import siglip as siglip_op


@pytest.fixture(autouse=True)
def fresh_memo():
    _memo.clear()
    yield
    _memo.clear()


@pytest.mark.parametrize("value", [True, 1, np.float32(0.5), np.float64(0.5), "0.5",
                                   np.zeros((2, 2)), np.asarray(0.5)])
def test_signature_refuses_what_it_cannot_pin_down(value):
    """Only CuPy arrays, Python floats and None are signed: bools and ints (which equal
    floats and hash alike), NumPy scalars and host arrays (whose values the checks read)
    give no signature, so such calls are always checked in full."""
    assert _memo.signature("op", value) is None
    assert not _memo.known(None)


def test_signature_of_floats_and_none():
    if _memo.cupy_module() is None:
        pytest.skip("needs CuPy")
    assert _memo.signature("op", 0.5, None) == ("op", 0.5, None)
    assert _memo.signature("op", 0.5) != _memo.signature("op", 0.25)


def test_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(_memo, "MAX_KNOWN", 3)
    for k in range(7):
        _memo.remember(("op", float(k)))
        assert len(_memo._known) <= 3
    assert _memo.known(("op", 6.0)) and not _memo.known(("op", 0.0))


def _cupy():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError
    except Exception:  # noqa: BLE001 - no driver / no device
        pytest.skip("needs a CUDA GPU (none here)")
    return cp


def _calls(cp):
    """op -> (module, forward(**overrides) -> loss), on small float32 / bfloat16 inputs."""
    rng = np.random.default_rng(0)
    z = cp.asarray(rng.standard_normal((12, 16)).astype(np.float32))
    a = cp.asarray(rng.standard_normal((6, 16)).astype(np.float32))
    b = cp.asarray(rng.standard_normal((6, 16)).astype(np.float32))
    neg = cp.asarray(rng.standard_normal((5, 16)).astype(np.float32))
    ls, lb = cp.asarray(np.float32(np.log(10.0))), cp.asarray(np.float32(-10.0))

    def nt(**kw):
        return cupynce.nt_xent_forward(kw.pop("z", z), kw.pop("t", 0.3), **kw)[0]

    def inf(**kw):
        return cupynce.info_nce_forward(kw.pop("q", a), kw.pop("k", b), kw.pop("t", 0.3),
                                        negatives=kw.pop("neg", neg), **kw)[0]

    def cl(**kw):
        return cupynce.clip_loss_forward(kw.pop("a", a), kw.pop("b", b), kw.pop("t", ls),
                                         **kw)[0]

    def sg(**kw):
        return cupynce.siglip_loss_forward(kw.pop("a", a), kw.pop("b", b), kw.pop("t", ls),
                                           kw.pop("bias", lb), **kw)[0]

    return {"nt_xent": (nt_xent_op, nt), "info_nce": (info_nce_op, inf),
            "clip_loss": (clip_op, cl), "siglip_loss": (siglip_op, sg)}


@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss", "siglip_loss"])
def test_second_call_skips_the_checks_with_the_same_result(op, monkeypatch):
    cp = _cupy()
    mod, fwd = _calls(cp)[op]
    first = cp.asnumpy(fwd())
    assert len(_memo._known) == 1

    def boom(*args, **kwargs):
        raise AssertionError("checked again")
    monkeypatch.setattr(mod, "_check", boom)
    for _ in range(3):  # (the third call on replays a CUDA graph)
        again = cp.asnumpy(fwd())
        np.testing.assert_array_equal(again, first)
    # the flags are checked on every call, remembered signature or not
    with pytest.raises(ValueError, match=f"{op}: reduction must be one of"):
        fwd(reduction="average")
    with pytest.raises(TypeError, match=f"{op}: normalize must be a bool"):
        fwd(normalize=1)
    with pytest.raises(TypeError, match=f"{op}: requires_grad must be a bool"):
        fwd(requires_grad="yes")
    with pytest.raises(ValueError, match=f"{op}: precision must be one of"):
        fwd(precision="fp64")


@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss", "siglip_loss"])
def test_a_new_signature_is_checked_in_full(op):
    """Whatever differs from a remembered call -- a scalar's value or type, an array's shape,
    dtype or layout -- is checked again; failures and copied layouts are not remembered."""
    cp = _cupy()
    _, fwd = _calls(cp)[op]
    fwd()
    bad = {"nt_xent": dict(t=-1.0), "info_nce": dict(t=float("nan")),
           "clip_loss": dict(t=100.0), "siglip_loss": dict(bias=float("inf"))}[op]
    with pytest.raises(ValueError):
        fwd(**bad)
    with pytest.raises(TypeError):
        fwd(t=True)  # (True == 1.0 and hashes alike: never signed, always checked)
    assert len(_memo._known) == 1
    x = cp.zeros((6, 32), cp.float32)[:, ::2]  # (a strided view: laid out by a copy)
    arg = {"nt_xent": "z", "info_nce": "q", "clip_loss": "a", "siglip_loss": "a"}[op]
    if op == "nt_xent":
        x = cp.zeros((12, 32), cp.float32)[:, ::2]
    fwd(**{arg: x})
    assert len(_memo._known) == 1
    # NT-Xent: an odd number of rows; the others: D unlike the other input's
    wrong = cp.zeros((11, 16) if op == "nt_xent" else (6, 15), cp.float32)
    with pytest.raises(ValueError):
        fwd(**{arg: wrong})
    assert len(_memo._known) == 1
