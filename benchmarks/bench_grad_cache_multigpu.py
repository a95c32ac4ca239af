"""The cached step across GPUs (issue 57): sentence-transformers' cached MNRL with
``gather_across_devices=True`` -- cupynce's drop-in, and with ``--losses`` the library's -- on P
ranks at one global batch N (N / P pairs a rank), against the same N on one GPU.

The encoder, batches and loop are ``bench_grad_cache.py``'s (BERT of ``--shape`` with random
weights, mean pooling, pre-tokenised random ids of ``--length``, the "plain" AMP loop: bf16
autocast around the loss call, ``backward()`` outside it, fused AdamW; mini-batches of
``--mini-batch``).  With P > 1 the model runs under ``DistributedDataParallel``
(``find_unused_parameters``: BERT's pooler gets no gradient) and the loss's ``model`` is the
DDP module, as ``SentenceTransformerTrainer`` sets it; every rank's rows are in
every rank's softmax (``gather_across_devices``).  Per loss: one warm-up step, then the median
of ``--steps`` steps (each started after a barrier, synchronised at its end), the slowest
rank's; peak ``max_memory_allocated``, the fullest GPU's.  Rank 0 writes the rows as JSON;
``--report`` merges launches (P = 1, 2, 4, ...) into the scaling table T1 / (P · TP).

    torchrun --standalone --nproc_per_node P benchmarks/bench_grad_cache_multigpu.py \\
        --global-batch 262144 --json out/c$P.json
    python benchmarks/bench_grad_cache_multigpu.py --report out/c1.json out/c2.json
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cupynce.report.environment import device_info  # noqa: E402
from cupynce.report.formatting import markdown_table  # noqa: E402

LOSSES = ("cupynce cached", "library cached")


def run_rank(shape: str, global_batch: int, losses: List[str], *, length: int = 64,
             mini_batch: int = 1024, steps: int = 2, device: str = "cuda",
             profile: bool = False, cprofile: bool = False,
             ddp: bool = True) -> List[Dict[str, Any]]:
    """Every loss's cached step on this rank (inside an initialised process group, or alone);
    rank 0 gets the merged rows.  ``profile``: then one step more under torch.profiler and
    one under cProfile (``bench_multigpu._breakdown``: compute, NCCL, copies, GPU idle, the
    host's top events), the slowest rank's kept as the row's ``breakdown``.  ``cprofile``:
    then one step under cProfile alone (``host_py``: the Python functions of most own time,
    the slowest rank's; ``cprofile_s`` that step's time) -- what ``profile`` finds at a
    fraction of its cost, for steps too long for torch.profiler (a few million events).
    ``ddp`` False (a diagnostic, not a training setup): the model not under DDP, its
    parameters' gradients left on each rank (no all-reduce, the ranks' weights drift apart),
    the loss still global -- what DDP's own machinery costs a cached step."""
    import torch
    import torch.distributed as dist
    from sentence_transformers.sentence_transformer import losses as ST

    import bench_grad_cache as G
    from cupynce.integrations import sentence_transformers as c_st

    grouped = dist.is_initialized()
    rank, size = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    if global_batch % size:
        raise SystemExit(f"--global-batch {global_batch} is not a multiple of {size} ranks")
    n = global_batch // size
    cuda = device == "cuda"
    rows = []
    # (transformers saves on rank 0 alone once torch.distributed is up: one folder for the
    # launch -- the ranks are one launcher's children -- written by rank 0, then read by all)
    shared = Path(tempfile.gettempdir()) / f"cupynce-bench-cached-{os.getppid()}"
    with tempfile.TemporaryDirectory() as own:
        folder = str(shared) if size > 1 else own
        if rank == 0:
            model = G.build(shape, folder, device)  # (seeded: the same weights everywhere)
        if size > 1:
            dist.barrier()
        if rank != 0:
            model = G.build(shape, folder, device)
        model.train()
        wrapped = model
        if size > 1 and ddp:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # (BERT's pooler gets no gradient under mean pooling: unused parameters)
            wrapped = DDP(model, device_ids=[torch.cuda.current_device()] if cuda else None,
                          find_unused_parameters=True)
        feats = G.batch(n, length, seed=1000 + rank, device=device)
        for name in losses:
            cls = c_st.CachedMultipleNegativesRankingLoss if name == "cupynce cached" else \
                ST.CachedMultipleNegativesRankingLoss
            loss_obj = cls(model, mini_batch_size=mini_batch, gather_across_devices=size > 1)
            loss_obj.model = wrapped  # (SentenceTransformerTrainer's: the DDP module)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)

            def step(loss_obj=loss_obj, opt=opt):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                    loss = loss_obj([dict(f) for f in feats], None)
                loss.backward()
                opt.step()

            # (each timed step after a barrier: the ranks time the same step)
            t, peak = G._timed(step, steps, cuda, before=dist.barrier if grouped else None)
            mine = {"step_s": t, "peak_bytes": peak}
            if profile and cuda:
                from bench_multigpu import _breakdown

                if grouped:
                    dist.barrier()
                mine["breakdown"] = _breakdown(step, steps=1, host=True)
            if cprofile:
                import time

                from bench_multigpu import _python_profile

                t0 = time.perf_counter()
                mine["host_py"] = _python_profile(step, 1, cuda=cuda)
                mine["cprofile_s"] = time.perf_counter() - t0
            every = [mine]
            if grouped:
                every = [None] * size
                dist.all_gather_object(every, mine)
            if rank == 0:
                peaks = [e["peak_bytes"] for e in every if e["peak_bytes"] is not None]
                rows.append({"shape": shape, "loss": name, "N": global_batch, "P": size,
                             "n": n, "mini_batch": mini_batch, "length": length,
                             **({} if ddp or size == 1 else {"ddp": False}),
                             "step_s": max(e["step_s"] for e in every),
                             "step_s_ranks": [e["step_s"] for e in every],
                             "peak_gib": max(peaks) / 2 ** 30 if peaks else None})
                if profile and cuda:
                    rows[-1]["breakdown"] = max(every, key=lambda e: e["breakdown"]["wall_ms"]
                                                )["breakdown"]
                if cprofile:
                    slow = max(every, key=lambda e: e["cprofile_s"])
                    rows[-1].update(host_py=slow["host_py"], cprofile_s=slow["cprofile_s"])
                print(json.dumps(rows[-1]), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    if size > 1:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(shared, ignore_errors=True)
    return rows


def report(paths: List[str]) -> str:
    """The scaling table of several launches' JSON files."""
    from bench_multigpu import launches

    rows, headers = launches(paths)
    one = {(r["shape"], r["loss"], r["N"]): r["step_s"] for r in rows if r["P"] == 1}
    out = []
    for r in sorted(rows, key=lambda r: (r["shape"], r["loss"], r["N"], r["P"])):
        base = one.get((r["shape"], r["loss"], r["N"]))
        eff = f"{100 * base / (r['P'] * r['step_s']):.0f} %" if base else "—"
        name = r["loss"] + ("" if r.get("ddp", True) else " (no DDP)")
        out.append([r["shape"], name, r["N"], r["P"], r["n"], f"{r['step_s']:.3f}",
                    "—" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}", eff])
    text = "\n".join(headers) + "\n\n" + markdown_table(
        ["shape", "loss", "global N", "GPUs", "pairs a GPU", "step s", "peak GiB a GPU",
         "scaling T1/(P·TP)"], out)
    prof = [r for r in rows if r.get("breakdown")]
    if prof:  # (--profile: one step, the slowest rank)
        text += "\n\nWhere a rank's step goes (--profile: one step, the slowest rank):\n\n"
        text += markdown_table(
            ["loss", "GPUs", "step s", "compute s", "NCCL s", "copies s", "GPU idle s",
             "host s"],
            [[r["loss"], r["P"]] + [f"{r['breakdown'][k] / 1e3:.3f}" for k in (
                "wall_ms", "compute_ms", "nccl_ms", "copy_ms", "gap_ms", "host_ms")]
             for r in prof])
        for key, title in (("host_top", "host events"), ("host_py", "Python functions")):
            text += f"\n\nThe {title} of most own time (ms a step):\n\n" + markdown_table(
                ["loss", "GPUs", "name", "ms", "calls"],
                [[r["loss"], r["P"], name, f"{ms:.1f}", f"{calls:g}"]
                 for r in prof for name, ms, calls in r["breakdown"].get(key, [])[:8]])
    alone = [r for r in rows if r.get("host_py")]
    if alone:  # (--cprofile: one step under cProfile alone, the slowest rank)
        text += "\n\nThe Python functions of most own time, one step under cProfile alone " \
                "(the slowest rank; ms):\n\n" + markdown_table(
                    ["loss", "global N", "GPUs", "step s (profiled)", "name", "ms", "calls"],
                    [[r["loss"], r["N"], r["P"], f"{r['cprofile_s']:.3f}", name, f"{ms:.1f}",
                      f"{calls:g}"] for r in alone for name, ms, calls in r["host_py"][:10]])
    return text


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="minilm")
    p.add_argument("--global-batch", type=int, default=262144)
    p.add_argument("--losses", default="cupynce cached",
                   help=f"comma-separated, of {', '.join(LOSSES)}")
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--mini-batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--profile", action="store_true",
                   help="then where a step goes: one step under torch.profiler and cProfile")
    p.add_argument("--cprofile", action="store_true",
                   help="then one step under cProfile alone (long steps: --profile's cost)")
    p.add_argument("--no-ddp", action="store_true",
                   help="diagnostic: the model without DDP (its gradients not all-reduced)")
    p.add_argument("--json", help="where rank 0 writes the rows")
    p.add_argument("--report", nargs="*", help="JSON files to merge into the table (no run)")
    args = p.parse_args(argv)
    if args.report is not None:  # (no files -- every launch failed --: nothing to run)
        if not args.report:
            print("--report: no launch wrote its JSON file", file=sys.stderr)
            return 1
        print(report(args.report))
        return 0
    losses = args.losses.split(",")
    if any(x not in LOSSES for x in losses):
        raise SystemExit(f"--losses: each of {', '.join(LOSSES)}, got {args.losses!r}")
    import torch
    import torch.distributed as dist

    grouped = "LOCAL_RANK" in os.environ
    if grouped:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=_dt.timedelta(minutes=10),
                                device_id=torch.device("cuda", local))
    try:
        rows = run_rank(args.shape, args.global_batch, losses, length=args.length,
                        mini_batch=args.mini_batch, steps=args.steps, profile=args.profile,
                        cprofile=args.cprofile, ddp=not args.no_ddp)
        if not grouped or dist.get_rank() == 0:
            data = {"P": dist.get_world_size() if grouped else 1, "device": device_info(),
                    "rows": rows}
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(data, indent=1))
                print(report([args.json]))
    finally:
        if grouped:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
