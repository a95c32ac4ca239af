"""One module per op: its public functions, its argument checks and its NumPy path.

===============  ===========================================================================
nt_xent.py       SimCLR's NT-Xent
info_nce.py      query/key InfoNCE, in-batch and explicit (shared or per-query) negatives
supcon.py        supervised contrastive (SupCon's L_out) with labels
nt_xent_pairs.py NT-Xent over every positive pair of labels (pytorch-metric-learning's)
clip.py          CLIP's symmetric loss with a learnable temperature
siglip.py        SigLIP's pairwise sigmoid loss with a learnable scale and bias
splade.py        SPLADE's max-pooled vocabulary head and its FLOPS regularizer
_base.py         the context, reductions, the CPU / GPU switch and the float32 precision
                 default the losses share
_numpy.py        the NumPy counterparts of the GPU engine's primitives
_variants.py     the label-aware variants' O(N·D) differences from the plain losses
===============  ===========================================================================

The functions are re-exported by :mod:`cupynce`; call them from there.  CuPy arrays run the
GPU engine (``cupynce._engine``), NumPy arrays the NumPy path.
"""
