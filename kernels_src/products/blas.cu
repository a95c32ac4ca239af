// cupynce small products: the matrix products of tiny ops, without cuBLAS; and the operand
// split of the 3xTF32 float32 products (cpn_split_tf32_f32, float32 only).
//
// At N = 64, D = 32 a cuBLAS call costs 25-60 µs of host time (handle, stream, heuristics)
// for a product of a few µs; a CuPy launch of this kernel costs ~10.  _blas.gemm routes
// products of at most SMALL_GEMM_MACS multiply-adds here (see cupynce/_engine/blas.py).
//
// Naming: extern "C" wrappers `cpn_small_gemm_<dtype>`, dtype in {f16, bf16, f32, f64}: the
// inputs' type T; the output is the accumulator type A (float, or double for f64).
#include "include/common.cuh"

// Row-major out[m, n] = alpha * sum_k op(a)[r, k] op(b)[k, c] + beta * out[r, c]
//   op(a)[r, k] = ta ? a[k * lda + r] : a[r * lda + k]
//   op(b)[k, c] = tb ? b[c * ldb + k] : b[k * ldb + c]
// One thread per output element; k is summed in order in A (fused multiply-adds): the same
// bits on every run.  beta == 0 never reads out (it may hold garbage, as for cuBLAS).
// Built, like every file here, with CuPy's -ftz=true: float32 subnormals flush to zero.
__device__ __forceinline__ float madd(float x, float y, float s) { return __fmaf_rn(x, y, s); }
__device__ __forceinline__ double madd(double x, double y, double s) { return __fma_rn(x, y, s); }

template <typename T, typename A>
__device__ __forceinline__ void small_gemm_body(
    const T* __restrict__ a, i64 lda, int ta, const T* __restrict__ b, i64 ldb, int tb,
    A* __restrict__ out, i64 ldo, int m, int n, int k, A alpha, A beta)
{
    const i64 idx = (i64)blockIdx.x * CPN_BLOCK + threadIdx.x;
    if (idx >= (i64)m * n) return;
    const int r = (int)(idx / n), c = (int)(idx % n);
    const T* pa = ta ? a + r : a + (i64)r * lda;
    const T* pb = tb ? b + (i64)c * ldb : b + c;
    const i64 sa = ta ? lda : 1, sb = tb ? 1 : ldb;
    A s = A(0);
    for (int kk = 0; kk < k; ++kk)
        s = madd(Conv<T>::load(pa[kk * sa]), Conv<T>::load(pb[kk * sb]), s);
    A v = alpha * s;
    A* o = out + (i64)r * ldo + c;
    if (beta != A(0)) v = madd(beta, *o, v);
    *o = v;
}

// ---- extern "C" wrappers, one per dtype --------------------------------------------
#define CPN_DEFINE(SUF, T, A)                                                              \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_small_gemm_##SUF(              \
    const T* a, i64 lda, int ta, const T* b, i64 ldb, int tb, A* out, i64 ldo,             \
    int m, int n, int k, A alpha, A beta) {                                                \
    small_gemm_body<T, A>(a, lda, ta, b, ldb, tb, out, ldo, m, n, k, alpha, beta); }

CPN_DEFINE(f16, f16_t, float)
CPN_DEFINE(bf16, bf16_t, float)
CPN_DEFINE(f32, float, float)
CPN_DEFINE(f64, double, double)

// ---- 3xTF32 operand split (float32 only; _blas.gemm's "3xtf32" mode) -------------------
// (split_tf32: common.cuh, shared with the TF32x3 tiles' split gradient blocks)

// hi, lo: contiguous (rows, cols); x: row-major, row stride ldx (a row-strided view).
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_split_tf32_f32(
    const float* __restrict__ x, i64 ldx, float* __restrict__ hi, float* __restrict__ lo,
    i64 rows, int cols)
{
    const i64 idx = (i64)blockIdx.x * CPN_BLOCK + threadIdx.x;
    if (idx >= rows * cols) return;
    const i64 r = idx / cols;
    split_tf32(x[r * ldx + (idx - r * cols)], hi[idx], lo[idx]);
}

// The split of xᵀ: hi, lo contiguous (cols, rows_out) with hi[c][r] + lo[c][r] = x[r][c] for
// r < rows and 0 for rows <= r < rows_out (a K-major operand padded to 16-byte rows:
// tiles_tf32.split_t) -- one read of x, no transposed copy.  32 x 32 tiles through padded
// shared memory (reads along x's rows, writes along hi's); grid (ceil(rows_out / 32),
// ceil(cols / 32)), 256 threads.
extern "C" __global__ void __launch_bounds__(256) cpn_split_tf32_t_f32(
    const float* __restrict__ x, i64 ldx, float* __restrict__ hi, float* __restrict__ lo,
    int rows, int rows_out, int cols)
{
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
            float h, l;
            split_tf32(t[tx][y], h, l);
            hi[(i64)c * rows_out + r] = h;
            lo[(i64)c * rows_out + r] = l;
        }
    }
}

// ---- the K splits' sum of a TF32x3 product (tf32x3.mm with k_splits > 1) ------------------
// out[r][c] = (accumulate ? out[r][c] : 0) + ((part[0][r][c] + part[1][r][c]) + ...), the
// partials added in z order (each one already scaled and compensated by the tiles' store):
// the same arithmetic whatever the grid, the same bits run after run.  part: nz slices
// zstride floats apart, each (rows, cols) of row stride ldp; out: row stride ldo.  Grid
// ceil(rows * cols / CPN_BLOCK).
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_mm_sum_splits_f32(
    const float* __restrict__ part, i64 zstride, int nz, i64 ldp, float* __restrict__ out,
    i64 ldo, i64 rows, int cols, int accumulate)
{
    const i64 idx = (i64)blockIdx.x * CPN_BLOCK + threadIdx.x;
    if (idx >= rows * cols) return;
    const i64 r = idx / cols, c = idx - r * cols;
    const float* p = part + r * ldp + c;
    float v = p[0];
    for (int z = 1; z < nz; ++z) v += p[(i64)z * zstride];
    float* o = out + r * ldo + c;
    *o = accumulate ? *o + v : v;
}

// ---- fills (a device scalar, a sentinel) -------------------------------------------------
// x[i] = value for i < n: what cupy.full would do, but from this file's cubin, so a first
// call compiles no CuPy kernel (issue 52: the release wheel's prebuilt kernels are all a first
// call needs).  Grid ceil(n / CPN_BLOCK).
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_fill_f32(float* x, float value, i64 n)
{
    const i64 i = (i64)blockIdx.x * CPN_BLOCK + threadIdx.x;
    if (i < n) x[i] = value;
}

extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_fill_f64(double* x, double value, i64 n)
{
    const i64 i = (i64)blockIdx.x * CPN_BLOCK + threadIdx.x;
    if (i < n) x[i] = value;
}
