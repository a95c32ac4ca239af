"""How often SPLADE's bf16 arg-max differs from float64's (issue 56 item 2).

Run from the repository root on a GPU::

    PYTHONUNBUFFERED=1 python benchmarks/bench_splade_argmax.py [--out DIR]

Every logit the bf16 head takes its max over is rounded, so near-ties can pick another
position l* than float64 would, and each such entry sends a whole gradient row (dW[v], dx[b,
l*]) elsewhere.  For BERT-shaped heads (D = 768, V = 30522; B = 32, L = 128 and 256, random
bf16 data with MLM-like logit and bias spreads) this counts, over the active entries (float64
max > 0), those whose arg-max differs from the float64 arg-max of the same bf16 values, for:

``ws`` / ``tiles`` / ``cublas``  cupynce's three forward paths (Hopper's fused kernel, the
                                 MODE_SPMAX tiles, cuBLAS products + the max kernel): the
                                 logits x·W + bias rounded to bf16 once, as ``F.linear``;
``library``                      sentence-transformers' SpladePooling on ``F.linear``'s bf16
                                 logits (``torch.max`` of log1p(relu) over the sequence);
``before-bias``                  the rule cupynce had before: the products rounded to bf16
                                 before the bias is added (the bias then changes no arg-max:
                                 cupynce's forward with the bias left out).

The float64 arg-max is computed in vocabulary chunks (the (B, L, V) float64 logits never
exist whole).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupynce.report.harness import device_header, device_info, markdown_table  # noqa: E402

SHAPES = [(32, 128, 768, 30522), (32, 256, 768, 30522)]
PATHS = ("ws", "tiles", "cublas")


def inputs(b, l, d, v, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, d, generator=g).bfloat16().cuda()
    w = (torch.randn(v, d, generator=g) * (3 / math.sqrt(d))).bfloat16().cuda()
    bias = (torch.randn(v, generator=g) * 2.0 - 2.0).bfloat16().cuda()
    return x, w, bias


def float64_argmax(x, w, bias, chunk=2048):
    """(arg-max, active) over the sequence of the float64 logits, in vocabulary chunks."""
    import torch

    b, l, _ = x.shape
    v = w.shape[0]
    arg = torch.empty(b, v, dtype=torch.long, device=x.device)
    act = torch.empty(b, v, dtype=torch.bool, device=x.device)
    xd = x.double()
    for v0 in range(0, v, chunk):
        z = torch.einsum("bld,vd->blv", xd, w[v0:v0 + chunk].double()) \
            + bias[v0:v0 + chunk].double()
        m, a = z.max(dim=1)
        arg[:, v0:v0 + chunk], act[:, v0:v0 + chunk] = a, m > 0
    return arg, act


def main(argv=None) -> int:
    import torch

    import cupynce.config as cfg
    from cupynce.torch.ops import splade as tsplade

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    header = device_header(device_info())
    print(header, flush=True)
    rows, raw = [], []
    for b, l, d, v in SHAPES:
        x, w, bias = inputs(b, l, d, v)
        ref, active = float64_argmax(x, w, bias)
        n = int(active.sum())

        def differ(idx):
            return int(((idx.long() != ref) & active).sum())

        counts, args_of = {}, {}
        for path in PATHS:
            with cfg.scope(tiles=path != "cublas", splade_ws=path == "ws"):
                _, a = tsplade.fwd(x, w, bias, None, "log1p_relu", None, True)
            args_of[path] = a
            counts[path] = differ(a)
        act = torch.log1p(torch.relu(torch.nn.functional.linear(x, w, bias)))
        counts["library"] = differ(torch.max(act, dim=1).indices)
        del act
        _, a = tsplade.fwd(x, w, None, None, "log1p_relu", None, True)
        counts["before-bias"] = differ(a)
        same = bool(torch.equal(args_of["ws"], args_of["tiles"]))
        cub = int((args_of["cublas"] != args_of["tiles"]).sum())
        rec = dict(b=b, l=l, d=d, v=v, active=n, differ=counts, ws_equals_tiles=same,
                   cublas_vs_tiles=cub)
        raw.append(rec)
        print(rec, flush=True)
        rows.append([f"{b} × {l} × {d} × {v}", n]
                    + [f"{counts[k]} ({100 * counts[k] / n:.3f} %)"
                       for k in (*PATHS, "library", "before-bias")]
                    + ["yes" if same else "no", cub])
    table = markdown_table(["B × L × D × V", "active", *PATHS, "library", "before-bias",
                            "ws = tiles", "cublas ≠ tiles"], rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_splade_argmax.md").write_text(f"# {header}\n\n{table}\n")
        (out / "bench_splade_argmax.json").write_text(json.dumps(
            dict(device=header, rows=raw), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
