"""``python -m cupynce``: the machine, a self-check against the float64 oracle, a short benchmark.

With a CUDA GPU and CuPy the self-check runs the kernels and a short benchmark compares the
forward+backward time and peak memory with the PyTorch reference (when torch is installed).
Without a GPU it says so and checks the NumPy path on small sizes.  Exit status 1 if any
check fails.
"""
from __future__ import annotations

import argparse
import platform
import sys
from typing import List

import numpy as np

import cupynce
from cupynce import reference as R
from cupynce._kernels import BFLOAT16


def _gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def machine(gpu: bool) -> List[str]:
    lines = [f"cupynce {cupynce.__version__}, Python {platform.python_version()}, "
             f"NumPy {np.__version__}"]
    try:
        import torch

        lines.append(f"torch {torch.__version__}")
    except ImportError:
        lines.append("torch not installed (the PyTorch comparison is skipped)")
    if gpu:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        free, total = cupy.cuda.runtime.memGetInfo()
        lines.append(f"GPU {props['name'].decode()}, {total / 2**30:.1f} GiB, CUDA runtime "
                     f"{cupy.cuda.runtime.runtimeGetVersion()}, CuPy {cupy.__version__}")
    else:
        lines.append("No CUDA GPU (or no CuPy): checking the NumPy path on small sizes only.")
    return lines


def _rel(x, ref) -> float:
    try:
        import cupy

        x = cupy.asnumpy(x)
    except ImportError:
        pass
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    den = np.linalg.norm(ref.ravel())
    return float(np.linalg.norm((x - ref).ravel()) / (den if den > 0 else 1.0))


#: (loss, gradient) relative tolerances against the float64 oracle, per dtype
CHECK_TOL = {"float64": (1e-12, 1e-12), "float32": (1e-5, 1e-4), "float16": (5e-3, 2e-2),
             "bfloat16": (2e-2, 5e-2)}


def self_check(gpu: bool) -> bool:
    xp = np
    if gpu:
        import cupy as xp  # noqa: F811
    dtypes = ["float32", "bfloat16", "float16", "float64"] if gpu else ["float32", "float64"]
    shapes = [(64, 32), (1030, 100)] if gpu else [(16, 8), (130, 33)]
    rng = np.random.default_rng(0)
    ok = True
    print(f"\nSelf-check ({'CuPy kernels' if gpu else 'NumPy path'}) against the float64 oracle")
    print(f"| op | dtype | N, D | loss err | worst grad err | tol (loss, grad) | |")
    print("|---|---|---|---|---|---|---|")
    for name in dtypes:
        dt = BFLOAT16 if name == "bfloat16" else np.dtype(name)
        for n, d in shapes:
            x = [(rng.standard_normal((n, d)) / np.sqrt(d)).astype(dt) for _ in range(2)]
            dev = [xp.asarray(v) for v in x]
            runs = []
            loss, ctx = cupynce.nt_xent_forward(dev[0], 0.1, normalize=True)
            runs.append(("nt_xent", loss, [cupynce.nt_xent_backward(ctx, 0.5)],
                         R.nt_xent(x[0], 0.1, normalize=True, grad_loss=0.5)))
            loss, ctx = cupynce.info_nce_forward(dev[0], dev[1], 0.1, normalize=True)
            runs.append(("info_nce", loss, list(cupynce.info_nce_backward(ctx, 0.5))[:2],
                         R.info_nce(x[0], x[1], 0.1, normalize=True, grad_loss=0.5)))
            ls = float(np.log(1 / 0.07))
            loss, ctx = cupynce.clip_loss_forward(dev[0], dev[1], ls, normalize=True)
            runs.append(("clip_loss", loss, list(cupynce.clip_loss_backward(ctx, 0.5))[:2],
                         R.clip_loss(x[0], x[1], ls, normalize=True, grad_loss=0.5)))
            lt, gt = CHECK_TOL[name]
            for op, got_loss, got_grads, (ref_loss, ref_grads) in runs:
                le = _rel(got_loss, ref_loss)
                ge = max(_rel(g, r) for g, r in zip(got_grads, ref_grads))
                good = le <= lt and ge <= gt and np.isfinite(le) and np.isfinite(ge)
                ok &= good
                print(f"| {op} | {name} | {n}, {d} | {le:.1e} | {ge:.1e} | {lt:.0e}, {gt:.0e} "
                      f"| {'pass' if good else 'FAIL'} |")
    return ok


def benchmark(sizes: List[int], dim: int) -> None:
    """Forward+backward of cupynce vs the eager PyTorch reference, bfloat16, on this GPU."""
    import cupy as cp

    from cupynce._harness import fmt_mib, fmt_ms, load_torch, run_case, to_torch, \
        torch_reference, torch_step

    torch = load_torch()
    ls = float(np.log(1 / 0.07))
    print(f"\nBenchmark: forward+backward, bfloat16, D={dim}, unit rows; median time, "
          f"peak extra memory")
    print("| op | N | cupynce | PyTorch eager | speedup |")
    print("|---|---|---|---|---|")
    for op in ("nt_xent", "clip_loss"):
        for n in sizes:
            z = cp.random.default_rng(0).standard_normal((n, dim), dtype=cp.float32)
            z /= cp.linalg.norm(z, axis=1, keepdims=True)
            a, b = z.astype(BFLOAT16), z[::-1].copy().astype(BFLOAT16)
            if op == "nt_xent":
                def ours():
                    _, ctx = cupynce.nt_xent_forward(a, 0.1)
                    return cupynce.nt_xent_backward(ctx)
                leaves = [to_torch(torch, a).clone().requires_grad_()] if torch else None
            else:
                def ours():
                    _, ctx = cupynce.clip_loss_forward(a, b, ls)
                    return cupynce.clip_loss_backward(ctx)
                leaves = ([to_torch(torch, a).clone().requires_grad_(),
                           to_torch(torch, b).clone().requires_grad_(),
                           torch.tensor(ls, device="cuda", requires_grad=True)]
                          if torch else None)
            mine = run_case(ours, repeat=5)
            ref = (run_case(torch_step(torch, torch_reference(torch, op, 0.1), leaves), repeat=5)
                   if torch else None)

            def fmt(m):
                if m is None:
                    return "n/a (no torch)"
                if m.get("oom"):
                    return "out of memory"
                return f"{fmt_ms(m['median_ms'])} ms, {fmt_mib(m['peak_extra_bytes'])} MiB"

            speed = (f"{ref['median_ms'] / mine['median_ms']:.1f}x"
                     if ref and not ref.get("oom") and not mine.get("oom") else "")
            print(f"| {op} | {n} | {fmt(mine)} | {fmt(ref)} | {speed} |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupynce", description=__doc__.splitlines()[0])
    p.add_argument("--no-bench", action="store_true", help="self-check only")
    p.add_argument("--sizes", default="8192,16384", help="benchmark N values (comma-separated)")
    p.add_argument("--dim", type=int, default=512)
    args = p.parse_args(argv)
    gpu = _gpu()
    print("\n".join(machine(gpu)))
    ok = self_check(gpu)
    if gpu and not args.no_bench:
        benchmark([int(s) for s in args.sizes.split(",")], args.dim)
    print("\nself-check:", "all passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
