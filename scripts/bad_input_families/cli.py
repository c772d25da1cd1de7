"""``scripts/bad_inputs.py``'s command-line families: the planner's, the demo's and ``python -m
dspark_vllm.plan``'s."""

from __future__ import annotations

import json
import math
import random
import tempfile
from pathlib import Path

import test_entry_properties as props

from bad_input_families.common import Case, _bad_int_text, _garbled_arch, _scratch, _short, _unicode_digits, run_cli
from dspark_core.planner import policy
from dspark_core.reference.config import MAX_LAYERS


def _small_config_file(tmp: Path, **changes) -> str:
    path = tmp / "small.json"
    path.write_text(json.dumps({**props.SMALL_CONFIG, **changes}))
    return str(path)


def _bad_config_text(rng: random.Random) -> tuple[str, bytes]:
    base = dict(props.SMALL_CONFIG)
    kind = rng.randrange(12)
    if kind == 0:
        return "NaN", json.dumps(base).replace("256", "NaN").encode()
    if kind == 1:
        return "a huge integer", json.dumps(base).replace("512", "9" * rng.randint(20, 5000)).encode()
    if kind == 2:
        depth = rng.randint(2000, 200000)
        return f"{depth} levels of nesting", ("[" * depth + "]" * depth).encode()
    if kind == 3:
        return "no object", rng.choice([b"[]", b"1", b'"x"', b"null", b"true"])
    if kind == 4:
        return "empty", rng.choice([b"", b" ", b"\n"])
    if kind == 5:
        return "not UTF-8", b'{"hidden_size": "\xff\xfe"}'
    if kind == 6:
        key = rng.choice(sorted(base))
        return f"{key} as a string", json.dumps({**base, key: str(base[key])}).encode()
    if kind == 7:
        key = rng.choice(sorted(base))
        return f"{key} as a bool", json.dumps({**base, key: True}).encode()
    if kind == 8:
        return "too many layers", json.dumps({**base, "num_layers": MAX_LAYERS + 1 + rng.randrange(10**9)}).encode()
    if kind == 9:
        key = rng.choice(sorted(base))
        return f"{key} negative", json.dumps({**base, key: -rng.randint(1, 10**6)}).encode()
    if kind == 10:
        return "1e400", json.dumps(base).replace("256", "1e400").encode()
    return "a float size", json.dumps({**base, "hidden_size": 2048.0}).encode()


def _config_cli(main, before: list[str], after: list[str], option: str, value: str, content: bytes | None):
    """``main`` over a config file: the bad ``content`` where given, else the
    small config with ``option=value``."""
    with _scratch() as tmp:
        if content is not None:
            path = tmp / "bad.json"
            path.write_bytes(content)
            return run_cli(main, [*before, str(path), *after])
        return run_cli(main, [*before, _small_config_file(tmp), *after, f"{option}={value}"])


# The int options of the planner's and python -m dspark_vllm.plan's command lines, and what they take.
INT_OPTIONS = {"--tp": (1, policy.MAX_TP), "--num-sms": (1, policy.MAX_SMS), "--target-layers": (1, MAX_LAYERS),
               "--max-num-seqs": (1, 2**31 - 1)}


def _bad_option(rng: random.Random, option: str, kernel_lists: list[str]) -> str:
    """A value ``option`` (an int option, ``--arch``, or a kernel list:
    ``--kernels``, ``--exact``, one of ``kernel_lists``) must refuse."""
    if option in INT_OPTIONS:
        return _bad_int_text(rng, *INT_OPTIONS[option])
    if option == "--arch":
        return _garbled_arch(rng)
    return rng.choice(kernel_lists)


def fam_cli_planner(rng):
    from dspark_core.planner import cli

    option = rng.choice(["--tp", "--num-sms", "--arch", "--kernels", "--attention", "CONFIG", "CONFIG"])
    content = None
    if option in ("--tp", "--num-sms", "--arch", "--kernels"):
        value = _bad_option(rng, option, ["", ",", "boundary,", "boundary,,o_gate", "boundary,boundary", "bondary",
                                          "ALL", " all", "o_gate;boundary", "x" * 5000])
    elif option == "--attention":
        value = rng.choice(["", "Staged", "direct ", "paged", "flash"])
    else:
        value, content = _bad_config_text(rng)

    return Case("cli", f"dspark-plan {option} {_short(value, 60)}",
                lambda: _config_cli(cli.main, [], [], option, value, content))


def fam_cli_demo(rng):
    from dspark_core import demo

    option = rng.choice(["--steps", "--block", "--context", "--tp", "--device", "--stock", "--config"])
    content = None
    if option in ("--steps", "--context"):
        value = _bad_int_text(rng, 1, None)
    elif option == "--block":
        value = _bad_int_text(rng, 1, policy.MAX_DECODE_ROWS)
    elif option == "--tp":
        value = rng.choice([_bad_int_text(rng, 1, 2), _unicode_digits(rng, rng.choice([1, 2]))])
    elif option == "--device":
        value = rng.choice(["", "CPU", "gpu", "cuda:0", "mps"])
    elif option == "--stock":
        value = rng.choice(["", "/nonexistent/stock", "/etc/hostname"])
    else:
        value, content = _bad_config_text(rng)

    def run():
        return _config_cli(demo.main, ["--config"], ["--device", "cpu"], option, value, content)

    return Case("cli", f"demo {option} {_short(value, 60)}", run)


_VLLM_DRAFT: dict = {}


def _vllm_draft() -> Path:
    """A draft checkpoint of vLLM's test draft (config only is read), written once per worker."""
    if "dir" not in _VLLM_DRAFT:
        import _draft

        root = Path(tempfile.mkdtemp(prefix="dspark-bad-inputs-vllm-"))
        draft = root / "draft"
        draft.mkdir()
        (draft / "config.json").write_text(json.dumps(_draft.draft_config()))
        _VLLM_DRAFT["dir"] = draft
    return _VLLM_DRAFT["dir"]


def fam_cli_vllm_plan(rng):
    option = rng.choice(["--tp", "--num-sms", "--target-layers", "--max-num-seqs", "--arch", "--kernels", "--exact",
                         "DRAFT", "CONFIG"])
    change = None
    lists = ["", ",", "boundary,", "boundary,boundary", "bondary", "o_gate;boundary"]
    if option == "--target-layers":  # (a target of a billion layers too)
        value = rng.choice([_bad_option(rng, option, lists), str(10**9 + rng.randrange(10**9))])
    elif option not in ("DRAFT", "CONFIG"):
        value = _bad_option(rng, option, lists)
    elif option == "DRAFT":
        value = rng.choice(["", "/nonexistent/draft", "/", "//", "/etc/hostname", "org/model-on-a-hub"])
    else:
        key, bad = rng.choice([("metap", {"use_metap": True, "metap_mode": "mup", "base_width": 0}),
                               ("metap", {"use_metap": True, "metap_mode": "mup", "base_width": math.inf}),
                               ("metap", {"use_metap": True, "metap_mode": "xx"}), ("metap", "on"),
                               ("num_hidden_layers", 10**6), ("hidden_size", 0), ("num_attention_heads", True),
                               ("rope_theta", -1.0), ("rms_norm_eps", -1e-6), ("output_soft_cap_temp", 1e-40),
                               ("num_key_value_heads", 3), ("target_layer_ids", [0, -1]),
                               ("target_layer_ids", "0,1"), ("vocab_size", 2**40), ("moe", {"is_enabled": True}),
                               ("moe", {"is_enabled": True, "num_experts": 0}), ("head_dim", 2**31),
                               ("max_position_embeddings", -1), ("ffn_dim_multiplier", math.nan)])
        change, value = {key: bad}, f"{key}={bad!r}"

    def run():
        from dspark_vllm import plan

        draft = _vllm_draft()
        if change is not None:
            import _draft

            with _scratch() as tmp:
                folder = tmp / "draft"
                folder.mkdir()
                text = json.dumps(_draft.draft_config(**change)).replace("Infinity", "1e400")
                (folder / "config.json").write_text(text)
                return run_cli(plan.main, [str(folder)])
        argv = [value] if option == "DRAFT" else [str(draft), f"{option}={value}"]
        return run_cli(plan.main, argv)

    return Case("cli", f"python -m dspark_vllm.plan {option} {_short(value, 60)}", run)


def fam_silent_unicode_cli(rng):
    """Unicode digits in a command line's int options: ASCII only."""
    from dspark_core import demo
    from dspark_core.planner import cli

    which = rng.choice(["dspark-plan --tp", "dspark-plan --num-sms", "demo --tp", "demo --steps", "demo --block",
                        "demo --context"])
    prog, option = which.split(" ")
    value = _unicode_digits(rng, rng.choice([1, 2]) if option == "--tp" else rng.randint(1, 16))

    def run():
        with _scratch() as tmp:
            if prog == "demo":
                return run_cli(demo.main, ["--config", _small_config_file(tmp), "--device", "cpu", option, value])
            return run_cli(cli.main, [_small_config_file(tmp), option, value])

    return Case("silent", f"{which} {value!r}", run)


