#!/usr/bin/env bash
# The GPU suites, the stock comparisons and the benchmarks on a device machine, each step
# under its own time limit, with a short summary table last. Pick steps by name:
#   bash scripts/gpu-check.sh STEP...
# Staging (scripts/stage_device.sh writes .device/): a fresh machine needs the CuTe DSL's
# two parts over two calls, back to back (a machine is released after a short idle):
#   run(command="bash scripts/gpu-check.sh unpack spec", carry=[".device/cutedsl-4.8.0-a.tar.xz",
#       ".device/env.sh", ".device/stock"], kind="nvidia-h200")
#   run(command="bash scripts/gpu-check.sh unpack norms qkv gating decode", carry=[
#       ".device/cutedsl-4.8.0-b.tar.xz", ".device/wheels", ".device/env.sh"], kind="nvidia-h200")
# Steps (seconds measured on an H200 where known):
#   unpack         unpack what .device/ carries (env.sh does it; this step reports what is there)
#   check-spec     the spec on CUDA against the stock binaries (scripts/stock/check_spec.py, ~20 s)
#   spec           dspark-core's GPU tests (the spec on CUDA; no CuTe DSL needed)
#   norms qkv markov gating gemv attention   the kernel families' GPU suites (against the spec and the stock binaries)
#   markov-persistent  the N greedy steps in one cooperative launch against vLLM's loop (CuTe DSL 4.8)
#   markov-bias-sample the probabilistic step with its bias GEMM against the step after cuBLAS's GEMM and vLLM's binary
#   bench-markov   the Markov stage alone: vLLM's loop, the bias step's N launches, the persistent launch
#   probe-direct-gemm  an exact one-split GEMM with a GEMV's schedule (register-direct, one warp a 16-row tile)
#                  against cuBLAS: time and bits (scripts/probes/exact_direct_gemm.py)
#   probe-pdl-overlap  a latency-bound part, then that GEMM with its weight asked of L2 before its PDL wait, vs cuBLAS
#   ordered        the ordered GEMM against the live cuBLAS (orders found at every row count, bits, graphs, TP shards,
#                  the build's timing decision on this card and its cache)
#   decide         the build's timing decision alone (test_gpu_ordered_gemm.py -k decide): bits kept, cache warm < 1 s
#   card           the card's facts as the benchmarks and the decision cache name it (no CuTe DSL needed)
#   bench-gemm     bench_ordered_gemm: each projection and the 14-GEMM chain, cuBLAS against the ordered GEMM
#   cublas-kernels cuBLAS's kernel names and grids per projection and row count (needs no CuTe DSL)
#   ops            the custom ops (opcheck, torch.compile against eager) and the on-disk kernel cache
#   decode         the executor over the reference draft (tests/test_gpu_decode.py)
#   rows           its steps captured in CUDA graphs with PDL at every size vLLM captures (tests/test_gpu_rows.py)
#   multigpu       the two-GPU suites (comm, package GEMM, TP2 draft); kind nvidia-h200-x2
#   multigpu-one   the mailbox all-reduce and fused boundary as 2, 4 and 8 processes on one GPU (test_comm_one_gpu)
#   draft-one-gpu  the TP draft end to end (bitwise, exact package GEMM, the plugin's binding) as 2, 4, 8 ranks
#   bench-boundary bench_boundary_stock (DSpark / vLLM's chain / vLLM's one-kernel boundary)
#   bench-step     the whole draft step against vLLM's from its binaries: test_gpu_draft_step (bits), then
#                  bench_draft_step with vLLM's Triton attention on both sides, with DSpark's, and V_draft 202752
#   triton-attention  vLLM's Triton unified_attention binary against the spec (test_gpu_triton_attention_stock)
#   bench-step-ordered  bench_draft_step with the opt-in ordered GEMM (m = 1 to 64)
#   default        the default configuration on this card, named by it: bench_draft_step with vLLM's Triton
#                  attention on both sides at m = ${DEFAULT_ROWS:-1,4,16,64} (the plugin's projections, decisions
#                  and Markov stage), then the 14 projections chained as decided at m = 1, 4 (warm cache)
#   bench-step-tp  one rank's work of the TP2/4/8 step (bench_draft_step --tp; no all-reduce on either side)
#   bench-step-tp-triton  the same with vLLM's Triton unified_attention on both sides (its H8/H16/H32 binaries)
#   bench          bench_decode and profile_decode; bench-kernels: the other single-GPU benchmarks
#   bench-tp2      the package GEMM and TP2 draft benchmarks; kind nvidia-h200-x2
#   demo           the README's demo against vLLM's step from .device/stock (carry it): tests/test_gpu_demo.py
#                  (bits), the demo, then with the one-token GEMV; demo-tp2 on two GPUs
# Logs, benchmark tables and plots go to $OUT (default bench-results/).
set -u
cd "$(dirname "$0")/.."
[ -f .device/env.sh ] && source .device/env.sh
export OUT=${OUT:-bench-results}
mkdir -p "$OUT"
export DSPARK_BENCH_OUT=$OUT
# A fresh decision cache per run: the benchmarks report the build's cold cost.
export DSPARK_DECISION_CACHE=${DSPARK_DECISION_CACHE:-$(mktemp -d /tmp/dspark-decisions.XXXXXX)}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && { sed -n '2,/^# Logs/p' "$0"; exit 2; }
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
  last=$(grep -E "passed|failed|error|summary|mismatch" "$OUT/$name.log" | tail -1)
  summary+=("$(printf '%-20s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$last")")
  tail -n 12 "$OUT/$name.log"
}
gpu() { step "$1" "$2" python -m pytest -m gpu -q -p no:cacheprovider "${@:3}"; }
nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader
if wanted unpack; then
  python -c "import cutlass, sys; print('CuTe DSL', cutlass.__version__)" 2>&1 | tail -1
  ls .device 2>/dev/null
fi
wanted card && step card 60 python -c "from dspark_core.tools.card import card_facts; print(card_facts().describe())"
wanted check-spec && step check-spec 120 python scripts/stock/check_spec.py
wanted spec && gpu spec 120 packages/dspark-core/tests
wanted norms && gpu norms 240 packages/dspark-cute/tests/test_gpu_row_norm.py \
  packages/dspark-cute/tests/test_gpu_boundary.py packages/dspark-cute/tests/test_gpu_context.py
wanted qkv && gpu qkv 300 packages/dspark-cute/tests/test_gpu_qkv_epilogue.py
wanted markov && gpu markov 300 packages/dspark-cute/tests/test_gpu_markov.py packages/dspark-cute/tests/test_gpu_markov_stock.py \
  packages/dspark-cute/tests/test_gpu_markov_bias_step.py
wanted markov-bias-sample && gpu markov-bias-sample 300 packages/dspark-cute/tests/test_gpu_markov_bias_sample.py
wanted markov-persistent && gpu markov-persistent 300 packages/dspark-cute/tests/test_gpu_markov_persistent.py
wanted bench-markov && step bench-markov 240 python scripts/probes/markov_loop.py --rows 1,4,16,32,64 --sample
wanted probe-direct-gemm && step probe-direct-gemm 500 python scripts/probes/exact_direct_gemm.py
wanted probe-pdl-overlap && step probe-pdl-overlap 300 python scripts/probes/pdl_overlap.py
wanted gating && gpu gating 200 packages/dspark-cute/tests/test_gpu_activations.py
wanted attention && gpu attention 200 packages/dspark-cute/tests/test_gpu_attention.py
wanted triton-attention && gpu triton-attention 200 packages/dspark-cute/tests/test_gpu_triton_attention_stock.py
wanted gemv && gpu gemv 150 packages/dspark-cute/tests/test_gpu_gemv.py
wanted ordered && gpu ordered 360 packages/dspark-cute/tests/test_gpu_ordered_gemm.py
wanted decide && gpu decide 300 packages/dspark-cute/tests/test_gpu_ordered_gemm.py -k decide -s
wanted bench-gemm && step bench-gemm 420 python packages/dspark-cute/benchmarks/bench_ordered_gemm.py --out "$OUT"
wanted cublas-kernels && step cublas-kernels 200 python packages/dspark-cute/benchmarks/bench_ordered_gemm.py --roles "" \
  --rows "" --chain-rows "" --kernels 1,2,4,8,16,24,32,48,64,128,256,512 --name cublas_kernels --out "$OUT"
wanted ops && gpu ops 240 packages/dspark-cute/tests/test_gpu_ops.py packages/dspark-cute/tests/test_gpu_disk_cache.py
wanted decode && gpu decode 300 tests/test_gpu_decode.py
wanted rows && gpu rows 240 tests/test_gpu_rows.py
wanted multigpu-one && gpu multigpu-one 560 packages/dspark-comm/tests/test_comm_one_gpu.py
wanted draft-one-gpu && gpu draft-one-gpu 580 packages/dspark-comm/tests/test_draft_one_gpu.py
if wanted multigpu; then
  step comm-multigpu 150 python -m pytest -m multigpu packages/dspark-comm/tests/test_comm_multigpu.py -q -p no:cacheprovider
  step gemm-multigpu 200 python -m pytest -m multigpu packages/dspark-comm/tests/test_package_gemm_multigpu.py -q -p no:cacheprovider
  step draft-multigpu 200 python -m pytest -m multigpu packages/dspark-comm/tests/test_draft_multigpu.py -q -p no:cacheprovider
fi
wanted bench-boundary && step bench-boundary 150 python packages/dspark-cute/benchmarks/bench_boundary_stock.py --out "$OUT"
if wanted bench-step; then
  gpu bench-step-bits 200 packages/dspark-cute/tests/test_gpu_draft_step.py
  step bench-step-triton 290 python packages/dspark-cute/benchmarks/bench_draft_step.py --attention triton \
    --name draft_step_triton --out "$OUT"
  step bench-step 290 python packages/dspark-cute/benchmarks/bench_draft_step.py --out "$OUT"
  step bench-step-v202752 290 python packages/dspark-cute/benchmarks/bench_draft_step.py --draft-vocab 202752 \
    --name draft_step_v202752 --rows 1,4,32,128,512 --out "$OUT"
fi
if wanted default; then
  slug=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -qi h200 && echo h200 || echo h100)
  step default-step 330 python packages/dspark-cute/benchmarks/bench_draft_step.py --attention triton \
    --rows "${DEFAULT_ROWS:-1,4,16,64}" --name "draft_step_triton_default_$slug" --out "$OUT"
  step default-chain 150 python packages/dspark-cute/benchmarks/bench_ordered_gemm.py --roles "" --rows "" \
    --chain-rows 1,4 --name "ordered_gemm_chain_$slug" --out "$OUT"
fi
if wanted bench-step-tp; then
  for tp in 2 4 8; do
    step bench-step-tp$tp 200 python packages/dspark-cute/benchmarks/bench_draft_step.py --tp $tp \
      --rows 1,4,16,64,512 --name draft_step_tp$tp --out "$OUT"
  done
fi
if wanted bench-step-tp-triton; then
  for tp in 2 4 8; do
    step bench-step-tp$tp-triton 200 python packages/dspark-cute/benchmarks/bench_draft_step.py --tp $tp \
      --attention triton --rows 1,4,16,64,512 --name draft_step_tp${tp}_triton --out "$OUT"
  done
fi
wanted bench-step-ordered && step bench-step-ordered 290 python packages/dspark-cute/benchmarks/bench_draft_step.py \
  --ordered --rows 1,4,8,16,32,64 --name draft_step_ordered --out "$OUT"
if wanted bench; then
  step profile-decode 120 python packages/dspark-cute/benchmarks/profile_decode.py --gemv --out "$OUT"
  step bench-decode 300 python packages/dspark-cute/benchmarks/bench_decode.py --direct --prefetch --gemv --out "$OUT"
fi
if wanted bench-kernels; then
  step bench-boundary-kernels 120 python packages/dspark-cute/benchmarks/bench_boundary.py --out "$OUT"
  step bench-gemv 120 python packages/dspark-cute/benchmarks/bench_gemv.py --sweep --out "$OUT"
fi
if wanted bench-tp2; then
  step bench-package-gemm 330 python packages/dspark-comm/benchmarks/bench_package_gemm.py --out "$OUT" --timeout 310
  step bench-draft-tp2 240 python packages/dspark-comm/benchmarks/bench_draft_tp2.py --out "$OUT"
fi
if wanted demo; then
  gpu demo-bits 200 tests/test_gpu_demo.py
  step demo 200 python -m dspark_core.demo --stock .device/stock
  step demo-gemv 200 python -m dspark_core.demo --gemv --stock .device/stock
fi
wanted demo-tp2 && step demo-tp2 200 python -m dspark_core.demo --tp 2
echo; echo "== summary =="; printf '%s\n' "${summary[@]}"
for f in "$OUT"/*.md; do [ -f "$f" ] && { echo "-- $f"; cat "$f"; }; done
exit $failed  # non-zero when any step failed or ran out of time
