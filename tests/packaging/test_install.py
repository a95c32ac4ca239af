"""Packaging: a non-editable install ships kernels_src and finds it; the CLI runs on the CPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

# one worker for the whole module: `pip install .` builds in the checkout's build/ folder
pytestmark = pytest.mark.xdist_group("install")
ROOT = Path(__file__).resolve().parents[2]


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
        "assert (d / 'losses' / 'stats.cu').is_file();"
        "assert (d / 'include' / 'common.cuh').is_file();"
        # products/blas.cu: the smallest module that pastes a header (test_kernels_compile
        # builds all)
        "print(len(k.compile_source('products/blas.cu', 'sm_90')))"
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


# ------------------------------------------------------------------------------------------
# the wheel: what `pip install` gives is what the source tree has
# ------------------------------------------------------------------------------------------
#: what a wheel is built from (a copy: no stale build/ folder, no local _cubins)
_TREE = ("cupynce", "kernels_src", "setup.py", "setup.cfg", "pyproject.toml", "README.md",
         "LICENSE")
#: the capability the CPU test prebuilds (every module, the smallest complete build)
_CPU_CAPABILITY = "80"


def _source_modules():
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cupynce").rglob("*.py")
                  if "__pycache__" not in p.parts)


def _kernel_sources():
    """Every kernels_src/**/*.cu(h), as its path relative to kernels_src."""
    src = ROOT / "kernels_src"
    return sorted(p.relative_to(src).as_posix() for p in src.rglob("*")
                  if p.suffix in (".cu", ".cuh"))


def _build_wheel(dest, capabilities=()):
    """``pip wheel --no-deps`` of a clean copy of the tree, after the release step's
    ``python -m cupynce._engine.build`` for ``capabilities`` (none: a plain source wheel)."""
    import shutil

    tree = dest / "tree"
    tree.mkdir()
    for name in _TREE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tree / name,
                            ignore=shutil.ignore_patterns("__pycache__", "_cubins", "*.pyc"))
        else:
            shutil.copy2(src, tree / name)
    if capabilities:
        cmd = [sys.executable, "-m", "cupynce._engine.build"]
        for cc in capabilities:
            cmd += ["--capability", cc]
        env = dict(os.environ, PYTHONPATH=str(tree))
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, timeout=900)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(tree)]
    try:
        import setuptools  # noqa: F401
        cmd.insert(4, "--no-build-isolation")  # no network needed when setuptools is here
    except ImportError:
        pass
    subprocess.run(cmd, check=True, cwd=dest, capture_output=True, timeout=600)
    (wheel,) = dest.glob("cupynce-*.whl")
    return wheel


@pytest.fixture(scope="module")
def release_wheel(tmp_path_factory):
    """A wheel built as a release is: sm_80 cubins for every module (the CPU test's share of
    PREBUILT_CAPABILITIES), then ``pip wheel``."""
    pytest.importorskip("cupy")  # the release step compiles with NVRTC (the cuda12 extra)
    return _build_wheel(tmp_path_factory.mktemp("wheel"), (_CPU_CAPABILITY,))


def test_wheel_holds_every_module_and_kernel_source(release_wheel):
    import zipfile

    names = set(zipfile.ZipFile(release_wheel).namelist())
    missing = [m for m in _source_modules() if m not in names]
    assert not missing, f"modules of the source tree missing from the wheel: {missing}"
    missing = [k for k in _kernel_sources() if f"cupynce/kernels_src/{k}" not in names]
    assert not missing, f"kernel sources missing from the wheel: {missing}"
    assert "cupynce/integrations/open_clip.py" in names  # the module the 0.1 wheel left out


def test_wheel_holds_a_cubin_for_every_kernel_module(release_wheel):
    """One sm_80 cubin per ``kernels_src/**/*.cu``, named as the loader looks it up (the hash
    of the source it would compile), and an ELF image for a CUDA GPU."""
    import zipfile

    from cupynce._engine import kernels

    wheel = zipfile.ZipFile(release_wheel)
    cubins = {n.rsplit("/", 1)[1]: n for n in wheel.namelist() if n.endswith(".cubin")}
    assert all(n.startswith("cupynce/_cubins/") for n in cubins.values()), cubins
    src = ROOT / "kernels_src"
    modules = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.cu"))
    assert len(cubins) == len(modules), sorted(cubins)
    for filename in modules:
        name = kernels.prebuilt_name(filename, kernels.build_arch(filename, _CPU_CAPABILITY))
        assert name in cubins, f"{filename}: no {name} in the wheel"
        image = wheel.read(cubins[name])
        assert image[:4] == b"\x7fELF", filename
        assert int.from_bytes(image[18:20], "little") == 190, filename  # e_machine EM_CUDA


def test_plain_source_wheel_has_no_cubins(tmp_path):
    """``pip wheel .`` on a checkout without the release step: no cubins (JIT at first use)."""
    import zipfile

    wheel = _build_wheel(tmp_path)
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".cubin")]


# ------------------------------------------------------------------------------------------
# the tests themselves run the installed copy
# ------------------------------------------------------------------------------------------
def _public_modules():
    import pkgutil

    import cupynce

    return sorted(m.name for m in pkgutil.walk_packages(cupynce.__path__, "cupynce.")
                  if not m.name.rsplit(".", 1)[-1].startswith("__"))


def test_cupynce_is_the_installed_copy():
    """README's test command installs non-editably and runs ``.venv/bin/pytest``, so the
    checkout is not on ``sys.path``: ``import cupynce`` is site-packages'.  Set
    ``CUPYNCE_TEST_CHECKOUT=1`` to run the suite on a checkout on purpose (this test then
    says so and skips)."""
    import cupynce

    where = Path(cupynce.__file__).resolve()
    if os.environ.get("CUPYNCE_TEST_CHECKOUT") == "1":
        pytest.skip(f"CUPYNCE_TEST_CHECKOUT=1: testing the checkout on purpose ({where})")
    assert where.parent != ROOT / "cupynce", (
        f"cupynce was imported from the checkout ({where}), not the installed package: run "
        f"README's test command (a non-editable install, then .venv/bin/pytest)")
    assert "site-packages" in where.parts or "dist-packages" in where.parts, where


def test_every_module_imports_from_one_copy():
    """Every module of the package, the adapters included, imports from the same copy as
    ``cupynce`` (a wheel that left one out would fail here, as would a mix of two copies)."""
    import importlib

    import cupynce

    base = Path(cupynce.__file__).resolve().parent
    names = _public_modules()
    assert "cupynce.integrations.open_clip" in names
    if any(n.startswith(("cupynce.torch", "cupynce.integrations")) for n in names):
        pytest.importorskip("torch")  # (the adapters need torch alone, not their libraries)
    for name in names:
        mod = importlib.import_module(name)
        assert base in Path(mod.__file__).resolve().parents, (name, mod.__file__)
