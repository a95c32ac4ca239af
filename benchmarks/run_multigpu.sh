#!/usr/bin/env bash
# The distributed losses on one host with several GPUs (NCCL, one process per GPU).
#
#   bash benchmarks/run_multigpu.sh tests     # the multi-GPU tests on 2 GPUs and on all of them
#   bash benchmarks/run_multigpu.sh largest   # the largest global batch, CLIP, every GPU
#   bash benchmarks/run_multigpu.sh scaling   # bench_multigpu.py on 1, 2, 4, 8 GPUs (as present),
#                                             # the all-gather schedule and the rings
#   bash benchmarks/run_multigpu.sh breakdown # N = 65536 on 1, 2, ... GPUs: where a rank's step
#                                             # goes (compute, NCCL, copies, idle, host), with
#                                             # an NCCL-only group and with gloo beside it
#   bash benchmarks/run_multigpu.sh host      # N = 65536 on 1 and every GPU (gloo beside NCCL):
#                                             # the host's costliest events a step
#   bash benchmarks/run_multigpu.sh cached    # sentence-transformers' cached MNRL across the
#                                             # GPUs at a global batch of 262144 (MiniLM), on
#                                             # 1, 2, ... GPUs (bench_grad_cache_multigpu.py)
#   bash benchmarks/run_multigpu.sh cached-profile # at 32768 on 1 and every GPU, then where a
#                                             # rank's cached step goes (--profile; at 262144
#                                             # torch.profiler's millions of events a step take
#                                             # longer than a run may)
#   bash benchmarks/run_multigpu.sh cached-cprofile # 131072 pairs a GPU on 1 and every GPU,
#                                             # one step more under cProfile alone (--cprofile)
#   bash benchmarks/run_multigpu.sh cached-noddp # 262144 on every GPU with and without DDP
#                                             # (--no-ddp: what DDP's machinery costs the step)
#
# The scaling and cached modes log the GPUs' clocks, power and temperature through each launch
# (clocks_<launch>.csv, summarised in clocks.md: benchmarks/gpu_clocks.py).
#
# Logs and JSON go to $OUT (default ./multigpu-out).  NVLink multicast stays off: a program that
# uses it can put a shared host's GPUs out of service.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-multigpu-out}
mkdir -p "$OUT"
G=$(nvidia-smi -L | wc -l)
devices() { seq -s, 0 $(($1 - 1)); }
counts() { for P in 1 2 4 8; do [ "$P" -le "$G" ] && echo "$P"; done; }
# clocks NAME CMD...: CMD with the GPUs' clocks, power and temperature logged every 0.5 s
# ($OUT/clocks_NAME.csv; benchmarks/gpu_clocks.py's summary appended to $OUT/clocks.md)
clocks() {
  local name=$1 smi reasons=clocks_event_reasons.active rc
  shift
  nvidia-smi --query-gpu=$reasons --format=csv >/dev/null 2>&1 \
    || reasons=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw,temperature.gpu,$reasons \
    --format=csv,noheader,nounits -lms 500 >"$OUT/clocks_$name.csv" 2>/dev/null &
  smi=$!
  "$@"
  rc=$?
  kill "$smi" 2>/dev/null
  wait "$smi" 2>/dev/null
  python benchmarks/gpu_clocks.py "$OUT/clocks_$name.csv" >>"$OUT/clocks.md" 2>&1
  return $rc
}
# sentence-transformers and its dependencies from ./.whl when present (run_gpu.sh's way)
wheels() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      >"$OUT/wheels.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
}

case "${1:-all}" in
tests | all)
  nvidia-smi topo -m >"$OUT/topo.txt" 2>&1
  for P in $(printf '%s\n' 2 "$G" | sort -un); do
    [ "$P" -le "$G" ] || continue
    echo "=== $P GPUs: $(date -u +%FT%TZ)" | tee -a "$OUT/tests.log"
    CUDA_VISIBLE_DEVICES=$(devices "$P") timeout 420 python -m pytest -q -rs -p no:cacheprovider \
      tests/distributed/test_torch_distributed.py tests/distributed/test_nccl_cupy.py \
      tests/integrations/test_integrations.py tests/torch/test_torch_cuda.py \
      tests/torch/test_torch_splade.py tests/ops/test_contrastive_kernels.py \
      tests/ops/test_splade_kernels.py \
      -k "nccl or second_gpu or two_gpus or gloo_two_ranks" 2>&1 | tee -a "$OUT/tests.log"
  done
  ;;&
largest | all)
  timeout 300 torchrun --standalone --nproc_per_node "$G" benchmarks/bench_multigpu.py \
    --ops clip_loss --sizes 1048576 4194304 --once --no-peers --json "$OUT/largest.json"
  ;;&
breakdown)
  # with an NCCL-only group (the agreement check read on the GPU), with gloo beside it, and
  # with gloo and the rings on the GPUs (config.ring_gpu: every plain op's)
  # (one GPU once: the 1-GPU step, the yardstick of each table)
  for run in nccl: cpu:gloo,cuda:nccl: cpu:gloo,cuda:nccl:--ring; do
    be=${run%:*}; extra=${run##*:}; files=()
    tag=$([ "$be" = nccl ] && echo nccl || echo gloo)${extra:+_ring}
    for P in $(counts); do
      f="$OUT/b${P}_$tag.json"
      [ "$P" = 1 ] && f="$OUT/b1.json" && [ -f "$f" ] && { files+=("$f"); continue; }
      timeout 300 torchrun --standalone --nproc_per_node "$P" benchmarks/bench_multigpu.py \
        --sizes 65536 --no-peers --breakdown --backend "$be" $extra --json "$f" && files+=("$f")
    done
    python benchmarks/bench_multigpu.py --report "${files[@]}" | tee "$OUT/breakdown_$tag.md"
  done
  ;;
host)
  # the host's events under the CPU profiler (gloo beside NCCL: the default group)
  files=()
  for P in $(printf '%s\n' 1 "$G" | sort -un); do
    timeout 300 torchrun --standalone --nproc_per_node "$P" benchmarks/bench_multigpu.py \
      --sizes 65536 --no-peers --host-profile --backend cpu:gloo,cuda:nccl \
      --json "$OUT/h$P.json" && files+=("$OUT/h$P.json")
  done
  python benchmarks/bench_multigpu.py --report "${files[@]}" | tee "$OUT/host.md"
  ;;
cached | cached-profile | cached-cprofile)
  wheels
  files=(); extra=(); Ps=$(counts); tag=cached
  [ "$1" = cached-profile ] && extra=(--profile) && Ps=$(printf '%s\n' 1 "$G" | sort -un) \
    && tag=cached_profile
  [ "$1" = cached-cprofile ] && extra=(--cprofile) && Ps=$(printf '%s\n' 1 "$G" | sort -un) \
    && tag=cached_cprofile
  for P in $Ps; do
    # (--cprofile: the same rows a GPU at every P, 131072: where a rank's step grows with P)
    N=262144 && [ "$1" = cached-cprofile ] && N=$((131072 * P))
    [ "$1" = cached-profile ] && N=32768
    clocks "${tag}$P" timeout 400 torchrun --standalone --nproc_per_node "$P" \
      benchmarks/bench_grad_cache_multigpu.py --global-batch "$N" "${extra[@]}" \
      --json "$OUT/${tag}$P.json" && files+=("$OUT/${tag}$P.json")
  done
  python benchmarks/bench_grad_cache_multigpu.py --report "${files[@]}" | tee "$OUT/$tag.md"
  ;;
cached-noddp)
  wheels
  files=()
  for extra in "" --no-ddp; do
    f="$OUT/cached_ddp$G${extra:+_off}.json"
    clocks "cached_ddp$G${extra:+_off}" timeout 280 torchrun --standalone \
      --nproc_per_node "$G" benchmarks/bench_grad_cache_multigpu.py --global-batch 262144 \
      $extra --json "$f" && files+=("$f")
  done
  python benchmarks/bench_grad_cache_multigpu.py --report "${files[@]}" | tee "$OUT/cached_noddp.md"
  ;;
scaling | all)
  # the group docs/distributed.md recommends (gloo beside NCCL): the all-gather schedule with
  # open_clip's formula beside it (scaling.md), then the rings (config.ring_gpu, cupynce alone;
  # scaling_ring.md), both against the same 1-GPU launch
  for extra in "" --ring; do
    files=(); tag=scaling${extra:+_ring}
    for P in $(counts); do
      f="$OUT/p$P${extra:+_ring}.json"
      [ "$P" = 1 ] && f="$OUT/p1.json" && [ -f "$f" ] && { files+=("$f"); continue; }
      clocks "p$P${extra:+_ring}" timeout 300 torchrun --standalone --nproc_per_node "$P" \
        benchmarks/bench_multigpu.py --backend cpu:gloo,cuda:nccl $extra ${extra:+--no-peers} \
        --json "$f" && files+=("$f")
    done
    python benchmarks/bench_multigpu.py --report "${files[@]}" | tee "$OUT/$tag.md"
  done
  ;;
esac
