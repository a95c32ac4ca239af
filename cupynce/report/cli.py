"""The command line of ``python -m cupynce`` (console script ``cupynce``): the report users run
first.

It prints the machine (GPU, CUDA, CuPy, NumPy, torch), runs a self-check of every op against
the float64 oracle (loss and gradients, pass/fail with errors and tolerances), then benchmarks
forward + backward against PyTorch and the installed peers (memeff, Inf-CL) over a sweep of
sizes, and writes ``results.json``, ``summary.md`` and PNG plots to ``--out``.  Without a CUDA
GPU it says so and runs the NumPy path at small sizes.

Exit status: 0 when everything passed, 1 when a check failed (or cupynce crashed in the
benchmark), 2 for bad options.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from cupynce.report.ops import DTYPES, REGISTRY

EPILOG = """\
examples:
  python -m cupynce                      self-check + quick benchmark (under 2 min on an H100)
  python -m cupynce check                self-check only (results.json, summary.md)
  python -m cupynce bench --full         the full sweep (minutes)
  python -m cupynce bench --compile      also torch.compile (GPU)
  python -m cupynce --ops clip_loss --dtype bfloat16 --out clip-report
"""


def _csv(kind, allowed: Optional[Sequence[str]] = None, what: str = "value"):
    def parse(text: str) -> List:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}s")
        try:
            vals = [kind(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                             f"{what}s") from None
        if allowed is not None:
            bad = [v for v in vals if v not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {', '.join(map(str, bad))}; choose from "
                    f"{', '.join(allowed)}")
        return vals
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cupynce",
        description="cupynce's report: the machine, a self-check of every op against the "
                    "float64 oracle, and a benchmark against PyTorch and installed peers, "
                    "written to an output folder (results.json, summary.md, PNG plots).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", choices=("check", "bench"), default=None,
                   help="check: the self-check only; bench: the benchmark only; "
                        "none: both")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="a short sweep (the default): 3 sizes per op")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="the full sweep: more sizes, up to where PyTorch runs out of "
                           "memory (minutes)")
    p.add_argument("--ops", type=_csv(str, list(REGISTRY), "op"), default=None,
                   help=f"comma-separated ops (default: every op available: "
                        f"{', '.join(REGISTRY)})")
    p.add_argument("--dtype", "--dtypes", dest="dtypes", type=_csv(str, DTYPES, "dtype"),
                   default=None,
                   help="comma-separated dtypes (default: all four for the check; "
                        "bfloat16,float32 for the GPU benchmark, float32 on the CPU)")
    p.add_argument("--out", default="cupynce-report",
                   help="output folder (default ./cupynce-report/, created if missing)")
    p.add_argument("--sizes", type=_csv(int, what="integer"), default=None,
                   help="benchmark sizes overriding the sweep: N (rows) for the contrastive "
                        "losses, V (vocabulary) for splade_pool")
    p.add_argument("--dim", type=int, default=None,
                   help="benchmark feature size D (default 512 on the GPU, 64 on the CPU; "
                        "768 / 32 for splade_pool)")
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile of the PyTorch formula (GPU only; compiles "
                        "once per size and dtype, ~10-30 s each)")
    p.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")
    p.add_argument("--no-bench", action="store_true", help=argparse.SUPPRESS)  # old spelling
    p.set_defaults(mode="quick")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.no_bench:
        if args.command == "bench":
            p.error("--no-bench contradicts the bench command")
        args.command = "check"
    if args.sizes is not None:
        if any(s < 2 for s in args.sizes):
            p.error("--sizes: every size must be >= 2")
        if (args.ops is None or "nt_xent" in args.ops) and any(s % 2 for s in args.sizes):
            p.error("--sizes: nt_xent needs even N (it stacks two views); "
                    "pass even sizes or leave nt_xent out with --ops")
    if args.dim is not None and args.dim < 1:
        p.error(f"--dim must be >= 1, got {args.dim}")
    from cupynce.report import runner

    try:
        return runner.run(
            check=args.command in (None, "check"), bench=args.command in (None, "bench"),
            mode=args.mode, ops=args.ops, dtypes=args.dtypes, out=args.out, sizes=args.sizes,
            dim=args.dim, plots=not args.no_plots, torch_compile=args.compile,
            command=" ".join(["python -m cupynce"] + list(sys.argv[1:] if argv is None
                                                          else argv)))
    except ValueError as exc:  # unavailable op, and the like: a usage error
        p.error(str(exc))
    return 2  # pragma: no cover - p.error exits


if __name__ == "__main__":
    sys.exit(main())
