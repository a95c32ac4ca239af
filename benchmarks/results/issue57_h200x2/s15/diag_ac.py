"""Session 15 probe: which path moves under autocast on the GPU (check_autocast failed there).
Per op, each loss's and a-gradient's relative error against float64 on the bf16-rounded data:
single/global, autocast (float32 leaves) / bf16 leaves, tensor / real scalars.  Then the
TF32x3 split-K product's error at K = 65632 beside the unsplit one's and cuBLAS fp32's."""
import sys
import numpy as np
import torch
import torch.distributed as dist


def check_diag(rank, P):
    import cupynce.torch as ct
    D = "cuda"
    N, d = 40, 64
    gen = torch.Generator().manual_seed(41)
    A, Bm = ((torch.randn(N, d, generator=gen, dtype=torch.float64) / 4).to(D, torch.float32)
             for _ in range(2))
    S = (torch.randn(2, d, generator=gen, dtype=torch.float64) / 4).to(D, torch.float32)
    lab = torch.arange(N, device=D) % 3
    ops = {
        "nt_xent": (lambda x, y, s, t, **g: ct.nt_xent(torch.cat([x, y]), t, **g), (0.3,)),
        "info_nce": (lambda x, y, s, t, **g: ct.info_nce(x, y, t, negatives=s, **g), (0.2,)),
        "clip_loss": (lambda x, y, s, ls, **g: ct.clip_loss(x, y, ls, **g), (2.3,)),
        "siglip_loss": (lambda x, y, s, ls, lb, **g: ct.siglip_loss(x, y, ls, lb, **g),
                        (2.3, -10.0)),
        "supcon_loss": (lambda x, y, s, t, **g: ct.supcon_loss(x, lab, t, **g), (0.1,)),
        "nt_xent_pairs": (lambda x, y, s, t, **g: ct.nt_xent_pairs(x, lab, t, **g), (0.2,)),
    }

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return ((a - b).norm() / b.norm()).item()

    for name, (fn, vals) in ops.items():
        res = {}
        for key in ("f64", "single_ac", "single_bf_t", "single_bf_f", "glob_ac", "glob_bf_t",
                    "glob_bf_f"):
            ac = key.endswith("ac")
            dt = {True: torch.float32, False: torch.bfloat16}[ac]
            a, b, s = (x.to(dt) for x in (A, Bm, S))
            if key == "f64":
                a, b, s = (x.double() for x in (a, b, s))
            a, b, s = (x.clone().requires_grad_(True) for x in (a, b, s))
            sc = list(vals) if key.endswith("_f") or key == "f64" else \
                [torch.tensor(v, device=D, requires_grad=True) for v in vals]
            g = {"group": dist.group.WORLD} if key.startswith("glob") else {}
            with torch.autocast(D, dtype=torch.bfloat16, enabled=ac):
                loss = fn(a, b, s, *sc, **g)
            loss.backward(torch.tensor(0.7, device=D, dtype=loss.dtype))
            res[key] = (loss, a.grad)
        ref = res["f64"]
        print(name, " ".join(f"{k}: L {rel(v[0], ref[0]):.1e} g {rel(v[1], ref[1]):.1e}"
                             for k, v in res.items() if k != "f64"), flush=True)


def tf32_k():
    import cupy as cp
    import cupynce.config as cfg
    from cupynce._engine.gemm import tf32x3
    rng = np.random.default_rng(1)
    m, c, k = 300, 384, 65632
    a = cp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    b = cp.asarray(rng.standard_normal((c, k)).astype(np.float32))
    ref = cp.asnumpy(a).astype(np.float64) @ cp.asnumpy(b).astype(np.float64).T
    parts = tf32x3.split(b)
    whole = tf32x3.mm(tf32x3.padded(a), parts, cp.empty((m, c), np.float32))
    cfg.set(mm_k_splits=8)
    got = tf32x3.mm(tf32x3.padded(a), parts, cp.empty((m, c), np.float32), k_split=True)
    f32 = a @ b.T

    def rel(x):
        x = cp.asnumpy(x).astype(np.float64)
        return np.linalg.norm(x - ref) / np.linalg.norm(ref)
    print(f"K={k}: split {rel(got):.3e} whole {rel(whole):.3e} cublas fp32 {rel(f32):.3e}")


if __name__ == "__main__":  # (run from the repository root)
    sys.path[:0] = ["tests/distributed", "tests/_support", __file__.rsplit("/", 1)[0]]
    from test_torch_distributed import run_ranks
    if "tf32" in sys.argv:
        tf32_k()
    else:
        run_ranks(1, ["check_diag"], backend="nccl", device="cuda", module="diag_ac")
