"""benchmarks/bench_distributed.py's pure parts on the CPU: ``--kernels``' table (the kernels
of a rank's share against 1/P of the single op's) and the bytes a rank sends.  The GPU run is
``benchmarks/run_gpu.sh share`` / ``python benchmarks/bench_distributed.py --kernels``."""
from __future__ import annotations

from bench_scripts import load


def _cells(table):
    return [[c.strip() for c in ln.split("|")[1:-1]] for ln in table.splitlines()[2:]]


def test_excess_table_sorts_by_excess_and_totals():
    b = load("bench_distributed")
    share = {"gemm": [2.0, 4], "stats": [0.9, 2], "copy": [0.05, 3]}
    single = {"gemm": [15.2, 4], "stats": [2.4, 2], "merge": [0.8, 1]}
    cells = _cells(b.excess_table(share, single, 8, share_ms=3.4, single_ms=20.0))
    # excess = share − single / 8: stats 0.9 − 0.3, gemm 2.0 − 1.9, copy 0.05, merge −0.1
    assert [c[0] for c in cells[:4]] == ["stats", "gemm", "copy", "merge"], cells
    assert [c[5] for c in cells[:4]] == ["+0.600", "+0.100", "+0.050", "-0.100"], cells
    assert cells[0][1:5] == ["0.900", "2", "0.300", "2"], cells
    total, idle = cells[4], cells[5]
    assert total[0] == "(every kernel)" and total[2] == "9" and total[4] == "7", cells
    assert total[5] == "+0.650", cells  # 2.95 − 2.3
    assert idle[1] == "0.450" and idle[3] == "0.200", cells  # 3.4 − 2.95, 2.5 − 2.3
    assert idle[5] == "+0.250", cells


def test_excess_table_top_and_long_names():
    b = load("bench_distributed")
    share = {f"k{i}" + "x" * 80: [float(i), 1] for i in range(20)}
    cells = _cells(b.excess_table(share, {}, 2, share_ms=200.0, single_ms=0.0, top=3))
    assert len(cells) == 5 and cells[0][0].startswith("k19") and cells[0][0].endswith("..."), \
        cells
    assert len(cells[0][0]) == 70, cells


def test_sent_bytes_ring():
    b = load("bench_distributed")
    # InfoNCE: (P − 1) of the rank's n × D keys in bf16 and their float32 gradients
    assert b.sent_bytes("info_nce", 8, 65536, 512) == 7 * 8192 * 512 * 6
    assert b.sent_bytes("clip_loss", 1, 4096, 64) == 0


def test_host_profile_lists_the_costliest_functions(monkeypatch):
    """``--cprofile``'s table: the issued function's own callees by own time, ``steps`` calls
    profiled (the device waits stand in for a GPU here)."""
    import sys
    import types

    waits = []
    device = types.SimpleNamespace(synchronize=lambda: waits.append(1))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=lambda: device)))
    b = load("bench_distributed")
    calls = []

    def costly_issue():
        return sum(i * i for i in range(20000))

    def fn():
        calls.append(1)
        return costly_issue()

    text = b.host_profile(fn, steps=4, top=5)
    assert len(calls) == 3 + 4 and len(waits) == 1 + 4, (calls, waits)
    assert text.startswith("4 steps; the times below are their totals"), text
    assert "costly_issue" in text and "Ordered by: internal time" in text, text
