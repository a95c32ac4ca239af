"""Gradient caching with sentence-transformers (issue 54): step time and peak memory of the
library's ``CachedMultipleNegativesRankingLoss``, cupynce's, and the uncached MNRL where it fits.

Encoders with random weights built offline (transformers' ``BertModel``; "minilm": 6 layers,
384 wide, 12 heads — all-MiniLM-L6's shape; "bert-base": 12 layers, 768 wide), in a
SentenceTransformer with mean pooling; (anchor, positive) batches of pre-tokenised random ids,
sequence length 64 (no padding), float32 weights under bf16 autocast; mini-batches of 1024;
AdamW (fused) steps. One GPU; per configuration one warm-up step, then the median of
``--steps`` synchronised steps and the peak of ``torch.cuda.max_memory_allocated``.

Loops:
* ``plain`` — PyTorch's AMP recipe: the forward under ``torch.autocast``, ``backward()``
  outside it (the library's cached loss then re-embeds in float32: its hook runs outside the
  autocast region; cupynce's replays the forward's autocast state);
* ``trainer`` — what ``SentenceTransformerTrainer`` runs through accelerate: the model's
  forward itself wrapped in autocast (accelerate's ``autocast`` around ``model.forward``,
  emulated here without the trainer's data pipeline), so every re-embedding is in bf16.

``loss`` rows: the loss part alone on (N, 384) bf16 embeddings (forward and the embeddings'
gradient): the library's cached ``calculate_loss(..., with_backward=True)`` (its chunked
PyTorch loss) against cupynce's fused call.

    python benchmarks/bench_grad_cache.py --out results/ --name bench_grad_cache
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cupynce.integrations import sentence_transformers as c_st  # noqa: E402
from cupynce.report.environment import device_header, device_info  # noqa: E402
from cupynce.report.formatting import markdown_table  # noqa: E402
from cupynce.report.harness import is_oom  # noqa: E402

SHAPES = {"minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                         intermediate_size=1536),
          "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                            intermediate_size=3072)}
VOCAB = 30522


def build(shape: str, folder: str):
    """A SentenceTransformer (BERT of ``shape``, random weights, mean pooling) on CUDA."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = Path(folder) / shape
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                              + [f"w{i}" for i in range(100)]))
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(str(path))
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=VOCAB, max_position_embeddings=512,
                         **SHAPES[shape])).save_pretrained(str(path))
    t = Transformer(str(path))
    return SentenceTransformer(modules=[t, Pooling(SHAPES[shape]["hidden_size"], "mean")],
                               device="cuda")


def batch(n: int, length: int, seed: int) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [{"input_ids": torch.randint(5, VOCAB, (n, length), device="cuda", generator=g),
             "attention_mask": torch.ones(n, length, dtype=torch.long, device="cuda"),
             "token_type_ids": torch.zeros(n, length, dtype=torch.long, device="cuda")}
            for _ in range(2)]


def _autocast_forward(model):
    """accelerate's mixed precision: the model's forward runs under autocast, whoever calls
    it (restore with ``model.forward = model._plain_forward``)."""
    model._plain_forward = model.forward
    model.forward = torch.autocast("cuda", dtype=torch.bfloat16)(model._plain_forward)


def _timed(step, steps: int):
    torch.cuda.synchronize()
    step()  # (warm-up: kernels, the allocator, cuBLAS handles)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cuda.max_memory_allocated()


def step_case(model, loss_obj, feats, loop: str, steps: int) -> Dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        opt.zero_grad(set_to_none=True)
        if loop == "plain":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_obj([dict(f) for f in feats], None)
        else:
            loss = loss_obj([dict(f) for f in feats], None)
        loss.backward()
        opt.step()

    try:
        t, peak = _timed(step, steps)
        return {"step_s": t, "peak_gib": peak / 2 ** 30}
    except Exception as exc:  # noqa: BLE001 - an OOM is a result
        if not is_oom(exc):
            raise
        return {"step_s": None, "peak_gib": None, "note": "out of memory"}
    finally:
        torch.cuda.empty_cache()


def loss_case(n: int, d: int, steps: int) -> List[Dict[str, Any]]:
    """The loss part alone: forward + the embeddings' gradient, bf16 (N, d) embeddings."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, p = (torch.randn(n, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    out = []
    ours = c_st.MultipleNegativesRankingLoss(None)

    def leaves():
        return [x.detach().requires_grad_() for x in (q, p)]

    def lib_step():
        _lib_loss().calculate_loss([[x] for x in leaves()], None, with_backward=True)

    def our_step():
        ours.compute_loss_from_embeddings(leaves(), None).backward()

    for name, fn in (("library (chunked torch)", lib_step), ("cupynce (fused)", our_step)):
        t, peak = _timed(fn, steps)
        out.append({"loss": name, "n": n, "time_s": t, "peak_gib": peak / 2 ** 30})
    return out


@functools.lru_cache(maxsize=None)
def _lib_loss():
    """The library's cached MNRL without a model (its ``calculate_loss`` needs none)."""
    from sentence_transformers.sentence_transformer import losses as ST

    class _NoModel(torch.nn.Module):  # (the constructor asks the model for its first module)
        def __getitem__(self, i):
            return torch.nn.Identity()

    return ST.CachedMultipleNegativesRankingLoss(_NoModel(), mini_batch_size=1024)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="minilm")
    p.add_argument("--sizes", default="8192,32768,65536")
    p.add_argument("--loops", default="plain,trainer")
    p.add_argument("--uncached-max", type=int, default=8192)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--mini-batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--loss-sizes", default="8192,65536")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--name", default="bench_grad_cache")
    args = p.parse_args(argv)
    from sentence_transformers.sentence_transformer import losses as ST

    args.out.mkdir(parents=True, exist_ok=True)
    rows, loss_rows = [], []
    header = f"# bench_grad_cache: {device_header(device_info())}"

    def report():
        lines = [header, "", "## steps", ""]
        heads = ["shape", "loop", "n", "loss", "step_s", "peak_gib", "vs uncached",
                 "vs library cached", "note"]
        lines.append(markdown_table(heads, [[_fmt(r.get(h)) for h in heads] for r in rows]))
        if loss_rows:
            heads = ["loss", "n", "time_s", "peak_gib"]
            lines += ["", "## the loss part alone (bf16, D = 384)", "",
                      markdown_table(heads, [[_fmt(r.get(h)) for h in heads]
                                             for r in loss_rows])]
        (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
        (args.out / f"{args.name}.json").write_text(json.dumps(rows + loss_rows, indent=1))

    with tempfile.TemporaryDirectory() as folder:
        for shape in args.shapes.split(","):
            model = build(shape, folder)
            model.train()
            for loop in args.loops.split(","):
                if loop == "trainer":
                    _autocast_forward(model)
                for n in map(int, args.sizes.split(",")):
                    feats = batch(n, args.length, seed=n)
                    cases = [("library cached", ST.CachedMultipleNegativesRankingLoss(
                                  model, mini_batch_size=args.mini_batch)),
                             ("cupynce cached", c_st.CachedMultipleNegativesRankingLoss(
                                  model, mini_batch_size=args.mini_batch))]
                    if n <= args.uncached_max:
                        cases.insert(0, ("uncached", ST.MultipleNegativesRankingLoss(model)))
                    got = {}
                    for name, loss_obj in cases:
                        r = {"shape": shape, "loop": loop, "n": n, "loss": name,
                             **step_case(model, loss_obj, feats, loop, args.steps)}
                        got[name] = r["step_s"]
                        for ref in ("uncached", "library cached"):
                            if name != ref and got.get(ref) and r["step_s"]:
                                r[f"vs {ref}"] = r["step_s"] / got[ref]
                        rows.append(r)
                        print(json.dumps(r), flush=True)
                        report()
                    del feats
                if loop == "trainer":
                    model.forward = model._plain_forward
            del model
            torch.cuda.empty_cache()
        for n in map(int, args.loss_sizes.split(",")):
            loss_rows += loss_case(n, 384, args.steps)
            print(json.dumps(loss_rows[-2:]), flush=True)
            report()
    print((args.out / f"{args.name}.md").read_text())


def _fmt(x):
    if x is None:
        return "—"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


if __name__ == "__main__":
    main()
