"""Bad input gets a clear error: a ValueError or TypeError whose sentence
names the argument and what was expected, or the planner's refusal with its
reason; never a silent conversion, a wrong answer or a traceback from a CLI.
A fuzz test over configs asserts one of: a clear error, a plan that refuses
with reasons, or a plan."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import DraftConfig, small_config
from dspark_core.reference.model import DraftModel, StepInputs

CONFIG_ERRORS = [
    ({"use_o_gate": "no"}, TypeError, "use_o_gate must be a bool, not str 'no'"),
    ({"hidden_size": 8192.0}, TypeError, "hidden_size must be an int, not float"),
    ({"num_layers": True}, TypeError, "num_layers must be an int, not bool"),
    ({"rope_theta": float("nan")}, ValueError, "rope_theta must be a number above 1 finite in FP32"),
    ({"rope_theta": 0.0}, ValueError, "rope_theta must be a number above 1 finite in FP32"),
    ({"norm_gain_center": float("nan")}, ValueError, "norm_gain_center must be a number finite in FP32"),
    ({"rms_norm_eps": -1e-6}, ValueError, "rms_norm_eps must be a non-negative number finite in FP32"),
    ({"norm_overrides": {"layers.7.input_norm": {"eps": 1e-5}}}, ValueError, "not a norm of this draft"),
    ({"norm_overrides": {"hidden_nrom": {"eps": 1e-5}}}, ValueError, "not a norm of this draft"),
    ({"norm_overrides": {"norm": {"epsilon": 1e-5}}}, ValueError, r"has unknown keys \['epsilon'\]"),
    ({"norm_overrides": {"norm": {"has_weight": "yes"}}}, TypeError, "norm's has_weight must be a bool"),
    ({"norm_overrides": {"norm": {"gain_center": float("inf")}}}, ValueError,
     "norm's gain_center must be a number finite in FP32"),
    ({"connection_overrides": {"layers.0.add_atn": {"dtype": "bf16"}}}, ValueError, "not a connection"),
    ({"connection_overrides": {"layers.0.add_attn": {"dtype": "int8"}}}, ValueError, "must be {'dtype'"),
    ({"compute_dtype": "bfloat16"}, ValueError, "compute_dtype must be one of"),
    ({"num_heads": 12, "num_kv_heads": 8}, ValueError, "multiple of num_kv_heads"),
    ({"hidden": 8192}, ValueError, r"unknown DraftConfig keys \['hidden'\]"),
]


@pytest.mark.parametrize("changes, error, message", CONFIG_ERRORS)
def test_a_bad_config_value_is_a_clear_error(changes, error, message):
    with pytest.raises(error, match=message):
        DraftConfig.from_dict({**json.loads(small_config().to_json()), **changes})


def test_step_inputs_of_mismatched_lengths_or_dtypes_are_refused():
    with pytest.raises(ValueError, match="positions and slots of \\[m\\]"):
        StepInputs(torch.arange(3), torch.arange(2), torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="attn_slots of \\[m, S\\]"):
        StepInputs(torch.arange(3), torch.arange(3), torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="StepInputs.positions must be an int64 tensor"):
        StepInputs(torch.arange(3.0), torch.arange(3), torch.zeros(3, 4, dtype=torch.int64))


def test_token_ids_outside_the_vocabulary_are_refused():
    model = DraftModel(small_config(num_layers=0, vocab_size=16))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 16\)"):
        model.embed_tokens(torch.tensor([-1]))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 16\)"):
        model.embed_tokens(torch.tensor([16]))
    with pytest.raises(TypeError, match="integer tensor"):
        model.embed_tokens(torch.tensor([1.0]))
    assert model.embed_tokens(torch.tensor([15])).shape == (1, 2048)


def test_a_config_and_its_type_are_checked_by_the_model():
    with pytest.raises(TypeError, match="DraftModel takes a DraftConfig"):
        DraftModel({"hidden_size": 2048})


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (("--tp", "3"), "TP3 does not divide the draft's 64 heads"),
    (("--tp", "0"), "expected an integer from 1 to 1024, not 0"),
    (("--tp", "two"), "expected an integer from 1 to 1024, not 'two'"),
    (("--num-sms", "-5"), "expected an integer from 1 to 1024, not -5"),
    (("--arch", "sm_75"), "the architecture must be one of sm_90a, sm_100a, not sm_75"),
    (("--arch", ""), "the architecture must be a GPU architecture written like sm_90a"),
    (("--tp", "\u0663"), "expected an integer from 1 to 1024, not '\u0663'"),  # ARABIC-INDIC DIGIT THREE
    (("--num-sms", "1_32"), "expected an integer from 1 to 1024, not '1_32'"),
    (("--kernels", "boundry"), "unknown kernels ['boundry']"),
    (("/nonexistent.json",), "No such file"),
    (("--kernels", ""), "--kernels names no kernel; the kernels are"),
    (("--kernels", " , "), "--kernels names no kernel"),
    (("--kernels", "boundary,,row_norm"), "has an empty entry"),
    (("--kernels", "boundary,"), "has an empty entry"),
    (("--kernels", "boundary,boundary"), "--kernels names ['boundary'] more than once"),
    (("--gemv", "--tp", "2"), "--gemv runs at TP1 only"),
    (("--package-gemm",), "--package-gemm runs at TP > 1 only"),
    (("--num-sms", "100000"), "expected an integer from 1 to 1024, not 100000"),
    (("--tp", "99999999999999999999999"), "expected an integer from 1 to 1024"),
    (("/dev/null",), "/dev/null is a character device, not a regular file of DraftConfig fields"),
    (("/tmp",), "/tmp is a directory, not a regular file"),
    (("/tmp/",), "the path of DraftConfig fields must name a JSON file, not '/tmp/' (a trailing slash"),
    (("",), "the path of DraftConfig fields must name a JSON file, not ''"),
])
def test_the_plan_cli_says_a_user_error_in_one_line_and_exits_2(args, message):
    out = _run("dspark_core.planner", *args)
    assert out.returncode == 2, out.stdout
    assert "Traceback" not in out.stderr
    assert message in out.stderr.strip().splitlines()[-1]


def test_the_plan_cli_rejects_a_config_the_model_cannot_build(tmp_path):
    for body, message in (({"hidden_size": 3000}, "multiple of 2048 columns, not 3000"),
                          ([1, 2], "must hold a JSON object"), ("{", "is not JSON")):
        path = tmp_path / "c.json"
        path.write_text(body if isinstance(body, str) else json.dumps(body))
        out = _run("dspark_core.planner", str(path))
        assert out.returncode == 2 and "Traceback" not in out.stderr and message in out.stderr, out.stderr


@pytest.mark.parametrize("text, message", [
    ("[" * 100000 + "]" * 100000, "nests its JSON too deeply"),
    ('{"hidden_size": 99999999999999999999999}', "does not fit in 64 bits"),
    ('{"hidden_size": 4294967296}', "hidden_size must be at most 2147483647"),
    ('{"norm_gain_center": 1e300}', "norm_gain_center must be a number finite in FP32"),
    ('{"rope_theta": NaN}', "NaN is not a JSON number"),
])
def test_the_plan_cli_refuses_pathological_configs_in_one_line(tmp_path, text, message):
    path = tmp_path / "c.json"
    path.write_text(text)
    out = _run("dspark_core.planner", str(path))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_the_plan_cli_refuses_a_fifo_without_waiting_on_it(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    out = _run("dspark_core.planner", str(tmp_path / "fifo"))  # _run's timeout fails a hang
    assert out.returncode == 2 and "fifo is a FIFO, not a regular file" in out.stderr, out.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("module, args", [("dspark_core.planner", ()),
                                          ("dspark_core.demo", ("--steps", "1", "--context", "4"))])
def test_a_full_stdout_is_one_line_not_a_traceback(tmp_path, module, args):
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"hidden_size": 2048, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1024,
                                "vocab_size": 512, "max_position": 1024, "num_layers": 1}))
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", module, *(("--config",) if module.endswith("demo") else ()),
                              str(path), *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert out.returncode in (1, 2) and "Traceback" not in out.stderr and "Exception ignored" not in out.stderr
    assert "No space left on device" in out.stderr.strip().splitlines()[-1], out.stderr


def test_the_plan_cli_survives_a_closed_pipe():
    out = subprocess.run(f"{sys.executable} -m dspark_core.planner --kernels all | head -1", shell=True,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("DSpark plan for") and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("args, message", [
    (("--steps", "0"), "expected a positive integer, not 0"),
    (("--context", "-5"), "expected a positive integer, not -5"),
    (("--block", "17"), "--block must lie in [1, 16]"),
    (("--device", "tpu"), "invalid choice: 'tpu'"),
])
def test_the_demo_says_a_user_error_in_one_line_and_exits_2(args, message):
    out = _run("dspark_core.demo", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert message in out.stderr


def test_the_demo_runs_a_draft_without_layers_and_refuses_a_compute_dtype_it_cannot_run(tmp_path):
    small = {"hidden_size": 2048, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1024,
             "vocab_size": 512, "max_position": 1024}
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**small, "num_layers": 0}))
    out = _run("dspark_core.demo", "--config", str(path), "--steps", "2", "--context", "4")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "built the reference draft (0 layers" in out.stdout and "step 1:" in out.stdout
    for dtype in ("fp16", "fp32"):
        path.write_text(json.dumps({**small, "compute_dtype": dtype}))
        out = _run("dspark_core.demo", "--config", str(path))
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert f"the demo runs drafts of bf16 compute, not '{dtype}'" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU build")
def test_the_demo_refuses_cuda_on_a_cpu_build():
    out = _run("dspark_core.demo", "--device", "cuda")
    assert out.returncode == 2 and "this torch build sees no CUDA GPU" in out.stderr


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    changes=st.fixed_dictionaries({}, optional={
        "hidden_size": st.sampled_from([2048, 3000, 4096, 0, -2048]),
        "num_layers": st.integers(-1, 3),
        "num_heads": st.sampled_from([1, 3, 8, 16, 64]),
        "num_kv_heads": st.sampled_from([0, 1, 2, 3, 8]),
        "head_dim": st.sampled_from([32, 64, 65, 128]),
        "intermediate_size": st.sampled_from([8, 100, 1024]),
        "rope_theta": st.sampled_from([10000.0, 1.0, float("nan"), -5.0]),
        "norm_weight_dtype": st.sampled_from(["bf16", "fp32", "int8"]),
        "norm_has_weight": st.sampled_from([True, False, "no"]),
        "norm_gain_center": st.sampled_from([0.0, 1.0, -0.0, float("inf")]),
        "rms_norm_eps": st.sampled_from([1e-6, 0.0, -1.0, float("nan")]),
        "use_o_gate": st.sampled_from([True, False, 1]),
        "compute_dtype": st.sampled_from(["bf16", "fp16"]),
        "residual_dtype": st.sampled_from(["fp32", "bf16"]),
    }),
    tp=st.sampled_from([1, 2, 3, 4, 8]),
    platform=st.sampled_from(["cuda", "cpu"]),
)
def test_any_config_gives_a_clear_error_a_refusal_or_a_plan(changes, tp, platform):
    try:
        config = DraftConfig.from_dict({**json.loads(small_config().to_json()), **changes})
        draft = describe(DraftModel(config, device="meta"))
        plan = plan_draft(draft, policy.Target(platform=platform, tp=tp, kernels=policy.ALL_KERNELS))
    except (ValueError, TypeError) as error:
        assert str(error) and not isinstance(error, (KeyError, IndexError, AttributeError))
        return
    text = plan.format()
    assert text.startswith("DSpark plan for")
    if plan.draft_reason is not None:
        assert plan.draft_reason in text
    for part in plan.parts():
        assert part.fused or part.reason, part
    if platform == "cuda" and plan.draft_reason is None:
        assert math.isfinite(plan.input_norm.constants.norm.eps) if plan.input_norm.fused else True
