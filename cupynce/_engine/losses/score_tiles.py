"""The score tiles: the 16-bit loss path whose scores never reach memory
(``kernels_src/losses/tiles.cu``, ``tiles_ws.cu``): planning and launches.

Float16 / bfloat16 operands whose D, leading dimensions and pointers are multiples of 8
elements / 16 bytes (``tiling.tiles_ok``) run fused score tiles: each 128 x 128 tile of S = A Bᵀ
is computed on the tensor cores and consumed in registers by an epilogue (row / column
log-sum-exp partials, or the 16-bit gradient block), so the scores never reach memory.  Two
main loops: wgmma (Hopper, tiles.cu built for sm_90a) and mma.sync (sm_80+).  The gradient
products (G · K, Gᵀ · Q) stay cuBLAS calls (``gemm.cublas``).

* :func:`rows` — NT-Xent / InfoNCE without per-query negatives (NT-Xent's symmetric schedules
  computing each pair of tiles once);
* :func:`clip` — CLIP's row and column statistics in one pass, then its gradient block;
* :func:`siglip`, :func:`cross` — SigLIP's pairs; a global NT-Xent's off-diagonal block;
* :func:`tile` — one launch of a stage (the shared plumbing is ``tiling``).

On Hopper the stages of ``config.ws_stages`` run the warp-specialised kernels of
``tiles_ws.cu`` (issue 23: a TMA producer warpgroup and two consumer warpgroups ping-ponging
whole tiles, the same epilogues) where :func:`ws_launch` can encode the tensor maps;
``config.ws_tiles`` switches them off (the cp.async wgmma loop then runs, as before).

The switches (:mod:`cupynce.config`) and what they were measured at:

* ``tiles`` (env ``CUPYNCE_TILES``): unset / ``auto`` uses the tiles where their wgmma main
  loop is built (compute capability 9.0: Hopper, sm_90a), which is faster than cuBLAS + row
  kernels there (docs/design.md); ``1`` also on other sm_80+ GPUs (mma.sync main loop,
  slower than the cuBLAS path, kept for testing); ``0`` never.  The same switch selects
  SPLADE's fused forward (``_engine/splade.py``) and the float32 TF32x3 / F16x3 tiles.
* ``wgmma``: on Hopper, the wgmma main loop (False: the mma.sync one, so tests can cover both).
* ``ws_tiles`` (env ``CUPYNCE_WSTILE=0``: off), ``ws_stages``: the stages the
  warp-specialised kernels run (SPLADE's max keeps its own kernels).
* ``ws_ar_min_stages``: the ring keeps A resident (the CTA's 128 rows x D loaded once, a ring
  of 16 KiB B boxes) where that leaves at least this many stages, else 32 KiB (A + B) stages,
  as many as fit (at most ``ws_max_stages``, the kernel's WS_MAX_STAGES).  On an H100
  (prototype, LSE, D = 512) A resident with 6 stages: 0.347 ms at N = 16384 against 0.391 for
  6 A + B stages.  H100, bf16, N = 16384, D = 512, GPU time of back-to-back calls
  (2026-11-27): A resident with 5 stages against 6 A + B stages, NT-Xent's symmetric lse2
  352 -> 314 µs (an A + B stage is 64 FLOP / byte of L2 reads, A resident 128); with 4,
  siglip 740 -> 716, g unchanged; with 3, h slower (366 -> 427 µs), clip unchanged (then with
  16 KiB staging): hence 4.  Measured at D = 512 only (at D = 640 lse now takes A resident
  with 4 stages instead of 7 A + B).
* ``symmetric_lse`` / ``symmetric_lse_min_nd``: NT-Xent's forward computes each pair of score
  tiles once (S = Z Zᵀ is symmetric: row and column partials of half the tiles, see
  :func:`tile_lse_symmetric`) when N · D >= the minimum and its column partials,
  8 · N · ceil(N / 128) bytes, fit the workspace; its row + column epilogue costs more per
  tile than the row-only one, so it pays where the products dominate.  Measured on an H100
  (bf16, forward + backward, square -> symmetric): D = 512: N = 65536 34.3 -> 30.6 ms, 32768
  8.54 -> 7.72, 16384 2.17 -> 2.09, 8192 0.65 -> 0.68; D = 256: 65536 22.0 -> 21.6, 32768
  5.54 -> 5.53, 16384 1.48 -> 1.54, 8192 0.47 -> 0.54; hence N = 16384 at D = 512.
* ``symmetric_h``: NT-Xent's gradient pass computes each pair of H = G + Gᵀ tiles once and
  writes the tile and its mirror when the whole 16-bit H fits the workspace in one block
  (N ≲ 23000 with the default 1 GiB).  H100, bf16, D = 512, forward + backward: N = 16384
  2.17 -> 1.90 ms, 8192 0.65 -> 0.58; D = 256: 1.48 -> 1.46, 0.47 -> 0.46.
* ``tile_workspace_bytes`` (env ``CUPYNCE_TILE_WORKSPACE_MIB``, default 256 MiB): CLIP's and
  SigLIP's budget for each phase's scratch when the caller gives no ``workspace_bytes``: the
  forward's column partials and the backward's 16-bit score-gradient blocks (rows × columns,
  ``_plan_2d``).  The phases do not overlap (the forward's scratch goes back to the pool
  first), so the peak is about this plus the float32 gradient accumulators: H100, bf16,
  D = 512, CLIP N = 65536 514 MiB (1538 with the general 1 GiB cap and whole-row blocks),
  131072 774 MiB (2565), at +2-3 % time (the accumulating products); SigLIP 514 / 779 MiB
  (769 / 1026) at the same time.  No free-memory query (a driver call) is made for it.
  NT-Xent and InfoNCE keep the general cap: their symmetric passes and single gradient
  product are worth it (measured: a 256 MiB cap cost 5 % at N = 65536 and 17 % at 131072).
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ... import config
from .. import kernels, side, tail
from ..arrays import buffers, fixed_sums, leading_dim, pair_weights, ptr
from ..gemm import cublas
from ..kernels import BLOCK
from ..tiling import (TILE, TILE_ARGS_DTYPE, WS_THREADS, grid_splits, launch_blob,
                      pack_tile_args, shifted, tile_launch, tile_map, wgmma, ws_smem)
from ..tma import available as tma_available
from ..workspace import fits, plan_rows
from .stats import FAR_MOD
from .stats import FILE as ROWS_FILE  # (the statistics kernels between the tiles)

FILE = "losses/tiles.cu"

WS_FILE = "losses/tiles_ws.cu"
#: the stages that stage the 16-bit gradient block through ``WS_SOUT_BYTES`` of shared memory
#: per consumer warpgroup (SigLIP's loss alone writes none: no staging, see ws_ring)
_WS_SOUT = frozenset({"g", "h", "clip", "siglip"})
#: staging of the gradient block per consumer warpgroup (WS_SOUT_BYTES in tile_ws.cuh): 1 KiB
#: a warp, so that g, clip and siglip keep A resident at D = 512 (H100, bf16, N = 16384, GPU
#: time, 2026-11-27, against 16 KiB a warpgroup: clip 586 -> 547 µs, siglip 714 -> 678,
#: g unchanged); h stages 64 x 128 a warpgroup (``WS_SOUT_BYTES_H``): its mirror staged per
#: warp, 16 rows, came in 32-byte runs (347 -> 368-378 µs), and staging 64 or 32 columns at a
#: time (room for A resident) or TMA stores of 64 x 64 blocks measured within 3 % of this
#: (h tri 0.386-0.403 ms, 2026-11-27): dropped
WS_SOUT_BYTES = 4 * 1024
WS_SOUT_BYTES_H = 16 * 1024

def _plan(op: str, rows: int, bytes_per_row: int, workspace_bytes: Optional[int]) -> int:
    """Rows of a tile-path block: ``plan_rows`` under the caller's workspace, or under
    ``config.tile_workspace_bytes`` when none is given."""
    cap = config.current().tile_workspace_bytes if workspace_bytes is None else workspace_bytes
    return plan_rows(op, rows, bytes_per_row, cap, align=TILE)


def _plan_2d(op: str, rows: int, cols: int, itemsize: int,
             workspace_bytes: Optional[int]) -> Tuple[int, int]:
    """(rows, columns) of the gradient blocks G[r0:r1, c0:c1] of CLIP / SigLIP under the
    workspace (``config.tile_workspace_bytes`` when none is given).

    Each block's products accumulate: dA's rows over the column blocks, dB's over the row
    blocks — every extra block re-reads and re-writes a float32 (·, D) slice, so the blocks
    are chosen with as few of them as fit: whole rows when they do, else the column count
    (a divisor-like split of the columns, multiple of 128) that minimises the row blocks plus
    the column blocks.  At N = 65536, D = 512, bf16, 256 MiB: 8 × 4 blocks of 8192 × 16384
    rather than 32 row blocks of 2048 (≈ 2.7 GB of accumulator traffic instead of ≈ 8 GB)."""
    cap = config.current().tile_workspace_bytes if workspace_bytes is None else workspace_bytes
    ld = -(-cols // 8) * 8
    if rows * ld * itemsize <= cap:
        return rows, cols
    best, prev = None, 0
    for k in range(1, -(-cols // TILE) + 1):  # k column blocks
        cb = -(-cols // (k * TILE)) * TILE
        if cb == prev:
            continue
        prev = cb
        rb = _plan(op, rows, cb * itemsize, workspace_bytes)
        cost = -(-rows // rb) + -(-cols // cb)
        if best is None or cost < best[0]:
            best = (cost, rb, cb)
        if rb >= rows:
            break
    return best[1], best[2]


def tile(stage: str, t, grid, a, row0: int, b1, b2, *, scale: float = 1.0, scale_log=None,
         exclude_diag: bool = False, pos_shift: int = 0, pos_mod: int = 1,
         part=(0, 0, 0), pos_out=0, colp=(0, 0), lse_row=None, lse_col=None,
         weights=(None, 0, 0.0), g=None, dsp=0, tri: bool = False, labels=(0, 0)) -> None:
    """Launch ``cpn_tile_<stage>`` over rows ``a`` (global row ``row0`` first) x columns b1|b2.
    ``labels``: CLIP's (row, column) int64 label pointers (``lse2`` / ``clip``; 0: none), the
    row labels read at the global row, the column labels at the column: given, the stage's
    ``_lab`` kernel runs (the plain kernels compile the label code out)."""
    rows, d = a.shape
    w_arr, w_stride, w_mul = weights
    n2 = 0 if b2 is None else b2.shape[0]
    b2 = b1 if b2 is None else b2
    ld = leading_dim
    raw = pack_tile_args(
        a.data.ptr, b1.data.ptr, b2.data.ptr, ptr(scale_log), part[0], part[1], pos_out,
        colp[0], colp[1], ptr(lse_row), ptr(lse_col), ptr(w_arr), ptr(g), dsp,
        labels[0], labels[1], ld(a), ld(b1), ld(b2), part[2], w_stride, 0 if g is None else ld(g),
        rows, row0, b1.shape[0], n2, d, int(exclude_diag), pos_shift, pos_mod, int(tri),
        scale, w_mul)
    lab = bool(labels[0])
    if stage in config.current().ws_stages and wstile() and ws_launch(
            stage, t, grid, a, b1, b2, n2, raw, block=g is not None, lab=lab):
        return
    tile_launch(FILE, stage + "_lab" if lab else stage, t, grid,
                (np.frombuffer(raw, TILE_ARGS_DTYPE),))


def wstile() -> bool:
    """Whether the tile stages of ``config.ws_stages`` run on ``tiles_ws.cu`` (Hopper, the
    wgmma loop in use, the driver encodes tensor maps) unless :func:`ws_launch` declines a
    call."""
    return config.current().ws_tiles and wgmma() and tma_available()


def ws_ring(stage: str, d: int, static_smem: int, smem_max: int,
            block: bool = True) -> Optional[Tuple[int, int]]:
    """(ring argument, dynamic shared memory) of ``cpn_wstile_<stage>`` for D = ``d``, with
    ``static_smem`` bytes of static shared memory and ``smem_max`` per block (opt-in): the
    ring of tile_ws.cuh (stages | A resident << 8) under ``config.ws_ar_min_stages``; None where not
    even 2 stages fit.  The stages of ``_WS_SOUT`` stage the gradient block after the ring
    (the kernel places nothing else there); ``block`` False (SigLIP's loss alone: no g, the
    one mode whose staging depends on g, as in tile_epilogue.cuh) drops it, so those bytes go
    to the ring."""
    kt = -(-d // 64)
    sout = 0
    if stage in _WS_SOUT and (block or stage != "siglip"):
        sout = 2 * (WS_SOUT_BYTES_H if stage == "h" else WS_SOUT_BYTES)
    budget = smem_max - static_smem - 1024 - sout  # (1 KiB: aligning the swizzled boxes)
    cfg = config.current()
    ar = min(cfg.ws_max_stages, budget // 16384 - kt)
    if ar >= cfg.ws_ar_min_stages:
        return ar | 256, 1024 + (kt + ar) * 16384 + sout
    st = min(cfg.ws_max_stages, budget // 32768)
    return (st, 1024 + st * 32768 + sout) if st >= 2 else None


def ws_launch(stage: str, t, grid, a, b1, b2, n2: int, raw: bytes, block: bool = True,
              lab: bool = False) -> bool:
    """Launch ``cpn_wstile_<stage>`` of ``tiles_ws.cu`` with the packed TileArgs ``raw``
    (``block``: they give a gradient block, see ws_ring; ``lab``: its ``_lab`` kernel, CLIP's
    labels in ``raw``, the same ring); False (nothing launched) where it
    does not apply: B2's columns after n1 % 8 != 0 for a stage writing the gradient block (its
    16-byte stores would straddle n1), row coordinates past 2^31 - 128, a tensor map the
    driver refuses, or no ring that fits."""
    n1 = b1.shape[0]
    if n2 and stage in _WS_SOUT and block and n1 % 8:
        return False
    if max(a.shape[0], n1, n2) >= 2 ** 31 - TILE:
        return False
    ta, tb1 = tile_map(a), tile_map(b1)
    tb2 = tile_map(b2) if n2 else tb1
    if ta is None or tb1 is None or tb2 is None:
        return False
    kern = kernels.get_kernel(WS_FILE, f"wstile_{stage}_lab" if lab else f"wstile_{stage}", t)
    ring = ws_ring(stage, a.shape[1], *ws_smem(kern), block=block)
    if ring is None:
        return False
    kern(tuple(grid), (WS_THREADS,), (launch_blob((ta, tb1, tb2, tb2), raw, ring[0]),),
         shared_mem=ring[1])
    return True


def tile_lse(q, k, neg_s, scale: float, *, exclude_diag: bool, pos_shift: int, pos_mod: int,
             scale_log=None):
    """Row log-sum-exps and losses ``lse_i - s q_i.k_pos(i)`` with no score matrix in memory."""
    import cupy as cp

    t, f32 = q.dtype, np.dtype(np.float32)
    n = q.shape[0]
    ncols = k.shape[0] + (0 if neg_s is None else neg_s.shape[0])
    rt, ct = -(-n // TILE), -(-ncols // TILE)
    splits = grid_splits(rt, ct)
    part = cp.empty((2, splits, n), f32)
    part_s = part.data.ptr + 4 * splits * n  # the sums' half (a pointer: no view)
    pos = cp.empty((n,), f32)
    tile("lse", t, (rt, splits), q, 0, k, neg_s, scale=scale, scale_log=scale_log,
         exclude_diag=exclude_diag,
          pos_shift=pos_shift, pos_mod=pos_mod,
          part=(part.data.ptr, part_s, n), pos_out=pos.data.ptr)
    lse = cp.empty((n,), f32)
    loss = cp.empty((n,), f32)
    kernels.launch(FILE, "tile_finish", t, (-(-n // BLOCK),),
           (part, part_s, np.int64(n), np.int32(splits), np.int32(n), pos, lse, loss))
    return lse, loss


def tile_lse_symmetric(z, scale: float, pos_shift: int, workspace_bytes):
    """NT-Xent's row log-sum-exps and losses with each pair of score tiles computed once.

    S = Z Zᵀ is symmetric, so the column sums of tile (I, J) are the row sums of tile (J, I).
    Row tile I takes the tiles I + o (mod CT) for o < ``tri_count(I)`` (tiles.cu: every
    unordered pair once, every CTA about CT / 2 tiles); the ``lse2`` pass writes the row
    partials of those tiles and the column partials of the off-diagonal ones (shifted by each
    column's positive logit, ``paired_dots``), and ``tile_finish_tri`` merges, for each row,
    its row partials and the column partials of the tiles that covered it, in a fixed order.
    About half the tensor-core work of the square pass.  Returns None (the caller runs the
    square pass) when the column partials, 8 · N · CT bytes, exceed the workspace.
    """
    import cupy as cp

    t, f32 = z.dtype, np.dtype(np.float32)
    n, d = z.shape
    ct = -(-n // TILE)
    if not fits(8 * n * ct, workspace_bytes):
        return None
    half = pos_shift  # NT-Xent: positive of row i is i + half (mod 2 half)
    cnt = ct // 2 + 1  # tiles of the busiest row tile
    splits = grid_splits(ct, cnt)
    # one scratch allocation (host time before the first kernel): dots (n) | part (2, splits,
    # n) | colp (2, ct, n).  The lse2 pass reads the column shift from lse_col: the positive
    # dot of every column, dots[i] = dots[i + half] = z_i . z_{i + half}
    scratch = cp.empty((n * (1 + 2 * splits + 2 * ct),), f32)
    dots = scratch[:n]
    part = scratch[n:n * (1 + 2 * splits)].reshape(2, splits, n)
    colp = scratch[n * (1 + 2 * splits):].reshape(2, ct, n)
    second = z[half:]
    if leading_dim(second) != d:
        second = cp.ascontiguousarray(second)
    kernels.launch(ROWS_FILE, "paired_dots", t, (-(-half * 32 // BLOCK),),
           (z, np.int64(leading_dim(z)), second, np.int32(half), np.int32(1),
            np.int32(d), dots, dots[half:]))  # (both halves: dots[i] = dots[i + half])
    tile("lse2", t, (ct, splits), z, 0, z, None, scale=scale, exclude_diag=True,
          pos_shift=pos_shift, pos_mod=n, part=(part.data.ptr, part[1].data.ptr, n),
          colp=(colp.data.ptr, colp[1].data.ptr), lse_col=dots, tri=True)
    lse = cp.empty((n,), f32)
    loss = cp.empty((n,), f32)
    kernels.launch(FILE, "tile_finish_tri", t, (-(-n // 32),),
           (part, part[1], np.int64(n), np.int32(splits), np.int32(n), colp, colp[1], dots,
            np.int32(half), np.float32(scale), lse, loss))
    return lse, loss


def self_symmetric(n: int, neg_s, exclude_diag: bool, pos_shift: int, pos_mod: int,
                   self_pair: bool, scale_log) -> bool:
    """NT-Xent's problem: S = Z Zᵀ over n rows, no extra negatives or learnable scale, and the
    pairing i <-> i + n/2 its own inverse, so S and H = G + Gᵀ are symmetric (each pair of
    tiles computed once: tiles.cu tri_count; H from S_ij alone: ``row_blocks.nt_xent_kept``)."""
    return (self_pair and neg_s is None and exclude_diag and pos_mod == n
            and 2 * pos_shift == n and scale_log is None)


def rows(q, k, neg_s, scale: float, *, exclude_diag: bool, pos_shift: int,
         pos_mod: int, lse_in, weights, want_grad: bool, workspace_bytes, op: str,
         self_pair: bool, scale_log=None, col_grads: bool = True):
    """:func:`row_blocks.rows` on the tile kernels (no per-query negatives).

    The gradient pass writes the 16-bit gradient block G (or, for NT-Xent, H = G + Gᵀ, which
    needs one product instead of two) straight from the tile registers, then cuBLAS
    multiplies it by the keys / queries.  ``col_grads=False`` (not with ``self_pair``): only
    dq = G [k | neg_s]; the column products Gᵀ q are skipped, dk and dns None.
    """
    import cupy as cp

    cfg = config.current()
    t, f32 = q.dtype, np.dtype(np.float32)
    n, d = q.shape
    nk = k.shape[0]
    ms = 0 if neg_s is None else neg_s.shape[0]
    ncols = nk + ms
    symmetric = self_symmetric(n, neg_s, exclude_diag, pos_shift, pos_mod, self_pair,
                               scale_log)
    stats = None
    if lse_in is not None:
        stats = lse_in, None
    elif symmetric and cfg.symmetric_lse and n * d >= cfg.symmetric_lse_min_nd:
        stats = tile_lse_symmetric(q, scale, pos_shift, workspace_bytes)
    if stats is None:
        stats = tile_lse(q, k, neg_s, scale, exclude_diag=exclude_diag, pos_shift=pos_shift,
                         pos_mod=pos_mod, scale_log=scale_log)
    lse, loss = stats
    if not want_grad:
        return lse, loss, (None, None, None, None)
    ldg = -(-ncols // 8) * 8  # 16-byte rows for the kernel's paired stores and cuBLAS
    rb = plan_rows(op, n, ldg * t.itemsize, workspace_bytes, align=TILE)
    if rb >= n and not tail.later_work():  # the statistics are final: what needs only
        # them may run beside (side.py); not where the caller's later work adds to the
        # products' outputs (tail.not_last: a capture's gather beside would read them early).
        # (One block only: its products are the call's last work, which a graph defers, so
        # no small output is written after this point; with several blocks the products of
        # the first ones run inside the graph, and a gather beside would read them early.)
        side.fork_point()
    g_buf = cp.empty((rb, ldg), t)
    dq = cp.empty((n, d), f32)
    cols = col_grads or self_pair
    dk = dq if self_pair else cp.empty((nk, d), f32) if cols else None  # first block: beta 0
    dns = cp.empty((ms, d), f32) if ms and cols else None
    ct = -(-ncols // TILE)
    tri = symmetric and cfg.symmetric_h and rb >= n  # all of H in one block: tiles mirrored
    for r0 in range(0, n, rb):
        r1 = min(n, r0 + rb)
        qb = q[r0:r1]
        g_blk = g_buf[:r1 - r0, :ncols]
        rt = -(-(r1 - r0) // TILE)
        splits = grid_splits(rt, ct // 2 + 1 if tri else ct)
        tile("h" if self_pair else "g", t, (rt, splits), qb, r0, k, neg_s,
             scale=scale, scale_log=scale_log, exclude_diag=exclude_diag,
             pos_shift=pos_shift, pos_mod=pos_mod, lse_row=lse, lse_col=lse, weights=weights,
             g=g_blk, tri=tri)

        def products(*o, r0=r0, r1=r1, qb=qb, g_blk=g_blk):
            it = iter(o)
            dq = next(it)
            dk = dq if self_pair else next(it) if cols else None
            dns = next(it) if ms and cols else None
            acc = 1.0 if r0 else 0.0
            cublas.gemm(g_blk[:, :nk], k, dq[r0:r1])
            if dk is not None and not self_pair:
                cublas.gemm(g_blk[:, :nk], qb, dk, trans_a=True, beta=acc)
            if ms:
                cublas.gemm(g_blk[:, nk:], neg_s, dq[r0:r1], beta=1.0)
                if dns is not None:
                    cublas.gemm(g_blk[:, nk:], qb, dns, trans_a=True, beta=acc)
        outs = (dq,) + tuple(x for x in (dk, dns) if x is not None and x is not dq)
        # (one block: the call's last work, which a graph may leave out, tail.py)
        tail.products(outs, products, last=rb >= n)
    return lse, loss, (dq, dk, dns, None)


def label_ranges(labels):
    """CLIP's labels for the tile kernels: the contiguous int64 labels and, for each index,
    the (min, max) of the labels' low 32 bits over its aligned 128-block (uint64, packed:
    ``cpn_label_ranges``), which lets a tile whose rows and columns cannot share a label
    skip the labels (``label_bits``)."""
    import cupy as cp

    lab = cp.ascontiguousarray(labels, dtype=np.int64)
    rng = cp.empty(lab.shape[0], np.uint64)
    if lab.shape[0]:
        kernels.get_function(ROWS_FILE, "cpn_label_ranges")(
            (-(-lab.shape[0] // 128),), (128,), (lab, np.int32(lab.shape[0]), rng))
    return lab, rng


def clip(an, bn, ls, *, lse_r, lse_c, weights, want_loss: bool, want_grad: bool,
         workspace_bytes, row0: int = 0, col_shift=None, col_state: bool = False,
         labels=None, positives: bool = True):
    """:func:`row_blocks.clip` on the tile kernels: row and column statistics in one pass.

    ``positives=False``: no pair in the block (a ring's chunk of another rank's texts): the
    rows numbered past the columns (no diagonal, no positive: G = ½ w (p_row + p_col)), the
    row losses None (``_engine.clip`` checks the rest of its arguments).

    ``col_shift`` (tiles only): the raw positive dots a_j·b_j of every column, which the
    column pass shifts its exponentials by (computed here when None: square problems).
    ``labels`` (the pair (row labels, column labels) of one array, indexed by the global row
    and by the column alike): the same-label scores off the positive leave both softmaxes
    and get no gradient, masked in the epilogues of both stages (``label_bits`` in
    tile_labels.cuh; :func:`label_ranges` lets most tiles skip the labels) as
    ``clip_mask`` masks the row blocks' scores.
    """
    import cupy as cp

    t, f32 = an.dtype, np.dtype(np.float32)
    n, d = an.shape
    nc = bn.shape[0]
    nt, ct = -(-n // TILE), -(-nc // TILE)
    # the rows' global numbering (the diagonal test, the per-row arrays' offsets) and the
    # positive's modulus: without positives, rows past every column and no positive at all
    base, pmod = (row0, nc) if positives else (nc, FAR_MOD)
    lab_r = lab_c = 0  # the label pointers (0: no labels)
    if labels is not None:  # (kept alive below: lab, rng)
        lab, rng = label_ranges(labels[1])
        lab_r, lab_c = ptr(rng), ptr(lab)
    pair_loss = state = None
    if want_loss:
        # column partials: one (m, s) pair per (row tile, column) of the rows in flight
        rg = _plan("clip_loss", n, -(-8 * nc // TILE), workspace_bytes)
        cpt = -(-rg // TILE)
        # the splits fill the GPU with one group's row tiles: a wide block (a rank's share
        # at global N = 4M has 1024-row groups) would otherwise launch a few CTAs a group
        splits = grid_splits(min(nt, cpt), ct)
        # one fp32 scratch allocation (allocations are host time before the first kernel):
        # dots (nc) | pos (n) | part (2, splits, n) | colp (2, cpt, nc); kernels get pointers
        scratch = cp.empty((nc + (1 + 2 * splits) * n + 2 * cpt * nc,), f32)
        dots, pos = scratch[:nc], scratch.data.ptr + 4 * nc
        part, part_s = pos + 4 * n, pos + 4 * n * (1 + splits)
        colp, colp_s = part + 8 * splits * n, part + 8 * splits * n + 4 * cpt * nc
        # running column state (m and s rows): several row groups, or the state asked for
        col_m = cp.empty((2, nc), f32) if rg < n or col_state else None
        cgrid = (-(-n // BLOCK),)
        if col_shift is None:
            # a_j . b_j: the kernel shifts column j's exponentials by its positive logit
            b_rows = bn if leading_dim(bn) == d else cp.ascontiguousarray(bn)
            kernels.launch(ROWS_FILE, "paired_dots", t, (-(-n * 32 // BLOCK),),
                   (an, np.int64(leading_dim(an)), b_rows, np.int32(n), np.int32(1),
                    np.int32(d), dots, 0))
        else:
            dots = col_shift
        for r0 in range(0, n, rg):
            r1 = min(n, r0 + rg)
            rt = -(-(r1 - r0) // TILE)
            tile("lse2", t, (rt, splits), an[r0:r1], base + r0, bn, None, scale_log=ls,
                  pos_mod=pmod, part=(part + 4 * r0, part_s + 4 * r0, n),
                  pos_out=pos + 4 * r0 if positives else 0, colp=(colp, colp_s),
                  lse_col=dots, labels=(lab_r, lab_c))
            if col_m is not None:  # fold into the running column state
                kernels.launch(ROWS_FILE, "col_combine", t, (-(-nc // 32),), (
                    colp, colp_s, np.int32(rt), np.int32(nc), col_m, col_m[1],
                    np.int32(2 if r0 == 0 else 0), 0, 0, 0, 0))
        lse_r = cp.empty((n,), f32)
        row_loss = cp.empty((n,), f32) if positives else None
        kernels.launch(FILE, "tile_finish", t, cgrid,
               (part, part_s, np.int64(n), np.int32(splits), np.int32(n),
                pos if positives else 0, lse_r, ptr(row_loss)))
        if col_state:  # the column (m, s) state over these rows, to merge with other rows'
            state, pair_loss = col_m, row_loss
        else:
            lse_c = cp.empty((n,), f32)
            pair_loss = cp.empty((n,), f32)
            if col_m is None:  # one group: its partials straight to the column lse
                fold = (colp, colp_s, np.int32(rt), 0, 0, np.int32(3))
            else:  # the running state (finalize)
                fold = (0, 0, np.int32(0), col_m, col_m[1], np.int32(1))
            kernels.launch(ROWS_FILE, "col_combine", t, (-(-n // 32),),
                   fold[:3] + (np.int32(n),) + fold[3:] + (lse_r, row_loss, lse_c, pair_loss))
        del scratch, dots  # (to the pool before the gradient block: the phases' peaks apart)
    grads = None
    if want_grad:
        rb, cb = _plan_2d("clip_loss", n, nc, t.itemsize, workspace_bytes)
        g_buf = cp.empty((rb, -(-cb // 8) * 8), t)
        da = cp.empty((n, d), f32)  # the first column block's product writes it (beta = 0)
        db = cp.empty((nc, d), f32)  # the first row block's product writes it (beta = 0)
        dsp = cp.empty((n,), f32)
        w_arr, w_stride, w_mul = weights
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            rt = -(-(r1 - r0) // TILE)
            blocks = [(c0, min(nc, c0 + cb)) for c0 in range(0, nc, cb)]
            splits = [grid_splits(rt, -(-(c1 - c0) // TILE)) for c0, c1 in blocks]
            # dlogit_scale's row partials: every column block's splits, summed in order
            dpart = cp.empty((sum(splits), r1 - r0), f32)
            k = 0
            for (c0, c1), sp in zip(blocks, splits):
                g_blk = g_buf[:r1 - r0, :c1 - c0]
                # the block as its own problem: columns c0.. numbered from 0, so the rows from
                # row0 + r0 - c0 (the diagonal test), and the per-index arrays shifted by c0
                # (the labels too: the kernel reads lab_r at row0 + r0 - c0 + r, lab_c at the
                # block's column)
                tile("clip", t, (rt, sp), an[r0:r1], base + r0 - c0, bn[c0:c1], None,
                     scale_log=ls, pos_mod=pmod, lse_row=lse_r.data.ptr - 4 * (base - c0),
                     lse_col=lse_c.data.ptr + 4 * c0,
                     weights=(shifted(w_arr, w_stride, c0), w_stride, w_mul),
                     g=g_blk, dsp=dpart[k].data.ptr, part=(0, 0, r1 - r0),
                     labels=(lab_r and lab_r + 8 * c0, lab_c and lab_c + 8 * c0))
                k += sp

                def products(da, db, r0=r0, r1=r1, c0=c0, c1=c1, g_blk=g_blk):
                    cublas.gemm(g_blk, bn[c0:c1], da[r0:r1], beta=1.0 if c0 else 0.0)
                    cublas.gemm(g_blk, an[r0:r1], db[c0:c1], trans_a=True,
                              beta=1.0 if r0 else 0.0)
                # (one block: the call's last work, which a graph may leave out, tail.py)
                tail.products((da, db), products, last=rb >= n and cb >= nc)
            out = dsp[r0:r1]
            kernels.launch(FILE, "tile_sum", t, (-(-(r1 - r0) // BLOCK), 1),
                           (dpart, np.int64(r1 - r0), np.int32(k), np.int32(r1 - r0),
                            np.int64(0), out, out, out))
        grads = (da, db, dsp)
    if col_state:
        return lse_r, state, pair_loss, grads
    return lse_r, lse_c, pair_loss, grads


def siglip(an, bn, ls, lb, *, weights, want_loss: bool, want_grad: bool, workspace_bytes,
           row0: int = 0, col0: int = 0):
    """:func:`row_blocks.siglip` on the tile kernels (``MODE_SIGLIP``): the score tiles never
    reach memory.  Per row block one launch gives the rows' loss, dbias and dscale partials
    (per column split, summed in split order by ``tile_sum``) and, for the gradient, the
    block s G' in the input dtype, which the two gradient products read with alpha = w_mul.
    Without the gradient there is no block: one launch over every row.  Same returns as
    :func:`row_blocks.siglip`."""
    import cupy as cp

    t, f32 = an.dtype, np.dtype(np.float32)
    n, d = an.shape
    nc = bn.shape[0]
    w_arr, w_stride, w_mul = weights
    rb, cb, g_buf = n, nc, None
    if want_grad:
        rb, cb = _plan_2d("siglip_loss", n, nc, t.itemsize, workspace_bytes)
        g_buf = cp.empty((rb, -(-cb // 8) * 8), t)
    row_loss, da, db, parts = buffers((
        ((n,), f32) if want_loss else None, ((n, d), f32) if want_grad else None,
        ((nc, d), f32) if want_grad else None, ((2, n), f32) if want_grad else None))
    blocks = [(c0, min(nc, c0 + cb)) for c0 in range(0, nc, cb)]
    for r0 in range(0, n, rb):
        r1 = min(n, r0 + rb)
        m = r1 - r0
        rt = -(-m // TILE)
        splits = [grid_splits(rt, -(-(c1 - c0) // TILE)) for c0, c1 in blocks]
        # per-split row partials of what is asked: loss, then dbias and dscale; every column
        # block's splits in turn, summed in that order
        part = cp.empty((int(want_loss) + 2 * int(want_grad), sum(splits), m), f32)
        k = 0
        for (c0, c1), sp in zip(blocks, splits):
            loss_p = part[0, k] if want_loss else None
            dbias_p, dscale_p = (part[-2, k], part[-1, k]) if want_grad else (None, None)
            g_blk = g_buf[:m, :c1 - c0] if want_grad else None
            # the block as its own problem (see clip): rows from row0 + r0 - c0 - col0 (bn's
            # columns start at global column col0), the row weights shifted by c0 + col0;
            # lse_col holds the bias
            tile("siglip", t, (rt, sp), an[r0:r1], row0 + r0 - c0 - col0, bn[c0:c1], None,
                 scale_log=ls, pos_mod=FAR_MOD, part=(ptr(loss_p), ptr(dbias_p), m),
                 lse_col=lb, weights=(shifted(w_arr, w_stride, c0 + col0), w_stride, w_mul),
                 g=g_blk, dsp=ptr(dscale_p))
            k += sp
            if want_grad:  # (the block holds s G' = s G / w_mul; first blocks write da, db)

                def products(da, db, r0=r0, r1=r1, c0=c0, c1=c1, g_blk=g_blk):
                    cublas.gemm(g_blk, bn[c0:c1], da[r0:r1], alpha=w_mul,
                              beta=1.0 if c0 else 0.0)
                    cublas.gemm(g_blk, an[r0:r1], db[c0:c1], trans_a=True, alpha=w_mul,
                              beta=1.0 if r0 else 0.0)
                # (one block: the call's last work, which a graph may leave out, tail.py)
                tail.products((da, db), products, last=rb >= n and cb >= nc)
        # part's rows in order (loss, dbias, dscale) summed in one launch, one grid row each
        outs = ([row_loss[r0:r1]] if want_loss else []) + (
            [parts[1, r0:r1], parts[0, r0:r1]] if want_grad else [])
        outs += outs[-1:] * (3 - len(outs))
        kernels.launch(FILE, "tile_sum", t, (-(-m // BLOCK), part.shape[0]),
                       (part, np.int64(m), np.int32(k), np.int32(m), np.int64(k * m), *outs))
    grads = None
    if want_grad:  # parts: dscale, dbias rows (row_blocks.siglip's layout), summed in one launch
        sums = fixed_sums(parts, 1)
        grads = (da, db, sums[0], sums[1])
    return row_loss, grads


def cross(q, k, scale: float, *, lse_r, lse_c, weights, want_stats: bool, want_grad: bool,
          workspace_bytes, col_shift=None, scale_log=None):
    """:func:`row_blocks.cross` on the tile kernels: the ``lse2`` pass (row partials, and column
    partials shifted by ``col_shift``, the raw positive dots of k's rows) and the ``h``
    gradient block (H = w_i p_i(j) + w_j p_j(i)), with the rows numbered past the columns
    (``row0 = m``) so that no tile holds a diagonal or a positive."""
    import cupy as cp

    t, f32 = q.dtype, np.dtype(np.float32)
    n, d = q.shape
    m = k.shape[0]
    ct = -(-m // TILE)
    lse_q = state = grads = None
    if want_stats:
        rg = plan_rows("nt_xent", n, -(-8 * m // TILE), workspace_bytes, align=TILE)
        cpt = -(-rg // TILE)
        splits = grid_splits(min(-(-n // TILE), cpt), ct)  # one group's rows fill the GPU
        # one fp32 scratch: row partials (2, splits, n) | column partials (2, cpt, m)
        scratch = cp.empty((2 * splits * n + 2 * cpt * m,), f32)
        part, part_s = scratch.data.ptr, scratch.data.ptr + 4 * splits * n
        colp, colp_s = part + 8 * splits * n, part + 8 * splits * n + 4 * cpt * m
        state = cp.empty((2, m), f32)
        for r0 in range(0, n, rg):
            r1 = min(n, r0 + rg)
            rt = -(-(r1 - r0) // TILE)
            tile("lse2", t, (rt, splits), q[r0:r1], m + r0, k, None, scale=scale,
                 scale_log=scale_log, pos_mod=FAR_MOD,
                 part=(part + 4 * r0, part_s + 4 * r0, n),
                 colp=(colp, colp_s), lse_col=col_shift)
            kernels.launch(ROWS_FILE, "col_combine", t, (-(-m // 32),), (
                colp, colp_s, np.int32(rt), np.int32(m), state, state[1],
                np.int32(2 if r0 == 0 else 0), 0, 0, 0, 0))
        lse_q = cp.empty((n,), f32)
        kernels.launch(FILE, "tile_finish", t, (-(-n // BLOCK),),
                       (part, part_s, np.int64(n), np.int32(splits), np.int32(n), 0, lse_q, 0))
        del scratch  # (before the gradient block)
    if want_grad:
        w_arr, w_mul = pair_weights(weights, f32)
        ldg = -(-m // 8) * 8
        rb = plan_rows("nt_xent", n, ldg * t.itemsize, workspace_bytes, align=TILE)
        g_buf = cp.empty((rb, ldg), t)
        dq = cp.empty((n, d), f32)
        dk = cp.empty((m, d), f32)  # the first row block's product writes it (beta = 0)
        lse_row = lse_r.data.ptr - 4 * m  # the kernel reads lse_row[global row m + r]
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            rt = -(-(r1 - r0) // TILE)
            g_blk = g_buf[:r1 - r0, :m]
            tile("h", t, (rt, grid_splits(rt, ct)), q[r0:r1], m + r0, k, None, scale=scale,
                 scale_log=scale_log, pos_mod=FAR_MOD, lse_row=lse_row, lse_col=lse_c,
                 weights=(w_arr, 1, w_mul), g=g_blk)
            cublas.gemm(g_blk, k, dq[r0:r1])
            cublas.gemm(g_blk, q[r0:r1], dk, trans_a=True, beta=1.0 if r0 else 0.0)
        grads = (dq, dk)
    return lse_q, state, grads
