// cupynce common device helpers: storage types, conversions, block reductions.
//
// Compiled by NVRTC (through cupy.RawModule) with no CUDA headers: 16-bit types are
// carried as raw bits and converted with PTX / bit arithmetic, so the same sources
// compile wherever NVRTC does (sm_80+ for the PTX conversions used here).
//
// The loader prepends `#define CPN_BLOCK <n>` (the block size, defined once in Python).
#pragma once

#ifndef CPN_BLOCK
#define CPN_BLOCK 256
#endif

typedef long long i64;

struct __align__(2) f16_t { unsigned short bits; };
struct __align__(2) bf16_t { unsigned short bits; };

// ---- conversions: load(T) -> accumulator, store(accumulator) -> T ------------------
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ double to_f64(double x) { return x; }
__device__ __forceinline__ float to_f32(f16_t h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h.bits));
    return f;
}
__device__ __forceinline__ float to_f32(bf16_t h) {
    return __uint_as_float(((unsigned int)h.bits) << 16);
}

template <typename T> struct Conv;
template <> struct Conv<float> {
    typedef float acc;
    static __device__ __forceinline__ float load(float x) { return x; }
    static __device__ __forceinline__ float store(float x) { return x; }
};
template <> struct Conv<double> {
    typedef double acc;
    static __device__ __forceinline__ double load(double x) { return x; }
    static __device__ __forceinline__ double store(double x) { return x; }
};
template <> struct Conv<f16_t> {
    typedef float acc;
    static __device__ __forceinline__ float load(f16_t x) { return to_f32(x); }
    static __device__ __forceinline__ f16_t store(float x) {
        f16_t h;
        asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h.bits) : "f"(x));
        return h;
    }
};
template <> struct Conv<bf16_t> {
    typedef float acc;
    static __device__ __forceinline__ float load(bf16_t x) { return to_f32(x); }
    static __device__ __forceinline__ bf16_t store(float x) {
        // round to nearest even; NaN stays a (quiet) NaN
        bf16_t h;
        unsigned int u = __float_as_uint(x);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            h.bits = (unsigned short)((u >> 16) | 0x40u);
        } else {
            u += 0x7fffu + ((u >> 16) & 1u);
            h.bits = (unsigned short)(u >> 16);
        }
        return h;
    }
};

// ---- 3xTF32 operand split (float32: blas.cu's cpn_split_tf32_f32, the TF32x3 tiles) ----
// x = hi + lo exactly: hi = x rounded to TF32 (10 explicit mantissa bits) to nearest, ties away
// from zero, lo = x - hi.  The rounding is integer arithmetic on the bit pattern (add half of
// the 13 dropped bits' range, clear them; the carry moves into the exponent as it should), not
// PTX cvt.rna.tf32.f32: the same hi for every finite x whose rounding stays finite, on every
// arch, with the dropped bits defined as zero, and it is the rule tests/engine/test_float32_precision.py
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

// ---- F16x3 operand split (tiles_ws_f16x3.cu, grads.cu's clip_grad_f16x3) ----------
// x 2^e = hi + lo in float16 with e a power of two per row / column / matrix (the largest
// |x| into [2^14, 2^15)); see tiles_ws_f16x3.cu.
// (exponents in [-113, 126]: 2^e and 2^-e normal; a finite largest |x| never needs e < -113;
// rows whose largest is below 2^-112 are scaled by 2^126 only, less than [2^14, 2^15))
#define F16X3_EXP_MIN (-113)
#define F16X3_EXP_MAX 126
// e for a row whose largest |x| has the bit pattern `mbits` (sign cleared): its largest into
// [2^14, 2^15); 0 for inf / NaN; the clamp as above.  A zero or subnormal largest counts as
// 2^-126 (clamped).
__device__ __forceinline__ int f16x3_exp(unsigned mbits) {
    if (mbits >= 0x7f800000u) return 0;
    int ex = (int)(mbits >> 23) - 127;  // floor(log2(max)) for a normal max
    if ((mbits >> 23) == 0u) ex = -126;
    int e = 14 - ex;
    return e < F16X3_EXP_MIN ? F16X3_EXP_MIN : (e > F16X3_EXP_MAX ? F16X3_EXP_MAX : e);
}
__device__ __forceinline__ float f16x3_pow2(int e) { return __uint_as_float((unsigned)(e + 127) << 23); }

// x 2^e = hi + lo (float16 bit patterns).  Inline PTX without .ftz: CuPy builds with
// -ftz=true, which would flush a subnormal x or lo.
__device__ __forceinline__ void f16x3_split(float x, float s, unsigned short& hi,
                                            unsigned short& lo) {
    float xs, hf, d;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(xs) : "f"(x), "f"(s));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hi) : "f"(xs));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hf) : "h"(hi));
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(xs), "f"(hf));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(lo) : "f"(d));
    if (!(hf - hf == 0.f)) lo = 0;  // (hi inf / NaN: lo would be NaN)
}

// Two fp32 values rounded to T (round to nearest even, as Conv<T>::store) in one register:
// `round(lo, hi)`, the rounded values back as fp32 (`lo`, `hi`), a NaN-propagating packed max
// and whether either half is NaN.  NEG_INF2: -inf in both halves.  sm_80+ instructions: only
// the tensor-core kernels (tiles.cu, splade_wgmma.cu) instantiate it.
template <typename T> struct Pack2;
template <> struct Pack2<bf16_t> {
    enum : unsigned { NEG_INF2 = 0xff80ff80u };
    static __device__ __forceinline__ unsigned round(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float lo(unsigned p) { return __uint_as_float(p << 16); }
    static __device__ __forceinline__ float hi(unsigned p) { return __uint_as_float(p & 0xffff0000u); }
    static __device__ __forceinline__ unsigned max_nan(unsigned a, unsigned b) {
        unsigned r;
        asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
        return r;
    }
    static __device__ __forceinline__ bool any_nan(unsigned p) {
        return (p & 0x7fffu) > 0x7f80u || ((p >> 16) & 0x7fffu) > 0x7f80u;
    }
};
template <> struct Pack2<f16_t> {
    enum : unsigned { NEG_INF2 = 0xfc00fc00u };
    static __device__ __forceinline__ unsigned round(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float lo(unsigned p) {
        float f;
        asm("{ .reg .f16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }" : "=f"(f) : "r"(p));
        return f;
    }
    static __device__ __forceinline__ float hi(unsigned p) {
        float f;
        asm("{ .reg .f16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "r"(p));
        return f;
    }
    static __device__ __forceinline__ unsigned max_nan(unsigned a, unsigned b) {
        unsigned r;
        asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
        return r;
    }
    static __device__ __forceinline__ bool any_nan(unsigned p) {
        return (p & 0x7fffu) > 0x7c00u || ((p >> 16) & 0x7fffu) > 0x7c00u;
    }
};

// ---- math on the accumulator type --------------------------------------------------
// Full-precision expf/logf (not the __expf intrinsics, whose error grows with |x|).
__device__ __forceinline__ float cpn_exp(float x) { return expf(x); }
__device__ __forceinline__ double cpn_exp(double x) { return exp(x); }
__device__ __forceinline__ float cpn_log(float x) { return logf(x); }
__device__ __forceinline__ double cpn_log(double x) { return log(x); }
__device__ __forceinline__ float cpn_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double cpn_log1p(double x) { return log1p(x); }
// 2^x by the SFU alone (~2^-22 relative, subnormal results flushed): for terms whose error
// budget is far above that (SigLIP's series on scores below -4.85)
__device__ __forceinline__ float cpn_ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float cpn_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double cpn_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float cpn_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double cpn_abs(double x) { return fabs(x); }
template <typename A> __device__ __forceinline__ A cpn_inf();
template <> __device__ __forceinline__ float cpn_inf<float>() { return __int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double cpn_inf<double>() { return __longlong_as_double(0x7ff0000000000000LL); }
// the smallest normal number (what -ftz keeps)
template <typename A> __device__ __forceinline__ A cpn_min_normal();
template <> __device__ __forceinline__ float cpn_min_normal<float>() { return 1.17549435e-38f; }
template <> __device__ __forceinline__ double cpn_min_normal<double>() { return 2.2250738585072014e-308; }
template <typename A> __device__ __forceinline__ A cpn_nan();
template <> __device__ __forceinline__ float cpn_nan<float>() { return __int_as_float(0x7fffffff); }
template <> __device__ __forceinline__ double cpn_nan<double>() { return __longlong_as_double(0x7fffffffffffffffLL); }

// max that keeps a NaN once seen (fmax would drop it)
template <typename A> __device__ __forceinline__ A nanmax(A a, A b) { return (b > a || b != b) ? b : a; }

// ---- online log-sum-exp state (m = running max, s = sum exp(x - m)) ----------------
// NaN-propagating: once a NaN is seen the state stays NaN, so a NaN input can never
// produce a finite-looking loss (fmax would silently drop it).
template <typename A> struct Lse {
    A m, s;
    __device__ __forceinline__ void init() { m = -cpn_inf<A>(); s = A(0); }
    __device__ __forceinline__ void add(A x) {
        if (x > m) {  // new maximum: rescale the sum
            s = s * cpn_exp(m - x) + A(1);
            m = x;
        } else if (x == x) {
            if (x != -cpn_inf<A>()) s += cpn_exp(x - m);
        } else {
            m = x; s = x;  // NaN
        }
    }
    // add's arithmetic without its branches, for loops that keep many states: d = x - m,
    // e = exp(-|d|) (exp(m - x) for a new maximum, exp(x - m) else: add's very argument),
    // s = up ? s e + 1 : s + e, m = up ? x : m with up = !(d <= 0) (a NaN d: a NaN x, or
    // +inf after +inf, takes that branch and leaves s NaN, m = x as add does: merge's
    // "empty" test (m = -inf) must never see a NaN sum); -inf adds nothing.  Bit for bit
    // add's (m, s) where every x is finite or -inf (add's s e + 1 contracts to the same FMA).
    __device__ __forceinline__ void add_nb(A x) {
        const A d = x - m;
        const A e = cpn_exp(-fabs(d));
        const bool up = !(d <= A(0));
        const A s_up = fma(s, e, A(1)), s_dn = s + e;
        if (x != -cpn_inf<A>()) { s = up ? s_up : s_dn; m = up ? x : m; }
    }
    __device__ __forceinline__ void merge(A om, A os) {
        if (om != om || m != m) { m = cpn_nan<A>(); s = m; return; }
        if (om == -cpn_inf<A>()) return;
        if (m == -cpn_inf<A>()) { m = om; s = os; return; }
        if (om > m) { s = s * cpn_exp(m - om) + os; m = om; }
        else { s += os * cpn_exp(om - m); }
    }
    __device__ __forceinline__ A value() const {
        if (m != m) return m;
        if (m == cpn_inf<A>()) return cpn_nan<A>();  // inf logits: undefined softmax
        return m + cpn_log(s);
    }
};

// Block-wide reductions in a fixed order (deterministic). `sh` needs 2 * 32 slots.
template <typename A>
__device__ __forceinline__ void block_lse(Lse<A>& st, A* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        A om = __shfl_xor_sync(0xffffffffu, st.m, o);
        A os = __shfl_xor_sync(0xffffffffu, st.s, o);
        st.merge(om, os);
    }
    __syncthreads();  // protect `sh` from a previous use
    if (lane == 0) { sh[warp] = st.m; sh[32 + warp] = st.s; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        Lse<A> t; t.init();
        if (lane < nw) { t.m = sh[lane]; t.s = sh[32 + lane]; }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            A om = __shfl_xor_sync(0xffffffffu, t.m, o);
            A os = __shfl_xor_sync(0xffffffffu, t.s, o);
            t.merge(om, os);
        }
        if (lane == 0) { sh[0] = t.m; sh[32] = t.s; }
    }
    __syncthreads();
    st.m = sh[0]; st.s = sh[32];
}

// Warp-wide reduction in a fixed order (xor-shuffles: every lane gets the same bits).
template <typename A, typename Op>
__device__ __forceinline__ A warp_reduce(A v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reduction in a fixed order (deterministic): xor-shuffles inside each warp, then
// warp 0 over the warps' results.  op(a, b) combines two values; lanes past the warp count
// hold A(0), the identity of both uses below.  `sh` needs 32 slots.
template <typename A, typename Op>
__device__ __forceinline__ A block_reduce(A v, A* sh, Op op) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads();  // protect `sh` from a previous use
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        const A t = warp_reduce(lane < nw ? sh[lane] : A(0), op);
        if (lane == 0) sh[0] = t;
    }
    __syncthreads();
    return sh[0];
}

// 16 bytes of A (4 float or 2 double): one vector load / store
template <typename A> struct __align__(16) Vec16 { A x[16 / sizeof(A)]; };

struct SumOp {
    template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};
struct MaxOp {  // (of non-negative, NaN-free values: A(0) is its identity)
    template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return b > a ? b : a; }
};

template <typename A>
__device__ __forceinline__ A block_sum(A v, A* sh) { return block_reduce(v, sh, SumOp()); }

template <typename A>
__device__ __forceinline__ A block_max(A v, A* sh) { return block_reduce(v, sh, MaxOp()); }
