// cupynce SPLADE head kernels, the backward: dW, dbias and dx from the forward's output and
// arg-max over the active (b, v) entries (splade.cu's header: the naming, the types).
//
//   g'[b, v] = grad_out[b, v] * act'(out[b, v]),  l* = argmax[b, v]
//   dW[v] = sum_b g' x[b, l*],  dbias[v] = sum_b g',  dx[b, l] = sum_{v : l* = l} g' W[v]
//
// Every floating-point reduction is a sequential loop in a fixed order (by b for dW and dbias,
// by v within each (b, l) for dx): no floating-point atomics, bitwise reproducible results.
// The only atomics are integer counts (whose result does not depend on the order).
#include "include/common.cuh"
#include "splade/splade_common.cuh"

// g' = grad_out * act'(m) from the stored output: 1 (relu) or 1 / (1 + m) = exp(-out)
// (log1p_relu) where out > 0, 0 where out == 0, NaN where out is NaN.
template <typename A>
__device__ __forceinline__ A spl_gprime(A out, A g, int act) {
    if (out != out) return out;
    if (!(out > A(0))) return A(0);
    return act == SPL_ACT_LOG1P ? g * cpn_exp(-out) : g;
}

// Whether entry o is active, and its g' and winning position: one definition for the dw,
// count and place passes (they must agree exactly).  An arg-max outside [0, L) (only possible
// from a caller-supplied arg-max) makes the entry inactive instead of an out-of-bounds access.
template <typename T, typename I>
__device__ __forceinline__ bool spl_entry(const T* __restrict__ out, const T* __restrict__ g,
                                          const I* __restrict__ arg, i64 o, int L, int act,
                                          typename Conv<T>::acc& gp, int& l)
{
    typedef typename Conv<T>::acc A;
    l = (int)arg[o];
    gp = spl_gprime(Conv<T>::load(out[o]), Conv<T>::load(g[o]), act);
    return gp != A(0) && (unsigned)l < (unsigned)L;
}

// 16 bytes of T, the gradient kernels' vector access (VEC) where rows are aligned
template <typename T> struct alignas(16) SplRow16 { T v[16 / sizeof(T)]; };

// Columns a lane of the gradient kernels covers: NV chunks of E consecutive columns, E = 16
// bytes of T with vector access, else 1; chunk q of lane `lane` starts at (q * 32 + lane) * E.
#define SPL_GRAD_NV 4
// gradient row += w * src row over the lane's columns [d0 .. ) (E-wide chunks, NV of them)
template <typename T, bool VEC, typename A, int E>
__device__ __forceinline__ void spl_axpy(A (&acc)[SPL_GRAD_NV][E], A w,
                                         const T* __restrict__ row, i64 sd, int dbase, int D,
                                         int lane)
{
#pragma unroll
    for (int q = 0; q < SPL_GRAD_NV; ++q) {
        const int d = dbase + (q * 32 + lane) * E;
        if (d >= D) continue;
        if (VEC) {
            const SplRow16<T> r = *reinterpret_cast<const SplRow16<T>*>(row + d);
#pragma unroll
            for (int e = 0; e < E; ++e) acc[q][e] += w * Conv<T>::load(r.v[e]);
        } else {
            acc[q][0] += w * Conv<T>::load(row[(i64)d * sd]);
        }
    }
}

template <typename T, bool VEC, typename A, int E>
__device__ __forceinline__ void spl_store_row(const A (&acc)[SPL_GRAD_NV][E], T* __restrict__ dst,
                                              int dbase, int D, int lane)
{
#pragma unroll
    for (int q = 0; q < SPL_GRAD_NV; ++q) {
        const int d = dbase + (q * 32 + lane) * E;
        if (d >= D) continue;
        if (VEC) {
            SplRow16<T> r;
#pragma unroll
            for (int e = 0; e < E; ++e) r.v[e] = Conv<T>::store(acc[q][e]);
            *reinterpret_cast<SplRow16<T>*>(dst + d) = r;
        } else {
            dst[d] = Conv<T>::store(acc[q][0]);
        }
    }
}

// The 16-byte gradient kernels keep SPL_RING - 1 rows in flight per warp beyond the one they
// add: each lane copies its own chunks of a gathered row into a per-warp ring in shared memory
// (cp.async: the copies hold no registers, where loads into registers held them until their
// use, one row a warp in flight) and reads back only its own chunks, so no barrier is needed:
// cp.async.wait_group orders a thread's own copies before its reads, and a slot is refilled
// only after its row was added (the adds consume the reads first, in program order).
// Slot layout [warp][SPL_RING][SPL_GRAD_NV][32 lanes] x 16 bytes (conflict-free).  The kernels
// are issue-bound, not memory-bound, once rows are in flight: every address is a base set up
// once plus a constant (chunk q of a row is 512 bytes after chunk q - 1, in global and shared
// memory alike), and the 16 bytes are widened to A with integer shifts (bf16) where possible.
#define SPL_RING 4
#define SPL_RING_BYTES (SPL_RING * SPL_GRAD_NV * 32 * 16)  // a warp's ring
#define SPL_SLOT_BYTES (SPL_GRAD_NV * 32 * 16)
struct SplRing {
    unsigned base;  // shared address of the lane's chunk 0 in slot 0
    int nq;         // the lane's chunks inside [0, D): q < nq
    __device__ __forceinline__ SplRing(const void* warp_ring, int dbase, int D, int E, int lane) {
        asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
            : "=r"(base) : "l"(warp_ring));
        base += lane * 16;
        const int d0 = dbase + lane * E;  // chunk q starts at d0 + 32 E q
        nq = d0 < D ? min(SPL_GRAD_NV, (D - d0 + 32 * E - 1) / (32 * E)) : 0;
    }
    // start copying the lane's chunks of a row (src: the row + the lane's first column)
    __device__ __forceinline__ void fill(int slot, const void* src) const {
        const unsigned dst = base + slot * SPL_SLOT_BYTES;
        const char* g = static_cast<const char*>(src);
#pragma unroll
        for (int q = 0; q < SPL_GRAD_NV; ++q) {
            if (q >= nq) break;
#if __CUDA_ARCH__ >= 800
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                         :: "r"(dst + q * 512), "l"(g + q * 512));
#else  // no cp.async before sm_80: a plain copy
            uint4 v = *reinterpret_cast<const uint4*>(g + q * 512);
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                         :: "r"(dst + q * 512), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
#endif
        }
    }
    __device__ __forceinline__ uint4 read(int slot, int q) const {
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(base + slot * SPL_SLOT_BYTES + q * 512));
        return v;
    }
};
__device__ __forceinline__ void spl_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// wait until at most SPL_RING - 1 of this thread's copy groups are pending
__device__ __forceinline__ void spl_wait_ring() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" :: "n"(SPL_RING - 1) : "memory");
#endif
}
// acc[e] += w * the 16 bytes u as E values of T (in order e = 0 .. E - 1)
template <typename T, typename A>
__device__ __forceinline__ void spl_fma16(A* acc, A w, uint4 u) {
    const SplRow16<T> r = *reinterpret_cast<const SplRow16<T>*>(&u);
#pragma unroll
    for (int e = 0; e < 16 / (int)sizeof(T); ++e) acc[e] += w * Conv<T>::load(r.v[e]);
}
template <>
__device__ __forceinline__ void spl_fma16<bf16_t, float>(float* acc, float w, uint4 u) {
    const unsigned p[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // element 2k in the low half, 2k + 1 in the high half
        acc[2 * k] += w * __uint_as_float(p[k] << 16);
        acc[2 * k + 1] += w * __uint_as_float(p[k] & 0xffff0000u);
    }
}
template <>
__device__ __forceinline__ void spl_fma16<float, float>(float* acc, float w, uint4 u) {
    acc[0] += w * __uint_as_float(u.x);
    acc[1] += w * __uint_as_float(u.y);
    acc[2] += w * __uint_as_float(u.z);
    acc[3] += w * __uint_as_float(u.w);
}
template <>
__device__ __forceinline__ void spl_fma16<double, double>(double* acc, double w, uint4 u) {
    acc[0] += w * __hiloint2double((int)u.y, (int)u.x);
    acc[1] += w * __hiloint2double((int)u.w, (int)u.z);
}
template <>
__device__ __forceinline__ void spl_fma16<f16_t, float>(float* acc, float w, uint4 u) {
    const unsigned p[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        f16_t lo, hi;
        lo.bits = (unsigned short)(p[k] & 0xffffu);
        hi.bits = (unsigned short)(p[k] >> 16);
        acc[2 * k] += w * to_f32(lo);
        acc[2 * k + 1] += w * to_f32(hi);
    }
}
// acc += w * the row in ring slot `slot` (the lane's chunks), in the order spl_axpy adds
template <typename T, typename A>
__device__ __forceinline__ void spl_ring_axpy(A (&acc)[SPL_GRAD_NV][16 / sizeof(T)], A w,
                                              const SplRing& ring, int slot)
{
#pragma unroll
    for (int q = 0; q < SPL_GRAD_NV; ++q) {
        if (q >= ring.nq) break;
        spl_fma16<T, A>(acc[q], w, ring.read(slot, q));
    }
}

// dW[v, :] = sum_b g'[b, v] x[b, l*(b, v), :] and dbias[v] = sum_b g'[b, v], each in
// increasing b (the same sums, in the same order, whatever the tiling).
// CTA: SPL_DW_TV vocabulary rows (SPL_DW_TV / 8 a warp) x 32 E SPL_GRAD_NV columns of D.
// The (g', l*) of SPL_DW_BC batches x those rows are staged in shared memory by one load per
// thread, consecutive threads on consecutive v (coalesced: a block per v read each entry
// alone, a 32-byte sector for 2 bytes); then each warp walks the batches for its rows and
// gathers only the x rows of the active entries (instantiated element-wise, VEC = false: the
// 16-byte kernel for aligned rows is splade_dwv_impl).
// Grid (ceil(V / SPL_DW_TV), ceil(D / (32 E SPL_GRAD_NV))), CPN_BLOCK threads.
#define SPL_DW_TV 16
#define SPL_DW_BC (CPN_BLOCK / SPL_DW_TV)
template <typename T, typename I, bool VEC>
__device__ __forceinline__ void splade_dw_impl(
    const T* __restrict__ x, const T* __restrict__ out, const T* __restrict__ g,
    const I* __restrict__ arg, int B, int L, int D, int V, int act,
    T* __restrict__ dw, T* __restrict__ dbias)
{
    typedef typename Conv<T>::acc A;
    enum { E = VEC ? 16 / sizeof(T) : 1, VPW = SPL_DW_TV / (CPN_BLOCK / 32) };
    __shared__ A sg[SPL_DW_BC][SPL_DW_TV];
    __shared__ int sl[SPL_DW_BC][SPL_DW_TV];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int v0 = blockIdx.x * SPL_DW_TV;
    const int dbase = blockIdx.y * (32 * E * SPL_GRAD_NV);
    A acc[VPW][SPL_GRAD_NV][E];
    A bsum[VPW];
#pragma unroll
    for (int r = 0; r < VPW; ++r) {
        bsum[r] = A(0);
#pragma unroll
        for (int q = 0; q < SPL_GRAD_NV; ++q)
#pragma unroll
            for (int e = 0; e < E; ++e) acc[r][q][e] = A(0);
    }
    const int tb = threadIdx.x / SPL_DW_TV, tv = threadIdx.x % SPL_DW_TV;
    for (int bb = 0; bb < B; bb += SPL_DW_BC) {
        const int b = bb + tb, v = v0 + tv;
        A gp = A(0);
        int l = 0;
        if (b < B && v < V && !spl_entry(out, g, arg, (i64)b * V + v, L, act, gp, l)) gp = A(0);
        __syncthreads();  // the previous chunk's readers are done
        sg[tb][tv] = gp;
        sl[tb][tv] = l;
        __syncthreads();
        const int nb = min(SPL_DW_BC, B - bb);
        for (int k = 0; k < nb; ++k) {
#pragma unroll
            for (int r = 0; r < VPW; ++r) {
                const int j = warp * VPW + r;
                const A w = sg[k][j];
                if (w == A(0)) continue;  // inactive (a NaN g' is active and propagates)
                bsum[r] += w;
                spl_axpy<T, VEC, A, E>(acc[r], w, x + ((i64)(bb + k) * L + sl[k][j]) * D, 1,
                                       dbase, D, lane);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < VPW; ++r) {
        const int v = v0 + warp * VPW + r;
        if (v >= V) continue;
        spl_store_row<T, VEC, A, E>(acc[r], dw + (i64)v * D, dbase, D, lane);
        if (dbias && blockIdx.y == 0 && lane == 0) dbias[v] = Conv<T>::store(bsum[r]);
    }
}

// dW with 16-byte rows: as splade_dw_impl (the same sums in the same order), one vocabulary
// row a warp (SPL_DWV_TV = 8 a CTA: two rows' accumulators left too few warps resident), the
// (g', l*) of SPL_DWV_BC batches staged at once and the x rows gathered through the warp's
// ring.  Each warp first lists its active entries of the chunk in increasing b (ballot, prefix
// popcount), then keeps SPL_RING - 1 rows in flight ahead of the one it adds.
// Grid (ceil(V / SPL_DWV_TV), ceil(D / (32 E SPL_GRAD_NV))), CPN_BLOCK threads; dynamic shared
// memory SPL_DWV_SMEM bytes (splade.py: _RING_SMEM).
#define SPL_DWV_TV (CPN_BLOCK / 32)
#define SPL_DWV_BC 64
#define SPL_DWV_SMEM ((CPN_BLOCK / 32) * SPL_RING_BYTES)
template <typename T, typename I>
__device__ __forceinline__ void splade_dwv_impl(
    const T* __restrict__ x, const T* __restrict__ out, const T* __restrict__ g,
    const I* __restrict__ arg, int B, int L, int D, int V, int act,
    T* __restrict__ dw, T* __restrict__ dbias)
{
    typedef typename Conv<T>::acc A;
    enum { E = 16 / sizeof(T), NW = CPN_BLOCK / 32 };
    __shared__ A sg[SPL_DWV_BC][SPL_DWV_TV];
    __shared__ int sl[SPL_DWV_BC][SPL_DWV_TV];
    // a warp's active entries of the chunk, in increasing b: g' and the x row (b L + l)
    __shared__ A lw[NW][SPL_DWV_BC];
    __shared__ long long lrow[NW][SPL_DWV_BC];
    extern __shared__ uint4 rings[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int v = blockIdx.x * SPL_DWV_TV + warp;  // the warp's row
    const int dbase = blockIdx.y * (32 * E * SPL_GRAD_NV);
    const SplRing ring(rings + warp * (SPL_RING_BYTES / 16), dbase, D, E, lane);
    const T* xl = x + dbase + lane * E;  // + row * D: the lane's first column of a row
    A acc[SPL_GRAD_NV][E];
    A bsum = A(0);
#pragma unroll
    for (int q = 0; q < SPL_GRAD_NV; ++q)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[q][e] = A(0);
    for (int bb = 0; bb < B; bb += SPL_DWV_BC) {
        __syncthreads();  // the previous chunk's readers are done
        for (int t = threadIdx.x; t < SPL_DWV_BC * SPL_DWV_TV; t += CPN_BLOCK) {
            const int tb = t / SPL_DWV_TV, tv = t % SPL_DWV_TV;
            const int b = bb + tb, vt = blockIdx.x * SPL_DWV_TV + tv;
            A gp = A(0);
            int l = 0;
            if (b < B && vt < V && !spl_entry(out, g, arg, (i64)b * V + vt, L, act, gp, l))
                gp = A(0);
            sg[tb][tv] = gp;
            sl[tb][tv] = l;
        }
        __syncthreads();
        const int nb = min(SPL_DWV_BC, B - bb);
        int n = 0;  // the warp's active entries of this chunk, listed in order
        for (int k0 = 0; k0 < nb; k0 += 32) {
            const int k = k0 + lane;
            const A w = k < nb ? sg[k][warp] : A(0);
            const bool on = w != A(0);  // (a NaN g' is active and propagates)
            const unsigned m = __ballot_sync(0xffffffffu, on);
            if (on) {
                const int p = n + __popc(m & ((1u << lane) - 1u));
                lw[warp][p] = w;
                lrow[warp][p] = (long long)(bb + k) * L + sl[k][warp];
            }
            n += __popc(m);
        }
        __syncwarp();
        for (int i = 0; i < SPL_RING - 1; ++i) {
            if (i < n) ring.fill(i, xl + lrow[warp][i] * D);
            spl_commit();
        }
        for (int i = 0; i < n; ++i) {
            const int j = i + SPL_RING - 1;
            if (j < n) ring.fill(j % SPL_RING, xl + lrow[warp][j] * D);
            spl_commit();
            spl_wait_ring();
            const A w = lw[warp][i];
            bsum += w;
            spl_ring_axpy<T, A>(acc, w, ring, i % SPL_RING);
        }
        __syncwarp();  // the list is read before the next chunk rewrites it
    }
    if (v >= V) return;
    spl_store_row<T, true, A, E>(acc, dw + (i64)v * D, dbase, D, lane);
    if (dbias && blockIdx.y == 0 && lane == 0) dbias[v] = Conv<T>::store(bsum);
}

// dx grouping, pass 1: counts[b, l, s] = number of active v of segment s of batch b whose
// arg-max is l (integer atomics in shared memory: the counts do not depend on the order).
// Grid (nseg, B); dynamic shared memory L ints.
template <typename T, typename I>
__device__ __forceinline__ void splade_count_body(
    const T* __restrict__ out, const T* __restrict__ g, const I* __restrict__ arg,
    int V, int L, int seg, int nseg, int act, int global, int* __restrict__ counts)
{
    typedef typename Conv<T>::acc A;
    extern __shared__ int cnt[];  // L ints, or none with `global` (long sequences)
    const int s = blockIdx.x, b = blockIdx.y;
    if (!global) {
        for (int l = threadIdx.x; l < L; l += blockDim.x) cnt[l] = 0;
        __syncthreads();
    }
    const int v1 = min(V, (s + 1) * seg);
    for (int v = s * seg + threadIdx.x; v < v1; v += blockDim.x) {
        A gp;
        int l;
        if (spl_entry(out, g, arg, (i64)b * V + v, L, act, gp, l)) {
            if (global) atomicAdd(&counts[((i64)b * L + l) * nseg + s], 1);  // zeroed by the caller
            else atomicAdd(&cnt[l], 1);
        }
    }
    if (global) return;
    __syncthreads();
    for (int l = threadIdx.x; l < L; l += blockDim.x)
        counts[((i64)b * L + l) * nseg + s] = cnt[l];
}

// dx grouping, pass 2: a stable counting sort. One warp per (segment s, batch b) walks its
// v in increasing order, 32 at a time, and writes each active v at
//   list[b, offset[b, l, s] + (active v of (b, l) in segment s before it)]
// so that list[b] is ordered by (l, v).  Grid (nseg, B), 32 threads, L ints of shared memory.
#define SPL_PLACE_ROUNDS 4
template <typename T, typename I>
__device__ __forceinline__ void splade_place_body(
    const T* __restrict__ out, const T* __restrict__ g, const I* __restrict__ arg,
    int V, int L, int seg, int nseg, int act, const int* __restrict__ offsets,
    int* __restrict__ gcur, int* __restrict__ list)
{
    typedef typename Conv<T>::acc A;
    // the cursors: L ints of shared memory, or (long sequences) gcur, a copy of the offsets
    // whose (b, l, s) entries only this warp touches
    extern __shared__ int scur[];
    const int s = blockIdx.x, b = blockIdx.y, lane = threadIdx.x;
    int* cur = gcur ? gcur : scur;
    const i64 cbase = gcur ? (i64)b * L * nseg + s : 0;
    const int cstride = gcur ? nseg : 1;
    if (!gcur)
        for (int l = lane; l < L; l += 32) scur[l] = offsets[((i64)b * L + l) * nseg + s];
    __syncwarp();
    const int v1 = min(V, (s + 1) * seg);
    // SPL_PLACE_ROUNDS rounds of 32 v: their entries are all read first (the reads of one
    // round at a time left the warp waiting on each), then placed round by round
    for (int base = s * seg; base < v1; base += 32 * SPL_PLACE_ROUNDS) {
        bool on[SPL_PLACE_ROUNDS];
        int ls[SPL_PLACE_ROUNDS];
#pragma unroll
        for (int u = 0; u < SPL_PLACE_ROUNDS; ++u) {
            const int v = base + 32 * u + lane;
            A gp;
            on[u] = false;
            ls[u] = 0;
            if (v < v1) on[u] = spl_entry(out, g, arg, (i64)b * V + v, L, act, gp, ls[u]);
        }
#pragma unroll
        for (int u = 0; u < SPL_PLACE_ROUNDS; ++u) {
            const int v = base + 32 * u + lane, l = ls[u];
            const unsigned am = __ballot_sync(0xffffffffu, on[u]);
            if (on[u]) {
                const unsigned peers = __match_any_sync(am, l);
                const int rank = __popc(peers & ((1u << lane) - 1u));
                int* c = cur + cbase + (i64)l * cstride;
                list[(i64)b * V + *c + rank] = v;
                __syncwarp(am);  // every peer has read the cursor
                if (rank == __popc(peers) - 1) *c += __popc(peers);
                if (gcur) __threadfence_block();  // the next round's readers see the update
            }
            __syncwarp();
        }
    }
}

// dx[b, l, :] = sum over the active v with l*(b, v) = l, in increasing v, of g'[b, v] W[v, :].
// W is (V, D) with element strides (sv, sd): a row-major matrix or the transpose of one.
// A warp per (b, l) (8 consecutive positions a CTA) and 32 E SPL_GRAD_NV columns of D: the
// lanes read 32 entries of the (b, l) run of the list at once (its v and g'), then the warp
// adds their W rows in list order (instantiated element-wise, VEC = false: any strides; the
// 16-byte kernel for aligned rows with sd == 1 is splade_dxv_impl).  No block barrier.  Grid (ceil(B L / 8), ceil(D / (32 E SPL_GRAD_NV))), CPN_BLOCK threads; every
// (b, l) is written (zeros when its run is empty).
template <typename T, bool VEC>
__device__ __forceinline__ void splade_dx_impl(
    const T* __restrict__ W, i64 sv, i64 sd, const T* __restrict__ out,
    const T* __restrict__ g, const int* __restrict__ list, const int* __restrict__ excl,
    const int* __restrict__ incl, int B, int V, int L, int D, int nseg, int act,
    T* __restrict__ dx)
{
    typedef typename Conv<T>::acc A;
    enum { E = VEC ? 16 / sizeof(T) : 1 };
    const int lane = threadIdx.x & 31;
    const i64 bl = (i64)blockIdx.x * (CPN_BLOCK / 32) + (threadIdx.x >> 5);
    if (bl >= (i64)B * L) return;  // (uniform over the warp)
    const i64 b = bl / L;
    const int dbase = blockIdx.y * (32 * E * SPL_GRAD_NV);
    const int start = excl[bl * nseg];
    const int end = incl[bl * nseg + nseg - 1];
    A acc[SPL_GRAD_NV][E];
#pragma unroll
    for (int q = 0; q < SPL_GRAD_NV; ++q)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[q][e] = A(0);
    for (int e0 = start; e0 < end; e0 += 32) {
        int vl = 0;
        A wl = A(0);
        if (e0 + lane < end) {
            vl = list[b * V + e0 + lane];
            const i64 o = b * V + vl;
            wl = spl_gprime(Conv<T>::load(out[o]), Conv<T>::load(g[o]), act);
        }
        const int n = min(32, end - e0);
        for (int k = 0; k < n; ++k) {
            const int v = __shfl_sync(0xffffffffu, vl, k);
            const A w = __shfl_sync(0xffffffffu, wl, k);
            spl_axpy<T, VEC, A, E>(acc, w, W + (i64)v * sv, sd, dbase, D, lane);
        }
    }
    spl_store_row<T, VEC, A, E>(acc, dx + bl * D, dbase, D, lane);
}

// dx with 16-byte W rows: as splade_dx_impl (the same sums in the same order), with the W rows
// gathered through the warp's ring, SPL_RING - 1 rows in flight ahead of the one it adds.  The
// lanes hold the (v, g') of the run's 32-entry chunk being added and of the next one.
// Dynamic shared memory: SPL_DXV_SMEM bytes (splade.py: _RING_SMEM).
#define SPL_DXV_SMEM ((CPN_BLOCK / 32) * SPL_RING_BYTES)
template <typename T>
__device__ __forceinline__ void splade_dxv_impl(
    const T* __restrict__ W, i64 sv, const T* __restrict__ out, const T* __restrict__ g,
    const int* __restrict__ list, const int* __restrict__ excl, const int* __restrict__ incl,
    int B, int V, int L, int D, int nseg, int act, T* __restrict__ dx)
{
    typedef typename Conv<T>::acc A;
    enum { E = 16 / sizeof(T) };
    extern __shared__ uint4 rings[];
    const int lane = threadIdx.x & 31;
    const i64 bl = (i64)blockIdx.x * (CPN_BLOCK / 32) + (threadIdx.x >> 5);
    if (bl >= (i64)B * L) return;  // (uniform over the warp; no block barrier below)
    const i64 b = bl / L;
    const int dbase = blockIdx.y * (32 * E * SPL_GRAD_NV);
    const SplRing ring(rings + (threadIdx.x >> 5) * (SPL_RING_BYTES / 16), dbase, D, E, lane);
    const T* wl = W + dbase + lane * E;  // + v sv: the lane's first column of row v
    const int* run = list + b * V + excl[bl * nseg];  // the (b, l) run: its v, increasing
    const int n = incl[bl * nseg + nseg - 1] - excl[bl * nseg];
    A acc[SPL_GRAD_NV][E];
#pragma unroll
    for (int q = 0; q < SPL_GRAD_NV; ++q)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[q][e] = A(0);
    // the lanes hold the (v, g') of the run's 32-entry chunk being added and of the next
    auto chunk = [&](int c, int& vl, A& wl_) {
        const int e = c * 32 + lane;
        vl = 0;
        wl_ = A(0);
        if (e < n) {
            vl = run[e];
            const i64 o = b * V + vl;
            wl_ = spl_gprime(Conv<T>::load(out[o]), Conv<T>::load(g[o]), act);
        }
    };
    int vc, vn;
    A wc, wn;
    chunk(0, vc, wc);
    chunk(1, vn, wn);
    for (int i = 0; i < SPL_RING - 1; ++i) {  // (SPL_RING - 1 < 32: all in chunk 0)
        const int v = __shfl_sync(0xffffffffu, vc, i);
        if (i < n) ring.fill(i, wl + v * sv);
        spl_commit();
    }
    for (int i = 0; i < n; ++i) {
        const int j = i + SPL_RING - 1;
        const int v = __shfl_sync(0xffffffffu, (j >> 5) == (i >> 5) ? vc : vn, j & 31);
        if (j < n) ring.fill(j % SPL_RING, wl + v * sv);
        spl_commit();
        spl_wait_ring();
        spl_ring_axpy<T, A>(acc, __shfl_sync(0xffffffffu, wc, i & 31), ring, i % SPL_RING);
        if ((i & 31) == 31) {
            vc = vn;
            wc = wn;
            chunk((i >> 5) + 2, vn, wn);
        }
    }
    spl_store_row<T, true, A, E>(acc, dx + bl * D, dbase, D, lane);
}

// dx grouping, between the passes: per batch row b, the inclusive and exclusive prefix sums
// of counts[b, :] (n = L * nseg ints in (l, s) order): excl is the place pass's offsets (and
// excl2, when given, its global cursors: a copy it may overwrite), incl and excl bound each
// (b, l)'s run in the dx pass.  Integer sums, exact in any order.  Grid (B), SPL_SCAN_BLOCK threads:
// the row in chunks of SPL_SCAN_ITEMS SPL_SCAN_BLOCK ints (one chunk for rows up to splade.py's
// _MAX_SCAN), warp w over the chunk's w-th run of 32 SPL_SCAN_ITEMS ints, lane over ints
// lane, lane + 32, ...: every read and write coalesced, all of a thread's reads issued at
// once; SPL_SCAN_ITEMS warp-shuffle scans per warp, the warps' totals scanned by warp 0.
#define SPL_SCAN_ITEMS 16
#define SPL_SCAN_BLOCK 1024
extern "C" __global__ void __launch_bounds__(SPL_SCAN_BLOCK)
cpn_splade_scan(const int* __restrict__ counts, int n, int* __restrict__ incl,
                int* __restrict__ excl, int* __restrict__ excl2)
{
    constexpr int WARPS = SPL_SCAN_BLOCK / 32;
    __shared__ int wsum[WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 row = (i64)blockIdx.x * n;
    int carry = 0;
    for (int base = 0; base < n; base += SPL_SCAN_ITEMS * SPL_SCAN_BLOCK) {
        const int i0 = base + warp * (32 * SPL_SCAN_ITEMS) + lane;  // + 32 k
        int c[SPL_SCAN_ITEMS], inc[SPL_SCAN_ITEMS];
#pragma unroll
        for (int k = 0; k < SPL_SCAN_ITEMS; ++k)
            c[k] = i0 + 32 * k < n ? counts[row + i0 + 32 * k] : 0;
        int run = 0;  // the warp's total of its ints before int 32 k
#pragma unroll
        for (int k = 0; k < SPL_SCAN_ITEMS; ++k) {
            int x = c[k];
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, x, o);
                if (lane >= o) x += y;
            }
            inc[k] = run + x;
            run += __shfl_sync(0xffffffffu, x, 31);
        }
        if (lane == 0) wsum[warp] = run;
        __syncthreads();
        if (warp == 0) {
            int w = lane < WARPS ? wsum[lane] : 0;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, w, o);
                if (lane >= o) w += y;
            }
            if (lane < WARPS) wsum[lane] = w;  // inclusive totals of warps 0 .. lane
        }
        __syncthreads();
        const int off = carry + (warp ? wsum[warp - 1] : 0);
#pragma unroll
        for (int k = 0; k < SPL_SCAN_ITEMS; ++k) {
            const int i = i0 + 32 * k;
            if (i < n) {
                incl[row + i] = off + inc[k];
                excl[row + i] = off + inc[k] - c[k];
                if (excl2) excl2[row + i] = off + inc[k] - c[k];
            }
        }
        carry += wsum[WARPS - 1];
        __syncthreads();  // every thread has read wsum before the next chunk rewrites it
    }
}

// ---- extern "C" wrappers, one per (index type, dtype) ----------------------------------
#define SPL_DW_ARGS(T, I) const T* x, const T* out, const T* g, const I* arg, int B, int L,       \
    int D, int V, int act, T* dw, T* dbias
// dW's kernels: index type I, 16-byte rows (VEC) or element-wise
#define SPL_DW_KERNEL(NAME, SUF, T, I, IMPL)                                                 \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK) NAME##_##SUF(SPL_DW_ARGS(T, I))      \
{ IMPL(x, out, g, arg, B, L, D, V, act, dw, dbias); }
#define SPL_DX_ARGS(T) const T* W, i64 sv, i64 sd, const T* out, const T* g, const int* list,   \
    const int* excl, const int* incl, int B, int V, int L, int D, int nseg, int act, T* dx
#define SPL_COUNT_ARGS(T, I) const T* out, const T* g, const I* arg, int V, int L, int seg,       \
    int nseg, int act, int global, int* counts
#define SPL_PLACE_ARGS(T, I) const T* out, const T* g, const I* arg, int V, int L, int seg,       \
    int nseg, int act, const int* offsets, int* gcur, int* list
#define SPL_GRAD_DEFINE(SUF, T)                                                              \
SPL_DW_KERNEL(cpn_splade_dw_i16, SUF, T, short, (splade_dw_impl<T, short, false>))                                       \
SPL_DW_KERNEL(cpn_splade_dw_i32, SUF, T, int, (splade_dw_impl<T, int, false>))                                       \
SPL_DW_KERNEL(cpn_splade_dwv_i16, SUF, T, short, (splade_dwv_impl<T, short>))                                       \
SPL_DW_KERNEL(cpn_splade_dwv_i32, SUF, T, int, (splade_dwv_impl<T, int>))                                       \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK)                                      \
cpn_splade_count_i16_##SUF(SPL_COUNT_ARGS(T, short))                                         \
{ splade_count_body<T, short>(out, g, arg, V, L, seg, nseg, act, global, counts); }                  \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK)                                      \
cpn_splade_count_i32_##SUF(SPL_COUNT_ARGS(T, int))                                           \
{ splade_count_body<T, int>(out, g, arg, V, L, seg, nseg, act, global, counts); }                    \
extern "C" __global__ void __launch_bounds__(32)                                             \
cpn_splade_place_i16_##SUF(SPL_PLACE_ARGS(T, short))                                         \
{ splade_place_body<T, short>(out, g, arg, V, L, seg, nseg, act, offsets, gcur, list); }           \
extern "C" __global__ void __launch_bounds__(32)                                             \
cpn_splade_place_i32_##SUF(SPL_PLACE_ARGS(T, int))                                           \
{ splade_place_body<T, int>(out, g, arg, V, L, seg, nseg, act, offsets, gcur, list); }             \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK)                                      \
cpn_splade_dx_##SUF(SPL_DX_ARGS(T))                                                          \
{ splade_dx_impl<T, false>(W, sv, sd, out, g, list, excl, incl, B, V, L, D, nseg, act, dx); } \
extern "C" __global__ void __launch_bounds__(CPN_BLOCK)                                      \
cpn_splade_dxv_##SUF(SPL_DX_ARGS(T))                                                         \
{ splade_dxv_impl<T>(W, sv, out, g, list, excl, incl, B, V, L, D, nseg, act, dx); }

SPL_GRAD_DEFINE(f16, f16_t)
SPL_GRAD_DEFINE(bf16, bf16_t)
SPL_GRAD_DEFINE(f32, float)
SPL_GRAD_DEFINE(f64, double)
