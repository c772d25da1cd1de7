"""DSpark's sessions.

CPU (each installs what it needs into its own virtualenv):
    nox -s lint            ruff
    nox -s tests           every package's CPU suite and the cross-package tests/ (pytest-xdist),
                           kernels compiled for sm_90a and sm_100a with CuTe DSL 4.8.0 (vLLM 0.33.0's pin)
    nox -s tests-vllm      the vLLM plugin's tests and the stock-recompile check, against the real
                           vLLM 0.33.0 and its pins (DSPARK_VLLM: the requirement)
    nox -s compile-cute    the compile checks under the other ends of the CuTe DSL range: 4.3.5, 4.8.1

GPU (run with the interpreter at hand, nothing installed: a device machine has
no network; the packages' src/ folders and their entry-point metadata go on PYTHONPATH):
    nox -s tests-sm90      GPU tests on an sm_90 GPU (H100/H200)
    nox -s tests-sm100     GPU tests on an sm_100 GPU (B200)
    nox -s tests-multigpu  tests that need two or more GPUs
    nox -s bench           benchmarks: markdown tables and PNG plots in bench-results/

Environment: DSPARK_TORCH (the torch requirement of the CPU sessions, default
torch==2.13.0, the CPU build on this project's machines), DSPARK_CUTE (the
CuTe DSL of ``tests``, default nvidia-cutlass-dsl==4.8.0), DSPARK_SEED (fix
the tests' random seed), DSPARK_BENCH_OUT (the benchmarks' output folder),
DSPARK_ATTENTION / DSPARK_PREFETCH / DSPARK_GEMV /
DSPARK_PACKAGE_GEMM (the specialized decode's switches; the GPU suites pass
them explicitly where they depend on them), DSPARK_KERNEL_CACHE (1 or a
directory: the opt-in on-disk cache of compiled kernels).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ["dspark-core", "dspark-cute", "dspark-comm", "dspark-vllm"]
TORCH = os.environ.get("DSPARK_TORCH", "torch==2.13.0")
# The packages' src/ folders, and dspark-comm's tests/ (its rank workers are
# spawned processes that import them by module name).
SRC_PATH = os.pathsep.join(
    [str(ROOT / "packages" / p / "src") for p in PACKAGES] + [str(ROOT / "packages" / "dspark-comm" / "tests")]
)
# The test folders that exist (a package may have none yet).
TEST_DIRS = [d for d in [f"packages/{p}/tests" for p in PACKAGES] + ["tests"] if (ROOT / d).is_dir()]

nox.options.sessions = ["lint", "tests"]
CUTE = os.environ.get("DSPARK_CUTE", "nvidia-cutlass-dsl==4.8.0")
nox.options.reuse_existing_virtualenvs = True


def _install(session: nox.Session, cute: str = CUTE) -> None:
    session.install(TORCH)
    session.install(cute)
    # ptxas for the compile tests' register/spill reports: CuTe DSL 4.8 writes
    # PTX 9.4, which a CUDA 13.0 toolkit's ptxas cannot read; nvdisasm for
    # their machine-code audits (what ptxas keeps before a PDL wait).
    session.install("pytest-xdist", "nvidia-cuda-nvcc>=13.4", "nvidia-cuda-nvdisasm>=13.4")
    session.install(*[f"-e./packages/{p}[test]" for p in PACKAGES])


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU suite of every package, compile checks and PTX audits included."""
    _install(session)
    session.run("python", "-m", "pytest", "-n", "auto", "-m", "not gpu and not multigpu", *TEST_DIRS,
                *session.posargs)


@nox.session(name="compile-cute")
@nox.parametrize("cute", ["4.3.5", "4.8.1"])
def compile_cute(session: nox.Session, cute: str) -> None:
    """The kernels' compile checks under the ends of the supported CuTe DSL
    range besides ``tests``' 4.8.0: 4.3.5 and 4.8.1."""
    _install(session, f"nvidia-cutlass-dsl=={cute}")
    session.run("python", "-m", "pytest", "-n", "auto", "-m", "compile", *TEST_DIRS, *session.posargs,
                success_codes=[0, 5])


@nox.session(name="tests-vllm")
def tests_vllm(session: nox.Session) -> None:
    """dspark-vllm's tests against the real vLLM (``DSPARK_VLLM``, default
    vllm==0.33.0, with its own pins: about 4.5 GB of wheels, ten minutes to
    install on two cores), our four packages over it without their own
    dependencies (vLLM's torch and CuTe DSL 4.8.0 serve them)."""
    session.install(os.environ.get("DSPARK_VLLM", "vllm==0.33.0"))
    session.install("pytest>=8", "pytest-xdist", "hypothesis", "safetensors")
    session.install("--no-deps", *[f"-e./packages/{p}" for p in PACKAGES])
    # Two processes: the plugin's tests import vLLM on its CPU platform (Triton off, vLLM's
    # placeholder triton.jit), the stock recompile imports it with Triton on to compile its kernels.
    session.run("python", "-m", "pytest", "-n", "auto", "packages/dspark-vllm/tests", *session.posargs)
    session.run("python", "-m", "pytest", "-n", "auto", "packages/dspark-core/tests/test_stock_recompile.py",
                *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


def _gpus() -> list[tuple[int, int]]:
    """The compute capabilities of the visible GPUs, via the interpreter at hand."""
    code = (
        "import torch\n"
        "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
        "print(';'.join('%d,%d' % torch.cuda.get_device_capability(i) for i in range(n)))"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [tuple(int(v) for v in cc.split(",")) for cc in out.strip().split(";") if cc]


def _gpu_session(session: nox.Session, major: int, marker: str, min_gpus: int = 1) -> None:
    gpus = [cc for cc in _gpus() if major == 0 or cc[0] == major]
    if len(gpus) < min_gpus:
        session.skip(
            f"needs {min_gpus} GPU(s) of compute capability {major}.x; this machine has "
            f"{_gpus() or 'none'} (the suite runs on a device machine)"
        )
    session.run("python", "-m", "pytest", "-m", marker, *TEST_DIRS, *session.posargs, env=_gpu_env(session),
                external=True)


def _gpu_env(session: nox.Session) -> dict:
    """PYTHONPATH for a machine where the packages are not installed: their
    src/ folders and their entry-point metadata (scripts/dev_entry_points.py)."""
    meta = Path(session.create_tmp()) / "dspark-meta"
    session.run("python", str(ROOT / "scripts" / "dev_entry_points.py"), str(meta), external=True, silent=True)
    return {"PYTHONPATH": os.pathsep.join([SRC_PATH, str(meta), os.environ.get("PYTHONPATH", "")])}


@nox.session(name="tests-sm90", venv_backend="none")
def tests_sm90(session: nox.Session) -> None:
    """GPU tests on sm_90 (H100/H200), the spec's CPU == CUDA check included."""
    _gpu_session(session, 9, "gpu")


@nox.session(name="tests-sm100", venv_backend="none")
def tests_sm100(session: nox.Session) -> None:
    """GPU tests on sm_100 (B200)."""
    _gpu_session(session, 10, "gpu")


@nox.session(name="tests-multigpu", venv_backend="none")
def tests_multigpu(session: nox.Session) -> None:
    """Tests over two or more GPUs of one host (one process per rank)."""
    _gpu_session(session, 0, "multigpu", min_gpus=2)


# Columns a benchmark times beyond its defaults: the draft step with the
# one-token GEMV (the fastest m = 1 step).
BENCH_ARGS = {"bench_decode.py": ("--gemv",)}


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Every benchmark script under packages/*/benchmarks, in CUDA graphs on the GPU."""
    if not _gpus():
        session.skip("the benchmarks time GPU kernels; this machine has no GPU")
    out = os.environ.get("DSPARK_BENCH_OUT", str(ROOT / "bench-results"))
    env = _gpu_env(session)
    for script in sorted(ROOT.glob("packages/*/benchmarks/bench_*.py")):
        extra = BENCH_ARGS.get(script.name, ())
        session.run("python", str(script), "--out", out, *extra, *session.posargs, env=env, external=True)
