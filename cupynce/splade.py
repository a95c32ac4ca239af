"""Deprecated module path: SPLADE's head now lives in ``cupynce.ops.splade``.

Kept for one release so that ``from cupynce.splade import splade_pool`` and the like keep
working; import the functions from :mod:`cupynce` instead.
"""
import warnings

from .ops.splade import *  # noqa: F401,F403
from .ops.splade import __all__  # noqa: F401

warnings.warn("cupynce.splade is deprecated: import the ops from cupynce "
              "(cupynce.splade_pool, cupynce.flops_regularizer, ...)",
              DeprecationWarning, stacklevel=2)
