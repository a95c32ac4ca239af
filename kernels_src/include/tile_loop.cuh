// cupynce tensor-core tile loop: the shared main loops of tiles.cu and splade_tiles.cu.
//
// `TileLoop<T, WG>` computes one 128 x 128 tile S = A B^T of float16 / bfloat16 operands into
// fp32 registers, operands staged in shared memory by a cp.async pipeline:
//
//   WG = false   mma.sync m16n8k16 (sm_80+): 8 warps of 32 x 64, ldmatrix fragments from a
//                padded shared layout
//   WG = true    wgmma m64n128k16 (sm_90a, Hopper): 2 warpgroups of 64 x 128, operands read
//                by the tensor cores straight from 128-byte-swizzled shared memory; built only
//                when the loader compiles the including file for sm_90a (__trap() otherwise)
//
// Also the tile geometry (TBM, TBN, TBK, stages, shared-memory sizes), the epilogue modes and
// the PTX helpers (cp.async, ldmatrix, stmatrix, wgmma fences) the epilogues use.
#pragma once
#include "include/common.cuh"
#include "include/wgmma.cuh"

#define TBM 128
#define TBN 128
#define TBK 64
#define TLD 72  // shared row stride in 16-bit elements (144 B): conflict-free ldmatrix rows
#define TSTAGES 3
#define TTHREADS 256
// dynamic shared memory of one CTA: TSTAGES x (A tile + B tile); Python reads these values
// from cpn_tile_smem_<dtype> below and opts the kernels in above 48 KiB
#define TSMEM_BYTES (TSTAGES * (TBM + TBN) * TLD * 2)
// wgmma: TBK = 64 16-bit values = one 128-byte swizzle row; stages 1024-byte aligned
#define WSTAGES 6
#define WSTAGE_BYTES ((TBM + TBN) * TBK * 2)
#define WSMEM_BYTES (WSTAGES * WSTAGE_BYTES + 1024)

#define MODE_LSE 0
#define MODE_LSE2 1
#define MODE_G 2
#define MODE_H 3
#define MODE_CLIP 4
#define MODE_SPMAX 5
#define MODE_SIGLIP 6
#define MODE_MM 7      // the TF32x3 product tiles (tiles_ws_tf32.cu): out = alpha A B^T, no softmax

#define CPN_LOG2E 1.4426950408889634f
#define CPN_LOG2E_LO 1.925963e-8f  // log2(e) - (float)CPN_LOG2E
#define CPN_LN2 0.6931471805599453f

template <typename T> struct Mma;
template <> struct Mma<bf16_t> {
    static __device__ __forceinline__ void run(float* d, const unsigned* a, const unsigned* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
template <> struct Mma<f16_t> {
    static __device__ __forceinline__ void run(float* d, const unsigned* a, const unsigned* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
// 16-byte async copy; bytes = 0 zero-fills the destination (out-of-range rows / k).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// four 8x8 16-bit matrices from shared memory; lane l gives the address of row (l & 7) of
// matrix (l >> 3); register k receives matrix k in the mma fragment layout
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// (m, l) with l = sum 2^(x - m): fold in another such pair (NaN-propagating)
__device__ __forceinline__ void lse2_merge(float& m, float& l, float om, float ol) {
    const float ninf = -cpn_inf<float>();
    if (om != om || m != m) { m = cpn_nan<float>(); l = m; return; }
    if (om == ninf) return;
    if (m == ninf) { m = om; l = ol; return; }
    if (om > m) { l = l * exp2f(m - om) + ol; m = om; }
    else { l += ol * exp2f(om - m); }
}

// ---- Hopper warpgroup MMA (sm_90a; wg_desc and fence_operand in wgmma.cuh) ---------------
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CPN_SM90A_ASM(text) asm volatile(text ::: "memory")
#else
#define CPN_SM90A_ASM(text) __trap()  // not an sm_90a build: Python never launches these
#endif
__device__ __forceinline__ void wg_fence() { CPN_SM90A_ASM("wgmma.fence.sync.aligned;\n"); }
__device__ __forceinline__ void wg_commit() { CPN_SM90A_ASM("wgmma.commit_group.sync.aligned;\n"); }
__device__ __forceinline__ void wg_wait0() { CPN_SM90A_ASM("wgmma.wait_group.sync.aligned 0;\n"); }
__device__ __forceinline__ void wg_wait1() { CPN_SM90A_ASM("wgmma.wait_group.sync.aligned 1;\n"); }
// cp.async writes shared memory through the generic proxy, wgmma reads it through the async
// proxy: each thread fences its own completed copies before the CTA barrier
__device__ __forceinline__ void fence_proxy_async() {
    CPN_SM90A_ASM("fence.proxy.async.shared::cta;\n");
}
// Four 8 x 8 16-bit matrices from the mma fragment layout into shared memory (sm_90): lane l
// gives the address of row (l & 7) of matrix (l >> 3); TRANS stores each matrix transposed.
template <bool TRANS>
__device__ __forceinline__ void stmatrix_x4(unsigned addr, unsigned a, unsigned b, unsigned c,
                                            unsigned d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (TRANS)
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                     :: "r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
    else
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                     :: "r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
#else
    __trap();
#endif
}
// barrier of one warpgroup (128 threads); id 0 is __syncthreads'
__device__ __forceinline__ void wg_bar(int wg) {
    asm volatile("bar.sync %0, 128;\n" :: "r"(1 + wg) : "memory");
}

// one wgmma m64n128 with both operands from shared-memory descriptors: INSTR the shape and
// types ("m64n128k16.f32.bf16.bf16"), IMM the immediates after scale-d (16-bit types: scale-a,
// scale-b, transpose-a, transpose-b; tf32: scale-a, scale-b only, no transposes)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CPN_WGMMA_ASM_SS(INSTR, IMM)                                                       \
    asm volatile(                                                                          \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                       \
        "wgmma.mma_async.sync.aligned." INSTR " "                                          \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "          \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "\
        "%64, %65, p, " IMM ";\n}\n"                                                       \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),          \
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),        \
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),    \
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),    \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),    \
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),    \
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),    \
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),    \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),    \
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),    \
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                               \
        : "l"(da), "l"(db), "r"(scale_d))
#else
#define CPN_WGMMA_ASM_SS(INSTR, IMM) __trap()
#endif
#define CPN_WGMMA_ASM(TY) CPN_WGMMA_ASM_SS("m64n128k16.f32." TY "." TY, "1, 1, 0, 0")

// D (64 x 128, fp32) (+)= A (64 x 16) B^T (16 x 128); scale_d = 0 starts a new tile
template <typename T> struct Wgmma;
template <> struct Wgmma<bf16_t> {
    static __device__ __forceinline__ void run(float* d, unsigned long long da,
                                               unsigned long long db, int scale_d) {
        CPN_WGMMA_ASM("bf16");
    }
};
template <> struct Wgmma<f16_t> {
    static __device__ __forceinline__ void run(float* d, unsigned long long da,
                                               unsigned long long db, int scale_d) {
        CPN_WGMMA_ASM("f16");
    }
};
// D (64 x 128, fp32) (+)= A (64 x 8) B^T (8 x 128) of TF32 operands (float32 in shared memory,
// the tensor cores read the top 19 bits: sign, exponent, 10 mantissa bits), both K-major:
// a 128-byte swizzled row holds 32 of K, so the k8 steps advance the descriptors by 32 B
// (+2), as the 16-bit k16 steps do (tiles_ws_tf32.cu)
struct WgmmaTf32 {
    static __device__ __forceinline__ void run(float* d, unsigned long long da,
                                               unsigned long long db, int scale_d) {
        CPN_WGMMA_ASM_SS("m64n128k8.f32.tf32.tf32", "1, 1");
    }
};

// ---- the two main loops --------------------------------------------------------------
// Both stage a TBM x TBK tile of A and a TBN x TBK tile of B per pipeline stage (16-byte
// cp.async chunks, zero-filled outside the matrix) and add one TBK step of A B^T to the
// accumulators.  Fragment layout (shared by the epilogues, tile_epilogue.cuh): warp w owns
// rows row_base(w) + i*IS + h*8 + (lane >> 2) and columns col_base(w) + j*8 + 2*(lane & 3) + e
// of the tile, in acc[i][j][h*2 + e]; NCG warps share each column (col_group(w)) and
// ROW_WARPS warps (or warpgroups: WsLayout) share each row, `second(w)` telling the one that
// hands its row values over.  Barriers of the epilogues: tile_sync(w) among the threads of
// one tile (here the CTA), pair_sync() among the holders of a row.  WGMMA: 16-bit gradient
// tiles go through the shared-memory staging ("SOUT"), 64 rows at a time from half_row(w, i).
template <typename T, bool WG, int NSTG = WSTAGES> struct TileLoop;

template <typename T, int NSTG> struct TileLoop<T, false, NSTG> {  // mma.sync m16n8k16, 4 x 2 warps
    // synchronous MMA: the stage loaded in iteration it may be any but the one read in it
    enum { I = 2, J = 8, NCG = 4, ROW_WARPS = 2, IS = 16, WGMMA = 0, WS = 0,
           STAGES = TSTAGES, PREFETCH = TSTAGES - 1 };
    static __device__ __forceinline__ int row_base(int w) { return (w >> 1) * 32; }
    static __device__ __forceinline__ int col_base(int w) { return (w & 1) * 64; }
    static __device__ __forceinline__ int col_group(int w) { return w >> 1; }
    static __device__ __forceinline__ bool second(int w) { return (w & 1) != 0; }
    static __device__ __forceinline__ int half_row(int, int) { return 0; }  // (no SOUT)
    static __device__ __forceinline__ void tile_sync(int) { __syncthreads(); }
    static __device__ __forceinline__ void pair_sync() { __syncthreads(); }
    unsigned sA, sB;
    int a_off, b_off;
    __device__ __forceinline__ void init(void* smem, int lane, int warp) {
        sA = smem_u32(smem);
        sB = sA + TSTAGES * TBM * TLD * 2;
        // ldmatrix lane addresses (elements, within a stage): A rows wm*32 + i*16 + (l & 15),
        // k + (l >> 4) * 8; B rows wn*64 + (jj*2 + (l >> 4))*8 + (l & 7), k + ((l >> 3) & 1) * 8
        a_off = (row_base(warp) + (lane & 15)) * TLD + (lane >> 4) * 8;
        b_off = (col_base(warp) + (lane >> 4) * 8 + (lane & 7)) * TLD + ((lane >> 3) & 1) * 8;
    }
    // byte address of 16-byte chunk c of row r in a stage's A (b = 0) or B (b = 1) tile
    __device__ __forceinline__ unsigned dst(int b, int stage, int r, int c) const {
        return (b ? sB + stage * TBN * TLD * 2 : sA + stage * TBM * TLD * 2) + (r * TLD + c * 8) * 2;
    }
    __device__ __forceinline__ void wait_stage() const {
        asm volatile("cp.async.wait_group %0;\n" :: "n"(PREFETCH - 1));
    }
    __device__ __forceinline__ void retire(float (&)[I][J][4], bool) const {}
    __device__ __forceinline__ void issue(float (&acc)[I][J][4], int stage, bool first) const {
        if (first) {
#pragma unroll
            for (int i = 0; i < I; ++i)
#pragma unroll
                for (int j = 0; j < J; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
        }
        const unsigned as = sA + stage * TBM * TLD * 2 + a_off * 2;
        const unsigned bs = sB + stage * TBN * TLD * 2 + b_off * 2;
#pragma unroll
        for (int kk = 0; kk < TBK; kk += 16) {
            unsigned af[2][4], bf[8][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) ldmatrix_x4(af[i], as + 2 * (i * 16 * TLD + kk));
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                unsigned r4[4];
                ldmatrix_x4(r4, bs + 2 * (jj * 16 * TLD + kk));
                bf[2 * jj][0] = r4[0]; bf[2 * jj][1] = r4[1];
                bf[2 * jj + 1][0] = r4[2]; bf[2 * jj + 1][1] = r4[3];
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) Mma<T>::run(acc[i][j], af[i], bf[j]);
        }
    }
};

template <typename T, int NSTG> struct TileLoop<T, true, NSTG> {  // wgmma m64n128k16, 2 WGs
    // one MMA batch stays in flight while the next is issued (retire waits for all but the
    // newest), so the other warpgroup may still read stage it - 1: load it + STAGES - 2
    enum { I = 1, J = 16, NCG = 8, ROW_WARPS = 1, IS = 16, WGMMA = 1, WS = 0,
           STAGES = NSTG, PREFETCH = NSTG - 2 };
    static __device__ __forceinline__ int row_base(int w) { return w * 16; }
    static __device__ __forceinline__ int col_base(int) { return 0; }
    static __device__ __forceinline__ int col_group(int w) { return w; }
    static __device__ __forceinline__ bool second(int) { return false; }
    static __device__ __forceinline__ int half_row(int w, int) { return (w >> 2) * 64; }
    static __device__ __forceinline__ void tile_sync(int) { __syncthreads(); }
    static __device__ __forceinline__ void pair_sync() { __syncthreads(); }
    unsigned base;
    int wg;
    __device__ __forceinline__ void init(void* smem, int, int warp) {
        base = (smem_u32(smem) + 1023u) & ~1023u;  // the swizzle pattern repeats every 1 KiB
        wg = warp >> 2;
    }
    // 128-byte swizzle: chunk c of row r lands at chunk c ^ (r mod 8) of that row
    __device__ __forceinline__ unsigned dst(int b, int stage, int r, int c) const {
        return base + stage * WSTAGE_BYTES + b * TBM * TBK * 2 + r * 128 + ((c ^ (r & 7)) << 4);
    }
    __device__ __forceinline__ void wait_stage() const {
        asm volatile("cp.async.wait_group %0;\n" :: "n"(PREFETCH - 1));
        fence_proxy_async();
    }
    // start one TBK step on `stage` (asynchronous); `first` starts a new tile (D = A B^T)
    __device__ __forceinline__ void issue(float (&acc)[I][J][4], int stage, bool first) const {
        float* d = &acc[0][0][0];
#pragma unroll
        for (int r = 0; r < 64; ++r) fence_operand(d[r]);
        const unsigned a = base + stage * WSTAGE_BYTES + wg * 64 * 128;
        const unsigned b = base + stage * WSTAGE_BYTES + TBM * TBK * 2;
        const unsigned long long da = wg_desc(a), db = wg_desc(b);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < TBK / 16; ++kk)  // +32 B per K step = +2 in the descriptor
            Wgmma<T>::run(d, da + 2 * kk, db + 2 * kk, (first && kk == 0) ? 0 : 1);
        wg_commit();
    }
    // wait for the previous step (all steps when `all`: the epilogue reads the accumulators)
    __device__ __forceinline__ void retire(float (&acc)[I][J][4], bool all) const {
        if (all) wg_wait0(); else wg_wait1();
        float* d = &acc[0][0][0];
#pragma unroll
        for (int r = 0; r < 64; ++r) fence_operand(d[r]);
    }
};

// The warp-specialised kernel's fragment layout (tile_ws.cuh): consumer warpgroup c (warps
// 4c .. 4c + 3) owns WHOLE 128 x 128 tiles, two wgmma m64n128k16 per k16 (i = 0: rows 0-63,
// i = 1: rows 64-127), so its warp w holds rows i*64 + (w & 3)*16 + h*8 + (lane >> 2) of every
// column; the two consumers hold the same rows of different tiles (ROW_WARPS = 2: consumer 1
// hands its row values to consumer 0 at the end).  Epilogue barriers: named barrier 1 + c
// (the consumer's 128 threads) for a tile, 5 (both consumers) for the row merge.
struct WsLayout {
    enum { I = 2, J = 16, NCG = 4, ROW_WARPS = 2, IS = 64, WGMMA = 1, WS = 1 };
    static __device__ __forceinline__ int row_base(int w) { return (w & 3) * 16; }
    static __device__ __forceinline__ int col_base(int) { return 0; }
    static __device__ __forceinline__ int col_group(int w) { return w & 3; }
    static __device__ __forceinline__ bool second(int w) { return w >= 4; }
    static __device__ __forceinline__ int half_row(int, int i) { return i * 64; }
    static __device__ __forceinline__ void tile_sync(int w) { wg_bar(w >> 2); }
    static __device__ __forceinline__ void pair_sync() {
        asm volatile("bar.sync 5, 256;\n" ::: "memory");
    }
};
