"""The chooser by cost (issue 53, item 6): which path a call takes, decided from shapes, flags,
the configuration and the workspace alone -- on the CPU (zero NumPy arrays stand in for the
device's; every workspace is given, so no free-memory query runs).  The paths themselves
against the float64 oracle: ``tests/ops/test_contrastive_kernels.py``
(``test_clip_keeps_scores_at_large_d``, ``test_nt_xent_keeps_scores_at_large_d``, GPU).
"""
from __future__ import annotations

import numpy as np
import pytest

from cupynce import _engine
from cupynce._engine.losses import row_blocks
from cupynce.ops import clip as clip_op
from cupynce.ops import nt_xent as nt_xent_op


def _rows(n: int, d: int, dtype=np.float16) -> np.ndarray:
    return np.zeros((n, d), dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_kept_scores_take_four_bytes_a_score(dtype):
    """float32 scores; a 16-bit G is written over them, so 16-bit inputs need no more."""
    n = 200
    a = _rows(n, 64, dtype)
    assert row_blocks.clip_keeps_scores(a, a, 4 * n * n)
    assert not row_blocks.clip_keeps_scores(a, a, 4 * n * n - 1)
    assert row_blocks.nt_xent_keeps_scores(a, 4 * n * n, "nt_xent")
    assert not row_blocks.nt_xent_keeps_scores(a, 4 * n * n - 1, "nt_xent")


def test_a_workspace_below_one_row_is_a_no_not_an_error():
    """The chooser asks whether the whole matrix fits; a workspace the path's rows would not
    fit is a "no" (the tiles then plan their own rows), never the row planner's ValueError."""
    a = _rows(200, 64)
    assert not row_blocks.clip_keeps_scores(a, a, 10)
    assert not row_blocks.nt_xent_keeps_scores(a, 10, "nt_xent")


def test_clip_keeps_scores_for_a_fused_wide_call_of_one_rank(configure):
    n, d = 200, 2048
    a, ws = _rows(n, d), 4 * n * n
    keeps = _engine._clip_keeps_scores
    assert keeps(a, a, True, True, ws, 0, False)
    assert not keeps(a, a, True, False, ws, 0, False), "no gradient: nothing recomputed"
    assert not keeps(a, a, False, True, ws, 0, False), "the backward of the statistics"
    assert not keeps(a, a, True, True, ws, 5, False), "a rank's block (row0)"
    assert not keeps(a, a, True, True, ws, 0, True), "a rank's block (col_state)"
    assert not keeps(a, a, True, True, ws - 1, 0, False), "the matrix does not fit"
    assert not keeps(_rows(n, d - 8), _rows(n, d - 8), True, True, ws, 0, False)
    configure(keep_scores_min_dim=64)
    assert keeps(_rows(n, 64), _rows(n, 64), True, True, ws, 0, False)


def test_nt_xent_keeps_scores_from_its_bounds(configure):
    n, d = 200, 4096
    z, ws = _rows(n, d), 4 * n * n

    def keeps(q=z, neg_s=None, exclude_diag=True, pos_shift=n // 2, pos_mod=n,
              self_pair=True, scale_log=None, workspace=ws):
        return _engine._nt_xent_keeps_scores(q, neg_s, exclude_diag, pos_shift, pos_mod,
                                             self_pair, scale_log, workspace, "nt_xent")

    assert not keeps(), "N · D below nt_xent_keep_min_nd (2^26)"
    configure(nt_xent_keep_min_nd=0)
    assert keeps()
    assert not keeps(workspace=ws - 1)
    assert not keeps(q=_rows(n, 2048)), "below nt_xent_keep_min_dim"
    assert not keeps(neg_s=_rows(3, d)), "extra negatives: S is not symmetric"
    assert not keeps(self_pair=False), "InfoNCE's keys"
    assert not keeps(pos_shift=1), "positives not the i <-> i + N/2 pairing"
    assert not keeps(scale_log=np.zeros(1, np.float32)), "a learnable scale"
    assert not keeps(exclude_diag=False)


def test_graph_estimates_count_the_kept_scores(configure):
    """``_graphs.run``'s ``est_bytes``: a plan of a kept-scores call holds the float32
    matrix (a plan above ``MAX_PLAN_BYTES`` is then never built)."""
    n = 1000
    wide, narrow = _rows(n, 4096), _rows(n, 512)
    acc = np.dtype(np.float32)
    assert clip_op._score_block_bytes(wide, acc, None) == 4 * n * n
    assert clip_op._score_block_bytes(narrow, acc, None) == 0  # (the tiles keep none)
    assert nt_xent_op._kept_bytes(narrow, None) == 2 * n * n + 4 * n * 512  # 16-bit H
    configure(nt_xent_keep_min_nd=0)
    assert nt_xent_op._kept_bytes(wide, None) == 4 * n * n + 4 * n * 4096


def test_clip_labels_take_the_tiles_where_a_column_shift_exists(configure):
    """CLIP's labels= on the score tiles (``config.clip_labels_tiles``, default on; the
    kernels' masking is checked on the GPU: tests/ops/test_clip_labels.py): where the
    statistics pass has its column shift -- square problems compute it, a rank's block
    (row0, more columns than rows) must be given it -- and always for a gradient pass alone."""
    n, d = 200, 64
    a, b_all = _rows(n, d), _rows(3 * n, d)
    lab = np.zeros(3 * n, np.int64)
    labs = (lab, lab)

    def on_tiles(*args, labels=labs):
        return _engine._clip_labels_tiles(*args, labels)
    assert on_tiles(a, a, True, 0, None), "square: score_tiles.clip computes the shift"
    assert not on_tiles(a, b_all, True, n, None), "a rank's block without the pairs' dots"
    assert not on_tiles(a, b_all, True, 0, None), "rank 0's block: more columns than rows"
    assert on_tiles(a, b_all, True, n, np.zeros(3 * n, np.float32)), "the dots given"
    assert on_tiles(a, b_all, False, n, None), "the gradient pass takes no shift"
    assert not on_tiles(a, a, True, 0, None, labels=(lab, lab.copy())), "two label arrays"
    configure(clip_labels_tiles=False)
    assert not on_tiles(a, a, True, 0, None)
    assert not on_tiles(a, b_all, False, n, None)
