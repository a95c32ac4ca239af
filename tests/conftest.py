"""Shared test configuration: what the tests import by name goes on ``sys.path``; the ``gpu``
marker skips (visibly) without CuPy and a CUDA GPU."""
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

# The tests are in folders by subject (tests/ops, tests/engine, tests/torch, ...).  pytest runs
# in its "importlib" import mode (setup.cfg), which puts nothing on sys.path: its default
# "prepend" mode would put tests/ there (for this file), where the folder tests/torch passes
# for torch wherever torch is not installed (a namespace package: importorskip("torch") would
# not skip).  What the tests import by name goes on sys.path here instead: tests/_support (the
# helper modules) and each folder of test files, so that a test module imports another's
# helpers -- and a process spawned by a test (the torch.distributed ranks) imports its module
# -- by the file's name, from any folder.  With consider_namespace_packages (setup.cfg) pytest
# imports a test file under that same name, not as a second copy; so a test file's name must
# be unique across the folders (checked here).  The checkout's root is never added: the suite
# tests the installed package.
_TESTS = Path(__file__).resolve().parent
_FILES = sorted(_TESTS.rglob("test_*.py"))
_SAME = sorted(name for name, n in Counter(p.name for p in _FILES).items() if n > 1)
if _SAME:
    raise RuntimeError(f"test files share a name (each is imported by its name): {_SAME}")
_FOLDERS = [_TESTS / "_support", *sorted({p.parent for p in _FILES})]
sys.path[:0] = [str(f) for f in _FOLDERS if str(f) not in sys.path]


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The suite tests the installed package (README's test command: a non-editable install, then
# .venv/bin/pytest, which keeps the checkout off sys.path).  The subprocesses the tests start
# (``python -c``, ``python -m cupynce``) would put their working folder -- often the checkout --
# first on sys.path and import the checkout instead: PYTHONSAFEPATH (Python >= 3.11) stops
# that.  A run on the checkout on purpose sets PYTHONPATH, which this leaves alone.
os.environ.setdefault("PYTHONSAFEPATH", "1")


@pytest.fixture
def configure(monkeypatch):
    """``configure(**changes)``: ``cupynce.config.set(**changes)`` for this test only (the
    process-wide configuration comes back at teardown, whatever the test set meanwhile)."""
    import cupynce.config as cfg

    monkeypatch.setattr(cfg, "_global", cfg.get())

    def apply(**changes):
        return cfg.set(**changes)

    return apply
