"""The release step: compile every kernel module to cubins for the wheel (no GPU needed).

``python -m cupynce._engine.build`` writes ``cupynce/_cubins/<stem>_<arch>_<key>.cubin`` for
each ``kernels_src/<folder>/*.cu`` and each compute capability of
:data:`~cupynce._engine.kernels.PREBUILT_CAPABILITIES` (sm_80, sm_86, sm_89, sm_90 / sm_90a),
then ``pip wheel --no-deps .`` packs them (package data).  The loader
(:mod:`cupynce._engine.kernels`) looks a cubin up by the same name, computed from the source
it would compile, so a wheel whose kernels changed after the build simply JIT-compiles the
changed modules.  Build with the oldest NVRTC the release supports (the ``cuda12`` extra's):
a cubin from a newer NVRTC than a user's driver is refused by the driver, and the loader then
falls back to compiling.

Compilation needs NVRTC only (``cupy.cuda.nvrtc`` over the ``nvidia-cuda-nvrtc`` wheel of the
``cuda12`` / ``cuda13`` extra), not a driver or a GPU; the modules compile in parallel
processes (the largest takes about a minute on one core).
"""
from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from . import kernels


def _compile_one(task: Tuple[str, str, str, str]) -> Tuple[str, float]:
    """Compile one (file, arch) from its pasted source into the cubin at ``path``; returns
    the cubin's name and the seconds taken."""
    filename, arch, source, path = task
    start = time.perf_counter()
    out = Path(path)
    kernels.write_atomic(out, kernels.compile_source(filename, arch, kernels.BUILD_OPTIONS, source))
    return out.name, time.perf_counter() - start


def build(out: Path = kernels.PREBUILT_DIR,
          capabilities: Sequence[str] = kernels.PREBUILT_CAPABILITIES,
          jobs: Optional[int] = None, verbose: bool = False) -> List[Path]:
    """Compile every module for every capability into ``out``; returns the cubins' paths.

    Each source is read once, and its cubin is named by the hash of that text (a file edited
    during the build can never leave a cubin under the wrong name).  Cubins already in
    ``out`` under the same name (same source, options and arch) are kept, and any other
    ``*.cubin`` there (an older source's) is removed, so that ``out`` holds exactly one cubin
    per (module, arch).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = {}
    for filename in kernels.module_files():
        source = kernels.read_source(filename)
        for cc in capabilities:
            arch = kernels.build_arch(filename, cc)
            name = kernels.prebuilt_name(filename, arch, source)
            wanted[name] = (filename, arch, source, str(out / name))
    for stale in out.glob("*.cubin"):
        if stale.name not in wanted:
            stale.unlink()
    todo = [task for name, task in wanted.items() if not (out / name).is_file()]
    # the largest modules first, so the pool's last minutes are not one long compile alone
    todo.sort(key=lambda t: -len(t[2]))
    with ProcessPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        for name, seconds in pool.map(_compile_one, todo):
            if verbose:
                print(f"cupynce build: {name} ({seconds:.1f} s)", flush=True)
    return sorted(out / name for name in wanted)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cupynce._engine.build",
        description="Compile every kernel module to cubins for a release wheel.")
    parser.add_argument("--out", type=Path, default=kernels.PREBUILT_DIR,
                        help="folder for the cubins (default: the package's _cubins)")
    parser.add_argument("--capability", action="append", dest="capabilities",
                        help="compute capability such as 90 (repeatable; default: "
                             + ", ".join(kernels.PREBUILT_CAPABILITIES) + ")")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compiles")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    paths = build(args.out, args.capabilities or kernels.PREBUILT_CAPABILITIES, args.jobs,
                  verbose=True)
    size = sum(p.stat().st_size for p in paths)
    print(f"cupynce build: {len(paths)} cubins, {size / 2**20:.1f} MiB in {args.out} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
