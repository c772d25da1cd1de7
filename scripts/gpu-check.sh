#!/usr/bin/env bash
# Every GPU suite and the benchmarks, on a device machine, each step under its own time
# limit, with a short summary table last. Pick steps by name (default: gpu multigpu bench):
#   bash scripts/gpu-check.sh [gpu] [decode] [multigpu] [bench] [demo] [bench-kernels] [bench-tp2] [demo-tp2] [sweep] [sweep-quick] [sweep-deep] [sweep-copies] [sweep-depth] [ncu] [gemm-tp2] [draft-tp2]
# On this project's device machines one call stays under 10 minutes, so split the steps
# (gpu alone takes about 4-5 minutes):
#   run(command="bash scripts/gpu-check.sh gpu", carry=[".device"], kind="nvidia-h200")
#   run(command="bash scripts/gpu-check.sh bench demo", carry=[".device"], kind="nvidia-h200")
#   run(command="bash scripts/gpu-check.sh multigpu bench-tp2", carry=[".device"], kind="nvidia-h200-x2")
# gpu: every single-GPU suite; multigpu: the two-GPU suites (comm, package GEMM, TP2 draft);
# bench: the decode profile (graph replays) and bench_decode with its --direct --front --prefetch --gemv columns.
# decode: the executor's GPU suite alone (part of gpu).
# demo: the README's demo (front off, then on).
# bench-kernels: the single-kernel benchmarks; bench-tp2: the package GEMM and the draft step at TP2
# (two GPUs); demo-tp2: the demo at TP2 (two GPUs); sweep: the package GEMM's main-loop shapes
# against cuBLAS (scripts/probes/package_gemm_sweep.py, one GPU, about 6 minutes); sweep-copies: row
# and lane copies of the weight and x side by side (about 2.5 minutes); sweep-depth: the ring's warps
# and depth side by side (about 2 minutes); ncu: Nsight Compute counters against cuBLAS (about 1.5
# minutes); gemm-tp2: the package GEMM's two-GPU suite and benchmark (about 8 minutes);
# draft-tp2: the TP2 draft's two-GPU suite and step benchmark (about 3 minutes; gemm-tp2 and draft-tp2
# together no longer fit one call's 10 minutes, so they are two steps).
# Logs, benchmark tables and plots go to $OUT (default bench-results/).
set -u
cd "$(dirname "$0")/.."
[ -f .device/env.sh ] && source .device/env.sh
export OUT=${OUT:-bench-results}
mkdir -p "$OUT"
# Append, never replace: env.sh puts the CuTe DSL on PYTHONPATH.
export PYTHONPATH=packages/dspark-core/src:packages/dspark-cute/src:packages/dspark-comm/src:packages/dspark-vllm/src:packages/dspark-comm/tests${PYTHONPATH:+:$PYTHONPATH}
export DSPARK_BENCH_OUT=$OUT
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(gpu multigpu bench)
wanted() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
summary=()
failed=0
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  [ "$rc" -ne 0 ] && failed=1
  local last
  last=$(grep -E "passed|failed|error" "$OUT/$name.log" | tail -1)
  summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$last")")
  tail -n 15 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader
if wanted gpu; then
  step gpu-suites 420 python -m pytest -m gpu packages/dspark-core/tests packages/dspark-cute/tests -q -p no:cacheprovider
fi
if wanted decode; then  # the executor's suite alone (a subset of gpu)
  step decode-suite 240 python -m pytest -m gpu packages/dspark-cute/tests/test_gpu_decode.py -q -p no:cacheprovider
fi
if wanted multigpu; then
  step comm-multigpu 150 python -m pytest -m multigpu packages/dspark-comm/tests/test_comm_multigpu.py -q -p no:cacheprovider
  step gemm-multigpu 200 python -m pytest -m multigpu packages/dspark-comm/tests/test_package_gemm_multigpu.py -q -p no:cacheprovider
  step draft-multigpu 200 python -m pytest -m multigpu packages/dspark-comm/tests/test_draft_multigpu.py -q -p no:cacheprovider
fi
if wanted gemm-tp2; then  # the package GEMM alone at TP2: its two-GPU suite and its benchmark (two GPUs)
  step gemm-multigpu 200 python -m pytest -m multigpu packages/dspark-comm/tests/test_package_gemm_multigpu.py -q -p no:cacheprovider
  step bench-package-gemm 330 python packages/dspark-comm/benchmarks/bench_package_gemm.py --out "$OUT" --timeout 310
fi
if wanted draft-tp2; then  # the TP2 draft's suite and step benchmark (two GPUs)
  step draft-multigpu 180 python -m pytest -m multigpu packages/dspark-comm/tests/test_draft_multigpu.py -q -p no:cacheprovider
  step bench-draft-tp2 200 python packages/dspark-comm/benchmarks/bench_draft_tp2.py --out "$OUT"
fi
if wanted bench-tp2; then
  step bench-package-gemm 330 python packages/dspark-comm/benchmarks/bench_package_gemm.py --out "$OUT" --timeout 310
  step bench-draft-tp2 240 python packages/dspark-comm/benchmarks/bench_draft_tp2.py --out "$OUT"
fi
if wanted sweep; then
  step package-gemm-sweep 560 python scripts/probes/package_gemm_sweep.py
fi
if wanted sweep-deep; then  # K = 8192's 8 warps past the package's shared-memory cap (about 1.5 minutes)
  step package-gemm-sweep-deep 200 python scripts/probes/package_gemm_sweep.py --deep
fi
if wanted sweep-copies; then  # weight and x copies x L2 prefetch at K = 4096 / 8192 (package_gemm_sweep.py --copies)
  step package-gemm-sweep-copies 300 python scripts/probes/package_gemm_sweep.py --copies
fi
if wanted sweep-depth; then  # the ring's warps and depth at K = 4096 / 8192 (package_gemm_sweep.py --depth)
  step package-gemm-sweep-depth 400 python scripts/probes/package_gemm_sweep.py --depth
fi
if wanted ncu; then  # hardware counters: the ring main loop against cuBLAS (scripts/probes/ncu_gemm.py)
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  step ncu 300 bash -c "'$NCU' --profile-from-start off --clock-control none --csv --page raw --log-file '$OUT/ncu.csv' \
    --metrics \"\$(python scripts/probes/ncu_gemm.py metrics)\" python scripts/probes/ncu_gemm.py run && python scripts/probes/ncu_gemm.py report"
fi
if wanted sweep-quick; then  # the policy's k_warps only, K >= 2048, m 1 / 4 / 16 (about 3 minutes)
  step package-gemm-sweep-quick 300 python scripts/probes/package_gemm_sweep.py --quick
fi
if wanted demo-tp2; then
  step demo-tp2 150 python -m dspark_core.demo --tp 2
fi
if wanted demo; then
  step demo 150 python -m dspark_core.demo
  step demo-front 150 python -m dspark_core.demo --front
fi
if wanted bench; then
  step profile-decode 120 python packages/dspark-cute/benchmarks/profile_decode.py --gemv --out "$OUT"
  step bench-decode 300 python packages/dspark-cute/benchmarks/bench_decode.py --direct --front --prefetch --gemv --out "$OUT"
fi
if wanted bench-kernels; then
  step bench-qkv-front 60 python packages/dspark-cute/benchmarks/bench_qkv_front.py --out "$OUT"
  step bench-gemv 120 python packages/dspark-cute/benchmarks/bench_gemv.py --sweep --out "$OUT"
fi
echo; echo "== summary =="; printf '%s\n' "${summary[@]}"
for f in "$OUT"/*.md; do [ -f "$f" ] && { echo "-- $f"; cat "$f"; }; done
exit $failed  # non-zero when any step failed or ran out of time
