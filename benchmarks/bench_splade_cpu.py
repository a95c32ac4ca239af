"""SPLADE's head on the CPU: cupynce's NumPy path against PyTorch's CPU autograd of the formula.

Run from the repository root::

    python benchmarks/bench_splade_cpu.py                  # the shapes below, float32
    python benchmarks/bench_splade_cpu.py --repeat 31 --out splade_cpu.json

Cases: (B, L, D, V) = (8, 32, 128, 30522) (a BERT vocabulary; the new-user report's shape) and
the report's CPU sizes (4, 16, 32, V) for V in 256, 1024, 4096; each with dense activations
(every output > 0: the backward's worst case) and about half of them active.  PyTorch:
``logits = x @ W.T + b; masked_fill(~mask, -inf); amax over L; log1p(relu)`` and
``torch.autograd.grad`` of it.  Each implementation runs its repeats in three blocks, the
blocks of the implementations alternating, so that a change in the machine's load hits both
(not call by call: NumPy's BLAS and torch keep separate thread pools, and a call right after
the other library's pays for the hand-over).  Medians and the 20-80 % range of the repeats
(``cupynce.report.harness`` statistics); ratios marked ≈ where the two ranges overlap.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupynce  # noqa: E402
from cupynce.report.harness import (_stats, device_header, device_info, fmt_ms,  # noqa: E402
                                    fmt_ratio, markdown_table)

SHAPES = [(8, 32, 128, 30522), (4, 16, 32, 256), (4, 16, 32, 1024), (4, 16, 32, 4096)]


def make(b, l, d, v, dense: bool, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, l, d)).astype(np.float32)
    w = (rng.standard_normal((v, d)) / np.sqrt(d)).astype(np.float32)
    bias = (rng.standard_normal(v) * 0.1 + (4.0 if dense else -2.5)).astype(np.float32)
    mask = np.ones((b, l), bool)
    mask[:, l - l // 4:] = rng.random((b, l // 4)) < 0.5  # some padding
    go = rng.standard_normal((b, v)).astype(np.float32)
    return x, w, bias, mask, go


def run(shape, dense: bool, repeat: int, warmup: int = 2):
    import torch

    x, w, bias, mask, go = make(*shape, dense)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, bias))
    mt, got = torch.tensor(mask), torch.tensor(go)

    def torch_fwd():
        logits = (xt @ wt.T + bt).masked_fill(~mt[:, :, None], float("-inf"))
        return torch.log1p(torch.relu(logits.amax(dim=1)))

    def torch_step():
        out = torch_fwd()
        return torch.autograd.grad(out, (xt, wt, bt), got)

    def ours_fwd():
        return cupynce.splade_pool_forward(x, w, bias, mask)

    def ours_step():
        out, ctx = ours_fwd()
        return cupynce.splade_pool_backward(ctx, go)

    saved_out = torch_fwd()  # a graph kept for the backward alone
    _, saved_ctx = ours_fwd()
    fns = {"cupynce fwd": ours_fwd, "cupynce bwd": lambda: cupynce.splade_pool_backward(
               saved_ctx, go), "cupynce fwd+bwd": ours_step,
           "torch fwd": lambda: torch_fwd().detach(),
           "torch bwd": lambda: torch.autograd.grad(saved_out, (xt, wt, bt), got,
                                                    retain_graph=True),
           "torch fwd+bwd": torch_step}
    for f in fns.values():
        for _ in range(warmup):
            f()
    times = {k: [] for k in fns}
    rounds = 3
    for r in range(rounds):  # blocks per implementation, the blocks alternating (see above)
        for k, f in fns.items():
            f()  # (wakes this library's thread pool: the other's may still be spinning)
            for _ in range(-(-repeat // rounds)):
                t0 = time.perf_counter()
                f()
                times[k].append((time.perf_counter() - t0) * 1e3)
    out = ours_fwd()[0]
    return {k: _stats("", v) for k, v in times.items()}, float((out > 0).mean())


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=21)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    info = device_info()
    rows, doc = [], {"device": info, "torch_threads": torch.get_num_threads(), "cases": []}
    for shape in SHAPES:
        for dense in (True, False):
            st, density = run(shape, dense, args.repeat)
            doc["cases"].append(dict(shape=shape, density=density, stats=st))

            def cell(k):
                s = st[k]
                return f"{fmt_ms(s['median_ms'])} ({fmt_ms(s['p20_ms'])}–{fmt_ms(s['p80_ms'])})"

            def ratio(a, b):
                noisy = st[a]["p20_ms"] <= st[b]["p80_ms"] and st[b]["p20_ms"] <= st[a]["p80_ms"]
                return ("≈" if noisy else "") + fmt_ratio(st[a]["median_ms"] / st[b]["median_ms"])

            rows.append([", ".join(map(str, shape)), f"{100 * density:.0f}%",
                         cell("cupynce fwd"), cell("torch fwd"), cell("cupynce bwd"),
                         cell("torch bwd"), cell("cupynce fwd+bwd"), cell("torch fwd+bwd"),
                         ratio("torch fwd", "cupynce fwd"), ratio("torch bwd", "cupynce bwd"),
                         ratio("torch fwd+bwd", "cupynce fwd+bwd")])
    table = markdown_table(["B, L, D, V", "active", "cupynce fwd ms", "torch fwd ms",
                            "cupynce bwd ms", "torch bwd ms", "cupynce fwd+bwd ms",
                            "torch fwd+bwd ms", "fwd speedup", "bwd speedup",
                            "fwd+bwd speedup"], rows)
    print(f"{device_header(info)} · torch threads {torch.get_num_threads()} · "
          f"{args.repeat} interleaved repeats, median (20–80 %)\n\n{table}")
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
