import sys, numpy as np, cupy as cp, cupynce
from cupynce import contrastive as C, splade as S, _blas
from cupynce._harness import time_cuda
from cupynce._kernels import BFLOAT16
b, l, d, v = map(int, sys.argv[1:5])
rs = cp.random.RandomState(0)
x = rs.standard_normal((b, l, d), dtype=cp.float32).astype(BFLOAT16)
w = (rs.standard_normal((v, d), dtype=cp.float32) / np.sqrt(d)).astype(BFLOAT16)
mask = cp.ones((b, l), bool)
calls = []
orig = _blas.gemm
def counting(*a, **k):
    calls.append(1); return orig(*a, **k)
S._blas.gemm = counting
for tiles in (None, True, False):
    for wg in (True, False):
        if tiles is False and not wg: continue
        C.USE_TILES, C.USE_WGMMA = tiles, wg
        calls.clear()
        S.splade_pool_forward(x, w, None, mask)
        t = time_cuda(lambda: S.splade_pool_forward(x, w, None, mask), warmup=2, repeat=7)["median_ms"]
        print(f"tiles={tiles} wgmma={wg} gemm calls={len(calls)} fwd {t:.3f} ms  {2*b*l*d*v/t/1e9:.0f} TFLOP/s", flush=True)
