"""Bit fingerprints of every op's outputs, to prove that a change gives the same bits.

Runs every op (nt_xent, info_nce with no / shared / per-query negatives, clip_loss with a real
and an array logit_scale, splade_pool) forward and backward over a grid of dtypes, reductions,
normalize, sizes (the small-product kernel, the cuBLAS path, blocked workspaces) and GPU paths
(tile kernels on the wgmma and mma.sync main loops, cuBLAS + row kernels), through the CuPy core
and through ``cupynce.torch``, and writes the SHA-256 of each output's bytes to a JSON file::

    python benchmarks/fingerprint.py --out before.json       # on the old tree
    python benchmarks/fingerprint.py --out after.json        # on the new tree
    python benchmarks/fingerprint.py --compare before.json after.json

Only the public API and the path switches are used, so the same script runs on both trees; a
switch is set in ``cupynce.config`` where the tree has it (issue 53), else looked up wherever
the tree keeps it (``cupynce._engine.tiles`` before, ``cupynce.contrastive`` before the layout
split).  Needs a GPU (CuPy); torch is optional.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
from typing import Any, Dict, List

import numpy as np

#: (module, attribute) homes of the path switches, newest first
SWITCH_HOMES = {
    "USE_TILES": ("cupynce._engine.tiles", "cupynce.contrastive"),
    "USE_WGMMA": ("cupynce._engine.tiles", "cupynce.contrastive"),
    "SYMMETRIC_LSE_MIN_ND": ("cupynce._engine.tiles", "cupynce.contrastive"),
    "USE_WS": ("cupynce._engine.splade", "cupynce.splade"),
    "USE_F16X3": ("cupynce._engine.products_tf32",),
}


#: the same switches as fields of ``cupynce.config`` (issue 53's one configuration)
CONFIG_FIELDS = {"USE_TILES": "tiles", "USE_WGMMA": "wgmma",
                 "SYMMETRIC_LSE_MIN_ND": "symmetric_lse_min_nd", "USE_WS": "splade_ws",
                 "USE_F16X3": "f16x3"}


def set_switch(name: str, value: Any) -> None:
    try:  # the engine's one configuration, where the tree has it
        config = importlib.import_module("cupynce.config")
    except ImportError:
        config = None
    if config is not None:
        config.set(**{CONFIG_FIELDS[name]: value})
        return
    for mod in SWITCH_HOMES[name]:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, name):
            setattr(m, name, value)
            return
    raise RuntimeError(f"no module holds the switch {name}")


def digest(x) -> str:
    import cupy as cp

    if x is None:
        return "None"
    if hasattr(x, "detach"):  # torch
        x = x.detach()
        if x.dtype.is_floating_point and x.element_size() == 2:
            import torch

            x = x.view(torch.int16)
        x = x.cpu().numpy()
    a = cp.asnumpy(x) if isinstance(x, cp.ndarray) else np.asarray(x)
    a = np.ascontiguousarray(a)
    return f"{a.dtype}{a.shape}:" + hashlib.sha256(a.view(np.uint8).tobytes()).hexdigest()[:24]


def _arrays(dtype, shapes, seed):
    import cupy as cp

    rng = np.random.default_rng(seed)
    out = []
    for sh in shapes:
        if sh is None:
            out.append(None)
            continue
        x = rng.standard_normal(sh).astype(np.float32) / np.sqrt(sh[-1])
        out.append(cp.asarray(x.astype(dtype)))
    return out


def contrastive_cases(dtypes) -> List[Dict[str, Any]]:
    cases = []
    for dtype in dtypes:
        for n, d in ((48, 32), (520, 64), (1030, 136)):
            for red in ("mean", "none"):
                for norm in (False, True):
                    for ws in (None, 64 * 1024):
                        base = dict(dtype=dtype, n=n, d=d, red=red, norm=norm, ws=ws)
                        cases.append(dict(base, op="nt_xent"))
                        for neg in (None, "shared", "paired"):
                            cases.append(dict(base, op="info_nce", neg=neg))
                        for ls in ("float", "array"):
                            cases.append(dict(base, op="clip_loss", ls=ls))
                            cases.append(dict(base, op="siglip_loss", ls=ls))
    return cases


def float32_cases() -> List[Dict[str, Any]]:
    """float32 at the sizes where the precision modes pick different products (the TF32x3 and
    F16x3 tiles from 4096 rows; CLIP / SigLIP from D = 512)."""
    cases = []
    for prec, f16 in (("auto", True), ("auto", False), ("3xtf32", True), ("tf32", True),
                      ("fp32", True)):
        for op, n, d in (("nt_xent", 4104, 64), ("nt_xent", 4096, 136), ("info_nce", 4096, 128),
                         ("clip_loss", 4100, 512), ("siglip_loss", 4096, 512),
                         ("clip_loss", 600, 96)):
            for ws in (None, 16 << 20):
                cases.append(dict(op=op, dtype=np.dtype(np.float32), n=n, d=d, red="mean",
                                  norm=False, ws=ws, neg=None, ls="array", prec=prec, f16=f16))
    return cases


def chooser_cases(dtypes) -> List[Dict[str, Any]]:
    """CLIP and NT-Xent where the chooser by cost (issue 53, item 6) keeps the scores:
    16-bit, D = 2048 (``config.keep_scores_min_dim``; NT-Xent's bounds lowered to it), fused (mean) and not (none), with the
    default workspace (the scores fit) and a small one (they do not: the tiles)."""
    return [dict(op=op, dtype=dtype, n=520, d=2048, red=red, norm=True, ws=ws, neg=None,
                 ls="array")
            for op in ("clip_loss", "nt_xent") for dtype in dtypes for red in ("mean", "none")
            for ws in (None, 256 * 1024)]


def global_cases(dtypes) -> List[Dict[str, Any]]:
    """The global losses on emulated ranks (one GPU, threads;
    tests/_support/emulated_ranks.py)."""
    cases = []
    for dtype in dtypes:
        for ranks in (2, 3):
            for op in ("nt_xent", "info_nce", "clip_loss", "siglip_loss"):
                for n, d in ((40, 32), (300, 64)):
                    cases.append(dict(op=op, dtype=dtype, ranks=ranks, n=n, d=d, red="mean",
                                      norm=True, ws=None, neg=None, ls="array"))
    return cases


def run_global(c) -> List[str]:
    import cupy as cp

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests"
                           / "_support"))
    import emulated_ranks

    def body(comm):
        return run_case(c, group=comm, seed_shift=comm.rank)

    outs = emulated_ranks.run(c["ranks"], body, device=cp.cuda.Device().id)
    return [h for rank_out in outs for h in rank_out]


def run_case(c, group=None, seed_shift: int = 0) -> List[str]:
    import cupy as cp

    import cupynce

    n, d, dt = c["n"], c["d"], c["dtype"]
    kw = dict(reduction=c["red"], normalize=c["norm"], workspace_bytes=c["ws"])
    if group is not None:
        kw["group"] = group
    if "prec" in c:
        set_switch("USE_F16X3", c["f16"])
        kw["precision"] = c["prec"]
    g = 0.75 if c["red"] != "none" else cp.asarray(
        np.random.default_rng(1).standard_normal(n).astype(np.float32))
    if c["op"] == "nt_xent":
        (z,) = _arrays(dt, [(n, d)], 11 + 100 * seed_shift)
        loss, ctx = cupynce.nt_xent_forward(z, 0.2, **kw)
        outs = [loss, *ctx.stats, cupynce.nt_xent_backward(ctx, g)]
        if group is None:
            outs.append(cupynce.nt_xent_backward_from_stats(z, ctx.stats[0], g, temperature=0.2,
                                                            **kw))
    elif c["op"] == "info_nce":
        neg = {None: None, "shared": (37, d), "paired": (n, 5, d)}[c["neg"]]
        q, k, ng = _arrays(dt, [(n, d), (n, d), neg], 12 + 100 * seed_shift)
        loss, ctx = cupynce.info_nce_forward(q, k, 0.1, negatives=ng, **kw)
        outs = [loss, *ctx.stats, *cupynce.info_nce_backward(ctx, g)]
        if group is None:
            outs += list(cupynce.info_nce_backward_from_stats(q, k, ng, ctx.stats[0], g,
                                                              temperature=0.1, **kw))
    elif c["op"] == "clip_loss":
        a, b = _arrays(dt, [(n, d), (n, d)], 13 + 100 * seed_shift)
        ls = 2.3 if c["ls"] == "float" else cp.asarray(2.3, cp.float32)
        loss, ctx = cupynce.clip_loss_forward(a, b, ls, **kw)
        outs = [loss, *ctx.stats, *cupynce.clip_loss_backward(ctx, g)]
        if group is None:
            outs += list(cupynce.clip_loss_backward_from_stats(a, b, ls, *ctx.stats, g, **kw))
    else:
        a, b = _arrays(dt, [(n, d), (n, d)], 15 + 100 * seed_shift)
        if c["ls"] == "float":
            ls, lb = 2.3, -10.0
        else:
            ls, lb = cp.asarray(2.3, cp.float32), cp.asarray(-10.0, cp.float32)
        loss, ctx = cupynce.siglip_loss_forward(a, b, ls, lb, **kw)
        outs = [loss, *ctx.stats, *cupynce.siglip_loss_backward(ctx, g)]
        if group is None:
            outs += list(cupynce.siglip_loss_backward_from_inputs(a, b, ls, lb, g, **kw))
    if "prec" in c:
        set_switch("USE_F16X3", True)
    return [digest(o) for o in outs]


def splade_cases(dtypes):
    cases = []
    for dtype in dtypes:
        for shape in ((2, 40, 16, 300), (3, 130, 24, 1001), (2, 70, 64, 4100)):
            for act in ("relu", "log1p_relu"):
                for mask in (False, True):
                    cases.append(dict(op="splade_pool", dtype=dtype, shape=shape, act=act,
                                      mask=mask))
    return cases


def run_splade(c) -> List[str]:
    import cupy as cp

    import cupynce

    b, l, d, v = c["shape"]
    x, w, bias = _arrays(c["dtype"], [(b, l, d), (v, d), (v,)], 14)
    mask = None
    if c["mask"]:
        mask = cp.asarray((np.random.default_rng(2).random((b, l)) < 0.7).astype(np.uint8))
        mask[0, :] = 0
    out, ctx = cupynce.splade_pool_forward(x, w, bias, mask, activation=c["act"])
    gout = cp.asarray(np.random.default_rng(3).standard_normal((b, v)).astype(out.dtype))
    grads = cupynce.splade_pool_backward(ctx, gout)
    return [digest(out), digest(ctx.stats[0]), *(digest(gr) for gr in grads)]


def torch_cases(dtypes):
    return [dict(op=op, dtype=dt, red=red, norm=norm) for dt in dtypes
            for op in ("nt_xent", "info_nce", "clip_loss", "splade_pool")
            for red in ("mean", "none") for norm in (False, True)]


def run_torch(c) -> List[str]:
    import torch

    import cupynce.torch as ct

    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "float64": torch.float64}[np.dtype(c["dtype"]).name]
    gen = torch.Generator(device="cuda").manual_seed(5)

    def leaf(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) / shape[-1] ** 0.5).to(
            tdt).requires_grad_()

    kw = dict(reduction=c["red"], normalize=c["norm"])
    if c["op"] == "nt_xent":
        leaves = [leaf(512, 64)]
        loss = ct.nt_xent(leaves[0], 0.2, **kw)
    elif c["op"] == "info_nce":
        leaves = [leaf(256, 64), leaf(256, 64), leaf(40, 64)]
        loss = ct.info_nce(*leaves[:2], 0.1, negatives=leaves[2], **kw)
    elif c["op"] == "clip_loss":
        leaves = [leaf(256, 64), leaf(256, 64),
                  torch.tensor(2.3, device="cuda", requires_grad=True)]
        loss = ct.clip_loss(*leaves, **kw)
    else:
        if c["norm"]:
            return ["n/a"]
        leaves = [leaf(2, 70, 64), leaf(4100, 64), leaf(4100)]
        loss = ct.splade_pool(*leaves, activation="log1p_relu")
        loss = loss.float().square().sum() if c["red"] == "mean" else loss.float().sum()
    gl = torch.ones_like(loss) * 0.5 if loss.dim() == 0 else \
        torch.linspace(-1, 1, loss.numel(), device="cuda", dtype=loss.dtype)
    grads = torch.autograd.grad(loss, leaves, gl)
    return [digest(loss), *(digest(g) for g in grads)]


def key(c) -> str:
    return " ".join(f"{k}={np.dtype(v).name if k == 'dtype' else v}" for k, v in c.items())


def fingerprint() -> Dict[str, Any]:
    import cupy as cp

    import cupynce

    try:
        import ml_dtypes

        half = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
    except ImportError:  # pragma: no cover
        half = [np.dtype(np.float16)]
    full = [np.dtype(np.float32), np.dtype(np.float64)]
    cc = cp.cuda.Device().compute_capability
    paths = [("cublas", dict(USE_TILES=False))]
    paths.append(("tiles-mma.sync", dict(USE_TILES=True, USE_WGMMA=False)))
    if cc == "90":
        paths.append(("tiles-wgmma", dict(USE_TILES=True, USE_WGMMA=True)))
        paths.append(("tiles-wgmma-sym", dict(USE_TILES=True, USE_WGMMA=True,
                                              SYMMETRIC_LSE_MIN_ND=0)))
    out: Dict[str, Any] = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                           "cupynce": cupynce.__version__, "cases": {}}
    defaults = dict(USE_TILES=None, USE_WGMMA=True, SYMMETRIC_LSE_MIN_ND=16384 * 512)
    for pname, sw in paths:
        for k, v in {**defaults, **sw}.items():
            set_switch(k, v)
        dts = full + half if pname == "cublas" else half
        for c in contrastive_cases(dts):
            if pname != "cublas" and c["d"] % 8:
                continue
            out["cases"][f"{pname} {key(c)}"] = run_case(c)
        for ws in ((True, False) if pname == "tiles-wgmma" else (False,)):
            set_switch("USE_WS", ws)
            for c in splade_cases(dts):
                out["cases"][f"{pname} ws={ws} {key(c)}"] = run_splade(c)
        set_switch("USE_WS", True)
    for k, v in defaults.items():
        set_switch(k, v)
    for c in float32_cases():
        out["cases"][f"float32 {key(c)}"] = run_case(c)
    from cupynce import config  # (the chooser's cases exist from issue 53 on)

    # (NT-Xent keeps its scores from D = 4096 and N · D = 2^26: at these sizes by the switches)
    with config.override(nt_xent_keep_min_dim=2048, nt_xent_keep_min_nd=0):
        for c in chooser_cases(half):
            out["cases"][f"chooser {key(c)}"] = run_case(c)
    for c in global_cases([np.dtype(np.float32)] + half):
        out["cases"][f"global {key(c)}"] = run_global(c)
    try:
        import torch

        if torch.cuda.is_available():
            for c in torch_cases(full + half):
                out["cases"][f"torch {key(c)}"] = run_torch(c)
    except ImportError:
        pass
    return out


def compare(a_path: str, b_path: str) -> int:
    a = json.load(open(a_path))["cases"]
    b = json.load(open(b_path))["cases"]
    missing = sorted(set(a) ^ set(b))
    diff = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    print(f"{len(a)} / {len(b)} cases; {len(set(a) & set(b))} in both; "
          f"{len(diff)} differ; {len(missing)} in one only")
    for k in diff[:50]:
        print("DIFF", k, a[k], b[k])
    for k in missing[:20]:
        print("ONLY", "before" if k in a else "after", k)
    return 1 if diff or missing else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the fingerprints here (JSON)")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    doc = fingerprint()
    text = json.dumps(doc, indent=1, sort_keys=True)
    if args.out:
        open(args.out, "w").write(text)
    print(f"{len(doc['cases'])} cases on {doc['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
