"""The tile kernels' shared plumbing: what the score tiles (``losses.score_tiles``), the
product tiles (``gemm.tf32x3``, ``gemm.f16x3``) and SPLADE's fused forward launch with.

* the tile geometry (:data:`TILE`) and the device's caps (:func:`device_caps`);
* :func:`tiles_ok` -- whether the 16-bit tile kernels take these operands, :func:`wgmma` --
  which main loop they run;
* :func:`grid_splits` -- the column splits of a tile grid;
* the packed launch arguments: ``TileArgs`` (:func:`pack_tile_args`) and the
  warp-specialised kernels' one 768-byte parameter (:func:`launch_blob`);
* :func:`tile_map` -- the tensor maps of the operands, cached; :func:`ws_smem` /
  :func:`tile_launch` -- the shared-memory opt-in, once per kernel.
"""
from __future__ import annotations

import functools
import struct
from typing import Dict, Optional, Tuple

import numpy as np

from .. import config
from . import kernels, tma
from .arrays import leading_dim, ptr

#: the 16-bit score tiles' source (``wgmma`` asks whether it is built for sm_90a here)
TILES_FILE = "losses/tiles.cu"

TILE = 128  # rows / columns of one score tile (TBM = TBN in tiles.cu)
TILE_THREADS = 256
#: dynamic shared memory of a tile CTA (TSMEM_BYTES / WSMEM_BYTES in tiles.cu; a GPU test
#: checks they agree through cpn_tile_smem): mma.sync, 3 stages x (TBM + TBN) x TLD x 2 bytes;
#: wgmma, 6 stages x (TBM + TBN) x TBK x 2 bytes + 1 KiB to align the swizzled stages
TILE_SMEM = 3 * (128 + 128) * 72 * 2
WG_SMEM = 6 * (128 + 128) * 64 * 2 + 1024

#: (compute capability, SM count) per device id
SM_COUNT: Dict[int, Tuple[int, int]] = {}


def device_caps() -> Tuple[int, int]:
    """(compute capability as an int, SM count) of the current device, cached per device."""
    import cupy as cp

    dev = cp.cuda.Device()
    if dev.id not in SM_COUNT:
        SM_COUNT[dev.id] = (int(dev.compute_capability),
                             int(dev.attributes["MultiProcessorCount"]))
    return SM_COUNT[dev.id]


#: threads of the warp-specialised kernels (a TMA producer warpgroup, two consumers)
WS_THREADS = 384


def tiles_ok(*xs) -> bool:
    """Whether the tile kernels take these (2-D, same 16-bit dtype) operands (see
    ``config.tiles``)."""
    use = config.current().tiles
    if use is False or xs[0].dtype.itemsize != 2:
        return False
    for x in xs:
        if x is None:
            continue
        if x.shape[1] % 8 or leading_dim(x) % 8 or x.data.ptr % 16:
            return False
    if use is None:
        return wgmma()
    return device_caps()[0] >= 80


def wgmma() -> bool:
    """Whether the tile kernels run the wgmma main loop (tiles.cu built for sm_90a here)."""
    return config.current().wgmma and kernels.arch_specific_build(TILES_FILE)


def grid_splits(row_tiles: int, col_tiles: int) -> int:
    return grid_splits_for(row_tiles, col_tiles, device_caps()[1])


@functools.lru_cache(maxsize=1024)
def grid_splits_for(row_tiles: int, col_tiles: int, slots: int) -> int:
    """Column splits of a tile grid: the fewest (longest CTAs, fewest partials) that fill the
    GPU's CTA slots in waves >= 90 % full on average, else the best-filling count.

    Slots: one CTA per SM for both main loops (wgmma: 193 KiB of shared memory; mma.sync:
    116 KiB, two of which exceed an H100 SM's 228 KiB).  (N = 8192 on an H100: 64 row tiles
    x 2 splits = 128 CTAs, one wave 97 % full, where the former "two CTAs per SM" rule gave
    320 CTAs in 3 waves, the last 42 % full.)
    """
    rt = max(row_tiles, 1)
    best, best_fill = 1, 0.0
    for s in range(1, max(1, min(col_tiles, 4 * slots)) + 1):
        ctas = rt * s
        fill = ctas / (slots * -(-ctas // slots))
        if fill >= 0.9:
            return s
        if fill > best_fill:
            best, best_fill = s, fill
    return best


#: The contrastive tile kernels' arguments: one by-value struct (``TileArgs`` in tiles.cu),
#: packed with ``struct`` -- one parameter for CuPy to marshal instead of 31 (~20 us less
#: host time per launch).  16 pointers, 6 int64, 9 int32, 2 float32, padded to 8 bytes
#: (224 bytes); ``TILE_ARGS_FIELDS`` is the declaration order (a GPU test checks the offsets).
#: ``lab_r`` / ``lab_c``: CLIP's int64 labels (the ``lse2`` and ``clip`` stages; 0: none).
TILE_ARGS_FORMAT = "<16Q6q9i2f4x"
TILE_ARGS_FIELDS = (
    "A", "B1", "B2", "scale_log", "part_m", "part_s", "pos_out", "colp_m", "colp_s",
    "lse_row", "lse_col", "w_ptr", "g", "dsp_part", "lab_r", "lab_c",
    "lda", "ldb1", "ldb2", "part_ld", "w_stride", "ldg",
    "rows", "row0", "n1", "n2", "d", "exclude_diag", "pos_shift", "pos_mod", "tri",
    "scale_mul", "w_mul")
TILE_ARGS_DTYPE = np.dtype({"names": ["raw"], "formats": [("u1", struct.calcsize(TILE_ARGS_FORMAT))]})
pack_tile_args = struct.Struct(TILE_ARGS_FORMAT).pack
#: the warp-specialised kernels' one parameter (``WsLaunch`` of tile_ws.cuh; the TF32 / F16x3
#: kernels' ``WsTf32Launch`` / ``WsF16Launch`` begin alike): four 128-byte tensor maps, the
#: packed TileArgs at byte ``LAUNCH_ARGS_AT``, the ring (int32) after it, then the F16x3
#: kernels' fields; ``LAUNCH_BYTES`` in all (64-aligned).  One struct instead of five or six
#: arguments: CuPy's launch of six such arguments took ~38 µs of host time, of one 768-byte
#: struct ~13 (H100 host, 2026-11-27).
LAUNCH_ARGS_AT = 512
LAUNCH_BYTES = 768
LAUNCH_DTYPE = np.dtype({"names": ["raw"], "formats": [("u1", LAUNCH_BYTES)]})
_RING = struct.Struct("<i")


def launch_blob(maps, raw: bytes, ring: int, tail: bytes = b"") -> np.ndarray:
    """The one kernel argument of the warp-specialised tiles: the four tensor ``maps`` (NumPy
    128-byte records) at 0, 128, 256, 384, the packed TileArgs ``raw`` at ``LAUNCH_ARGS_AT``,
    the int32 ``ring`` after it, then ``tail``, zero-padded to ``LAUNCH_BYTES``."""
    blob = b"".join([mp.tobytes() for mp in maps] + [raw, _RING.pack(ring), tail])
    if len(maps) != 4 or len(raw) != TILE_ARGS_DTYPE.itemsize or len(blob) > LAUNCH_BYTES:
        raise ValueError(f"launch_blob: 4 maps and {TILE_ARGS_DTYPE.itemsize} bytes of "
                         f"TileArgs fitting {LAUNCH_BYTES} bytes, got {len(maps)} maps, "
                         f"{len(raw)} bytes, {len(blob)} in all")
    return np.frombuffer(blob + bytes(LAUNCH_BYTES - len(blob)), LAUNCH_DTYPE)


def shifted(w_arr, w_stride: int, c0: int) -> Optional[int]:
    """The float32 per-index weights ``w_arr`` (stride ``w_stride``) from index ``c0`` on, as
    a pointer (None when there are none): a column block's weights, its columns from 0."""
    return None if w_arr is None else ptr(w_arr) + 4 * c0 * w_stride


#: tensor maps by (pointer, rows, columns, leading dimension, dtype, box rows: 128, or 32 for
#: the transposed product of gemm.tf32x3), boxes of one
#: 128-byte row (64 16-bit values, or 32 float32 for gemm.tf32x3): encoding one is a driver call
#: and two NumPy allocations, the same map for the same matrix; None where the driver refused
#: it (the same answer for the same key: not asked again on every call)
_MAPS: Dict[tuple, Optional[np.ndarray]] = {}
_MAPS_MAX = 512


def tile_map(x, box_rows: int = TILE) -> Optional[np.ndarray]:
    # (the dtype itself in the key: its .name is computed in Python, µs a call)
    key = (x.data.ptr, x.shape[0], x.shape[1], leading_dim(x), x.dtype, box_rows)
    try:  # (not `key in _MAPS` then a read: another thread may clear it in between)
        return _MAPS[key]
    except KeyError:
        pass
    m = tma.matrix_map(x, box_rows, 128 // x.dtype.itemsize)
    if len(_MAPS) >= _MAPS_MAX:
        _MAPS.clear()
    _MAPS[key] = m
    return m


#: per warp-specialised kernel, by its id: (its static shared memory, the device's opt-in
#: maximum, the kernel itself -- held, so that its id names no other object while recorded:
#: a new kernel given a dropped one's id would be launched without the opt-in,
#: CUDA_ERROR_INVALID_VALUE)
_WS_SMEM: Dict[int, Tuple[int, int, object]] = {}


def ws_smem(kern) -> Tuple[int, int]:
    """(static shared memory, the device's opt-in maximum per block) of the warp-specialised
    kernel ``kern`` (or any kernel with dynamic shared memory: SPLADE's gradient rings), opted
    in to all the dynamic shared memory that leaves (once)."""
    info = _WS_SMEM.get(id(kern))
    if info is None or info[2] is not kern:
        import cupy as cp

        smem_max = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
        static = int(kern.attributes["shared_size_bytes"])
        if kern.max_dynamic_shared_size_bytes < smem_max - static:  # opt in, once
            kern.max_dynamic_shared_size_bytes = smem_max - static
        # recorded only once set: a thread that finds the record launches with the opt-in
        # applied (two threads racing here at worst both set it)
        info = _WS_SMEM[id(kern)] = (static, smem_max, kern)
    return info[0], info[1]


#: kernels already opted in to their dynamic shared memory (the attribute query costs host
#: time), by id, each held (see _WS_SMEM)
_SMEM_OPTED: Dict[int, object] = {}


def tile_launch(filename: str, stage: str, t, grid, args) -> None:
    """Launch ``cpn_(wg)tile_<stage>`` of ``kernels_src/filename`` (``tiles.cu``, or SPLADE's
    ``splade_tiles.cu``) with the main loop in use and its shared memory."""
    wg = wgmma()
    kern = kernels.get_kernel(filename, f"{'wgtile' if wg else 'tile'}_{stage}", t)
    smem = WG_SMEM if wg else TILE_SMEM
    if _SMEM_OPTED.get(id(kern)) is not kern:  # opt in above 48 KiB, once per kernel
        if kern.max_dynamic_shared_size_bytes < smem:
            kern.max_dynamic_shared_size_bytes = smem
        _SMEM_OPTED[id(kern)] = kern
    kern(tuple(grid), (TILE_THREADS,), args, shared_mem=smem)
