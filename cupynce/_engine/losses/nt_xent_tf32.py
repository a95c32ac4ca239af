"""Float32 NT-Xent on Hopper's tensor cores (``kernels_src/products/tiles_ws_tf32.cu``, issue 24): the
loss path of the float32 precisions "auto" (from ``config.tf32x3_min_rows`` x
``tf32x3_min_dim``) and "3xtf32" for NT-Xent (:func:`applies`, :func:`rows`, routed from
``_engine.rows``); its products are ``gemm.tf32x3``'s.

Each float32 operand is split x = hi + lo (``gemm.cublas.split_tf32``: hi = x rounded to TF32,
lo = x - hi exactly) and the warp-specialised tile walk of ``tile_ws.cuh`` computes
S = lo_a·hi_b + hi_a·lo_b + hi_a·hi_b with TF32 wgmma, adding each 32-wide K step's chunk to
an fp32 register sum with round-to-nearest adds: Hopper's tensor cores truncate when they
accumulate, which makes cuBLAS's 3xTF32 (one long accumulation) 3-13x less accurate than
fp32; the promoted chunks are not (docs/notes.md, issue 24).

NT-Xent's float32 step (:func:`rows`): the statistics (:func:`lse_symmetric`, each pair of
score tiles once; finished into each row's (M, log2 S) pair), then the gradient block
H = G + Gᵀ in float32 -- from the raw scores the statistics pass kept in H's buffer
(:func:`h_from_s`, elementwise) when the whole H fits the workspace and the gradient is
computed in the same call, else recomputed by the ``h`` pass (:func:`h_block`, in row
blocks) -- and dz = H z on the same promoted product tiles (:func:`mm`, A split by its
consumers in shared memory, against zᵀ split).  Accuracy choices, float32 only (the 16-bit
kernels' code is unchanged, their outputs bit for bit): logits in base 2 through s·log2(e)
held in two floats; the rows' partials kept in base 2 and merged by
``cpn_tf32x3_finish[_tri]`` into each row's (M, log2 S) pair, which H reads so that
t - lse = (t - M) - log2 S and P - 1 at the positive comes from expm1 (the float32 gradient
is a difference of nearly equal terms: that, not the products, sets its error); the losses
from the tiles' own base-2 positive logits.  Measured (H100, N = 16384, D = 512, t = 0.07):
dz 7.2e-6 and lse 1.4e-7 relative against float64, cuBLAS fp32's path 1.7e-5 / 3.0e-7; at
small shapes the split operands' 22 bits cost more than fp32's accumulation loses, hence
``config.tf32x3_min_rows``.

Limits: NT-Xent's symmetric problem only (no shared or per-query negatives, no learnable
scale: a ``group=`` NT-Xent's own diagonal block qualifies, its cross-rank blocks stay on
cuBLAS, ``_engine.cross``), sm_90a only.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from ... import config
from .. import arrays, kernels, tiling
from ..arrays import leading_dim
from ..gemm import tf32x3
from ..kernels import BLOCK
from ..tiling import TILE, grid_splits
from ..workspace import plan_rows, workspace_cap
from .stats import pair_dots

FILE = tf32x3.FILE  # (the fused passes are kernels of the TF32x3 tiles' file)


def _check(x, name: str):
    if getattr(x, "ndim", None) != 2 or x.dtype != np.float32:
        raise ValueError(f"tile_lse_tf32x3: {name} must be a 2-D float32 CuPy array, got "
                         f"{getattr(x, 'dtype', type(x))} of shape {getattr(x, 'shape', None)}")


def tile_lse_tf32x3(q, k, scale: float, *, neg_s=None, exclude_diag: bool = False,
                    pos_shift: int = 0, pos_mod: Optional[int] = None, scale_log=None,
                    splits: Optional[int] = None, positives: bool = False):
    """Row log-sum-exps and losses of the float32 scores ``scale · q kᵀ`` on the TF32x3 tiles.

    What :func:`score_tiles.tile_lse` computes for 16-bit inputs: ``lse_i = log sum_j exp(L_ij)``
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
        InfoNCE's extra negatives: not supported (B1 only) (``NotImplementedError``).
    exclude_diag, pos_shift, pos_mod, scale_log :
        As :func:`score_tiles.tile_lse`.
    splits : int, optional
        Column splits of the grid (default :func:`tiling.grid_splits`; for tests).
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
    :class:`gemm.tf32x3.TF32TilesUnavailable` off Hopper (compute capability 9.0) or without
    tensor maps.
    """
    if neg_s is not None:
        raise NotImplementedError("tile_lse_tf32x3: no second column matrix (neg_s) in the "
                                  "TF32x3 tiles (tiles_ws_tf32.cu reads B1 only)")
    _check(q, "q")
    _check(k, "k")
    n, d = q.shape
    m = k.shape[0]
    if k.shape[1] != d:
        raise ValueError(f"tile_lse_tf32x3: q is {q.shape} and k {k.shape}: the same d expected")
    if n == 0 or m == 0 or d == 0:
        raise ValueError(f"tile_lse_tf32x3: empty operands q {q.shape}, k {k.shape}")
    if max(n, m) >= 2 ** 31 - TILE:
        raise ValueError(f"tile_lse_tf32x3: {max(n, m)} rows: at most 2^31 - 129")
    if not tf32x3.available():
        raise tf32x3.TF32TilesUnavailable(
            "tile_lse_tf32x3 needs a compute-capability 9.0 GPU (Hopper: the kernel is built "
            "for sm_90a) and a CUDA driver that encodes tensor maps")
    q_hi, q_lo = tf32x3.split(q, "q")
    same = (k.data.ptr == q.data.ptr and k.shape == q.shape and k.strides == q.strides)
    k_hi, k_lo = (q_hi, q_lo) if same else tf32x3.split(k, "k")
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
    rt, ct = -(-n // TILE), -(-m // TILE)
    if splits is None:
        splits = grid_splits(rt, ct)
    f32 = np.dtype(np.float32)
    part = cp.empty((2, splits, n), f32)
    pos2 = cp.empty((n,), f32)
    raw = tf32x3.args(q_hi, k_hi, rows=n, n1=m, d=dp, scale=scale, scale_log=scale_log,
                      part=(part.data.ptr, part[1].data.ptr, n), pos_out=pos2.data.ptr,
                      exclude_diag=exclude_diag, pos_shift=pos_shift, pos_mod=pos_mod)
    tf32x3.launch("lse", parts, (rt, splits), raw)
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


def lse_symmetric(z, parts, scale: float, pos_shift: int, s_out=None):
    """NT-Xent's row statistics on the TF32x3 tiles with each pair of score tiles computed once
    (the ``lse2`` pass + ``cpn_tf32x3_finish_tri``: :func:`score_tiles.tile_lse_symmetric`'s
    schedule).  ``z`` (n, d) float32 rows, ``parts`` = its :func:`split`, ``pos_shift`` = n / 2.
    The column shifts are the positive dots z_i · z_{i + n/2} in float32 (``paired_dots``; a
    shift only: the positives' logits for the losses are the tiles').  ``s_out``: an (n, n)
    float32 view with 16-byte rows that also receives the raw scores z_i · z_j, every tile
    and its mirror (for :func:`h_from_s`).  Returns (lse, loss, ml) as :func:`_finish`."""
    import cupy as cp

    z_hi, z_lo = parts
    n = z.shape[0]
    dp = z_hi.shape[1]
    f32 = np.dtype(np.float32)
    half = pos_shift
    ct = -(-n // TILE)
    splits = grid_splits(ct, ct // 2 + 1)
    part = cp.empty((2, splits, n), f32)
    colp = cp.empty((2, ct, n), f32)
    pd = pair_dots(z[:half], z[half:])  # dots[i] = dots[i + half] = z_i . z_{i + half}
    dots = cp.empty((n,), f32)  # (two device copies, not cp.concatenate: no CuPy kernel)
    dots[:half].data.copy_from_device_async(pd.data, pd.nbytes)
    dots[half:].data.copy_from_device_async(pd.data, pd.nbytes)
    # written for the rows whose tile held the positive; NaN marks the others
    pos2 = arrays.fill(cp.empty((n,), f32), np.nan)
    raw = tf32x3.args(z_hi, z_hi, rows=n, n1=n, d=dp, scale=scale,
                      part=(part.data.ptr, part[1].data.ptr, n),
                      colp=(colp.data.ptr, colp[1].data.ptr),
                      pos_out=pos2.data.ptr, lse_col=dots, g=s_out, exclude_diag=True,
                      pos_shift=half, pos_mod=n, tri=True)
    tf32x3.launch("lse2", (z_hi, z_lo, z_hi, z_lo), (ct, splits), raw)
    return _finish(part, splits, n, pos2, colp, half)


def h_block(parts, ml, scale: float, pos_shift: int, weights, *, tri: bool = True,
            row0: int = 0, rows: Optional[int] = None, out=None):
    """NT-Xent's gradient block H = scale (W P + (W P)ᵀ - pairs), float32, of the rows
    ``row0 .. row0 + rows`` (default: all) of the split rows ``parts`` (n, dp) against all n:
    a (rows, n) view of a (rows, ldg) buffer (ldg = n rounded up to 4: 16-byte rows for the
    product's tensor map), or of ``out`` when given.  ``ml``: the rows' (M, log2 S) pairs
    (:func:`_finish`, :func:`ml_from_lse`).  ``tri`` (all rows only): each pair of tiles once,
    the mirror written too."""
    import cupy as cp

    z_hi, z_lo = parts
    n, dp = z_hi.shape
    rows = n - row0 if rows is None else rows
    if tri and (row0 or rows != n):
        raise ValueError("h_block: tri needs the whole block (row0 = 0, rows = n)")
    ldg = -(-n // 4) * 4
    h = (cp.empty((rows, ldg), np.float32) if out is None else out)[:rows, :n]
    ct, rt = -(-n // TILE), -(-rows // TILE)
    splits = grid_splits(rt, ct // 2 + 1 if tri else ct)
    a_hi, a_lo = z_hi[row0:row0 + rows], z_lo[row0:row0 + rows]
    raw = tf32x3.args(a_hi, z_hi, rows=rows, n1=n, d=dp, scale=scale, lse_row=ml, lse_col=ml,
                      weights=weights, g=h, exclude_diag=True, row0=row0, pos_shift=pos_shift,
                      pos_mod=n, tri=tri)
    tf32x3.launch("h", (a_hi, a_lo, z_hi, z_lo), (rt, splits), raw)
    return h


def h_pair(parts, ml, scale: float, pos_shift: int, weights, rows: Tuple[int, int],
           cols: Tuple[int, int], out):
    """NT-Xent's gradient block H[r0:r1, c0:c1] (:func:`h_block`'s H, every index global) as
    an (r1 - r0, c1 - c0) view of ``out``: the ``h`` pass over the split rows r0 .. r1 against
    the rows c0 .. c1, the rows' block of a :func:`rows` pair schedule.  The kernel indexes
    columns from 0: it runs in a frame shifted by c0 -- its rows r - c0 (negative above the
    diagonal block), the (M, log2 S) pairs and the weights read from index c0 on (one pointer
    serves the rows and the columns), the positive (i + pos_shift) mod n shifted alike (pos_shift
    + n keeps the kernel's remainder non-negative) -- so the diagonal test (col == row) and the
    positives' fall where they do globally.  A diagonal block (r0 = c0, r1 = c1) computes each
    pair of its tiles once and writes the mirror (H = Hᵀ)."""
    z_hi, z_lo = parts
    n, dp = z_hi.shape
    (r0, r1), (c0, c1) = rows, cols
    nr, nc = r1 - r0, c1 - c0
    tri = (r0, r1) == (c0, c1)
    h = out[:nr, :nc]
    rt, ct = -(-nr // TILE), -(-nc // TILE)
    splits = grid_splits(rt, ct // 2 + 1 if tri else ct)
    w_arr, w_stride, w_mul = weights
    shifted = ml.data.ptr + c0 * ml.strides[0]
    raw = tf32x3.args(z_hi[r0:r1], z_hi[c0:c1], rows=nr, n1=nc, d=dp, scale=scale,
                      lse_row=shifted, lse_col=shifted,
                      weights=(tiling.shifted(w_arr, w_stride, c0), w_stride, w_mul),
                      g=h, exclude_diag=True, row0=r0 - c0, pos_shift=pos_shift + n, pos_mod=n,
                      tri=tri)
    tf32x3.launch("h", (z_hi[r0:r1], z_lo[r0:r1], z_hi[c0:c1], z_lo[c0:c1]), (rt, splits), raw)
    return h


def pair_rows(n: int, cap: int) -> int:
    """Rows of the square blocks of the pair schedule (:func:`rows`): the fewest blocks whose
    float32 (R, R) fits ``cap`` bytes, R balanced over them and a multiple of the tile (0: not
    even one 128 x 128 tile fits)."""
    r_max = (math.isqrt(cap // 4) // TILE) * TILE
    if r_max == 0:
        return 0
    per_block = -(-n // -(-n // r_max))
    return min(r_max, -(-per_block // TILE) * TILE)


#: rows of ``cpn_tf32x3_h_from_s``'s grid (CUDA caps y at 65535; each block then loops over
#: rows y, y + this, ...; a test lowers it to cover the loop)
H_FROM_S_GRID_Y = 65535


def h_from_s(s_block, ml, scale: float, pos_shift: int, weights):
    """NT-Xent's gradient block H from the raw scores the symmetric forward stored
    (:func:`lse_symmetric` with ``s_out``), in place: ``cpn_tf32x3_h_from_s``, every element
    in the H tiles' accurate float32 form.  ``s_block`` (n, n) view with 16-byte rows;
    ``ml``, ``weights`` as :func:`h_block`.  Returns ``s_block``, now H."""
    n = s_block.shape[0]
    w_arr, w_stride, w_mul = weights
    kern = kernels.get_function(FILE, "cpn_tf32x3_h_from_s")
    kern((-(-n // (4 * BLOCK)), min(n, H_FROM_S_GRID_Y)), (BLOCK,),
         (s_block, np.int64(leading_dim(s_block)), np.int32(n), np.int32(pos_shift), ml,
          w_arr if w_arr is not None else np.uint64(0), np.int64(w_stride), np.float32(w_mul),
          np.float32(scale)))
    return s_block


def ml_from_lse(lse):
    """The (M, log2 S) pairs :func:`h_block` reads, from natural row log-sum-exps alone (the
    recompute backward): lse log2(e) in float64 split into its float32 rounding and the
    remainder, so that the pair's sum is the base-2 lse to float64 accuracy."""
    import cupy as cp

    l2 = lse.astype(np.float64) * (1.0 / math.log(2.0))
    m = l2.astype(np.float32)
    return cp.stack((m, (l2 - m).astype(np.float32)), axis=1)


# ``config.tf32x3_min_rows`` / ``tf32x3_min_dim``: "auto" takes the tiles only from these
# sizes on: rows n = 2B and columns d where they were measured at least as accurate as the
# fp32 path, loss (per row) and gradient (H100, 2026-11-26, unit rows, t = 0.1, two seeds a shape, docs/notes.md).  Below, the TF32x3
# operands' 22 bits (hi and the TF32 part of lo) cost more than fp32's accumulation loses:
# per-row losses 6e-8 against fp32's 5e-8 at d <= 32 for every n up to 4096, dz up to
# 1.25x fp32's at n <= 1536 (mean reduction); from n = 2048, d >= 64 every case measured
# was at or below fp32's (n = 2048, d = 64: dz 2.21e-7 against 2.27e-7, the thinnest margin),
# so the threshold takes one more doubling of n.  "3xtf32" takes the tiles at every size.


def applies(q, k, neg_s, *, exclude_diag: bool, pos_shift: int, pos_mod: int, self_pair: bool,
            scale_log) -> bool:
    """Whether :func:`rows` takes this row-softmax problem: NT-Xent's symmetric one (the keys
    are the queries, the diagonal excluded, i <-> i + n/2, no shared negatives or learnable
    scale) on float32 rows, the float32 precision in effect "3xtf32", or "auto" from
    ``config.tf32x3_min_rows`` x ``tf32x3_min_dim`` on, a Hopper GPU with tensor maps, and the
    tiles not switched off (``config.tiles`` False, ``CUPYNCE_TILES=0``: the cuBLAS row blocks, as
    for 16-bit inputs)."""
    n, d = q.shape
    cfg = config.current()
    if not (cfg.tiles is not False and q.dtype == np.float32 and self_pair
            and neg_s is None and exclude_diag and scale_log is None and pos_mod == n
            and 2 * pos_shift == n and n >= 2):
        return False
    mode = cfg.float32_precision
    if mode == "auto":
        return n >= cfg.tf32x3_min_rows and d >= cfg.tf32x3_min_dim and tf32x3.available()
    return mode == "3xtf32" and tf32x3.available()


def rows(q, scale: float, *, pos_shift: int, lse_in, weights, want_grad: bool,
         workspace_bytes, op: str, symmetric: bool = True):
    """NT-Xent's row statistics and gradient accumulator of the float32 rows ``q`` (n, d) on
    the TF32x3 tiles: what :func:`score_tiles.rows` returns, ``lse, loss, (dq, dq, None, None)``
    (dq = dk: the keys are the queries; loss None with ``lse_in``).

    The statistics: the symmetric ``lse2`` pass (each pair of score tiles once; ``symmetric``
    False: the square ``lse`` pass, for tests), finished into each row's (M, log2 S) pair, or
    those pairs from ``lse_in`` (:func:`ml_from_lse`).  The gradient: H in float32 (4 · ldg
    bytes a row, ``plan_rows`` under ``workspace_bytes``) -- when the whole H is one
    block and the statistics run in this call, from the raw scores the ``lse2`` pass kept in
    its buffer (:func:`h_from_s`), else by the ``h`` pass in row blocks (mirrored tiles when
    one block holds all of H) --, then dq[block] = H[block] q (``mm``, against qᵀ split).
    Above the workspace (the symmetric statistics), H goes in square blocks H[I, J], J >= I,
    of R rows (:func:`pair_rows`; R x R float32 in the workspace): each computed once
    (:func:`h_pair`, a diagonal block's pairs of tiles once) and used twice, as H is symmetric:
    dq[I] += H[I, J] q[J] (``mm``) and dq[J] += H[I, J]ᵀ q[I] (``mmt``, for J > I), each
    dq block first written, then accumulated in the fixed order of the loop: half the
    recomputed scores of row blocks of H, the same product work.
    Scratch besides H: q and qᵀ split (4 n d floats)."""
    import cupy as cp

    n, d = q.shape
    f32 = np.dtype(np.float32)
    parts = tf32x3.split(q, "q")
    ldg = -(-n // 4) * 4
    rb = plan_rows(op, n, 4 * ldg, workspace_bytes, align=TILE) if want_grad else 0
    # the fused step with the whole H in the workspace: the forward keeps the scores in H's
    # buffer and H is computed from them elementwise (no second pass over the products)
    keep_s = want_grad and lse_in is None and symmetric and rb >= n
    pr = pair_rows(n, workspace_cap(workspace_bytes)) if want_grad and symmetric \
        and rb < n else 0
    h_buf = (cp.empty((pr, pr), f32) if pr else cp.empty((rb, ldg), f32)) if want_grad else None
    loss = None
    if lse_in is not None:
        lse, ml = lse_in, ml_from_lse(lse_in)
    elif symmetric:
        lse, loss, ml = lse_symmetric(q, parts, scale, pos_shift,
                                      s_out=h_buf[:, :n] if keep_s else None)
    else:
        lse, loss, _, ml = _lse_square(parts + parts, scale, exclude_diag=True,
                                       pos_shift=pos_shift, pos_mod=n)
    if not want_grad:
        return lse, loss, (None, None, None, None)
    qt = tf32x3.split_t(q, "q")  # (d, n): K-major for the product
    de = d + d % 2  # (the product's paired stores want an even leading dimension)
    dq = cp.empty((n, de), f32)
    if keep_s:
        tf32x3.mm(h_from_s(h_buf[:, :n], ml, scale, pos_shift, weights), qt, dq)
    elif pr:
        edges = list(range(0, n, pr)) + [n]
        spans = list(zip(edges[:-1], edges[1:]))
        written = [False] * len(spans)
        for bi, (r0, r1) in enumerate(spans):
            for bj in range(bi, len(spans)):
                c0, c1 = spans[bj]
                h = h_pair(parts, ml, scale, pos_shift, weights, (r0, r1), (c0, c1), h_buf)
                tf32x3.mm(h, (qt[0][:, c0:c1], qt[1][:, c0:c1]), dq[r0:r1],
                          accumulate=written[bi])
                written[bi] = True
                if bj != bi:
                    tf32x3.mm(h, (qt[0][:, r0:r1], qt[1][:, r0:r1]), dq[c0:c1],
                              accumulate=written[bj], trans_a=True)
                    written[bj] = True
    else:
        tri = symmetric and rb >= n
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            h = h_block(parts, ml, scale, pos_shift, weights, tri=tri, row0=r0, rows=r1 - r0,
                        out=h_buf)
            tf32x3.mm(h, qt, dq[r0:r1])
    if de != d:
        dq = cp.ascontiguousarray(dq[:, :d])
    return lse, loss, (dq, dq, None, None)


def nt_xent(z, scale: float, weights, *, want_grad: bool = True, symmetric: bool = True,
            workspace_bytes=None):
    """NT-Xent's (lse, loss, dz) of the float32 rows ``z`` (2B, d) on the TF32x3 tiles
    (:func:`rows`; ``weights`` as :func:`score_tiles.rows` takes them); dz is the gradient w.r.t.
    ``z`` itself (before any normalisation's finish)."""
    lse, loss, (dz, *_) = rows(z, scale, pos_shift=z.shape[0] // 2, lse_in=None,
                               weights=weights, want_grad=want_grad,
                               workspace_bytes=workspace_bytes, op="nt_xent",
                               symmetric=symmetric)
    return lse, loss, dz
