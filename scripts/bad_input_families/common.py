"""``scripts/bad_inputs.py``'s shared pieces: the outcome rules (``refusal``,
``refused``, the command-line runners), the ``Case`` and ``Result`` records
and the random draws the families share."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import math
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import test_entry_properties as props
import torch

from dspark_core import checks

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


@contextlib.contextmanager
def _scratch():
    with tempfile.TemporaryDirectory(prefix="dspark-bad-inputs-") as tmp:
        yield Path(tmp)
