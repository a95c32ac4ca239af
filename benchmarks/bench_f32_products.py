"""How accurate cupynce's float32 product modes are, and why (issue 24): each mode's error
against float64 for Z·Zᵀ (positive diagonal) and a random A·Bᵀ, with the mean signed error
(a bias shows there), the hi·hi product alone on the tensor cores and through fp32, and hi·hi
in K-chunks summed with round-to-nearest between chunks (what a kernel promoting its
accumulator every ``chunk`` K elements would get), and an Ozaki-style product of bfloat16
slices (exact partial products: ``slices_bf16``).  Then each mode's time for one
16384 x 16384 x 512 product (median of CUDA-event spans, ``report.harness.time_cuda``).
On Hopper the tensor cores round the accumulator toward zero at every MMA step: 3xtf32's
error is hi·hi's, a bias, ~3-13x fp32's (docs/decisions.md).

    python benchmarks/bench_f32_products.py
"""
import cupy as cp
import numpy as np

from cupynce import config
from cupynce._engine.gemm import cublas as B
from cupynce.report.harness import time_cuda

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


def slices_bf16(x, count: int = 3, bits: int = 8):
    """Ozaki-style split of the float32 rows of ``x`` into ``count`` bfloat16 slices with one
    scale per row: slice s holds integers |v| <= 2^(bits-1) times 2^(e - (bits - 1) - bits s)
    (2^e >= the row's max |x|), so every product of two slices' entries is an integer of at most
    2(bits - 1) bits in one unit per (row, row) pair, and a sum of K of them is exact in fp32
    while 2^(2 bits - 2) K <= 2^24 (K <= 1024 for 8 bits): the tensor cores' truncation has no
    bits to drop."""
    import ml_dtypes

    x64 = cp.asnumpy(x).astype(np.float64)  # (on the host: a measurement, not the kernel)
    amax = np.maximum(np.abs(x64).max(axis=1, keepdims=True), 1e-300)
    scale = 2.0 ** (np.ceil(np.log2(amax)) - (bits - 1))
    out, r = [], x64
    for _ in range(count):
        v = np.rint(r / scale)
        out.append(cp.asarray((v * scale).astype(np.float32).astype(ml_dtypes.bfloat16)))
        r = r - v * scale
        scale = scale / 2.0 ** bits
    return out


def ozaki(a, b, count: int, limit: int, bits: int = 8):
    """a·bᵀ from bf16 slice products through cuBLAS (fp32 out, each exact), the slice pairs
    (s, t) with s + t <= ``limit`` (0-based), small terms first; (out, products issued).
    CPU emulation (2026-11-26, K = 256 / 512, Gaussian rows): 3 slices x 6 pairs 5.2e-7,
    3 x 9 2.1e-7 (fp32: 2.9e-7), 4 slices x 10 pairs 2.3e-9."""
    sa, sb = slices_bf16(a, count, bits), slices_bf16(b, count, bits)
    out = cp.zeros((a.shape[0], b.shape[0]), cp.float32)
    pairs = sorted(((s, t) for s in range(count) for t in range(count) if s + t <= limit),
                   key=lambda p: -(p[0] + p[1]))
    for s, t in pairs:
        B._cublas_gemm(sa[s], sb[t], out, False, True, 1.0, 1.0, FP32)
    return out, len(pairs)


def main() -> None:
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("| case | fp32 | tf32 | 3xtf32 | hi·hi TF32 | hi·hi fp32 | hi·hi chunks 32 | chunks 128 "
          "| bf16 3 slices, 9 products | 4 slices, 10 products |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
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
            with config.float32_precision("3xtf32"):
                o = cp.zeros((m, m), cp.float32)
                B.gemm(zd, wd, o, trans_b=True)
            res += [rel(o, ref), rel(prod(hi, whi, TF32), href), rel(prod(hi, whi, FP32), href)]
            for chunk in (32, 128):
                o = cp.zeros((m, m), cp.float32)
                for c0 in range(0, k, chunk):
                    prod(hi[:, c0:c0 + chunk], whi[:, c0:c0 + chunk], TF32, o, 1.0)
                res.append(rel(o, href))
            res.append(rel(ozaki(zd, wd, 3, 4)[0], ref))
            res.append(rel(ozaki(zd, wd, 4, 3)[0], ref))
            print(f"| k={k} {kind} | " + " | ".join(f"{e:.2e} ({b:+.1e})" for e, b in res) + " |")
    z = cp.asarray(np.random.default_rng(2).standard_normal((16384, 512)).astype(np.float32))
    out = cp.empty((16384, 16384), cp.float32)
    for mode in config.FLOAT32_PRECISIONS:
        with config.float32_precision(mode):
            ms = time_cuda(lambda: B.gemm(z, z, out, trans_b=True))["median_ms"]
        print(f"{mode}: 16384 x 16384 x 512 in {ms:.3f} ms")
    sa = slices_bf16(z)
    ms = time_cuda(lambda: B._cublas_gemm(sa[0], sa[0], out, False, True, 1.0, 0.0, FP32))
    print(f"one bf16 slice product: {ms['median_ms']:.3f} ms (x 9 or 10 for a slices' product, "
          "the split not counted)")

if __name__ == "__main__":
    main()
