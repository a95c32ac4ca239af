"""cupynce.integrations against the libraries' own classes, one GPU, the sizes their users train at.

Run from the repository root on a GPU (open_clip_torch and lightly installed, with torchvision;
sentence-transformers)::

    PYTHONUNBUFFERED=1 python benchmarks/bench_integrations.py [--quick]

Each row: the library's loss class and cupynce's drop-in on the same bf16 leaves, forward +
backward (the learnable scale / bias included), CUDA-event medians, peak memory above the
inputs, and each one's relative error ||x − ref|| / ||ref|| of the loss and of the worst input
gradient against the library's class run in float64 on the same (bf16-rounded) values (the check that the
drop-in gives the library's numbers).  The library classes are loaded from their installed files
(``tests/_support/library_losses.py``) where their packages' imports need more than torch.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "_support"))

from cupynce.report.harness import (device_header, device_info, fmt_mib, fmt_ms,  # noqa: E402
                                    fmt_ratio, markdown_table, run_case)


def _cases(quick: bool):
    """(name, size text, library factory, cupynce factory, inputs maker)."""
    import torch

    import library_losses as LL
    from cupynce.integrations import lightly as c_lightly
    from cupynce.integrations import open_clip as c_oc
    from cupynce.integrations import sentence_transformers as c_st

    oc, ntx = LL.open_clip_loss(), LL.lightly_ntxent()
    try:
        from sentence_transformers.losses import MultipleNegativesRankingLoss as STMNRL
    except ImportError:  # pragma: no cover
        STMNRL = None

    def unit(n, d, k=2, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.nn.functional.normalize(torch.randn(n, d, device="cuda", generator=g), dim=-1)
                for _ in range(k)]

    clip_sizes = (4096,) if quick else (4096, 16384, 32768)
    for n in clip_sizes:
        if oc is not None:
            yield ("open_clip ClipLoss", f"N = {n}, D = 768", oc.ClipLoss, c_oc.ClipLoss,
                   lambda n=n: (unit(n, 768), [math.log(1 / 0.07)]), "clip")
            yield ("open_clip SigLipLoss", f"N = {n}, D = 768", oc.SigLipLoss, c_oc.SigLipLoss,
                   lambda n=n: (unit(n, 768), [math.log(10.0), -10.0]), "siglip")
    for n in ((2048,) if quick else (2048, 8192)):
        if ntx is not None:
            yield ("lightly NTXentLoss", f"2 × {n} views, D = 128", lambda: ntx(0.1),
                   lambda: c_lightly.NTXentLoss(0.1),
                   lambda n=n: ([x * 3 for x in unit(n, 128)], []), "ntxent")
    try:
        from sentence_transformers.sparse_encoder.modules import SpladePooling as STPool
    except ImportError:  # pragma: no cover
        STPool = None
    if STPool is not None:
        for bsz, seq in (((32, 128),) if quick else ((32, 128), (32, 256), (64, 256))):
            yield ("sentence-transformers SpladePooling", f"B = {bsz}, L = {seq}, V = 30522, "
                   "D = 768 (decoder included)", lambda: _LibSplade(STPool),
                   lambda: _OurSplade(c_st.SpladePooling),
                   lambda b=bsz, l=seq: (_splade_inputs(b, l), []), "splade")
    for n in ((1024,) if quick else (1024, 4096)):
        if STMNRL is not None:
            yield ("sentence-transformers MNRL", f"N = {n} + {n} hard negatives, D = 768",
                   lambda: STMNRL(None), lambda: c_st.MultipleNegativesRankingLoss(None),
                   lambda n=n: (unit(n, 768, k=3), []), "mnrl")


def _splade_inputs(bsz, seq, d=768, v=30522):
    """BERT-base-sized decoder inputs: hidden states (B, L, D) of a transformed MLM output,
    the decoder's weight (V, D) and bias (V,), a padding mask with lengths in [L/2, L]."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(bsz * seq)
    h = torch.randn(bsz, seq, d, device="cuda", generator=g)
    w = torch.randn(v, d, device="cuda", generator=g) / d ** 0.5
    b = torch.randn(v, device="cuda", generator=g) * 0.5 - 2.0  # (about half active)
    lens = torch.randint(seq // 2, seq + 1, (bsz,), device="cuda", generator=g)
    mask = (torch.arange(seq, device="cuda")[None, :] < lens[:, None]).long()
    return [h, w, b, mask]


class _LibSplade:
    """The library's pipeline: the decoder's (B, L, V) logits, then its SpladePooling."""

    def __init__(self, pool_cls):
        self.pool = pool_cls("max", "relu")

    def __call__(self, h, w, b, mask):
        import torch

        logits = torch.nn.functional.linear(h, w, b)
        return self.pool({"token_embeddings": logits,
                          "attention_mask": mask})["sentence_embedding"]


class _OurSplade:
    """cupynce's SpladePooling on a stand-in masked LM whose decoder holds (w, b), built once
    per (w, b) (the decoder on the meta device, then given w and b as its Parameters)."""

    def __init__(self, pool_cls):
        self.pool_cls, self.key, self.pool, self.leaves = pool_cls, None, None, None

    def __call__(self, h, w, b, mask):
        import torch

        if self.key != (id(w), id(b)):
            class _LM(torch.nn.Module):  # get / set_output_embeddings, as a masked LM has
                def __init__(self):
                    super().__init__()
                    self.dec = torch.nn.Linear(w.shape[1], w.shape[0], device="meta")

                def get_output_embeddings(self):
                    return self.dec

                def set_output_embeddings(self, m):
                    self.dec = m

            lm = _LM()
            # Parameters sharing w's and b's storage (their own autograd leaves)
            lm.dec.weight = torch.nn.Parameter(w.detach())
            lm.dec.bias = torch.nn.Parameter(b.detach())
            self.leaves = (lm.dec.weight, lm.dec.bias)
            self.pool, self.key = self.pool_cls(lm), (id(w), id(b))
        out = self.pool({"token_embeddings": h, "attention_mask": mask})["sentence_embedding"]
        return out, self.leaves


def _step(kind, loss_fn, xs, scalars):
    """forward + backward; returns (loss, grads of xs and scalars)."""
    import torch

    if kind in ("clip", "siglip"):
        args = [xs[0], xs[1], scalars[0].exp()] + ([scalars[1]] if kind == "siglip" else [])
        loss = loss_fn(*args)
    elif kind == "ntxent":
        loss = loss_fn(xs[0], xs[1])
    elif kind == "splade":  # out (B, V) against a fixed upstream gradient
        h, w, b, mask = xs
        res = loss_fn(h, w, b, mask)
        out, leaves = res if isinstance(res, tuple) else (res, (w, b))
        up = torch.linspace(-1, 1, out.shape[-1], device=out.device, dtype=out.dtype)
        loss = (out * up).sum()
        grads = torch.autograd.grad(loss, [h, *leaves])
        return loss.detach(), [g.detach() for g in grads]
    else:
        loss = loss_fn.compute_loss_from_embeddings(list(xs), None)
    grads = torch.autograd.grad(loss, [*xs, *scalars])
    return loss.detach(), [g.detach() for g in grads]


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args(argv)
    info = device_info()
    print(device_header(info))
    rows = []
    for name, size, lib, ours, make, kind in _cases(args.quick):
        feats, scal = make()
        ref_fn = lib()
        def leaf(f, dt):  # (a mask stays as it is)
            return f.to(dt).requires_grad_(True) if f.is_floating_point() else f

        # the reference sees the bf16 values the runs see: the errors are the implementations'
        # own, not the inputs' rounding (which moves SPLADE's max positions for both alike)
        x64 = [leaf(f.to(torch.bfloat16) if f.is_floating_point() else f, torch.float64)
               for f in feats]
        s64 = [torch.tensor(v, dtype=torch.float64, device="cuda", requires_grad=True)
               for v in scal]
        ref_loss, ref_grads = _step(kind, ref_fn, x64, s64)
        res = {}
        for impl, factory in (("library", lib), ("cupynce", ours)):
            fn = factory()
            xs = [leaf(f, torch.bfloat16) for f in feats]
            ss = [torch.tensor(v, dtype=torch.float32, device="cuda", requires_grad=True)
                  for v in scal]
            case = run_case(lambda: _step(kind, fn, xs, ss), repeat=args.repeat,
                            keep_result=True, catch_errors=True)
            out = case.pop("result", None)
            if out is not None:
                loss, grads = out
                case["loss_err"] = float(abs(loss.double() - ref_loss) / abs(ref_loss))
                case["grad_err"] = max(float((g.double() - r).norm() / r.norm().clamp_min(1e-30))
                                       for g, r in zip(grads, ref_grads)
                                       if g.dim() > 0)
            res[impl] = case
            del fn, xs, ss, out
        lib_r, our_r = res["library"], res["cupynce"]

        def ms(r):
            return r.get("median_ms")

        speed = ms(lib_r) / ms(our_r) if ms(lib_r) and ms(our_r) else None
        mem = (lib_r.get("peak_extra_bytes") / our_r["peak_extra_bytes"]
               if lib_r.get("peak_extra_bytes") and our_r.get("peak_extra_bytes") else None)
        rows.append([name, size,
                     "OOM" if lib_r.get("oom") else fmt_ms(ms(lib_r)),
                     "OOM" if lib_r.get("oom") else fmt_mib(lib_r.get("peak_extra_bytes")),
                     fmt_ms(ms(our_r)), fmt_mib(our_r.get("peak_extra_bytes")),
                     fmt_ratio(speed), fmt_ratio(mem),
                     f"{lib_r.get('loss_err', float('nan')):.1e} / "
                     f"{lib_r.get('grad_err', float('nan')):.1e}",
                     f"{our_r.get('loss_err', float('nan')):.1e} / "
                     f"{our_r.get('grad_err', float('nan')):.1e}"])
        print(rows[-1], flush=True)
    print(markdown_table(["library class", "size", "library ms", "library MiB", "cupynce ms",
                          "cupynce MiB", "speed-up", "memory ÷", "library err loss / grad",
                          "cupynce err loss / grad"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
