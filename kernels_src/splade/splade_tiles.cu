// cupynce SPLADE fused max on the tensor-core tile loop (float16 / bfloat16): the MODE_SPMAX
// epilogue of tile_body.cuh, out[b, v] = act(max_l x[b, l] . W[v] + bias[v]) and its arg-max,
// the (B, L, V) logits never in memory.  Used where splade_wgmma.cu (Hopper's TMA kernel) is
// not: other sm_80+ GPUs, or where the driver cannot encode tensor maps.  Same bits as the
// cuBLAS path's max kernel (splade.cu, splade_common.cuh) on the same rounded logits.
//
//   cpn_tile_spmax_*    mma.sync main loop (sm_80+)
//   cpn_wgtile_spmax_*  wgmma main loop (sm_90a builds only)
#include "include/tile_body.cuh"

// cpn-dtypes: f16 bf16
// SPLADE's fused max: A = W (V, D), B1 = x (B, L, D) as B L rows, n1 = L, rows = V;
// 1-D grid of ceil(V / 128) x ceil(B / per_cta) CTAs, ordered in groups of `group` batch
// groups; out (B, V); arg-max (B, V) int16 (i16) / int32 (i32)
#define CPN_SPMAX_ARGS(T, IX)                                                              \
    const T* A, i64 lda, int rows, const T* B1, i64 ldb1, int n1, int d,                   \
    const unsigned char* mask, const T* bias, int act, T* out, IX* arg, int batches,    \
    int per_cta, int group
#define CPN_SPMAX_BODY(T, WG, IX)                                                          \
    tile_body<T, MODE_SPMAX, WG, IX>(A, lda, rows, 0, B1, ldb1, n1, B1, ldb1, 0, d, 1.f,   \
        0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.f, out, 0, 0, mask, bias, act, arg,     \
        batches, per_cta, group)
#define CPN_DEFINE_SPMAX(SUF, T)                                                           \
extern "C" __global__ void __launch_bounds__(TTHREADS)                                     \
cpn_tile_spmax_i16_##SUF(CPN_SPMAX_ARGS(T, short)) { CPN_SPMAX_BODY(T, false, short); }    \
extern "C" __global__ void __launch_bounds__(TTHREADS)                                     \
cpn_tile_spmax_i32_##SUF(CPN_SPMAX_ARGS(T, int)) { CPN_SPMAX_BODY(T, false, int); }        \
extern "C" __global__ void __launch_bounds__(TTHREADS)                                     \
cpn_wgtile_spmax_i16_##SUF(CPN_SPMAX_ARGS(T, short)) { CPN_SPMAX_BODY(T, true, short); }   \
extern "C" __global__ void __launch_bounds__(TTHREADS)                                     \
cpn_wgtile_spmax_i32_##SUF(CPN_SPMAX_ARGS(T, int)) { CPN_SPMAX_BODY(T, true, int); }

CPN_DEFINE_SPMAX(f16, f16_t)
CPN_DEFINE_SPMAX(bf16, bf16_t)
