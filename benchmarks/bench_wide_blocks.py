"""One rank's share of CLIP at a large global N on one GPU (bench_distributed.Loopback): the
loss-only forward and the forward with gradients, each twice, with TFLOP/s.  Found the wide-
block split planning fixed on 2026-11-26 (docs/results.md, "Several GPUs").  Run from the
repository root: ``python benchmarks/bench_wide_blocks.py``."""
import sys, time
import numpy as np
import cupy as cp
sys.path.insert(0, "benchmarks")
import bench_distributed as bd
import cupynce

d = 512
for P, N in [(4, 262144), (4, 1048576), (16, 4194304)]:
    n = N // P
    rs = cp.random.RandomState(0)
    comm = bd.Loopback(0, P)
    a, b = bd._unit(rs, n, d), bd._unit(rs, n, d)
    ls = cp.full((), np.log(1 / 0.07), cp.float32)
    for what, rg in (("loss", False), ("grad", True), ("loss", False), ("grad", True)):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter(); s.record()
        out = cupynce.clip_loss_forward(a, b, ls, requires_grad=rg, group=comm)
        e.record(); e.synchronize()
        t1 = time.perf_counter()
        flops = (2 if not rg else 8) * n * N * d
        ms = cp.cuda.get_elapsed_time(s, e)
        print(f"P={P} N={N} n={n} {what}: {ms:.1f} ms GPU, host {1e3*(t1-t0):.1f} ms, "
              f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        del out
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
