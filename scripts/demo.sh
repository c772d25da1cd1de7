#!/usr/bin/env bash
# Set up a virtualenv with DSpark's packages and run the demo. Extra arguments go to
# the demo (python -m dspark_core.demo --help).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "${DSPARK_TORCH:-torch==2.13.0}"
python -m pip install -q -e ./packages/dspark-core
if python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  python -m pip install -q -e ./packages/dspark-cute
fi
python -m dspark_core.demo "$@"
