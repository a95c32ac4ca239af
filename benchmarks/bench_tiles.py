"""Throughput of each tensor-core tile kernel (kernels_src/tiles.cu) against the cuBLAS
product of the same shape: where the fused path stands relative to the library GEMM.

    python benchmarks/bench_tiles.py --n 16384 --d 512 [--loops wstile,wgmma,mma.sync]
        [--burst 10]

Main loops: "wstile" (Hopper's warp-specialised kernels, tiles_ws.cu, for the stages they
have), "wgmma" (the cp.async wgmma loop), "mma.sync"; by default those built here.  Each
time is the median over 10 repeats of ``--burst`` calls back to back between two events,
per call: the kernels' own time, the host's hidden behind the queue (``--burst 1``: an
isolated call, the host's time before its kernels included; ±8 % between runs on one H100
at N = 16384).
TFLOP/s counts the square's 2 N² D for every case: the symmetric / mirrored passes do half
of it (their rate is the square-equivalent one).
"""
from __future__ import annotations

import argparse

import numpy as np

from cupynce import config
from cupynce._engine import kernels
from cupynce._engine.gemm import cublas
from cupynce._engine.losses import score_tiles as C
from cupynce._engine.losses.stats import FAR_MOD
from cupynce._engine.tiling import TILE, grid_splits
from cupynce.report.harness import device_header, device_info, time_cuda


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--loops", default=None, help="comma-separated: wstile, wgmma, mma.sync")
    ap.add_argument("--burst", type=int, default=10, help="calls back to back per timed span")
    args = ap.parse_args()
    import cupy as cp
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(np.float16)
    n, d = args.n, args.d
    rng = cp.random.default_rng(0)
    q = (rng.standard_normal((n, d), dtype=cp.float32) / np.sqrt(d)).astype(dt)
    k = (rng.standard_normal((n, d), dtype=cp.float32) / np.sqrt(d)).astype(dt)
    s = cp.empty((n, n), cp.float32)
    g = cp.empty((n, n), dt)
    lse = C.tile_lse(q, k, None, 10.0, exclude_diag=False, pos_shift=0, pos_mod=n)[0]
    w = (None, 0, 1.0 / n)
    rt = -(-n // TILE)
    sp = grid_splits(rt, rt)
    flop = 2.0 * n * n * d
    ls = cp.full((1,), np.log(10.0), cp.float32)
    lb = cp.full((1,), -10.0, cp.float32)
    part = cp.empty((2, sp, n), cp.float32)
    pos = cp.empty((n,), cp.float32)
    colp = cp.empty((2, rt, n), cp.float32)
    dpart = cp.empty((sp, n), cp.float32)
    dots = (q.astype(cp.float32) * k.astype(cp.float32)).sum(1)  # lse2's column shifts
    cases = {
        "cuBLAS S = Q K^T (fp32 out)": lambda: cublas.gemm(q, k, s, trans_b=True),
        "cuBLAS G K (16-bit G)": lambda: cublas.gemm(g, k, s[:, :d]),
        "tile_lse (+finish)": lambda: C.tile_lse(q, k, None, 10.0, exclude_diag=False,
                                                  pos_shift=0, pos_mod=n),
        "tile_lse symmetric (NT-Xent, +dots, finish)": lambda: C.tile_lse_symmetric(
            q, 10.0, n // 2, None),
        "tile_g": lambda: C.tile("g", dt, (rt, sp), q, 0, k, None, scale=10.0, pos_mod=n,
                                  lse_row=lse, lse_col=lse, weights=w, g=g),
        "tile_h": lambda: C.tile("h", dt, (rt, sp), q, 0, q, None, scale=10.0, pos_mod=n,
                                  lse_row=lse, lse_col=lse, weights=w, g=g),
        "tile_h tri (mirrored, half the tiles)": lambda: C.tile(
            "h", dt, (rt, grid_splits(rt, rt // 2 + 1)), q, 0, q, None, scale=10.0,
            pos_mod=n, lse_row=lse, lse_col=lse, weights=w, g=g, tri=True),
        "tile_lse2 (CLIP rows + columns)": lambda: C.tile(
            "lse2", dt, (rt, sp), q, 0, k, None, scale_log=ls, pos_mod=n,
            part=(part.data.ptr, part[1].data.ptr, n), pos_out=pos.data.ptr,
            colp=(colp.data.ptr, colp[1].data.ptr), lse_col=dots),
        "tile_clip": lambda: C.tile("clip", dt, (rt, sp), q, 0, k, None, scale_log=ls,
                                     pos_mod=n, lse_row=lse, lse_col=lse, weights=w, g=g,
                                     dsp=dpart.data.ptr, part=(0, 0, n)),
        "tile_siglip (loss, dbias, dscale, G)": lambda: C.tile(
            "siglip", dt, (rt, sp), q, 0, k, None, scale_log=ls, pos_mod=FAR_MOD,
            part=(part.data.ptr, part[1].data.ptr, n), lse_col=lb, weights=w, g=g,
            dsp=dpart.data.ptr),
    }
    print(device_header(device_info()))
    print(f"N={n} D={d} {args.dtype}; splits={sp}; {args.burst} calls a timed span")
    hopper = kernels.arch_specific_build(C.FILE)
    loops = ["wstile", "wgmma", "mma.sync"] if hopper else ["mma.sync"]
    if args.loops:
        loops = [x for x in args.loops.split(",") if x in loops]
    for loop in loops:
        config.set(wgmma=loop != "mma.sync", ws_tiles=loop == "wstile")
        for name, fn in cases.items():
            if name.startswith("cuBLAS") and loop != loops[0]:
                continue
            t = time_cuda(fn, warmup=3, repeat=10, burst=args.burst)["median_ms"]
            label = name if name.startswith("cuBLAS") else f"{name} [{loop}]"
            print(f"  {label:40s} {t:8.3f} ms  {flop / t / 1e9:7.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
