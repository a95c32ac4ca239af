// cupynce fused score tiles on tensor cores: float16 / bfloat16 inputs, float32 accumulation.
//
// One CTA owns TBM = 128 rows of A (queries) and walks the column tiles of B (keys, then
// shared negatives) assigned to it: column tile ct = split, split + splits, ... where
// split = blockIdx.y.  Each 128 x 128 score tile S = A B^T is computed with mma.sync
// (m16n8k16, fp32 accumulators kept in registers; operands staged in shared memory by
// cp.async, double buffered) and consumed in registers by an epilogue, so the score matrix
// never reaches global memory:
//
//   MODE_LSE   row log-sum-exp partials (per split) and the positive logit
//   MODE_LSE2  MODE_LSE plus column partials per (row tile, column): CLIP's column softmax
//   MODE_G     the gradient block G_ij = w_i s (p_ij - [j = pos(i)]) in T     (InfoNCE)
//   MODE_H     G + G^T for NT-Xent (S symmetric):                              (NT-Xent)
//              H_ij = s (w_i p_ij + w_j p_ji - (w_i + w_j) [j = pos(i)]), H_ii = 0,
//              p_ji = exp(l_ij - lse_j), so dZ = H Z is one product
//   MODE_CLIP  CLIP's gradient block s G_ij and the row partials of sum_j G_ij L_ij
//
// Determinism: every reduction has a fixed order (per-thread sequential over the tiles it
// owns, xor-shuffles in a fixed pattern, then a fixed smem merge); no atomics.
// Requirements (checked in Python): d, every leading dimension and every pointer are
// multiples of 8 elements / 16 bytes; sm_80 or newer.
//
// Partials are stored in natural-log units (m, s) with s = sum exp(x - m), the Lse<float>
// convention of common.cuh, so col_combine in contrastive.cu can fold them.
#include "common.cuh"

#define TBM 128
#define TBN 128
#define TBK 64
#define TLD 72  // shared row stride in 16-bit elements (144 B): conflict-free ldmatrix rows
#define TSTAGES 3
#define TTHREADS 256
// dynamic shared memory of one CTA: TSTAGES x (A tile + B tile); Python reads this value
// from tile_smem_bytes() below and opts the kernels in above 48 KiB
#define TSMEM_BYTES (TSTAGES * (TBM + TBN) * TLD * 2)

#define MODE_LSE 0
#define MODE_LSE2 1
#define MODE_G 2
#define MODE_H 3
#define MODE_CLIP 4

#define CPN_LOG2E 1.4426950408889634f
#define CPN_LN2 0.6931471805599453f

template <typename T> struct Mma;
template <> struct Mma<bf16_t> {
    static __device__ __forceinline__ void run(float* d, const unsigned* a, const unsigned* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
template <> struct Mma<f16_t> {
    static __device__ __forceinline__ void run(float* d, const unsigned* a, const unsigned* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
// 16-byte async copy; bytes = 0 zero-fills the destination (out-of-range rows / k).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait_stages() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(TSTAGES - 2));
}
// four 8x8 16-bit matrices from shared memory; lane l gives the address of row (l & 7) of
// matrix (l >> 3); register k receives matrix k in the mma fragment layout
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// max that keeps a NaN once seen (fmaxf would drop it)
__device__ __forceinline__ float nanmax(float a, float b) { return (b > a || b != b) ? b : a; }

// (m, l) with l = sum 2^(x - m): fold in another such pair (NaN-propagating)
__device__ __forceinline__ void lse2_merge(float& m, float& l, float om, float ol) {
    const float ninf = -cpn_inf<float>();
    if (om != om || m != m) { m = cpn_nan<float>(); l = m; return; }
    if (om == ninf) return;
    if (m == ninf) { m = om; l = ol; return; }
    if (om > m) { l = l * exp2f(m - om) + ol; m = om; }
    else { l += ol * exp2f(om - m); }
}

template <typename T> __device__ __forceinline__ unsigned pack2(float x, float y) {
    const T a = Conv<T>::store(x), b = Conv<T>::store(y);
    return (unsigned)a.bits | ((unsigned)b.bits << 16);
}

template <typename T, int MODE>
__device__ __forceinline__ void tile_body(
    const T* __restrict__ A, i64 lda, int rows, int row0,
    const T* __restrict__ B1, i64 ldb1, int n1,
    const T* __restrict__ B2, i64 ldb2, int n2, int d,
    float scale_mul, const float* __restrict__ scale_log,
    int exclude_diag, int pos_shift, int pos_mod,
    float* __restrict__ part_m, float* __restrict__ part_s, i64 part_ld,
    float* __restrict__ pos_out, float* __restrict__ colp_m, float* __restrict__ colp_s,
    const float* __restrict__ lse_row, const float* __restrict__ lse_col,
    const float* __restrict__ w_ptr, i64 w_stride, float w_mul,
    T* __restrict__ g, i64 ldg, float* __restrict__ dsp_part)
{
    extern __shared__ __align__(16) unsigned short smem[];
    unsigned short* sA = smem;                          // [TSTAGES][TBM * TLD]
    unsigned short* sB = smem + TSTAGES * TBM * TLD;    // [TSTAGES][TBN * TLD]
    __shared__ float red[2][4][TBN];

    const float ninf = -cpn_inf<float>();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;  // 4 x 2 warps, each 32 rows x 64 columns
    const int gq = lane >> 2, cq = lane & 3;
    const int m0 = blockIdx.x * TBM;
    const int ncols = n1 + n2;
    const int ntiles = (ncols + TBN - 1) / TBN;
    const int split = blockIdx.y, splits = gridDim.y;
    const int my_tiles = ntiles > split ? (ntiles - split + splits - 1) / splits : 0;
    const int KT = (d + TBK - 1) / TBK;
    const int total = my_tiles * KT;
    const float scale = scale_log ? scale_mul * expf(scale_log[0]) : scale_mul;
    const float sl2 = scale * CPN_LOG2E;  // logits in base-2 units: t = acc * sl2

    // per-thread rows: (i, h) -> local row m0 + wm*32 + i*16 + h*8 + gq
    float rm[2][2], rl[2][2], rx[2][2], li2[2][2], wi[2][2];
    int gi[2][2];
    bool rv[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int lr = m0 + wm * 32 + i * 16 + h * 8 + gq;
            rv[i][h] = lr < rows;
            gi[i][h] = row0 + lr;
            rm[i][h] = ninf; rl[i][h] = 0.f; rx[i][h] = 0.f;
            li2[i][h] = 0.f; wi[i][h] = 0.f;
            if (MODE >= MODE_G && rv[i][h]) {
                li2[i][h] = lse_row[gi[i][h]] * CPN_LOG2E;
                wi[i][h] = w_mul * (w_ptr ? w_ptr[(i64)gi[i][h] * w_stride] : 1.f);
            }
        }

    auto load = [&](int it, int stage) {
        const int ct = split + (it / KT) * splits;
        const int k0 = (it % KT) * TBK;
        const int n0 = ct * TBN;
#pragma unroll
        for (int q = tid; q < TBM * (TBK / 8); q += TTHREADS) {
            const int r = q >> 3, kc = (q & 7) * 8;
            const int row = m0 + r;
            const bool ok = row < rows && k0 + kc < d;
            const T* src = ok ? A + (i64)row * lda + k0 + kc : A;
            cp_async16(smem_u32(sA + stage * TBM * TLD + r * TLD + kc), src, ok ? 16 : 0);
        }
#pragma unroll
        for (int q = tid; q < TBN * (TBK / 8); q += TTHREADS) {
            const int r = q >> 3, kc = (q & 7) * 8;
            const int col = n0 + r;
            const T* src = B1;
            bool ok = k0 + kc < d;
            if (col < n1) src = B1 + (i64)col * ldb1 + k0 + kc;
            else if (col < ncols) src = B2 + (i64)(col - n1) * ldb2 + k0 + kc;
            else ok = false;
            cp_async16(smem_u32(sB + stage * TBN * TLD + r * TLD + kc), ok ? src : B1, ok ? 16 : 0);
        }
    };

    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
    for (int st = 0; st < TSTAGES - 1; ++st) {
        if (st < total) load(st, st);
        cp_commit();
    }
    // ldmatrix lane addresses (in elements, within a stage): A rows wm*32 + i*16 + (l & 15),
    // k + (l >> 4) * 8; B rows wn*64 + (jj*2 + (l >> 4))*8 + (l & 7), k + ((l >> 3) & 1) * 8
    const int a_off = (wm * 32 + (lane & 15)) * TLD + (lane >> 4) * 8;
    const int b_off = (wn * 64 + (lane >> 4) * 8 + (lane & 7)) * TLD + ((lane >> 3) & 1) * 8;
    for (int it = 0; it < total; ++it) {
        cp_wait_stages();
        __syncthreads();  // stage it is in; every warp is done with stage it - 1
        if (it + TSTAGES - 1 < total) load(it + TSTAGES - 1, (it + TSTAGES - 1) % TSTAGES);
        cp_commit();
        const int stg = it % TSTAGES;
        const unsigned as = smem_u32(sA + stg * TBM * TLD + a_off);
        const unsigned bs = smem_u32(sB + stg * TBN * TLD + b_off);
#pragma unroll
        for (int kk = 0; kk < TBK; kk += 16) {
            unsigned af[2][4], bf[8][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) ldmatrix_x4(af[i], as + 2 * (i * 16 * TLD + kk));
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                unsigned r4[4];
                ldmatrix_x4(r4, bs + 2 * (jj * 16 * TLD + kk));
                bf[2 * jj][0] = r4[0]; bf[2 * jj][1] = r4[1];
                bf[2 * jj + 1][0] = r4[2]; bf[2 * jj + 1][1] = r4[3];
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) Mma<T>::run(acc[i][j], af[i], bf[j]);
        }
        if (it % KT != KT - 1) continue;

        // ---------------- epilogue of one 128 x 128 tile ----------------
        const int n0 = (split + (it / KT) * splits) * TBN;
        if (MODE == MODE_LSE || MODE == MODE_LSE2) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int grow = gi[i][h];
                    const int pos = (int)(((i64)grow + pos_shift) % pos_mod);
                    float v[16];
                    float tm = ninf;
#pragma unroll
                    for (int j = 0; j < 8; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = n0 + wn * 64 + j * 8 + 2 * cq + e;
                            const float a = acc[i][j][h * 2 + e];
                            float t = a * sl2;
                            if (col >= ncols || (exclude_diag && col == grow)) t = ninf;
                            if (col == pos && rv[i][h]) pos_out[grow - row0] = a * scale;
                            v[j * 2 + e] = t;
                            tm = nanmax(tm, t);
                        }
                    float m = rm[i][h], l = rl[i][h];
                    if (tm != tm) { m = tm; l = tm; }
                    else if (tm > m) { l *= exp2f(m - tm); m = tm; }
                    if (m > ninf) {
#pragma unroll
                        for (int k = 0; k < 16; ++k) l += exp2f(v[k] - m);
                    }
                    rm[i][h] = m; rl[i][h] = l;
                }
        }
        if (MODE == MODE_LSE2) {  // column partials over this CTA's 128 rows
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float cm = ninf, cl = 0.f;
#pragma unroll
                    for (int i = 0; i < 2; ++i)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            if (rv[i][h]) cm = nanmax(cm, acc[i][j][h * 2 + e] * sl2);
                    if (cm > ninf || cm != cm) {
#pragma unroll
                        for (int i = 0; i < 2; ++i)
#pragma unroll
                            for (int h = 0; h < 2; ++h)
                                if (rv[i][h]) cl += exp2f(acc[i][j][h * 2 + e] * sl2 - cm);
                    }
#pragma unroll
                    for (int o = 4; o < 32; o <<= 1) {
                        const float om = __shfl_xor_sync(0xffffffffu, cm, o);
                        const float ol = __shfl_xor_sync(0xffffffffu, cl, o);
                        lse2_merge(cm, cl, om, ol);
                    }
                    if (gq == 0) {
                        const int cc = wn * 64 + j * 8 + 2 * cq + e;
                        red[0][wm][cc] = cm;
                        red[1][wm][cc] = cl;
                    }
                }
            __syncthreads();
            if (tid < TBN && n0 + tid < ncols) {
                float cm = red[0][0][tid], cl = red[1][0][tid];
#pragma unroll
                for (int w = 1; w < 4; ++w) lse2_merge(cm, cl, red[0][w][tid], red[1][w][tid]);
                const i64 o = (i64)blockIdx.x * ncols + n0 + tid;
                colp_m[o] = cm * CPN_LN2;
                colp_s[o] = cl;
            }
            __syncthreads();
        }
        if (MODE == MODE_G || MODE == MODE_H || MODE == MODE_CLIP) {
            float lc2[16], wc[16];
            if (MODE != MODE_G) {
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = n0 + wn * 64 + j * 8 + 2 * cq + e;
                        const bool ok = col < ncols;
                        lc2[j * 2 + e] = ok ? lse_col[col] * CPN_LOG2E : 0.f;
                        wc[j * 2 + e] = ok ? w_mul * (w_ptr ? w_ptr[(i64)col * w_stride] : 1.f) : 0.f;
                    }
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (!rv[i][h]) continue;
                    const int grow = gi[i][h];
                    const int pos = (int)(((i64)grow + pos_shift) % pos_mod);
                    T* grow_ptr = g + (i64)(grow - row0) * ldg;
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        float val[2];
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = n0 + wn * 64 + j * 8 + 2 * cq + e;
                            const float t = acc[i][j][h * 2 + e] * sl2;
                            float x;
                            if (MODE == MODE_G) {
                                float p = (exclude_diag && col == grow) ? 0.f : exp2f(t - li2[i][h]);
                                if (col == pos) p -= 1.f;
                                x = wi[i][h] * scale * p;
                            } else if (MODE == MODE_H) {
                                if (col == grow) {
                                    x = 0.f;
                                } else {
                                    float p = wi[i][h] * exp2f(t - li2[i][h])
                                            + wc[j * 2 + e] * exp2f(t - lc2[j * 2 + e]);
                                    if (col == pos) p -= wi[i][h] + wc[j * 2 + e];
                                    x = scale * p;
                                }
                            } else {  // MODE_CLIP
                                float G = wi[i][h] * exp2f(t - li2[i][h])
                                        + wc[j * 2 + e] * exp2f(t - lc2[j * 2 + e]);
                                if (col == grow) G -= wi[i][h] + wc[j * 2 + e];
                                G *= 0.5f;
                                if (col < ncols) rx[i][h] += G * (t * CPN_LN2);
                                x = scale * G;
                            }
                            val[e] = x;
                        }
                        const int col = n0 + wn * 64 + j * 8 + 2 * cq;
                        if (col + 1 < ncols) {
                            *(unsigned*)(grow_ptr + col) = pack2<T>(val[0], val[1]);
                        } else if (col < ncols) {
                            grow_ptr[col] = Conv<T>::store(val[0]);
                        }
                    }
                }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
    }

    // ---------------- per-row results of this CTA: merge the 4 lanes, then the 2 warps ----
    if (MODE == MODE_LSE || MODE == MODE_LSE2 || MODE == MODE_CLIP) {
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float m = rm[i][h], l = rl[i][h], x = rx[i][h];
#pragma unroll
                for (int o = 1; o < 4; o <<= 1) {
                    const float om = __shfl_xor_sync(0xffffffffu, m, o);
                    const float ol = __shfl_xor_sync(0xffffffffu, l, o);
                    lse2_merge(m, l, om, ol);
                    x += __shfl_xor_sync(0xffffffffu, x, o);
                }
                rm[i][h] = m; rl[i][h] = l; rx[i][h] = x;
            }
        __syncthreads();
        if (wn == 1 && cq == 0) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int rr = wm * 32 + i * 16 + h * 8 + gq;
                    red[0][0][rr] = rm[i][h];
                    red[1][0][rr] = rl[i][h];
                    red[0][1][rr] = rx[i][h];
                }
        }
        __syncthreads();
        if (wn == 0 && cq == 0) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (!rv[i][h]) continue;
                    const int rr = wm * 32 + i * 16 + h * 8 + gq;
                    const i64 o = (i64)split * part_ld + (gi[i][h] - row0);
                    if (MODE == MODE_CLIP) {
                        dsp_part[o] = rx[i][h] + red[0][1][rr];
                    } else {
                        float m = rm[i][h], l = rl[i][h];
                        lse2_merge(m, l, red[0][0][rr], red[1][0][rr]);
                        part_m[o] = m * CPN_LN2;
                        part_s[o] = l;
                    }
                }
        }
    }
}

// Row statistics from the split partials (in split order):
//   lse_i = log sum over splits, loss_i = lse_i - pos_i
__device__ __forceinline__ void tile_finish_body(
    const float* __restrict__ part_m, const float* __restrict__ part_s, i64 part_ld,
    int splits, int rows, const float* __restrict__ pos, float* __restrict__ lse,
    float* __restrict__ loss)
{
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    Lse<float> st; st.init();
    for (int s = 0; s < splits; ++s) st.merge(part_m[(i64)s * part_ld + r], part_s[(i64)s * part_ld + r]);
    const float v = st.value();
    lse[r] = v;
    if (loss) loss[r] = v - pos[r];
}

// dscale row sums from the split partials (in split order)
__device__ __forceinline__ void tile_sum_body(
    const float* __restrict__ part, i64 part_ld, int splits, int rows, float* __restrict__ out)
{
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float a = 0.f;
    for (int s = 0; s < splits; ++s) a += part[(i64)s * part_ld + r];
    out[r] = a;
}

#define CPN_TILE_ARGS(T)                                                                   \
    const T* A, i64 lda, int rows, int row0, const T* B1, i64 ldb1, int n1,                \
    const T* B2, i64 ldb2, int n2, int d, float scale_mul, const float* scale_log,         \
    int exclude_diag, int pos_shift, int pos_mod, float* part_m, float* part_s,            \
    i64 part_ld, float* pos_out, float* colp_m, float* colp_s, const float* lse_row,       \
    const float* lse_col, const float* w_ptr, i64 w_stride, float w_mul, T* g, i64 ldg,    \
    float* dsp_part
#define CPN_TILE_PASS                                                                      \
    A, lda, rows, row0, B1, ldb1, n1, B2, ldb2, n2, d, scale_mul, scale_log, exclude_diag, \
    pos_shift, pos_mod, part_m, part_s, part_ld, pos_out, colp_m, colp_s, lse_row,         \
    lse_col, w_ptr, w_stride, w_mul, g, ldg, dsp_part

// Tensor-core tiles exist for the 16-bit types only:
// (cpn_tile_smem_<dtype> writes TSMEM_BYTES, so Python never hard-codes it)
// cpn-dtypes: f16 bf16
#define CPN_DEFINE_TILES(SUF, T)                                                           \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_lse_##SUF(CPN_TILE_ARGS(T)) { \
    tile_body<T, MODE_LSE>(CPN_TILE_PASS); }                                               \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_lse2_##SUF(CPN_TILE_ARGS(T)) { \
    tile_body<T, MODE_LSE2>(CPN_TILE_PASS); }                                              \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_g_##SUF(CPN_TILE_ARGS(T)) { \
    tile_body<T, MODE_G>(CPN_TILE_PASS); }                                                 \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_h_##SUF(CPN_TILE_ARGS(T)) { \
    tile_body<T, MODE_H>(CPN_TILE_PASS); }                                                 \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_clip_##SUF(CPN_TILE_ARGS(T)) { \
    tile_body<T, MODE_CLIP>(CPN_TILE_PASS); }                                              \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_tile_finish_##SUF(             \
    const float* part_m, const float* part_s, i64 part_ld, int splits, int rows,           \
    const float* pos, float* lse, float* loss) {                                           \
    tile_finish_body(part_m, part_s, part_ld, splits, rows, pos, lse, loss); }             \
extern "C" __global__ void cpn_tile_smem_##SUF(int* out) { out[0] = TSMEM_BYTES; }          \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_tile_sum_##SUF(                \
    const float* part, i64 part_ld, int splits, int rows, float* out) {                    \
    tile_sum_body(part, part_ld, splits, rows, out); }

CPN_DEFINE_TILES(f16, f16_t)
CPN_DEFINE_TILES(bf16, bf16_t)
