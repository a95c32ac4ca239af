"""cupynce.config: the one immutable configuration, its scopes, the environment it reads once,
and the 0.2 module attributes that still reach it (with a DeprecationWarning)."""
from __future__ import annotations

import dataclasses
import importlib
import threading
import warnings

import pytest

import cupynce
import cupynce.config as cfg
from cupynce._engine import compat


def test_defaults_and_environment():
    env = cfg.Config.from_env({})
    assert env == cfg.Config()
    assert (env.float32_precision, env.tiles, env.f16x3, env.graphs) == ("auto", None, True, True)
    got = cfg.Config.from_env({
        "CUPYNCE_FLOAT32": "3xtf32", "CUPYNCE_TILES": "0", "CUPYNCE_WSTILE": "0",
        "CUPYNCE_TILE_WORKSPACE_MIB": "64", "CUPYNCE_F16X3": "0", "CUPYNCE_SIDE": "0",
        "CUPYNCE_GRAPHS": "0", "CUPYNCE_GRAPH_VARIANTS": "0", "CUPYNCE_PREBUILT": "0",
        "CUPYNCE_DEBUG_KERNELS": "1", "CUPYNCE_CPU_TORCH": "0", "CUPYNCE_MM_K_SPLITS": "8"})
    assert got == cfg.Config(float32_precision="3xtf32", tiles=False, ws_tiles=False,
                             tile_workspace_bytes=64 << 20, f16x3=False, side_streams=False,
                             graphs=False, graph_variants=False, prebuilt=False,
                             debug_kernels=True, cpu_torch=False, mm_k_splits=8)
    assert env.cpu_torch is True
    assert cfg.Config.from_env({"CUPYNCE_TILES": "1"}).tiles is True
    assert cfg.Config.from_env({"CUPYNCE_TILES": "auto"}).tiles is None


def test_environment_integer_is_validated():
    with pytest.raises(ValueError, match=r"CUPYNCE_MM_K_SPLITS='eight': expected an integer$"):
        cfg.Config.from_env({"CUPYNCE_MM_K_SPLITS": "eight"})
    with pytest.raises(ValueError,
                       match=r"CUPYNCE_TILE_WORKSPACE_MIB='1G': expected an integer$"):
        cfg.Config.from_env({"CUPYNCE_TILE_WORKSPACE_MIB": "1G"})


def test_environment_precision_is_validated():
    with pytest.raises(ValueError, match=r"CUPYNCE_FLOAT32='bf16x3' is not a float32 precision; "
                                         r"expected one of 'fp32', 'tf32', '3xtf32', 'auto'$"):
        cfg.Config.from_env({"CUPYNCE_FLOAT32": "bf16x3"})


def test_the_test_environment_sets_no_switch():
    """(the suite runs on the defaults: a CUPYNCE_* variable here would skew every test)"""
    assert cfg.get() == cfg.Config()


def test_config_is_immutable_and_validated():
    c = cfg.get()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.tiles = False
    with pytest.raises(TypeError, match=r"Config has no field 'use_tiles'; fields: "):
        c.replace(use_tiles=False)
    with pytest.raises(TypeError, match=r"Config.tiles=3: expected None or a bool"):
        c.replace(tiles=3)
    with pytest.raises(TypeError, match=r"Config.small_gemm_macs=True: expected int"):
        c.replace(small_gemm_macs=True)
    with pytest.raises(TypeError, match=r"Config.ws_stages=\['lse'\]: expected frozenset"):
        c.replace(ws_stages=["lse"])
    with pytest.raises(ValueError, match=r"Config.float32_precision='fp16' is not a float32 "):
        c.replace(float32_precision="fp16")
    assert c.replace(free_memory_fraction=1).free_memory_fraction == 1


def test_hash_and_equality_follow_the_fields():
    a, b = cfg.Config(), cfg.Config()
    assert a == b and hash(a) == hash(b) and a is not b
    c = a.replace(side_splits=False)
    assert c != a and hash(c) != hash(a)
    assert {a: 1}[b] == 1


def test_set_and_override_replace_the_process_wide_config(monkeypatch):
    monkeypatch.setattr(cfg, "_global", cfg.get())
    before = cfg.get()
    new = cfg.set(f16x3=False)
    assert cfg.get() is new and new.f16x3 is False and before.f16x3 is True
    assert cfg.current() is new
    with cfg.override(tiles=False, wgmma=False) as inside:
        assert cfg.get() is inside and (inside.tiles, inside.wgmma, inside.f16x3) == (False, False, False)
    assert cfg.get() is new
    with cfg.override(before):
        assert cfg.get() is before
    assert cfg.get() is new


def test_set_float32_precision_is_config(monkeypatch):
    monkeypatch.setattr(cfg, "_global", cfg.get())
    cupynce.set_float32_precision("tf32")
    assert cfg.get().float32_precision == "tf32" == cupynce.get_float32_precision()


def test_precision_scope_is_per_thread_and_derives_the_config(monkeypatch):
    monkeypatch.setattr(cfg, "_global", cfg.get())
    seen = {}
    with cfg.float32_precision("3xtf32"):
        inner = cfg.current()
        assert inner.float32_precision == "3xtf32" and cfg.get().float32_precision == "auto"
        assert cfg.scoped_precision() == "3xtf32"
        assert cfg.current() is inner  # (derived once: the graph key hashes it every call)
        t = threading.Thread(target=lambda: seen.update(p=cfg.current().float32_precision))
        t.start()
        t.join()
        with cfg.float32_precision("fp32"):
            assert cfg.current().float32_precision == "fp32"
        assert cfg.current() is inner
        cfg.set(side_splits=False)  # (a set() inside a scope: the scope keeps its precision)
        assert cfg.current().float32_precision == "3xtf32"
        assert cfg.current().side_splits is False
    assert seen["p"] == "auto"
    assert cfg.current().float32_precision == "auto" and cfg.scoped_precision() is None
    with pytest.raises(ValueError, match=r"float32_precision: precision='x' is not a float32 "):
        cfg.float32_precision("x")


def test_scope_changes_any_field_for_this_thread(monkeypatch):
    """``scope(**changes)``: this thread only, nested scopes merged, restored on exit, a
    ``set()`` inside shows through the fields it does not change; bad input raises before."""
    monkeypatch.setattr(cfg, "_global", cfg.get())
    seen = {}
    with cfg.scope(graphs=False, side_streams=False):
        inner = cfg.current()
        assert (inner.graphs, inner.side_streams) == (False, False) and cfg.get().graphs
        assert cfg.current() is inner and cfg.scoped_precision() is None
        t = threading.Thread(target=lambda: seen.update(g=cfg.current().graphs))
        t.start()
        t.join()
        with cfg.float32_precision("tf32"):  # (what every op opens: it keeps the scope's)
            c = cfg.current()
            assert (c.float32_precision, c.graphs, c.side_streams) == ("tf32", False, False)
            assert cfg.scoped_precision() == "tf32"
            with cfg.scope(graphs=True):
                assert cfg.current().graphs and cfg.current().float32_precision == "tf32"
            assert cfg.current() is c
        assert cfg.current() is inner and cfg.scoped_precision() is None
        cfg.set(f16x3=False)
        assert (cfg.current().f16x3, cfg.current().graphs) == (False, False)
    assert seen["g"] is True
    assert cfg.current() is cfg.get() and cfg.current().graphs
    with pytest.raises(TypeError, match=r"Config has no field 'graph'"):
        cfg.scope(graph=False)
    with pytest.raises(TypeError, match=r"Config.graphs=1: expected bool"):
        cfg.scope(graphs=1)


def _old_switches():
    for module, (switches, _homes) in compat.DISSOLVED.items():
        for name, field in switches.items():
            yield module, name, field
    yield "cupynce._engine.side", "ENABLED", "side_streams"
    yield "cupynce._engine.splade", "USE_WS", "splade_ws"
    yield "cupynce._engine.arrays", "ARENA_BYTES", "arena_bytes"
    yield "cupynce.ops._graphs", "ENABLED", "graphs"
    yield "cupynce.ops._graphs", "VARIANTS", "graph_variants"


@pytest.mark.parametrize("module,name,field", list(_old_switches()))
def test_0_2_switch_attributes_reach_the_config_with_a_warning(monkeypatch, module, name, field):
    monkeypatch.setattr(cfg, "_global", cfg.get())
    mod = importlib.import_module(module)
    default = getattr(cfg.get(), field)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} is deprecated since cupynce "
                                                rf"0\.3 and goes in 0\.4; read cupynce\.config"):
        assert getattr(mod, name) == default
    if default is None or isinstance(default, bool):
        new = not default if default is not None else False
    elif isinstance(default, frozenset):
        new = frozenset({"lse"})
    elif isinstance(default, str):
        new = "fp32"
    else:
        new = 2 * default + 1 if isinstance(default, int) else 2 * default
    with pytest.warns(DeprecationWarning, match=rf"use cupynce\.config\.set\({field}=\.\.\.\)"):
        setattr(mod, name, new)
    assert getattr(cfg.get(), field) == new
    with pytest.warns(DeprecationWarning):
        delattr(mod, name)  # (a monkeypatch's undo: back to the environment's value)
    assert getattr(cfg.get(), field) == default


@pytest.mark.parametrize("old,name,new", [
    ("cupynce._engine.blas", "gemm", "cupynce._engine.gemm.cublas"),
    ("cupynce._engine.blas", "plan_rows", "cupynce._engine.workspace"),
    ("cupynce._engine.blas", "leading_dim", "cupynce._engine.arrays"),
    ("cupynce._engine.tiles", "grid_splits", "cupynce._engine.tiling"),
    ("cupynce._engine.tiles", "tile_lse", "cupynce._engine.losses.score_tiles"),
    ("cupynce._engine.tiles_tf32", "mm", "cupynce._engine.gemm.tf32x3"),
    ("cupynce._engine.tiles_tf32", "h_block", "cupynce._engine.losses.nt_xent_tf32"),
    ("cupynce._engine.tiles_f16x3", "split_rows", "cupynce._engine.gemm.f16x3"),
    ("cupynce._engine.products_tf32", "same_stream", "cupynce._engine.gemm.chooser"),
    ("cupynce._engine.blocks", "clip", "cupynce._engine.losses.row_blocks"),
    ("cupynce._engine.blocks", "col_lse", "cupynce._engine.losses.stats"),
])
def test_dissolved_modules_point_to_the_new_homes(old, name, new):
    mod = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"use {new}\.{name}$"):
        got = getattr(mod, name)
    assert got is getattr(importlib.import_module(new), name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match=r"has no attribute 'nothing_here'"):
            getattr(mod, "nothing_here")
