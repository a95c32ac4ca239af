"""benchmarks/gpu_clocks.py on the CPU: nvidia-smi's CSV log summarised a GPU a row (busy
samples only, the clock event reasons decoded)."""
from __future__ import annotations

from bench_scripts import load

LOG = """index, timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu, x
0, 2026/11/30 08:41:09.100, 345, 75.10, 30, 0x0000000000000001
1, 2026/11/30 08:41:09.100, 345, 74.00, 31, 0x0000000000000001
0, 2026/11/30 08:41:09.600, 1980, 650.00, 55, 0x0000000000000000
1, 2026/11/30 08:41:09.600, 1755, 700.00, 61, 0x0000000000000004
0, 2026/11/30 08:41:10.100, 1980, 640.00, 57, 0x0000000000000000
1, 2026/11/30 08:41:10.100, 1605, 698.00, 66, 0x0000000000000044
1, 2026/11/30 08:41:10.600, [N/A], [N/A], 66, [N/A]
"""


def _cells(table):
    return [[c.strip() for c in ln.split("|")[1:-1]] for ln in table.splitlines()[2:]]


def test_parse_skips_what_is_not_a_sample():
    b = load("gpu_clocks")
    got = b.parse(LOG)
    assert sorted(got) == [0, 1] and len(got[0]) == 3 and len(got[1]) == 3, got
    assert got[1][2] == [1605.0, 698.0, 66.0, float(0x44)], got


def test_summary_busy_samples_and_reasons():
    b = load("gpu_clocks")
    rows = _cells(b.summary(LOG))
    # (idle samples, power under a fifth of the highest, left out)
    assert rows[0] == ["0", "2", "1980", "1980", "645", "650", "57", "none"], rows
    assert rows[1][:7] == ["1", "2", "1680", "1605", "699", "700", "66"], rows
    assert rows[1][7] == "power cap 100 %, HW thermal 50 %", rows
