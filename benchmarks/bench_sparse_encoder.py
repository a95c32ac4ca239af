"""SPLADE training end to end (issue 56): a SparseEncoder's training step, the library's
against cupynce's, uncached and cached.

A BERT masked LM with random weights built offline ("bert-base": 12 layers, 768 wide,
V = 30522; "tiny": 1 layer, 64 wide, V = 1000, for a CPU smoke run) in a ``SparseEncoder``:

* ``library``  the library's ``SpladePooling`` (its (b, L, V) logits, then the max) and its
               ``SpladeLoss`` / ``CachedSpladeLoss`` around ``SparseMultipleNegativesRankingLoss``
               (FLOPS regularisers on documents 3e-5 and queries 5e-5);
* ``cupynce``  ``cupynce.integrations.sentence_transformers.SpladePooling`` (fused with the
               decoder: no (b, L, V) logits) and its ``SpladeLoss`` / ``CachedSpladeLoss``
               (cupynce's sparse MNRL, the library's regularisers; the cached one on
               ``cupynce.torch.GradientCache``).

(query, document) batches of pre-tokenised random ids, ``--length`` tokens each (256, no
padding), float32 weights under bf16 autocast (PyTorch's AMP recipe: the forward under
``torch.autocast``, ``backward()`` outside it), AdamW (fused) steps; cached mini-batches of
``--mini-batch`` rows. Per case one warm-up step, then the median of ``--steps`` synchronised
steps and ``torch.cuda.max_memory_allocated`` over them; out of memory is a result.
``--largest``: per (implementation, loss) the batch doubled from the last size that fitted
until a step runs out of memory (one step each): the largest batch that fits and its peak.

    python benchmarks/bench_sparse_encoder.py --out results/ --name bench_sparse_encoder
    python benchmarks/bench_sparse_encoder.py --shape tiny --sizes 4 --steps 1 --device cpu
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_grad_cache import _oom_is_a_result, _timed  # noqa: E402

from cupynce.report.environment import device_header, device_info  # noqa: E402
from cupynce.report.formatting import markdown_table  # noqa: E402
from cupynce.report.timing import time_cpu  # noqa: E402

SHAPES = {"bert-base": dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                            num_attention_heads=12, intermediate_size=3072),
          "tiny": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=128)}
REG = dict(document_regularizer_weight=3e-5, query_regularizer_weight=5e-5)


def save_mlm(shape: str, folder: str) -> str:
    """A BertForMaskedLM of ``shape`` (random weights) and its tokenizer, saved offline."""
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    cfg = SHAPES[shape]
    path = Path(folder) / shape
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        + [f"w{i}" for i in range(cfg["vocab_size"] - 5)]))
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(str(path))
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(max_position_embeddings=512, **cfg)).save_pretrained(str(path))
    return str(path)


def build(path: str, impl: str, device: str):
    """The SparseEncoder (masked LM + the implementation's SpladePooling) on ``device``."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling as LibPooling

    from cupynce.integrations import sentence_transformers as c_st

    t = Transformer(path, transformer_task="fill-mask")
    pool = c_st.SpladePooling(t) if impl == "cupynce" else LibPooling("max")
    return SparseEncoder(modules=[t, pool], device=device)


def loss_for(model, impl: str, cached: bool, mini: int):
    import sentence_transformers.sparse_encoder.losses as L

    from cupynce.integrations import sentence_transformers as c_st

    mod = c_st if impl == "cupynce" else L
    base = L.SparseMultipleNegativesRankingLoss(model)  # (cupynce's classes convert it)
    if cached:
        return mod.CachedSpladeLoss(model, base, mini_batch_size=mini, **REG)
    return mod.SpladeLoss(model, base, **REG)


def batch(n: int, length: int, vocab: int, seed: int, device: str) -> List[Dict[str, Any]]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [{"input_ids": torch.randint(5, vocab, (n, length), device=device, generator=g),
             "attention_mask": torch.ones(n, length, dtype=torch.long, device=device),
             "token_type_ids": torch.zeros(n, length, dtype=torch.long, device=device)}
            for _ in range(2)]


def step_fn(model, loss_obj, feats, device: str):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            parts = loss_obj([dict(f) for f in feats], None)
        sum(parts.values()).backward()  # (as the trainer sums the dict)
        opt.step()
    return step


def case(path: str, impl: str, cached: bool, n: int, args) -> Dict[str, Any]:
    vocab = SHAPES[args.shape]["vocab_size"]
    model = build(path, impl, args.device)
    model.train()
    loss_obj = loss_for(model, impl, cached, args.mini_batch)
    feats = batch(n, args.length, vocab, n, args.device)
    step = step_fn(model, loss_obj, feats, args.device)
    if args.device != "cuda":  # (the CPU smoke run: time only, the median step)
        ms = time_cpu(step, warmup=0, repeat=max(args.steps, 1))["median_ms"]
        row = {"step_s": ms / 1e3, "peak_gib": None}
    else:
        row = _oom_is_a_result(functools.partial(_timed, step, args.steps))
    del model, loss_obj, feats, step
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return dict(row, impl=impl, loss="CachedSpladeLoss" if cached else "SpladeLoss", n=n)


def largest(path: str, impl: str, cached: bool, start: int, args) -> Dict[str, Any]:
    """The batch doubled from ``start`` until a step runs out of memory (one step each) or
    passes ``--largest-max``; ``oom_at`` None then: the largest that fits lies at or beyond
    the last size tried (``bounded``)."""
    fit, n, oom = None, start, False
    while n <= args.largest_max:
        one = argparse.Namespace(**{**vars(args), "steps": 0})
        row = case(path, impl, cached, n, one)
        if row["step_s"] is None:
            oom = True
            break
        fit, n = row, 2 * n
    return {"impl": impl, "loss": "CachedSpladeLoss" if cached else "SpladeLoss",
            "largest": None if fit is None else fit["n"],
            "peak_gib": None if fit is None else fit["peak_gib"],
            "step_s": None if fit is None else fit["step_s"], "oom_at": n if oom else None,
            "bounded": not oom}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="bert-base", choices=sorted(SHAPES))
    p.add_argument("--sizes", default="32,128")
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--mini-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--losses", default="uncached,cached")
    p.add_argument("--largest", action="store_true")
    p.add_argument("--largest-max", type=int, default=1 << 16)
    p.add_argument("--largest-start", type=int, default=128)
    p.add_argument("--impls", default="library,cupynce")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--name", default="bench_sparse_encoder")
    args = p.parse_args(argv)
    info = device_info()
    print(device_header(info), flush=True)
    rows: List[Dict[str, Any]] = []
    big: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        path = save_mlm(args.shape, folder)
        impls = args.impls.split(",")
        for n in (int(s) for s in args.sizes.split(",") if s):
            for cached in (c == "cached" for c in args.losses.split(",")):
                for impl in impls:
                    rows.append(case(path, impl, cached, n, args))
                    print(json.dumps(rows[-1]), flush=True)
        if args.largest:
            for cached in (c == "cached" for c in args.losses.split(",")):
                for impl in impls:
                    big.append(largest(path, impl, cached, args.largest_start, args))
                    print(json.dumps(big[-1]), flush=True)
    by = {(r["impl"], r["loss"], r["n"]): r for r in rows}
    table = []
    for (impl, loss, n), r in by.items():
        if impl != "cupynce":
            continue
        lib = by.get(("library", loss, n), {})
        ratio = (f"{r['step_s'] / lib['step_s']:.2f}×" if r.get("step_s") and lib.get("step_s")
                 else "—")
        mem = (f"{r['peak_gib'] / lib['peak_gib']:.2f}×" if r.get("peak_gib")
               and lib.get("peak_gib") else "—")
        table.append([loss, n, _fmt(lib.get("step_s"), 1e3), _fmt(lib.get("peak_gib")),
                      _fmt(r.get("step_s"), 1e3), _fmt(r.get("peak_gib")), ratio, mem])
    md = [f"# {args.name}: {device_header(info)}", "",
          f"SparseEncoder ({args.shape}), {args.length} tokens a text, query + document "
          f"columns, bf16 autocast, AdamW; cached mini-batches of {args.mini_batch}", "",
          markdown_table(["loss", "batch", "library ms", "library GiB", "cupynce ms",
                          "cupynce GiB", "step ÷ library", "peak ÷ library"], table)]
    if big:
        md += ["", f"Largest batch that fits (doubling from {args.largest_start} up to "
               f"{args.largest_max}; one step each):", "",
               markdown_table(["impl", "loss", "largest batch", "its peak GiB", "its step s",
                               "out of memory at"],
                              [[b["impl"], b["loss"], b["largest"] or "—",
                                _fmt(b["peak_gib"]), _fmt(b["step_s"]),
                                b["oom_at"] or f"not reached (≤ {args.largest_max})"]
                               for b in big])]
    text = "\n".join(md)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text + "\n")
    (args.out / f"{args.name}.json").write_text(json.dumps(
        {"device": info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
         "largest": big}, indent=1))


def _fmt(x, mul: float = 1.0) -> str:
    return "—" if x is None else f"{x * mul:.3g}"


if __name__ == "__main__":
    main()
