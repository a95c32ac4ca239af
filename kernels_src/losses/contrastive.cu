// cupynce InfoNCE-family kernels: the fused row/column passes around the cuBLAS products.
//
// Naming: extern "C" wrappers `cpn_<stage>_<dtype>`, dtype in {f16, bf16, f32, f64}.
// T is the storage type of inputs and of the gradient matrix fed back to cuBLAS;
// A (float, or double for f64) is the type of the score matrix S and of every accumulator.
// Every reduction is a fixed-order tree inside one block or a sequential loop: no atomics,
// so results are bitwise reproducible.
#include "include/common.cuh"

// 16 bytes of A (4 float or 2 double): one vector load / store
template <typename A> struct __align__(16) Vec16 { A x[16 / sizeof(A)]; };

// Row pass: one block per row r (global row i = row0 + r) of a score block.
//   logits  = scale * S, scale = scale_mul * (scale_log ? exp(*scale_log) : 1)
//   columns = segment 1 (n1 columns of s1, leading dim ld1; column i excluded when
//             exclude_diag) followed by segment 2 (n2 columns of s2, may be null)
//   positive= column (i + pos_shift) % pos_mod of segment 1
//   lse     = log-sum-exp over the columns (read from lse_in when given)
//   loss    = lse - logit[positive]
//   gradient (when g1 != null): w_i * scale * (softmax - onehot), excluded column 0,
//             w_i = w_mul * (w_ptr ? w_ptr[i * w_stride] : 1); segment 2 goes to g2 (type A).
template <typename T, typename A>
__device__ __forceinline__ void row_softmax_body(
    const A* __restrict__ s1, i64 ld1, int n1,
    const A* __restrict__ s2, i64 ld2, int n2,
    int row0, int exclude_diag, int pos_shift, int pos_mod,
    const A* __restrict__ scale_log, A scale_mul,
    const A* __restrict__ lse_in, A* __restrict__ lse_out, A* __restrict__ loss_out,
    T* __restrict__ g1, i64 ldg1, A* __restrict__ g2, i64 ldg2,
    const A* __restrict__ w_ptr, i64 w_stride, A w_mul)
{
    __shared__ A sh[64];
    const int r = blockIdx.x;
    const int i = row0 + r;
    const A scale = scale_log ? scale_mul * cpn_exp(scale_log[0]) : scale_mul;
    const A* row1 = s1 + (i64)r * ld1;
    const A* row2 = s2 ? s2 + (i64)r * ld2 : (const A*)0;
    const int diag = exclude_diag ? i : -1;
    const int pos = (int)(((i64)i + pos_shift) % pos_mod);

    A lse;
    if (lse_in) {
        lse = lse_in[i];
    } else {
        Lse<A> st; st.init();
        for (int j = threadIdx.x; j < n1; j += blockDim.x)
            if (j != diag) st.add(scale * row1[j]);
        for (int j = threadIdx.x; j < n2; j += blockDim.x) st.add(scale * row2[j]);
        block_lse(st, sh);
        lse = st.value();
    }
    if (threadIdx.x == 0) {
        if (lse_out) lse_out[i] = lse;
        if (loss_out) loss_out[i] = lse - scale * row1[pos];
    }
    if (!g1) return;
    __syncthreads();  // g1 may alias s1: row1[pos] must be read before it is overwritten
    const A gm = w_mul * (w_ptr ? w_ptr[(i64)i * w_stride] : A(1)) * scale;
    T* grow1 = g1 + (i64)r * ldg1;
    for (int j = threadIdx.x; j < n1; j += blockDim.x) {
        A p = (j == diag) ? A(0) : cpn_exp(scale * row1[j] - lse);
        if (j == pos) p -= A(1);
        grow1[j] = Conv<T>::store(gm * p);
    }
    if (g2) {
        A* grow2 = g2 + (i64)r * ldg2;
        for (int j = threadIdx.x; j < n2; j += blockDim.x)
            grow2[j] = gm * cpn_exp(scale * row2[j] - lse);
    }
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

// The reduced loss: out[0] = (sum of x[0..n)) / divisor in one block, in a fixed order
// (thread t adds x[t], x[t + B], ... in turn, then a fixed tree over the threads): the same
// bits on every run, and one small launch where CuPy's mean / sum take several.  Block b of
// the launch sums row b of a (gridDim.x, n) array into out[b] (one launch for several sums).
template <typename A>
__device__ __forceinline__ void sum_rows_body(const A* __restrict__ x, i64 n, A divisor,
                                              A* __restrict__ out)
{
    __shared__ A sh[CPN_BLOCK];
    A s = A(0);
    for (i64 i = threadIdx.x; i < n; i += CPN_BLOCK) s += x[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = CPN_BLOCK / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = sh[0] / divisor;
}

// The device logit-scale guard (arrays.guard_log_scale): y = x, NaN where x > limit (a log
// scale whose exp overflows float32) -- a device value is never read on the host, so past
// the limit it poisons the loss and the gradients instead.  (NaN compares false: kept.)
template <typename A>
__device__ __forceinline__ void guard_log_scale_body(const A* __restrict__ x, i64 n, A limit,
                                                     A* __restrict__ y)
{
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (i64)gridDim.x * blockDim.x)
        y[k] = x[k] > limit ? cpn_nan<A>() : x[k];
}

// CLIP gradient of a row block: block per row r (global i).
//   G_ij = 1/2 [ w_i (exp(L_ij - lse_row_i) - d_ij) + w_j (exp(L_ij - lse_col_j) - d_ij) ]
//   g[r, j] = scale * G_ij (the gradient w.r.t. the raw product a_i . b_j)
//   dscale_part[i] = sum_j G_ij L_ij (row share of d loss / d logit_scale; null: not wanted)
// scale = scale_mul * (scale_log ? exp(*scale_log) : 1).  Also the block of two disjoint row
// sets of one symmetric softmax (a global NT-Xent's off-diagonal rank block: row0 past the
// columns, so no d_ij, and w doubled: G = H = w_i p_i(j) + w_j p_j(i)).
template <typename T, typename A>
__device__ __forceinline__ void clip_grad_body(
    const A* __restrict__ s, i64 ld, int n, int row0,
    const A* __restrict__ scale_log, A scale_mul,
    const A* __restrict__ lse_row, const A* __restrict__ lse_col,
    const A* __restrict__ w_ptr, i64 w_stride, A w_mul,
    T* __restrict__ g, i64 ldg, A* __restrict__ dscale_part)
{
    __shared__ A sh[64];
    enum { V = 16 / sizeof(A) };
    const int r = blockIdx.x;
    const int i = row0 + r;
    const A scale = scale_log ? scale_mul * cpn_exp(scale_log[0]) : scale_mul;
    const A* row = s + (i64)r * ld;
    T* grow = g + (i64)r * ldg;
    const A lr = lse_row[i];
    const A wi = w_mul * (w_ptr ? w_ptr[(i64)i * w_stride] : A(1));
    A acc = A(0);
    auto grad = [&](int j, A sj, A lc) {
        const A wj = w_mul * (w_ptr ? w_ptr[(i64)j * w_stride] : A(1));
        const A L = scale * sj;
        A G = wi * cpn_exp(L - lr) + wj * cpn_exp(L - lc);
        if (j == i) G -= wi + wj;
        G *= A(0.5);
        acc += G * L;
        return scale * G;
    };
    int j1 = 0;  // (the columns from j1 on: one at a time)
    // 16-byte loads and stores where every row, lse_col and g (of A itself) allow them
    // (uniform over the grid); thread t takes the vectors t, t + B, ... in order
    if (sizeof(T) == sizeof(A) && (unsigned long long)s % 16 == 0 && ld % V == 0 &&
        (unsigned long long)g % 16 == 0 && ldg % V == 0 && (unsigned long long)lse_col % 16 == 0) {
        j1 = n / V * V;
        for (int j = V * threadIdx.x; j < j1; j += V * blockDim.x) {
            const Vec16<A> sv = *reinterpret_cast<const Vec16<A>*>(row + j);
            const Vec16<A> lv = *reinterpret_cast<const Vec16<A>*>(lse_col + j);
            Vec16<A> o;
#pragma unroll
            for (int e = 0; e < V; ++e) o.x[e] = grad(j + e, sv.x[e], lv.x[e]);
            *reinterpret_cast<Vec16<A>*>(grow + j) = o;
        }
    }
    for (int j = j1 + threadIdx.x; j < n; j += blockDim.x)
        grow[j] = Conv<T>::store(grad(j, row[j], lse_col[j]));
    if (dscale_part) {  // (uniform over the block: every thread reaches block_sum)
        acc = block_sum(acc, sh);
        if (threadIdx.x == 0) dscale_part[i] = acc;
    }
}

// The gradient block of a kept square score matrix, for 16-bit T, written in place over the
// float32 row it is computed from (one block per row r, global row i = row0 + r):
//   L = scale * S_ij,  G_ij = factor * (w_i e^(L - lse_row_i) + w_j e^(L - lse_col_j)
//                                       - [j == pos_i] (w_i + w_j)),   g = scale * G,
//   pos_i = (i + pos_shift) % pos_mod; column i gives 0 when exclude_diag.
// CLIP (factor 1/2, pos_i = i, lse_col its column statistics): clip_grad_body's G, the same
// operations per element, with dscale_part[i] = sum_j G_ij L_ij (summed per thread over its
// vectors, then block_sum: a fixed order, its own).  NT-Xent (factor 1, the diagonal
// excluded, lse_col = lse_row): H = G + G^T of its symmetric S, whose one product H Z gives
// dZ (dscale_part null).
// G's row r starts where S's does (g == s as bytes, ldg == 2 ld in a 16-bit T), so that a kept
// score matrix needs no second buffer for G (4 N^2 bytes, not 6: N = 16384 fits 1 GiB); for
// T == A (float32, float64: defined for every dtype, used for 16-bit inputs) G_j is S_j's own
// slot.  G_j's bytes overlap S_{j/2} (or S_j), read in the same or an earlier round; every
// round reads its S values into registers, then the block synchronises, then writes them: no
// thread's store lands on a value another thread has still to read.  Hence neither pointer is
// __restrict__ (the barrier also keeps the compiler from moving a store above a load) and the
// loop runs in uniform rounds of V * blockDim.x columns: V = 16 / sizeof(A) columns a thread
// (one 16-byte load of S and of lse_col, one store of V T's) where every row and lse_col are
// 16-byte aligned (uniform over the grid), else V = 1 (the bandwidth: a 16384^2 block read
// one float at a time between barriers is latency-bound).
template <typename T, int V> struct alignas(V * sizeof(T)) VecOut { T x[V]; };  // V T's, one store

template <typename T, typename A, int V>
__device__ __forceinline__ A grad_inplace_run(
    A* s, i64 ld, int n, int r, int i, int pos, int diag, A factor, A scale,
    const A* __restrict__ lse_col, const A* __restrict__ w_ptr, i64 w_stride, A w_mul,
    A lr, A wi)
{
    typedef VecOut<T, V> Out;
    const A* row = s + (i64)r * ld;
    T* grow = reinterpret_cast<T*>(s + (i64)r * ld);
    A acc = A(0);
    for (int j0 = 0; j0 < n; j0 += V * blockDim.x) {
        const int j = j0 + V * threadIdx.x;
        A sv[V], lv[V], out[V];
        if (j + V <= n) {  // (a whole vector; a row's last, partial one element-wise below)
            if (V > 1) {
                const Vec16<A> a = *reinterpret_cast<const Vec16<A>*>(row + j);
                const Vec16<A> b = *reinterpret_cast<const Vec16<A>*>(lse_col + j);
#pragma unroll
                for (int e = 0; e < V; ++e) { sv[e] = a.x[e]; lv[e] = b.x[e]; }
            } else {
                sv[0] = row[j]; lv[0] = lse_col[j];
            }
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e) {
                sv[e] = j + e < n ? row[j + e] : A(0);
                lv[e] = j + e < n ? lse_col[j + e] : A(0);
            }
        }
#pragma unroll
        for (int e = 0; e < V; ++e) {
            const int c = j + e;
            out[e] = A(0);
            if (c < n && c != diag) {
                const A wj = w_mul * (w_ptr ? w_ptr[(i64)c * w_stride] : A(1));
                const A L = scale * sv[e];
                A G = wi * cpn_exp(L - lr) + wj * cpn_exp(L - lv[e]);
                if (c == pos) G -= wi + wj;
                G *= factor;
                acc += G * L;
                out[e] = scale * G;
            }
        }
        __syncthreads();  // (every read of this round before any write of it)
        if (j + V <= n) {
            Out o;
#pragma unroll
            for (int e = 0; e < V; ++e) o.x[e] = Conv<T>::store(out[e]);
            *reinterpret_cast<Out*>(grow + j) = o;
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e)
                if (j + e < n) grow[j + e] = Conv<T>::store(out[e]);
        }
    }
    return acc;
}

template <typename T, typename A>
__device__ __forceinline__ void grad_inplace_body(
    A* s, i64 ld, int n, int row0, int pos_shift, int pos_mod, int exclude_diag, A factor,
    const A* __restrict__ scale_log, A scale_mul,
    const A* __restrict__ lse_row, const A* __restrict__ lse_col,
    const A* __restrict__ w_ptr, i64 w_stride, A w_mul, A* __restrict__ dscale_part)
{
    __shared__ A sh[64];
    enum { V = 16 / sizeof(A) };
    const int r = blockIdx.x;
    const int i = row0 + r;
    const int pos = (i + pos_shift) % pos_mod;
    const int diag = exclude_diag ? i : -1;
    const A scale = scale_log ? scale_mul * cpn_exp(scale_log[0]) : scale_mul;
    const A lr = lse_row[i];
    const A wi = w_mul * (w_ptr ? w_ptr[(i64)i * w_stride] : A(1));
    A acc;
    if ((unsigned long long)s % 16 == 0 && ld % V == 0 && (unsigned long long)lse_col % 16 == 0)
        acc = grad_inplace_run<T, A, V>(s, ld, n, r, i, pos, diag, factor, scale, lse_col,
                                        w_ptr, w_stride, w_mul, lr, wi);
    else
        acc = grad_inplace_run<T, A, 1>(s, ld, n, r, i, pos, diag, factor, scale, lse_col,
                                        w_ptr, w_stride, w_mul, lr, wi);
    if (dscale_part) {  // (uniform over the block: every thread reaches block_sum)
        acc = block_sum(acc, sh);
        if (threadIdx.x == 0) dscale_part[i] = acc;
    }
}

// SigLIP row pass: one block per row r (global row i = row0 + r) of a raw score block S
// (S_ij = a_i . b_j; n columns, leading dim ld).  With scale = exp(*scale_log), L_ij =
// scale * S_ij + *bias and z_ij = +1 for j == i, -1 otherwise (no softmax: every pair alone):
//   loss_out[i]   = sum_j softplus(-z_ij L_ij)                              (null: not wanted)
//   when g != null, with v_i = w_ptr ? w_ptr[i * w_stride] : 1 and
//   G'_ij = -v_i z_ij sigmoid(-z_ij L_ij), G_ij = w_mul G'_ij (the gradient w.r.t. L_ij):
//     g[r, j]        = scale * G'_ij  (w_mul is the products' alpha: at SigLIP's start, the
//                      negatives' 10 sigmoid(-10) / N would underflow float16 for N >~ 16k)
//     dscale_part[i] = sum_j G_ij (L_ij - bias),  dbias_part[i] = sum_j G_ij
// softplus(-x) = max(-x, 0) + log1p(e) and sigmoid(-x) from the same e = exp(-|x|): finite
// for any finite logit; a NaN score gives NaN.  g may alias s (each element is read, then
// written, by one thread): neither is __restrict__.
template <typename T, typename A>
__device__ __forceinline__ void siglip_rows_body(
    const A* s, i64 ld, int n, int row0,
    const A* __restrict__ scale_log, const A* __restrict__ bias_ptr,
    A* __restrict__ loss_out, T* g, i64 ldg,
    const A* __restrict__ w_ptr, i64 w_stride, A w_mul,
    A* __restrict__ dscale_part, A* __restrict__ dbias_part)
{
    __shared__ A sh[64];
    const int r = blockIdx.x;
    const int i = row0 + r;
    const A scale = cpn_exp(scale_log[0]);
    const A bias = bias_ptr[0];
    const A* row = s + (i64)r * ld;
    T* grow = g ? g + (i64)r * ldg : (T*)0;
    const A vi = w_ptr ? w_ptr[(i64)i * w_stride] : A(1);
    A loss = A(0), dsc = A(0), dbi = A(0);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const A raw = row[j];  // (read before g, which may alias s, is written)
        const A L = scale * raw + bias;
        const A zl = (j == i) ? L : -L;
        const A e = cpn_exp(-cpn_abs(zl));
        if (loss_out) loss += (zl < A(0) ? -zl : A(0)) + cpn_log1p(e);
        if (grow) {
            const A sg = (zl > A(0) ? e : A(1)) / (A(1) + e);  // sigmoid(-zl)
            const A Gp = (j == i) ? -vi * sg : vi * sg;
            const A G = w_mul * Gp;
            dsc += G * (scale * raw);
            dbi += G;
            grow[j] = Conv<T>::store(scale * Gp);
        }
    }
    // (uniform over the block: every thread reaches each block_sum)
    if (loss_out) {
        loss = block_sum(loss, sh);
        if (threadIdx.x == 0) loss_out[i] = loss;
    }
    if (grow) {
        dsc = block_sum(dsc, sh);
        dbi = block_sum(dbi, sh);
        if (threadIdx.x == 0) { dscale_part[i] = dsc; dbias_part[i] = dbi; }
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

// Gradient of the paired negatives; block per query i, threads over d:
//   dq_acc[i, :] += sum_m g2[i, m] * neg[i, m, :]   (sequential over m)
//   dneg[i, m, :] = g2[i, m] * q[i, :]
template <typename T, typename A>
__device__ __forceinline__ void paired_grad_body(
    const T* __restrict__ q, i64 ldq, const T* __restrict__ neg, const A* __restrict__ g2,
    int m, int d, A* __restrict__ dq_acc, A* __restrict__ dneg)
{
    const i64 i = blockIdx.x;
    const A* gi = g2 + i * m;
    for (int k = threadIdx.x; k < d; k += blockDim.x) {
        const A qk = Conv<T>::load(q[i * ldq + k]);
        A acc = dq_acc[i * d + k];
        for (int t = 0; t < m; ++t) {
            const i64 off = (i * m + t) * d + k;
            acc += gi[t] * Conv<T>::load(neg[off]);
            dneg[off] = gi[t] * qk;
        }
        dq_acc[i * d + k] = acc;
    }
}

// Row L2 normalisation, as F.normalize: xn = x / max(||x||, eps). Block per row.
template <typename T, typename A>
__device__ __forceinline__ void l2norm_fwd_body(
    const T* __restrict__ x, i64 ldx, int d, A eps, T* __restrict__ xn, A* __restrict__ norm)
{
    __shared__ A sh[64];
    const i64 i = blockIdx.x;
    const T* xi = x + i * ldx;
    A ss = A(0);
    for (int k = threadIdx.x; k < d; k += blockDim.x) { A v = Conv<T>::load(xi[k]); ss += v * v; }
    ss = block_sum(ss, sh);
    A nrm = cpn_sqrt(ss);
    if (nrm == cpn_inf<A>()) {  // (uniform over the block: every thread holds the block sum)
        // the sum of squares overflowed (|x| >~ 1.8e19 in float32): ||x|| = m ||x / m|| with
        // m = max |x_k|, as F.normalize gets it; an inf entry keeps ||x|| = inf
        A m = A(0);
        for (int k = threadIdx.x; k < d; k += blockDim.x) {
            const A v = cpn_abs(Conv<T>::load(xi[k]));
            m = v > m ? v : m;
        }
        m = block_max(m, sh);
        if (m < cpn_inf<A>()) {  // (x / m, not x * (1 / m): 1 / m may be subnormal, flushed)
            A s2 = A(0);
            for (int k = threadIdx.x; k < d; k += blockDim.x) {
                const A v = Conv<T>::load(xi[k]) / m;
                s2 += v * v;
            }
            nrm = m * cpn_sqrt(block_sum(s2, sh));
        }
    }
    const A den = nrm > eps ? nrm : eps;
    const A inv = A(1) / den;
    if (inv >= cpn_min_normal<A>()) {
        for (int k = threadIdx.x; k < d; k += blockDim.x)
            xn[i * d + k] = Conv<T>::store(Conv<T>::load(xi[k]) * inv);
    } else {  // ||x|| > 2^126 (float32): 1 / ||x|| would flush to 0 (-ftz); divide instead
        for (int k = threadIdx.x; k < d; k += blockDim.x)
            xn[i * d + k] = Conv<T>::store(Conv<T>::load(xi[k]) / den);
    }
    if (threadIdx.x == 0) norm[i] = nrm;
}

// Backward of the normalisation, times the upstream scalar *g (when g != null):
//   dx = g * (dxn - [||x|| > eps] xn (xn . dxn)) / max(||x||, eps)
template <typename T, typename A>
__device__ __forceinline__ void l2norm_bwd_body(
    const T* __restrict__ x, i64 ldx, int d, A eps, const A* __restrict__ norm,
    const A* __restrict__ dxn, const A* __restrict__ g, T* __restrict__ dx)
{
    __shared__ A sh[64];
    const i64 i = blockIdx.x;
    const T* xi = x + i * ldx;
    const A nrm = norm[i];
    const A den = nrm > eps ? nrm : eps;
    const A inv = A(1) / den;
    A dot = A(0);
    for (int k = threadIdx.x; k < d; k += blockDim.x)
        dot += Conv<T>::load(xi[k]) * inv * dxn[i * d + k];
    dot = block_sum(dot, sh);
    const A proj = nrm > eps ? dot : A(0);
    const A gs = g ? g[0] : A(1);
    for (int k = threadIdx.x; k < d; k += blockDim.x) {
        const A xn = Conv<T>::load(xi[k]) * inv;
        dx[i * d + k] = Conv<T>::store(gs * (dxn[i * d + k] - xn * proj) * inv);
    }
}

// Four fp32 accumulators per 16-byte load and four T per store, for aligned buffers; returns
// how many leading elements it handled (0: not float or not aligned).  Same arithmetic per
// element as the scalar loop: one fp32 product, one rounding.
template <typename T> struct alignas(4 * sizeof(T)) Vec4 { T v[4]; };
template <typename T, typename A> struct CastVec {
    static __device__ __forceinline__ i64 run(const A*, i64, A, T*) { return 0; }
};
template <typename T> struct CastVec<T, float> {
    static __device__ __forceinline__ i64 run(const float* __restrict__ acc, i64 n, float gs,
                                              T* __restrict__ out) {
        if (((size_t)acc & 15) || ((size_t)out & (4 * sizeof(T) - 1))) return 0;
        const i64 n4 = n >> 2;
        for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < n4; q += (i64)gridDim.x * blockDim.x) {
            const float4 v = reinterpret_cast<const float4*>(acc)[q];
            Vec4<T> o;
            o.v[0] = Conv<T>::store(v.x * gs); o.v[1] = Conv<T>::store(v.y * gs);
            o.v[2] = Conv<T>::store(v.z * gs); o.v[3] = Conv<T>::store(v.w * gs);
            reinterpret_cast<Vec4<T>*>(out)[q] = o;
        }
        return n4 * 4;
    }
};

// out[k] = T(acc[k] * (g ? *g : 1)): the final cast of an accumulated gradient.
template <typename T, typename A>
__device__ __forceinline__ void scale_cast_body(
    const A* __restrict__ acc, i64 n, const A* __restrict__ g, T* __restrict__ out)
{
    const A gs = g ? g[0] : A(1);
    const i64 done = CastVec<T, A>::run(acc, n, gs, out);
    for (i64 k = done + (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (i64)gridDim.x * blockDim.x)
        out[k] = Conv<T>::store(acc[k] * gs);
}

// ---- extern "C" wrappers, one per dtype --------------------------------------------
#define CPN_DEFINE(SUF, T, A)                                                              \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_row_softmax_##SUF(             \
    const A* s1, i64 ld1, int n1, const A* s2, i64 ld2, int n2,                            \
    int row0, int exclude_diag, int pos_shift, int pos_mod,                                \
    const A* scale_log, A scale_mul, const A* lse_in, A* lse_out, A* loss_out,             \
    T* g1, i64 ldg1, A* g2, i64 ldg2, const A* w_ptr, i64 w_stride, A w_mul) {             \
    row_softmax_body<T, A>(s1, ld1, n1, s2, ld2, n2, row0, exclude_diag, pos_shift,        \
        pos_mod, scale_log, scale_mul, lse_in, lse_out, loss_out, g1, ldg1, g2, ldg2,      \
        w_ptr, w_stride, w_mul); }                                                         \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_clip_grad_##SUF(               \
    const A* s, i64 ld, int n, int row0, const A* scale_log, A scale_mul,                  \
    const A* lse_row, const A* lse_col, const A* w_ptr, i64 w_stride, A w_mul, T* g,       \
    i64 ldg, A* dscale_part) {                                                             \
    clip_grad_body<T, A>(s, ld, n, row0, scale_log, scale_mul, lse_row, lse_col, w_ptr,    \
        w_stride, w_mul, g, ldg, dscale_part); }                                           \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_siglip_rows_##SUF(            \
    const A* s, i64 ld, int n, int row0, const A* scale_log, const A* bias, A* loss_out,   \
    T* g, i64 ldg, const A* w_ptr, i64 w_stride, A w_mul, A* dscale_part,                  \
    A* dbias_part) {                                                                       \
    siglip_rows_body<T, A>(s, ld, n, row0, scale_log, bias, loss_out, g, ldg, w_ptr,       \
        w_stride, w_mul, dscale_part, dbias_part); }                                       \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_paired_dots_##SUF(             \
    const T* q, i64 ldq, const T* neg, int n, int m, int d, A* e, A* e2) {                 \
    paired_dots_body<T, A>(q, ldq, neg, n, m, d, e, e2); }                                 \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_paired_grad_##SUF(             \
    const T* q, i64 ldq, const T* neg, const A* g2, int m, int d, A* dq_acc, A* dneg) {    \
    paired_grad_body<T, A>(q, ldq, neg, g2, m, d, dq_acc, dneg); }                         \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_l2norm_fwd_##SUF(              \
    const T* x, i64 ldx, int d, A eps, T* xn, A* norm) {                                   \
    l2norm_fwd_body<T, A>(x, ldx, d, eps, xn, norm); }                                     \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_l2norm_bwd_##SUF(              \
    const T* x, i64 ldx, int d, A eps, const A* norm, const A* dxn, const A* g, T* dx) {   \
    l2norm_bwd_body<T, A>(x, ldx, d, eps, norm, dxn, g, dx); }                             \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_scale_cast_##SUF(              \
    const A* acc, i64 n, const A* g, T* out) {                                             \
    scale_cast_body<T, A>(acc, n, g, out); }

#define CPN_DEFINE_ACC(SUF, A)                                                             \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK, RCS_MIN_BLOCKS(A)) cpn_row_col_stats_##SUF( \
    const A* s, i64 ld, int rows, int n, int row0, int pos_shift, int pos_mod,             \
    const A* scale_log, A scale_mul, A* lse_out, A* loss_out, A* part_m, A* part_s) {      \
    row_col_stats_body<A>(s, ld, rows, n, row0, pos_shift, pos_mod, scale_log, scale_mul,  \
        lse_out, loss_out, part_m, part_s); }                                              \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_col_combine_##SUF(             \
    const A* part_m, const A* part_s, int chunks, int n, A* col_m, A* col_s,               \
    int mode, const A* lse_row, const A* row_loss, A* lse_col, A* pair_loss) {             \
    col_combine_body<A>(part_m, part_s, chunks, n, col_m, col_s, mode, lse_row,            \
        row_loss, lse_col, pair_loss); }                                                   \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_sum_rows_##SUF(                \
    const A* x, i64 n, A divisor, A* out) {                                                \
    sum_rows_body<A>(x + (i64)blockIdx.x * n, n, divisor, out + blockIdx.x); }                                                \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_guard_log_scale_##SUF(         \
    const A* x, i64 n, A limit, A* y) {                                                    \
    guard_log_scale_body<A>(x, n, limit, y); }

CPN_DEFINE(f16, f16_t, float)
CPN_DEFINE(bf16, bf16_t, float)
CPN_DEFINE(f32, float, float)
CPN_DEFINE(f64, double, double)

// the in-place G (used for 16-bit inputs)
#define CPN_DEFINE_INPLACE(SUF, T, A)                                                      \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_grad_inplace_##SUF(            \
    A* s, i64 ld, int n, int row0, int pos_shift, int pos_mod, int exclude_diag, A factor,  \
    const A* scale_log, A scale_mul, const A* lse_row, const A* lse_col, const A* w_ptr,    \
    i64 w_stride, A w_mul, A* dscale_part) {                                               \
    grad_inplace_body<T, A>(s, ld, n, row0, pos_shift, pos_mod, exclude_diag, factor,      \
        scale_log, scale_mul, lse_row, lse_col, w_ptr, w_stride, w_mul, dscale_part); }
CPN_DEFINE_INPLACE(f16, f16_t, float)
CPN_DEFINE_INPLACE(bf16, bf16_t, float)
CPN_DEFINE_INPLACE(f32, float, float)
CPN_DEFINE_INPLACE(f64, double, double)
CPN_DEFINE_ACC(f16, float)
CPN_DEFINE_ACC(bf16, float)
CPN_DEFINE_ACC(f32, float)
CPN_DEFINE_ACC(f64, double)

// ---- CLIP's gradient block as F16x3 halves (float32; tiles_f16x3, issue 24) ----------------
// clip_grad_body's G for one row r (global i), written in place over the row of s (leading
// dimension ld, a multiple of 64) as tiles_ws_f16x3.cu's interleaved halves of G 2^e: per
// 64-column group, its 64 hi then its 64 lo float16 in the group's 256 bytes (columns n .. of
// the last group zero).  No scale in G (|G_ij| <= max |w|, whose exponent is *e_ptr, else
// e_host; e = that - 1 puts G 2^e below 2^14, a 2x margin against float16's 65504 for an lse
// given from elsewhere): the products take scale 2^-e from *ufac (written by block 0, thread
// 0).  dscale_part[i] = sum_j G_ij L_ij as clip_grad.  A group is one half-warp's 16 float4
// (all read before any is written, __syncwarp: in place); 256 threads.
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_clip_grad_f16x3(
    float* s, i64 ld, int n, int row0, const float* __restrict__ scale_log, float scale_mul,
    const float* __restrict__ lse_row, const float* __restrict__ lse_col,
    const float* __restrict__ w_ptr, i64 w_stride, float w_mul, const int* __restrict__ e_ptr,
    int e_host, float* ufac, float* dscale_part)
{
    __shared__ float sh[64];
    const int r = blockIdx.x, i = row0 + r;
    const float scale = scale_log ? scale_mul * cpn_exp(scale_log[0]) : scale_mul;
    const int e = (e_ptr ? *e_ptr : e_host) - 1;  // (|G| 2^e below 2^14: a 2x margin)
    const float s2 = f16x3_pow2(e);
    if (ufac && r == 0 && threadIdx.x == 0) ufac[0] = scale * f16x3_pow2(-e);
    float* const row = s + (i64)r * ld;
    const float lr = lse_row[i];
    const float wi = w_mul * (w_ptr ? w_ptr[(i64)i * w_stride] : 1.f);
    const int hw = threadIdx.x >> 4, l = threadIdx.x & 15;
    const int groups = (n + 63) / 64;
    float acc = 0.f;
    for (int q0 = 0; q0 < groups; q0 += CPN_BLOCK / 16) {  // (uniform: every lane syncs)
        const int q = q0 + hw, c = 64 * q + 4 * l;
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (q < groups && c + 3 < n) {
            const float4 x = *(const float4*)(row + c);
            v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
        } else if (q < groups) {
            for (int k = 0; k < 4 && c + k < n; ++k) v[k] = row[c + k];
        }
        __syncwarp();
        if (q >= groups) continue;
        unsigned short h[4], lo[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            h[k] = lo[k] = 0;
            const int j = c + k;
            if (j < n) {
                const float wj = w_mul * (w_ptr ? w_ptr[(i64)j * w_stride] : 1.f);
                const float L = scale * v[k];
                // (clip_grad_body's G, the same operations)
                float G = wi * cpn_exp(L - lr) + wj * cpn_exp(L - lse_col[j]);
                if (j == i) G -= wi + wj;
                G *= 0.5f;
                acc += G * L;
                f16x3_split(G, s2, h[k], lo[k]);
            }
        }
        unsigned short* const gb = (unsigned short*)(row + 64 * q);
        *(uint2*)(gb + 4 * l) = make_uint2(h[0] | ((unsigned)h[1] << 16), h[2] | ((unsigned)h[3] << 16));
        *(uint2*)(gb + 64 + 4 * l) =
            make_uint2(lo[0] | ((unsigned)lo[1] << 16), lo[2] | ((unsigned)lo[3] << 16));
    }
    if (dscale_part) {
        acc = block_sum(acc, sh);
        if (threadIdx.x == 0) dscale_part[i] = acc;
    }
}

// ops/_graphs.py's pack: a graph gathers a call's small outputs into one block, copied out in
// one piece.  Range k (blockIdx.y) copies tab[3k + 2] bytes from address tab[3k] to
// dst + tab[3k + 1]; 16-byte words where both ends are 16-byte aligned, else bytes.  One
// launch where a memcpy node per output cost ~1.2 us of GPU time each (H100).
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) cpn_gather_bytes(
    const long long* __restrict__ tab, char* __restrict__ dst)
{
    const int k = blockIdx.y;
    const char* const src = (const char*)tab[3 * k];
    char* const out = dst + tab[3 * k + 1];
    const long long nb = tab[3 * k + 2];
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if ((((unsigned long long)src | (unsigned long long)out) & 15) == 0) {
        const long long nw = nb >> 4;
        for (long long w = t0; w < nw; w += stride) ((uint4*)out)[w] = ((const uint4*)src)[w];
        done = nw << 4;
    }
    for (long long b = done + t0; b < nb; b += stride) out[b] = src[b];
}
