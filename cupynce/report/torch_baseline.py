"""The PyTorch baseline that the report and the benchmarks measure cupynce against.

torch loaded for a device (:func:`load_torch`), the plain formulas users run today
(:func:`torch_reference`), CuPy / NumPy arrays as tensors (:func:`to_torch`) and a forward +
backward step (:func:`torch_step`).  Only :func:`load_torch` imports torch; the others take the
module as their first argument, so that importing this module needs neither torch nor CuPy.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["load_torch", "torch_reference", "to_torch", "torch_step"]


def load_torch(device: str = "cuda", *, quiet: bool = False):
    """torch ready for ``device``, or None (with the reason printed unless ``quiet``).

    ``"cuda"``: torch with CUDA on CuPy's current device, its CUDA state initialised (the
    harness reads its allocator statistics); ``"cpu"``: torch as imported.
    """
    def say(msg: str) -> None:
        if not quiet:
            print(msg, flush=True)

    try:
        import torch
    except ImportError as exc:
        say(f"torch not importable ({exc}); measuring cupynce and cuBLAS only")
        return None
    if device == "cpu":
        return torch
    if not torch.cuda.is_available():
        say("torch has no CUDA; measuring cupynce and cuBLAS only")
        return None
    import cupy as cp

    torch.cuda.set_device(cp.cuda.Device().id)
    torch.zeros(1, device="cuda")  # initialise torch's CUDA state (the harness reads its stats)
    return torch


def torch_reference(torch, op: str, temperature: float = 0.1) -> Callable[..., Any]:
    """The plain PyTorch formula users run today (the seeds' / open_clip's / SPLADE's).

    Arguments of the returned function: ``nt_xent(z)``, ``info_nce(query, key)`` (in-batch
    negatives), ``supcon_loss(z, labels)``, ``clip_loss(a, b, logit_scale)`` (logit_scale a 0-d tensor),
    ``siglip_loss(a, b, logit_scale, logit_bias)`` (open_clip's SigLipLoss, 0-d scalars),
    ``splade_pool(x, weight, bias, mask)`` (SPLADE's ``max_l log(1 + relu(x Wᵀ + b)) * mask``,
    the (B, V) output).
    """
    F = torch.nn.functional

    if op == "nt_xent":
        def nt_xent_ref(z):
            n = z.shape[0]
            eye = torch.eye(n, dtype=torch.bool, device=z.device)
            labels = (torch.arange(n, device=z.device) + n // 2) % n
            s = (z @ z.T).masked_fill(eye, float("-inf")) / temperature
            return F.cross_entropy(s, labels)
        return nt_xent_ref

    if op == "info_nce":
        def info_nce_ref(q, k):
            labels = torch.arange(q.shape[0], device=q.device)
            return F.cross_entropy(q @ k.T / temperature, labels)
        return info_nce_ref

    if op == "supcon_loss":  # the SupCon reference code's L_out (every anchor has a positive)
        def supcon_ref(z, labels):
            n = z.shape[0]
            eye = torch.eye(n, dtype=torch.bool, device=z.device)
            s = (z @ z.T).masked_fill(eye, float("-inf")) / temperature
            log_prob = torch.log_softmax(s, dim=1)
            pos = (labels[:, None] == labels[None, :]) & ~eye
            count = pos.sum(1)
            rows = -log_prob.masked_fill(~pos, 0).sum(1) / count.clamp_min(1)
            return rows.sum() / (count > 0).sum().clamp_min(1)
        return supcon_ref

    if op == "splade_pool":
        def splade_ref(x, weight, bias, mask):
            logits = x @ weight.T
            if bias is not None:
                logits = logits + bias
            act = torch.log1p(torch.relu(logits)) * mask.unsqueeze(-1).to(logits.dtype)
            return torch.max(act, dim=1).values
        return splade_ref

    if op == "siglip_loss":  # open_clip's SigLipLoss on one GPU
        def siglip_ref(a, b, logit_scale, logit_bias):
            logits = logit_scale.exp() * a @ b.T + logit_bias
            labels = 2 * torch.eye(a.shape[0], device=a.device, dtype=logits.dtype) - 1
            return -F.logsigmoid(labels * logits).sum() / a.shape[0]
        return siglip_ref

    if op != "clip_loss":
        raise ValueError(f"torch_reference: unknown op {op!r}")

    def clip_ref(a, b, logit_scale):
        labels = torch.arange(a.shape[0], device=a.device)
        logits = logit_scale.exp() * a @ b.T
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    return clip_ref


def to_torch(torch, x):
    """A torch view of a CuPy (or NumPy) array, bit for bit (bfloat16 through an int16 view)."""
    from cupynce._engine.kernels import BFLOAT16

    if type(x).__module__.startswith("numpy"):
        import numpy as np

        x = np.asarray(x, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        if BFLOAT16 is not None and x.dtype == BFLOAT16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)
    if BFLOAT16 is not None and x.dtype == BFLOAT16:
        import cupy as cp

        return torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


def torch_step(torch, fn: Callable[..., Any], leaves: Sequence[Any], *, extra: Sequence[Any] = (),
               grad_output: Any = None) -> Callable[[], Any]:
    """A step computing ``out = fn(*leaves, *extra)`` and the gradients of ``leaves``.

    ``grad_output`` (a tensor like ``out``) for a non-scalar ``out``; returns ``(out, grads)``.
    """
    def step():
        loss = fn(*leaves, *extra)
        grads = torch.autograd.grad(loss, leaves, grad_outputs=grad_output)
        return loss, grads
    return step
