#!/usr/bin/env bash
# Set up a virtualenv with DSpark's packages and run the demo. Extra arguments go to
# the demo (python -m dspark_core.demo --help).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "${DSPARK_TORCH:-torch==2.13.0}"
# The kernel packages install on a CPU too (the CuTe DSL compiles there): the plan
# then shows what a GPU would run fused.
python -m pip install -q -e ./packages/dspark-core -e ./packages/dspark-cute -e ./packages/dspark-comm
# vLLM's stock binaries (scripts/stock/compile_stock.py; scripts/stage_device.sh stages them in
# .device/stock): where they are there, the demo times its draft against vLLM's step from them;
# elsewhere it compares with dspark-core's spec and says why it prints no speed ratio.
stock=()
case " $* " in
  *" --stock "* | *" --stock="*) ;;
  *) if [ -z "${DSPARK_STOCK_DIR:-}" ] && [ -f .device/stock/manifest.json ]; then stock=(--stock .device/stock); fi ;;
esac
python -m dspark_core.demo ${stock[@]+"${stock[@]}"} "$@"
# With two GPUs, the TP2 demo too (the draft sharded over both; dspark-comm, installed above),
# with the same arguments, unless they already chose a TP size.
case " $* " in
  *" --tp "* | *" --tp="*) ;;
  *)
    if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
      python -m dspark_core.demo --tp 2 "$@"
    fi
    ;;
esac
