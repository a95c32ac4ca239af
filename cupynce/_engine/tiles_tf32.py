"""Float32 score tiles on Hopper's tensor cores (``kernels_src/tiles_ws_tf32.cu``, issue 24):
a prototype, not wired into any op (the float32 ops keep cuBLAS, ``blas.float32_precision``).

Each float32 operand is split x = hi + lo (:func:`blas.split_tf32`: hi = x rounded to TF32,
lo = x - hi exactly) and the warp-specialised tile walk of ``tile_ws.cuh`` computes
S = lo_a·hi_b + hi_a·lo_b + hi_a·hi_b with TF32 wgmma, adding each 32-wide K step's chunk to
an fp32 register sum with round-to-nearest adds: Hopper's tensor cores truncate when they
accumulate, which makes cuBLAS's 3xTF32 (one long accumulation) 3-13x less accurate than
fp32; the promoted chunks are not (docs/notes.md, issue 24).  The LSE epilogue, its outputs
and the finishing kernel are the 16-bit tiles' (``tiles.tile_lse``).

Prototype limits: LSE only (no gradient block, no LSE2 / CLIP / SigLIP), no second column
matrix (InfoNCE's per-query negatives), no A-resident ring, sm_90a only.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from . import blas, kernels, tiles, tma
from .kernels import BFLOAT16, BLOCK

FILE = "tiles_ws_tf32.cu"
KERNEL = "cpn_wstile_lse_tf32x3"
#: K elements per ring stage (WS_TF32_KSTEP: one 128-byte swizzled row of float32) and the
#: stage: four 128 x 32 float32 boxes, A_hi | A_lo | B_hi | B_lo
KSTEP = 32
STAGE_BYTES = 4 * tiles.TILE * KSTEP * 4
#: fewest ring stages worth launching (the H100's 227 KiB per block hold 3)
MIN_STAGES = 2


class TF32TilesUnavailable(RuntimeError):
    """The TF32 tiles cannot run here (not a compute-capability 9.0 GPU, no tensor maps, or
    too little shared memory for two ring stages)."""


def available() -> bool:
    """Whether :func:`tile_lse_tf32x3` can run on the current device: compute capability 9.0
    (the kernel is built for sm_90a) and a driver that encodes tensor maps."""
    return kernels.arch_specific_build(FILE) and tma.available()


def ring(static_smem: int, smem_max: int) -> Optional[Tuple[int, int]]:
    """(stages, dynamic shared memory) of the kernel with ``static_smem`` bytes of static
    shared memory and ``smem_max`` per block (opt-in); None where 2 stages do not fit."""
    st = min(tiles.WS_MAX_STAGES, (smem_max - static_smem - 1024) // STAGE_BYTES)
    return (st, 1024 + st * STAGE_BYTES) if st >= MIN_STAGES else None


def split(x, name: str = "x"):
    """``(hi, lo)`` of the float32 matrix ``x`` (:func:`blas.split_tf32`), contiguous, with the
    columns zero-padded to a multiple of 4 (the tensor maps want 16-byte rows; zeros add
    nothing to the products)."""
    import cupy as cp

    rows, d = x.shape
    dp = -(-d // 4) * 4
    if dp != d:
        xp = cp.zeros((rows, dp), np.float32)
        xp[:, :d] = x
        x = xp
    return blas.split_tf32(x, name)


def _kernel():
    """The kernel on the current device and (its static shared memory, the opt-in maximum),
    opted in as the 16-bit warp-specialised kernels are (:func:`tiles.ws_smem`)."""
    kern = kernels.get_function(FILE, KERNEL)
    return kern, tiles.ws_smem(kern)


def _check(x, name: str):
    if getattr(x, "ndim", None) != 2 or x.dtype != np.float32:
        raise ValueError(f"tile_lse_tf32x3: {name} must be a 2-D float32 CuPy array, got "
                         f"{getattr(x, 'dtype', type(x))} of shape {getattr(x, 'shape', None)}")


def tile_lse_tf32x3(q, k, scale: float, *, neg_s=None, exclude_diag: bool = False,
                    pos_shift: int = 0, pos_mod: Optional[int] = None, scale_log=None,
                    splits: Optional[int] = None, positives: bool = False):
    """Row log-sum-exps and losses of the float32 scores ``scale · q kᵀ`` on the TF32x3 tiles.

    What :func:`tiles.tile_lse` computes for 16-bit inputs: ``lse_i = log sum_j exp(L_ij)``
    over the columns j of ``k`` (``exclude_diag``: j = i left out), L = s q kᵀ with
    s = ``scale`` (times exp(``scale_log[0]``) when that device scalar is given), and
    ``loss_i = lse_i - L_{i, p(i)}``, p(i) = (i + ``pos_shift``) mod ``pos_mod`` (default
    ``k.shape[0]``: the pairs i <-> i).  No score matrix in memory.

    Parameters
    ----------
    q : cupy.ndarray, (n, d) float32 (any row stride)
    k : cupy.ndarray, (m, d) float32; ``q`` itself (the same view) is split once
    scale : float
    neg_s : None
        InfoNCE's extra negatives: not supported by the prototype (``NotImplementedError``).
    exclude_diag, pos_shift, pos_mod, scale_log :
        As :func:`tiles.tile_lse`.
    splits : int, optional
        Column splits of the grid (default :func:`tiles.grid_splits`; for tests).
    positives : bool
        Also return the positive logits ``L_{i, p(i)}`` the kernel wrote (its products,
        rounded once to float32: what the tests measure the products' accuracy on).

    Returns
    -------
    lse, loss : cupy.ndarray, (n,) float32
    pos : cupy.ndarray, (n,) float32, with ``positives`` (rows whose p(i) is not a column of
        ``k`` hold garbage, as their loss does)

    Notes
    -----
    Scratch: the hi / lo copies of q and k (2 x their size in float32, 4 x when k is not q)
    and the (2, splits, n) partials.  Deterministic (fixed orders throughout).  Raises
    :class:`TF32TilesUnavailable` off Hopper (compute capability 9.0) or without tensor maps.
    """
    if neg_s is not None:
        raise NotImplementedError("tile_lse_tf32x3: no second column matrix (neg_s) in the "
                                  "prototype (tiles_ws_tf32.cu reads B1 only)")
    _check(q, "q")
    _check(k, "k")
    n, d = q.shape
    m = k.shape[0]
    if k.shape[1] != d:
        raise ValueError(f"tile_lse_tf32x3: q is {q.shape} and k {k.shape}: the same d expected")
    if n == 0 or m == 0 or d == 0:
        raise ValueError(f"tile_lse_tf32x3: empty operands q {q.shape}, k {k.shape}")
    if max(n, m) >= 2 ** 31 - tiles.TILE:
        raise ValueError(f"tile_lse_tf32x3: {max(n, m)} rows: at most 2^31 - 129")
    if not available():
        raise TF32TilesUnavailable(
            "tile_lse_tf32x3 needs a compute-capability 9.0 GPU (Hopper: the kernel is built "
            "for sm_90a) and a CUDA driver that encodes tensor maps")
    q_hi, q_lo = split(q, "q")
    same = (k.data.ptr == q.data.ptr and k.shape == q.shape and k.strides == q.strides)
    k_hi, k_lo = (q_hi, q_lo) if same else split(k, "k")
    return lse_split((q_hi, q_lo, k_hi, k_lo), scale, exclude_diag=exclude_diag,
                     pos_shift=pos_shift, pos_mod=pos_mod, scale_log=scale_log, splits=splits,
                     positives=positives)


def lse_split(parts, scale: float, *, exclude_diag: bool = False, pos_shift: int = 0,
              pos_mod: Optional[int] = None, scale_log=None, splits: Optional[int] = None,
              positives: bool = False):
    """:func:`tile_lse_tf32x3` from operands already split: ``parts`` = (q_hi, q_lo, k_hi,
    k_lo) as :func:`split` gives them (contiguous float32, columns a multiple of 4).  The
    kernel and the finish alone (benchmarks time them apart from the split)."""
    import cupy as cp

    q_hi, _, k_hi, _ = parts
    n, dp = q_hi.shape
    m = k_hi.shape[0]
    kern, info = _kernel()
    rg = ring(*info)
    if rg is None:
        raise TF32TilesUnavailable(f"tile_lse_tf32x3: {info[1]} bytes of shared memory per "
                                   f"block hold fewer than {MIN_STAGES} ring stages")
    pos_mod = m if pos_mod is None else pos_mod
    maps = [tiles._tile_map(x) for x in parts]
    if any(mp is None for mp in maps):
        raise TF32TilesUnavailable("tile_lse_tf32x3: the driver refused a tensor map")
    rt, ct = -(-n // tiles.TILE), -(-m // tiles.TILE)
    if splits is None:
        splits = tiles.grid_splits(rt, ct)
    f32 = np.dtype(np.float32)
    part = cp.empty((2, splits, n), f32)
    part_s = part.data.ptr + 4 * splits * n  # the sums' half
    pos = cp.empty((n,), f32)
    ptr = tiles.ptr
    raw = tiles._pack_tile_args(
        q_hi.data.ptr, k_hi.data.ptr, k_hi.data.ptr, ptr(scale_log), part.data.ptr, part_s,
        pos.data.ptr, 0, 0, 0, 0, 0, 0, 0,
        dp, dp, dp, n, 0, 0,
        n, 0, m, 0, dp, int(exclude_diag), pos_shift, pos_mod, 0,
        scale, 0.0)
    args = np.frombuffer(raw, tiles.TILE_ARGS_DTYPE)
    kern((rt, splits), (tiles.WS_THREADS,), (*maps, args, np.int32(rg[0])), shared_mem=rg[1])
    lse = cp.empty((n,), f32)
    loss = cp.empty((n,), f32)
    # tiles.cu's finish (float32 partials in and out: the dtype only names the wrapper)
    kernels.launch(tiles.FILE, "tile_finish", BFLOAT16, (-(-n // BLOCK),),
                   (part, part_s, np.int64(n), np.int32(splits), np.int32(n), pos, lse, loss))
    return (lse, loss, pos) if positives else (lse, loss)
