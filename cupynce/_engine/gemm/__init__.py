"""The matrix products: one module per backend and one that chooses.

============  ==============================================================================
cublas.py     cuBLAS (``cublasGemmEx`` through ctypes, fp32 / fp64 accumulation; float32 in
              fp32, TF32 or 3xTF32 per ``config.float32_precision``), the small-product kernel,
              the recorded calls CUDA graphs replay
tf32x3.py     float32 products on Hopper's TF32 tensor cores with fp32 accuracy (operands split
              hi + lo, three products per K step promoted to an fp32 register sum)
f16x3.py      the same on the float16 tensor cores (twice TF32's rate; rows scaled by powers
              of two, split into float16 halves)
chooser.py    the chooser: :func:`plan` gives a row-block op the :class:`Plan` that issues its
              products (the tiles under "auto" / "3xtf32" where they apply, else cuBLAS)
============  ==============================================================================

The loss paths (``_engine.losses``, ``_engine.splade``) call these; nothing here knows a loss.
Imports run cublas <- tf32x3 <- f16x3 <- chooser.
"""
from __future__ import annotations

from .chooser import CUBLAS, Plan, TilesPlan, plan, same_stream

__all__ = ["CUBLAS", "Plan", "TilesPlan", "plan", "same_stream"]
