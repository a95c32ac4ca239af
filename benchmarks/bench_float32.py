"""float32 forward + backward in each float32 precision ("fp32", "tf32", "3xtf32"), the time
beside the errors against float64 (issue 24).

Per op and N (D = 512 by default; the inputs and the step of ``bench_contrastive.py``): the
median time of the step in each precision (``cupynce.set_float32_precision`` around the step:
the default every entry point's ``precision=None`` takes), its peak extra memory, and the
relative errors of the loss and of the gradients, ``|L - L64| / |L64|`` and
``||g - g64|| / ||g64||`` (all gradients stacked), against cupynce's float64 path on the very
float32 inputs upcast.  PyTorch eager / torch.compile float32 times: run
``bench_contrastive.py --dtypes float32 --impls cupynce,eager,compile`` in the same session.

    python benchmarks/bench_float32.py --ops nt_xent,clip_loss --sizes 16384
"""
import argparse
import sys

import numpy as np

sys.path.insert(0, "benchmarks")
import bench_contrastive as B  # noqa: E402


def _flat(xp, grads):
    return xp.concatenate([g.astype(xp.float64).ravel() for g in grads if g is not None
                           and getattr(g, "size", 0) > 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default="nt_xent,clip_loss,siglip_loss,info_nce")
    ap.add_argument("--sizes", default="16384")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    import cupy as cp

    import cupynce
    from cupynce import config
    from cupynce.report.harness import run_case

    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("| op | N | precision | ms | MiB | loss rel. error | gradient rel. error |")
    print("|---|--:|---|--:|--:|--:|--:|")
    for op in args.ops.split(","):
        for n in map(int, args.sizes.split(",")):
            inputs = B.make_inputs(op, n, args.dim, np.dtype(np.float32))
            wide = tuple(x.astype(cp.float64) if x.dtype == cp.float32 else x for x in inputs)
            loss64, grads64 = B.cupynce_step(op, wide)()
            g64 = _flat(cp, grads64)
            l64 = float(loss64)
            del wide, grads64
            for mode in config.FLOAT32_PRECISIONS:
                step = B.cupynce_step(op, inputs)

                def run(step=step, mode=mode):
                    # (the global default: the entry points resolve precision=None to it)
                    prev = cupynce.get_float32_precision()
                    cupynce.set_float32_precision(mode)
                    try:
                        return step()
                    finally:
                        cupynce.set_float32_precision(prev)
                loss, grads = run()
                el = abs(float(loss) - l64) / abs(l64)
                eg = float(cp.linalg.norm(_flat(cp, grads) - g64) / cp.linalg.norm(g64))
                del loss, grads
                r = run_case(run, warmup=3, repeat=args.repeat, catch_errors=True)
                if "error" in r:
                    print(f"| {op} | {n} | {mode} | error: {r['error'][:80]} | | | |")
                    continue
                ms, mib = r["median_ms"], r["peak_extra_bytes"] / 2 ** 20
                print(f"| {op} | {n} | {mode} | {ms:.2f} | {mib:.0f} | {el:.1e} | {eg:.1e} |",
                      flush=True)
            del inputs, g64


if __name__ == "__main__":
    main()
