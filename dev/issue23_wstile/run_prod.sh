#!/usr/bin/env bash
# Issue 23, production warp-specialised tiles (kernels_src/tiles_ws.cu) on the device.
# From /work/main's copy with the worktree carried (carry ["scratch"]):
#     bash scratch/wt_ws/dev/issue23_wstile/run_prod.sh
# (or from the worktree root: bash dev/issue23_wstile/run_prod.sh).  Logs to $OUT.  Every step
# has its own timeout under one deadline (TOTAL_S, default 530 s):
#   1. device, NVRTC builds of every kernel file in parallel (+ ptxas -v of tiles_ws.cu)
#   2. smoke: each stage once, new kernel vs the cp.async wgmma loop (watchdog)
#   3. in parallel: tests/test_gpu_wstile.py (2 shards), test_gpu_contrastive.py (2 shards),
#      test_gpu_siglip.py, compute-sanitizer memcheck / racecheck / synccheck on
#      benchmarks/sanitize_case.py ws ws
#   4. bench_contrastive (nt_xent, clip_loss, siglip_loss, info_nce; bf16; 8192, 16384, 65536;
#      D = 512) with the new kernels (cupynce, cublas), then CUPYNCE_WSTILE=0 (cupynce), then
#      bench_tiles at N = 16384 (wstile, wgmma)
set -u
cd "$(dirname "$0")/../.."  # the worktree root
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/wsprod_out}; mkdir -p "$OUT"
PY=${PY:-$(command -v python || command -v python3)}
T0=$(date +%s)
TOTAL_S=${TOTAL_S:-530}
left() { echo $(( TOTAL_S - ($(date +%s) - T0) )); }
# timeout for a step: its own cap, or what is left before the deadline less `reserve`
cap() { local want=$1 reserve=${2:-0} l; l=$(( $(left) - reserve )); [ $l -lt $want ] && want=$l; [ $want -lt 5 ] && want=5; echo $want; }
say() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

say "device"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
git log --oneline -1 2>/dev/null | cut -c1-120
$PY -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"

say "NVRTC builds (parallel; the shards below then load from the cache)"
for f in tiles.cu tiles_ws.cu contrastive.cu blas.cu splade.cu splade_tiles.cu splade_wgmma.cu; do
  (timeout "$(cap 150 380)" $PY -c "
import time; t=time.time()
from cupynce._engine import kernels
kernels._loader('$f')()
print('$f built/loaded in %.0f s' % (time.time() - t))" > "$OUT/build_$f.log" 2>&1
   echo "rc=$?" >> "$OUT/build_$f.log") &
done
(timeout "$(cap 150 380)" $PY dev/issue23_wstile/smoke_prod.py --build > "$OUT/ptxas_ws.log" 2>&1) &
wait
cat "$OUT"/build_*.log | grep -v "^rc=0"
cat "$OUT/ptxas_ws.log"

say "smoke: every stage, new vs old loop"
timeout "$(cap 90 340)" $PY dev/issue23_wstile/smoke_prod.py > "$OUT/smoke.log" 2>&1
echo "smoke rc=$?"; cat "$OUT/smoke.log"

say "tests and sanitizers in parallel"
TT=$(cap 190 270)
PT="-v -p no:cacheprovider -rf --durations=8"  # (-v: a killed shard still shows its results)
run_tests() {  # name, pytest args...
  local name=$1; shift
  (timeout "$TT" $PY -m pytest $PT "$@" > "$OUT/test_$name.log" 2>&1; echo "rc=$?" >> "$OUT/test_$name.log") &
}
for tool in memcheck racecheck synccheck; do
  (timeout "$TT" compute-sanitizer --tool $tool --print-limit 20 $PY benchmarks/sanitize_case.py ws ws \
     > "$OUT/san_$tool.log" 2>&1; echo "rc=$?" >> "$OUT/san_$tool.log") &
done
run_tests ws1 tests/test_gpu_wstile.py -k "ops_against or siglip_against or ops_large"
run_tests ws2 tests/test_gpu_wstile.py -k "not (ops_against or siglip_against or ops_large)"
run_tests contrastive1 tests/test_gpu_contrastive.py -k "tiles or tile_ or symmetric or wgmma"
run_tests contrastive2 tests/test_gpu_contrastive.py -k "not (tiles or tile_ or symmetric or wgmma)"
run_tests siglip tests/test_gpu_siglip.py
wait
for f in "$OUT"/test_*.log; do
  echo "-- $(basename "$f"): $(grep -c " PASSED" "$f") passed, $(grep -c " FAILED" "$f") failed, $(grep -c " ERROR" "$f") errors, $(grep -c " SKIPPED" "$f") skipped; $(tail -1 "$f")"
  grep -E " (FAILED|ERROR)" "$f" | grep "::" | cut -c1-200 | head -25
  grep -E "^(E  |FAILED)" "$f" | cut -c1-200 | head -40
done
for tool in memcheck racecheck synccheck; do
  echo "-- $tool"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|Hazard|^ok|Traceback|rc=" "$OUT/san_$tool.log" | head -12
done

say "bench_contrastive: new kernels (cupynce, cublas)"
BA="--ops nt_xent,clip_loss,siglip_loss,info_nce --dtypes bfloat16 --sizes 8192,16384,65536 --dims 512"
timeout "$(cap 140 130)" $PY benchmarks/bench_contrastive.py $BA --impls cupynce,cublas \
  --out "$OUT/bench_ws.json" > "$OUT/bench_ws.log" 2>&1
echo "rc=$?"; grep -E "^\[|cupynce|cuBLAS|^\| " "$OUT/bench_ws.log" | cut -c1-150

say "bench_contrastive: CUPYNCE_WSTILE=0 (the cp.async wgmma loop; cupynce)"
CUPYNCE_WSTILE=0 timeout "$(cap 90 45)" $PY benchmarks/bench_contrastive.py $BA --impls cupynce \
  --out "$OUT/bench_old.json" > "$OUT/bench_old.log" 2>&1
echo "rc=$?"; grep -E "^\[|cupynce|^\| " "$OUT/bench_old.log" | cut -c1-150

say "bench_tiles N = 16384, D = 512"
timeout "$(cap 60 0)" $PY benchmarks/bench_tiles.py --n 16384 --d 512 --loops wstile,wgmma \
  > "$OUT/bench_tiles.log" 2>&1
echo "rc=$?"; cat "$OUT/bench_tiles.log"
say "done"
