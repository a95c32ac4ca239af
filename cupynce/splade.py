"""SPLADE's sparse max-pool head and its FLOPS regularizer.

``out[b, v] = act(max_{l : mask[b, l]} (x[b, l, :] · W[v, :]) + bias[v])`` with
``act = relu`` or ``log1p∘relu``, computed without ever holding the (B, L, V) logits.

Entry points (as for the InfoNCE ops):

* :func:`splade_pool` — the output only;
* :func:`splade_pool_forward` → ``(out, ctx)``; :func:`splade_pool_backward` →
  ``(dx, dweight, dbias)``; :func:`splade_pool_backward_from_stats` rebuilds the same gradients
  from ``x``, ``weight``, ``out`` and the arg-max (``ctx.stats[0]``) alone;
* :func:`flops_regularizer` / :func:`flops_regularizer_backward` — SPLADE's FLOPS term.

How it is computed (CuPy arrays)
--------------------------------
Forward, fused (float16/bfloat16 with D and W's row stride multiples of 8 and a (V, D) weight,
where the tensor-core tiles run: by default on Hopper, see ``CUPYNCE_TILES``): the max and
arg-max over L are taken in the epilogue of the product tiles, each logit rounded to the dtype
first; no logits and no workspace at all.  On Hopper the product is the warp-specialised
kernel of kernels_src/splade_wgmma.cu (TMA loads by a producer warp, 128 x 256 wgmma tiles;
``USE_WS``); elsewhere, or where the driver cannot encode its tensor maps, tiles.cu's
MODE_SPMAX (128 x 128 tiles, cp.async loads).  Both give the same bits.

Forward, cuBLAS tiles (everything else): the logits of a tile of batches × vocabulary are one cuBLAS product (fp32
accumulation; stored in the input dtype, as PyTorch's half matmul does) into a workspace of at
most ``workspace_bytes`` (default 64 MiB); a kernel reduces max and arg-max over L for every
(b, v) of the tile and writes ``act(max + bias)`` (when a tile is too narrow to fill the GPU,
the sequence is split over several blocks whose partial maxima, < 2 MiB, are merged in a fixed
order by a second kernel).  The logits make one round trip through memory per tile: that
traffic, not the arithmetic, is what the forward adds to the product (benchmarks/NOTES.md).  The bias is constant over L, so it is
added after the max; both activations are monotone, so the activation is applied once.  What
stays for backward is the output and the arg-max, (B, V) int16 (int32 when L > 32768).

Backward (sparse, deterministic): with ``g' = grad_out · act'(out)`` (1 for relu, 1/(1+m) =
exp(-out) for log1p_relu, 0 where out = 0), only the active entries (``g' != 0``) are touched:

* ``dW[v] = Σ_b g'[b, v] x[b, l*(b, v)]`` and ``dbias[v] = Σ_b g'[b, v]`` — one block per v, a
  sequential loop over b;
* ``dx[b, l] = Σ_{v : l*(b, v) = l} g'[b, v] W[v]`` — the active v of each batch are grouped by
  l with a stable counting sort (integer counts, a scan, a warp-ordered placement), then one
  block per (b, l) sums its list in increasing v.

No floating-point atomics: the same inputs give the same bits.  Gradients are in the inputs'
dtypes (a bf16 weight gets a bf16 gradient, accumulated in fp32; no fp32 copy of W).
"""
from __future__ import annotations

import numbers
from typing import Any, Optional, Tuple

import numpy as np

from . import _blas, _checks, _tma
from . import contrastive as _C  # the tile kernels (tiles.cu) and their launch
from ._kernels import BLOCK, SUPPORTED_DTYPES, acc_dtype, get_kernel
from .contrastive import Context, _require

#: Default cap on the forward's logit workspace (bytes).
DEFAULT_WORKSPACE_BYTES = 64 << 20
#: Workspace of the NumPy path when the caller gives none (bytes).
NUMPY_WORKSPACE_BYTES = 64 << 20
ACTIVATIONS = ("relu", "log1p_relu")
_FILE = "splade.cu"
#: The fused forward on Hopper runs kernels_src/splade_wgmma.cu (warp-specialised, TMA, 128 x
#: 256 tiles) where the tiles run with the wgmma loop and the driver encodes tensor maps;
#: False: tiles.cu's MODE_SPMAX kernel (tests cover both).
USE_WS = True
_WS_FILE = "splade_wgmma.cu"
_WS_BM, _WS_BN, _WS_BK = 128, 256, 64  # SW_BM, SW_BN, SW_BK
_WS_THREADS = 288  # SW_THREADS: 2 consumer warpgroups + 1 producer warp
_WS_CLUSTER = 2  # SW_CLUSTER: CTAs per cluster, sharing (multicasting) the x loads
#: SW_SMEM_BYTES: 4 stages x (128 + 256) rows x 64 x 2 bytes + 1 KiB to align the stages (a
#: GPU test checks it against cpn_spmax_ws_smem)
_WS_SMEM = 4 * (_WS_BM + _WS_BN) * _WS_BK * 2 + 1024
_SPL_DK = 4  # SPL_DK in splade.cu: accumulators per thread along D
_MAX_SLICES = 8  # SPL_MAX_SLICES: warps of a max block, warp y over the positions l = y mod 8
_MAX_FILL = 1024  # max blocks per tile wanted (~8 per SM of an H100)
_MIN_CHUNK = 64  # fewest positions per chunk when the sequence is split across blocks
#: Shared-memory budgets (bytes) that keep every launch under the default 48 KiB: the mask row
#: of the max kernel (L bytes, beside ~9 KiB of static shared memory) and the count / place
#: kernels' per-position counters (4 L bytes); longer sequences use global memory instead.
_MAX_STAGED_MASK = 32 << 10
_MAX_SHARED_CURSORS = 32 << 10
_MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (batches per launch)
#: Vocabulary segments per batch in the dx grouping (more segments: more parallel placement,
#: larger count arrays).
_MAX_SEGMENTS = 16
_MIN_SEGMENT = 2048


def _index_dtype(length: int) -> np.dtype:
    """The smallest integer type that holds an arg-max over ``length`` positions."""
    return np.dtype(np.int16) if length <= np.iinfo(np.int16).max + 1 else np.dtype(np.int32)


def _index_tag(dtype) -> str:
    return "i16" if np.dtype(dtype) == np.int16 else "i32"


def _act_code(activation: str) -> int:
    return ACTIVATIONS.index(activation)


# ----------------------------------------------------------------------------------------
# validation (shapes, dtypes, devices; never values of device arrays)
# ----------------------------------------------------------------------------------------
def _check(x, weight, bias, mask, activation, workspace_bytes, op="splade_pool"):
    xp = _checks.array_module(op, optional=("bias", "mask"), x=x, weight=weight, bias=bias,
                              mask=mask)
    for name, arr, nd, want in (("x", x, 3, "(B, L, D)"), ("weight", weight, 2, "(V, D)"),
                                ("bias", bias, 1, "(V,)"), ("mask", mask, 2, "(B, L)")):
        if arr is not None and arr.ndim != nd:
            raise ValueError(f"{op}: {name} must be {nd}-D {want}, got shape {tuple(arr.shape)}")
    for name, arr in (("x", x), ("weight", weight), ("bias", bias)):
        if arr is not None:
            _checks.check_float(op, name, arr)
    _checks.check_same_dtype(op, x=x, weight=weight, bias=bias)
    b, l, d = x.shape
    v = weight.shape[0]
    for name, size in (("B", b), ("L", l), ("D", d)):
        if size < 1:
            raise ValueError(f"{op}: x must have {name} >= 1, got shape {tuple(x.shape)}")
    if v < 1:
        raise ValueError(f"{op}: weight must have V >= 1 rows, got shape {tuple(weight.shape)}")
    if weight.shape[1] != d:
        raise ValueError(f"{op}: D must match: x has D={d} (shape {tuple(x.shape)}), weight has "
                         f"D={weight.shape[1]} (shape {tuple(weight.shape)}); weight is (V, D), "
                         f"pass a (D, V) matrix as its transpose .T")
    if bias is not None and bias.shape != (v,):
        raise ValueError(f"{op}: bias must have shape ({v},) (V of weight), "
                         f"got {tuple(bias.shape)}")
    if mask is not None:
        if mask.shape != (b, l):
            raise ValueError(f"{op}: mask must have shape ({b}, {l}) (B, L of x), "
                             f"got {tuple(mask.shape)}")
        if mask.dtype.kind not in "biuf" and mask.dtype not in SUPPORTED_DTYPES:  # + bfloat16
            raise TypeError(f"{op}: mask must be bool or a real 0/1 array, got dtype {mask.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    workspace_bytes = _checks.check_workspace(op, workspace_bytes)
    itemsize = x.dtype.itemsize
    if workspace_bytes is not None and workspace_bytes < l * itemsize:
        raise ValueError(f"{op}: workspace_bytes={workspace_bytes} is smaller than one column of "
                         f"logits over the sequence (L * itemsize = {l * itemsize} bytes); give "
                         f"at least that")
    if xp is not np and b > _MAX_GRID_Y:
        raise ValueError(f"{op}: x has B={b} rows; the GPU path takes at most {_MAX_GRID_Y} per "
                         f"call (split the batch)")
    return xp, workspace_bytes


def _check_grad_out(op, xp, grad_out, shape, x):
    ok = isinstance(grad_out, np.ndarray) if xp is np else _checks.is_cupy_array(grad_out)
    if not ok or tuple(grad_out.shape) != shape:
        got = tuple(grad_out.shape) if hasattr(grad_out, "shape") else type(grad_out).__name__
        raise ValueError(f"{op}: grad_out must be a {xp.__name__} array of shape {shape} "
                         f"(the shape of out), got {got}")
    _checks.check_float(op, "grad_out", grad_out)
    if xp is not np and grad_out.device.id != x.device.id:
        raise ValueError(f"{op}: grad_out is on cuda:{grad_out.device.id} but the inputs are on "
                         f"cuda:{x.device.id}")


# ----------------------------------------------------------------------------------------
# GPU path
# ----------------------------------------------------------------------------------------
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
    """(batches per tile, vocabulary columns per tile) for a workspace of (nb·L) × vt items."""
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


def _gpu_forward(x, weight, bias, mask, act, workspace_bytes):
    import cupy as cp

    b, l, d = x.shape
    v = weight.shape[0]
    dt = x.dtype
    xs = cp.ascontiguousarray(x).reshape(b * l, d)
    wm, trans_b = _weight_operand(weight)
    bias = None if bias is None else cp.ascontiguousarray(bias)
    m8 = None
    if mask is not None:
        m8 = mask if mask.dtype == np.bool_ else (mask != 0)
        m8 = cp.ascontiguousarray(m8).view(np.uint8)
    idt = _index_dtype(l)
    out = cp.empty((b, v), dt)
    arg = cp.empty((b, v), idt)
    if trans_b and _C._tiles_ok(xs, wm):
        # fused: the max over the sequence in the epilogue of the tensor-core product tiles;
        # no logits workspace at all
        if USE_WS and _C._wgmma() and _ws_forward(xs, wm, m8, bias, act, out, arg, l):
            return out, arg
        vtiles = -(-v // _C._TILE)  # tiles.cu, MODE_SPMAX
        per, group = _spmax_schedule(b, l, d, dt.itemsize, _C._TILE)
        _C._tile_launch(f"spmax_{_index_tag(idt)}", dt, (vtiles * -(-b // per),), (
            wm, np.int64(_blas.leading_dim(wm)), np.int32(v), xs, np.int64(d), np.int32(l),
            np.int32(d), m8 if m8 is not None else 0, bias if bias is not None else 0,
            np.int32(act), out, arg, np.int32(b), np.int32(per), np.int32(group)))
        return out, arg
    nb, vt = _plan_tiles("splade_pool", b, l, v, dt.itemsize, workspace_bytes)
    ws = cp.empty((nb * l, vt), dt)
    tag = _index_tag(idt)
    fn = get_kernel(_FILE, f"splade_max_{tag}", dt)
    cols = 32 * (8 // dt.itemsize)  # vocabulary columns of a max block (8 bytes per lane)
    nz = _position_chunks(-(-vt // cols) * nb, l)
    lchunk = -(-l // nz)
    acc = acc_dtype(dt)
    part = [cp.empty((nz, nb, vt), t) for t in (acc, np.int32, np.uint8)] if nz > 1 else None
    pv, pa, pn = part if part is not None else (0, 0, 0)
    combine = get_kernel(_FILE, f"splade_max_combine_{tag}", dt) if part is not None else None
    stage = m8 is not None and l <= _MAX_STAGED_MASK  # the mask row in shared memory
    smem = l if stage else 0
    for b0 in range(0, b, nb):
        nbt = min(nb, b - b0)
        rows = xs[b0 * l:(b0 + nbt) * l]
        for v0 in range(0, v, vt):
            vtt = min(vt, v - v0)
            tile = ws[:nbt * l, :vtt]
            wt = wm[v0:v0 + vtt] if trans_b else wm[:, v0:v0 + vtt]
            _blas.gemm(rows, wt, tile, trans_b=trans_b)
            common = (np.int32(b0), np.int32(v0), np.int32(v))
            fn((-(-vtt // cols), nbt, nz), (32, _MAX_SLICES),
               (tile, np.int64(_blas.leading_dim(tile)), np.int32(l), np.int32(vtt)) + common
               + (m8 if m8 is not None else 0, bias if bias is not None else 0, np.int32(act),
                  out, arg, np.int32(lchunk), np.int32(stage), pv, pa, pn),
               shared_mem=smem)
            if combine is not None:
                combine((-(-(nbt * vtt) // BLOCK),), (BLOCK,),
                        (pv, pa, pn, np.int32(nz), np.int32(nbt), np.int32(vtt)) + common
                        + (bias if bias is not None else 0, np.int32(act), out, arg))
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
    """The fused forward through kernels_src/splade_wgmma.cu; False (nothing launched) where
    x has too many rows for it (:func:`_ws_fits`) or the driver does not encode the tensor
    maps."""
    if not _ws_fits(xs.shape[0]):
        return False
    tw = _tma.matrix_map(wm, _WS_BM, _WS_BK)
    tx = _tma.matrix_map(xs, _WS_BN // _WS_CLUSTER, _WS_BK)  # each CTA loads half the x box
    if tw is None or tx is None:
        return False
    b, v = out.shape
    d = xs.shape[1]
    per, group = _spmax_schedule(b, l, d, xs.dtype.itemsize, _WS_BN)
    kern = get_kernel(_WS_FILE, f"spmax_ws_{_index_tag(arg.dtype)}", xs.dtype)
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


def _segments(v: int) -> Tuple[int, int]:
    seg = max(_MIN_SEGMENT, -(-v // _MAX_SEGMENTS))
    return seg, -(-v // seg)


def _gpu_backward(x, weight, out, arg, g, has_bias, act):
    import cupy as cp

    b, l, d = x.shape
    v = weight.shape[0]
    dt = x.dtype
    tag = _index_tag(arg.dtype)
    xs = cp.ascontiguousarray(x)
    g = cp.ascontiguousarray(g.astype(dt, copy=False))
    out = cp.ascontiguousarray(out)  # the kernels index (B, V) arrays as b * V + v
    arg = cp.ascontiguousarray(arg)
    dchunks = -(-d // (_SPL_DK * BLOCK))
    dw = cp.empty((v, d), dt)
    dbias = cp.empty((v,), dt) if has_bias else None
    get_kernel(_FILE, f"splade_dw_{tag}", dt)(
        (v, dchunks), (BLOCK,),
        (xs, out, g, arg, np.int32(b), np.int32(l), np.int32(d), np.int32(v), np.int32(act),
         dw, dbias if dbias is not None else 0))
    # dx: group the active (b, v) by (b, l*) in increasing v, then one block per (b, l)
    seg, nseg = _segments(v)
    counts = cp.zeros((b, l, nseg), np.int32)
    scal = (np.int32(v), np.int32(l), np.int32(seg), np.int32(nseg), np.int32(act))
    glob = 4 * l > _MAX_SHARED_CURSORS  # long sequences: counts and cursors in global memory
    get_kernel(_FILE, f"splade_count_{tag}", dt)(
        (nseg, b), (BLOCK,), (out, g, arg) + scal + (np.int32(glob), counts),
        shared_mem=0 if glob else 4 * l)
    incl = cp.cumsum(counts.reshape(b, l * nseg), axis=1, dtype=np.int32)
    excl = incl - counts.reshape(b, l * nseg)
    lst = cp.empty((b, v), np.int32)
    get_kernel(_FILE, f"splade_place_{tag}", dt)(
        (nseg, b), (32,), (out, g, arg) + scal + (excl, excl.copy() if glob else 0, lst),
        shared_mem=0 if glob else 4 * l)
    item = dt.itemsize
    dx = cp.empty((b, l, d), dt)
    get_kernel(_FILE, "splade_dx", dt)(
        (l, b, dchunks), (BLOCK,),
        (weight, np.int64(weight.strides[0] // item), np.int64(weight.strides[1] // item), out,
         g, lst, excl, incl, np.int32(v), np.int32(l), np.int32(d), np.int32(nseg),
         np.int32(act), dx))
    return dx, dw, dbias


# ----------------------------------------------------------------------------------------
# NumPy path (the same algorithm, vectorised, in vocabulary chunks)
# ----------------------------------------------------------------------------------------
def _np_act(m, act):
    r = np.where(m > 0, m, 0).astype(m.dtype)
    r = np.where(np.isnan(m), m, r)
    return np.log1p(r) if act == 1 else r


def _np_gprime(out, g, act):
    out = out.astype(g.dtype)
    gp = np.where(out > 0, g * np.exp(-out) if act == 1 else g, 0).astype(g.dtype)
    return np.where(np.isnan(out), out, gp)


def _np_step(per_column: int, workspace_bytes) -> int:
    """Vocabulary columns per chunk of the NumPy path."""
    cap = NUMPY_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    return max(1, cap // max(per_column, 1))


def _np_forward(x, weight, bias, mask, act, workspace_bytes):
    b, l, d = x.shape
    v = weight.shape[0]
    dt = x.dtype
    a = acc_dtype(dt)
    half = dt.itemsize == 2
    xa = x.astype(a).reshape(b * l, d)
    keep = None if mask is None else (np.asarray(mask) != 0)
    idt = _index_dtype(l)
    out = np.empty((b, v), dt)
    arg = np.empty((b, v), idt)
    step = _np_step(2 * b * l * a.itemsize, workspace_bytes)  # the logits and their masked copy
    empty = None if keep is None else ~keep.any(axis=1)[:, None]  # all-masked rows give 0
    for v0 in range(0, v, step):
        v1 = min(v, v0 + step)
        logits = xa @ weight[v0:v1].astype(a).T
        if half:  # the GPU path stores the logits in the input dtype before the max
            logits = logits.astype(dt).astype(a)
        logits = logits.reshape(b, l, v1 - v0)
        if keep is not None:
            logits = np.where(keep[:, :, None], logits, -np.inf)
        idx = np.argmax(logits, axis=1)  # first occurrence: ties go to the lowest l; NaN wins
        m = np.take_along_axis(logits, idx[:, None, :], axis=1)[:, 0, :]
        if bias is not None:
            m = m + bias[v0:v1].astype(a)
        val = _np_act(m, act)
        if empty is not None:
            val, idx = np.where(empty, 0, val), np.where(empty, 0, idx)
        out[:, v0:v1] = val.astype(dt)
        arg[:, v0:v1] = idx.astype(idt)
    return out, arg


def _np_backward(x, weight, out, arg, g, has_bias, act, workspace_bytes=None):
    b, l, d = x.shape
    v = weight.shape[0]
    dt = x.dtype
    a = acc_dtype(dt)
    xa = x.astype(a)
    gp = _np_gprime(out, g.astype(dt).astype(a), act)  # grad_out in out's dtype, as on the GPU
    dxa = np.zeros((b, l, d), a)
    dw = np.empty((v, d), dt)
    bi = np.arange(b)[:, None]
    step = _np_step(2 * b * d * a.itemsize, workspace_bytes)
    for v0 in range(0, v, step):
        v1 = min(v, v0 + step)
        idx = arg[:, v0:v1].astype(np.intp)
        w = gp[:, v0:v1]
        on = (w != 0)[..., None]  # inactive entries contribute exactly nothing (not 0 * inf)
        rows = np.where(on, xa[bi, idx], 0)  # (B, vc, D): the winning x row of every (b, v)
        dw[v0:v1] = np.einsum("bv,bvd->vd", w, rows).astype(dt)
        contrib = np.where(on, w[..., None] * weight[v0:v1].astype(a)[None], 0)
        np.add.at(dxa, (np.broadcast_to(bi, idx.shape), idx), contrib)  # sequential: deterministic
    dbias = gp.sum(axis=0).astype(dt) if has_bias else None
    return dxa.astype(dt), dw, dbias


# ----------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------
def splade_pool_forward(x, weight, bias=None, mask=None, *, activation: str = "log1p_relu",
                        workspace_bytes: Optional[int] = None,
                        requires_grad: bool = True) -> Tuple[Any, Context]:
    """SPLADE's max-pooled vocabulary representation and a context for the backward.

    Parameters
    ----------
    x : (B, L, D) array (numpy or cupy), float16 / bfloat16 / float32 / float64
        Hidden states.
    weight : (V, D) array, x's dtype
        The vocabulary projection in ``nn.Linear`` / Hugging Face decoder layout.  A (D, V)
        matrix ``w`` is passed as ``w.T`` (a view; it is read in place, never copied).
    bias : (V,) array or None
    mask : (B, L) bool or 0/1 array, or None (every position counts)
    activation : "relu" | "log1p_relu"
    workspace_bytes : int, optional
        Cap on the logit workspace of the cuBLAS-tile forward, default 64 MiB: the logits of
        (batches × vocabulary) tiles are computed one tile at a time; (B, L, V) never exists.
        The fused forward (16-bit inputs where the tensor-core tiles run, see the module
        docstring) holds no logits and ignores it.
    requires_grad : bool
        Keep what :func:`splade_pool_backward` needs (x, weight, out, the arg-max).

    Returns
    -------
    out : (B, V) array, x's dtype
        ``act(max_{l: mask[b,l]} x[b,l]·W[v] + bias[v])``; 0 for a row whose mask is all zero.
    ctx : Context
        ``ctx.stats == (argmax,)``: (B, V) int16 (int32 when L > 32768), the winning l; ties
        go to the lowest l; 0 for all-masked rows.

    Notes
    -----
    For float16 / bfloat16 the logits are accumulated in float32 and rounded to the input
    dtype before the max (as a PyTorch half matmul gives them), so ties are judged on the
    rounded values; the bias is added in float32 and the result rounded once.  A NaN logit
    that reaches the max gives a NaN output (its arg-max is then unspecified, and the NaN
    reaches the gradients).
    """
    xp, workspace_bytes = _check(x, weight, bias, mask, activation, workspace_bytes)
    act = _act_code(activation)
    if xp is np:
        out, arg = _np_forward(x, weight, bias, mask, act, workspace_bytes)
    else:
        with x.device:  # launches and cuBLAS on the arrays' GPU, whatever the current one is
            out, arg = _gpu_forward(x, weight, bias, mask, act, workspace_bytes)
    ctx = Context("splade_pool", "none", x.shape[0], xp, stats=(arg,) if requires_grad else ())
    if requires_grad:
        ctx.saved = dict(x=x, weight=weight, out=out, arg=arg, bias=bias, act=act,
                         ws=workspace_bytes)
    return out, ctx


def splade_pool_backward(ctx: Context, grad_out) -> Tuple[Any, Any, Optional[Any]]:
    """Gradients of ``Σ grad_out · out`` w.r.t. x, weight and bias (None without a bias).

    ``grad_out``: (B, V) array of the same kind (cast to out's dtype).  Returns ``dx`` (B, L, D),
    ``dweight`` (V, D) and ``dbias`` (V,) in the inputs' dtype; only the entries with
    ``g' = grad_out · act'(out) != 0`` are touched (see the module notes).
    """
    _require(ctx, "splade_pool")
    s = ctx.saved
    op = "splade_pool_backward"
    _check_grad_out(op, ctx.xp, grad_out, tuple(s["out"].shape), s["x"])
    if ctx.xp is np:
        return _np_backward(s["x"], s["weight"], s["out"], s["arg"], grad_out,
                            s["bias"] is not None, s["act"], s["ws"])
    with s["x"].device:
        return _gpu_backward(s["x"], s["weight"], s["out"], s["arg"], grad_out,
                             s["bias"] is not None, s["act"])


def splade_pool_backward_from_stats(x, weight, out, argmax, grad_out, *, bias=None,
                                    activation: str = "log1p_relu"):
    """The gradients from ``x``, ``weight``, the forward's ``out`` and arg-max (``ctx.stats[0]``).

    For callers that keep only these between forward and backward (the PyTorch op).  ``bias``
    is used only for its presence, shape and dtype: ``dbias`` is returned iff it is given.
    Same result as :func:`splade_pool_backward` on the forward's context.
    """
    op = "splade_pool_backward_from_stats"
    xp, _ = _check(x, weight, bias, None, activation, None, op=op)
    b, l, _d = x.shape
    v = weight.shape[0]
    want = _index_dtype(l)
    for name, arr, dtype in (("out", out, x.dtype), ("argmax", argmax, want)):
        ok = isinstance(arr, np.ndarray) if xp is np else _checks.is_cupy_array(arr)
        if not ok or tuple(arr.shape) != (b, v) or arr.dtype != dtype:
            got = f"{type(arr).__name__} {getattr(arr, 'shape', '')} {getattr(arr, 'dtype', '')}"
            raise ValueError(f"{op}: {name} must be a ({b}, {v}) {dtype} {xp.__name__} array "
                             f"(from splade_pool_forward), got {got}")
        if xp is not np and arr.device.id != x.device.id:
            raise ValueError(f"{op}: {name} is on cuda:{arr.device.id} but x is on "
                             f"cuda:{x.device.id}")
    if xp is np and argmax.size and (argmax.min() < 0 or argmax.max() >= l):
        raise ValueError(f"{op}: argmax values must be positions in [0, {l}), got "
                         f"[{argmax.min()}, {argmax.max()}]")
    # (on the GPU values are not read back; an out-of-range position makes its entry inactive)
    ctx = Context("splade_pool", "none", b, xp, stats=(argmax,),
                  saved=dict(x=x, weight=weight, out=out, arg=argmax, bias=bias,
                             act=_act_code(activation), ws=None))
    return splade_pool_backward(ctx, grad_out)


def splade_pool(x, weight, bias=None, mask=None, *, activation: str = "log1p_relu",
                workspace_bytes: Optional[int] = None):
    """SPLADE's (B, V) representation of ``x`` (B, L, D); see :func:`splade_pool_forward`."""
    return splade_pool_forward(x, weight, bias, mask, activation=activation,
                               workspace_bytes=workspace_bytes, requires_grad=False)[0]


def _check_out(op, out):
    xp = _checks.array_module(op, out=out)
    if out.ndim != 2:
        raise ValueError(f"{op}: out must be 2-D (B, V), got shape {tuple(out.shape)}")
    _checks.check_float(op, "out", out)
    if out.shape[0] < 1:
        raise ValueError(f"{op}: out needs B >= 1 rows, got shape {tuple(out.shape)}")
    return xp


def flops_regularizer(out):
    """SPLADE's FLOPS regularizer ``Σ_v (mean_b out[b, v])²`` of a (B, V) representation.

    Returns a 0-d float32 array (float64 for float64 ``out``); the column means are
    accumulated in that type without a widened copy of ``out``.
    """
    xp = _check_out("flops_regularizer", out)
    a = acc_dtype(out.dtype)
    mean = out.mean(axis=0, dtype=a)
    return xp.asarray((mean * mean).sum())


def flops_regularizer_backward(out, grad: Any = 1.0):
    """``d/d out`` of ``grad · flops_regularizer(out)``: ``grad · 2 · mean_b(out[:, v]) / B``.

    ``grad`` is a real or a 0-d array of the same kind (never read back from the device).
    Returns a (B, V) array of out's dtype.
    """
    op = "flops_regularizer_backward"
    xp = _check_out(op, out)
    g = _checks.check_grad_loss(op, grad, "sum", out.shape[0], xp)
    a = acc_dtype(out.dtype)
    col = out.mean(axis=0, dtype=a) * a.type(2.0 / out.shape[0])
    if not isinstance(g, numbers.Real):
        col = col * g.astype(a).reshape(())
    elif g != 1.0:
        col = col * a.type(g)
    return xp.broadcast_to(col.astype(out.dtype)[None, :], out.shape).copy()
