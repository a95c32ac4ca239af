// cupynce warp-specialised tile walk (Hopper, sm_90a; issue 23): the CTA of tiles.cu's schedule
// (128 rows m0 = 128 blockIdx.x, column tiles split, split + splits, ... of split = blockIdx.y,
// or NT-Xent's symmetric `tri` tiles) with a TMA producer and two consumer warpgroups, each
// consuming WHOLE 128 x 128 tiles through the epilogues of tile_epilogue.cuh:
//
//   * warpgroup 2 = producer (setmaxnreg.dec 24); thread 256 issues the TMA boxes (128 rows x
//     64 of K, 128-byte swizzled; rows and K past the ends zero-filled) into a ring of ST stages
//     with full / empty mbarriers.  A stage holds the A and B boxes of one K step, or (AR, A
//     resident) the B box alone after the CTA's KT A boxes, loaded once: half the L2 reads.
//     (The 16-bit operands; the split float32 ones: see Operands below.)
//   * warpgroups 0 / 1 = consumers (setmaxnreg.inc 240): consumer c takes the CTA's tiles
//     t = c, c + 2, ...: two wgmma m64n128k16 per k16 (rows 0-63 and 64-127, WsLayout), then the
//     tile's epilogue.  Named barriers 3 + c order the consumers' MMA phases (ping-pong: c waits
//     on 3 + c before its first MMA of a tile and arrives on 3 + (c ^ 1) once its last is
//     issued), so one consumer's epilogue overlaps the other's MMAs.
//   * mbarrier phases: full[c][s] completes one phase per fill of stage s for consumer c, so
//     each consumer tracks its own parity per stage (bit s of fph): with one full barrier per
//     stage a consumer running ahead could see a phase of the other's fill.  empty[s] completes
//     one phase per use of stage s (its owner's release once its MMAs on it are done).
//   * column tiles: B1's rows ct * 128 .. (ct < CT1 = ceil(n1 / 128)), then B2's from row 0, so
//     the columns of tile ct >= CT1 start at n1 + (ct - CT1) * 128 (with n1 % 128 != 0 the
//     last B1 tile ends at nlim = n1, not 128 columns later: each box comes from one matrix).
//     The epilogues number columns globally (positives, diagonal, lse_col) and stop at nlim:
//     the last B1 tile's columns past n1 (zero fill) carry the numbers of B2's first columns,
//     so none of them may count -- not even as a positive (pos_out).
//   * per consumer: its colv (column values of its tile, filled after the MMAs from loads
//     issued before them), LSE2 column scratch and SOUT staging (H: 16 KiB, else 1 KiB a
//     warp); epilogue
//     barriers are the consumer's named barrier 1 + c, the final row merge is barrier 5.
//
// Operands: the walk is templated on an operand policy (Ops) that says what a ring stage holds,
// what the producer loads into it and how a consumer runs a tile's MMAs on it: WsOps16<T>
// below for the 16-bit kernels (tiles_ws.cu), WsOpsTf32x3 for the split float32 ones
// (tiles_ws_tf32.cu).  Everything else -- the schedule, the ring's barriers, the ping-pong,
// the epilogues and the row merge -- is this file's, for both.
//
// Determinism: every order is fixed (tile t always on consumer t & 1; consumer 1's row values
// merged into consumer 0's in row_pairs).  Requirements (Python, tiles.ws_ok): those of the
// tiles, tensor maps encodable, n1 % 8 == 0 for the SOUT modes when B2 is given (16-byte
// chunks of g must not straddle n1), row coordinates + 128 < 2^31.
#pragma once
#include "include/tile_epilogue.cuh"

#define WS_THREADS 384
#define WS_MAX_STAGES 8
#define WS_A_BYTES (TBM * TBK * 2)      // 16 KiB: one A box
#define WS_B_BYTES (TBN * TBK * 2)      // 16 KiB: one B box
// staging per consumer (SOUT modes): a warpgroup's 64 x 128 block for H, 1 KiB a warp else
#define WS_SOUT_BYTES(MODE) ((MODE) == MODE_H ? 64 * TBN * 2 : 4 * WS_SOUT_WARP)
#define WS_PROD_REGS 24
#define WS_CONS_REGS 240
#define WS_STR2(x) #x
#define WS_STR(x) WS_STR2(x)

// the 16-bit kernels' one parameter (tiles.launch_blob packs it; the layout of tiles_ws_tf32.cu's
// WsTf32Launch, so one packing serves both): maps of A, B1 and B2 (B1's when there is none), a
// fourth map slot unused, the TileArgs at byte 512, the ring after it.  (CuPy's launch of one
// such 768-byte argument took ~13 us of host time, of six separate ones ~38: H100 host,
// 2026-11-27, the TF32 kernels.)
template <typename T> struct WsLaunch {
    TmaMap a, b1, b2, unused;
    TileArgs<T> p;
    int ring;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void ws_arrive_if(unsigned bar, bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n"
                 "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n"
                 :: "r"(bar), "r"((int)pred) : "memory");
}
// the two consumers' order barriers (256 threads: one warpgroup syncs, the other arrives)
__device__ __forceinline__ void ws_bar_sync(int id) {
    asm volatile("bar.sync %0, 256;\n" :: "r"(id) : "memory");
}
__device__ __forceinline__ void ws_bar_arrive(int id) {
    asm volatile("bar.arrive %0, 256;\n" :: "r"(id) : "memory");
}

// A consumer's view of the ring: its full barriers (fullc, stage s at + 8 s), the empty ones,
// the A-resident boxes (abase), the ring (rbase, SB bytes a stage, ST stages), whether A is
// resident and whether this thread releases stages (one per warpgroup).
struct WsRing {
    unsigned fullc, empty0, abase, rbase, SB;
    int ST;
    bool AR, leader;
    int stride;  // ring stages between this consumer's K steps (2: MODE_MM interleaved)
};

// The 16-bit operands: a stage holds the A and B boxes of one K step of TBK = 64 (or, A
// resident, the B box alone); a tile is two wgmma m64n128k16 per k16 into acc, one K step's
// batch kept in flight while the next is issued.
template <typename T> struct WsOps16 {
    enum { KSTEP = TBK, AR_OK = 1, K_SPLIT = 0 };
    typedef const TmaMap* BSrc;  // the tile's B map (B1 or B2)
    const TmaMap *ta, *tb1, *tb2;
    static __device__ __forceinline__ unsigned stage_bytes(bool ar) {
        return ar ? WS_B_BYTES : WS_A_BYTES + WS_B_BYTES;
    }
    // the bytes the TMA writes into a stage (all of it)
    static __device__ __forceinline__ unsigned tx_bytes(bool ar) { return stage_bytes(ar); }
    __device__ __forceinline__ BSrc b_src(bool first) const { return first ? tb1 : tb2; }
    // A box kt of the CTA's rows (A resident)
    __device__ __forceinline__ void load_a(unsigned dst, int kt, int m0, unsigned bar) const {
        tma_load(dst, ta, kt * TBK, m0, bar);
    }
    // the stage at `a` for K step kt of the tile whose B rows start at brow
    __device__ __forceinline__ void load_stage(unsigned a, bool ar, int kt, int m0, BSrc tb,
                                               int brow, unsigned bar) const {
        if (!ar) tma_load(a, ta, kt * TBK, m0, bar);
        tma_load(ar ? a : a + WS_A_BYTES, tb, kt * TBK, brow, bar);
    }
    // The tile's MMAs over KT K steps from ring stage s on (s, fph advanced; every stage it
    // read released); issued() once its last MMAs are issued; acc complete on return.
    template <typename Issued>
    __device__ __forceinline__ void mma_tile(float (&acc)[2][16][4], const WsRing& r, int KT,
                                             int& s, unsigned& fph, Issued issued) const {
        // K step kt on stage s (asynchronous); returns the stage, advances s
        auto step = [&](int kt, bool first) {
            mbar_wait(r.fullc + 8 * s, (fph >> s) & 1u);
            fph ^= 1u << s;
            const unsigned a = r.AR ? r.abase + kt * WS_A_BYTES : r.rbase + s * r.SB;
            const unsigned b = r.AR ? r.rbase + s * r.SB : a + WS_A_BYTES;
            const unsigned long long da0 = wg_desc(a), da1 = wg_desc(a + 64 * 128),
                                     db = wg_desc(b);
            float* d0 = &acc[0][0][0];
            float* d1 = &acc[1][0][0];
#pragma unroll
            for (int q = 0; q < 64; ++q) { fence_operand(d0[q]); fence_operand(d1[q]); }
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < TBK / 16; ++kk) {  // +32 B per k16 = +2 in the descriptor
                Wgmma<T>::run(d0, da0 + 2 * kk, db + 2 * kk, (first && kk == 0) ? 0 : 1);
                Wgmma<T>::run(d1, da1 + 2 * kk, db + 2 * kk, (first && kk == 0) ? 0 : 1);
            }
            wg_commit();
            const int cur = s;
            if (++s == r.ST) s = 0;
            return cur;
        };
        // the first step peeled: no branch between the wgmma batches
        int prev = step(0, true);
        for (int kt = 1; kt < KT; ++kt) {
            const int cur = step(kt, false);
            wg_wait1();  // the previous step's MMAs are done reading its stage
            ws_arrive_if(r.empty0 + 8 * prev, r.leader);
            prev = cur;
        }
        issued();
        wg_wait0();
        {
            float* d0 = &acc[0][0][0];
            float* d1 = &acc[1][0][0];
#pragma unroll
            for (int q = 0; q < 64; ++q) { fence_operand(d0[q]); fence_operand(d1[q]); }
        }
        ws_arrive_if(r.empty0 + 8 * prev, r.leader);
    }
    // (MODE_MM: the 16-bit kernels have none; for the walk to compile; defined below)
    template <typename L, typename P>
    __device__ __forceinline__ void mm_store(const P& p, const float (&acc)[2][16][4], int m0,
                                             int n0, int nlim, int warp, int lane) const;
};

// The promoted chunk of the split-operand policies (WsOpsTf32x3, WsOpsF16x3), once its MMAs
// for half h of the tile on ring stage s are committed: wait for them, release the stage
// after its second half, and add the chunk to the fp32 sum acc[h] (round to nearest).
__device__ __forceinline__ void ws_promote(float (&acc)[2][16][4], float (&ch)[64],
                                           const WsRing& r, int s, int h) {
    wg_wait0();
#pragma unroll
    for (int q = 0; q < 64; ++q) fence_operand(ch[q]);
    if (h == 1) ws_arrive_if(r.empty0 + 8 * s, r.leader);  // the stage is read
    float* d = &acc[h][0][0];
#pragma unroll
    for (int q = 0; q < 64; ++q) d[q] += ch[q];  // round to nearest
}

// The 128 x 128 product tile times alpha into the float32 rows of g (leading dimension ldg),
// rows < rows and columns < nlim (MODE_MM's epilogue, alpha = p.scale_mul; the float32 LSE2
// pass's raw scores, alpha = 1); a quad's float2 stores cover 32 contiguous bytes (whole
// sectors).  comp: the products scaled by 1 + comp (MODE_MM: CPN_TF32X3_TRUNC,
// tile_epilogue.cuh's compensation of the tiles' mean truncation loss), alpha acc +
// (alpha comp) acc in one FMA; the LSE2 pass's raw scores are stored as they are (comp 0:
// cpn_tf32x3_h_from_s then scales them as the epilogue did, the same bits).  accumulate: g = that
// + g (MODE_MM with p.tri set: a product summed over row blocks, each element read and
// written by one thread).  mirror: also the transposed
// tile, g[col][row] (NT-Xent's symmetric schedule: 8 lanes' rows make a 32-byte run of a
// mirrored row).
template <typename L>
__device__ __forceinline__ void ws_tile_store(float* g, i64 ldg, int rows, float alpha,
                                              const float (&acc)[2][16][4], int m0, int n0,
                                              int nlim, bool mirror, int warp, int lane,
                                              float comp, bool accumulate = false) {
    const int gq = lane >> 2, cq = lane & 3;
    const float ac = alpha * comp;
#pragma unroll
    for (int i = 0; i < L::I; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int lr = m0 + L::row_base(warp) + i * L::IS + h * 8 + gq;
            if (lr >= rows) continue;
            float* const o = g + (i64)lr * ldg;
#pragma unroll
            for (int j = 0; j < L::J; ++j) {
                const int col = n0 + j * 8 + 2 * cq;
                float v0 = alpha * acc[i][j][h * 2], v1 = alpha * acc[i][j][h * 2 + 1];
                if (comp != 0.f) {  // (not fmaf(x, 0, y) for comp = 0: inf * 0)
                    v0 = fmaf(acc[i][j][h * 2], ac, v0);
                    v1 = fmaf(acc[i][j][h * 2 + 1], ac, v1);
                }
                if (col + 1 < nlim) {
                    if (accumulate) {
                        const float2 o2 = *(const float2*)(o + col);
                        v0 += o2.x;
                        v1 += o2.y;
                    }
                    *(float2*)(o + col) = make_float2(v0, v1);
                } else if (col < nlim) {
                    o[col] = accumulate ? v0 + o[col] : v0;
                }
                if (mirror) {
                    if (col < nlim) g[(i64)col * ldg + lr] = v0;
                    if (col + 1 < nlim) g[(i64)(col + 1) * ldg + lr] = v1;
                }
            }
        }
}

// MODE_MM's store of the TF32x3 tiles (tiles_ws_tf32.cu): g = alpha acc (+ g), the mean
// truncation loss compensated (CPN_TF32X3_TRUNC); WsOps16 and WsOpsTf32x3's mm_store.
template <typename L, typename P>
__device__ __forceinline__ void ws_mm_store(const P& p, const float (&acc)[2][16][4], int m0,
                                            int n0, int nlim, int warp, int lane) {
    // (grid z > 1: the K split's partial, into slice z of p.g -- the host passes tri = 0)
    ws_tile_store<L>((float*)p.g + (i64)blockIdx.z * p.part_ld, p.ldg, p.rows, p.scale_mul, acc,
                     m0, n0, nlim, false, warp, lane, (float)CPN_TF32X3_TRUNC, p.tri != 0);
}

template <typename T>
template <typename L, typename P>
__device__ __forceinline__ void WsOps16<T>::mm_store(const P& p, const float (&acc)[2][16][4],
                                                     int m0, int n0, int nlim, int warp,
                                                     int lane) const {
    ws_mm_store<L>(p, acc, m0, n0, nlim, warp, lane);
}

// One CTA.  ring: ST (stages, <= WS_MAX_STAGES) | AR << 8 | IL << 9 (MODE_MM); the dynamic shared memory is
// 1 KiB (alignment) + AR ? KT x 16 KiB : 0 + ST x stage + SOUT ? 2 WS_SOUT_BYTES : 0, the staging
// last (SIGLIP without g, the loss alone, never touches it: not reserved); a stage is
// Ops::stage_bytes(AR) (16-bit: AR ? 16 : 32 KiB; the TMA fills Ops::tx_bytes(AR) of it),
// KT = ceil(d / Ops::KSTEP).
template <typename T, int MODE, bool PP, typename Ops, bool LAB = false>
__device__ __forceinline__ void tile_ws_walk(const Ops& ops, const TileArgs<T>& p, int ring) {
    typedef WsLayout L;
    enum { I = L::I, J = L::J, NCG = L::NCG,
           NCV = MODE == MODE_LSE2 ? 1 : (MODE == MODE_H || MODE == MODE_CLIP)
                                            ? (sizeof(T) == 4 ? 4 : 3) : 0 };
    extern __shared__ __align__(1024) unsigned char ws_smem[];
    // full[c][s] at [c * WS_MAX_STAGES + s], empty[s] at [2 WS_MAX_STAGES + s], A's at the end
    __shared__ __align__(8) unsigned long long bars[3 * WS_MAX_STAGES + 1];
    __shared__ float slot[3][TBM];  // consumer 1's row values for the final merge
    // per consumer and own-tile parity: the tile's column values (NCV of colv_values')
    __shared__ float colv[2][2][NCV ? NCV : 1][TBN];
    __shared__ float red[MODE == MODE_LSE2 ? 2 : 1][2][NCG][TBN];  // per consumer (LSE2)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int m0 = blockIdx.x * TBM;
    const int n1 = p.n1, ncols = p.n1 + p.n2;
    const int CT1 = (n1 + TBN - 1) / TBN, CT = CT1 + (p.n2 + TBN - 1) / TBN;
    const bool TRI = (MODE == MODE_LSE2 || MODE == MODE_H) && p.tri;
    const int tri_i = m0 / TBM;
    const int split = blockIdx.y, splits = gridDim.y;
    const int ntiles = TRI ? tri_count(tri_i, CT) : CT;
    const int my_tiles = ntiles > split ? (ntiles - split + splits - 1) / splits : 0;
    // column tile of the CTA's tile t, and its first column
    auto tile_ct = [&](int t) {
        const int ct = split + t * splits;
        return TRI ? (tri_i + ct) % CT : ct;
    };
    auto tile_n0 = [&](int ct) { return ct < CT1 ? ct * TBN : n1 + (ct - CT1) * TBN; };
    const int KTA = (p.d + Ops::KSTEP - 1) / Ops::KSTEP;  // K steps in all
    // MODE_MM split over K (grid z > 1: tf32x3.mm's K splits, policies with K_SPLIT): this
    // CTA's K steps are kt0 .. kt0 + KT - 1 of KTA, its tile the partial product into its own
    // slice of p.g (z p.part_ld floats on: ws_mm_store), summed in z order by
    // cpn_mm_sum_splits_f32.  The host keeps gridDim.z <= KTA; a CTA without a K step would
    // never signal `issued` (a hang), so it traps instead.  Every other mode and policy, and
    // z = 1: all of K (kt0 = 0, KT = KTA).
    const bool KS = MODE == MODE_MM && Ops::K_SPLIT;
    const int kz = KS ? (int)blockIdx.z : 0;
    const int kzs = KS ? (int)gridDim.z : 1;
    const int kt0 = (int)((long long)KTA * kz / kzs);
    const int KT = (int)((long long)KTA * (kz + 1) / kzs) - kt0;
    if (KS && KT <= 0) __trap();
    const int ST = ring & 0xff;
    const bool AR = Ops::AR_OK && ((ring >> 8) & 1);
    // IL (MODE_MM, ring bit 9): the two consumers' tiles t, t + 1 interleaved in the ring a
    // K step each, both on the tensor cores at once (no ping-pong), so that one consumer's
    // waits for its chunk accumulator (tiles_ws_tf32.cu) hide under the other's MMAs
    const bool IL = MODE == MODE_MM && ((ring >> 9) & 1);
    const unsigned SB = Ops::stage_bytes(AR);  // a ring stage
    const unsigned abase = (sw_smem(ws_smem) + 1023u) & ~1023u;  // swizzle atoms: 1 KiB
    const unsigned rbase = AR ? abase + KTA * WS_A_BYTES : abase;  // the ring
    const unsigned full0 = sw_smem(&bars[0]), empty0 = sw_smem(&bars[2 * WS_MAX_STAGES]);
    const unsigned abar = sw_smem(&bars[3 * WS_MAX_STAGES]);
    if (tid == 0) {
        for (int s = 0; s < ST; ++s) {
            mbar_init(full0 + 8 * s, 1);                      // consumer 0's: expect_tx
            mbar_init(full0 + 8 * (WS_MAX_STAGES + s), 1);    // consumer 1's
            mbar_init(empty0 + 8 * s, 1);                     // the owner's release
        }
        mbar_init(abar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // (the last CTA-wide barrier: the producer warps exit early)

    if (tid >= 256) {  // ---------------- producer warpgroup ----------------
        asm volatile("setmaxnreg.dec.sync.aligned.u32 " WS_STR(WS_PROD_REGS) ";\n" ::: "memory");
        if (tid == 256) {
            if (AR && my_tiles > 0) {  // the CTA's 128 rows of A, once (one phase, parity 0)
                mbar_expect_tx(abar, KT * WS_A_BYTES);
                for (int kt = 0; kt < KT; ++kt)
                    ops.load_a(abase + kt * WS_A_BYTES, kt0 + kt, m0, abar);
            }
            int s = 0;
            unsigned ph = 0;  // parity of the current use of stage s
            // stage s for K step kt of tile t (its consumer's full barrier)
            auto fill = [&](int t, int kt) {
                const int ct = tile_ct(t);
                const typename Ops::BSrc tb = ops.b_src(ct < CT1);
                const int brow = ct < CT1 ? ct * TBN : (ct - CT1) * TBN;
                const unsigned fullc = full0 + 8 * ((t & 1) * WS_MAX_STAGES);
                mbar_wait(empty0 + 8 * s, ph ^ 1);  // use u - 1 released (u = 0: passes)
                const unsigned a = rbase + s * SB;
                mbar_expect_tx(fullc + 8 * s, Ops::tx_bytes(AR));
                ops.load_stage(a, AR, kt0 + kt, m0, tb, brow, fullc + 8 * s);
                if (++s == ST) { s = 0; ph ^= 1; }
            };
            if (IL) {  // tiles t, t + 1 (both consumers) a K step each in turn
                for (int t = 0; t < my_tiles; t += 2)
                    for (int kt = 0; kt < KT; ++kt) {
                        fill(t, kt);
                        if (t + 1 < my_tiles) fill(t + 1, kt);
                    }
            } else {
                for (int t = 0; t < my_tiles; ++t) {
                    const int ct = tile_ct(t);
                    const typename Ops::BSrc tb = ops.b_src(ct < CT1);
                    const int brow = ct < CT1 ? ct * TBN : (ct - CT1) * TBN;
                    const unsigned fullc = full0 + 8 * ((t & 1) * WS_MAX_STAGES);
                    for (int kt = 0; kt < KT; ++kt) {
                        mbar_wait(empty0 + 8 * s, ph ^ 1);  // use u - 1 released (u = 0: passes)
                        const unsigned a = rbase + s * SB;
                        mbar_expect_tx(fullc + 8 * s, Ops::tx_bytes(AR));
                        ops.load_stage(a, AR, kt0 + kt, m0, tb, brow, fullc + 8 * s);
                        if (++s == ST) { s = 0; ph ^= 1; }
                    }
                }
            }
        }
        return;
    }
    // ---------------- consumer warpgroups ----------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 " WS_STR(WS_CONS_REGS) ";\n" ::: "memory");
    const int c = warp >> 2, lt = tid & 127, gq = lane >> 2;
    const EpiCtx<T> ep = epi_ctx<T, MODE, LAB>(p.g, p.ldg, p.part_m, p.part_s, p.part_ld, p.pos_out,
        p.colp_m, p.colp_s, p.dsp_part, p.rows, p.row0, ncols, m0, split, p.exclude_diag,
        p.scale_mul, p.scale_log, p.lse_col, p.w_mul, p.tri, p.lab_r, p.lab_c);
    RowState<I> rs;
    rows_init<T, MODE, L>(rs, ep, p.lse_row, p.w_ptr, p.w_stride, p.pos_shift, p.pos_mod, warp, gq);
    char* const sout = (char*)ws_smem + (rbase + ST * SB - sw_smem(ws_smem)) + c * WS_SOUT_BYTES(MODE);
    WsRing rg;
    rg.fullc = full0 + 8 * (c * WS_MAX_STAGES);
    rg.empty0 = empty0; rg.abase = abase; rg.rbase = rbase; rg.SB = SB; rg.ST = ST;
    rg.AR = AR;
    rg.leader = lt == 0;  // one release per warpgroup
    rg.stride = 1;
    float acc[I][J][4];
    unsigned fph = 0;  // bit s: parity of this consumer's next use of stage s
    int s = 0;
    if (AR && c < my_tiles) mbar_wait(abar, 0);  // A resident (completes once)
    const bool pp = PP && !IL;
    if (pp && c == 1 && my_tiles > 0) ws_bar_arrive(3);  // consumer 0 goes first
    for (int t = c, k = 0; t < my_tiles; t += 2, ++k) {
        const int ct = tile_ct(t);
        const int n0 = tile_n0(ct), nlim = ct < CT1 ? n1 : ncols;
        ColRaw raw;
        if (NCV)  // (in flight)
            raw = colv_load<sizeof(T) == 4 && MODE == MODE_H>(n0 + lt, nlim, p.lse_col, p.w_ptr,
                                                              p.w_stride);
        s = (t * KT) % ST;  // this tile's first stage (iteration t KT of the ring)
        if (IL && (c == 1 || t + 1 < my_tiles)) {  // a pair: K steps alternate in the ring
            s = ((t - c) * KT + c) % ST;
            rg.stride = 2;
        } else if (IL) {
            rg.stride = 1;  // (a last tile alone)
        }
        if (pp) ws_bar_sync(3 + c);  // my turn on the tensor cores
        ops.mma_tile(acc, rg, KT, s, fph, [&] {
            if (pp && t + 1 < my_tiles) ws_bar_arrive(3 + (c ^ 1));  // the other's turn
        });
        if (MODE == MODE_MM) {  // a product tile: the policy's store (ws_mm_store below)
            ops.template mm_store<L>(p, acc, m0, n0, nlim, warp, lane);
            continue;
        }
        // float32 LSE2 with g (tiles_ws_tf32.cu, whole matrix: row0 = 0): the raw scores
        // too, each tile and its mirror, for the gradient pass that follows
        if (MODE == MODE_LSE2 && sizeof(T) == 4 && p.g)
            ws_tile_store<L>((float*)p.g, p.ldg, p.rows, 1.f, acc, m0, n0, nlim,
                             TRI && n0 != m0, warp, lane, 0.f);
        if (NCV) {  // the tile's column values, read by its epilogue
            float v[4];
            colv_values<MODE, sizeof(T) == 4>(v, raw, p.w_mul, ep.sl2);
#pragma unroll
            for (int q = 0; q < NCV; ++q) colv[c][k & 1][q][lt] = v[q];
            wg_bar(c);  // (the other parity's readers passed this barrier a tile ago)
        }
        tile_epilogue<T, MODE, L>(ep, rs, acc, n0, nlim, colv[c][k & 1],
                                  red[MODE == MODE_LSE2 ? c : 0], sout, warp, lane, lt);
    }
    if (MODE == MODE_LSE || MODE == MODE_LSE2 || MODE == MODE_CLIP || MODE == MODE_SIGLIP) {
        float* const slots[3] = {slot[0], slot[1], slot[2]};
        rows_finish<T, MODE, L>(ep, rs, slots, warp, lane);
    }
}
// the 16-bit kernels (tiles_ws.cu): maps of A, B1 and B2
template <typename T, int MODE, bool PP, bool LAB = false>
__device__ __forceinline__ void tile_ws(const TmaMap& ta, const TmaMap& tb1, const TmaMap& tb2,
                                        const TileArgs<T>& p, int ring) {
    WsOps16<T> ops;
    ops.ta = &ta; ops.tb1 = &tb1; ops.tb2 = &tb2;
    tile_ws_walk<T, MODE, PP, WsOps16<T>, LAB>(ops, p, ring);
}
#define CPN_WS_BODY(T, MODE) tile_ws<T, MODE, true>(L.a, L.b1, L.b2, L.p, L.ring)
// (the `_lab` kernels: CLIP's labels, epi_ctx)
#define CPN_WS_BODY_LAB(T, MODE) tile_ws<T, MODE, true, true>(L.a, L.b1, L.b2, L.p, L.ring)
#else
#define CPN_WS_BODY(T, MODE) __trap()  // not an sm_90a build: Python never launches these
#define CPN_WS_BODY_LAB(T, MODE) __trap()
#endif
