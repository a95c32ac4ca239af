"""Forward + backward time and peak memory of cupynce's NT-Xent, CLIP and SigLIP losses vs PyTorch.

Run from the repository root::

    PYTHONUNBUFFERED=1 python benchmarks/bench_contrastive.py --out results.json
    python benchmarks/bench_contrastive.py --quick            # N in {8192, 16384}, D = 512
    python benchmarks/bench_contrastive.py --dtypes float32 --precisions fp32,tf32,3xtf32,auto

What is measured, per case (op, N, D, dtype), ordered from small to large
--------------------------------------------------------------------------
Inputs: rows drawn from a normal distribution and L2-normalised in float32, then cast, so the
logits are realistic (positive pairs have cosine ~0.71: view 2 = normalise(view 1 + noise)).
NT-Xent: z (N, D) = two stacked views, temperature 0.1.  CLIP: a, b (N, D) paired rows,
``logit_scale = log(1 / 0.07)`` (a learnable scalar: its gradient is computed too).  SigLIP:
a, b as CLIP's, ``logit_scale = log 10`` and ``logit_bias = -10`` (the paper's initialisation,
both learnable); eager is open_clip's ``SigLipLoss`` formula
``-logsigmoid((2 I - 1) * (logit_scale.exp() * a @ b.T + logit_bias)).sum() / N``, and the
cuBLAS products are 3 (S, G B, Gᵀ A per row block).  InfoNCE (``--ops info_nce``, not in
the default set): query and key the two views, in-batch negatives, temperature 0.1; cuBLAS
products 3 (S, G K, Gᵀ Q; 4 on the tiles, see ``cublas_products``).
Every implementation computes the mean loss *and* the gradients of all inputs:

``cupynce``
    ``loss, ctx = op_forward(...); grads = op_backward(ctx, 1.0)`` on CuPy arrays.  float32
    cases run once per ``--precisions`` mode (``precision=`` of every ``*_forward``, from
    ``cupynce.config.FLOAT32_PRECISIONS``: fp32, tf32, 3xtf32, auto; default auto
    alone); the first listed is the ``cupynce`` column of the per-op tables, every one is
    recorded as ``cupynce_<p>`` and listed in the "float32 precisions" table.  Other dtypes
    run once, without a precision argument.
``eager``
    The usual PyTorch formula, on torch tensors holding the same bits (DLPack, cloned):
    NT-Xent ``F.cross_entropy((z @ z.T).masked_fill(eye, -inf) / t, labels)`` (the eye mask
    is built inside, as in typical code); CLIP (open_clip)
    ``logits = logit_scale.exp() * a @ b.T; (CE(logits, l) + CE(logits.T, l)) / 2``;
    gradients with ``torch.autograd.grad``.  Skipped ("would not fit", not run) when
    ``4 x N^2 x itemsize`` exceeds the free device memory; an OOM when tried is a result.
``amp``
    The same formula under ``torch.autocast("cuda", dtype=<the input dtype>)``: 16-bit inputs
    only.  This is how mixed-precision training runs it and how ``../shared/ANCHORS.md``
    measured "PyTorch eager" (its 64 GiB at CLIP N = 65536 is four float32 N x N matrices):
    the product stays in the 16-bit dtype, but autocast runs ``cross_entropy`` (log-softmax
    and its gradient) in float32.  Pure 16-bit eager above is the faster of the two
    baselines; docs/results.md reports the speed-up against both.  Skipped when
    ``16 x N^2`` bytes exceed the free device memory.
``compile``
    ``torch.compile(reference, dynamic=False)``, compiled once per case (after
    ``torch._dynamo.reset()``); compile + first backward run outside the timing (reported as
    ``compile_s``).  Skipped when ``2 x N^2 x itemsize`` exceeds free memory.  A compile
    failure or OOM is recorded, not fatal.
``cublas_products``
    The cuBLAS products cupynce issues, alone, with ``cupynce._engine.gemm.cublas.gemm`` on
    preallocated buffers and the same row blocks (``_engine.workspace.plan_rows``), in
    N x N x D products (#prod):
    on the row blocks (float32, or no tiles) NT-Xent and InfoNCE 3 (S = Q Kᵀ into float32,
    G K, Gᵀ Q; G in the input dtype, float32 accumulation), CLIP 4 (S in the loss pass, S
    again in the gradient pass, G B, Gᵀ A) or 3 when the whole N x N float32 block fits in
    the workspace, SigLIP 3 (one pass).  On the tensor-core tiles (16-bit inputs on Hopper,
    the default there) the tile passes count as the S products they compute, taken from
    the passes one cupynce call launches (``_tile_passes``): the tiles keep no scores, so
    CLIP and InfoNCE count 4 (statistics pass, gradient pass, two gradient products);
    NT-Xent counts its statistics and gradient passes as half a product each where they are
    symmetric / mirrored (half the tiles) plus its one gradient product H Z (H = G + Gᵀ):
    2 at N = 16384, D = 512, 2.5 at 8192 (the statistics pass square there); SigLIP 3.  The
    ratio cupynce / cuBLAS then compares the fused kernels with cuBLAS doing the same
    arithmetic.  (Until 2026-11-27 NT-Xent and InfoNCE counted 3 on the tiles too.)

Timing and memory come from ``benchmarks/harness.py`` (CUDA events on the current stream
after a device synchronisation; median and p20/p80 of ``repeat`` runs after ``warmup``; peak
memory above the inputs from CuPy's pool hook + torch's allocator statistics).  Repeats:
10 (warm-up 3) for N < 32768, 5 (warm-up 2) above.  Correctness is checked once per case:
the relative difference of cupynce's loss and gradients against eager's (else compile's).
float32 cases also get errors against a float64 oracle (``--errors``, the default;
``--no-errors`` to skip): the eager formula on float64 copies of the inputs, run once per
case, against which every precision's loss and gradients are compared (relative errors,
``check["float64_<p>"]``).  Its footprint is estimated as 6 float64 N x N matrices
(48·N² bytes); above the free device memory it is skipped (``float64_reference``), as it is
without torch.  torch is imported for it even when no torch column is asked for.

Output: a markdown table per op, and every measurement plus ``device_info()`` as JSON
(``--out``, rewritten after every case so that an interrupted run keeps what it measured).
torch is imported only when an eager/compile column or the float64 oracle is asked for;
without it the script still measures cupynce and the cuBLAS products.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `python benchmarks/bench_contrastive.py` from anywhere
    sys.path.insert(0, str(_ROOT))

import numpy as np  # noqa: E402

from cupynce.report.harness import (  # noqa: E402
    device_header, device_info, fmt_mib, fmt_ms, fmt_ratio, free_device_bytes, free_memory,
    is_oom, load_torch, markdown_table, run_case, to_torch, torch_reference, torch_step,
)

from cupynce.config import FLOAT32_PRECISIONS  # noqa: E402

OPS = ("nt_xent", "clip_loss", "siglip_loss")
#: also measurable (--ops): InfoNCE with in-batch negatives, query / key = the two views
ALL_OPS = OPS + ("info_nce",)
IMPLS = ("cupynce", "cublas", "eager", "amp", "compile", "memeff")
SIZES = (8192, 16384, 32768, 65536)
BIG_SIZE = 131072
QUICK_SIZES = (8192, 16384)
DIMS = (256, 512)
QUICK_DIMS = (512,)
DTYPES = ("bfloat16", "float32")
ALL_DTYPES = ("bfloat16", "float16", "float32", "float64")

NT_XENT_TEMPERATURE = 0.1
CLIP_LOGIT_SCALE = math.log(1 / 0.07)
SIGLIP_LOGIT_SCALE, SIGLIP_LOGIT_BIAS = math.log(10.0), -10.0
#: Noise norm added to view 1 to make view 2 (both unit rows): positive cosine ~ 1/sqrt(2).
POSITIVE_NOISE = 1.0
SEED = 0

#: Eager PyTorch keeps about this many N x N matrices (input dtype) alive at its peak
#: (scores, masked/scaled copies, log-softmax, their gradients); NT-Xent float32 measures ~3.5.
EAGER_NN_COPIES = 4
#: Under autocast: the 16-bit scores plus about four float32 N x N matrices (ANCHORS.md:
#: 64 GiB at CLIP N = 65536), in bytes per score.
AMP_NN_BYTES = 16
#: torch.compile fuses the element-wise work: the product and one gradient block remain.
COMPILE_NN_COPIES = 2
#: At and above this N: fewer repeats (the products alone take ~0.1-1 s in float32).
BIG_N = 32768


# ------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------
def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        from cupynce._engine.kernels import BFLOAT16

        if BFLOAT16 is None:
            raise SystemExit("bfloat16 needs ml_dtypes")
        return BFLOAT16
    return np.dtype(name)


def _unit_rows(x):
    import cupy as cp

    return x / cp.linalg.norm(x, axis=1, keepdims=True)


def _cast(x, dtype: np.dtype):
    """``x.astype(dtype)`` on the device; through the host if CuPy cannot cast to it."""
    import cupy as cp

    try:
        return x.astype(dtype)
    except Exception:  # noqa: BLE001 - e.g. a CuPy without bfloat16 kernels
        return cp.asarray(cp.asnumpy(x).astype(dtype))


def make_inputs(op: str, n: int, d: int, dtype: np.dtype, seed: int = SEED) -> Tuple[Any, ...]:
    """CuPy inputs: unit rows (normalised in float32, then cast); see the module notes."""
    import cupy as cp

    rng = cp.random.default_rng(seed)
    rows = n // 2 if op == "nt_xent" else n
    x = _unit_rows(rng.standard_normal((rows, d), dtype=cp.float32))
    noise = rng.standard_normal((rows, d), dtype=cp.float32) * np.float32(POSITIVE_NOISE / math.sqrt(d))
    y = _unit_rows(x + noise)
    del noise
    if op == "nt_xent":
        return (_cast(cp.concatenate([x, y]), dtype),)
    if op == "info_nce":
        return _cast(x, dtype), _cast(y, dtype)
    if op == "siglip_loss":  # 0-d scale and bias, learnable in both implementations
        return (_cast(x, dtype), _cast(y, dtype), cp.asarray(np.float32(SIGLIP_LOGIT_SCALE)),
                cp.asarray(np.float32(SIGLIP_LOGIT_BIAS)))
    ls = cp.asarray(np.float32(CLIP_LOGIT_SCALE))  # 0-d, learnable in both implementations
    return _cast(x, dtype), _cast(y, dtype), ls


# ------------------------------------------------------------------------------------------
# implementations
# ------------------------------------------------------------------------------------------
def cupynce_step(op: str, inputs: Tuple[Any, ...],
                 precision: Optional[str] = None) -> Callable[[], Any]:
    """``step() -> (loss, grads)``; ``precision`` (float32 mode) is passed only when given."""
    import cupynce

    kw: Dict[str, Any] = {} if precision is None else {"precision": precision}
    if op == "nt_xent":
        (z,) = inputs

        def step():
            loss, ctx = cupynce.nt_xent_forward(z, NT_XENT_TEMPERATURE, **kw)
            return loss, (cupynce.nt_xent_backward(ctx, 1.0),)
    elif op == "info_nce":
        q, k = inputs

        def step():
            loss, ctx = cupynce.info_nce_forward(q, k, NT_XENT_TEMPERATURE, **kw)
            return loss, cupynce.info_nce_backward(ctx, 1.0)[:2]
    elif op == "siglip_loss":
        def step():
            loss, ctx = cupynce.siglip_loss_forward(*inputs, **kw)
            return loss, cupynce.siglip_loss_backward(ctx, 1.0)
    else:
        a, b, ls = inputs

        def step():
            loss, ctx = cupynce.clip_loss_forward(a, b, ls, **kw)
            return loss, cupynce.clip_loss_backward(ctx, 1.0)
    return step


def _tile_passes(op: str, inputs: Tuple[Any, ...]) -> List[Tuple[str, bool, int]]:
    """The tile launches (stage, tri, rows) one plain cupynce forward + backward makes on
    ``inputs`` (CUDA graphs off, so that the passes are launched, not replayed); empty off
    the tiles."""
    from cupynce import config
    # (score_tiles' passes call ``tile`` by its module-level name: the spy goes there)
    from cupynce._engine.losses import score_tiles as C

    seen: List[Tuple[str, bool, int]] = []
    real = C.tile

    def spy(stage, t, grid, a, *args, **kw):  # (score_tiles.tile's signature)
        seen.append((stage, bool(kw.get("tri", False)), int(a.shape[0])))
        return real(stage, t, grid, a, *args, **kw)

    C.tile = spy
    try:
        with config.override(graphs=False):
            cupynce_step(op, inputs)()
    except Exception as exc:  # noqa: BLE001 - (cupynce's own run reports it): 3 products
        print(f"  (the tile passes could not be read: {type(exc).__name__}: {exc}"[:200] + ")",
              flush=True)
        return []
    finally:
        C.tile = real
        free_memory(full_gc=False)
    return seen


def tile_products(op: str, passes: Sequence[Tuple[str, bool, int]], n: int,
                  rb: int) -> Tuple[List[Tuple[int, int]], float]:
    """NT-Xent's / InfoNCE's tile path as cuBLAS products: the row blocks (of at most ``rb``
    rows) of the S = Q Kᵀ products standing for its score passes ``passes`` (see
    :func:`_tile_passes`: each launch's rows × all N columns, half of them where ``tri``), and
    the count of N × N × D products with its gradient products (NT-Xent: H Z; InfoNCE: G K,
    Gᵀ Q).  A mirrored pass does CT (CT + 1) / 2 of CT² tiles, 0.504 at N = 16384: counted as
    half, ~0.4 % low."""
    s_blocks: List[Tuple[int, int]] = []
    for stage, tri, rows in passes:
        if stage in ("lse", "lse2", "g", "h"):
            last = rows // 2 if tri else rows
            s_blocks += [(r0, min(last, r0 + rb)) for r0 in range(0, last, rb)]
    count = sum(r1 - r0 for r0, r1 in s_blocks) / n + (1 if op == "nt_xent" else 2)
    return s_blocks, (int(count) if count == int(count) else round(count, 2))


def cublas_products_step(op: str, inputs: Tuple[Any, ...]) -> Tuple[Callable[[], None], Dict[str, Any]]:
    """The products cupynce issues for (op, inputs), on the same row blocks; and their plan."""
    import cupy as cp
    from cupynce._engine import tiling
    from cupynce._engine.gemm import cublas
    from cupynce._engine.kernels import acc_dtype
    from cupynce._engine.workspace import plan_rows

    x = inputs[0]
    n, d = x.shape
    t = x.dtype
    acc = acc_dtype(t)
    # (before the buffers below: cupynce plans by the free memory, as in the timed runs)
    passes = _tile_passes(op, inputs) if op in ("nt_xent", "info_nce") and t.itemsize == 2 \
        else []
    split_g = t != acc  # half inputs: cupynce stores the gradient block separately, in T
    row_bytes = n * acc.itemsize + (n * t.itemsize if split_g else 0)
    rb = plan_rows(op, n, row_bytes, None)
    rng = cp.random.default_rng(SEED + 1)
    s_buf = rng.standard_normal((rb, n), dtype=cp.float32).astype(acc, copy=False)
    s_buf *= acc.type(1.0 / n)  # softmax-like magnitudes (data barely matters to cuBLAS)
    g_buf = s_buf.astype(t) if split_g else s_buf
    blocks = [(r0, min(n, r0 + rb)) for r0 in range(0, n, rb)]
    gemm = cublas.gemm
    if op == "siglip_loss":  # one pass: S, then G B and Gᵀ A per row block
        a, b = inputs[0], inputs[1]
        da = cp.empty((n, d), acc)
        db = cp.zeros((n, d), acc)
        count = 3

        def step() -> None:
            for r0, r1 in blocks:
                rows = r1 - r0
                gemm(a[r0:r1], b, s_buf[:rows], trans_b=True)            # S = A_r Bᵀ
                gemm(g_buf[:rows], b, da[r0:r1])                         # G B
                gemm(g_buf[:rows], a[r0:r1], db, trans_a=True, beta=1.0)  # Gᵀ A_r
    elif op in ("nt_xent", "info_nce") and passes:
        # the tile path: a statistics pass, then a gradient pass that computes S again (the
        # tiles keep no scores); NT-Xent's symmetric passes each cover half the tiles
        # ("lse2" / "h" with tri) and its gradient is one product, H Z (H = G + Gᵀ)
        q, k = (x, x) if op == "nt_xent" else inputs
        dq = cp.zeros((n, d), acc)
        dk = cp.zeros((n, d), acc) if op == "info_nce" else None
        s_blocks, count = tile_products(op, passes, n, rb)

        def step() -> None:
            for r0, r1 in s_blocks:                                       # the S passes
                gemm(q[r0:r1], k, s_buf[:r1 - r0], trans_b=True)
            for r0, r1 in blocks:
                rows = r1 - r0
                gemm(g_buf[:rows], k, dq[r0:r1])                         # G K (NT-Xent: H Z)
                if op == "info_nce":
                    gemm(g_buf[:rows], q[r0:r1], dk, trans_a=True, beta=1.0)  # Gᵀ Q_r
    elif op in ("nt_xent", "info_nce"):  # S = Q_r Kᵀ, G K, Gᵀ Q_r (NT-Xent: Q = K = Z)
        q, k = (x, x) if op == "nt_xent" else inputs
        dq = cp.zeros((n, d), acc)
        dk = dq if op == "nt_xent" else cp.zeros((n, d), acc)
        beta = 1.0 if op == "nt_xent" else 0.0  # (NT-Xent: both products add into dZ)
        count = 3

        def step() -> None:
            for r0, r1 in blocks:
                rows = r1 - r0
                gemm(q[r0:r1], k, s_buf[:rows], trans_b=True)            # S = Q_r Kᵀ
                gemm(g_buf[:rows], k, dq[r0:r1], beta=beta)              # G K
                gemm(g_buf[:rows], q[r0:r1], dk, trans_a=True, beta=1.0)  # Gᵀ Q_r
    else:
        a, b = inputs[0], inputs[1]
        da = cp.empty((n, d), acc)
        db = cp.zeros((n, d), acc)
        # the whole score matrix fits: the cuBLAS path's gradient pass reuses it (the tile
        # path never stores scores, so it always recomputes them: 4 products)
        reuse = rb >= n and not tiling.tiles_ok(a, b)
        count = 3 if reuse else 4

        def step() -> None:
            for r0, r1 in blocks:                                         # loss pass
                gemm(a[r0:r1], b, s_buf[:r1 - r0], trans_b=True)
            for r0, r1 in blocks:                                         # gradient pass
                rows = r1 - r0
                if not reuse:
                    gemm(a[r0:r1], b, s_buf[:rows], trans_b=True)
                gemm(g_buf[:rows], b, da[r0:r1])                         # G B
                gemm(g_buf[:rows], a[r0:r1], db, trans_a=True, beta=1.0)  # Gᵀ A_r
    buf_bytes = s_buf.nbytes + (g_buf.nbytes if split_g else 0)
    plan = {"products": count, "rows_per_block": int(rb), "blocks": len(blocks),
            "buffer_bytes": int(buf_bytes), "flop": float(2.0 * n * n * d * count)}
    return step, plan


# ------------------------------------------------------------------------------------------
# one case
# ------------------------------------------------------------------------------------------
def schedule(n: int, args: argparse.Namespace) -> Tuple[int, int]:
    warmup, repeat = (2, 5) if n >= BIG_N else (3, 10)
    if args.warmup is not None:
        warmup = args.warmup
    if args.repeat is not None:
        repeat = args.repeat
    return warmup, repeat


def _guard(stage: str, thunk: Callable[[], Any]) -> Tuple[Any, Optional[Dict[str, Any]]]:
    """``(thunk(), None)``, or ``(None, failure record)`` on any exception (OOM recognised)."""
    try:
        return thunk(), None
    except Exception as exc:  # noqa: BLE001 - recorded, the benchmark goes on
        if is_oom(exc):
            fail = {"oom": True, "stage": stage, "error": f"{type(exc).__name__}: {exc}"[:300]}
        else:
            fail = {"error": f"{type(exc).__name__}: {exc}"[:300], "stage": stage}
            traceback.print_exc(limit=4)
    free_memory(full_gc=True)
    return None, fail


def _rel(torch, x, ref) -> float:
    x = x.detach().double()
    ref = ref.detach().double()
    num = float(torch.linalg.vector_norm(x - ref))
    den = float(torch.linalg.vector_norm(ref))
    return num / den if den > 0 else num


def check_against(torch, ours: Any, theirs: Any) -> Dict[str, Any]:
    """Relative differences of cupynce's (loss, grads) against a torch (loss, grads)."""
    (c_loss, c_grads), (t_loss, t_grads) = ours, theirs
    lc, lt = float(c_loss), float(t_loss.detach())
    grads = [_rel(torch, to_torch(torch, cg), tg) for cg, tg in zip(c_grads, t_grads)]
    return {"cupynce_loss": lc, "torch_loss": lt,
            "loss_rel_diff": abs(lc - lt) / abs(lt) if lt else abs(lc - lt),
            "grad_rel_diff": grads, "grad_rel_diff_max": max(grads) if grads else None}


#: The float64 oracle (the PyTorch formula on float64 copies) keeps about 6 float64 N x N
#: matrices alive: this many bytes per score; skipped when that exceeds free memory.
F64_NN_BYTES = 48


def float64_errors(torch, op: str, n: int, inputs: Tuple[Any, ...], kept: Dict[str, Any],
                   rec: Dict[str, Any]) -> None:
    """Relative errors of each precision's kept (loss, grads) against the float64 formula,
    into ``rec["check"]["float64_<p>"]`` (one reference per case)."""
    free_memory()
    est = F64_NN_BYTES * n * n
    free = free_device_bytes()
    if est > free:
        rec["float64_reference"] = {"skipped": "would not fit", "estimate_bytes": est,
                                    "free_bytes": free}
        print(f"  error vs float64: skipped (~{est / 2**30:.0f} GiB > {free / 2**30:.0f} GiB "
              f"free)", flush=True)
        return

    def reference() -> Any:
        leaves = [to_torch(torch, x).double().clone().requires_grad_(True) for x in inputs]
        return torch_step(torch, torch_reference(torch, op, NT_XENT_TEMPERATURE), leaves)()
    theirs, fail = _guard("float64 reference", reference)
    if fail is not None:
        rec["float64_reference"] = fail
        print(_line("float64 reference", fail), flush=True)
        return
    for p, ours in kept.items():
        chk, fail = _guard("check", lambda o=ours, t=theirs: check_against(torch, o, t))
        rec["check"][f"float64_{p}"] = chk if fail is None else fail
        if fail is None:
            print(f"  error vs float64 [{p}]: loss {chk['loss_rel_diff']:.2e}, grads max "
                  f"{chk['grad_rel_diff_max']:.2e}", flush=True)
    del theirs
    free_memory()


def _line(name: str, r: Dict[str, Any]) -> str:
    if r.get("oom"):
        return f"  {name:<16} OOM ({r.get('stage')})"
    if "skipped" in r:
        return f"  {name:<16} skipped: {r['skipped']}"
    if "error" in r:
        return f"  {name:<16} error ({r.get('stage')}): {r['error']}"
    s = (f"  {name:<16} {fmt_ms(r['median_ms']):>8} ms  (p20-p80 {fmt_ms(r['p20_ms'])}-"
         f"{fmt_ms(r['p80_ms'])}, min {fmt_ms(r['min_ms'])}, wall {fmt_ms(r['wall_median_ms'])})")
    if "peak_extra_bytes" in r:
        s += f"  peak +{fmt_mib(r['peak_extra_bytes'])} MiB"
    if r.get("sm_mhz"):  # (the SM clock over the repeats, first to last: a power cap shows)
        mhz = r["sm_mhz"]
        s += f"  SM {mhz[0]}-{mhz[-1]} MHz" + (f" ({', '.join(r['throttle'])})"
                                              if r.get("throttle") else "")
    if "products" in r:
        tflops = r["flop"] / (r["median_ms"] * 1e-3) / 1e12
        r["tflops"] = tflops
        s += (f"  [{r['products']} products x {r['blocks']} block(s) of {r['rows_per_block']} rows,"
              f" {tflops:.0f} TFLOP/s]")
    if "compile_s" in r:
        s += f"  (compile {r['compile_s']:.1f} s)"
    return s


def run_one(op: str, n: int, d: int, dtype_name: str, args: argparse.Namespace,
            torch) -> Dict[str, Any]:
    dtype = np_dtype(dtype_name)
    warmup, repeat = schedule(n, args)
    rec: Dict[str, Any] = {"op": op, "n": n, "d": d, "dtype": dtype_name,
                           "warmup": warmup, "repeat": repeat, "check": {}}
    inputs, fail = _guard("inputs", lambda: make_inputs(op, n, d, dtype))
    if fail is not None:
        rec["inputs_error"] = fail
        print(f"  inputs: {fail}", flush=True)
        return rec

    ours = None  # the (first) cupynce run's (loss, grads), for the checks vs eager / compile
    if "cupynce" in args.impls:
        f32 = np.dtype(dtype) == np.float32
        kept: Dict[str, Any] = {}  # precision -> (loss, grads), until the float64 check
        for p in (args.precisions if f32 else [None]):
            r = run_case(cupynce_step(op, inputs, p), warmup=warmup, repeat=repeat,
                         keep_result=True, catch_errors=True)
            res = r.pop("result", None)
            if "cupynce" not in rec:  # the first precision feeds the per-op table
                rec["cupynce"], ours = r, res
            if p is None:
                print(_line("cupynce", r), flush=True)
                continue
            rec[f"cupynce_{p}"] = r
            print(_line(f"cupynce {p}", r), flush=True)
            if res is not None:
                kept[p] = res
            del res
        if kept and args.errors and torch is not None:
            float64_errors(torch, op, n, inputs, kept, rec)
        del kept

    if "cublas" in args.impls:
        built, fail = _guard("buffers", lambda: cublas_products_step(op, inputs))
        if fail is not None:
            r = fail
        else:
            step, plan = built
            r = run_case(step, warmup=warmup, repeat=repeat, memory=False, catch_errors=True)
            r.update(plan)
            del step, built
        rec["cublas_products"] = r
        print(_line("cuBLAS products", r), flush=True)

    if torch is not None and {"eager", "amp", "compile"} & set(args.impls):
        itemsize = np.dtype(dtype).itemsize
        ref = torch_reference(torch, op, NT_XENT_TEMPERATURE)
        leaves = [to_torch(torch, x).clone().requires_grad_(True) for x in inputs]
        for impl, nbytes in (("eager", EAGER_NN_COPIES * itemsize), ("amp", AMP_NN_BYTES),
                             ("compile", COMPILE_NN_COPIES * itemsize)):
            if impl not in args.impls:
                continue
            if impl == "amp" and itemsize != 2:
                continue  # autocast changes nothing a float32 user would run: no column
            free_memory()
            est = nbytes * n * n
            free = free_device_bytes()
            if est > free:
                r = {"skipped": "would not fit", "estimate_bytes": est, "free_bytes": free}
                rec[impl] = r
                print(_line(impl, r) + f" (~{est / 2**30:.0f} GiB > {free / 2**30:.0f} GiB free)",
                      flush=True)
                continue
            compile_s = None
            if impl == "eager":
                step = torch_step(torch, ref, leaves)
            elif impl == "amp":
                amp_dtype = leaves[0].dtype

                def amp_ref(*xs, _ref=ref, _dt=amp_dtype):
                    with torch.autocast("cuda", dtype=_dt):
                        return _ref(*xs)
                step = torch_step(torch, amp_ref, leaves)
            else:
                torch._dynamo.reset()
                compiled = torch.compile(ref, dynamic=False)
                step = torch_step(torch, compiled, leaves)

                def warm() -> float:
                    t0 = time.perf_counter()
                    out = step()  # compiles the forward, then (at autograd.grad) the backward
                    del out
                    torch.cuda.synchronize()
                    return time.perf_counter() - t0
                compile_s, fail = _guard("compile", warm)
                if fail is not None:
                    rec[impl] = fail
                    print(_line(impl, fail), flush=True)
                    del step, compiled
                    continue
            r = run_case(step, warmup=warmup, repeat=repeat, keep_result=True, catch_errors=True,
                         free_first=False)  # freed just above, before the estimate
            theirs = r.pop("result", None)
            if compile_s is not None:
                r["compile_s"] = compile_s
            r["estimate_bytes"] = est
            rec[impl] = r
            print(_line(impl, r), flush=True)
            if ours is not None and theirs is not None:
                chk, fail = _guard("check", lambda o=ours, t=theirs: check_against(torch, o, t))
                rec["check"][impl] = chk if fail is None else fail
                if fail is None:
                    print(f"  check vs {impl:<8} loss {chk['cupynce_loss']:.6g} vs "
                          f"{chk['torch_loss']:.6g}: rel diff {chk['loss_rel_diff']:.2e}; "
                          f"grads max rel diff {chk['grad_rel_diff_max']:.2e}", flush=True)
            del theirs, step
            if impl == "compile":
                del compiled
                torch._dynamo.reset()
        del leaves
    if torch is not None and "memeff" in args.impls and op == "clip_loss" and \
            np.dtype(dtype).itemsize == 2:
        r = memeff_case(torch, inputs, warmup, repeat)
        rec["memeff"] = r
        print(_line("memeff", r), flush=True)
    if ours is not None and not rec["check"]:
        rec["check"]["cupynce_loss"] = float(ours[0])
        print(f"  check: cupynce loss {rec['check']['cupynce_loss']:.6g} (no torch reference)",
              flush=True)
    del ours, inputs
    return rec


def memeff_case(torch, inputs: Tuple[Any, ...], warmup: int, repeat: int) -> Dict[str, Any]:
    """memeff's fused CLIP loss on the same a, b (fixed temperature), or why it did not run."""
    try:
        import memeff
    except ImportError:
        return {"skipped": "memeff is not installed"}
    a, b = (to_torch(torch, x).clone().requires_grad_(True) for x in inputs[:2])
    loss_fn = memeff.MemoryEfficientCLIPLoss(temperature=math.exp(-CLIP_LOGIT_SCALE),
                                             normalized_inputs=True, stable=False)
    r = run_case(torch_step(torch, loss_fn, [a, b]), warmup=warmup, repeat=repeat,
                 catch_errors=True)
    r.pop("result", None)
    return r


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------
def _ok(r: Optional[Dict[str, Any]]) -> bool:
    return bool(r) and "median_ms" in r


def _ms_cell(r: Optional[Dict[str, Any]]) -> str:
    if not r:
        return "—"
    if r.get("oom"):
        return "OOM"
    if "skipped" in r:
        return "skip"
    if "error" in r:
        return "error"
    return fmt_ms(r.get("median_ms"))


def _mib_cell(r: Optional[Dict[str, Any]]) -> str:
    if not _ok(r):
        return _ms_cell(r) if r and (r.get("oom") or "skipped" in r) else "—"
    return fmt_mib(r.get("peak_extra_bytes"))


def _ratio(num: Optional[Dict[str, Any]], den: Optional[Dict[str, Any]]) -> Optional[float]:
    if _ok(num) and _ok(den) and den["median_ms"] > 0:
        return num["median_ms"] / den["median_ms"]
    return None


HEADERS = ["N", "D", "dtype", "cupynce ms", "cupynce MiB", "eager ms", "eager MiB",
           "amp ms", "amp MiB", "compile ms", "compile MiB", "cuBLAS-products ms", "#prod",
           "speedup vs eager", "speedup vs amp", "speedup vs compile", "cupynce/cuBLAS",
           "memeff ms", "memeff MiB", "cupynce/memeff"]


def table(results: Sequence[Dict[str, Any]], op: str) -> str:
    rows = []
    for rec in sorted((r for r in results if r["op"] == op),
                      key=lambda r: (r["n"], r["d"], r["dtype"])):
        c, e, m, k, b, me = (rec.get(x) for x in ("cupynce", "eager", "amp", "compile",
                                                   "cublas_products", "memeff"))
        if c is None and ("error" in rec or "inputs_error" in rec):
            c = {"error": rec.get("error") or rec.get("inputs_error")}
        rows.append([
            rec["n"], rec["d"], rec["dtype"], _ms_cell(c), _mib_cell(c), _ms_cell(e),
            _mib_cell(e), _ms_cell(m), _mib_cell(m), _ms_cell(k), _mib_cell(k), _ms_cell(b),
            b.get("products", "—") if b else "—",
            fmt_ratio(_ratio(e, c)), fmt_ratio(_ratio(m, c)), fmt_ratio(_ratio(k, c)),
            fmt_ratio(_ratio(c, b)), _ms_cell(me), _mib_cell(me), fmt_ratio(_ratio(c, me)),
        ])
    return markdown_table(HEADERS, rows, align="rrl" + "r" * (len(HEADERS) - 3))


LEGEND = (
    "ms: median forward+backward time (CUDA events); MiB: peak device memory above the inputs "
    "during one forward+backward. eager: the PyTorch formula on the 16-bit tensors; amp: the "
    "same under torch.autocast (cross_entropy in float32, as ANCHORS.md measured it); —: not "
    "applicable (float32). speedup = reference ms / cupynce ms. cupynce/cuBLAS = cupynce "
    "ms / time of the cuBLAS products cupynce issues, run alone (#prod of N×N×D each). "
    "OOM: ran out of device memory; skip: not run, estimated N×N footprint exceeds free memory; "
    "error: see the JSON.")


PRECISION_HEADERS = ["op", "N", "D", "precision", "cupynce ms", "MiB", "loss err",
                     "grad err (max)", "vs eager", "vs compile"]


def _err_cell(chk: Optional[Dict[str, Any]], key: str) -> str:
    x = chk.get(key) if chk else None
    return "—" if x is None else f"{x:.1e}"


def precision_table(results: Sequence[Dict[str, Any]], ops: Sequence[str],
                    precisions: Sequence[str]) -> Optional[str]:
    """One row per float32 case and precision; None when no float32 case ran any."""
    rows = []
    for rec in sorted((r for r in results if r.get("dtype") == "float32" and r["op"] in ops),
                      key=lambda r: (list(ops).index(r["op"]), r["n"], r["d"])):
        for p in precisions:
            r = rec.get(f"cupynce_{p}")
            if r is None:
                continue
            chk = rec.get("check", {}).get(f"float64_{p}")
            rows.append([rec["op"], rec["n"], rec["d"], p, _ms_cell(r), _mib_cell(r),
                         _err_cell(chk, "loss_rel_diff"), _err_cell(chk, "grad_rel_diff_max"),
                         fmt_ratio(_ratio(rec.get("eager"), r)),
                         fmt_ratio(_ratio(rec.get("compile"), r))])
    if not rows:
        return None
    return markdown_table(PRECISION_HEADERS, rows, align="lrrl" + "r" * 6)


PRECISION_LEGEND = (
    "float32 precisions: cupynce per --precisions mode (fp32: true-fp32 products; tf32: TF32 "
    "tensor cores; 3xtf32: three TF32 products on a hi/lo split; auto: the library default); "
    "loss err / grad err: relative error (|Δ| / |ref|, grads: Frobenius norm, max over inputs) "
    "against the same PyTorch formula in float64 (—: not computed, e.g. its ~48·N² bytes "
    "exceeded free memory); vs eager / vs compile = float32 PyTorch ms / this ms; the per-op "
    "tables show the first listed precision.")


def save(path: Optional[str], doc: Dict[str, Any]) -> None:
    if not path:
        return
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, p)


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------
def _csv(kind: type, allowed: Optional[Sequence[Any]] = None) -> Callable[[str], List[Any]]:
    def parse(text: str) -> List[Any]:
        vals = [kind(v.strip()) for v in text.split(",") if v.strip()]
        if not vals:
            raise argparse.ArgumentTypeError("empty list")
        if allowed is not None:
            bad = [v for v in vals if v not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {list(allowed)}")
        return vals
    return parse


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="cupynce NT-Xent / CLIP forward+backward vs PyTorch eager, torch.compile "
                    "and the bare cuBLAS products (time and peak memory).")
    ap.add_argument("--quick", action="store_true",
                    help=f"N in {list(QUICK_SIZES)}, D in {list(QUICK_DIMS)} only")
    ap.add_argument("--big", action="store_true", help=f"also N = {BIG_SIZE}")
    ap.add_argument("--ops", type=_csv(str, ALL_OPS), default=list(OPS))
    ap.add_argument("--dtypes", type=_csv(str, ALL_DTYPES), default=list(DTYPES))
    ap.add_argument("--sizes", type=_csv(int), default=None, help="N values (rows), even")
    ap.add_argument("--dims", type=_csv(int), default=None, help="D values")
    ap.add_argument("--impls", type=_csv(str, IMPLS), default=list(IMPLS),
                    help="which columns to measure (drop 'compile' to save compile time)")
    ap.add_argument("--precisions", type=_csv(str, FLOAT32_PRECISIONS), default=["auto"],
                    help="float32 cases: run cupynce once per mode (precision=), from "
                         f"{list(FLOAT32_PRECISIONS)}; the first feeds the per-op tables")
    ap.add_argument("--errors", action=argparse.BooleanOptionalAction, default=True,
                    help="float32 cases: relative errors of each precision against the PyTorch "
                         "formula in float64 (needs torch; skipped when ~48 N^2 bytes exceed "
                         "free device memory)")
    ap.add_argument("--warmup", type=int, default=None, help="override the warm-up count")
    ap.add_argument("--repeat", type=int, default=None, help="override the repeat count")
    ap.add_argument("--out", default="bench_contrastive.json",
                    help="JSON file for all measurements ('' for none)")
    args = ap.parse_args(argv)
    if args.sizes is None:
        args.sizes = list(QUICK_SIZES if args.quick else SIZES)
        if args.big:
            args.sizes.append(BIG_SIZE)
    if args.dims is None:
        args.dims = list(QUICK_DIMS if args.quick else DIMS)
    if any(n < 2 or n % 2 for n in args.sizes):
        ap.error("--sizes: every N must be even and >= 2 (NT-Xent stacks two views)")
    if any(d < 1 for d in args.dims):
        ap.error("--dims: every D must be >= 1")
    if args.repeat is not None and args.repeat < 1:
        ap.error("--repeat must be >= 1")
    return args


def cases(args: argparse.Namespace) -> List[Tuple[str, int, int, str]]:
    """Small to large: N, then D, then dtype (as listed), then op."""
    return [(op, n, d, dt) for n in sorted(set(args.sizes)) for d in sorted(set(args.dims))
            for dt in args.dtypes for op in args.ops]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        pass
    import cupy  # noqa: F401 - fail early and clearly without CuPy
    import cupynce  # noqa: F401

    f64_oracle = args.errors and "float32" in args.dtypes and "cupynce" in args.impls
    torch = (load_torch() if f64_oracle or {"eager", "amp", "compile", "memeff"} & set(args.impls)
             else None)
    info = device_info()
    print(f"# cupynce contrastive benchmark\n\n{device_header(info)}\n", flush=True)
    todo = cases(args)
    doc: Dict[str, Any] = {
        "benchmark": "contrastive", "device": info,
        "settings": {"ops": args.ops, "dtypes": args.dtypes, "sizes": args.sizes,
                     "dims": args.dims, "impls": args.impls, "quick": args.quick,
                     "big": args.big, "nt_xent_temperature": NT_XENT_TEMPERATURE,
                     "clip_logit_scale": CLIP_LOGIT_SCALE, "seed": SEED,
                     "eager_nn_copies": EAGER_NN_COPIES, "compile_nn_copies": COMPILE_NN_COPIES,
                     "amp_nn_bytes": AMP_NN_BYTES, "precisions": args.precisions,
                     "errors": args.errors, "f64_nn_bytes": F64_NN_BYTES,
                     "torch": torch is not None},
        "results": [],
    }
    t_start = time.perf_counter()
    for i, (op, n, d, dt) in enumerate(todo, 1):
        t0 = time.perf_counter()
        print(f"[{i}/{len(todo)}] {op} N={n} D={d} {dt}", flush=True)
        try:
            rec = run_one(op, n, d, dt, args, torch)
        except Exception as exc:  # noqa: BLE001 - keep what was measured, go on
            traceback.print_exc()
            rec = {"op": op, "n": n, "d": d, "dtype": dt,
                   "error": f"{type(exc).__name__}: {exc}"[:300]}
        free_memory(full_gc=True)
        rec["case_s"] = time.perf_counter() - t0
        doc["results"].append(rec)
        doc["elapsed_s"] = time.perf_counter() - t_start
        save(args.out, doc)
        print(f"  ({rec['case_s']:.1f} s; {doc['elapsed_s']:.0f} s total)", flush=True)

    print(f"\n# Results\n\n{device_header(info)}\n")
    for op in args.ops:
        print(f"## {op}\n\n{table(doc['results'], op)}\n")
    print(LEGEND)
    ptable = precision_table(doc["results"], args.ops, args.precisions)
    if ptable is not None:
        print(f"\n## float32 precisions\n\n{ptable}\n\n{PRECISION_LEGEND}")
    if args.out:
        print(f"\nJSON: {args.out}")
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
