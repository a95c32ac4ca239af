"""The engine's one configuration: every switch and threshold that decides which kernels a
call runs, in one immutable :class:`Config`.

The engine reads :func:`current` (this thread's configuration: the process-wide one, or a
:func:`scope`'s derivation of it, :func:`float32_precision` being one); nothing else in cupynce
holds a switch.
The CUDA-graph cache (``cupynce.ops._graphs``) keys its plans by the :class:`Config` object
itself, so a new setting can never replay a plan captured under another.

The environment variables are read once, when cupynce is imported (:meth:`Config.from_env`):

==============================  ======================  =====================================
environment variable            field                   effect
==============================  ======================  =====================================
``CUPYNCE_FLOAT32``             ``float32_precision``   "auto" | "fp32" | "tf32" | "3xtf32"
``CUPYNCE_TILES``               ``tiles``               unset/"auto": None; "1" True; "0" False
``CUPYNCE_WSTILE=0``            ``ws_tiles``            the warp-specialised tiles off
``CUPYNCE_TILE_WORKSPACE_MIB``  ``tile_workspace_...``  CLIP / SigLIP tiles' default budget
``CUPYNCE_F16X3=0``             ``f16x3``               "auto"'s products on TF32x3, not F16x3
``CUPYNCE_SIDE=0``              ``side_streams``        no side-stream overlap
``CUPYNCE_GRAPHS=0``            ``graphs``              no CUDA-graph replay
``CUPYNCE_GRAPH_VARIANTS=0``    ``graph_variants``      one graph per problem, no variants
``CUPYNCE_PREBUILT=0``          ``prebuilt``            ignore the wheel's cubins (JIT)
``CUPYNCE_DEBUG_KERNELS``       ``debug_kernels``       print each kernel's resources
``CUPYNCE_CPU_TORCH=0``         ``cpu_torch``           torch CPU tensors on the NumPy path
``CUPYNCE_RING_GPU=1``          ``ring_gpu``            the global rings on CuPy arrays too
``CUPYNCE_MM_K_SPLITS=1``       ``mm_k_splits``         TF32x3 dA = G·B K whole (default 8)
==============================  ======================  =====================================

In code::

    import cupynce.config as cfg
    cfg.set(f16x3=False)                    # process-wide, from now on
    with cfg.override(tiles=False):         # process-wide, restored on exit (tests, A/B runs)
        ...
    with cfg.float32_precision("3xtf32"):   # this thread only (what ``precision=`` opens)
        ...
    with cfg.scope(graphs=False):           # this thread only, any fields
        ...

``cupynce.set_float32_precision(p)`` is ``set(float32_precision=p)``.  The 0.2 module
attributes that set these (``products_tf32.USE_F16X3``, ``tiles.USE_TILES``, ...) still
work in 0.3 with a ``DeprecationWarning`` (``cupynce._engine.compat``).

This module imports nothing from cupynce, nor CuPy or torch.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, FrozenSet, Mapping, Optional

__all__ = ["Config", "FLOAT32_PRECISIONS", "current", "get", "set", "override", "scope",
           "float32_precision", "scoped_precision", "check_precision"]

#: The float32 product modes (``cupynce.set_float32_precision`` documents them).
FLOAT32_PRECISIONS = ("fp32", "tf32", "3xtf32", "auto")


def check_precision(value: Any, what: str) -> str:
    """``value`` if it is a float32 precision, else ``ValueError`` naming ``what``."""
    if value not in FLOAT32_PRECISIONS:
        raise ValueError(f"{what}={value!r} is not a float32 precision; expected one of "
                         f"{', '.join(map(repr, FLOAT32_PRECISIONS))}")
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    """Every engine switch (immutable: :func:`set` and the scopes make new ones).

    The measurements behind the defaults are in the comments of the modules that read them
    (named per field).
    """

    # -- float32 products (``_engine.gemm``) -------------------------------------------------
    #: how float32 products run: "auto" | "fp32" | "tf32" | "3xtf32"
    float32_precision: str = "auto"
    #: "auto"'s products on the F16x3 tiles where they run (False: the TF32x3 tiles)
    f16x3: bool = True
    #: "auto" takes the TF32x3 / F16x3 tiles from this many rows (both operands) ...
    tf32x3_min_rows: int = 4096
    #: ... and this many columns D (NT-Xent, InfoNCE, a global NT-Xent's rank blocks) ...
    tf32x3_min_dim: int = 64
    #: ... or this many for the ops with a learnable scale (CLIP, SigLIP: the scale gradient)
    tf32x3_min_dim_scale: int = 512
    #: the TF32x3 ``mm`` kernel's two consumers interleave their K steps (same bits)
    mm_interleave: bool = True
    #: the TF32x3 ``mm``'s K split: the row blocks' dA = G·B (K = N, few output tiles) runs
    #: its K over up to this many CTAs a tile, the partials summed in a fixed order
    #: (``tf32x3.k_splits``: chosen from K alone, so the same bits at every row block and on
    #: every GPU, not the unsplit product's), for K >= ``tf32x3.K_SPLIT_MIN_K`` (65536)
    #: alone; 1: never.  Default 8: float32 InfoNCE at D = 384 2.4x faster at N = 262144,
    #: 1.18x at 65536 on an H200 (docs/api.md, "At large N")
    mm_k_splits: int = 8
    #: the F16x3 products' store compensation 1 + this (the tensor cores' mean truncation)
    f16x3_trunc: float = 0.86e-7
    #: split the gradient products' operands on a side stream beside the score product
    side_splits: bool = True
    #: products of at most this many multiply-adds (and K <= ``small_gemm_max_k``) run the
    #: small-product kernel instead of cuBLAS
    small_gemm_macs: int = 1 << 20
    small_gemm_max_k: int = 1024

    # -- workspaces (``_engine.workspace``) --------------------------------------------------
    #: cap on the score-block workspace when the caller gives none (bytes)
    default_workspace_bytes: int = 1 << 30
    #: never take more than this fraction of the free device memory by default
    free_memory_fraction: float = 0.5
    #: a default-workspace block of at most this many bytes skips the free-memory query
    small_block_bytes: int = 128 << 20
    #: CLIP's and SigLIP's tile budget when the caller gives no ``workspace_bytes``
    tile_workspace_bytes: int = 256 << 20
    #: the small buffers of one call come from one allocation up to this size
    arena_bytes: int = 1 << 20

    # -- the score tiles (``_engine.losses.score_tiles``) ------------------------------------
    #: the tensor-core tiles for 16-bit inputs: None (where wgmma is built: Hopper), True
    #: (also mma.sync on other sm_80+), False (never; also SPLADE's fused forward and the
    #: float32 TF32x3 / F16x3 tiles)
    tiles: Optional[bool] = None
    #: on Hopper, the wgmma main loop (False: mma.sync)
    wgmma: bool = True
    #: the warp-specialised kernels for the stages of ``ws_stages`` (False: cp.async wgmma)
    ws_tiles: bool = True
    ws_stages: FrozenSet[str] = frozenset({"lse", "lse2", "g", "h", "clip", "siglip"})
    #: A resident in the ring where that leaves at least this many stages
    ws_ar_min_stages: int = 4
    #: most ring stages (WS_MAX_STAGES of tile_ws.cuh: a kernel-side limit, lower only)
    ws_max_stages: int = 8
    #: NT-Xent's forward computes each pair of score tiles once from N · D >= the minimum
    symmetric_lse: bool = True
    symmetric_lse_min_nd: int = 16384 * 512
    #: NT-Xent's gradient block computes each pair of tiles once when H fits one block
    symmetric_h: bool = True
    #: a fused 16-bit CLIP call at D >= this runs the cuBLAS row blocks that keep the whole
    #: score matrix where it fits the workspace (three products), not the tiles (four)
    keep_scores_min_dim: int = 2048
    #: CLIP's ``labels=`` on the score tiles (masked in their epilogues) where the tiles
    #: apply (False: the cuBLAS row blocks with ``clip_mask``, as before)
    clip_labels_tiles: bool = True
    #: a fused 16-bit NT-Xent call at D >= this and N · D >= the minimum keeps its scores
    #: where they fit (two cuBLAS products), not the tiles (two slower product-equivalents)
    nt_xent_keep_min_dim: int = 4096
    nt_xent_keep_min_nd: int = 16384 * 4096

    # -- SPLADE (``_engine.splade``) ---------------------------------------------------------
    #: the TMA / warp-specialised SPLADE forward on Hopper (False: the tile kernels)
    splade_ws: bool = True

    # -- overlap and replay --------------------------------------------------------------------
    #: side streams for the work that needs only a call's statistics (``_engine.side``)
    side_streams: bool = True
    #: CUDA-graph replay of repeated calls (``ops._graphs``)
    graphs: bool = True
    #: a graph per variant of a repeated problem (``ops._graphs``)
    graph_variants: bool = True
    #: the global losses' ring schedules (``ops._global.ring_blocks``: the exchange overlapped
    #: with the compute) on CuPy arrays too, the plain ops' (and the label smoothing): off until
    #: measured on several GPUs (issue 57); NumPy arrays take them wherever the communicator
    #: can shift
    ring_gpu: bool = False

    # -- the kernel loader (``_engine.kernels``) -----------------------------------------------
    #: load the wheel's prebuilt cubins where they match (False: NVRTC at the first call)
    prebuilt: bool = True
    #: print each kernel's registers and shared / local memory when it is loaded
    debug_kernels: bool = False

    # -- the CPU path (``ops._cpu``) -----------------------------------------------------------
    #: ``cupynce.torch`` on CPU tensors runs the CPU path's primitives on torch's functions
    #: (torch's thread pool, ``torch.set_num_threads``); False: on NumPy's, as NumPy arrays do
    cpu_torch: bool = True

    def __post_init__(self) -> None:
        check_precision(self.float32_precision, "Config.float32_precision")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            kind = _KINDS[f.name]
            ok = (v is None or isinstance(v, bool)) if kind is _OPT_BOOL else \
                isinstance(v, kind) and (kind is not int or not isinstance(v, bool))
            if kind is float:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok:
                raise TypeError(f"Config.{f.name}={v!r}: expected "
                                f"{'None or a bool' if kind is _OPT_BOOL else kind.__name__}")
        # (a dataclass recomputes its hash on every call: the graph keys hash this object
        # on every call of every op, so the hash is computed once here)
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def replace(self, **changes: Any) -> "Config":
        """A copy with ``changes`` (field names, validated)."""
        unknown = sorted(changes.keys() - _FIELDS)
        if unknown:
            raise TypeError(f"Config has no field {unknown[0]!r}; fields: "
                            f"{', '.join(sorted(_FIELDS))}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Config":
        """The defaults with the ``CUPYNCE_*`` environment variables of the module doc."""
        env = os.environ if environ is None else environ
        on = lambda name: env.get(name, "1") != "0"  # noqa: E731
        return cls(
            float32_precision=check_precision(env.get("CUPYNCE_FLOAT32", "auto"),
                                              "CUPYNCE_FLOAT32"),
            tiles={"0": False, "1": True}.get(env.get("CUPYNCE_TILES", "auto")),
            ws_tiles=on("CUPYNCE_WSTILE"),
            tile_workspace_bytes=_env_int(env, "CUPYNCE_TILE_WORKSPACE_MIB", 256) << 20,
            f16x3=on("CUPYNCE_F16X3"),
            side_streams=on("CUPYNCE_SIDE"),
            graphs=on("CUPYNCE_GRAPHS"),
            graph_variants=on("CUPYNCE_GRAPH_VARIANTS"),
            ring_gpu=env.get("CUPYNCE_RING_GPU", "0") == "1",
            mm_k_splits=_env_int(env, "CUPYNCE_MM_K_SPLITS", 8),
            prebuilt=env.get("CUPYNCE_PREBUILT", "1") != "0",
            debug_kernels=bool(env.get("CUPYNCE_DEBUG_KERNELS")),
            cpu_torch=on("CUPYNCE_CPU_TORCH"))


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    """The integer environment variable ``name`` (``default`` when unset); a ValueError
    naming it otherwise."""
    value = env.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected an integer") from None


_OPT_BOOL = object()
_KINDS = {"tiles": _OPT_BOOL, "ws_stages": frozenset}
_KINDS.update({f.name: {"bool": bool, "int": int, "float": float, "str": str}[f.type]
               for f in dataclasses.fields(Config) if f.name not in _KINDS})
_FIELDS = frozenset(f.name for f in dataclasses.fields(Config))

_global: Config = Config.from_env()


class _Local(threading.local):
    """This thread's :func:`scope`: its changes (a sorted tuple of (field, value) pairs), the
    precision among them, and the configuration derived for them from the process-wide one
    (None: outside a scope).  Class attributes, so that a read never misses (a ``getattr``
    default on a ``threading.local`` raises and catches inside)."""

    changes: Optional[tuple] = None
    precision: Optional[str] = None
    config: Optional[Config] = None
    base: Optional[Config] = None


_local = _Local()
_lock = threading.Lock()
#: (process-wide config, changes) -> the derived config (a scope opens on every call)
_derived: dict = {}


def get() -> Config:
    """The process-wide configuration (not this thread's scope: see :func:`current`)."""
    return _global


def current() -> Config:
    """The configuration in effect in this thread: the innermost :func:`scope`'s derivation
    of the process-wide one, else the process-wide one."""
    loc = _local
    ch = loc.changes
    if ch is None:
        return _global
    c = loc.config
    if c is None or loc.base is not _global:  # (set() ran since the scope opened)
        c = loc.config = _derive(_global, ch)
        loc.base = _global
    return c


def _derive(base: Config, changes: tuple) -> Config:
    key = (base, changes)
    c = _derived.get(key)
    if c is None:
        c = base if all(getattr(base, k) == v for k, v in changes) else \
            base.replace(**dict(changes))
        if len(_derived) > 64:
            _derived.clear()
        _derived[key] = c
    return c


def set(**changes: Any) -> Config:  # noqa: A001 - (cfg.set reads as intended)
    """Replace the process-wide configuration by a copy with ``changes``; returns the new
    one.  Every thread sees it from its next call (a thread inside a
    :func:`scope` keeps the fields that scope changes)."""
    global _global
    with _lock:
        _global = _global.replace(**changes)
        return _global


class override:
    """``with override(**changes):`` -- :func:`set` for the block, the previous process-wide
    configuration restored on exit (also ``override(config)`` with a whole :class:`Config`)."""

    def __init__(self, config: Optional[Config] = None, **changes: Any):
        self.new = (config or get()).replace(**changes) if changes else config
        self.before: Optional[Config] = None

    def __enter__(self) -> Config:
        global _global
        self.before = _global
        if self.new is not None:
            _global = self.new
        return _global

    def __exit__(self, *exc) -> None:
        global _global
        _global = self.before


class _Scope:
    """:func:`scope`'s context manager (a class, not a generator: every entry point opens a
    precision scope per call, forward and backward)."""

    __slots__ = ("changes", "precision", "prev")

    def __init__(self, changes: tuple):
        self.changes, self.prev = changes, None
        self.precision = dict(changes).get("float32_precision")

    def __enter__(self) -> None:
        loc = _local
        self.prev = (loc.changes, loc.precision, loc.config, loc.base)
        if loc.changes is None:  # (the common case: an op's precision scope, outermost)
            new, precision = self.changes, self.precision
        else:
            merged = {**dict(loc.changes), **dict(self.changes)}
            new, precision = tuple(sorted(merged.items())), merged.get("float32_precision")
        if new != loc.changes:
            loc.changes, loc.precision, loc.config, loc.base = new, precision, None, None

    def __exit__(self, *exc) -> bool:
        loc = _local
        loc.changes, loc.precision, loc.config, loc.base = self.prev
        return False


def scope(**changes: Any) -> _Scope:
    """``with scope(graphs=False):`` -- this thread's configuration is the process-wide one
    with ``changes`` for the block (validated here, before it opens), nested scopes merged,
    the previous one back on exit.  A :func:`set` during the block still shows through the
    fields the scope does not change."""
    get().replace(**changes)  # (names and values checked now)
    return _Scope(tuple(sorted(changes.items())))


def float32_precision(precision: str) -> _Scope:
    """``with float32_precision("3xtf32"):`` -- this thread's float32 products in that mode
    (validated here, before the scope opens); the previous one comes back on exit."""
    return _Scope((("float32_precision",
                    check_precision(precision, "float32_precision: precision")),))


def scoped_precision() -> Optional[str]:
    """This thread's scoped float32 precision (:func:`float32_precision`), None outside one."""
    return _local.precision
