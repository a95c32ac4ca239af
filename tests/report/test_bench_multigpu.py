"""benchmarks/bench_multigpu.py on the CPU: its cases run over gloo with 1 and 2 processes at
tiny sizes (cupynce's global loss and open_clip's formula, every op), rank 0 collects one row
per case, and ``--report`` merges the launches into the scaling table.  The GPU run itself
(torchrun, NCCL) is in docs/distributed.md."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import test_torch_distributed as D  # noqa: E402  (its folder is on sys.path: conftest)
from bench_scripts import load  # noqa: E402


def _bench():
    return load("bench_multigpu")


def check_bench_rank(rank, P):
    """One launch's cases on this rank; rank 0 writes the rows where the test said."""
    import os

    from cupynce.report.memory import measure_peak_host

    # tracemalloc started and stopped beside gloo's threads can segfault the rank (the -11 this
    # test once died of): the harness refuses, and the CPU cases measure no memory
    with pytest.raises(RuntimeError, match="torch.distributed is initialised"):
        measure_peak_host(lambda: None)
    b = _bench()
    rows = b.run_rank(list(b.OPS), [16], d=16, repeat=2, device="cpu", dtype_name="float32")
    once = b.run_rank(["clip_loss"], [8], d=16, once=True, peers=False, device="cpu",
                      dtype_name="float32")
    if rank == 0:
        assert len(rows) == 2 * len(b.OPS), rows
        for r in rows + once:
            assert r["P"] == P and r.get("ms", 0) > 0 and len(r["ms_ranks"]) == P, r
            assert r["peak_bytes"] is None, r  # no tracemalloc in a gloo rank
        path = Path(os.environ["CUPYNCE_BENCH_OUT"]) / f"p{P}.json"
        path.write_text(json.dumps({"P": P, "device": {"gpu": None}, "rows": rows}))
    else:
        assert rows == [] and once == []


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_bench_multigpu_over_gloo(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYNCE_BENCH_OUT", str(tmp_path))  # the spawned ranks inherit it
    for P in (1, 2):
        D.run_ranks(P, ["check_bench_rank"], module="test_bench_multigpu")
    table = _bench().report([str(tmp_path / "p1.json"), str(tmp_path / "p2.json")])
    lines = [ln for ln in table.splitlines() if ln.startswith("| clip_loss")]
    assert len(lines) == 2, table
    assert "100 %" in lines[0], table  # P = 1 is its own baseline
    assert "%" in lines[1], table  # P = 2 against it


def test_report_breakdown_and_host_events(tmp_path):
    """``--report`` of ``--breakdown`` / ``--host-profile`` rows (the GPU runs' fields, written
    here by hand): the step's split against the 1-GPU compute / P, and the host's events."""
    def row(P, wall, host_top=None):
        b = {"wall_ms": wall, "host_ms": 1.5, "nccl_ms": 0.5 * (P > 1), "copy_ms": 0.0,
             "compute_ms": 8.0 / P, "gap_ms": 0.25}
        if host_top:
            b["host_top"] = host_top
            b["host_py"] = [["_comm.py:184(exchange)", 2.5, 1.0]]
        return {"op": "clip_loss", "N": 64, "P": P, "impl": "cupynce", "ms": wall,
                "ms_ranks": [wall] * P, "peak_bytes": 1 << 20, "breakdown": b}
    top = [["cudaStreamSynchronize", 3.25, 2.0], ["aten::empty", 0.125, 40.0]]
    for P, r in ((1, row(1, 8.0)), (2, row(2, 4.5, top))):
        (tmp_path / f"h{P}.json").write_text(json.dumps({"P": P, "device": {"gpu": None},
                                                         "rows": [r]}))
    table = _bench().report([str(tmp_path / "h1.json"), str(tmp_path / "h2.json")])
    split = [ln for ln in table.splitlines() if ln.startswith("| clip_loss") and "4.00" in ln]
    assert split, table  # P = 2: compute 4.00 ms and the 1-GPU compute / P, 4.00 ms
    events = table.split("self CPU time a step")[1].split("(cProfile)")[0]
    assert "cudaStreamSynchronize" in events and "3.25" in events and "aten::empty" in events
    assert "_comm.py:184(exchange)" in table.split("(cProfile)")[1]


def test_device_events_keep_the_device_side_alone():
    """``device_events``: the kernels' own entries, per step; an op's CPU-side entry (whose
    device total repeats its kernels' time) and entries without device time left out."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    b = load("bench_multigpu")
    evs = [SimpleNamespace(key="gemm_kernel", device_type=DeviceType.CUDA,
                           device_time_total=3000.0, count=6),
           SimpleNamespace(key="aten::mm", device_type=DeviceType.CPU,
                           device_time_total=3000.0, count=6),
           SimpleNamespace(key="cudaLaunchKernel", device_type=DeviceType.CPU,
                           device_time_total=0.0, count=6),
           SimpleNamespace(key="Memset (Device)", device_type=DeviceType.CUDA,
                           device_time_total=0.0, count=3)]
    prof = SimpleNamespace(key_averages=lambda: evs)
    assert b.device_events(prof, 3) == {"gemm_kernel": [1.0, 2.0]}
