"""Shared test configuration: the ``gpu`` marker skips (visibly) without CuPy and a CUDA GPU."""
import os

import pytest


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
