// cupynce fused score tiles of float32 operands on Hopper's tensor cores (issue 24):
// tile_ws.cuh's warp-specialised walk (TMA producer warpgroup, two consumer warpgroups that
// ping-pong whole 128 x 128 tiles, tile_epilogue.cuh's epilogues) over split operands
// x = hi + lo (hi = x rounded to TF32, lo = x - hi exactly: blas.split_tf32), three TF32
// products S = lo_a hi_b + hi_a lo_b + hi_a hi_b (lo lo, ~2^-22 relative, dropped), with the
// accumulator promoted every 32 of K so that the scores are as accurate as fp32's or better.
// Modes LSE, LSE2 (NT-Xent's symmetric forward), H (NT-Xent's gradient block) and MM (a
// product; mmt: of a transposed A); tiles_tf32.py launches them for float32 NT-Xent and
// products_tf32.py for the other ops' products (precisions "auto" / "3xtf32").  Built for
// sm_90a only (__trap() elsewhere).
//
//   cpn_wstile_<mode>_tf32x3(L), L = WsTf32Launch {ahi, alo, bhi, blo, p, ring} (below):
//   tensor maps of A_hi, A_lo (rows x d) and B_hi, B_lo (n1 x d), float32, 128 x 32 boxes,
//   128-byte swizzle (tma.matrix_map); p the TileArgs<float> of tiles.cu with n2 = 0 (no
//   B2); ring = stages (no A-resident ring).  Grid (ceil(rows / 128), splits), 384 threads,
//   dynamic shared memory 1 KiB + stages x 64 KiB.  LSE / LSE2 write cpn_wstile_<mode>_bf16's outputs (row (m, s) partials
//   per split, column partials, positive logits), combined by the finishing kernels below;
//   LSE2 with p.g also stores the raw scores, each tile and its mirror (ws_tile_store), for
//   cpn_tf32x3_h_from_s; H writes the float32 block into p.g (direct float2 stores, the
//   mirror of a `tri` tile element by element); MM writes p.g = alpha A B^T (alpha =
//   p.scale_mul; A = the float32 H block, its map in ahi's place and split by the consumers,
//   alo unread; B = the keys transposed, split; d = the block's columns; ring | 1 << 9: the
//   consumers interleaved, tile_ws.cuh); mmt writes p.g = alpha Aᵀ B^T from the map of the
//   stored A (K x M) with 32 x 32 boxes, transposed by the consumers (split_a_t).  MM / mmt
//   with grid z > 1 (tf32x3.mm's K split): CTA z takes the K steps KTA z / Z .. KTA (z + 1)
//   / Z - 1 and stores its partial into p.g + z p.part_ld (no accumulate), which
//   blas.cu's cpn_mm_sum_splits_f32 adds up in z order.
//
// Why the promotion: Hopper's tensor cores add each MMA step's products to the accumulator
// truncating toward zero, ~0.5 ulp of the partial sum lost per k8 step, always the same way,
// so a long chain of TF32 MMAs into one accumulator (cuBLAS's 3xTF32) is 3-13x less accurate
// than fp32 (docs/notes.md, issue 24).  Here each ring stage's 32 of K goes into a zeroed
// chunk accumulator on the tensor cores -- the small terms first (4 k8 steps of lo_a hi_b,
// 4 of hi_a lo_b, then 4 of hi_a hi_b: the large partial sums see 4 truncations, the small
// ones round at their own, ~2^-11 smaller, magnitude) -- and the chunk is added to the fp32
// main accumulator with ordinary round-to-nearest FADDs (measured with cuBLAS chunks: ~1e-7
// relative, fp32 ~2.7e-7, at k = 256).
// cpn-dtypes: tf32x3
#include "include/tile_ws.cuh"

#define WS_TF32_KSTEP 32                 // a 128-byte swizzle row: 32 float32 of K
#define WS_TF32_BOX (TBM * WS_TF32_KSTEP * 4)  // 16 KiB: one 128 x 32 float32 box
#define WS_TF32_TBOX (32 * 32 * 4)              // 4 KiB: a 32 x 32 box (TRANS_A's)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// tile_epilogue<float, MODE_LSE, ...> compiles the 16-bit gradient-block branches (G, H, CLIP,
// SIGLIP) too, which pack two values a register; LSE never takes them (no g): this only lets
// them compile.
template <> struct Pack2<float> {
    static __device__ __forceinline__ unsigned round(float, float) {
        __trap();
        return 0u;
    }
};

// The split float32 operands (tile_ws.cuh's operand policy): a stage holds the four boxes of
// one 32-wide K step, A_hi | A_lo | B_hi | B_lo (64 KiB).  SPLIT_A (MM, whose A is the float32
// block H wrote once): the TMA loads A into A_hi's box and the consumer splits it there, hi
// in place and lo into A_lo's box (the boxes' swizzle is position-wise, so the split is
// too), one stage ahead of its MMAs: A crosses DRAM once, not as hi + lo.  TRANS_A (MM of
// Aᵀ: the map is of the stored (K x M) matrix, 32 x 32 boxes): the TMA loads the stage's
// four 32(K) x 32(M) boxes of the stored matrix into A_hi's box, and the consumer reads
// them into registers, transposes and splits them into the K-major boxes (split_a_t).  B1
// only, no A-resident ring.
template <bool SPLIT_A, bool TRANS_A = false> struct WsOpsTf32x3 {
    enum { KSTEP = WS_TF32_KSTEP, AR_OK = 0, K_SPLIT = 1 };  // (K_SPLIT: MODE_MM's grid z)
    typedef int BSrc;  // (B1 always)
    const TmaMap *ahi, *alo, *bhi, *blo;
    static __device__ __forceinline__ unsigned stage_bytes(bool) { return 4 * WS_TF32_BOX; }
    static __device__ __forceinline__ unsigned tx_bytes(bool) {
        return (SPLIT_A ? 3 : 4) * WS_TF32_BOX;
    }
    __device__ __forceinline__ BSrc b_src(bool) const { return 0; }
    __device__ __forceinline__ void load_a(unsigned, int, int, unsigned) const {}  // (AR_OK = 0)
    __device__ __forceinline__ void load_stage(unsigned a, bool, int kt, int m0, BSrc, int brow,
                                               unsigned bar) const {
        const int k = kt * KSTEP;
        if (TRANS_A) {  // rows k.. of the stored matrix, its columns m0 + 32 b ..
#pragma unroll
            for (int b = 0; b < 4; ++b) tma_load(a + b * WS_TF32_TBOX, ahi, m0 + 32 * b, k, bar);
        } else {
            tma_load(a, ahi, k, m0, bar);
        }
        if (!SPLIT_A) tma_load(a + WS_TF32_BOX, alo, k, m0, bar);
        tma_load(a + 2 * WS_TF32_BOX, bhi, k, brow, bar);
        tma_load(a + 3 * WS_TF32_BOX, blo, k, brow, bar);
    }
    // SPLIT_A: the A box of the stage at `a` split, x = hi + lo (split_tf32), by the
    // consumer's 128 threads (16-byte chunks, conflict-free), made visible to the tensor
    // cores' async proxy and waited for by the whole warpgroup.
    static __device__ __forceinline__ void split_a(unsigned a, int c, int lt) {
#pragma unroll
        for (int u = 0; u < WS_TF32_BOX / (16 * 128); ++u) {
            const unsigned o = a + (unsigned)(u * 128 + lt) * 16u;
            float x[4], h[4], l[4];
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                         : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "r"(o) : "memory");
#pragma unroll
            for (int e = 0; e < 4; ++e) split_tf32(x[e], h[e], l[e]);
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n"
                         :: "r"(o), "f"(h[0]), "f"(h[1]), "f"(h[2]), "f"(h[3]) : "memory");
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n"
                         :: "r"(o + WS_TF32_BOX), "f"(l[0]), "f"(l[1]), "f"(l[2]), "f"(l[3])
                         : "memory");
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        wg_bar(c);
    }
    // TRANS_A: the stage at `a` holds, in A_hi's box, four 128-byte-swizzled 32 x 32 boxes
    // of the stored matrix (box b: its rows = K 0..31, its columns = M 32 b ..; row k's
    // 16-byte chunk q at position q ^ (k & 7)); written back transposed and split into the
    // K-major layout of split_a (row m's chunk q = K 4q .. 4q + 3 at position q ^ (m & 7)).
    // 16-byte accesses are served a quarter warp (8 lanes) at a time: conflict-free when a
    // quarter's 8 lanes touch 8 distinct chunk positions.  Thread (warp w, lane l = 8 h + i)
    // takes the M quad mq = 8 w + i and the K quads kq = 2 h + p, p = 0, 1: 4 x 4 values
    // each.  Reads (row k = 4 kq + r, chunk mq & 7 = i): position i ^ (k & 7), distinct over
    // i.  Writes (row m of M, chunk kq): a quarter's rows 4 mq + e would give only 2
    // positions, so lane i writes its row 4 mq + ((e + i / 2) & 3) at step e (its values
    // rotated by i / 2 in registers first): position kq ^ (4 (i & 1) + that), distinct over
    // i.  Every thread reads before any writes (the warpgroup barrier: hi overwrites the raw
    // boxes).  The same hi / lo as split_a of the transposed matrix, bit for bit.
    static __device__ __forceinline__ void split_a_t(unsigned a, int c, int lt) {
        const int l = lt & 31, w = lt >> 5, h = l >> 3, i = l & 7, mq = 8 * w + i;
        const int rot = (i >> 1) & 3;
        float v[2][4][4];  // [p][K offset r][M offset e, rotated by rot]
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const int kq = 2 * h + p;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int k = 4 * kq + r;
                const unsigned o = a + (unsigned)(w * WS_TF32_TBOX + k * 128 + ((i ^ (k & 7)) << 4));
                float x[4];
                asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                             : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "r"(o) : "memory");
                // v[e] = x[(e + rot) & 3]: rotate by 1 if rot & 1, then by 2 if rot & 2
                float y[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) y[e] = (rot & 1) ? x[(e + 1) & 3] : x[e];
#pragma unroll
                for (int e = 0; e < 4; ++e) v[p][r][e] = (rot & 2) ? y[(e + 2) & 3] : y[e];
            }
        }
        wg_bar(c);
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const int kq = 2 * h + p;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = 4 * mq + ((e + rot) & 3);
                const unsigned o = a + (unsigned)(m * 128 + ((kq ^ (m & 7)) << 4));
                float hv[4], lv[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) split_tf32(v[p][r][e], hv[r], lv[r]);
                asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n"
                             :: "r"(o), "f"(hv[0]), "f"(hv[1]), "f"(hv[2]), "f"(hv[3]) : "memory");
                asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n"
                             :: "r"(o + WS_TF32_BOX), "f"(lv[0]), "f"(lv[1]), "f"(lv[2]),
                                "f"(lv[3]) : "memory");
            }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        wg_bar(c);
    }
    static __device__ __forceinline__ void split_stage(unsigned a, int c, int lt) {
        if (TRANS_A) split_a_t(a, c, lt); else split_a(a, c, lt);
    }
    // The tile (see tile_ws.cuh's WsOps16::mma_tile): per stage and per 64-row half h, 12
    // wgmma m64n128k8 into the chunk accumulator ch (scale-d = 0 on the first), commit, wait,
    // then acc[h] += ch.  One chunk of 64 registers: the main accumulator takes 128 of the
    // consumer's 240, so the two halves' chunks (128 more) would not fit; the tensor cores
    // idle while a consumer waits for its chunk and adds it unless the other consumer's MMAs
    // run then -- MODE_MM's interleaved ring (r.stride = 2: this consumer's K steps are every
    // other stage), not the ping-pong modes, whose other consumer is in its epilogue.
    // SPLIT_A: alone (stride 1) the next stage is waited for and split while the first
    // half's MMAs run (the tile's first stage before them); interleaved, each stage is split
    // when it is reached (the next one is the other consumer's to wait for: waiting on it
    // here would stall these MMAs' completion behind that consumer's release and a refill),
    // while the other consumer's MMAs run.  The stage is released once its second half has
    // been read.
    template <typename Issued>
    __device__ __forceinline__ void mma_tile(float (&acc)[2][16][4], const WsRing& r, int KT,
                                             int& s, unsigned& fph, Issued issued) const {
        float ch[64];
        const int c = (int)(threadIdx.x >> 7), lt = (int)(threadIdx.x & 127);
        // split the next stage under the MMAs (not TRANS_A: its 32 values a thread would
        // not fit beside the chunk, which those MMAs are writing)
        const bool ahead = SPLIT_A && !TRANS_A && r.stride == 1;
        auto wait_full = [&](int st) {
            mbar_wait(r.fullc + 8 * st, (fph >> st) & 1u);
            fph ^= 1u << st;
        };
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 16; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
        if (ahead) {
            wait_full(s);
            split_a(r.rbase + s * r.SB, c, lt);
        }
        for (int kt = 0; kt < KT; ++kt) {
            if (!ahead) wait_full(s);
            if (SPLIT_A && !ahead) split_stage(r.rbase + s * r.SB, c, lt);
            const unsigned a = r.rbase + s * r.SB;
            const unsigned long long dbh = wg_desc(a + 2 * WS_TF32_BOX),
                                     dbl = wg_desc(a + 3 * WS_TF32_BOX);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned ah = a + h * 64 * 128;  // rows 64 h .. of the A boxes
                const unsigned long long dah = wg_desc(ah), dal = wg_desc(ah + WS_TF32_BOX);
#pragma unroll
                for (int q = 0; q < 64; ++q) fence_operand(ch[q]);
                wg_fence();
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)  // +32 B per k8 = +2 in the descriptor
                    WgmmaTf32::run(ch, dal + 2 * kk, dbh + 2 * kk, kk == 0 ? 0 : 1);
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) WgmmaTf32::run(ch, dah + 2 * kk, dbl + 2 * kk, 1);
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) WgmmaTf32::run(ch, dah + 2 * kk, dbh + 2 * kk, 1);
                wg_commit();
                if (h == 1 && kt == KT - 1) issued();
                if (ahead && h == 0 && kt + 1 < KT) {  // (stage s + 1: not read by these)
                    const int s1 = s + 1 == r.ST ? 0 : s + 1;
                    wait_full(s1);
                    split_a(r.rbase + s1 * r.SB, c, lt);
                }
                ws_promote(acc, ch, r, s, h);
            }
            s += r.stride;
            if (s >= r.ST) s -= r.ST;
        }
    }
    template <typename L>
    __device__ __forceinline__ void mm_store(const TileArgs<float>& p, const float (&acc)[2][16][4],
                                             int m0, int n0, int nlim, int warp, int lane) const {
        ws_mm_store<L>(p, acc, m0, n0, nlim, warp, lane);
    }
};

template <int MODE, bool TRANS_A = false>
__device__ __forceinline__ void tile_ws_tf32x3(const TmaMap& ahi, const TmaMap& alo,
                                               const TmaMap& bhi, const TmaMap& blo,
                                               const TileArgs<float>& p, int ring) {
    WsOpsTf32x3<MODE == MODE_MM, TRANS_A> ops;
    ops.ahi = &ahi; ops.alo = &alo; ops.bhi = &bhi; ops.blo = &blo;
    tile_ws_walk<float, MODE, true>(ops, p, ring);
}
#define CPN_WS_TF32_BODY(MODE) tile_ws_tf32x3<MODE>(L.ahi, L.alo, L.bhi, L.blo, L.p, L.ring)
#define CPN_WS_TF32_BODY_T tile_ws_tf32x3<MODE_MM, true>(L.ahi, L.alo, L.bhi, L.blo, L.p, L.ring)
#else
#define CPN_WS_TF32_BODY(MODE) __trap()  // not an sm_90a build: Python never launches these
#define CPN_WS_TF32_BODY_T __trap()
#endif

// The kernels' one parameter: the four maps, the TileArgs and the ring (tiles_tf32._launch
// packs it: one 768-byte argument costs the host ~13 µs a launch, the six it replaces ~38,
// H100 host, 2026-11-27).  The layout is fixed here and in tiles.launch_blob / LAUNCH_*.
struct WsTf32Launch {
    TmaMap ahi, alo, bhi, blo;
    TileArgs<float> p;
    int ring;
};
// (members in order, no gaps: p at 4 x 128 = 512, ring at 512 + 224 = 736, padded to 768)
static_assert(sizeof(TmaMap) == 128 && sizeof(TileArgs<float>) == 224 &&
              sizeof(WsTf32Launch) == 768, "WsTf32Launch's layout is tiles.launch_blob's");
#define CPN_WS_TF32_ARGS const __grid_constant__ WsTf32Launch L
#define CPN_DEFINE_WS_TF32(SUF)                                                            \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_lse_##SUF(          \
    CPN_WS_TF32_ARGS) { CPN_WS_TF32_BODY(MODE_LSE); }                                      \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_lse2_##SUF(         \
    CPN_WS_TF32_ARGS) { CPN_WS_TF32_BODY(MODE_LSE2); }                                     \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_h_##SUF(            \
    CPN_WS_TF32_ARGS) { CPN_WS_TF32_BODY(MODE_H); }                                        \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_mm_##SUF(           \
    CPN_WS_TF32_ARGS) { CPN_WS_TF32_BODY(MODE_MM); }                                       \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_mmt_##SUF(          \
    CPN_WS_TF32_ARGS) { CPN_WS_TF32_BODY_T; }

CPN_DEFINE_WS_TF32(tf32x3)

// ---- the finish of the float32 statistics (LSE / LSE2 partials in base 2) -----------------
// Each row's log-sum-exp stays the pair (M, log2 S) that its partials merge to (lse2_merge,
// in a fixed order): ml[r] = (M, log2 S) for the H pass, lse[r] = (M + log2 S) ln 2 and
// loss[r] = ((M - t_pos) + log2 S) ln 2 rounded once from double, t_pos being the positive's
// base-2 logit as the tiles computed it (pos2), so that lse - L_pos does not cancel two
// separately rounded numbers.  Tri (NT-Xent's symmetric pass): the column partials of the
// tiles that covered the row merged after its row partials (tiles.cu's tile_finish_tri order);
// a row whose positive sat in a column of another row tile's tile takes its partner's pos2
// (NaN where not written: the buffer starts as NaN).  One thread a row.
__device__ __forceinline__ void tf32x3_finish_row(int r, float m, float s, float t_pos,
                                                  float* lse, float* loss, float2* ml) {
    const double l2 = log2((double)s);
    const double ln2 = 0.6931471805599453;
    ml[r] = make_float2(m, (float)l2);
    lse[r] = (float)(((double)m + l2) * ln2);
    loss[r] = (float)(((double)(m - t_pos) + l2) * ln2);
}

extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_tf32x3_finish(
    const float* __restrict__ part_m, const float* __restrict__ part_s, i64 part_ld, int splits,
    int rows, const float* __restrict__ pos2, float* lse, float* loss, float2* ml) {
    const int r = blockIdx.x * CPN_BLOCK + threadIdx.x;
    if (r >= rows) return;
    float m = -cpn_inf<float>(), s = 0.f;
    for (int k = 0; k < splits; ++k) lse2_merge(m, s, part_m[k * part_ld + r], part_s[k * part_ld + r]);
    tf32x3_finish_row(r, m, s, pos2[r], lse, loss, ml);
}

extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_tf32x3_finish_tri(
    const float* __restrict__ part_m, const float* __restrict__ part_s, i64 part_ld, int splits,
    int rows, const float* __restrict__ colp_m, const float* __restrict__ colp_s,
    const float* __restrict__ pos2, int half, float* lse, float* loss, float2* ml) {
    const int r = blockIdx.x * CPN_BLOCK + threadIdx.x;
    if (r >= rows) return;
    const int ct = (rows + TBN - 1) / TBN, tr = r / TBN;
    float m = -cpn_inf<float>(), s = 0.f;
    for (int k = 0; k < splits; ++k) lse2_merge(m, s, part_m[k * part_ld + r], part_s[k * part_ld + r]);
    for (int o = 1; o <= ct / 2; ++o) {
        const int i = (tr - o + ct) % ct;
        if (o < tri_count(i, ct)) lse2_merge(m, s, colp_m[(i64)i * rows + r], colp_s[(i64)i * rows + r]);
    }
    float tp = pos2[r];
    if (tp != tp) tp = pos2[(r + half) % rows];
    tf32x3_finish_row(r, m, s, tp, lse, loss, ml);
}

// ---- NT-Xent's gradient block from the stored scores (the symmetric forward kept them) -----
// g (n x n, leading dimension ldg, a multiple of 4) holds the raw scores a_ij = z_i . z_j (the
// LSE2 pass's, with g); replaced in place by H_ij = s (w_i P_ij + w_j P_ji - pairs), P from
// the rows' (M, log2 S) pairs ml, exponents t - lse = (t - M) - log2 S with t = a s log2(e)
// (s log2(e) in two floats, as epi_ctx), P - 1 at the positive j = (i + half) mod n through
// expm1, 0 on the diagonal: the float32 H tile epilogue's accurate form for every element
// (the tiles take a one-exp2 form on most tiles; this pass is memory-bound, two exp2 cost
// nothing).  w_i = w_mul w[i w_stride] (w_mul alone without w).  Four columns a thread; rows
// blockIdx.y, + gridDim.y, ... (the grid's y is capped at 65535).
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_tf32x3_h_from_s(
    float* g, i64 ldg, int n, int half, const float2* __restrict__ ml,
    const float* __restrict__ w, i64 w_stride, float w_mul, float scale) {
    const int j0 = 4 * (blockIdx.x * CPN_BLOCK + threadIdx.x);
    if (j0 >= n) return;
    // (as epi_ctx: the LSE2 epilogue's very t, compensation included, from its raw scores)
    const double s2 = (double)scale * 1.4426950408889634 * (1.0 + CPN_TF32X3_TRUNC);
    const float sl2 = (float)s2, sl2lo = (float)(s2 - (double)sl2);
    for (int i = blockIdx.y; i < n; i += gridDim.y) {
        const float2 mi = ml[i];
        const float wi = w_mul * (w ? w[(i64)i * w_stride] : 1.f);
        const int pos = (int)(((i64)i + half) % n);
        float* const row = g + (i64)i * ldg;
        float4 a = *(const float4*)(row + j0);
        float* const av = &a.x;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = j0 + e;
            if (j >= n) break;
            const float2 mj = ml[j];
            const float wj = w_mul * (w ? w[(i64)j * w_stride] : 1.f);
            const float t = fmaf(av[e], sl2, av[e] * sl2lo);
            const float di = (t - mi.x) - mi.y, dc = (t - mj.x) - mj.y;
            float p;
            if (j == pos)
                p = wi * expm1f(di * CPN_LN2) + wj * expm1f(dc * CPN_LN2);
            else
                p = wi * exp2f(di) + wj * exp2f(dc);
            av[e] = j == i ? 0.f : scale * p;
        }
        if (j0 + 3 < n) {
            *(float4*)(row + j0) = a;
        } else {
            for (int e = 0; j0 + e < n; ++e) row[j0 + e] = av[e];
        }
    }
}
