"""The package layout: layers import only downwards, no module imports itself back through
others (no import cycle), and the module paths before the split by op still work (with a
DeprecationWarning) for one release."""
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


def _modules():
    """Every module of the package: dotted name -> (path, whether it is a package)."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def import_graph():
    """cupynce's modules -> the cupynce modules each imports anywhere in its source (at the
    top or inside a function), relative imports resolved.  ``from pkg import name`` imports
    the submodule ``pkg.name`` where there is one, else ``pkg`` itself; the parent packages
    that Python initialises on the way are not counted (every module would sit in a cycle
    with its package's ``__init__``)."""
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, (path, package) in modules.items():
        here = (name if package else name.rpartition(".")[0]).split(".")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1])
                    src = f"{base}.{node.module}" if node.module else base
                else:
                    src = node.module or ""
                for alias in node.names:
                    target = f"{src}.{alias.name}"
                    if target in modules:
                        graph[name].add(target)
                    elif src in modules:
                        graph[name].add(src)
    return graph


def import_cycles(graph, scope: str):
    """The import cycles among the modules in ``scope`` (a package and its submodules): one
    cycle, as ``a -> b -> ... -> a``, through each strongly connected component of more than
    one module (or a module that imports itself)."""
    inside = {m for m in graph if m == scope or m.startswith(scope + ".")}
    edges = {m: sorted(t for t in graph[m] if t in inside) for m in sorted(inside)}
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1 or v in edges[v]:
                components.append(component)

    for m in edges:
        if m not in index:
            visit(m)
    cycles = []
    for component in components:
        start = min(component)
        paths = {start: [start]}  # breadth first: the shortest way back to start
        queue = [start]
        while queue:
            v = queue.pop(0)
            nxt = [w for w in edges[v] if w in component]
            if start in nxt:
                cycles.append(" -> ".join(paths[v] + [start]))
                break
            for w in nxt:
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return sorted(cycles)


@pytest.mark.parametrize("scope", [
    "cupynce._engine", "cupynce._engine.gemm", "cupynce._engine.losses", "cupynce.ops",
    "cupynce.torch", "cupynce.report", "cupynce.integrations",
    pytest.param("cupynce", id="cupynce (the whole package)"),
])
def test_no_import_cycle(scope):
    """No module of ``scope`` imports itself back through others, at the top of a module or
    inside a function (a function-local import that only postpones a circle is still one)."""
    cycles = import_cycles(import_graph(), scope)
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_import_cycles_are_found():
    """The cycle finder on a small graph: two cycles, one self-import, one chain."""
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a", "p.d"}, "p.d": set(),
             "p.e": {"p.e"}, "p.f": {"p.a"}, "q.a": {"q.b"}, "q.b": {"q.a"}}
    assert import_cycles(graph, "p") == ["p.a -> p.b -> p.c -> p.a", "p.e -> p.e"]
    assert import_cycles(graph, "q") == ["q.a -> q.b -> q.a"]
    assert import_cycles(graph, "p.d") == []


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


#: past this many lines a module is split (modules named by responsibility: docs/design.md)
MAX_MODULE_LINES = 800


def test_modules_stay_under_the_split_size():
    long = {str(p.relative_to(PKG.parent)): n for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules past {MAX_MODULE_LINES} lines (split them): {long}"
