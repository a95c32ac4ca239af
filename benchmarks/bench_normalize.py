"""cupynce's row L2 normalisation (every op's ``normalize=True``) against ``F.normalize``.

Run from the repository root on a GPU::

    PYTHONUNBUFFERED=1 python benchmarks/bench_normalize.py

The forward of ``cupynce._engine.arrays.normalize`` (1-8 warps a row by D:
``arrays.norm_warps``) and of ``torch.nn.functional.normalize(x, dim=1)`` on the same tensor,
by shape and dtype: CUDA-event time per call over 200 back-to-back calls, the median of five
such spans (so the host's launch time is inside, as in a training step).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [(8, 32768), (8, 4096), (64, 4096), (64, 32768), (256, 8192), (1024, 4096),
          (4096, 128), (65536, 128), (16384, 512)]


def per_call_us(fn, reps: int = 200) -> float:
    import torch

    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spans = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        spans.append(start.elapsed_time(end) / reps * 1e3)
    return sorted(spans)[2]


def main() -> int:
    import cupy as cp
    import torch
    import torch.nn.functional as F

    from cupynce._engine import arrays
    from cupynce.report.harness import device_header, device_info, markdown_table

    print(device_header(device_info()), flush=True)
    rows = []
    for n, d in SHAPES:
        for dt in (torch.bfloat16, torch.float32):
            x = torch.randn(n, d, device="cuda", dtype=dt)
            xc = cp.from_dlpack(x)
            ours = per_call_us(lambda: arrays.normalize(xc))
            theirs = per_call_us(lambda: F.normalize(x, dim=1))
            rows.append([n, d, str(dt).replace("torch.", ""), arrays.norm_warps(d),
                         f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}"])
            print(rows[-1], flush=True)
    print(markdown_table(["rows", "D", "dtype", "warps a row", "cupynce µs", "F.normalize µs",
                          "ratio"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
