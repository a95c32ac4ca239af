"""Host overhead of ``cupynce.torch`` per call: forward + backward at N = 64, D = 32 on CUDA.

At this size the kernels take microseconds and a training step is bound by the host, so the
figure that matters is how long the Python side of one call takes compared with the GPU work
it issues.  For each op (nt_xent, info_nce, clip_loss with a learnable logit_scale) and each
path — ``cupynce.torch`` (the bridge), the CuPy core alone on the same stream (what the
bridge calls, without torch), and the plain PyTorch formula — one "call" is
``loss = f(*leaves); torch.autograd.grad(loss, leaves)`` (the core: forward, reduce,
``*_backward_from_stats``) and three numbers are taken:

* wall: a loop of ``--iters`` calls, synchronised at the end: µs per call in steady state
  (the larger of host and GPU time per call);
* GPU: the GPU time of ``--burst`` calls run back to back: the calls are queued while the
  GPU spins (``torch.cuda._sleep``), CUDA events on the stream bracket them, so the span is
  kernels plus the device's own launch gaps, with no host starvation;
* host: the time the host took to queue those calls (the GPU was busy throughout, so nothing
  waited) — the host cost of one call.

overhead = wall − GPU: what a call costs above its kernels' time (the issue's bound: 100 µs).
A "starved" burst is one where the GPU finished its spin before the calls were queued: the
call synchronised, and its host / GPU figures are not meaningful.
Medians of ``--repeat`` bursts.  Writes ``bench_torch_overhead.json`` / ``.md`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupynce.torch as ct  # noqa: E402
from cupynce.ops import _base  # noqa: E402
from cupynce.ops import clip, info_nce, nt_xent  # noqa: E402
from cupynce.report import harness as _harness  # noqa: E402
from cupynce.torch import _bridge as bridge  # noqa: E402

OPS = ("nt_xent", "info_nce", "clip_loss")
LEGEND = ("starved bursts: bursts in which the GPU finished its spin before the host had queued "
          "the calls, i.e. the call waited for the GPU (a synchronisation): host and GPU are then "
          "not meaningful for that row")
T = 0.1
LOGIT_SCALE = 2.659  # log(1/0.07)


def _cycles(seconds: float) -> int:
    import cupy

    khz = cupy.cuda.runtime.getDeviceProperties(torch.cuda.current_device())["clockRate"]
    return int(seconds * khz * 1e3)


def _inputs(op: str, n: int, d: int, dtype: torch.dtype) -> List[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = [torch.randn(n, d, generator=g, device="cuda").to(dtype).requires_grad_(True)
         for _ in range(1 if op == "nt_xent" else 2)]
    if op == "clip_loss":
        x.append(torch.tensor(LOGIT_SCALE, device="cuda", requires_grad=True))
    return x


def bridge_call(op: str, leaves: List[torch.Tensor]) -> Callable[[], Any]:
    fn = {"nt_xent": lambda z: ct.nt_xent(z, T),
          "info_nce": lambda q, k: ct.info_nce(q, k, T),
          "clip_loss": ct.clip_loss}[op]
    return _harness.torch_step(torch, fn, leaves)


def torch_call(op: str, leaves: List[torch.Tensor]) -> Callable[[], Any]:
    if op == "info_nce":
        def fn(q, k):
            return F.cross_entropy(q @ k.T / T, torch.arange(q.shape[0], device=q.device))
    else:
        fn = _harness.torch_reference(torch, op, T)
    return _harness.torch_step(torch, fn, leaves)


def core_call(op: str, leaves: List[torch.Tensor]) -> Callable[[], Any]:
    """What the bridge's two ops run, on CuPy views of the same tensors, on torch's stream
    (CuPy's own memory pool, no torch in the loop)."""
    import cupy

    xs = [bridge.array_of(t) for t in leaves]
    one = cupy.ones((), cupy.float32)  # grad_output, on the device as torch's is
    stream = bridge._cupy_stream(torch.cuda.current_stream(), torch.cuda.current_device())

    def call():
        with stream:
            if op == "nt_xent":
                rows, ctx = nt_xent.nt_xent_forward(xs[0], T, reduction="none")
                _base.reduce(ctx.xp, rows, "mean")  # as the bridge does
                return nt_xent.nt_xent_backward_from_stats(xs[0], ctx.stats[0], one,
                                                               temperature=T)
            if op == "info_nce":
                rows, ctx = info_nce.info_nce_forward(xs[0], xs[1], T, reduction="none")
                _base.reduce(ctx.xp, rows, "mean")  # as the bridge does
                return info_nce.info_nce_backward_from_stats(xs[0], xs[1], None, ctx.stats[0],
                                                                one, temperature=T)
            rows, ctx = clip.clip_loss_forward(xs[0], xs[1], xs[2], reduction="none")
            _base.reduce(ctx.xp, rows, "mean")  # as the bridge does
            return clip.clip_loss_backward_from_stats(xs[0], xs[1], xs[2], *ctx.stats,
                                                             one)
    return call


def measure(call: Callable[[], Any], *, iters: int, burst: int, repeat: int) -> Dict[str, Any]:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / iters * 1e6
    spin = _cycles(0.2)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu, host, starved = [], [], 0
    for _ in range(repeat):
        torch.cuda.synchronize()
        torch.cuda._sleep(spin)
        start.record()
        t0 = time.perf_counter()
        for _ in range(burst):
            call()
        t1 = time.perf_counter()
        end.record()
        busy = not start.query()  # still spinning when the last call was queued
        torch.cuda.synchronize()
        starved += not busy
        host.append((t1 - t0) / burst * 1e6)
        gpu.append(start.elapsed_time(end) / burst * 1e3)
    g = statistics.median(gpu)
    return dict(wall_us=wall_us, gpu_us=g, host_us=statistics.median(host),
                overhead_us=wall_us - g, gpu_starved_bursts=starved)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--d", type=int, default=32)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--burst", type=int, default=40, help="calls queued behind one GPU spin "
                   "(keep launches below CUDA's queue depth, ~1000)")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_torch_overhead: needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    torch.zeros(1, device="cuda")
    info = _harness.device_info()
    rows, res = [], dict(n=args.n, d=args.d, dtype=args.dtype, info=info, results={})
    for op in OPS:
        res["results"][op] = {}
        for path, make in (("cupynce.torch", bridge_call), ("CuPy core alone", core_call),
                           ("PyTorch eager", torch_call)):
            leaves = _inputs(op, args.n, args.d, dtype)
            r = measure(make(op, leaves), iters=args.iters, burst=args.burst,
                        repeat=args.repeat)
            res["results"][op][path] = r
            rows.append([op, path, f"{r['wall_us']:.0f}", f"{r['host_us']:.0f}",
                         f"{r['gpu_us']:.1f}", f"{r['overhead_us']:.0f}",
                         str(r["gpu_starved_bursts"])])
            print(rows[-1], flush=True)
    table = _harness.markdown_table(
        ["op", "path", "wall µs/call", "host µs/call", "GPU µs/call", "overhead µs (wall − GPU)",
         "starved bursts"], rows)
    md = (f"{_harness.device_header(info)}\n\nforward + backward, N = {args.n}, D = {args.d}, "
          f"{args.dtype}; wall: {args.iters} calls; host / GPU: median of {args.repeat} bursts of "
          f"{args.burst} calls queued behind a GPU spin\n\n{table}\n\n{LEGEND}.\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_torch_overhead.json").write_text(json.dumps(res, indent=1))
    (args.out / "bench_torch_overhead.md").write_text(md)
    print(md)
    return res


if __name__ == "__main__":
    main()
