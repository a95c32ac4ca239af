"""Probe: the torch single-GPU fp32 InfoNCE at N = 262144, D = 384.

Ran as ``benchmarks/probe_single_f32.py`` from the repository root (its sys.path line is that
location's); kept beside its log as the experiment behind docs/results.md's numbers."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import cupynce.torch as C  # noqa: E402

for N in (131072, 262144):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(N, 384, device="cuda", generator=g).requires_grad_(True)
    p = torch.randn(N, 384, device="cuda", generator=g).requires_grad_(True)
    for norm in (True, False):
        for kw in ({}, {"reduction": "none"}):
            def step():
                loss = C.info_nce(q, p, 0.05, normalize=norm, **kw)
                loss.mean().backward() if loss.dim() else loss.backward()
            step(); torch.cuda.synchronize()
            t0 = time.perf_counter(); step(); torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step(); torch.cuda.synchronize()
            tot = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    tot[e.name[:28]] = tot.get(e.name[:28], 0) + e.time_range.elapsed_us() / 1e3
            top = sorted(tot.items(), key=lambda x: -x[1])[:4]
            print(N, "normalize", norm, kw, f"{ms:.0f} ms", [(k, round(v)) for k, v in top],
                  flush=True)
