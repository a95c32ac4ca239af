// Issue 23 prototype (scratch, not shipped): a warp-specialised ping-pong row log-sum-exp pass
// on Hopper (sm_90a), the MODE_LSE of kernels_src/tiles.cu without the positives / diagonal.
//
// For A (rows x d) and B (ncols x d), 16-bit, row-major, and sl2 = scale * log2(e), the CTA
// (blockIdx.x, split = blockIdx.y) owns rows m0 = 128 blockIdx.x .. m0 + 127 and the column
// tiles ct = split, split + splits, ... (as tiles.cu), and writes for each of its rows
//     part_m[split * part_ld + row] = ln(2) * max_j t_ij,   t_ij = sl2 * a_i . b_j
//     part_s[split * part_ld + row] = sum_j 2^(t_ij - max)
// over the columns of its tiles: the layout of cpn_wgtile_lse, so cpn_tile_finish combines.
//
// 384 threads:
//   * warpgroup 2 = producer (setmaxnreg.dec 40): thread 256 issues the TMA boxes of A
//     (128 x 64) and B (128 x 64) of each K step, 128-byte swizzled, into a ring of ST stages
//     of 32 KiB; a stage of column tile t signals full[t & 1][s] (the barriers of the
//     consumer that owns tile t).  The consumer releases it on empty[s] (count 1).
//   * warpgroups 0 / 1 = consumers (setmaxnreg.inc 232), each owning WHOLE 128 x 128 tiles:
//     consumer c takes the CTA's tiles t = c, c + 2, ...: two wgmma m64n128k16 per k16
//     (acc[2][64]: rows 0-63 and 64-127), then the online row max / sum-exp epilogue.
//   * PP (ping-pong): named barriers 3 + c order the consumers' MMA phases: consumer c waits
//     on bar 3 + c before its first MMA of a tile and, once the tile's last MMA batch is
//     issued, arrives on bar 3 + (c ^ 1) (only if the other consumer has a next tile, so
//     the arrivals and syncs match exactly); consumer 1 arrives on bar 3 once at the start
//     so consumer 0 goes first.  Its epilogue then overlaps the other consumer's MMAs.
//     PP = false: the consumers run free (a bisecting fallback); correctness does not depend
//     on the order barriers (per-consumer full barriers, see below).
//
// mbarrier phases: full[c][s] completes one phase per fill of stage s FOR consumer c, so
// consumer c tracks its own parity per stage (bit s of fph) -- with one full barrier per
// stage a consumer running ahead of the other could see the barrier one phase behind and pass
// on the wrong parity.  empty[s] completes one phase per use of stage s (fills of use u need
// the release of use u - 1, so releases come in order); the producer waits parity
// ((use) & 1) ^ 1 (a fresh barrier passes parity 1).
//
// AR (A resident, D <= 512 at 6 stages): the producer loads the CTA's KT A boxes once (one
// barrier, one phase) and the ring holds 16 KiB B boxes only: half the L2 reads per tile.
//
// Row merge: 4 lanes of a row (xor shuffles), then consumer 1's (m, l) into consumer 0's
// through shared memory (bar 5, 256 threads): fixed order, deterministic.
// Requirements (the harness checks): 16-bit A, B; d multiple of 8 (TMA strides), 16-byte
// aligned rows; TMA zero-fills rows / K past the ends; columns past ncols are masked in the
// last tile's epilogue (-inf); rows past `rows` are not written.
#include "common.cuh"
#include "wgmma.cuh"
// tile_loop.cuh: Wgmma<T> (m64n128k16), wg_* fences, lse2_merge, nanmax, CPN_LOG2E / CPN_LN2
#include "tile_loop.cuh"

#define WS_BM 128
#define WS_BN 128
#define WS_BK 64
#define WS_A_BYTES (WS_BM * WS_BK * 2)
#define WS_B_BYTES (WS_BN * WS_BK * 2)
#define WS_STAGE_BYTES (WS_A_BYTES + WS_B_BYTES)
#define WS_THREADS 384
#ifndef WS_PROD_REGS
#define WS_PROD_REGS 40
#endif
#ifndef WS_CONS_REGS
#define WS_CONS_REGS 232
#endif
#define WS_STR2(x) #x
#define WS_STR(x) WS_STR2(x)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void ws_arrive_if(unsigned bar, bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n"
                 "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n"
                 :: "r"(bar), "r"((int)pred) : "memory");
}
__device__ __forceinline__ void ws_bar_sync(int id) {
    asm volatile("bar.sync %0, 256;\n" :: "r"(id) : "memory");
}
__device__ __forceinline__ void ws_bar_arrive(int id) {
    asm volatile("bar.arrive %0, 256;\n" :: "r"(id) : "memory");
}

// one consumer's row update for its 128 x 128 tile: rows (i, h) of the thread are
// i * 64 + w * 16 + h * 8 + gq, columns j * 8 + 2 cq + e in acc[i][j * 4 + h * 2 + e].
// C: the tile reaches past ncols (those columns are -inf, NaN-aware max as tile_body's
// checked copy); else tile_body's unchecked copy (fmaxf; a NaN still reaches l).
template <bool C>
__device__ __forceinline__ void ws_lse_tile(const float (&acc)[2][64], float (&rm)[2][2],
                                            float (&rl)[2][2], float sl2, int n0, int ncols,
                                            int cq) {
    const float ninf = -cpn_inf<float>();
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v[32];
            float tm = ninf;
#pragma unroll
            for (int j = 0; j < 16; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float t = acc[i][j * 4 + h * 2 + e] * sl2;
                    if (C) {
                        if (n0 + j * 8 + 2 * cq + e >= ncols) t = ninf;
                        tm = nanmax(tm, t);
                    } else {
                        tm = fmaxf(tm, t);
                    }
                    v[j * 2 + e] = t;
                }
            float m = rm[i][h], l = rl[i][h];
            if (C) {
                if (tm != tm) { m = tm; l = tm; }
                else if (tm > m) { l *= exp2f(m - tm); m = tm; }
                if (m > ninf) {
#pragma unroll
                    for (int k = 0; k < 32; ++k) l += exp2f(v[k] - m);
                }
            } else {
                const float mn = fmaxf(m, tm);
                l *= exp2f(m - mn);
#pragma unroll
                for (int k = 0; k < 32; ++k) l += exp2f(v[k] - mn);
                m = mn;
            }
            rm[i][h] = m; rl[i][h] = l;
        }
}

template <typename T, bool PP, int ST, bool AR>
__device__ __forceinline__ void wstile_lse(const TmaMap& ta, const TmaMap& tb, int rows,
                                           int ncols, int d, float sl2,
                                           float* __restrict__ part_m,
                                           float* __restrict__ part_s, i64 part_ld) {
    extern __shared__ __align__(1024) unsigned char ws_smem_raw[];
    // full[c][s] at [c * ST + s], empty[s] at [2 ST + s]; AR: A's barrier at [3 ST]
    __shared__ __align__(8) unsigned long long bars[3 * ST + 1];
    __shared__ float slot[2][WS_BM];
    // ring stage: A box + B box, or (AR) the B box alone after the KT resident A boxes
    enum { SB = AR ? WS_B_BYTES : WS_STAGE_BYTES };

    const int tid = threadIdx.x;
    const int m0 = blockIdx.x * WS_BM;
    const int split = blockIdx.y, splits = gridDim.y;
    const int CT = (ncols + WS_BN - 1) / WS_BN;
    const int my_tiles = CT > split ? (CT - split + splits - 1) / splits : 0;
    const int KT = (d + WS_BK - 1) / WS_BK;
    const unsigned abase = (sw_smem(ws_smem_raw) + 1023u) & ~1023u;  // swizzle atoms: 1 KiB
    const unsigned base = AR ? abase + KT * WS_A_BYTES : abase;      // the ring
    const unsigned full0 = sw_smem(&bars[0]), empty0 = sw_smem(&bars[2 * ST]);
    const unsigned abar = sw_smem(&bars[3 * ST]);
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < ST; ++s) {
            mbar_init(full0 + 8 * s, 1);         // consumer 0's: the producer's expect_tx
            mbar_init(full0 + 8 * (ST + s), 1);  // consumer 1's
            mbar_init(empty0 + 8 * s, 1);        // the owning consumer warpgroup's release
        }
        mbar_init(abar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // (the last CTA-wide barrier: the producer warps exit early)

    if (tid >= 256) {  // ---------------- producer warpgroup ----------------
        asm volatile("setmaxnreg.dec.sync.aligned.u32 " WS_STR(WS_PROD_REGS) ";\n" ::: "memory");
        if (tid == 256) {
            if (AR && my_tiles > 0) {  // the CTA's 128 rows of A, once (one phase, parity 0)
                mbar_expect_tx(abar, KT * WS_A_BYTES);
                for (int kt = 0; kt < KT; ++kt)
                    tma_load(abase + kt * WS_A_BYTES, &ta, kt * WS_BK, m0, abar);
            }
            int s = 0;
            unsigned ph = 0;  // parity of the current use of stage s
            for (int t = 0; t < my_tiles; ++t) {
                const int n0 = (split + t * splits) * WS_BN;
                const unsigned fullc = full0 + 8 * ((t & 1) * ST);
                for (int kt = 0; kt < KT; ++kt) {
                    mbar_wait(empty0 + 8 * s, ph ^ 1);  // use u - 1 released (u = 0: passes)
                    const unsigned a = base + s * SB;
                    mbar_expect_tx(fullc + 8 * s, SB);
                    if (!AR) tma_load(a, &ta, kt * WS_BK, m0, fullc + 8 * s);
                    tma_load(AR ? a : a + WS_A_BYTES, &tb, kt * WS_BK, n0, fullc + 8 * s);
                    if (++s == ST) { s = 0; ph ^= 1; }
                }
            }
        }
    } else {  // ---------------- consumer warpgroups ----------------
        asm volatile("setmaxnreg.inc.sync.aligned.u32 " WS_STR(WS_CONS_REGS) ";\n" ::: "memory");
        const int c = tid >> 7;
        const int lane = tid & 31, w = (tid >> 5) & 3, gq = lane >> 2, cq = lane & 3;
        const float ninf = -cpn_inf<float>();
        const unsigned fullc = full0 + 8 * (c * ST);
        float rm[2][2], rl[2][2];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) { rm[i][h] = ninf; rl[i][h] = 0.f; }
        float acc[2][64];
        unsigned fph = 0;  // bit s: parity of this consumer's next use of stage s
        int s = 0;
        // K step kt on stage s (asynchronous); returns the stage, advances s
        auto step = [&](int kt, bool first) {
            mbar_wait(fullc + 8 * s, (fph >> s) & 1u);
            fph ^= 1u << s;
            const unsigned a = AR ? abase + kt * WS_A_BYTES : base + s * SB;
            const unsigned bb = AR ? base + s * SB : a + WS_A_BYTES;
            const unsigned long long da0 = wg_desc(a), da1 = wg_desc(a + 64 * 128),
                                     db = wg_desc(bb);
#pragma unroll
            for (int r = 0; r < 64; ++r) { fence_operand(acc[0][r]); fence_operand(acc[1][r]); }
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < WS_BK / 16; ++kk) {  // +32 B per k16 = +2 in the descriptor
                Wgmma<T>::run(acc[0], da0 + 2 * kk, db + 2 * kk, (first && kk == 0) ? 0 : 1);
                Wgmma<T>::run(acc[1], da1 + 2 * kk, db + 2 * kk, (first && kk == 0) ? 0 : 1);
            }
            wg_commit();
            const int cur = s;
            if (++s == ST) s = 0;
            return cur;
        };
        const unsigned release_pred = (tid & 127) == 0;  // one arrival per warpgroup
        if (AR && c < my_tiles) mbar_wait(abar, 0);  // A resident (completes once)
        if (PP && c == 1 && my_tiles > 0) ws_bar_arrive(3);  // consumer 0 goes first
        for (int t = c; t < my_tiles; t += 2) {
            s = (t * KT) % ST;  // this tile's first stage (iteration t KT of the ring)
            if (PP) ws_bar_sync(3 + c);  // my turn on the tensor cores
            // the first step peeled: no branch between the wgmma batches
            int prev = step(0, true);
            for (int kt = 1; kt < KT; ++kt) {
                const int cur = step(kt, false);
                wg_wait1();  // the previous step's MMAs are done reading its stage
                ws_arrive_if(empty0 + 8 * prev, release_pred);
                prev = cur;
            }
            if (PP && t + 1 < my_tiles) ws_bar_arrive(3 + (c ^ 1));  // the other's turn
            wg_wait0();
#pragma unroll
            for (int r = 0; r < 64; ++r) { fence_operand(acc[0][r]); fence_operand(acc[1][r]); }
            ws_arrive_if(empty0 + 8 * prev, release_pred);
            const int n0 = (split + t * splits) * WS_BN;
            if (n0 + WS_BN > ncols) ws_lse_tile<true>(acc, rm, rl, sl2, n0, ncols, cq);
            else ws_lse_tile<false>(acc, rm, rl, sl2, n0, ncols, cq);
        }
        // merge the 4 lanes of a row (fixed xor order), then consumer 1 into consumer 0
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int o = 1; o < 4; o <<= 1) {
                    const float om = __shfl_xor_sync(0xffffffffu, rm[i][h], o);
                    const float ol = __shfl_xor_sync(0xffffffffu, rl[i][h], o);
                    lse2_merge(rm[i][h], rl[i][h], om, ol);
                }
        if (c == 1 && cq == 0) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = i * 64 + w * 16 + h * 8 + gq;
                    slot[0][r] = rm[i][h];
                    slot[1][r] = rl[i][h];
                }
        }
        ws_bar_sync(5);  // both consumers (256 threads)
        if (c == 0 && cq == 0) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = i * 64 + w * 16 + h * 8 + gq;
                    float m = rm[i][h], l = rl[i][h];
                    lse2_merge(m, l, slot[0][r], slot[1][r]);
                    if (m0 + r < rows) {
                        const i64 o = (i64)split * part_ld + m0 + r;
                        part_m[o] = m * CPN_LN2;
                        part_s[o] = l;
                    }
                }
        }
    }
}
#define WS_BODY(T, PP, ST, AR) wstile_lse<T, PP, ST, AR>(ta, tb, rows, ncols, d, sl2, part_m, part_s, part_ld)
#else
#define WS_BODY(T, PP, ST, AR) __trap()  // not an sm_90a build
#endif

// grid (ceil(rows / 128), splits), 384 threads, dynamic shared memory: ST x 32 KiB + 1 KiB;
// AR (A resident): (KT + ST) x 16 KiB + 1 KiB, KT = ceil(d / 64) (D <= 512 at ST = 6)
#define WS_ARGS                                                                            \
    const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tb, int rows,        \
    int ncols, int d, float sl2, float* part_m, float* part_s, i64 part_ld
#define WS_DEFINE(NAME, T, PP, ST, AR)                                                     \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) NAME(WS_ARGS) { WS_BODY(T, PP, ST, AR); }

WS_DEFINE(cpn_wstile_lse_pp_s6_bf16, bf16_t, true, 6, false)
WS_DEFINE(cpn_wstile_lse_free_s6_bf16, bf16_t, false, 6, false)
WS_DEFINE(cpn_wstile_lse_pp_s6_f16, f16_t, true, 6, false)
WS_DEFINE(cpn_wstile_lse_free_s6_f16, f16_t, false, 6, false)
WS_DEFINE(cpn_wstile_lse_pp_s4_bf16, bf16_t, true, 4, false)
WS_DEFINE(cpn_wstile_lse_pp_s7_bf16, bf16_t, true, 7, false)
// A resident: the CTA's 128 x D rows of A loaded once; the ring holds B alone (L2 reads per
// tile halved: 128 FLOP per byte instead of 64)
WS_DEFINE(cpn_wstile_lse_pp_ar6_bf16, bf16_t, true, 6, true)
WS_DEFINE(cpn_wstile_lse_free_ar6_bf16, bf16_t, false, 6, true)
