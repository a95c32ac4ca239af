"""``python -m cupynce`` (the report): runs on the CPU (NumPy path) and writes every file.

One quick run of the real command (a subprocess) is shared by the file and schema tests; the
other tests call :func:`cupynce.__main__.main` in this process (so that an op can be
monkeypatched to plant a wrong result) with small sizes.
"""
from __future__ import annotations

import configparser
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cupynce
from cupynce.report import timing
from cupynce.report.harness import run_case
from cupynce.report.progress import Progress
from cupynce.__main__ import main
from cupynce.report.ops import DTYPES, REGISTRY, available_ops

ROOT = Path(__file__).resolve().parents[2]
PNGS = ("execution_times.png", "speedup.png", "peak_memory.png", "loss_error.png",
        "gradient_error.png")
OPS = [name for name, why in available_ops().items() if why is None]

pytest.importorskip("matplotlib")  # the `test` extra installs it: the plots are tested


def _strict_json(path: Path):
    def bad(const):
        raise AssertionError(f"{path.name} holds {const}: not strict JSON")
    return json.loads(path.read_text(), parse_constant=bad)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``python -m cupynce --quick`` at two small sizes, into a fresh folder."""
    out = tmp_path_factory.mktemp("report") / "out"
    proc = subprocess.run([sys.executable, "-m", "cupynce", "--quick", "--out", str(out),
                           "--sizes", "32,64"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    return proc, out


# ---- the command and its files ----------------------------------------------------------
def test_command_runs_and_writes_every_file(quick_run):
    proc, out = quick_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No CUDA GPU" in proc.stdout or "GPU " in proc.stdout  # the machine is reported
    assert "self-check: all passed" in proc.stdout
    assert "[" in proc.stderr and "/" in proc.stderr  # the progress bar goes to stderr
    for name in ("results.json", "summary.md") + PNGS:
        f = out / name
        assert f.is_file() and f.stat().st_size > 0, name
    for name in PNGS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        assert len(data) > 10_000, f"{name} looks empty ({len(data)} bytes)"
    md = (out / "summary.md").read_text()
    assert "## Self-check" in md and "## Benchmark" in md
    for op in OPS:
        assert f"### {op}, float32" in md
    for name in PNGS:
        assert f"]({name})" in md


def test_results_json_schema(quick_run):
    _, out = quick_run
    doc = _strict_json(out / "results.json")
    for key, typ in (("schema", str), ("command", str), ("date", str), ("device", dict),
                     ("versions", dict), ("settings", dict), ("checks", list),
                     ("check_passed", bool), ("benchmarks", list), ("files", list),
                     ("skipped_ops", dict), ("elapsed_s", float)):
        assert isinstance(doc.get(key), typ), (key, doc.get(key))
    assert doc["schema"] == "cupynce-report/1"
    dev = doc["device"]
    assert dev["backend"] in ("numpy", "cupy")
    assert ("gpu" in dev) and isinstance(dev["python"], str) and isinstance(dev["numpy"], str)
    for key in ("cupynce", "numpy", "torch", "cupy", "python"):
        assert key in doc["versions"]
    assert doc["versions"]["cupynce"] == cupynce.__version__
    s = doc["settings"]
    assert s["mode"] == "quick" and s["ops"] == OPS and s["sizes"] == [32, 64]
    assert set(doc["files"]) == {"results.json", "summary.md", *PNGS}

    checks = doc["checks"]
    assert {(c["op"], c["dtype"]) for c in checks} == {(o, d) for o in OPS for d in DTYPES}
    for c in checks:
        assert isinstance(c["shape"], dict) and isinstance(c["shape_text"], str)
        for k in ("loss_err", "grad_err", "loss_tol", "grad_tol"):
            assert isinstance(c[k], float), (k, c)
        assert isinstance(c["grad_errs"], dict) and c["grad_errs"]
        assert set(c["grad_errs"]) <= set(REGISTRY[c["op"]].grad_names)
        assert c["passed"] is True and c["error"] is None
        assert c["loss_err"] <= c["loss_tol"] and c["grad_err"] <= c["grad_tol"]

    bench = doc["benchmarks"]
    assert bench
    for r in bench:
        assert isinstance(r["op"], str) and isinstance(r["dtype"], str)
        assert isinstance(r["size"], int) and isinstance(r["shape"], dict)
        assert r["status"] in ("ok", "oom", "error", "skipped")
        for k in ("median_ms", "p20_ms", "p80_ms", "min_ms", "loss_err", "grad_err"):
            assert r.get(k) is None or isinstance(r[k], float), (k, r)
        assert r.get("peak_bytes") is None or isinstance(r["peak_bytes"], int)
    for op in OPS:
        ours = [r for r in bench if r["op"] == op and r["impl"] == "cupynce"]
        assert ours, op
        for dt in {r["dtype"] for r in ours}:  # the GPU benchmark runs two dtypes by default
            assert sorted(r["size"] for r in ours if r["dtype"] == dt) == [32, 64], (op, dt)
        for r in ours:  # every measurement there: time, memory, errors against float64
            assert r["status"] == "ok" and r["median_ms"] > 0 and r["peak_bytes"] > 0
            assert r["error_reference"] == "oracle"
            if r["dtype"] in ("float32", "float64"):
                assert r["loss_err"] < 1e-4 and r["grad_err"] < 1e-3, r
            else:  # 16-bit (the GPU default adds bfloat16): at most twice PyTorch's own error
                theirs = [e for e in bench if e["op"] == op and e["impl"] == "eager"
                          and e["dtype"] == r["dtype"] and e["size"] == r["size"]]
                for e in theirs:
                    assert r["loss_err"] <= 2 * e["loss_err"] + 1e-3, (r, e)
                    assert r["grad_err"] <= 2 * e["grad_err"] + 1e-3, (r, e)
    try:
        import torch  # noqa: F401
        assert any(r["impl"] == "pytorch" and r["status"] == "ok" for r in bench)
    except ImportError:
        pass


# ---- a wrong result fails the self-check ------------------------------------------------
@pytest.mark.parametrize("where", ["loss", "gradient", "crash"])
def test_planted_wrong_result_fails_the_check(where, monkeypatch, tmp_path, capsys):
    fwd, bwd = cupynce.nt_xent_forward, cupynce.nt_xent_backward
    if where == "loss":
        def planted(z, t, **kw):
            loss, ctx = fwd(z, t, **kw)
            return loss * (1 + 1e-3), ctx
        monkeypatch.setattr(cupynce, "nt_xent_forward", planted)
    elif where == "gradient":
        def planted(ctx, g=1.0):
            dz = bwd(ctx, g).copy()
            dz.reshape(-1)[0] += abs(dz).max()  # one element off (NumPy or CuPy)
            return dz
        monkeypatch.setattr(cupynce, "nt_xent_backward", planted)
    else:
        def planted(ctx, g=1.0):
            raise RuntimeError("planted crash")
        monkeypatch.setattr(cupynce, "nt_xent_backward", planted)
    rc = main(["check", "--ops", "nt_xent,clip_loss", "--dtype", "float32", "--out",
               str(tmp_path)])
    assert rc == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "self-check: FAILED" in text
    doc = _strict_json(tmp_path / "results.json")
    assert doc["check_passed"] is False
    bad = [c for c in doc["checks"] if not c["passed"]]
    assert bad and all(c["op"] == "nt_xent" for c in bad)
    assert all(c["passed"] for c in doc["checks"] if c["op"] == "clip_loss")
    if where == "loss":
        assert all(c["loss_err"] > c["loss_tol"] for c in bad)
    elif where == "gradient":
        assert all(c["grad_err"] > c["grad_tol"] for c in bad)
    else:
        assert all("planted crash" in c["error"] for c in bad)
    assert "FAILED" in (tmp_path / "summary.md").read_text()
    assert not list(tmp_path.glob("*.png"))  # check only: no benchmark, no plots


# ---- options ----------------------------------------------------------------------------
def test_ops_and_dtype_filter(tmp_path, capsys):
    rc = main(["--ops", "clip_loss,info_nce", "--dtype", "float64", "--sizes", "16,24",
               "--out", str(tmp_path), "--no-plots"])
    assert rc == 0, capsys.readouterr()
    doc = _strict_json(tmp_path / "results.json")
    assert doc["settings"]["ops"] == ["clip_loss", "info_nce"]
    assert {(c["op"], c["dtype"]) for c in doc["checks"]} == {("clip_loss", "float64"),
                                                             ("info_nce", "float64")}
    assert {(r["op"], r["dtype"]) for r in doc["benchmarks"]} == {("clip_loss", "float64"),
                                                                 ("info_nce", "float64")}
    assert {r["size"] for r in doc["benchmarks"]} == {16, 24}
    assert not list(tmp_path.glob("*.png")) and "--no-plots" in doc["plots_note"]


def test_bench_subcommand_only_benchmarks(tmp_path, capsys):
    rc = main(["bench", "--ops", "nt_xent", "--sizes", "16", "--out", str(tmp_path)])
    assert rc == 0
    doc = _strict_json(tmp_path / "results.json")
    assert doc["checks"] is None and doc["check_passed"] is None
    assert {r["op"] for r in doc["benchmarks"]} == {"nt_xent"}
    assert "self-check" not in capsys.readouterr().out
    for name in PNGS:
        assert (tmp_path / name).is_file()


def test_op_without_kernels_is_skipped_not_fatal(monkeypatch, tmp_path, capsys):
    """An op this cupynce lacks (as splade_pool before it lands) is listed as skipped."""
    spec = REGISTRY["nt_xent"]
    monkeypatch.setattr(type(spec), "available", lambda self: "planted: not in this build")
    rc = main(["check", "--dtype", "float32", "--out", str(tmp_path)])
    assert rc == 0
    doc = _strict_json(tmp_path / "results.json")
    assert "nt_xent" not in {c["op"] for c in doc["checks"]}
    assert doc["skipped_ops"]["nt_xent"] == "planted: not in this build"
    with pytest.raises(SystemExit) as exc:  # asked for by name: a clear error
        main(["check", "--ops", "nt_xent", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "not available here: nt_xent (planted: not in this build)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--ops", "nt_xent,softmax"], "unknown op softmax; choose from"),
    (["--dtype", "int8"], "unknown dtype int8; choose from"),
    (["--sizes", "16,33"], "nt_xent needs even N"),
    (["--sizes", "8,x"], "not a comma-separated list of integers"),
    (["--sizes", "1"], "every size must be >= 2"),
    (["--dim", "0"], "--dim must be >= 1"),
    (["--quick", "--full"], "not allowed with argument"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["bench", "--no-bench"], "contradicts"),
    (["--out"], "expected one argument"),
])
def test_bad_options_are_clear_errors(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(argv + (["--out", str(tmp_path)] if argv != ["--out"] else []))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "usage: python -m cupynce" in err


def test_without_matplotlib_plots_are_skipped(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.delitem(sys.modules, "cupynce.report.plots", raising=False)
    rc = main(["bench", "--ops", "info_nce", "--sizes", "16", "--out", str(tmp_path)])
    assert rc == 0
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.png"))
    doc = _strict_json(tmp_path / "results.json")
    assert "matplotlib" in doc["plots_note"] and doc["files"] == ["results.json", "summary.md"]
    assert "matplotlib is not installed" in (tmp_path / "summary.md").read_text()


def test_full_sweeps_more_sizes_than_quick():
    for spec in REGISTRY.values():
        for gpu in (False, True):
            quick = spec.bench_shapes("quick", gpu)
            full = spec.bench_shapes("full", gpu)
            assert len(full) > len(quick) >= 3
            sizes = [s[spec.size_key] for s in full]
            assert sizes == sorted(sizes) and sizes[-1] / sizes[0] >= 10  # log axes


def test_console_script_entry_point():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    scripts = cfg["options.entry_points"]["console_scripts"]
    assert "cupynce = cupynce.__main__:main" in scripts
    extras = cfg["options.extras_require"]
    assert "matplotlib" in extras["report"] and "tqdm" in extras["report"]
    # the run-time compiler's NVRTC is the GPU extras' (the main job installs no test extra)
    assert "nvidia-cuda-nvrtc-cu12" in extras["cuda12"]
    assert "nvidia-cuda-nvrtc" in extras["cuda13"]
    assert "nvidia-cuda-nvrtc" not in extras["test"]


# ---- the harness pieces the report added ------------------------------------------------
def test_harness_host_timing_and_memory():
    r = run_case(lambda: np.ones(1 << 20), device="cpu", warmup=1, repeat=3)
    assert r["repeat"] == 3 and len(r["times_ms"]) == 3 and r["median_ms"] > 0
    assert (1 << 23) <= r["peak_extra_bytes"] < (1 << 24)  # one 8 MiB array
    r = run_case(lambda: np.ones(1 << 20), device="cpu", memory=False, repeat=2)
    assert "peak_extra_bytes" not in r
    failed = run_case(lambda: 1 / 0, device="cpu", catch_errors=True)
    assert failed["stage"] == "first call" and "ZeroDivisionError" in failed["error"]
    with pytest.raises(ValueError, match="device must be"):
        run_case(lambda: None, device="tpu")


def test_progress_bar_in_a_log():
    """Not a terminal: nothing until a step is done, then one line per finished step (tqdm's
    meter: bar, count, elapsed time), ending with the step's label."""
    pytest.importorskip("tqdm")
    buf = io.StringIO()
    p = Progress(4, stream=buf)
    p.show("starting")
    p.update("one")
    p.update("two", advance=3)
    p.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    assert " 1/4 " in lines[0] and "25%" in lines[0] and lines[0].endswith("one")
    assert " 4/4 " in lines[1] and "100%" in lines[1] and lines[1].endswith("two")


def test_progress_bar_on_a_terminal():
    """A terminal gets tqdm's bar redrawn in place, continued after close() (check, then
    bench)."""
    pytest.importorskip("tqdm")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    buf = Tty()
    p = Progress(3, stream=buf)
    p.show("check a")
    p.update("check a")
    p.close()
    p.update("bench b", advance=2)
    p.close()
    text = buf.getvalue()
    assert "\r" in text and "3/3" in text and "bench b" in text


def test_out_of_memory_is_a_result(monkeypatch, tmp_path, capsys):
    """A (planted) out-of-memory at the larger size is recorded and drawn, not a crash."""
    fwd = cupynce.clip_loss_forward

    def planted(a, b, ls, **kw):
        if a.shape[0] > 16:
            raise RuntimeError("CUDA error: out of memory (planted)")
        return fwd(a, b, ls, **kw)
    monkeypatch.setattr(cupynce, "clip_loss_forward", planted)
    rc = main(["bench", "--ops", "clip_loss", "--sizes", "16,32", "--out", str(tmp_path)])
    assert rc == 0
    doc = _strict_json(tmp_path / "results.json")
    ours = {r["size"]: r for r in doc["benchmarks"] if r["impl"] == "cupynce"}
    assert ours[16]["status"] == "ok" and ours[32]["status"] == "oom"
    assert ours[32]["median_ms"] is None and "planted" in ours[32]["error"]
    assert "| 32 |" in (tmp_path / "summary.md").read_text().replace("  ", " ")
    assert "OOM" in (tmp_path / "summary.md").read_text()
    for name in PNGS:
        assert (tmp_path / name).is_file()


def test_torch_float64_reference_beyond_the_oracle(monkeypatch, tmp_path):
    """Sizes too large for the host oracle get their errors from PyTorch in float64."""
    pytest.importorskip("torch")
    from cupynce.report import runner

    monkeypatch.setattr(runner, "ORACLE_MAX_BYTES", 0)
    rc = main(["bench", "--ops", "nt_xent,splade_pool" if "splade_pool" in OPS else "nt_xent",
               "--dtype", "float32", "--sizes", "16", "--out", str(tmp_path), "--no-plots"])
    assert rc == 0
    doc = _strict_json(tmp_path / "results.json")
    for r in doc["benchmarks"]:
        assert r["status"] == "ok" and r["error_reference"] == "torch-float64"
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r


def test_every_implementation_runs_in_half_precision(tmp_path):
    rc = main(["bench", "--dtype", "bfloat16,float16", "--sizes", "16", "--out", str(tmp_path),
               "--no-plots"])
    assert rc == 0
    doc = _strict_json(tmp_path / "results.json")
    failed = [(r["op"], r["dtype"], r["impl"], r.get("error")) for r in doc["benchmarks"]
              if r["status"] != "ok" and r["impl"] in ("cupynce", "pytorch")]
    assert not failed
    assert {r["op"] for r in doc["benchmarks"]} == set(OPS)


def test_version_and_per_command_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"cupynce {cupynce.__version__}"
    for cmd, words in (("check", "self-check only"), ("bench", "benchmark only")):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert exc.value.code == 0 and f"usage: python -m cupynce {cmd}" in out and words in out


def test_options_before_and_after_the_command(tmp_path):
    """``--dtype`` given before ``check`` is not reset by the subcommand's own defaults."""
    for argv in (["--dtype", "float32", "check"], ["check", "--dtype", "float32"]):
        out = tmp_path / argv[0].strip("-")
        assert main(argv + ["--ops", "nt_xent", "--out", str(out)]) == 0
        doc = _strict_json(out / "results.json")
        assert {c["dtype"] for c in doc["checks"]} == {"float32"}


def test_sizes_without_a_reference_say_so(monkeypatch, tmp_path):
    """Sizes where no float64 reference fits keep their rows and say why the errors are
    missing (the error columns used to vanish silently)."""
    from cupynce.report import runner

    monkeypatch.setattr(runner, "_reference", lambda *a, **k: (None, None))
    rc = main(["bench", "--ops", "nt_xent", "--dtype", "float32", "--sizes", "16,24",
               "--out", str(tmp_path), "--no-plots"])
    assert rc == 0
    md = (tmp_path / "summary.md").read_text()
    assert "No errors at N = 16, 24: no float64 reference there" in md


def test_tables_show_the_spread_and_the_noise():
    """ms cells carry the 20-80 % range; a speed-up whose two ranges overlap is marked ≈."""
    from cupynce.report import runner

    def rec(impl, med, lo, hi):
        return dict(op="nt_xent", dtype="float32", size=16, impl=impl, status="ok",
                    median_ms=med, p20_ms=lo, p80_ms=hi, peak_bytes=1 << 20, loss_err=1e-7,
                    grad_err=1e-6, shape_text="N=16, D=8")
    noisy = [rec("cupynce", 1.0, 0.9, 1.2), rec("pytorch", 1.1, 1.0, 1.3)]
    clear = [rec("cupynce", 1.0, 0.95, 1.05), rec("pytorch", 2.0, 1.9, 2.1)]
    (_, t1), = runner.bench_tables(noisy)
    (_, t2), = runner.bench_tables(clear)
    assert "1.00 (0.900–1.20)" in t1 and "≈1.10×" in t1
    assert "2.00×" in t2 and "≈" not in t2
    assert runner.within_noise(noisy[0], noisy[1]) and not runner.within_noise(*clear)


def test_time_cuda_reads_the_sm_clock_outside_the_span(monkeypatch):
    """time_cuda with NVML (faked here, as CuPy's events: no GPU): one SM clock reading per
    repeat after its synchronisation, their median and the throttle reasons seen, by name;
    without NVML no clock keys at all."""
    cupy = pytest.importorskip("cupy")

    class Event:
        def record(self, stream=None):
            pass

    order = []
    monkeypatch.setattr(cupy.cuda, "Event", Event)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: None)
    monkeypatch.setattr(cupy.cuda, "get_elapsed_time", lambda a, b: 2.0)
    monkeypatch.setattr(timing, "_synchronize", lambda: order.append("sync"))
    readings = iter([(1980, 0), (1830, 0x4), (1755, 0x4 | 0x20)])

    def clock():
        order.append("clock")
        return next(readings)
    monkeypatch.setattr(timing, "_clock_reader", lambda: clock)
    res = timing.time_cuda(lambda: order.append("call"), warmup=0, repeat=3)
    assert res["sm_mhz"] == [1980, 1830, 1755] and res["sm_mhz_median"] == 1830
    assert res["throttle"] == ["power cap", "SW thermal"] and res["median_ms"] == 2.0
    # each reading after the call's closing synchronisation, never inside the span
    assert order[-4:] == ["sync", "call", "sync", "clock"]
    monkeypatch.setattr(timing, "_clock_reader", lambda: None)
    assert "sm_mhz" not in timing.time_cuda(lambda: None, warmup=0, repeat=2)


def test_time_cuda_burst_times_back_to_back_calls_per_call(monkeypatch):
    """burst = k: k calls between one pair of events, no synchronisation among them, and the
    span divided by k; burst < 1 is refused before anything runs."""
    cupy = pytest.importorskip("cupy")

    class Event:
        def record(self, stream=None):
            order.append("event")

    order = []
    monkeypatch.setattr(cupy.cuda, "Event", Event)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: None)
    monkeypatch.setattr(cupy.cuda, "get_elapsed_time", lambda a, b: 6.0)
    monkeypatch.setattr(timing, "_synchronize", lambda: order.append("sync"))
    monkeypatch.setattr(timing, "_clock_reader", lambda: None)
    res = timing.time_cuda(lambda: order.append("call"), warmup=0, repeat=2, burst=3)
    assert res["median_ms"] == 2.0 and res["times_ms"] == [2.0, 2.0]
    assert order[-6:] == ["event", "call", "call", "call", "event", "sync"]
    with pytest.raises(ValueError, match="burst must be >= 1, got 0"):
        timing.time_cuda(lambda: order.append("call"), warmup=0, repeat=2, burst=0)


def test_report_keeps_torch_fields_under_new_api_tf32():
    torch = pytest.importorskip("torch")
    from cupynce.report.environment import device_info

    mm = torch.backends.cuda.matmul
    if getattr(mm, "fp32_precision", None) is None:
        pytest.skip("torch < 2.9: no fp32_precision API")
    saved = mm.fp32_precision
    try:
        mm.fp32_precision = "tf32"
        info = device_info()
    finally:
        mm.fp32_precision = saved
    assert info.get("torch_allow_tf32_matmul") is True, info
    assert "torch_cuda" in info and "torch_alloc_conf" in info, info
