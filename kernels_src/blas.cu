// cupynce small products: the matrix products of tiny ops, without cuBLAS; and the operand
// split of the 3xTF32 float32 products (cpn_split_tf32_f32, float32 only).
//
// At N = 64, D = 32 a cuBLAS call costs 25-60 µs of host time (handle, stream, heuristics)
// for a product of a few µs; a CuPy launch of this kernel costs ~10.  _blas.gemm routes
// products of at most SMALL_GEMM_MACS multiply-adds here (see cupynce/_engine/blas.py).
//
// Naming: extern "C" wrappers `cpn_small_gemm_<dtype>`, dtype in {f16, bf16, f32, f64}: the
// inputs' type T; the output is the accumulator type A (float, or double for f64).
#include "common.cuh"

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
// x = hi + lo exactly: hi = x rounded to TF32 (10 explicit mantissa bits) to nearest, ties away
// from zero, lo = x - hi.  The rounding is integer arithmetic on the bit pattern (add half of
// the 13 dropped bits' range, clear them; the carry moves into the exponent as it should), not
// PTX cvt.rna.tf32.f32: the same hi for every finite x whose rounding stays finite, on every
// arch, with the dropped bits defined as zero, and it is the rule tests/test_float32_precision.py
// emulates in NumPy.  Edges: a finite x that would round to infinity (|x| >= (2 - 2^-11) 2^127)
// is truncated instead (hi + lo == x for every finite x; cvt.rna would give inf); inf / NaN
// give hi = x, lo = 0.  lo = x - hi is exact (Sterbenz, or both subnormal); the subtraction is
// inline PTX without .ftz so that CuPy's -ftz=true does not flush a subnormal x or lo.
__device__ __forceinline__ void split_tf32(float x, float& hi, float& lo)
{
    const unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) { hi = x; lo = 0.f; return; }
    unsigned h = (u + 0x1000u) & ~0x1fffu;
    if ((h & 0x7f800000u) == 0x7f800000u) h = u & ~0x1fffu;
    hi = __uint_as_float(h);
    float d;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(x), "f"(hi));
    lo = d;
}

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
