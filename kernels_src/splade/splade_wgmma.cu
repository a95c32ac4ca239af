// cupynce SPLADE forward on Hopper (sm_90a): the max over the sequence in the epilogue of a
// warp-specialised TMA + wgmma product.  Same result as tiles.cu MODE_SPMAX (and as the
// cuBLAS path of splade.cu): out[b, v] = act(max over unmasked l of round_T(x[b, l] . W[v]
// + bias[v])), the first arg-max, NaN when a NaN logit is seen; the (B, L, V) logits never
// exist.  What differs is the main loop:
//
//   * one CTA = 2 consumer warpgroups (warps 0-7) and a producer warp (warp 8).  One thread
//     of the producer issues the tensor-memory-accelerator (TMA) loads of each K step (W:
//     128 rows x 64; x: 256 positions x 64, as two 128-position halves, one per CTA of the
//     cluster, see below; 128-byte swizzled by the TMA unit) into a 4-stage ring.  The
//     consumers run wgmma m64n256k16 on rows 0-63 / 64-127 of the 128 x 256 tile, then the
//     max epilogue.  Stages are handed over by mbarriers (full: the TMA's byte count; empty:
//     one arrival per consumer warpgroup of each CTA once its MMAs on the stage are done).
//   * 128 x 256 tiles: 85 FLOP per byte read from L2 instead of 64 for 128 x 128 (the tile
//     kernels of tiles.cu run at the L2's read bandwidth), and no load instructions in the
//     consumers (cp.async took a third of their issue slots).
//   * clusters of 2 CTAs on adjacent vocabulary tiles of the same batches: each loads its own
//     W box and one half (128 positions) of the shared x box, multicast into both CTAs'
//     shared memory, so L2 delivers 32 KiB per CTA and K step instead of 48.  A stage is
//     refilled only when the consumers of both CTAs have released it (the empty barriers take
//     4 arrivals, two of them remote), and no CTA exits before its peer is done with it.
//   * 288 threads leave 224 registers per thread (128 fp32 accumulators per consumer
//     thread); with a whole producer warpgroup (384 threads, 168 registers) ptxas serialises
//     the wgmma pipeline for want of registers, and this needs no setmaxnreg.
//
// The tensor maps (CUtensorMap, 128 opaque bytes) are encoded on the host by the driver
// (cupynce/_engine/tma.py) and passed by value as __grid_constant__ parameters.  W is (V, D) with
// rows `ldw` apart, x is (B L, D); out-of-range rows and K columns are zero-filled by the
// TMA unit; positions of the next batch inside a tile (L not a multiple of 256) are loaded
// and skipped by the epilogue's position flags.
//
// Schedule: a 1-D grid over (batch group, vocabulary tile) in groups of `group` batch
// groups, as tiles.cu MODE_SPMAX: each CTA owns 128 vocabulary rows and `per_cta` batches,
// and walks their (batch, position tile) tiles in order, so the max over a batch's sequence
// stays in registers.  Determinism: fixed per-thread order over positions, a fixed xor
// shuffle merge of the 4 lanes of a row; no atomics.
// Requirements (checked in Python): 16-bit dtype, D and ldw multiples of 8 elements,
// 16-byte aligned pointers, compute capability 9.0 (the loader builds this file for sm_90a),
// B L + 256 < 2^31 (x's TMA row coordinate is a 32-bit int; tiles.cu takes larger inputs).
// cpn-dtypes: f16 bf16
#include "include/common.cuh"
#include "splade/splade_common.cuh"
#include "include/wgmma.cuh"

#define SW_BM 128      // vocabulary rows per CTA (2 consumer warpgroups x 64)
#define SW_BN 256      // positions per tile
#define SW_BK 64       // K per stage: 128-byte rows, the span of the 128-byte swizzle
#define SW_STAGES 4
#define SW_A_BYTES (SW_BM * SW_BK * 2)
#define SW_B_BYTES (SW_BN * SW_BK * 2)
#define SW_STAGE_BYTES (SW_A_BYTES + SW_B_BYTES)
#define SW_SMEM_BYTES (SW_STAGES * SW_STAGE_BYTES + 1024)  // + 1 KiB to align the stages
#define SW_THREADS 288  // 8 consumer warps + 1 producer warp
#define SW_CLUSTER 2    // CTAs per cluster (the x box is multicast to both)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// D (64 x 256, fp32) (+)= A (64 x 16) B^T (16 x 256); scale_d = 0 starts a new tile
#define SW_WGMMA_ASM(TY)                                                                    \
    asm volatile(                                                                           \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                     \
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {"                     \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"                                             \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
        : "l"(da), "l"(db), "r"(scale_d))
template <typename T> struct Wgmma256;
template <> struct Wgmma256<bf16_t> {
    static __device__ __forceinline__ void run(float* d, unsigned long long da,
                                               unsigned long long db, int scale_d) {
        SW_WGMMA_ASM("bf16");
    }
};
template <> struct Wgmma256<f16_t> {
    static __device__ __forceinline__ void run(float* d, unsigned long long da,
                                               unsigned long long db, int scale_d) {
        SW_WGMMA_ASM("f16");
    }
};

template <typename T, typename IX>
__device__ __forceinline__ void spmax_ws(
    const TmaMap& tw, const TmaMap& tx, int V, int L, int D,
    const unsigned char* __restrict__ mask, const T* __restrict__ bias, int act,
    T* __restrict__ out, IX* __restrict__ arg, int batches, int per_cta, int group)
{
    extern __shared__ __align__(1024) unsigned char sw_smem_raw[];
    __shared__ __align__(8) unsigned long long bars[2 * SW_STAGES];  // full[s], empty[s]
    // per tile parity: bit i of word k is set where position 32 k + i of the tile counts
    __shared__ unsigned onbits[2][SW_BN / 32];

    const int tid = threadIdx.x;
    // (batch group, pair of vocabulary tiles) of this cluster: Triton's grouped ordering
    // (tiles.cu); the CTA of rank `rank` takes the pair's tile `rank` (the second tile of the
    // last pair may lie past V: it loads zeros and writes nothing, but shares the x loads)
    const int rank = blockIdx.x % SW_CLUSTER, cid = blockIdx.x / SW_CLUSTER;
    const int LT = (L + SW_BN - 1) / SW_BN;
    const int ngroups = (batches + per_cta - 1) / per_cta;
    const int vpairs = (V + SW_CLUSTER * SW_BM - 1) / (SW_CLUSTER * SW_BM);
    const int span = group * vpairs, first = (cid / span) * group;
    const int gsz = min(ngroups - first, group), rr = cid % span;
    const int grp = first + rr % gsz, v0 = ((rr / gsz) * SW_CLUSTER + rank) * SW_BM;
    const int sb0 = grp * per_cta, sb1 = min(batches, sb0 + per_cta);
    const int ntiles = (sb1 - sb0) * LT;
    const int KT = (D + SW_BK - 1) / SW_BK;
    const unsigned base = (sw_smem(sw_smem_raw) + 1023u) & ~1023u;  // swizzle atoms: 1 KiB
    const unsigned full0 = sw_smem(&bars[0]), empty0 = sw_smem(&bars[SW_STAGES]);
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < SW_STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);  // the producer's arrive.expect_tx (+ TMA bytes)
            mbar_init(empty0 + 8 * s, 2 * SW_CLUSTER);  // each consumer warpgroup of each CTA
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_sync();  // the peer's barriers are initialised before any multicast or arrival

    if (tid >= 256) {  // ---------------- producer warp ----------------
        if (tid == 256) {
            int it = 0;
            for (int t = 0; t < ntiles; ++t) {
                const int row = (sb0 + t / LT) * L + (t % LT) * SW_BN;  // first row of x
                for (int kt = 0; kt < KT; ++kt, ++it) {
                    const int s = it % SW_STAGES;
                    mbar_wait(empty0 + 8 * s, ((it / SW_STAGES) & 1) ^ 1);
                    const unsigned a = base + s * SW_STAGE_BYTES;
                    // its W box, and its half of the x box into both CTAs; the stage's bytes
                    // arrive from both producers
                    mbar_expect_tx(full0 + 8 * s, SW_STAGE_BYTES);
                    tma_load(a, &tw, kt * SW_BK, v0, full0 + 8 * s);
                    tma_load_multicast(a + SW_A_BYTES + rank * (SW_B_BYTES / SW_CLUSTER), &tx,
                                       kt * SW_BK, row + rank * (SW_BN / SW_CLUSTER),
                                       full0 + 8 * s, (1u << SW_CLUSTER) - 1);
                }
            }
        }
        cluster_sync();  // stay until the peer's consumers have made their last arrivals here
        return;
    }

    // ---------------- consumer warpgroups ----------------
    const int c = tid >> 7;  // rows c * 64 .. c * 64 + 63 of the tile
    const int ct = tid;      // 0 .. 255 over both consumers
    const int lane = tid & 31, warp = (tid >> 5) & 3, gq = lane >> 2, cq = lane & 3;
    const float ninf = -cpn_inf<float>();
    // this thread's rows: v0 + c * 64 + warp * 16 + h * 8 + gq (h = 0, 1); its columns of a
    // tile: j * 8 + 2 * cq + e (j < 32, e < 2), in acc[j * 4 + h * 2 + e]
    int vrow[2];
    float rm[2], bv[2];  // bv: the row's bias, added to each fp32 logit before its rounding
    int win[2];
    bool nanr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        vrow[h] = v0 + c * 64 + warp * 16 + h * 8 + gq;
        bv[h] = bias && vrow[h] < V ? Conv<T>::load(bias[vrow[h]]) : 0.f;
        rm[h] = ninf; win[h] = -1; nanr[h] = false;
    }
    float acc[128];
    int it = 0;
    for (int t = 0; t < ntiles; ++t) {
        const int b = sb0 + t / LT, p0 = (t % LT) * SW_BN;
        {  // position flags of this tile (read after the named barrier below)
            const int p = p0 + ct;
            const unsigned word = __ballot_sync(0xffffffffu, p < L && (!mask || mask[(i64)b * L + p]));
            if (lane == 0) onbits[t & 1][ct >> 5] = word;
        }
        // stage s goes back to both producers: one thread per consumer warpgroup arrives on
        // the empty barrier of each CTA (predicated: a divergent path between the wgmma
        // batches makes ptxas serialise them)
        auto release = [&](int s) {
#pragma unroll
            for (int r = 0; r < SW_CLUSTER; ++r) mbar_arrive_remote_if(empty0 + 8 * s, r, (ct & 127) == 0);
        };
        // one K step on the next stage (asynchronous); its stage index
        auto step = [&](bool first) {
            const int s = it % SW_STAGES;
            mbar_wait(full0 + 8 * s, (it / SW_STAGES) & 1);
            const unsigned a = base + s * SW_STAGE_BYTES;
            const unsigned long long da = wg_desc(a + c * 64 * 128), db = wg_desc(a + SW_A_BYTES);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < SW_BK / 16; ++kk)  // +32 B per K step = +2 in the descriptor
                Wgmma256<T>::run(acc, da + 2 * kk, db + 2 * kk, (first && kk == 0) ? 0 : 1);
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            ++it;
            return s;
        };
        // the first step peeled off: no branch between the wgmma batches (ptxas serialises
        // them across a divergent path)
        int prev = step(true);
        for (int kt = 1; kt < KT; ++kt) {
            const int s = step(false);
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            release(prev);  // the previous step's stage
            prev = s;
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
        for (int r = 0; r < 128; ++r) fence_operand(acc[r]);
        release(prev);
        asm volatile("bar.sync 1, 256;\n" ::: "memory");  // both consumers: flags written

        // running (max, arg-max, NaN) of each row over the positions, in increasing position:
        // strict > keeps the first; each logit is the fp32 product plus the row's bias rounded
        // to T (spl_logit, as every path), two at a time (cvt to T x 2); positions that do
        // not count become -inf (never > the
        // running max, which starts at -inf; a row of -inf only gives arg -1: out 0); NaN seen
        // through a NaN-propagating packed max.  Tiles where every position counts skip the
        // mask (the same result, fewer instructions).
        unsigned bits[SW_BN / 32];  // this thread's columns j * 8 + 2 cq + e: bit (j & 3) * 8 + e
        bool full = true;
#pragma unroll
        for (int k = 0; k < SW_BN / 32; ++k) {
            const unsigned w = onbits[t & 1][k];
            full &= w == 0xffffffffu;
            bits[k] = w >> (2 * cq);
        }
        auto scan = [&](const bool masked) {  // inlined twice: masked is a constant in each
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float m = rm[h];
                int wl = -1;  // this tile's winner, j * 8 + e
                unsigned nanp = Pack2<T>::NEG_INF2;
#pragma unroll
                for (int j = 0; j < 32; ++j) {
                    unsigned pk = Pack2<T>::round(acc[j * 4 + h * 2] + bv[h],
                                                  acc[j * 4 + h * 2 + 1] + bv[h]);
                    if (masked) {
                        const unsigned bw = bits[j >> 2] >> ((j & 3) * 8);
                        pk = ((bw & 1u) ? pk : (pk & 0xffff0000u) | (Pack2<T>::NEG_INF2 & 0xffffu));
                        pk = ((bw & 2u) ? pk : (pk & 0xffffu) | (Pack2<T>::NEG_INF2 & 0xffff0000u));
                    }
                    nanp = Pack2<T>::max_nan(nanp, pk);
                    const float x0 = Pack2<T>::lo(pk), x1 = Pack2<T>::hi(pk);
                    bool gt = x0 > m;
                    m = gt ? x0 : m;
                    wl = gt ? j * 8 : wl;
                    gt = x1 > m;
                    m = gt ? x1 : m;
                    wl = gt ? j * 8 + 1 : wl;
                }
                rm[h] = m;
                if (wl >= 0) win[h] = p0 + 2 * cq + wl;
                nanr[h] |= Pack2<T>::any_nan(nanp);
            }
        };
        if (full) scan(false);
        else scan(true);
        if (t % LT == LT - 1) {  // the batch's last tile: merge the 4 lanes of a row, write
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int o = 1; o < 4; o <<= 1) {
                    const float om = __shfl_xor_sync(0xffffffffu, rm[h], o);
                    const int ow = __shfl_xor_sync(0xffffffffu, win[h], o);
                    nanr[h] |= __shfl_xor_sync(0xffffffffu, (int)nanr[h], o) != 0;
                    spl_merge(rm[h], win[h], om, ow);
                }
                if (cq == 0 && vrow[h] < V)
                    spl_write<T, IX, float>(rm[h], win[h], nanr[h], b, vrow[h], 0, V, act, out,
                                            arg);
                rm[h] = ninf; win[h] = -1; nanr[h] = false;
            }
        }
    }
    cluster_sync();  // the peer's last multicasts into this CTA and arrivals are done
}
#define SW_BODY(T, IX) spmax_ws<T, IX>(tw, tx, V, L, D, mask, bias, act, out, arg, batches, per_cta, group)
#define SW_CLUSTER_DIMS __cluster_dims__(SW_CLUSTER, 1, 1)
#else
#define SW_BODY(T, IX) __trap()  // not an sm_90a build: Python launches this only on Hopper
#define SW_CLUSTER_DIMS
#endif

// 1-D grid of 2 ceil(V / 256) x ceil(B / per_cta) CTAs (clusters of 2) of 288 threads,
// SW_SMEM_BYTES of dynamic shared memory; out (B, V); arg-max (B, V) int16 (i16) / int32 (i32)
#define SW_ARGS(T, IX)                                                                     \
    const __grid_constant__ TmaMap tw, const __grid_constant__ TmaMap tx, int V, int L,    \
    int D, const unsigned char* mask, const T* bias, int act, T* out, IX* arg,             \
    int batches, int per_cta, int group
#define CPN_DEFINE_SPMAX_WS(SUF, T)                                                        \
extern "C" __global__ void __launch_bounds__(SW_THREADS, 1) SW_CLUSTER_DIMS                \
cpn_spmax_ws_i16_##SUF(SW_ARGS(T, short)) { SW_BODY(T, short); }                           \
extern "C" __global__ void __launch_bounds__(SW_THREADS, 1) SW_CLUSTER_DIMS                \
cpn_spmax_ws_i32_##SUF(SW_ARGS(T, int)) { SW_BODY(T, int); }                               \
extern "C" __global__ void cpn_spmax_ws_smem_##SUF(int* out) { out[0] = SW_SMEM_BYTES; }

CPN_DEFINE_SPMAX_WS(f16, f16_t)
CPN_DEFINE_SPMAX_WS(bf16, bf16_t)
