"""End to end: contrastive training on real data with cupynce.torch and with plain PyTorch.

Data: scikit-learn's bundled digits (1797 greyscale 8×8 images, 10 classes; no download).
Two augmented views of every image (random ±1-pixel shifts, brightness, Gaussian noise, a
random 3×3 cut-out; generated in torch from a seeded CPU generator, so both runs see the
same views).  A small MLP encoder (64 → 256 → 128, then a 64-d projection head) is trained:

* SimCLR: one encoder, the two views stacked as z (2B, D), ``cupynce.torch.NTXentLoss``;
* CLIP: the two views as two "modalities", one encoder each, ``cupynce.torch.ClipLoss``
  with a learnable temperature (init 0.07, clamped as CLIP).

Each is run twice from the same seed: with cupynce and with the plain PyTorch formula
(``cupynce.report.harness.torch_reference``: masked matmul + ``F.cross_entropy``; CLIP's
logit_scale an ``nn.Parameter`` clamped the same way).  Reported side by side: the per-step
loss curves, their largest relative difference, the median time per step (model + loss +
optimizer; the views are generated beforehand), and the linear-probe accuracy (scikit-learn
``LogisticRegression`` on the frozen 128-d encoder features of un-augmented images,
stratified 70/30 train/test split; fitted on all training labels, and on 10 labels per class
where self-supervision matters more) next to raw pixels and an untrained encoder.

Usage::

    python benchmarks/train_digits.py --device cuda --steps 300 --out benchmarks/results

writes ``train_digits_<device>.json`` and ``.md`` (and ``.png`` of the loss curves when
matplotlib is installed) into ``--out``.  ``tests/report/test_train_digits.py`` runs a few
steps.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without install

import cupynce.torch as ct  # noqa: E402
from cupynce.report import harness as _harness  # noqa: E402

KINDS = ("simclr", "clip")
IMPLS = ("cupynce", "torch")
SIMCLR_T = 0.2
CLIP_T0 = 0.07
MAX_LOGIT_SCALE = 100.0


# ------------------------------------------------------------------------------------------
# data and augmentation
# ------------------------------------------------------------------------------------------
def load_digits(seed: int = 0) -> Dict[str, Any]:
    """Digits in [0, 1] as float32 (N, 64), with a stratified 70/30 train/test split."""
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    x, y = _load(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.3, stratify=y, random_state=seed)
    return dict(x_train=torch.from_numpy(xtr), y_train=ytr, x_test=torch.from_numpy(xte),
                y_test=yte)


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One random view of each image of x (B, 64): shift by up to one pixel, scale the
    brightness by U(0.8, 1.2), add N(0, 0.1²) noise, cut out a random 3×3 patch (p = 0.5)."""
    b = x.shape[0]
    img = F.pad(x.reshape(b, 8, 8), (1, 1, 1, 1))
    dy, dx = (torch.randint(-1, 2, (b,), generator=gen) for _ in range(2))
    rows = torch.arange(8)[None, :] + 1 + dy[:, None]
    cols = torch.arange(8)[None, :] + 1 + dx[:, None]
    img = img[torch.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]
    img = img * torch.empty(b, 1, 1).uniform_(0.8, 1.2, generator=gen)
    img = img + 0.1 * torch.randn(b, 8, 8, generator=gen)
    r0, c0 = (torch.randint(0, 6, (b, 1, 1), generator=gen) for _ in range(2))
    grid = torch.arange(8)
    patch = ((grid[None, :, None] - r0).abs() <= 1) & ((grid[None, None, :] - c0).abs() <= 1)
    keep = torch.rand(b, 1, 1, generator=gen) >= 0.5
    img = img.masked_fill(patch & ~keep, 0.0)
    return img.reshape(b, 64)


def make_batches(x_train: torch.Tensor, steps: int, batch: int,
                 seed: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` pairs of views (B, 64), generated once from ``seed`` (shared by every run)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randperm(x_train.shape[0], generator=gen)[:batch]
        x = x_train[idx]
        out.append((augment(x, gen), augment(x, gen)))
    return out


# ------------------------------------------------------------------------------------------
# model and losses
# ------------------------------------------------------------------------------------------
class Encoder(nn.Module):
    """MLP 64 → 256 → 128 (the representation the probe reads) and a 128 → 64 head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128))
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """L2-normalised projections (B, 64)."""
        return F.normalize(self.head(self.body(x)), dim=1)


class TorchClipLoss(nn.Module):
    """The plain-PyTorch counterpart of ``ct.ClipLoss``: same Parameter, same clamp."""

    def __init__(self, init_temperature: float = CLIP_T0) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / init_temperature)))
        self._ref = _harness.torch_reference(torch, "clip_loss")

    @property
    def temperature(self) -> torch.Tensor:
        return torch.exp(-self.logit_scale.detach().clamp(0.0, math.log(MAX_LOGIT_SCALE)))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self._ref(a, b, self.logit_scale.clamp(0.0, math.log(MAX_LOGIT_SCALE)))


def make_loss(kind: str, impl: str) -> nn.Module:
    if kind == "simclr":
        if impl == "cupynce":
            return ct.NTXentLoss(temperature=SIMCLR_T)
        ref = _harness.torch_reference(torch, "nt_xent", SIMCLR_T)
        return _Lambda(ref)
    if impl == "cupynce":
        return ct.ClipLoss(CLIP_T0, learnable=True, max_logit_scale=MAX_LOGIT_SCALE,
                           normalize=False)  # the encoders already normalise
    return TorchClipLoss(CLIP_T0)


class _Lambda(nn.Module):
    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


# ------------------------------------------------------------------------------------------
# training and probing
# ------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(kind: str, impl: str, batches: List[Tuple[torch.Tensor, torch.Tensor]], *,
          device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
          lr: float = 1e-3) -> Dict[str, Any]:
    """Train from ``seed`` on ``batches``; returns the loss curve, step times and encoder."""
    dev = torch.device(device)
    torch.manual_seed(seed)
    encoders = [Encoder()] if kind == "simclr" else [Encoder(), Encoder()]
    encoders = [e.to(dev, dtype) for e in encoders]
    loss_fn = make_loss(kind, impl).to(dev, dtype)  # CLIP's logit_scale in the run's dtype
    params = [p for e in encoders for p in e.parameters()] + list(loss_fn.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    data = [(v1.to(dev, dtype), v2.to(dev, dtype)) for v1, v2 in batches]
    losses, step_s, temps = [], [], []
    for v1, v2 in data:
        _sync(dev)
        t0 = time.perf_counter()
        if kind == "simclr":
            loss = loss_fn(torch.cat([encoders[0](v1), encoders[0](v2)]))
        else:
            loss = loss_fn(encoders[0](v1), encoders[1](v2))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        _sync(dev)
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.detach())
        if kind == "clip":
            temps.append(loss_fn.temperature)
    out = dict(losses=[float(v) for v in torch.stack(losses).cpu()],
               step_ms=[1e3 * s for s in step_s], encoder=encoders[0])
    if temps:
        out["temperature"] = [float(t) for t in torch.stack(temps).cpu()]
    return out


@torch.no_grad()
def features(encoder: Optional[Encoder], x: torch.Tensor) -> np.ndarray:
    """The 128-d representation (raw pixels for ``encoder=None``), as float64 NumPy."""
    if encoder is None:
        return x.double().numpy()
    p = next(encoder.parameters())
    return encoder.body(x.to(p.device, p.dtype)).double().cpu().numpy()


#: labels per class of the few-label probe
FEW_LABELS = 10


def linear_probe(encoder: Optional[Encoder], data: Dict[str, Any],
                 seed: int = 0) -> Dict[str, float]:
    """Test accuracy of a logistic regression on frozen, standardised features, fitted on
    all training labels ("all") and on ``FEW_LABELS`` per class ("few"; seeded choice)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    ftr, fte = features(encoder, data["x_train"]), features(encoder, data["x_test"])
    y = data["y_train"]
    rng = np.random.default_rng(seed)
    few = np.concatenate([rng.choice(np.flatnonzero(y == c), FEW_LABELS, replace=False)
                          for c in np.unique(y)])
    out = {}
    for name, idx in (("all", np.arange(len(y))), ("few", few)):
        clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000))
        clf.fit(ftr[idx], y[idx])
        out[name] = float(clf.score(fte, data["y_test"]))
    return out


def max_rel_diff(a: List[float], b: List[float]) -> float:
    """The largest per-step ``|a - b| / |b|`` of two loss curves."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def run(*, steps: int = 300, device: str = "cpu", batch: int = 256, seed: int = 0,
        dtype: str = "float32", kinds=KINDS, probe: bool = True) -> Dict[str, Any]:
    """Both losses × both implementations; a JSON-serialisable result."""
    tdtype = getattr(torch, dtype)
    data = load_digits(seed)
    batches = make_batches(data["x_train"], steps, batch, seed)
    res: Dict[str, Any] = dict(
        steps=steps, device=device, batch=batch, seed=seed, dtype=dtype,
        simclr_temperature=SIMCLR_T, clip_init_temperature=CLIP_T0, runs={}, agreement={})
    if probe:
        torch.manual_seed(seed)
        res["baselines"] = dict(raw_pixels=linear_probe(None, data),
                                untrained_encoder=linear_probe(Encoder(), data))
    for kind in kinds:
        res["runs"][kind] = {}
        for impl in IMPLS:
            out = train(kind, impl, batches, device=device, dtype=tdtype, seed=seed)
            enc = out.pop("encoder")
            warm = out["step_ms"][min(5, len(out["step_ms"]) - 1):]  # first steps: compile
            out["step_ms_median"] = statistics.median(warm)
            if probe:
                out["probe_accuracy"] = linear_probe(enc, data)
            res["runs"][kind][impl] = out
        r = res["runs"][kind]
        res["agreement"][kind] = max_rel_diff(r["cupynce"]["losses"], r["torch"]["losses"])
    return res


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------
def markdown(res: Dict[str, Any], info: Dict[str, Any]) -> str:
    head = (f"{_harness.device_header(info)}\n\n"
            f"digits (sklearn), {res['steps']} steps of {res['batch']} images × 2 views, "
            f"{res['dtype']}, Adam 1e-3, seed {res['seed']}, device {res['device']}\n\n")
    rows = []
    for kind, runs in res["runs"].items():
        for impl, r in runs.items():
            last = r["losses"][-10:]
            rows.append([
                "SimCLR (NTXentLoss)" if kind == "simclr" else "CLIP (ClipLoss)", impl,
                f"{r['losses'][0]:.4f}", f"{statistics.mean(last):.4f}",
                _harness.fmt_ms(r["step_ms_median"]),
                *([f"{100 * r['probe_accuracy'][k]:.1f}" for k in ("all", "few")]
                  if "probe_accuracy" in r else ["—", "—"]),
                f"{r['temperature'][-1]:.4f}" if "temperature" in r else "—",
                f"{res['agreement'][kind]:.1e}"])
    table = _harness.markdown_table(
        ["loss", "impl", "loss @1", "loss (last 10)", "ms / step", "probe % (all labels)",
         f"probe % ({FEW_LABELS}/class)", "final τ", "max rel Δ curves"], rows)
    base = ""
    if "baselines" in res:
        b = res["baselines"]
        base = ("\n\nLinear-probe baselines (all labels / "
                f"{FEW_LABELS} per class): raw pixels {100 * b['raw_pixels']['all']:.1f} / "
                f"{100 * b['raw_pixels']['few']:.1f} %, untrained encoder "
                f"{100 * b['untrained_encoder']['all']:.1f} / "
                f"{100 * b['untrained_encoder']['few']:.1f} %.")
    return head + table + base + "\n"


def plot(res: Dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(res["runs"]), figsize=(5 * len(res["runs"]), 3.5))
    for ax, (kind, runs) in zip(np.atleast_1d(axes), res["runs"].items()):
        for impl, style in zip(IMPLS, ("-", "--")):
            ax.plot(runs[impl]["losses"], style, label=impl)
        ax.set(title=kind, xlabel="step", ylabel="loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda"
                   if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    res = run(steps=args.steps, device=args.device, batch=args.batch, seed=args.seed,
              dtype=args.dtype)
    info = _harness.device_info() if args.device == "cuda" else dict(
        date=_harness.device_info()["date"], python=sys.version.split()[0],
        torch=torch.__version__, gpu="CPU")
    res["info"] = info
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"train_digits_{args.device}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = markdown(res, info)
    stem.with_suffix(".md").write_text(md)
    if plot(res, stem.with_suffix(".png")):
        print(f"wrote {stem}.png")
    print(md)
    return res


if __name__ == "__main__":
    main()
