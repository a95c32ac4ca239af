"""Where one forward + backward call's host time goes, and when the GPU starts each kernel.

    python benchmarks/host_timeline.py clip_loss:16384,nt_xent:16384 float32 \\
        [module.function,module.function,...]

For each case: 3 warm-up calls, then 7 calls from an idle GPU (``bench_contrastive``'s inputs
and step, D = 512); prints the median GPU time of a call (CUDA events around it) and host time,
then, for the last call, every kernel launched through ``cupynce._engine.kernels`` with its
host launch time and the time the GPU reached it (an event recorded just before the launch),
both in ms from the call; ``IDLE`` marks a kernel the GPU was waiting for (the host is the
bottleneck there).  The optional third argument wraps those functions (looked up as module
attributes at call time) and prints their entry and exit times, nested.  The events and
wrappers add a few µs a launch / call: compare runs of this script, not with the benchmarks.
"""
import functools
import importlib
import sys
import time

import numpy as np
import cupy as cp

sys.path.insert(0, "benchmarks")
import bench_contrastive as B  # noqa: E402
from cupynce._engine import kernels  # noqa: E402

rec = []
T0 = [0.0]
depth = [0]


class _Proxy:
    """A loaded kernel that records an event (and the host time) at each launch."""

    def __init__(self, f, name):
        object.__setattr__(self, "f", f)
        object.__setattr__(self, "name", name)

    def __setattr__(self, k, v):
        setattr(self.f, k, v)

    def __getattr__(self, k):
        return getattr(self.f, k)

    def __call__(self, *a, **k):
        ev = cp.cuda.Event()
        ev.record()
        rec.append(("K", depth[0], self.name, (time.perf_counter() - T0[0]) * 1e3, ev))
        return self.f(*a, **k)


_proxies = {}


def _px(f, name):
    p = _proxies.get(id(f))
    if p is None:
        p = _proxies[id(f)] = (_Proxy(f, name), f)
    return p[0]


_get_kernel, _get_function = kernels.get_kernel, kernels.get_function
kernels.get_kernel = lambda fn, stage, dt: _px(_get_kernel(fn, stage, dt), stage)
kernels.get_function = lambda fn, name: _px(_get_function(fn, name), name.replace("cpn_", ""))


def wrap(modname: str, fname: str) -> None:
    mod = importlib.import_module(modname)
    f = getattr(mod, fname)

    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        depth[0] += 1
        try:
            return f(*a, **k)
        finally:
            depth[0] -= 1
            rec.append(("F", depth[0], f"{modname.split('.')[-1]}.{fname}",
                        (t - T0[0]) * 1e3, (time.perf_counter() - T0[0]) * 1e3))
    setattr(mod, fname, w)


def main() -> None:
    if len(sys.argv) > 3:
        for spec in sys.argv[3].split(","):
            m, f = spec.rsplit(".", 1)
            wrap(m, f)
    dt = B.np_dtype(sys.argv[2] if len(sys.argv) > 2 else "float32")
    for case in sys.argv[1].split(","):
        op, n = case.split(":")
        inputs = B.make_inputs(op, int(n), 512, dt)
        step = B.cupynce_step(op, inputs)
        for _ in range(3):
            step()
        dev = cp.cuda.Device()
        host, gpu = [], []
        for _ in range(7):
            rec.clear()
            dev.synchronize()
            e0 = cp.cuda.Event()
            e0.record()
            T0[0] = time.perf_counter()
            step()
            host.append((time.perf_counter() - T0[0]) * 1e3)
            e1 = cp.cuda.Event()
            e1.record()
            e1.synchronize()
            gpu.append(cp.cuda.get_elapsed_time(e0, e1))
        print(f"=== {op} {n}: call gpu median {np.median(gpu):.3f} ms, host median "
              f"{np.median(host):.3f} ms (the last call below)")
        for r in sorted(rec, key=lambda r: r[3]):
            pad = "  " * r[1]
            if r[0] == "K":
                g = cp.cuda.get_elapsed_time(e0, r[4])
                idle = "IDLE" if g - r[3] < 0.02 else ""
                print(f"  {pad}K {r[2]:30s} host {r[3]:7.3f}  gpu {g:7.3f} {idle}")
            else:
                print(f"  {pad}{r[2]:32s} {r[3]:7.3f} -> {r[4]:7.3f}  ({r[4] - r[3]:.3f})")
        del step, inputs


if __name__ == "__main__":
    main()
