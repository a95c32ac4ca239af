// cupynce's gradient blocks around the cuBLAS products: CLIP's (also as F16x3 halves), the
// in-place G over a kept score matrix, SigLIP's row pass, and the per-query negatives'.
//
// Naming: extern "C" wrappers `cpn_<stage>_<dtype>`, dtype in {f16, bf16, f32, f64}.
// T is the storage type of inputs and of the gradient matrix fed back to cuBLAS;
// A (float, or double for f64) is the type of the score matrix S and of every accumulator.
// Every reduction is a fixed-order tree inside one block or a sequential loop: no atomics,
// so results are bitwise reproducible.
#include "include/common.cuh"

// CLIP gradient of a row block: block per row r (global i).
//   G_ij = 1/2 [ w_i (exp(L_ij - lse_row_i) - d_ij) + w_j (exp(L_ij - lse_col_j) - d_ij) ]
//   g[r, j] = scale * G_ij (the gradient w.r.t. the raw product a_i . b_j)
//   dscale_part[i] = sum_j G_ij L_ij (row share of d loss / d logit_scale; null: not wanted)
// scale = scale_mul * (scale_log ? exp(*scale_log) : 1).  Also the block of two disjoint row
// sets of one symmetric softmax (a global NT-Xent's off-diagonal rank block: row0 past the
// columns, so no d_ij, and w doubled: G = H = w_i p_i(j) + w_j p_j(i)).
template <typename T, typename A>
__device__ __forceinline__ void clip_grad_body(
    const A* __restrict__ s, i64 ld, int n, int row0,
    const A* __restrict__ scale_log, A scale_mul,
    const A* __restrict__ lse_row, const A* __restrict__ lse_col,
    const A* __restrict__ w_ptr, i64 w_stride, A w_mul,
    T* __restrict__ g, i64 ldg, A* __restrict__ dscale_part)
{
    __shared__ A sh[64];
    enum { V = 16 / sizeof(A) };
    const int r = blockIdx.x;
    const int i = row0 + r;
    const A scale = scale_log ? scale_mul * cpn_exp(scale_log[0]) : scale_mul;
    const A* row = s + (i64)r * ld;
    T* grow = g + (i64)r * ldg;
    const A lr = lse_row[i];
    const A wi = w_mul * (w_ptr ? w_ptr[(i64)i * w_stride] : A(1));
    A acc = A(0);
    auto grad = [&](int j, A sj, A lc) {
        const A wj = w_mul * (w_ptr ? w_ptr[(i64)j * w_stride] : A(1));
        const A L = scale * sj;
        A G = wi * cpn_exp(L - lr) + wj * cpn_exp(L - lc);
        if (j == i) G -= wi + wj;
        G *= A(0.5);
        acc += G != A(0) ? G * L : A(0);  // (a masked pair: G = 0, L = -inf)
        return scale * G;
    };
    int j1 = 0;  // (the columns from j1 on: one at a time)
    // 16-byte loads and stores where every row, lse_col and g (of A itself) allow them
    // (uniform over the grid); thread t takes the vectors t, t + B, ... in order
    if (sizeof(T) == sizeof(A) && (unsigned long long)s % 16 == 0 && ld % V == 0 &&
        (unsigned long long)g % 16 == 0 && ldg % V == 0 && (unsigned long long)lse_col % 16 == 0) {
        j1 = n / V * V;
        for (int j = V * threadIdx.x; j < j1; j += V * blockDim.x) {
            const Vec16<A> sv = *reinterpret_cast<const Vec16<A>*>(row + j);
            const Vec16<A> lv = *reinterpret_cast<const Vec16<A>*>(lse_col + j);
            Vec16<A> o;
#pragma unroll
            for (int e = 0; e < V; ++e) o.x[e] = grad(j + e, sv.x[e], lv.x[e]);
            *reinterpret_cast<Vec16<A>*>(grow + j) = o;
        }
    }
    for (int j = j1 + threadIdx.x; j < n; j += blockDim.x)
        grow[j] = Conv<T>::store(grad(j, row[j], lse_col[j]));
    if (dscale_part) {  // (uniform over the block: every thread reaches block_sum)
        acc = block_sum(acc, sh);
        if (threadIdx.x == 0) dscale_part[i] = acc;
    }
}

// The gradient block of a kept square score matrix, for 16-bit T, written in place over the
// float32 row it is computed from (one block per row r, global row i = row0 + r):
//   L = scale * S_ij,  G_ij = factor * (w_i e^(L - lse_row_i) + w_j e^(L - lse_col_j)
//                                       - [j == pos_i] (w_i + w_j)),   g = scale * G,
//   pos_i = (i + pos_shift) % pos_mod; column i gives 0 when exclude_diag.
// CLIP (factor 1/2, pos_i = i, lse_col its column statistics): clip_grad_body's G, the same
// operations per element, with dscale_part[i] = sum_j G_ij L_ij (summed per thread over its
// vectors, then block_sum: a fixed order, its own).  NT-Xent (factor 1, the diagonal
// excluded, lse_col = lse_row): H = G + G^T of its symmetric S, whose one product H Z gives
// dZ (dscale_part null).
// G's row r starts where S's does (g == s as bytes, ldg == 2 ld in a 16-bit T), so that a kept
// score matrix needs no second buffer for G (4 N^2 bytes, not 6: N = 16384 fits 1 GiB); for
// T == A (float32, float64: defined for every dtype, used for 16-bit inputs) G_j is S_j's own
// slot.  G_j's bytes overlap S_{j/2} (or S_j), read in the same or an earlier round; every
// round reads its S values into registers, then the block synchronises, then writes them: no
// thread's store lands on a value another thread has still to read.  Hence neither pointer is
// __restrict__ (the barrier also keeps the compiler from moving a store above a load) and the
// loop runs in uniform rounds of V * blockDim.x columns: V = 16 / sizeof(A) columns a thread
// (one 16-byte load of S and of lse_col, one store of V T's) where every row and lse_col are
// 16-byte aligned (uniform over the grid), else V = 1 (the bandwidth: a 16384^2 block read
// one float at a time between barriers is latency-bound).
template <typename T, int V> struct alignas(V * sizeof(T)) VecOut { T x[V]; };  // V T's, one store

template <typename T, typename A, int V>
__device__ __forceinline__ A grad_inplace_run(
    A* s, i64 ld, int n, int r, int i, int pos, int diag, A factor, A scale,
    const A* __restrict__ lse_col, const A* __restrict__ w_ptr, i64 w_stride, A w_mul,
    A lr, A wi)
{
    typedef VecOut<T, V> Out;
    const A* row = s + (i64)r * ld;
    T* grow = reinterpret_cast<T*>(s + (i64)r * ld);
    A acc = A(0);
    for (int j0 = 0; j0 < n; j0 += V * blockDim.x) {
        const int j = j0 + V * threadIdx.x;
        A sv[V], lv[V], out[V];
        if (j + V <= n) {  // (a whole vector; a row's last, partial one element-wise below)
            if (V > 1) {
                const Vec16<A> a = *reinterpret_cast<const Vec16<A>*>(row + j);
                const Vec16<A> b = *reinterpret_cast<const Vec16<A>*>(lse_col + j);
#pragma unroll
                for (int e = 0; e < V; ++e) { sv[e] = a.x[e]; lv[e] = b.x[e]; }
            } else {
                sv[0] = row[j]; lv[0] = lse_col[j];
            }
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e) {
                sv[e] = j + e < n ? row[j + e] : A(0);
                lv[e] = j + e < n ? lse_col[j + e] : A(0);
            }
        }
#pragma unroll
        for (int e = 0; e < V; ++e) {
            const int c = j + e;
            out[e] = A(0);
            if (c < n && c != diag) {
                const A wj = w_mul * (w_ptr ? w_ptr[(i64)c * w_stride] : A(1));
                const A L = scale * sv[e];
                A G = wi * cpn_exp(L - lr) + wj * cpn_exp(L - lv[e]);
                if (c == pos) G -= wi + wj;
                G *= factor;
                acc += G != A(0) ? G * L : A(0);  // (a masked pair: G = 0, L = -inf)
                out[e] = scale * G;
            }
        }
        __syncthreads();  // (every read of this round before any write of it)
        if (j + V <= n) {
            Out o;
#pragma unroll
            for (int e = 0; e < V; ++e) o.x[e] = Conv<T>::store(out[e]);
            *reinterpret_cast<Out*>(grow + j) = o;
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e)
                if (j + e < n) grow[j + e] = Conv<T>::store(out[e]);
        }
    }
    return acc;
}

template <typename T, typename A>
__device__ __forceinline__ void grad_inplace_body(
    A* s, i64 ld, int n, int row0, int pos_shift, int pos_mod, int exclude_diag, A factor,
    const A* __restrict__ scale_log, A scale_mul,
    const A* __restrict__ lse_row, const A* __restrict__ lse_col,
    const A* __restrict__ w_ptr, i64 w_stride, A w_mul, A* __restrict__ dscale_part)
{
    __shared__ A sh[64];
    enum { V = 16 / sizeof(A) };
    const int r = blockIdx.x;
    const int i = row0 + r;
    const int pos = (i + pos_shift) % pos_mod;
    const int diag = exclude_diag ? i : -1;
    const A scale = scale_log ? scale_mul * cpn_exp(scale_log[0]) : scale_mul;
    const A lr = lse_row[i];
    const A wi = w_mul * (w_ptr ? w_ptr[(i64)i * w_stride] : A(1));
    A acc;
    if ((unsigned long long)s % 16 == 0 && ld % V == 0 && (unsigned long long)lse_col % 16 == 0)
        acc = grad_inplace_run<T, A, V>(s, ld, n, r, i, pos, diag, factor, scale, lse_col,
                                        w_ptr, w_stride, w_mul, lr, wi);
    else
        acc = grad_inplace_run<T, A, 1>(s, ld, n, r, i, pos, diag, factor, scale, lse_col,
                                        w_ptr, w_stride, w_mul, lr, wi);
    if (dscale_part) {  // (uniform over the block: every thread reaches block_sum)
        acc = block_sum(acc, sh);
        if (threadIdx.x == 0) dscale_part[i] = acc;
    }
}

// SigLIP row pass: one block per row r (global row i = row0 + r) of a raw score block S
// (S_ij = a_i . b_j; n columns, leading dim ld).  With scale = exp(*scale_log), L_ij =
// scale * S_ij + *bias and z_ij = +1 for j == i, -1 otherwise (no softmax: every pair alone):
//   loss_out[i]   = sum_j softplus(-z_ij L_ij)                              (null: not wanted)
//   when g != null, with v_i = w_ptr ? w_ptr[i * w_stride] : 1 and
//   G'_ij = -v_i z_ij sigmoid(-z_ij L_ij), G_ij = w_mul G'_ij (the gradient w.r.t. L_ij):
//     g[r, j]        = scale * G'_ij  (w_mul is the products' alpha: at SigLIP's start, the
//                      negatives' 10 sigmoid(-10) / N would underflow float16 for N >~ 16k)
//     dscale_part[i] = sum_j G_ij (L_ij - bias),  dbias_part[i] = sum_j G_ij
// softplus(-x) = max(-x, 0) + log1p(e) and sigmoid(-x) from the same e = exp(-|x|): finite
// for any finite logit; a NaN score gives NaN.  g may alias s (each element is read, then
// written, by one thread): neither is __restrict__.
template <typename T, typename A>
__device__ __forceinline__ void siglip_rows_body(
    const A* s, i64 ld, int n, int row0,
    const A* __restrict__ scale_log, const A* __restrict__ bias_ptr,
    A* __restrict__ loss_out, T* g, i64 ldg,
    const A* __restrict__ w_ptr, i64 w_stride, A w_mul,
    A* __restrict__ dscale_part, A* __restrict__ dbias_part)
{
    __shared__ A sh[64];
    const int r = blockIdx.x;
    const int i = row0 + r;
    const A scale = cpn_exp(scale_log[0]);
    const A bias = bias_ptr[0];
    const A* row = s + (i64)r * ld;
    T* grow = g ? g + (i64)r * ldg : (T*)0;
    const A vi = w_ptr ? w_ptr[(i64)i * w_stride] : A(1);
    A loss = A(0), dsc = A(0), dbi = A(0);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const A raw = row[j];  // (read before g, which may alias s, is written)
        const A L = scale * raw + bias;
        const A zl = (j == i) ? L : -L;
        const A e = cpn_exp(-cpn_abs(zl));
        if (loss_out) loss += (zl < A(0) ? -zl : A(0)) + cpn_log1p(e);
        if (grow) {
            const A sg = (zl > A(0) ? e : A(1)) / (A(1) + e);  // sigmoid(-zl)
            const A Gp = (j == i) ? -vi * sg : vi * sg;
            const A G = w_mul * Gp;
            dsc += G * (scale * raw);
            dbi += G;
            grow[j] = Conv<T>::store(scale * Gp);
        }
    }
    // (uniform over the block: every thread reaches each block_sum)
    if (loss_out) {
        loss = block_sum(loss, sh);
        if (threadIdx.x == 0) loss_out[i] = loss;
    }
    if (grow) {
        dsc = block_sum(dsc, sh);
        dbi = block_sum(dbi, sh);
        if (threadIdx.x == 0) { dscale_part[i] = dsc; dbias_part[i] = dbi; }
    }
}

// Gradient of the paired negatives; block per query i, threads over d:
//   dq_acc[i, :] += sum_m g2[i, m] * neg[i, m, :]   (sequential over m)
//   dneg[i, m, :] = g2[i, m] * q[i, :]
template <typename T, typename A>
__device__ __forceinline__ void paired_grad_body(
    const T* __restrict__ q, i64 ldq, const T* __restrict__ neg, const A* __restrict__ g2,
    int m, int d, A* __restrict__ dq_acc, A* __restrict__ dneg)
{
    const i64 i = blockIdx.x;
    const A* gi = g2 + i * m;
    for (int k = threadIdx.x; k < d; k += blockDim.x) {
        const A qk = Conv<T>::load(q[i * ldq + k]);
        A acc = dq_acc[i * d + k];
        for (int t = 0; t < m; ++t) {
            const i64 off = (i * m + t) * d + k;
            acc += gi[t] * Conv<T>::load(neg[off]);
            dneg[off] = gi[t] * qk;
        }
        dq_acc[i * d + k] = acc;
    }
}

// ---- extern "C" wrappers, one per dtype --------------------------------------------
#define CPN_DEFINE(SUF, T, A)                                                              \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_clip_grad_##SUF(               \
    const A* s, i64 ld, int n, int row0, const A* scale_log, A scale_mul,                  \
    const A* lse_row, const A* lse_col, const A* w_ptr, i64 w_stride, A w_mul, T* g,       \
    i64 ldg, A* dscale_part) {                                                             \
    clip_grad_body<T, A>(s, ld, n, row0, scale_log, scale_mul, lse_row, lse_col, w_ptr,    \
        w_stride, w_mul, g, ldg, dscale_part); }                                           \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_siglip_rows_##SUF(             \
    const A* s, i64 ld, int n, int row0, const A* scale_log, const A* bias, A* loss_out,   \
    T* g, i64 ldg, const A* w_ptr, i64 w_stride, A w_mul, A* dscale_part,                  \
    A* dbias_part) {                                                                       \
    siglip_rows_body<T, A>(s, ld, n, row0, scale_log, bias, loss_out, g, ldg, w_ptr,       \
        w_stride, w_mul, dscale_part, dbias_part); }                                       \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_paired_grad_##SUF(             \
    const T* q, i64 ldq, const T* neg, const A* g2, int m, int d, A* dq_acc, A* dneg) {    \
    paired_grad_body<T, A>(q, ldq, neg, g2, m, d, dq_acc, dneg); }

// the in-place G (used for 16-bit inputs)
#define CPN_DEFINE_INPLACE(SUF, T, A)                                                      \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_grad_inplace_##SUF(            \
    A* s, i64 ld, int n, int row0, int pos_shift, int pos_mod, int exclude_diag, A factor,  \
    const A* scale_log, A scale_mul, const A* lse_row, const A* lse_col, const A* w_ptr,    \
    i64 w_stride, A w_mul, A* dscale_part) {                                               \
    grad_inplace_body<T, A>(s, ld, n, row0, pos_shift, pos_mod, exclude_diag, factor,      \
        scale_log, scale_mul, lse_row, lse_col, w_ptr, w_stride, w_mul, dscale_part); }

CPN_DEFINE(f16, f16_t, float)
CPN_DEFINE(bf16, bf16_t, float)
CPN_DEFINE(f32, float, float)
CPN_DEFINE(f64, double, double)
CPN_DEFINE_INPLACE(f16, f16_t, float)
CPN_DEFINE_INPLACE(bf16, bf16_t, float)
CPN_DEFINE_INPLACE(f32, float, float)
CPN_DEFINE_INPLACE(f64, double, double)

// ---- CLIP's gradient block as F16x3 halves (float32; tiles_f16x3, issue 24) ----------------
// clip_grad_body's G for one row r (global i), written in place over the row of s (leading
// dimension ld, a multiple of 64) as tiles_ws_f16x3.cu's interleaved halves of G 2^e: per
// 64-column group, its 64 hi then its 64 lo float16 in the group's 256 bytes (columns n .. of
// the last group zero).  No scale in G (|G_ij| <= max |w|, whose exponent is *e_ptr, else
// e_host; e = that - 1 puts G 2^e below 2^14, a 2x margin against float16's 65504 for an lse
// given from elsewhere): the products take scale 2^-e from *ufac (written by block 0, thread
// 0).  dscale_part[i] = sum_j G_ij L_ij as clip_grad.  A group is one half-warp's 16 float4
// (all read before any is written, __syncwarp: in place); 256 threads.
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_clip_grad_f16x3(
    float* s, i64 ld, int n, int row0, const float* __restrict__ scale_log, float scale_mul,
    const float* __restrict__ lse_row, const float* __restrict__ lse_col,
    const float* __restrict__ w_ptr, i64 w_stride, float w_mul, const int* __restrict__ e_ptr,
    int e_host, float* ufac, float* dscale_part)
{
    __shared__ float sh[64];
    const int r = blockIdx.x, i = row0 + r;
    const float scale = scale_log ? scale_mul * cpn_exp(scale_log[0]) : scale_mul;
    const int e = (e_ptr ? *e_ptr : e_host) - 1;  // (|G| 2^e below 2^14: a 2x margin)
    const float s2 = f16x3_pow2(e);
    if (ufac && r == 0 && threadIdx.x == 0) ufac[0] = scale * f16x3_pow2(-e);
    float* const row = s + (i64)r * ld;
    const float lr = lse_row[i];
    const float wi = w_mul * (w_ptr ? w_ptr[(i64)i * w_stride] : 1.f);
    const int hw = threadIdx.x >> 4, l = threadIdx.x & 15;
    const int groups = (n + 63) / 64;
    float acc = 0.f;
    for (int q0 = 0; q0 < groups; q0 += CPN_BLOCK / 16) {  // (uniform: every lane syncs)
        const int q = q0 + hw, c = 64 * q + 4 * l;
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (q < groups && c + 3 < n) {
            const float4 x = *(const float4*)(row + c);
            v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
        } else if (q < groups) {
            for (int k = 0; k < 4 && c + k < n; ++k) v[k] = row[c + k];
        }
        __syncwarp();
        if (q >= groups) continue;
        unsigned short h[4], lo[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            h[k] = lo[k] = 0;
            const int j = c + k;
            if (j < n) {
                const float wj = w_mul * (w_ptr ? w_ptr[(i64)j * w_stride] : 1.f);
                const float L = scale * v[k];
                // (clip_grad_body's G, the same operations)
                float G = wi * cpn_exp(L - lr) + wj * cpn_exp(L - lse_col[j]);
                if (j == i) G -= wi + wj;
                G *= 0.5f;
                acc += G != 0.f ? G * L : 0.f;  // (a masked pair: G = 0, L = -inf)
                f16x3_split(G, s2, h[k], lo[k]);
            }
        }
        unsigned short* const gb = (unsigned short*)(row + 64 * q);
        *(uint2*)(gb + 4 * l) = make_uint2(h[0] | ((unsigned)h[1] << 16), h[2] | ((unsigned)h[3] << 16));
        *(uint2*)(gb + 64 + 4 * l) =
            make_uint2(lo[0] | ((unsigned)lo[1] << 16), lo[2] | ((unsigned)lo[3] << 16));
    }
    if (dscale_part) {
        acc = block_sum(acc, sh);
        if (threadIdx.x == 0) dscale_part[i] = acc;
    }
}
