// cupynce: how a tile epilogue's gradient block leaves the registers (tile_epilogue.cuh's
// SOUT modes: 16-bit G, H, CLIP, SigLIP on the wgmma loops).  The packed values pk[i][h][j]
// (rows row_base(warp) + i IS + h 8 + lane / 4, columns j 8 + 2 (lane % 4) + {0, 1} of the
// tile, two 16-bit values a register) go through shared memory by stmatrix, then out as
// 16-byte chunks or TMA boxes -- whole lines instead of 8 rows x 16 bytes per warp store.
// Chunks past the last row (rows) or column (nlim) are skipped; a chunk that starts inside a
// row stays inside its 16-byte-padded leading dim (or, B2's columns starting at nlim, inside
// the row: n1 % 8 == 0 there).
#pragma once
#include "include/tile_loop.cuh"

// The warp-specialised kernels' gradient-block staging (G, CLIP, SigLIP), bytes a consumer
// warp: a 16 x 32 block of 16-bit values (H stages 64 x 128 a warpgroup: tile_ws.cuh)
#define WS_SOUT_WARP 1024

// Per warp (the warp-specialised G, CLIP, SigLIP): each warp stages its own 16 x 32 blocks
// through WS_SOUT_WARP bytes at sout + (warp & 3) WS_SOUT_WARP, __syncwarp only -- no
// warpgroup barrier, and 4 KiB a consumer instead of 16, which leaves the ring room for A
// resident at D = 512 (tile_ws.cuh): stmatrix into 64-byte rows (16-byte chunk c of row r at
// c ^ ((r >> 1) & 3): conflict-free), then 16-byte stores, 64 bytes of each of 16 rows.  (H
// keeps the warpgroup's staging: its mirror, stored from one warp's 16 rows, would come in
// 32-byte runs -- measured slower on an H100, 2026-11-27.)
template <typename L, typename T, int I, int J>
__device__ __forceinline__ void stage_warp(const unsigned (&pk)[I][2][J], T* g, i64 ldg,
                                           int rows, int nlim, int m0, int n0, char* sout,
                                           int warp, int lane) {
    char* const wbuf = sout + (warp & 3) * WS_SOUT_WARP;
    const unsigned sbuf = smem_u32(wbuf);
#pragma unroll
    for (int i = 0; i < I; ++i) {
        const int r0 = m0 + L::row_base(warp) + i * L::IS;  // the warp's first row
#pragma unroll
        for (int q = 0; q < J / 4; ++q) {  // columns 32 q .. 32 q + 31
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
                const int jp = 2 * q + jj;
                const int r = ((lane >> 3) & 1) * 8 + (lane & 7);
                const int c = 2 * jj + (lane >> 4);
                stmatrix_x4<false>(sbuf + r * 64 + ((c ^ ((r >> 1) & 3)) << 4),
                                   pk[i][0][2 * jp], pk[i][1][2 * jp],
                                   pk[i][0][2 * jp + 1], pk[i][1][2 * jp + 1]);
            }
            __syncwarp();
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int idx = u * 32 + lane, r = idx >> 2, c = idx & 3;
                const uint4 v = *(const uint4*)(wbuf + r * 64 + ((c ^ ((r >> 1) & 3)) << 4));
                const int lr = r0 + r, col = n0 + 32 * q + c * 8;
                if (lr < rows && col < nlim) *(uint4*)(g + (i64)lr * ldg + col) = v;
            }
            __syncwarp();  // (read before the next stmatrix overwrites it)
        }
    }
}

// Per warpgroup: its 64 x 128 block through the staging tile at sout: stmatrix into 256-byte
// rows (16-byte chunk c of row r at c ^ (r & 7): conflict-free), then each thread stores
// 16-byte chunks (whole 128-byte lines).  mirror (H with `tri`, off the diagonal): also the
// block's transpose H_JI = H_IJ^T, by stmatrix.trans into a 128 x 64 staging tile of 128-byte
// rows (the mirrored rows' runs are whole lines).  On the warp-specialised loop a barrier
// frees the staging before the block too (the previous tile's stores may still read it);
// the cp.async loops' tile barriers do that for them.  (Staging 64 or 32 columns at a time,
// which leaves the ring room for A resident, and TMA stores of 64 x 64 staged blocks were
// measured on an H100, 2026-11-27: within 3 % of this, dropped; docs/notes.md.)
template <typename L, typename T, int I, int J>
__device__ __forceinline__ void stage_warpgroup(const unsigned (&pk)[I][2][J], T* g, i64 ldg,
                                                int rows, int nlim, int m0, int n0,
                                                bool mirror, char* sout, int warp, int lane,
                                                int lt) {
    const int wg = warp >> 2, wl = warp & 3, tw = lt & 127;
    const unsigned sbuf = smem_u32(sout);
#pragma unroll
    for (int i = 0; i < I; ++i) {
        const int hr = L::half_row(warp, i);  // the block's first row in the tile
        if (L::WS) wg_bar(wg);  // (the staging may still be read by the previous stores)
#pragma unroll
        for (int jq = 0; jq < TBN / 16; ++jq) {
            const int r = wl * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
            const int c = 2 * jq + (lane >> 4);
            stmatrix_x4<false>(sbuf + r * (2 * TBN) + ((c ^ (r & 7)) << 4),
                               pk[i][0][2 * jq], pk[i][1][2 * jq],
                               pk[i][0][2 * jq + 1], pk[i][1][2 * jq + 1]);
        }
        wg_bar(wg);
#pragma unroll
        for (int u = 0; u < TBN / 16; ++u) {
            const int idx = u * 128 + tw, r = idx / (TBN / 8), c = idx % (TBN / 8);
            const uint4 v = *(const uint4*)(sout + r * (2 * TBN) + ((c ^ (r & 7)) << 4));
            const int lr = m0 + hr + r, col = n0 + c * 8;
            if (lr < rows && col < nlim) *(uint4*)(g + (i64)lr * ldg + col) = v;
        }
        if (mirror) {
            wg_bar(wg);  // (the stores above have read the staging tile)
#pragma unroll
            for (int jq = 0; jq < TBN / 16; ++jq) {
                const int mtx = lane >> 3;
                const int r = (2 * jq + (mtx >> 1)) * 8 + (lane & 7);
                const int c = wl * 2 + (mtx & 1);
                stmatrix_x4<true>(sbuf + r * 128 + ((c ^ (r & 7)) << 4),
                                  pk[i][0][2 * jq], pk[i][1][2 * jq],
                                  pk[i][0][2 * jq + 1], pk[i][1][2 * jq + 1]);
            }
            wg_bar(wg);
#pragma unroll
            for (int u = 0; u < TBN / 16; ++u) {
                const int idx = u * 128 + tw, r = idx >> 3, c = idx & 7;
                const uint4 v = *(const uint4*)(sout + r * 128 + ((c ^ (r & 7)) << 4));
                const int grow = n0 + r, col = m0 + hr + c * 8;
                if (grow < nlim && col < rows) *(uint4*)(g + (i64)grow * ldg + col) = v;
            }
        }
    }
}
