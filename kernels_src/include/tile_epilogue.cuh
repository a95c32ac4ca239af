// cupynce tile epilogues: what one 128 x 128 score tile's accumulators become in each MODE
// (see tiles.cu), shared by the main loops that produce the tiles -- the cp.async loops of
// tile_body.cuh (mma.sync, wgmma) and the warp-specialised TMA loop of tile_ws.cuh.  The
// fragment geometry and the barriers come from the layout L (tile_loop.cuh): the epilogue
// code is the same text for every loop, so they give the same values up to the order of the
// products' accumulation and of the row merges.
#pragma once
#include "splade/splade_common.cuh"
#include "include/tile_loop.cuh"
#include "include/tile_stage.cuh"
#include "include/tile_labels.cuh"

// Per-row results: where a row is held twice (ROW_WARPS == 2: with mma.sync a row's columns
// are split over two warps, in the warp-specialised kernel its tiles over two consumer
// warpgroups) the second holder's quad leader (L::second) hands three values per row to the
// first through shared memory (`put(i, h, v)` fills v); then `finish(i, h, v)` runs on the
// first holder's quad leaders for every valid row, v = the partner's values (0 when
// ROW_WARPS == 1).  Called by every thread that holds rows (it holds L::pair_sync);
// slot[k][row] is 128 floats each.
template <typename L, int I, typename Put, typename Finish>
__device__ __forceinline__ void row_pairs(float* const (&slot)[3], int warp, int cq, int gq,
                                          const bool (&rv)[I][2], Put put, Finish finish) {
    const int rbase = L::row_base(warp);
    if (L::ROW_WARPS == 2 && L::second(warp) && cq == 0) {
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float v[3];
                put(i, h, v);
                const int rr = rbase + i * L::IS + h * 8 + gq;
#pragma unroll
                for (int k = 0; k < 3; ++k) slot[k][rr] = v[k];
            }
    }
    L::pair_sync();
    if ((L::ROW_WARPS == 1 || !L::second(warp)) && cq == 0) {
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (!rv[i][h]) continue;
                const int rr = rbase + i * L::IS + h * 8 + gq;
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

// The contrastive tile kernels take their arguments as one struct passed by value: one
// kernel parameter for CuPy to marshal instead of 33 (the launch's host time).  Layout:
// pointers, then 64-bit integers, then 32-bit fields -- no padding inside; Python packs it
// with struct format "<16Q6q9i2f4x" (_engine/tiling.py TILE_ARGS_*; a GPU test compares the
// offsets through cpn_tile_args_layout).  lab_r / lab_c: CLIP's labels (LSE2 and CLIP, 16-bit
// only; null: none): lab_c the int64 labels of rows and columns (one index space), lab_r their
// 128-block key ranges (cpn_label_ranges, stats.cu): a score whose row and column labels
// agree, other than the row's positive (col == row), leaves both softmaxes (see label_bits).
// The TF32x3 tiles' products (tiles_ws_tf32.cu) come out low by this fraction on average:
// each wgmma k8 step truncates its sum toward zero, and a promoted 32-wide chunk (12 steps,
// the last 4 at the chunk's magnitude) keeps the loss, the same sign in every chunk, so it
// does not average out over K.  Measured on an H100 (benchmarks/tf32x3_bias.py, 2026-11-26:
// mean signed error of mm against float64 over its outputs, relative to their mean size):
// -0.91e-7 for zero-mean unit rows at D = 64 ... 512, -0.84e-7 for a softmax-like block
// times unit columns (K = 4096), -1.38e-7 for all-positive unit rows; cuBLAS fp32's is
// below 3e-9.  The products are scaled by 1 + this (folded into s log2(e) in double by the
// softmax epilogues and by cpn_tf32x3_h_from_s, one more FMA in MODE_MM's stores), which
// leaves ~0 for zero-mean data, +0.8e-8 and -4.6e-8 for the other two.  Without it a sum of
// many scores in one direction -- a scale gradient -- inherits the bias.
#define CPN_TF32X3_TRUNC 0.92e-7

template <typename T> struct TileArgs {
    const T* A; const T* B1; const T* B2; const float* scale_log;
    float* part_m; float* part_s; float* pos_out; float* colp_m; float* colp_s;
    const float* lse_row; const float* lse_col; const float* w_ptr; T* g; float* dsp_part;
    const long long* lab_r; const long long* lab_c;
    i64 lda, ldb1, ldb2, part_ld, w_stride, ldg;
    int rows, row0, n1, n2, d, exclude_diag, pos_shift, pos_mod, tri;
    float scale_mul, w_mul;
};

// What the epilogues read besides the tile: the kernel's outputs and scalars, and the CTA's
// row tile (m0) and column split.  TRI: LSE2 / H with NT-Xent's symmetric schedule.
template <typename T> struct EpiCtx {
    T* g;
    float *part_m, *part_s, *pos_out, *colp_m, *colp_s, *dsp_part;
    const long long *lab_r, *lab_c;  // CLIP's labels (LSE2 / CLIP, 16-bit; else null)
    i64 part_ld, ldg;
    int rows, row0, ncols, m0, split, exclude_diag;
    float scale, sl2, sl2lo, sbias, sb2, w_mul;
    bool sg_loss, sg_grad, tri;
};

// LAB: the kernel takes CLIP's labels (the `_lab` kernels of LSE2 / CLIP; lab_r null there
// still means none).  Every other kernel has ep.lab_r = null as a constant, so the label code
// of the epilogue compiles out of it: the same code as before labels existed (a run-time
// null test alone left the no-labels kernels more spills on their hot paths: the label
// block's registers beside the 128 accumulators).
template <typename T, int MODE, bool LAB = false>
__device__ __forceinline__ EpiCtx<T> epi_ctx(
    T* g, i64 ldg, float* part_m, float* part_s, i64 part_ld, float* pos_out, float* colp_m,
    float* colp_s, float* dsp_part, int rows, int row0, int ncols, int m0, int split,
    int exclude_diag, float scale_mul, const float* scale_log, const float* lse_col,
    float w_mul, int tri, const long long* lab_r, const long long* lab_c) {
    EpiCtx<T> ep;
    ep.g = g; ep.ldg = ldg; ep.part_m = part_m; ep.part_s = part_s; ep.part_ld = part_ld;
    const bool lab = LAB && (MODE == MODE_LSE2 || MODE == MODE_CLIP) && sizeof(T) == 2 && lab_r;
    ep.lab_r = lab ? lab_r : 0;
    ep.lab_c = lab ? lab_c : 0;
    ep.pos_out = pos_out; ep.colp_m = colp_m; ep.colp_s = colp_s; ep.dsp_part = dsp_part;
    ep.rows = rows; ep.row0 = row0; ep.ncols = ncols; ep.m0 = m0; ep.split = split;
    ep.exclude_diag = exclude_diag; ep.w_mul = w_mul;
    ep.scale = scale_log ? scale_mul * expf(scale_log[0]) : scale_mul;
    ep.sl2 = ep.scale * CPN_LOG2E;  // logits in base-2 units: t = acc * sl2
    ep.sl2lo = 0.f;
    if (sizeof(T) == 4) {
        // float32 (the TF32x3 tiles): s log2(e) as sl2 + sl2lo, t = acc sl2 + acc sl2lo (log2e
        // in float32 alone is 1.3e-8 off and the product rounds: a bias of every logit alike,
        // -4.7e-8 at s = 1 / 0.07, which the float32 gradient's cancellation magnifies)
        // (times 1 + CPN_TF32X3_TRUNC: the mean truncation loss of the promoted products)
        const double s2 = (double)ep.scale * 1.4426950408889634 * (1.0 + CPN_TF32X3_TRUNC);
        ep.sl2 = (float)s2;
        ep.sl2lo = (float)(s2 - (double)ep.sl2);
    }
    // SIGLIP: the bias beta (through the lse_col slot, which this mode does not otherwise use);
    // the loss only where asked for (part_m), the gradient's terms only where asked for
    ep.sbias = MODE == MODE_SIGLIP ? lse_col[0] : 0.f;
    ep.sb2 = ep.sbias * CPN_LOG2E;  // (the fast path's logits in base-2 units)
    ep.sg_loss = MODE == MODE_SIGLIP && part_m;
    ep.sg_grad = MODE == MODE_SIGLIP && (g || part_s || dsp_part);
    ep.tri = (MODE == MODE_LSE2 || MODE == MODE_H) && tri;
    return ep;
}

// One thread's rows, (i, h) -> local row m0 + row_base(warp) + i*IS + h*8 + gq, and what the
// epilogues keep per row: running statistics rm / rl / rx, the H / G / CLIP row lse (base 2),
// weight and one-exp2 factor, the global row and its positive column, whether it exists.
template <int I> struct RowState {
    float rm[I][2], rl[I][2], rx[I][2], li2[I][2], wi[I][2], fi[I][2];
    float lo2[I][2];  // float32 H: the row's log2 S (its lse in base 2 = li2 + lo2)
    int gi[I][2], pr[I][2];
    bool rv[I][2];
};

template <typename T, int MODE, typename L>
__device__ __forceinline__ void rows_init(RowState<L::I>& rs, const EpiCtx<T>& ep,
                                          const float* __restrict__ lse_row,
                                          const float* __restrict__ w_ptr, i64 w_stride,
                                          int pos_shift, int pos_mod, int warp, int gq) {
    const float ninf = -cpn_inf<float>();
#pragma unroll
    for (int i = 0; i < L::I; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int lr = ep.m0 + L::row_base(warp) + i * L::IS + h * 8 + gq;
            rs.rv[i][h] = lr < ep.rows;
            rs.gi[i][h] = ep.row0 + lr;
            rs.pr[i][h] = (int)(((i64)rs.gi[i][h] + pos_shift) % pos_mod);
            rs.rm[i][h] = ninf; rs.rl[i][h] = 0.f; rs.rx[i][h] = 0.f;
            rs.li2[i][h] = 0.f; rs.wi[i][h] = 0.f; rs.fi[i][h] = 0.f; rs.lo2[i][h] = 0.f;
            if ((MODE == MODE_G || MODE == MODE_H || MODE == MODE_CLIP) && rs.rv[i][h]) {
                if (sizeof(T) == 4) {
                    // float32 (the TF32x3 tiles): lse_row holds (M, log2 S) pairs, the row's
                    // log-sum-exp in base 2 as its finish left it (tiles_ws_tf32.cu), so that
                    // t - lse = (t - M) - log2 S keeps the positive's small exponent exact
                    const float2 ml = ((const float2*)lse_row)[rs.gi[i][h]];
                    rs.li2[i][h] = ml.x;
                    rs.lo2[i][h] = ml.y;
                } else {
                    rs.li2[i][h] = lse_row[rs.gi[i][h]] * CPN_LOG2E;
                }
                rs.wi[i][h] = ep.w_mul * (w_ptr ? w_ptr[(i64)rs.gi[i][h] * w_stride] : 1.f);
                rs.fi[i][h] = hw_factor<MODE>(
                    sizeof(T) == 4 ? rs.li2[i][h] + rs.lo2[i][h] : rs.li2[i][h], rs.wi[i][h]);
            }
            if (MODE == MODE_SIGLIP) {  // rl: loss, rx: dscale, rm: dbias (sums from 0,
                rs.rm[i][h] = 0.f;       // of z-signed sigmoids: the row's factors at the end);
                // wi: v_i without w_mul (the products' alpha); fi: s v_i, the block's factor
                rs.wi[i][h] = !rs.rv[i][h] ? 0.f
                            : w_ptr ? w_ptr[(i64)rs.gi[i][h] * w_stride] : 1.f;
                rs.fi[i][h] = ep.scale * rs.wi[i][h];
            }
        }
}

// Column values a tile's epilogue reads (colv): H / CLIP the column's lse (base 2), weight and
// factor f_j; LSE2 the column's shift, its positive logit (lse_col holds the raw dots).
// Columns past nlim get zeros.  Two halves: the loads (the warp-specialised kernel issues
// them before the tile's MMAs) and the values.
struct ColRaw { float l, w, llo; bool ok; };
template <bool F32 = false>
__device__ __forceinline__ ColRaw colv_load(int col, int nlim, const float* __restrict__ lse_col,
                                            const float* __restrict__ w_ptr, i64 w_stride) {
    ColRaw r;
    r.ok = col < nlim;
    r.llo = 0.f;
    if (F32) {  // (float32 H: (M, log2 S) pairs, as rows_init)
        const float2 ml = r.ok ? ((const float2*)lse_col)[col] : make_float2(0.f, 0.f);
        r.l = ml.x;
        r.llo = ml.y;
    } else {
        r.l = r.ok ? lse_col[col] : 0.f;
    }
    r.w = r.ok && w_ptr ? w_ptr[(i64)col * w_stride] : 1.f;
    return r;
}
template <int MODE, bool F32 = false>
__device__ __forceinline__ void colv_values(float (&v)[4], const ColRaw& r, float w_mul,
                                            float sl2) {
    // (F32, H: v[0] = M, v[3] = log2 S of the column's (M, log2 S) pair, as rows_init)
    v[0] = r.ok ? (F32 && MODE != MODE_LSE2 ? r.l : r.l * (MODE == MODE_LSE2 ? sl2 : CPN_LOG2E)) : 0.f;
    v[1] = r.ok ? w_mul * r.w : 0.f;
    v[2] = MODE != MODE_LSE2 && r.ok ? hw_factor<MODE>(F32 ? v[0] + r.llo : v[0], v[1]) : 0.f;
    v[3] = r.llo;
}

// The epilogue of one 128 x 128 tile (columns n0 .. n0 + 127, those at or past nlim absent) for
// every MODE but SPMAX: acc in L's fragment layout, rs the thread's rows, cv the tile's column
// values (colv_values, in shared memory: cv[k][column]), red the LSE2 column-partial scratch
// ([2][NCG][TBN] floats), sout the SOUT staging tile of the thread's warpgroup (64 x 128
// 16-bit values, 16 KiB; the warp-specialised kernels' G, CLIP and SigLIP: WS_SOUT_WARP
// bytes a warp), lt the thread's index among those sharing the tile.  Holds L::tile_sync
// barriers (LSE2, SOUT).  acc is spent afterwards: SigLIP's rolled exact path (SROLL below)
// moves its groups.
template <typename T, int MODE, typename L>
__device__ __forceinline__ void tile_epilogue(const EpiCtx<T>& ep, RowState<L::I>& rs,
                                              float (&acc)[L::I][L::J][4], int n0, int nlim,
                                              const float (*cv)[TBN], float (*red)[L::NCG][TBN],
                                              char* sout, int warp, int lane, int lt) {
    enum { I = L::I, J = L::J, NCG = L::NCG,
           SOUT = L::WGMMA && sizeof(T) == 2
                  && (MODE == MODE_G || MODE == MODE_H || MODE == MODE_CLIP
                      || MODE == MODE_SIGLIP) };
    const float ninf = -cpn_inf<float>();
    const int cbase = L::col_base(warp), cg = L::col_group(warp);
    const int gq = lane >> 2, cq = lane & 3;
    T* const g = ep.g;
    float* const pos_out = ep.pos_out;
    float* const colp_m = ep.colp_m;
    float* const colp_s = ep.colp_s;
    const i64 ldg = ep.ldg;
    const int rows = ep.rows, row0 = ep.row0, ncols = ep.ncols, m0 = ep.m0;
    const int exclude_diag = ep.exclude_diag;
    const float scale = ep.scale, sl2 = ep.sl2, sbias = ep.sbias, sb2 = ep.sb2;
    // a logit in base-2 units (float32: s log2(e) in two floats, epi_ctx)
    const float sl2lo = ep.sl2lo;
    auto t2 = [&](float a) -> float { return sizeof(T) == 4 ? fmaf(a, sl2, a * sl2lo) : a * sl2; };
    const bool sg_loss = ep.sg_loss, sg_grad = ep.sg_grad, TRI = ep.tri;
    float (&rm)[I][2] = rs.rm;
    float (&rl)[I][2] = rs.rl;
    float (&rx)[I][2] = rs.rx;
    const float (&li2)[I][2] = rs.li2;
    const float (&wi)[I][2] = rs.wi;
    const float (&fi)[I][2] = rs.fi;
    const int (&gi)[I][2] = rs.gi;
    const int (&pr)[I][2] = rs.pr;
    const bool (&rv)[I][2] = rs.rv;
    // Most tiles hold no column past the end, no diagonal and no positive of this warp's
    // rows: those take the unchecked copy of the epilogue (C = false).
    bool special = n0 + TBN > nlim;
#pragma unroll
    for (int i = 0; i < I; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            special |= (unsigned)(gi[i][h] - n0) < TBN || (unsigned)(pr[i][h] - n0) < TBN;
    // CLIP's labels (ep.lab_r: a constant null in every kernel but the LSE2 / CLIP `_lab`
    // ones, where this compiles out, epi_ctx): the masked scores' bits (label_bits); a tile
    // holding one is special -- the checked copies only, no colfast, no one-exp2 CLIP path
    unsigned mb[I][2];
#pragma unroll
    for (int i = 0; i < I; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) mb[i][h] = 0u;
    const bool labs = ep.lab_r != 0;  // (uniform: one test a tile)
    if (labs)
        special |= label_bits<L>(mb, ep.lab_r, ep.lab_c, gi, rv, row0 + m0,
                                 row0 + min(m0 + TBM, rows) - 1, n0, nlim, cbase, cq);
    special = __any_sync(0xffffffffu, special);
    // LSE2: a masked score becomes -inf in the accumulators themselves, so that the row pass
    // and every column-partial path below (all of which read acc) leave it out: t = -inf
    // (+inf raw when sl2 < 0; sl2 = 0 gives NaN, as clip_mask's -inf times a zero scale)
    if (MODE == MODE_LSE2 && labs && special) {
        const float mval = sl2 < 0.f ? -ninf : ninf;
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (mb[i][h]) {
#pragma unroll
                    for (int j = 0; j < J; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            if ((mb[i][h] >> (j * 2 + e)) & 1u) acc[i][j][h * 2 + e] = mval;
                }
    }
    // LSE2 on an unchecked tile (`colfast`): the column sums reuse the row pass's
    // exponentials, 2^(t_ij - c_j) = 2^(t_ij - m_i) 2^(m_i - M) 2^(M - c_j) with M the
    // warp's largest running row max: one exp2 per score instead of two.  Taken when
    // M - c_j <= 64 for every column of the warp (then no term exceeds 2^64, as on the
    // shifted path below); the row sums are the same operations in the same order either
    // way.  A term below 2^-126 (a row 126 binary orders under M) flushes to zero: at most
    // 2^-62 against the column's full sum, which holds its positive pair's 2^0.
    const float* cc2 = cv[0] + cbase + 2 * cq;  // LSE2: c_j at [j * 8 + e]
    float cs[MODE == MODE_LSE2 ? 2 * J : 1];
    float mw = ninf;
    bool colfast = false;
    if (MODE == MODE_LSE2) {
        if (!special) {
            float mn[I][2];
#pragma unroll
            for (int i = 0; i < I; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    // max_j (a_j sl2) = (max_j a_j) sl2 for sl2 >= 0 (rounding is monotone),
                    // min for sl2 < 0: no products kept beside the accumulators for the
                    // exponentials below (they made the warp-specialised tile spill)
                    float amax = ninf, amin = -ninf;
#pragma unroll
                    for (int j = 0; j < J; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            amax = fmaxf(amax, acc[i][j][h * 2 + e]);
                            amin = fminf(amin, acc[i][j][h * 2 + e]);
                        }
                    const float tm = sl2 >= 0.f ? t2(amax) : t2(amin);
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
                                const float ev = exp2f(t2(acc[i][j][h * 2 + e]) - mnv);
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
                            float t = t2(a);
                            if (C) {
                                const int col = n0 + cbase + j * 8 + 2 * cq + e;
                                if (col >= nlim || (exclude_diag && col == grow)) t = ninf;
                                // (WS: a B1 tile's columns past nlim = n1 are TMA zero fill
                                // numbered as B2's first, tile_ws.cuh; the cp.async loops'
                                // tiles run on to ncols, past every positive)
                                if (pos_out && col == pr[i][h] && (!L::WS || col < nlim) && rv[i][h])
                                    pos_out[grow - row0] = sizeof(T) == 4 ? t : a * scale;
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
        // the lane's columns after the three halvings of a reduce-scatter (colfast: cs holds
        // the sums scaled by 2^(c_j - M))
        auto put_sums = [&](bool scaled) {
            reduce_scatter<2 * J>(cs, lane & 16, 16);
            reduce_scatter<J>(cs, lane & 8, 8);
            reduce_scatter<J / 2>(cs, lane & 4, 4);
#pragma unroll
            for (int k = 0; k < J / 4; ++k) {
                const int idx = k + ((lane & 16) ? J : 0) + ((lane & 8) ? J / 2 : 0) +
                                ((lane & 4) ? J / 4 : 0);  // = j * 2 + e
                const int off = (idx >> 1) * 8 + (idx & 1);
                red[0][cg][cbase + 2 * cq + off] = cc2[off];
                red[1][cg][cbase + 2 * cq + off] = scaled ? cs[k] * exp2f(mw - cc2[off]) : cs[k];
            }
        };
        // (WS: colfast calls it on its own, not after a join where the other path still holds
        // the accumulators -- the warp-specialised tile spilled its sums there; the other
        // loops spill with two calls)
        if (L::WS && colfast) {
            put_sums(true);
        } else {
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
                                    const float x = t2(acc[i][j][h * 2 + e]) - c;
                                    big |= x > 64.f;
                                    s += exp2f(x);
                                }
                        cs[j * 2 + e] = s;
                    }
            }
            // (float32: a special tile -- the positives' -- takes the max-based sums, whose
            // largest term is exactly 1 where the positive is the column's max)
            if (colfast || (!(sizeof(T) == 4 && special) && !__any_sync(0xffffffffu, big))) {
                put_sums(colfast);
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
                                if (rv[i][h]) cm = nanmax(cm, t2(acc[i][j][h * 2 + e]));
#pragma unroll
                        for (int o = 4; o < 32; o <<= 1)
                            cm = nanmax(cm, __shfl_xor_sync(0xffffffffu, cm, o));
                        if (cm > ninf) {  // false for NaN too: (NaN, 0) still merges to NaN
#pragma unroll
                            for (int i = 0; i < I; ++i)
#pragma unroll
                                for (int h = 0; h < 2; ++h)
                                    if (rv[i][h]) cl += exp2f(t2(acc[i][j][h * 2 + e]) - cm);
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
        }
        L::tile_sync(warp);
        if (lt < TBN && n0 + lt < nlim) {
            float cm = red[0][0][lt], cl = red[1][0][lt];
#pragma unroll
            for (int w = 1; w < NCG; ++w) lse2_merge(cm, cl, red[0][w][lt], red[1][w][lt]);
            const i64 o = (i64)blockIdx.x * ncols + n0 + lt;
            colp_m[o] = sizeof(T) == 4 ? cm : cm * CPN_LN2;  // (float32: base 2, below)
            colp_s[o] = cl;
        }
        L::tile_sync(warp);
    }
    if (MODE == MODE_G || MODE == MODE_H || MODE == MODE_CLIP || MODE == MODE_SIGLIP) {
        const float* lc2 = cv[0] + cbase + 2 * cq;  // [j * 8 + e]
        const float* wc = cv[1] + cbase + 2 * cq;
        const float* fc = cv[2] + cbase + 2 * cq;
        const float* lcl = cv[3] + cbase + 2 * cq;  // (float32 H only: the columns' log2 S)
        const float (&lo2)[I][2] = rs.lo2;
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
        // SIGLIP's exact path for one score (C: a special tile): L = s a + beta, z = +1 on the
        // positive (col == grow) and -1 elsewhere: softplus(-zL) and sigmoid(-zL) from one
        // e = exp(-|zL|), as siglip_rows (grads.cu); adds to the row's sums, returns
        // the gradient block's value
        auto siglip_exact = [&](int i, int h, float raw, int col, bool C) -> float {
            const bool posi = C && col == gi[i][h];
            const float lg = scale * raw + sbias;
            const float zl = posi ? lg : -lg;
            const float ez = cpn_exp(-fabsf(zl));
            float x = 0.f;
            if (sg_loss && (!C || col < nlim))
                rl[i][h] += (zl < 0.f ? -zl : 0.f) + cpn_log1p(ez);
            if (sg_grad && (!C || col < nlim)) {
                // -z sigmoid(-zl); (1 + ez in [1, 2]: the fast division is within 2 ulp, far
                // below the block's rounding); the row's factors w_mul v_i (s) at the end
                const float sg = __fdividef(zl > 0.f ? ez : 1.f, 1.f + ez);
                const float sz = posi ? -sg : sg;
                rx[i][h] = fmaf(sz, raw, rx[i][h]);
                rm[i][h] += sz;
                x = fi[i][h] * sz;
            }
            return x;
        };
        // SROLL: SigLIP's exact path is the rolled loop after this one (SR column groups a turn)
        enum { SROLL = MODE == MODE_SIGLIP && L::WS && SOUT && sizeof(T) == 2, SR = 1 };
#pragma unroll
        for (int variant = 0; variant < 3; ++variant) {  // C and F are constants in each copy
            const bool C = variant == 0, F = variant == 2;
            if (MODE == MODE_G && F) continue;
            if (SROLL && !F) continue;  // (the rolled loop below)
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
                            const float t = t2(acc[i][j][h * 2 + e]);
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
                                x = siglip_exact(i, h, acc[i][j][h * 2 + e], col, C);
                            } else if (F) {  // H or CLIP, unchecked tile
                                const float G = exp2f(t) * (fi[i][h] + fc[j * 8 + e]);
                                if (MODE == MODE_CLIP) rx[i][h] += G * t;
                                x = scale * G;
                            } else if (MODE == MODE_H && sizeof(T) == 4) {
                                // float32: exponents (t - M) - log2 S against the rows' and
                                // columns' (M, log2 S) pairs; P - 1 at the positive through
                                // expm1 (P is near 1 there: exp2 - 1 would cancel)
                                if (C && col == grow) {
                                    x = 0.f;
                                } else {
                                    const float di = (t - li2[i][h]) - lo2[i][h];
                                    const float dc = (t - lc2[j * 8 + e]) - lcl[j * 8 + e];
                                    float p;
                                    if (C && col == pos)
                                        p = wi[i][h] * expm1f(di * CPN_LN2)
                                          + wc[j * 8 + e] * expm1f(dc * CPN_LN2);
                                    else
                                        p = wi[i][h] * exp2f(di) + wc[j * 8 + e] * exp2f(dc);
                                    x = scale * p;
                                }
                            } else if (MODE == MODE_H) {
                                if (C && col == grow) {
                                    x = 0.f;
                                } else {
                                    float p = wi[i][h] * exp2f(t - li2[i][h])
                                            + wc[j * 8 + e] * exp2f(t - lc2[j * 8 + e]);
                                    if (C && col == pos) p -= wi[i][h] + wc[j * 8 + e];
                                    x = scale * p;
                                }
                            } else if (C && ((mb[i][h] >> (j * 2 + e)) & 1u)) {
                                x = 0.f;  // CLIP, a masked score (labels): G = 0, and no
                                          // G t in the scale's sum (0 * -inf)
                            } else {  // MODE_CLIP
                                float G = wi[i][h] * exp2f(t - li2[i][h])
                                        + wc[j * 8 + e] * exp2f(t - lc2[j * 8 + e]);
                                if (C && col == grow) G -= wi[i][h] + wc[j * 8 + e];
                                G *= 0.5f;
                                if (!C || col < nlim) rx[i][h] += G * t;
                                x = scale * G;
                            }
                            val[e] = x;
                        }
                        const int col = n0 + cbase + j * 8 + 2 * cq;
                        if (SOUT) {
                            pk[i][h][j] = Pack2<T>::round(val[0], val[1]);
                        } else if (MODE == MODE_SIGLIP && !g) {
                            // (the loss alone: no gradient block)
                        } else if (sizeof(T) == 4) {
                            // float32 (the TF32x3 tiles): the block as it is; the product
                            // that reads it splits it (tiles_ws_tf32.cu's MM)
                            float* const gh = (float*)grow_ptr + col;
                            if (!C || col + 1 < nlim) *(float2*)gh = make_float2(val[0], val[1]);
                            else if (col < nlim) gh[0] = val[0];
                        } else if (!C || col + 1 < nlim) {
                            *(unsigned*)(grow_ptr + col) = Pack2<T>::round(val[0], val[1]);
                        } else if (col < nlim) {
                            grow_ptr[col] = Conv<T>::store(val[0]);
                        }
                        // H with `tri` (H = H^T, the whole matrix in g, row0 = 0): an
                        // off-diagonal tile also writes its mirror H_JI = H_IJ^T (SOUT:
                        // through the staging tile below)
                        if (!SOUT && MODE == MODE_H && TRI && n0 != m0) {
#pragma unroll
                            for (int e = 0; e < 2; ++e)
                                if (!C || col + e < nlim) {
                                    const i64 o = (i64)(col + e) * ldg + grow;
                                    if (sizeof(T) == 4) ((float*)g)[o] = val[e];
                                    else g[o] = Conv<T>::store(val[e]);
                                }
                        }
                    }
                }
        }
        // SIGLIP's exact path in the warp-specialised 16-bit kernels (SROLL): a loop over the
        // column groups, SR of them a turn, instead of all J unrolled.  Unrolled (twice: the
        // special tiles' copy and the others'), its ~60-instruction body made the kernel 22k
        // instructions, and instruction fetch stalled the fast path as well (H100, ncu at
        // N = 8192: no_instruction 0.99 cycles a issued instruction; 0.30 with this path
        // compiled out, 25 % less time).  Rolled: 5k instructions (8 bytes of spills, outside
        // the tile loop), the siglip pass at N = 16384 670 -> 620 us (SR = 2: 624 us, 48
        // bytes of spills; SR = 4: 668 us, 104 bytes).  Each turn reads
        // groups 0..SR-1 of acc, then moves acc and pk down SR groups and puts its packed
        // values at the top: after J / SR turns pk is in place (acc is spent: the next tile's
        // first wgmma overwrites it).  Each row's sums keep the column order, so the bits are
        // the unrolled copy's (docs/notes.md, thirteenth session).
        static_assert(J % SR == 0, "the rolled SigLIP path takes SR column groups a turn");
        if (SROLL && !fast) {
#pragma unroll 1
            for (int j0 = 0; j0 < J; j0 += SR) {
                unsigned nx[I][2][SR];
#pragma unroll
                for (int i = 0; i < I; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int jj = 0; jj < SR; ++jj) {
                            float val[2] = {0.f, 0.f};
                            if (rv[i][h]) {
#pragma unroll
                                for (int e = 0; e < 2; ++e)
                                    val[e] = siglip_exact(i, h, acc[i][jj][h * 2 + e],
                                                          n0 + cbase + (j0 + jj) * 8 + 2 * cq + e,
                                                          special);
                            }
                            nx[i][h][jj] = Pack2<T>::round(val[0], val[1]);
                        }
#pragma unroll
                for (int i = 0; i < I; ++i) {
#pragma unroll
                    for (int j = 0; j + SR < J; ++j)
#pragma unroll
                        for (int q = 0; q < 4; ++q) acc[i][j][q] = acc[i][j + SR][q];
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int j = 0; j < J; ++j)
                            pk[i][h][j] = j + SR < J ? pk[i][h][j + SR] : nx[i][h][j + SR - J];
                }
            }
        }
        if (SOUT && (MODE != MODE_SIGLIP || g)) {  // (g: uniform over the CTA; tile_stage.cuh)
            if (L::WS && MODE != MODE_H)
                stage_warp<L>(pk, g, ldg, rows, nlim, m0, n0, sout, warp, lane);
            else
                stage_warpgroup<L>(pk, g, ldg, rows, nlim, m0, n0,
                                   MODE == MODE_H && TRI && n0 != m0, sout, warp, lane, lt);
        }
    }
}

// The CTA's per-row results after its last tile (LSE, LSE2, CLIP, SIGLIP): merge the 4 lanes
// of a row, then its two holders (row_pairs; slots: three 128-float arrays), and write the
// split's partials.  Called by every thread that holds rows.
template <typename T, int MODE, typename L>
__device__ __forceinline__ void rows_finish(const EpiCtx<T>& ep, RowState<L::I>& rs,
                                            float* const (&slots)[3], int warp, int lane) {
    enum { I = L::I };
    const int gq = lane >> 2, cq = lane & 3;
    float* const part_m = ep.part_m;
    float* const part_s = ep.part_s;
    float* const dsp_part = ep.dsp_part;
    const i64 part_ld = ep.part_ld;
    const int row0 = ep.row0, split = ep.split;
    const float w_mul = ep.w_mul;
    float (&rm)[I][2] = rs.rm;
    float (&rl)[I][2] = rs.rl;
    float (&rx)[I][2] = rs.rx;
    const float (&wi)[I][2] = rs.wi;
    const float (&fi)[I][2] = rs.fi;
    const int (&gi)[I][2] = rs.gi;
    const bool (&rv)[I][2] = rs.rv;
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
        // (no barrier first: nothing else in this mode uses the slots)
        row_pairs<L, I>(slots, warp, cq, gq, rv,
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
        L::tile_sync(warp);  // (mma.sync, wgmma) red[] was last read by the column partials
        row_pairs<L, I>(slots, warp, cq, gq, rv,
            [&](int i, int h, float* v) { v[0] = rm[i][h]; v[1] = rl[i][h]; v[2] = rx[i][h]; },
            [&](int i, int h, const float* v) {
                const i64 o = (i64)split * part_ld + (gi[i][h] - row0);
                if (MODE == MODE_CLIP) {
                    dsp_part[o] = (rx[i][h] + (L::ROW_WARPS == 2 ? v[2] : 0.f)) * CPN_LN2;
                } else {
                    float m = rm[i][h], l = rl[i][h];
                    if (L::ROW_WARPS == 2) lse2_merge(m, l, v[0], v[1]);
                    // float32 (the TF32x3 tiles): the maxima stay in base 2 for their own
                    // finish, which keeps each row's log-sum-exp as the pair (M, log2 S)
                    part_m[o] = sizeof(T) == 4 ? m : m * CPN_LN2;
                    part_s[o] = l;
                }
            });
    }
}
