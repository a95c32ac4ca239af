"""How accurate cupynce's float32 product modes are, and why (issue 24): each mode's error
against float64 for Z·Zᵀ (positive diagonal) and a random A·Bᵀ, with the mean signed error
(a bias shows there), the hi·hi product alone on the tensor cores and through fp32, and hi·hi
in K-chunks summed with round-to-nearest between chunks (what a kernel promoting its
accumulator every ``chunk`` K elements would get).  Then each mode's time for one
16384 x 16384 x 512 product.  On Hopper the tensor cores round the accumulator toward zero
at every MMA step: 3xtf32's error is hi·hi's, a bias, ~3-13x fp32's (docs/notes.md).

    python benchmarks/bench_f32_products.py
"""
import time

import cupy as cp
import numpy as np

from cupynce._engine import blas as B

FP32, TF32 = 68, B.COMPUTE_32F_FAST_TF32


def rel(x, ref):
    """(relative Frobenius error, mean signed error / mean |ref|)."""
    d = cp.asnumpy(x).astype(np.float64) - ref
    return (float(np.linalg.norm(d) / np.linalg.norm(ref)),
            float(np.mean(d * np.sign(ref)) / np.mean(np.abs(ref))))


def prod(a, b, compute, out=None, beta=0.0):
    out = cp.zeros((a.shape[0], b.shape[0]), cp.float32) if out is None else out
    B._cublas_gemm(a, b, out, False, True, 1.0, beta, compute)
    return out


def main() -> None:
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("| case | fp32 | tf32 | 3xtf32 | hi·hi TF32 | hi·hi fp32 | hi·hi chunks 32 | chunks 128 |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for m, k in [(512, 256), (512, 512), (256, 4096)]:
        rng = np.random.default_rng(1)
        for kind in ("Z Zᵀ", "random"):
            z = rng.standard_normal((m, k)).astype(np.float32)
            w = z if kind == "Z Zᵀ" else rng.standard_normal((m, k)).astype(np.float32)
            zd, wd = cp.asarray(z), cp.asarray(w)
            ref = z.astype(np.float64) @ w.astype(np.float64).T
            hi, _ = B.split_tf32(zd)
            whi, _ = B.split_tf32(wd)
            href = cp.asnumpy(hi).astype(np.float64) @ cp.asnumpy(whi).astype(np.float64).T
            res = [rel(prod(zd, wd, FP32), ref), rel(prod(zd, wd, TF32), ref)]
            with B.float32_precision("3xtf32"):
                o = cp.zeros((m, m), cp.float32)
                B.gemm(zd, wd, o, trans_b=True)
            res += [rel(o, ref), rel(prod(hi, whi, TF32), href), rel(prod(hi, whi, FP32), href)]
            for chunk in (32, 128):
                o = cp.zeros((m, m), cp.float32)
                for c0 in range(0, k, chunk):
                    prod(hi[:, c0:c0 + chunk], whi[:, c0:c0 + chunk], TF32, o, 1.0)
                res.append(rel(o, href))
            print(f"| k={k} {kind} | " + " | ".join(f"{e:.2e} ({b:+.1e})" for e, b in res) + " |")
    z = cp.asarray(np.random.default_rng(2).standard_normal((16384, 512)).astype(np.float32))
    out = cp.empty((16384, 16384), cp.float32)
    for mode in B.FLOAT32_PRECISIONS:
        with B.float32_precision(mode):
            for _ in range(3):
                B.gemm(z, z, out, trans_b=True)
            cp.cuda.Device().synchronize()
            t = time.perf_counter()
            for _ in range(10):
                B.gemm(z, z, out, trans_b=True)
            cp.cuda.Device().synchronize()
        print(f"{mode}: 16384 x 16384 x 512 in {(time.perf_counter() - t) / 10 * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
