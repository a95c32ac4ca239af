#!/usr/bin/env bash
# The GPU test suite, compute-sanitizer and the SPLADE / variants benchmarks on one GPU, on the
# checkout (PYTHONPATH, CUPYNCE_TEST_CHECKOUT=1), e.g. on a lent machine with no network:
#
#   bash benchmarks/run_gpu.sh suite1     # tests/ops, engine, distributed (~8 min on an H200)
#   bash benchmarks/run_gpu.sh suite2     # tests/torch, integrations, packaging, report (~4 min
#                                         # warm, over 5 min on a fresh machine)
#   bash benchmarks/run_gpu.sh sanitize   # memcheck + racecheck over benchmarks/sanitize_case.py
#   bash benchmarks/run_gpu.sh splade     # the SPLADE GPU tests, bench_splade --quick (fused
#                                         # and cuBLAS paths), bench_splade_argmax
#   bash benchmarks/run_gpu.sh variants   # bench_variants (SupCon, MoCo, CLIP with labels)
#   bash benchmarks/run_gpu.sh splade-bench # bench_splade on every shape and density, with
#                                         # eager, torch.compile and Sparton (if installed)
#   bash benchmarks/run_gpu.sh splade-gemm # bench_splade, cupynce against the GEMM alone, on
#                                         # issue 56's four shapes (no peers: minutes)
#   bash benchmarks/run_gpu.sh sparse     # bench_sparse_encoder: a SparseEncoder's training
#                                         # step, library vs cupynce, uncached and cached
#   bash benchmarks/run_gpu.sh sparse-largest # its largest batch that fits, each (up to 4096)
#   bash benchmarks/run_gpu.sh share     # bench_distributed: a rank's share of P = 4 and 8 at
#                                         # N = 65536 on one GPU, its GPU time beside the
#                                         # host's time to issue it, and its kernels
#                                         # against 1/P of the single op's (issue 57)
#   bash benchmarks/run_gpu.sh share-host # the same at P = 8 (no peers), then the Python
#                                         # functions of most host time issuing each share
#   bash benchmarks/run_gpu.sh ncu-splade # Nsight Compute over SPLADE's backward kernels at
#                                         # (32, 256, 768, 30522), 1 % and 50 % density
#
# Several modes run in turn: bash benchmarks/run_gpu.sh suite1 sanitize.  The comparison
# libraries the integration tests import (open_clip_torch, lightly, pytorch-metric-learning,
# sentence-transformers at the test extra's versions) are taken from wheels in ./.whl when
# present (pip download ... -d .whl on a machine with a network), installed to /tmp/site.
# Logs go to $OUT (default ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    >"$OUT/wheels.log" 2>&1 || echo "wheels: install failed (see $OUT/wheels.log)"
  SITE=/tmp/site
fi
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}" CUPYNCE_TEST_CHECKOUT=1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
pytest() { python -m pytest -p no:cacheprovider -q -n 16 --maxprocesses=16 "$@"; }

for mode in "${@:-suite1}"; do
  echo "=== $mode $(date -u +%FT%TZ)"
  case $mode in
  suite1) pytest tests/ops tests/engine tests/distributed 2>&1 | tee "$OUT/suite1.log" | tail -15 ;;
  suite2) pytest tests/torch tests/integrations tests/packaging tests/report 2>&1 \
            | tee "$OUT/suite2.log" | tail -15 ;;
  sanitize)
    # racecheck on the tile kernels only: it stops partway through the "blocks" half
    # (docs/decisions.md); memcheck on everything
    for args in "memcheck wg" "memcheck ws" "memcheck mma" "racecheck wg tiles" \
                "racecheck mma tiles" "racecheck ws ws" "racecheck wg splade" \
                "memcheck ws ksplit" "racecheck ws ksplit0"; do
      set -- $args
      log="$OUT/san_$1_$2_${3:-all}.log"
      compute-sanitizer --tool "$1" python benchmarks/sanitize_case.py "$2" ${3:-} >"$log" 2>&1
      echo "$args: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
    done ;;
  splade)
    pytest tests/ops/test_splade.py tests/ops/test_splade_fused.py tests/ops/test_splade_kernels.py \
      tests/torch/test_torch_splade.py 2>&1 | tee "$OUT/splade_tests.log" | tail -5
    python benchmarks/bench_splade.py --quick --out "$OUT/splade.json" 2>&1 | tail -8
    CUPYNCE_TILES=0 python benchmarks/bench_splade.py --quick --impls --out "$OUT/splade_cublas.json" \
      2>&1 | tail -6
    python benchmarks/bench_splade_argmax.py --out "$OUT/argmax" 2>&1 | tail -6 ;;
  splade-bench) python benchmarks/bench_splade.py --out "$OUT/bench_splade.json" 2>&1 \
                  | tee "$OUT/bench_splade.log" | tail -12 ;;
  splade-gemm) python benchmarks/bench_splade.py --impls --shapes 0 1 2 4 \
                 --out "$OUT/splade_gemm.json" 2>&1 | tee "$OUT/splade_gemm.log" | tail -14 ;;
  sparse) python benchmarks/bench_sparse_encoder.py --out "$OUT" 2>&1 | tail -12 ;;
  sparse-largest) python benchmarks/bench_sparse_encoder.py --sizes 128 --largest --largest-max 4096 \
                    --out "$OUT" --name bench_sparse_encoder_largest 2>&1 | tail -14 ;;
  ncu-splade)
    for dens in 0.01 0.5; do
      ncu --kernel-name regex:'splade_(dw|dx|count|place|scan)' --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --csv python -c "
import sys; sys.path.insert(0, 'benchmarks')
import cupynce, bench_splade as S
x, w, b, m, g = S.make_inputs(32, 256, 768, 30522, $dens)
out, ctx = cupynce.splade_pool_forward(x, w, b, m)
cupynce.splade_pool_backward(ctx, g)" >"$OUT/ncu_splade_$dens.csv" 2>&1
      echo "density $dens: rc=$? ($OUT/ncu_splade_$dens.csv)"
    done ;;
  share) for P in 4 8; do
           python benchmarks/bench_distributed.py --P $P --sizes 65536 --kernels 2>&1 \
             | tee "$OUT/share_p$P.log" | tail -8
         done ;;
  share-host) python benchmarks/bench_distributed.py --P 8 --sizes 65536 --no-peers --cprofile \
                2>&1 | tee "$OUT/share_host_p8.log" | grep -A3 "cupynce / " ;;
  variants) python benchmarks/bench_variants.py --repeat 5 --moco --clip --out "$OUT/variants" \
              2>&1 | tail -20 ;;
  *) echo "unknown mode: $mode" ;;
  esac
done
