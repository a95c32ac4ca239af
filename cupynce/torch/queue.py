"""A queue of negatives (MoCo's, lightly's memory bank): a ring buffer of detached keys that
the loss uses as shared negatives, the same on every rank.

    queue = NegativeQueue(65536, 128, device="cuda", dtype=torch.bfloat16)
    loss = cupynce.torch.info_nce(q, k, 0.2, negatives=queue.negatives(),
                                  in_batch_negatives=False, group=group,
                                  replicated_negatives=group is not None)
    queue.enqueue(k, group=group)   # after the loss: the keys join the next steps' negatives
    loss.backward()

The enqueue writes the queue in place, so it comes after the loss; before or after backward,
which keeps nothing of the queue (its gradient is skipped: the queue is detached) -- except
with ``reduction="none"``, whose backward recomputes from the queue: enqueue after it.

Across ranks the enqueue all-gathers the keys (rank order) before it writes, so every rank
holds the same queue -- what lightly #1018 and pytorch-metric-learning #639 got wrong -- and
the loss takes it once (``replicated_negatives=True``: not gathered again, which would count
each key P times).
"""
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn


__all__ = ["NegativeQueue"]


class NegativeQueue(nn.Module):
    """A first-in first-out queue of ``size`` keys of width ``dim``: MoCo's negatives.

    Parameters
    ----------
    size : int > 0
        How many keys it holds (MoCo: 65536).
    dim : int > 0
        The keys' width.
    dtype, device : the buffer's (default torch's defaults); keys are cast to them.

    The keys live in the buffer ``keys`` (moved by ``.to()``, saved in ``state_dict`` with the
    write position and the count); :meth:`negatives` is the filled part, detached (the
    oldest keys first once full, in ring order: the loss takes them as a set).  The write
    position is a host integer, so no call reads the device.
    """

    def __init__(self, size: int, dim: int, *, dtype: Optional[torch.dtype] = None,
                 device: Any = None) -> None:
        super().__init__()
        for name, v in (("size", size), ("dim", dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"NegativeQueue: {name} must be a positive int, got {v!r}")
        self.size, self.dim = size, dim
        self.register_buffer("keys", torch.zeros(size, dim, dtype=dtype, device=device))
        self.position, self.count = 0, 0

    def negatives(self) -> Tensor:
        """The keys held so far, (count, dim), detached: shared negatives for the loss."""
        return (self.keys if self.count == self.size else self.keys[:self.count]).detach()

    @torch.no_grad()
    def enqueue(self, keys: Tensor, group: Any = None) -> None:
        """Add ``keys`` (n, dim), detached and cast to the buffer's dtype, replacing the
        oldest; with ``group`` (a ``torch.distributed`` group) every rank's keys in rank
        order, so that every rank's queue is the same.  More keys than ``size``: the last
        ``size`` of them."""
        if not isinstance(keys, Tensor) or keys.ndim != 2 or keys.shape[1] != self.dim:
            raise ValueError(f"NegativeQueue.enqueue: keys must be a tensor of shape "
                             f"(n, {self.dim}), got "
                             f"{getattr(keys, 'shape', type(keys).__name__)}")
        if keys.device != self.keys.device:
            raise ValueError(f"NegativeQueue.enqueue: keys are on {keys.device}, the queue on "
                             f"{self.keys.device}")
        keys = keys.detach().to(self.keys.dtype)
        if group is not None:
            world = dist.get_world_size(group)
            every = keys.new_empty((world,) + tuple(keys.shape))
            dist.all_gather(list(every.unbind(0)), keys.contiguous(), group=group)
            keys = every.reshape(-1, self.dim)
        n = keys.shape[0]
        if n >= self.size:
            self.keys.copy_(keys[n - self.size:])
            self.position, self.count = 0, self.size
            return
        first = min(n, self.size - self.position)
        self.keys[self.position:self.position + first] = keys[:first]
        if first < n:
            self.keys[:n - first] = keys[first:]
        self.position = (self.position + n) % self.size
        self.count = min(self.count + n, self.size)

    def get_extra_state(self) -> Any:
        return {"position": self.position, "count": self.count}

    def set_extra_state(self, state: Any) -> None:
        self.position, self.count = int(state["position"]), int(state["count"])

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.dim}, count={self.count}"

