"""Where one forward + backward of ``bench_contrastive.py`` spends its wall time: the GPU's work
or the host's.  Per case (bf16 by default, D = 512, the inputs and step of bench_contrastive):

* ``wall``: the synchronised step, as bench_contrastive times it (median of 30);
* ``host``: the time the step takes to return with the GPU kept busy by a spin kernel queued
  first (so no call waits for the device): the Python, CuPy and driver time of the launches;
* ``gpu``: the GPU time of the step with the host hidden (events around the step, queued behind
  the spin kernel): what the step costs where the GPU never waits, as inside a training step
  whose encoder work is still queued when the loss is called;
* ``exposed = wall - gpu``: host time the device waits for, mostly the part of ``host`` before
  the first large kernel is launched;
* with ``--kernels``: each kernel's GPU time (torch.profiler / CUPTI), largest first.

Run from the repository root (needs CuPy, a GPU, and torch for ``--kernels``)::

    python benchmarks/bench_exposure.py --cases nt_xent:16384,clip_loss:8192 [--kernels]
"""
import argparse
import statistics as st
import sys
import time

import numpy as np

sys.path.insert(0, "benchmarks")
import bench_contrastive as B  # noqa: E402

SPIN_SRC = r'''extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}'''
#: the spin kernel's length in SM clocks (~4 ms at 2 GHz: longer than any step's host time)
SPIN_CYCLES = 8_000_000


def measure(step, repeat: int = 30):
    """(wall, host, gpu) medians in seconds of ``step()`` (see the module notes)."""
    import cupy as cp

    spin = cp.RawKernel(SPIN_SRC, "spin")
    dev = cp.cuda.Device()
    walls, hosts, gpus = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        dev.synchronize()
        walls.append(time.perf_counter() - t0)
    for _ in range(repeat):
        spin((1,), (1,), (np.int64(SPIN_CYCLES),))
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        t0 = time.perf_counter()
        step()
        hosts.append(time.perf_counter() - t0)
        e1.record()
        e1.synchronize()
        gpus.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3)
    return st.median(walls), st.median(hosts), st.median(gpus)


def kernels(step, runs: int = 5):
    """[(name, µs a step, launches a step)] of ``step()``'s GPU work, largest first."""
    import cupy as cp
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(runs):
            step()
        cp.cuda.Device().synchronize()
    rows = [(e.key, e.device_time_total / runs, e.count // runs)
            for e in p.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="nt_xent:16384,info_nce:16384,clip_loss:8192,"
                    "siglip_loss:8192", help="op:N,... (ops of bench_contrastive)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--kernels", action="store_true", help="list each kernel's GPU time")
    args = ap.parse_args()
    import cupy as cp

    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("| op | N | wall ms | host ms | gpu ms (host hidden) | exposed ms |")
    print("|---|--:|--:|--:|--:|--:|")
    notes = []
    for case in args.cases.split(","):
        op, n = case.split(":")
        inputs = B.make_inputs(op, int(n), args.dim, B.np_dtype(args.dtype))
        step = B.cupynce_step(op, inputs)
        for _ in range(5):  # (loads the kernels, plans and any CUDA graph first)
            step()
        wall, host, gpu = measure(step)
        print(f"| {op} | {n} | {wall * 1e3:.3f} | {host * 1e3:.3f} | {gpu * 1e3:.3f} | "
              f"{(wall - gpu) * 1e3:.3f} |", flush=True)
        if args.kernels:
            rows = kernels(step)
            notes.append(f"{op} {n}: kernels {sum(r[1] for r in rows):.1f} us a step")
            notes += [f"  {t:8.1f} us x{c}  {k[:80]}" for k, t, c in rows[:12]]
        del step, inputs
    print("\n".join(notes))


if __name__ == "__main__":
    main()
