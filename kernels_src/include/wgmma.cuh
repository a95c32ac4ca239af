// cupynce: what the Hopper (sm_90a) kernels of tiles.cu and splade_wgmma.cu share: the
// wgmma operand descriptor, and the tensor-memory-accelerator (TMA) and mbarrier helpers of
// the warp-specialised kernels (splade_wgmma.cu; the tile kernels' issue 23 ping-pong).
#pragma once

// Shared-memory matrix descriptor of a K-major operand tile with 128-byte swizzle: rows of
// 64 16-bit values (128 B), 8-row groups 1024 B apart (stride byte offset), leading byte
// offset unused (1); the 16-element K steps inside a row advance the start address by 32 B.
// The tile's base must be 1024-byte aligned (the swizzle pattern repeats every 1 KiB).
__device__ __forceinline__ unsigned long long wg_desc(unsigned saddr) {
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) |
           (1ull << 62);
}
// an empty asm that "writes" r: keeps the compiler from moving accumulator reads or writes
// across the wgmma wait that precedes it
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r) :: "memory"); }

// CUtensorMap: 128 opaque bytes, 64-byte aligned (cuda.h)
struct __align__(64) TmaMap { unsigned long long v[16]; };

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// (the helpers below use sm_90a-only instructions)
__device__ __forceinline__ unsigned sw_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(bar), "r"(bytes) : "memory");
}
// wait until the phase of parity `parity` of the barrier has completed
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile("{\n.reg .pred p;\nSW_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra SW_WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}
// box of the tensor map at coordinates (c0 = K, c1 = row) into shared memory at dst
__device__ __forceinline__ void tma_load(unsigned dst, const TmaMap* map, int c0, int c1,
                                         unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n"
                 :: "r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
// box of a 3-D tensor map at coordinates (c0, c1, c2) (tiles_ws_f16x3.cu's interleaved
// halves: c0 = 0, c1 = the 64-column group, c2 = the row)
__device__ __forceinline__ void tma_load3(unsigned dst, const TmaMap* map, int c0, int c1, int c2,
                                          unsigned bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];\n"
                 :: "r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}
// the same box into dst of every CTA of the cluster in `ctas` (a bit per rank), each
// signalling its own barrier at offset bar
__device__ __forceinline__ void tma_load_multicast(unsigned dst, const TmaMap* map, int c0,
                                                   int c1, unsigned bar, unsigned short ctas) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n"
                 :: "r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar), "h"(ctas)
                 : "memory");
}
// arrive on the barrier at offset bar of cluster CTA `rank` when `pred` (predicated, no branch)
__device__ __forceinline__ void mbar_arrive_remote_if(unsigned bar, unsigned rank, bool pred) {
    asm volatile("{\n.reg .pred p;\n.reg .b32 r;\nsetp.ne.b32 p, %2, 0;\n"
                 "mapa.shared::cluster.u32 r, %0, %1;\n"
                 "@p mbarrier.arrive.shared::cluster.b64 _, [r];\n}\n"
                 :: "r"(bar), "r"(rank), "r"((int)pred) : "memory");
}
// every thread of both CTAs (release / acquire: barrier inits, then the last remote arrivals)
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
