#!/usr/bin/env bash
# The first call on a fresh machine, from an installed release wheel (issue 52).
#
# Builds the release wheel as a release is built (python -m cupynce._engine.build, then
# pip wheel) from a copy of this checkout -- or takes WHEEL=path/to/cupynce-*.whl -- installs
# it into a fresh folder, and runs benchmarks/first_call.py against that installed copy (every
# case in a new process with an empty kernel cache).
#   benchmarks/run_first_call.sh OUTDIR [first_call.py arguments]
#   CAPS="80 86 89 90": the capabilities to build (default: this GPU's)
#   CUPYNCE_PREBUILT=0: ignore the wheel's cubins (the run-time build, for comparison)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:?usage: run_first_call.sh OUTDIR [args]}" && cd "$1" && pwd); shift
work=$(mktemp -d)
if [ -z "${WHEEL:-}" ]; then
  mkdir "$work/tree"
  cp -r "$root"/{cupynce,kernels_src,setup.py,setup.cfg,pyproject.toml,README.md,LICENSE} "$work/tree/"
  rm -rf "$work/tree/cupynce/_cubins"
  caps=${CAPS:-$(python -c "import cupy; print(cupy.cuda.Device().compute_capability)")}
  args=(); for c in $caps; do args+=(--capability "$c"); done
  (cd "$work/tree" && python -m cupynce._engine.build "${args[@]}") | tail -1
  python -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/tree"
  WHEEL=$(ls "$work"/dist/cupynce-*.whl)
fi
ls -l "$WHEEL"; cp "$WHEEL" "$out/"
python -m pip install -q --no-deps --no-compile --target "$work/site" "$WHEEL"
cd "$work"
PYTHONPATH="$work/site" python "$root/benchmarks/first_call.py" --json "$out/first_call.json" "$@"
