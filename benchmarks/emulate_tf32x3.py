"""CPU emulation (NumPy, no GPU) of the TF32x3 tiles' products and LSE epilogue (issue 24), to
size tests/engine/test_tf32_tiles.py's bounds before the kernel ran on a GPU.

    python benchmarks/emulate_tf32x3.py

Model: x = hi + lo (hi = TF32 round-to-nearest-away, lo = x - hi read as its top 19 bits);
each wgmma k8 step adds its 8 products (exact) to the accumulator rounding toward zero
(Hopper's tensor cores, docs/decisions.md issue 24); the kernel's chunk of 32 of K runs 4 steps of
lo·hi, 4 of hi·lo, 4 of hi·hi into a zeroed chunk, added to the fp32 sum rounding to nearest;
cuBLAS's 3xTF32 is the same chain without the promotion; fp32 a sequential FMA chain.  The
epilogue: t = acc · fp32(s log2 e), per 128-column tile a max and a float32 sum of exp2.
Prints the relative errors (‖x − ref‖ / ‖ref‖ over the rows) against float64 of the positive
logits s q_i·k_i and of the row lse, unit rows with k_i = unit(q_i + 0.3 noise), s = 1/0.07.
"""
from __future__ import annotations

import numpy as np

SCALE = 1 / 0.07


def tf32_rna(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x1000) & ~np.uint64(0x1fff)).astype(np.uint32).view(np.float32)


def top19(x):
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xffffe000)).view(np.float32)


def rz32(x64):
    """float64 -> float32 rounding toward zero."""
    f = x64.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(x64)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f


def tf32x3(a, b, chunk=32):
    """a bᵀ the kernel's way (chunks of ``chunk`` K promoted); chunk=None:
    one chain (cuBLAS 3xTF32)."""
    ahi, bhi = tf32_rna(a), tf32_rna(b)
    A = (ahi.astype(np.float64), top19(a - ahi).astype(np.float64))
    B = (bhi.astype(np.float64), top19(b - bhi).astype(np.float64))
    d = a.shape[1]
    chunk = chunk or d
    main = np.zeros((a.shape[0], b.shape[0]), np.float32)
    for k0 in range(0, d, chunk):
        ch = np.zeros_like(main)
        for ia, ib in ((1, 0), (0, 1), (0, 0)):  # small terms first
            for s in range(k0, min(d, k0 + chunk), 8):
                ch = rz32(ch.astype(np.float64) + A[ia][:, s:s + 8] @ B[ib][:, s:s + 8].T)
        main = (main + ch).astype(np.float32)
    return main


def fp32_chain(a, b):
    s = np.zeros((a.shape[0], b.shape[0]), np.float32)
    for j in range(a.shape[1]):
        s = (s.astype(np.float64) + np.outer(a[:, j], b[:, j])).astype(np.float32)
    return s


def epilogue_lse(acc):
    sl2 = np.float32(np.float32(SCALE) * np.float32(1.4426950408889634))
    t = (acc * sl2).astype(np.float32)
    m = np.full(t.shape[0], -np.inf, np.float32)
    l = np.zeros(t.shape[0], np.float32)
    for c0 in range(0, t.shape[1], 128):
        tt = t[:, c0:c0 + 128]
        mn = np.maximum(m, tt.max(1))
        l = (l * np.exp2(m - mn)).astype(np.float32)
        for e in np.exp2(tt - mn[:, None]).astype(np.float32).T:
            l = (l + e).astype(np.float32)
        m = mn
    return (m * np.float32(0.6931471805599453) + np.log(l)).astype(np.float32)


def lse64(s):
    x = SCALE * s.astype(np.float64)
    mx = x.max(1)
    return mx + np.log(np.exp(x - mx[:, None]).sum(1))


def rel(x, ref):
    return float(np.linalg.norm(x.astype(np.float64) - ref) / np.linalg.norm(ref))


def unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def main() -> None:
    print("| D | positives: kernel | fp32 | cuBLAS 3xTF32 | lse: kernel (fp32 epilogue) "
          "| fp32 scores, float64 lse | fp32 scores, fp32 epilogue |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for d in (32, 72, 512):
        rng = np.random.default_rng(d)
        n, m = 256, 384
        q = unit(rng.standard_normal((n, d)))
        k = unit(rng.standard_normal((m, d)))
        k[:n] = unit(q + 0.3 * unit(rng.standard_normal((n, d))))
        q, k = q.astype(np.float32), k.astype(np.float32)
        ref = q.astype(np.float64) @ k.astype(np.float64).T
        sk, sf, s3 = tf32x3(q, k), fp32_chain(q, k), tf32x3(q, k, None)
        rows = np.arange(n)
        s32 = np.float32(SCALE)

        def pos(s):
            return rel((s[rows, rows] * s32).astype(np.float32), SCALE * ref[rows, rows])

        lref = lse64(ref)
        print(f"| {d} | {pos(sk):.2e} | {pos(sf):.2e} | {pos(s3):.2e} | "
              f"{rel(epilogue_lse(sk), lref):.2e} | {rel(lse64(sf), lref):.2e} | "
              f"{rel(epilogue_lse(sf), lref):.2e} |")


if __name__ == "__main__":
    main()
