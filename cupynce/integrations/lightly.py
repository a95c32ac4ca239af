"""lightly's ``NTXentLoss`` (``lightly.loss``) on cupynce's kernels; lightly is not imported."""
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .. import _checks
from .. import torch as C
from ..torch import _registry
from ._common import dist_group, rank_share

__all__ = ["NTXentLoss"]


class NTXentLoss(nn.Module):
    """SimCLR's NT-Xent as lightly computes it: ``forward(out0, out1)`` with the two views'
    (n, D) projections, normalised inside (lightly's cosine similarity), the mean over the
    2n rows of −log softmax over the other 2n − 1 rows at the positive.

    Parameters (lightly's)
    ----------------------
    temperature : float, default 0.5 (|temperature| < 1e-8 raises ``ValueError`` as lightly).
    memory_bank_size : int or (size, dim), default 0
        A non-zero size (MoCo's memory bank) raises ``NotImplementedError``: not in cupynce
        yet.
    gather_distributed : bool
        With torch.distributed initialised and more than one process: lightly's global batch
        (every rank's view-0 rows, then every rank's view-1 rows; each row against all 2N − 1
        others), by :func:`cupynce.torch.nt_xent` over the group.  Each rank returns its share
        as lightly does (the mean over its 2n rows; the mean over ranks is the global loss L)
        and P dL/dx as its features' gradient (lightly's gather layer sums the ranks'
        gradients: the same; DDP's average gives the single-process gradient).

    Keyword-only extras: ``workspace_bytes`` (the op's scratch cap), ``group`` (the process
    group, used with ``gather_distributed``; lightly uses the default one), ``precision``
    (float32 products on CUDA, as :func:`cupynce.torch.nt_xent`'s: None follows torch's TF32
    setting, then ``cupynce.get_float32_precision()``).  The loss is
    float32 for 16-bit inputs (lightly returns the inputs' dtype).
    """

    def __init__(self, temperature: float = 0.5,
                 memory_bank_size: Union[int, Sequence[int]] = 0,
                 gather_distributed: bool = False, *, workspace_bytes: Optional[int] = None,
                 group: Optional[Any] = None, precision: Optional[str] = None):
        super().__init__()
        size = memory_bank_size if isinstance(memory_bank_size, int) else \
            (memory_bank_size[0] if len(memory_bank_size) else 0)
        if size:
            raise NotImplementedError(
                f"NTXentLoss: memory_bank_size={memory_bank_size!r}: a memory bank (MoCo) has "
                "no cupynce equivalent yet; use memory_bank_size=0 (SimCLR), or lightly's class")
        _checks.check_no_grad("NTXentLoss", "temperature", temperature)
        if abs(temperature) < 1e-8:
            raise ValueError(f"Illegal temperature: abs({temperature}) < 1e-8")
        if temperature < 0:
            raise NotImplementedError(f"NTXentLoss: temperature={temperature!r}: lightly "
                                      "accepts a negative temperature, cupynce needs one > 0")
        self.temperature, self.memory_bank_size = temperature, memory_bank_size
        self.gather_distributed = gather_distributed
        self.workspace_bytes, self.group = workspace_bytes, group
        self.precision = _registry.module_precision("NTXentLoss", precision)

    def forward(self, out0: Tensor, out1: Tensor) -> Tensor:
        if out0.shape != out1.shape or out0.dim() != 2:
            raise ValueError(f"NTXentLoss: out0 and out1 must be (n, D) of one shape, got "
                             f"{tuple(out0.shape)} and {tuple(out1.shape)}")
        z = torch.cat([out0, out1], 0)
        kw = dict(normalize=True, workspace_bytes=self.workspace_bytes, precision=self.precision)
        group, size = dist_group(self.group) if self.gather_distributed else (None, 1)
        if size == 1:
            return C.nt_xent(z, self.temperature, **kw)
        return rank_share(C.nt_xent(z, self.temperature, reduction="none", group=group, **kw),
                          size)
