"""Deprecated module path: the InfoNCE family now lives in ``cupynce.ops`` (one module per op).

Kept for one release so that ``from cupynce.contrastive import nt_xent`` and the like keep
working; import the functions from :mod:`cupynce` instead.
"""
import warnings

from .ops._base import Context
from .ops.clip import *  # noqa: F401,F403
from .ops.clip import __all__ as _clip_all
from .ops.info_nce import *  # noqa: F401,F403
from .ops.info_nce import __all__ as _info_nce_all
from .ops.nt_xent import *  # noqa: F401,F403
from .ops.nt_xent import __all__ as _nt_xent_all

__all__ = ["Context", *_nt_xent_all, *_info_nce_all, *_clip_all]

warnings.warn("cupynce.contrastive is deprecated: import the ops from cupynce "
              "(cupynce.nt_xent, cupynce.info_nce, cupynce.clip_loss, ...)",
              DeprecationWarning, stacklevel=2)
