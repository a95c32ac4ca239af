"""The float32 precision switch (``cupynce.config``, issue 24), without a GPU: a NumPy
emulation of ``cpn_split_tf32_f32`` (the kernel's integer rule, bit for bit), the accuracy of an
emulated 3xTF32 product against float32's, the switch's validation and graph keys, and the
thread-local scope's reads; "3xtf32" splits a float32 score block that the gradient products
take as an operand (hi and lo: twice the block), so the row-block planners count it within
``workspace_bytes``.  The GPU side (``gemm`` in each mode) is in engine/test_blas.py.
"""
from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pytest

import cupynce.config as cfg
from cupynce._engine.gemm import cublas
from cupynce._engine.gemm.chooser import applies
from cupynce._engine.kernels import BFLOAT16

F32 = np.float32
U32 = np.uint32


def split_tf32(x) -> tuple:
    """``kernels_src/products/blas.cu``'s split: hi = x rounded to TF32 to nearest, ties away
    from zero (add 0x1000 to the bit pattern, clear the low 13 bits), truncated instead where
    that gives infinity; inf / NaN: hi = x, lo = 0; lo = x - hi (exact)."""
    x = np.asarray(x, F32)
    u = x.view(U32)
    finite = (u & U32(0x7F800000)) != U32(0x7F800000)
    h = (u + U32(0x1000)) & U32(0xFFFFE000)
    h = np.where((h & U32(0x7F800000)) == U32(0x7F800000), u & U32(0xFFFFE000), h)
    hi = np.where(finite, h, u).astype(U32).view(F32)
    with np.errstate(invalid="ignore"):
        lo = np.where(finite, x - hi, F32(0)).astype(F32)
    return hi, lo


def tf32_truncate(x) -> np.ndarray:
    """What a TF32 tensor core reads of a float32 operand: the low 13 mantissa bits dropped."""
    return (np.asarray(x, F32).view(U32) & U32(0xFFFFE000)).view(F32)


def _bits(rng, n) -> np.ndarray:
    """Random finite float32 values over every exponent (subnormals included)."""
    u = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(U32)
    x = u.view(F32)
    return x[np.isfinite(x)]


def test_split_is_exact_and_hi_has_ten_mantissa_bits():
    x = _bits(np.random.default_rng(0), 1 << 20)
    hi, lo = split_tf32(x)
    assert not np.any(hi.view(U32) & U32(0x1FFF)), "hi keeps more than 10 mantissa bits"
    assert np.all(np.isfinite(hi))
    assert np.array_equal(hi + lo, x)  # in float32 ...
    assert np.array_equal(hi.astype(np.float64) + lo, x.astype(np.float64))  # ... and exactly
    normal = (np.abs(x) >= np.finfo(F32).tiny) & (np.abs(x) < 2.0 ** 127)
    assert np.all(np.abs(lo[normal]) <= np.abs(x[normal]) * 2.0 ** -11)  # half a TF32 ulp


def test_split_rounds_to_nearest_ties_away():
    """hi against an independent rounding (frexp, 11 significant bits, half away from zero)
    for normal values, and the ties themselves."""
    x = _bits(np.random.default_rng(1), 1 << 18)
    x = x[(np.abs(x) >= np.finfo(F32).tiny) & (np.abs(x) < 2.0 ** 127)]
    m, e = np.frexp(x.astype(np.float64))
    ref = np.ldexp(np.sign(m) * np.floor(np.abs(m) * 2.0 ** 11 + 0.5), e - 11)
    assert np.array_equal(split_tf32(x)[0].astype(np.float64), ref)
    ulp = 2.0 ** -10
    ties = np.array([1 + ulp / 2, -(1 + ulp / 2), 1 + 1.5 * ulp, 1 + ulp / 2 - 2.0 ** -23], F32)
    assert split_tf32(ties)[0].tolist() == [1 + ulp, -(1 + ulp), 1 + 2 * ulp, 1.0]


def test_split_special_values():
    tiny = np.finfo(F32).smallest_subnormal
    big = np.finfo(F32).max
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, tiny, -tiny, 4097 * tiny, 12345 * tiny,
                  np.finfo(F32).tiny, big, -big], F32)
    hi, lo = split_tf32(x)
    assert hi.view(U32)[:2].tolist() == [0, 0x80000000] and lo[:2].tolist() == [0, 0]  # signs
    assert hi[2] == np.inf and hi[3] == -np.inf and np.isnan(hi[4])
    assert hi.view(U32)[4] == x.view(U32)[4] and lo[2:5].tolist() == [0, 0, 0]  # NaN kept
    # subnormals: rounded at the same bit, the rest exactly in lo (the kernel's subtraction
    # does not flush them)
    assert hi[5] == 0 and lo[5] == tiny and hi[6] == 0 and lo[6] == -tiny
    assert hi.view(U32)[7] == 0x2000 and lo[7] == -(8192 - 4097) * tiny
    # the largest values would round to infinity: truncated instead, still exact
    assert np.all(np.isfinite(hi[10:])) and np.array_equal(hi[8:] + lo[8:], x[8:])


def _rel(x, ref) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


def _emulated_3xtf32(a, b) -> np.ndarray:
    """gemm's "3xtf32" product, emulated: exact products of the TF32 parts (float64 sums; lo
    read as TF32 by the tensor cores), each of the three GEMMs landing in float32 ``out`` in
    gemm's order lo·hi, hi·lo, hi·hi."""
    a_hi, a_lo = split_tf32(a)
    b_hi, b_lo = split_tf32(b)
    a_hi, a_lo, b_hi, b_lo = (np.asarray(v, np.float64) for v in
                              (a_hi, tf32_truncate(a_lo), b_hi, tf32_truncate(b_lo)))
    out = (a_lo @ b_hi).astype(F32)
    out = (out + (a_hi @ b_lo).astype(F32)).astype(F32)
    return (out + (a_hi @ b_hi).astype(F32)).astype(F32)


@pytest.mark.parametrize("k", [64, 256, 1024, 4096])
def test_emulated_3xtf32_error_within_float32s(k):
    """Relative (Frobenius) error vs float64 at m = n = 64, standard normal inputs; measured
    (NumPy's float32 matmul on the CPU host): k = 64: 3xTF32 8.6e-8, float32 1.5e-7, TF32
    (hi·hi) 2.9e-4; k = 256: 8.3e-8, 2.9e-7, 3.0e-4; k = 1024: 8.5e-8, 3.4e-7, 2.9e-4;
    k = 4096: 8.6e-8, 3.8e-7, 3.0e-4.  The emulation sums in float64, so it shows the split's
    error (lo·lo dropped, lo read as TF32, three roundings into out), not cuBLAS's fp32
    accumulation, which the GPU test measures."""
    rng = np.random.default_rng(k)
    a = rng.standard_normal((64, k)).astype(F32)
    b = rng.standard_normal((k, 64)).astype(F32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    e3 = _rel(_emulated_3xtf32(a, b), ref)
    e32 = _rel(a @ b, ref)
    hi_a, hi_b = (np.asarray(split_tf32(v)[0], np.float64) for v in (a, b))
    etf = _rel((hi_a @ hi_b).astype(F32), ref)
    assert e3 <= e32, (e3, e32)
    assert e3 <= 1e-7 and 1e-4 < etf < 1e-3, (e3, etf)


def test_env_variable_is_validated(monkeypatch):
    monkeypatch.setenv("CUPYNCE_FLOAT32", "tf32")
    assert cfg.Config.from_env().float32_precision == "tf32"
    monkeypatch.delenv("CUPYNCE_FLOAT32")
    assert cfg.Config.from_env().float32_precision == "auto"
    monkeypatch.setenv("CUPYNCE_FLOAT32", "bf16x3")
    with pytest.raises(ValueError, match=r"CUPYNCE_FLOAT32='bf16x3' is not a float32 precision; "
                                         r"expected one of 'fp32', 'tf32', '3xtf32', 'auto'$"):
        cfg.Config.from_env()


def test_default_is_auto():
    assert cfg.get().float32_precision == "auto"  # (the test environment sets no CUPYNCE_FLOAT32)
    assert cfg.current().float32_precision == "auto"


def test_context_manager_scopes_this_thread(configure):
    with pytest.raises(ValueError, match=r"float32_precision: precision='TF32' is not"):
        cfg.float32_precision("TF32")  # refused at the call, before any scope opens
    seen = []
    with cfg.float32_precision("3xtf32"):
        assert cfg.current().float32_precision == "3xtf32"
        with cfg.float32_precision("tf32"):
            assert cfg.current().float32_precision == "tf32"
            t = threading.Thread(target=lambda: seen.append(cfg.current().float32_precision))
            t.start()
            t.join()
        assert cfg.current().float32_precision == "3xtf32"
    assert cfg.current().float32_precision == "auto" and seen == ["auto"]
    with pytest.raises(RuntimeError):
        with cfg.float32_precision("tf32"):
            raise RuntimeError
    assert cfg.current().float32_precision == "auto"  # restored on an exception too
    configure(float32_precision="tf32")
    assert cfg.current().float32_precision == "tf32"
    with pytest.raises(ValueError, match=r"Config.float32_precision='fast'"):
        configure(float32_precision="fast")  # (refused when set: never read)
    assert cfg.current().float32_precision == "tf32"


def test_graph_key_includes_precision():
    from cupynce.ops import _graphs

    keys = {}
    for p in cfg.FLOAT32_PRECISIONS:
        with cfg.float32_precision(p):
            keys[p] = _graphs.switches()
            assert keys[p].float32_precision == p
    assert len(set(keys.values())) == 4
    assert _graphs.switches() == keys["auto"]


def truncation_bound(k: int) -> float:
    """What Hopper's tensor cores add to a "3xtf32" product's relative error over a reduction
    of length ``k``: each TF32 MMA step (k = 8) adds its products to the accumulator rounding
    toward zero, losing up to 1 ulp (2^-23 relative) of the partial sum, half that on
    average and the same way every step.  Measured (benchmarks/bench_f32_products.py, H200):
    0.5-0.55 of this for Z·Zᵀ at k = 256 / 512; the ops' gradients (k = N = 1000) 0.3 of it.
    """
    return (k / 8) * 2.0 ** -24


def test_scope_reads_without_a_miss():
    assert type(cfg._local).precision is None  # (a class default: no AttributeError)
    seen = []

    def other():
        seen.append(cfg.current().float32_precision)
    with cfg.float32_precision("3xtf32"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert cfg.current().float32_precision == "3xtf32"
    assert seen == [cfg.get().float32_precision]  # (the scope is this thread's alone)


# ---- 3xtf32's split within the workspace ---------------------------------------------------
@pytest.mark.parametrize("mode", cfg.FLOAT32_PRECISIONS)
def test_split_row_bytes(mode):
    with cfg.float32_precision(mode):
        want = 2 * 100 * 4 if mode == "3xtf32" else 0
        assert cublas.split_row_bytes(np.float32, 100) == want
        for dt in (np.float16, np.float64, BFLOAT16):
            assert cublas.split_row_bytes(dt, 100) == 0


class _Planned(Exception):
    pass


def _planned_bytes(monkeypatch, call):
    """bytes_per_row that ``call`` hands to workspace.plan_rows (stopped there: no GPU
    needed)."""
    from cupynce._engine.losses import row_blocks

    seen = []

    def plan_rows(op, rows, bytes_per_row, workspace_bytes, **kw):
        seen.append(bytes_per_row)
        raise _Planned

    monkeypatch.setattr(row_blocks, "plan_rows", plan_rows)  # (row_blocks imports it by name)
    # (row_blocks.rows imports cupy before planning; a stand-in where CuPy is absent)
    monkeypatch.setitem(sys.modules, "cupy", sys.modules.get("cupy")
                        or types.ModuleType("cupy"))
    with pytest.raises(_Planned):
        call(row_blocks)
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
    (``gemm.chooser``'s ``TilesPlan``, stubbed as available) split no gradient block: nothing
    counted."""
    from cupynce._engine.gemm import tf32x3

    monkeypatch.setattr(tf32x3, "available", lambda: tiles)
    for dt in (np.float32, np.float64, np.float16):
        calls, nc = _planners(dt, want_grad)
        got = {}
        for mode in cfg.FLOAT32_PRECISIONS:
            with cfg.float32_precision(mode):
                got[mode] = _planned_bytes(monkeypatch, calls[which])
        assert got["fp32"] == got["tf32"]
        with cfg.float32_precision("3xtf32"):
            q = np.zeros((8, 4), dt)
            assert applies(q, q) == (tiles and dt == np.float32)
        extra = 2 * nc * 4 if dt == np.float32 and want_grad and not tiles else 0
        assert got["3xtf32"] == got["fp32"] + extra, (dt, got)
