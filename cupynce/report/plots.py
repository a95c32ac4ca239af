"""The PNG plots of ``python -m cupynce`` (matplotlib, Agg backend; ``cupynce[report]``).

Five figures from ``results.json``'s benchmark records, one panel per op, one line per
implementation (colour) and dtype (line style and marker):

* ``execution_times.png`` — forward + backward time against size;
* ``speedup.png`` — every other implementation's time ÷ cupynce's (> 1: cupynce is faster);
* ``peak_memory.png`` — peak memory above the inputs against size;
* ``loss_error.png`` / ``gradient_error.png`` — relative error of the loss (SPLADE: the output)
  and of the worst input gradient against float64, for every implementation.

Out-of-memory runs are drawn as ✕ on the panel's top edge at their size (in the
implementation's colour); in ``speedup.png`` a ✕ means the other implementation ran out of
memory where cupynce did not.  Sizes that span a decade or more get logarithmic axes.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")  # no display; before pyplot is imported anywhere
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402

IMPL_STYLE = {  # colour, label
    "cupynce": ("#1f63b4", "cupynce"),
    "pytorch": ("#e8740c", "PyTorch eager"),
    "torch.compile": ("#2a9d3a", "torch.compile"),
    "memeff": ("#8c4fc2", "memeff"),
    "inf_cl": ("#8a5a44", "Inf-CL"),
}
DTYPE_STYLE = {  # line style, marker, short name
    "bfloat16": ("-", "o", "bf16"),
    "float16": ("-.", "^", "fp16"),
    "float32": ("--", "s", "fp32"),
    "float64": (":", "D", "fp64"),
}
ERR_FLOOR = 1e-17
MiB = float(1 << 20)


def _size_label(n: int) -> str:
    return f"{n:d}"


def _ops(records: Sequence[Dict[str, Any]]) -> List[str]:
    return list(dict.fromkeys(r["op"] for r in records))


def _grid(n: int) -> Tuple[int, int]:
    if n <= 3:
        return 1, max(n, 1)
    return math.ceil(n / 2), 2


def _fixed_shape(recs: Sequence[Dict[str, Any]], size_name: str) -> str:
    parts = recs[0]["shape_text"].split(", ")
    return ", ".join(p for p in parts if not p.startswith(size_name + "="))


def _setup_x(ax, sizes: Sequence[int], label: str) -> None:
    sizes = sorted(set(sizes))
    if len(sizes) > 1 and sizes[-1] / max(sizes[0], 1) >= 10:
        ax.set_xscale("log")
    ax.set_xticks(sizes)
    ax.set_xticklabels([_size_label(s) for s in sizes], rotation=30 if len(sizes) > 5 else 0,
                       fontsize=8)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(label)
    if len(sizes) == 1:
        ax.set_xlim(sizes[0] * 0.8, sizes[0] * 1.25)


def _setup_y(ax, values: Sequence[float], label: str, *, force_log: bool = False) -> None:
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if vals and (force_log or max(vals) / min(vals) >= 10):
        ax.set_yscale("log")
    ax.set_ylabel(label)
    ax.grid(True, which="major", alpha=0.3)


def _mark_oom(ax, xs: Sequence[int], color: str, dtype: str) -> None:
    """✕ on the top edge at each size in ``xs``; several at one size stack downwards."""
    stacks = ax.__dict__.setdefault("_cpn_oom", {})
    short = DTYPE_STYLE.get(dtype, ("", "", dtype))[2]
    tr = ax.get_xaxis_transform()
    for x in xs:
        k = stacks.get(x, 0)
        stacks[x] = k + 1
        y = 0.955 - 0.085 * k
        ax.plot([x], [y], linestyle="none", marker="X", markersize=10, color=color,
                markeredgecolor="black", markeredgewidth=0.6, clip_on=False, transform=tr,
                zorder=5)
        ax.annotate(short, (x, y), xycoords=tr, xytext=(-7, 0), textcoords="offset points",
                    ha="right", va="center", fontsize=6.5, color="#333333")


def _series(recs, impl, dtype, key, scale=1.0):
    pts = sorted((r["size"], r[key] * scale) for r in recs
                 if r["impl"] == impl and r["dtype"] == dtype and r["status"] == "ok"
                 and r.get(key) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def _spread(recs, impl, dtype, xs):
    """The 20-80 % range of the repeats at each size of a time series, as error bars
    (``yerr`` rows: below, above the median); None where the records lack it."""
    by = {r["size"]: r for r in recs if r["impl"] == impl and r["dtype"] == dtype}
    lo, hi = [], []
    for x in xs:
        r = by[x]
        if r.get("p20_ms") is None or r.get("p80_ms") is None:
            return None
        lo.append(max(r["median_ms"] - r["p20_ms"], 0.0))
        hi.append(max(r["p80_ms"] - r["median_ms"], 0.0))
    return [lo, hi]


def _legend(fig, used: Dict[Tuple[str, str], bool], oom: bool, oom_text: str) -> None:
    handles = []
    for (impl, dtype) in used:
        color, label = IMPL_STYLE.get(impl, ("grey", impl))
        ls, marker, short = DTYPE_STYLE.get(dtype, ("-", "o", dtype))
        handles.append(Line2D([], [], color=color, linestyle=ls, marker=marker,
                              label=f"{label}, {short}"))
    if oom:
        handles.append(Line2D([], [], linestyle="none", marker="X", markersize=9, color="white",
                              markeredgecolor="black", label=oom_text))
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8.5,
                   frameon=False, bbox_to_anchor=(0.5, 0.0))


HEADER_IN = 0.95  # title lines
ROW_IN = 3.3     # one row of panels, with its x labels
LEGEND_ROW_IN = 0.28


def _legend_rows(records, impls: Optional[Sequence[str]] = None, skip: Sequence[str] = ()) -> int:
    keys = {(r["impl"], r["dtype"]) for r in records if r["status"] in ("ok", "oom")
            and r["impl"] not in skip and (impls is None or r["impl"] in impls)}
    oom = any(r["status"] == "oom" for r in records)
    return max(1, math.ceil((len(keys) + oom) / 4))


def _figure(records, metric_title: str, title: str, subtitle: str, legend_rows: int):
    ops = _ops(records)
    rows, cols = _grid(len(ops))
    footer = 0.12 + LEGEND_ROW_IN * legend_rows
    height = HEADER_IN + ROW_IN * rows + footer
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, height), squeeze=False)
    for ax in axes.ravel()[len(ops):]:
        ax.set_visible(False)
    fig.text(0.5, 1 - 0.1 / height, f"{metric_title}\n{title}", ha="center", va="top",
             fontsize=10.5)
    fig.text(0.5, 1 - 0.62 / height, subtitle, ha="center", va="top", fontsize=8.5,
             color="#444444")
    fig._cpn_rect = (0, footer / height, 1, 1 - HEADER_IN / height)  # type: ignore[attr-defined]
    return fig, ops, list(axes.ravel())


def _finish(fig, path: Path) -> str:
    fig.tight_layout(rect=fig._cpn_rect, h_pad=1.2)  # type: ignore[attr-defined]
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _line_plot(records, path: Path, *, key: str, scale: float, ylabel: str, metric: str,
               title: str, subtitle: str, size_labels: Dict[str, str], force_log: bool = False,
               floor: Optional[float] = None, impls: Optional[Sequence[str]] = None,
               note: Optional[str] = None) -> str:
    fig, ops, axes = _figure(records, metric, title, subtitle, _legend_rows(records, impls))
    used: Dict[Tuple[str, str], bool] = {}
    any_oom = False
    for ax, op in zip(axes, ops):
        recs = [r for r in records if r["op"] == op]
        vals: List[float] = []
        dtypes = list(dict.fromkeys(r["dtype"] for r in recs))
        floored = False
        for impl in IMPL_STYLE:
            if impls is not None and impl not in impls:
                continue
            color = IMPL_STYLE[impl][0]
            for dt in dtypes:
                xs, ys = _series(recs, impl, dt, key, scale)
                if floor is not None:
                    floored |= any(y < floor for y in ys)
                    ys = [max(y, floor) for y in ys]
                if xs:
                    ls, marker, _ = DTYPE_STYLE.get(dt, ("-", "o", dt))
                    ax.plot(xs, ys, linestyle=ls, marker=marker, color=color, markersize=5)
                    err = _spread(recs, impl, dt, xs) if key == "median_ms" else None
                    if err is not None:  # the 20-80 % range of the repeats
                        ax.errorbar(xs, ys, yerr=err, fmt="none", ecolor=color, capsize=3,
                                    elinewidth=1)
                    used[(impl, dt)] = True
                    vals += ys
                if key in ("median_ms", "peak_bytes"):
                    oom = [r["size"] for r in recs if r["impl"] == impl and r["dtype"] == dt
                           and r["status"] == "oom"]
                    if oom:
                        any_oom = True
                        used.setdefault((impl, dt), True)
                        _mark_oom(ax, oom, color, dt)
        size_name = size_labels.get(op, "size")
        _setup_x(ax, [r["size"] for r in recs], size_name)
        _setup_y(ax, vals, ylabel, force_log=force_log)
        ax.set_title(f"{op} ({_fixed_shape(recs, size_name.split(' ')[0])})", fontsize=9.5)
        if floored:
            ax.text(0.01, 0.01, f"0 drawn at {floor:g}", transform=ax.transAxes, fontsize=7,
                    color="#666666")
        if not vals and not any_oom:
            ax.text(0.5, 0.5, note or "nothing measured", transform=ax.transAxes, ha="center",
                    va="center", fontsize=9, color="#666666")
    _legend(fig, used, any_oom, "out of memory (top edge, at its size)")
    return _finish(fig, path)


def _speedup_plot(records, path: Path, *, title: str, subtitle: str,
                  size_labels: Dict[str, str]) -> str:
    fig, ops, axes = _figure(records, "Speedup of cupynce: other implementation's time ÷ "
                             "cupynce's time (> 1: cupynce is faster; bars: from the 20–80 % "
                             "ranges)", title, subtitle,
                             _legend_rows(records, skip=("cupynce",)))
    used: Dict[Tuple[str, str], bool] = {}
    any_oom = False
    for ax, op in zip(axes, ops):
        recs = [r for r in records if r["op"] == op]
        dtypes = list(dict.fromkeys(r["dtype"] for r in recs))
        vals: List[float] = [1.0]
        for impl in IMPL_STYLE:
            if impl == "cupynce":
                continue
            color = IMPL_STYLE[impl][0]
            for dt in dtypes:
                ours = {r["size"]: r for r in recs if r["impl"] == "cupynce"
                        and r["dtype"] == dt and r["status"] == "ok"}
                theirs = {r["size"]: r for r in recs if r["impl"] == impl and r["dtype"] == dt}
                xs, ys, oom, lo, hi = [], [], [], [], []
                for size, t in sorted(theirs.items()):
                    c = ours.get(size)
                    if c is None:
                        continue
                    if t["status"] == "ok" and t.get("median_ms") and c.get("median_ms"):
                        xs.append(size)
                        ys.append(t["median_ms"] / c["median_ms"])
                        # the ratio's range from the two 20-80 % ranges (theirs / ours)
                        lo.append(t.get("p20_ms", t["median_ms"]) / c.get("p80_ms", c["median_ms"]))
                        hi.append(t.get("p80_ms", t["median_ms"]) / c.get("p20_ms", c["median_ms"]))
                    elif t["status"] == "oom":
                        oom.append(size)
                if xs:
                    ls, marker, _ = DTYPE_STYLE.get(dt, ("-", "o", dt))
                    ax.plot(xs, ys, linestyle=ls, marker=marker, color=color, markersize=5)
                    ax.errorbar(xs, ys, yerr=[[max(y - a, 0.0) for y, a in zip(ys, lo)],
                                              [max(b - y, 0.0) for y, b in zip(ys, hi)]],
                                fmt="none", ecolor=color, capsize=3, elinewidth=1)
                    vals += ys
                    used[(impl, dt)] = True
                if oom:
                    any_oom = True
                    used.setdefault((impl, dt), True)
                    _mark_oom(ax, oom, color, dt)
        ax.axhline(1.0, color="black", linewidth=0.8, alpha=0.6)
        size_name = size_labels.get(op, "size")
        _setup_x(ax, [r["size"] for r in recs], size_name)
        _setup_y(ax, vals, "speedup (×)")
        if ax.get_yscale() == "linear":
            lo, hi = ax.get_ylim()
            ax.set_ylim(min(lo, 0.0), max(hi, 1.2))
        ax.set_title(f"{op} ({_fixed_shape(recs, size_name.split(' ')[0])})", fontsize=9.5)
        if len(vals) == 1 and not any_oom:
            ax.text(0.5, 0.5, "no other implementation measured\n(is torch installed?)",
                    transform=ax.transAxes, ha="center", va="center", fontsize=9,
                    color="#666666")
    _legend(fig, used, any_oom, "the other ran out of memory, cupynce did not")
    return _finish(fig, path)


def make_plots(doc: Dict[str, Any], out_dir: Path, title: str) -> List[str]:
    """Write the five PNGs of the benchmark records in ``doc``; return their paths."""
    records = doc.get("benchmarks") or []
    if not records:
        return []
    from cupynce.report.ops import REGISTRY

    out_dir = Path(out_dir)
    s = doc["settings"]
    gpu = bool(doc["device"].get("gpu"))
    sub = (f"{s['mode']} run of {doc['date']}; forward + backward, "
           + ("CUDA-event medians" if gpu else
              "host-clock medians (NumPy path; PyTorch on the CPU)"))
    labels = {op: (REGISTRY[op].size_label if op in REGISTRY else "size") for op in _ops(records)}
    common = dict(title=title, subtitle=sub, size_labels=labels)
    files = [
        _line_plot(records, out_dir / "execution_times.png", key="median_ms", scale=1.0,
                   ylabel="time (ms, median)", metric="Forward + backward time", **common),
        _speedup_plot(records, out_dir / "speedup.png", **common),
        _line_plot(records, out_dir / "peak_memory.png", key="peak_bytes", scale=1 / MiB,
                   ylabel="peak memory above inputs (MiB)",
                   metric="Peak memory of one forward + backward" + (
                       "" if gpu else " (NumPy path, tracemalloc; PyTorch CPU not measured)"),
                   **common),
        _line_plot(records, out_dir / "loss_error.png", key="loss_err", scale=1.0,
                   ylabel="relative error of the loss", force_log=True, floor=ERR_FLOOR,
                   metric="Loss error against float64 (‖x − ref‖ / ‖ref‖; SPLADE: the output)",
                   note="no float64 reference at these sizes", **common),
        _line_plot(records, out_dir / "gradient_error.png", key="grad_err", scale=1.0,
                   ylabel="relative error, worst gradient", force_log=True, floor=ERR_FLOOR,
                   metric="Gradient error against float64 (worst input gradient, "
                          "‖x − ref‖ / ‖ref‖)",
                   note="no float64 reference at these sizes", **common),
    ]
    return files
