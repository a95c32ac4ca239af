"""``cupynce.torch`` on CPU tensors against plain PyTorch on the same machine (issue 53, item 6).

Run from the repository root::

    python benchmarks/bench_cpu_torch.py                          # the grid below, 2 threads
    python benchmarks/bench_cpu_torch.py --threads 4 --out cpu.json

The grid is item 6's target: every loss at N = 256, 1024, 4096 (rows), D = 256, float32, and
``splade_pool`` at (B, L, D, V) = (8, 64, 128, 5000), each a forward and the gradients of every
input (``torch.autograd.grad``), ``torch.set_num_threads(--threads)``.  Plain PyTorch is the
formula users run: NT-Xent ``cross_entropy((z zᵀ).masked_fill(eye, -inf) / t, (i + B) mod 2B)``;
InfoNCE ``cross_entropy(q kᵀ / t, arange)``; CLIP open_clip's
``(CE(s a bᵀ, l) + CE(s b aᵀ, l)) / 2`` with ``s = exp(logit_scale)`` learnable; SigLIP
``-logsigmoid((2I - 1)(s a bᵀ + bias)).sum() / N``; SPLADE ``log1p(relu(max_l(x Wᵀ + b)))``
with the mask as ``-inf``.  The two implementations run their repeats in alternating blocks
(a change in the machine's load hits both); medians and the 20-80 % range
(``cupynce.report.timing.time_cpu``); "≈" where the ranges overlap.  Inputs are unit rows
(realistic logits), the same tensors for both.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

import cupynce.torch as ct
from cupynce.report.environment import device_info
from cupynce.report.timing import _stats, time_cpu

SIZES = (256, 1024, 4096)
D = 256
SPLADE = (8, 64, 128, 5000)
TEMPERATURE = 0.1
LOGIT_SCALE = 2.659  # log(1 / 0.07)


def _unit(gen, n, d):
    return F.normalize(torch.randn(n, d, generator=gen), dim=1).requires_grad_()


def contrastive_case(op: str, n: int) -> Tuple[Callable, Callable]:
    """(cupynce step, plain torch step): a forward and the gradients of every input."""
    gen = torch.Generator().manual_seed(0)
    if op == "nt_xent":
        z = _unit(gen, n, D)
        lab = (torch.arange(n) + n // 2) % n
        eye = torch.eye(n, dtype=torch.bool)
        return (lambda: torch.autograd.grad(ct.nt_xent(z, TEMPERATURE), (z,)),
                lambda: torch.autograd.grad(F.cross_entropy(
                    (z @ z.T).masked_fill(eye, float("-inf")) / TEMPERATURE, lab), (z,)))
    a, b = _unit(gen, n, D), _unit(gen, n, D)
    lab = torch.arange(n)
    if op == "info_nce":
        return (lambda: torch.autograd.grad(ct.info_nce(a, b, TEMPERATURE), (a, b)),
                lambda: torch.autograd.grad(F.cross_entropy(a @ b.T / TEMPERATURE, lab), (a, b)))
    ls = torch.tensor(LOGIT_SCALE, requires_grad=True)
    if op == "clip_loss":
        def plain():
            logits = ls.exp() * a @ b.T
            loss = (F.cross_entropy(logits, lab) + F.cross_entropy(logits.T, lab)) / 2
            return torch.autograd.grad(loss, (a, b, ls))
        return lambda: torch.autograd.grad(ct.clip_loss(a, b, ls), (a, b, ls)), plain
    lb = torch.tensor(-10.0, requires_grad=True)
    sign = 2 * torch.eye(n) - 1

    def plain_siglip():
        logits = ls.exp() * a @ b.T + lb
        return torch.autograd.grad(-F.logsigmoid(sign * logits).sum() / n, (a, b, ls, lb))
    return (lambda: torch.autograd.grad(ct.siglip_loss(a, b, ls, lb), (a, b, ls, lb)),
            plain_siglip)


def splade_case() -> Tuple[Callable, Callable]:
    b, l, d, v = SPLADE
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(b, l, d, generator=gen) / d ** 0.5).requires_grad_()
    w = (torch.randn(v, d, generator=gen) / d ** 0.5).requires_grad_()
    bias = (torch.randn(v, generator=gen) * 0.1).requires_grad_()
    mask = torch.rand(b, l, generator=gen) < 0.8
    g = torch.randn(b, v, generator=gen)

    def ours():
        out = ct.splade_pool(x, w, bias, mask, activation="log1p_relu")
        return torch.autograd.grad(out, (x, w, bias), g)

    def plain():
        logits = (x @ w.T + bias).masked_fill(~mask[:, :, None], float("-inf"))
        out = torch.log1p(torch.relu(logits.amax(dim=1)))
        return torch.autograd.grad(out, (x, w, bias), g)
    return ours, plain


def measure(ours: Callable, plain: Callable, repeat: int, blocks: int = 3) -> Dict[str, dict]:
    """Both steps, their repeats in ``blocks`` alternating blocks; the statistics of each."""
    times: Dict[str, List[float]] = {"cupynce": [], "torch": []}
    per = max(1, repeat // blocks)
    for _ in range(blocks):
        for name, fn in (("cupynce", ours), ("torch", plain)):
            times[name] += time_cpu(fn, warmup=1, repeat=per)["times_ms"]
    return {name: dict(_stats("", t), times_ms=t) for name, t in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--ops", default="nt_xent,info_nce,clip_loss,siglip_loss,splade_pool")
    p.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for op in args.ops.split(","):
        for n in ([None] if op == "splade_pool" else [int(s) for s in args.sizes.split(",")]):
            ours, plain = splade_case() if op == "splade_pool" else contrastive_case(op, n)
            r = measure(ours, plain, args.repeat)
            c, t = r["cupynce"], r["torch"]
            overlap = c["p20_ms"] <= t["p80_ms"] and t["p20_ms"] <= c["p80_ms"]
            ratio = c["median_ms"] / t["median_ms"]
            shape = "x".join(map(str, SPLADE)) if n is None else f"N={n} D={D}"
            rows.append({"op": op, "shape": shape, **r, "ratio": ratio})
            print(f"{op:12s} {shape:22s} cupynce {c['median_ms']:8.2f} ms  torch "
                  f"{t['median_ms']:8.2f} ms  ratio {'≈' if overlap else ''}{ratio:.2f}",
                  flush=True)
    if args.out:
        info = device_info()
        args.out.write_text(json.dumps({"benchmark": "cpu_torch", "threads": args.threads,
                                        "device": info, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
