"""The plain PyTorch formulas of the three losses (what users write today), for the bridge tests.

Independent of cupynce: ``F.normalize``, matmul, ``masked_fill`` and ``F.cross_entropy``,
differentiated by torch's autograd.  Run in float64 they are the oracle of
``tests/torch/test_torch_contrastive.py`` and ``tests/torch/test_torch_cuda.py``; run in
float16 / bfloat16 they give the same-dtype error that bounds cupynce's half-precision error on
the GPU.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def _norm(x: Optional[torch.Tensor], normalize: bool) -> Optional[torch.Tensor]:
    return F.normalize(x, dim=-1) if (normalize and x is not None) else x


def nt_xent(z, temperature=0.5, *, reduction="mean", normalize=False):
    """``F.cross_entropy(masked_fill(ẑẑᵀ, eye, -inf)/τ, (i + B) mod 2B)``."""
    z = _norm(z, normalize)
    n = z.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=z.device)
    labels = (torch.arange(n, device=z.device) + n // 2) % n
    s = (z @ z.T).masked_fill(eye, float("-inf")) / temperature
    return F.cross_entropy(s, labels, reduction=reduction)


def info_nce(query, key, temperature=0.1, *, negatives=None, reduction="mean", normalize=False):
    """Candidates: every key, then the shared (M, D) or per-query (N, M, D) negatives."""
    q, k, neg = (_norm(x, normalize) for x in (query, key, negatives))
    cols = [q @ k.T]
    if neg is not None:
        cols.append(q @ neg.T if neg.dim() == 2 else torch.einsum("nd,nmd->nm", q, neg))
    logits = torch.cat(cols, dim=1) / temperature
    return F.cross_entropy(logits, torch.arange(q.shape[0], device=q.device), reduction=reduction)


def clip_loss(a, b, logit_scale, *, reduction="mean", normalize=False):
    """open_clip's ``(CE(L) + CE(Lᵀ)) / 2`` with ``L = exp(logit_scale) â b̂ᵀ``."""
    a, b = _norm(a, normalize), _norm(b, normalize)
    scale = torch.as_tensor(logit_scale, dtype=a.dtype, device=a.device).exp()
    logits = scale * (a @ b.T)  # () or (1,) broadcasts
    labels = torch.arange(a.shape[0], device=a.device)
    per = (F.cross_entropy(logits, labels, reduction="none")
           + F.cross_entropy(logits.T, labels, reduction="none")) / 2
    return {"mean": per.mean, "sum": per.sum, "none": lambda: per}[reduction]()


def supcon_loss(z, labels, temperature=0.1, *, reduction="mean", normalize=False):
    """SupCon's L_out as its reference code writes it: the N × N logits less the diagonal,
    log-softmax, the mean over each anchor's same-label rows; anchors without one left out
    ("mean" over the others, 0 for "none")."""
    z = _norm(z, normalize)
    n = z.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=z.device)
    s = (z @ z.T).masked_fill(eye, float("-inf")) / temperature
    log_prob = torch.log_softmax(s.float() if s.dtype in (torch.float16, torch.bfloat16)
                                 else s, dim=1).to(s.dtype)
    pos = (labels[:, None] == labels[None, :]) & ~eye
    count = pos.sum(1)
    rows = -(log_prob.masked_fill(~pos, 0).sum(1)) / count.clamp_min(1)
    if reduction == "none":
        return rows
    total = rows.sum()
    return total / (count > 0).sum().clamp_min(1) if reduction == "mean" else total


def loss_and_grads(fn, inputs: Sequence[Optional[torch.Tensor]], grad_output, **kw):
    """``fn(*inputs, **kw)`` and the gradients of ``sum(grad_output * loss)`` w.r.t. the
    tensors of ``inputs`` that require grad (None elsewhere)."""
    loss = fn(*inputs, **kw)
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    g = torch.as_tensor(grad_output, dtype=loss.dtype, device=loss.device).expand_as(loss)
    grads = iter(torch.autograd.grad(loss, leaves, g))
    return loss.detach(), [next(grads) if isinstance(x, torch.Tensor) and x.requires_grad
                           else None for x in inputs]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64 (absolute when ref is 0)."""
    x, ref = x.double(), ref.double()
    den = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(x - ref).item()
    return num / den if den > 0 else num
