"""One rank's share of the global losses, on one GPU (the collectives looped back).

Run from the repository root on a GPU::

    PYTHONUNBUFFERED=1 python benchmarks/bench_distributed.py            # P = 8, N = 65536, 262144

For CLIP, NT-Xent and InfoNCE, bf16 (``--dtype float32``: float32), D = 512, a global batch
of N (pairs, images or queries) split over P = 8 ranks (n = N / P a rank), forward + backward
of rank 0's share:

``cupynce``        ``cupynce.<op>_forward(..., group=comm)`` and its backward, the library's
                   own code, with a loop-back communicator (:class:`Loopback`: the gathers
                   return P copies of this rank's array, the reductions its own): what a rank
                   computes between its collectives, gradients included, at the default
                   workspace and at ``workspace_bytes`` = 256 MiB (``lean``);
``1/P single``     the single-GPU op on the whole batch, divided by P: the target is
                   cupynce ≤ 1.15 × this;
``open_clip``      open_clip's formula on the same rank (``local_loss=True``,
                   ``gather_with_grad=True``: the n × N logits both ways from the gathered
                   features, ``F.cross_entropy``, autograd; NT-Xent: lightly's masked n × 2N
                   logits; InfoNCE: the n × N logits one way), in torch on bf16 leaves, plain
                   and under ``torch.autocast(bfloat16)`` (``amp``: how open_clip trains with
                   ``--precision amp_bf16``; cross_entropy runs in float32).

``host ms`` is the host's time to issue rank 0's step (until the backward returns, no
synchronisation: ``issue_median_ms``) beside its GPU time: where the two meet, the rank's
step waits on the host, not on the GPU (the real communicators add their own calls' host
time to it: torch.distributed's, NCCL's).  Also the bytes each rank sends per step over a
ring (all-gathers of the column-side rows in bf16 and of the O(N) statistics,
reduce-scatter of the float32 gradients).  CUDA-event
medians, peak memory above the inputs (``cupynce.report.harness``).

``--cprofile``: then the Python functions of most own host time issuing each share (cProfile
over 10 steps, each waited for outside the profile): where the host's time goes where it
meets the GPU's (CLIP at P = 8).

``--kernels``: then, per op and size, where the share's time goes beyond 1/P of the
single-GPU op: both profiled for a few steps (torch.profiler: CUPTI sees CuPy's and cuBLAS's
kernels alike), each kernel's time a step in the share against its time in the single op
divided by P, sorted by the excess, and the GPU's idle time (the median step minus its
kernels) of each -- the fixed costs that keep a rank's share above 1/P.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench_multigpu's helpers)

from cupynce.ops._comm import Comm  # noqa: E402
from cupynce.report.harness import (device_header, device_info, fmt_mib, fmt_ms,  # noqa: E402
                                    fmt_ratio, free_memory, markdown_table, run_case)

LEAN = 256 << 20


class Loopback(Comm):
    """Rank ``rank`` of P with the collectives looped back on one GPU: every other rank holds
    a copy of this rank's arrays (same shapes, same bytes moved into place)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_gather(self, x):
        """P copies of ``x`` in one launch (a broadcast copy), as NCCL's all-gather is one
        call (``cp.stack`` of P arrays was P copies: at P = 8, 24 of CLIP's share's launches
        and their host time, which a real communicator does not have; before 2026-11-30
        the share was measured that way)."""
        import cupy as cp

        out = cp.empty((self.size,) + x.shape, x.dtype)
        raw = f"u{x.dtype.itemsize}"  # (a plain unsigned view: the bytes, whatever the dtype)
        out.view(raw)[...] = x.view(raw)
        return out

    def all_reduce(self, x):
        return x.copy()

    def reduce_scatter(self, x):
        return x[self.rank].copy()

    def exchange(self, ints):
        return [list(ints)] * self.size


#: the inputs' dtype (``--dtype``): "bf16", or "float32" (the products on the float32
#: paths the library picks by default, as a gradient-cached step's float32 embeddings take)
DTYPE = "bf16"


def _unit(rs, rows, d):
    import cupy as cp

    from cupynce._engine.kernels import BFLOAT16

    x = rs.standard_normal((rows, d), dtype=cp.float32)
    x /= cp.linalg.norm(x, axis=1, keepdims=True)
    return x if DTYPE == "float32" else x.astype(BFLOAT16)


def cupynce_rank(op, P, N, d, ws=None):
    import cupy as cp

    import cupynce

    n = N // P
    rs = cp.random.RandomState(0)
    comm = Loopback(0, P)
    if op == "clip_loss":
        a, b = _unit(rs, n, d), _unit(rs, n, d)
        ls = cp.full((), np.log(1 / 0.07), cp.float32)
        return lambda: cupynce.clip_loss_backward(cupynce.clip_loss_forward(
            a, b, ls, workspace_bytes=ws, group=comm)[1])
    if op == "info_nce":
        q, k = _unit(rs, n, d), _unit(rs, n, d)
        return lambda: cupynce.info_nce_backward(cupynce.info_nce_forward(
            q, k, 0.07, workspace_bytes=ws, group=comm)[1])
    z = _unit(rs, 2 * n, d)
    return lambda: cupynce.nt_xent_backward(cupynce.nt_xent_forward(
        z, 0.2, workspace_bytes=ws, group=comm)[1])


def single(op, N, d):
    import cupy as cp

    import cupynce

    rs = cp.random.RandomState(1)
    if op == "clip_loss":
        a, b = _unit(rs, N, d), _unit(rs, N, d)
        ls = cp.full((), np.log(1 / 0.07), cp.float32)
        return lambda: cupynce.clip_loss_backward(cupynce.clip_loss_forward(a, b, ls)[1])
    if op == "info_nce":
        q, k = _unit(rs, N, d), _unit(rs, N, d)
        return lambda: cupynce.info_nce_backward(cupynce.info_nce_forward(q, k, 0.07)[1])
    z = _unit(rs, 2 * N, d)
    return lambda: cupynce.nt_xent_backward(cupynce.nt_xent_forward(z, 0.2)[1])


def open_clip_rank(op, P, N, d, amp=False):
    import contextlib

    import torch
    import torch.nn.functional as F

    n = N // P
    g = torch.Generator(device="cuda").manual_seed(2)
    cast = torch.autocast("cuda", torch.bfloat16) if amp else contextlib.nullcontext()

    def leaf(rows):
        x = F.normalize(torch.randn(rows, d, device="cuda", generator=g), dim=-1)
        return x.to(torch.bfloat16 if DTYPE == "bf16" else torch.float32).requires_grad_(True)

    if op in ("clip_loss", "info_nce"):
        a, b, B = leaf(n), leaf(n), leaf(N)
        A = leaf(N) if op == "clip_loss" else None
        ls = torch.tensor(np.log(1 / 0.07), device="cuda", requires_grad=True)
        labels = torch.arange(n, device="cuda")  # rank 0's rows: its pairs at 0 .. n - 1

        def step():
            with cast:
                s = ls.exp()
                loss = F.cross_entropy(s * a @ B.T, labels)
                if A is not None:
                    loss = (loss + F.cross_entropy(s * b @ A.T, labels)) / 2
            leaves = (a, b, A, B, ls) if A is not None else (a, B, ls)
            return torch.autograd.grad(loss, leaves)
        return step
    z, Z = leaf(2 * n), leaf(2 * N)
    rows = torch.cat([torch.arange(n), N + torch.arange(n)]).cuda()
    labels = torch.cat([N + torch.arange(n), torch.arange(n)]).cuda()

    def step():
        with cast:
            s = (z @ Z.T) / 0.2
            s = s.index_put((torch.arange(2 * n, device="cuda"), rows),
                            torch.tensor(float("-inf"), device="cuda", dtype=s.dtype))
            loss = F.cross_entropy(s, labels)
        return torch.autograd.grad(loss, (z, Z))
    return step


def sent_bytes(op, P, N, d):
    """Bytes a rank sends per step over a ring (a rank sends (P - 1) / P of a gathered or
    reduce-scattered buffer): the column-side rows in bf16 and their float32 gradients,
    plus the O(N) float32 statistics (CLIP: the pairs' dots and the (2, N) column states;
    NT-Xent: the dots, the (2, width) column states and the rows' lse)."""
    n = N // P
    if op == "nt_xent":
        width = ((P - 1) // 2) * 2 * n + (2 * n if P % 2 == 0 else 0)
        return (P - 1) * (2 * n * d * (2 + 4) + 4 * (2 * n + 2 * width + 2 * n))
    extra = (P - 1) * (4 * n + 8 * N) if op == "clip_loss" else 0
    return (P - 1) * n * d * (2 + 4) + extra


def kernel_times(fn, steps: int = 3) -> Dict[str, List[float]]:
    """{kernel name: [ms a step, launches a step]} of ``steps`` calls of ``fn`` (after one
    unprofiled call), the device's events alone (``bench_multigpu.device_events``)."""
    import cupy as cp
    from torch.profiler import ProfilerActivity, profile

    from bench_multigpu import device_events

    fn()
    cp.cuda.runtime.deviceSynchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        cp.cuda.runtime.deviceSynchronize()
    return device_events(prof, steps)


def excess_table(share: Dict[str, List[float]], single: Dict[str, List[float]], P: int,
                 share_ms: float, single_ms: float, top: int = 12) -> str:
    """The kernels of most excess time in a rank's share over 1/P of the single op (ms a
    step; launches), then the totals and the GPU's idle time (a median step minus its
    kernels' sum) of each: ``share`` / ``single`` from :func:`kernel_times`."""
    rows = []
    for name in set(share) | set(single):
        s_ms, s_n = share.get(name, [0.0, 0])
        o_ms, o_n = single.get(name, [0.0, 0])
        rows.append([name, s_ms, s_n, o_ms / P, o_n, s_ms - o_ms / P])
    rows.sort(key=lambda r: -r[5])

    def short(name: str) -> str:
        return name if len(name) <= 70 else name[:67] + "..."

    out = [[short(r[0]), fmt_ms(r[1]), f"{r[2]:g}", fmt_ms(r[3]), f"{r[4]:g}",
            f"{r[5]:+.3f}"] for r in rows[:top]]
    k_share = sum(r[1] for r in rows)
    k_single = sum(r[3] for r in rows)
    out.append(["(every kernel)", fmt_ms(k_share), f"{sum(r[2] for r in rows):g}",
                fmt_ms(k_single), f"{sum(r[4] for r in rows):g}", f"{k_share - k_single:+.3f}"])
    out.append(["(GPU idle: median step − kernels)", fmt_ms(share_ms - k_share), "",
                fmt_ms(single_ms / P - k_single), "",
                f"{(share_ms - k_share) - (single_ms / P - k_single):+.3f}"])
    return markdown_table(["kernel", "share ms", "launches", "single ms / P",
                           "single launches", "excess ms"], out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--P", type=int, default=8)
    p.add_argument("--sizes", type=int, nargs="*", default=[65536, 262144])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ops", nargs="*", default=["clip_loss", "nt_xent", "info_nce"])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dtype", choices=["bf16", "float32"], default="bf16")
    p.add_argument("--no-peers", action="store_true", help="cupynce and 1/P single alone")
    p.add_argument("--kernels", action="store_true",
                   help="then each kernel's time in the share against 1/P of the single op's")
    p.add_argument("--cprofile", action="store_true",
                   help="then the host's costliest Python functions issuing the share")
    args = p.parse_args(argv)
    global DTYPE
    DTYPE = args.dtype
    rows, excess = [], []
    P, d = args.P, args.dim
    for op in args.ops:
        for N in args.sizes:
            res = {}
            for name, build in (("rank", lambda: cupynce_rank(op, P, N, d)),
                                ("lean", lambda: cupynce_rank(op, P, N, d, LEAN)),
                                ("single", lambda: single(op, N, d)),
                                ("open_clip", lambda: open_clip_rank(op, P, N, d)),
                                ("amp", lambda: open_clip_rank(op, P, N, d, amp=True))):
                if args.no_peers and name in ("open_clip", "amp"):
                    res[name] = {}
                    continue
                free_memory(full_gc=True)
                fn = None
                try:
                    fn = build()
                    res[name] = run_case(fn, warmup=1, repeat=args.repeat, catch_errors=True)
                except Exception as exc:  # noqa: BLE001 - out of memory in setup: a result
                    res[name] = {"error": f"{type(exc).__name__}"}
                del fn
            blk, lean, one = res["rank"], res["lean"], res["single"]

            def ms(r, div=1):
                if not r:  # (not run: --no-peers)
                    return "—"
                return fmt_ms(r["median_ms"] / div) if r.get("median_ms") else \
                    ("OOM" if r.get("oom") or "memory" in str(r.get("error", "")).lower()
                     else "error")

            def ratio(x, y, key="median_ms", div=1.0):
                return fmt_ratio(x[key] / (y[key] / div)) if x.get(key) and y.get(key) else "—"

            host = fmt_ms(blk["issue_median_ms"]) if blk.get("issue_median_ms") else "—"
            row = [op, N, N // P, ms(blk), host, fmt_mib(blk.get("peak_extra_bytes")), ms(lean),
                   fmt_mib(lean.get("peak_extra_bytes")), ms(one, P), ratio(blk, one, div=P)]
            for ref in (res["open_clip"], res["amp"]):
                row += [ms(ref), fmt_mib(ref.get("peak_extra_bytes")), ratio(ref, blk),
                        ratio(ref, lean, "peak_extra_bytes")]
            row.append(f"{sent_bytes(op, P, N, d) / 2**20:.0f}")
            rows.append(row)
            print(row, flush=True)
            if args.kernels and blk.get("median_ms") and one.get("median_ms"):
                free_memory(full_gc=True)
                share_k = kernel_times(cupynce_rank(op, P, N, d))
                free_memory(full_gc=True)
                single_k = kernel_times(single(op, N, d))
                excess.append(f"{op}, N = {N}, P = {P} (share {fmt_ms(blk['median_ms'])} ms, "
                              f"single / P {fmt_ms(one['median_ms'] / P)} ms):\n\n"
                              + excess_table(share_k, single_k, P, blk["median_ms"],
                                             one["median_ms"]))
                print(excess[-1], flush=True)
    table = markdown_table(
        ["op", "N", "n", "cupynce ms", "host ms", "MiB", "lean ms", "lean MiB", "1/P single ms",
         "cupynce / (1/P single)", "open_clip ms", "MiB", "speed-up", "memory ÷ lean",
         "open_clip amp ms", "MiB", "speed-up", "memory ÷ lean", "MiB sent per rank"], rows)
    print(f"\n{device_header(device_info())} · P = {P}, D = {d}, {DTYPE}, forward + "
          f"backward of one rank's share (rank 0)\n\n{table}")
    for text in excess:
        print(f"\n{text}")
    if args.cprofile:
        for op in args.ops:
            for N in args.sizes:
                free_memory(full_gc=True)
                print(f"\n{op}, N = {N}, P = {P}: the share's host time by function\n\n"
                      + host_profile(cupynce_rank(op, P, N, d)), flush=True)
    return 0


def host_profile(fn, steps: int = 10, top: int = 30) -> str:
    """cProfile over ``steps`` issues of ``fn`` (each outside the profile waited for, so
    the host never blocks on a full queue inside it): the ``top`` functions by own time,
    their totals over the steps (pstats' text)."""
    import io

    import cupy as cp
    from bench_multigpu import profile_calls

    for _ in range(3):
        fn()
    sync = cp.cuda.Device().synchronize
    sync()
    stats = profile_calls(fn, steps, sync, each=True)
    out = io.StringIO()
    stats.stream = out
    out.write(f"{steps} steps; the times below are their totals\n")
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


if __name__ == "__main__":
    sys.exit(main())
