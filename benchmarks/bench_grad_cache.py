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

The floor of any cached step, measured in the same loop (``--floor``): "floor" = the
mini-batches' forward under ``no_grad`` (step i) plus plain gradient accumulation over the same
mini-batches (a forward with a graph and a backward of a loss that couples nothing:
``emb.float().square().mean()``, then the optimizer step) — the encoder's work of steps i and
iii with nothing of the contrastive loss.

``--trainer-real``: the same losses through a real ``SentenceTransformerTrainer`` (bf16,
``per_device_train_batch_size`` = N, random texts of ``length`` words tokenised by the
collator); step time between the ``on_step_begin`` and ``on_step_end`` callbacks
(synchronised), so the collator's tokenisation is not in it. Needs ``datasets``.

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
                            intermediate_size=3072),
          # (the CPU tests' encoder)
          "tiny": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=64)}
VOCAB = 30522


def build(shape: str, folder: str, device: str = "cuda"):
    """A SentenceTransformer (BERT of ``shape``, random weights, mean pooling) on
    ``device``."""
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
                               device=device)


def batch(n: int, length: int, seed: int, device: str = "cuda") -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [{"input_ids": torch.randint(5, VOCAB, (n, length), device=device, generator=g),
             "attention_mask": torch.ones(n, length, dtype=torch.long, device=device),
             "token_type_ids": torch.zeros(n, length, dtype=torch.long, device=device)}
            for _ in range(2)]


def _autocast_forward(model):
    """accelerate's mixed precision: the model's forward runs under autocast, whoever calls
    it (restore with ``model.forward = model._plain_forward``)."""
    model._plain_forward = model.forward
    model.forward = torch.autocast("cuda", dtype=torch.bfloat16)(model._plain_forward)


def _timed(step, steps: int, cuda: bool = True, before=None):
    """(median seconds of ``steps`` steps after a warm-up, their peak bytes); ``steps`` = 0:
    the one step alone, warm-up included (the largest batches: one step is minutes).
    ``cuda=False``: CPU steps, no peak (None); ``before``: called before each timed step
    (the multi-GPU bench's barrier, so that the ranks time the same step)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if steps:
        step()  # (warm-up: kernels, the allocator, cuBLAS handles)
        sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(max(steps, 1)):
        if before is not None:
            before()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (torch.cuda.max_memory_allocated() if cuda else None)


def _oom_is_a_result(run) -> Dict[str, Any]:
    """``run()`` -> (seconds, peak bytes) as a row; out of memory is a row too."""
    try:
        t, peak = run()
        return {"step_s": t, "peak_gib": peak / 2 ** 30}
    except Exception as exc:  # noqa: BLE001 - an OOM is a result
        if not is_oom(exc):
            raise
        return {"step_s": None, "peak_gib": None, "note": "out of memory"}
    finally:
        torch.cuda.empty_cache()


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

    return _oom_is_a_result(lambda: _timed(step, steps))


def floor_case(model, feats, loop: str, steps: int, mini: int) -> Dict[str, Any]:
    """The encoder's work of a cached step without the loss (module docstring)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=loop == "plain")
    n = feats[0]["input_ids"].shape[0]

    def chunks():
        for f in feats:
            for b in range(0, n, mini):
                yield {k: v[b:b + mini] if isinstance(v, torch.Tensor) else v
                       for k, v in f.items()}

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.no_grad(), amp:
            for c in chunks():
                model(c)
        for c in chunks():
            with amp:
                emb = model(c)["sentence_embedding"]
            emb.float().square().mean().backward()
        opt.step()

    t, peak = _timed(step, steps)
    torch.cuda.empty_cache()
    return {"step_s": t, "peak_gib": peak / 2 ** 30}


class _StepTimer:
    """A trainer callback timing each step (synchronised at both ends)."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                torch.cuda.synchronize()
                timer.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                torch.cuda.synchronize()
                timer.times.append(time.perf_counter() - timer.t0)

        self.times: List[float] = []
        self.callback = CB()


def trainer_case(model, make_loss, n: int, length: int, steps: int, folder: str
                 ) -> Dict[str, Any]:
    """Steps of a real SentenceTransformerTrainer (module docstring)."""
    import datasets
    from sentence_transformers import (SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)

    g = torch.Generator().manual_seed(n)
    words = torch.randint(0, 100, (2, n * (steps + 1), length), generator=g).tolist()
    cols = [[" ".join(f"w{w}" for w in row) for row in col] for col in words]
    # a fixed fingerprint: datasets hashes a new Dataset's state with dill, which fails on
    # some pyarrow / Python pairs (pyarrow 26, Python 3.12: "Can't pickle MonthDayNano")
    data = datasets.Dataset(datasets.table.InMemoryTable.from_pydict(
        {"anchor": cols[0], "positive": cols[1]}), fingerprint=f"bench-{n}")
    args = SentenceTransformerTrainingArguments(
        output_dir=folder, max_steps=steps + 1, per_device_train_batch_size=n, bf16=True,
        learning_rate=1e-5, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, dataloader_drop_last=True, seed=0)
    timer = _StepTimer()
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                         loss=make_loss(model), callbacks=[timer.callback])
    def train():
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
        return statistics.median(timer.times[1:]), torch.cuda.max_memory_allocated()

    return _oom_is_a_result(train)


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
    p.add_argument("--floor", action="store_true", help="the encoder-only floor rows")
    p.add_argument("--losses", default="uncached,library cached,cupynce cached",
                   help="which losses to step (the largest batches: --losses 'cupynce cached'"
                        " --steps 0)")
    p.add_argument("--trainer-real", action="store_true",
                   help="also through a real SentenceTransformerTrainer (needs datasets)")
    p.add_argument("--trainer-losses", default="library cached,cupynce cached",
                   help="the cached losses --trainer-real runs")
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
                 "vs library cached", "vs floor", "note"]
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
                    cases = [c for c in cases if c[0] in args.losses.split(",")]
                    got = {}
                    if args.floor:
                        r = {"shape": shape, "loop": loop, "n": n, "loss": "floor",
                             **floor_case(model, feats, loop, args.steps, args.mini_batch)}
                        got["floor"] = r["step_s"]
                        rows.append(r)
                        print(json.dumps(r), flush=True)
                    for name, loss_obj in cases:
                        r = {"shape": shape, "loop": loop, "n": n, "loss": name,
                             **step_case(model, loss_obj, feats, loop, args.steps)}
                        got[name] = r["step_s"]
                        for ref in ("uncached", "library cached", "floor"):
                            if name != ref and got.get(ref) and r["step_s"]:
                                r[f"vs {ref}"] = r["step_s"] / got[ref]
                        rows.append(r)
                        print(json.dumps(r), flush=True)
                        report()
                    del feats
                if loop == "trainer":
                    model.forward = model._plain_forward
            if args.trainer_real:
                for n in map(int, args.sizes.split(",")):
                    makers = [("library cached", lambda m: ST.CachedMultipleNegativesRankingLoss(
                                  m, mini_batch_size=args.mini_batch)),
                              ("cupynce cached", lambda m: c_st.CachedMultipleNegativesRankingLoss(
                                  m, mini_batch_size=args.mini_batch))]
                    makers = [m for m in makers if m[0] in args.trainer_losses.split(",")]
                    got = {}
                    for name, make in makers:
                        r = {"shape": shape, "loop": "SentenceTransformerTrainer", "n": n,
                             "loss": name, **trainer_case(model, make, n, args.length,
                                                          args.steps, f"{folder}/run")}
                        got[name] = r["step_s"]
                        if name != "library cached" and got.get("library cached") and \
                                r["step_s"]:
                            r["vs library cached"] = r["step_s"] / got["library cached"]
                        rows.append(r)
                        print(json.dumps(r), flush=True)
                        report()
            del model
            torch.cuda.empty_cache()
        for n in [int(x) for x in args.loss_sizes.split(",") if x]:
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
