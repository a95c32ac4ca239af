"""CPU tests of what ``cupynce.torch._fast`` learns from a traced call (the mapping rules; the
replays themselves run on GPUs: ``tests/torch/test_torch_graphs.py``)."""
from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from cupynce.torch import _fast  # noqa: E402


def arr(t: "torch.Tensor", offset: int = 0):
    """A stand-in for a CuPy array over ``t``'s memory (``.data.ptr``, ``.nbytes``)."""
    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=t.data_ptr() + offset),
                                 nbytes=t.numel() * t.element_size())


class _Plan:  # (weak-referenceable, as ``_graphs._Plan``)
    def __init__(self, layout, pack_bytes):
        self.layout, self.pack_bytes, self.pack = layout, pack_bytes, object()


def plan(layout, pack_bytes=512):
    return _Plan(layout, pack_bytes)


@pytest.fixture(autouse=True)
def no_stream(monkeypatch):
    monkeypatch.setattr(_fast.B, "_scope", lambda index: (None, None))


def test_learns_inputs_and_outputs_by_memory():
    z = torch.zeros(8, 4)
    loss, dz = torch.zeros(()), torch.zeros(8, 4)
    p = plan([0, None])
    e = _fast._learn((("k",), p, (arr(z),), (arr(loss), arr(dz))), (z, 0.5, "mean"),
                     (loss, None, dz), 0)
    assert e.ins == (0,)
    assert e.outs == (("p", 0, (), torch.float32), None, ("o", 1))
    assert e.large == ((1, (8, 4), torch.float32),)
    assert e.pack_bytes == 512 and e.plan() is p


def test_refuses_inputs_not_the_arguments():
    z = torch.zeros(8, 4)
    copy = torch.zeros(8, 4)  # the core made its own copy: replaying from z would be wrong
    loss = torch.zeros(())
    ev = (("k",), plan([0]), (arr(copy),), (arr(loss),))
    assert _fast._learn(ev, (z,), (loss,), 0) is None


def test_refuses_arguments_sharing_memory():
    q = torch.zeros(8, 4)
    loss = torch.zeros(())
    ev = (("k",), plan([0]), (arr(q), arr(q)), (arr(loss),))
    assert _fast._learn(ev, (q, q), (loss,), 0) is None


def test_refuses_outputs_not_the_graphs():
    z = torch.zeros(8, 4)
    loss, other = torch.zeros(()), torch.zeros(())
    ev = (("k",), plan([0]), (arr(z),), (arr(loss),))
    assert _fast._learn(ev, (z,), (other,), 0) is None  # made after the replay
    assert _fast._learn(ev, (z,), [loss], 0) is None  # not a tuple


def test_refuses_non_contiguous_arguments():
    z = torch.zeros(4, 8).t()
    loss = torch.zeros(())
    ev = (("k",), plan([0]), (arr(z),), (arr(loss),))
    assert _fast._learn(ev, (z,), (loss,), 0) is None


def test_call_on_cpu_tensors_runs_the_body():
    calls = []

    def body(x):
        calls.append(x)
        return (x + 1,)

    x = torch.zeros(3)
    before = _fast.info()["entries"]  # (GPU tests earlier in the session may have learnt some)
    assert torch.equal(_fast.call(body, (x,))[0], x + 1)
    assert calls and _fast.info()["entries"] == before


def test_contiguous_strides():
    assert _fast._contiguous_strides(()) == ()
    assert _fast._contiguous_strides((3, 4, 5)) == (20, 5, 1)
