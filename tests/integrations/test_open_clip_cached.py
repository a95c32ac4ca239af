"""examples/open_clip_grad_cache.py against open_clip's ``--accum-freq`` algorithm.

open_clip's accumulation (``open_clip_train/train.py``, ``train_one_epoch`` with
``accum_freq > 1``), reproduced step for step — its package imports torchvision, which CI's
pinned CPU torch cannot install — with open_clip's own ``ClipLoss`` (its installed
``loss.py``): the features of every micro-batch cached without a graph, then for every
micro-batch a forward with a graph, the loss over the accumulated batch with that micro-batch's
rows replaced, and a backward. The example's gradient cache gives the same encoder gradients
(float64, 1e-10 relative) with the loss computed once, and ``logit_scale`` the whole batch's
gradient once (open_clip's loop: ``accum_freq`` times it).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import library_losses as LL  # noqa: E402

OC = LL.open_clip_loss()
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "open_clip_grad_cache.py"
TOL = dict(rtol=1e-10, atol=1e-13)


def _example():
    spec = importlib.util.spec_from_file_location("open_clip_grad_cache", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _open_clip_accumulation(model, images, texts, accum_freq):
    """open_clip_train/train.py's accum_freq path for one optimizer step (no autocast)."""
    loss = OC.ClipLoss()
    micro = images.shape[0] // accum_freq
    parts = [(images[j * micro:(j + 1) * micro], texts[j * micro:(j + 1) * micro])
             for j in range(accum_freq)]
    feats = {}
    with torch.no_grad():
        for im, tx in parts:
            out = model(im, tx)
            out.pop("logit_scale")
            for key, val in out.items():
                feats.setdefault(key, []).append(val)
    total = []
    for j, (im, tx) in enumerate(parts):
        out = model(im, tx)
        scale = out.pop("logit_scale")
        inputs = {k: torch.cat(v[:j] + [out[k]] + v[j + 1:]) for k, v in feats.items()}
        step_loss = loss(**inputs, logit_scale=scale)
        step_loss.backward()
        total.append(step_loss.detach())
    return total


@pytest.mark.skipif(OC is None, reason="open_clip_torch is not installed")
@pytest.mark.parametrize("accum_freq", [2, 4])
def test_cached_step_equals_open_clip_accumulation(accum_freq):
    ex = _example()
    torch.manual_seed(0)
    model = ex.ToyCLIP().double()
    g = torch.Generator().manual_seed(1)
    images = torch.randn(24, 3, 2, 2, generator=g, dtype=torch.float64)
    texts = torch.randint(0, 50, (24, 7), generator=g)
    losses = _open_clip_accumulation(model, images, texts, accum_freq)
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    cache = ex.clip_gradient_cache(model, micro_batch=24 // accum_freq)
    loss = cache({"image": images, "text": texts})
    loss.backward()
    for l_j in losses:  # (each of open_clip's losses is the whole batch's, as is ours)
        torch.testing.assert_close(loss.detach(), l_j, **TOL)
    for name, p in model.named_parameters():
        if name == "logit_scale":
            torch.testing.assert_close(accum_freq * p.grad, want[name], **TOL)
        else:
            torch.testing.assert_close(p.grad, want[name], **TOL,
                                       msg=lambda m: f"{name}: {m}")


def test_the_example_runs(capsys):
    _example().main()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and all(line.startswith(f"step {i}: loss ") for i, line in
                                 enumerate(out))
    first, last = (float(line.split()[-1]) for line in (out[0], out[-1]))
    assert last < first  # (it trains)
