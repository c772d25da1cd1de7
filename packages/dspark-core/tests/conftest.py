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


@pytest.fixture
def approx(monkeypatch):
    """``approx(ops, record=None)``: make the spec's approximate instructions
    those of ``ops`` (an ``_independent.Approx``: NumPy functions, applied to
    float32 CPU tensors through their bits) for this test, by replacing each
    name in ``dspark_core.spec.numerics`` and ``dspark_core.spec.layers``.
    ``record`` (a dict) collects each call's input under the function's name."""
    import _independent as I

    from dspark_core.spec import layers, numerics

    def use(ops, record: dict | None = None) -> None:
        for name in I.Approx.NAMES:
            fn = getattr(ops, name)

            def wrapped(x, _fn=fn, _name=name):
                v = I.to_np(x.to(torch.float32))
                if record is not None:
                    record.setdefault(_name, []).append(v)
                return torch.from_numpy(np.ascontiguousarray(_fn(v), dtype=np.float32))

            for module in (numerics, layers):
                if hasattr(module, name):
                    monkeypatch.setattr(module, name, wrapped)

    return use
