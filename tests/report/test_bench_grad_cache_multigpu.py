"""benchmarks/bench_grad_cache_multigpu.py on the CPU: the cached step of cupynce's and the
library's cached MNRL with ``gather_across_devices`` over gloo with 1 and 2 processes (a tiny
BERT under DDP), rank 0 collecting one row per loss, and ``--report``'s scaling table.  The
GPU run (torchrun, NCCL) is ``benchmarks/run_multigpu.sh cached``."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")
import torch.distributed as dist  # noqa: E402

import test_torch_distributed as D  # noqa: E402  (its folder is on sys.path: conftest)
from bench_scripts import load  # noqa: E402


def _bench():
    return load("bench_grad_cache_multigpu")


def check_cached_rank(rank, P):
    """This rank's steps; rank 0 writes the rows where the test said."""
    b = _bench()
    rows = b.run_rank("tiny", 8, list(b.LOSSES), length=6, mini_batch=2, steps=1,
                      device="cpu", cprofile=True)
    if rank == 0:
        assert [r["loss"] for r in rows] == list(b.LOSSES), rows
        for r in rows:
            assert r["P"] == P and r["n"] == 8 // P and r["step_s"] > 0, r
            assert len(r["step_s_ranks"]) == P and r["peak_gib"] is None, r
            # (--cprofile: the profiled step's time and its functions, own ms and calls)
            assert r["cprofile_s"] > 0 and r["host_py"], r
            assert all(isinstance(f, str) and ms >= 0 and calls >= 1
                       for f, ms, calls in r["host_py"]), r["host_py"]
        path = Path(os.environ["CUPYNCE_BENCH_OUT"]) / f"c{P}.json"
        path.write_text(json.dumps({"P": P, "device": {"gpu": None}, "rows": rows}))
    else:
        assert rows == []


def check_no_ddp_rank(rank, P):
    """--no-ddp: the model not wrapped (the loss still global), the row marked."""
    b = _bench()
    rows = b.run_rank("tiny", 8, ["cupynce cached"], length=6, mini_batch=2, steps=1,
                      device="cpu", ddp=False)
    if rank == 0:
        assert len(rows) == 1 and rows[0]["ddp"] is False and rows[0]["P"] == P, rows
        path = Path(os.environ["CUPYNCE_BENCH_OUT"]) / "nd.json"
        path.write_text(json.dumps({"P": P, "device": {"gpu": None}, "rows": rows}))


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_bench_grad_cache_no_ddp_over_gloo(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYNCE_BENCH_OUT", str(tmp_path))
    D.run_ranks(2, ["check_no_ddp_rank"], module="test_bench_grad_cache_multigpu", timeout=400)
    table = _bench().report([str(tmp_path / "nd.json")])
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in table.splitlines()
             if ln.startswith("| tiny")]
    assert [c[1] for c in cells] == ["cupynce cached (no DDP)"], table


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_bench_grad_cache_multigpu_over_gloo(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYNCE_BENCH_OUT", str(tmp_path))  # the spawned ranks inherit it
    for P in (1, 2):
        D.run_ranks(P, ["check_cached_rank"], module="test_bench_grad_cache_multigpu",
                    timeout=400)
    table = _bench().report([str(tmp_path / "c1.json"), str(tmp_path / "c2.json")])
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in table.splitlines()
             if ln.startswith("| tiny")]
    assert [(c[1], c[3]) for c in cells] == [(loss, P) for loss in sorted(_bench().LOSSES)
                                             for P in ("1", "2")], table
    for c in cells:  # (P = 1 is its own baseline; P = 2 against it)
        assert c[7] == "100 %" if c[3] == "1" else c[7].endswith("%"), table
    prof = [[c.strip() for c in ln.split("|")[1:-1]] for ln in table.split("cProfile alone")[1]
            .splitlines() if ln.startswith("| ") and "cached" in ln]
    assert {(c[0], c[2]) for c in prof} == {(loss, P) for loss in _bench().LOSSES
                                            for P in ("1", "2")}, table


def test_report_profile(tmp_path):
    """``--profile``'s rows (a GPU run: ``breakdown`` in ms, the slowest rank's) become the
    breakdown table in seconds and the host's and Python's top entries."""
    b = _bench()
    brk = {"wall_ms": 14200.0, "compute_ms": 11000.0, "nccl_ms": 900.0, "copy_ms": 12.0,
           "gap_ms": 2288.0, "host_ms": 13900.0, "host_top": [["aten::mm", 800.0, 512]],
           "host_py": [["distributed_c10d.py:1(all_gather)", 1500.0, 2]]}
    row = {"shape": "minilm", "loss": "cupynce cached", "N": 16, "P": 2, "n": 8,
           "mini_batch": 4, "length": 6, "step_s": 14.2, "step_s_ranks": [14.2, 14.1],
           "peak_gib": 8.7, "breakdown": brk}
    path = tmp_path / "c2.json"
    path.write_text(json.dumps({"P": 2, "device": {"gpu": None}, "rows": [row]}))
    table = b.report([str(path)])
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in table.splitlines()
             if ln.startswith("| cupynce cached")]
    assert cells[0] == ["cupynce cached", "2", "14.200", "11.000", "0.900", "0.012", "2.288",
                        "13.900"], table
    assert "aten::mm" in table and "all_gather" in table and "1500.0" in table, table


def test_report_without_files_runs_nothing(capsys):
    """``--report`` with no file (every launch of run_multigpu.sh failed): an error, not a
    run of the benchmark in this process."""
    assert _bench().main(["--report"]) == 1
    assert "no launch wrote its JSON file" in capsys.readouterr().err
    assert load("bench_multigpu").main(["--report"]) == 1
