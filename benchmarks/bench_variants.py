"""Issue 55's benchmark: the label-aware variants against the libraries and the plain formulas,
one GPU, one run.

Run from the repository root on a GPU (pytorch-metric-learning installed for its row)::

    PYTHONUNBUFFERED=1 python benchmarks/bench_variants.py [--sizes 16384,65536] [--out DIR]

SupCon (bf16, D = 512, four views a class, the views stacked view-major, L2-normalised inside
every implementation), forward + backward of the mean loss w.r.t. the embeddings:

* ``cupynce`` — :func:`cupynce.torch.supcon_loss` (``normalize=True``);
* ``pml`` — pytorch-metric-learning's ``SupConLoss`` (its defaults: the same loss);
* ``eager`` / ``compile`` — the SupCon reference code's formula (N × N logits, masks and
  log-probabilities) in plain PyTorch, and ``torch.compile`` of it;
* ``nt_xent`` (the floor) — :func:`cupynce.torch.nt_xent` on the same rows: the row softmax
  SupCon shares with it, so ``cupynce ÷ nt_xent`` is the class terms' cost.

MoCo (``--moco``: bf16, D = 128, ``--moco-queries`` queries against a ``--moco-queue``-key
queue, L2-normalised inside), forward + backward w.r.t. the queries and keys (the queue is
detached, as MoCo's):

* ``cupynce`` — ``info_nce(q, k, negatives=queue, in_batch_negatives=False)``;
* ``eager`` / ``compile`` — MoCo's formula (the positive's logit beside q̂ queuêᵀ, cross
  entropy at 0) and ``torch.compile`` of it;
* ``products`` (the floor) — the two products any implementation computes, q queueᵀ and
  the gradient block times the queue, alone (cuBLAS through torch).

The MoCo table has two times per implementation: one step alone (the device idle before it,
the host's launch time inside the span: the harness's median) and a step inside a training
loop (``loop``: ``--moco-loop`` steps back to back in one span, per step -- the host runs
ahead of the GPU as it does in training; ``time_cuda(burst=...)``).

CLIP with labels (``--clip``: bf16, D = 512, ``--clip-sizes`` pairs, four pairs a label --
duplicates, several captions of one image --, L2-normalised inside, a learnable logit_scale),
forward + backward w.r.t. both sides and the scale:

* ``labels`` — ``clip_loss(a, b, logit_scale, labels=labels)``; ``plain`` — the same call
  without labels (the target: ``labels ÷ plain`` <= 1.1);
* ``eager`` / ``compile`` — open_clip's formula with the same-label pairs masked to -inf
  (``masked_fill`` of the N × N logits, both cross entropies) and ``torch.compile`` of it.

CUDA-event medians, peak memory above the inputs (``cupynce.report.harness``), the loss's and
gradient's relative error against the formula in float64 on the same bf16 values (sizes up to
``--check-max``).  Out of memory is a result.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupynce.report.harness import (device_header, device_info, fmt_mib, fmt_ms,  # noqa: E402
                                    fmt_ratio, markdown_table, run_case)
from cupynce.report.timing import time_cuda  # noqa: E402


def supcon_formula(z, labels, temperature: float):
    """The SupCon reference code's ``L_out`` (contrast_mode "all", base_temperature =
    temperature) on L2-normalised rows: the plain PyTorch users run."""
    import torch

    z = torch.nn.functional.normalize(z, dim=-1)
    n = z.shape[0]
    logits = z @ z.T / temperature
    logits = logits - logits.max(dim=1, keepdim=True).values.detach()
    same = (labels[:, None] == labels[None, :]).to(logits.dtype)
    not_self = 1 - torch.eye(n, device=z.device, dtype=logits.dtype)
    pos = same * not_self
    log_prob = logits - torch.log((torch.exp(logits) * not_self).sum(1, keepdim=True))
    count = pos.sum(1)
    has = count > 0
    mean_pos = (pos * log_prob).sum(1) / count.clamp_min(1)
    return -(mean_pos[has]).mean()


def _implementations(temperature: float):
    """name -> loss(z, labels) (None where the library is missing)."""
    import torch

    import cupynce.torch as ct

    impls = {
        "cupynce": lambda z, y: ct.supcon_loss(z, y, temperature, normalize=True),
        "eager": lambda z, y: supcon_formula(z, y, temperature),
    }
    try:
        from pytorch_metric_learning.losses import SupConLoss

        pml = SupConLoss(temperature=temperature)
        impls["pml"] = lambda z, y: pml(z, y)
    except ImportError:
        impls["pml"] = None
    compiled = torch.compile(supcon_formula)
    impls["compile"] = lambda z, y: compiled(z, y, temperature)
    impls["nt_xent"] = lambda z, y: ct.nt_xent(z, temperature, normalize=True)
    return impls


def moco_formula(q, k, queue, temperature: float):
    """MoCo's loss as its code writes it: logits [q̂·k̂, q̂ queuêᵀ] / τ, cross entropy at 0."""
    import torch

    qn, kn, un = (torch.nn.functional.normalize(x, dim=1) for x in (q, k, queue))
    logits = torch.cat([(qn * kn).sum(1, keepdim=True), qn @ un.T], 1) / temperature
    return torch.nn.functional.cross_entropy(
        logits, torch.zeros(q.shape[0], dtype=torch.long, device=q.device))


def _moco_rows(args) -> list:
    """The MoCo rows (see the module notes)."""
    import torch

    import cupynce.torch as ct

    t, n, m, d = 0.2, args.moco_queries, args.moco_queue, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q0, k0 = (torch.randn(n, d, device="cuda", generator=g).to(torch.bfloat16)
              for _ in range(2))
    queue = torch.nn.functional.normalize(torch.randn(m, d, device="cuda", generator=g),
                                          dim=1).to(torch.bfloat16)
    compiled = torch.compile(moco_formula)
    impls = {
        "cupynce": lambda q, k: ct.info_nce(q, k, t, negatives=queue, in_batch_negatives=False,
                                           normalize=True),
        "eager": lambda q, k: moco_formula(q, k, queue, t),
        "compile": lambda q, k: compiled(q, k, queue, t),
    }
    q64, k64 = (x.double().requires_grad_() for x in (q0, k0))
    want = moco_formula(q64, k64, queue.double(), t)
    ref = (want.detach(), torch.autograd.grad(want, [q64, k64]))
    del q64, k64, want
    res = {}
    for name, fn in impls.items():
        q, k = (x.clone().requires_grad_() for x in (q0, k0))

        def step(fn=fn, q=q, k=k):
            loss = fn(q, k)
            return (loss.detach(),) + torch.autograd.grad(loss, [q, k])

        case = run_case(step, repeat=args.repeat, keep_result=True, catch_errors=True)
        out = case.pop("result", None)
        if case.get("median_ms"):
            case["loop_ms"] = time_cuda(step, repeat=args.repeat, burst=args.moco_loop)["median_ms"]
        if out is not None:
            case["loss_err"] = float(abs(out[0].double() - ref[0]) / abs(ref[0]))
            case["grad_err"] = max(float((x.double() - r).norm() / r.norm())
                                   for x, r in zip(out[1:], ref[1]))
        res[name] = case
        print("moco", name, {k: case.get(k) for k in ("median_ms", "peak_extra_bytes", "oom",
                                                     "loss_err", "grad_err", "error")},
              flush=True)
    gblock = torch.randn(n, m, device="cuda", generator=g).to(torch.bfloat16)
    res["products"] = run_case(lambda: (q0 @ queue.T, gblock @ queue), repeat=args.repeat)
    return [res]


def clip_formula(a, b, logit_scale, labels):
    """open_clip's loss with the same-label pairs (off the diagonal) masked out of both
    directions: the plain PyTorch a user writes."""
    import torch
    import torch.nn.functional as F

    a, b = F.normalize(a, dim=1), F.normalize(b, dim=1)
    logits = logit_scale.exp() * a @ b.T
    n = a.shape[0]
    mask = (labels[:, None] == labels[None, :]) & ~torch.eye(n, dtype=torch.bool,
                                                             device=a.device)
    logits = logits.masked_fill(mask, float("-inf"))
    target = torch.arange(n, device=a.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def _clip_rows(args) -> list:
    """The CLIP-with-labels rows (see the module notes): one dict of cases per size."""
    import torch

    import cupynce.torch as ct

    out = []
    for n in (int(s) for s in args.clip_sizes.split(",")):
        g = torch.Generator(device="cuda").manual_seed(2)
        a0, b0 = (torch.randn(n, args.dim, device="cuda", generator=g).to(torch.bfloat16)
                  for _ in range(2))
        labels = torch.arange(n, device="cuda") // 4
        ls0 = torch.tensor(2.0, device="cuda")
        compiled = torch.compile(clip_formula)
        impls = {
            "labels": lambda a, b, s: ct.clip_loss(a, b, s, labels=labels, normalize=True),
            "plain": lambda a, b, s: ct.clip_loss(a, b, s, normalize=True),
            "eager": lambda a, b, s: clip_formula(a, b, s, labels),
            "compile": lambda a, b, s: compiled(a, b, s, labels),
        }
        ref = None
        if n <= args.check_max:
            a64, b64, s64 = (x.double().requires_grad_() for x in (a0, b0, ls0))
            want = clip_formula(a64, b64, s64, labels)
            ref = (want.detach(), torch.autograd.grad(want, [a64, b64]))
            del a64, b64, s64, want
        res = {}
        for name, fn in impls.items():
            a, b, s = (x.clone().requires_grad_() for x in (a0, b0, ls0))

            def step(fn=fn, a=a, b=b, s=s):
                loss = fn(a, b, s)
                return (loss.detach(),) + torch.autograd.grad(loss, [a, b, s])

            case = run_case(step, repeat=args.repeat, keep_result=ref is not None,
                            catch_errors=True)
            got = case.pop("result", None)
            if got is not None and ref is not None and name != "plain":
                case["loss_err"] = float(abs(got[0].double() - ref[0]) / abs(ref[0]))
                case["grad_err"] = max(float((x.double() - r).norm() / r.norm())
                                       for x, r in zip(got[1:3], ref[1]))
            res[name] = case
            print("clip", n, name, {k: case.get(k) for k in ("median_ms", "peak_extra_bytes",
                                                            "oom", "loss_err", "grad_err",
                                                            "error")}, flush=True)
        out.append((n, res))
    return out


def _inputs(n: int, d: int, views: int = 4, seed: int = 0):
    """bf16 leaves: each class's ``views`` rows near a class centre (a SupCon batch); labels
    view-major, as the reference code's ``torch.cat(features.unbind(1))`` stacks them."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    classes = n // views
    centre = torch.randn(classes, d, device="cuda", generator=g)
    labels = torch.arange(classes, device="cuda").repeat(views)
    z = centre[labels] + 0.7 * torch.randn(n, d, device="cuda", generator=g)
    return z.to(torch.bfloat16), labels


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="16384,65536")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.1)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--check-max", type=int, default=16384)
    p.add_argument("--only", default="", help="comma-separated implementations (default all)")
    p.add_argument("--moco", action="store_true", help="the MoCo rows too")
    p.add_argument("--moco-only", action="store_true", help="the MoCo rows alone")
    p.add_argument("--moco-queries", type=int, default=4096)
    p.add_argument("--moco-queue", type=int, default=65536)
    p.add_argument("--moco-loop", type=int, default=20,
                   help="steps back to back in the MoCo rows' training-loop time")
    p.add_argument("--clip", action="store_true", help="the CLIP-with-labels rows too")
    p.add_argument("--clip-only", action="store_true", help="the CLIP rows alone")
    p.add_argument("--clip-sizes", default="16384,32768")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    info = device_info()
    header = device_header(info)
    print(header, flush=True)
    impls = _implementations(args.temperature)
    only = [s for s in args.only.split(",") if s]
    rows, raw = [], []
    skip_supcon = args.moco_only or args.clip_only
    for n in (() if skip_supcon else (int(s) for s in args.sizes.split(","))):
        z0, labels = _inputs(n, args.dim)
        ref = None
        if n <= args.check_max:
            z64 = z0.double().requires_grad_()
            loss64 = supcon_formula(z64, labels, args.temperature)
            ref = (loss64.detach(), torch.autograd.grad(loss64, [z64])[0])
            del z64, loss64
        res = {}
        for name, fn in impls.items():
            if fn is None or (only and name not in only):
                continue
            z = z0.clone().requires_grad_()

            def step(fn=fn, z=z):
                loss = fn(z, labels)
                (dz,) = torch.autograd.grad(loss, [z])
                return loss.detach(), dz

            case = run_case(step, repeat=args.repeat, keep_result=ref is not None,
                            catch_errors=True)
            out = case.pop("result", None)
            if out is not None and ref is not None:
                loss, dz = out
                case["loss_err"] = float(abs(loss.double() - ref[0]) / abs(ref[0]))
                case["grad_err"] = float((dz.double() - ref[1]).norm() / ref[1].norm())
            res[name] = case
            raw.append(dict(n=n, d=args.dim, impl=name, **{k: v for k, v in case.items()
                                                            if not k.startswith("_")}))
            print(name, n, {k: case.get(k) for k in ("median_ms", "peak_extra_bytes", "oom",
                                                     "loss_err", "grad_err", "error")},
                  flush=True)
            del z, out
        ours = res.get("cupynce", {})

        def cell(r):
            if not r:
                return "—", "—"
            if r.get("oom"):
                return "OOM", "—"
            return fmt_ms(r.get("median_ms")), fmt_mib(r.get("peak_extra_bytes"))

        def ratio(name):
            r = res.get(name, {})
            if r.get("median_ms") and ours.get("median_ms"):
                return fmt_ratio(r["median_ms"] / ours["median_ms"])
            return "—"

        err = (f"{ours['loss_err']:.1e} / {ours['grad_err']:.1e}" if "loss_err" in ours
               else "—")
        floor = res.get("nt_xent", {}).get("median_ms")
        rows.append([f"supcon {n}", *cell(ours), *cell(res.get("pml")), *cell(res.get("eager")),
                     *cell(res.get("compile")), ratio("pml"), ratio("eager"), ratio("compile"),
                     fmt_ms(floor) if floor else "—",
                     fmt_ratio(ours["median_ms"] / floor) if floor and ours.get("median_ms")
                     else "—", err])
    table = markdown_table(
        ["op, N", "cupynce ms", "MiB", "pml ms", "pml MiB", "eager ms", "eager MiB",
         "compile ms", "compile MiB", "pml ÷ cupynce", "eager ÷", "compile ÷",
         "nt_xent ms (floor)", "cupynce ÷ floor", "cupynce err loss / grad"], rows)
    parts = [table] if rows else []
    if args.clip or args.clip_only:
        clip_res = _clip_rows(args)

        def c3(r):
            return ("OOM", "—") if r.get("oom") else (fmt_ms(r.get("median_ms")),
                                                      fmt_mib(r.get("peak_extra_bytes")))

        def over(r, base):
            return (fmt_ratio(r["median_ms"] / base["median_ms"])
                    if r.get("median_ms") and base.get("median_ms") else "—")
        clip_table = markdown_table(
            ["CLIP with labels, N", "labels ms", "MiB", "plain ms", "plain MiB",
             "labels ÷ plain", "eager ms", "eager MiB", "compile ms", "compile MiB",
             "eager ÷ labels", "compile ÷ labels", "labels err loss / grad"],
            [[str(n), *c3(r["labels"]), *c3(r["plain"]), over(r["labels"], r["plain"]),
              *c3(r["eager"]), *c3(r["compile"]), over(r["eager"], r["labels"]),
              over(r["compile"], r["labels"]),
              f"{r['labels'].get('loss_err', float('nan')):.1e} / "
              f"{r['labels'].get('grad_err', float('nan')):.1e}"] for n, r in clip_res])
        parts.append(clip_table)
        raw.append(dict(clip={str(n): {k: {kk: vv for kk, vv in v.items()
                                          if not kk.startswith("_")}
                                      for k, v in r.items()} for n, r in clip_res}))
    if args.moco or args.moco_only:
        (res,) = _moco_rows(args)
        ours = res["cupynce"]

        def cell2(r):
            return ("OOM", "—") if r.get("oom") else (fmt_ms(r.get("median_ms")),
                                                      fmt_mib(r.get("peak_extra_bytes")))
        moco = markdown_table(
            ["MoCo, queries × queue", "cupynce ms", "MiB", "eager ms", "eager MiB",
             "compile ms", "compile MiB", "eager ÷ cupynce", "eager MiB ÷ cupynce MiB",
             "compile ÷", "loop ms: cupynce / eager / compile", "eager ÷ cupynce (loop)",
             "products ms (floor)", "cupynce ÷ floor", "cupynce err loss / grad",
             "eager err loss / grad"],
            [[f"{args.moco_queries} × {args.moco_queue}", *cell2(ours), *cell2(res["eager"]),
              *cell2(res["compile"]),
              fmt_ratio(res["eager"]["median_ms"] / ours["median_ms"])
              if res["eager"].get("median_ms") and ours.get("median_ms") else "—",
              fmt_ratio(res["eager"]["peak_extra_bytes"] / ours["peak_extra_bytes"])
              if res["eager"].get("peak_extra_bytes") and ours.get("peak_extra_bytes") else "—",
              fmt_ratio(res["compile"]["median_ms"] / ours["median_ms"])
              if res["compile"].get("median_ms") and ours.get("median_ms") else "—",
              " / ".join(fmt_ms(res[k].get("loop_ms")) for k in ("cupynce", "eager", "compile")),
              fmt_ratio(res["eager"]["loop_ms"] / ours["loop_ms"])
              if res["eager"].get("loop_ms") and ours.get("loop_ms") else "—",
              fmt_ms(res["products"].get("median_ms")),
              fmt_ratio(ours["median_ms"] / res["products"]["median_ms"])
              if ours.get("median_ms") and res["products"].get("median_ms") else "—",
              f"{ours.get('loss_err', float('nan')):.1e} / {ours.get('grad_err', float('nan')):.1e}",
              f"{res['eager'].get('loss_err', float('nan')):.1e} / "
              f"{res['eager'].get('grad_err', float('nan')):.1e}"]])
        parts.append(moco)
        raw.append(dict(moco={k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")}
                              for k, v in res.items()}))
    table = "\n\n".join(parts)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_variants.md").write_text(f"# bench_variants: {header}\n\n{table}\n")
        (out / "bench_variants.json").write_text(json.dumps(dict(device=info, rows=raw),
                                                            indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
