"""Cross-package checks: every package imports alone, reports its version, and the
installed backends' kernel lists name only kernels the planner knows."""

import importlib
from pathlib import Path

import pytest
import tomllib

from dspark_core.planner import policy

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["dspark-core", "dspark-cute", "dspark-comm", "dspark-vllm"]


@pytest.mark.parametrize("name", PACKAGES)
def test_package_version_matches_pyproject(name):
    meta = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())
    module = importlib.import_module(name.replace("-", "_"))
    assert module.__version__ == meta["project"]["version"]


def test_installed_kernels_are_known():
    kernels = policy.installed_kernels()
    assert kernels <= policy.ALL_KERNELS
    # dspark-cute is installed by `nox -s tests`: its kernels must be advertised.
    assert {policy.ROW_NORM, policy.BOUNDARY} <= kernels
