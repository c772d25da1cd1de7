"""Seeding of the dspark-core tests.

One session seed: ``DSPARK_SEED`` from the environment, or fresh from the clock.
It is printed in the report header and by every test that draws random data
(``seed``/``rng``/``gen`` fixtures), so a failure is rerun with
``DSPARK_SEED=<n> python -m pytest ...``. Each test derives its own stream from
the session seed and its file and test name, so a test's data does not depend
on which other tests ran. The Hypothesis tests take the same seed
(``test_properties.py`` reads it back from the environment, which this file sets).
"""

from __future__ import annotations

import os
import time
import zlib

import numpy as np
import pytest
import torch


def _session_seed() -> int:
    env = os.environ.get("DSPARK_SEED", "").strip()
    if env:
        return int(env)
    return time.time_ns() % (2**31 - 1)


SEED = _session_seed()
os.environ["DSPARK_SEED"] = str(SEED)


def pytest_report_header(config) -> str:
    return f"DSPARK_SEED={SEED}"


def _test_stream(request) -> int:
    name = f"{os.path.basename(str(request.node.path))}::{request.node.name}"
    return zlib.crc32(name.encode())


@pytest.fixture
def seed(request) -> int:
    """The session seed (printed; pytest shows it with a failure)."""
    print(f"DSPARK_SEED={SEED}")
    return SEED


@pytest.fixture
def rng(seed, request) -> np.random.Generator:
    """A NumPy generator of this test's stream of the session seed."""
    return np.random.default_rng([seed, _test_stream(request)])


@pytest.fixture
def gen(seed, request) -> torch.Generator:
    """A torch CPU generator of this test's stream of the session seed."""
    return torch.Generator().manual_seed(seed * 2**32 + _test_stream(request))
