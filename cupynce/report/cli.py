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


def _options(p: argparse.ArgumentParser, sub: bool) -> None:
    """The options every form takes (``python -m cupynce [check|bench] [options]``).  On a
    subcommand their defaults are SUPPRESS, so that an option given before the subcommand is
    not reset by the subcommand's default."""
    d = (lambda value: argparse.SUPPRESS) if sub else (lambda value: value)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      default=d("quick"),
                      help="a short sweep (the default): 3 sizes per op (5 for the "
                           "contrastive ops on a GPU, from N = 256)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      default=d("quick"),
                      help="the full sweep: more sizes, up to where PyTorch runs out of "
                           "memory (minutes)")
    p.add_argument("--ops", type=_csv(str, list(REGISTRY), "op"), default=d(None),
                   help=f"comma-separated ops (default: every op available: "
                        f"{', '.join(REGISTRY)})")
    p.add_argument("--dtype", "--dtypes", dest="dtypes", type=_csv(str, DTYPES, "dtype"),
                   default=d(None),
                   help="comma-separated dtypes (default: all four for the check; "
                        "bfloat16,float32 for the GPU benchmark, float32 on the CPU)")
    p.add_argument("--out", default=d("cupynce-report"),
                   help="output folder (default ./cupynce-report/, created if missing)")
    p.add_argument("--sizes", type=_csv(int, what="integer"), default=d(None),
                   help="benchmark sizes overriding the sweep: N (rows) for the contrastive "
                        "losses, V (vocabulary) for splade_pool")
    p.add_argument("--dim", type=int, default=d(None),
                   help="benchmark feature size D (default 512 on the GPU, 64 on the CPU; "
                        "768 / 32 for splade_pool)")
    p.add_argument("--compile", action="store_true", default=d(False),
                   help="also time torch.compile of the PyTorch formula (GPU only; compiles "
                        "once per size and dtype, ~10-30 s each)")
    p.add_argument("--no-plots", action="store_true", default=d(False),
                   help="do not draw the PNG plots")
    p.add_argument("--no-bench", action="store_true", default=d(False),
                   help=argparse.SUPPRESS)  # old spelling of `check`


def parser() -> argparse.ArgumentParser:
    from cupynce import __version__

    p = argparse.ArgumentParser(
        prog="python -m cupynce",
        description="cupynce's report: the machine, a self-check of every op against the "
                    "float64 oracle, and a benchmark against PyTorch and installed peers, "
                    "written to an output folder (results.json, summary.md, PNG plots).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"cupynce {__version__}")
    _options(p, sub=False)
    subs = p.add_subparsers(dest="command", metavar="{check,bench}",
                            title="commands (none: both)")
    for name, text in (
            ("check", "the self-check only: every op and dtype against the float64 oracle, "
                      "loss and gradients, with errors and tolerances; exit status 1 on any "
                      "failure"),
            ("bench", "the benchmark only: forward + backward against PyTorch (and "
                      "torch.compile, memeff, Inf-CL where available) over a sweep of sizes, "
                      "time, peak memory and errors, with tables and plots")):
        sp = subs.add_parser(name, help=text.split(":")[0], description=text,
                             prog=f"python -m cupynce {name}")
        _options(sp, sub=True)
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
