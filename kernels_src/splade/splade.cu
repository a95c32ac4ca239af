// cupynce SPLADE head kernels, the forward: the max over the sequence around cuBLAS logit
// tiles (the fused tile paths: splade_tiles.cu, splade_wgmma.cu; the backward:
// splade_grad.cu).
//
//   out[b, v] = act(max_{l : mask[b, l]} round_T(x[b, l, :] . W[v, :] + bias[v])),  act = relu | log1p∘relu
//
// (each logit rounded to T after the bias, as F.linear gives it: splade_common.cuh spl_logit)
//
// Naming: extern "C" wrappers `cpn_<stage>_<index>_<dtype>`, index in {i16, i32} (the type of
// the stored arg-max), dtype in {f16, bf16, f32, f64}.  T is the storage type of x, W, bias,
// out and the gradients; A (float, or double for f64) is every accumulator.
// The max is merged in a fixed order: no atomics, bitwise reproducible results.
#include "include/common.cuh"
#include "splade/splade_common.cuh"

// Max over the sequence of one logit tile. ws holds the products x . W (no bias) of batches
// [b0, b0 + nb) x vocabulary [v0, v0 + vt) in the accumulator type A (cuBLAS's fp32 sums for
// half inputs, unrounded): row (bl * L + l), column j, leading dim ldw.  Each is made the
// logit spl_logit (+ bias[v], rounded to T) before the max.
// Block (32, SPL_MAX_SLICES): lane -> E = 8 / sizeof(T) consecutive columns (one load of
// E * sizeof(A) bytes when ldw is a multiple of E), warp y -> positions l = y, y +
// SPL_MAX_SLICES, ...  SPL_MAX_UNROLL rows'
// loads are issued before their compares (the loop is latency-bound otherwise).  The per-slice
// (max, arg) are merged in a fixed order.  Grid (ceil(vt / (32 SPL_E)), nb).
// Ties go to the lowest l.  A NaN logit makes the output NaN (tracked apart from the max, so
// the inner loop is one compare and two selects per element).
#define SPL_MAX_SLICES 8
#define SPL_MAX_UNROLL 4

template <typename T> struct SplVec {  // the workspace's A values of 8 bytes of T
    typedef typename Conv<T>::acc A;
    enum { E = 8 / sizeof(T) };
    struct alignas(E * sizeof(A)) type { A v[E]; };
};

// Grid (ceil(vt / (32 SPL_E)), nb, nz): block z covers the positions [z lchunk, (z+1) lchunk)
// (narrow tiles need the extra blocks to fill the GPU).  With nz == 1 the block writes out and
// arg; otherwise its (max, arg, NaN) go to the partials pv/pa/pn[(z nb + bl) vt + j], merged in
// z order by splade_max_combine.
template <typename T, typename I>
__device__ __forceinline__ void splade_max_body(
    const typename Conv<T>::acc* __restrict__ ws, i64 ldw, int L, int vt, int b0, int v0,
    int V, const unsigned char* __restrict__ mask, const T* __restrict__ bias, int act,
    T* __restrict__ out, I* __restrict__ arg, int lchunk, int stage_mask,
    typename Conv<T>::acc* __restrict__ pv, int* __restrict__ pa, unsigned char* __restrict__ pn)
{
    typedef typename Conv<T>::acc A;
    enum { E = SplVec<T>::E };
    typedef typename SplVec<T>::type Vec;
    __shared__ A sv[SPL_MAX_SLICES][32 * E];
    __shared__ int sa[SPL_MAX_SLICES][32 * E];
    __shared__ unsigned char sn[SPL_MAX_SLICES][32 * E];
    const int lane = threadIdx.x, y = threadIdx.y;
    const int jj = blockIdx.x * (32 * E) + E * lane;  // this lane's first column
    const bool vec = (ldw % E) == 0 && jj + E <= vt;
    const bool live = jj < vt;  // lanes past the tile's last column load nothing
    const int bl = blockIdx.y;
    const int b = b0 + bl;
    const A* tile = ws + (i64)bl * L * ldw + jj;
    A bj[E];  // this lane's columns' bias (constant over the positions)
#pragma unroll
    for (int e = 0; e < E; ++e)
        bj[e] = bias && jj + e < vt ? Conv<T>::load(bias[v0 + jj + e]) : A(0);
    // the row's mask, staged in shared memory: a global load there would sit between each
    // row's address and its data load (a dependent latency per step)
    // (only when the launch gives L bytes of dynamic shared memory; long sequences read it in
    // place)
    extern __shared__ unsigned char smask[];
    const bool staged = mask && stage_mask;
    if (staged) {
        for (int l = y * 32 + lane; l < L; l += 32 * SPL_MAX_SLICES) smask[l] = mask[(i64)b * L + l];
        __syncthreads();
    }
    const unsigned char* mrow = staged ? smask : mask ? mask + (i64)b * L : (const unsigned char*)0;
    A best[E];
    int win[E];
    bool nan[E];
#pragma unroll
    for (int e = 0; e < E; ++e) { best[e] = -cpn_inf<A>(); win[e] = -1; nan[e] = false; }
    const int lbeg = blockIdx.z * lchunk, lend = min(L, lbeg + lchunk);
    for (int l0 = lbeg + y; l0 < lend; l0 += SPL_MAX_SLICES * SPL_MAX_UNROLL) {
        Vec val[SPL_MAX_UNROLL];
        bool on[SPL_MAX_UNROLL];
#pragma unroll
        for (int u = 0; u < SPL_MAX_UNROLL; ++u) {
            const int l = l0 + u * SPL_MAX_SLICES;
            on[u] = live && l < lend && (!mrow || mrow[l]);
            const A* row = tile + (i64)l * ldw;
            if (on[u] && vec) {
                val[u] = *reinterpret_cast<const Vec*>(row);
            } else if (on[u]) {
#pragma unroll
                for (int e = 0; e < E; ++e) val[u].v[e] = row[jj + e < vt ? e : 0];
            }
        }
#pragma unroll
        for (int u = 0; u < SPL_MAX_UNROLL; ++u) {
            if (!on[u]) continue;
            const int l = l0 + u * SPL_MAX_SLICES;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const A s = spl_logit<T>(val[u].v[e], bj[e]);
                const bool gt = s > best[e];  // strict: the first (lowest l) of equal values
                best[e] = gt ? s : best[e];
                win[e] = gt ? l : win[e];
                nan[e] |= s != s;
            }
        }
    }
#pragma unroll
    for (int e = 0; e < E; ++e) {
        sv[y][E * lane + e] = best[e];
        sa[y][E * lane + e] = win[e];
        sn[y][E * lane + e] = nan[e];
    }
    __syncthreads();
    if (y != 0) return;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int j = jj + e;
        if (j >= vt) continue;
        A m = best[e];
        int w = win[e];
        bool isnan = nan[e];
        for (int s = 1; s < SPL_MAX_SLICES; ++s) {
            spl_merge(m, w, sv[s][E * lane + e], sa[s][E * lane + e]);
            isnan |= sn[s][E * lane + e] != 0;
        }
        if (pv) {
            const i64 p = ((i64)blockIdx.z * gridDim.y + bl) * vt + j;
            pv[p] = m;
            pa[p] = w;
            pn[p] = isnan;
        } else {
            spl_write<T, I, A>(m, w, isnan, b, j, v0, V, act, out, arg);
        }
    }
}

// Merge the nz partials of splade_max_body in z order.  Thread per (bl, j), grid
// ceil(nb vt / CPN_BLOCK).
template <typename T, typename I>
__device__ __forceinline__ void splade_max_combine_body(
    const typename Conv<T>::acc* __restrict__ pv, const int* __restrict__ pa,
    const unsigned char* __restrict__ pn, int nz, int nb, int vt, int b0, int v0, int V,
    int act, T* __restrict__ out, I* __restrict__ arg)
{
    typedef typename Conv<T>::acc A;
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (i64)nb * vt) return;
    const int bl = (int)(t / vt), j = (int)(t % vt);
    A m = pv[t];
    int w = pa[t];
    bool isnan = pn[t] != 0;
    for (int z = 1; z < nz; ++z) {
        const i64 p = (i64)z * nb * vt + t;
        spl_merge(m, w, pv[p], pa[p]);
        isnan |= pn[p] != 0;
    }
    spl_write<T, I, A>(m, w, isnan, b0 + bl, j, v0, V, act, out, arg);
}

// ---- extern "C" wrappers, one per (index type, dtype) ----------------------------------
#define SPL_MAX_ARGS(T, I) const Conv<T>::acc* ws, i64 ldw, int L, int vt, int b0, int v0, int V,           \
    const unsigned char* mask, const T* bias, int act, T* out, I* arg, int lchunk,            \
    int stage_mask, Conv<T>::acc* pv, int* pa, unsigned char* pn
#define SPL_COMBINE_ARGS(T, I) const Conv<T>::acc* pv, const int* pa, const unsigned char* pn,  \
    int nz, int nb, int vt, int b0, int v0, int V, int act, T* out, I* arg
#define SPL_DEFINE(SUF, T)                                                                   \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK)                                      \
cpn_splade_max_i16_##SUF(SPL_MAX_ARGS(T, short))                                             \
{ splade_max_body<T, short>(ws, ldw, L, vt, b0, v0, V, mask, bias, act, out, arg, lchunk,    \
                            stage_mask, pv, pa, pn); }                                                   \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK)                                      \
cpn_splade_max_i32_##SUF(SPL_MAX_ARGS(T, int))                                               \
{ splade_max_body<T, int>(ws, ldw, L, vt, b0, v0, V, mask, bias, act, out, arg, lchunk,      \
                          stage_mask, pv, pa, pn); }                                                     \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK)                                      \
cpn_splade_max_combine_i16_##SUF(SPL_COMBINE_ARGS(T, short))                                 \
{ splade_max_combine_body<T, short>(pv, pa, pn, nz, nb, vt, b0, v0, V, act, out, arg); }\
extern "C" __global__ void __launch_bounds__(CPN_BLOCK)                                      \
cpn_splade_max_combine_i32_##SUF(SPL_COMBINE_ARGS(T, int))                                   \
{ splade_max_combine_body<T, int>(pv, pa, pn, nz, nb, vt, b0, v0, V, act, out, arg); }

SPL_DEFINE(f16, f16_t)
SPL_DEFINE(bf16, bf16_t)
SPL_DEFINE(f32, float)
SPL_DEFINE(f64, double)
