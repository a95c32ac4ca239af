// CLIP's labels in the score tiles' epilogue (tile_epilogue.cuh includes this): which of a
// thread's scores of one tile are same-label pairs, after a per-tile prefilter on the
// labels' 128-block key ranges (cpn_label_ranges, losses/stats.cu).
#pragma once
#include "include/tile_loop.cuh"

// CLIP's labels on one tile (ep.lab_r set: LSE2 and CLIP, 16-bit): bit 2j + e of mb[i][h] is
// set where the thread's score (i, h, j, e) -- global row gi[i][h], column c = n0 + cbase +
// 8j + 2cq + e < nlim -- has lab[row] == lab[c] and c != row (the row's positive, column
// row in both CLIP stages, stays), as clip_mask (stats.cu) leaves it out of the row blocks.
// lab (ep.lab_c) holds the labels of rows and columns alike (CLIP: one index space); rng
// (ep.lab_r, cpn_label_ranges) holds, for each index, the (min, max) of the labels' low 32
// bits over its aligned 128-block.  The tile's rows ra..rb and columns span at most two
// such blocks each: where the two key ranges are disjoint no pair can be equal and the tile
// reads no label (4 broadcast loads: most tiles where labels come grouped, as duplicates and
// views do).  Else each thread reads its 2I row labels and its 2J column labels (L1 / L2
// hits) and compares them in registers; rows past the end get no bits.
// Returns whether any bit is set (the caller makes such a tile `special`).
template <typename L>
__device__ __forceinline__ bool label_bits(unsigned (&mb)[L::I][2],
                                           const long long* __restrict__ rng,
                                           const long long* __restrict__ lab,
                                           const int (&gi)[L::I][2], const bool (&rv)[L::I][2],
                                           int ra, int rb, int n0, int nlim, int cbase, int cq) {
    enum { I = L::I, J = L::J };
    static_assert(2 * J <= 32, "label_bits: one 32-bit mask per row");
#pragma unroll
    for (int i = 0; i < I; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) mb[i][h] = 0u;
    {   // the prefilter: the key ranges of the tile's rows and columns (uniform in the tile)
        const unsigned long long r1 = __ldg(rng + ra), r2 = __ldg(rng + rb);
        const unsigned long long c1 = __ldg(rng + n0), c2 = __ldg(rng + min(n0 + TBN, nlim) - 1);
        const int rlo = min((int)(unsigned)(r1 >> 32), (int)(unsigned)(r2 >> 32));
        const int rhi = max((int)(unsigned)r1, (int)(unsigned)r2);
        const int clo = min((int)(unsigned)(c1 >> 32), (int)(unsigned)(c2 >> 32));
        const int chi = max((int)(unsigned)c1, (int)(unsigned)c2);
        if (rlo > chi || clo > rhi) return false;
    }
    long long rlab[I][2];
#pragma unroll
    for (int i = 0; i < I; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // (the row index made opaque: the addresses, hoisted out of the tile loop, cost
            // long-lived registers -- spills -- for one load a tile)
            int gr = gi[i][h];
            asm volatile("" : "+r"(gr));
            rlab[i][h] = rv[i][h] ? __ldg(lab + gr) : 0ll;
        }
    const int c0 = n0 + cbase + 2 * cq;  // the thread's first column
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int col = c0 + j * 8 + e;
            if (col < nlim) {
                const long long lc = __ldg(lab + col);
#pragma unroll
                for (int i = 0; i < I; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        if (lc == rlab[i][h]) mb[i][h] |= 1u << (j * 2 + e);
            }
        }
    bool any = false;
#pragma unroll
    for (int i = 0; i < I; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // the positive (column == row) keeps its score: clear its bit where it is ours
            const int dd = gi[i][h] - c0;
            if (dd >= 0 && dd < 8 * J && (dd & 6) == 0)
                mb[i][h] &= ~(1u << ((dd >> 3) * 2 + (dd & 1)));
            if (!rv[i][h]) mb[i][h] = 0u;
            any |= mb[i][h] != 0u;
        }
    return any;
}
