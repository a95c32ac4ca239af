"""Probe: tf32x3.mm's time against the output block's shape.

Ran as ``benchmarks/probe_mm_stride.py`` from the repository root (its sys.path line is that
location's); kept beside its log as the experiment behind docs/results.md's numbers."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402

from cupynce._engine.gemm import tf32x3, cublas  # noqa: E402
from cupynce import config  # noqa: E402

K = 384


def t(fn, rep=5):
    fn(); cp.cuda.runtime.deviceSynchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(rep):
        s.record(); fn(); e.record(); e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e))
    ts.sort()
    return ts[len(ts) // 2]


rs = cp.random.RandomState(0)
B = rs.standard_normal((262144, K), dtype=cp.float32)
parts_full = tf32x3.split(B)
big = cp.empty((1 << 30,), cp.float32)  # 4 GiB
for m, c, ld in [(1024, 262144, 262144), (4096, 65536, 65536), (2048, 131072, 131072),
                 (1024, 65536, 65536), (1024, 65536, 262144), (4096, 65536, 262144 // 4 * 4),
                 (16384, 16384, 16384), (512, 262144, 262144), (8192, 32768, 32768),
                 (1024, 32768, 262144), (1024, 131072, 262144)]:
    a = rs.standard_normal((m, K), dtype=cp.float32)
    parts = tuple(p[:c] for p in parts_full)
    out = big[: m * ld].reshape(m, ld)[:, :c]
    ms = t(lambda: tf32x3.mm(a, parts, out))
    fl = 2 * m * c * K * 3
    # cuBLAS TF32 alone, same shapes (one product)
    with config.float32_precision("tf32"):
        ms_cb = t(lambda: cublas.gemm(a, B[:c], out, trans_b=True))
    fill = t(lambda: out.fill(1.0))
    print(f"m={m:6d} c={c:7d} ld={ld:7d}: tf32x3 {ms:8.3f} ms {fl / ms / 1e9:6.1f} TF(3 prod) | "
          f"cublas tf32 {ms_cb:7.3f} ms {fl / 3 / ms_cb / 1e9:6.1f} TF | fill {fill:6.3f} ms",
          flush=True)

# (a) sustained: 300 launches back to back, each timed
a = rs.standard_normal((1024, K), dtype=cp.float32)
out = big[: 1024 * 262144].reshape(1024, 262144)
evs = [cp.cuda.Event() for _ in range(301)]
evs[0].record()
for i in range(300):
    tf32x3.mm(a, parts_full, out)
    evs[i + 1].record()
evs[-1].synchronize()
d = [cp.cuda.get_elapsed_time(evs[i], evs[i + 1]) for i in range(300)]
print("sustained mm (1024, 262144): first", [round(x, 2) for x in d[:5]], "last",
      [round(x, 2) for x in d[-5:]], "median", sorted(d)[150], flush=True)
del big, out

# (b) the loss share itself: each mm_tf32x3 launch's duration through one step
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_distributed as bd  # noqa: E402
bd.DTYPE = "float32"
from torch.profiler import ProfilerActivity, profile  # noqa: E402
for N in (65536, 262144):
    fn = bd.cupynce_rank("info_nce", 2, N, 384)
    fn(); cp.cuda.runtime.deviceSynchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(); cp.cuda.runtime.deviceSynchronize()
    ks = [e for e in prof.events() if e.device_type.name == "CUDA"]
    ks.sort(key=lambda e: e.time_range.start)
    for name in ("cpn_wstile_mm_tf32x3", "cpn_row_softmax_f32", "cpn_wstile_mmt_tf32x3",
                 "cpn_wstile_mm_f16x3"):
        dd = [e.time_range.elapsed_us() / 1e3 for e in ks if e.name == name]
        if dd:
            print(N, name, len(dd), "first", [round(x, 2) for x in dd[:4]], "last",
                  [round(x, 2) for x in dd[-4:]], "median", round(sorted(dd)[len(dd) // 2], 3),
                  flush=True)
    order = [e.name[:22] for e in ks[:40]]
    print(N, "first kernels:", order, flush=True)
    del fn
