"""NT-Xent in float32 on the TF32x3 tiles (issue 24, ``_engine.losses.nt_xent_tf32.nt_xent``:
the lse2 / lse pass keeping the scores, H from them elementwise -- or the h pass, recomputing
them --, dz = H z on the promoted TF32x3 product tiles, ``_engine.gemm.tf32x3.mm``, A split in
shared memory) against the op under each float32 ``precision`` ("auto" = these tiles through
the op, mean loss and the recompute backward of reduction="none"; "fp32" / "tf32" through the
cuBLAS row blocks) and PyTorch eager:
time of forward + backward and the errors of lse and dz against a float64 reference.

    python benchmarks/bench_tf32_nt_xent.py [--n 8192,16384] [--d 512] [--repeat 10]

Inputs: unit rows, positives z_{i + n/2} = unit(z_i + 0.3 noise), temperature 0.07, mean
loss, no normalisation inside the op.  Per pass (median ms, CUDA events): the split, the
statistics pass, the H pass, the product, for the tiles.  Medians of CUDA-event times
(``cupynce.report.harness.time_cuda``), one run, one GPU; peak memory above the inputs.
"""
from __future__ import annotations

import argparse

import cupynce
from cupynce._engine.gemm import tf32x3
from cupynce._engine.losses import nt_xent_tf32
from cupynce.report.harness import device_header, device_info, time_cuda

T = 0.07


def _inputs(cp, n, d, seed=0):
    rng = cp.random.default_rng(seed)

    def unit(x):
        return x / cp.linalg.norm(x, axis=1, keepdims=True)

    z = unit(rng.standard_normal((n, d), dtype=cp.float64))
    h = n // 2
    z[h:] = unit(z[:h] + 0.3 * unit(rng.standard_normal((h, d), dtype=cp.float64)))
    return z.astype(cp.float32)


def _reference(cp, z, block=2048):
    """float64 (lse, dz) on the GPU, in row blocks (dz = s (dS + dSᵀ) z, dS = (P - E) / n)."""
    n = z.shape[0]
    s = 1 / T
    z64 = z.astype(cp.float64)
    lse = cp.empty((n,), cp.float64)
    dz = cp.zeros_like(z64)
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        lg = s * (z64[r0:r1] @ z64.T)
        idx = cp.arange(r0, r1)
        lg[idx - r0, idx] = -cp.inf
        mx = lg.max(1)
        lse[r0:r1] = mx + cp.log(cp.exp(lg - mx[:, None]).sum(1))
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        idx = cp.arange(r0, r1)
        lg = s * (z64[r0:r1] @ z64.T)
        p = cp.exp(lg - lse[r0:r1, None])
        p[idx - r0, idx] = 0
        p[idx - r0, (idx + n // 2) % n] -= 1
        p /= n
        dz[r0:r1] += s * (p @ z64)      # dS z
        dz += s * (p.T @ z64[r0:r1])    # dSᵀ z
    return lse, dz


def _rel(cp, x, ref):
    return float(cp.linalg.norm((x.astype(cp.float64) - ref).ravel())
                 / cp.linalg.norm(ref.ravel()))


def main(argv=None):
    import cupy as cp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="8192,16384")
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--torch", action="store_true", help="PyTorch eager float32 beside")
    args = p.parse_args(argv)
    print(device_header(device_info()))
    for n in [int(x) for x in args.n.split(",")]:
        z = _inputs(cp, n, args.d)
        ref_lse, ref_dz = _reference(cp, z)
        w = (None, 0, 1.0 / n)
        rows = []

        def tiles_call(sym):
            def f():
                return nt_xent_tf32.nt_xent(z, 1 / T, w, symmetric=sym)
            return f

        def core_call(prec, fused=True):
            def f():
                if fused:  # the mean loss: the gradient in the forward's pass
                    loss, ctx = cupynce.nt_xent_forward(z, T, precision=prec)
                    return ctx.stats[0], loss, cupynce.nt_xent_backward(ctx)
                loss, ctx = cupynce.nt_xent_forward(z, T, reduction="none", requires_grad=True,
                                                    precision=prec)
                dz = cupynce.nt_xent_backward(ctx, cp.full((n,), 1.0 / n, cp.float32))
                return ctx.stats[0], loss, dz
            return f

        cases = [("tf32x3 tiles, symmetric", tiles_call(True)),
                 ("tf32x3 tiles, square lse", tiles_call(False))]
        cases += [("op, precision auto (tiles), mean", core_call("auto")),
                  ("op, precision auto (tiles), none + recompute backward",
                   core_call("auto", False))]
        cases += [(f"op, cuBLAS {pr}, mean", core_call(pr)) for pr in ("fp32", "tf32")]
        for name, f in cases:
            lse, _, dz = f()
            e_l, e_d = _rel(cp, lse, ref_lse), _rel(cp, dz, ref_dz)
            del lse, dz
            cp.get_default_memory_pool().free_all_blocks()
            base = cp.get_default_memory_pool().used_bytes()
            cp.cuda.Device().synchronize()
            ms = time_cuda(f, repeat=args.repeat)["median_ms"]
            peak = cp.get_default_memory_pool().total_bytes() - base
            rows.append((name, ms, e_l, e_d, peak / 2 ** 20))
        # the passes of the symmetric tiles
        parts = tf32x3.split(z)
        _, _, ml = nt_xent_tf32.lse_symmetric(z, parts, 1 / T, n // 2)
        h = nt_xent_tf32.h_block(parts, ml, 1 / T, n // 2, w)
        hb = cp.empty((n, -(-n // 4) * 4), cp.float32)
        zt = tf32x3.split(cp.ascontiguousarray(z.T))
        dz = cp.empty_like(z)
        passes = [("split z and zᵀ", lambda: (tf32x3.split(z),
                                            tf32x3.split(cp.ascontiguousarray(z.T)))),
                  ("lse2 (symmetric) + finish",
                   lambda: nt_xent_tf32.lse_symmetric(z, parts, 1 / T, n // 2)),
                  ("lse2 keeping the scores + finish",
                   lambda: nt_xent_tf32.lse_symmetric(z, parts, 1 / T, n // 2, s_out=hb[:, :n])),
                  ("H from the kept scores (elementwise)",
                   lambda: nt_xent_tf32.h_from_s(hb[:, :n], ml, 1 / T, n // 2, w)),
                  ("h pass (mirrored tiles, recompute backward)",
                   lambda: nt_xent_tf32.h_block(parts, ml, 1 / T, n // 2, w, out=hb)),
                  ("mm dz = H z", lambda: tf32x3.mm(h, zt, dz))]
        tflop = 2 * n * n * args.d / 1e12
        print(f"\nN={n} D={args.d} float32, t = {T}, forward + backward "
              f"(TFLOP/s of a pass = one N x N x D product's 2 N^2 D over its time)")
        print("| case | median ms | lse error | dz error | peak MiB |\n|---|--:|--:|--:|--:|")
        for name, ms, e_l, e_d, mib in rows:
            print(f"| {name} | {ms:.3f} | {e_l:.2e} | {e_d:.2e} | {mib:.0f} |")
        print("\n| pass (tf32x3 tiles) | median ms | TFLOP/s (2 N^2 D) |\n|---|--:|--:|")
        for name, f in passes:
            ms = time_cuda(f, repeat=args.repeat)["median_ms"]
            print(f"| {name} | {ms:.3f} | {tflop / (ms / 1e3):.0f} |")
        if args.torch:
            import torch

            zt_ = torch.as_tensor(z, device="cuda").clone().requires_grad_(True)
            lab = (torch.arange(n, device="cuda") + n // 2) % n

            def eager():
                lg = zt_ @ zt_.T / T
                lg = lg.masked_fill(torch.eye(n, dtype=torch.bool, device="cuda"), float("-inf"))
                loss = torch.nn.functional.cross_entropy(lg, lab)
                (g,) = torch.autograd.grad(loss, zt_)
                return g
            torch.backends.cuda.matmul.allow_tf32 = False
            ms = time_cuda(eager, repeat=args.repeat)["median_ms"]
            print(f"\nPyTorch eager float32 (no TF32): {ms:.3f} ms")


if __name__ == "__main__":
    main()
