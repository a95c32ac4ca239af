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
    memory_bank_size : 0 or (size, dim), default 0
        A memory bank (MoCo's, as lightly keeps it): ``size`` keys of width ``dim``, randomly
        initialised (``torch.randn``, normalised: lightly's draw), float32.  ``forward``
        then returns ``info_nce(out0, out1, negatives=bank, in_batch_negatives=False)``:
        each out0 row against its out1 row and the bank alone, the bank as it was before
        the call; in training (``out0.requires_grad``) the normalised out1 rows then replace
        the oldest entries as lightly writes them (a batch that passes the bank's end fills
        it and the rest is dropped; with ``gather_distributed`` every rank's rows, so every
        rank's bank is the same).  The write position is a host integer (lightly reads a
        device one).  A bare non-zero int raises ``ValueError`` as lightly.
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
        shape = (memory_bank_size,) if isinstance(memory_bank_size, int) else \
            tuple(memory_bank_size)
        if any(x < 0 for x in shape) or (shape != (0,) and len(shape) != 2) or \
                (isinstance(memory_bank_size, int) and memory_bank_size > 0):
            raise ValueError(f"NTXentLoss: illegal memory bank size {memory_bank_size!r}: "
                             f"expected (num_features, dim), or 0 to disable the memory bank")
        self.bank: Optional[Tensor]
        if shape != (0,) and shape[0] > 0:  # (lightly's draw: randn, then normalised)
            self.register_buffer("bank", torch.nn.functional.normalize(
                torch.randn(shape).float(), dim=-1), persistent=False)
        else:
            self.bank = None
        self.bank_position = 0
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

    @torch.no_grad()
    def _enqueue(self, keys: Tensor, group, size: int) -> None:
        """lightly's ``_dequeue_and_enqueue``: every rank's rows first with
        ``gather_distributed``; past the bank's end the rest of the batch is dropped."""
        if size > 1:
            every = keys.new_empty((size,) + tuple(keys.shape))
            torch.distributed.all_gather(list(every.unbind(0)), keys.contiguous(), group=group)
            keys = every.reshape(-1, keys.shape[1])
        bank, ptr, n = self.bank, self.bank_position, keys.shape[0]
        if ptr + n >= bank.shape[0]:
            bank[ptr:] = keys[:bank.shape[0] - ptr].to(bank.device, bank.dtype)
            self.bank_position = 0
        else:
            bank[ptr:ptr + n] = keys.to(bank.device, bank.dtype)
            self.bank_position = ptr + n

    def forward(self, out0: Tensor, out1: Tensor) -> Tensor:
        if out0.shape != out1.shape or out0.dim() != 2:
            raise ValueError(f"NTXentLoss: out0 and out1 must be (n, D) of one shape, got "
                             f"{tuple(out0.shape)} and {tuple(out1.shape)}")
        kw = dict(normalize=True, workspace_bytes=self.workspace_bytes, precision=self.precision)
        group, size = dist_group(self.group) if self.gather_distributed else (None, 1)
        if self.bank is not None:
            negatives = self.bank.to(out0.device, out0.dtype, copy=True)  # (before the update)
            loss = C.info_nce(out0, out1, self.temperature, negatives=negatives,
                              in_batch_negatives=False, **kw)
            if out0.requires_grad:
                self._enqueue(torch.nn.functional.normalize(out1.detach(), dim=1), group, size)
            return loss
        z = torch.cat([out0, out1], 0)
        if size == 1:
            return C.nt_xent(z, self.temperature, **kw)
        return rank_share(C.nt_xent(z, self.temperature, reduction="none", group=group, **kw),
                          size)
