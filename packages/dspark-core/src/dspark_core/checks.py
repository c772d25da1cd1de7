"""The checks a public entry makes of its parameters, written once and called
by every entry of the four packages (the API and the command lines), so that
bad input is refused where it enters, with the project's error types
(``dspark_core.errors``), in a sentence naming the parameter, the value and
what it takes:

- ``integer``: an int, a numpy integer included; a bool, a float, a string
  or anything else is a TypeError, a value outside the bounds a ValueError;
- ``fp32_number``: a number the kernels (and the stock) round to FP32 must
  stay what it says once rounded: finite (``FP32_OVERFLOW``), and where the
  caller needs it positive, non-zero, or of a finite FP32 reciprocal (a soft
  cap of 1e-46 rounds to 0, one of 1e-39 has the reciprocal inf);
- ``duration``: a timeout in seconds, finite and within the caller's
  bounds (never 0 ns once converted, never an overflow);
- ``arch``: the one normaliser of a GPU architecture: ``sm_90a`` in any
  case and the compute capability ``(9, 0)`` are ``sm_90a`` (likewise
  ``sm_100a``); ``sm_90`` (no ``a``: another compile target) is not;
- ``arch_set`` and ``name_set``: a set of architectures or of names is a
  set, frozenset, list or tuple of them (a string is refused: ``"sm_90a"``
  is no set, and testing membership in it would match substrings).

Long collections in a message are cut (``errors.listed``).
"""

from __future__ import annotations

import math
import numbers
import re

import numpy as np

from dspark_core.errors import SHOWN, listed, quoted

# The GPU architectures whose stock arithmetic the spec describes and the
# kernels are built for (re-exported by ``spec.numerics``).
ARCHS = ("sm_90a", "sm_100a")

# The least magnitude that rounds to infinity in FP32 (2^128 - 2^103): a
# number the kernels round to FP32 must lie below it.
FP32_OVERFLOW = (2 - 2**-24) * 2**127


def shown(value: object) -> str:
    """``value``'s type and ``repr`` for a message, the repr cut at ``SHOWN``
    characters (``errors.quoted``): ``str 'sm_90a'``."""
    return f"{type(value).__name__} {quoted(value)}"


def _span(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"from {low} to {high}"
    if low is not None:
        return "that is positive" if low == 1 else f"of at least {low}"
    return f"of at most {high}" if high is not None else ""


def integer(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """``value`` as a Python int: an int or a numpy integer (not a bool,
    whose arithmetic is an int's but whose meaning is not; not a float or a
    string: no silent conversion) from ``low`` to ``high`` (None: no bound).
    TypeError for another type, ValueError for a value out of bounds, each
    naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {shown(value)}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an int {_span(low, high)}, not {value}")
    return value


def as_int(value: object) -> int | None:
    """``value`` as a Python int where it is an int or a numpy integer (not
    a bool, not a float such as 64.0, not a string), else None: for the
    checks that refuse a non-int in their own words."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _f32(value: float) -> float:
    """``value`` rounded to FP32 as a Python float; inf (or NaN) where that
    is not finite, without numpy's overflow warning."""
    return float(np.float32(value)) if abs(value) < FP32_OVERFLOW else math.inf


def fp32_number(name: str, value: object, *, low: str | None = None, above: float | None = None,
                nonzero: bool = False, reciprocal: bool = False, error: type[ValueError] = ValueError) -> float:
    """``value`` as a float, where it is a real number (an int, a float or a
    numpy number; not a bool or a string: TypeError) that the kernels and the
    stock can round to FP32 and still use: finite once rounded (below
    ``FP32_OVERFLOW`` in magnitude: 1e39 is finite here and inf there; NaN
    refused); with ``low="non-negative"`` not below 0; with
    ``low="positive"`` positive once rounded (1e-46 rounds to 0); with
    ``above`` greater than it; with ``nonzero`` not 0 once rounded unless it
    is 0; with ``reciprocal`` its FP32 reciprocal ``1 / f32(value)`` finite
    too (a soft cap is applied through it). ``error`` (ValueError or a
    subclass: the contracts raise ``Unsupported``) for the rest, naming
    ``name``. The value is returned unrounded (the caller rounds it where the
    stock does)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {shown(value)}")
    value = float(value)
    rounded = _f32(value)
    need = {"positive": "a positive number", "non-negative": "a non-negative number"}.get(low, "a number")
    if above is not None:
        need = f"a number above {above:g}"
    why = None
    if not math.isfinite(rounded):
        why = f" (below {FP32_OVERFLOW:.7g} in magnitude)"
    elif (low == "non-negative" and value < 0.0) or (low == "positive" and not value > 0.0) \
            or (above is not None and not value > above):
        why = ""
    elif low == "positive" and not rounded > 0.0:
        why = " and positive once rounded to FP32"
    elif nonzero and value != 0.0 and rounded == 0.0:
        why = ", not rounded to 0 in FP32"
    elif reciprocal and not math.isfinite(_f32(1.0 / rounded)):
        why = " with a finite FP32 reciprocal"
    if why is not None:
        raise error(f"{name} must be {need} finite in FP32{why}, not {value!r}")
    return value


def duration(name: str, value: object, low: float = 1e-6, high: float = 86400.0) -> float:
    """``value`` as seconds: a real number (an int, a float or a numpy
    number; not a bool, a string or None: TypeError) from ``low`` to
    ``high`` (ValueError otherwise: NaN, infinities, 0 and negatives
    included, and a value so small it would become 0 ns). The one rule for
    every timeout a public entry takes, so a wait is never 0 ns (a trap at
    the first poll) and never overflows a conversion to ns."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, not {shown(value)}")
    seconds = float(value)
    if not (math.isfinite(seconds) and low <= seconds <= high):
        raise ValueError(f"{name} must be a number of seconds from {low:g} to {high:g}, not {seconds!r}")
    return seconds


# An architecture written as a name: sm_<major><minor>, with the suffix a of
# the arch-specific targets (sm_90a) or without it (sm_80), in any case.
_ARCH_NAME = re.compile(r"sm_(\d{2,3})(a?)")


def _arch_of(major: int, minor: int) -> str:
    name = f"sm_{major}{minor}"
    return f"{name}a" if f"{name}a" in ARCHS else name


def arch(name: str, value: object, known: bool = True) -> str:
    """The architecture ``value`` in its one spelling, lower case: ``sm_90a``
    or ``sm_100a`` (``ARCHS``) for ``"sm_90a"`` in any case and with
    surrounding blanks, or the compute capability ``(9, 0)`` (a tuple of
    two ints, as ``torch.cuda.get_device_capability`` gives it);
    likewise ``sm_100a`` / ``(10, 0)``. Another architecture (``sm_80``,
    ``sm_90`` without the suffix, ``(8, 6)`` as ``sm_86``) is returned where
    ``known`` is False, else a ValueError naming ``ARCHS``. TypeError for a
    value of another type (None included), ValueError for an empty or
    malformed name, each naming ``name``."""
    if isinstance(value, tuple) and len(value) == 2:
        major = integer(f"{name}'s major", value[0], 0, 99)
        minor = integer(f"{name}'s minor", value[1], 0, 9)
        found = _arch_of(major, minor)
    elif isinstance(value, str):
        match = _ARCH_NAME.fullmatch(value.strip().lower())
        if match is None:
            raise ValueError(f"{name} must be a GPU architecture written like sm_90a (one of {', '.join(ARCHS)}), "
                             f"not {shown(value)}")
        found = f"sm_{match.group(1)}{match.group(2)}"
    else:
        raise TypeError(f"{name} must be a GPU architecture (a name like 'sm_90a' or a compute capability tuple "
                        f"like (9, 0)), not {shown(value)}")
    if known and found not in ARCHS:
        raise ValueError(f"{name} must be one of {', '.join(ARCHS)}, not {found}"
                         + ("" if value == found else f" ({value!r})"))
    return found


def _collection(name: str, value: object, what: str) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, (set, frozenset, list, tuple)):
        raise TypeError(f"{name} must be a set of {what} (a set, frozenset, list or tuple), not {shown(value)}")
    return tuple(value)


def arch_set(name: str, value: object, known: bool = True) -> frozenset[str]:
    """The architectures of ``value``, each normalised by ``arch``: a set,
    frozenset, list or tuple (a string is refused with a TypeError: it is
    no set, and membership in it matches substrings)."""
    return frozenset(arch(f"an entry of {name}", v, known) for v in _collection(name, value, "architectures"))


def name_set(name: str, value: object, names: frozenset[str] | set[str]) -> frozenset[str]:
    """The names of ``value``, a set, frozenset, list or tuple of strings,
    each one of ``names``: TypeError for a string or another type (or an
    entry that is no string), ValueError naming the unknown entries (cut)."""
    entries = _collection(name, value, "names")
    odd = [v for v in entries if not isinstance(v, str)]
    if odd:
        raise TypeError(f"{name} must hold names (strings), not {shown(odd[0])}")
    unknown = set(entries) - set(names)
    if unknown:
        raise ValueError(f"{name} names unknown entries {listed(unknown)}; known: {listed(names, len(names))}")
    return frozenset(entries)


__all__ = ["ARCHS", "FP32_OVERFLOW", "SHOWN", "arch", "arch_set", "duration", "fp32_number", "integer", "name_set",
           "quoted", "shown"]
