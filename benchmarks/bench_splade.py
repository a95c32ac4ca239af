"""Forward + backward time and peak memory of cupynce's SPLADE head vs PyTorch (issue 4).

Run from the repository root::

    PYTHONUNBUFFERED=1 python benchmarks/bench_splade.py --out splade.json
    python benchmarks/bench_splade.py --quick       # the first shape only

Cases: (B, L, D, V) in the issues' shapes (issue 4's four, issue 56's (128, 256, 768,
250002) last), bfloat16, activation log1p_relu, each with the
output density set to about 1 % and about 50 % by shifting the bias: the exact (float32) max
logits ``m[b, v]`` are computed once and the bias is ``bias0 - quantile(m + bias0, 1 - density)``.
The attention mask marks a random length in [L/2, L] per row (padding as in real batches).
``grad_out`` is dense (standard normal), as from a ranking loss plus the FLOPS term.

Implementations (each computes out and the gradients of x, W and bias):

``cupynce``      ``splade_pool_forward`` + ``splade_pool_backward`` on CuPy arrays; also timed
                 alone: ``fwd`` and ``bwd`` (the backward's cost follows the density).
``eager``        ``logits = F.linear(x, W, b); masked_fill(~mask, -inf); max over L;
                 log1p(relu)`` (the masked LM decoder's logits, rounded after the bias),
                 gradients with ``torch.autograd.grad`` (same bits, through DLPack).
``compile``      ``torch.compile`` of the same function (compile time outside the timing).
``sparton``      Sparton's ``SpartonHead`` (Nguyen et al. 2026, its public Triton kernels), when
                 the ``sparton`` package is installed: the head tied to an ``nn.Linear``
                 decoder holding W and the bias, ``head(x, mask)`` (SPLADE's log1p(relu)
                 max-pool), gradients with ``torch.autograd.grad``; "not installed" otherwise
                 (it is not on PyPI: install it from its repository to compare).
``gemm``         the single forward GEMM (B·L × D by D × V) alone, torch ``x2d @ W.T`` into a
                 preallocated bf16 output: the yardstick of the issue's 1.6× / 1.3× targets.
``gather``       the backward's floor as a gather: for every active (b, v) the two rows its
                 gradients read, x[b, l*] and W[v] (``_GATHER``: 16-byte loads, a warp per
                 row, every SM full of warps, no arithmetic), i.e. the bytes dW and dx must
                 bring to the SMs once the rows are read once per active entry.

Timing and memory through ``cupynce.report.harness`` (CUDA events, medians of several runs, peak
memory above the inputs from CuPy's pool hook + torch's allocator statistics).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupynce  # noqa: E402
from cupynce.report.harness import (device_header, device_info, fmt_mib, fmt_ms, fmt_ratio,  # noqa: E402
                              free_memory, load_torch, markdown_table, run_case)
from cupynce._engine.kernels import BFLOAT16  # noqa: E402

SHAPES = [(32, 256, 768, 30522), (128, 256, 768, 30522), (32, 256, 768, 250002),
          (16, 768, 1024, 151936), (128, 256, 768, 250002)]
#: issue 56's shapes of its target "fwd + bwd <= 1.0x the forward's GEMM" (32 / 128 x 256 x 768,
#: V = 30522 and 250002): ``--shapes 0 1 2 4``
DENSITIES = [0.01, 0.5]


def make_inputs(b: int, l: int, d: int, v: int, density: float, seed: int = 0):
    import cupy as cp

    rs = cp.random.RandomState(seed)
    x = (rs.standard_normal((b, l, d), dtype=cp.float32)).astype(BFLOAT16)
    w = (rs.standard_normal((v, d), dtype=cp.float32) * (1.0 / np.sqrt(d))).astype(BFLOAT16)
    lengths = rs.randint(l // 2, l + 1, size=(b,))
    mask = cp.arange(l)[None, :] < lengths[:, None]
    # exact max logits, one batch row at a time (float32 products of the bf16 values)
    wf = w.astype(cp.float32)
    m = cp.empty((b, v), cp.float32)
    for i in range(b):
        lg = x[i].astype(cp.float32) @ wf.T
        lg[~mask[i]] = -cp.inf
        m[i] = lg.max(axis=0)
    del wf
    shift = float(cp.quantile(m.ravel(), 1.0 - density))
    bias = cp.full((v,), -shift, cp.float32).astype(BFLOAT16)
    g = rs.standard_normal((b, v), dtype=cp.float32).astype(BFLOAT16)
    return x, w, bias, mask, g


def torch_fn(torch):
    def f(x, w, bias, mask):
        logits = torch.nn.functional.linear(x, w, bias)  # (one rounding, after the bias)
        logits = logits.masked_fill(~mask[:, :, None], float("-inf"))
        return torch.log1p(torch.relu(logits.max(dim=1).values))
    return f


def torch_step(torch, fn, x, w, bias, mask, g):
    def step():
        out = fn(x, w, bias, mask)
        return torch.autograd.grad(out, (x, w, bias), g)
    return step


def sparton_step(torch, x, w, bias, mask, g):
    """A training step of Sparton's head on (x, W, bias), through its documented API only
    (``SpartonHead(V, D, use_bias=True)``, ``tie_weights(decoder)``, ``head(hidden,
    attention_mask)``); ImportError when the package is not installed."""
    from sparton import SpartonHead  # optional peer, never vendored

    v, d = w.shape
    dec = torch.nn.Linear(d, v, bias=True, device=x.device, dtype=x.dtype)
    with torch.no_grad():
        dec.weight.copy_(w)
        dec.bias.copy_(bias)
    head = SpartonHead(v, d, use_bias=True).to(device=x.device, dtype=x.dtype)
    head.tie_weights(dec)
    params = (x, dec.weight, dec.bias)

    def step():
        out = head(x, mask)
        return torch.autograd.grad(out, params, g)
    return step


#: the gather floor's kernel (a measurement, not part of cupynce): warp i reads rows i, i + warps,
#: ... of ``a`` (``chunks`` 16-byte chunks a row) through L2, folding them into a value that
#: only decides whether one word is written (so no load is optimised away)
_GATHER = r"""
extern "C" __global__ void __launch_bounds__(256) gather_rows(
    const uint4* __restrict__ a, const long long* __restrict__ rows, long long n, int chunks,
    unsigned* __restrict__ sink)
{
    unsigned acc = 0;
    const long long nw = ((long long)gridDim.x * blockDim.x) >> 5;
    const int lane = threadIdx.x & 31;
#pragma unroll 4
    for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < n; i += nw) {
        const uint4* r = a + rows[i] * chunks;
        for (int c = lane; c < chunks; c += 32) {
            const uint4 v = __ldcg(r + c);
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}
"""


def gather_floor(x, w, out, arg, g):
    """A callable reading, for each active (b, v) (out > 0, grad_out != 0), the rows x[b, l*]
    and W[v] once (16-byte rows only): the backward's gathers without their arithmetic."""
    import cupy as cp

    b, l, d = x.shape
    item = x.dtype.itemsize
    if d * item % 16:
        return None
    kern = cp.RawKernel(_GATHER, "gather_rows")
    bi, vi = cp.nonzero((out.astype(cp.float32) > 0) & (g.astype(cp.float32) != 0))
    xrows = (bi * l + arg[bi, vi].astype(cp.int64)).astype(cp.int64)
    wrows = vi.astype(cp.int64)
    xs, ws = (cp.ascontiguousarray(a).view(cp.uint8) for a in (x, w))
    sink = cp.zeros(1, cp.uint32)
    chunks = np.int32(d * item // 16)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]

    def run():
        for a, rows in ((xs, xrows), (ws, wrows)):
            kern((8 * sms,), (256,), (a, rows, np.int64(rows.size), chunks, sink))
    return run


def run_one(shape, density, args, torch) -> Dict[str, Any]:
    import cupy as cp

    b, l, d, v = shape
    rec: Dict[str, Any] = {"B": b, "L": l, "D": d, "V": v, "target_density": density}
    x, w, bias, mask, g = make_inputs(b, l, d, v, density)
    ws = None if args.workspace_mib is None else args.workspace_mib << 20
    rec["workspace_bytes"] = ws

    def fwd(x, w, bias, mask):
        return cupynce.splade_pool_forward(x, w, bias, mask, workspace_bytes=ws)

    out, ctx = fwd(x, w, bias, mask)
    rec["density"] = float((out.astype(cp.float32) > 0).mean())
    ours = (out,) + cupynce.splade_pool_backward(ctx, g)
    del ctx
    rep = dict(warmup=args.warmup, repeat=args.repeat)

    def fwd_bwd():
        o, c = fwd(x, w, bias, mask)
        return cupynce.splade_pool_backward(c, g)

    rec["cupynce"] = run_case(fwd_bwd, **rep, catch_errors=True)
    rec["cupynce_fwd"] = run_case(lambda: fwd(x, w, bias, mask), **rep, memory=False,
                                  catch_errors=True)
    _o, c = fwd(x, w, bias, mask)
    rec["cupynce_bwd"] = run_case(lambda: cupynce.splade_pool_backward(c, g), **rep,
                                  memory=False, catch_errors=True)
    floor = gather_floor(x, w, _o, c.stats[0], g)
    if floor is not None:
        rec["gather"] = run_case(floor, **rep, memory=False, catch_errors=True)
    del _o, c, floor
    if torch is not None:
        tx, tw, tb = (torch.from_dlpack(a).clone().requires_grad_(True) for a in (x, w, bias))
        tm, tg = torch.from_dlpack(mask).clone(), torch.from_dlpack(g).clone()
        x2 = tx.detach().reshape(b * l, d)
        buf = torch.empty((b * l, v), dtype=tx.dtype, device=tx.device)
        rec["gemm"] = run_case(lambda: torch.matmul(x2, tw.detach().t(), out=buf), **rep,
                               memory=False, catch_errors=True)
        del buf
        fn = torch_fn(torch)
        for impl in args.impls:
            if impl == "eager":
                step = torch_step(torch, fn, tx, tw, tb, tm, tg)
            elif impl == "sparton":
                try:
                    step = sparton_step(torch, tx, tw.detach(), tb.detach(), tm, tg)
                except ImportError:
                    rec[impl] = {"error": "not installed"}
                    continue
            else:
                torch._dynamo.reset()
                step = torch_step(torch, torch.compile(fn, dynamic=False), tx, tw, tb, tm, tg)
            r = run_case(step, **rep, keep_result=impl == "eager", catch_errors=True)
            theirs = r.pop("result", None)
            rec[impl] = r
            if theirs is not None:
                ref_out = fn(tx, tw, tb, tm).detach()
                errs = {}
                for name, a, t in zip(("out", "dx", "dw", "dbias"), ours, (ref_out,) + tuple(theirs)):
                    ta = torch.from_dlpack(a).float()
                    t = t.float()
                    errs[name] = float((ta - t).abs().max() / t.abs().max().clamp_min(1e-30))
                rec["check_vs_eager"] = errs
            del step
            free_memory(full_gc=True)
        del tx, tw, tb, tm, tg, x2
    del x, w, bias, mask, g, out, ours
    free_memory(full_gc=True)
    return rec


def _ms(r: Optional[Dict[str, Any]]) -> Optional[float]:
    if not r:
        return None
    if r.get("oom"):
        return float("nan")
    return r.get("median_ms")


def table(records: List[Dict[str, Any]]) -> str:
    rows = []
    for r in records:
        ours, gemm, eager, comp = (_ms(r.get(k)) for k in ("cupynce", "gemm", "eager", "compile"))
        spr = r.get("sparton") or {}
        sparton = (spr["error"] if "error" in spr and spr["error"]
                   else f"{fmt_ms(_ms(spr))}, {fmt_mib(spr.get('peak_extra_bytes'))}")
        mem = r.get("cupynce", {}).get("peak_extra_bytes")
        emem = (r.get("eager") or {}).get("peak_extra_bytes")
        cmem = (r.get("compile") or {}).get("peak_extra_bytes")
        rows.append([
            f"{r['B']}, {r['L']}, {r['D']}, {r['V']}", f"{100 * r['density']:.1f}%",
            f"{fmt_ms(ours)} ({fmt_ms(_ms(r.get('cupynce_fwd')))} + {fmt_ms(_ms(r.get('cupynce_bwd')))})",
            fmt_ms(_ms(r.get("gather"))),
            fmt_mib(mem), f"{fmt_ms(eager)}, {fmt_mib(emem)}", f"{fmt_ms(comp)}, {fmt_mib(cmem)}",
            sparton, fmt_ms(gemm),
            fmt_ratio(ours / gemm if ours and gemm else None),
            fmt_ratio(eager / ours if ours and eager else None),
            fmt_ratio(mem / emem if mem is not None and emem else None).replace("×", ""),
        ])
    return markdown_table(["B, L, D, V", "density", "cupynce ms (fwd + bwd)", "gather ms", "MiB",
                           "eager ms, MiB", "compile ms, MiB", "sparton ms, MiB", "GEMM ms",
                           "cupynce / GEMM",
                           "eager / cupynce", "memory / eager"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the first shape only")
    p.add_argument("--out", type=Path, default=None, help="write every measurement as JSON")
    p.add_argument("--impls", nargs="*", default=["eager", "compile", "sparton"],
                   choices=["eager", "compile", "sparton"])
    p.add_argument("--shapes", type=int, nargs="*", default=None,
                   help="indices into SHAPES (default: all; --quick: the first)")
    p.add_argument("--workspace-mib", type=int, default=None,
                   help="workspace_bytes for cupynce, in MiB (default: the library's)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args(argv)
    torch = load_torch()
    info = device_info()
    print(device_header(info), flush=True)
    records = []
    shapes = [SHAPES[i] for i in args.shapes] if args.shapes is not None else \
        SHAPES[:1] if args.quick else SHAPES
    for shape in shapes:
        for density in DENSITIES:
            rec = run_one(shape, density, args, torch)
            records.append(rec)
            print(json.dumps({k: (v if not isinstance(v, dict) else
                                  {kk: vv for kk, vv in v.items() if kk != "times_ms"})
                              for k, v in rec.items()}), flush=True)
            if args.out:
                args.out.write_text(json.dumps({"device": info, "records": records}, indent=1))
    print()
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
