"""Review fixes of issue 24's ``precision=`` (CPU).

* "3xtf32" splits a float32 score block that the gradient products take as an operand (hi and
  lo: twice the block), so the row-block planners count it within ``workspace_bytes``;
* a global (``group=``) forward resolves ``precision=None`` once: the mode the ranks agree on
  is the mode the rank runs;
* the report keeps torch's fields when torch refuses to read one of them (new-API TF32);
* the thread-local scope reads without a miss; cupynce.torch's error names what None means.
"""
from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pytest

import cupynce
from cupynce import _checks
from cupynce._engine import blas, products_tf32
from cupynce.ops import _global
from emulated_ranks import run
from test_precision import spy  # noqa: F401  (the fixture)

BFLOAT16 = blas.BFLOAT16


# ---- 3xtf32's split within the workspace --------------------------------------------------
@pytest.mark.parametrize("mode", blas.FLOAT32_PRECISIONS)
def test_split_row_bytes(mode):
    with blas.float32_precision(mode):
        want = 2 * 100 * 4 if mode == "3xtf32" else 0
        assert blas.split_row_bytes(np.float32, 100) == want
        for dt in (np.float16, np.float64, BFLOAT16):
            assert blas.split_row_bytes(dt, 100) == 0


class _Planned(Exception):
    pass


def _planned_bytes(monkeypatch, call):
    """bytes_per_row that ``call`` hands to blas.plan_rows (stopped there: no GPU needed)."""
    from cupynce._engine import blocks

    seen = []

    def plan_rows(op, rows, bytes_per_row, workspace_bytes, **kw):
        seen.append(bytes_per_row)
        raise _Planned

    monkeypatch.setattr(blas, "plan_rows", plan_rows)
    # (blocks.rows imports cupy before planning; a stand-in where CuPy is absent)
    monkeypatch.setitem(sys.modules, "cupy", sys.modules.get("cupy")
                        or types.ModuleType("cupy"))
    with pytest.raises(_Planned):
        call(blocks)
    return seen[-1]


def _planners(dt, want_grad):
    n, nc, d = 8, 12, 4
    q, k = np.zeros((n, d), dt), np.zeros((nc, d), dt)
    w = (None, 0, 1.0)
    return {
        "rows": lambda b: b.rows(q, k, None, None, 1.0, exclude_diag=False, pos_shift=0,
                                 pos_mod=nc, lse_in=None, weights=w, want_grad=want_grad,
                                 workspace_bytes=None, op="info_nce"),
        "clip": lambda b: b.clip(q, k, None, lse_r=None, lse_c=None, weights=w,
                                 want_loss=True, want_grad=want_grad, workspace_bytes=None),
        "siglip": lambda b: b.siglip(q, k, None, None, weights=w, want_loss=True,
                                     want_grad=want_grad, workspace_bytes=None),
        "cross": lambda b: b.cross(q, k, 1.0, lse_r=None, lse_c=None, weights=w,
                                   want_stats=True, want_grad=want_grad, workspace_bytes=None),
    }, nc


@pytest.mark.parametrize("which", ["rows", "clip", "siglip", "cross"])
@pytest.mark.parametrize("want_grad", [True, False])
@pytest.mark.parametrize("tiles", [False, True])
def test_planners_count_the_split_block(monkeypatch, which, want_grad, tiles):
    """cuBLAS's "3xtf32" splits the gradient block: the planners count it; the TF32x3 tiles
    (``products_tf32``, stubbed as available) split no gradient block: nothing counted."""
    from cupynce._engine import tiles_tf32

    monkeypatch.setattr(tiles_tf32, "available", lambda: tiles)
    for dt in (np.float32, np.float64, np.float16):
        calls, nc = _planners(dt, want_grad)
        got = {}
        for mode in blas.FLOAT32_PRECISIONS:
            with blas.float32_precision(mode):
                got[mode] = _planned_bytes(monkeypatch, calls[which])
        assert got["fp32"] == got["tf32"]
        with blas.float32_precision("3xtf32"):
            q = np.zeros((8, 4), dt)
            assert products_tf32.applies(q, q) == (tiles and dt == np.float32)
        extra = 2 * nc * 4 if dt == np.float32 and want_grad and not tiles else 0
        assert got["3xtf32"] == got["fp32"] + extra, (dt, got)


# ---- a global forward resolves None once ---------------------------------------------------
@pytest.mark.parametrize("op", ["nt_xent", "info_nce", "clip_loss", "siglip_loss"])
def test_global_forward_reads_the_default_once(monkeypatch, spy, op):  # noqa: F811
    """A second read of the global default (another thread's set_float32_precision in
    between) must not make the rank run another mode than the one it exchanged."""
    real = blas.float32_precision_default
    local = threading.local()

    def flipping():
        local.n = getattr(local, "n", 0) + 1
        real()
        return "tf32" if local.n == 1 else "fp32"  # (the first read, then "changed")

    monkeypatch.setattr(blas, "float32_precision_default", flipping)
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


# ---- the report keeps torch's fields ---------------------------------------------------------
def test_report_keeps_torch_fields_under_new_api_tf32():
    torch = pytest.importorskip("torch")
    from cupynce.report import harness as H

    mm = torch.backends.cuda.matmul
    if getattr(mm, "fp32_precision", None) is None:
        pytest.skip("torch < 2.9: no fp32_precision API")
    saved = mm.fp32_precision
    try:
        mm.fp32_precision = "tf32"
        info = H.device_info()
    finally:
        mm.fp32_precision = saved
    assert info.get("torch_allow_tf32_matmul") is True, info
    assert "torch_cuda" in info and "torch_alloc_conf" in info, info


# ---- cheap reads, messages ---------------------------------------------------------------
def test_scope_reads_without_a_miss():
    assert type(blas._LOCAL).precision is None  # (a class default: no AttributeError)
    seen = []

    def other():
        seen.append(blas.float32_precision_now())
    with blas.float32_precision("3xtf32"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert blas.float32_precision_now() == "3xtf32"
    assert seen == [blas.float32_precision_default()]  # (the scope is this thread's alone)


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
