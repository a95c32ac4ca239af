// cupynce's score-block statistics: the row pass of the row blocks (log-sum-exp, loss and the
// gradient block), the row and column statistics in one read, the column fold, and the
// paired dots (per-query negatives, the tiles' positive logits).
//
// Naming: extern "C" wrappers `cpn_<stage>_<dtype>`, dtype in {f16, bf16, f32, f64}.
// T is the storage type of inputs and of the gradient matrix fed back to cuBLAS;
// A (float, or double for f64) is the type of the score matrix S and of every accumulator.
// Every reduction is a fixed-order tree inside one block or a sequential loop: no atomics,
// so results are bitwise reproducible.
#include "include/common.cuh"

// Row pass: one block per row r (global row i = row0 + r) of a score block.
//   logits  = scale * S, scale = scale_mul * (scale_log ? exp(*scale_log) : 1)
//   columns = segment 1 (n1 columns of s1, leading dim ld1; column i excluded when
//             exclude_diag) followed by segment 2 (n2 columns of s2, may be null)
//   positive= column (i + pos_shift) % pos_mod of segment 1
//   lse     = log-sum-exp over the columns (read from lse_in when given)
//   loss    = lse - logit[positive]
//   gradient (when g1 != null): w_i * scale * (softmax - onehot), excluded column 0,
//             w_i = w_mul * (w_ptr ? w_ptr[i * w_stride] : 1); segment 2 goes to g2 (type A).
// Labels (lab_r != null): a column j < nlab of segment 1 (the keys, and across ranks the other
// ranks' keys before the shared negatives), j != positive, whose lab_c[j] is row i's lab_r[i]
// is no candidate (left out as the diagonal is).  Smoothing eps > 0: the
// target is (1 - eps) onehot + eps / K over the row's K candidates, so
//   loss = lse - (1 - eps) logit[positive] - eps / K sum_{candidates} logit
// and the gradient subtracts eps / K at every candidate (K counts the columns not left out,
// as F.cross_entropy counts the classes: a -inf logit among them makes the loss +inf).  K and
// the logits' sum are block sums in a fixed order, as the log-sum-exp: deterministic.
// Hardness (hard_mode > 0, sentence-transformers' hardness_mode): a penalised column's logit
// is scale * S + hard_alpha * S, the penalty a constant of the gradient (stop-gradient), so
// the gradient keeps the multiplier scale: w_i * scale * (softmax - onehot).  Row i's own
// columns are segment 1's own_start + i + own_mod * m (m >= 0, below own_start + own_count:
// its hard negatives in the library's layout) and all of segment 2; penalised are, for
// hard_mode 1 (in_batch_negatives) the columns that are neither the positive nor own,
// 2 (hard_negatives) the own ones, 3 (all_negatives) every column but the positive.
template <typename T, typename A>
__device__ __forceinline__ void row_softmax_body(
    const A* __restrict__ s1, i64 ld1, int n1,
    const A* __restrict__ s2, i64 ld2, int n2,
    int row0, int exclude_diag, int pos_shift, int pos_mod,
    const A* __restrict__ scale_log, A scale_mul,
    const A* __restrict__ lse_in, A* __restrict__ lse_out, A* __restrict__ loss_out,
    T* __restrict__ g1, i64 ldg1, A* __restrict__ g2, i64 ldg2,
    const A* __restrict__ w_ptr, i64 w_stride, A w_mul,
    const i64* __restrict__ lab_r, const i64* __restrict__ lab_c, int nlab, A eps,
    int hard_mode, A hard_alpha, int own_start, int own_count, int own_mod)
{
    __shared__ A sh[64];
    const int r = blockIdx.x;
    const int i = row0 + r;
    const A scale = scale_log ? scale_mul * cpn_exp(scale_log[0]) : scale_mul;
    const A* row1 = s1 + (i64)r * ld1;
    const A* row2 = s2 ? s2 + (i64)r * ld2 : (const A*)0;
    const int diag = exclude_diag ? i : -1;
    const int pos = (int)(((i64)i + pos_shift) % pos_mod);
    const i64 li = lab_r ? lab_r[i] : 0;
    // column j of segment 1 left out: the diagonal, or a same-label key that is not the positive
#define CPN_OUT(j) ((j) == diag || (lab_r && (j) < nlab && (j) != pos && lab_c[j] == li))
    // column j of segment 1: own (row i's hard negative), penalised; its logit (see above)
#define CPN_OWN(j) ((j) >= own_start && (j) < own_start + own_count && ((j) - own_start) % own_mod == i)
#define CPN_PEN(j) (hard_mode == 1 ? ((j) != pos && !CPN_OWN(j)) \
                    : hard_mode == 2 ? CPN_OWN(j) : (hard_mode == 3 && (j) != pos))
#define CPN_L1(j) (hard_mode && CPN_PEN(j) ? fma(hard_alpha, row1[j], scale * row1[j]) \
                                           : scale * row1[j])
    const A scale2 = hard_mode >= 2 ? scale + hard_alpha : scale;  // segment 2's multiplier

    A lse;
    if (lse_in) {
        lse = lse_in[i];
    } else {
        Lse<A> st; st.init();
        for (int j = threadIdx.x; j < n1; j += blockDim.x)
            if (!CPN_OUT(j)) st.add(CPN_L1(j));
        for (int j = threadIdx.x; j < n2; j += blockDim.x) st.add(scale2 * row2[j]);
        block_lse(st, sh);
        lse = st.value();
    }
    A smooth = A(0);  // eps / K: every candidate's share of the smoothing mass
    A lsum = A(0);    // the candidates' logits' sum
    if (eps > A(0)) {
        A cnt = A(0);
        for (int j = threadIdx.x; j < n1; j += blockDim.x)
            if (!CPN_OUT(j)) { cnt += A(1); lsum += CPN_L1(j); }
        for (int j = threadIdx.x; j < n2; j += blockDim.x) { cnt += A(1); lsum += scale2 * row2[j]; }
        cnt = block_sum(cnt, sh);  // (block_sum protects sh from block_lse's use first)
        lsum = block_sum(lsum, sh);
        smooth = eps / cnt;
    }
    if (threadIdx.x == 0) {
        if (lse_out) lse_out[i] = lse;
        if (loss_out) loss_out[i] = eps > A(0)
            ? lse - (A(1) - eps) * scale * row1[pos] - smooth * lsum
            : lse - scale * row1[pos];
    }
    if (!g1) return;
    __syncthreads();  // g1 may alias s1: row1[pos] must be read before it is overwritten
    const A gm = w_mul * (w_ptr ? w_ptr[(i64)i * w_stride] : A(1)) * scale;
    T* grow1 = g1 + (i64)r * ldg1;
    for (int j = threadIdx.x; j < n1; j += blockDim.x) {
        const bool out = CPN_OUT(j);
        A p = out ? A(0) : cpn_exp(CPN_L1(j) - lse) - smooth;
        if (j == pos) p -= A(1) - eps;
        grow1[j] = Conv<T>::store(gm * p);
    }
    if (g2) {
        A* grow2 = g2 + (i64)r * ldg2;
        for (int j = threadIdx.x; j < n2; j += blockDim.x)
            grow2[j] = gm * (cpn_exp(scale2 * row2[j] - lse) - smooth);
    }
#undef CPN_OUT
#undef CPN_OWN
#undef CPN_PEN
#undef CPN_L1
}

// pytorch-metric-learning's NTXentLoss(labels): every positive pair (i, p), p != i of row i's
// label, against row i's negatives (the rows of another label).  One block per row r
// (global row i = row0 + r) of a block of z zᵀ (n columns: the whole batch), l = scale * S:
//   lse_i  = log-sum-exp of l_ij over the negatives j (-inf: none; every pair's loss is 0)
//   loss_i = sum_{p} softplus(lse_i - l_ip)        (-log(e^l_ip / (e^l_ip + sum_j e^l_ij)))
//   gradient (g != null), w_i = w_mul * (w_ptr ? w_ptr[i * w_stride] : 1), gm = w_i * scale:
//     g_ij = gm * c_i * exp(l_ij - lse_i)  (a negative; c_i = sum_p sigmoid(lse_i - l_ip))
//     g_ip = -gm * sigmoid(lse_i - l_ip)   (a positive)        g_ii = 0
// Block sums in a fixed order: deterministic.  g may alias s (each thread reads, then writes,
// its own columns after the sums).
template <typename A>
__device__ __forceinline__ A cpn_softplus(A x)
{
    return x > A(0) ? x + log1p(cpn_exp(-x)) : log1p(cpn_exp(x));
}
template <typename A>
__device__ __forceinline__ A cpn_sigmoid(A x)
{
    if (x >= A(0)) return A(1) / (A(1) + cpn_exp(-x));
    const A e = cpn_exp(x);
    return e / (A(1) + e);
}
template <typename T, typename A>
__device__ __forceinline__ void row_pairs_body(
    const A* s, i64 ld, int n, int row0, const A* __restrict__ scale_log,
    A scale_mul, const i64* __restrict__ lab, A* __restrict__ lse_out, A* __restrict__ loss_out,
    T* g, i64 ldg, const A* __restrict__ w_ptr, i64 w_stride, A w_mul)
{
    __shared__ A sh[64];
    const int r = blockIdx.x;
    const int i = row0 + r;
    const A scale = scale_log ? scale_mul * cpn_exp(scale_log[0]) : scale_mul;
    const A* row = s + (i64)r * ld;
    const i64 li = lab[i];
    Lse<A> st; st.init();
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        if (lab[j] != li) st.add(scale * row[j]);
    block_lse(st, sh);
    const A lse = st.value();
    A sp = A(0), sg = A(0);
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        if (j != i && lab[j] == li) {
            const A x = lse - scale * row[j];
            sp += cpn_softplus(x);
            sg += cpn_sigmoid(x);
        }
    sp = block_sum(sp, sh);  // (block_sum protects sh from block_lse's use first)
    sg = block_sum(sg, sh);
    if (threadIdx.x == 0) {
        if (lse_out) lse_out[i] = lse;
        if (loss_out) loss_out[i] = sp;
    }
    if (!g) return;
    __syncthreads();
    const A gm = w_mul * (w_ptr ? w_ptr[(i64)i * w_stride] : A(1)) * scale;
    T* grow = g + (i64)r * ldg;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const A l = scale * row[j];
        const A v = j == i ? A(0)
                  : lab[j] == li ? -gm * cpn_sigmoid(lse - l) : gm * sg * cpn_exp(l - lse);
        grow[j] = Conv<T>::store(v);
    }
}

// CLIP's labels: a pair (i, j), j != i, of one label is no negative in either direction --
// its score set to -inf in a score block (rows row0 + r, every column; lab_r indexed by the
// global row, lab_c by the column) before the statistics and the gradient read it: exp(-inf)
// = 0, so it has no probability in its row's or its column's softmax and no gradient (the
// gradient kernels leave a zero G out of the scale's sum, where 0 * -inf would be NaN).
template <typename A>
__device__ __forceinline__ void clip_mask_body(A* s, i64 ld, int n, int row0,
                                               const i64* __restrict__ lab_r,
                                               const i64* __restrict__ lab_c)
{
    const int r = blockIdx.x;
    const int i = row0 + r;
    const i64 li = lab_r[i];
    A* row = s + (i64)r * ld;
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        if (j != i && lab_c[j] == li) row[j] = -cpn_inf<A>();
}

// CLIP's labels on the score tiles (label_bits, tile_labels.cuh): out[i] = the (min, max)
// of the keys k = (int) low 32 bits of lab[j] over i's aligned 128-block, packed as
// (min << 32) | (unsigned) max.  Equal labels have equal keys, so a tile whose rows' key range
// and columns' key range are disjoint holds no same-label pair.  One 128-thread block a
// 128-block; a thread past n takes the block's first key (no effect on the range).
extern "C" __global__ void __launch_bounds__(128) cpn_label_ranges(
    const i64* __restrict__ lab, int n, unsigned long long* __restrict__ out)
{
    __shared__ int smin[4], smax[4];
    const int i0 = blockIdx.x * 128, i = i0 + threadIdx.x;
    const int k = (int)(unsigned)(unsigned long long)lab[i < n ? i : i0];
    int mn = k, mx = k;
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        mn = min(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    }
    if ((threadIdx.x & 31) == 0) { smin[threadIdx.x >> 5] = mn; smax[threadIdx.x >> 5] = mx; }
    __syncthreads();
    mn = min(min(smin[0], smin[1]), min(smin[2], smin[3]));
    mx = max(max(smax[0], smax[1]), max(smax[2], smax[3]));
    if (i < n) out[i] = ((unsigned long long)(unsigned)mn << 32) | (unsigned)mx;
}

// Row and column statistics of a score block in one read (CLIP's, and a global NT-Xent's
// cross-rank blocks'): row_softmax's lse / loss of each row (no diagonal excluded, no second
// segment, no gradient) and the column partials col_combine folds (online LSEs over chunks
// of R = 32 rows), for rows R b .. R b + R - 1 of block b and every column.  Warp w owns the
// block's rows 4 w .. 4 w + 3; the columns go in tiles of TW = 2048 / sizeof(A) (16 KiB of
// each kind of partial in shared memory), lane l reading V consecutive columns (one 16-byte load where
// the rows allow it, V = 16 / sizeof(A); else V = 1) at l V + 32 V g, g = 0, 1, ...: per
// column one online LSE over the warp's 4 rows (into shared memory), then thread t merges
// the 8 warps' partials of the tile's columns t, t + CPN_BLOCK, ... in a fixed tree
// ((0 1) (2 3)) ((4 5) (6 7)) into part_m / part_s[b n + j]; each row's online LSE is kept
// per lane (its columns, in order) and merged over the lanes by the xor tree of block_lse.
// Each 4 x V block of a lane is added with one exponential a score, f = exp(y - b_q) (b_q
// row q's maximum in the block), which serves both sides: row q's state takes sum_e f times
// one factor; column e's partial is (c_e, exp(M - c_e) sum_q f exp(b_q - M)), c_e its maximum
// in the block, M the block's -- eight more exponentials a block, not one a score (28 a 4 x 4
// block instead of 36) -- where the block's column maxima lie within 64 of each other (no
// term that matters can underflow: e^-64 is a normal float, and a flushed term is below
// e^-23 of its column's sum); elsewhere (a wider block, a -inf or NaN) each column its own
// exponentials.  Every partial keeps its column's exact maximum as m (s >= 1: the merges and
// m + log s round as before).  NaN: the maxima ignore it, its exponential carries it into
// the sums, and a row or column whose block sum is NaN takes m = NaN (merge's empty test
// must not drop it).  Every order is fixed: deterministic (for a given V: the row partition
// across lanes follows it).  Grid: ceil(rows / R).
// row_col_stats' loads of one lane's RW x V block (rows of wbase, columns j..): scaled; a
// row past my_rows (read as row qmax, which is there: the loads stay unconditional) and a
// column past n are -inf, which adds nothing
template <typename A, int RW, int V>
__device__ __forceinline__ void rcs_load(A (&y)[RW][V], const A* wbase, i64 ld, int my_rows,
                                         int qmax, int j, int n, A scale)
{
#pragma unroll
    for (int q = 0; q < RW; ++q) {
        const bool live = q < my_rows;
        const A* const row = wbase + (i64)min(q, qmax) * ld;
        if (V > 1 && j + V <= n) {
            const Vec16<A> v = *reinterpret_cast<const Vec16<A>*>(row + j);
#pragma unroll
            for (int e = 0; e < V; ++e) y[q][e] = live ? scale * v.x[e] : -cpn_inf<A>();
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e)
                y[q][e] = live && j + e < n ? scale * row[j + e] : -cpn_inf<A>();
        }
    }
}
// row_col_stats' registers: at most 64 for float (4 blocks an SM: a 16384-row block's 512
// CTAs in one wave), double's 2 blocks (it needs ~100)
#define RCS_MIN_BLOCKS(A) (sizeof(A) == 8 ? 2 : 4)
template <typename A, int V>
__device__ __forceinline__ void row_col_stats_run(
    const A* __restrict__ s, i64 ld, int rows, int n, int row0, int pos_shift, int pos_mod,
    A scale, A* __restrict__ lse_out, A* __restrict__ loss_out, A* __restrict__ part_m,
    A* __restrict__ part_s, A (*cm)[2048 / sizeof(A)], A (*cv)[2048 / sizeof(A)])
{
    enum { NW = CPN_BLOCK / 32, RW = 4, R = NW * RW, TW = 2048 / sizeof(A), G = TW / (32 * V) };
    static_assert(NW == 8, "the warps' merge tree below is written for 8 warps");
    const int b = blockIdx.x, r0 = b * R, nr = min(R, rows - r0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = threadIdx.x;
    const A* const base = s + (i64)(r0 + warp * RW) * ld;
    const int my_rows = max(0, min(RW, nr - warp * RW));
    // (a warp with no rows loads the block's first one: see the loads below)
    const A* const wbase = my_rows ? base : s + (i64)r0 * ld;
    const int qmax = max(my_rows - 1, 0);
    Lse<A> rs[RW];
#pragma unroll
    for (int q = 0; q < RW; ++q) rs[q].init();
    for (int j0 = 0; j0 < n; j0 += TW) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const int jl = 32 * V * g + V * lane, j = j0 + jl;
            // the RW rows' loads first, unconditional (in flight together: 678 -> 625 us for
            // a 16384^2 block on an H100), then the adds; a row past my_rows reads a row that
            // is there (wbase's row qmax) as -inf, which adds nothing: the sums of skipping it
            A y[RW][V];
            rcs_load<A, RW, V>(y, wbase, ld, my_rows, qmax, j, n, scale);
            // one exponential per score (see above): b_q / c_e the rows' / columns' maxima
            // in the block (fmax: a NaN reaches the sums through its exponential instead)
            A b[RW], c[V];
#pragma unroll
            for (int q = 0; q < RW; ++q) {
                b[q] = y[q][0];
#pragma unroll
                for (int e = 1; e < V; ++e) b[q] = fmax(b[q], y[q][e]);
            }
#pragma unroll
            for (int e = 0; e < V; ++e) {
                c[e] = y[0][e];
#pragma unroll
                for (int q = 1; q < RW; ++q) c[e] = fmax(c[e], y[q][e]);
            }
            A mx = c[0], mn = c[0];
#pragma unroll
            for (int e = 1; e < V; ++e) { mx = fmax(mx, c[e]); mn = fmin(mn, c[e]); }
            const bool fast = mx - mn <= A(64);  // (false for NaN, -inf)
            A sc[V];
#pragma unroll
            for (int e = 0; e < V; ++e) sc[e] = A(0);
#pragma unroll
            for (int q = 0; q < RW; ++q) {
                const A bs = b[q] == -cpn_inf<A>() ? A(0) : b[q];  // (-inf - -inf is NaN)
                A f[V];
#pragma unroll
                for (int e = 0; e < V; ++e) f[e] = cpn_exp(y[q][e] - bs);
                if (fast) {
                    const A r = cpn_exp(b[q] - mx);
#pragma unroll
                    for (int e = 0; e < V; ++e) sc[e] = fma(f[e], r, sc[e]);
                }
                A sf = f[0];
#pragma unroll
                for (int e = 1; e < V; ++e) sf += f[e];
                const A bq = sf != sf ? sf : b[q];  // (a NaN score: the row's m NaN too)
                const A m = rs[q].m, dd = bq - m;
                const A x = cpn_exp(-fabs(dd));
                const bool up = !(dd <= A(0));
                const A s_new = up ? fma(rs[q].s, x, sf) : fma(sf, x, rs[q].s);
                const bool add = bq != -cpn_inf<A>();  // (selects, not a branch)
                rs[q].s = add ? s_new : rs[q].s;
                rs[q].m = add ? nanmax(m, bq) : m;
            }
            if (!fast) {  // (rare: the block is loaded again, y need not stay live)
                A z[RW][V];
                rcs_load<A, RW, V>(z, wbase, ld, my_rows, qmax, j, n, scale);
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    const A cs = c[e] == -cpn_inf<A>() ? A(0) : c[e];
#pragma unroll
                    for (int q = 0; q < RW; ++q) sc[e] += cpn_exp(z[q][e] - cs);
                }
            } else {  // each column against its own maximum (s >= 1: see above)
#pragma unroll
                for (int e = 0; e < V; ++e) sc[e] *= cpn_exp(mx - c[e]);
            }
#pragma unroll
            for (int e = 0; e < V; ++e) {
                const A m = sc[e] != sc[e] ? sc[e] : c[e];  // (a NaN score: the column's m NaN)
                cm[warp][jl + e] = m; cv[warp][jl + e] = sc[e];
            }
        }
        __syncthreads();
#pragma unroll
        for (int k0 = 0; k0 < TW; k0 += CPN_BLOCK) {
            const int c = k0 + t;
            if (j0 + c < n) {
                Lse<A> u[NW];
#pragma unroll
                for (int k = 0; k < NW; ++k) { u[k].m = cm[k][c]; u[k].s = cv[k][c]; }
#pragma unroll
                for (int k = 0; k < NW; k += 2) u[k].merge(u[k + 1].m, u[k + 1].s);
                u[0].merge(u[2].m, u[2].s);
                u[4].merge(u[6].m, u[6].s);
                u[0].merge(u[4].m, u[4].s);
                part_m[(i64)b * n + j0 + c] = u[0].m;
                part_s[(i64)b * n + j0 + c] = u[0].s;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int q = 0; q < RW; ++q) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const A om = __shfl_xor_sync(0xffffffffu, rs[q].m, o);
            const A os = __shfl_xor_sync(0xffffffffu, rs[q].s, o);
            rs[q].merge(om, os);
        }
        if (lane == 0 && q < my_rows) {
            const A lse = rs[q].value();
            const int i = row0 + r0 + warp * RW + q;
            lse_out[i] = lse;
            if (loss_out)
                loss_out[i] = lse - scale * base[(i64)q * ld + (int)(((i64)i + pos_shift) % pos_mod)];
        }
    }
}
template <typename A>
__device__ __forceinline__ void row_col_stats_body(
    const A* __restrict__ s, i64 ld, int rows, int n, int row0, int pos_shift, int pos_mod,
    const A* __restrict__ scale_log, A scale_mul, A* __restrict__ lse_out,
    A* __restrict__ loss_out, A* __restrict__ part_m, A* __restrict__ part_s)
{
    __shared__ A cm[CPN_BLOCK / 32][2048 / sizeof(A)], cv[CPN_BLOCK / 32][2048 / sizeof(A)];
    const A scale = scale_log ? scale_mul * cpn_exp(scale_log[0]) : scale_mul;
    enum { V = 16 / sizeof(A) };
    if (((unsigned long long)s % 16 == 0) && ld % V == 0)  // (uniform: every row 16-byte aligned)
        row_col_stats_run<A, V>(s, ld, rows, n, row0, pos_shift, pos_mod, scale, lse_out,
                                loss_out, part_m, part_s, cm, cv);
    else
        row_col_stats_run<A, 1>(s, ld, rows, n, row0, pos_shift, pos_mod, scale, lse_out,
                                loss_out, part_m, part_s, cm, cv);
}

// Column statistics, stage 2: fold the partials of one row block into the running
// (col_m, col_s).  `mode` bit 1 (fresh): start from the empty state instead of reading
// (col_m, col_s); bit 0 (finalize): instead of storing the state, turn it into the column lse
// and the per-pair CLIP loss: col_loss_j = lse_col_j - logit_jj, where
// logit_jj = lse_row_j - row_loss_j (pair_loss null: the column lse alone, as for the ranks'
// column states of a distributed CLIP).  (A pass over one row block is one call with both bits.)
// A block of CPN_BLOCK threads takes 32 columns (lane = column: coalesced loads); warp w folds
// the chunks w, w + NW, ... (their loads 8 at a time in flight),
// then warp 0 folds the running pair and the NW partials in warp order.  Fixed orders:
// deterministic.  Launch with ceil(n / 32) blocks.
template <typename A>
__device__ __forceinline__ void col_combine_body(
    const A* __restrict__ part_m, const A* __restrict__ part_s, int chunks, int n,
    A* __restrict__ col_m, A* __restrict__ col_s, int mode,
    const A* __restrict__ lse_row, const A* __restrict__ row_loss,
    A* __restrict__ lse_col, A* __restrict__ pair_loss)
{
    enum { NW = CPN_BLOCK / 32 };
    __shared__ A sm[NW][32], ss[NW][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j = blockIdx.x * 32 + lane;
    Lse<A> part; part.init();
    if (j < n) {
        // U chunks' loads in flight before their merges (in the same order: the same bits;
        // one load at a time, a 512-chunk block took 63 us on an H100, latency-bound)
        enum { U = 8 };
        int c = warp;
        for (; c + (U - 1) * NW < chunks; c += U * NW) {
            A m[U], v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                m[u] = part_m[(i64)(c + u * NW) * n + j];
                v[u] = part_s[(i64)(c + u * NW) * n + j];
            }
#pragma unroll
            for (int u = 0; u < U; ++u) part.merge(m[u], v[u]);
        }
        for (; c < chunks; c += NW) part.merge(part_m[(i64)c * n + j], part_s[(i64)c * n + j]);
    }
    sm[warp][lane] = part.m;
    ss[warp][lane] = part.s;
    __syncthreads();
    if (warp != 0 || j >= n) return;
    // mode bit 1: the first call of a column pass (start from the empty state, so the
    // running state needs no fill kernel); bit 0: finalize
    Lse<A> st;
    if (mode & 2) st.init(); else { st.m = col_m[j]; st.s = col_s[j]; }
    for (int w = 0; w < NW; ++w) st.merge(sm[w][lane], ss[w][lane]);
    if (!(mode & 1)) { col_m[j] = st.m; col_s[j] = st.s; }
    if (mode & 1) {
        const A lc = st.value();
        lse_col[j] = lc;
        if (pair_loss) {  // (null: the column lse alone, e.g. of the ranks' column states)
            const A col_loss = lc - (lse_row[j] - row_loss[j]);
            pair_loss[j] = A(0.5) * (row_loss[j] + col_loss);
        }
    }
}

// Per-query ("paired") negatives: E[i, m] = q_i . neg[i, m]; one warp per (i, m).  Also the
// tile paths' positive dots (m = 1).  e2 (null: none) gets a second copy (NT-Xent's dots of
// both views, dots[i] = dots[i + half]: no copy node after).  16-bit rows with d % 8 == 0 on
// 16-byte boundaries are read 16 bytes a lane (lane l: elements 8 l .. 8 l + 7, then + 256):
// the 2-byte loads left the warp latency-bound (11 us for 16 MiB at N = 16384, H100, where
// the bytes take ~5).  A fixed order either way: deterministic.
template <typename T, typename A>
__device__ __forceinline__ void paired_dots_body(
    const T* __restrict__ q, i64 ldq, const T* __restrict__ neg, int n, int m, int d,
    A* __restrict__ e, A* __restrict__ e2)
{
    const i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= (i64)n * m) return;
    const i64 i = w / m;
    const T* qi = q + i * ldq;
    const T* nk = neg + w * d;
    A acc = A(0);
    if (sizeof(T) == 2 && (d & 7) == 0
        && ((reinterpret_cast<unsigned long long>(qi) | reinterpret_cast<unsigned long long>(nk))
            & 15) == 0) {
        for (int k = lane * 8; k < d; k += 256) {
            const uint4 x = *reinterpret_cast<const uint4*>(qi + k);
            const uint4 y = *reinterpret_cast<const uint4*>(nk + k);
            const T* xs = reinterpret_cast<const T*>(&x);
            const T* ys = reinterpret_cast<const T*>(&y);
#pragma unroll
            for (int u = 0; u < 8; ++u) acc += Conv<T>::load(xs[u]) * Conv<T>::load(ys[u]);
        }
    } else {
        for (int k = lane; k < d; k += 32) acc += Conv<T>::load(qi[k]) * Conv<T>::load(nk[k]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) {
        e[w] = acc;
        if (e2) e2[w] = acc;
    }
}

// ---- extern "C" wrappers, one per dtype --------------------------------------------
#define CPN_DEFINE(SUF, T, A)                                                              \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_row_softmax_##SUF(             \
    const A* s1, i64 ld1, int n1, const A* s2, i64 ld2, int n2,                            \
    int row0, int exclude_diag, int pos_shift, int pos_mod,                                \
    const A* scale_log, A scale_mul, const A* lse_in, A* lse_out, A* loss_out,             \
    T* g1, i64 ldg1, A* g2, i64 ldg2, const A* w_ptr, i64 w_stride, A w_mul,               \
    const i64* lab_r, const i64* lab_c, int nlab, A eps,                                   \
    int hard_mode, A hard_alpha, int own_start, int own_count, int own_mod) {              \
    row_softmax_body<T, A>(s1, ld1, n1, s2, ld2, n2, row0, exclude_diag, pos_shift,        \
        pos_mod, scale_log, scale_mul, lse_in, lse_out, loss_out, g1, ldg1, g2, ldg2,      \
        w_ptr, w_stride, w_mul, lab_r, lab_c, nlab, eps, hard_mode, hard_alpha, own_start, \
        own_count, own_mod); }                                                             \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_row_pairs_##SUF(               \
    const A* s, i64 ld, int n, int row0, const A* scale_log, A scale_mul, const i64* lab,  \
    A* lse_out, A* loss_out, T* g, i64 ldg, const A* w_ptr, i64 w_stride, A w_mul) {       \
    row_pairs_body<T, A>(s, ld, n, row0, scale_log, scale_mul, lab, lse_out, loss_out, g,  \
        ldg, w_ptr, w_stride, w_mul); }                                                    \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_paired_dots_##SUF(             \
    const T* q, i64 ldq, const T* neg, int n, int m, int d, A* e, A* e2) {                 \
    paired_dots_body<T, A>(q, ldq, neg, n, m, d, e, e2); }

#define CPN_DEFINE_ACC(SUF, A)                                                                      \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK, RCS_MIN_BLOCKS(A)) cpn_row_col_stats_##SUF( \
    const A* s, i64 ld, int rows, int n, int row0, int pos_shift, int pos_mod,                      \
    const A* scale_log, A scale_mul, A* lse_out, A* loss_out, A* part_m, A* part_s) {               \
    row_col_stats_body<A>(s, ld, rows, n, row0, pos_shift, pos_mod, scale_log, scale_mul,           \
        lse_out, loss_out, part_m, part_s); }                                                       \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_clip_mask_##SUF(                         \
    A* s, i64 ld, int n, int row0, const i64* lab_r, const i64* lab_c) {                            \
    clip_mask_body<A>(s, ld, n, row0, lab_r, lab_c); }                                              \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_col_combine_##SUF(                      \
    const A* part_m, const A* part_s, int chunks, int n, A* col_m, A* col_s,                        \
    int mode, const A* lse_row, const A* row_loss, A* lse_col, A* pair_loss) {                      \
    col_combine_body<A>(part_m, part_s, chunks, n, col_m, col_s, mode, lse_row,                     \
        row_loss, lse_col, pair_loss); }

CPN_DEFINE(f16, f16_t, float)
CPN_DEFINE(bf16, bf16_t, float)
CPN_DEFINE(f32, float, float)
CPN_DEFINE(f64, double, double)
CPN_DEFINE_ACC(f16, float)
CPN_DEFINE_ACC(bf16, float)
CPN_DEFINE_ACC(f32, float)
CPN_DEFINE_ACC(f64, double)
