"""Every CUDA source compiles (NVRTC for sm_80 / sm_90, and nvcc's PTX when on PATH) with no GPU.

The cubin must export every ``cpn_<stage>_<dtype>`` wrapper: the stages are read from the
source's ``cpn_<stage>_##SUF`` macro lines, the dtype suffixes from ``cupynce._engine.kernels``.
NVRTC needs only libnvrtc (``nvidia-cuda-nvrtc-cu12``), not a driver or a device.
"""
from __future__ import annotations

import functools
import re
import shutil
import subprocess

import numpy as np
import pytest

from cupynce._engine import kernels as _kernels
from cupynce._engine.kernels import KernelCompileError

pytest.importorskip("cupy")  # NVRTC is reached through cupy.cuda.nvrtc

ARCHS = ["sm_80", "sm_90"]
SUFFIXES = ("f16", "bf16", "f32", "f64")
_STAGE = re.compile(r"\bcpn_([A-Za-z0-9_]+?)_##SUF\b")


def _cu_files():
    return list(_kernels.module_files())


@functools.lru_cache(maxsize=None)
def _build(filename, arch, options=_kernels.NVRTC_OPTIONS):
    """(cubin, PTX) of one NVRTC compile, kept for the module: the compiles are most of the
    CPU suite's time, so each (file, arch, options) is compiled once."""
    return _kernels.compile_source(filename, arch, options, with_ptx=True)


def _cubin(filename, arch):
    return _build(filename, arch)[0]


def _stages(filename):
    return sorted(set(_STAGE.findall((_kernels.kernels_dir() / filename).read_text())))


_DTYPES_LINE = re.compile(r"^// cpn-dtypes:\s*(.+)$", re.M)


def _suffixes(filename):
    """The dtypes a file defines wrappers for: its ``// cpn-dtypes:`` line, else all four."""
    m = _DTYPES_LINE.search((_kernels.kernels_dir() / filename).read_text())
    return tuple(m.group(1).split()) if m else SUFFIXES


def test_kernels_dir_layout():
    d = _kernels.kernels_dir()
    assert d.is_dir(), d
    assert (d / "losses/stats.cu").is_file()
    assert (d / "include/common.cuh").is_file()
    assert "losses/stats.cu" in _cu_files()


def test_dtype_suffixes_cover_supported_dtypes():
    got = {_kernels.dtype_suffix(dt) for dt in _kernels.SUPPORTED_DTYPES}
    assert got == set(SUFFIXES)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64, "not-a-dtype"])
def test_dtype_suffix_rejects_unsupported(dtype):
    with pytest.raises(ValueError, match=r"nt_xent: unsupported dtype .*; expected one of"):
        _kernels.dtype_suffix(dtype, op="nt_xent")


def test_read_source_pastes_includes():
    src = _kernels.read_source("losses/stats.cu")
    assert f"#define CPN_BLOCK {_kernels.BLOCK}" in src
    assert not re.search(r'#\s*include\s+"', src), "local includes must be pasted in"
    assert "struct __align__(2) bf16_t" in src  # from common.cuh


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", _cu_files())
def test_nvrtc_compiles_and_exports_every_kernel(filename, arch):
    cubin = _cubin(filename, arch)
    assert cubin[:4] == b"\x7fELF", "NVRTC should return a cubin (ELF)"
    assert _stages(filename), f"no cpn_<stage>_##SUF wrappers found in {filename}"
    missing = _missing_symbols(filename, cubin)
    assert not missing, f"{filename} ({arch}): symbols missing from the cubin: {missing}"


def _missing_symbols(filename, cubin):
    """The ``cpn_<stage>_<dtype>`` wrappers of ``filename`` that ``cubin`` does not export."""
    return [f"cpn_{st}_{suf}" for st in _stages(filename) for suf in _suffixes(filename)
            if f"cpn_{st}_{suf}".encode() + b"\x00" not in cubin]


#: kernels written without the ``cpn_<stage>_##SUF`` macros (one dtype), by file
_SINGLE = {"products/blas.cu": ("cpn_split_tf32_f32", "cpn_fill_f32", "cpn_fill_f64",
                                 "cpn_mm_sum_splits_f32"),
           "splade/splade_grad.cu": ("cpn_splade_scan",),
           "losses/grads.cu": ("cpn_clip_grad_f16x3",),
           "losses/arrays.cu": ("cpn_gather_bytes",),
           "products/tiles_ws_f16x3.cu": ("cpn_f16x3_split_rows", "cpn_f16x3_colmax",
                                          "cpn_f16x3_split_t", "cpn_f16x3_split_scaled",
                                          "cpn_f16x3_split_scaled_il", "cpn_f16x3_bound_exp")}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename,name", [(f, n) for f, ns in _SINGLE.items() for n in ns])
def test_single_dtype_kernels_are_exported(filename, name, arch):
    assert name.encode() + b"\x00" in _cubin(filename, arch)


@pytest.mark.parametrize("filename", sorted(_kernels.ARCH_SPECIFIC))
def test_arch_specific_file_builds_for_sm90a(filename):
    """Files with Hopper-only code also build for sm_90a (what the loader does on Hopper), and
    only that build holds the wgmma instructions (elsewhere those functions trap)."""
    cubin, ptx = _build(filename, "sm_90a", _kernels.BUILD_OPTIONS)
    assert cubin[:4] == b"\x7fELF"
    missing = _missing_symbols(filename, cubin)
    assert not missing, f"{filename} (sm_90a): symbols missing from the cubin: {missing}"
    assert b"wgmma.mma_async" in ptx
    assert b"wgmma.mma_async" not in _build(filename, "sm_90")[1]  # (the plain sm_90 build)


#: engine module -> {name of a file constant in launch(<const>, "<stage>", ...): file}
_LAUNCHERS = {"arrays.py": {"FILE": "losses/arrays.cu"},
              "losses/row_blocks.py": {"STATS_FILE": "losses/stats.cu",
                                       "GRADS_FILE": "losses/grads.cu"},
              "losses/stats.py": {"FILE": "losses/stats.cu"},
              "losses/score_tiles.py": {"FILE": "losses/tiles.cu",
                                        "ROWS_FILE": "losses/stats.cu"}}


@pytest.mark.parametrize("module,const,filename",
                         [(m, c, f) for m, cs in _LAUNCHERS.items() for c, f in cs.items()])
def test_python_launches_only_existing_stages(module, const, filename):
    """Every stage that an engine module launches from a file exists in that file."""
    py = (_kernels.Path(_kernels.__file__).parent / module).read_text()
    launched = set(re.findall(r'launch\(' + const + r',\s*"([A-Za-z0-9_]+)"', py))
    assert launched, f"no launches of {filename} found in {module}"
    assert launched <= set(_stages(filename)), launched - set(_stages(filename))


def test_python_launches_only_existing_wstile_stages():
    """score_tiles.ws_launch builds cpn_wstile_<stage> from config.ws_stages: each exists."""
    import cupynce.config as cfg
    from cupynce._engine.losses import score_tiles

    assert ({f"wstile_{s}" for s in cfg.current().ws_stages}
            <= set(_stages(score_tiles.WS_FILE)))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("filename", _cu_files())
def test_nvcc_compiles(filename, tmp_path):
    src = tmp_path / filename
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(_kernels.read_source(filename))
    # PTX only: nvcc's front end and optimiser are what can differ from NVRTC's; the PTX
    # assembler's pass is the one the NVRTC tests above already run (half of nvcc's time)
    ptx = tmp_path / (filename + ".ptx")
    res = subprocess.run(["nvcc", "-arch=compute_90", "-std=c++14", "-ptx", str(src),
                          "-o", str(ptx)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"nvcc failed on {filename}:\n{res.stderr}"
    data = ptx.read_bytes()
    for st in _stages(filename):
        for suf in _suffixes(filename):
            assert f".entry cpn_{st}_{suf}(".encode() in data, \
                f"cpn_{st}_{suf} missing from nvcc output"


BROKEN = """#include "common.cuh"
extern "C" __global__ void cpn_broken_f32(float* x) { x[0] = undeclared_thing_42; }
"""


@pytest.mark.parametrize("arch", ARCHS)
def test_broken_source_raises_kernel_compile_error(tmp_path, monkeypatch, arch):
    (tmp_path / "broken.cu").write_text(BROKEN)
    (tmp_path / "common.cuh").write_text("#pragma once\ntypedef long long i64;\n")
    monkeypatch.setattr(_kernels, "kernels_dir", lambda: tmp_path)
    with pytest.raises(KernelCompileError) as info:
        _kernels.compile_source("broken.cu", arch)
    msg = str(info.value)
    assert "kernels_src/broken.cu" in msg and arch in msg, msg
    assert "undeclared_thing_42" in msg, f"the NVRTC log is missing from the message:\n{msg}"
    assert "error" in msg.lower(), msg
    assert isinstance(info.value, RuntimeError)


def test_broken_header_raises_kernel_compile_error(tmp_path, monkeypatch):
    (tmp_path / "ok.cu").write_text('#include "bad.cuh"\n'
                                    'extern "C" __global__ void cpn_ok_f32(float* x) {}\n')
    (tmp_path / "bad.cuh").write_text("this is not C++;\n")
    monkeypatch.setattr(_kernels, "kernels_dir", lambda: tmp_path)
    with pytest.raises(KernelCompileError, match=r"kernels_src/ok\.cu failed to compile"):
        _kernels.compile_source("ok.cu", "sm_90")
