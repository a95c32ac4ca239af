#!/usr/bin/env bash
# A same-run A/B of two source trees on one GPU, for a change that must alter no bit and no
# time (issue 53's re-layout): this tree ("after") against BEFORE (a copy of the old tree,
# e.g. `git archive <commit> | tar -x -C before`):
#
#   BEFORE=path/to/old/tree bash benchmarks/run_ab.sh fingerprint bench
#
#   fingerprint  benchmarks/fingerprint.py on this tree, compared with BASELINE (a saved JSON,
#                default: BEFORE's run, made here)       [~2-3 min each, NVRTC included]
#   bench        bench_contrastive.py --impls cupynce on both trees, alternating
#                before / after / before / after (the second pair shows the noise): NT-Xent,
#                CLIP, SigLIP, InfoNCE; bf16 and float32; N = 1024, 4096, 16384; D = 512;
#                then the median of each case per tree and after / before        [~4 min]
#   splade       bench_splade.py --quick --impls (cupynce and the GEMM alone: fwd, bwd and
#                fwd + bwd at 1 % and 50 % density, (32, 256, 768, 30522) bf16) on both trees,
#                alternating, with the fused forward and with CUPYNCE_TILES=0 (the cuBLAS
#                tiles); the JSON of each run in $OUT                            [~3 min]
#   torch        bench_torch_overhead.py (cupynce.torch, the CuPy core, the autograd floor;
#                CLIP and NT-Xent, bf16, N = 256, 1024) on both trees, alternating: the host
#                time a call costs                                              [~2 min]
#
# Logs and JSON go to $OUT (default ./ab-out); the CuPy kernel cache to $TMPDIR/cupynce_ab_cache
# (outside $OUT: a lent machine sends back a limited count of files)
# (both trees compile the same pasted sources: they share it).
set -uo pipefail
cd "$(dirname "$0")/.."
AFTER=$PWD
BEFORE=${BEFORE:+$(cd "$BEFORE" && pwd)}
if [ -z "$BEFORE" ] && { [ -z "${BASELINE:-}" ] || [[ " $* " == *" bench "* ]]; }; then
  echo "set BEFORE to the old tree (BASELINE alone serves the fingerprint stage)"; exit 2
fi
OUT=$(mkdir -p "${OUT:-ab-out}" && cd "${OUT:-ab-out}" && pwd)
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/cupynce_ab_cache}
nvidia-smi -L | tee "$OUT/device.txt"
T0=$(date +%s)
stamp() { echo "[$1: rc $2, $(( $(date +%s) - T0 )) s]"; }
in_tree() { (cd "$1" && shift && PYTHONPATH="$PWD" "$@"); }

for stage in "$@"; do
  case "$stage" in
  fingerprint)
    base=${BASELINE:-}
    if [ -z "$base" ]; then
      in_tree "$BEFORE" python benchmarks/fingerprint.py --out "$OUT/fingerprint_before.json" \
        >"$OUT/fingerprint_before.log" 2>&1
      stamp fingerprint_before $?; base=$OUT/fingerprint_before.json
    fi
    in_tree "$AFTER" python -W error::DeprecationWarning benchmarks/fingerprint.py \
      --out "$OUT/fingerprint_after.json" >"$OUT/fingerprint_after.log" 2>&1
    stamp fingerprint_after $?; tail -1 "$OUT/fingerprint_after.log"
    python benchmarks/fingerprint.py --compare "$base" "$OUT/fingerprint_after.json" \
      >"$OUT/fingerprint_compare.txt" 2>&1
    stamp fingerprint_compare $?; head -5 "$OUT/fingerprint_compare.txt"
    ;;
  bench)
    args=(--impls cupynce --ops nt_xent,clip_loss,siglip_loss,info_nce
          --dtypes bfloat16,float32 --sizes ${AB_SIZES:-1024,4096,16384} --dims 512 --no-errors)
    for round in 1 2; do
      for tree in before after; do
        dir=$BEFORE; [ $tree = after ] && dir=$AFTER
        in_tree "$dir" python benchmarks/bench_contrastive.py "${args[@]}" \
          --out "$OUT/bench_${tree}_$round.json" >"$OUT/bench_${tree}_$round.log" 2>&1
        stamp "bench $tree $round" $?
      done
    done
    python - "$OUT" <<'PY' | tee "$OUT/bench_ab.md"
import json, statistics, sys
out = sys.argv[1]
runs = {(t, r): json.load(open(f"{out}/bench_{t}_{r}.json"))["results"]
        for t in ("before", "after") for r in (1, 2)}
def med(t, r, key):
    for rec in runs[(t, r)]:
        if (rec["op"], rec["n"], rec["d"], rec["dtype"]) == key and "median_ms" in rec.get("cupynce", {}):
            return rec["cupynce"]["median_ms"]
keys = [(x["op"], x["n"], x["d"], x["dtype"]) for x in runs[("before", 1)]]
print("| op | N | D | dtype | before 1 | after 1 | before 2 | after 2 | after / before (medians of 2) |")
print("|---|---|---|---|---|---|---|---|---|")
ratios = []
for k in keys:
    v = {(t, r): med(t, r, k) for t in ("before", "after") for r in (1, 2)}
    if None in v.values():
        print(f"| {' | '.join(map(str, k))} | missing |")
        continue
    b = statistics.median([v[("before", 1)], v[("before", 2)]])
    a = statistics.median([v[("after", 1)], v[("after", 2)]])
    ratios.append(a / b)
    print(f"| {' | '.join(map(str, k))} | " + " | ".join(f"{v[(t, r)]:.3f}" for r in (1, 2)
          for t in ("before", "after")) + f" | {a / b:.3f} |")
print(f"\nafter / before over {len(ratios)} cases: median {statistics.median(ratios):.3f}, "
      f"min {min(ratios):.3f}, max {max(ratios):.3f}")
PY
    ;;
  splade)
    for round in 1 2; do
      for tree in before after; do
        dir=$BEFORE; [ $tree = after ] && dir=$AFTER
        for tiles in auto 0; do
          CUPYNCE_TILES=$tiles in_tree "$dir" python benchmarks/bench_splade.py --quick --impls \
            --out "$OUT/splade_${tree}_tiles${tiles}_$round.json" \
            >"$OUT/splade_${tree}_tiles${tiles}_$round.log" 2>&1
          stamp "splade $tree tiles=$tiles $round" $?
          tail -6 "$OUT/splade_${tree}_tiles${tiles}_$round.log"
        done
      done
    done
    ;;
  torch)
    for round in 1 2; do
      for tree in before after; do
        dir=$BEFORE; [ $tree = after ] && dir=$AFTER
        in_tree "$dir" python benchmarks/bench_torch_overhead.py --ops clip_loss,nt_xent \
          --dtypes bfloat16 --sizes 256,1024 --paths "cupynce.torch,CuPy core,autograd floor" \
          --repeat 30 --out "$OUT" --name "torch_${tree}_$round" >"$OUT/torch_${tree}_$round.log" 2>&1
        stamp "torch $tree $round" $?
      done
    done
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
