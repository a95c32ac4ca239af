// cupynce fused score tiles on tensor cores: float16 / bfloat16 inputs, float32 accumulation.
//
// One CTA owns TBM = 128 rows of A (queries) and walks the column tiles of B (keys, then
// shared negatives) assigned to it: column tile ct = split, split + splits, ... where
// split = blockIdx.y.  Each 128 x 128 score tile S = A B^T is computed on tensor cores
// (fp32 accumulators kept in registers; operands staged in shared memory by a cp.async
// pipeline) and consumed in registers by an epilogue, so the score matrix never reaches
// global memory.  Two main loops share the epilogues (`TileLoop<T, WG>`, tile_loop.cuh):
//
//   cpn_tile_*    mma.sync m16n8k16 (sm_80+)
//   cpn_wgtile_*  wgmma m64n128k16 (sm_90a, Hopper; built only when the loader compiles
//                 this file for sm_90a, __trap() otherwise)
//
// Files: tile_loop.cuh (main loops, geometry, PTX helpers), tile_body.cuh (the tile walk and
// every epilogue), this file (the InfoNCE family's kernels, their finishing kernels and the
// launch struct), splade_tiles.cu (SPLADE's MODE_SPMAX kernels).
//
// The epilogues:
//
//   MODE_LSE   row log-sum-exp partials (per split) and the positive logit
//   MODE_LSE2  MODE_LSE plus column partials per (row tile, column): CLIP's column softmax
//   MODE_G     the gradient block G_ij = w_i s (p_ij - [j = pos(i)]) in T     (InfoNCE)
//   MODE_H     G + G^T for NT-Xent (S symmetric):                              (NT-Xent)
//              H_ij = s (w_i p_ij + w_j p_ji - (w_i + w_j) [j = pos(i)]), H_ii = 0,
//              p_ji = exp(l_ij - lse_j), so dZ = H Z is one product
//   MODE_CLIP  CLIP's gradient block s G_ij and the row partials of sum_j G_ij L_ij
//              (LSE2 and CLIP also as `_lab` kernels: CLIP's labels, TileArgs lab_r / lab_c,
//              same-label scores off the positive left out -- label_bits, tile_labels.cuh)
//   MODE_SIGLIP SigLIP, one pass (no statistics): with L = s S_ij + beta (beta at lse_col[0])
//              and z = +1 on the positive, -1 elsewhere, the row partials of the loss
//              sum_j softplus(-z L) (part_m), of dbias sum_j G_ij (part_s) and of dscale
//              sum_j G_ij (L - beta) (dsp_part), G_ij = w_mul G'_ij, G'_ij = -z v_i
//              sigmoid(-z L); and, when g is given, the gradient block s G'_ij in T (w_mul
//              is the products' alpha, as siglip_rows)
//   MODE_SPMAX SPLADE's max over the sequence (splade_tiles.cu): A = W (vocabulary rows),
//              B = x[b] for the CTA's batches (every position tile of each in turn), each
//              logit rounded to T (as the cuBLAS path and PyTorch's half matmul give it),
//              masked positions skipped, ties to the lowest l; writes out[b, v] and the
//              arg-max like splade.cu (splade_common.cuh) -- the (B, L, V) logits never exist
//
// Determinism: every reduction has a fixed order (per-thread sequential over the tiles it
// owns, xor-shuffles in a fixed pattern, then a fixed smem merge); no atomics.
// Requirements (checked in Python): d, every leading dimension and every pointer are
// multiples of 8 elements / 16 bytes; sm_80 or newer.
//
// Partials are stored in natural-log units (m, s) with s = sum exp(x - m), the Lse<float>
// convention of common.cuh, so col_combine in stats.cu can fold them.
#include "include/tile_body.cuh"

// Row statistics from the split partials (in split order):
//   lse_i = log sum over splits, loss_i = lse_i - pos_i
__device__ __forceinline__ void tile_finish_body(
    const float* __restrict__ part_m, const float* __restrict__ part_s, i64 part_ld,
    int splits, int rows, const float* __restrict__ pos, float* __restrict__ lse,
    float* __restrict__ loss)
{
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    Lse<float> st; st.init();
    for (int s = 0; s < splits; ++s) st.merge(part_m[(i64)s * part_ld + r], part_s[(i64)s * part_ld + r]);
    const float v = st.value();
    lse[r] = v;
    if (loss) loss[r] = v - pos[r];
}

// NT-Xent's symmetric schedule (tri_count): row r of tile R merges its split partials, then
// the column partials colp[i][r] of the tiles i that took tile R at distance o >= 1;
// loss_r = lse_r - scale dots[r mod half] (dots: z_i . z_{i + half}, i < half).
// A block of CPN_BLOCK threads takes 32 rows (lane = row, so each load is one coalesced
// line): warp w merges the distances o = 1 + w, 1 + w + NW, ... (independent loads in
// flight instead of ct / 2 dependent ones), then warp 0 merges the NW partials in warp
// order.  Fixed orders throughout: deterministic.
__device__ __forceinline__ void tile_finish_tri_body(
    const float* __restrict__ part_m, const float* __restrict__ part_s, i64 part_ld,
    int splits, int rows, const float* __restrict__ colp_m, const float* __restrict__ colp_s,
    const float* __restrict__ dots, int half, float scale, float* __restrict__ lse,
    float* __restrict__ loss)
{
    enum { NW = CPN_BLOCK / 32 };
    __shared__ float sm[NW][32], ss[NW][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = blockIdx.x * 32 + lane;
    const int ct = (rows + TBN - 1) / TBN, tr = r / TBN;
    Lse<float> st; st.init();
    if (r < rows) {
        if (warp == 0)
            for (int s = 0; s < splits; ++s) st.merge(part_m[(i64)s * part_ld + r], part_s[(i64)s * part_ld + r]);
        for (int o = 1 + warp; o <= ct / 2; o += NW) {
            const int i = (tr - o + ct) % ct;
            if (o < tri_count(i, ct)) st.merge(colp_m[(i64)i * rows + r], colp_s[(i64)i * rows + r]);
        }
    }
    sm[warp][lane] = st.m;
    ss[warp][lane] = st.s;
    __syncthreads();
    if (warp != 0 || r >= rows) return;
    for (int w = 1; w < NW; ++w) st.merge(sm[w][lane], ss[w][lane]);
    const float v = st.value();
    lse[r] = v;
    loss[r] = v - scale * dots[r % half];
}

// Row sums of the split partials (in split order): SigLIP's loss, dbias and dscale rows.
// blockIdx.y picks one of up to three (partials, out) pairs, the partials part_stride apart
// (one launch for the three).
__device__ __forceinline__ void tile_sum_body(
    const float* __restrict__ part, i64 part_ld, int splits, int rows, float* __restrict__ out)
{
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float a = 0.f;
    for (int s = 0; s < splits; ++s) a += part[(i64)s * part_ld + r];
    out[r] = a;
}

// The launch struct TileArgs is in tile_epilogue.cuh (tiles_ws.cu's kernels take it too).
#define CPN_TILE_ARGS(T) const TileArgs<T> p
#define CPN_TILE_PASS                                                                      \
    p.A, p.lda, p.rows, p.row0, p.B1, p.ldb1, p.n1, p.B2, p.ldb2, p.n2, p.d, p.scale_mul,  \
    p.scale_log, p.exclude_diag, p.pos_shift, p.pos_mod, p.part_m, p.part_s, p.part_ld,    \
    p.pos_out, p.colp_m, p.colp_s, p.lse_row, p.lse_col, p.w_ptr, p.w_stride, p.w_mul,     \
    p.g, p.ldg, p.dsp_part, 0, 0, 0, (int*)0, 0, 0, 1, p.tri, p.lab_r, p.lab_c

#define CPN_TA_OFF(f) (int)((const char*)&x.f - (const char*)&x)
// offsets of TileArgs' fields in declaration order, then its size (the layout test)
template <typename T> __device__ void tile_args_layout(int* out) {
    const TileArgs<T> x = {};
    const int o[] = {CPN_TA_OFF(A), CPN_TA_OFF(B1), CPN_TA_OFF(B2), CPN_TA_OFF(scale_log),
        CPN_TA_OFF(part_m), CPN_TA_OFF(part_s), CPN_TA_OFF(pos_out), CPN_TA_OFF(colp_m),
        CPN_TA_OFF(colp_s), CPN_TA_OFF(lse_row), CPN_TA_OFF(lse_col), CPN_TA_OFF(w_ptr),
        CPN_TA_OFF(g), CPN_TA_OFF(dsp_part), CPN_TA_OFF(lab_r), CPN_TA_OFF(lab_c),
        CPN_TA_OFF(lda), CPN_TA_OFF(ldb1),
        CPN_TA_OFF(ldb2), CPN_TA_OFF(part_ld), CPN_TA_OFF(w_stride), CPN_TA_OFF(ldg),
        CPN_TA_OFF(rows), CPN_TA_OFF(row0), CPN_TA_OFF(n1), CPN_TA_OFF(n2), CPN_TA_OFF(d),
        CPN_TA_OFF(exclude_diag), CPN_TA_OFF(pos_shift), CPN_TA_OFF(pos_mod), CPN_TA_OFF(tri),
        CPN_TA_OFF(scale_mul), CPN_TA_OFF(w_mul), (int)sizeof(TileArgs<T>)};
    for (int i = 0; i < (int)(sizeof(o) / sizeof(o[0])); ++i) out[i] = o[i];
}

// Tensor-core tiles exist for the 16-bit types only:
// (cpn_tile_smem_<dtype> writes TSMEM_BYTES and WSMEM_BYTES, so Python never hard-codes them)
// cpn-dtypes: f16 bf16
#define CPN_DEFINE_TILES(SUF, T)                                                           \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_lse_##SUF(                 \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_LSE, false>(CPN_TILE_PASS); }                    \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_lse2_##SUF(                \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_LSE2, false>(CPN_TILE_PASS); }                   \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_g_##SUF(                   \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_G, false>(CPN_TILE_PASS); }                      \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_h_##SUF(                   \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_H, false>(CPN_TILE_PASS); }                      \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_clip_##SUF(                \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_CLIP, false>(CPN_TILE_PASS); }                   \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_siglip_##SUF(              \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_SIGLIP, false>(CPN_TILE_PASS); }                 \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_wgtile_siglip_##SUF(            \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_SIGLIP, true>(CPN_TILE_PASS); }                  \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_wgtile_lse_##SUF(               \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_LSE, true>(CPN_TILE_PASS); }                     \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_wgtile_lse2_##SUF(              \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_LSE2, true>(CPN_TILE_PASS); }                    \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_wgtile_g_##SUF(                 \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_G, true>(CPN_TILE_PASS); }                       \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_wgtile_h_##SUF(                 \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_H, true>(CPN_TILE_PASS); }                       \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_wgtile_clip_##SUF(              \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_CLIP, true>(CPN_TILE_PASS); }                    \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_lse2_lab_##SUF(            \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_LSE2, false, int, true>(CPN_TILE_PASS); }        \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_tile_clip_lab_##SUF(            \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_CLIP, false, int, true>(CPN_TILE_PASS); }        \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_wgtile_lse2_lab_##SUF(          \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_LSE2, true, int, true>(CPN_TILE_PASS); }         \
extern "C" __global__ void __launch_bounds__(TTHREADS) cpn_wgtile_clip_lab_##SUF(          \
    CPN_TILE_ARGS(T)) { tile_body<T, MODE_CLIP, true, int, true>(CPN_TILE_PASS); }         \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_tile_finish_##SUF(             \
    const float* part_m, const float* part_s, i64 part_ld, int splits, int rows,           \
    const float* pos, float* lse, float* loss) {                                           \
    tile_finish_body(part_m, part_s, part_ld, splits, rows, pos, lse, loss); }             \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_tile_finish_tri_##SUF(         \
    const float* part_m, const float* part_s, i64 part_ld, int splits, int rows,           \
    const float* colp_m, const float* colp_s, const float* dots, int half, float scale,    \
    float* lse, float* loss) {                                                             \
    tile_finish_tri_body(part_m, part_s, part_ld, splits, rows, colp_m, colp_s, dots,      \
        half, scale, lse, loss); }                                                         \
extern "C" __global__ void cpn_tile_smem_##SUF(int* out) {                                 \
    out[0] = TSMEM_BYTES; out[1] = WSMEM_BYTES; }                                          \
extern "C" __global__ void cpn_tile_args_layout_##SUF(int* out) { tile_args_layout<T>(out); } \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_tile_sum_##SUF(                \
    const float* part, i64 part_ld, int splits, int rows, i64 part_stride, float* out0,    \
    float* out1, float* out2) {                                                            \
    const int y = blockIdx.y;                                                              \
    tile_sum_body(part + y * part_stride, part_ld, splits, rows,                           \
                  y == 0 ? out0 : (y == 1 ? out1 : out2)); }


CPN_DEFINE_TILES(f16, f16_t)
CPN_DEFINE_TILES(bf16, bf16_t)
