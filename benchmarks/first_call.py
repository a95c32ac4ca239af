"""The first call on a fresh machine: forward + backward of every op and dtype, cold caches.

Each case runs in its own process with an empty kernel cache (``CUPY_CACHE_DIR`` a new
folder), as a training job starts on a new machine or container.  The CUDA context and the
cuBLAS / cuBLASLt handles are made before the clock starts (the issue's only exclusions);
everything the first forward + backward does after that is timed: loading or compiling
cupynce's modules and any CuPy kernel the call needs.  Inputs are made on the host (NumPy)
and copied in, so that making them compiles nothing.  Each child also records what it
compiled (cupynce modules through NVRTC, CuPy's own kernels) and which prebuilt cubins it
loaded.

    python benchmarks/first_call.py                       # every op x dtype, core and torch
    python benchmarks/first_call.py --ops clip_loss --dtypes bfloat16 --api torch

The target of issue 52: every first forward + backward <= 2 s with the release wheel's cubins.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

OPS = ("nt_xent", "info_nce", "clip_loss", "siglip_loss", "splade_pool")
DTYPES = ("bfloat16", "float16", "float32", "float64")
SHAPES = {"splade_pool": {"b": 32, "l": 128, "d": 768, "v": 30522, "activation": "log1p_relu"}}
CONTRASTIVE = {"n": 8192, "d": 512}


def _hooks(log):
    """Record NVRTC builds (cupynce's and CuPy's) and prebuilt cubin loads into ``log``."""
    import cupy.cuda.compiler as cc

    from cupynce._engine import kernels

    def timed(kind, fn, name_of):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                log.append({"kind": kind, "name": name_of(args), "s": time.perf_counter() - t})
        return wrapper

    def cupy_name(args):  # the first kernel the source defines (CuPy's, or a RawModule's)
        m = re.search(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s*)?"
                      r"(?:void\s+)?(\w+)\s*\(", args[0])
        return m.group(1)[:60] if m else args[0][:60]

    cc._compile_using_nvrtc_no_warning = timed("cupy_nvrtc", cc._compile_using_nvrtc_no_warning,
                                               cupy_name)
    kernels.compile_source = timed("cupynce_nvrtc", kernels.compile_source, lambda a: a[0])
    kernels._load_cubin = timed("cubin_load", kernels._load_cubin, lambda a: a[0].name)


def _core_step(op, dtype):
    import cupy as cp

    from cupynce.report.ops import REGISTRY, np_dtype

    spec = REGISTRY[op]
    shape = dict(SHAPES.get(op, CONTRASTIVE))
    dt = np_dtype(dtype)
    inputs = spec.inputs(cp, shape, dt, check=True)  # host-made: no CuPy kernel compiled
    grad = spec.grad(cp, shape, dt, check=True) if op == "splade_pool" else 1.0

    def step(normalize=False):
        return spec.run(inputs, shape, grad, check=normalize)
    return step


def _torch_step(op, dtype):
    import numpy as np
    import torch

    import cupynce.torch as ct
    from cupynce.report.ops import REGISTRY, np_dtype

    spec = REGISTRY[op]
    shape = dict(SHAPES.get(op, CONTRASTIVE))
    host = spec.inputs(np, shape, np.dtype(np.float64), check=True)
    tdt = getattr(torch, dtype)

    def leaf(x, dt=tdt, grad=True):
        t = torch.from_numpy(np.asarray(x, np.float64)).cuda().to(dt)
        return t.requires_grad_(grad)

    def step(normalize=False):
        if op == "nt_xent":
            loss = ct.nt_xent(leaf(host[0]), 0.1, normalize=normalize)
        elif op == "info_nce":
            loss = ct.info_nce(leaf(host[0]), leaf(host[1]), 0.1, normalize=normalize)
        elif op == "clip_loss":
            scale = leaf(host[2], torch.float64 if dtype == "float64" else torch.float32)
            loss = ct.clip_loss(leaf(host[0]), leaf(host[1]), scale, normalize=normalize)
        elif op == "siglip_loss":
            sdt = torch.float64 if dtype == "float64" else torch.float32
            loss = ct.siglip_loss(leaf(host[0]), leaf(host[1]), leaf(host[2], sdt),
                                  leaf(host[3], sdt), normalize=normalize)
        else:
            x, w, b = (leaf(a) for a in host[:3])
            mask = torch.from_numpy(np.asarray(host[3])).cuda()
            out = ct.splade_pool(x, w, b, mask, activation=shape["activation"])
            loss = out.float().sum()
        loss.backward()
        return loss
    return step


def child(op: str, dtype: str, api: str) -> dict:
    import cupy as cp

    t_import = time.perf_counter()
    import cupynce  # noqa: F401
    if api == "torch":
        import torch

        import cupynce.torch  # noqa: F401
        torch.empty(1, device="cuda")
    t_import = time.perf_counter() - t_import
    cp.cuda.Device().synchronize()  # the context
    cp.cuda.device.get_cublas_handle()  # the excluded set-up: cuBLAS (and cuBLASLt below)
    try:
        cp.cuda.device.get_cublaslt_handle()
    except AttributeError:
        pass
    if api == "torch":
        import torch
        torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # torch's cuBLAS
        torch.cuda.synchronize()
    step = _core_step(op, dtype) if api == "core" else _torch_step(op, dtype)
    cp.cuda.Device().synchronize()
    log: list = []
    _hooks(log)
    times = []
    for normalize in (False, False, True):
        t = time.perf_counter()
        step(normalize)
        cp.cuda.Device().synchronize()
        if api == "torch":
            import torch
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if len(times) == 1:
            first_log = list(log)
    by = lambda kind, entries: [e for e in entries if e["kind"] == kind]  # noqa: E731
    return {"op": op, "dtype": dtype, "api": api, "import_s": t_import,
            "first_s": times[0], "second_s": times[1], "first_normalize_s": times[2],
            "cupynce_builds": by("cupynce_nvrtc", first_log),
            "cupy_builds": by("cupy_nvrtc", first_log),
            "cubins_loaded": [e["name"] for e in by("cubin_load", first_log)],
            "normalize_cupy_builds": by("cupy_nvrtc", log[len(first_log):])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", nargs="+", default=OPS)
    ap.add_argument("--dtypes", nargs="+", default=DTYPES)
    ap.add_argument("--api", choices=("core", "torch", "both"), default="both")
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--child", nargs=3, metavar=("OP", "DTYPE", "API"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    apis = ("core", "torch") if args.api == "both" else (args.api,)
    rows = []
    print("| api | op | dtype | first fwd+bwd s | 2nd ms | cubins loaded | cupynce NVRTC "
          "builds (s) | CuPy kernel builds (s) | + normalize: CuPy builds |")
    print("|---|---|---|--:|--:|--:|---|---|---|", flush=True)
    for api in apis:
        for op in args.ops:
            for dtype in args.dtypes:
                with tempfile.TemporaryDirectory() as cache:
                    env = dict(os.environ, CUPY_CACHE_DIR=cache)
                    res = subprocess.run([sys.executable, __file__, "--child", op, dtype, api],
                                         env=env, capture_output=True, text=True)
                if res.returncode != 0:
                    print(f"| {api} | {op} | {dtype} | failed: {res.stderr[-400:]!r} |")
                    continue
                r = json.loads(res.stdout.strip().splitlines()[-1])
                rows.append(r)
                cb = r["cupynce_builds"]
                cp_ = r["cupy_builds"]
                print(f"| {api} | {op} | {dtype} | {r['first_s']:.2f} | "
                      f"{r['second_s'] * 1e3:.1f} | "
                      f"{len(r['cubins_loaded'])} | {len(cb)} ({sum(e['s'] for e in cb):.1f}) | "
                      f"{len(cp_)} ({sum(e['s'] for e in cp_):.2f}): "
                      f"{', '.join(sorted(set(e['name'] for e in cp_)))[:120]} | "
                      f"{len(r['normalize_cupy_builds'])} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
