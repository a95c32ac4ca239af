"""The loss paths: how a softmax loss (NT-Xent, InfoNCE, CLIP) or SigLIP's pairs are computed
on the GPU without the full score matrix in memory.

==============  ============================================================================
row_blocks.py   score blocks through the products of ``gemm`` (cuBLAS, or the TF32x3 / F16x3
                tiles for float32), the row / column kernels of ``stats.cu`` / ``grads.cu`` between
                them: every dtype, every problem
score_tiles.py  16-bit operands on the fused score tiles (``tiles.cu``, ``tiles_ws.cu``): the
                scores never leave the registers
nt_xent_tf32.py float32 NT-Xent on the TF32x3 tiles (``tiles_ws_tf32.cu``), fp32-accurate
stats.py        the statistics kernels they share (column-state merge, positive dots, a
                block's row and column statistics)
==============  ============================================================================

``cupynce._engine`` picks the path of each problem; each path imports ``gemm``, ``tiling``,
``workspace`` and ``stats`` below it, never another path.
"""
