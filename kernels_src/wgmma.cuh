// cupynce: what the Hopper (sm_90a) kernels of tiles.cu and splade_wgmma.cu share.
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
