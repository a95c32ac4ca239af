"""Where a wide call's time goes: per-kernel CUDA time (torch.profiler) of ``cupynce.torch``
CLIP and NT-Xent, bf16, forward + backward, at D = 2048-4096 (issue 53, item 6), with the
median CUDA-event span of the whole call; NT-Xent at N = 8192 also with its kept-scores path
forced (``nt_xent_keep_min_nd=0``), the chooser's alternative.  One GPU, stdout::

    python benchmarks/kernel_breakdown.py > kernel_breakdown.txt
"""
import torch
from torch.profiler import ProfilerActivity, profile

import cupynce.config as cfg
import cupynce.torch as ct

#: (op, N, D, config changes): CLIP and NT-Xent where the chooser keeps the scores or not
CASES = [("clip", 16384, 4096, {}), ("clip", 8192, 4096, {}),
         ("nt", 16384, 4096, {}), ("nt", 8192, 4096, {}),
         ("nt", 8192, 4096, dict(nt_xent_keep_min_nd=0)),
         ("nt", 8192, 2048, {}),
         ("nt", 8192, 2048, dict(nt_xent_keep_min_nd=0, nt_xent_keep_min_dim=2048))]


def step(op: str, n: int, d: int):
    """One forward + backward on unit-scale bf16 leaves (CLIP with a learnable scale)."""
    def leaf():
        return (torch.randn(n, d, device="cuda") / d ** .5).bfloat16().requires_grad_()
    if op == "clip":
        a, b = leaf(), leaf()
        ls = torch.tensor(2.3, device="cuda", requires_grad=True)
        return lambda: ct.clip_loss(a, b, ls).backward()
    z = leaf()
    return lambda: ct.nt_xent(z, 0.1).backward()


def median_ms(fn, reps: int = 15) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    spans = []
    for _ in range(reps):
        e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        spans.append(e0.elapsed_time(e1))
    return sorted(spans)[reps // 2]


def main() -> None:
    torch.manual_seed(0)
    print(f"# kernel_breakdown: {torch.cuda.get_device_name()}")
    for op, n, d, over in CASES:
        with cfg.override(**over):
            fn = step(op, n, d)
            med = median_ms(fn)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
        print(f"\n### {op} n={n} d={d} {over}: median {med:.3f} ms", flush=True)
        rows = sorted(((e.key, e.device_time_total / 5e3, e.count / 5)
                       for e in prof.key_averages()), key=lambda r: -r[1])
        for key, ms, count in rows[:12]:
            print(f"  {ms:8.3f} ms  x{count:4.1f}  {key[:110]}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
