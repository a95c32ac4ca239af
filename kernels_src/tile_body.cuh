// cupynce tile body: one CTA's walk over its score tiles and the epilogue of each MODE
// (see tiles.cu for the modes and the schedule).  The modes share the main loop's registers,
// so they are one templated function: an epilogue reads the accumulators the MMA wrote.
// Included by tiles.cu (the InfoNCE family) and splade_tiles.cu (SPLADE's max).
#pragma once
#include "splade_common.cuh"
#include "tile_loop.cuh"

// Per-row results: with mma.sync (ROW_WARPS == 2) a row's columns are split over two warps,
// so the second warp's quad leader hands three values per row to the first through shared
// memory (`put(i, h, v)` fills v); then `finish(i, h, v)` runs on the first warp's quad
// leaders for every valid row, v = the partner's values (0 when ROW_WARPS == 1).  Called by
// every thread of the CTA (it holds a barrier); slot[k][row] is 128 floats each.
template <typename L, int I, typename Put, typename Finish>
__device__ __forceinline__ void row_pairs(float* const (&slot)[3], int warp, int cq, int rbase,
                                          int gq, const bool (&rv)[I][2], Put put,
                                          Finish finish) {
    if (L::ROW_WARPS == 2 && (warp & 1) == 1 && cq == 0) {
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float v[3];
                put(i, h, v);
                const int rr = rbase + i * 16 + h * 8 + gq;
#pragma unroll
                for (int k = 0; k < 3; ++k) slot[k][rr] = v[k];
            }
    }
    __syncthreads();
    if ((L::ROW_WARPS == 1 || (warp & 1) == 0) && cq == 0) {
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (!rv[i][h]) continue;
                const int rr = rbase + i * 16 + h * 8 + gq;
                float v[3];
#pragma unroll
                for (int k = 0; k < 3; ++k) v[k] = L::ROW_WARPS == 2 ? slot[k][rr] : 0.f;
                finish(i, h, (const float*)v);
            }
    }
}

// f = w 2^-l (CLIP: halved) for the one-exp2 H / CLIP epilogue; NaN (the two-exp2 form is
// used) when l is not finite or |l| > 100 (base 2), and when a nonzero f is not a normal
// float below 2^126: flushed to zero (this file builds with -ftz) it would drop the whole
// w 2^(t - l) term, and f_i + f_j must stay finite.
template <int MODE>
__device__ __forceinline__ float hw_factor(float l2, float w) {
    if (!(fabsf(l2) <= 100.f)) return cpn_nan<float>();
    const float f = (MODE == MODE_CLIP ? 0.5f * w : w) * exp2f(-l2);
    if (w != 0.f && !(fabsf(f) >= 1.17549435e-38f && fabsf(f) <= 8.5e37f)) return cpn_nan<float>();
    return f;
}

// One halving of a reduce-scatter over lane bit `o`: of v[0, NV) the lane keeps the upper
// half when `up`, adds its partner's copy of that half, and leaves the sums in v[0, NV/2).
template <int NV>
__device__ __forceinline__ void reduce_scatter(float* v, bool up, int o) {
#pragma unroll
    for (int k = 0; k < NV / 2; ++k) {
        const float send = up ? v[k] : v[k + NV / 2];
        const float keep = up ? v[k + NV / 2] : v[k];
        v[k] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
}

// Symmetric tile schedule over CT x CT tiles: row tile i takes the column tiles i + o (mod CT),
// o = 0 .. tri_count(i, CT) - 1.  Each unordered pair {i, j}, i != j, has circular distances
// d and CT - d, one of them <= (CT - 1) / 2 for odd CT; for even CT the pairs at distance
// CT / 2 go to the smaller tile.  So every pair is computed exactly once and every row tile
// takes (CT + 1) / 2 or (CT + 2) / 2 tiles: balanced, unlike the upper triangle.
__host__ __device__ __forceinline__ int tri_count(int i, int ct) {
    return 1 + (ct - 1) / 2 + ((ct % 2 == 0 && i < ct / 2) ? 1 : 0);
}

template <typename T, int MODE, bool WG, typename IX = int>
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
    int tri = 0)
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
    const int rbase = L::row_base(warp), cbase = L::col_base(warp), cg = L::col_group(warp);
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
    const bool TRI = (MODE == MODE_LSE2 || MODE == MODE_H) && tri;
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
    const float scale = scale_log ? scale_mul * expf(scale_log[0]) : scale_mul;
    const float sl2 = scale * CPN_LOG2E;  // logits in base-2 units: t = acc * sl2
    // SIGLIP: the bias beta (through the lse_col slot, which this mode does not otherwise use);
    // the loss only where asked for (part_m), the gradient's terms only where asked for
    const float sbias = MODE == MODE_SIGLIP ? lse_col[0] : 0.f;
    const float sb2 = sbias * CPN_LOG2E;  // (the fast path's logits in base-2 units)
    const bool sg_loss = MODE == MODE_SIGLIP && part_m;
    const bool sg_grad = MODE == MODE_SIGLIP && (g || part_s || dsp_part);
    L loop;
    loop.init(smem, lane, warp);
    // SOUT: the staging tile, the last stage slot of the (1 KiB-aligned) wgmma ring
    const unsigned stage_smem = ((smem_u32(smem) + 1023u) & ~1023u) + (WSTAGES - 1) * WSTAGE_BYTES;

    // per-thread rows: (i, h) -> local row m0 + rbase + i*16 + h*8 + gq
    float rm[I][2], rl[I][2], rx[I][2], li2[I][2], wi[I][2], fi[I][2];
    int gi[I][2], pr[I][2], win[I][2];  // global row, its positive column; SPMAX arg-max
    bool nanr[I][2];  // SPMAX: a NaN logit seen
    bool rv[I][2];
#pragma unroll
    for (int i = 0; i < I; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int lr = m0 + rbase + i * 16 + h * 8 + gq;
            rv[i][h] = lr < rows;
            gi[i][h] = row0 + lr;
            pr[i][h] = (int)(((i64)gi[i][h] + pos_shift) % pos_mod);
            rm[i][h] = ninf; rl[i][h] = 0.f; rx[i][h] = 0.f;
            li2[i][h] = 0.f; wi[i][h] = 0.f; fi[i][h] = 0.f;
            win[i][h] = -1; nanr[i][h] = false;
            if ((MODE == MODE_G || MODE == MODE_H || MODE == MODE_CLIP) && rv[i][h]) {
                li2[i][h] = lse_row[gi[i][h]] * CPN_LOG2E;
                wi[i][h] = w_mul * (w_ptr ? w_ptr[(i64)gi[i][h] * w_stride] : 1.f);
                fi[i][h] = hw_factor<MODE>(li2[i][h], wi[i][h]);
            }
            if (MODE == MODE_SIGLIP) {  // rl: loss, rx: dscale, rm: dbias (sums from 0,
                rm[i][h] = 0.f;          // of z-signed sigmoids: the row's factors at the end);
                // wi: v_i without w_mul (the products' alpha); fi: s v_i, the block's factor
                wi[i][h] = rv[i][h] ? (w_ptr ? w_ptr[(i64)gi[i][h] * w_stride] : 1.f) : 0.f;
                fi[i][h] = scale * wi[i][h];
            }
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
            const int col = tile_n0(tile) + tid;  // read by this tile's epilogue
            const bool ok = col < ncols;
            // LSE2: the column's shift, its positive logit (lse_col holds the raw dots)
            colv[tile & 1][0][tid] = ok ? lse_col[col] * (MODE == MODE_LSE2 ? sl2 : CPN_LOG2E) : 0.f;
            const float wc = ok ? w_mul * (w_ptr ? w_ptr[(i64)col * w_stride] : 1.f) : 0.f;
            colv[tile & 1][1][tid] = wc;
            if (MODE != MODE_LSE2) colv[tile & 1][2][tid] = ok ? hw_factor<MODE>(colv[tile & 1][0][tid], wc) : 0.f;
        }
        if (ld_it < total) load_next();  // overlaps the (asynchronous) MMA
        cp_commit();
        if (WG) wg_wait1();
    }
        loop.retire(acc, true);

        // ---------------- epilogue of one 128 x 128 tile ----------------
        const int cur = tile++;
        const int n0 = tile_n0(cur);
        // Most tiles hold no column past the end, no diagonal and no positive of this warp's
        // rows: those take the unchecked copy of the epilogue (C = false).
        bool special = n0 + TBN > ncols;
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                special |= (unsigned)(gi[i][h] - n0) < TBN || (unsigned)(pr[i][h] - n0) < TBN;
        special = __any_sync(0xffffffffu, special);
        // LSE2 on an unchecked tile (`colfast`): the column sums reuse the row pass's
        // exponentials, 2^(t_ij - c_j) = 2^(t_ij - m_i) 2^(m_i - M) 2^(M - c_j) with M the
        // warp's largest running row max: one exp2 per score instead of two.  Taken when
        // M - c_j <= 64 for every column of the warp (then no term exceeds 2^64, as on the
        // shifted path below); the row sums are the same operations in the same order either
        // way.  A term below 2^-126 (a row 126 binary orders under M) flushes to zero: at most
        // 2^-62 against the column's full sum, which holds its positive pair's 2^0.
        const float* cc2 = colv[cur & 1][0] + cbase + 2 * cq;  // LSE2: c_j at [j * 8 + e]
        float cs[MODE == MODE_LSE2 ? 2 * J : 1];
        float mw = ninf;
        bool colfast = false;
        if (MODE == MODE_LSE2) {
            if (KT == 1) __syncthreads();  // colv written this iteration
            if (!special) {
                float mn[I][2];
#pragma unroll
                for (int i = 0; i < I; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float tm = ninf;
#pragma unroll
                        for (int j = 0; j < J; ++j)
#pragma unroll
                            for (int e = 0; e < 2; ++e) tm = fmaxf(tm, acc[i][j][h * 2 + e] * sl2);
                        mn[i][h] = fmaxf(rm[i][h], tm);
                        if (rv[i][h]) mw = fmaxf(mw, mn[i][h]);
                    }
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) mw = fmaxf(mw, __shfl_xor_sync(0xffffffffu, mw, o));
                bool ok = true;
#pragma unroll
                for (int j = 0; j < J; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) ok &= mw - cc2[j * 8 + e] <= 64.f;
                colfast = __all_sync(0xffffffffu, ok);
                if (colfast) {
#pragma unroll
                    for (int k = 0; k < 2 * J; ++k) cs[k] = 0.f;
#pragma unroll
                    for (int i = 0; i < I; ++i)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const float m = rm[i][h], mnv = mn[i][h];
                            const float r = rv[i][h] ? exp2f(mnv - mw) : 0.f;
                            float l = rl[i][h] * exp2f(m - mnv);
#pragma unroll
                            for (int j = 0; j < J; ++j)
#pragma unroll
                                for (int e = 0; e < 2; ++e) {
                                    const float ev = exp2f(acc[i][j][h * 2 + e] * sl2 - mnv);
                                    l += ev;
                                    cs[j * 2 + e] += ev * r;
                                }
                            rm[i][h] = mnv; rl[i][h] = l;
                        }
                }
            }
        }
        if ((MODE == MODE_LSE || MODE == MODE_LSE2) && !colfast) {
    #pragma unroll
            for (int variant = 0; variant < 2; ++variant) {  // two copies: C is a constant in each
                const bool C = variant == 0;
                if (C != special) continue;
#pragma unroll
                for (int i = 0; i < I; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int grow = gi[i][h];
                        float v[2 * J];
                        float tm = ninf;
#pragma unroll
                        for (int j = 0; j < J; ++j)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const float a = acc[i][j][h * 2 + e];
                                float t = a * sl2;
                                if (C) {
                                    const int col = n0 + cbase + j * 8 + 2 * cq + e;
                                    if (col >= ncols || (exclude_diag && col == grow)) t = ninf;
                                    if (pos_out && col == pr[i][h] && rv[i][h]) pos_out[grow - row0] = a * scale;
                                    tm = nanmax(tm, t);
                                } else {
                                    tm = fmaxf(tm, t);  // a NaN still reaches l below
                                }
                                v[j * 2 + e] = t;
                            }
                        float m = rm[i][h], l = rl[i][h];
                        if (C) {
                            if (tm != tm) { m = tm; l = tm; }
                            else if (tm > m) { l *= exp2f(m - tm); m = tm; }
                            if (m > ninf) {
#pragma unroll
                                for (int k = 0; k < 2 * J; ++k) l += exp2f(v[k] - m);
                            }
                        } else {
                            const float mn = fmaxf(m, tm);
                            l *= exp2f(m - mn);
#pragma unroll
                            for (int k = 0; k < 2 * J; ++k) l += exp2f(v[k] - mn);
                            m = mn;
                        }
                        rm[i][h] = m; rl[i][h] = l;
                    }
            }
        }
        // column partials over this CTA's 128 rows (TRI: not on the diagonal tile, whose
        // column sums are its own rows' sums)
        if (MODE == MODE_LSE2 && !(TRI && n0 == m0)) {
            // Fast path: each column shifted by its positive logit c_j (staged in colv), so the
            // partial is a plain sum of 2^(t - c_j) -- no max to find, no rescaling -- and the
            // 8 lanes that share a column reduce their 2J sums by a reduce-scatter (2J - J/4
            // shuffles instead of 6 per column).  Exact while no term exceeds 2^64 (a score
            // 44 nats above the column's positive); a warp that meets one takes the max-based
            // path below for this tile.  Both write (m, s) pairs in base 2 to red[].
            bool big = false;
            if (!colfast) {  // (colfast: cs holds the sums, scaled by 2^(c_j - M))
#pragma unroll
            for (int j = 0; j < J; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float c = cc2[j * 8 + e];
                    float s = 0.f;
#pragma unroll
                    for (int i = 0; i < I; ++i)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            if (rv[i][h]) {
                                const float x = acc[i][j][h * 2 + e] * sl2 - c;
                                big |= x > 64.f;
                                s += exp2f(x);
                            }
                    cs[j * 2 + e] = s;
                }
            }
            if (!__any_sync(0xffffffffu, big)) {
                reduce_scatter<2 * J>(cs, lane & 16, 16);
                reduce_scatter<J>(cs, lane & 8, 8);
                reduce_scatter<J / 2>(cs, lane & 4, 4);
#pragma unroll
                for (int k = 0; k < J / 4; ++k) {  // the lane's columns after the three halvings
                    const int idx = k + ((lane & 16) ? J : 0) + ((lane & 8) ? J / 2 : 0) +
                                    ((lane & 4) ? J / 4 : 0);  // = j * 2 + e
                    const int off = (idx >> 1) * 8 + (idx & 1);
                    red[0][cg][cbase + 2 * cq + off] = cc2[off];
                    red[1][cg][cbase + 2 * cq + off] = colfast ? cs[k] * exp2f(mw - cc2[off]) : cs[k];
                }
            } else {
#pragma unroll
            for (int j = 0; j < J; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    // the warp's column max first (8 lanes share a column), then one sum of
                    // exponentials against it: no rescaling merges
                    float cm = ninf, cl = 0.f;
#pragma unroll
                    for (int i = 0; i < I; ++i)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            if (rv[i][h]) cm = nanmax(cm, acc[i][j][h * 2 + e] * sl2);
#pragma unroll
                    for (int o = 4; o < 32; o <<= 1) cm = nanmax(cm, __shfl_xor_sync(0xffffffffu, cm, o));
                    if (cm > ninf) {  // false for NaN too: (NaN, 0) still merges to NaN
#pragma unroll
                        for (int i = 0; i < I; ++i)
#pragma unroll
                            for (int h = 0; h < 2; ++h)
                                if (rv[i][h]) cl += exp2f(acc[i][j][h * 2 + e] * sl2 - cm);
                    }
#pragma unroll
                    for (int o = 4; o < 32; o <<= 1) cl += __shfl_xor_sync(0xffffffffu, cl, o);
                    if (gq == 0) {
                        const int cc = cbase + j * 8 + 2 * cq + e;
                        red[0][cg][cc] = cm;
                        red[1][cg][cc] = cl;
                    }
                }
            }
            __syncthreads();
            if (tid < TBN && n0 + tid < ncols) {
                float cm = red[0][0][tid], cl = red[1][0][tid];
#pragma unroll
                for (int w = 1; w < NCG; ++w) lse2_merge(cm, cl, red[0][w][tid], red[1][w][tid]);
                const i64 o = (i64)blockIdx.x * ncols + n0 + tid;
                colp_m[o] = cm * CPN_LN2;
                colp_s[o] = cl;
            }
            __syncthreads();
        }
        if (MODE == MODE_SPMAX) {  // running (max, arg-max, NaN) of each row over positions
            if (KT == 1) __syncthreads();  // colv written this iteration
            const float* onc = colv[cur & 1][0] + cbase + 2 * cq;  // [j * 8 + e]
#pragma unroll
            for (int i = 0; i < I; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int j = 0; j < J; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {  // increasing column: strict > keeps the first
                            const float x = Conv<T>::load(Conv<T>::store(acc[i][j][h * 2 + e]));
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
            row_pairs<L, I>(pair_slots, warp, cq, rbase, gq, rv,  // 2nd warp: columns 64-127
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
                                            bias, act, g, arg);
                });
#pragma unroll
            for (int i = 0; i < I; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) { rm[i][h] = ninf; win[i][h] = -1; nanr[i][h] = false; }
        }
        if (MODE == MODE_G || MODE == MODE_H || MODE == MODE_CLIP || MODE == MODE_SIGLIP) {
            if ((MODE == MODE_H || MODE == MODE_CLIP) && KT == 1) __syncthreads();  // colv written
            const float* lc2 = colv[cur & 1][0] + cbase + 2 * cq;  // [j * 8 + e]
            const float* wc = colv[cur & 1][1] + cbase + 2 * cq;
            const float* fc = colv[cur & 1][2] + cbase + 2 * cq;
            // H / CLIP on unchecked tiles: w_i 2^(t - l_i) + w_j 2^(t - l_j) = 2^t (f_i + f_j)
            // with f = w 2^-l (times 1/2 for CLIP), one exp2 per score instead of two.  Taken
            // by a warp when every score of its tile has |t| <= 100 and every f is finite, so
            // that 2^t and the f are normal floats; otherwise the two-exp2 form below.
            // (|t| <= 100 through the largest |acc|: one max per score; a NaN score, which
            // fmaxf skips, gives NaN on either path)
            bool fast = false;
            if ((MODE == MODE_H || MODE == MODE_CLIP) && !special) {
                bool bad = false;
                float amax = 0.f;
#pragma unroll
                for (int i = 0; i < I; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) bad |= rv[i][h] && fi[i][h] != fi[i][h];
#pragma unroll
                for (int j = 0; j < J; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        bad |= fc[j * 8 + e] != fc[j * 8 + e];
#pragma unroll
                        for (int i = 0; i < I; ++i)
#pragma unroll
                            for (int h = 0; h < 2; ++h)
                                amax = fmaxf(amax, fabsf(acc[i][j][h * 2 + e]));
                    }
                bad |= !(amax * fabsf(sl2) <= 100.f);
                fast = !__any_sync(0xffffffffu, bad);
            }
            // SIGLIP on unchecked tiles (every score a negative, z = -1): when every logit
            // of the warp's tile is L <= -7 ln 2 (u = L log2(e) <= -7: one max of the raw
            // dots, s > 0), e = exp(L) = 2^u <= 2^-7 and the series log1p(e) = e (1 - e/2 +
            // e^2/3) and sigmoid(L) = e / (1 + e) = e (1 - e + e^2) are within ~2^-21
            // relative (the next terms): one SFU exp2 and FMAs instead of expf, log1pf and
            // a division.  (NaN, which fmaxf skips, propagates through e on this path too;
            // +inf fails the test.)
            if (MODE == MODE_SIGLIP && !special) {
                float hi = ninf;
#pragma unroll
                for (int i = 0; i < I; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float rmax = ninf;
#pragma unroll
                        for (int j = 0; j < J; ++j)
#pragma unroll
                            for (int e = 0; e < 2; ++e) rmax = fmaxf(rmax, acc[i][j][h * 2 + e]);
                        if (rv[i][h]) hi = fmaxf(hi, rmax);
                    }
                fast = __all_sync(0xffffffffu, !(hi > ninf) || fmaf(hi, sl2, sb2) <= -7.f);
            }
            unsigned pk[I][2][J];  // SOUT: the packed values, in the fragment layout
#pragma unroll
            for (int i = 0; i < I; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int j = 0; j < J; ++j) pk[i][h][j] = 0u;
#pragma unroll
            for (int variant = 0; variant < 3; ++variant) {  // C and F are constants in each copy
                const bool C = variant == 0, F = variant == 2;
                if (MODE == MODE_G && F) continue;
                if (C != special || F != fast) continue;
#pragma unroll
                for (int i = 0; i < I; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if (!rv[i][h]) continue;
                        const int grow = gi[i][h], pos = pr[i][h];
                        T* grow_ptr = g ? g + (i64)(grow - row0) * ldg : g;
#pragma unroll
                        for (int j = 0; j < J; ++j) {
                            float val[2];
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const int col = n0 + cbase + j * 8 + 2 * cq + e;
                                const float t = acc[i][j][h * 2 + e] * sl2;
                                float x;
                                if (MODE == MODE_G) {
                                    float p = (C && exclude_diag && col == grow) ? 0.f : exp2f(t - li2[i][h]);
                                    if (C && col == pos) p -= 1.f;
                                    x = wi[i][h] * scale * p;
                                } else if (MODE == MODE_SIGLIP && F) {
                                    // every score a negative with u = L log2(e) <= -7 (above)
                                    const float raw = acc[i][j][h * 2 + e];
                                    const float ez = cpn_ex2_approx(fmaf(raw, sl2, sb2));
                                    x = 0.f;
                                    if (sg_loss)  // log1p(e)
                                        rl[i][h] = fmaf(ez, fmaf(ez, fmaf(ez, 1.f / 3.f, -0.5f),
                                                                 1.f), rl[i][h]);
                                    if (sg_grad) {  // sigmoid(L)
                                        const float se = ez * fmaf(ez, ez - 1.f, 1.f);
                                        rx[i][h] = fmaf(se, raw, rx[i][h]);
                                        rm[i][h] += se;
                                        x = fi[i][h] * se;
                                    }
                                } else if (MODE == MODE_SIGLIP) {
                                    // L = s a + beta, z = +1 on the positive (col == grow)
                                    // and -1 elsewhere: softplus(-zL) and sigmoid(-zL) from
                                    // one e = exp(-|zL|), as siglip_rows (contrastive.cu)
                                    const float raw = acc[i][j][h * 2 + e];
                                    const bool posi = C && col == grow;
                                    const float lg = scale * raw + sbias;
                                    const float zl = posi ? lg : -lg;
                                    const float ez = cpn_exp(-fabsf(zl));
                                    x = 0.f;
                                    if (sg_loss && (!C || col < ncols))
                                        rl[i][h] += (zl < 0.f ? -zl : 0.f) + cpn_log1p(ez);
                                    if (sg_grad && (!C || col < ncols)) {
                                        // -z sigmoid(-zl); (1 + ez in [1, 2]: the fast
                                        // division is within 2 ulp, far below the block's
                                        // rounding); the row's factors w_mul v_i (s) at the end
                                        const float sg = __fdividef(zl > 0.f ? ez : 1.f, 1.f + ez);
                                        const float sz = posi ? -sg : sg;
                                        rx[i][h] = fmaf(sz, raw, rx[i][h]);
                                        rm[i][h] += sz;
                                        x = fi[i][h] * sz;
                                    }
                                } else if (F) {  // H or CLIP, unchecked tile
                                    const float G = exp2f(t) * (fi[i][h] + fc[j * 8 + e]);
                                    if (MODE == MODE_CLIP) rx[i][h] += G * t;
                                    x = scale * G;
                                } else if (MODE == MODE_H) {
                                    if (C && col == grow) {
                                        x = 0.f;
                                    } else {
                                        float p = wi[i][h] * exp2f(t - li2[i][h])
                                                + wc[j * 8 + e] * exp2f(t - lc2[j * 8 + e]);
                                        if (C && col == pos) p -= wi[i][h] + wc[j * 8 + e];
                                        x = scale * p;
                                    }
                                } else {  // MODE_CLIP
                                    float G = wi[i][h] * exp2f(t - li2[i][h])
                                            + wc[j * 8 + e] * exp2f(t - lc2[j * 8 + e]);
                                    if (C && col == grow) G -= wi[i][h] + wc[j * 8 + e];
                                    G *= 0.5f;
                                    if (!C || col < ncols) rx[i][h] += G * t;
                                    x = scale * G;
                                }
                                val[e] = x;
                            }
                            const int col = n0 + cbase + j * 8 + 2 * cq;
                            if (SOUT) {
                                pk[i][h][j] = Pack2<T>::round(val[0], val[1]);
                            } else if (MODE == MODE_SIGLIP && !g) {
                                // (the loss alone: no gradient block)
                            } else if (!C || col + 1 < ncols) {
                                *(unsigned*)(grow_ptr + col) = Pack2<T>::round(val[0], val[1]);
                            } else if (col < ncols) {
                                grow_ptr[col] = Conv<T>::store(val[0]);
                            }
                            // H with `tri` (H = H^T, the whole matrix in g, row0 = 0): an
                            // off-diagonal tile also writes its mirror H_JI = H_IJ^T (SOUT:
                            // through the staging tile below)
                            if (!SOUT && MODE == MODE_H && TRI && n0 != m0) {
#pragma unroll
                                for (int e = 0; e < 2; ++e)
                                    if (!C || col + e < ncols)
                                        g[(i64)(col + e) * ldg + grow] = Conv<T>::store(val[e]);
                            }
                        }
                    }
            }
            if (SOUT && (MODE != MODE_SIGLIP || g)) {  // (g: uniform over the CTA)
                // The warpgroup's 64 x 128 block: stmatrix into a row-major staging tile
                // (256-byte rows, 16-byte chunk c of row r at c ^ (r & 7): conflict-free), then
                // each thread stores 16-byte chunks -- whole 128-byte lines instead of 8 rows x
                // 16 bytes per warp store.  Chunks past the last row or column are skipped; a
                // chunk that starts inside a row stays inside its 16-byte-padded leading dim.
                const int wg = warp >> 2, wl = warp & 3, tw = tid & 127;
                const unsigned sbuf = stage_smem + wg * (64 * TBN * 2);
                const char* sgen = (const char*)smem + (sbuf - smem_u32(smem));
#pragma unroll
                for (int jp = 0; jp < J / 2; ++jp) {
                    const int r = wl * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
                    const int c = 2 * jp + (lane >> 4);
                    stmatrix_x4<false>(sbuf + r * 256 + ((c ^ (r & 7)) << 4), pk[0][0][2 * jp],
                                       pk[0][1][2 * jp], pk[0][0][2 * jp + 1], pk[0][1][2 * jp + 1]);
                }
                wg_bar(wg);
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    const int idx = u * 128 + tw, r = idx >> 4, c = idx & 15;
                    const uint4 v = *(const uint4*)(sgen + r * 256 + ((c ^ (r & 7)) << 4));
                    const int lr = m0 + wg * 64 + r, col = n0 + c * 8;
                    if (lr < rows && col < ncols) *(uint4*)(g + (i64)lr * ldg + col) = v;
                }
                // H with `tri`: the mirror H_JI = H_IJ^T of an off-diagonal tile, transposed
                // by stmatrix.trans into a 128 x 64 staging tile (128-byte rows)
                if (MODE == MODE_H && TRI && n0 != m0) {
                    wg_bar(wg);  // the stores above have read the staging tile
#pragma unroll
                    for (int jp = 0; jp < J / 2; ++jp) {
                        const int mtx = lane >> 3;
                        const int r = (2 * jp + (mtx >> 1)) * 8 + (lane & 7);
                        const int c = wl * 2 + (mtx & 1);
                        stmatrix_x4<true>(sbuf + r * 128 + ((c ^ (r & 7)) << 4), pk[0][0][2 * jp],
                                          pk[0][1][2 * jp], pk[0][0][2 * jp + 1],
                                          pk[0][1][2 * jp + 1]);
                    }
                    wg_bar(wg);
#pragma unroll
                    for (int u = 0; u < 8; ++u) {
                        const int idx = u * 128 + tw, r = idx >> 3, c = idx & 7;
                        const uint4 v = *(const uint4*)(sgen + r * 128 + ((c ^ (r & 7)) << 4));
                        const int grow = n0 + r, col = m0 + wg * 64 + c * 8;
                        if (grow < ncols && col < rows) *(uint4*)(g + (i64)grow * ldg + col) = v;
                    }
                }
            }
        }
    }

    // ---------------- per-row results of this CTA: merge the 4 lanes, then the 2 warps ----
    if (MODE == MODE_SIGLIP) {  // three plain sums per row, in a fixed order
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int o = 1; o < 4; o <<= 1) {
                    rm[i][h] += __shfl_xor_sync(0xffffffffu, rm[i][h], o);
                    rl[i][h] += __shfl_xor_sync(0xffffffffu, rl[i][h], o);
                    rx[i][h] += __shfl_xor_sync(0xffffffffu, rx[i][h], o);
                }
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // dbias: w_mul v_i sum(-z sigma); dscale: times s a
                rm[i][h] *= w_mul * wi[i][h];
                rx[i][h] *= w_mul * fi[i][h];
            }
        // (no barrier first: nothing else in this mode uses red[], row_pairs' slots)
        row_pairs<L, I>(pair_slots, warp, cq, rbase, gq, rv,
            [&](int i, int h, float* v) { v[0] = rm[i][h]; v[1] = rl[i][h]; v[2] = rx[i][h]; },
            [&](int i, int h, const float* v) {
                const i64 o = (i64)split * part_ld + (gi[i][h] - row0);
                const bool two = L::ROW_WARPS == 2;
                if (part_m) part_m[o] = rl[i][h] + (two ? v[1] : 0.f);   // loss
                if (part_s) part_s[o] = rm[i][h] + (two ? v[0] : 0.f);   // dbias
                if (dsp_part) dsp_part[o] = rx[i][h] + (two ? v[2] : 0.f);  // dscale
            });
    }
    if (MODE == MODE_LSE || MODE == MODE_LSE2 || MODE == MODE_CLIP) {
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float m = rm[i][h], l = rl[i][h], x = rx[i][h];
#pragma unroll
                for (int o = 1; o < 4; o <<= 1) {
                    const float om = __shfl_xor_sync(0xffffffffu, m, o);
                    const float ol = __shfl_xor_sync(0xffffffffu, l, o);
                    lse2_merge(m, l, om, ol);
                    x += __shfl_xor_sync(0xffffffffu, x, o);
                }
                rm[i][h] = m; rl[i][h] = l; rx[i][h] = x;
            }
        __syncthreads();  // red[] was last read by the column partials (LSE2)
        row_pairs<L, I>(pair_slots, warp, cq, rbase, gq, rv,
            [&](int i, int h, float* v) { v[0] = rm[i][h]; v[1] = rl[i][h]; v[2] = rx[i][h]; },
            [&](int i, int h, const float* v) {
                const i64 o = (i64)split * part_ld + (gi[i][h] - row0);
                if (MODE == MODE_CLIP) {
                    dsp_part[o] = (rx[i][h] + (L::ROW_WARPS == 2 ? v[2] : 0.f)) * CPN_LN2;
                } else {
                    float m = rm[i][h], l = rl[i][h];
                    if (L::ROW_WARPS == 2) lse2_merge(m, l, v[0], v[1]);
                    part_m[o] = m * CPN_LN2;
                    part_s[o] = l;
                }
            });
    }
}
