// cupynce fused score tiles, Hopper's warp-specialised kernels (issue 23): tiles.cu's modes
// LSE, LSE2, G, H, CLIP and SIGLIP with a TMA producer warpgroup and two consumer warpgroups
// that each own whole 128 x 128 tiles, ping-ponging on the tensor cores (tile_ws.cuh); the
// epilogues are tiles.cu's (tile_epilogue.cuh), so the outputs and their layouts are the same
// and tiles.cu's finishing kernels combine them.  Built for sm_90a only (__trap() elsewhere;
// Python launches them where tiles.cu's wgmma loop runs, tiles.USE_WSTILE).
//
//   cpn_wstile_<mode>_<dtype>(L): L = WsLaunch<T> (tile_ws.cuh) {a, b1, b2, unused, p, ring}:
//   tensor maps of A (rows x d), B1 (n1 x d) and B2 (n2 x d; B1's map when there is none),
//   128 x 64 boxes, 128-byte swizzle (cupynce/_engine/tma.py); p the TileArgs of tiles.cu;
//   ring = stages | A-resident << 8.
//   Grid (ceil(rows / 128), splits), 384 threads, dynamic shared memory as tile_ws.cuh says.
//   cpn_wstile_{lse2,clip}_lab_<dtype>: the same with CLIP's labels (TileArgs lab_r / lab_c,
//   tile_labels.cuh's label_bits); the plain kernels compile the label code out.
// cpn-dtypes: f16 bf16
#include "include/tile_ws.cuh"

// (NVRTC has no offsetof: the members are laid out in order without gaps)
static_assert(sizeof(TmaMap) == 128 && sizeof(TileArgs<f16_t>) == 224 &&
              sizeof(TileArgs<bf16_t>) == 224 && sizeof(WsLaunch<f16_t>) == 768 &&
              sizeof(WsLaunch<bf16_t>) == 768, "WsLaunch's layout is tiles.launch_blob's");
#define CPN_WS_ARGS(T) const __grid_constant__ WsLaunch<T> L
#define CPN_DEFINE_WS(SUF, T)                                                              \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_lse_##SUF(          \
    CPN_WS_ARGS(T)) { CPN_WS_BODY(T, MODE_LSE); }                                          \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_lse2_##SUF(         \
    CPN_WS_ARGS(T)) { CPN_WS_BODY(T, MODE_LSE2); }                                         \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_g_##SUF(            \
    CPN_WS_ARGS(T)) { CPN_WS_BODY(T, MODE_G); }                                            \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_h_##SUF(            \
    CPN_WS_ARGS(T)) { CPN_WS_BODY(T, MODE_H); }                                            \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_clip_##SUF(         \
    CPN_WS_ARGS(T)) { CPN_WS_BODY(T, MODE_CLIP); }                                         \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_siglip_##SUF(       \
    CPN_WS_ARGS(T)) { CPN_WS_BODY(T, MODE_SIGLIP); }                                       \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_lse2_lab_##SUF(     \
    CPN_WS_ARGS(T)) { CPN_WS_BODY_LAB(T, MODE_LSE2); }                                     \
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) cpn_wstile_clip_lab_##SUF(     \
    CPN_WS_ARGS(T)) { CPN_WS_BODY_LAB(T, MODE_CLIP); }

CPN_DEFINE_WS(f16, f16_t)
CPN_DEFINE_WS(bf16, bf16_t)
