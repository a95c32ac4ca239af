"""Mean signed and norm-wise error of the TF32x3 tiles' product (``_engine.gemm.tf32x3.mm``,
with its truncation compensation ``CPN_TF32X3_TRUNC``), of the F16x3 prototype's
(``_engine.gemm.f16x3.mm``, with ``CPN_F16X3_TRUNC``, ``cupynce.config``'s ``f16x3_trunc``)
and of cuBLAS fp32 against float64, on a Hopper GPU (issue 24; docs/results.md, "the
truncation compensation"):

    python benchmarks/tf32x3_bias.py

Data: unit rows with zero-mean entries (D = 64, 512), all-positive unit rows (D = 128),
pairs b = a + 0.3 noise (D = 256), and a softmax-like block (probabilities minus one-hot,
K = 4096) times unit columns.  "bias": the mean of (x - ref) sign(ref) over the outputs,
relative to their mean |ref|; "rms": ‖x - ref‖ / ‖ref‖.
"""
import numpy as np
import cupy as cp

from cupynce import config
from cupynce._engine.gemm import cublas, f16x3, tf32x3


def case(rng, kind, d, n=2048):
    if kind == "softmax-like":
        k = 4096
        lg = rng.standard_normal((n, k)) * 3
        p = np.exp(lg - lg.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(n), np.arange(n)] -= 1
        b = rng.standard_normal((d, k))
        b /= np.linalg.norm(b, axis=0, keepdims=True)
        return p.astype(np.float32), b.astype(np.float32)
    a, b = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    if kind == "positive":
        a, b = np.abs(a), np.abs(b)
    if kind == "pairs":
        b = a + 0.3 * b
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    return a.astype(np.float32), b.astype(np.float32)


def main():
    rng = np.random.default_rng(1)
    for kind, d in (("zero-mean", 64), ("zero-mean", 512), ("positive", 128), ("pairs", 256),
                    ("softmax-like", 64), ("softmax-like", 512)):
        a, b = case(rng, kind, d)
        ref = a.astype(np.float64) @ b.astype(np.float64).T
        ad, bd = cp.asarray(a), cp.asarray(b)
        tiles = tf32x3.mm(ad, tf32x3.split(bd), cp.empty(ref.shape, np.float32))
        ah, al, ia = f16x3.split_rows(ad)
        bh, bl, ib = f16x3.split_rows(bd)
        with config.override(f16x3_trunc=0.0):  # (uncompensated: the loss itself)
            f16_raw = f16x3.mm((ah, al), (bh, bl), cp.empty(ref.shape, np.float32),
                               rowf=ia, colf=ib)
        f16 = f16x3.mm((ah, al), (bh, bl), cp.empty(ref.shape, np.float32), rowf=ia,
                       colf=ib)
        fp32 = cp.empty(ref.shape, np.float32)
        with config.float32_precision("fp32"):
            cublas.gemm(ad, bd, fp32, trans_b=True)

        def err(x):
            e = cp.asnumpy(x).astype(np.float64) - ref
            return (f"bias {np.mean(e * np.sign(ref)) / np.mean(np.abs(ref)):+.2e} "
                    f"rms {np.linalg.norm(e) / np.linalg.norm(ref):.2e}")
        print(f"{kind:12s} d={d:3d} K={a.shape[1]:4d}: tiles {err(tiles)} | f16x3 {err(f16)} "
              f"(uncompensated {err(f16_raw)}) | cuBLAS fp32 {err(fp32)}", flush=True)


if __name__ == "__main__":
    main()
