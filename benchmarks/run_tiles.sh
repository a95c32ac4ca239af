#!/usr/bin/env bash
# The 16-bit warp-specialised tiles' checks and measurements on one Hopper GPU (issue 23), in
# as few device calls as they fit (each stage's rough time on an H100 with a warm kernel cache
# in brackets; a fresh machine first spends ~80 s compiling the NVRTC modules):
#
#   bash benchmarks/run_tiles.sh tests    # test_gpu_wstile + test_side (-n 8: eight workers
#                                         # found the side branch's race, which one never
#                                         # showed) + compute-sanitizer memcheck / racecheck /
#                                         # synccheck on its stages                    [~3 min]
#   bash benchmarks/run_tiles.sh passes   # bench_tiles: each pass's GPU time, bf16 and fp16
#                                         #                                            [~1 min]
#   bash benchmarks/run_tiles.sh ratios   # bench_contrastive, cupynce against its cuBLAS
#                                         # products, bf16 and fp16, N = 8192, 16384  [~1 min]
#   bash benchmarks/run_tiles.sh table    # the README's same-run table: every column, bf16,
#                                         # N = 8192, 16384, 65536; CLIP 131072       [~6 min]
#                                         # (memeff's columns need memeff 0.3.1: a pure-Python
#                                         # wheel; offline, `pip install --no-deps` a downloaded one)
#
# Several stages: `bash benchmarks/run_tiles.sh tests passes`.  Logs and JSON go to $OUT
# (default ./tiles-out).  On the device tool, where at most 8 files come back, tar $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-tiles-out}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/device.txt"
T0=$(date +%s)
stamp() { echo "[$1: rc $2, $(( $(date +%s) - T0 )) s]"; }

for stage in "${@:-tests}"; do
  case "$stage" in
  tests)
    timeout 300 python -m pytest -q -rs -p no:cacheprovider -n 8 tests/engine/test_tiles_ws.py \
      tests/engine/test_side.py >"$OUT/test_tiles_ws.log" 2>&1
    stamp test_tiles_ws $?; tail -2 "$OUT/test_tiles_ws.log"
    for tool in memcheck racecheck synccheck; do
      timeout 120 compute-sanitizer --tool $tool python benchmarks/sanitize_case.py ws ws \
        >"$OUT/san_$tool.log" 2>&1
      stamp "$tool" $?; tail -1 "$OUT/san_$tool.log"
    done
    ;;
  passes)
    for dt in bfloat16 float16; do
      timeout 150 python benchmarks/bench_tiles.py --loops wstile --dtype $dt \
        >"$OUT/bench_tiles_$dt.log" 2>&1
      stamp "bench_tiles $dt" $?; cat "$OUT/bench_tiles_$dt.log"
    done
    ;;
  ratios)
    timeout 240 python benchmarks/bench_contrastive.py --ops nt_xent,clip_loss,siglip_loss,info_nce \
      --dtypes bfloat16,float16 --sizes 8192,16384 --dims 512 --impls cupynce,cublas --repeat 20 \
      --out "$OUT/bench_ratios.json" >"$OUT/bench_ratios.log" 2>&1
    stamp ratios $?; grep "^|  *[0-9]" "$OUT/bench_ratios.log"
    ;;
  table)
    timeout 480 python benchmarks/bench_contrastive.py --ops nt_xent,clip_loss,siglip_loss,info_nce \
      --dtypes bfloat16 --sizes 8192,16384,65536 --dims 512 --out "$OUT/bench_bf16.json" \
      >"$OUT/bench_bf16.log" 2>&1
    stamp table $?; grep "^|  *[0-9]" "$OUT/bench_bf16.log"
    timeout 120 python benchmarks/bench_contrastive.py --ops clip_loss --dtypes bfloat16 \
      --sizes 131072 --dims 512 --impls cupynce,cublas,memeff --out "$OUT/bench_131072.json" \
      >"$OUT/bench_131072.log" 2>&1
    stamp "CLIP 131072" $?; grep "^|  *[0-9]" "$OUT/bench_131072.log"
    ;;
  *)
    echo "unknown stage $stage (tests, passes, ratios, table)"; exit 2 ;;
  esac
done
