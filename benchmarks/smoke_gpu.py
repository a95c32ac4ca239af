"""Quick GPU smoke check: every op x dtype x reduction x normalize against the float64 oracle."""
import sys
import numpy as np
import cupy as cp
import ml_dtypes
import cupynce as c
from cupynce import reference as R

rng = np.random.default_rng(0)


def err(x, y):
    x = np.asarray(cp.asnumpy(x) if isinstance(x, cp.ndarray) else x, np.float64)
    y = np.asarray(y, np.float64)
    return float(np.linalg.norm((x - y).ravel()) / max(np.linalg.norm(y.ravel()), 1e-30))


worst = {}
for dt in [np.float64, np.float32, np.float16, ml_dtypes.bfloat16]:
    for red in ["mean", "sum", "none"]:
        for nz in [False, True]:
            for ws in [None, 3000]:
                z = rng.standard_normal((42, 33)).astype(dt)
                g = rng.standard_normal(42) if red == "none" else 0.7
                gd = cp.asarray(g) if red == "none" else g
                l, ctx = c.nt_xent_forward(cp.asarray(z), 0.3, reduction=red, normalize=nz, workspace_bytes=ws)
                dz = c.nt_xent_backward(ctx, gd)
                rl, (rdz,) = R.nt_xent(z, 0.3, reduction=red, normalize=nz, grad_loss=g)
                e = [err(l, rl), err(dz, rdz)]
                q = rng.standard_normal((41, 33)).astype(dt); k = rng.standard_normal((41, 33)).astype(dt)
                g = rng.standard_normal(41) if red == "none" else 0.7
                gd = cp.asarray(g) if red == "none" else g
                for neg in [None, rng.standard_normal((5, 33)).astype(dt), rng.standard_normal((41, 3, 33)).astype(dt)]:
                    l2, c2 = c.info_nce_forward(cp.asarray(q), cp.asarray(k), 0.2, negatives=None if neg is None else cp.asarray(neg), reduction=red, normalize=nz, workspace_bytes=ws)
                    gr = c.info_nce_backward(c2, gd)
                    rl2, rg = R.info_nce(q, k, 0.2, negatives=neg, reduction=red, normalize=nz, grad_loss=g)
                    e += [err(l2, rl2)] + [err(x, y) for x, y in zip(gr, rg) if y is not None]
                l3, c3 = c.clip_loss_forward(cp.asarray(q), cp.asarray(k), cp.asarray(np.float32(np.log(1 / 0.07))), reduction=red, normalize=nz, workspace_bytes=ws)
                gr3 = c.clip_loss_backward(c3, gd)
                rl3, rg3 = R.clip_loss(q, k, np.log(1 / 0.07), reduction=red, normalize=nz, grad_loss=g)
                e += [err(l3, rl3)] + [err(x, y) for x, y in zip(gr3, rg3)]
                key = np.dtype(dt).name
                worst[key] = max(worst.get(key, 0), max(e))
                print(key, red, nz, ws, "max rel err %.2e" % max(e), flush=True)
print(worst)
