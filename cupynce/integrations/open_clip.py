"""open_clip's ``ClipLoss`` and ``SigLipLoss`` on cupynce's kernels (``open_clip.loss``).

Same constructor arguments, same call ``forward(image_features, text_features, logit_scale,
logit_bias=None, output_dict=False)``: replace ``from open_clip.loss import ClipLoss`` by
``from cupynce.integrations.open_clip import ClipLoss``.  open_clip itself is not imported.

**Scale convention.**  open_clip passes the *exponentiated* scale (``model.logit_scale.exp()``,
100 at CLIP's clamp); cupynce's functional ops take its log.  These classes take open_clip's
and pass ``log(logit_scale)`` on (a tensor through ``torch.log``, so its gradient reaches the
caller's tensor exactly as in open_clip).

Extra keyword-only arguments: ``normalize`` (L2-normalise the features inside the op; open_clip
expects them normalised by the model), ``workspace_bytes`` (the op's scratch cap), ``group``
(the process group; the default group when ``world_size > 1``), ``precision`` (float32
products on CUDA: "auto" | "fp32" | "tf32" | "3xtf32"; None follows torch's TF32 setting, as
open_clip's own matmuls do, then ``cupynce.get_float32_precision()``).
"""
from typing import Any, Dict, Optional, Union

import torch
from torch import Tensor, nn

from .. import torch as C
from ..torch import _registry
from ._common import log_scale, rank_share, scale_grad, world_group

__all__ = ["ClipLoss", "SigLipLoss"]


def _out(loss: Tensor, output_dict: bool) -> Union[Tensor, Dict[str, Tensor]]:
    return {"contrastive_loss": loss} if output_dict else loss


class ClipLoss(nn.Module):
    """CLIP's symmetric InfoNCE, ``(CE(images → texts) + CE(texts → images)) / 2``.

    Parameters (open_clip's)
    ------------------------
    local_loss, gather_with_grad : bool
        With ``world_size > 1`` (P ranks of n rows each, L the loss of the global batch):

        ============  ================  =====================  ==================================
        local_loss    gather_with_grad  value on each rank     gradient of the rank's features
        ============  ================  =====================  ==================================
        False         False             L                      dL/dx (its rows' terms only once:
                                                               after DDP's average, 1/P of the
                                                               single-process gradient)
        False         True              L                      P dL/dx (DDP: single-process)
        True          True              the rank's share       P dL/dx (DDP: single-process)
        True          False             the rank's share       its rows' own terms only: the
                                                               terms where its features are the
                                                               other side are missing (open_clip
                                                               #616; reproduced, not advised)
        ============  ================  =====================  ==================================

        (F, T) assumes every rank back-propagates the same upstream gradient (as in
        data-parallel training): its backward is local, so a rank-dependent loss weight w_r
        gives w_r P dL/dx where open_clip's gather gives (Σ_r w_r) dL/dx.
        "The rank's share": (CE of its images against every text + CE of its texts against
        every image) / 2, averaged over its n rows (the mean over ranks is L).  ``logit_scale``
        gets dL/dscale on every rank except with ``local_loss=True, gather_with_grad=True``,
        where open_clip gives each rank its share's (equal after DDP's average; cupynce gives
        the global one) and ``local_loss=True, gather_with_grad=False`` (the share's, as
        open_clip).  The first three run :func:`cupynce.torch.clip_loss` over the group (its
        rows against every column, one block for both directions, no n × N logits in
        memory); the last runs open_clip's own algorithm (a gather without gradient, then
        :func:`cupynce.torch.info_nce` per direction).
    cache_labels : bool — accepted; there are no labels to cache.
    rank, world_size : int — must match the process group's.
    use_horovod : bool — ``True`` raises ``NotImplementedError`` (torch.distributed only).

    ``logit_bias`` (open_clip's ClipLoss accepts one) adds the same value to every logit of a
    row and of a column, which no softmax sees: the loss is unchanged and its gradient is 0.
    The loss is float32 for 16-bit features (the op's accumulation dtype; open_clip returns
    the features' dtype); a half-precision ``logit_scale``'s log is taken in float32.
    ``group`` must come with open_clip's ``world_size`` / ``rank`` (``world_size=1`` with a
    group raises).
    """

    def __init__(self, local_loss: bool = False, gather_with_grad: bool = False,
                 cache_labels: bool = False, rank: int = 0, world_size: int = 1,
                 use_horovod: bool = False, *, normalize: bool = False,
                 workspace_bytes: Optional[int] = None, group: Optional[Any] = None,
                 precision: Optional[str] = None):
        super().__init__()
        if use_horovod:
            raise NotImplementedError(
                "ClipLoss: use_horovod=True has no cupynce equivalent (cupynce's global loss "
                "runs over torch.distributed: NCCL or gloo); use world_size / rank with a "
                "torch.distributed process group")
        self.local_loss, self.gather_with_grad = bool(local_loss), bool(gather_with_grad)
        self.cache_labels, self.rank, self.world_size = cache_labels, rank, world_size
        self.use_horovod = False
        self.normalize, self.workspace_bytes, self.group = normalize, workspace_bytes, group
        self.precision = _registry.module_precision("ClipLoss", precision)

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Any,
                logit_bias: Optional[Any] = None, output_dict: bool = False):
        t = log_scale("ClipLoss", logit_scale)
        group, size = world_group("ClipLoss", self.rank, self.world_size, self.group)
        kw = dict(normalize=self.normalize, workspace_bytes=self.workspace_bytes,
                  precision=self.precision)
        a, b = image_features, text_features
        if size == 1:
            loss = C.clip_loss(a, b, t, **kw)
        elif not self.local_loss:
            if not self.gather_with_grad:  # its rows' terms once: 1/P of the convention's
                a, b = scale_grad(a, 1.0 / size), scale_grad(b, 1.0 / size)
            loss = C.clip_loss(a, b, t, group=group, **kw)
        elif self.gather_with_grad:
            loss = rank_share(C.clip_loss(a, b, t, reduction="none", group=group, **kw), size)
        else:
            loss = self._local_no_grad(a, b, logit_scale, group, size)
        if logit_bias is not None and isinstance(logit_bias, Tensor):
            loss = loss + 0.0 * logit_bias.sum()  # softmax-invariant: a zero gradient
        return _out(loss, output_dict)

    def _local_no_grad(self, a: Tensor, b: Tensor, scale: Any, group: Any,
                       size: int) -> Tensor:
        """open_clip's ``local_loss=True, gather_with_grad=False``: the rank's rows against
        every (detached) column; the (exponentiated) scale multiplied into the rows so that
        its gradient is the share's."""
        import torch.distributed as dist

        n = torch.tensor([a.shape[0], b.shape[0]], dtype=torch.int64,
                         device=a.device if "nccl" in str(dist.get_backend(group)) else "cpu")
        ns = [torch.empty_like(n) for _ in range(size)]
        dist.all_gather(ns, n, group=group)  # (unequal sizes: an error on every rank, no abort)
        if any(tuple(x.tolist()) != tuple(ns[0].tolist()) for x in ns) or int(n[0]) != int(n[1]):
            raise ValueError("ClipLoss: every rank must hold the same number of image and text "
                             f"rows; got (images, texts) per rank {[tuple(x.tolist()) for x in ns]}")

        def others(x: Tensor) -> Tensor:
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x.detach().contiguous(), group=group)
            me = dist.get_rank(group)
            return torch.cat([p for i, p in enumerate(parts) if i != me])

        if self.normalize:  # the op's normalisation, before the scale multiplies the rows
            a, b = nn.functional.normalize(a, dim=-1), nn.functional.normalize(b, dim=-1)
        other_b, other_a = others(b), others(a)
        kw = dict(workspace_bytes=self.workspace_bytes, precision=self.precision)
        li = C.info_nce(a * scale, b.detach(), 1.0, negatives=other_b, **kw)
        lt = C.info_nce(b * scale, a.detach(), 1.0, negatives=other_a, **kw)
        return (li + lt) / 2


class SigLipLoss(nn.Module):
    """SigLIP's sigmoid loss, ``−Σ_ij log σ(z_ij (s a_i·b_j + β)) / n`` (z = +1 on the pairs).

    Parameters (open_clip's)
    ------------------------
    cache_labels : bool — accepted; there are no labels to cache.
    rank, world_size : int — must match the process group's.
    dist_impl : "bidir" | "shift" | "reduce" | "gather" | None
        open_clip's ways of passing the text features round the ranks; they all give the
        same loss, and so does cupynce's, which all-gathers them once (O(N·D) bytes) and
        computes the rank's images against every text without an n × N matrix in memory.

    With ``world_size > 1`` each rank returns its share, as open_clip: its n images against
    every rank's texts, summed and divided by n (the mean over ranks is the global loss L);
    the features' gradients are P dL/dx (DDP's average gives the single-process gradient).
    ``logit_scale`` / ``logit_bias`` get dL/d· on every rank, where open_clip gives each rank
    its share's: equal after DDP's average, not rank by rank.  ``logit_bias=None``: no bias.
    The loss is float32 for 16-bit features (open_clip returns the features' dtype).
    """

    def __init__(self, cache_labels: bool = False, rank: int = 0, world_size: int = 1,
                 dist_impl: Optional[str] = None, *, normalize: bool = False,
                 workspace_bytes: Optional[int] = None, group: Optional[Any] = None,
                 precision: Optional[str] = None):
        super().__init__()
        self.dist_impl = dist_impl or "bidir"
        if self.dist_impl not in ("bidir", "shift", "reduce", "gather"):
            raise ValueError(f"SigLipLoss: dist_impl={dist_impl!r}, expected 'bidir', 'shift', "
                             "'reduce' or 'gather' (all give the same loss here)")
        self.cache_labels, self.rank, self.world_size = cache_labels, rank, world_size
        self.normalize, self.workspace_bytes, self.group = normalize, workspace_bytes, group
        self.precision = _registry.module_precision("SigLipLoss", precision)

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Any,
                logit_bias: Any = None, output_dict: bool = False):
        t = log_scale("SigLipLoss", logit_scale)
        if logit_bias is None:  # (open_clip: no bias added)
            logit_bias = 0.0
        group, size = world_group("SigLipLoss", self.rank, self.world_size, self.group)
        kw = dict(normalize=self.normalize, workspace_bytes=self.workspace_bytes,
                  precision=self.precision)
        a, b = image_features, text_features
        if size == 1:
            loss = C.siglip_loss(a, b, t, logit_bias, **kw)
        else:
            loss = rank_share(C.siglip_loss(a, b, t, logit_bias, reduction="none",
                                            group=group, **kw), size)
        return _out(loss, output_dict)
