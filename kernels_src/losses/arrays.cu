// cupynce's small per-row array kernels every op shares: the reduced loss's sums, the device
// logit-scale guard, L2 normalisation and its backward, the final scale-and-cast of an
// accumulated gradient, and the CUDA graphs' gather of small outputs.
//
// Naming: extern "C" wrappers `cpn_<stage>_<dtype>`, dtype in {f16, bf16, f32, f64}.
// T is the storage type of inputs and of the gradient matrix fed back to cuBLAS;
// A (float, or double for f64) is the type of the score matrix S and of every accumulator.
// Every reduction is a fixed-order tree inside one block or a sequential loop: no atomics,
// so results are bitwise reproducible.
#include "include/common.cuh"

// The reduced loss: out[0] = (sum of x[0..n)) / divisor in one block, in a fixed order
// (thread t adds x[t], x[t + B], ... in turn, then a fixed tree over the threads): the same
// bits on every run, and one small launch where CuPy's mean / sum take several.  Block b of
// the launch sums row b of a (gridDim.x, n) array into out[b] (one launch for several sums).
template <typename A>
__device__ __forceinline__ void sum_rows_body(const A* __restrict__ x, i64 n, A divisor,
                                              A* __restrict__ out)
{
    __shared__ A sh[CPN_BLOCK];
    A s = A(0);
    for (i64 i = threadIdx.x; i < n; i += CPN_BLOCK) s += x[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = CPN_BLOCK / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = sh[0] / divisor;
}

// The device logit-scale guard (arrays.guard_log_scale): y = x, NaN where x > limit (a log
// scale whose exp overflows float32) -- a device value is never read on the host, so past
// the limit it poisons the loss and the gradients instead.  (NaN compares false: kept.)
template <typename A>
__device__ __forceinline__ void guard_log_scale_body(const A* __restrict__ x, i64 n, A limit,
                                                     A* __restrict__ y)
{
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (i64)gridDim.x * blockDim.x)
        y[k] = x[k] > limit ? cpn_nan<A>() : x[k];
}

// Row L2 normalisation, as F.normalize: xn = x / max(||x||, eps).  A row takes `wpr` warps
// (1, 2, 4 or 8; a block holds (CPN_BLOCK / 32) / wpr rows), so that each lane sums at most
// ~64 of its entries (arrays.normalize picks wpr from D): a block per row left most threads
// idle at D = 128 and paid two block barriers a row (MoCo's 65536-key queue took ~80 us, 8x
// its bytes' time), a warp per row left the GPU nearly empty at few wide rows (8 x 32768:
// 4.5x F.normalize's time).  With wpr = 1 there is no block barrier; with wpr > 1 every
// thread of the block reaches each one (rows past n load nothing).  The sums run in a fixed
// order (group-strided, the warp's xor tree, then the row's warps in order): deterministic.

// The row's sum (or max) of the group's values: warp_reduce, then (wpr > 1) the row's warps'
// results from `red` (CPN_BLOCK / 32 slots) in warp order.  Every thread gets the same bits.
template <typename A, typename Op>
__device__ __forceinline__ A row_group_reduce(A v, Op op, int wpr, A* red) {
    v = warp_reduce(v, op);
    if (wpr == 1) return v;
    const int warp = threadIdx.x >> 5;
    __syncthreads();  // red's previous readers are done
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    const int g0 = warp & ~(wpr - 1);
    A t = red[g0];
    for (int k = 1; k < wpr; ++k) t = op(t, red[g0 + k]);
    return t;
}

template <typename T, typename A>
__device__ __forceinline__ void l2norm_fwd_body(
    const T* __restrict__ x, i64 ldx, i64 n, int d, A eps, T* __restrict__ xn,
    A* __restrict__ norm, int wpr)
{
    __shared__ A red[CPN_BLOCK / 32];
    const int warp = threadIdx.x >> 5;
    const int gl = (warp & (wpr - 1)) * 32 + (threadIdx.x & 31), gs = 32 * wpr;
    const i64 i = (i64)blockIdx.x * ((blockDim.x >> 5) / wpr) + warp / wpr;
    const bool live = i < n;
    if (wpr == 1 && !live) return;  // (uniform over the warp; no block barrier below)
    const T* xi = x + (live ? i : 0) * ldx;
    A ss = A(0);
    if (live)
        for (int k = gl; k < d; k += gs) { A v = Conv<T>::load(xi[k]); ss += v * v; }
    ss = row_group_reduce(ss, SumOp(), wpr, red);
    A nrm = cpn_sqrt(ss);
    const bool over = live && nrm == cpn_inf<A>();
    // (uniform: over the warp -- every lane holds the row's sum -- or, wpr > 1, the block)
    if (wpr == 1 ? over : __syncthreads_or(over)) {
        // the sum of squares overflowed (|x| >~ 1.8e19 in float32): ||x|| = m ||x / m|| with
        // m = max |x_k|, as F.normalize gets it; an inf entry keeps ||x|| = inf
        A m = A(0);
        if (over)
            for (int k = gl; k < d; k += gs) {
                const A v = cpn_abs(Conv<T>::load(xi[k]));
                m = v > m ? v : m;
            }
        m = row_group_reduce(m, MaxOp(), wpr, red);
        const bool rescale = over && m < cpn_inf<A>();
        A s2 = A(0);
        if (rescale)  // (x / m, not x * (1 / m): 1 / m may be subnormal, flushed)
            for (int k = gl; k < d; k += gs) {
                const A v = Conv<T>::load(xi[k]) / m;
                s2 += v * v;
            }
        s2 = row_group_reduce(s2, SumOp(), wpr, red);
        if (rescale) nrm = m * cpn_sqrt(s2);
    }
    if (!live) return;  // (after the last barrier)
    const A den = nrm > eps ? nrm : eps;
    const A inv = A(1) / den;
    if (inv >= cpn_min_normal<A>()) {
        for (int k = gl; k < d; k += gs)
            xn[i * d + k] = Conv<T>::store(Conv<T>::load(xi[k]) * inv);
    } else {  // ||x|| > 2^126 (float32): 1 / ||x|| would flush to 0 (-ftz); divide instead
        for (int k = gl; k < d; k += gs)
            xn[i * d + k] = Conv<T>::store(Conv<T>::load(xi[k]) / den);
    }
    if (gl == 0) norm[i] = nrm;
}

// Backward of the normalisation, times the upstream scalar *g (when g != null), `wpr` warps
// per row as the forward:
//   dx = g * (dxn - [||x|| > eps] xn (xn . dxn)) / max(||x||, eps)
template <typename T, typename A>
__device__ __forceinline__ void l2norm_bwd_body(
    const T* __restrict__ x, i64 ldx, i64 n, int d, A eps, const A* __restrict__ norm,
    const A* __restrict__ dxn, const A* __restrict__ g, T* __restrict__ dx, int wpr)
{
    __shared__ A red[CPN_BLOCK / 32];
    const int warp = threadIdx.x >> 5;
    const int gl = (warp & (wpr - 1)) * 32 + (threadIdx.x & 31), gs = 32 * wpr;
    const i64 i = (i64)blockIdx.x * ((blockDim.x >> 5) / wpr) + warp / wpr;
    const bool live = i < n;
    if (wpr == 1 && !live) return;
    const T* xi = x + (live ? i : 0) * ldx;
    const A nrm = live ? norm[i] : A(1);
    const A den = nrm > eps ? nrm : eps;
    const A inv = A(1) / den;
    A dot = A(0);
    if (live)
        for (int k = gl; k < d; k += gs)
            dot += Conv<T>::load(xi[k]) * inv * dxn[i * d + k];
    dot = row_group_reduce(dot, SumOp(), wpr, red);
    if (!live) return;  // (after the barrier)
    const A proj = nrm > eps ? dot : A(0);
    const A gs_ = g ? g[0] : A(1);
    for (int k = gl; k < d; k += gs) {
        const A xn = Conv<T>::load(xi[k]) * inv;
        dx[i * d + k] = Conv<T>::store(gs_ * (dxn[i * d + k] - xn * proj) * inv);
    }
}

// Four fp32 accumulators per 16-byte load and four T per store, for aligned buffers; returns
// how many leading elements it handled (0: not float or not aligned).  Same arithmetic per
// element as the scalar loop: one fp32 product, one rounding.
template <typename T> struct alignas(4 * sizeof(T)) Vec4 { T v[4]; };
template <typename T, typename A> struct CastVec {
    static __device__ __forceinline__ i64 run(const A*, i64, A, T*) { return 0; }
};
template <typename T> struct CastVec<T, float> {
    static __device__ __forceinline__ i64 run(const float* __restrict__ acc, i64 n, float gs,
                                              T* __restrict__ out) {
        if (((size_t)acc & 15) || ((size_t)out & (4 * sizeof(T) - 1))) return 0;
        const i64 n4 = n >> 2;
        for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < n4; q += (i64)gridDim.x * blockDim.x) {
            const float4 v = reinterpret_cast<const float4*>(acc)[q];
            Vec4<T> o;
            o.v[0] = Conv<T>::store(v.x * gs); o.v[1] = Conv<T>::store(v.y * gs);
            o.v[2] = Conv<T>::store(v.z * gs); o.v[3] = Conv<T>::store(v.w * gs);
            reinterpret_cast<Vec4<T>*>(out)[q] = o;
        }
        return n4 * 4;
    }
};

// out[k] = T(acc[k] * (g ? *g : 1)): the final cast of an accumulated gradient.
template <typename T, typename A>
__device__ __forceinline__ void scale_cast_body(
    const A* __restrict__ acc, i64 n, const A* __restrict__ g, T* __restrict__ out)
{
    const A gs = g ? g[0] : A(1);
    const i64 done = CastVec<T, A>::run(acc, n, gs, out);
    for (i64 k = done + (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (i64)gridDim.x * blockDim.x)
        out[k] = Conv<T>::store(acc[k] * gs);
}

// ---- class sums (ops/_variants.py's SupCon terms; arrays.class_sums) -----------------
// Rows grouped by label: order[k] is the row at sorted position k, sl[k] its label (sorted).
// Two passes, each sum in a fixed order (the same bits on every run, no atomics):
//   seg_partial: each run of equal labels inside a chunk of CPN_SEG_CHUNK sorted positions
//     sums its rows (times w[row] when given) into part at the run's first position;
//   seg_heads: at each label's first position k, the class total = that partial plus the
//     partials at the chunk starts inside the class (before end[k]), in order, in place
//     (those partials belong to this class alone: no other thread reads or writes them).
// A class of c rows costs c adds per column in the first pass, spread over c / CPN_SEG_CHUNK
// threads, and a chain of c / CPN_SEG_CHUNK adds in the second (2048 for one class of 65536
// rows: latency-bound, a fixed-order tree would shorten it).
#define CPN_SEG_CHUNK 32

template <typename T, typename A>
__device__ __forceinline__ void seg_partial_body(
    const T* __restrict__ x, i64 ldx, int d, const i64* __restrict__ order,
    const i64* __restrict__ sl, const A* __restrict__ w, i64 n, A* __restrict__ part)
{
    const int col = blockIdx.x * CPN_BLOCK + threadIdx.x;
    if (col >= d) return;
    const i64 chunks = (n + CPN_SEG_CHUNK - 1) / CPN_SEG_CHUNK;
    for (i64 c = blockIdx.y; c < chunks; c += gridDim.y) {
        const i64 k0 = c * CPN_SEG_CHUNK;
        const i64 k1 = min(n, k0 + (i64)CPN_SEG_CHUNK);
        A s = A(0);
        i64 first = k0;
        for (i64 k = k0; k < k1; ++k) {
            const i64 r = order[k];
            const A v = Conv<T>::load(x[r * ldx + col]);
            s += w ? w[r] * v : v;
            if (k + 1 == k1 || sl[k + 1] != sl[k]) {
                part[first * d + col] = s;
                s = A(0);
                first = k + 1;
            }
        }
    }
}

template <typename A>
__device__ __forceinline__ void seg_heads_body(
    const i64* __restrict__ sl, const i64* __restrict__ end, i64 n, int d, A* part)
{
    // block (sorted position k, column tile): the blocks of every position but a class's
    // first leave at once (one test a block, not one a column)
    for (i64 k = blockIdx.x; k < n; k += gridDim.x) {
        if (k > 0 && sl[k] == sl[k - 1]) continue;  // not the class's first position
        const i64 e = end[k];
        for (i64 col = (i64)blockIdx.y * CPN_BLOCK + threadIdx.x; col < d;
             col += (i64)gridDim.y * CPN_BLOCK) {
            A s = part[k * d + col];
            for (i64 c = (k / CPN_SEG_CHUNK + 1) * CPN_SEG_CHUNK; c < e; c += CPN_SEG_CHUNK)
                s += part[c * d + col];
            part[k * d + col] = s;
        }
    }
}

// SupCon's rows from NT-Xent's row softmax (ops/_variants.supcon_terms), block per row i.
// With C_i = pc[start_i] (row i's class sum of ẑ, seg_heads' layout), W_i = pw[start_i] (the
// class sum of u ẑ), c_i = stop_i - start_i - 1 (its positives) and u_i = w_i / max(c_i, 1):
//   loss_i = c_i > 0 ? lse_i - scale (ẑ_i·C_i - |ẑ_i|²) / c_i : 0              (loss given)
//   acc_i += scale (w_i ẑ_p(i) + w_q(i) ẑ_q(i) - u_i C_i - W_i + 2 u_i ẑ_i)   (acc given)
// p(i) = (i + h) mod n is the positive the softmax pass used, q its inverse; scale is
// times exp(scale_log[0]) where given.  The dot is a fixed-order block sum; one pass where
// CuPy's array expressions took fifteen.
template <typename T, typename A>
__device__ __forceinline__ void supcon_rows_body(
    const T* __restrict__ z, i64 ldz, int d, i64 n, i64 h, const i64* __restrict__ start,
    const i64* __restrict__ stop, const A* __restrict__ pc, const A* __restrict__ pw,
    const A* __restrict__ w, const A* __restrict__ lse, A scale, const A* __restrict__ scale_log,
    A* __restrict__ loss, A* __restrict__ acc, i64 ld_acc)
{
    __shared__ A sh[32];
    if (scale_log) scale *= cpn_exp(scale_log[0]);  // (a device temperature: 1/τ = exp(−log τ))
    const i64 i = blockIdx.x;
    const i64 s = start[i];
    const A cnt = A(stop[i] - s - 1);
    const T* zi = z + i * ldz;
    const A* ci = pc + s * d;
    if (loss) {
        A t = A(0);
        for (int k = threadIdx.x; k < d; k += blockDim.x) {
            const A x = Conv<T>::load(zi[k]);
            t += x * (ci[k] - x);
        }
        t = block_sum(t, sh);
        if (threadIdx.x == 0) loss[i] = cnt > A(0) ? lse[i] - scale * t / cnt : A(0);
    }
    if (acc) {
        const i64 p = (i + h) % n, q = (i - h % n + n) % n;
        const A wi = w[i], wq = w[q];
        const A u = wi / (cnt > A(1) ? cnt : A(1));
        const T* zp = z + p * ldz;
        const T* zq = z + q * ldz;
        const A* wc = pw + s * d;
        A* ai = acc + i * ld_acc;
        for (int k = threadIdx.x; k < d; k += blockDim.x)
            ai[k] += scale * (wi * Conv<T>::load(zp[k]) + wq * Conv<T>::load(zq[k]) - u * ci[k]
                              - wc[k] + A(2) * u * Conv<T>::load(zi[k]));
    }
}

// ---- extern "C" wrappers, one per dtype --------------------------------------------
#define CPN_DEFINE(SUF, T, A)                                                              \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_l2norm_fwd_##SUF(              \
    const T* x, i64 ldx, i64 n, int d, A eps, T* xn, A* norm, int wpr) {                   \
    l2norm_fwd_body<T, A>(x, ldx, n, d, eps, xn, norm, wpr); }                             \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_l2norm_bwd_##SUF(              \
    const T* x, i64 ldx, i64 n, int d, A eps, const A* norm, const A* dxn, const A* g,     \
    T* dx, int wpr) {                                                                      \
    l2norm_bwd_body<T, A>(x, ldx, n, d, eps, norm, dxn, g, dx, wpr); }                     \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_scale_cast_##SUF(              \
    const A* acc, i64 n, const A* g, T* out) {                                             \
    scale_cast_body<T, A>(acc, n, g, out); }                                               \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_seg_partial_##SUF(             \
    const T* x, i64 ldx, int d, const i64* order, const i64* sl, const A* w, i64 n,        \
    A* part) {                                                                             \
    seg_partial_body<T, A>(x, ldx, d, order, sl, w, n, part); }                            \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_supcon_rows_##SUF(             \
    const T* z, i64 ldz, int d, i64 n, i64 h, const i64* start, const i64* stop,           \
    const A* pc, const A* pw, const A* w, const A* lse, A scale, const A* scale_log,       \
    A* loss, A* acc, i64 ld_acc) {                                                         \
    supcon_rows_body<T, A>(z, ldz, d, n, h, start, stop, pc, pw, w, lse, scale, scale_log, \
                           loss, acc, ld_acc); }

#define CPN_DEFINE_ACC(SUF, A)                                                             \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_sum_rows_##SUF(                \
    const A* x, i64 n, A divisor, A* out) {                                                \
    sum_rows_body<A>(x + (i64)blockIdx.x * n, n, divisor, out + blockIdx.x); }             \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_guard_log_scale_##SUF(         \
    const A* x, i64 n, A limit, A* y) {                                                    \
    guard_log_scale_body<A>(x, n, limit, y); }                                             \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_seg_heads_##SUF(               \
    const i64* sl, const i64* end, i64 n, int d, A* part) {                                \
    seg_heads_body<A>(sl, end, n, d, part); }

CPN_DEFINE(f16, f16_t, float)
CPN_DEFINE(bf16, bf16_t, float)
CPN_DEFINE(f32, float, float)
CPN_DEFINE(f64, double, double)
CPN_DEFINE_ACC(f16, float)
CPN_DEFINE_ACC(bf16, float)
CPN_DEFINE_ACC(f32, float)
CPN_DEFINE_ACC(f64, double)

// ops/_graphs.py's pack: a graph gathers a call's small outputs into one block, copied out in
// one piece.  Range k (blockIdx.y) copies tab[3k + 2] bytes from address tab[3k] to
// dst + tab[3k + 1]; 16-byte words where both ends are 16-byte aligned, else bytes.  One
// launch where a memcpy node per output cost ~1.2 us of GPU time each (H100).
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_gather_bytes(
    const long long* __restrict__ tab, char* __restrict__ dst)
{
    const int k = blockIdx.y;
    const char* const src = (const char*)tab[3 * k];
    char* const out = dst + tab[3 * k + 1];
    const long long nb = tab[3 * k + 2];
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if ((((unsigned long long)src | (unsigned long long)out) & 15) == 0) {
        const long long nw = nb >> 4;
        for (long long w = t0; w < nw; w += stride) ((uint4*)out)[w] = ((const uint4*)src)[w];
        done = nw << 4;
    }
    for (long long b = done + t0; b < nb; b += stride) out[b] = src[b];
}
