"""The local block one of P ranks computes for the global losses, on one GPU (no communication).

Run from the repository root on a GPU::

    PYTHONUNBUFFERED=1 python benchmarks/bench_distributed.py            # P = 8, N = 65536, 262144

For CLIP and NT-Xent, bf16, D = 512, global batch N split over P = 8 ranks (n = N / 8 rows a
rank), forward + backward of rank 0's share:

``cupynce block``  what ``group=`` computes between its collectives: the rank's rows against
                   every column (NT-Xent: ``cupynce.ops._local``; CLIP: the one n × N block
                   for both directions of ``cupynce.ops._global``, with its column-state
                   merge), gradients included (CuPy arrays, the engine's default path);
``1/P single``     the single-GPU op on the whole batch, divided by P: the target is
                   block ≤ 1.15 × this;
``open_clip``      open_clip's formula on the same local block (``local_loss=True``,
                   ``gather_with_grad=True``): the n × N logits both ways from the gathered
                   features, ``F.cross_entropy``, autograd (NT-Xent: the same masked n × 2N
                   logits), in torch, bf16.

Also the bytes each rank sends per step over a ring (all-gather of the column-side rows in
bf16, reduce-scatter of their float32 gradients).  CUDA-event medians, peak memory above the
inputs (``cupynce.report.harness``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupynce.report.harness import (device_header, device_info, fmt_mib, fmt_ms,  # noqa: E402
                                    fmt_ratio, free_memory, markdown_table, run_case)


def cupynce_block(op, P, N, d):
    import cupy as cp

    from cupynce._engine.kernels import BFLOAT16
    from cupynce.ops import _base, _local

    n = N // P
    rs = cp.random.RandomState(0)

    def arr(rows):
        x = rs.standard_normal((rows, d), dtype=cp.float32)
        x /= cp.linalg.norm(x, axis=1, keepdims=True)
        return x.astype(BFLOAT16)

    path = _base.Path(cp)
    w = _base.weights(cp, None, "mean", N if op == "clip_loss" else 2 * N, np.dtype(np.float32))
    if op == "clip_loss":  # the one-block CLIP of cupynce.ops._global (rank P - 1's rows)
        from cupynce import _engine

        a, b_all = arr(n), arr(N)
        ls = cp.full((1,), np.log(1 / 0.07), cp.float32)
        row0 = N - n

        def step():
            dots = _engine.pair_dots(a, b_all[row0:])
            dots_all = cp.concatenate([dots] * P)  # (what the all-gather returns)
            lse_r, state, _, _ = _engine.clip(
                a, b_all, ls, lse_r=None, lse_c=None, weights=None, want_loss=True,
                want_grad=False, workspace_bytes=None, row0=row0, col_shift=dots_all,
                col_state=True)
            lse_c = _engine.col_lse(cp.stack([state] * P))  # (the gathered states)
            return _engine.clip(a, b_all, ls, lse_r=lse_r, lse_c=lse_c, weights=w,
                                want_loss=False, want_grad=True, workspace_bytes=None,
                                row0=row0)
        return step
    z, others = arr(2 * n), arr(2 * (N - n))
    return lambda: _local.nt_xent_block(path, z, others, 1 / 0.2, lse_in=None, weights=w,
                                        want_grad=True, workspace_bytes=None)


def single(op, N, d):
    import cupy as cp

    import cupynce
    from cupynce._engine.kernels import BFLOAT16

    rs = cp.random.RandomState(1)

    def arr(rows):
        x = rs.standard_normal((rows, d), dtype=cp.float32)
        x /= cp.linalg.norm(x, axis=1, keepdims=True)
        return x.astype(BFLOAT16)

    if op == "clip_loss":
        a, b = arr(N), arr(N)
        ls = cp.full((), np.log(1 / 0.07), cp.float32)
        return lambda: cupynce.clip_loss_backward(cupynce.clip_loss_forward(a, b, ls)[1])
    z = arr(2 * N)
    return lambda: cupynce.nt_xent_backward(cupynce.nt_xent_forward(z, 0.2)[1])


def open_clip_block(op, P, N, d):
    import torch
    import torch.nn.functional as F

    n = N // P
    g = torch.Generator(device="cuda").manual_seed(2)

    def leaf(rows):
        x = F.normalize(torch.randn(rows, d, device="cuda", generator=g), dim=-1)
        return x.to(torch.bfloat16).requires_grad_(True)

    if op == "clip_loss":
        a, b, A, B = leaf(n), leaf(n), leaf(N), leaf(N)
        ls = torch.tensor(np.log(1 / 0.07), device="cuda", requires_grad=True)
        labels = torch.arange(n, device="cuda")

        def step():
            s = ls.exp()
            lpi = s * a @ B.T
            lpt = s * b @ A.T
            loss = (F.cross_entropy(lpi, labels) + F.cross_entropy(lpt, labels)) / 2
            return torch.autograd.grad(loss, (a, b, A, B, ls))
        return step
    z, Z = leaf(2 * n), leaf(2 * N)
    rows = torch.cat([torch.arange(n), N + torch.arange(n)]).cuda()
    labels = torch.cat([N + torch.arange(n), torch.arange(n)]).cuda()

    def step():
        s = (z @ Z.T) / 0.2
        s = s.index_put((torch.arange(2 * n, device="cuda"), rows),
                        torch.tensor(float("-inf"), device="cuda", dtype=s.dtype))
        loss = F.cross_entropy(s, labels)
        return torch.autograd.grad(loss, (z, Z))
    return step


def sent_bytes(op, P, N, d):
    """Bytes a rank sends per step over a ring: all-gather (P - 1) n rows in bf16 and a
    reduce-scatter of (P - 1) n rows in float32 of the column-side tensor (CLIP: b only, plus
    the pairs' dots, n floats, and the column states, 2N floats, all-gathered)."""
    n = N // P
    rows = 2 * n if op == "nt_xent" else n
    extra = (P - 1) * (4 * n + 8 * N) if op == "clip_loss" else 0
    return (P - 1) * rows * d * (2 + 4) + extra


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--P", type=int, default=8)
    p.add_argument("--sizes", type=int, nargs="*", default=[65536, 262144])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ops", nargs="*", default=["clip_loss", "nt_xent"])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    rows = []
    for op in args.ops:
        for N in args.sizes:
            res = {}
            for name, build in (("block", lambda: cupynce_block(op, args.P, N, args.dim)),
                                ("single", lambda: single(op, N, args.dim)),
                                ("open_clip", lambda: open_clip_block(op, args.P, N, args.dim))):
                free_memory(full_gc=True)
                fn = None
                try:
                    fn = build()
                    res[name] = run_case(fn, warmup=1, repeat=args.repeat, catch_errors=True)
                except Exception as exc:  # noqa: BLE001 - out of memory in setup: a result
                    res[name] = {"error": f"{type(exc).__name__}"}
                del fn
            blk, one, oc = res["block"], res["single"], res["open_clip"]

            def ms(r, div=1):
                return fmt_ms(r["median_ms"] / div) if r.get("median_ms") else \
                    ("OOM" if "memory" in str(r.get("error", "")).lower() else "error")

            ratio = blk["median_ms"] / (one["median_ms"] / args.P) \
                if blk.get("median_ms") and one.get("median_ms") else None
            speed = oc["median_ms"] / blk["median_ms"] \
                if oc.get("median_ms") and blk.get("median_ms") else None
            mem = oc["peak_extra_bytes"] / blk["peak_extra_bytes"] \
                if oc.get("peak_extra_bytes") and blk.get("peak_extra_bytes") else None
            rows.append([op, N, N // args.P, ms(blk), fmt_mib(blk.get("peak_extra_bytes")),
                         ms(one, args.P), fmt_ratio(ratio), ms(oc),
                         fmt_mib(oc.get("peak_extra_bytes")), fmt_ratio(speed),
                         fmt_ratio(mem), f"{sent_bytes(op, args.P, N, args.dim) / 2**20:.0f}"])
            print(rows[-1], flush=True)
    table = markdown_table(
        ["op", "N", "n", "cupynce block ms", "block MiB", "1/P single ms", "block / (1/P single)",
         "open_clip ms", "open_clip MiB", "speedup vs open_clip", "memory vs open_clip",
         "MiB sent per rank"], rows)
    print(f"\n{device_header(device_info())} · P = {args.P}, D = {args.dim}, bf16, forward + "
          f"backward of one rank's share\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
