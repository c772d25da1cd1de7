"""Issue 35's target, measured: a fresh, seeded set of bad inputs of the
issue's classes, thrown at the four packages' public entries (the API, the
planner's command line, ``python -m dspark_vllm.plan`` where vLLM is
installed, the demo's), each outcome classified:

- ``clear``: refused where it enters: a ValueError or TypeError (the
  project's ``Unsupported`` is one) whose message names the parameter or
  what was expected (cut below 2,000 characters), or the system's OSError
  naming the file for a path that does not exist; a command line's exit
  code 2 with an error line and no traceback; a plan that keeps the part
  stock with the reason; a warning in the log where the issue asks for one
  (a non-mapping ``additional_config``, a near-miss key);
- ``unclear``: another exception, or a message naming nothing of it;
- ``wrong``: taken where it should not be (a plan line that says fused for
  what the build refuses is one);
- ``traceback``: a command line that ended in an exception (or a worker
  that died);
- ``hang``: no outcome within the per-case timeout.

    python scripts/bad_inputs.py [--seed N] [--count N] [--timeout S] [--show wrong,unclear,...]

The cases are drawn with ``random.Random(seed)`` (the seed is printed; the
default is a fresh one), round robin over the families of ``FAMILIES`` (so
any count of at least their number covers each), and run one at a time in a
forked worker process that is replaced after a hang. The entries' lists are
the property tests' (``packages/dspark-vllm/tests/test_entry_properties.py``:
``ENTRIES``, what each parameter takes, the words naming it, ``run_cli``)
and the limit test's host-class checks (``tests/test_limits.py``). Prints the
seed, a table per class and the total; exits 0 (the measurement is the
output; ``tests/test_bad_inputs.py`` asserts on it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import math
import multiprocessing
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# The property tests' module (the entries and their words) and vLLM's test draft (_draft), by name.
sys.path[:0] = [str(ROOT / "packages" / "dspark-vllm" / "tests"), str(ROOT / "tests")]
# vLLM's settings for a plan on a CPU machine (python -m dspark_vllm.plan sets them too, but vLLM is imported
# here first): its CPU platform, the V2 model runner, no hub.
for _key, _value in (("VLLM_TARGET_DEVICE", "cpu"), ("VLLM_USE_V2_MODEL_RUNNER", "1"), ("HF_HUB_OFFLINE", "1"),
                     ("TRANSFORMERS_OFFLINE", "1"), ("VLLM_LOGGING_LEVEL", "ERROR"),
                     ("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "dspark-vllm-tests-cache"))):
    os.environ.setdefault(_key, _value)

import numpy as np  # noqa: E402
import test_entry_properties as props  # noqa: E402
import torch  # noqa: E402

from dspark_core import checks, switches  # noqa: E402
from dspark_core.contracts import markov as KM  # noqa: E402
from dspark_core.planner import policy  # noqa: E402
from dspark_core.reference.config import MAX_LAYERS, DraftConfig, small_config  # noqa: E402

CLASSES = {
    "plan": "plan lines vs build",
    "fp32": "FP32-non-finite constants",
    "index": "out-of-bounds index operands",
    "spec": "spec layers vs DraftConfig",
    "silent": "silent accepts",
    "unclear": "unclear refusals",
    "cli": "command-line input",
}
OUTCOMES = ("clear", "unclear", "wrong", "traceback", "hang")
LONGEST = props.LONGEST
HOME = os.path.realpath(os.path.expanduser("~"))


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


# -- outcomes -------------------------------------------------------------------


def _short(value: object, n: int = 160) -> str:
    text = " ".join(repr(value).split()) if not isinstance(value, str) else " ".join(value.split())
    return text if len(text) <= n else text[:n] + "..."


def named(message: str, words) -> bool:
    """Whether ``message`` names one of ``words`` (the property tests' rule)."""
    return props._named(message, words)


def refusal(error: BaseException, words) -> tuple[str, str]:
    """The outcome of an exception raised for a bad input: clear where it is
    the project's error type and its short message names one of ``words``,
    or the system's OSError naming the file (a path that does not exist)."""
    message = str(error)
    if isinstance(error, (ValueError, TypeError)) and len(message) < LONGEST and named(message, words):
        return "clear", _short(message)
    if isinstance(error, OSError) and error.filename is not None:
        return "clear", f"{type(error).__name__}: {_short(message)}"
    return "unclear", f"{type(error).__name__}: {_short(message)}"


def refused(call, words) -> tuple[str, str]:
    """``call()`` must refuse (``refusal``); a result is wrong."""
    try:
        result = call()
    except Exception as error:  # noqa: BLE001 (classified)
        return refusal(error, words)
    return "wrong", f"accepted: {_short(result)}"


def run_cli(main, argv: list[str]) -> tuple[str, str]:
    """A command line that must refuse: exit code 2 with an error line and no
    traceback is clear, 0 is wrong, an exception a traceback."""
    try:
        code, err = props.run_cli(main, argv)
    except BaseException as error:  # noqa: BLE001 (a traceback on a command line)
        return "traceback", f"{type(error).__name__}: {_short(str(error))}"
    return run_cli_outcome(code, err)


def run_cli_outcome(code, err: str) -> tuple[str, str]:
    lines = err.strip().splitlines()
    if "Traceback" in err:
        return "traceback", _short(err[-300:])
    if code == 2 and lines and "error" in lines[-1] and len(err) < LONGEST:
        return "clear", _short(lines[-1])
    if code == 0:
        return "wrong", f"exit 0: {_short(err[-200:])}"
    return "unclear", f"exit {code}: {_short(err[-200:])}"


def cli_output(main, argv: list[str]) -> tuple[int | str, str, str]:
    """``(exit code, stdout, stderr)`` of ``main(argv)``; the exit code is
    ``"traceback"`` where it raised (stderr then holds the exception)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as done:
            code = done.code
        except BaseException as error:  # noqa: BLE001 (a traceback on a command line)
            return "traceback", out.getvalue(), f"{type(error).__name__}: {error}"
    return code, out.getvalue(), err.getvalue()


@contextlib.contextmanager
def captured_log(name: str):
    """The warnings logged on logger ``name`` inside the block."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger, handler = logging.getLogger(name), Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# -- the cases -------------------------------------------------------------------


@dataclass
class Case:
    cls: str
    label: str
    run: object  # () -> (outcome, detail)


@dataclass
class Result:
    case: Case
    outcome: str
    detail: str
    seconds: float = 0.0


def _fp32_overflow(rng: random.Random, sign: bool = True) -> float:
    """A float that is finite in FP64 but not once rounded to FP32 (or NaN, an infinity)."""
    kind = rng.randrange(4)
    if kind == 0:
        value = rng.uniform(checks.FP32_OVERFLOW, 1e39)
    elif kind == 1:
        value = 10 ** rng.uniform(39, 308)
    elif kind == 2:
        value = rng.choice([math.nan, math.inf])
    else:
        value = rng.uniform(3.4028235677973366e38, 3.4028236e38)
    return -value if sign and rng.random() < 0.5 else value


def _fp32_zero(rng: random.Random) -> float:
    """A positive float that rounds to 0 in FP32."""
    return rng.uniform(1e-60, 7e-46)


def _unicode_digits(rng: random.Random, value: int) -> str:
    """``value`` written with at least one digit of another script (Python's int() reads them)."""
    scripts = ["٠١٢٣٤٥٦٧٨٩", "۰۱۲۳۴۵۶۷۸۹", "०१२३४५६७८९", "০১২৩৪৫৬৭৮৯", "０１２３４５６７８９", "๐๑๒๓๔๕๖๗๘๙",
               "𝟎𝟏𝟐𝟑𝟒𝟓𝟔𝟕𝟖𝟗", "༠༡༢༣༤༥༦༧༨༩"]
    digits = rng.choice(scripts)
    text = list(str(value))
    k = rng.randrange(len(text))
    for i, ch in enumerate(text):
        if i == k or rng.random() < 0.5:
            text[i] = digits[int(ch)]
    return "".join(text)


def _bad_int_text(rng: random.Random, low: int, high: int | None) -> str:
    """Text a command line's int option from ``low`` to ``high`` must refuse."""
    top = high if high is not None else 10**6
    good = rng.randint(low, min(top, low + 64))
    kind = rng.randrange(9)
    if kind == 0:
        return _unicode_digits(rng, good)
    if kind == 1:
        return str(low - 1 - rng.randrange(1000))
    if kind == 2 and high is not None:
        return str(high + 1 + rng.randrange(10**rng.randint(1, 12)))
    if kind == 3:
        return rng.choice(["", " ", "+", "-", "nan", "inf", "eight", "None", "true"])
    if kind == 4:
        return f"{good}.{rng.randrange(10)}"
    if kind == 5:
        return rng.choice([f"{good}e0", f"0x{good:x}", f"{good}_0", f"1_{good}"])
    if kind == 6:
        return str(good) + rng.choice(["a", " 1", ",", "%", "²", "\x00"])
    if kind == 7:
        return "9" * rng.randint(20, 400)
    return rng.choice(["١", "２", "٣", "８", "४"])  # a one-digit value in another script


def _garbled_arch(rng: random.Random) -> str:
    return rng.choice(["", " ", "sm90a", "SM-90A", "sm_9Oa", "hopper", "blackwell", "9.0", "sm_", "sm_90 a", "sm_90b",
                       "sm_1000a", "compute_90a", "sm_90a,sm_100a", "\x00", "sm_80", "sm_90", "sm_120a"])


# -- families: each draws one case ---------------------------------------------
# A family is ``fn(rng) -> Case``; FAMILIES lists them with their class and whether they need vLLM.


def _entries(kind: type, pred=lambda p: True) -> list[tuple]:
    return [(e, name) for e in props.ENTRIES for name, p in e.params.items() if isinstance(p, kind) and pred(p)]


def _entry_case(cls: str, entry, param: str, value, why: str) -> Case:
    def run():
        kwargs = {**entry.valid, param: value}
        with torch.device("meta") if entry.meta else contextlib.nullcontext():
            return refused(lambda: entry.call(**kwargs), props._words(entry, param))

    return Case(cls, f"{entry.name}({param}={_short(value, 60)}): {why}", run)


def _draw_refused(rng: random.Random, pairs: list[tuple], draw) -> tuple:
    """An (entry, param, value) whose parameter must refuse the drawn value."""
    for _ in range(200):
        entry, param = rng.choice(pairs)
        value = draw(rng, entry.params[param])
        if entry.params[param].refuses(value):
            return entry, param, value
    raise RuntimeError("no refused value drawn")


def fam_entry_fp32(rng):
    pairs = _entries(props.Num, lambda p: p.fp32)

    def draw(rng, p):
        return _fp32_zero(rng) if p.positive and rng.random() < 0.3 else _fp32_overflow(rng)

    entry, param, value = _draw_refused(rng, pairs, draw)
    return _entry_case("fp32", entry, param, value, "not finite (or 0) in FP32")


def fam_config_fp32(rng):
    field_, value = rng.choice([("rope_theta", None), ("rms_norm_eps", None), ("norm_gain_center", None),
                                ("norm_overrides", "eps"), ("norm_overrides", "gain_center")])
    number = _fp32_overflow(rng, sign=field_ != "rms_norm_eps")
    if field_ == "norm_overrides":
        change = {"norm_overrides": {"norm": {value: number}}}
        words = [value]
    else:
        change, words = {field_: number}, [field_]
    base = json.loads(small_config().to_json())
    return Case("fp32", f"DraftConfig.from_dict({_short(change, 80)})",
                lambda: refused(lambda: DraftConfig.from_dict({**base, **change}), words))


def fam_markov_fp32(rng):
    from dspark_core.spec import markov as SM

    which = rng.choice(["multiplier", "soft_cap"])
    if which == "multiplier":
        mult, cap = rng.choice([_fp32_overflow(rng), _fp32_zero(rng)]), 30.0
    else:
        mult = 1.0
        cap = rng.choice([_fp32_overflow(rng, sign=False), _fp32_zero(rng), rng.uniform(1e-44, 2.9e-39),
                          -rng.uniform(0, 100), 0.0])
    words = ["multiplier", "output multiplier"] if which == "multiplier" else ["soft cap", "soft_cap"]
    base = torch.zeros(2, 16, dtype=torch.bfloat16)
    calls = {
        "transform_constants": lambda: SM.transform_constants(mult, cap),
        "markov_constants": lambda: KM.markov_constants(4096, 256, mult, cap, False),
        "markov_sample_constants": lambda: KM.markov_sample_constants(64, 128, 16, mult, cap),
        "output_transform": lambda: SM.output_transform(base, mult, cap),
        "greedy_step": lambda: SM.greedy_step(base, base, mult, cap, None),
    }
    name = rng.choice(sorted(calls))
    return Case("fp32", f"{name}(multiplier={mult!r}, soft_cap={cap!r})", lambda: refused(calls[name], words))


def _stub_head(vocab: int, target: int, rank: int, mult=0.0625, cap=30.0, dtype=torch.bfloat16, d2t=True):
    """vLLM's draft as ``dspark_vllm.markov.plan_stage`` reads it (the Markov
    head's weights, the vocabularies, the output transform, the d2t map)."""
    w1 = torch.zeros(max(vocab, target), rank, dtype=torch.bfloat16)
    ids = torch.arange(vocab) * max(1, target // max(vocab, 1))
    m = (ids.clamp(max=target - 1) - torch.arange(vocab)) if d2t else None
    head = SimpleNamespace(markov_w1=SimpleNamespace(weight=w1),
                           markov_w2=SimpleNamespace(weight=torch.zeros(vocab, rank, dtype=torch.bfloat16)))
    return SimpleNamespace(model=SimpleNamespace(markov_head=head),
                           config=SimpleNamespace(draft_vocab_size=vocab, vocab_size=target),
                           output_multiplier=mult, output_soft_cap_temp=cap, draft_id_to_target_id=m,
                           lm_head=SimpleNamespace(weight=torch.zeros(1, 1, dtype=dtype)))


def _build_markov(constants, w1, d2t, rows, sample: bool) -> str | None:
    """The host class's refusal of what a plan fused (dspark-cute's MarkovStep / MarkovSampleStep on the CPU:
    their checks come before any launch), or None where it takes it."""
    from dspark_cute.cutedsl.markov.greedy import MarkovStep
    from dspark_cute.cutedsl.markov.sample import MarkovSampleStep

    try:
        (MarkovSampleStep if sample else MarkovStep)(constants, w1, d2t, rows)
    except (ValueError, TypeError) as error:
        return str(error)
    return None


def fam_plan_markov_contract(rng):
    """The Markov contract (what the planner and the plugin's plan read) against the host class (the build)."""
    kind = rng.choice(["rank past 2048", "rank not a multiple of 8", "vocab not a multiple of 8",
                       "target vocab below the draft's", "target vocab not a multiple of 8"])
    vocab, rank = 8 * rng.randint(1, 64), 8 * rng.randint(1, 32)
    target = vocab + 8 * rng.randint(0, 64)
    if kind == "rank past 2048":
        rank = 8 * rng.randint(257, 1024)
    elif kind == "rank not a multiple of 8":
        rank = rng.choice([r for r in range(1, 2049) if r % 8])
    elif kind == "vocab not a multiple of 8":
        vocab = rng.randint(1, 4096) | 1
        target = max(target, vocab + 7)
    elif kind == "target vocab below the draft's":
        vocab = 8 * rng.randint(2, 64)
        target = vocab - 8 * rng.randint(1, vocab // 8 - 1)
    else:
        target = vocab + rng.randint(1, 7)
    sample = kind.startswith("target") or rng.random() < 0.3
    words = ["rank", "Markov rank", "vocab", "vocabulary", "target vocabulary"]

    def run():
        try:
            if sample:
                c = KM.markov_sample_constants(vocab, target, rank, 1.0, None)
            else:
                c = KM.markov_constants(vocab, rank, 1.0, None, True)
        except Exception as error:  # noqa: BLE001
            return refusal(error, words)
        w1 = torch.zeros(max(vocab, target), rank, dtype=torch.bfloat16)
        d2t = torch.zeros(vocab, dtype=torch.int64)
        built = _build_markov(c, w1, d2t, 4, sample)
        if built is not None:
            return "wrong", f"the contract takes it, the build refuses: {_short(built)}"
        return "wrong", "taken by the contract and the build"

    step = "markov_sample_constants" if sample else "markov_constants"
    return Case("plan", f"{step}: {kind} (vocab {vocab}, target {target}, rank {rank})", run)


def fam_plan_markov_vllm(rng):
    """``dspark_vllm.markov.plan_stage`` (the plan line's and the build's decision) on a head past a limit,
    then the host classes on whatever it fuses."""
    kind = rng.choice(["rows", "checked as a string", "draft vocab above the target's", "rank past 2048",
                       "soft cap not finite in FP32", "multiplier not finite in FP32", "FP16 head"])
    vocab, rank = 8 * rng.randint(2, 48), 8 * rng.randint(1, 32)
    target, rows, checked, sample = vocab + 8 * rng.randint(0, 16), rng.randint(1, 512), {"sm_90a"}, False
    mult, cap, dtype = 0.0625, 30.0, torch.bfloat16
    if kind == "rows":
        rows = rng.choice([0, -rng.randint(1, 10**6), KM.MARKOV_MAX_ROWS + rng.randint(1, 10**7), True, 2.5, "8",
                           np.float32(4)])
    elif kind == "checked as a string":
        checked = rng.choice(["sm_90a", "sm_90a, sm_100a", "sm_90a sm_100a", "{'sm_90a'}"])
    elif kind == "draft vocab above the target's":
        target, sample = vocab - 8 * rng.randint(1, vocab // 8 - 1), True
    elif kind == "rank past 2048":
        rank = 8 * rng.randint(257, 600)
    elif kind == "soft cap not finite in FP32":
        cap = rng.choice([_fp32_overflow(rng, sign=False), _fp32_zero(rng), rng.uniform(1e-44, 2.9e-39)])
    elif kind == "multiplier not finite in FP32":
        mult = rng.choice([_fp32_overflow(rng), _fp32_zero(rng)])
    else:
        dtype = torch.float16
    words = ["checked", "architectures", "max_num_seqs", "rows"]

    def run():
        from dspark_vllm.markov import plan_stage

        model = _stub_head(vocab, target, rank, mult, cap, dtype)
        try:
            planned = plan_stage(model, "sm_90a", rows, checked, checked)
        except Exception as error:  # noqa: BLE001
            return refusal(error, words)
        if sample:
            if planned.sample_reason is not None:
                return "clear", f"probabilistic step: {_short(planned.sample_reason)}"
            built = _build_markov(planned.sample, model.model.markov_head.markov_w1.weight,
                                  model.draft_id_to_target_id, 4, True)
            return "wrong", f"planned fused; the build: {_short(built or 'takes it')}"
        if planned.reason is not None:
            return "clear", _short(planned.reason)
        built = _build_markov(planned.constants, model.model.markov_head.markov_w1.weight,
                              model.draft_id_to_target_id, rows if isinstance(rows, int) else 4, False)
        return "wrong", f"planned fused; the build: {_short(built or 'takes it')}"

    return Case("plan", f"plan_stage: {kind} (vocab {vocab}, target {target}, rank {rank}, rows {rows!r}, "
                        f"checked {checked!r})", run)


def fam_plan_vllm_cli(rng):
    """``python -m dspark_vllm.plan``'s Markov line on a draft or a row count past a Markov step's limit: the
    line must keep vLLM's loop for what the build refuses (or the command refuse it)."""
    kind = rng.choice(["--max-num-seqs past the rows", "Markov rank past 2048", "Markov rank not a multiple of 8",
                       "draft vocab above the target's"])
    argv, change, sampled = [], {}, False
    if kind.startswith("--max-num-seqs"):
        argv = [f"--max-num-seqs={KM.MARKOV_MAX_ROWS + 1 + rng.randrange(2**31 - 1 - KM.MARKOV_MAX_ROWS - 1)}"]
    elif kind == "Markov rank past 2048":
        change = {"markov_rank": 8 * rng.randint(257, 1024)}
    elif kind == "Markov rank not a multiple of 8":
        change = {"markov_rank": rng.choice([r for r in range(1, 2049) if r % 8])}
    else:
        change, sampled = {"draft_vocab_size": 512 + 8 * rng.randint(1, 64)}, True
    argv += rng.choice([[], ["--exact=all"]])

    def run():
        import _draft

        from dspark_vllm import plan

        with _scratch() as tmp:
            folder = tmp / "draft"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(_draft.draft_config(**change)))
            code, out, err = cli_output(plan.main, [str(folder), *argv])
        if code == "traceback" or "Traceback" in err:
            return "traceback", _short(err[-300:])
        if code == 2:
            return run_cli_outcome(code, err)
        line = next((x for x in out.splitlines() if x.startswith("Markov stage:")), "")
        fused = "probabilistic drafting fused" if sampled else "greedy drafting fused"
        if code != 0 or not line:
            return "unclear", f"exit {code}: {_short(err[-200:])}"
        return ("wrong", _short(line)) if fused in line else ("clear", _short(line))

    return Case("plan", f"python -m dspark_vllm.plan: {kind} {change or argv}", run)


def _plan_and_hosts(model):
    """``(core plan, vLLM plan, host refusals of fused parts)`` of the reference draft ``model``."""
    from test_limits import _hosts

    from dspark_core.errors import Unsupported
    from dspark_core.planner.plan import plan_draft
    from dspark_core.reference.adapter import describe
    from dspark_vllm.planning import plan_vllm

    draft = describe(model)
    target = policy.Target(kernels=policy.ALL_KERNELS)
    core, vllm = plan_draft(draft, target), plan_vllm(draft, target, exact=policy.ALL_KERNELS)
    hosts, refusals = _hosts(), []
    for part in core.parts():
        host = hosts.get(type(part.constants).__name__) if part.fused else None
        if host is not None:
            try:
                host(part.constants)
            except Unsupported as error:
                refusals.append(f"{part.name}: {error}")
            except (ValueError, TypeError, RuntimeError):  # an operand the limit test's call leaves out
                pass
    return core, vllm, refusals


def fam_plan_config(rng):
    """A reference draft past a kernel's limit: the planner, the vLLM plan and the host classes must agree,
    and the part stay stock with the reason."""
    kind = rng.choice(["intermediate size", "head width", "KV heads", "hidden width"])
    change = {"num_layers": 1}
    if kind == "intermediate size":
        change["intermediate_size"] = rng.randint(1, 20000) | rng.choice([1, 2, 4])
    elif kind == "head width":
        d = rng.choice([8, 16, 32, 48, 80, 96, 128, 256])
        change.update(head_dim=d, num_heads=8, num_kv_heads=2)
    elif kind == "KV heads":
        kv = rng.choice([3, 5, 6, 7, 12, 24, 48, 64])
        change.update(num_kv_heads=kv, num_heads=kv * rng.choice([1, 2]))
    else:
        change["hidden_size"] = 2048 * rng.randint(1, 3) + 8 * rng.randint(1, 255)
    fields = [k for k in change if k != "num_layers"]

    def run():
        from dspark_core.reference.model import DraftModel

        try:
            model = DraftModel(small_config(**change), device="meta")
        except Exception as error:  # noqa: BLE001
            return refusal(error, fields)
        core, vllm, refusals = _plan_and_hosts(model)
        if refusals:
            return "wrong", f"planned fused, refused by the host class: {_short(refusals[0])}"
        core_reasons = {p.name: p.reason for p in core.parts()}
        vllm_reasons = {p.name: p.reason for p in vllm.parts()}
        differ = [n for n in core_reasons if n in vllm_reasons and core_reasons[n] != vllm_reasons[n]]
        if differ:
            return "wrong", f"the planner and the vLLM plan disagree on {differ[0]}"
        stock = core.refused()
        if not stock:
            return "wrong", "every part planned fused"
        return "clear", _short(stock[0])

    return Case("plan", f"plan_draft vs build: {kind} {change}", run)


def fam_d2t_host(rng):
    """A d2t map pointing past (or before) the first Markov factor, or repeating a target (sampling)."""
    sample = rng.random() < 0.5
    vocab, rank = 8 * rng.randint(2, 64), 8 * rng.randint(1, 8)
    target = vocab + 8 * rng.randint(0, 32)
    ids = torch.tensor(sorted(rng.sample(range(target), vocab)), dtype=torch.int64)
    d2t = ids - torch.arange(vocab)
    i = rng.randrange(vocab)
    kind = rng.choice(["past", "before", "repeat"] if sample else ["past", "before"])
    if kind == "past":
        d2t[i] = target - i + rng.randrange(10**rng.randint(0, 9))
    elif kind == "before":
        d2t[i] = -i - 1 - rng.randrange(10**rng.randint(0, 9))
    else:
        j = (i + 1 + rng.randrange(vocab - 1)) % vocab
        d2t[j] = int(ids[i]) - j

    def run():
        w1 = torch.zeros(target, rank, dtype=torch.bfloat16)
        if sample:
            c = KM.markov_sample_constants(vocab, target, rank, 1.0, None)
        else:
            c = KM.markov_constants(vocab, rank, 1.0, None, True)
        built = _build_markov(c, w1, d2t, 4, sample)
        return ("clear", _short(built)) if built and named(built, ["d2t"]) else \
            ("unclear", _short(built)) if built else ("wrong", "the build takes it")

    return Case("index", f"{'MarkovSampleStep' if sample else 'MarkovStep'}: d2t {kind} (draft id {i}, "
                         f"vocab {vocab}, target {target})", run)


def fam_d2t_spec(rng):
    from dspark_core.spec import markov as SM

    vocab, targets = 8 * rng.randint(1, 8), 8 * rng.randint(1, 8)
    d2t = torch.zeros(vocab, dtype=torch.int64)
    i = rng.randrange(vocab)
    d2t[i] = rng.choice([targets - i + rng.randrange(1000), -i - 1 - rng.randrange(1000)])
    kind = rng.choice(["greedy_loop", "check_d2t"])

    def run():
        if kind == "check_d2t":
            return refused(lambda: SM.check_d2t(d2t, vocab, targets), ["d2t"])
        base = torch.zeros(2, 3, vocab, dtype=torch.bfloat16)
        w1 = torch.zeros(targets, 8, dtype=torch.bfloat16)
        w2 = torch.zeros(vocab, 8, dtype=torch.bfloat16)
        return refused(lambda: SM.greedy_loop(base, torch.tensor([0, 1]), w1, w2, 1.0, None, d2t), ["d2t"])

    return Case("index", f"spec.markov.{kind}: d2t[{i}] = {int(d2t[i])} (vocab {vocab}, {targets} targets)", run)


_MODELS: dict = {}


def _tiny_model(vocab: int):
    from dspark_core.reference.model import DraftModel

    if vocab not in _MODELS:
        _MODELS[vocab] = DraftModel(small_config(num_layers=0, vocab_size=vocab))
    return _MODELS[vocab]


def fam_index_tokens_slots(rng):
    from dspark_core.spec import layers as L
    from dspark_core.spec.attention import paged_attention

    kind = rng.choice(["token ids", "insert slots", "attention slots", "RoPE positions"])
    n = rng.randint(1, 6)
    if kind == "token ids":
        vocab = 8 * rng.randint(1, 8)
        bad, at = rng.choice([vocab + rng.randrange(10**6), -1 - rng.randrange(10**6)]), rng.randrange(n)

        def run():
            ids = torch.arange(n) % vocab
            ids[at] = bad
            return refused(lambda: _tiny_model(vocab).embed_tokens(ids), ["token ids"])

        return Case("index", f"DraftModel.embed_tokens: id {bad} of a vocabulary of {vocab}", run)
    blocks, bs = rng.randint(1, 4), rng.choice([1, 16])
    bad = blocks * bs + rng.randrange(10**rng.randint(0, 8))
    at, col = rng.randrange(n), rng.randrange(3)
    if kind == "insert slots":
        def run():
            cache = L.PagedKVCache(blocks, 1, bs, 64)
            k = torch.zeros(n, 1, 64, dtype=torch.bfloat16)
            slots = torch.full((n,), -1, dtype=torch.int64)
            slots[at] = bad
            return refused(lambda: cache.insert(k, k, slots), ["slot", "slots"])

        return Case("index", f"PagedKVCache.insert: slot {bad} of {blocks * bs}", run)
    if kind == "attention slots":
        def run():
            cache = L.PagedKVCache(blocks, 1, bs, 64)
            q = torch.zeros(n, 1, 64, dtype=torch.bfloat16)
            slots = torch.zeros(n, 3, dtype=torch.int64)
            slots[at, col] = bad
            return refused(lambda: paged_attention(q, cache, slots, 1), ["slot", "attn_slots"])

        return Case("index", f"paged_attention: attention slot {bad} of {blocks * bs}", run)
    max_pos = rng.randint(1, 256)
    pos = rng.choice([max_pos + rng.randrange(10**6), -1 - rng.randrange(10**6)])

    def run():
        rotary = L.Rotary(64, max_pos)
        x = torch.zeros(n, 2, 64, dtype=torch.bfloat16)
        positions = torch.zeros(n, dtype=torch.int64)
        positions[at] = pos
        return refused(lambda: rotary(x, positions), ["positions", "RoPE positions"])

    return Case("index", f"Rotary: position {pos} of a table of {max_pos}", run)


def fam_spec_layers(rng):
    """Parameters DraftConfig refuses, given to the spec's layers (which returned NaN for them)."""
    from dspark_core.spec import layers as L

    kind = rng.choice(["gain centre", "eps", "RoPE base", "residual scale"])
    if kind == "gain centre":
        v = rng.choice([math.nan, _fp32_overflow(rng)])
        return Case("spec", f"RMSNorm(gain_center={v!r})",
                    lambda: refused(lambda: L.RMSNorm(2048, gain_center=v), ["gain center", "gain_center"]))
    if kind == "eps":
        v = rng.choice([math.nan, -rng.uniform(1e-9, 1.0), _fp32_overflow(rng)])
        layer = rng.choice(["RMSNorm", "HeadNorm"])
        make = (lambda: L.RMSNorm(2048, eps=v)) if layer == "RMSNorm" else (lambda: L.HeadNorm(64, eps=v))
        return Case("spec", f"{layer}(eps={v!r})", lambda: refused(make, ["eps"]))
    if kind == "RoPE base":
        v = rng.choice([0.0, 1.0, rng.uniform(-1e6, 1.0), -0.0, math.nan, _fp32_overflow(rng, sign=False)])
        return Case("spec", f"Rotary(theta={v!r})",
                    lambda: refused(lambda: L.Rotary(64, 16, v), ["theta", "RoPE base"]))
    name = rng.choice(["alpha", "beta"])
    v = rng.choice([math.nan, _fp32_overflow(rng)])
    return Case("spec", f"GatedResidual({name}={v!r})",
                lambda: refused(lambda: L.GatedResidual(2048, **{name: v}), [name]))


def fam_spec_empty_rows(rng):
    from dspark_core.spec import layers as L
    from dspark_core.spec.attention import paged_attention

    m, s = rng.randint(1, 6), rng.randint(1, 5)
    empty = rng.randrange(m)

    def run():
        cache = L.PagedKVCache(2, 1, 16, 64)
        q = torch.zeros(m, 1, 64, dtype=torch.bfloat16)
        slots = torch.randint(0, 32, (m, s))
        slots[empty] = -torch.randint(1, 5, (s,))
        return refused(lambda: paged_attention(q, cache, slots, 1), ["attn_slots", "slot"])

    return Case("spec", f"paged_attention: row {empty} of {m} with no valid slot", run)


def _huge_change(rng) -> dict:
    """Sizes below 2^31 whose layer weights no GPU holds (an independent count: above 400 GB in BF16)."""
    kind = rng.choice(["hidden", "heads", "layers", "intermediate"])
    c = {"hidden_size": 2048, "num_layers": 1, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64,
         "intermediate_size": 1024}
    if kind == "hidden":
        c["hidden_size"] = 2048 * rng.randint(2**12, 2**20 - 1)
        c["intermediate_size"] = 8 * rng.randint(2**9, 2**12)
    elif kind == "heads":
        c["num_heads"] = c["num_kv_heads"] = 2 ** rng.randint(16, 20)
    elif kind == "layers":
        c["num_layers"], c["intermediate_size"] = rng.randint(300, MAX_LAYERS), 8 * rng.randint(2**14, 2**18)
    else:
        c["intermediate_size"] = 8 * rng.randint(2**24, 2**27)

    def weight_bytes(c) -> int:
        q, kv = c["num_heads"] * c["head_dim"], c["num_kv_heads"] * c["head_dim"]
        per_layer = c["hidden_size"] * (2 * q + 2 * kv + q) + 3 * c["hidden_size"] * c["intermediate_size"]
        return 2 * c["num_layers"] * per_layer

    while weight_bytes(c) < 4e11:
        c["num_layers"] = min(MAX_LAYERS, 2 * c["num_layers"])
        c["intermediate_size"] *= 2
    return c


def fam_silent_huge(rng):
    change = _huge_change(rng)

    def run():
        from dspark_core.planner.plan import plan_draft
        from dspark_core.reference.adapter import describe
        from dspark_core.reference.model import DraftModel

        try:
            config = small_config(**change)
            plan = plan_draft(describe(DraftModel(config, device="meta")), policy.Target(kernels=policy.ALL_KERNELS))
        except Exception as error:  # noqa: BLE001
            return refusal(error, list(change))
        if plan.fused_count()[0]:
            return "wrong", f"{plan.fused_count()[0]} parts planned fused"
        return "clear", _short(plan.draft_reason or plan.refused()[0])

    return Case("silent", f"plan_draft of a draft no GPU holds: {change}", run)


def fam_silent_cache_path(rng):
    """DSPARK_KERNEL_CACHE naming the home directory or one above it, spelled with doubled slashes, dots,
    trailing slashes."""
    parts = [p for p in HOME.split("/") if p]
    depth = rng.randint(0, len(parts))
    pieces = parts[:depth]
    sep = lambda: rng.choice(["/", "//", "///", "/./", "/.//"])  # noqa: E731
    text = sep() + sep().join(pieces) if pieces else sep()
    if rng.random() < 0.5:
        text += rng.choice(["/", "//", "/.", "/./", "/x/..", "/x/../", "//x//..//"])
    if depth == len(parts) and rng.random() < 0.4:
        text = "~" + rng.choice(["/", "//", "/.", "/./", "//.//", "/x/.."])
    env = {"DSPARK_KERNEL_CACHE": text}
    return Case("silent", f"DSPARK_KERNEL_CACHE={text!r}",
                lambda: refused(lambda: switches.cache_setting("DSPARK_KERNEL_CACHE", Path("/d/k"), env),
                                ["DSPARK_KERNEL_CACHE"]))


@contextlib.contextmanager
def _scratch():
    with tempfile.TemporaryDirectory(prefix="dspark-bad-inputs-") as tmp:
        yield Path(tmp)


def fam_silent_config_path(rng):
    """A config path that is empty, ends in a slash (a file's or a folder's) or doubles its slashes into a
    folder."""
    kind = rng.choice(["empty", "a file with a trailing slash", "a folder with a trailing slash", "a folder"])
    how = rng.choice(["DraftConfig.from_json", "read_json_object"])

    def run():
        from dspark_core.reference.config import read_json_object

        with _scratch() as tmp:
            (tmp / "c.json").write_text(small_config().to_json())
            (tmp / "d").mkdir()
            path = {"empty": "", "a file with a trailing slash": f"{tmp}/c.json/",
                    "a folder with a trailing slash": f"{tmp}//d/", "a folder": f"{tmp}//d"}[kind]
            call = (lambda: DraftConfig.from_json(path)) if how == "DraftConfig.from_json" else \
                (lambda: read_json_object(path, "a draft config"))
            return refused(call, ["path", "directory", "JSON file", "regular file", "config"])

    return Case("silent", f"{how}: {kind}", run)


class _Extra:
    def __init__(self, extra):
        self.additional_config = extra


def fam_silent_additional_config(rng):
    """``additional_config`` that is no mapping, or a key that misses one DSpark reads: said in the log."""
    from dspark_vllm import options

    if rng.random() < 0.5:
        extra = rng.choice([["decode_backend"], "latency_specialized", 7, ("ordered_gemm", True), b"{}", 1.5,
                            [("decode_backend", "auto")]])
        words, label = ["additional_config"], f"additional_config={extra!r}"
    else:
        key = rng.choice(options.KEYS)
        miss = rng.choice([key.upper(), key.replace("_", "-"), f" {key}", f"{key} ", key[:-1], key + "s",
                           key.title(), key.replace("_", ""), key[0].upper() + key[1:]])
        extra, words, label = {miss: rng.choice([True, "auto"])}, [repr(miss), miss], f"the key {miss!r}"
    # (a near miss is said where the key it misses is read)
    read = rng.choice(options.KEYS) if isinstance(extra, (list, str, int, tuple, bytes, float)) else key

    def run():
        options._said.clear()  # each case says it afresh
        with captured_log("vllm.dspark") as said:
            try:
                if read == options.DECODE_BACKEND:
                    options.read(_Extra(extra), read, "auto")
                else:
                    options.switch(_Extra(extra), read)
            except Exception as error:  # noqa: BLE001 (a refusal naming it is clear too)
                return refusal(error, words)
        hits = [m for m in said if any(w in m for w in words)]
        return ("clear", _short(hits[0])) if hits else ("wrong", "read without a word")

    return Case("silent", f"options.read({read!r}) with {label}", run)


def fam_silent_duplicate_keys(rng):
    base = json.loads(small_config().to_json())
    key = rng.choice(sorted(base))
    other = rng.choice([base[key], 1, "x", None, [1], {"a": 1}])
    fields = [f'"{k}": {json.dumps(v)}' for k, v in base.items()]
    at = rng.randrange(len(fields) + 1)
    fields.insert(at, f'"{key}": {json.dumps(other)}')
    text = "{" + ", ".join(fields) + "}"
    how = rng.choice(["DraftConfig.from_json", "dspark-plan"])

    def run():
        with _scratch() as tmp:
            path = tmp / "dup.json"
            path.write_text(text)
            if how == "dspark-plan":
                from dspark_core.planner import cli

                return run_cli(cli.main, [str(path)])
            return refused(lambda: DraftConfig.from_json(str(path)), [repr(key), "repeats"])

    return Case("silent", f"{how}: the key {key!r} twice", run)


def fam_silent_dtype(rng):
    """Inputs of a dtype a layer would cast (integers, FP64), or slots that are no integers."""
    from dspark_core.spec import layers as L

    dtype = rng.choice([torch.int32, torch.int64, torch.float64, torch.int8, torch.uint8, torch.bool,
                        torch.complex64])
    kind = rng.choice(["RMSNorm", "HeadNorm rows", "silu_and_mul", "insert K", "insert slots", "GatedResidual"])
    m, half = rng.randint(1, 4), rng.choice([0.0, 0.5])

    def run():
        x = torch.ones(m, 2048).to(dtype)
        if kind == "RMSNorm":
            return refused(lambda: L.RMSNorm(2048)(x), ["input", "norm"])
        if kind == "HeadNorm rows":
            return refused(lambda: L.qk_norm_rope(torch.ones(m, 2, 64).to(dtype), L.HeadNorm(64)),
                           ["input", "heads", "rows", "norm"])
        if kind == "silu_and_mul":
            return refused(lambda: L.silu_and_mul(torch.ones(m, 16).to(dtype), 8), ["gate-up", "rows", "activation"])
        if kind == "GatedResidual":
            return refused(lambda: L.GatedResidual(2048)(x, x), ["stream", "branch", "residual"])
        cache = L.PagedKVCache(2, 1, 16, 64)
        k = torch.zeros(m, 1, 64, dtype=torch.bfloat16)
        if kind == "insert K":
            return refused(lambda: cache.insert(k.to(dtype), k, torch.arange(m)), ["K", "inserted K"])
        slots = torch.arange(m).to(dtype) if dtype != torch.bool else torch.ones(m, dtype=torch.bool)
        if dtype in (torch.int32, torch.int64, torch.int8, torch.uint8):
            slots = torch.arange(m, dtype=torch.float32) + half
        return refused(lambda: cache.insert(k, k, slots), ["slots"])

    return Case("silent", f"{kind} given {dtype}", run)


def fam_silent_bool_int(rng):
    pairs = _entries(props.Int)

    def draw(rng, p):
        return rng.choice([True, False, np.bool_(True), np.bool_(False)])

    entry, param, value = _draw_refused(rng, pairs, draw)
    return _entry_case("silent", entry, param, value, "a bool as an int")


def fam_silent_huge_int(rng):
    pairs = _entries(props.Int, lambda p: p.high is not None)

    def draw(rng, p):
        v = p.high + 1 + rng.randrange(10**rng.randint(0, 18))
        return np.int64(v) if rng.random() < 0.2 and v < 2**63 else v

    entry, param, value = _draw_refused(rng, pairs, draw)
    return _entry_case("silent", entry, param, value, "beyond what it takes")


def fam_silent_allreduce(rng):
    from dspark_vllm import allreduce

    kind = rng.choice(["tp", "rows", "backend"])
    if kind == "backend":
        var = rng.choice(["VLLM_FLASHINFER_ALLREDUCE_BACKEND", "VLLM_CUSTOM_ALLREDUCE_ALGO"])
        value = rng.choice(["nccl", "MNNVL", " auto", "trtllm ", "", "1stage ", "ONESHOT", "custom", "3stage"])
        return Case("silent", f"all-reduce switches: {var}={value!r}",
                    lambda: refused(lambda: allreduce.switches({var: value}), [var]))
    value = rng.choice([True, False, 10**6 + rng.randrange(10**9), 0, -rng.randint(1, 10**6), 2.0]) if kind == "tp" \
        else rng.choice([0, -rng.randint(1, 10**6), allreduce.MAX_MESSAGE_ROWS + rng.randint(1, 10**8), True, 4.0])
    kwargs = {"tp": 2, "rows": 4, "hidden_size": 8192, "arch": "sm_90a", kind: value}
    return Case("silent", f"allreduce.resolve({kind}={value!r})",
                lambda: refused(lambda: allreduce.resolve(**kwargs), ["TP size", "tp", "row count", "rows"]))


def fam_unclear_types(rng):
    """Values of another type than a parameter takes: the refusal must name it where it enters."""
    pairs = [(e, p) for e in props.ENTRIES for p in e.params]

    def draw(rng, p):
        return rng.choice([None, "8", "", "٣", [8], (8,), {"x": 1}, object(), b"8", 8j, torch.bfloat16,
                           np.array([1, 2]), math.nan, Path("/"), slice(1), "x" * rng.randint(100, 100000)])

    entry, param, value = _draw_refused(rng, pairs, draw)
    return _entry_case("unclear", entry, param, value, "a value of another type")


def fam_unclear_arch(rng):
    from dspark_core.contracts import constants as K

    text = _garbled_arch(rng)
    calls = {
        "checks.arch": lambda: checks.arch("arch", text),
        "Target": lambda: policy.Target(arch=text),
        "NormConstants": lambda: K.NormConstants(1e-6, "bf16", 0.0, False, text),
        "o-gate constants (OGateConstants)": lambda: K.OGateConstants(8, 1e-6, text),
    }
    # A target of another well-formed architecture (sm_80) is planned all stock, by design: only
    # malformed names are bad there.
    well_formed = bool(re.fullmatch(r"sm_\d+a?", text.strip().lower()))
    name = rng.choice([n for n in sorted(calls) if not (well_formed and n == "Target")])
    return Case("unclear", f"{name}: the architecture {text!r}",
                lambda: refused(calls[name], ["arch", "architecture", "stock norm tree", "stock o-gate"]))


def fam_unclear_objects(rng):
    """An object of another kind where an entry takes a draft, a config, a tensor or constants."""
    from dspark_core.planner.plan import plan_draft
    from dspark_core.reference.adapter import describe
    from dspark_core.reference.config import read_json_object
    from dspark_core.reference.model import DraftModel, StepInputs
    from dspark_core.runtime.decode import build_draft_decode
    from dspark_core.spec import layers as L
    from dspark_core.spec import markov as SM
    from dspark_core.spec.attention import paged_attention

    value = rng.choice([None, "x", 5, 2.5, [1, 2], np.zeros(4, dtype=np.float32), {}, b"x", object()])
    i64 = torch.zeros(2, dtype=torch.int64)
    base = torch.zeros(2, 16, dtype=torch.bfloat16)

    def markov_step(*args):
        from dspark_cute.cutedsl.markov.greedy import MarkovStep

        return MarkovStep(*args)

    calls = {
        "plan_draft(draft)": (lambda: plan_draft(value), ["draft"]),
        "describe(model)": (lambda: describe(value), ["model", "DraftModel"]),
        "DraftModel(config)": (lambda: DraftModel(value), ["DraftConfig", "config"]),
        "DraftConfig.from_json(path)": (lambda: DraftConfig.from_json(value), ["path"]),
        "read_json_object(path)": (lambda: read_json_object(value, "a config"), ["path"]),
        "StepInputs(positions)": (lambda: StepInputs(value, i64, torch.zeros(2, 2, dtype=torch.int64)),
                                  ["positions"]),
        "paged_attention(q)": (lambda: paged_attention(value, L.PagedKVCache(1, 1, 16, 64),
                                                       torch.zeros(2, 1, dtype=torch.int64), 1),
                               ["q", "queries"]),
        "greedy_step(base)": (lambda: SM.greedy_step(value, base, 1.0, None, None), ["base", "logits"]),
        "RMSNorm(x)": (lambda: L.RMSNorm(2048)(value), ["input", "norm"]),
        "build_draft_decode(draft)": (lambda: build_draft_decode(value), ["draft"]),
        "check_d2t(d2t)": (lambda: SM.check_d2t(value, 8, 8), ["d2t"]),
        "MarkovStep(constants)": (lambda: markov_step(value, torch.zeros(8, 8, dtype=torch.bfloat16), None),
                                  ["MarkovConstants", "constants"]),
        "MarkovStep(w1)": (lambda: markov_step(KM.markov_constants(8, 8, 1.0, None, False), value, None),
                           ["w1"]),
    }
    name = rng.choice(sorted(calls))
    call, words = calls[name]
    return Case("unclear", f"{name} given {_short(value, 40)}", lambda: refused(call, words))


def fam_unclear_special_file(rng):
    """A config path that is a directory or a FIFO named config.json: said what it is, never read."""
    kind = rng.choice(["directory", "FIFO"])
    how = rng.choice(["DraftConfig.from_json", "dspark-plan"])

    def run():
        with _scratch() as tmp:
            path = tmp / "config.json"
            path.mkdir() if kind == "directory" else os.mkfifo(path)
            if how == "dspark-plan":
                from dspark_core.planner import cli

                return run_cli(cli.main, [str(path)])
            return refused(lambda: DraftConfig.from_json(str(path)), [kind, f"a {kind}"])

    return Case("unclear", f"{how}: config.json is a {kind}", run)


def fam_unclear_unknown_keys(rng):
    n = rng.choice([rng.randint(11, 1000), rng.randint(1000, 200000)])
    prefix = rng.choice(["k", "hidden_", "num_", "x" * 50])

    def run():
        data = {**json.loads(small_config().to_json()), **{f"{prefix}{i}": i for i in range(n)}}
        return refused(lambda: DraftConfig.from_dict(data), ["unknown"])

    return Case("unclear", f"DraftConfig.from_dict with {n} unknown keys", run)


def fam_unclear_tp_table(rng):
    """All-reduce table entries vLLM's tables lack (TP16 on sm_100a had a bare KeyError): answered, no order."""
    from dspark_vllm import allreduce

    tp = rng.choice([16, 32, 64, 12, 6, 3, 5, 7, 128])
    arch = rng.choice(["sm_100a", "sm_90a", "SM_100A", (10, 0)])
    which, rows = rng.choice(["resolve", "decode_order"]), rng.randint(1, 64)

    def run():
        try:
            if which == "resolve":
                got = allreduce.resolve(tp, rows, 8192, arch)
            else:
                got = allreduce.decode_order(tp, arch)
        except Exception as error:  # noqa: BLE001
            return refusal(error, ["TP", "tp", "TP size"])
        if got.sum_order is None and got.why:
            return "clear", f"no order: {_short(got.why)}"
        return "clear", f"order {got.sum_order}"

    return Case("unclear", f"allreduce.{which}(tp={tp}, arch={arch!r})", run)


# -- command lines -------------------------------------------------------------


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


FAMILIES = [
    ("plan", fam_plan_markov_contract, False), ("plan", fam_plan_markov_vllm, True), ("plan", fam_plan_config, False),
    ("plan", fam_plan_vllm_cli, True),
    ("fp32", fam_entry_fp32, False), ("fp32", fam_config_fp32, False), ("fp32", fam_markov_fp32, False),
    ("index", fam_d2t_host, False), ("index", fam_d2t_spec, False), ("index", fam_index_tokens_slots, False),
    ("spec", fam_spec_layers, False), ("spec", fam_spec_empty_rows, False),
    ("silent", fam_silent_huge, False), ("silent", fam_silent_cache_path, False),
    ("silent", fam_silent_config_path, False), ("silent", fam_silent_additional_config, False),
    ("silent", fam_silent_duplicate_keys, False), ("silent", fam_silent_dtype, False),
    ("silent", fam_silent_bool_int, False), ("silent", fam_silent_huge_int, False),
    ("silent", fam_silent_allreduce, False), ("silent", fam_silent_unicode_cli, False),
    ("unclear", fam_unclear_types, False), ("unclear", fam_unclear_arch, False),
    ("unclear", fam_unclear_objects, False),
    ("unclear", fam_unclear_special_file, False), ("unclear", fam_unclear_unknown_keys, False),
    ("unclear", fam_unclear_tp_table, False),
    ("cli", fam_cli_planner, False), ("cli", fam_cli_demo, False), ("cli", fam_cli_vllm_plan, True),
]


def generate(seed: int, count: int, vllm: bool | None = None) -> list[Case]:
    """``count`` cases drawn with ``seed``, round robin over ``FAMILIES``
    (those needing vLLM only where it is installed, or where ``vllm``)."""
    vllm = has_vllm() if vllm is None else vllm
    families = [f for f in FAMILIES if vllm or not f[2]]
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        cls, family, _ = families[i % len(families)]
        case = family(rng)
        assert case.cls == cls, (family.__name__, case.cls)
        cases.append(case)
    return cases


# -- the runner: one case at a time in a forked worker, replaced after a hang ----


def _worker(cases: list[Case], conn) -> None:
    torch.set_num_threads(1)
    from dspark_core import demo

    # The demo's run is stubbed: a case that reaches it was taken (and is wrong), not run for minutes.
    demo.run_demo = lambda *args: None
    demo._run_tp = lambda *args: None
    logging.getLogger().setLevel(logging.ERROR)
    logging.getLogger("vllm.dspark").setLevel(logging.WARNING)
    while True:
        index = conn.recv()
        if index is None:
            return
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                outcome, detail = cases[index].run()
        except BaseException as error:  # noqa: BLE001 (a case that escaped its own classification)
            outcome, detail = "unclear", f"{type(error).__name__}: {_short(str(error))}"
        conn.send((outcome, detail))


def run_cases(cases: list[Case], timeout: float = 60.0, progress=None) -> list[Result]:
    """Each case's ``Result``, run one at a time in a forked worker: a case
    with no outcome in ``timeout`` seconds is a hang (the worker killed and
    replaced), a worker that dies a traceback. ``progress(result)`` after
    each, where given."""
    ctx = multiprocessing.get_context("fork")
    results: list[Result] = []
    worker = conn = None
    for index, case in enumerate(cases):
        if worker is None:
            conn, child = ctx.Pipe()
            worker = ctx.Process(target=_worker, args=(cases, child), daemon=True)
            worker.start()
            child.close()
        start = time.monotonic()
        conn.send(index)
        if conn.poll(timeout):
            try:
                outcome, detail = conn.recv()
            except EOFError:
                worker.join(5)
                outcome, detail = "traceback", f"the worker died (exit code {worker.exitcode})"
                worker = None
        else:
            outcome, detail = "hang", f"no outcome in {timeout:g} s"
        if outcome in ("hang",) or (worker is not None and not worker.is_alive()):
            worker.kill()
            worker.join()
            worker = None
        results.append(Result(case, outcome, detail, time.monotonic() - start))
        if progress is not None:
            progress(results[-1])
    if worker is not None:
        conn.send(None)
        worker.join(10)
    return results


# -- the report ----------------------------------------------------------------


def table(results: list[Result]) -> str:
    counts = {cls: Counter() for cls in CLASSES}
    for r in results:
        counts[r.case.cls][r.outcome] += 1
    total = Counter()
    rows = [f"| class | cases | {' | '.join(OUTCOMES)} | % clear |", "|---|---:|" + "---:|" * (len(OUTCOMES) + 1)]
    for cls, title in CLASSES.items():
        c = counts[cls]
        n = sum(c.values())
        total.update(c)
        if n:
            rows.append(f"| {title} | {n} | {' | '.join(str(c[o]) for o in OUTCOMES)} | {100 * c['clear'] / n:.1f} |")
    n = sum(total.values())
    rows.append(f"| **total** | {n} | {' | '.join(str(total[o]) for o in OUTCOMES)} | "
                f"{100 * total['clear'] / max(n, 1):.1f} |")
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="the draw's seed (default: a fresh one, printed)")
    p.add_argument("--count", type=int, default=360, help="how many cases (default 360)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take before it is a hang")
    p.add_argument("--show", default="unclear,wrong,traceback,hang",
                   help="the outcomes whose cases are listed (comma-separated; 'none' for none)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    vllm = has_vllm()
    print(f"seed {seed}; {args.count} cases; vLLM {'installed' if vllm else 'not installed (its cases left out)'}")
    if vllm:
        import vllm  # noqa: F401 (imported before the worker forks: once, not per worker)

        import dspark_vllm.plan  # noqa: F401
    cases = generate(seed, args.count, vllm)
    start = time.monotonic()
    results = run_cases(cases, args.timeout)
    print(f"ran in {time.monotonic() - start:.0f} s\n")
    print(table(results))
    show = set() if args.show == "none" else set(args.show.split(","))
    listed = [r for r in results if r.outcome in show]
    if listed:
        print()
    for r in listed:
        print(f"- {r.outcome} [{CLASSES[r.case.cls]}] {r.case.label}: {r.detail}")
    return 0


__all__ = ["CLASSES", "FAMILIES", "OUTCOMES", "Case", "Result", "generate", "run_cases", "table"]

if __name__ == "__main__":
    sys.exit(main())
