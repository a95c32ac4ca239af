"""cuBLAS: H Z as one product vs the 2x2 quadrant split (three products) at N = 8192, 16384."""
import numpy as np, cupy as cp, sys
from cupynce._engine import blas
import cupyx
from cupynce._engine.kernels import BFLOAT16 as bf
for dt in (bf, np.dtype(np.float16)):
  for n in (8192, 16384):
    d = 512; hs = ((n // 128 + 1) // 2) * 128
    H = (cp.random.standard_normal((n, n), dtype=cp.float32) * 0.01).view(cp.uint32).__rshift__(16).astype(cp.uint16).view(dt) if dt == bf else cp.random.standard_normal((n, n), dtype=cp.float32).astype(dt)
    Z = (cp.random.standard_normal((n, d), dtype=cp.float32)).view(cp.uint32).__rshift__(16).astype(cp.uint16).view(dt) if dt == bf else cp.random.standard_normal((n, d), dtype=cp.float32).astype(dt)
    out = cp.empty((n, d), cp.float32)
    s2 = cp.cuda.Stream(non_blocking=True)
    def one(): blas.gemm(H, Z, out)
    def three():
        blas.gemm(H[:hs], Z, out[:hs])
        blas.gemm(H[hs:, hs:], Z[hs:], out[hs:])
        blas.gemm(H[:hs, hs:], Z[:hs], out[hs:], trans_a=True, beta=1.0)
    def three_b():
        blas.gemm(H[:hs, hs:], Z[:hs], out[hs:], trans_a=True)
        blas.gemm(H[hs:, hs:], Z[hs:], out[hs:], beta=1.0)
        blas.gemm(H[:hs], Z, out[:hs])
    def conc():
        cur = cp.cuda.get_current_stream()
        e = cur.record(); s2.wait_event(e)
        with s2:
            blas.gemm(H[:hs, hs:], Z[:hs], out[hs:], trans_a=True)
            blas.gemm(H[hs:, hs:], Z[hs:], out[hs:], beta=1.0)
        blas.gemm(H[:hs], Z, out[:hs])
        cur.wait_event(s2.record())
    fs = dict(one=one, three=three, three_b=three_b, conc=conc)
    ts = {k: [] for k in fs}
    for f in fs.values():
        for _ in range(3): f()
    cp.cuda.Device().synchronize()
    for r in range(25):
        for k, f in fs.items():
            a, b = cp.cuda.Event(), cp.cuda.Event()
            cp.cuda.Device().synchronize()
            a.record(); f(); b.record(); b.synchronize()
            ts[k].append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    ref = out.copy(); one(); r1 = out.copy(); three(); r3 = out.copy()
    print(dt, n, hs, {k: f"{np.median(v):.1f} ({np.percentile(v,20):.1f}-{np.percentile(v,80):.1f})" for k, v in ts.items()},
          "maxdiff one vs three", float(cp.abs(r1 - r3).max()), "scale", float(cp.abs(r1).max()))
    del H, Z, out
