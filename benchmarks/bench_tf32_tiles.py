"""The TF32x3 score tiles (issue 24 prototype, ``_engine.losses.nt_xent_tf32.tile_lse_tf32x3``)
against the float32 LSE through cuBLAS: time and accuracy of the row log-sum-exps of S = s Q Kᵀ.

    python benchmarks/bench_tf32_tiles.py [--n 8192,16384] [--d 512] [--repeat 10]

Cases (float32 Q, K of unit rows, K_i = unit(Q_i + 0.3 noise), s = 1 / 0.07; Hopper only):

* ``tf32x3 tiles``: split (``gemm.cublas.split_tf32`` of Q and K) + the kernel + the finish;
  ``tf32x3 kernel``: the kernel and the finish on operands split beforehand;
* ``cuBLAS fp32`` / ``cuBLAS 3xtf32``: the library's float32 path, ``losses.row_blocks.rows``
  (cuBLAS score blocks, ``gemm.cublas.gemm``, then the row-softmax kernel) under that float32
  precision;
* ``product only``: one cuBLAS N x N x D product into a float32 block (fp32, 3xtf32, tf32), and
  the bfloat16 tiles' ``tile_lse`` on the same rows rounded to bfloat16, for scale.

TFLOP/s count 2 N² D (one product's useful work; the tf32x3 kernel issues three TF32
products, 6 N² D).  Errors (relative, over the rows) against a float64 reference computed on
the GPU: the lse, and for the tiles the positive logits (their products, see
tests/engine/test_tf32_tiles.py; for cuBLAS the diagonal of its product block times s).
Medians of CUDA-event times (``cupynce.report.harness.time_cuda``), one run, one GPU.
"""
from __future__ import annotations

import argparse

import numpy as np

from cupynce import config
from cupynce._engine.gemm import cublas, tf32x3
from cupynce._engine.losses import nt_xent_tf32, row_blocks, score_tiles
from cupynce._engine.kernels import BFLOAT16
from cupynce.report.harness import device_header, device_info, time_cuda

SCALE = 1 / 0.07


def _inputs(cp, n, d, seed=0):
    rng = cp.random.default_rng(seed)

    def unit(x):
        return x / cp.linalg.norm(x, axis=1, keepdims=True)

    q = unit(rng.standard_normal((n, d), dtype=cp.float64))
    k = unit(q + 0.3 * unit(rng.standard_normal((n, d), dtype=cp.float64)))
    return q.astype(cp.float32), k.astype(cp.float32)


def _reference(cp, q, k, block=2048):
    """float64 (lse, positive logits) of the float32 rows, on the GPU, in row blocks."""
    q64, k64 = q.astype(cp.float64), k.astype(cp.float64)
    n = q.shape[0]
    lse = cp.empty((n,), cp.float64)
    for r0 in range(0, n, block):
        s = SCALE * (q64[r0:r0 + block] @ k64.T)
        mx = s.max(1)
        lse[r0:r0 + block] = mx + cp.log(cp.exp(s - mx[:, None]).sum(1))
    pos = SCALE * (q64 * k64).sum(1)
    return lse, pos


def _rel(cp, x, ref) -> float:
    return float(cp.linalg.norm(x.astype(cp.float64) - ref) / cp.linalg.norm(ref))


def _cublas_lse(q, k, precision):
    n = q.shape[0]
    with config.float32_precision(precision):
        return row_blocks.rows(q, k, None, None, SCALE, exclude_diag=False, pos_shift=0,
                               pos_mod=n, lse_in=None, weights=(None, 0, 0.0), want_grad=False,
                               workspace_bytes=None, op="bench_tf32_tiles")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="8192,16384", help="comma-separated N")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    import cupy as cp

    print(device_header(device_info()))
    if not tf32x3.available():
        raise SystemExit("the TF32x3 tiles need a compute-capability 9.0 GPU (Hopper) and TMA")
    d = args.d
    for n in (int(x) for x in args.n.split(",")):
        q, k = _inputs(cp, n, d)
        ref_lse, ref_pos = _reference(cp, q, k)
        parts = (*tf32x3.split(q), *tf32x3.split(k))
        qb, kb = q.astype(BFLOAT16), k.astype(BFLOAT16)
        block = cp.empty((n, n), cp.float32)
        flop = 2.0 * n * n * d
        rows = cp.arange(n)
        print(f"\nN={n} D={d} float32, s = 1/0.07; TFLOP/s = 2 N^2 D / time "
              f"(tf32x3 executes 3 TF32 products)")
        print("| case | median ms | TFLOP/s | lse error | positive-logit error |")
        print("|---|--:|--:|--:|--:|")

        def row(name, fn, lse=None, pos=None):
            t = time_cuda(fn, warmup=3, repeat=args.repeat)["median_ms"]
            e_l = "" if lse is None else f"{_rel(cp, lse, ref_lse):.2e}"
            e_p = "" if pos is None else f"{_rel(cp, pos, ref_pos):.2e}"
            print(f"| {name} | {t:.3f} | {flop / t / 1e9:.1f} | {e_l} | {e_p} |", flush=True)

        lse, _, pos = nt_xent_tf32.tile_lse_tf32x3(q, k, SCALE, positives=True)
        row("tf32x3 tiles (split + kernel + finish)",
            lambda: nt_xent_tf32.tile_lse_tf32x3(q, k, SCALE), lse, pos)
        row("tf32x3 kernel + finish (split beforehand)",
            lambda: nt_xent_tf32.lse_split(parts, SCALE))
        row("split of Q and K alone", lambda: (tf32x3.split(q), tf32x3.split(k)))
        for prec in ("fp32", "3xtf32"):
            with config.float32_precision(prec):
                cublas.gemm(q, k, block, trans_b=True)
            pos = (block[rows, rows] * np.float32(SCALE)).astype(cp.float32)
            row(f"cuBLAS {prec} LSE (blocks.rows)", lambda p=prec: _cublas_lse(q, k, p),
                _cublas_lse(q, k, prec), pos)
        for prec in ("fp32", "3xtf32", "tf32"):
            def prod(p=prec):
                with config.float32_precision(p):
                    cublas.gemm(q, k, block, trans_b=True)
            row(f"product only: cuBLAS {prec} N x N x D", prod)
        row("bf16 tile_lse (inputs rounded to bf16)", lambda: score_tiles.tile_lse(
            qb, kb, None, SCALE, exclude_diag=False, pos_shift=0, pos_mod=n))


if __name__ == "__main__":
    main()
