// cupynce warp-specialised H pass (NT-Xent's gradient block), staging variants (issue 23):
// tiles_ws.cu's cpn_wstile_h with the 64 x 128 block of a consumer warpgroup staged HSW
// columns at a time (tile_epilogue.cuh's SOUT, SW = HSW), so that its staging takes 64 HSW 2
// bytes a consumer instead of 16 KiB and the ring can keep A resident at D = 512 (the direct
// rows' runs: 2 HSW bytes; the mirror's: 128 bytes, as with 128).  Python picks them with
// tiles.WS_H_STAGING (env CUPYNCE_WS_H_STAGING: 128, tiles_ws.cu's kernel; 64; 32).  Same
// arguments, grid and outputs as cpn_wstile_h, the same bits (only the stores' grouping
// differs).  cpn_wstile_h64t (tiles.WS_H_TMA, env CUPYNCE_WS_H_TMA=1, with 64): the 64 x 64
// staged blocks -- the tile's and its mirror's -- go out by TMA stores (one thread, after a
// proxy fence and the warpgroup barrier; the staging is rewritten once its stores have read
// it), through tg, a tensor map of the gradient block (rows x columns, 64 x 64 boxes,
// 128-byte swizzle: the SW = 64 staging layout); the consumers issue no global stores.
// cpn-dtypes: f16 bf16
#include "tile_ws.cuh"

#define CPN_WS_ARGS(T)                                                                     \
    const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tb1,                 \
    const __grid_constant__ TmaMap tb2, const TileArgs<T> p, int ring
#define CPN_DEFINE_WS_H(SUF, T)                                                            \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_h64_##SUF(          \
    CPN_WS_ARGS(T)) { CPN_WS_BODY_H(T, 64); }                                              \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_h32_##SUF(          \
    CPN_WS_ARGS(T)) { CPN_WS_BODY_H(T, 32); }                                              \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_h64t_##SUF(         \
    const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tb1,                 \
    const __grid_constant__ TmaMap tb2, const __grid_constant__ TmaMap tg,                 \
    const TileArgs<T> p, int ring) { CPN_WS_BODY_HT(T); }

CPN_DEFINE_WS_H(f16, f16_t)
CPN_DEFINE_WS_H(bf16, bf16_t)
