"""The demo's reference path (dspark_core.demo, dspark_core.demo_stock) on a
CPU: the --stock option and its default, the one-line reason where vLLM's
binaries are not staged (and no speed ratio then), no import of scripts/ or a
kernel backend until asked, and a dry run of the stock path: vLLM's step
(scripts/stock/stock_step.py) on the spec's stand-in kernels beside a
specialized decode without kernels, their bits compared (and a planted
difference reported)."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark_core import demo, demo_stock
from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft
from dspark_core.reference.config import small_config
from dspark_core.runtime.decode import DraftDecode

ROOT = Path(__file__).resolve().parents[3]


def _module(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_stock_option_and_its_default(monkeypatch, tmp_path):
    assert demo.parser().parse_args([]).stock is None
    assert demo.parser().parse_args(["--stock", str(tmp_path)]).stock == tmp_path
    monkeypatch.setenv("DSPARK_STOCK_DIR", str(tmp_path / "x"))
    assert demo_stock.default_stock_dir() == tmp_path / "x"
    monkeypatch.setenv("DSPARK_STOCK_DIR", "  ")
    assert demo_stock.in_checkout()  # these tests run from the repository
    assert demo_stock.default_stock_dir() == ROOT / ".device" / "stock"
    monkeypatch.setattr(demo_stock, "SCRIPTS", tmp_path)
    assert demo_stock.default_stock_dir() is None


def test_a_stock_folder_that_is_not_there_is_refused_in_one_line(capsys, tmp_path):
    assert demo.main(["--stock", str(tmp_path / "nothing"), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    nothing = str(tmp_path / "nothing")
    assert err == [f"error: --stock {nothing!r}: no such folder (the compiled stock binaries' folder)"]
    with pytest.raises(SystemExit) as done:  # an empty path is not the working directory
        demo.main(["--stock", "", "--steps", "1"])
    assert done.value.code == 2 and "--stock: expected a folder's path, not ''" in capsys.readouterr().err


def test_the_missing_binaries_reason(tmp_path, monkeypatch):
    why = demo_stock.missing_reason(tmp_path)
    assert f"the stock binaries are not staged in {tmp_path} (no manifest.json)" in why
    assert "scripts/stock/compile_stock.py --out DIR" in why and "\n" not in why
    assert "no folder of stock binaries named" in demo_stock.missing_reason(None)
    (tmp_path / "manifest.json").write_text("{}")
    assert demo_stock.missing_reason(tmp_path) is None
    # Staged but on a CPU: the path says why it does not run, touching no binary.
    assert demo._stock_path(None, torch.device("cpu"), tmp_path, None, None) == (
        None, None, "vLLM's binaries run on a CUDA GPU")
    monkeypatch.setattr(demo_stock, "SCRIPTS", tmp_path)
    assert "run the demo from a checkout" in demo_stock.missing_reason(tmp_path)


def test_importing_the_demo_loads_no_stock_script_and_no_backend():
    code = ("import sys, dspark_core.demo; "
            "print(sorted(m for m in ('stock_step', 'launch_stock', 'dspark_cute') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def _kernel_less_decode(draft, device, gemv):
    """The specialized decode with no kernel (every part on the spec): the
    executor's plumbing on a CPU."""
    plan = plan_draft(draft, policy.Target(kernels=frozenset()).opt_in(frozenset()))
    decode = DraftDecode(draft, plan, None, prefetch=None, kernels={})
    decode.prepare()
    return decode


def _spec_attention(config):
    bench = _module("bench_draft_step", ROOT / "packages" / "dspark-cute" / "benchmarks" / "bench_draft_step.py")
    fn = lambda q, cache, slots: bench.attend(q, bench._CacheView(cache), slots, config.num_kv_heads)  # noqa: E731
    return fn, "the spec attention"


@pytest.fixture
def config(seed):
    print(f"draft seed {seed}")
    return small_config(seed=seed)


def test_where_the_binaries_are_not_staged_the_spec_is_compared_and_no_ratio_printed(
        config, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "_build_decode", _kernel_less_decode)
    tokens = demo.run_demo(config, 2, 2, 8, torch.device("cpu"), stock_dir=tmp_path)
    out = capsys.readouterr().out
    assert set(tokens) == {"spec", "specialized"} and tokens["spec"] == tokens["specialized"]
    assert f"no speed ratio: the stock binaries are not staged in {tmp_path}" in out
    assert "spec path, dspark-core's spec of vLLM's arithmetic (eager PyTorch): 2 greedy steps of 2 token(s) " \
           "(not timed)" in out
    summary = out.strip().splitlines()[-1]
    assert "hidden states are bit for bit equal with dspark-core's spec's; tokens equal" in summary
    assert summary.endswith("no speed ratio (vLLM's binaries did not run: the line above says why).")
    assert "x as fast" not in out


class _Planted:
    """The stand-in kernels with the final norm's first output element's
    sign bit flipped (every other call as given): a difference in the
    compared hidden states that the comparison must report."""

    def __init__(self, kernels, final_weight) -> None:
        self._k, self._final = kernels, final_weight

    def __getattr__(self, name):
        return getattr(self._k, name)

    def stock_rmsnorm(self, x, w, *args, **kwargs):
        out = self._k.stock_rmsnorm(x, w, *args, **kwargs)
        if w is self._final:
            out.view(torch.int16).view(-1)[0] ^= -0x8000
        return out


@pytest.mark.parametrize("planted", [False, True])
def test_the_dry_stock_path_runs_vllms_step_beside_the_specialized_decode(config, capsys, monkeypatch, planted):
    stock_step = _module("stock_step", ROOT / "scripts" / "stock" / "stock_step.py")
    monkeypatch.setattr(demo, "_build_decode", _kernel_less_decode)
    seen = {}
    real = demo_stock.stock_step

    def spy(model, stock_dir, kernels, attention, pdl):
        seen["pdl"] = pdl
        kernels = stock_step.SpecKernels(model.rotary)
        kernels = _Planted(kernels, model.norm.weight) if planted else kernels
        return real(model, stock_dir, kernels, _spec_attention(model.config), pdl)

    monkeypatch.setattr(demo_stock, "stock_step", spy)
    tokens = demo.run_demo(config, 3, 2, 8, torch.device("cpu"), stock_kernels=object())
    out = capsys.readouterr().out
    assert seen == {"pdl": False}  # no PDL on a CPU
    assert set(tokens) == {"stock", "specialized"}
    assert "stock path, vLLM 0.33.0's draft step on stand-in kernels (attention: the spec attention, both paths): " \
           "3 greedy steps of 2 token(s); a step takes" in out
    assert "no speed ratio" not in out
    summary = out.strip().splitlines()[-1]
    assert "with vLLM's step from its binaries'" in summary
    assert "x as fast as vLLM's (medians of eager steps)" in summary
    if planted:
        assert "hidden states are NOT bit for bit" in summary
    else:
        assert "hidden states are bit for bit equal" in summary and "tokens equal" in summary
        assert tokens["stock"] == tokens["specialized"]


def test_the_binaries_folder_is_bound_to_every_stock_function_the_step_calls(tmp_path):
    launch = demo_stock.load_script("launch_stock")
    rooted = demo_stock._Rooted(launch, tmp_path)
    called = {"stock_rmsnorm", "stock_o_gate", "stock_silu_and_mul", "stock_rotary", "stock_qknorm_rope_kv_insert",
              "stock_reshape_and_cache_flash"}
    source = (ROOT / "scripts" / "stock" / "stock_step.py").read_text()
    assert {name for name in called if f"self.S.{name}(" in source} == called
    for name in called:
        bound = getattr(rooted, name)
        assert bound.func is getattr(launch, name) and bound.keywords == {"root": tmp_path}
        assert "root" in inspect.signature(bound.func).parameters
    assert rooted.DEFAULT_DIR is launch.DEFAULT_DIR  # other names pass through unbound


@pytest.mark.parametrize("error, said", [
    (RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU"), "did not run here (RuntimeError: CUDA_ERROR_NO_BINARY_FOR_GPU)"),
    (FileNotFoundError("rmsnorm.cubin"), "did not run here (FileNotFoundError: rmsnorm.cubin)"),
    (LookupError("no installed backend provides the attention kernel"), "no paged decode attention installed"),
])
def test_binaries_that_do_not_run_leave_the_spec_path_with_the_reason(tmp_path, monkeypatch, error, said):
    (tmp_path / "manifest.json").write_text("{}")

    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(demo_stock, "stock_step", fails)
    stock, label, why = demo._stock_path(None, torch.device("cuda"), tmp_path, None, None)
    assert stock is None and label is None and said in why and "\n" not in why
