"""The TF32x3 product kernel (``_engine.gemm.tf32x3.mm``, issue 24) on CLIP's three float32
products, against cuBLAS fp32 and TF32 on the same shapes: time, TFLOP/s, error against float64.

    python benchmarks/bench_tf32_mm.py [--n 16384] [--d 512] [--repeat 10] [--no-f16x3]

CLIP's N x N block issues S = A Bᵀ (M = N, cols = N, K = D), dA = G B and dB = Gᵀ A (M = N,
cols = D, K = N; the ``mmt`` kernel reads G as stored and transposes its boxes in shared
memory).  Per shape:

* ``tiles mm``: ``tf32x3.mm`` on operands split beforehand (A split in the kernel's shared
  memory, B as ``tf32x3.split`` / ``split_t`` gives it), with the consumers interleaved
  (``cupynce.config``'s ``mm_interleave``, the default) and ping-ponging whole tiles (the
  fused passes' schedule, the default before 2026-11-27) -- the same arithmetic in the same
  order: the script checks the two outputs are identical bit for bit;
* ``f16x3 mm`` (``_engine.gemm.f16x3.mm``, the float16 prototype: operands split beforehand
  into scaled float16 halves -- A and B per row for S, G as a whole with B / A per column for
  the gradient products --, interleaved and ping-pong) and the splits' own time (``f16x3
  splits``: the split of G is what a fused gradient pass would write instead of G);
* ``cuBLAS fp32`` (true fp32, ``_engine.gemm.cublas.gemm``'s float32 path) and ``cuBLAS
  tf32`` (one TF32 product: the tensor cores' rate, a third of the work the tiles issue).

TFLOP/s count 2 M cols K (the product's useful work; the tiles issue three TF32 products).
Errors: relative Frobenius norm against float64 products computed on the GPU.  Medians of
CUDA-event times (``cupynce.report.harness.time_cuda``), one run, one GPU.
"""
from __future__ import annotations

import argparse

import numpy as np

import math

from cupynce import config
from cupynce._engine.gemm import cublas, f16x3, tf32x3
from cupynce.report.harness import device_header, device_info, time_cuda


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="16384", help="comma-separated N")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-f16x3", action="store_true", help="skip the F16x3 rows")
    args = ap.parse_args()
    import cupy as cp

    print(device_header(device_info()))
    if not tf32x3.available():
        raise SystemExit("the TF32x3 tiles need a compute-capability 9.0 GPU (Hopper) and TMA")
    d = args.d
    print("| product | M x cols x K | case | median ms | TFLOP/s | rel. error |")
    print("|---|---|---|--:|--:|--:|")
    for n in (int(x) for x in args.n.split(",")):
        rng = cp.random.default_rng(0)
        a = rng.standard_normal((n, d), dtype=cp.float32) / np.float32(np.sqrt(d))
        b = rng.standard_normal((n, d), dtype=cp.float32) / np.float32(np.sqrt(d))
        g = rng.standard_normal((n, n), dtype=cp.float32) / np.float32(n)
        # (name, tiles' A, its B parts, trans_a, cuBLAS operands (x, y, trans_a, trans_b),
        # out shape)
        shapes = [("S = A Bᵀ", a, tf32x3.split(b), False, (a, b, False, True), (n, n)),
                  ("dA = G B", g, tf32x3.split_t(b), False, (g, b, False, False), (n, d)),
                  ("dB = Gᵀ A", g, tf32x3.split_t(a), True, (g, a, True, False), (n, d))]
        for name, ta, parts, tr, (x, y, xa, tb), oshape in shapes:
            m, cols = oshape
            k = x.shape[0] if xa else x.shape[1]
            flop = 2.0 * m * cols * k
            ref = (x.T if xa else x).astype(cp.float64) @ (y.T if tb else y).astype(cp.float64)
            out = cp.empty(oshape, cp.float32)

            def err(o):
                return float(cp.linalg.norm(o.astype(cp.float64) - ref) / cp.linalg.norm(ref))

            def row(case, fn, o):
                t = time_cuda(fn, warmup=3, repeat=args.repeat)["median_ms"]
                print(f"| {name} | {m} x {cols} x {k} | {case} | {t:.3f} | "
                      f"{flop / t / 1e9:.1f} | {err(o):.2e} |", flush=True)

            outs = {}
            for il in (True, False):
                with config.override(mm_interleave=il):
                    o = cp.empty(oshape, cp.float32)
                    row(f"tiles mm{'t' if tr else ''}, {'interleaved' if il else 'ping-pong'}",
                        lambda o=o: tf32x3.mm(ta, parts, o, trans_a=tr), o)
                    outs[il] = o
            same = bool(cp.array_equal(outs[True], outs[False]))
            print(f"| {name} | | interleaved == ping-pong bit for bit | {same} | | |")
            if not args.no_f16x3:
                # G's scale from its largest |g| (a fused gradient pass knows a bound instead)
                e = 14 - math.frexp(float(cp.abs(g).max()))[1] + 1
                if name.startswith("S"):
                    def split(a=a, b=b):
                        (ah, al, ia), (bh, bl, ib) = (f16x3.split_rows(a),
                                                      f16x3.split_rows(b))
                        return (ah, al), (bh, bl), dict(rowf=ia, colf=ib, alpha=1.0)
                else:
                    def split(y=b if "dA" in name else a):
                        bh, bl, ib = f16x3.split_cols_t(y)
                        return (f16x3.split_scaled(g, e), (bh, bl),
                                dict(colf=ib, alpha=2.0 ** -e))
                fa, fb, kw = split()
                for il in (True, False):
                    with config.override(mm_interleave=il):
                        o = cp.empty(oshape, cp.float32)
                        row(f"f16x3 mm{'t' if tr else ''}, "
                            f"{'interleaved' if il else 'ping-pong'}",
                            lambda o=o: f16x3.mm(fa, fb, o, trans_a=tr, k=k, **kw), o)
                if not name.startswith("S") and n % 64 == 0:  # G's halves in its own buffer
                    gil = f16x3.split_scaled_il(g.copy(), e)
                    o = cp.empty(oshape, cp.float32)
                    row(f"f16x3 mm{'t' if tr else ''}, G interleaved in place",
                        lambda o=o: f16x3.mm(gil, fb, o, trans_a=tr, k=k, **kw), o)
                    t = time_cuda(lambda: f16x3.split_scaled_il(gil.buf, e, "g"),
                                  warmup=1, repeat=args.repeat)["median_ms"]
                    print(f"| {name} | | f16x3 split of G in place (timing only) | {t:.3f} | | |")
                    del gil
                t = time_cuda(split, warmup=2, repeat=args.repeat)["median_ms"]
                print(f"| {name} | | f16x3 splits | {t:.3f} | | |", flush=True)
                del fa, fb, kw
            for prec in ("fp32", "tf32"):
                def prod(p=prec):
                    with config.float32_precision(p):
                        cublas.gemm(x, y, out, trans_a=xa, trans_b=tb)
                prod()
                row(f"cuBLAS {prec}", prod, out)
            del ref


if __name__ == "__main__":
    main()
