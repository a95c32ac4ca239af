"""Float32 score tiles on Hopper's tensor cores (``kernels_src/tiles_ws_tf32.cu``, issue 24):
not yet wired into any op (the float32 ops keep cuBLAS, ``blas.float32_precision``).

Each float32 operand is split x = hi + lo (:func:`blas.split_tf32`: hi = x rounded to TF32,
lo = x - hi exactly) and the warp-specialised tile walk of ``tile_ws.cuh`` computes
S = lo_a·hi_b + hi_a·lo_b + hi_a·hi_b with TF32 wgmma, adding each 32-wide K step's chunk to
an fp32 register sum with round-to-nearest adds: Hopper's tensor cores truncate when they
accumulate, which makes cuBLAS's 3xTF32 (one long accumulation) 3-13x less accurate than
fp32; the promoted chunks are not (docs/notes.md, issue 24).

What runs: :func:`tile_lse_tf32x3` / :func:`lse_split` (the square LSE pass), and NT-Xent's
whole float32 step, :func:`nt_xent` -- :func:`lse_symmetric` (each pair of score tiles once),
:func:`h_block` (H = G + Gᵀ written as its own split H_hi + H_lo) and :func:`mm` (dz = H z on
the same promoted product tiles, against zᵀ split).  Accuracy choices, float32 only (the
16-bit kernels' code is unchanged, their outputs bit for bit): logits in base 2 through
s·log2(e) held in two floats; the rows' partials kept in base 2 and merged by
``cpn_tf32x3_finish[_tri]`` into each row's (M, log2 S) pair, which H reads so that
t - lse = (t - M) - log2 S and P - 1 at the positive comes from expm1 (the float32 gradient
is a difference of nearly equal terms: that, not the products, sets its error); the losses
from the tiles' own base-2 positive logits.  Measured (H100, N = 16384, D = 512, t = 0.07):
dz 7.2e-6 and lse 1.4e-7 relative against float64, cuBLAS fp32's path 1.7e-5 / 3.0e-7.

Limits: B1 only (no shared negatives, no per-query ones), no A-resident ring, sm_90a only; the
symmetric H needs the whole (n, n) split block (8 n² bytes: 2 GiB at n = 16384, no row blocks).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from . import blas, blocks, kernels, tiles, tma
from .kernels import BLOCK

FILE = "tiles_ws_tf32.cu"
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


def _kernel(mode: str = "lse"):
    """The kernel of ``mode`` (lse, lse2, h, mm) on the current device and (its static shared
    memory, the opt-in maximum), opted in as the 16-bit warp-specialised kernels are
    (:func:`tiles.ws_smem`)."""
    kern = kernels.get_function(FILE, f"cpn_wstile_{mode}_tf32x3")
    return kern, tiles.ws_smem(kern)


def _launch(mode: str, parts, grid, raw: bytes) -> None:
    """Launch ``cpn_wstile_<mode>_tf32x3`` over the split operands ``parts`` = (A_hi, A_lo,
    B_hi, B_lo) with the packed :data:`tiles.TILE_ARGS_FORMAT` arguments ``raw``."""
    kern, info = _kernel(mode)
    rg = ring(*info)
    if rg is None:
        raise TF32TilesUnavailable(f"cpn_wstile_{mode}_tf32x3: {info[1]} bytes of shared "
                                   f"memory per block hold fewer than {MIN_STAGES} ring stages")
    maps = [tiles._tile_map(x) for x in parts]
    if any(mp is None for mp in maps):
        raise TF32TilesUnavailable(f"cpn_wstile_{mode}_tf32x3: the driver refused a tensor map")
    args = np.frombuffer(raw, tiles.TILE_ARGS_DTYPE)
    kern(tuple(grid), (tiles.WS_THREADS,), (*maps, args, np.int32(rg[0])), shared_mem=rg[1])


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
        Also return the positive logits ``L_{i, p(i)}`` the kernel wrote (its products in
        base 2, rounded once to float32, times ln 2 in float64: what the tests measure the
        products' accuracy on).

    Returns
    -------
    lse, loss : cupy.ndarray, (n,) float32
    pos : cupy.ndarray, (n,) float64, with ``positives`` (rows whose p(i) is not a column of
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
    lse, loss, pos2, _ = _lse_square(parts, scale, exclude_diag=exclude_diag,
                                     pos_shift=pos_shift, pos_mod=pos_mod, scale_log=scale_log,
                                     splits=splits)
    if not positives:
        return lse, loss
    # the kernel's positives are base-2 logits: natural ones in float64 (no second rounding)
    return lse, loss, pos2.astype(np.float64) * math.log(2.0)


def _lse_square(parts, scale: float, *, exclude_diag: bool, pos_shift: int,
                pos_mod: Optional[int], scale_log=None, splits: Optional[int] = None):
    """The square ``lse`` pass and :func:`_finish`: (lse, loss, pos2, ml)."""
    import cupy as cp

    q_hi, _, k_hi, _ = parts
    n, dp = q_hi.shape
    m = k_hi.shape[0]
    pos_mod = m if pos_mod is None else pos_mod
    rt, ct = -(-n // tiles.TILE), -(-m // tiles.TILE)
    if splits is None:
        splits = tiles.grid_splits(rt, ct)
    f32 = np.dtype(np.float32)
    part = cp.empty((2, splits, n), f32)
    pos2 = cp.empty((n,), f32)
    raw = _args(q_hi, k_hi, rows=n, n1=m, d=dp, scale=scale, scale_log=scale_log,
                part=(part.data.ptr, part[1].data.ptr, n), pos_out=pos2.data.ptr,
                exclude_diag=exclude_diag, pos_shift=pos_shift, pos_mod=pos_mod)
    _launch("lse", parts, (rt, splits), raw)
    lse, loss, ml = _finish(part, splits, n, pos2)
    return lse, loss, pos2, ml


def _finish(part, splits: int, n: int, pos2, colp=None, half: int = 0):
    """``cpn_tf32x3_finish`` (``_tri`` with the column partials ``colp``): the rows' partials
    merged in base 2 to (lse, loss, ml) -- ml (n, 2) float32: each row's (M, log2 S), what
    :func:`h_block` reads.  Returns (lse, loss, ml)."""
    import cupy as cp

    f32 = np.dtype(np.float32)
    lse, loss = cp.empty((n,), f32), cp.empty((n,), f32)
    ml = cp.empty((n, 2), f32)
    grid = (-(-n // BLOCK),)
    if colp is None:
        kern = kernels.get_function(FILE, "cpn_tf32x3_finish")
        kern(grid, (BLOCK,), (part, part[1], np.int64(n), np.int32(splits), np.int32(n), pos2,
                              lse, loss, ml))
    else:
        kern = kernels.get_function(FILE, "cpn_tf32x3_finish_tri")
        kern(grid, (BLOCK,), (part, part[1], np.int64(n), np.int32(splits), np.int32(n), colp,
                              colp[1], pos2, np.int32(half), lse, loss, ml))
    return lse, loss, ml


def _args(a_hi, b_hi, *, rows: int, n1: int, d: int, scale: float, scale_log=None,
          part=(0, 0, 0), pos_out=0, colp=(0, 0), lse_row=None, lse_col=None,
          weights=(None, 0, 0.0), g=None, g_lo=None, exclude_diag: bool = False,
          pos_shift: int = 0, pos_mod: int = 1, tri: bool = False) -> bytes:
    """The packed TileArgs<float> of a TF32x3 launch (B1 only: B2 is B1's map)."""
    ld, ptr = blas.leading_dim, tiles.ptr
    w_arr, w_stride, w_mul = weights
    return tiles._pack_tile_args(
        a_hi.data.ptr, b_hi.data.ptr, b_hi.data.ptr, ptr(scale_log), part[0], part[1], pos_out,
        colp[0], colp[1], ptr(lse_row), ptr(lse_col), ptr(w_arr), ptr(g), ptr(g_lo),
        ld(a_hi), ld(b_hi), ld(b_hi), part[2], w_stride, 0 if g is None else ld(g),
        rows, 0, n1, 0, d, int(exclude_diag), pos_shift, pos_mod, int(tri), scale, w_mul)


def lse_symmetric(z, parts, scale: float, pos_shift: int):
    """NT-Xent's row statistics on the TF32x3 tiles with each pair of score tiles computed once
    (the ``lse2`` pass + ``cpn_tf32x3_finish_tri``: :func:`tiles.tile_lse_symmetric`'s
    schedule).  ``z`` (n, d) float32 rows, ``parts`` = its :func:`split`, ``pos_shift`` = n / 2.
    The column shifts are the positive dots z_i · z_{i + n/2} in float32 (``paired_dots``; a
    shift only: the positives' logits for the losses are the tiles').  Returns (lse, loss, ml)
    as :func:`_finish`."""
    import cupy as cp

    z_hi, z_lo = parts
    n = z.shape[0]
    dp = z_hi.shape[1]
    f32 = np.dtype(np.float32)
    half = pos_shift
    ct = -(-n // tiles.TILE)
    splits = tiles.grid_splits(ct, ct // 2 + 1)
    part = cp.empty((2, splits, n), f32)
    colp = cp.empty((2, ct, n), f32)
    pd = blocks.pair_dots(z[:half], z[half:])  # dots[i] = dots[i + half] = z_i . z_{i + half}
    dots = cp.concatenate((pd, pd))
    pos2 = cp.full((n,), np.nan, f32)  # written for the rows whose tile held the positive
    raw = _args(z_hi, z_hi, rows=n, n1=n, d=dp, scale=scale,
                part=(part.data.ptr, part[1].data.ptr, n), colp=(colp.data.ptr, colp[1].data.ptr),
                pos_out=pos2.data.ptr, lse_col=dots, exclude_diag=True, pos_shift=half,
                pos_mod=n, tri=True)
    _launch("lse2", (z_hi, z_lo, z_hi, z_lo), (ct, splits), raw)
    return _finish(part, splits, n, pos2, colp, half)


def h_block(parts, ml, scale: float, pos_shift: int, weights, *, tri: bool = True):
    """NT-Xent's gradient block H = scale (W P + (W P)ᵀ - pairs) of the split rows ``parts``
    (n, dp) as its own TF32 split: ``(H_hi, H_lo)``, (n, n) float32 views of (n, ldg) buffers
    (ldg = n rounded up to 4).  ``ml``: the rows' (M, log2 S) from the statistics' finish
    (:func:`_finish`).  ``tri``: each pair of tiles once, the mirror written too."""
    import cupy as cp

    z_hi, z_lo = parts
    n, dp = z_hi.shape
    ldg = -(-n // 4) * 4
    f32 = np.dtype(np.float32)
    h_hi = cp.empty((n, ldg), f32)[:, :n]
    h_lo = cp.empty((n, ldg), f32)[:, :n]
    ct = -(-n // tiles.TILE)
    splits = tiles.grid_splits(ct, ct // 2 + 1 if tri else ct)
    raw = _args(z_hi, z_hi, rows=n, n1=n, d=dp, scale=scale, lse_row=ml, lse_col=ml,
                weights=weights, g=h_hi, g_lo=h_lo, exclude_diag=True, pos_shift=pos_shift,
                pos_mod=n, tri=tri)
    _launch("h", (z_hi, z_lo, z_hi, z_lo), (ct, splits), raw)
    return h_hi, h_lo


def mm(a_parts, bt_parts, out, alpha: float = 1.0, splits: Optional[int] = None):
    """``out = alpha · A Bᵀ`` on the TF32x3 tiles (three TF32 products per 32-wide K step,
    promoted to an fp32 register sum): ``a_parts`` = (A_hi, A_lo) (m, k), ``bt_parts`` =
    (B_hi, B_lo) (c, k) -- both K-major, as TF32 wgmma wants --, ``out`` (m, c) float32 with
    a leading dimension of even length.  Returns ``out``."""
    a_hi, a_lo = a_parts
    b_hi, b_lo = bt_parts
    m, k = a_hi.shape
    c = b_hi.shape[0]
    rt, ct = -(-m // tiles.TILE), -(-c // tiles.TILE)
    if splits is None:
        splits = tiles.grid_splits(rt, ct)
    raw = _args(a_hi, b_hi, rows=m, n1=c, d=k, scale=alpha, g=out)
    _launch("mm", (a_hi, a_lo, b_hi, b_lo), (rt, splits), raw)
    return out


def nt_xent(z, scale: float, weights, *, want_grad: bool = True, symmetric: bool = True):
    """NT-Xent's (lse, loss, dz) of the float32 rows ``z`` (2B, d) on the TF32x3 tiles: the
    statistics (symmetric ``lse2`` or square ``lse`` pass), then H (``h``, mirrored tiles) and
    dz = H z (``mm``, against zᵀ split).  ``weights`` as :func:`tiles.rows` takes them; dz is
    the gradient w.r.t. ``z`` itself (before any normalisation's finish)."""
    import cupy as cp

    n, d = z.shape
    half = n // 2
    parts = split(z, "z")
    if symmetric:
        lse, loss, ml = lse_symmetric(z, parts, scale, half)
    else:
        lse, loss, _, ml = _lse_square(parts + parts, scale, exclude_diag=True,
                                       pos_shift=half, pos_mod=n)
    if not want_grad:
        return lse, loss, None
    h = h_block(parts, ml, scale, half, weights, tri=symmetric)
    zt = split(cp.ascontiguousarray(z.T), "z")  # (d, n): K-major for the product
    dz = cp.empty((n, d), np.float32)
    mm(h, zt, dz)
    return lse, loss, dz
