"""The GPUs' clocks, power and temperature during a run, from ``nvidia-smi``'s CSV log.

A slower step on several GPUs than on one may be the GPUs' clocks, not the code: a host whose
GPUs share a power or cooling budget lowers their clocks under a long, sustained load on
several at once.  ``benchmarks/run_multigpu.sh`` logs every launch of its cached modes with ::

    nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw,temperature.gpu,\\
        clocks_event_reasons.active --format=csv,noheader,nounits -lms 500 > clocks.csv

and this script summarises such a log, one row a GPU (the samples while the GPU is busy: SM
clock above its idle floor, power above a fifth of the run's highest)::

    python benchmarks/gpu_clocks.py clocks.csv

The event reasons are NVML's clock-event (throttle) bits, named as the timing harness names
them (``cupynce.report.timing.throttle_names``), with the share of the busy samples that carry
each one.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cupynce.report.formatting import markdown_table  # noqa: E402
from cupynce.report.timing import throttle_names  # noqa: E402


def parse(text: str) -> Dict[int, List[List[float]]]:
    """{GPU index: [[SM MHz, power W, temperature °C, reasons bitmask], ...]} of a log's lines
    (lines that do not parse -- a header, "[N/A]" -- are skipped)."""
    out: Dict[int, List[List[float]]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 6:
            continue
        try:
            gpu = int(cells[0])
            sample = [float(cells[2]), float(cells[3]), float(cells[4]), float(int(cells[5], 16))]
        except ValueError:
            continue
        out.setdefault(gpu, []).append(sample)
    return out


def summary(text: str) -> str:
    """One row a GPU: busy samples, SM clock median / lowest, power mean / highest,
    temperature highest, and the event reasons seen (their share of the busy samples)."""
    rows = []
    for gpu, samples in sorted(parse(text).items()):
        top = max(s[1] for s in samples)
        busy = [s for s in samples if s[1] > 0.2 * top] or samples
        counts: Dict[str, int] = {}
        for s in busy:
            for name in throttle_names(int(s[3])):
                counts[name] = counts.get(name, 0) + 1
        seen = [f"{name} {100 * counts[name] / len(busy):.0f} %"
                for name in throttle_names(~0) if name in counts]  # (the table's order)
        rows.append([gpu, len(busy), f"{statistics.median(s[0] for s in busy):.0f}",
                     f"{min(s[0] for s in busy):.0f}",
                     f"{statistics.fmean(s[1] for s in busy):.0f}", f"{top:.0f}",
                     f"{max(s[2] for s in busy):.0f}", ", ".join(seen) or "none"])
    return markdown_table(["GPU", "busy samples", "SM MHz median", "SM MHz lowest",
                           "W mean", "W highest", "°C highest", "clock event reasons"], rows)


def main(argv: List[str]) -> int:
    for path in argv:
        print(f"{path}:\n\n{summary(Path(path).read_text())}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
