"""README's examples run as written, on the installed copy: each ```python block in a fresh
process whose working folder is not the checkout.  A block that uses CuPy needs a GPU (it is
marked ``gpu``: skipped, and reported so, without one); the others run on the CPU here and on
the GPU where there is one."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def _blocks():
    text = (ROOT / "README.md").read_text()
    out = []
    for i, m in enumerate(_BLOCK.finditer(text)):
        code = m.group(1)
        marks = [pytest.mark.gpu] if re.search(r"^import cupy|^\s*import cupy", code, re.M) else []
        line = text[:m.start()].count("\n") + 1
        out.append(pytest.param(code, id=f"line{line}", marks=marks))
    return out


def test_readme_has_three_examples():
    assert len(_blocks()) == 3


@pytest.mark.parametrize("code", _blocks())
def test_readme_example_runs(code, tmp_path):
    needs = [m for m in ("torch", "cupy") if re.search(rf"\b{m}\b", code)]
    for mod in needs:
        pytest.importorskip(mod)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if os.environ.get("CUPYNCE_TEST_CHECKOUT") == "1":  # the suite runs on a checkout on purpose
        env["PYTHONPATH"] = os.environ.get("PYTHONPATH", str(ROOT))
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
