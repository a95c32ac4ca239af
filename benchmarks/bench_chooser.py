"""Issue 53, item 6: does the engine choose well?  One run, one GPU, three grids.

* ``wide`` — CLIP and NT-Xent (and InfoNCE, SigLIP) in bf16 through ``cupynce.torch`` at
  N = 4096 ... 32768 and D = 512 ... 4096 against eager PyTorch (open_clip's formula), forward
  + backward, CUDA events, median of ``--repeat``.  Extra paths (``--paths``): ``rows`` (the
  cuBLAS row blocks, tiles off) and ``rows+ws`` (the same with a workspace large enough for
  the whole score matrix): what the chooser picks between.  Targets: ≤ 0.6× eager for
  D ≤ 1024; ≤ 0.7× at D = 2048-4096 where the scores fit the workspace, ≤ 0.85× where not.
* ``small`` — N = 256 ... 4096, D = 512, bf16, every loss: ``cupynce.torch`` against eager,
  ``--calls`` calls timed by the host clock, with a ``torch.cuda.synchronize()`` after each
  call (``sync``) and without (``nosync``: one at the end); the per-call mean of each of
  ``--blocks`` blocks, the median block reported.  The CuPy core (no torch) is the floor of
  what a bridge can reach; ``autograd floor`` (an empty Function) is torch's own share.
  Target: ≤ 0.6× eager, both ways.
* ``loop`` — a training-loop pattern: CLIP bf16 with a learnable scale, D = 512, N changing
  every step (``random``: uniform in 64 ... 4096, no size twice in a row; ``buckets``: 8
  sizes drawn at random, as a length-bucketing sampler gives), fresh input tensors each step,
  a synchronisation after each; per-step median and mean with CUDA graphs on and off, after
  a first pass that loads the kernels the shapes pick (CUDA's lazy loading).
  Target: graphs on no slower than off.

Writes ``bench_chooser.json`` and ``.md`` to ``--out``.  Run on the device:
``python benchmarks/bench_chooser.py --out $OUT``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupynce  # noqa: E402
import cupynce.torch as ct  # noqa: E402
from cupynce import config  # noqa: E402
from cupynce.report.environment import device_header, device_info  # noqa: E402
from cupynce.report.formatting import markdown_table  # noqa: E402
from cupynce.report.timing import time_cuda  # noqa: E402
from cupynce.report.torch_baseline import torch_step  # noqa: E402
from bench_torch_overhead import (_bridge_fn, _inputs, _torch_fn, core_call,  # noqa: E402
                                  floor_call)

WIDE_OPS = ("clip_loss", "nt_xent")
WIDE_N = (4096, 8192, 16384, 32768)
WIDE_D = (512, 1024, 2048, 4096)
SMALL_OPS = ("nt_xent", "info_nce", "clip_loss", "siglip_loss")
SMALL_N = (256, 1024, 2048, 4096)
BIG_WS = 8 << 30  # "rows+ws": room for any score matrix of the grid


def _csv(kind):
    return lambda s: [kind(v) for v in s.split(",") if v]


def _with_ws(op: str, ws: int) -> Callable[..., Any]:
    return {"nt_xent": lambda z: ct.nt_xent(z, 0.1, workspace_bytes=ws),
            "info_nce": lambda q, k: ct.info_nce(q, k, 0.1, workspace_bytes=ws),
            "clip_loss": lambda a, b, ls: ct.clip_loss(a, b, ls, workspace_bytes=ws),
            "siglip_loss": lambda a, b, ls, lb: ct.siglip_loss(a, b, ls, lb,
                                                               workspace_bytes=ws)}[op]


def wide(args) -> List[Dict[str, Any]]:
    rows = []
    for op in args.wide_ops:
        for d in args.wide_d:
            for n in args.wide_n:
                leaves = _inputs(op, n, d, torch.bfloat16)
                row = dict(grid="wide", op=op, n=n, d=d)
                paths = {"cupynce": (_bridge_fn(op), {}), "eager": (_torch_fn(op), None)}
                if "rows" in args.paths:
                    paths["rows"] = (_bridge_fn(op), dict(tiles=False))
                if "rows+ws" in args.paths:
                    paths["rows+ws"] = (_with_ws(op, BIG_WS), dict(tiles=False))
                if "products" in args.paths:
                    paths["products"] = (None, None)
                for name, (fn, cfg) in paths.items():
                    step = (_products(leaves) if name == "products"
                            else torch_step(torch, fn, leaves))
                    try:
                        with config.override(**(cfg or {})):
                            r = time_cuda(step, warmup=2, repeat=args.repeat)
                        row[name] = r["median_ms"]
                    except torch.cuda.OutOfMemoryError:
                        row[name] = None
                    torch.cuda.empty_cache()
                for name in paths:
                    if name != "eager" and row.get(name) and row.get("eager"):
                        row[name + "/eager"] = row[name] / row["eager"]
                print(json.dumps(row), flush=True)
                rows.append(row)
                del leaves
    return rows


def _products(leaves):
    """The floor of an unfused loss: eager's three bf16 cuBLAS products alone (scores, then
    the two gradient products with a stand-in N x N gradient block)."""
    a = leaves[0].detach()
    b = leaves[1].detach() if len(leaves) > 1 and leaves[1].dim() == 2 else a
    g = torch.randn(a.shape[0], b.shape[0], device=a.device, dtype=a.dtype)

    def step():
        s = a @ b.T
        return s, g @ b, g.T @ a
    return step


def _host_clock(call: Callable[[], Any], calls: int, blocks: int, sync: bool) -> float:
    """Median over ``blocks`` of the per-call host time of ``calls // blocks`` calls."""
    per = max(1, calls // blocks)
    means = []
    for _ in range(blocks):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(per):
            out = call()
            if sync:
                torch.cuda.synchronize()
            del out
        torch.cuda.synchronize()
        means.append((time.perf_counter() - t0) * 1e3 / per)
    return statistics.median(means)


def small(args) -> List[Dict[str, Any]]:
    rows = []
    for op in args.small_ops:
        for n in args.small_n:
            leaves = _inputs(op, n, 512, torch.bfloat16)
            calls = {"cupynce": torch_step(torch, _bridge_fn(op), leaves),
                     "eager": torch_step(torch, _torch_fn(op), leaves),
                     "floor": floor_call(leaves), "core": core_call(op, leaves)}
            for c in calls.values():  # warm: kernels loaded, graphs captured
                for _ in range(5):
                    c()
            for sync in (True, False):
                row = dict(grid="small", op=op, n=n, sync=sync)
                for name, c in calls.items():
                    row[name] = _host_clock(c, args.calls, args.blocks, sync)
                row["cupynce/eager"] = row["cupynce"] / row["eager"]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def _sizes(pattern: str, steps: int, seed: int = 0) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    if pattern == "random":
        out: List[int] = []
        while len(out) < steps:
            n = int(torch.randint(64, 4097, (1,), generator=g))
            if not out or n != out[-1]:
                out.append(n)
        return out
    buckets = torch.randint(64, 4097, (8,), generator=g).tolist()
    return [buckets[int(i)] for i in torch.randint(0, 8, (steps,), generator=g)]


def _loop_pass(fn, sizes, graphs: bool) -> List[float]:
    from cupynce.ops import _graphs

    _graphs.clear()
    times = []
    with config.override(graphs=graphs):
        for n in sizes:
            leaves = _inputs("clip_loss", n, 512, torch.bfloat16)  # (a fresh batch a step)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch_step(torch, fn, leaves)()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def loop(args) -> List[Dict[str, Any]]:
    """Each pattern: one pass with graphs off first (CUDA's lazy loading of the cuBLAS and
    tile kernels each new shape picks: a one-time cost that would fall on whichever pass ran
    first), then graphs on / off / eager alternating, ``--loop-rounds`` times; the medians of
    each path's step times over its rounds."""
    rows = []
    paths = (("cupynce", True), ("cupynce", False), ("eager", None))
    for pattern in ("random", "buckets"):
        sizes = _sizes(pattern, args.steps)
        first = _loop_pass(_bridge_fn("clip_loss"), sizes, False)
        times: Dict[tuple, List[float]] = {p: [] for p in paths}
        for _ in range(args.loop_rounds):
            for name, graphs in paths:
                fn = _bridge_fn("clip_loss") if name == "cupynce" else _torch_fn("clip_loss")
                times[(name, graphs)] += _loop_pass(fn, sizes, bool(graphs))
        for (name, graphs), ts in times.items():
            row = dict(grid="loop", pattern=pattern, path=name, graphs=graphs,
                       median_ms=statistics.median(ts), mean_ms=statistics.fmean(ts),
                       first_pass_median_ms=statistics.median(first)
                       if name == "cupynce" and graphs is False else None)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _fmt(x):
    return "—" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def report(rows, out: Path, name: str) -> None:
    lines = [f"# bench_chooser: {device_header(device_info())}", ""]
    for grid in ("wide", "small", "loop"):
        sub = [r for r in rows if r["grid"] == grid]
        if not sub:
            continue
        heads = [k for k in sub[0] if k != "grid"]
        for r in sub:
            heads += [k for k in r if k not in heads and k != "grid"]
        lines += [f"## {grid}", "", markdown_table(heads, [[_fmt(r.get(h)) for h in heads]
                                                          for r in sub]), ""]
    (out / f"{name}.md").write_text("\n".join(lines))
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--grids", type=_csv(str), default=["wide", "small", "loop"])
    p.add_argument("--wide-ops", type=_csv(str), default=list(WIDE_OPS))
    p.add_argument("--wide-n", type=_csv(int), default=list(WIDE_N))
    p.add_argument("--wide-d", type=_csv(int), default=list(WIDE_D))
    p.add_argument("--paths", type=_csv(str), default=[],
                   help="extra wide paths: rows, rows+ws, products")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--small-ops", type=_csv(str), default=list(SMALL_OPS))
    p.add_argument("--small-n", type=_csv(int), default=list(SMALL_N))
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--loop-rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--name", default="bench_chooser")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: List[Dict[str, Any]] = []
    for grid in args.grids:
        rows += {"wide": wide, "small": small, "loop": loop}[grid](args)
        report(rows, args.out, args.name)


if __name__ == "__main__":
    main()
