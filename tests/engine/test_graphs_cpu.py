"""CPU tests of ``cupynce.ops._graphs``' early exit for problems too large to capture (the
captures and replays themselves run on GPUs: ``tests/test_graphs.py``)."""
from __future__ import annotations

import numpy as np
import pytest

from cupynce._engine import blas
from cupynce.ops import _graphs
from cupynce.ops import clip as clip_op
from cupynce.ops import nt_xent as nt_xent_op


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(_graphs, "ENABLED", True)
    _graphs.clear()
    yield
    _graphs.clear()


def test_est_bytes_past_the_limit_runs_compute_without_a_key():
    """No stream, device or key is touched (NumPy inputs would fail there): ``compute`` runs,
    a trace records the call as uncaptured, nothing is counted."""
    x = np.arange(4.0)
    for _ in range(_graphs.CAPTURE_AFTER + 2):
        with _graphs.trace() as events:
            (y,) = _graphs.run(("test",), (x,), lambda x: (x + 1,),
                               est_bytes=_graphs.MAX_PLAN_BYTES + 1)
        np.testing.assert_array_equal(y, x + 1)
        assert events == [None]
    info = _graphs.info()
    assert info["plans"] == 0 and info["counting"] == 0 and not info["refused"]


@pytest.mark.parametrize("dtype, n, ws, want", [
    (np.float32, 16384, None, blas.DEFAULT_WORKSPACE_BYTES),  # capped: 1 GiB of 1 GiB
    (np.float32, 8192, None, 8192 * 8192 * 4),
    (np.float32, 16384, 64 << 20, 64 << 20),  # the caller's workspace
    (np.float64, 100, None, 100 * 100 * 8),
    (np.float16, 16384, None, 0),  # 16-bit: the tiles keep no score block
])
def test_clip_score_block_estimate(dtype, n, ws, want):
    a = np.zeros((n, 1), dtype)
    acc = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    assert clip_op._score_block_bytes(a, acc, ws) == want
    # a float32 CLIP at N = 16384 (1 GiB) skips the key; at 8192 (256 MiB) it is captured
    assert (want > _graphs.MAX_PLAN_BYTES) == (n == 16384 and dtype != np.float16
                                               and ws is None)


@pytest.mark.parametrize("dtype, n, d, ws, want", [
    # 16-bit: the whole H (N x N, z's dtype) + the float32 accumulator: 16384 is captured
    # (544 MiB), a float32 one at 16384 (1 GiB + the accumulator) skips the key
    ("bfloat16", 16384, 512, None, 16384 * 16384 * 2 + 16384 * 512 * 4),
    (np.float16, 8192, 512, None, 8192 * 8192 * 2 + 8192 * 512 * 4),
    (np.float16, 16384, 512, 64 << 20, (64 << 20) + 16384 * 512 * 4),  # capped
    (np.float32, 16384, 128, None, blas.DEFAULT_WORKSPACE_BYTES + 16384 * 128 * 4),
    (np.float64, 100, 8, None, 100 * 100 * 8 + 100 * 8 * 8),
])
def test_nt_xent_kept_bytes(dtype, n, d, ws, want):
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dtype = ml_dtypes.bfloat16
    z = np.zeros((n, d), dtype)
    assert nt_xent_op._kept_bytes(z, ws) == want
    assert (want > _graphs.MAX_PLAN_BYTES) == (dtype == np.float32)


def test_thread_tokens_are_never_reused():
    """The per-thread default stream's plans are keyed by a token per thread that no later
    thread gets, even once the first has exited (``threading.get_ident`` may be reused)."""
    import threading

    mine = _graphs._thread_token()
    assert _graphs._thread_token() == mine
    seen = []
    for _ in range(4):  # one after the other: each exits before the next starts
        t = threading.Thread(target=lambda: seen.append(_graphs._thread_token()))
        t.start()
        t.join()
    assert len(set(seen + [mine])) == 5


def test_deferred_products_run_plainly_outside_graphs():
    from cupynce._engine import tail

    out = []
    tail.products((1, 2), lambda a, b: out.append((a, b)))
    with tail.collecting(None) as rec:
        tail.products((3,), lambda a: out.append(a))
    with tail.collecting(lambda o, f: f(*o)) as rec2:
        tail.products((4,), lambda a: out.append(a))
    assert out == [(1, 2), 4] and len(rec) == 1 and len(rec2) == 1
    with tail.collecting(None) as rec3:  # (not the call's last work: run now, not recorded)
        tail.products((5,), lambda a: out.append(a), last=False)
    assert out == [(1, 2), 4, 5] and not rec3
