// cupynce float32 products on Hopper's float16 tensor cores (issue 24; beside the TF32x3
// tiles of tiles_ws_tf32.cu, taken by "auto" for CLIP's products and the other row-block
// ops' score products: products_tf32.py): each float32 operand row is scaled by a power of two
// 2^e (its largest |x| into [2^14, 2^15)) and split into two float16 values,
//     x 2^e = hi + lo,   hi = fp16_rn(x 2^e),   lo = fp16_rn(x 2^e - hi)
// (x 2^e - hi is exact in float32; hi + lo keeps ~22 bits of x, as the TF32 split does), and a
// product takes three float16 MMAs, lo_a hi_b + hi_a lo_b + hi_a hi_b (lo lo, ~2^-22
// relative, dropped), at twice TF32's tensor-core rate.  The scales come out exactly in the
// product's store (powers of two): out = alpha acc rowf[i] colf[j] (+ out).  The
// accumulator is promoted every 64 of K, as the TF32x3 tiles do every 32: each ring stage's
// chunk goes into a zeroed register block on the tensor cores (small terms first) and is
// added to the fp32 main accumulator with round-to-nearest FADDs (Hopper's tensor cores
// truncate each MMA step's sum: docs/notes.md, issue 24).
//
// Why a scale: float16 has 5 exponent bits.  With the row's largest |x| at 2^14..2^15, hi
// never overflows; hi + lo is within 2^-22 |x| of x 2^e wherever |x 2^e| >= 2^-3 (|x| >=
// 2^-17 of the row's largest), and smaller elements keep an absolute error <= 2^-25 in the
// scaled units (<= 2^-39 of the row's largest), below float32's own rounding of the dot
// product.  Exponents are clamped to [-113, 126] (common.cuh: 2^+-e stay normal; only rows
// whose largest |x| is below 2^-112 are scaled less, and lose relative accuracy).
// A row holding inf or NaN is not scaled (e = 0): its products stay non-finite, NaN where
// fp32 might give inf (0 inf in a cross term: a zero lo times an inf hi), as in the TF32x3
// tiles -- the ops' contract is a NaN loss for any non-finite input.
//
//   cpn_wstile_mm_f16x3(L):  out = alpha A Bᵀ, A (m x K) and B (c x K) split K-major
//                            (cpn_f16x3_split_rows / _split_t / _split_scaled), 128 x 64
//                            float16 boxes;
//   cpn_wstile_mmt_f16x3(L): out = alpha Aᵀ Bᵀ with A stored (K x m): its split halves read
//                            MN-major (64 x 64 boxes, wgmma's transposed A), no copy;
//   cpn_wstile_mmil_f16x3 / _mmtil_f16x3: the same with A's halves interleaved in place in
//                            its float32 buffer (cpn_f16x3_split_scaled_il,
//                            cpn_clip_grad_f16x3), read through 3-D maps.
//   L = WsF16Launch {ahi, alo, bhi, blo, p, ring, comp, rowf, colf, ufac}: p the TileArgs<float> of
//   tiles.cu (rows, n1 = c, d = K, g = out, ldg, scale_mul = alpha, tri = accumulate); rowf
//   (m) and colf (c) the operands' inverse scales (null: 1), ufac a device factor (null: 1;
//   CLIP's exp(logit_scale) 2^-e, written by cpn_clip_grad_f16x3).  Grid (ceil(m / 128), splits),
//   384 threads, dynamic shared memory 1 KiB + stages x 64 KiB.  Built for sm_90a only.
// cpn-dtypes: f16x3
#include "include/tile_ws.cuh"

#define WS_F16_KSTEP 64                       // a 128-byte swizzled row: 64 float16 of K
#define WS_F16_BOX (TBM * WS_F16_KSTEP * 2)   // 16 KiB: one 128 x 64 float16 box

// ---- the split (any arch; f16x3_exp / f16x3_split: common.cuh) ----------------------------
// the largest |x| of a warp's values, as a bit pattern (NaN's above inf's), over the warp
__device__ __forceinline__ unsigned f16x3_warp_max(unsigned m) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

// Rows scaled each by its own e: x (rows x cols, row stride ldx) -> hi, lo (rows x ld_out
// float16, columns cols .. ld_out - 1 zero) and inv[r] = 2^-e_r.  A warp a row.
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_f16x3_split_rows(
    const float* __restrict__ x, i64 ldx, int rows, int cols, int ld_out,
    unsigned short* __restrict__ hi, unsigned short* __restrict__ lo, float* __restrict__ inv) {
    const int lane = threadIdx.x & 31;
    const int r = (int)((blockIdx.x * (i64)CPN_BLOCK + threadIdx.x) >> 5);
    if (r >= rows) return;
    const float* xr = x + (i64)r * ldx;
    unsigned m = 0;
    for (int c = lane; c < cols; c += 32) m = max(m, __float_as_uint(xr[c]) & 0x7fffffffu);
    const int e = f16x3_exp(f16x3_warp_max(m));
    const float s = f16x3_pow2(e);
    unsigned short* hr = hi + (i64)r * ld_out;
    unsigned short* lr = lo + (i64)r * ld_out;
    for (int c = lane; c < ld_out; c += 32) {
        unsigned short h = 0, l = 0;
        if (c < cols) f16x3_split(xr[c], s, h, l);
        hr[c] = h;
        lr[c] = l;
    }
    if (lane == 0) inv[r] = f16x3_pow2(-e);
}

// The largest |x| of each column of x (rows x cols) as bit patterns, max-ed into cmax (cols,
// zeroed first): integer atomicMax, so the result is the same whatever the order.  Blocks of
// 32 columns x 256 rows, 256 threads.
extern "C" __global__ void __launch_bounds__(256) cpn_f16x3_colmax(
    const float* __restrict__ x, i64 ldx, int rows, int cols, unsigned* __restrict__ cmax) {
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const int c = blockIdx.y * 32 + tx;
    if (c >= cols) return;
    const int r0 = blockIdx.x * 256;
    unsigned m = 0;
    for (int r = r0 + ty; r < rows && r < r0 + 256; r += 8)
        m = max(m, __float_as_uint(x[(i64)r * ldx + c]) & 0x7fffffffu);
    atomicMax(cmax + c, m);
}

// The split of xᵀ scaled per column of x (each a row of xᵀ): hi, lo (cols x rows_out float16,
// rows .. rows_out - 1 zero), inv[c] = 2^-e_c from cmax (cpn_f16x3_colmax).  32 x 32 tiles
// through shared memory; grid (ceil(rows_out / 32), ceil(cols / 32)), 256 threads.
extern "C" __global__ void __launch_bounds__(256) cpn_f16x3_split_t(
    const float* __restrict__ x, i64 ldx, int rows, int rows_out, int cols,
    const unsigned* __restrict__ cmax, unsigned short* __restrict__ hi,
    unsigned short* __restrict__ lo, float* __restrict__ inv) {
    __shared__ float t[32][33];
    const int r0 = blockIdx.x * 32, c0 = blockIdx.y * 32;
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
#pragma unroll
    for (int y = ty; y < 32; y += 8) {
        const int r = r0 + y, c = c0 + tx;
        t[y][tx] = (r < rows && c < cols) ? x[(i64)r * ldx + c] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int y = ty; y < 32; y += 8) {
        const int c = c0 + y, r = r0 + tx;
        if (c < cols && r < rows_out) {
            const int e = f16x3_exp(cmax[c]);
            unsigned short h, l;
            f16x3_split(t[tx][y], f16x3_pow2(e), h, l);
            hi[(i64)c * rows_out + r] = h;
            lo[(i64)c * rows_out + r] = l;
            if (blockIdx.x == 0 && tx == 0) inv[c] = f16x3_pow2(-e);
        }
    }
}

// One scale 2^e for the whole matrix (a gradient block whose bound the caller knows):
// x (rows x cols, stride ldx) -> hi, lo (rows x ld_out, zero-padded).  A thread an element of
// the padded output.
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_f16x3_split_scaled(
    const float* __restrict__ x, i64 ldx, i64 rows, int cols, int ld_out, int e,
    unsigned short* __restrict__ hi, unsigned short* __restrict__ lo) {
    const i64 idx = (i64)blockIdx.x * CPN_BLOCK + threadIdx.x;
    if (idx >= rows * ld_out) return;
    const i64 r = idx / ld_out;
    const int c = (int)(idx - r * ld_out);
    unsigned short h = 0, l = 0;
    if (c < cols) f16x3_split(x[r * ldx + c], f16x3_pow2(e), h, l);
    hi[idx] = h;
    lo[idx] = l;
}

// e_out[0] = the exponent that puts max_i |w_mul w[i stride]| into [2^14, 2^15) (f16x3_exp):
// the scale of a gradient block bounded by its largest weight (CLIP: |G_ij| <= max |w|).
// One block of 256 threads.
extern "C" __global__ void __launch_bounds__(256) cpn_f16x3_bound_exp(
    const float* __restrict__ w, i64 n, i64 stride, float w_mul, int* e_out) {
    __shared__ unsigned sm[8];
    unsigned m = 0;
    for (i64 k = threadIdx.x; k < n; k += 256)
        m = max(m, __float_as_uint(w_mul * w[k * stride]) & 0x7fffffffu);
    m = f16x3_warp_max(m);
    if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < 8; ++k) m = max(m, sm[k]);
        e_out[0] = f16x3_exp(max(m, sm[0]));
    }
}

// The same split in place, interleaved: x (rows x ld float32, ld a multiple of 64) becomes,
// per row and 64-column group, the group's 64 hi then its 64 lo (float16) in the group's 256
// bytes (columns cols .. of the last group zero): the layout WsOpsF16x3<.., IL> reads.  A
// group is one half-warp's 16 float4 (read, then written after __syncwarp: in place);
// grid (ceil(groups / 16), min(rows, 65535)), rows blockIdx.y, + gridDim.y, ...; 256 threads.
// one 64-column group q of a row (its half-warp's lane l): see cpn_f16x3_split_scaled_il
__device__ __forceinline__ void f16x3_split_il_group(float* row, int q, int l, int groups,
                                                     int cols, int e) {
    float* g = row + (i64)q * 64;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    const int c = q * 64 + 4 * l;
    if (q < groups && c < cols) v = *(const float4*)(g + 4 * l);
    __syncwarp();
    if (q >= groups) return;  // (after the __syncwarp: every lane reaches it)
    const float s = f16x3_pow2(e);
    const float in[4] = {v.x, v.y, v.z, v.w};
    unsigned short h[4], lo[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        h[j] = lo[j] = 0;
        if (c + j < cols) f16x3_split(in[j], s, h[j], lo[j]);
    }
    unsigned short* gb = (unsigned short*)g;
    *(uint2*)(gb + 4 * l) = make_uint2(h[0] | ((unsigned)h[1] << 16), h[2] | ((unsigned)h[3] << 16));
    *(uint2*)(gb + 64 + 4 * l) =
        make_uint2(lo[0] | ((unsigned)lo[1] << 16), lo[2] | ((unsigned)lo[3] << 16));
}

extern "C" __global__ void __launch_bounds__(256) cpn_f16x3_split_scaled_il(
    float* __restrict__ x, i64 ldx, int rows, int cols, int e) {
    const int q = blockIdx.x * 16 + (threadIdx.x >> 4), l = threadIdx.x & 15;
    const int groups = (cols + 63) / 64;
    for (int r = blockIdx.y; r < rows; r += gridDim.y)
        f16x3_split_il_group(x + (i64)r * ldx, q, l, groups, cols, e);
}
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// (tile_epilogue<float, MODE_MM, ...> compiles the 16-bit gradient-block branches it never
// takes, as in tiles_ws_tf32.cu)
template <> struct Pack2<float> {
    static __device__ __forceinline__ unsigned round(float, float) {
        __trap();
        return 0u;
    }
};

// the exponent of a power of two (rowf / colf: 2^-e, normal)
__device__ __forceinline__ int f16x3_pow2_exp(float p) {
    return (int)((__float_as_uint(p) >> 23) & 0xffu) - 127;
}
// x 2^n for |n| <= 252 (two normal powers of two: the intermediate lies between x and the
// result, so it neither overflows nor flushes unless the result does)
__device__ __forceinline__ float f16x3_ldexp(float x, int n) {
    const int h = n / 2;
    return (x * f16x3_pow2(h)) * f16x3_pow2(n - h);
}

// wgmma with A read MN-major (transposed; float16 allows it, TF32 does not)
struct WgmmaF16TA {
    static __device__ __forceinline__ void run(float* d, unsigned long long da,
                                               unsigned long long db, int scale_d) {
        CPN_WGMMA_ASM_SS("m64n128k16.f32.f16.f16", "1, 1, 1, 0");
    }
};
// Descriptor of an MN-major 16-bit operand with 128-byte swizzle (CUTLASS's canonical
// ((8, 8, m), (8, k)) : ((1, 8, LBO), (64, SBO)) in elements): 64 MN-contiguous values a
// 128-byte row, one row per k, 8-k groups 1024 B apart (SBO); LBO, the next 64 of MN, is
// unused by m64 (one atom) and set to the box's 8 KiB.
__device__ __forceinline__ unsigned long long wg_desc_mn(unsigned saddr) {
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | (512ull << 16) | (64ull << 32) |
           (1ull << 62);
}

// The split float16 operands (tile_ws.cuh's operand policy): a stage holds the four boxes of
// one 64-wide K step, A_hi | A_lo | B_hi | B_lo (64 KiB).  TRANS_A: A's boxes are two 64 (K)
// x 64 (M) boxes of the stored (K x M) matrix each (rows 0-63 of the tile, then 64-127).
// ILA: A's halves interleaved in a float32 buffer (cpn_f16x3_split_scaled_il: per row, each
// 64-column group's 256 bytes hold its 64 hi, then its 64 lo), read through 3-D maps (64,
// groups, rows) whose (64, 1, rows) boxes land as the 2-D boxes do.
template <bool TRANS_A, bool ILA = false> struct WsOpsF16x3 {
    enum { KSTEP = WS_F16_KSTEP, AR_OK = 0, K_SPLIT = 0 };
    typedef int BSrc;  // (B1 always)
    const TmaMap *ahi, *alo, *bhi, *blo;
    const float *rowf, *colf, *ufac;
    float comp;
    static __device__ __forceinline__ unsigned stage_bytes(bool) { return 4 * WS_F16_BOX; }
    static __device__ __forceinline__ unsigned tx_bytes(bool) { return 4 * WS_F16_BOX; }
    __device__ __forceinline__ BSrc b_src(bool) const { return 0; }
    __device__ __forceinline__ void load_a(unsigned, int, int, unsigned) const {}  // (AR_OK = 0)
    __device__ __forceinline__ void load_stage(unsigned a, bool, int kt, int m0, BSrc, int brow,
                                               unsigned bar) const {
        const int k = kt * KSTEP;
        if (TRANS_A && ILA) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                tma_load3(a + h * (WS_F16_BOX / 2), ahi, 0, m0 / 64 + h, k, bar);
                tma_load3(a + WS_F16_BOX + h * (WS_F16_BOX / 2), alo, 0, m0 / 64 + h, k, bar);
            }
        } else if (ILA) {
            tma_load3(a, ahi, 0, kt, m0, bar);
            tma_load3(a + WS_F16_BOX, alo, 0, kt, m0, bar);
        } else if (TRANS_A) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                tma_load(a + h * (WS_F16_BOX / 2), ahi, m0 + 64 * h, k, bar);
                tma_load(a + WS_F16_BOX + h * (WS_F16_BOX / 2), alo, m0 + 64 * h, k, bar);
            }
        } else {
            tma_load(a, ahi, k, m0, bar);
            tma_load(a + WS_F16_BOX, alo, k, m0, bar);
        }
        tma_load(a + 2 * WS_F16_BOX, bhi, k, brow, bar);
        tma_load(a + 3 * WS_F16_BOX, blo, k, brow, bar);
    }
    // The tile (WsOpsTf32x3::mma_tile without the split): per stage and per 64-row half h,
    // 12 wgmma m64n128k16 into the chunk ch (4 lo_a hi_b, 4 hi_a lo_b, 4 hi_a hi_b), commit,
    // wait, acc[h] += ch (round to nearest).  The stage is released after its second half.
    template <typename Issued>
    __device__ __forceinline__ void mma_tile(float (&acc)[2][16][4], const WsRing& r, int KT,
                                             int& s, unsigned& fph, Issued issued) const {
        float ch[64];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 16; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
        for (int kt = 0; kt < KT; ++kt) {
            mbar_wait(r.fullc + 8 * s, (fph >> s) & 1u);
            fph ^= 1u << s;
            const unsigned a = r.rbase + s * r.SB;
            const unsigned long long dbh = wg_desc(a + 2 * WS_F16_BOX),
                                     dbl = wg_desc(a + 3 * WS_F16_BOX);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned ah = a + h * (WS_F16_BOX / 2);  // rows 64 h .. (either layout)
#pragma unroll
                for (int q = 0; q < 64; ++q) fence_operand(ch[q]);
                wg_fence();
                if (TRANS_A) {  // a k16 step: two 8-k groups, 2048 B (+128)
                    const unsigned long long dah = wg_desc_mn(ah), dal = wg_desc_mn(ah + WS_F16_BOX);
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk)
                        WgmmaF16TA::run(ch, dal + 128 * kk, dbh + 2 * kk, kk == 0 ? 0 : 1);
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) WgmmaF16TA::run(ch, dah + 128 * kk, dbl + 2 * kk, 1);
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) WgmmaF16TA::run(ch, dah + 128 * kk, dbh + 2 * kk, 1);
                } else {  // a k16 step: 32 B (+2)
                    const unsigned long long dah = wg_desc(ah), dal = wg_desc(ah + WS_F16_BOX);
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk)
                        Wgmma<f16_t>::run(ch, dal + 2 * kk, dbh + 2 * kk, kk == 0 ? 0 : 1);
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) Wgmma<f16_t>::run(ch, dah + 2 * kk, dbl + 2 * kk, 1);
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) Wgmma<f16_t>::run(ch, dah + 2 * kk, dbh + 2 * kk, 1);
                }
                wg_commit();
                if (h == 1 && kt == KT - 1) issued();
                ws_promote(acc, ch, r, s, h);
            }
            s += r.stride;
            if (s >= r.ST) s -= r.ST;
        }
    }
    // MODE_MM's store: out = alpha (acc' rowf[i] colf[j]) (+ out), acc' = acc + comp acc (one
    // FMA; not for comp = 0: inf * 0), alpha = p.scale_mul (times *ufac where given, rounded
    // once): the two scales exactly, as one power of two applied in two halves
    // (f16x3_ldexp: no intermediate overflow or flush).
    template <typename L>
    __device__ __forceinline__ void mm_store(const TileArgs<float>& p, const float (&acc)[2][16][4],
                                             int m0, int n0, int nlim, int warp, int lane) const {
        const int gq = lane >> 2, cq = lane & 3;
        const bool accumulate = p.tri != 0;
        const float alpha = ufac ? p.scale_mul * *ufac : p.scale_mul;
#pragma unroll
        for (int i = 0; i < L::I; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int lr = m0 + L::row_base(warp) + i * L::IS + h * 8 + gq;
                if (lr >= p.rows) continue;
                const int er = rowf ? f16x3_pow2_exp(rowf[lr]) : 0;
                float* const o = p.g + (i64)lr * p.ldg;
#pragma unroll
                for (int j = 0; j < L::J; ++j) {
                    const int col = n0 + j * 8 + 2 * cq;
                    if (col >= nlim) continue;
                    const bool two = col + 1 < nlim;
                    int n0e = er, n1e = er;  // the exponents of rowf[i] colf[j]
                    if (colf) {
                        n0e += f16x3_pow2_exp(colf[col]);
                        if (two) n1e += f16x3_pow2_exp(colf[col + 1]);
                    }
                    float a0 = acc[i][j][h * 2], a1 = acc[i][j][h * 2 + 1];
                    if (comp != 0.f) {
                        a0 = fmaf(a0, comp, a0);
                        a1 = fmaf(a1, comp, a1);
                    }
                    float v0 = alpha * f16x3_ldexp(a0, n0e);
                    float v1 = alpha * f16x3_ldexp(a1, n1e);
                    if (two) {
                        if (accumulate) {
                            const float2 o2 = *(const float2*)(o + col);
                            v0 += o2.x;
                            v1 += o2.y;
                        }
                        *(float2*)(o + col) = make_float2(v0, v1);
                    } else {
                        o[col] = accumulate ? v0 + o[col] : v0;
                    }
                }
            }
    }
};

template <bool TRANS_A, bool ILA>
__device__ __forceinline__ void tile_ws_f16x3(const TmaMap& ahi, const TmaMap& alo,
                                              const TmaMap& bhi, const TmaMap& blo,
                                              const TileArgs<float>& p, int ring,
                                              const float* rowf, const float* colf, float comp,
                                              const float* ufac) {
    WsOpsF16x3<TRANS_A, ILA> ops;
    ops.ahi = &ahi; ops.alo = &alo; ops.bhi = &bhi; ops.blo = &blo;
    ops.rowf = rowf; ops.colf = colf; ops.comp = comp; ops.ufac = ufac;
    tile_ws_walk<float, MODE_MM, true>(ops, p, ring);
}
#define CPN_WS_F16_BODY(TA, ILA) tile_ws_f16x3<TA, ILA>(L.ahi, L.alo, L.bhi, L.blo, L.p, L.ring, \
                                                      L.rowf, L.colf, L.comp, L.ufac)
#else
#define CPN_WS_F16_BODY(TA, ILA) __trap()  // not an sm_90a build: Python never launches these
#endif

// The kernels' one parameter (tiles.launch_blob packs it, the tail from tiles_f16x3): the
// four maps, the TileArgs, the ring and the two scale vectors.
struct WsF16Launch {
    TmaMap ahi, alo, bhi, blo;
    TileArgs<float> p;
    int ring;
    float comp;  // the products scaled by 1 + comp: the mean truncation loss (tiles_f16x3.TRUNC)
    const float* rowf;
    const float* colf;
    const float* ufac;  // one more factor of every product (a device scalar; null: 1)
};
// (p at 512, ring at 736, comp at 740, rowf at 744, colf at 752, ufac at 760: 768 exactly)
// (NVRTC has no offsetof here: the members are laid out in order without gaps, 8-byte
// pointers after the two 4-byte fields)
static_assert(sizeof(TmaMap) == 128 && sizeof(TileArgs<float>) == 224 &&
              sizeof(WsF16Launch) == 768, "WsF16Launch's layout is tiles_f16x3.py's");

#define CPN_DEFINE_WS_F16(SUF)                                                             \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_mm_##SUF(           \
    const __grid_constant__ WsF16Launch L) { CPN_WS_F16_BODY(false, false); }              \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_mmt_##SUF(          \
    const __grid_constant__ WsF16Launch L) { CPN_WS_F16_BODY(true, false); }               \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_mmil_##SUF(         \
    const __grid_constant__ WsF16Launch L) { CPN_WS_F16_BODY(false, true); }               \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_mmtil_##SUF(        \
    const __grid_constant__ WsF16Launch L) { CPN_WS_F16_BODY(true, true); }

CPN_DEFINE_WS_F16(f16x3)
