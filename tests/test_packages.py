"""Cross-package checks of the packaging: every package's version comes from
one place, every third-party module its src imports is a declared
dependency (or an extra's), each ships its LICENSE and ``py.typed``, and the
installed backends advertise only kernels the planner knows."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
import tomllib

from dspark_core.planner import policy

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["dspark-core", "dspark-cute", "dspark-comm", "dspark-vllm"]
# Import names of the distributions the packages may depend on.
DISTRIBUTIONS = {
    "torch": "torch", "numpy": "numpy", "cutlass": "nvidia-cutlass-dsl", "cupy": "cupy-cuda13x",
    "vllm": "vllm", "dspark_core": "dspark-core", "dspark_cute": "dspark-cute", "dspark_comm": "dspark-comm",
    "dspark_vllm": "dspark-vllm",
}
# Modules that arrive with a declared distribution (the CuTe DSL's CUDA bindings).
COMES_WITH = {"cuda": "nvidia-cutlass-dsl"}


def _project(name: str) -> dict:
    return tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=~!;\[ ]", req, maxsplit=1)[0].strip().lower()


@pytest.mark.parametrize("name", PACKAGES)
def test_the_version_is_written_once(name):
    project = _project(name)
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    module = importlib.import_module(name.replace("-", "_"))
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": f"{module.__name__}.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", module.__version__)
    assert importlib.metadata.version(name) == module.__version__  # the installed metadata agrees


@pytest.mark.parametrize("name", PACKAGES)
def test_every_imported_distribution_is_declared(name):
    project = _project(name)["project"]
    declared = {_requirement_name(r) for r in project.get("dependencies", [])}
    extras = {_requirement_name(r) for reqs in project.get("optional-dependencies", {}).values() for r in reqs}
    src = ROOT / "packages" / name / "src" / name.replace("-", "_")
    missing = set()
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            for module in names:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == name.replace("-", "_"):
                    continue
                dist = DISTRIBUTIONS.get(top) or COMES_WITH.get(top)
                assert dist is not None, f"{path.relative_to(ROOT)} imports {top}: name its distribution here"
                if dist not in declared | extras:
                    missing.add(f"{top} ({dist}) in {path.relative_to(ROOT)}")
    assert not missing, f"{name} imports undeclared distributions: {sorted(missing)}"


@pytest.mark.parametrize("name", PACKAGES)
def test_each_package_ships_its_license_and_types(name):
    folder = ROOT / "packages" / name
    assert (folder / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert (folder / "src" / name.replace("-", "_") / "py.typed").is_file()
    project = _project(name)
    assert project["project"]["license-files"] == ["LICENSE"]
    assert project["tool"]["setuptools"]["package-data"][name.replace("-", "_")] == ["py.typed"]


def test_the_cute_dsl_pin_is_the_tested_range():
    for name in ("dspark-cute", "dspark-comm"):
        deps = _project(name)["project"]["dependencies"]
        assert "nvidia-cutlass-dsl>=4.3.5,<=4.8.1" in deps, name


def test_installed_kernels_are_known():
    kernels = policy.installed_kernels()
    assert kernels <= policy.ALL_KERNELS
    # dspark-cute is installed by `nox -s tests`: its kernels must be advertised.
    assert {policy.ROW_NORM, policy.BOUNDARY} <= kernels
