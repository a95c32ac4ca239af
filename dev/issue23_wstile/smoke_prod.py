"""Issue 23 device smoke run of the production warp-specialised kernels (kernels_src/tiles_ws.cu):

    python dev/issue23_wstile/smoke_prod.py            # from the repository root, PYTHONPATH=.
    python dev/issue23_wstile/smoke_prod.py --build    # NVRTC build + ptxas -v of tiles_ws.cu

Prints each cpn_wstile kernel's registers / local / static shared memory, then runs every stage
once per shape with the new kernel and with the cp.async wgmma loop (tests/test_gpu_wstile.py's
``_stage_outputs``) and reports the ring used, whether the new kernel ran, and whether the
outputs agree.  A watchdog thread exits with status 3 when one stage takes over WATCHDOG_S
seconds (a deadlocked kernel), so the caller's timeout is not the only guard.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
WATCHDOG_S = 40.0
_deadline = [None]


def _watchdog():
    while True:
        time.sleep(1.0)
        if _deadline[0] is not None and time.time() > _deadline[0]:
            print(f"WATCHDOG: a stage ran over {WATCHDOG_S:.0f} s (deadlock?): exiting 3",
                  flush=True)
            os._exit(3)


def build():
    from cupy.cuda import nvrtc

    from cupynce._engine import kernels as K

    src = K.read_source("tiles_ws.cu")
    prog = nvrtc.createProgram(src, "tiles_ws.cu", [], [])
    t0 = time.time()
    nvrtc.compileProgram(prog, list(K.SM90A_OPTIONS) + ["--gpu-architecture=sm_90a",
                                                          "--ptxas-options=-v"])
    print(f"NVRTC {nvrtc.getVersion()} tiles_ws.cu sm_90a ptxas -v ({time.time() - t0:.0f} s):")
    for line in nvrtc.getProgramLog(prog).splitlines():
        if any(k in line for k in ("Compiling entry", "Used", "spill", "C75", "warning")):
            print("  " + line.strip())
    nvrtc.destroyProgram(prog)


def main():
    if "--build" in sys.argv:
        build()
        return
    import cupy as cp

    import test_gpu_wstile as T
    from cupynce._engine import kernels, tiles

    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    tiles.USE_TILES, tiles.USE_WGMMA, tiles.USE_WSTILE = True, True, True
    print("wstile available:", tiles.wstile())
    for stage in sorted(tiles.WS_STAGES):
        k = kernels.get_kernel(tiles.WS_FILE, f"wstile_{stage}", T.BF16)
        a = k.attributes
        print(f"  cpn_wstile_{stage}_bf16: {a['num_regs']} regs (launch cap), "
              f"{a['local_size_bytes']} B local, {a['shared_size_bytes']} B static smem; "
              f"ring D=512 {tiles.ws_ring(stage, 512, a['shared_size_bytes'], 232448)}")
    threading.Thread(target=_watchdog, daemon=True).start()
    log = []
    real = tiles.ws_launch

    def spy(stage, *args):
        ok = real(stage, *args)
        log.append((stage, ok))
        return ok

    tiles.ws_launch = spy
    bad = 0
    for stage in T.ALL_STAGES:
        for n, d in ((300, 136), (1030, 512), (2048, 64)):
            n += n % 2
            log.clear()
            _deadline[0] = time.time() + WATCHDOG_S
            t0 = time.time()
            try:
                new = T._stage_outputs(stage, T.BF16, n, d, 1)
                cp.cuda.Device().synchronize()
                tiles.USE_WSTILE = False
                old = T._stage_outputs(stage, T.BF16, n, d, 1)
                tiles.USE_WSTILE = True
                T._same_outputs(new, old, f"{stage} n={n} d={d}")
                status = "OK"
            except Exception as exc:  # noqa: BLE001 - reported, the smoke run goes on
                tiles.USE_WSTILE = True
                status = f"FAIL {type(exc).__name__}: {str(exc)[:300]}"
                bad += 1
            _deadline[0] = None
            print(f"  {stage:9s} n={n:5d} d={d:4d} new kernel ran: {log}  {status}  "
                  f"({time.time() - t0:.2f} s)", flush=True)
    print("SMOKE", "OK" if not bad else f"{bad} FAILED")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
