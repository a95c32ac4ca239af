"""Small calls through ``cupynce.torch``: time per forward + backward, and its host share.

In multi-GPU training each GPU's loss call covers a few thousand rows; the kernels then take
tens of microseconds and the host time around them decides the step.  For each op (nt_xent,
info_nce, clip_loss with a learnable logit_scale, siglip_loss with a learnable scale and
bias), dtype (bf16, fp32) and N (256 ... 8192,
D = 512 by default) this times one call ``loss = f(*leaves); torch.autograd.grad(loss, leaves)``
along these paths, on the same GPU in one run:

* ``cupynce.torch`` — the public function, eager;
* ``cupynce.torch compiled`` — the same function under ``torch.compile`` (custom ops);
* ``CuPy core`` — what the bridge calls, on CuPy views of the same tensors on torch's stream
  (forward, reduce, ``*_backward_from_stats``), no torch in the loop;
* ``PyTorch eager`` / ``torch.compile`` — the plain formula users run (open_clip's for CLIP);
* ``memeff`` (CLIP) — memeff's fused Triton loss (fixed temperature), where installed;
* ``autograd floor`` — an ``autograd.Function`` that does no work over the same leaves: the
  host cost every Function-based loss pays (autograd's graph, its hop to the CUDA device
  thread and back), against which the bridge's own share shows.

The paths of one (op, dtype, N) are timed interleaved, round-robin within each repeat, so that
a slow spell of the (noisy, shared) host hits them alike.

Three numbers per path:

* time: median over ``--repeat`` calls, each started from an idle, synchronised GPU, of the
  CUDA-event span of the call (what one call costs, host time before the first kernel
  included: the ANCHORS measure);
* kernels: the GPU time of ``--burst`` calls queued back to back behind a GPU spin
  (``torch.cuda._sleep``) and bracketed by CUDA events: kernels plus the device's own launch
  gaps, no host starvation;
* host: the host time those ``--burst`` calls took to queue (the GPU was busy, nothing waited).

With ``--kernels``, each path's kernels too: GPU time per call of each kernel (torch.profiler,
CUPTI), largest first — where a call's GPU time goes, beside where its wall time goes.  For a
large call of the CuPy core alone (how the issue-23 split of docs/results.md was taken):
``--ops nt_xent --dtypes bfloat16 --sizes 16384 --paths "CuPy core" --burst 1 --kernels``.

overhead = time − kernels: what a call costs above its kernels (the issue's bounds: 150 µs
through ``cupynce.torch``, eager and compiled; 80 µs for the CuPy core).  A "starved" burst is
one where the GPU finished its spin before the calls were queued (a call synchronised): its
host / kernels figures are then not meaningful, and the row says so.
Writes ``bench_torch_overhead.json`` / ``.md`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupynce  # noqa: E402
import cupynce.torch as ct  # noqa: E402
from cupynce.ops import _graphs  # noqa: E402
from cupynce.ops import clip, info_nce, nt_xent  # noqa: E402
from cupynce.report.environment import device_header, device_info  # noqa: E402
from cupynce.report.formatting import markdown_table  # noqa: E402
from cupynce.report.torch_baseline import torch_reference, torch_step  # noqa: E402
from cupynce.torch import _bridge as bridge  # noqa: E402

OPS = ("nt_xent", "info_nce", "clip_loss", "siglip_loss")
PATHS = ("cupynce.torch", "cupynce.torch compiled", "CuPy core", "PyTorch eager",
         "torch.compile", "memeff", "autograd floor")
SIZES = (256, 512, 1024, 2048, 4096, 8192)
T = 0.1
LOGIT_SCALE = 2.659  # log(1/0.07)


def _cycles(seconds: float) -> int:
    import cupy

    khz = cupy.cuda.runtime.getDeviceProperties(torch.cuda.current_device())["clockRate"]
    return int(seconds * khz * 1e3)


def _inputs(op: str, n: int, d: int, dtype: torch.dtype) -> List[torch.Tensor]:
    """Unit rows (as the ANCHORS runs), a, b / z / q, k requiring grad; CLIP's learnable
    logit_scale as a 0-d float32 leaf."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = [F.normalize(torch.randn(n, d, generator=g, device="cuda"), dim=1).to(dtype)
         .requires_grad_(True) for _ in range(1 if op == "nt_xent" else 2)]
    if op == "clip_loss":
        x.append(torch.tensor(LOGIT_SCALE, device="cuda", requires_grad=True))
    if op == "siglip_loss":  # the paper's initialisation, both learnable
        x += [torch.tensor(v, device="cuda", requires_grad=True) for v in (2.3026, -10.0)]
    return x


def _bridge_fn(op: str) -> Callable[..., Any]:
    return {"nt_xent": lambda z: ct.nt_xent(z, T),
            "info_nce": lambda q, k: ct.info_nce(q, k, T),
            "clip_loss": lambda a, b, ls: ct.clip_loss(a, b, ls),
            "siglip_loss": lambda a, b, ls, lb: ct.siglip_loss(a, b, ls, lb)}[op]


def _torch_fn(op: str) -> Callable[..., Any]:
    if op == "info_nce":
        def fn(q, k):
            return F.cross_entropy(q @ k.T / T, torch.arange(q.shape[0], device=q.device))
        return fn
    return torch_reference(torch, op, T)


_COMPILED: Dict[tuple, Callable[..., Any]] = {}


def _compiled(path: str, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """One ``torch.compile(dynamic=True)`` function per (path, op): N is symbolic, so one
    graph per dtype serves every size (a compile per size would take most of the run)."""
    key = (path, op)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=True)
    return _COMPILED[key]


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
                loss, ctx = nt_xent.nt_xent_forward(xs[0], T)
                return loss, nt_xent.nt_xent_backward(ctx, one)
            if op == "info_nce":
                loss, ctx = info_nce.info_nce_forward(xs[0], xs[1], T)
                return loss, info_nce.info_nce_backward(ctx, one)
            if op == "siglip_loss":
                loss, ctx = cupynce.siglip_loss_forward(*xs)
                return loss, cupynce.siglip_loss_backward(ctx, one)
            loss, ctx = clip.clip_loss_forward(xs[0], xs[1], xs[2])
            return loss, clip.clip_loss_backward(ctx, one)
    return call


def memeff_call(op: str, leaves: List[torch.Tensor]) -> Callable[[], Any]:
    import memeff

    a, b = leaves[:2]
    loss_fn = memeff.MemoryEfficientCLIPLoss(temperature=math.exp(-LOGIT_SCALE),
                                             normalized_inputs=True, stable=False)
    return torch_step(torch, loss_fn, [a, b])


def _raiser(exc: Exception) -> Callable[[], Any]:
    def call():
        raise exc
    return call


def make_call(path: str, op: str, leaves: List[torch.Tensor]) -> Callable[[], Any]:
    if path == "CuPy core":
        return core_call(op, leaves)
    if path == "memeff":
        return memeff_call(op, leaves)
    fn = _bridge_fn(op) if path.startswith("cupynce") else _torch_fn(op)
    if path in ("cupynce.torch compiled", "torch.compile"):
        fn = _compiled(path, op, fn)
    return torch_step(torch, fn, leaves)


class _Floor(torch.autograd.Function):
    """An autograd.Function that does no work: a new 0-d output, empty gradients.  Its
    forward + ``autograd.grad`` is the host floor of any loss built as a Function (the
    engine's graph, its hop to the CUDA device thread and back)."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.likes = [(x.shape, x.dtype) for x in xs]
        return xs[0].new_empty((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        return tuple(g.new_empty(s, dtype=d) for s, d in ctx.likes)


def floor_call(leaves: List[torch.Tensor]) -> Callable[[], Any]:
    return torch_step(torch, lambda *xs: _Floor.apply(*xs), leaves)


def kernel_times(call: Callable[[], Any], runs: int = 5) -> List[tuple]:
    """[(kernel name, µs a call, launches a call)] of ``call()``'s GPU work, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            call()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / runs, e.count // runs)
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def measure(calls: Dict[str, Callable[[], Any]], *, warmup: int, burst: int,
            repeat: int) -> Dict[str, Any]:
    """Time each of ``calls`` (path -> call), the paths interleaved round-robin within each
    repeat so that a slow spell of the host hits them alike (the ratios are then fair)."""
    res: Dict[str, Any] = {}
    live = {}
    for path, call in calls.items():
        try:
            for _ in range(warmup):
                call()
            torch.cuda.synchronize()
            live[path] = call
        except Exception as exc:  # noqa: BLE001 - a peer failing is a result
            res[path] = f"{type(exc).__name__}: {exc}"[:300]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: Dict[str, List[float]] = {p: [] for p in live}
    gpu: Dict[str, List[float]] = {p: [] for p in live}
    host: Dict[str, List[float]] = {p: [] for p in live}
    starved = dict.fromkeys(live, 0)
    spin = _cycles(0.05 + burst * 2e-4)
    for _ in range(repeat):
        for path, call in live.items():
            torch.cuda.synchronize()
            start.record()
            out = call()
            end.record()
            torch.cuda.synchronize()
            del out
            times[path].append(start.elapsed_time(end) * 1e3)
        for path, call in live.items():
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
            starved[path] += not busy
            host[path].append((t1 - t0) / burst * 1e6)
            gpu[path].append(start.elapsed_time(end) / burst * 1e3)
    for path in live:
        t, g = statistics.median(times[path]), statistics.median(gpu[path])
        res[path] = dict(time_us=t, kernels_us=g, host_us=statistics.median(host[path]),
                         overhead_us=t - g, starved_bursts=starved[path],
                         times_us=times[path])
    return res


def _fmt_ms(us: Optional[float]) -> str:
    if us is None:
        return "—"
    return f"{us / 1e3:.3f}" if us < 1e4 else f"{us / 1e3:.1f}"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "—" if a is None or b is None else f"{a / b:.2f}×"


def tables(res: Dict[str, Any], paths) -> str:
    """One table per op: time (ms) per path; the ratios of cupynce.torch to eager PyTorch and
    memeff; overhead (µs above the kernels) of cupynce.torch eager / compiled and the core."""
    out = []
    for op, per_dtype in res["results"].items():
        shown = [p for p in paths if any(p in cell for cases in per_dtype.values()
                                         for cell in cases.values())]
        head = (["dtype", "N"] + [f"{p} ms" for p in shown] + ["kernels µs", "÷ eager"]
                + (["÷ memeff"] if "memeff" in shown else [])
                + [f"overhead µs: {p}" for p in ("cupynce.torch", "cupynce.torch compiled",
                                                 "CuPy core") if p in shown])
        rows = []
        for dname, cases in per_dtype.items():
            for n, cell in cases.items():
                def t(p):
                    r = cell.get(p)
                    return r["time_us"] if isinstance(r, dict) else None

                def cellstr(p):
                    r = cell.get(p)
                    if r is None:
                        return "—"
                    if isinstance(r, str):
                        return "fails" if "OutOfMemory" not in r else "OOM"
                    return _fmt_ms(r["time_us"]) + ("*" if r["starved_bursts"] else "")
                ours = cell.get("cupynce.torch")
                row = [dname, n] + [cellstr(p) for p in shown]
                row.append(f"{ours['kernels_us']:.0f}" if isinstance(ours, dict) else "—")
                row.append(_ratio(t("cupynce.torch"), t("PyTorch eager")))
                if "memeff" in shown:
                    row.append(_ratio(t("cupynce.torch"), t("memeff")))
                for p in ("cupynce.torch", "cupynce.torch compiled", "CuPy core"):
                    if p in shown:
                        r = cell.get(p)
                        row.append(f"{r['overhead_us']:.0f}" if isinstance(r, dict) else "—")
                rows.append(row)
        out.append(f"**{op}**\n\n" + markdown_table(head, rows))
    return "\n\n".join(out)


def write(res: Dict[str, Any], args) -> str:
    md = (f"{device_header(res['info'])}\n\nforward + backward, D = {args.d}; time: "
          f"median of {args.repeat} calls each from an idle GPU (CUDA events); kernels: GPU "
          f"time per call of bursts of {args.burst} calls queued behind a GPU spin (median of "
          f"{args.repeat}); the paths of a row timed interleaved; overhead = time − kernels; "
          f"compiled: torch.compile(dynamic=True); autograd floor: a Function doing no work. "
          f"* = a starved burst (host / kernels not meaningful).\n\n"
          f"{tables(res, args.paths)}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(res, indent=1, default=str))
    (args.out / f"{args.name}.md").write_text(md)
    return md


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda f: (lambda s: [f(x) for x in s.split(",") if x])  # noqa: E731
    p.add_argument("--ops", type=csv(str), default=list(OPS))
    p.add_argument("--dtypes", type=csv(str), default=["bfloat16", "float32"])
    p.add_argument("--sizes", type=csv(int), default=list(SIZES))
    p.add_argument("--paths", type=csv(str), default=list(PATHS))
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--burst", type=int, default=20, help="calls queued behind one GPU spin "
                   "(keep launches below CUDA's queue depth, ~1000)")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--kernels", action="store_true",
                   help="also list each path's kernels and their GPU time (torch.profiler)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", default="bench_torch_overhead")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_torch_overhead: needs a CUDA GPU")
    import torch._dynamo as dynamo

    dynamo.config.cache_size_limit = 1024  # (a graph per dtype and op)
    if hasattr(dynamo.config, "recompile_limit"):
        dynamo.config.recompile_limit = 1024
    torch.zeros(1, device="cuda")
    info = device_info()
    res = dict(d=args.d, info=info, results={}, args=dict(warmup=args.warmup, burst=args.burst,
                                                          repeat=args.repeat))
    for op in args.ops:
        res["results"][op] = {}
        for dname in args.dtypes:
            dtype = getattr(torch, dname)
            res["results"][op][dname] = {}
            for n in args.sizes:
                t0 = time.perf_counter()
                leaves = _inputs(op, n, args.d, dtype)
                calls = {}
                for path in args.paths:
                    if path == "memeff" and op != "clip_loss":
                        continue
                    try:
                        calls[path] = (floor_call(leaves) if path == "autograd floor"
                                       else make_call(path, op, leaves))
                    except Exception as exc:  # noqa: BLE001 - a peer failing is a result
                        calls[path] = _raiser(exc)
                cell = res["results"][op][dname][n] = measure(
                    calls, warmup=args.warmup, burst=args.burst, repeat=args.repeat)
                if args.kernels:
                    for path, r in cell.items():
                        if isinstance(r, dict):
                            r["kernels"] = kernel_times(calls[path])[:12]
                gi = _graphs.info()
                for path, r in cell.items():
                    msg = r if isinstance(r, str) else (
                        f"{r['time_us']:.0f} µs, kernels {r['kernels_us']:.0f}, "
                        f"host {r['host_us']:.0f}, overhead {r['overhead_us']:.0f}"
                        + (f", {r['starved_bursts']} starved" if r["starved_bursts"] else ""))
                    print(f"{op} {dname} N={n} {path}: {msg}", flush=True)
                    for k, us, c in (r.get("kernels", ()) if isinstance(r, dict) else ()):
                        print(f"    {us:8.1f} µs x{c}  {k[:80]}", flush=True)
                print(f"  ({time.perf_counter() - t0:.1f} s; graphs: {gi['plans']} plans, "
                      f"{gi['bytes'] >> 20} MiB"
                      f"{'; refused: ' + str(gi['refused']) if gi['refused'] else ''})",
                      flush=True)
                del calls, leaves
                _graphs.clear()
                torch.cuda.empty_cache()
        write(res, args)  # (what is done so far, should the run be cut short)
    md = write(res, args)
    print(md)
    return res


if __name__ == "__main__":
    main()
