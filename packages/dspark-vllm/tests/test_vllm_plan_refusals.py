"""``python -m dspark_vllm.plan`` refuses bad input at once, in one line,
naming the file and key (issue 28): a config that is not an object, missing
or non-positive sizes, KV heads that do not divide the heads, a RoPE base or
eps that is no number finite in FP32, target layer ids of the wrong type or
out of the target's range, the draft as its own target, a target or draft
that is no local folder (never a hub lookup), unknown KV cache layouts,
empty or odd kernel lists and out-of-range TP sizes and SM counts. And the
plugin's switches: near misses of every ``additional_config`` key DSpark
reads, and an ``additional_config`` that is no mapping, are said once in
vLLM's log; a value in another case is a ValueError naming the backend
meant."""

from __future__ import annotations

import json
import logging
import time

import pytest

pytest.importorskip("vllm")

import _draft  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dspark_vllm import deployment, options, planning  # noqa: E402
from dspark_vllm.allreduce import package_gemm_asked  # noqa: E402
from dspark_vllm.plan import check_draft_config, main  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target, draft, _ = _draft.checkpoint_dir(tmp_path_factory, "refusals")
    return target, draft


def _cli(capsys, *args) -> str:
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    err = err.splitlines()[-1]  # after what importing vLLM may log the first time
    assert err.startswith("python -m dspark_vllm.plan: error: "), err
    return err


def _with_draft(dirs, tmp_path, **changes):
    """A draft folder whose config.json is the test draft's with ``changes`` (None: the key removed)."""
    config = _draft.draft_config()
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    folder = tmp_path / "draft"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer from 1 to 2147483647, not 0"),
    ({"num_hidden_layers": -2}, "num_hidden_layers must be an integer from 1"),
    ({"num_hidden_layers": 10**6}, "num_hidden_layers must be at most 1024, not 1000000"),
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer from 1"),
    ({"vocab_size": 0}, "vocab_size must be an integer from 1"),
    ({"hidden_size": 2.5}, "hidden_size must be an integer"),
    ({"hidden_size": None}, "the draft config has no hidden_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads (3) must divide num_attention_heads (8)"),
    ({"rope_theta": -1.0}, "rope_theta must be a positive number finite in FP32, not -1.0"),
    ({"rope_theta": 0}, "rope_theta must be a positive number"),
    ({"rope_theta": 1e300}, "rope_theta must be a positive number finite in FP32"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a non-negative number"),
    ({"target_layer_ids": [0, -1]}, "target_layer_ids [-1] are not layers of the target (0 to 3)"),
    ({"target_layer_ids": [0, 4]}, "target_layer_ids [4] are not layers of the target (0 to 3)"),
    ({"target_layer_ids": [0, "2"]}, "target_layer_ids must be a non-empty list of integer layer ids"),
    ({"target_layer_ids": [True]}, "target_layer_ids must be a non-empty list"),
    ({"target_layer_ids": 2}, "target_layer_ids must be a non-empty list"),
    # vLLM divides by metap.base_width (a ZeroDivisionError) and asserts the mode.
    ({"metap": {"use_metap": True, "metap_mode": "mup", "base_width": 0}},
     "metap.base_width must be a positive number finite in FP32, not 0.0"),
    ({"metap": {"use_metap": True, "metap_mode": "mup", "base_width": 1e-46}}, "positive once rounded to FP32"),
    ({"metap": {"use_metap": True, "metap_mode": "xx"}}, "metap.metap_mode must be 'mup' or 'sp', not str 'xx'"),
    ({"metap": {"use_metap": "yes"}}, "metap.use_metap must be True or False, not str 'yes'"),
    ({"metap": "yes"}, "metap must be an object, not str 'yes'"),
    ({"output_soft_cap_temp": 1e-46}, "output_soft_cap_temp (null or a number) must be a positive number finite "
                                      "in FP32 and positive once rounded to FP32, not 1e-46"),
    ({"output_soft_cap_temp": 1e39}, "output_soft_cap_temp (null or a number) must be a positive number finite"),
])
def test_a_bad_draft_config_is_refused_naming_its_file_and_key(dirs, tmp_path, capsys, changes, message):
    folder = _with_draft(dirs, tmp_path, **changes)
    err = _cli(capsys, folder, "--target", dirs[0])
    assert message in err and str(folder / "config.json") in err


def test_a_config_that_is_not_an_object_or_not_a_regular_file(dirs, tmp_path, capsys):
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text("[1, 2]")
    assert "must hold a JSON object of the draft's config, not list" in _cli(capsys, folder)
    (folder / "config.json").write_text('{"hidden_size": 99999999999999999999999}')
    assert "does not fit in 64 bits" in _cli(capsys, folder)
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()
    assert f"{folder / 'config.json'} is a directory, not a regular file" in _cli(capsys, folder)
    (folder / "config.json").rmdir()
    assert "has no config.json" in _cli(capsys, folder)


def test_a_draft_vllm_cannot_build_is_one_line(dirs, tmp_path, capsys):
    """vLLM's own failure on a checkpoint (here a MoE draft without its
    expert count: an AttributeError deep in the build) is one line naming
    the folder, not a traceback."""
    folder = _with_draft(dirs, tmp_path, moe={"is_enabled": True})
    err = _cli(capsys, folder, "--target", dirs[0])
    assert f"vLLM 0.33.0 cannot build the draft {str(folder)!r}: AttributeError:" in err
    assert "num_experts_per_tok" in err


def test_paths_not_on_disk_fail_at_once_naming_the_path(dirs, tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert f"the draft {str(missing)!r} is not a folder on this machine" in _cli(capsys, missing)
    start = time.monotonic()  # vLLM is imported by now: what remains is the check itself
    err = _cli(capsys, dirs[1], "--target", "meta-llama/Not-Here")
    assert "the target 'meta-llama/Not-Here' is not a folder on this machine" in err
    assert time.monotonic() - start < 30  # at once: no hub lookups and retries
    err = _cli(capsys, dirs[1], "--target", dirs[1])
    assert "--target names the draft's own folder" in err


@pytest.mark.parametrize("args, message", [
    (("--kv-cache-layout", "LBXYZ"), "the KV cache layout 'LBXYZ' is none of vLLM 0.33.0's"),
    (("--kernels", ""), "--kernels names no kernel"),
    (("--kernels", "boundary,,row_norm"), "has an empty entry"),
    (("--exact", "boundary,boundary"), "--exact names ['boundary'] more than once"),
    (("--exact", "boundry"), "--exact names unknown kernels ['boundry']"),
    (("--target-layers", "2"), "target_layer_ids [2] are not layers of the target (0 to 1)"),
])
def test_bad_flags_are_refused(dirs, capsys, args, message):
    assert message in _cli(capsys, dirs[1], *args)


@pytest.mark.parametrize("args", [("--tp", "0"), ("--tp", "2000"), ("--num-sms", "0"), ("--num-sms", "5000"),
                                  ("--target-layers", "0"), ("--target-layers", "1000000000"), ("--tp", "\u0663")])
def test_out_of_range_numbers_are_argument_errors(dirs, capsys, args):
    with pytest.raises(SystemExit) as done:
        main([str(dirs[1]), *args])
    assert done.value.code == 2 and "expected an integer from 1 to" in capsys.readouterr().err


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=st.lists(st.one_of(st.integers(-5, 8), st.booleans(), st.floats(0, 3), st.text(max_size=2)),
                    max_size=4))
def test_target_layer_ids_are_integers_within_the_target(ids):
    config = _draft.draft_config(target_layer_ids=ids)
    good = bool(ids) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 4 for i in ids)
    if good:
        check_draft_config(config, "config.json", 4)
    else:
        with pytest.raises(ValueError, match="config.json: target_layer_ids"):
            check_draft_config(config, "config.json", 4)


class _Config:
    def __init__(self, extra):
        self.additional_config = extra


@pytest.mark.parametrize("key", ["Decode_Backend", "decode-backend", "decode_backend ", " DECODE-BACKEND"])
def test_a_near_miss_of_decode_backend_is_said_once_in_vllms_log(caplog, monkeypatch, key):
    monkeypatch.setattr(options, "_said", set())
    with caplog.at_level(logging.WARNING, logger="vllm.dspark"):
        for _ in range(3):
            assert deployment.decode_backend(_Config({key: "latency_specialized"})) == deployment.AUTO
    said = [r for r in caplog.records if "not 'decode_backend'" in r.getMessage()]
    assert len(said) == 1 and repr(key) in said[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.dspark"):
        assert deployment.decode_backend(_Config({"decode_backend": "auto", "decoder": 1})) == deployment.AUTO
    assert not caplog.records


@pytest.mark.parametrize("asked, key, near", [
    (planning.ordered_gemm_asked, "ordered_gemm", ["Ordered-GEMM", "ordered_gem", "orderedgemm ", "order_gemm"]),
    (package_gemm_asked, "package_gemm", ["package-gemm", "Package_Gemm", "packge_gemm", "package_gemms"]),
    (deployment.decode_backend, "decode_backend", ["decode_backends", "decodebackend", "decode_bakend"]),
])
def test_every_key_dspark_reads_has_its_near_misses_said_once(caplog, monkeypatch, asked, key, near):
    """Each ``additional_config`` key DSpark reads (``options.KEYS``): its
    near misses (case, dashes, blanks, a letter or two) are said once, all
    in one line; another platform's keys and the exact key are not."""
    monkeypatch.setattr(options, "_said", set())
    extra = {k: True for k in near} | {"ascend_scheduler_config": {}, "ordered": 1, "gemm": 2}
    with caplog.at_level(logging.WARNING, logger="vllm.dspark"):
        for _ in range(3):
            # The exact key absent: each keeps its default (the ordered GEMM's at TP1: on).
            assert asked(_Config(extra)) in (False, deployment.AUTO) or asked is planning.ordered_gemm_asked
    said = [r.getMessage() for r in caplog.records if f"not {key!r}" in r.getMessage()]
    assert len(said) == 1 and all(repr(k) in said[0] for k in near), said
    assert "ascend" not in said[0] and "'ordered'" not in said[0] and "'gemm'" not in said[0]
    assert [options.near_miss(k) for k in (*near, key, "ascend_scheduler_config", 7)] == [key] * len(near) + [None] * 3


def test_an_additional_config_that_is_no_mapping_is_said_once_and_read_as_absent(caplog, monkeypatch):
    monkeypatch.setattr(options, "_said", set())
    with caplog.at_level(logging.WARNING, logger="vllm.dspark"):
        for extra in (["decode_backend"], "latency_specialized", ["decode_backend"]):
            assert deployment.decode_backend(_Config(extra)) == deployment.AUTO
            assert planning.ordered_gemm_asked(_Config(extra)) is True  # its default at TP1
            assert planning.ordered_gemm_asked(_Config(extra), 2) is False  # and at TP > 1
        assert deployment.decode_backend(_Config(None)) == deployment.AUTO
    said = [r.getMessage() for r in caplog.records]
    assert said == ["additional_config is a list, not a mapping: the DSpark plugin reads none of its keys "
                    "(decode_backend, package_gemm, ordered_gemm stay their defaults)",
                    "additional_config is a str, not a mapping: the DSpark plugin reads none of its keys "
                    "(decode_backend, package_gemm, ordered_gemm stay their defaults)"]


def test_thousands_of_near_misses_are_said_in_one_cut_line(caplog, monkeypatch):
    monkeypatch.setattr(options, "_said", set())
    letters = "decodebackend"  # every case of them but all-lower: 2^13 - 1 near misses
    extra = {"".join(c.upper() if i >> j & 1 else c for j, c in enumerate(letters)): 1 for i in range(1, 2**13)}
    with caplog.at_level(logging.WARNING, logger="vllm.dspark"):
        assert deployment.decode_backend(_Config(extra)) == deployment.AUTO
    (said,) = [r.getMessage() for r in caplog.records]
    assert f"... ({2**13 - 11} more)]" in said and len(said) < 1000


@pytest.mark.parametrize("value, meant", [("Latency_Specialized", "latency_specialized"), ("AUTO", "auto"),
                                          ("latency_specialized ", "latency_specialized")])
def test_a_value_in_another_case_names_the_backend_meant(value, meant):
    with pytest.raises(ValueError, match=f"not {value!r} \\(did you mean {meant!r}"):
        deployment.decode_backend(_Config({"decode_backend": value}))
    with pytest.raises(ValueError, match="must be one of auto, latency_specialized"):
        deployment.decode_backend(_Config({"decode_backend": "fast"}))
