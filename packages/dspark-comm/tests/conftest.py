"""Shared test setup of dspark-comm: markers, the printed random seed, the
CPU compile target, and dspark-cute's test helpers on the path (``ptx_audit``,
``skinny_emulation``: the comm kernels are audited and emulated the same way)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

CUTE_TESTS = Path(__file__).resolve().parents[2] / "dspark-cute" / "tests"
if str(CUTE_TESTS) not in sys.path:
    sys.path.append(str(CUTE_TESTS))

# Without a GPU the CuTe DSL needs a target to compile for (the compile tests
# pass their arch explicitly; this only keeps the DSL from guessing).
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    config.addinivalue_line("markers", "multigpu: needs two or more CUDA GPUs (nox -s tests-multigpu)")
    config.addinivalue_line("markers", "compile: compiles CuTe DSL kernels for sm_90a/sm_100a on the CPU")


SEED = int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31))


def pytest_report_header(config) -> str:
    return f"dspark-comm random seed: {SEED} (set DSPARK_SEED={SEED} to repeat)"


@pytest.fixture
def seed(request) -> int:
    """The session seed mixed with the test's name, printed (repeat a
    failure with DSPARK_SEED)."""
    value = (SEED + sum(map(ord, request.node.nodeid))) % 2**31
    print(f"seed {value} (DSPARK_SEED={SEED})")
    return value
