#!/usr/bin/env bash
# One device call that runs every GPU suite and the benchmarks and prints a short
# table last. On this project's device machines:
#   run(command="bash scripts/gpu-check.sh", carry=[".device"], kind="nvidia-h200-x2")
# Outputs (logs, benchmark tables and plots) go to $OUT (default bench-results/).
set -u
cd "$(dirname "$0")/.."
[ -f .device/env.sh ] && source .device/env.sh
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
export PYTHONPATH=packages/dspark-core/src:packages/dspark-cute/src:packages/dspark-comm/src:packages/dspark-vllm/src:packages/dspark-comm/tests${PYTHONPATH:+:$PYTHONPATH}
export DSPARK_BENCH_OUT=$OUT
summary=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log, keep a summary line
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local last
  last=$(grep -E "passed|failed|error" "$OUT/$name.log" | tail -1)
  summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$last")")
  tail -n 15 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader
step gpu-suites 200 python -m pytest -m gpu packages/dspark-core/tests packages/dspark-cute/tests -q -p no:cacheprovider
step multigpu 120 python -m pytest -m multigpu packages/dspark-comm/tests -q -p no:cacheprovider
step bench-decode 110 python packages/dspark-cute/benchmarks/bench_decode.py --out "$OUT"
step bench-qkv-front 40 python packages/dspark-cute/benchmarks/bench_qkv_front.py --out "$OUT"
echo; echo "== summary =="; printf '%s\n' "${summary[@]}"
for f in "$OUT"/decode.md "$OUT"/qkv_front.md; do [ -f "$f" ] && { echo "-- $f"; cat "$f"; }; done
