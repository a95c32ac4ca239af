"""The report behind ``python -m cupynce``: machine, self-check, benchmark, files.

Layers: :mod:`cupynce.__main__` parses the command line and calls :func:`run`; this module runs
the self-check (:func:`run_check`) and the benchmark (:func:`run_bench`) over the ops of
:data:`cupynce.report.ops.REGISTRY`, timing and measuring memory with the one shared harness
(:mod:`cupynce.report.harness`, also used by ``benchmarks/``), and writes ``results.json``,
``summary.md`` and the plots (:mod:`cupynce.report.plots`).

Backends: with CuPy and a CUDA GPU the kernels run on the GPU and are compared with PyTorch on
the GPU and with the installed peers; without one, the NumPy path runs at small sizes and is
compared with PyTorch on the CPU (when installed), with a notice.

Errors are relative, ``‖x − ref‖ / ‖ref‖`` (float64).  The self-check compares with the float64
oracle (:mod:`cupynce.reference`) against the tolerances of
:data:`cupynce.report.ops.TOLERANCES`.  The benchmark reports the same errors, for every
implementation, against the oracle where it fits on the host (``ORACLE_MAX_BYTES``) and
otherwise against the same PyTorch formula evaluated in float64 on the GPU.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

import cupynce
from cupynce._engine.kernels import BFLOAT16
from cupynce.report.environment import _version, device_header, device_info
from cupynce.report.formatting import _short, fmt_mib, fmt_ms, fmt_ratio, markdown_table
from cupynce.report.harness import is_oom, run_case
from cupynce.report.memory import free_memory
from cupynce.report.ops import DTYPES, REGISTRY, TOLERANCES, OpSpec, np_dtype
from cupynce.report.progress import Progress
from cupynce.report.timing import _synchronize
from cupynce.report.torch_baseline import load_torch

SCHEMA = "cupynce-report/1"
DEFAULT_OUT = "cupynce-report"
#: the benchmark computes errors against the float64 oracle on the host up to this estimate
ORACLE_MAX_BYTES = 1 << 30
#: implementations, in the order of tables and legends
IMPL_LABELS = {"cupynce": "cupynce", "pytorch": "PyTorch eager", "torch.compile": "torch.compile",
               "memeff": "memeff", "inf_cl": "Inf-CL"}
#: benchmark dtypes when --dtype is not given
BENCH_DTYPES_GPU = ("bfloat16", "float32")
BENCH_DTYPES_CPU = ("float32",)


# ------------------------------------------------------------------------------------------
# environment
# ------------------------------------------------------------------------------------------
def gpu_available() -> bool:
    """Whether CuPy imports and sees a CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return False


def machine_info(gpu: bool) -> Dict[str, Any]:
    """:func:`cupynce.report.environment.device_info` plus the backend and matplotlib's version."""
    info = device_info()
    info["cupynce"] = cupynce.__version__
    info["backend"] = "cupy" if gpu else "numpy"
    info["matplotlib"] = _version("matplotlib")
    if not gpu:
        info["gpu"] = None
    return info


def machine_lines(info: Dict[str, Any]) -> List[str]:
    lines = [f"cupynce {info.get('cupynce')} · Python {info.get('python')} · NumPy "
             f"{info.get('numpy')} · CuPy {info.get('cupy') or 'not installed'} · torch "
             f"{info.get('torch') or 'not installed'}"]
    if info.get("gpu"):
        lines.append(f"GPU {info['gpu']}, {info.get('memory_gib')} GiB, compute capability "
                     f"{info.get('compute_capability')}, CUDA runtime {info.get('cuda_runtime')}"
                     f" / driver {info.get('cuda_driver')}")
    else:
        lines.append(f"No CUDA GPU (or no CuPy): running the NumPy path on small sizes "
                     f"(CPU {info.get('cpu')}, {info.get('cpu_count')} cores).")
    peers = [f"{k} {info[k]}" for k in ("memeff", "inf_cl") if info.get(k)]
    lines.append("peers installed: " + (", ".join(peers) if peers else "none (memeff, inf-cl)"))
    return lines


def title_line(info: Dict[str, Any]) -> str:
    """The device and versions, for plot titles."""
    if info.get("gpu"):
        dev = f"{info['gpu']} · CUDA {info.get('cuda_runtime')} · CuPy {info.get('cupy')}"
    else:
        dev = f"no GPU: NumPy path on {info.get('cpu')} ({info.get('cpu_count')} cores)"
    parts = [f"cupynce {info.get('cupynce')}", dev]
    if info.get("torch"):
        parts.append(f"torch {info['torch']}")
    return " · ".join(parts)


# ------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------
def _f64(x) -> Tuple[Any, Any]:
    """``(xp, x as float64)`` for a NumPy / CuPy array, a torch tensor or a scalar."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        t = x.detach()
        t = t.double()
        if t.is_cuda:
            import cupy

            return cupy, cupy.from_dlpack(t.contiguous())
        return np, t.cpu().numpy()
    if mod.startswith("cupy"):
        import cupy

        if BFLOAT16 is not None and x.dtype == BFLOAT16:  # widen the bits: bf16 << 16
            wide = x.view(cupy.uint16).astype(cupy.uint32) << 16
            return cupy, wide.view(cupy.float32).astype(cupy.float64)
        return cupy, x.astype(cupy.float64)
    return np, np.asarray(x).astype(np.float64)


def rel_err(x, ref) -> float:
    """``‖x − ref‖ / ‖ref‖`` in float64 (on the GPU when either lives there); inf if non-finite."""
    xp1, a = _f64(x)
    xp2, b = _f64(ref)
    if xp1 is not xp2:  # move the host one to the device
        import cupy

        a, b = cupy.asarray(a), cupy.asarray(b)
        xp = cupy
    else:
        xp = xp1
    if a.shape != b.shape:
        a = a.reshape(b.shape)
    num = float(xp.linalg.norm((a - b).ravel()))
    den = float(xp.linalg.norm(b.ravel()))
    if not math.isfinite(num):
        return math.inf
    return num / den if den > 0 else num


def errors(got: Tuple[Any, Sequence[Any]], ref: Tuple[Any, Sequence[Any]],
           names: Sequence[str]) -> Dict[str, Any]:
    """Loss / output and per-gradient relative errors; the worst gradient's error."""
    loss, grads = got
    rloss, rgrads = ref
    gerrs: Dict[str, float] = {}
    for name, g, r in zip(names, grads, rgrads):
        if g is not None and r is not None:
            gerrs[name] = rel_err(g, r)
    worst = max(gerrs.values()) if gerrs else None
    return {"loss_err": rel_err(loss, rloss), "grad_errs": gerrs, "grad_err": worst}


# ------------------------------------------------------------------------------------------
# self-check
# ------------------------------------------------------------------------------------------
def run_check(specs: Sequence[OpSpec], dtypes: Sequence[str], gpu: bool,
              progress: Optional[Progress] = None) -> List[Dict[str, Any]]:
    """Every op x dtype x check shape against the float64 oracle; one record each."""
    xp = np
    if gpu:
        import cupy as xp  # noqa: F811
    rows: List[Dict[str, Any]] = []
    for spec in specs:
        for dname in dtypes:
            dtype = np_dtype(dname)
            lt, gt = TOLERANCES[dname]
            for seed, shape in enumerate(spec.check_shapes(gpu)):
                rec: Dict[str, Any] = {
                    "op": spec.name, "dtype": dname, "shape": dict(shape),
                    "shape_text": spec.shape_text(shape), "loss_tol": lt, "grad_tol": gt,
                    "loss_err": None, "grad_err": None, "grad_errs": {}, "passed": False,
                    "error": None}
                if progress is not None:
                    progress.show(f"check {spec.name} {dname} {rec['shape_text']}")
                try:
                    inputs = spec.inputs(xp, shape, dtype, check=True, seed=seed)
                    grad = spec.grad(xp, shape, dtype, check=True)
                    got = spec.run(inputs, shape, grad, check=True)
                    host = tuple(_host(x) for x in inputs)
                    ref = spec.oracle(host, shape, _host(grad), check=True)
                    rec.update(errors(got, ref, spec.grad_names))
                    le, ge = rec["loss_err"], rec["grad_err"]
                    rec["passed"] = bool(le <= lt and ge is not None and ge <= gt)
                    if not rec["passed"]:
                        bad = [n for n, e in rec["grad_errs"].items() if not e <= gt]
                        rec["error"] = ("loss error above tolerance" if not le <= lt else
                                        f"gradient error above tolerance: {', '.join(bad)}")
                except Exception as exc:  # noqa: BLE001 - a crash is a failed check
                    rec["error"] = _short(exc)
                    traceback.print_exc(limit=3)
                rows.append(_clean(rec))
                if progress is not None:
                    progress.update(f"check {spec.name} {dname} {rec['shape_text']}")
    return rows


def _host(x):
    mod = type(x).__module__
    if mod.startswith("cupy"):
        import cupy

        return cupy.asnumpy(x)
    return x


# ------------------------------------------------------------------------------------------
# benchmark
# ------------------------------------------------------------------------------------------
def schedule(gpu: bool, mode: str, spec: OpSpec, shape: Dict[str, Any]) -> Tuple[int, int]:
    """(warm-up, repeats): fewer at the largest sizes, where one call takes ~0.1-1 s."""
    if not gpu:  # host timings scatter (other processes, caches): more repeats for the median
        return (2, 15) if mode == "quick" else (3, 25)
    size = shape[spec.size_key]
    big = {"n": 32768, "v": 105879}.get(spec.size_key, 1 << 62)
    huge = {"n": 65536, "v": 250002}.get(spec.size_key, 1 << 62)
    if size >= huge:
        return 1, 3
    if mode == "quick" or size >= big:
        return 2, 5
    return 3, 10


def _status(r: Dict[str, Any]) -> str:
    if r.get("oom"):
        return "oom"
    if "skipped" in r:
        return "skipped"
    if "error" in r:
        return "error"
    return "ok"


def _measure(impl: str, step_fn, *, gpu: bool, warmup: int, repeat: int,
             memory: bool = True) -> Tuple[Dict[str, Any], Any]:
    r = run_case(step_fn, warmup=warmup, repeat=repeat, keep_result=True, catch_errors=True,
                 device="cuda" if gpu else "cpu", memory=memory)
    result = r.pop("result", None)
    rec = {"impl": impl, "status": _status(r), "median_ms": r.get("median_ms"),
           "p20_ms": r.get("p20_ms"), "p80_ms": r.get("p80_ms"), "min_ms": r.get("min_ms"),
           "warmup": warmup, "repeat": repeat,
           "peak_bytes": r.get("peak_extra_bytes") if memory else None,
           "error": r.get("error"), "stage": r.get("stage")}
    return rec, result


def _reference(spec: OpSpec, inputs, shape, grad, torch, gpu: bool) -> Tuple[Any, Optional[str]]:
    """The error reference of one benchmark case and its name (None, None when none fits).

    The oracle where it fits in ``ORACLE_MAX_BYTES`` on the host, else the PyTorch formula in
    float64 on the inputs' device (``"torch-float64"``); out of memory there: no errors.
    """
    if spec.oracle_bytes(shape) <= ORACLE_MAX_BYTES:
        host = tuple(_host(x) for x in inputs)
        return spec.oracle(host, shape, _host(grad), check=False), "oracle"
    if torch is None:
        return None, None
    try:
        out, grads = spec.torch_step(torch, inputs, shape, grad, dtype=torch.float64)()
        if gpu:
            _synchronize()
        return (out.detach(), [g.detach() for g in grads]), "torch-float64"
    except Exception as exc:  # noqa: BLE001 - OOM (or worse): no errors at this size
        if not is_oom(exc):
            traceback.print_exc(limit=3)
        return None, None
    finally:
        if gpu:
            free_memory(full_gc=True)


def bench_plan(specs: Sequence[OpSpec], dtypes: Sequence[str], mode: str, gpu: bool,
               sizes: Optional[Sequence[int]], dim: Optional[int]):
    """The benchmark's cases, small to large within each op: (spec, dtype, shape)."""
    plan = []
    for spec in specs:
        for dname in dtypes:
            for shape in spec.bench_shapes(mode, gpu, sizes, dim):
                plan.append((spec, dname, shape))
    return plan


def _compiled(spec: OpSpec, torch, inputs, shape, grad):
    """torch.compile of the PyTorch formula, static shapes, compiled afresh for this case."""
    torch._dynamo.reset()  # else the shared code object hits dynamo's recompile limit
    return spec.torch_step(torch, inputs, shape, grad, compile=True)


def impls_for(spec: OpSpec, dname: str, torch, gpu: bool, torch_compile: bool = False
              ) -> Dict[str, Any]:
    """``{impl: builder}`` (a builder maps (inputs, shape, grad) to a step) or a reason."""
    out: Dict[str, Any] = {"cupynce": lambda inputs, shape, grad: spec.step(inputs, shape, grad)}
    if torch is not None:
        out["pytorch"] = lambda inputs, shape, grad: spec.torch_step(torch, inputs, shape, grad)
        if gpu and torch_compile:
            out["torch.compile"] = (lambda inputs, shape, grad:
                                    _compiled(spec, torch, inputs, shape, grad))
        if gpu:
            for name, b in spec.peers(torch, dname).items():
                out[name] = b if isinstance(b, str) else (
                    lambda inputs, shape, grad, b=b: b(torch, inputs, shape, grad))
    return out


def run_bench(specs: Sequence[OpSpec], dtypes: Sequence[str], mode: str, gpu: bool, torch,
              sizes: Optional[Sequence[int]] = None, dim: Optional[int] = None,
              progress: Optional[Progress] = None, on_case=None,
              torch_compile: bool = False) -> List[Dict[str, Any]]:
    """Forward + backward of every implementation over the sweep; one record per measurement."""
    xp = np
    if gpu:
        import cupy as xp  # noqa: F811
    records: List[Dict[str, Any]] = []
    for spec, dname, shape in bench_plan(specs, dtypes, mode, gpu, sizes, dim):
        dtype = np_dtype(dname)
        warmup, repeat = schedule(gpu, mode, spec, shape)
        base = {"op": spec.name, "dtype": dname, "size": int(shape[spec.size_key]),
                "shape": dict(shape), "shape_text": spec.shape_text(shape)}
        label = f"{spec.name} {dname} {base['shape_text']}"
        impls = impls_for(spec, dname, torch, gpu, torch_compile)
        case: List[Dict[str, Any]] = []
        try:
            inputs = spec.inputs(xp, shape, dtype, check=False)
            grad = spec.grad(xp, shape, dtype, check=False)
        except Exception as exc:  # noqa: BLE001 - e.g. the inputs do not fit
            for impl in impls:
                rec = dict(base, impl=impl, status="oom" if is_oom(exc) else "error",
                           error=_short(exc), stage="inputs")
                case.append(rec)
            if progress is not None:
                progress.update(label, advance=len(impls) + 1)
            records.extend(_clean(r) for r in case)
            continue
        if progress is not None:
            progress.show(f"{label}: float64 reference")
        ref, ref_name = _reference(spec, inputs, shape, grad, torch, gpu)
        if progress is not None:
            progress.update(f"{label}: float64 reference")
        for impl, build in impls.items():
            if progress is not None:
                progress.show(f"{label}: {IMPL_LABELS.get(impl, impl)}")
            if isinstance(build, str):
                rec = dict(base, impl=impl, status="skipped", error=build)
            else:
                step_fn = None
                try:
                    step_fn = build(inputs, shape, grad)
                except Exception as exc:  # noqa: BLE001
                    rec = dict(base, impl=impl, status="oom" if is_oom(exc) else "error",
                               error=_short(exc), stage="setup")
                if step_fn is not None:
                    memory = gpu or impl == "cupynce"  # tracemalloc does not see torch's CPU memory
                    m, result = _measure(impl, step_fn, gpu=gpu, warmup=warmup, repeat=repeat,
                                         memory=memory)
                    rec = dict(base, **m)
                    if result is not None and ref is not None:
                        try:
                            rec.update(errors(result, ref, spec.grad_names))
                            rec["error_reference"] = ref_name
                        except Exception as exc:  # noqa: BLE001
                            rec["error_check"] = _short(exc)
                    del result, step_fn
                    if gpu:
                        free_memory()
            case.append(rec)
            if progress is not None:
                progress.update(f"{label}: {IMPL_LABELS.get(impl, impl)}")
        del ref, inputs, grad
        if gpu:
            free_memory(full_gc=True)
        records.extend(_clean(r) for r in case)
        if on_case is not None:
            on_case(records)
    return records


def bench_steps(specs, dtypes, mode, gpu, sizes, dim, torch, torch_compile=False) -> int:
    """How many progress steps :func:`run_bench` takes."""
    n = 0
    for spec, dname, _shape in bench_plan(specs, dtypes, mode, gpu, sizes, dim):
        n += 1 + len(impls_for(spec, dname, torch, gpu, torch_compile))
    return n


# ------------------------------------------------------------------------------------------
# results.json and summary.md
# ------------------------------------------------------------------------------------------
def _clean(obj):
    """JSON-safe: NumPy scalars to Python, non-finite floats to None."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        f = float(obj)
        return f if math.isfinite(f) else None
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def write_json(path: Path, doc: Dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(doc), indent=1, allow_nan=False, default=str))
    os.replace(tmp, path)


def _e(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.1e}"


def check_table(rows: Sequence[Dict[str, Any]]) -> str:
    body = []
    for r in rows:
        worst = ""
        if r.get("grad_errs"):
            worst = max(r["grad_errs"], key=lambda k: r["grad_errs"][k] if
                        r["grad_errs"][k] is not None else math.inf)
        body.append([r["op"], r["dtype"], r["shape_text"], _e(r.get("loss_err")),
                     f"{r['loss_tol']:.0e}", _e(r.get("grad_err")) + (f" ({worst})" if worst
                                                                      else ""),
                     f"{r['grad_tol']:.0e}", "pass" if r["passed"] else "FAIL"])
    return markdown_table(["op", "dtype", "shape", "loss err", "tol", "worst grad err",
                           "tol", "result"], body, align="lllrrrrl")


def _cell_ms(r: Optional[Dict[str, Any]]) -> str:
    """The median and, in brackets, the 20-80 % range of the repeats."""
    if r is None:
        return "—"
    bad = {"oom": "OOM", "error": "error", "skipped": "—"}.get(r["status"])
    if bad:
        return bad
    cell = fmt_ms(r.get("median_ms"))
    if r.get("p20_ms") is not None and r.get("p80_ms") is not None:
        cell += f" ({fmt_ms(r['p20_ms'])}–{fmt_ms(r['p80_ms'])})"
    return cell


def within_noise(a: Optional[Dict[str, Any]], b: Optional[Dict[str, Any]]) -> bool:
    """Whether two timings' 20-80 % ranges overlap: their ratio is then not a measured
    difference."""
    try:
        return a["p20_ms"] <= b["p80_ms"] and b["p20_ms"] <= a["p80_ms"]
    except (KeyError, TypeError):
        return False


def _speedup_cell(other: Optional[Dict[str, Any]], ours: Optional[Dict[str, Any]]) -> str:
    """other ÷ cupynce, marked ≈ when the two are within the noise."""
    text = fmt_ratio(_ratio(other, ours, "median_ms"))
    return "≈" + text if text != "—" and within_noise(other, ours) else text


def _cell_mib(r: Optional[Dict[str, Any]]) -> str:
    if r is None or r["status"] != "ok":
        return _cell_ms(r)
    return fmt_mib(r.get("peak_bytes"))


def _ratio(num: Optional[Dict[str, Any]], den: Optional[Dict[str, Any]], key: str):
    if num and den and num["status"] == "ok" and den["status"] == "ok" and \
            num.get(key) is not None and den.get(key):
        return num[key] / den[key]
    return None


SHORT = {"cupynce": "cupynce", "pytorch": "eager", "torch.compile": "compile",
         "memeff": "memeff", "inf_cl": "Inf-CL"}


def bench_tables(records: Sequence[Dict[str, Any]]) -> List[Tuple[str, str]]:
    """One (title, markdown table) per op and dtype; columns that are empty throughout go."""
    out = []
    keys = list(dict.fromkeys((r["op"], r["dtype"]) for r in records))
    for op, dname in keys:
        recs = [r for r in records if r["op"] == op and r["dtype"] == dname]
        impls = [i for i in IMPL_LABELS if any(r["impl"] == i and r["status"] != "skipped"
                                               for r in recs)]
        others = [i for i in impls if i != "cupynce"]
        size_name = REGISTRY[op].size_label.split(" ")[0] if op in REGISTRY else "size"
        cols: List[Tuple[str, Any]] = [(size_name, lambda by, s: s)]
        for i in impls:
            cols.append((f"{SHORT[i]} ms", lambda by, s, i=i: _cell_ms(by.get(i))))
        for i in impls:
            cols.append((f"{SHORT[i]} MiB", lambda by, s, i=i: _cell_mib(by.get(i))))
        for i in others:
            cols.append((f"speedup vs {SHORT[i]}",
                         lambda by, s, i=i: _speedup_cell(by.get(i), by.get("cupynce"))))
        for i in others:
            cols.append((f"memory saved vs {SHORT[i]}",
                         lambda by, s, i=i: fmt_ratio(_ratio(by.get(i), by.get("cupynce"),
                                                             "peak_bytes"))))
        for i in impls[:2]:
            cols.append((f"{SHORT[i]} loss err",
                         lambda by, s, i=i: _e((by.get(i) or {}).get("loss_err"))))
            cols.append((f"{SHORT[i]} grad err",
                         lambda by, s, i=i: _e((by.get(i) or {}).get("grad_err"))))
        rows = []
        for size in sorted({r["size"] for r in recs}):
            by = {r["impl"]: r for r in recs if r["size"] == size}
            rows.append([f(by, size) for _, f in cols])
        keep = [j for j in range(len(cols)) if j == 0 or any(row[j] != "—" for row in rows)]
        headers = [cols[j][0] for j in keep]
        rows = [[row[j] for j in keep] for row in rows]
        fixed = ", ".join(p for p in recs[0]["shape_text"].split(", ")
                          if not p.startswith(size_name + "="))
        table = markdown_table(headers, rows)
        blind = sorted(r["size"] for r in recs if r["impl"] == "cupynce" and r["status"] == "ok"
                       and r.get("loss_err") is None)
        if blind:  # say why those rows have no error columns rather than drop them silently
            table += (f"\n\nNo errors at {size_name} = {', '.join(map(str, blind))}: no float64 "
                      f"reference there (the oracle needs more than {ORACLE_MAX_BYTES >> 30} "
                      f"GiB of host memory at that size, and the PyTorch formula in float64 "
                      f"was not available or ran out of memory).")
        out.append((f"{op}, {dname} ({fixed})", table))
    return out


BENCH_LEGEND = (
    "ms: median forward + backward time ({timer}), in brackets the 20–80 % range of the "
    "repeats; MiB: peak memory above the inputs during "
    "one forward + backward ({mem}); eager: the plain PyTorch formula. speedup vs X = X's "
    "time ÷ cupynce's time; memory saved vs X = X's peak ÷ cupynce's peak (> 1: cupynce is "
    "faster / lighter); ≈: within the noise, the two 20–80 % ranges overlap. OOM: out of "
    "memory (a result, not a crash); error: see results.json; "
    "—: not measured. loss err / grad err: ‖x − ref‖ / ‖ref‖ of the loss (SPLADE: the output) "
    "and of the worst input gradient against float64 ({ref}). splade_pool in 16-bit dtypes: "
    "rounding the logits may move the max to a near-tied position, for PyTorch as for "
    "cupynce; those rows dominate its gradient error.")


def summary_md(doc: Dict[str, Any], plots: Sequence[str]) -> str:
    info = doc["device"]
    gpu = bool(info.get("gpu"))
    s = doc["settings"]
    lines = ["# cupynce report", "", device_header(info), ""]
    lines.append("Backend: " + ("CuPy kernels on the GPU." if gpu else
                                "**no CUDA GPU** (or no CuPy): the NumPy path, at small sizes."))
    lines.append(f"Command: `{doc['command']}` ({s['mode']}; {doc.get('elapsed_s', 0):.0f} s).")
    if doc.get("skipped_ops"):
        lines.append("Not run: " + "; ".join(f"{k} ({v})" for k, v in doc["skipped_ops"].items())
                     + ".")
    lines.append("")
    if doc.get("checks") is not None:
        checks = doc["checks"]
        passed = sum(r["passed"] for r in checks)
        verdict = "all passed" if passed == len(checks) else f"**{len(checks) - passed} FAILED**"
        lines += [f"## Self-check: {passed}/{len(checks)} ({verdict})", "",
                  "Loss and gradients of every op against the float64 oracle "
                  "(`cupynce.reference`), relative error ‖x − ref‖ / ‖ref‖; inputs L2-normalised "
                  "inside the op (normalize=True), upstream gradient 0.5.", "",
                  check_table(checks), ""]
    if doc.get("benchmarks") is not None:
        lines += ["## Benchmark: forward + backward", ""]
        timer = "CUDA events" if gpu else "host clock"
        mem = ("CuPy's pool + torch's allocator" if gpu else
               "tracemalloc, NumPy path only; PyTorch on the CPU is not measured")
        ref = (f"the oracle where it fits in {ORACLE_MAX_BYTES >> 30} GiB on the host, else "
               f"the PyTorch formula in float64 on the GPU; see each record's "
               f"error_reference" if gpu else "the oracle, cupynce.reference")
        lines += [BENCH_LEGEND.format(timer=timer, mem=mem, ref=ref), ""]
        for title, table in bench_tables(doc["benchmarks"]):
            lines += [f"### {title}", "", table, ""]
        skipped = sorted({f"{r['impl']}: {r['error']}" for r in doc["benchmarks"]
                          if r["status"] == "skipped"})
        if skipped:
            lines += ["Not measured: " + "; ".join(skipped), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    elif doc.get("plots_note"):
        lines += [f"Plots: {doc['plots_note']}", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# the whole report
# ------------------------------------------------------------------------------------------
def select_ops(names: Optional[Sequence[str]]) -> Tuple[List[OpSpec], Dict[str, str]]:
    """The specs to run and ``{name: reason}`` of those skipped; ValueError for bad names."""
    avail = {n: s.available() for n, s in REGISTRY.items()}
    if names is None:
        return ([REGISTRY[n] for n, why in avail.items() if why is None],
                {n: why for n, why in avail.items() if why is not None})
    bad = [n for n in names if n not in REGISTRY]
    if bad:
        raise ValueError(f"unknown op(s) {', '.join(bad)}; choose from {', '.join(REGISTRY)}")
    missing = [f"{n} ({avail[n]})" for n in names if avail[n] is not None]
    if missing:
        raise ValueError(f"op(s) not available here: {', '.join(missing)}")
    return [REGISTRY[n] for n in dict.fromkeys(names)], {}


def run(*, check: bool = True, bench: bool = True, mode: str = "quick",
        ops: Optional[Sequence[str]] = None, dtypes: Optional[Sequence[str]] = None,
        out: str = DEFAULT_OUT, sizes: Optional[Sequence[int]] = None,
        dim: Optional[int] = None, plots: bool = True, torch_compile: bool = False,
        command: str = "python -m cupynce",
        gpu: Optional[bool] = None, stream=None) -> int:
    """Run the report; write ``out``/results.json, summary.md and the plots.

    Returns the exit status: 0 when every check passed and cupynce ran at every benchmark
    size (out-of-memory counts as a result), 1 otherwise.  Bad arguments raise ValueError.
    """
    stream = sys.stdout if stream is None else stream

    def say(text: str = "") -> None:
        print(text, file=stream, flush=True)

    specs, skipped = select_ops(ops)
    for d in dtypes or ():
        if d not in DTYPES:
            raise ValueError(f"unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
    t0 = time.perf_counter()
    gpu = gpu_available() if gpu is None else gpu
    info = machine_info(gpu)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for line in machine_lines(info):
        say(line)
    check_dtypes = list(dtypes) if dtypes else list(DTYPES)
    bench_dtypes = list(dtypes) if dtypes else list(BENCH_DTYPES_GPU if gpu else BENCH_DTYPES_CPU)
    doc: Dict[str, Any] = {
        "schema": SCHEMA, "command": command, "date": info.get("date"),
        "device": info,
        "versions": {k: info.get(k) for k in ("cupynce", "cupy", "numpy", "ml_dtypes", "torch",
                                              "triton", "memeff", "inf_cl", "matplotlib",
                                              "python", "cuda_runtime", "cuda_driver")},
        "settings": {"mode": mode, "check": check, "bench": bench,
                     "ops": [s.name for s in specs], "check_dtypes": check_dtypes,
                     "bench_dtypes": bench_dtypes, "sizes": list(sizes) if sizes else None,
                     "dim": dim, "torch_compile": torch_compile, "backend": info["backend"],
                     "tolerances": TOLERANCES,
                     "oracle_max_bytes": ORACLE_MAX_BYTES,
                     "ops_params": {s.name: dict(s.params(), description=s.description,
                                                 size=s.size_label) for s in specs}},
        "skipped_ops": skipped, "checks": None, "check_passed": None, "benchmarks": None,
        "files": [], "plots_note": None, "elapsed_s": None,
    }
    json_path = out_dir / "results.json"
    status = 0
    torch = None
    if bench:
        torch = load_torch("cuda" if gpu else "cpu", quiet=True)
        if torch is None:
            say("torch is not usable here: the benchmark measures cupynce only")
        if gpu and torch is not None:
            info.update(machine_info(gpu))  # torch's CUDA settings, now that it is imported
        if torch_compile and not (gpu and torch is not None):
            say("--compile: torch.compile is timed on the GPU only (with torch); not here")
    total = (sum(len(s.check_shapes(gpu)) for s in specs) * len(check_dtypes) if check else 0)
    if bench:
        total += bench_steps(specs, bench_dtypes, mode, gpu, sizes, dim, torch, torch_compile)
    progress = Progress(total)
    try:
        if check:
            say(f"\nSelf-check ({'CuPy kernels' if gpu else 'NumPy path'}) against the float64 "
                f"oracle: {len(specs)} op(s) x {len(check_dtypes)} dtype(s)")
            rows = run_check(specs, check_dtypes, gpu, progress)
            progress.close()
            doc["checks"] = rows
            doc["check_passed"] = all(r["passed"] for r in rows)
            say(check_table(rows))
            write_json(json_path, doc)
            if not doc["check_passed"]:
                status = 1
        if bench:
            say(f"\nBenchmark ({mode}): forward + backward, {', '.join(bench_dtypes)}; "
                f"progress on stderr")

            def save(records):
                doc["benchmarks"] = records
                doc["elapsed_s"] = time.perf_counter() - t0
                write_json(json_path, doc)

            records = run_bench(specs, bench_dtypes, mode, gpu, torch, sizes, dim, progress,
                                on_case=save, torch_compile=torch_compile)
            progress.close()
            doc["benchmarks"] = records
            for title, table in bench_tables(records):
                say(f"\n{title}\n{table}")
            crashed = [r for r in records if r["impl"] == "cupynce" and r["status"] == "error"]
            if crashed:
                status = 1
                for r in crashed:
                    say(f"cupynce failed: {r['op']} {r['dtype']} {r['shape_text']}: {r['error']}")
    finally:
        progress.close()
        doc["elapsed_s"] = time.perf_counter() - t0
        plot_files: List[str] = []
        if plots and doc.get("benchmarks"):
            try:
                # (import_module: a fresh import where matplotlib went missing, see the tests)
                plots_mod = importlib.import_module("cupynce.report.plots")
                plot_files = plots_mod.make_plots(doc, out_dir, title_line(info))
            except ImportError as exc:
                doc["plots_note"] = f"skipped: matplotlib is not installed ({exc}); " \
                                    f"pip install 'cupynce[report]'"
                say(f"\nPlots {doc['plots_note']}")
        elif not plots:
            doc["plots_note"] = "skipped (--no-plots)"
        else:
            doc["plots_note"] = "none: the plots show the benchmark, which did not run"
        files = [json_path] + [Path(p) for p in plot_files] + [out_dir / "summary.md"]
        doc["files"] = [p.name for p in files]
        (out_dir / "summary.md").write_text(summary_md(doc, plot_files))
        write_json(json_path, doc)
    say(f"\nWrote {', '.join(doc['files'])} to {out_dir}/")
    if doc["checks"] is not None:
        say("self-check: " + ("all passed" if doc["check_passed"] else "FAILED"))
    return status
