"""The release wheel's prebuilt cubins on a GPU: each loads, gives the bits a run-time build
gives, a refused cubin falls back to compiling, and processes starting together compile a
module once.

The cubins are built here for this GPU's compute capability by the release step
(``cupynce._engine.build``) into a temporary folder that stands in for ``cupynce/_cubins``;
each check runs in a fresh process with an empty kernel cache, as on a new machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

#: a child: point the loader at the cubins folder, record NVRTC builds and cubin loads, run
#: every op once (forward + backward) and print what it did and the outputs' bytes' hashes
_CHILD = textwrap.dedent('''
    import hashlib, json, sys
    import cupy as cp, numpy as np
    from pathlib import Path
    from cupynce._engine import kernels
    from cupynce.report.ops import REGISTRY, np_dtype

    kernels.PREBUILT_DIR = Path(sys.argv[1])
    built, loaded = [], []
    compile_source, load_cubin = kernels.compile_source, kernels._load_cubin
    kernels.compile_source = lambda f, *a, **k: built.append(f) or compile_source(f, *a, **k)
    kernels._load_cubin = lambda p: loaded.append(p.name) or load_cubin(p)
    import cupy.cuda.compiler as cc
    nvrtc = cc._compile_using_nvrtc_no_warning
    cc._compile_using_nvrtc_no_warning = lambda *a, **k: built.append("cupy") or nvrtc(*a, **k)

    digests = {}
    for op, dtype, shape in json.loads(sys.argv[2]):
        spec, dt = REGISTRY[op], np_dtype(dtype)
        inputs = spec.inputs(cp, shape, dt, check=True)
        grad = spec.grad(cp, shape, dt, check=True)
        out, grads = spec.run(inputs, shape, grad, check=False)
        h = hashlib.sha256()
        for x in (out, *grads):
            h.update(cp.asnumpy(cp.ascontiguousarray(cp.asarray(x))).tobytes())
        digests[f"{op}/{dtype}"] = h.hexdigest()
    print(json.dumps({"built": built, "loaded": loaded, "digests": digests}))
''')

#: (op, dtype, shape): the tile paths (16-bit, N >= 4096 on Hopper), the row blocks, SPLADE
CASES = [
    ("nt_xent", "bfloat16", {"n": 4096, "d": 128}),
    ("nt_xent", "float32", {"n": 4096, "d": 128}),
    ("info_nce", "float16", {"n": 1030, "d": 100}),
    ("clip_loss", "bfloat16", {"n": 4096, "d": 128}),
    ("clip_loss", "float32", {"n": 4096, "d": 128}),
    ("siglip_loss", "bfloat16", {"n": 4096, "d": 128}),
    ("clip_loss", "float64", {"n": 256, "d": 64}),
    ("splade_pool", "bfloat16", {"b": 4, "l": 32, "d": 64, "v": 1000,
                                 "activation": "log1p_relu"}),
]


def _capability():
    import cupy

    return cupy.cuda.Device().compute_capability


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    from cupynce._engine import build

    out = tmp_path_factory.mktemp("cubins")
    build.build(out, (_capability(),))
    return out


def _child(folder, cache, prebuilt=True):
    env = dict(os.environ, CUPY_CACHE_DIR=str(cache), CUPYNCE_PREBUILT="1" if prebuilt else "0")
    res = subprocess.run([sys.executable, "-c", _CHILD, str(folder), json.dumps(CASES)],
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_every_module_has_a_loadable_cubin(cubins):
    import cupy

    from cupynce._engine import kernels

    for filename in kernels.module_files():
        path = cubins / kernels.prebuilt_name(filename, kernels.build_arch(filename, _capability()))
        assert path.is_file(), path
        mod = kernels._load_cubin(path)
        assert isinstance(mod, cupy.RawModule), filename


def test_prebuilt_cubins_give_the_run_time_build_bits(cubins, tmp_path):
    """A fresh process with the prebuilt cubins compiles nothing of cupynce's and gets the bits
    of a fresh process that compiles everything at run time."""
    pre = _child(cubins, tmp_path / "cache_a")
    jit = _child(cubins, tmp_path / "cache_b", prebuilt=False)
    assert not [b for b in pre["built"] if b != "cupy"], pre["built"]
    assert pre["loaded"], "no prebuilt cubin was loaded"
    assert jit["built"], "the run-time build compiled nothing"
    assert pre["digests"] == jit["digests"]


def test_a_refused_cubin_falls_back_to_compiling(cubins, tmp_path):
    """A cubin the driver refuses (here: not an image at all, as a cubin from a newer NVRTC
    than the driver is to it) is skipped, and the module compiles at run time."""
    from cupynce._engine import kernels

    bad = tmp_path / "bad"
    bad.mkdir()
    for path in cubins.glob("*.cubin"):
        (bad / path.name).write_bytes(b"\x7fELF" + b"\0" * 256)
    assert kernels._load_cubin(next(bad.glob("*.cubin"))) is None
    res = _child(bad, tmp_path / "cache")
    assert res["built"], "nothing was compiled after the refused cubins"


_ONCE = textwrap.dedent('''
    import sys, time, json
    import cupy
    from cupynce._engine import kernels
    import cupy.cuda.compiler as cc
    built = []
    cs, nv = kernels.compile_source, cc._compile_using_nvrtc_no_warning
    kernels.compile_source = lambda *a, **k: built.append(1) or cs(*a, **k)
    cc._compile_using_nvrtc_no_warning = lambda *a, **k: built.append(1) or nv(*a, **k)
    while time.time() < float(sys.argv[2]):  # start together
        pass
    kernels._loader(sys.argv[1])()
    print(json.dumps(len(built)))
''')


@pytest.mark.parametrize("filename", ["products/blas.cu", "splade/splade_wgmma.cu"])
def test_processes_starting_together_compile_a_module_once(filename, tmp_path):
    """Four processes (DDP ranks sharing a cache folder) load one module at the same moment
    with no prebuilt cubin: one compiles it, the others load what it wrote."""
    import time

    env = dict(os.environ, CUPY_CACHE_DIR=str(tmp_path / "cache"), CUPYNCE_PREBUILT="0")
    start = str(time.time() + 8)  # after the four interpreters have imported CuPy
    procs = [subprocess.Popen([sys.executable, "-c", _ONCE, filename, start], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    counts = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        counts.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(counts) == [0, 0, 0, 1], counts
