// cupynce SPLADE head: the pieces shared by the max kernels of splade.cu (over cuBLAS
// logit tiles) and the fused tile kernels (splade_tiles.cu's MODE_SPMAX, splade_wgmma.cu), so
// that every path rounds its logits alike and writes the same output and arg-max for the
// same (max, arg, NaN) of an entry.
#pragma once
#include "include/common.cuh"

#define SPL_ACT_RELU 0
#define SPL_ACT_LOG1P 1
template <typename A>
__device__ __forceinline__ A spl_act(A m, int act) {
    if (m != m) return m;  // NaN stays NaN (a plain relu would turn it into 0)
    const A r = m > A(0) ? m : A(0);
    return act == SPL_ACT_LOG1P ? cpn_log1p(r) : r;
}

// merge (vb, ab) into (va, aa): larger value, then lower l; arg -1 means "nothing seen"
template <typename A>
__device__ __forceinline__ void spl_merge(A& va, int& aa, A vb, int ab) {
    if (ab >= 0 && (vb > va || (vb == va && (aa < 0 || ab < aa)))) { va = vb; aa = ab; }
}

// The logit an entry's max is taken over: x[b, l] . W[v] (s, accumulated in A) plus the bias,
// rounded to T once -- as F.linear(x, W, bias) gives it in T (cuBLAS adds the bias to the
// fp32 accumulator and rounds the sum), so the max, the arg-max and the output are the
// library's, ties included.  Identity rounding for float32 / float64.  b is 0 without a bias.
template <typename T, typename A>
__device__ __forceinline__ A spl_logit(A s, A b) {
    return Conv<T>::load(Conv<T>::store(s + b));
}

// out[b, v0 + j] and arg[b, v0 + j] from the merged (max, arg, NaN seen) of one (b, j); m is
// a max of spl_logit values (the bias is in it already)
template <typename T, typename I, typename A>
__device__ __forceinline__ void spl_write(A m, int w, bool isnan, int b, int j, int v0, int V,
                                          int act, T* __restrict__ out, I* __restrict__ arg)
{
    const i64 o = (i64)b * V + v0 + j;
    A r = A(0);  // all positions masked (or every logit -inf: act gives 0 as well)
    if (isnan) r = cpn_nan<A>();
    else if (w >= 0) r = spl_act(m, act);
    out[o] = Conv<T>::store(r);
    arg[o] = (I)(w < 0 ? 0 : w);
}
