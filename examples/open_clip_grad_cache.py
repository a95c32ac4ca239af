"""open_clip with gradient caching: a big contrastive batch in a small memory, the loss once per
step — in place of open_clip's ``--accum-freq``.

open_clip's accumulation (``open_clip_train/train.py``, ``accum_freq > 1``) embeds the
accumulated micro-batches without a graph, then for every micro-batch re-embeds it with a graph
and computes the loss over the whole accumulated batch again: ``accum_freq`` forward passes and
``accum_freq`` losses over the whole batch. With :class:`cupynce.torch.GradientCache` the loss
runs once per step, fused (no N × N logits kept), and the encoders' gradients are the same
(``tests/integrations/test_open_clip_cached.py`` checks them against open_clip's algorithm).
One difference: open_clip's loop gives ``logit_scale`` the gradient of every micro-batch's
loss over the whole batch, ``accum_freq`` times the whole batch's gradient; the cache gives it
once, as training without accumulation does.

The step, for a model from ``open_clip.create_model_and_transforms`` (one process; under
``DistributedDataParallel`` the chunks run through the DDP forward and all-reduce once, but
``logit_scale``, which the loss reads from the unwrapped model outside that forward, is not
covered yet: DDP would not average its gradient)::

    cache = clip_gradient_cache(model, micro_batch=256)
    for images, texts in loader:            # the whole batch (accum_freq x 256 rows)
        with torch.autocast("cuda", torch.bfloat16):
            loss = cache({"image": images, "text": texts})
        scaler.scale(loss).backward()       # re-embeds chunk by chunk
        scaler.step(optimizer); scaler.update(); optimizer.zero_grad()

Run it (a toy two-tower model on random data, CPU or GPU)::

    python examples/open_clip_grad_cache.py
"""
from typing import Any, Dict

import torch
from torch import Tensor, nn

import cupynce.torch as ct
from cupynce.integrations.open_clip import ClipLoss


def _features(out: Any):
    """(image features, text features) of open_clip's forward (a dict with
    ``output_dict=True``, else a tuple)."""
    if isinstance(out, dict):
        return out["image_features"], out["text_features"]
    return out[0], out[1]


def clip_gradient_cache(model: nn.Module, micro_batch: int, **loss_kw: Any
                        ) -> ct.GradientCache:
    """A :class:`cupynce.torch.GradientCache` over open_clip's CLIP loss for ``model``: one
    column, ``{"image": (N, C, H, W), "text": (N, L)}``, whose chunks of ``micro_batch`` rows run
    through the model's own forward (both towers in one call: what DDP expects) and come back
    as ``[image features | text features]``; the loss is open_clip's ``ClipLoss`` on
    cupynce's kernels, with the model's ``logit_scale.exp()``. ``loss_kw`` go to ``ClipLoss``
    (``world_size``, ``rank``, ``local_loss``, ``gather_with_grad`` across ranks)."""
    inner = getattr(model, "module", model)  # (a DDP model's own)
    loss_fn = ClipLoss(**loss_kw)

    def encode(batch: Dict[str, Tensor]) -> Tensor:
        image, text = _features(model(batch["image"], batch["text"]))
        return torch.cat([image, text], dim=1)

    def loss(features: Tensor) -> Tensor:
        d = features.shape[1] // 2
        return loss_fn(features[:, :d], features[:, d:], inner.logit_scale.exp())

    ddp = [model] if isinstance(model, nn.parallel.DistributedDataParallel) else []
    return ct.GradientCache(encode, loss, micro_batch, ddp=ddp)


class ToyCLIP(nn.Module):
    """Two small towers with open_clip's interface (``encode_image``, ``encode_text``, a
    forward returning normalised features and ``logit_scale``), for this demo and the tests."""

    def __init__(self, image_dim: int = 12, vocab: int = 50, width: int = 16, embed: int = 8):
        super().__init__()
        self.visual = nn.Sequential(nn.Flatten(), nn.Linear(image_dim, width), nn.GELU(),
                                    nn.Linear(width, embed))
        self.token_embedding = nn.Embedding(vocab, width)
        self.text_proj = nn.Linear(width, embed)
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))  # log(1 / 0.07), as CLIP starts
        self.output_dict = True

    def encode_image(self, image: Tensor, normalize: bool = False) -> Tensor:
        x = self.visual(image)
        return nn.functional.normalize(x, dim=-1) if normalize else x

    def encode_text(self, text: Tensor, normalize: bool = False) -> Tensor:
        x = self.text_proj(self.token_embedding(text).mean(dim=1))
        return nn.functional.normalize(x, dim=-1) if normalize else x

    def forward(self, image: Tensor, text: Tensor):
        return {"image_features": self.encode_image(image, normalize=True),
                "text_features": self.encode_text(text, normalize=True),
                "logit_scale": self.logit_scale.exp()}


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = ToyCLIP().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cache = clip_gradient_cache(model, micro_batch=64)
    for step in range(5):
        images = torch.randn(512, 3, 2, 2, device=device)
        texts = torch.randint(0, 50, (512, 7), device=device)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = cache({"image": images, "text": texts})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
