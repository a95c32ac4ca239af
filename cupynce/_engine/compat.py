"""The 0.2 engine module attributes, for one release: reading or setting a switch the docs
named (``products_tf32.USE_F16X3 = False``, ``tiles.USE_TILES``, ``side.ENABLED``, ...)
still works in 0.3 and warns (``DeprecationWarning``), pointing at :mod:`cupynce.config`.

The modules of 0.2 that the re-layout of issue 53 dissolved (``blas``, ``blocks``, ``tiles``,
``tiles_tf32``, ``tiles_f16x3``, ``products_tf32``) are registered under their old names as
stand-ins (:func:`install`, run when ``cupynce._engine`` is imported): a switch maps to its
config field, any other name is looked up in the modules that hold it now (with the same
warning).  The modules that remain (``side``, ``splade``, ``arrays``, ``ops._graphs``) call
:func:`legacy_switches` for theirs.  To be removed in 0.4.
"""
from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Dict, Mapping, Sequence, Tuple

from .. import config

#: old module -> ({old switch: config field}, modules holding its other names now)
DISSOLVED: Dict[str, Tuple[Mapping[str, str], Sequence[str]]] = {
    "cupynce._engine.blas": (
        {"FLOAT32_PRECISION": "float32_precision", "SMALL_GEMM_MACS": "small_gemm_macs",
         "SMALL_GEMM_MAX_K": "small_gemm_max_k",
         "DEFAULT_WORKSPACE_BYTES": "default_workspace_bytes",
         "FREE_MEMORY_FRACTION": "free_memory_fraction",
         "SMALL_BLOCK_BYTES": "small_block_bytes"},
        ("cupynce._engine.gemm.cublas", "cupynce._engine.workspace", "cupynce._engine.arrays",
         "cupynce.config")),
    "cupynce._engine.tiles": (
        {"USE_TILES": "tiles", "USE_WGMMA": "wgmma", "USE_WSTILE": "ws_tiles",
         "WS_STAGES": "ws_stages", "WS_AR_MIN_STAGES": "ws_ar_min_stages",
         "WS_MAX_STAGES": "ws_max_stages", "SYMMETRIC_LSE": "symmetric_lse",
         "SYMMETRIC_LSE_MIN_ND": "symmetric_lse_min_nd", "SYMMETRIC_H": "symmetric_h",
         "TILE_WORKSPACE_BYTES": "tile_workspace_bytes"},
        ("cupynce._engine.tiling", "cupynce._engine.losses.score_tiles")),
    "cupynce._engine.products_tf32": (
        {"USE_F16X3": "f16x3", "SIDE_SPLITS": "side_splits",
         "AUTO_MIN_DIM_SCALE": "tf32x3_min_dim_scale", "AUTO_MIN_DIM": "tf32x3_min_dim"},
        ("cupynce._engine.gemm.chooser",)),
    "cupynce._engine.tiles_tf32": (
        {"AUTO_MIN_ROWS": "tf32x3_min_rows", "AUTO_MIN_DIM": "tf32x3_min_dim",
         "MM_INTERLEAVE": "mm_interleave"},
        ("cupynce._engine.losses.nt_xent_tf32", "cupynce._engine.gemm.tf32x3")),
    "cupynce._engine.tiles_f16x3": (
        {"TRUNC": "f16x3_trunc"}, ("cupynce._engine.gemm.f16x3",)),
    "cupynce._engine.blocks": (
        {}, ("cupynce._engine.losses.row_blocks", "cupynce._engine.losses.stats")),
}


def _warn(module: str, name: str, new: str) -> None:
    warnings.warn(f"{module}.{name} is deprecated since cupynce 0.3 and goes in 0.4; {new}",
                  DeprecationWarning, stacklevel=3)


class _Switches(types.ModuleType):
    """A module whose old switch attributes read and set :mod:`cupynce.config` (and, for a
    dissolved module, whose other names come from their new homes)."""

    _switches: Mapping[str, str] = {}
    _homes: Sequence[str] = ()

    def __getattr__(self, name: str):
        if name.startswith("__"):  # (module machinery probes: __file__, __path__, ...)
            raise AttributeError(name)
        switches = type(self)._switches
        if name in switches:
            _warn(self.__name__, name, f"read cupynce.config.get().{switches[name]}")
            return getattr(config.get(), switches[name])
        found = [(home, vars(importlib.import_module(home))[name]) for home in type(self)._homes
                 if name in vars(importlib.import_module(home))]
        if found:  # (the module that defines it, where one home only imports it)
            home, obj = next(((h, o) for h, o in found if getattr(o, "__module__", None) == h),
                             found[0])
            _warn(self.__name__, name, f"use {home}.{name}")
            return obj
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        switches = type(self)._switches
        if name in switches:
            _warn(self.__name__, name, f"use cupynce.config.set({switches[name]}=...)")
            config.set(**{switches[name]: value})
            return
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        switches = type(self)._switches
        if name in switches:  # (back to the environment's value: e.g. a monkeypatch's undo)
            _warn(self.__name__, name, f"use cupynce.config.set({switches[name]}=...)")
            config.set(**{switches[name]: getattr(config.Config.from_env(), switches[name])})
            return
        super().__delattr__(name)


def _switch_class(switches: Mapping[str, str], homes: Sequence[str] = ()) -> type:
    return type("_Switches", (_Switches,), {"_switches": dict(switches), "_homes": tuple(homes)})


def legacy_switches(module_name: str, switches: Mapping[str, str]) -> None:
    """Make the module ``module_name`` (importing, so in ``sys.modules``) map its 0.2 switch
    attributes ``switches`` (old name -> config field) to :mod:`cupynce.config`."""
    sys.modules[module_name].__class__ = _switch_class(switches)


def install() -> None:
    """Register a stand-in module under each dissolved module's old name (once)."""
    for name, (switches, homes) in DISSOLVED.items():
        if name in sys.modules:
            continue
        mod = _switch_class(switches, homes)(name, f"0.2's {name}, dissolved in 0.3 (see "
                                                    f"cupynce._engine.compat)")
        sys.modules[name] = mod


install()
