"""The global losses on several GPUs over NCCL: one process per GPU, launched by ``torchrun``.

Run from the repository root on a machine with P GPUs (NVLink multicast stays off)::

    export NCCL_NVLS_ENABLE=0
    for P in 1 2 4; do
      torchrun --standalone --nproc_per_node $P benchmarks/bench_multigpu.py --json out/p$P.json
    done
    python benchmarks/bench_multigpu.py --report out/p1.json out/p2.json out/p4.json

    # the largest global batch: one step each, time and peak memory per GPU
    torchrun --standalone --nproc_per_node 4 benchmarks/bench_multigpu.py --ops clip_loss \\
        --sizes 1048576 4194304 --once --json out/largest.json

Each rank holds n = N / P rows of one global batch of N (bf16 unit rows, D = 512; NT-Xent's N
counts the rows of z = 2B, as in ``bench_contrastive.py``), and one training step is timed:
forward + backward of the loss with respect to every leaf, the collectives included.

``cupynce``    ``cupynce.torch.<op>(..., group=WORLD)`` — the exact global loss (every rank the
               loss of the whole batch, DDP's gradient convention); learnable ``logit_scale``
               (CLIP, SigLIP) and ``logit_bias`` (SigLIP).  With P = 1 the plain
               single-process op (``group=None``): the scaling baseline.
``open_clip``  open_clip's formula written here: the features all-gathered with their
               gradient (``torch.distributed.nn.functional.all_gather``: open_clip's
               ``local_loss=True, gather_with_grad=True``), the n × N logits of this rank's
               rows against every column, ``F.cross_entropy`` / ``F.logsigmoid``, autograd.
               CLIP both directions; InfoNCE one; NT-Xent lightly's masked 2n × 2N logits;
               SigLIP the n × N sigmoid logits of the rank's rows (open_clip's neighbour
               exchange computes the same blocks).  Plain bf16, as ``bench_distributed.py``.
               A case whose logits alone (8 bytes a logit a direction: the bf16 logits, their
               log-softmax and gradients) would not fit in the GPU is not run and is reported
               as ``needs N GiB``.

Reported per (op, N, P): the median step time over the repeats (CUDA events on each rank; the
slowest rank's median), the peak memory above the inputs on the fullest rank (gradients
included), and, in ``--report``, the scaling efficiency T(1) / (P · T(P)) against the
single-GPU op at the same N.  ``--once``: one step (after one small warm-up step that
compiles and plans), timed and measured in the same call — for sizes where a step takes
seconds.  ``--breakdown``: after each cupynce case, three more steps under torch.profiler on
every rank -- the kernels' time split into NCCL's, copies and the rest, the GPU's idle time
and the host's -- reported for the slowest rank beside the 1-GPU compute / P.
``--host-profile``: the same with the host profiled too (its events of most self CPU time a
step: where it waits), in separate runs since the CPU profiling adds host time.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupynce.report.harness import (GiB, device_header, device_info, fmt_mib,  # noqa: E402
                                    fmt_ms, fmt_ratio, free_memory, markdown_table, run_case)

OPS = ("clip_loss", "siglip_loss", "nt_xent", "info_nce")
#: bytes a logit of the formula's n x N matrix costs per direction (bf16 logits, their
#: log-softmax and the gradients): open_clip's CLIP at N = 65536 on one GPU took 64 GiB
LOGIT_BYTES = 8
TEMPERATURE = 0.07


def _logits(op: str, n: int, N: int) -> int:
    """How many logits the formula materialises on one rank (both directions for CLIP)."""
    return {"clip_loss": 2 * n * N, "siglip_loss": 3 * n * N // 2, "info_nce": n * N,
            "nt_xent": n * N}[op]  # NT-Xent: n local rows of z against N rows; SigLIP: the
    #                                   ±1 label matrix beside the logits


def _unit(rows: int, d: int, gen, device, dtype):
    import torch
    import torch.nn.functional as F

    x = F.normalize(torch.randn(rows, d, generator=gen, device=device), dim=-1)
    return x.to(dtype).requires_grad_(True)


def cupynce_step(op: str, n: int, d: int, group, device, dtype) -> Callable[[], Any]:
    """One step of cupynce's global loss on this rank's n rows (z: n rows, n even)."""
    import torch

    import cupynce.torch as ct

    gen = torch.Generator(device=device).manual_seed(1 + (group.rank() if group else 0))
    ls = torch.tensor(math.log(1 / TEMPERATURE), device=device, requires_grad=True)
    if op == "nt_xent":
        z = _unit(n, d, gen, device, dtype)
        return lambda: torch.autograd.grad(ct.nt_xent(z, 0.2, group=group), (z,))
    a, b = _unit(n, d, gen, device, dtype), _unit(n, d, gen, device, dtype)
    if op == "info_nce":
        return lambda: torch.autograd.grad(ct.info_nce(a, b, TEMPERATURE, group=group), (a, b))
    if op == "clip_loss":
        return lambda: torch.autograd.grad(ct.clip_loss(a, b, ls, group=group), (a, b, ls))
    bias = torch.tensor(-10.0, device=device, requires_grad=True)
    return lambda: torch.autograd.grad(ct.siglip_loss(a, b, ls, bias, group=group),
                                       (a, b, ls, bias))


def open_clip_step(op: str, n: int, d: int, rank: int, P: int, device,
                   dtype) -> Callable[[], Any]:
    """One step of open_clip's formula (all-gather with gradient + local logits) on this rank."""
    import torch
    import torch.nn.functional as F

    def gather(x):
        if P == 1:
            return x
        from torch.distributed.nn.functional import all_gather

        return torch.cat(all_gather(x))

    gen = torch.Generator(device=device).manual_seed(100 + rank)
    ls = torch.tensor(math.log(1 / TEMPERATURE), device=device, requires_grad=True)
    if op == "nt_xent":  # z = [view 1; view 2] of this rank's n / 2 samples, lightly's layout
        h = n // 2
        z = _unit(n, d, gen, device, dtype)
        self_col = torch.cat([torch.arange(h), P * h + torch.arange(h)]).to(device) + rank * h
        pos_col = torch.cat([P * h + torch.arange(h), torch.arange(h)]).to(device) + rank * h
        rows = torch.arange(n, device=device)

        def step():
            parts = gather(z).view(P, 2, h, d)
            Z = torch.cat([parts[:, 0].reshape(P * h, d), parts[:, 1].reshape(P * h, d)])
            s = (z @ Z.T) / 0.2
            s = s.index_put((rows, self_col), torch.tensor(float("-inf"), device=device,
                                                           dtype=s.dtype))
            return torch.autograd.grad(F.cross_entropy(s, pos_col), (z,))
        return step
    a, b = _unit(n, d, gen, device, dtype), _unit(n, d, gen, device, dtype)
    labels = rank * n + torch.arange(n, device=device)
    if op == "info_nce":
        def step():
            return torch.autograd.grad(F.cross_entropy((a @ gather(b).T) / TEMPERATURE,
                                                       labels), (a, b))
        return step
    if op == "clip_loss":
        def step():
            s = ls.exp()
            A, B = gather(a), gather(b)
            loss = (F.cross_entropy(s * a @ B.T, labels) + F.cross_entropy(s * b @ A.T, labels)) / 2
            return torch.autograd.grad(loss, (a, b, ls))
        return step
    bias = torch.tensor(-10.0, device=device, requires_grad=True)

    def step():  # open_clip builds its ±1 labels each call (get_ground_truth)
        sign = -torch.ones(n, n * P, device=device, dtype=dtype)
        sign[torch.arange(n, device=device), labels] = 1
        logits = ls.exp() * a @ gather(b).T + bias
        loss = -F.logsigmoid(sign * logits).sum() / n
        return torch.autograd.grad(loss, (a, b, ls, bias))
    return step


def _once(fn: Callable[[], Any], device: str) -> Dict[str, Any]:
    """One call, timed with CUDA events and its peak memory above the inputs measured."""
    import torch

    from cupynce.report.harness import is_oom, measure_peak

    if device != "cuda":  # (no memory on the host: see run_rank)
        return run_case(fn, warmup=0, repeat=1, memory=False, catch_errors=True, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        def timed():
            start.record()
            out = fn()
            end.record()
            return out
        peaks, out = measure_peak(timed)
        del out
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        return {"median_ms": ms, "times_ms": [ms], "peak_extra_bytes": peaks["total"]}
    except Exception as exc:  # noqa: BLE001
        free_memory(full_gc=True)
        return {"oom": True} if is_oom(exc) else {"error": f"{type(exc).__name__}: {exc}"[:300]}


def _breakdown(fn: Callable[[], Any], steps: int = 3, host: bool = False) -> Dict[str, Any]:
    """Where this rank's step goes (``--breakdown``): ``steps`` steps under torch.profiler
    (CUDA kernels), per step: the CUDA-event wall time, the host time to issue it, the
    kernels' time split into NCCL's (the exchange), copies / memsets, and the rest (the
    compute); ``gap_ms`` = wall − the kernels' sum: the GPU idle (host-bound launches,
    waiting on another rank), negative where kernels overlap.  ``host`` (``--host-profile``):
    the CPU side profiled too, ``host_top`` the host events (torch ops, CUDA runtime and
    driver calls, gloo / NCCL calls) of most self CPU time a step -- where a host blocked on
    the GPU or on another rank shows (a synchronising call's time is its wait)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])
    with profile(activities=acts) as prof:
        start.record()
        h0 = time.perf_counter()
        for _ in range(steps):
            fn()
        host = (time.perf_counter() - h0) * 1e3 / steps
        end.record()
        torch.cuda.synchronize()
    out = {"wall_ms": start.elapsed_time(end) / steps, "host_ms": host, "nccl_ms": 0.0,
           "copy_ms": 0.0, "compute_ms": 0.0}
    for name, (t, _) in device_events(prof, steps).items():
        key = name.lower()
        kind = "nccl_ms" if "nccl" in key else "copy_ms" if key.startswith(("memcpy", "memset")) \
            else "compute_ms"
        out[kind] += t
    out["gap_ms"] = out["wall_ms"] - out["nccl_ms"] - out["copy_ms"] - out["compute_ms"]
    if host:
        top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        out["host_top"] = [[e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps]
                           for e in top[:12] if e.self_cpu_time_total > 0]
        out["host_py"] = _python_profile(fn, steps)
    return out


def device_events(prof, steps: int) -> Dict[str, List[float]]:
    """{kernel, copy or memset name: [ms a step, launches a step]} of a torch.profiler run of
    ``steps`` steps -- the device's events alone: with the CPU profiled, an op's device total
    holds its kernels' time once more."""
    from torch.autograd import DeviceType

    return {ev.key: [ev.device_time_total / 1e3 / steps, ev.count / steps]
            for ev in prof.key_averages()
            if ev.device_type == DeviceType.CUDA and ev.device_time_total > 0}


def profile_calls(fn: Callable[[], Any], steps: int, sync: Callable[[], Any],
                  each: bool = False):
    """cProfile over ``steps`` calls of ``fn``, then ``sync()`` outside the profile: after
    each call (``each``: the host never blocks on a full queue inside the profile) or after
    the last.  Returns the ``pstats.Stats``; the caller syncs before, as its case needs."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        fn()
        prof.disable()
        if each:
            sync()
    if not each:
        sync()
    return pstats.Stats(prof)


def _python_profile(fn: Callable[[], Any], steps: int, cuda: bool = True) -> List[List[Any]]:
    """The Python functions of most own time a step (cProfile over ``steps`` steps, then a
    synchronisation): [function, own ms, calls] -- a C call that waits (a synchronising
    CUDA call, a collective waiting for another rank) shows as a builtin's own time.
    ``cuda`` False: no CUDA synchronisation (a CPU run)."""
    import torch
    import torch.distributed as dist

    # (every rank starts together: the torch.profiler's post-processing before this takes a
    # different time on each, and a collective would wait that skew out under the profile)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if dist.is_initialized():
        dist.barrier()
    # {(file, line, name): (cc, nc, tt, ct, callers)}
    stats = profile_calls(fn, steps, sync).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:12]
    return [[f"{Path(f).name}:{line}({name})", tt * 1e3 / steps, nc / steps]
            for (f, line, name), (_, nc, tt, _, _) in rows]


def run_rank(ops: List[str], sizes: List[int], d: int = 512, repeat: int = 5,
             once: bool = False, peers: bool = True, device: str = "cuda",
             dtype_name: str = "bfloat16", breakdown: bool = False,
             host_profile: bool = False) -> List[Dict[str, Any]]:
    """Every case on this rank (inside an initialised process group); rank 0 gets the rows
    (one dict per case, merged over the ranks: slowest median, fullest memory)."""
    import torch
    import torch.distributed as dist

    rank, P = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD if P > 1 else None
    dtype = getattr(torch, dtype_name)
    total = (torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
             if device == "cuda" else 1 << 62)
    rows: List[Dict[str, Any]] = []
    if once and ops:  # a small step first: kernels compiled, plans learnt, pools warmed
        cupynce_step(ops[0], 2 * 1024, d, group, device, dtype)()
    for op in ops:
        for N in sizes:
            n = N // P
            if N % P or (op == "nt_xent" and n % 2):
                raise SystemExit(f"N = {N} must split into equal (even, for nt_xent) shares "
                                 f"over {P} ranks")
            impls = [("cupynce", lambda: cupynce_step(op, n, d, group, device, dtype))]
            if peers:
                impls.append(("open_clip", lambda: open_clip_step(op, n, d, rank, P, device,
                                                                  dtype)))
            for name, build in impls:
                need = LOGIT_BYTES * _logits(op, n, N) if name == "open_clip" else 0
                if need > 0.92 * total:
                    res: Dict[str, Any] = {"skipped": f"needs {need / GiB:.0f} GiB"}
                else:
                    free_memory(full_gc=True)
                    fn = build()
                    # on the CPU (the gloo test) no memory: tracemalloc sees none of torch's
                    # tensors, and starting / stopping it beside gloo's threads can crash the
                    # rank (harness._tracemalloc_toggle_unsafe)
                    res = _once(fn, device) if once else \
                        run_case(fn, warmup=1, repeat=repeat, memory=device == "cuda",
                                 catch_errors=True, device=device)
                    if breakdown and name == "cupynce" and device == "cuda" \
                            and res.get("median_ms") is not None:
                        res["breakdown"] = _breakdown(fn, host=host_profile)
                    del fn
                res.pop("result", None)
                every = [None] * P
                dist.all_gather_object(every, res)
                if rank == 0:
                    rows.append(_merge(op, N, P, name, every))
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def _merge(op: str, N: int, P: int, impl: str, every: List[Dict[str, Any]]) -> Dict[str, Any]:
    row: Dict[str, Any] = {"op": op, "N": N, "P": P, "impl": impl}
    ok = [r for r in every if r.get("median_ms") is not None]
    if len(ok) == len(every):
        row["ms"] = max(r["median_ms"] for r in ok)  # the slowest rank sets the step
        row["ms_ranks"] = [r["median_ms"] for r in ok]
        peaks = [r["peak_extra_bytes"] for r in ok if r.get("peak_extra_bytes") is not None]
        row["peak_bytes"] = max(peaks) if peaks else None  # None: not measured (the CPU)
        if all("breakdown" in r for r in ok):  # (the slowest rank's, by wall time)
            row["breakdown"] = max((r["breakdown"] for r in ok), key=lambda b: b["wall_ms"])
    else:
        bad = next(r for r in every if r.get("median_ms") is None)
        row["failed"] = bad.get("skipped") or ("OOM" if bad.get("oom") else
                                               str(bad.get("error", "error"))[:120])
    return row


# ---- the report ---------------------------------------------------------------------------
def launches(paths: List[str]):
    """(every row, one header line a launch) of several launches' JSON files (P = 1, 2, ...;
    each ``{"P", "device", "rows"}``)."""
    rows, headers = [], []
    for p in paths:
        data = json.loads(Path(p).read_text())
        rows += data["rows"]
        headers.append(f"P = {data['P']}: {device_header(data['device'])}")
    return rows, headers


def report(paths: List[str]) -> str:
    """Markdown tables from the JSON files of several launches (P = 1, 2, 4, ...)."""
    rows, headers = launches(paths)
    by = {(r["op"], r["N"], r["P"], r["impl"]): r for r in rows}
    Ps = sorted({r["P"] for r in rows})
    out = []
    for op, N in sorted({(r["op"], r["N"]) for r in rows}, key=lambda k: (OPS.index(k[0]), k[1])):
        base = by.get((op, N, 1, "cupynce"), {}).get("ms")
        for P in Ps:
            c, o = by.get((op, N, P, "cupynce"), {}), by.get((op, N, P, "open_clip"), {})
            eff = fmt_ratio(None) if not (base and c.get("ms")) else \
                f"{100 * base / (P * c['ms']):.0f} %"
            speed = fmt_ratio(o["ms"] / c["ms"]) if c.get("ms") and o.get("ms") else "—"
            out.append([op, N, P, N // P, _ms(c), _mib(c), eff, _ms(o), _mib(o), speed])
    table = markdown_table(["op", "global N", "GPUs", "rows a GPU", "cupynce ms", "MiB a GPU",
                            "scaling T1/(P·TP)", "open_clip formula ms", "MiB a GPU",
                            "speed-up"], out)
    split = []  # where a rank's step goes (--breakdown), the slowest rank's
    for (op, N, P, impl), r in sorted(by.items(), key=lambda kv: (OPS.index(kv[0][0]),
                                                                  kv[0][1], kv[0][2])):
        b = r.get("breakdown")
        if impl != "cupynce" or not b:
            continue
        one = by.get((op, N, 1, "cupynce"), {}).get("breakdown")
        ideal = fmt_ms(one["compute_ms"] / P) if one else "—"
        split.append([op, N, P, fmt_ms(b["wall_ms"]), fmt_ms(b["compute_ms"]), ideal,
                      fmt_ms(b["nccl_ms"]), fmt_ms(b["copy_ms"]), fmt_ms(b["gap_ms"]),
                      fmt_ms(b["host_ms"])])
    if split:
        table += "\n\nWhere a rank's step goes (torch.profiler, 3 steps, the slowest rank):\n\n"
        table += markdown_table(["op", "global N", "GPUs", "step ms", "compute ms",
                                 "1-GPU compute / P", "NCCL ms", "copies ms", "GPU idle ms",
                                 "host ms"], split)
    for key, title, what, unit in (
            ("host_top", "The host's events of most self CPU time a step", "event",
             "self CPU ms"),
            ("host_py", "The Python functions of most own time a step (cProfile)", "function",
             "own ms")):
        top = [[op, P, name, fmt_ms(ms), f"{calls:g}"]
               for (op, N, P, impl), r in sorted(by.items(), key=lambda kv: (
                   OPS.index(kv[0][0]), kv[0][1], kv[0][2]))
               if impl == "cupynce" and r.get("breakdown", {}).get(key)
               for name, ms, calls in r["breakdown"][key][:6]]
        if top:
            table += f"\n\n{title}, --host-profile:\n\n"
            table += markdown_table(["op", "GPUs", what, unit, "calls"], top)
    return "\n".join(headers) + "\n\n" + table


def _ms(r: Dict[str, Any]) -> str:
    return fmt_ms(r["ms"]) if r.get("ms") else (r.get("failed") or "—")


def _mib(r: Dict[str, Any]) -> str:
    return fmt_mib(r.get("peak_bytes")) if r.get("ms") else "—"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", nargs="*", default=list(OPS), choices=OPS)
    p.add_argument("--sizes", type=int, nargs="*", default=[65536, 262144])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--once", action="store_true", help="one timed step per case")
    p.add_argument("--no-peers", action="store_true", help="cupynce only")
    p.add_argument("--ring", action="store_true",
                   help="config.ring_gpu: the plain ops' rings on the GPUs")
    p.add_argument("--backend", default="nccl",
                   help='the process group\'s backend: "nccl" (the agreement check\'s '
                        'integers on the GPU) or "cpu:gloo,cuda:nccl" (through gloo)')
    p.add_argument("--json", help="where rank 0 writes the rows")
    p.add_argument("--report", nargs="*", help="JSON files to merge into tables (no run)")
    p.add_argument("--breakdown", action="store_true",
                   help="also where each cupynce step goes (compute, NCCL, copies, idle)")
    p.add_argument("--host-profile", action="store_true",
                   help="--breakdown with the host profiled too: its costliest events")
    args = p.parse_args(argv)
    if args.report is not None:  # (no files -- every launch failed --: nothing to run)
        if not args.report:
            print("--report: no launch wrote its JSON file", file=sys.stderr)
            return 1
        print(report(args.report))
        return 0
    import torch
    import torch.distributed as dist

    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("launch with torchrun (see the module docstring), or use --report")
    import cupy

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    cupy.cuda.Device(local).use()  # the harness times and synchronises CuPy's current device
    if args.ring:
        import cupynce.config as cfg

        cfg.set(ring_gpu=True)
    dist.init_process_group(args.backend, timeout=_dt.timedelta(minutes=5),
                            device_id=torch.device("cuda", local))
    try:
        rows = run_rank(args.ops, args.sizes, args.dim, args.repeat, args.once,
                        not args.no_peers, breakdown=args.breakdown or args.host_profile,
                        host_profile=args.host_profile)
        if dist.get_rank() == 0:
            data = {"P": dist.get_world_size(), "device": device_info(), "rows": rows,
                    "dim": args.dim, "once": args.once,
                    "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
                    "backend": args.backend, "ring_gpu": args.ring}
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(data, indent=1))
            print(report([args.json]) if args.json else json.dumps(rows))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
