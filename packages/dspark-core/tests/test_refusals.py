"""Every class of bad input refused at the edge where it enters, with a
sentence naming what was expected (issue 28's classes):

- values finite in a config but infinite in FP32 (eps, gain centers, the
  RoPE base), NaN and negative eps, non-integer counts: the config and the
  kernels' constants (whoever builds them);
- absurd sizes: the config (beyond 32-bit indexing or a tensor's element
  count) and the planner (a description of sizes no kernel takes: the whole
  draft stays stock, with the reason);
- config files that are no JSON object a config can hold (deep nesting,
  integers beyond int64, NaN, special files), never read or parsed past the
  refusal;
- the executor: a plan of another draft or TP size, hidden states of a
  dtype the draft does not take;
- attention over a row whose slots are all masked (0 / 0: a NaN).

Property tests draw each class; every refusal is checked for its words.
"""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_core.contracts import constants as K
from dspark_core.errors import Unsupported
from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft, sizes_unsupported
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import DraftConfig, read_json_object, small_config
from dspark_core.reference.model import DraftModel
from dspark_core.runtime.decode import DraftDecode

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _fp32_finite(x: float) -> bool:
    """Independently of ``K.FP32_OVERFLOW``: whether struct can round ``x`` to FP32."""
    try:
        return math.isfinite(struct.unpack("<f", struct.pack("<f", x))[0])
    except OverflowError:  # struct refuses what rounds to infinity
        return False


# Floats around FP32's overflow threshold, and far beyond it.
NEAR_FP32_MAX = st.one_of(
    st.floats(min_value=3.4e38, max_value=3.41e38),
    st.floats(min_value=1e39, max_value=1e308),
    st.sampled_from([3.4028234663852886e38, 3.4028235677973366e38, 3.402823567797337e38, 1e300, float("inf"),
                     float("nan")]),
)


def test_the_fp32_threshold_is_the_rounding_boundary():
    assert _fp32_finite(math.nextafter(K.FP32_OVERFLOW, 0)) and not _fp32_finite(K.FP32_OVERFLOW)


@FAST
@given(value=NEAR_FP32_MAX, sign=st.sampled_from([1.0, -1.0]),
       field=st.sampled_from(["norm_gain_center", "rms_norm_eps", "head_norm_eps", "rope_theta"]))
def test_a_config_value_infinite_in_fp32_is_refused(value, sign, field):
    value = sign * value
    ok = _fp32_finite(value) and (value >= 0 if "eps" in field else True) and (value > 1 if field == "rope_theta"
                                                                              else True)
    if ok:
        assert getattr(small_config(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=f"{field} must be .*finite"):
            small_config(**{field: value})


def test_a_norm_override_infinite_in_fp32_is_refused():
    with pytest.raises(ValueError, match=r"norm's gain_center must be a number finite in FP32.*1e\+300"):
        small_config(norm_overrides={"norm": {"gain_center": 1e300}})
    with pytest.raises(ValueError, match="hidden_norm's eps must be a non-negative number finite in FP32"):
        small_config(norm_overrides={"hidden_norm": {"eps": 1e39}})


def test_a_config_of_more_layers_than_any_draft_is_refused():
    with pytest.raises(ValueError, match="num_layers must be from 0 to 1024, not 1000000"):
        small_config(num_layers=10**6)
    with pytest.raises(ValueError, match="num_layers must be from 0 to 1024, not 1025"):
        small_config(num_layers=1025)
    with pytest.raises(ValueError, match="num_layers must be from 0 to 1024, not -1"):
        small_config(num_layers=-1)


@FAST
@given(field=st.sampled_from(["hidden_size", "intermediate_size", "num_heads", "head_dim", "kv_block_size",
                              "vocab_size", "max_position"]),
       exponent=st.integers(31, 80))
def test_a_config_size_beyond_32_bits_is_refused(field, exponent):
    with pytest.raises(ValueError, match=f"{field} must be at most 2147483647"):
        small_config(**{field: 2**exponent})


def test_a_config_whose_weights_overflow_a_tensor_is_refused():
    with pytest.raises(ValueError, match=r"num_heads \* head_dim must be at most"):
        small_config(num_heads=2**20, num_kv_heads=1, head_dim=2**12)
    with pytest.raises(ValueError, match="more than a tensor holds"):
        small_config(hidden_size=2**31 - 1, num_heads=2**15, num_kv_heads=2**15, head_dim=2**16 - 1)


# -- the constants: whoever builds them ----------------------------------------

@FAST
@given(eps=st.one_of(NEAR_FP32_MAX, st.floats(max_value=-1e-45), st.just(-0.0), st.floats(0, 1)),
       ctor=st.sampled_from(["norm", "o_gate", "store", "qkv_epilogue", "attention"]))
def test_an_eps_must_be_a_non_negative_number_finite_in_fp32(eps, ctor):
    build = {
        "norm": lambda e: K.NormConstants(e, None, 0.0, False),
        "o_gate": lambda e: K.OGateConstants(8, e),
        "store": lambda e: K.ContextStoreConstants(8, e, True, "fp32"),
        "qkv_epilogue": lambda e: K.QKVEpilogueConstants(8192, 64, 8, False, 1e-6, e, True, "fp32"),
        "attention": lambda e: K.AttentionConstants(64, 8, 64, 16, o_gate_eps=e),
    }[ctor]
    if _fp32_finite(eps) and eps >= 0:
        build(eps)
    else:
        with pytest.raises(Unsupported, match="must be a non-negative number finite in FP32"):
            build(eps)


@FAST
@given(center=NEAR_FP32_MAX, sign=st.sampled_from([1.0, -1.0]))
def test_a_gain_center_must_be_finite_in_fp32(center, sign):
    if _fp32_finite(sign * center):
        assert K.NormConstants(1e-6, "bf16", sign * center, False).gain_center == sign * center
    else:
        with pytest.raises(Unsupported, match="NormConstants.gain_center must be a number finite in FP32"):
            K.NormConstants(1e-6, "bf16", sign * center, False)


@FAST
@given(heads=st.one_of(st.floats(allow_nan=False), st.booleans(), st.text(max_size=3), st.none()))
def test_a_count_that_is_not_an_int_is_a_type_error(heads):
    for build in (lambda h: K.OGateConstants(h, 1e-6), lambda h: K.AttentionConstants(h, 8, 64, 16),
                  lambda h: K.QKVEpilogueConstants(8192, h, 8, False, 1e-6, 1e-6, True, "fp32"),
                  lambda h: K.MlpActivationConstants(h)):
        with pytest.raises(TypeError, match="must be an int, not"):
            build(heads)


@pytest.mark.parametrize("build, message", [
    (lambda: K.AttentionConstants(2**20, 8, 64, 16), "num_heads of 1048576, more than the kernels take"),
    (lambda: K.AttentionConstants(64, 8, 64, 2**62), "block_size of 4611686018427387904, more than"),
    (lambda: K.MlpActivationConstants(2**31), "intermediate_size of 2147483648, more than"),
    (lambda: K.GemvConstants("o_proj", 2**31, 8192), "GemvConstants.n of 2147483648"),
    (lambda: K.NormConstants(1e-6, None, 0.0, False, "sm_80"), "no stock norm tree is known for 'sm_80'"),
    (lambda: K.OGateConstants(8, 1e-6, "sm_120a"), "no stock o-gate is known for 'sm_120a'"),
    (lambda: K.AttentionConstants(64, 8, 64, 16, o_gate_eps=1e-6, o_gate_arch="sm_89"), "no stock o-gate"),
])
def test_constants_beyond_the_kernels_are_refused(build, message):
    with pytest.raises(Unsupported, match=message):
        build()


# -- the planner: sizes no kernel takes ----------------------------------------

@pytest.fixture(scope="module")
def meta_draft():
    return describe(DraftModel(small_config(), device="meta"))


@FAST
@given(what=st.sampled_from(["hidden", "intermediate", "heads", "kv_heads", "head_dim", "block"]),
       exponent=st.integers(20, 62), layer=st.integers(0, 1))
def test_the_planner_refuses_absurd_sizes_with_the_reason(meta_draft, what, exponent, layer):
    draft = describe(DraftModel(small_config(), device="meta"))
    a, mlp = draft.layers[layer].attention, draft.layers[layer].mlp
    n = 2**exponent
    if what == "hidden":
        draft.hidden_size = n
    elif what == "intermediate":
        mlp.intermediate_size = n
    elif what == "heads":
        a.num_heads = n
    elif what == "kv_heads":
        a.num_kv_heads = n
    elif what == "head_dim":
        a.head_dim = n
    else:
        a.kv_block_size = n
    beyond = n > (K.MAX_SIZE if what in ("hidden", "intermediate", "block") else K.MAX_HEADS)
    reason = sizes_unsupported(draft)
    if not beyond:
        return  # within the limits: other refusals (widths, groups) are the planner's ordinary ones
    assert reason is not None and str(n) in reason and "more than the kernels take" in reason
    plan = plan_draft(draft, policy.Target())
    assert plan.draft_reason == reason and not any(p.fused for p in plan.parts())
    assert reason in plan.format()


def test_an_eps_of_1e300_keeps_its_norms_stock(meta_draft):
    draft = describe(DraftModel(small_config(), device="meta"))
    draft.layers[1].attention_boundary.post.eps = 1e300
    plan = plan_draft(draft, policy.Target())
    refused = [p for p in plan.boundaries if not p.fused]
    assert [p.name for p in refused] == [draft.layers[1].attention_boundary.name]
    assert "NormConstants.eps must be a non-negative number finite in FP32" in refused[0].reason
    assert sum(p.fused for p in plan.boundaries) == len(plan.boundaries) - 1


# -- config files --------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ("[" * 100000 + "]" * 100000, "nests its JSON too deeply"),
    ('{"hidden_size": 99999999999999999999999}', "does not fit in 64 bits"),
    ('{"hidden_size": -9223372036854775809}', "does not fit in 64 bits"),
    ('{"rope_theta": NaN}', "NaN is not a JSON number"),
    ('{"rope_theta": -Infinity}', "-Infinity is not a JSON number"),
    ('{"rope_theta": 1e999}', "the number 1e999 is not finite"),
    ('{"a": 1} trailing', "Extra data"),
    ("[1, 2]", "must hold a JSON object of DraftConfig fields, not list"),
    ('"text"', "not str"),
    ('{"hidden_size": 2048, "hidden_size": 4096}', r"an object repeats the keys \['hidden_size'\]"),
    ('{"norm_overrides": {"norm": {"eps": 1, "eps": 2}}}', r"repeats the keys \['eps'\]"),
])
def test_pathological_json_is_a_value_error_naming_the_file(tmp_path, text, message):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as refused:
        DraftConfig.from_json(path)
    assert str(path) in str(refused.value)


def test_a_file_that_is_not_utf8_or_too_large_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        read_json_object(path, "x")
    import dspark_core.reference.config as config_module

    path.write_text(json.dumps({"pad": "x" * 100}))
    monkeypatch.setattr(config_module, "MAX_JSON_BYTES", 64)
    with pytest.raises(ValueError, match="more than a config's 64"):
        read_json_object(path, "x")


def test_an_empty_path_or_one_ending_in_a_slash_is_no_config_file(tmp_path):
    (tmp_path / "c.json").write_text("{}")
    for path in ("", f"{tmp_path}/c.json/", "./"):
        with pytest.raises(ValueError, match=f"the path of DraftConfig fields must name a JSON file, not {path!r}"):
            DraftConfig.from_json(path)
    assert DraftConfig.from_json(f"{tmp_path}//./c.json") == DraftConfig()


def test_a_long_list_of_unknown_keys_is_cut():
    with pytest.raises(ValueError) as refused:
        DraftConfig.from_dict({f"k{i:06d}": 0 for i in range(200_000)})
    message = str(refused.value)
    assert message.startswith("unknown DraftConfig keys ['k000000', 'k000001', ") and len(message) < 300
    assert message.endswith(", ... (199990 more)]")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_special_files_are_refused_unread(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would block: it must not be opened
    for path in (fifo, tmp_path, "/dev/null", "/dev/zero"):
        if not os.path.exists(path):
            continue
        with pytest.raises(ValueError, match="is a (FIFO|directory|character device), not a regular file"):
            DraftConfig.from_json(path)
    with pytest.raises(FileNotFoundError):
        DraftConfig.from_json(tmp_path / "missing.json")


# -- the executor --------------------------------------------------------------

class _Kernel:
    """A host class that binds and never launches (the refusals come first)."""

    def __init__(self, *args, **kwargs):
        pass

    def prepare(self, *args, **kwargs):
        pass


def test_the_executor_refuses_a_plan_of_another_draft_or_tp_size():
    draft = describe(DraftModel(small_config(num_layers=1), device="meta"))
    other = describe(DraftModel(small_config(num_layers=1, hidden_size=4096), device="meta"))
    with pytest.raises(ValueError, match="a plan made for a hidden size of 4096 for a draft of 2048"):
        DraftDecode(draft, plan_draft(other, policy.Target()))
    with pytest.raises(ValueError, match="a plan made for TP2 for a draft run at TP1"):
        DraftDecode(draft, plan_draft(draft, policy.Target(tp=2)))
    with pytest.raises(ValueError, match="a plan of 4 boundaries for a draft of 1 layers"):
        DraftDecode(draft, plan_draft(describe(DraftModel(small_config(), device="meta")), policy.Target()))


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.int32, torch.int64, torch.float64,
                                   torch.float16, torch.uint8])
def test_the_executor_refuses_hidden_states_of_another_dtype(dtype):
    model = DraftModel(small_config(num_layers=1))
    draft = describe(model)
    decode = DraftDecode(draft, plan_draft(draft, policy.Target().without(policy.ALL_KERNELS)))
    decode.prepare()
    with pytest.raises(TypeError, match=f"hidden states of torch.bfloat16 or torch.float32, not {dtype}"):
        decode.run(torch.zeros(1, 2048, dtype=dtype), None)


def test_bad_targets_are_refused():
    for changes, error, message in (
            ({"num_sms": 100000}, ValueError, r"Target.num_sms \(the SM count\) must be an int from 1 to 1024"),
            ({"num_sms": 0}, ValueError, "the SM count"), ({"tp": 2048}, ValueError, "TP size.* from 1 to 1024"),
            ({"tp": 2.0}, TypeError, r"Target.tp \(the TP size\) must be an int, not float 2.0"),
            ({"num_sms": True}, TypeError, "the SM count.* not bool True"),
            ({"arch": ""}, ValueError, "Target.arch must be a GPU architecture written like sm_90a"),
            ({"arch": None}, TypeError, "Target.arch must be a GPU architecture"),
            ({"kernels": "boundary"}, TypeError, "Target.kernels must be a set of names .*, not str 'boundary'"),
            ({"kernels": {"boundry"}}, ValueError, r"Target.kernels names unknown entries \['boundry'\]"),
            ({"declined": {policy.BOUNDARY}}, ValueError, "Target.declined .opt-in kernels only. names unknown")):
        with pytest.raises(error, match=message):
            policy.Target(**changes)


# -- attention over no slot ----------------------------------------------------

@pytest.fixture(scope="module")
def one_layer():
    return DraftModel(small_config(num_layers=1))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 4), s=st.integers(1, 40), row=st.integers(0, 3), data=st.data())
def test_attention_over_a_row_with_no_valid_slot_is_refused(one_layer, m, s, row, data):
    from dspark_core.reference.model import StepInputs, attend, check_inputs
    from dspark_core.spec.attention import paged_attention

    model, row = one_layer, row % m
    caches = model.make_caches(4)  # 64 slots
    slots = torch.tensor(data.draw(st.lists(st.lists(st.integers(-3, 63), min_size=s, max_size=s),
                                            min_size=m, max_size=m)), dtype=torch.int64)
    slots[row] = -1 - torch.arange(s) % 3  # every slot of this row masked
    step = StepInputs(torch.arange(m), torch.arange(m) + 32, slots)
    q = torch.zeros(m, 8, 64, dtype=torch.bfloat16)
    assert paged_attention(q, caches[0], slots, 2, empty_rows="nan")[row].isnan().all()  # the kernels' 0 / 0 ...
    with pytest.raises(ValueError, match="no valid"):  # ... which the spec refuses by default ...
        paged_attention(q, caches[0], slots, 2)
    with pytest.raises(ValueError, match="no valid"):  # ... as do the reference draft's edges
        attend(q, caches[0], slots, 2)
    with pytest.raises(ValueError, match="no valid"):
        check_inputs(model, step.positions, caches, step.slots, step.attn_slots)
    with pytest.raises(ValueError, match="no valid"):
        model.forward(torch.zeros(m, 2048, dtype=torch.bfloat16), step, caches)
    for r in range(m):  # one valid slot a row: attended, no NaN
        slots[r, data.draw(st.integers(0, s - 1))] = 5
    assert not paged_attention(q, caches[0], slots, 2).isnan().any()


# -- the planner's cost --------------------------------------------------------

def _planning_calls(layers: int) -> int:
    """Python calls to describe, plan and print a draft of ``layers`` layers
    (a count, not a time: the same on any machine and load)."""
    import cProfile
    import pstats

    config = small_config(num_layers=layers)
    profile = cProfile.Profile()
    profile.enable()
    plan_draft(describe(DraftModel(config, device="meta")), policy.Target()).format()
    profile.disable()
    return pstats.Stats(profile).total_calls


def test_the_planner_is_linear_in_the_layer_count():
    _planning_calls(2)  # imports and per-class caches first
    small, large = _planning_calls(40), _planning_calls(160)
    print(f"calls: 40 layers {small}, 160 layers {large}")
    assert large <= 4.05 * small, (small, large)
