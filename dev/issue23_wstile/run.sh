#!/usr/bin/env bash
# Issue 23 wstile prototype on the device (from the repo root; scratch/ must travel:
# carry ["scratch"]).  Logs to $OUT.  Typical ~3 min; every step has its own timeout.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/wstile_out}; mkdir -p "$OUT"
W=scratch/issue23/wstile
PY=python3
T0=$(date +%s)
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  nvcc --version | tail -n 1
  echo "== nvcc ptxas -v (sm_90a, -ftz=true as cupynce's NVRTC build)"
  timeout 60 nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -cubin -Xptxas -v -ftz=true \
    -Ikernels_src -o /tmp/wstile_nvcc.cubin $W/wstile_lse.cu 2>&1 \
    | grep -E "Compiling entry|Used|spill|warning|error|C75" | grep -v "Compile time"
  echo "== NVRTC (cupynce SM90A_OPTIONS) ptxas -v"
  timeout 60 $PY $W/run_wstile.py --compile-only 2>&1 \
    | grep -E "NVRTC|Compiling entry|Used|spill|warning|error|C75|Error"
} 2>&1 | tee "$OUT/compile.log"

echo "== checks + bench (driver; each phase a child process with a timeout)"
timeout 230 $PY $W/run_wstile.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/run.log"
echo "driver rc=${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"

# sanitizers on one small run (pp_s6 and pp_ar6; N = 512, 1024 and an odd 9-tile case)
for tool in memcheck synccheck racecheck; do
  left=$(( 235 - ($(date +%s) - T0) ))
  if [ $left -lt 20 ]; then echo "skip $tool: ${left} s left"; continue; fi
  [ $left -gt 60 ] && left=60
  echo "== compute-sanitizer --tool $tool (timeout ${left} s)"
  timeout $left compute-sanitizer --tool $tool --print-limit 20 $PY $W/run_wstile.py --sanitize \
    > "$OUT/san_$tool.log" 2>&1
  echo "rc=$?"; grep -E "SANITIZE-RUN|ERROR SUMMARY|RACECHECK SUMMARY|Error|Hazard|check " "$OUT/san_$tool.log" | head -n 25
done
echo "total $(( $(date +%s) - T0 )) s"
