"""CPU tests of benchmarks/bench_contrastive.py's product counting (the GPU runs it measures
need a GPU; the arithmetic of what its cuBLAS baseline issues does not)."""
from __future__ import annotations

import pytest
from bench_scripts import load


@pytest.fixture(scope="module")
def bench():
    return load("bench_contrastive")


@pytest.mark.parametrize("op,passes,n,rb,want", [
    # NT-Xent 16384: symmetric statistics pass and mirrored H, half the tiles each, + H Z
    ("nt_xent", [("lse2", True, 16384), ("h", True, 16384)], 16384, 16384, 2),
    # 8192: the square statistics pass (N D below SYMMETRIC_LSE_MIN_ND), mirrored H
    ("nt_xent", [("lse", False, 8192), ("h", True, 8192)], 8192, 8192, 2.5),
    # 65536: H in 8 row blocks of 8192 (not mirrored: it does not fit whole)
    ("nt_xent", [("lse2", True, 65536)] + [("h", False, 8192)] * 8, 65536, 4096, 2.5),
    # InfoNCE: the statistics pass, the gradient pass in row blocks, G K and Gᵀ Q
    ("info_nce", [("lse", False, 16384)] + [("g", False, 4096)] * 4, 16384, 4096, 4),
])
def test_tile_products(bench, op, passes, n, rb, want):
    blocks, count = bench.tile_products(op, passes, n, rb)
    assert count == want
    assert all(0 <= r0 < r1 <= n and r1 - r0 <= rb for r0, r1 in blocks)


def test_tile_products_ignores_other_stages(bench):
    """Stages that are not score passes of these ops (none today) add nothing."""
    blocks, count = bench.tile_products("info_nce", [("lse", False, 100), ("spmax", False, 100)],
                                        100, 64)
    assert count == 3 and blocks == [(0, 64), (64, 100)]
