"""The TF32x3 backend: float32 products on Hopper's TF32 tensor cores with fp32 accuracy
(``kernels_src/products/tiles_ws_tf32.cu``, issue 24).

Each float32 operand is split x = hi + lo (:func:`split`: hi = x rounded to TF32, lo = x - hi
exactly) and the warp-specialised tile walk of ``tile_ws.cuh`` computes
S = lo_a·hi_b + hi_a·lo_b + hi_a·hi_b with TF32 wgmma, adding each 32-wide K step's chunk to
an fp32 register sum with round-to-nearest adds: Hopper's tensor cores truncate when they
accumulate, which makes cuBLAS's 3xTF32 (one long accumulation) 3-13x less accurate than
fp32; the promoted chunks are not (docs/design.md, issue 24).

* :func:`mm` -- ``out = alpha · op(A) Bᵀ`` (A split by its consumers in shared memory, B
  given split K-major: :func:`split`, :func:`split_t`);
* :func:`launch` / :func:`launch_packed` / :func:`args` -- the launch of a kernel of the file
  (the fused NT-Xent passes of ``losses.nt_xent_tf32`` launch theirs through them; the F16x3
  kernels share :func:`launch_packed`'s parameter layout).

sm_90a only (:func:`available`); :class:`TF32TilesUnavailable` where a launch cannot run.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ... import config
from .. import kernels, tma
from ..arrays import leading_dim, ptr
from ..tiling import (TILE, WS_THREADS, grid_splits, launch_blob, pack_tile_args, tile_map,
                      ws_smem)
from . import cublas

FILE = "products/tiles_ws_tf32.cu"

#: K elements per ring stage (WS_TF32_KSTEP: one 128-byte swizzled row of float32), one
#: 128 x 32 float32 box, and the stage: four boxes, A_hi | A_lo | B_hi | B_lo (``mm``: the
#: TMA loads A into A_hi's box and the consumer splits it into both)
KSTEP = 32
BOX_BYTES = TILE * KSTEP * 4
STAGE_BYTES = 4 * BOX_BYTES
#: fewest ring stages worth launching (the H100's 227 KiB per block hold 3)
MIN_STAGES = 2
# ``config.mm_interleave``: ``mm``'s two consumer warpgroups on the tensor cores at once, their
# tiles' K steps interleaved in the ring (the kernel's ring bit 9), instead of the ping-pong of
# whole tiles the fused passes use: a consumer's wait for its promoted chunk then hides under
# the other's MMAs.  The same arithmetic in the same order either way (the same bits); False
# for the benchmark's before / after (bench_tf32_mm.py)


# the kernels' one parameter, ``WsTf32Launch`` (tiles_ws_tf32.cu): ``tiling.launch_blob``'s
# layout (four 128-byte tensor maps, the packed TileArgs<float> at byte 512, the ring after
# it; 768 bytes)


class TF32TilesUnavailable(RuntimeError):
    """The TF32 tiles cannot run here (not a compute-capability 9.0 GPU, no tensor maps, or
    too little shared memory for two ring stages)."""


def available() -> bool:
    """Whether the TF32x3 tiles can run on the current device: compute capability 9.0
    (the kernel is built for sm_90a) and a driver that encodes tensor maps; False without a
    CUDA device or driver (the cuBLAS paths that run instead raise their own error)."""
    try:
        return kernels.arch_specific_build(FILE) and tma.available()
    except RuntimeError:  # (CuPy's CUDARuntimeError: no device / driver)
        return False


def ring(static_smem: int, smem_max: int) -> Optional[Tuple[int, int]]:
    """(stages, dynamic shared memory) of the kernel with ``static_smem`` bytes of static
    shared memory and ``smem_max`` per block (opt-in); None where 2 stages do not fit."""
    st = min(config.current().ws_max_stages, (smem_max - static_smem - 1024) // STAGE_BYTES)
    return (st, 1024 + st * STAGE_BYTES) if st >= MIN_STAGES else None


def padded(x):
    """The float32 matrix ``x`` contiguous with its columns zero-padded to a multiple of 4 (the
    tensor maps want 16-byte rows; zeros add nothing to the products): ``x`` itself when it
    already is."""
    import cupy as cp

    rows, d = x.shape
    dp = -(-d // 4) * 4
    if dp == d:
        return cp.ascontiguousarray(x)
    xp = cp.zeros((rows, dp), np.float32)
    xp[:, :d] = x
    return xp


def split(x, name: str = "x"):
    """``(hi, lo)`` of the float32 matrix ``x`` (:func:`cublas.split_tf32`) as :func:`padded`
    lays it out."""
    rows, d = x.shape
    return cublas.split_tf32(x if d % 4 == 0 else padded(x), name)


def split_t_shape(x) -> tuple:
    """The shape of each half :func:`split_t` gives for ``x`` (rows, d): (d, rows rounded up
    to a multiple of 4)."""
    rows, d = x.shape
    return d, -(-rows // 4) * 4


def split_t(x, name: str = "x", out=None):
    """:func:`split` of xᵀ, as :func:`padded` lays it out (``cpn_split_tf32_t_f32``: x read
    once, no transposed copy): the K-major B operand of a product against x's columns.
    ``x`` (rows, d) float32 with unit column stride (else copied first).  ``out``: the two
    halves to write, contiguous float32 of :func:`split_t_shape` (``Products.prefetch``
    allocates them on one stream and splits on another); else allocated here."""
    import cupy as cp

    if x.ndim == 2 and x.shape[1] > 1 and x.strides[1] != 4:
        if out is not None:  # (a split on a side stream must allocate nothing there)
            raise ValueError(f"split_t: {name} with out= needs unit column stride, got "
                             f"strides {x.strides}")
        x = cp.ascontiguousarray(x)  # (the kernel reads rows with unit column stride)
    rows, _ = x.shape
    d, rp = shape = split_t_shape(x)
    hi, lo = out if out is not None else (cp.empty(shape, np.float32),
                                          cp.empty(shape, np.float32))
    if hi.size:
        kern = kernels.get_function("products/blas.cu", "cpn_split_tf32_t_f32")
        kern((-(-rp // 32), -(-d // 32)), (256,), (x, np.int64(leading_dim(x, name)), hi,
                                                    lo, np.int32(rows), np.int32(rp),
                                                    np.int32(d)))
    return hi, lo


def kernel(mode: str = "lse"):
    """The kernel of ``mode`` (lse, lse2, h, mm, mmt) on the current device and (its static shared
    memory, the opt-in maximum), opted in as the 16-bit warp-specialised kernels are
    (:func:`tiling.ws_smem`)."""
    kern = kernels.get_function(FILE, f"cpn_wstile_{mode}_tf32x3")
    return kern, ws_smem(kern)


def launch(mode: str, parts, grid, raw: bytes, ring_flags: int = 0) -> None:
    """Launch ``cpn_wstile_<mode>_tf32x3`` over the split operands ``parts`` = (A_hi, A_lo,
    B_hi, B_lo) (``mm``: A_lo unread, A itself in A_hi's place; ``mmt``: the stored (K x M)
    matrix of A there, mapped in 32 x 32 boxes) with the packed
    :data:`tiling.TILE_ARGS_FORMAT` arguments ``raw``; ``ring_flags`` or-ed into the ring
    argument (``1 << 9``: ``mm``'s interleaved consumers)."""
    kern, _ = kernel(mode)
    maps = [tile_map(x, 32 if mode == "mmt" and i == 0 else TILE)
            for i, x in enumerate(parts)]
    launch_packed(kern, f"cpn_wstile_{mode}_tf32x3", maps, grid, raw, ring_flags)


def launch_packed(kern, name: str, maps, grid, raw: bytes, ring_flags: int = 0,
                  tail: bytes = b"") -> None:
    """Launch the split-operand tile kernel ``kern`` (``name`` for the errors) with its one
    768-byte argument: the four tensor ``maps`` at 0, 128, 256, 384, the packed TileArgs
    ``raw`` at ``tiling.LAUNCH_ARGS_AT``, the ring (stages | ``ring_flags``, int32) after it,
    then ``tail`` (the F16x3 kernels' fields), zero-padded to ``tiling.LAUNCH_BYTES`` -- the
    layout the kernels' static_asserts hold (``WsTf32Launch``, ``WsF16Launch``).  Both
    kernels' stages are :data:`STAGE_BYTES`."""
    info = ws_smem(kern)
    rg = ring(*info)
    if rg is None:
        raise TF32TilesUnavailable(f"{name}: {info[1]} bytes of shared memory per block hold "
                                   f"fewer than {MIN_STAGES} ring stages")
    if any(mp is None for mp in maps):
        raise TF32TilesUnavailable(f"{name}: the driver refused a tensor map")
    kern(tuple(grid), (WS_THREADS,),
         (launch_blob(maps, raw, rg[0] | ring_flags, tail),), shared_mem=rg[1])


def args(a_hi, b_hi, *, rows: int, n1: int, d: int, scale: float, scale_log=None,
          part=(0, 0, 0), pos_out=0, colp=(0, 0), lse_row=None, lse_col=None,
          weights=(None, 0, 0.0), g=None, exclude_diag: bool = False, row0: int = 0,
          pos_shift: int = 0, pos_mod: int = 1, tri: bool = False) -> bytes:
    """The packed TileArgs<float> of a TF32x3 launch (B1 only: B2 is B1's map)."""
    ld = leading_dim
    w_arr, w_stride, w_mul = weights
    return pack_tile_args(
        a_hi.data.ptr, b_hi.data.ptr, b_hi.data.ptr, ptr(scale_log), part[0], part[1], pos_out,
        colp[0], colp[1], ptr(lse_row), ptr(lse_col), ptr(w_arr), ptr(g), 0, 0, 0,
        ld(a_hi), ld(b_hi), ld(b_hi), part[2], w_stride, 0 if g is None else ld(g),
        rows, row0, n1, 0, d, int(exclude_diag), pos_shift, pos_mod, int(tri), scale, w_mul)


def mm(a, bt_parts, out, alpha: float = 1.0, splits: Optional[int] = None,
       accumulate: bool = False, trans_a: bool = False, k_split: bool = False):
    """``out = alpha · op(A) Bᵀ`` (``accumulate``: ``+ out``) on the TF32x3 tiles (A split in
    shared memory, three TF32 products per 32-wide K step, promoted to an fp32 register sum,
    scaled by 1 + CPN_TF32X3_TRUNC: the mean truncation loss).

    ``a`` float32 with 16-byte rows (unit column stride, leading dimension a multiple of 4,
    16-byte aligned, as ``losses.nt_xent_tf32.h_block`` writes it): (m, k), op(A) = A;
    ``trans_a``: (k, m) as stored, op(A) = Aᵀ (the ``mmt`` kernel reads it in 32 x 32 boxes and its consumers
    transpose them in shared memory: no transposed copy; the same hi / lo, the same
    products in the same order, so the same bits as ``mm`` of a transposed copy).
    ``bt_parts`` = (B_hi, B_lo) (c, k) (:func:`split`) -- both K-major, as TF32 wgmma wants
    --, ``out`` (m, c) float32 with an even leading dimension; ``accumulate``: each element
    read, added to (round to nearest) and stored by one thread (a product summed over row
    blocks in a fixed order).  ``k_split``: K may run split (:func:`k_splits`; the caller
    opts in for a product of few output tiles and long K, a row block's dA = G·B: a split
    of a large output would only add its partials' memory and pass).  Returns ``out``."""
    b_hi, b_lo = bt_parts
    k, m = a.shape if trans_a else a.shape[::-1]
    c = b_hi.shape[0]
    if k > b_hi.shape[1] or out.shape[0] < m or out.shape[1] < c:
        raise ValueError(f"tf32x3.mm: a {a.shape}{' (transposed)' if trans_a else ''}, b "
                         f"{b_hi.shape} (K at least a's) and out {out.shape} (at least "
                         f"({m}, {c})) do not fit together")
    if a.dtype != np.float32 or a.strides[1] != 4 or leading_dim(a) % 4 \
            or a.data.ptr % 16:
        raise ValueError(f"tf32x3.mm: a must be float32 with 16-byte rows, got {a.dtype} "
                         f"strides {a.strides}")
    if leading_dim(out) % 2 or out.strides[1] != 4:
        raise ValueError(f"tf32x3.mm: out needs an even leading dimension, got strides "
                         f"{out.strides}")
    rt, ct = -(-m // TILE), -(-c // TILE)
    ks = k_splits(-(-b_hi.shape[1] // KSTEP)) if k_split else 1
    # (MODE_MM reads TileArgs' tri as its accumulate flag.)  K split: grid z = the split, each
    # CTA's partial tile into its slice of `slices` (TileArgs' part_ld: their stride,
    # no accumulate), then their sum in z order (+ out) into out
    g, slices, part = out, None, (0, 0, 0)
    if ks > 1:
        import cupy as cp

        ldp = c + (c & 1)  # (the store wants an even leading dimension)
        slices = cp.empty((ks, m, ldp), np.float32)
        g, part = slices[0], (0, 0, m * ldp)
    if splits is None:
        splits = grid_splits(rt * ks, ct)
    raw = args(a, b_hi, rows=m, n1=c, d=b_hi.shape[1], scale=alpha, g=g, part=part,
               tri=accumulate and ks == 1)
    launch("mmt" if trans_a else "mm", (a, a, b_hi, b_lo), (rt, splits, ks), raw,
           (1 << 9) if config.current().mm_interleave else 0)
    if slices is not None:
        kernels.launch("products/blas.cu", "mm_sum_splits", np.float32,
                       (-(-m * c // kernels.BLOCK),),
                       (slices, np.int64(m * ldp), np.int32(ks), np.int64(ldp), out,
                        np.int64(leading_dim(out)), np.int64(m), np.int32(c),
                        np.int32(accumulate)))
    return out


#: fewest K steps (of :data:`KSTEP`) a K split takes: 64 x 32 = 2048 of K
K_SPLIT_STEPS = 64
#: shortest K that is split at all: the smallest measured to gain.  float32 InfoNCE at
#: D = 384 on an H200 (a rank's share of P = 2, forward + backward): 8 splits 1.18x faster at
#: N = 65536 and 2.4x at 262144, but 2-8 % slower at N = 8192-32768 (the grid is full
#: there; the partials' sum and launches cost more than they give)
K_SPLIT_MIN_K = 65536


def k_splits(k_steps: int) -> int:
    """How many K splits :func:`mm` runs a product of ``k_steps`` K steps in: 1 for a K
    shorter than :data:`K_SPLIT_MIN_K`, else up to ``config.mm_k_splits``, each of at least
    :data:`K_SPLIT_STEPS` steps -- from K alone, so that a product's bits depend neither on
    its rows (the row blocks a workspace gives) nor on the GPU.  A split puts more CTAs on a
    product whose output has few tiles (a row block's dA = G·B: (rows / 128) x ceil(D / 128)
    tiles, K = N); 1 leaves K whole."""
    if k_steps * KSTEP < K_SPLIT_MIN_K:
        return 1
    return max(1, min(config.current().mm_k_splits, k_steps // K_SPLIT_STEPS))
