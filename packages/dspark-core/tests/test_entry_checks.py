"""Issue 35, item 2: bad input refused where it enters, by the checks written
once in ``dspark_core.checks`` (one int checker, one FP32-finite helper, one
architecture normaliser, typed sets), a regression test per class:

- constants finite in FP64 but not once rounded to FP32 (the Markov output
  transform, the spec's layers);
- an index operand a step would follow out of bounds (the Markov d2t map,
  checked where the loop starts);
- spec layers that returned NaN for what ``DraftConfig`` refuses (a NaN gain
  centre, a RoPE base of 1 or below, attention over a row with no slot);
- silent accepts (sizes no GPU holds, a string as a set, numpy ints);
- unclear refusals (an architecture in another case or empty);
- command lines (a layer count, a size no machine allocates, TP ranks on a
  CPU): one line, no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dspark_core import checks
from dspark_core.contracts import constants as K
from dspark_core.contracts.markov import markov_constants
from dspark_core.errors import Unsupported
from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import DraftConfig, small_config
from dspark_core.reference.model import DraftModel
from dspark_core.spec import layers as L
from dspark_core.spec import markov as SM
from dspark_core.spec.attention import paged_attention

# -- the checks themselves -------------------------------------------------------


@pytest.mark.parametrize("value, error, message", [
    (True, TypeError, "n must be an int, not bool True"),
    (np.bool_(False), TypeError, "n must be an int, not bool"),
    (2.0, TypeError, "n must be an int, not float 2.0"),
    ("8", TypeError, "n must be an int, not str '8'"),
    ("x" * 1000, TypeError, r"not str 'xxx.*\.\.\. \(1002 characters\)$"),
    (0, ValueError, "n must be an int from 1 to 9, not 0"),
    (np.int64(10), ValueError, "n must be an int from 1 to 9, not 10"),
])
def test_an_int_is_an_int_in_its_bounds(value, error, message):
    with pytest.raises(error, match=message):
        checks.integer("n", value, 1, 9)


def test_numpy_ints_are_ints():
    got = checks.integer("n", np.uint8(7), 1, 9)
    assert got == 7 and type(got) is int


@pytest.mark.parametrize("value, kwargs, message", [
    (1e39, {}, r"x must be a number finite in FP32 \(below 3.402824e\+38 in magnitude\), not 1e\+39"),
    (float("nan"), {}, "x must be a number finite in FP32"),
    (3.4028235677973366e38, {}, "finite in FP32"),  # finite in FP64, rounds to inf
    (1e-46, {"low": "positive"}, "x must be a positive number finite in FP32 and positive once rounded to FP32"),
    (1e-46, {"nonzero": True}, "not rounded to 0 in FP32"),
    (1e-39, {"low": "positive", "reciprocal": True}, "with a finite FP32 reciprocal, not 1e-39"),
    (-1e-6, {"low": "non-negative"}, "x must be a non-negative number finite in FP32, not -1e-06"),
    (1.0, {"above": 1.0}, "x must be a number above 1 finite in FP32, not 1.0"),
])
def test_a_number_must_stay_what_it_says_once_rounded_to_fp32(value, kwargs, message):
    with pytest.raises(ValueError, match=message):
        checks.fp32_number("x", value, **kwargs)


def test_a_number_is_no_bool_or_string_and_numpy_numbers_are_numbers():
    for value in (True, "1.0", None, 1j):
        with pytest.raises(TypeError, match="x must be a number, not"):
            checks.fp32_number("x", value)
    assert checks.fp32_number("x", np.float16(2.0)) == 2.0 and checks.fp32_number("x", np.int32(3)) == 3.0
    assert checks.fp32_number("x", 3.4028234663852886e38) == 3.4028234663852886e38  # FP32's largest: kept
    with pytest.raises(Unsupported):
        checks.fp32_number("x", 1e39, error=Unsupported)


@pytest.mark.parametrize("value, arch", [("sm_90a", "sm_90a"), ("SM_90A", "sm_90a"), (" Sm_100A ", "sm_100a"),
                                         ((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((np.int64(9), 0), "sm_90a")])
def test_an_architecture_has_one_spelling(value, arch):
    assert checks.arch("arch", value) == arch


@pytest.mark.parametrize("value, error, message", [
    ("", ValueError, "arch must be a GPU architecture written like sm_90a"),
    ("sm90a", ValueError, "written like sm_90a"),
    ("sm_80", ValueError, "arch must be one of sm_90a, sm_100a, not sm_80"),
    ("sm_90", ValueError, "arch must be one of sm_90a, sm_100a, not sm_90"),  # another compile target
    ((8, 6), ValueError, r"not sm_86 \(\(8, 6\)\)"),
    (None, TypeError, "arch must be a GPU architecture .*not NoneType None"),
    (90, TypeError, "not int 90"),
    ([9, 0], TypeError, r"a compute capability tuple like \(9, 0\)\), not list \[9, 0\]"),
    ((True, 0), TypeError, "arch's major must be an int, not bool"),
])
def test_an_architecture_that_is_none_of_ours_is_refused(value, error, message):
    with pytest.raises(error, match=message):
        checks.arch("arch", value)


def test_another_architecture_is_kept_where_the_caller_refuses_it_later():
    assert checks.arch("arch", "SM_80", known=False) == "sm_80"
    assert checks.arch("arch", (12, 0), known=False) == "sm_120"


def test_a_set_is_no_string():
    """A string as a set of architectures or names is refused, not matched
    by substring (``"sm_90a, sm_100a"`` would contain ``"sm_90"``)."""
    with pytest.raises(TypeError, match="checked must be a set of architectures .*not str 'sm_90a, sm_100a'"):
        checks.arch_set("checked", "sm_90a, sm_100a")
    assert checks.arch_set("checked", ["SM_90A", (10, 0)]) == {"sm_90a", "sm_100a"}
    with pytest.raises(TypeError, match="names must be a set of names"):
        checks.name_set("names", "boundary", {"boundary"})
    with pytest.raises(ValueError, match=r"names names unknown entries \['k000', .*'k009', \.\.\. \(190 more\)\]"):
        checks.name_set("names", [f"k{i:03d}" for i in range(200)], {"boundary"})


# -- constants finite in FP64 but not in FP32 ------------------------------------

@pytest.mark.parametrize("multiplier, soft_cap, message", [
    (1e39, None, "the output multiplier must be a number finite in FP32"),
    (1e-46, None, "the output multiplier must be a number finite in FP32, not rounded to 0"),
    (1.0, 1e39, r"the soft cap .* must be a positive number finite in FP32"),
    (1.0, 1e-46, "the soft cap .* positive once rounded to FP32"),
    (1.0, 1e-39, "the soft cap .* with a finite FP32 reciprocal"),
    (1.0, 0.0, "the soft cap .* must be a positive number"),
])
def test_a_markov_constant_infinite_or_zero_in_fp32_is_refused(multiplier, soft_cap, message):
    """Each would make every logit inf, NaN or 0: draft id 0 at every step."""
    with pytest.raises(ValueError, match=message):
        SM.transform_constants(multiplier, soft_cap)
    with pytest.raises(ValueError, match=message):
        markov_constants(4096, 256, multiplier, soft_cap, False)
    base = torch.zeros(2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        SM.greedy_step(base, base, multiplier, soft_cap, None)


def test_a_markov_constant_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match="the output multiplier must be a number, not str"):
        SM.transform_constants("1.0", None)
    with pytest.raises(TypeError, match="the soft cap .* must be a number, not bool True"):
        SM.transform_constants(1.0, True)


# -- an index operand a step would follow out of bounds --------------------------

def _loop(d2t, vocab=16, targets=20):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, vocab, generator=gen).to(torch.bfloat16)
    w1 = torch.randn(targets, 8, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(vocab, 8, generator=gen).to(torch.bfloat16)
    return SM.greedy_loop(base, torch.tensor([0, 1]), w1, w2, 1.0, None, d2t)


def test_a_d2t_map_past_or_before_the_first_markov_factor_is_refused_before_the_loop():
    assert _loop(torch.full((16,), 4)).shape == (2, 3)  # targets 4 .. 19 of w1's 20 rows
    with pytest.raises(ValueError, match=r"d2t maps draft id 15 to target id 20, outside \[0, 20\) .*; 1 draft ids do"):
        _loop(torch.full((16,), 5))
    with pytest.raises(ValueError, match=r"d2t maps draft id 0 to target id -1, outside \[0, 20\)"):
        _loop(torch.full((16,), -1))
    with pytest.raises(TypeError, match=r"d2t must be an int64 \[16\] tensor"):
        _loop(torch.zeros(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="without a d2t map the draft ids are target ids: a vocabulary of 16, more "
                                         "than w1's 12 rows"):
        _loop(None, targets=12)


def test_a_sampling_map_must_be_one_to_one():
    SM.check_d2t(torch.arange(8) * 0 + 2, 8, 10)  # the greedy step takes a repeated target
    with pytest.raises(ValueError, match="distinct target ids; 7 of them repeat one"):
        SM.check_d2t(-torch.arange(8), 8, 10, distinct=True)


# -- the spec layers refuse what DraftConfig refuses -----------------------------

@pytest.mark.parametrize("build, message", [
    (lambda: L.RMSNorm(2048, gain_center=float("nan")), "the norm's gain center must be a number finite in FP32"),
    (lambda: L.RMSNorm(2048, gain_center=1e39), "the norm's gain center must be a number finite in FP32"),
    (lambda: L.RMSNorm(2048, eps=1e39), "a norm's eps must be a non-negative number finite in FP32"),
    (lambda: L.HeadNorm(64, eps=float("nan")), "a norm's eps must be a non-negative number finite in FP32"),
    (lambda: L.Rotary(64, 16, 0.0), "the RoPE base theta must be a number above 1 finite in FP32, not 0.0"),
    (lambda: L.Rotary(64, 16, -2.0), "the RoPE base theta must be a number above 1"),
    (lambda: L.Rotary(64, 16, 1e39), "the RoPE base theta must be a number above 1 finite in FP32"),
    (lambda: L.GatedResidual(2048, alpha=float("inf")), "the residual alpha must be a number finite in FP32"),
])
def test_a_spec_layer_refuses_a_constant_draftconfig_refuses(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("build, message", [
    (lambda: L.RMSNorm("2048"), "RMSNorm's hidden_size must be an int, not str"),
    (lambda: L.RMSNorm(2048, has_weight="no"), "has_weight must be True or False"),
    (lambda: L.HeadNorm(64.0), "head_dim must be an int, not float"),
    (lambda: L.Rotary(64, True), "max_position must be an int, not bool"),
    (lambda: L.PagedKVCache(np.int64(2), 2, 16, 64, layout=0), "the KV cache layout must be one of"),
    (lambda: L.PagedKVCache(2, 2, 16.0, 64), "the cache's block_size must be an int, not float"),
])
def test_a_spec_layer_refuses_a_parameter_of_another_type(build, message):
    with pytest.raises((TypeError, ValueError), match=message):
        build()


def test_a_spec_layer_refuses_inputs_it_would_cast():
    """Integer and FP64 inputs are refused, not cast (a layer widens BF16,
    FP16 and FP32 to FP32 exactly); float slots are no slots."""
    norm = L.RMSNorm(2048)
    for dtype in (torch.int32, torch.float64):
        with pytest.raises(TypeError, match=f"the norm's input must be a bfloat16, float16 or float32 tensor, not "
                                            f"{dtype}"):
            norm(torch.ones(1, 2048, dtype=dtype))
    with pytest.raises(TypeError, match="the activation's gate-up rows must be"):
        L.silu_and_mul(torch.ones(1, 16, dtype=torch.float64), 8)
    cache = L.PagedKVCache(2, 1, 16, 64)
    k = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="the KV insert's slots must be an integer tensor, not torch.float32"):
        cache.insert(k, k, torch.tensor([1.0]))
    with pytest.raises(TypeError, match="the inserted K must be"):
        cache.insert(k.long(), k, torch.tensor([1]))


def test_attention_over_a_row_without_a_slot_is_refused_by_default():
    cache = L.PagedKVCache(2, 1, 16, 64)
    q = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    slots = torch.tensor([[0, 1], [-1, -1]])
    with pytest.raises(ValueError, match="no valid"):
        paged_attention(q, cache, slots, 1)
    assert paged_attention(q, cache, slots, 1, empty_rows="nan")[1].isnan().all()  # the kernels' 0 / 0
    with pytest.raises(ValueError, match="empty_rows must be 'refuse' or 'nan'"):
        paged_attention(q, cache, slots, 1, empty_rows="zero")


# -- silent accepts ---------------------------------------------------------------

@pytest.mark.parametrize("changes", [{"hidden_size": 2**31 - 2048, "num_layers": 1},
                                     {"num_heads": 2**20, "num_kv_heads": 8},
                                     {"num_layers": 300, "intermediate_size": 65536}])
def test_a_draft_no_gpu_holds_is_planned_stock_with_the_bytes(changes):
    draft = describe(DraftModel(small_config(**changes), device="meta"))
    plan = plan_draft(draft, policy.Target(kernels=policy.ALL_KERNELS))
    assert plan.fused_count()[0] == 0
    assert "GB of layer weights on a rank, more than a GPU holds (192 GB)" in plan.draft_reason


def test_a_config_takes_numpy_numbers_as_python_ones():
    config = small_config(hidden_size=np.int64(2048), num_layers=np.int32(1), rms_norm_eps=np.float32(1e-5))
    assert type(config.hidden_size) is int and type(config.num_layers) is int and type(config.rms_norm_eps) is float
    assert json.loads(config.to_json())["hidden_size"] == 2048
    with pytest.raises(TypeError, match="num_heads must be an int, not bool True"):
        small_config(num_heads=True)


def test_a_target_checks_and_normalises_its_fields():
    assert policy.Target(arch="SM_90A") == policy.Target(arch=(9, 0)) == policy.Target()
    assert policy.Target(tp=np.int64(2)).tp == 2
    with pytest.raises(TypeError, match="Target.kernels must be a set of names"):
        policy.Target(kernels="boundary")
    with pytest.raises(TypeError, match="the excluded kernels must be a set of names"):
        policy.Target().without("boundary")


# -- unclear refusals --------------------------------------------------------------

def test_an_architecture_in_another_case_plans_as_itself():
    draft = describe(DraftModel(small_config(num_layers=1), device="meta"))
    upper = plan_draft(draft, policy.Target(arch="SM_90A", kernels=policy.ALL_KERNELS))
    lower = plan_draft(draft, policy.Target(arch="sm_90a", kernels=policy.ALL_KERNELS))
    assert upper.format() == lower.format() and upper.fused_count() == lower.fused_count()
    assert K.NormConstants(1e-6, None, 0.0, False, "SM_100A").arch == "sm_100a"
    assert K.OGateConstants(np.int64(8), 1e-6).num_heads == 8
    with pytest.raises(Unsupported, match="no stock norm tree is known for ''"):
        K.NormConstants(1e-6, None, 0.0, False, "")


# -- command lines: one line, no traceback ------------------------------------------

def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300)


def test_the_largest_layer_count_plans_and_one_more_is_refused(tmp_path):
    small = {"hidden_size": 2048, "num_heads": 1, "num_kv_heads": 1, "intermediate_size": 8, "vocab_size": 64,
             "max_position": 64}
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**small, "num_layers": 1025}))
    out = _run("dspark_core.planner", str(path))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "num_layers must be from 0 to 1024, not 1025" in out.stderr
    assert DraftConfig.from_dict({**small, "num_layers": 1024}).num_layers == 1024


def test_the_demo_refuses_a_draft_this_machine_cannot_hold_in_one_line(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"hidden_size": 2**31 - 2048, "num_layers": 1, "num_heads": 1, "num_kv_heads": 1,
                                "intermediate_size": 8, "vocab_size": 512}))
    out = _run("dspark_core.demo", "--config", str(path), "--device", "cpu")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "GB, more than this CPU's" in out.stderr.strip().splitlines()[-1]


def test_the_demo_spawns_no_tp_ranks_on_the_cpu(tmp_path):
    """``--tp 2 --device cpu``: no rank is spawned (one per CUDA GPU), the TP1 demo runs, no traceback."""
    from dspark_core.reference.config import small_config

    path = tmp_path / "small.json"
    path.write_text(small_config(num_layers=1).to_json())
    out = _run("dspark_core.demo", "--device", "cpu", "--tp", "2", "--config", str(path), "--steps", "1",
               "--context", "4")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "--tp 2 needs 2 CUDA GPUs and --device cpu asks for none: running the TP1 demo" in out.stdout


def test_the_plan_cli_takes_an_architecture_in_any_case():
    out = _run("dspark_core.planner", "--arch", "SM_100A", "--kernels", "all")
    assert out.returncode == 0 and out.stdout.startswith("DSpark plan for TP1: one GPU of sm_100a"), out.stderr


def test_durations_are_finite_seconds_within_their_bounds():
    """``checks.duration``: the one rule of every timeout (never 0 ns once
    converted, never an overflow, no silent conversion of a string)."""
    from dspark_core import checks

    assert checks.duration("t", 5) == 5.0 and checks.duration("t", np.float32(0.5)) == 0.5
    for bad in (0, -1.0, 1e-12, float("inf"), float("nan"), 1e300, 10**30):
        with pytest.raises(ValueError, match="t must be a number of seconds from"):
            checks.duration("t", bad)
    for bad in ("5", None, True, np.bool_(False), [1]):
        with pytest.raises(TypeError, match="t must be a number of seconds"):
            checks.duration("t", bad)
