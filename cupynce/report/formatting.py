"""Text for reports: milliseconds, MiB and ratios as table cells, markdown tables, and an
exception as one short line."""
from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["fmt_ms", "fmt_mib", "fmt_ratio", "markdown_table", "MiB", "GiB"]

MiB = 1 << 20
GiB = 1 << 30


def _short(exc: BaseException, limit: int = 300) -> str:
    """``exc`` as one line of at most ``limit`` characters, for tables and results.json."""
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def fmt_ms(x: Optional[float]) -> str:
    """Milliseconds with about three significant digits ("—" for None)."""
    if x is None:
        return "—"
    if x != x:  # NaN
        return "nan"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def fmt_mib(nbytes: Optional[float]) -> str:
    """Bytes as MiB ("—" for None)."""
    if nbytes is None:
        return "—"
    mib = nbytes / MiB
    return f"{mib:.0f}" if mib >= 10 else f"{mib:.1f}"


def fmt_ratio(x: Optional[float]) -> str:
    """A speedup / ratio as ``1.23×`` ("—" for None)."""
    if x is None or x != x:
        return "—"
    return f"{x:.2f}×" if x < 100 else f"{x:.0f}×"


def _numeric(cell: str) -> bool:
    c = cell.strip().rstrip("×").replace(",", "")
    if c in ("", "—", "-", "nan", "OOM", "skip", "error"):
        return True
    try:
        float(c)
        return True
    except ValueError:
        return False


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                   align: Optional[str] = None) -> str:
    """A GitHub-flavoured markdown table, padded so that it also reads well as plain text.

    ``align``: one character per column, ``l`` / ``r`` / ``c``; by default numeric columns
    (cells that are numbers, ratios like ``1.5×``, or placeholders) are right-aligned.
    """
    cells = [[str(c) for c in row] for row in rows]
    ncol = len(headers)
    for row in cells:
        if len(row) != ncol:
            raise ValueError(f"markdown_table: row has {len(row)} cells, expected {ncol}: {row}")
    if align is None:
        align = "".join("r" if cells and all(_numeric(r[j]) for r in cells) else "l"
                        for j in range(ncol))
    if len(align) != ncol:
        raise ValueError(f"markdown_table: align {align!r} does not match {ncol} columns")
    widths = [max([len(headers[j])] + [len(r[j]) for r in cells] + [3]) for j in range(ncol)]

    def line(vals: Sequence[str]) -> str:
        out = []
        for v, w, a in zip(vals, widths, align):
            out.append(v.rjust(w) if a == "r" else v.center(w) if a == "c" else v.ljust(w))
        return "| " + " | ".join(out) + " |"

    rule = []
    for w, a in zip(widths, align):
        rule.append(("-" * (w - 1) + ":") if a == "r" else
                    (":" + "-" * (w - 2) + ":") if a == "c" else "-" * w)
    return "\n".join([line(headers), "| " + " | ".join(rule) + " |"] + [line(r) for r in cells])
