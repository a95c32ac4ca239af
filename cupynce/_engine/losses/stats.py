"""The statistics kernels every softmax loss path shares (``kernels_src/losses/stats.cu``):
the fixed-order merge of column states, the positive dots, a score block's row and column
statistics in one read.  The row blocks, the score tiles and the TF32x3 NT-Xent use them.
"""
from __future__ import annotations

import numpy as np

from ..arrays import leading_dim
from ..kernels import BLOCK, acc_dtype, launch

FILE = "losses/stats.cu"


def col_lse(states):
    """The column log-sum-exps (Nc,) of P row sets' column states (P, 2, Nc) (``clip(...,
    col_state=True)``), merged in set order by ``col_combine`` (fixed order: the same bits
    wherever it runs on the same states)."""
    import cupy as cp

    p, _, nc = states.shape
    m = cp.ascontiguousarray(states[:, 0])
    s = cp.ascontiguousarray(states[:, 1])
    out = cp.empty((nc,), states.dtype)
    # (the float32 / float64 instance: its accumulator type is the states')
    launch(FILE, "col_combine", states.dtype, (-(-nc // 32),),
                   (m, s, np.int32(p), np.int32(nc), 0, 0, np.int32(3), 0, 0, out, 0))
    return out


def pair_dots(an, bn):
    """The raw dots a_i · b_i (n,) in the accumulator dtype (the positive logits before the
    scale: the tile path's column shift)."""
    import cupy as cp

    t = an.dtype
    n, d = an.shape
    b_rows = bn if leading_dim(bn) == d else cp.ascontiguousarray(bn)
    out = cp.empty((n,), acc_dtype(t))
    launch(FILE, "paired_dots", t, (-(-n * 32 // BLOCK),),
                   (an, np.int64(leading_dim(an)), b_rows, np.int32(n), np.int32(1),
                    np.int32(d), out, 0))
    return out


#: rows of a score block per ``row_col_stats`` CTA, 8 warps of 4 (the kernel's R): the rows
#: each column partial covers, ``col_combine``'s chunk
STATS_ROWS = 32


def row_col_stats(s_blk, t, row0: int, pos_shift: int, pos_mod: int, scale_log, scale_mul,
                  lse_ptr: int, loss_ptr: int, part_m, part_s) -> int:
    """``cpn_row_col_stats`` over the score block ``s_blk`` (rows, nc) of the accumulator
    dtype (``t`` the inputs' dtype, which names the kernel): each row's log-sum-exp of
    scale · S into ``lse_ptr`` (and its loss, lse - L at column (i + pos_shift) mod
    pos_mod, into ``loss_ptr`` unless 0), both indexed by the global row i = ``row0`` + r
    (the pointers already shifted), and the column partials of every :data:`STATS_ROWS`
    rows into ``part_m`` / ``part_s`` (chunks, nc: each column's maximum over the chunk's
    rows and the sum of exp(L - max)) -- one read of the block.  Returns the number of chunks
    (``col_combine``'s)."""
    rows, nc = s_blk.shape
    chunks = -(-rows // STATS_ROWS)
    launch(FILE, "row_col_stats", t, (chunks,), (
        s_blk, np.int64(leading_dim(s_blk)), np.int32(rows), np.int32(nc),
        np.int32(row0), np.int32(pos_shift), np.int32(pos_mod), scale_log, scale_mul,
        lse_ptr, loss_ptr, part_m, part_s))
    return chunks


#: rows numbered past the columns: a block with no diagonal and no positive (see :func:`cross`)
FAR_MOD = 2 ** 31 - 1
