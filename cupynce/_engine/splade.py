"""SPLADE's head on the GPU: the forward's max over the sequence and the sparse backward.

How it is computed
------------------
Forward, fused (float16/bfloat16 with D and W's row stride multiples of 8 and a (V, D) weight,
where the tensor-core tiles run: by default on Hopper, see ``CUPYNCE_TILES``): the max and
arg-max over L are taken in the epilogue of the product tiles, each logit the fp32 product plus
the bias rounded to the dtype once (as ``F.linear(x, W, bias)`` gives it); no logits and no
workspace at all.  On Hopper the product is the warp-specialised
kernel of kernels_src/splade/splade_wgmma.cu (TMA loads by a producer warp, 128 x 256 wgmma tiles;
``config.splade_ws``); elsewhere, or where the driver cannot encode its tensor maps, the MODE_SPMAX
epilogue of the tile loop (kernels_src/splade/splade_tiles.cu: 128 x 128 tiles, cp.async loads).
Both give the same bits.

Forward, cuBLAS tiles (everything else): the products of a tile of batches × vocabulary are one
cuBLAS product into a workspace of at most ``workspace_bytes`` (default 64 MiB), kept in the
accumulator type (float32 for half inputs: the fp32 sums, unrounded); a kernel adds the bias,
rounds each logit to the dtype (``spl_logit``: the same logits as the fused paths and as
``F.linear``), reduces max and arg-max over L for every (b, v) of the tile and writes
``act(max)`` (when a tile is too narrow to fill the GPU, the sequence is split over several
blocks whose partial maxima, < 2 MiB, are merged in a fixed order by a second kernel).  The
products make one round trip through memory per tile: that traffic, not the arithmetic, is
what the forward adds to the product (docs/design.md); for half inputs it is 4 bytes a logit
(rounding after the bias needs the unrounded sum: docs/decisions.md).  Both activations are
monotone, so the activation is applied once, to the max.  What stays for backward is the
output and the arg-max, (B, V) int16 (int32 when L > 32768).

Backward (sparse, deterministic): with ``g' = grad_out · act'(out)`` (1 for relu, 1/(1+m) =
exp(-out) for log1p_relu, 0 where out = 0), only the active entries (``g' != 0``) are touched:

* ``dW[v] = Σ_b g'[b, v] x[b, l*(b, v)]`` and ``dbias[v] = Σ_b g'[b, v]`` — a warp per
  vocabulary row (8 a CTA), a sequential loop over b: the (g', l*) of 64 batches × those rows
  staged with coalesced loads, the warp's active entries listed, then their x rows gathered 16
  bytes a lane through a 4-slot cp.async ring a warp (SPL_RING rows in flight);
* ``dx[b, l] = Σ_{v : l*(b, v) = l} g'[b, v] W[v]`` — the active v of each batch are grouped by
  l with a stable counting sort (integer counts, a one-pass scan, a warp-ordered placement
  over up to 64 vocabulary segments), then a warp per (b, l) sums its list in increasing v
  (W rows through the same ring).

Rows that are not 16-byte aligned, and devices where the ring does not fit a block or has no
cp.async (before sm_80), take element-wise kernels (16 vocabulary rows a CTA for dW).  Each
gradient element is one sequential sum in a fixed order (b for dW, v for dx), whatever the
kernel: the same bits either way (tested).

No floating-point atomics: the same inputs give the same bits.  Gradients are in the inputs'
dtypes (a bf16 weight gets a bf16 gradient, accumulated in fp32; no fp32 copy of W).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from .. import config
from . import compat, kernels, tiling, tma
from .arrays import leading_dim
from .gemm import cublas
from .kernels import BLOCK, acc_dtype

#: Default cap on the cuBLAS-tile forward's logit workspace (bytes).
DEFAULT_WORKSPACE_BYTES = 64 << 20
FILE = "splade/splade.cu"
#: the backward's kernels (dW, dbias, dx and the dx grouping)
GRAD_FILE = "splade/splade_grad.cu"
#: SPLADE's fused max on the tile kernels (tiles.cu's main loops, MODE_SPMAX epilogue)
TILES_FILE = "splade/splade_tiles.cu"
# ``config.splade_ws``: the fused forward on Hopper runs kernels_src/splade/splade_wgmma.cu
# (warp-specialised, TMA, 128 x 256 tiles) where the tiles run with the wgmma loop and the
# driver encodes tensor maps; False: splade_tiles.cu's MODE_SPMAX kernel (tests cover both).
_WS_FILE = "splade/splade_wgmma.cu"
_WS_BM, _WS_BN, _WS_BK = 128, 256, 64  # SW_BM, SW_BN, SW_BK
_WS_THREADS = 288  # SW_THREADS: 2 consumer warpgroups + 1 producer warp
_WS_CLUSTER = 2  # SW_CLUSTER: CTAs per cluster, sharing (multicasting) the x loads
#: SW_SMEM_BYTES: 4 stages x (128 + 256) rows x 64 x 2 bytes + 1 KiB to align the stages (a
#: GPU test checks it against cpn_spmax_ws_smem)
_WS_SMEM = 4 * (_WS_BM + _WS_BN) * _WS_BK * 2 + 1024
_GRAD_NV = 4  # SPL_GRAD_NV in splade_grad.cu: column chunks a lane of the gradient kernels covers
_DW_TV = 16  # SPL_DW_TV: vocabulary rows a dW CTA covers (element-wise rows)
_DWV_TV = BLOCK // 32  # SPL_DWV_TV: vocabulary rows a 16-byte dW CTA covers, a warp each
_RING = 4  # SPL_RING: gathered rows a warp of the 16-byte gradient kernels has in flight, + 1
_DX_ROWS = BLOCK // 32  # (b, l) a dx CTA covers: a warp each
_MAX_SLICES = 8  # SPL_MAX_SLICES: warps of a max block, warp y over the positions l = y mod 8
_MAX_FILL = 1024  # max blocks per tile wanted (~8 per SM of an H100)
_MIN_CHUNK = 64  # fewest positions per chunk when the sequence is split across blocks
#: Shared-memory budgets (bytes) that keep every launch under the default 48 KiB: the mask row
#: of the max kernel (L bytes, beside ~9 KiB of static shared memory) and the count / place
#: kernels' per-position counters (4 L bytes); longer sequences use global memory instead.
_MAX_STAGED_MASK = 32 << 10
_MAX_SHARED_CURSORS = 32 << 10
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (batches per launch)
#: Vocabulary segments per batch in the dx grouping: each is placed by one warp, so more
#: segments place in parallel (at (32, 256, 768, 30522), 16 segments of 2048 left ~480 warps
#: for the GPU and the place pass took ~90 us), at the price of larger count arrays (B L nseg
#: ints, three of them) and a longer scan per batch row, held to _MAX_SCAN ints.
_MAX_SEGMENTS = 64
_MIN_SEGMENT = 512
_MAX_SCAN = 16384
_SCAN_BLOCK = 1024  # SPL_SCAN_BLOCK: threads of the scan (16 ints each: a row of _MAX_SCAN at once)


def index_dtype(length: int) -> np.dtype:
    """The smallest integer type that holds an arg-max over ``length`` positions."""
    return np.dtype(np.int16) if length <= np.iinfo(np.int16).max + 1 else np.dtype(np.int32)


def index_tag(dtype) -> str:
    return "i16" if np.dtype(dtype) == np.int16 else "i32"


def _weight_operand(weight):
    """``(matrix, trans_b)`` so that ``gemm(x, matrix[tile], trans_b=...)`` gives x Wᵀ.

    A row-major (V, D) weight (rows may be strided) is used as is with ``trans_b``; the
    transpose of a row-major (D, V) matrix (the seeds' layout) is used through that matrix.
    Anything else is made contiguous (a copy, only then).
    """
    item = weight.dtype.itemsize
    v, d = weight.shape
    if (d == 1 or weight.strides[1] == item) and weight.strides[0] % item == 0 \
            and weight.strides[0] >= d * item:
        return weight, True
    if (v == 1 or weight.strides[0] == item) and weight.strides[1] % item == 0 \
            and weight.strides[1] >= v * item:
        return weight.T, False
    import cupy as cp
    return cp.ascontiguousarray(weight), True


def _plan_tiles(op, b, l, v, item, workspace_bytes) -> Tuple[int, int]:
    """(batches per tile, vocabulary columns per tile) for a workspace of (nb·L) × vt items of
    ``item`` bytes (the accumulator type's: 4 for half inputs)."""
    cap = DEFAULT_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    per_col = b * l * item
    vt = cap // per_col
    if vt >= min(v, 256):  # whole batch, as many columns as fit (multiples of 128)
        vt = min(v, vt if vt < 128 else (vt // 128) * 128)
        return b, vt
    vt = min(v, 256)
    nb = cap // (l * vt * item)
    if nb >= 1:
        return nb, vt
    vt = cap // (l * item)
    if vt < 1:
        raise ValueError(f"{op}: workspace_bytes={workspace_bytes} is smaller than one column of "
                         f"logits over the sequence ({l * item} bytes); give at least that")
    return 1, vt


def forward(x, weight, bias, mask, act: int, workspace_bytes):
    """``(out, argmax)`` (B, V) of SPLADE's max-pool on the GPU; ``act`` 0 relu, 1 log1p_relu."""
    import cupy as cp

    b, l, d = x.shape
    v = weight.shape[0]
    dt = x.dtype
    xs = cp.ascontiguousarray(x).reshape(b * l, d)
    wm, trans_b = _weight_operand(weight)
    bias = None if bias is None else cp.ascontiguousarray(bias)
    m8 = None
    if mask is not None:
        # the kernels read bytes, nonzero = keep: bool and uint8 masks go as they are (no CuPy
        # kernel to compile at a first call); other dtypes are compared with 0 first
        m8 = mask if mask.dtype in (np.bool_, np.uint8) else (mask != 0)
        m8 = cp.ascontiguousarray(m8).view(np.uint8)
    idt = index_dtype(l)
    out = cp.empty((b, v), dt)
    arg = cp.empty((b, v), idt)
    if trans_b and tiling.tiles_ok(xs, wm):
        # fused: the max over the sequence in the epilogue of the tensor-core product tiles;
        # no logits workspace at all
        if config.current().splade_ws and tiling.wgmma() and _ws_forward(xs, wm, m8, bias, act, out, arg, l):
            return out, arg
        vtiles = -(-v // tiling.TILE)  # splade_tiles.cu, MODE_SPMAX
        per, group = _spmax_schedule(b, l, d, dt.itemsize, tiling.TILE)
        grid = (vtiles * -(-b // per),)
        tiling.tile_launch(TILES_FILE, f"spmax_{index_tag(idt)}", dt, grid, (
            wm, np.int64(leading_dim(wm)), np.int32(v), xs, np.int64(d), np.int32(l),
            np.int32(d), m8 if m8 is not None else 0, bias if bias is not None else 0,
            np.int32(act), out, arg, np.int32(b), np.int32(per), np.int32(group)))
        return out, arg
    acc = acc_dtype(dt)  # the workspace's: the products unrounded, the bias added before rounding
    nb, vt = _plan_tiles("splade_pool", b, l, v, acc.itemsize, workspace_bytes)
    ws = cp.empty((nb * l, vt), acc)
    tag = index_tag(idt)
    fn = kernels.get_kernel(FILE, f"splade_max_{tag}", dt)
    cols = 32 * (8 // dt.itemsize)  # vocabulary columns of a max block (8 bytes of T per lane)
    nz = _position_chunks(-(-vt // cols) * nb, l)
    lchunk = -(-l // nz)
    part = [cp.empty((nz, nb, vt), t) for t in (acc, np.int32, np.uint8)] if nz > 1 else None
    pv, pa, pn = part if part is not None else (0, 0, 0)
    combine = None if part is None else kernels.get_kernel(FILE, f"splade_max_combine_{tag}", dt)
    stage = m8 is not None and l <= _MAX_STAGED_MASK  # the mask row in shared memory
    smem = l if stage else 0
    for b0 in range(0, b, nb):
        nbt = min(nb, b - b0)
        rows = xs[b0 * l:(b0 + nbt) * l]
        for v0 in range(0, v, vt):
            vtt = min(vt, v - v0)
            tile = ws[:nbt * l, :vtt]
            wt = wm[v0:v0 + vtt] if trans_b else wm[:, v0:v0 + vtt]
            cublas.gemm(rows, wt, tile, trans_b=trans_b)
            common = (np.int32(b0), np.int32(v0), np.int32(v))
            fn((-(-vtt // cols), nbt, nz), (32, _MAX_SLICES),
               (tile, np.int64(leading_dim(tile)), np.int32(l), np.int32(vtt)) + common
               + (m8 if m8 is not None else 0, bias if bias is not None else 0, np.int32(act),
                  out, arg, np.int32(lchunk), np.int32(stage), pv, pa, pn),
               shared_mem=smem)
            if combine is not None:
                combine((-(-(nbt * vtt) // BLOCK),), (BLOCK,),
                        (pv, pa, pn, np.int32(nz), np.int32(nbt), np.int32(vtt)) + common
                        + (np.int32(act), out, arg))
    return out, arg


#: fused forward: product steps (one position tile -- 128 positions in tiles.cu, 256 in
#: splade_wgmma.cu -- x 64 of D) a CTA should run at least, so that filling its pipeline stays
#: a small part of it; and the x bytes that the CTAs in flight should share (a part of the
#: H100's 50 MB L2, beside their weight tiles)
_SPMAX_MIN_STEPS = 48
_SPMAX_X_BYTES = 12 << 20


def _ws_fits(rows: int) -> bool:
    """Whether x's ``rows`` = B·L rows are addressable by splade_wgmma.cu, whose TMA row
    coordinate (a position tile's first row, + 256) is a signed 32-bit int."""
    return rows + _WS_BN < 2 ** 31


def _ws_forward(xs, wm, m8, bias, act: int, out, arg, l: int) -> bool:
    """The fused forward through kernels_src/splade/splade_wgmma.cu; False (nothing launched) where
    x has too many rows for it (:func:`_ws_fits`) or the driver does not encode the tensor
    maps."""
    if not _ws_fits(xs.shape[0]):
        return False
    tw = tma.matrix_map(wm, _WS_BM, _WS_BK)
    tx = tma.matrix_map(xs, _WS_BN // _WS_CLUSTER, _WS_BK)  # each CTA loads half the x box
    if tw is None or tx is None:
        return False
    b, v = out.shape
    d = xs.shape[1]
    per, group = _spmax_schedule(b, l, d, xs.dtype.itemsize, _WS_BN)
    kern = kernels.get_kernel(_WS_FILE, f"spmax_ws_{index_tag(arg.dtype)}", xs.dtype)
    if kern.max_dynamic_shared_size_bytes < _WS_SMEM:  # opt in above 48 KiB, once
        kern.max_dynamic_shared_size_bytes = _WS_SMEM
    pairs = -(-v // (_WS_CLUSTER * _WS_BM))  # clusters of 2 CTAs on adjacent vocabulary tiles
    kern((_WS_CLUSTER * pairs * -(-b // per),), (_WS_THREADS,), (
        tw, tx, np.int32(v), np.int32(l), np.int32(d), m8 if m8 is not None else 0,
        bias if bias is not None else 0, np.int32(act), out, arg, np.int32(b), np.int32(per),
        np.int32(group)), shared_mem=_WS_SMEM)
    return True


def _spmax_schedule(b: int, l: int, d: int, item: int, tile: int) -> Tuple[int, int]:
    """(batches per CTA, batch groups per grid group) of the fused forward with ``tile``
    positions per product tile."""
    steps = -(-l // tile) * -(-d // 64)  # per batch
    per = min(b, -(-_SPMAX_MIN_STEPS // steps))
    group = max(1, min(-(-b // per), _SPMAX_X_BYTES // max(1, per * l * d * item)))
    return per, group


def _position_chunks(blocks: int, l: int) -> int:
    """Chunks of the sequence per max block so that a tile fills the GPU (>= _MAX_FILL blocks),
    each chunk at least _MIN_CHUNK positions."""
    return max(1, min(-(-_MAX_FILL // max(blocks, 1)), l // _MIN_CHUNK))


def _segments(v: int, l: int) -> Tuple[int, int]:
    """(segment length, segments) of the dx grouping for ``v`` words and ``l`` positions."""
    most = max(1, min(_MAX_SEGMENTS, _MAX_SCAN // max(l, 1)))
    seg = max(_MIN_SEGMENT, -(-v // most))
    return seg, -(-v // seg)


def _rows_aligned(ptr: int, d: int, stride: int, item: int) -> bool:
    """Whether rows of ``d`` elements, ``stride`` elements apart from ``ptr``, can be read as
    16-byte vectors (and the contiguous (.., d) gradient rows written so)."""
    e = 16 // item
    return ptr % 16 == 0 and d % e == 0 and stride % e == 0


def _grad_chunks(d: int, vec: bool, item: int) -> int:
    """The gradient kernels' grid along D: 32 lanes x ``_GRAD_NV`` chunks of 16 bytes (vec) or
    of one element each per CTA."""
    return max(1, -(-d // (32 * _GRAD_NV * (16 // item if vec else 1))))


#: the 16-byte gradient kernels' dynamic shared memory: a ring of ``_RING`` gathered rows a
#: warp (SPL_RING_BYTES: SPL_RING x SPL_GRAD_NV x 32 lanes x 16 bytes)
_RING_SMEM = (BLOCK // 32) * _RING * _GRAD_NV * 32 * 16


def _ring_kernel(name: str, dt):
    """``kernels_src/splade/splade_grad.cu``'s 16-byte gradient kernel ``name`` (splade_dwv,
    splade_dxv), opted in to the device's dynamic shared memory once (``tiling.ws_smem``), or
    None where its ring does not fit a block (static + dynamic above the opt-in maximum:
    Turing's 64 KiB) or its copies would not be asynchronous (no cp.async before sm_80): the
    callers then take the element-wise kernels, the same sums in the same order."""
    kern = kernels.get_kernel(GRAD_FILE, name, dt)
    static, smem_max = tiling.ws_smem(kern)
    fits = int(kernels._compute_capability()()) >= 80 and static + _RING_SMEM <= smem_max
    return kern if fits else None


def backward(x, weight, out, arg, g, has_bias: bool, act: int):
    """``(dx, dweight, dbias)`` from the forward's out and arg-max (see the module notes)."""
    import cupy as cp

    b, l, d = x.shape
    v = weight.shape[0]
    dt = x.dtype
    tag = index_tag(arg.dtype)
    xs = cp.ascontiguousarray(x)
    g = cp.ascontiguousarray(g.astype(dt, copy=False))
    out = cp.ascontiguousarray(out)  # the kernels index (B, V) arrays as b * V + v
    arg = cp.ascontiguousarray(arg)
    dw = cp.empty((v, d), dt)
    dbias = cp.empty((v,), dt) if has_bias else None
    # 16-byte row access where every row the kernel reads or writes is 16-byte aligned (and
    # the ring fits the device)
    ring = _rows_aligned(xs.data.ptr, d, d, dt.itemsize) and \
        _ring_kernel(f"splade_dwv_{tag}", dt)  # (x contiguous: rows d apart)
    kern = ring or kernels.get_kernel(GRAD_FILE, f"splade_dw_{tag}", dt)
    kern((-(-v // (_DWV_TV if ring else _DW_TV)), _grad_chunks(d, bool(ring), dt.itemsize)),
         (BLOCK,), (xs, out, g, arg, np.int32(b), np.int32(l), np.int32(d), np.int32(v),
                    np.int32(act), dw, dbias if dbias is not None else 0),
         shared_mem=_RING_SMEM if ring else 0)
    # dx: group the active (b, v) by (b, l*) in increasing v, then a warp per (b, l)
    seg, nseg = _segments(v, l)
    scal = (np.int32(v), np.int32(l), np.int32(seg), np.int32(nseg), np.int32(act))
    glob = 4 * l > _MAX_SHARED_CURSORS  # long sequences: counts and cursors in global memory
    # (the shared-memory count pass writes every (b, l, s) entry: no fill needed; the global
    # one adds to them)
    counts = (cp.zeros if glob else cp.empty)((b, l, nseg), np.int32)
    kernels.get_kernel(GRAD_FILE, f"splade_count_{tag}", dt)(
        (nseg, b), (BLOCK,), (out, g, arg) + scal + (np.int32(glob), counts),
        shared_mem=0 if glob else 4 * l)
    # the rows' prefix sums of the counts (our kernel, not cp.cumsum: nothing for CuPy to
    # compile at a first call); long sequences also get the place pass's global cursors
    incl, excl = (cp.empty((b, l * nseg), np.int32) for _ in range(2))
    cursors = cp.empty((b, l * nseg), np.int32) if glob else None
    kernels.get_function(GRAD_FILE, "cpn_splade_scan")(
        (b,), (_SCAN_BLOCK,), (counts, np.int32(l * nseg), incl, excl,
                         cursors if cursors is not None else 0))
    lst = cp.empty((b, v), np.int32)
    kernels.get_kernel(GRAD_FILE, f"splade_place_{tag}", dt)(
        (nseg, b), (32,), (out, g, arg) + scal + (excl, cursors if glob else 0, lst),
        shared_mem=0 if glob else 4 * l)
    item = dt.itemsize
    sv, sd = weight.strides[0] // item, weight.strides[1] // item
    ring = sd == 1 and _rows_aligned(weight.data.ptr, d, sv, item) and \
        _ring_kernel("splade_dxv", dt)
    dx = cp.empty((b, l, d), dt)
    kern = ring or kernels.get_kernel(GRAD_FILE, "splade_dx", dt)
    kern((-(-(b * l) // _DX_ROWS), _grad_chunks(d, bool(ring), item)), (BLOCK,),
         (weight, np.int64(sv), np.int64(sd), out, g, lst, excl, incl, np.int32(b),
          np.int32(v), np.int32(l), np.int32(d), np.int32(nseg), np.int32(act), dx),
         shared_mem=_RING_SMEM if ring else 0)
    return dx, dw, dbias


compat.legacy_switches(__name__, {"USE_WS": "splade_ws"})
