// cupynce tile body: one CTA's walk over its score tiles with the cp.async main loops
// (tile_loop.cuh: mma.sync, wgmma), calling the shared epilogues of tile_epilogue.cuh for
// each tile; SPLADE's max (MODE_SPMAX) keeps its epilogue here.  (see tiles.cu for the modes
// and the schedule; tile_ws.cuh is Hopper's warp-specialised walk.)
// Included by tiles.cu (the InfoNCE family) and splade_tiles.cu (SPLADE's max).
#pragma once
#include "include/tile_epilogue.cuh"

// LAB: a kernel that takes CLIP's labels (lab_r / lab_c; LSE2 / CLIP, epi_ctx)
template <typename T, int MODE, bool WG, typename IX = int, bool LAB = false>
__device__ __forceinline__ void tile_body(
    const T* __restrict__ A, i64 lda, int rows, int row0,
    const T* __restrict__ B1, i64 ldb1, int n1,
    const T* __restrict__ B2, i64 ldb2, int n2, int d,
    float scale_mul, const float* __restrict__ scale_log,
    int exclude_diag, int pos_shift, int pos_mod,
    float* __restrict__ part_m, float* __restrict__ part_s, i64 part_ld,
    float* __restrict__ pos_out, float* __restrict__ colp_m, float* __restrict__ colp_s,
    const float* __restrict__ lse_row, const float* __restrict__ lse_col,
    const float* __restrict__ w_ptr, i64 w_stride, float w_mul,
    T* __restrict__ g, i64 ldg, float* __restrict__ dsp_part,
    const unsigned char* __restrict__ mask = 0, const T* __restrict__ bias = 0, int act = 0,
    IX* __restrict__ arg = 0, int sp_batches = 0, int sp_per = 0, int sp_group = 1,
    int tri = 0, const long long* __restrict__ lab_r = 0,
    const long long* __restrict__ lab_c = 0)
{
    // G / H / CLIP on wgmma write their 16-bit tile through shared memory (stmatrix, then
    // 16-byte coalesced stores): the last of the WSTAGES stage slots becomes that staging
    // buffer, 16 KiB per warpgroup (same dynamic shared memory size for every mode)
    enum { SOUT = WG && (MODE == MODE_G || MODE == MODE_H || MODE == MODE_CLIP
                         || MODE == MODE_SIGLIP) };
    typedef TileLoop<T, WG, SOUT ? WSTAGES - 1 : WSTAGES> L;
    enum { I = L::I, J = L::J, NCG = L::NCG, NS = L::STAGES };
    extern __shared__ __align__(16) unsigned short smem[];
    __shared__ float red[2][NCG][TBN];
    // per tile parity: H / CLIP column lse (base 2), weight and factor f_j (see the epilogue);
    // LSE2 column shift
    __shared__ float colv[2][3][TBN];

    const float ninf = -cpn_inf<float>();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int cbase = L::col_base(warp);
    const int gq = lane >> 2, cq = lane & 3;
    // SPMAX: a 1-D grid over (batch group, vocabulary tile) in groups of sp_group batch
    // groups (Triton's grouped ordering): the CTAs in flight share a few weight tiles and a
    // few batches' x, so both stay in L2 (v-tile-major order re-read each CTA's weight rows
    // from HBM for every position tile: 420 TFLOP/s on the H100)
    int sp_vt = 0, sp_grp = 0;
    if (MODE == MODE_SPMAX) {
        const int ngroups = (sp_batches + sp_per - 1) / sp_per;
        const int vtiles = (rows + TBM - 1) / TBM;
        const int span = sp_group * vtiles, first = (blockIdx.x / span) * sp_group;
        const int gsz = min(ngroups - first, sp_group), r = blockIdx.x % span;
        sp_grp = first + r % gsz;
        sp_vt = r / gsz;
    }
    const int m0 = (MODE == MODE_SPMAX ? sp_vt : blockIdx.x) * TBM;
    const int ncols = n1 + n2;
    // SPMAX: the CTA (vocabulary tile blockIdx.x, batch group blockIdx.y) covers batches
    // [sb0, sb1); its column tiles are (batch, position tile) in order, LT tiles per batch,
    // so the pipeline runs on across batches; x[b] is rows [b n1, (b + 1) n1) of B1
    const int LT = (n1 + TBN - 1) / TBN;
    const int sb0 = MODE == MODE_SPMAX ? sp_grp * sp_per : 0;
    const int sb1 = MODE == MODE_SPMAX ? min(sp_batches, sb0 + sp_per) : 0;
    // LSE2 / H with `tri` (NT-Xent, S = Z Z^T symmetric, A = B1 = Z, row0 = 0): row tile I takes
    // the column tiles I + o (mod CT) for o = 0 .. tri_count(I) - 1 only, so every unordered
    // pair of tiles is computed once (see tri_count); the columns of the o >= 1 tiles get
    // column partials, which are the row sums of the rows of tile I + o for the tiles < I + o.
    const int CT = (ncols + TBN - 1) / TBN;
    const int tri_i = m0 / TBM;
    const bool TRI = (MODE == MODE_LSE2 || MODE == MODE_H) && tri;  // (as ep.tri)
    const int ntiles = MODE == MODE_SPMAX ? (sb1 - sb0) * LT : TRI ? tri_count(tri_i, CT) : CT;
    const int split = MODE == MODE_SPMAX ? 0 : blockIdx.y;
    const int splits = MODE == MODE_SPMAX ? 1 : gridDim.y;
    // first column of column tile t of this CTA (SPMAX: within its batch), and its batch
    auto tile_n0 = [&](int t) {
        return MODE == MODE_SPMAX ? (t % LT) * TBN
             : TRI ? ((tri_i + split + t * splits) % CT) * TBN : (split + t * splits) * TBN; };
    auto tile_batch = [&](int t) { return sb0 + t / LT; };
    const int my_tiles = ntiles > split ? (ntiles - split + splits - 1) / splits : 0;
    const int KT = (d + TBK - 1) / TBK;
    const int total = my_tiles * KT;
    const EpiCtx<T> ep = epi_ctx<T, MODE, LAB>(g, ldg, part_m, part_s, part_ld, pos_out, colp_m,
        colp_s, dsp_part, rows, row0, ncols, m0, split, exclude_diag, scale_mul, scale_log,
        lse_col, w_mul, tri, lab_r, lab_c);
    L loop;
    loop.init(smem, lane, warp);
    // SOUT: the staging tile of the thread's warpgroup, in the last stage slot of the
    // (1 KiB-aligned) wgmma ring
    char* const sout = (char*)smem + (((smem_u32(smem) + 1023u) & ~1023u) - smem_u32(smem))
                     + (WSTAGES - 1) * WSTAGE_BYTES + (warp >> 2) * (64 * TBN * 2);

    RowState<I> rs;
    rows_init<T, MODE, L>(rs, ep, lse_row, w_ptr, w_stride, pos_shift, pos_mod, warp, gq);
    // SPMAX: the running (max, arg-max, NaN seen) of each row, in rs.rm and these
    float (&rm)[I][2] = rs.rm;
    const int (&gi)[I][2] = rs.gi;
    const bool (&rv)[I][2] = rs.rv;
    int win[I][2];
    bool nanr[I][2];
    float bvr[I][2];  // SPMAX: the row's bias, added to each fp32 logit before its rounding
#pragma unroll
    for (int i = 0; i < I; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            win[i][h] = -1; nanr[i][h] = false;
            bvr[i][h] = MODE == MODE_SPMAX && bias && rv[i][h] ? Conv<T>::load(bias[gi[i][h]]) : 0.f;
        }

    // Loads: thread tid copies 16-byte chunk lc of rows lr0 + 32 u (u < LU) of the A and B
    // tiles; the A rows are fixed for the CTA, the B rows are set once per column tile.
    enum { LU = TBM * (TBK / 8) / TTHREADS };
    const int lr0 = tid >> 3, lc = tid & 7;
    const T* a_src[LU];
    const T* b_src[LU];
    bool a_ok[LU], b_ok[LU];
#pragma unroll
    for (int u = 0; u < LU; ++u) {
        const int row = m0 + lr0 + 32 * u;
        a_ok[u] = row < rows;
        a_src[u] = A + (a_ok[u] ? (i64)row * lda : 0) + lc * 8;
    }
    int ld_it = 0, ld_kt = 0, ld_tile = 0;  // the next step to load
    auto load_next = [&]() {
        const int stage = ld_it % NS;
        if (ld_kt == 0) {
            const int n0 = tile_n0(ld_tile);
            const T* B1t = MODE == MODE_SPMAX ? B1 + (i64)tile_batch(ld_tile) * n1 * ldb1 : B1;
#pragma unroll
            for (int u = 0; u < LU; ++u) {
                const int col = n0 + lr0 + 32 * u;
                b_ok[u] = col < ncols;
                b_src[u] = (col < n1 ? B1t + (i64)col * ldb1
                            : col < ncols ? B2 + (i64)(col - n1) * ldb2 : B1) + lc * 8;
            }
        }
        const int k0 = ld_kt * TBK;
        const bool kok = k0 + lc * 8 < d;
#pragma unroll
        for (int u = 0; u < LU; ++u) {
            const bool ok = a_ok[u] && kok;
            cp_async16(loop.dst(0, stage, lr0 + 32 * u, lc), ok ? a_src[u] + k0 : A, ok ? 16 : 0);
        }
#pragma unroll
        for (int u = 0; u < LU; ++u) {
            const bool ok = b_ok[u] && kok;
            cp_async16(loop.dst(1, stage, lr0 + 32 * u, lc), ok ? b_src[u] + k0 : B1, ok ? 16 : 0);
        }
        ++ld_it;
        if (++ld_kt == KT) { ld_kt = 0; ++ld_tile; }
    };

    // the three per-row slots of row_pairs() in red[] (free outside the column partials)
    float* const pair_slots[3] = {red[0][0], red[1][0], red[0][1]};

    float acc[I][J][4];
#pragma unroll
    for (int st = 0; st < L::PREFETCH; ++st) {
        if (ld_it < total) load_next();
        cp_commit();
    }
    // Tiles outer, K steps inner (not one flattened loop with the epilogue behind a
    // `continue`: there the accumulators are loop-carried across the epilogue's join and ptxas
    // drains the wgmma pipe every K step, C7517).  One MMA batch stays in flight in the K loop;
    // the retire after it waits for all.  Same MMA order: the same bits.
    int it = 0, tile = 0;
    for (int tt = 0; tt < my_tiles; ++tt) {
    if (MODE == MODE_SPMAX && tid < TBN) {  // 1 where position col counts (before the K loop:
        const int col = tile_n0(tile) + tid;  // between wgmma batches it serialises them, C7514)
        colv[tile & 1][0][tid] =
            col < ncols && (!mask || mask[(i64)tile_batch(tile) * n1 + col]) ? 1.f : 0.f;
    }
    for (int kt = 0; kt < KT; ++kt, ++it) {
        loop.wait_stage();
        __syncthreads();  // step it is in shared memory; the stage loaded below is free
        loop.issue(acc, it % NS, kt == 0);
        if ((MODE == MODE_H || MODE == MODE_CLIP || MODE == MODE_LSE2) && kt == 0 && tid < TBN) {
            float v[4];  // read by this tile's epilogue
            colv_values<MODE>(v, colv_load(tile_n0(tile) + tid, ncols, lse_col, w_ptr, w_stride),
                              w_mul, ep.sl2);
            colv[tile & 1][0][tid] = v[0];
            colv[tile & 1][1][tid] = v[1];
            if (MODE != MODE_LSE2) colv[tile & 1][2][tid] = v[2];
        }
        if (ld_it < total) load_next();  // overlaps the (asynchronous) MMA
        cp_commit();
        if (WG) wg_wait1();
    }
        loop.retire(acc, true);

        // ---------------- epilogue of one 128 x 128 tile ----------------
        const int cur = tile++;
        const int n0 = tile_n0(cur);
        if ((MODE == MODE_LSE2 || MODE == MODE_H || MODE == MODE_CLIP || MODE == MODE_SPMAX)
            && KT == 1)
            __syncthreads();  // colv written this iteration
        if (MODE != MODE_SPMAX)
            tile_epilogue<T, MODE, L>(ep, rs, acc, n0, ncols, colv[cur & 1], red, sout, warp,
                                      lane, tid);
        if (MODE == MODE_SPMAX) {  // running (max, arg-max, NaN) of each row over positions
            const float* onc = colv[cur & 1][0] + cbase + 2 * cq;  // [j * 8 + e]
#pragma unroll
            for (int i = 0; i < I; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int j = 0; j < J; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {  // increasing column: strict > keeps the first
                            const float x = spl_logit<T>(acc[i][j][h * 2 + e], bvr[i][h]);
                            const bool on = onc[j * 8 + e] != 0.f;
                            const bool gt = on && x > rm[i][h];
                            rm[i][h] = gt ? x : rm[i][h];
                            win[i][h] = gt ? n0 + cbase + j * 8 + 2 * cq + e : win[i][h];
                            nanr[i][h] |= on && x != x;
                        }
        }
        if (MODE == MODE_SPMAX && cur % LT == LT - 1) {  // the batch's last tile: write it
#pragma unroll
            for (int i = 0; i < I; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int o = 1; o < 4; o <<= 1) {
                        const float om = __shfl_xor_sync(0xffffffffu, rm[i][h], o);
                        const int ow = __shfl_xor_sync(0xffffffffu, win[i][h], o);
                        nanr[i][h] |= __shfl_xor_sync(0xffffffffu, (int)nanr[i][h], o) != 0;
                        spl_merge(rm[i][h], win[i][h], om, ow);
                    }
            row_pairs<L, I>(pair_slots, warp, cq, gq, rv,  // 2nd warp: columns 64-127
                [&](int i, int h, float* v) {
                    v[0] = rm[i][h]; v[1] = __int_as_float(win[i][h]); v[2] = nanr[i][h] ? 1.f : 0.f;
                },
                [&](int i, int h, const float* v) {
                    float m = rm[i][h];
                    int w = win[i][h];
                    bool isnan = nanr[i][h];
                    if (L::ROW_WARPS == 2) {
                        spl_merge(m, w, v[0], __float_as_int(v[1]));
                        isnan |= v[2] != 0.f;
                    }
                    spl_write<T, IX, float>(m, w, isnan, tile_batch(cur), gi[i][h], 0, rows,
                                            act, g, arg);
                });
#pragma unroll
            for (int i = 0; i < I; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) { rm[i][h] = ninf; win[i][h] = -1; nanr[i][h] = false; }
        }
    }
    if (MODE == MODE_LSE || MODE == MODE_LSE2 || MODE == MODE_CLIP || MODE == MODE_SIGLIP)
        rows_finish<T, MODE, L>(ep, rs, pair_slots, warp, lane);
}
