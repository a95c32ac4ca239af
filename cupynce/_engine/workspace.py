"""How much scratch a call may take: the score-block workspace and the row blocks under it.

``workspace_bytes=None`` means ``min(config.default_workspace_bytes,
config.free_memory_fraction x free memory)``, except that a whole block of at most
``config.small_block_bytes`` is taken without asking the driver (the free-memory query costs
more host time than a small op's kernels).  Every loss path plans its blocks here.
"""
from __future__ import annotations

from typing import Optional

from .. import config


def free_device_bytes() -> int:
    """Free device memory plus what CuPy's pool holds unused (no stream synchronisation)."""
    import cupy

    free, _total = cupy.cuda.runtime.memGetInfo()
    pool = cupy.get_default_memory_pool()
    return int(free) + int(pool.free_bytes())


def workspace_cap(workspace_bytes: Optional[int]) -> int:
    """The workspace in bytes: the caller's cap, else ``min(default_workspace_bytes,
    free_memory_fraction * free memory)`` (:mod:`cupynce.config`)."""
    if workspace_bytes is not None:
        return workspace_bytes
    cfg = config.current()
    return min(cfg.default_workspace_bytes, int(cfg.free_memory_fraction * free_device_bytes()))


def workspace_bound(workspace_bytes: Optional[int]) -> int:
    """The workspace cap without its free-memory bound (no driver query): the caller's, else
    ``default_workspace_bytes`` -- an upper bound of :func:`workspace_cap` for estimates."""
    return config.current().default_workspace_bytes if workspace_bytes is None \
        else workspace_bytes


def fits(nbytes: int, workspace_bytes: Optional[int]) -> bool:
    """Whether a buffer of ``nbytes`` fits the workspace (see :func:`plan_rows`)."""
    if workspace_bytes is None and nbytes <= config.current().small_block_bytes:
        return True
    return nbytes <= workspace_cap(workspace_bytes)


def plan_rows(op: str, rows: int, bytes_per_row: int, workspace_bytes: Optional[int],
              *, align: int = 64) -> int:
    """Rows per block so that ``rows_per_block * bytes_per_row <= workspace``.

    ``workspace_bytes=None`` takes ``min(default_workspace_bytes, free_memory_fraction *
    free memory)``, except that a whole block of at most ``small_block_bytes`` is taken
    without asking the driver for the free memory (the query costs more host time than a
    small op's kernels).  Blocks are rounded down to a multiple of ``align`` rows when larger.
    """
    if workspace_bytes is None and rows * bytes_per_row <= config.current().small_block_bytes:
        return rows
    cap = workspace_cap(workspace_bytes)
    r = cap // max(bytes_per_row, 1)
    if r < 1:
        raise ValueError(f"{op}: workspace_bytes={workspace_bytes} is smaller than one row of the "
                         f"score block ({bytes_per_row} bytes); give at least that")
    if r >= rows:
        return rows
    return (r // align) * align if r >= align else r
