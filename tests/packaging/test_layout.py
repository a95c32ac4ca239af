"""The package layout: layers import only downwards, and the module paths before the split by op
still work (with a DeprecationWarning) for one release."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import cupynce

PKG = Path(cupynce.__file__).resolve().parent

#: package folder -> the cupynce subpackages its modules must not import (the layers above it)
FORBIDDEN = {
    "_engine": ("cupynce.ops", "cupynce.torch", "cupynce.report"),
    "ops": ("cupynce.torch", "cupynce.report"),
    "torch": ("cupynce.report",),
}


def _imports(path: Path, package: str):
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    parts = package.split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(parts[:len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            yield mod
            for alias in node.names:  # "from . import x" imports module x
                yield f"{mod}.{alias.name}"


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_layers_import_only_downwards(folder):
    bad = []
    for path in sorted((PKG / folder).rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        package = ".".join(rel.parts[:-1])  # (an __init__ is its own package)
        for name in _imports(path, package):
            if name.startswith(FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(PKG)} imports {name}")
    assert not bad, bad


def test_import_cupynce_needs_neither_cupy_nor_torch():
    code = ("import sys, cupynce, cupynce.ops, cupynce._engine; "
            "assert 'cupy' not in sys.modules and 'torch' not in sys.modules, "
            "[m for m in ('cupy', 'torch') if m in sys.modules]")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("old,names", [
    ("cupynce.contrastive", ["Context", "nt_xent", "nt_xent_forward", "nt_xent_backward",
                             "nt_xent_backward_from_stats", "info_nce", "info_nce_forward",
                             "info_nce_backward", "info_nce_backward_from_stats", "clip_loss",
                             "clip_loss_forward", "clip_loss_backward",
                             "clip_loss_backward_from_stats"]),
    ("cupynce.splade", ["splade_pool", "splade_pool_forward", "splade_pool_backward",
                        "splade_pool_backward_from_stats", "flops_regularizer",
                        "flops_regularizer_backward", "ACTIVATIONS", "DEFAULT_WORKSPACE_BYTES",
                        "NUMPY_WORKSPACE_BYTES"]),
])
def test_old_module_paths_reexport_with_a_warning(old, names):
    """A fresh interpreter: importing the old path warns once, and every public name of the
    old module is the object :mod:`cupynce` (or its op module) exports."""
    code = (
        "import importlib, warnings, cupynce\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        f"    m = importlib.import_module({old!r})\n"
        "assert any(issubclass(x.category, DeprecationWarning) and 'deprecated' in str(x.message)"
        " for x in w), [str(x.message) for x in w]\n"
        f"for name in {names!r}:\n"
        "    obj = getattr(m, name)\n"
        "    if hasattr(cupynce, name):\n"
        "        assert obj is getattr(cupynce, name), name\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
