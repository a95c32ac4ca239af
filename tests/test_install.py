"""Packaging: a non-editable install ships kernels_src and finds it; the CLI runs on the CPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``pip install --no-deps .`` (not editable) into a fresh target folder."""
    target = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
           "--target", str(target), str(ROOT)]
    try:
        import setuptools  # noqa: F401
        cmd.insert(4, "--no-build-isolation")  # no network needed when setuptools is here
    except ImportError:
        pass
    subprocess.run(cmd, check=True, cwd=target)
    return target


def test_installed_copy_finds_and_compiles_kernels(installed):
    code = (
        "import cupynce, cupynce._engine.kernels as k, pathlib;"
        "d = k.kernels_dir();"
        f"assert str(d).startswith({str(installed)!r}), d;"
        "assert (d / 'contrastive.cu').is_file() and (d / 'common.cuh').is_file();"
        "print(len(k.compile_source('contrastive.cu', 'sm_90')))"
    )
    env = dict(os.environ, PYTHONPATH=str(installed))
    out = subprocess.run([sys.executable, "-c", code], cwd=installed, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 1000


def test_import_needs_no_cupy_or_torch(installed):
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['torch'] = None;"
            "import cupynce, numpy as np;"
            "print(float(cupynce.nt_xent(np.ones((4, 3), np.float32))))")
    env = dict(os.environ, PYTHONPATH=str(installed))
    out = subprocess.run([sys.executable, "-c", code], cwd=installed, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "torch" not in out.stderr


def test_cli_self_check_runs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cupynce", "check", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "self-check: all passed" in out.stdout
