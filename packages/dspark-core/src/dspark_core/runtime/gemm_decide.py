"""The build-time decision that follows the order check: at each row count
where DSpark's GEMM gives cuBLAS's bits (``gemm_check``), is it also faster
than cuBLAS on this card? DSpark's kernel runs a row count only where it is;
cuBLAS keeps the others, with the times that decided it.

Nothing here is a rule drawn from another card: cuBLAS's kernel and split
change with the card, the shape, the row count and the library build, and so
does which side is faster (an H200 had the ordered GEMM at parity over the
draft's 14 projections where an H100 had it 1.07x ahead). So the deciding is
done by timing, on the user's GPU, at build:

- ``measure(rows, sides, rounds)``: for each row count, every side's
  time-once function (``sides[name](m)``: µs per call, or None where that
  side cannot run ``m``) is called ``rounds`` times, the sides alternating
  within each round (so a drift of the clocks or of the card's temperature
  touches them alike), and each side's median kept;
- ``decide_row(m, cublas_us, candidates, margin)``: DSpark's fastest
  candidate where cuBLAS's time is at least ``1 + margin`` times its own
  (``MARGIN``: a gain below the timings' spread is no gain), else cuBLAS;
- ``GemmDecision``: one projection's decisions, summarised as row-count
  ranges for the plan line and the log.

The times are cached on disk (``DecisionCache``), one file a row count,
keyed by the card (``dspark_core.tools.card.CardFacts.key``: name, SMs,
driver, cuBLAS, torch), the kernels' own fingerprint (their sources), the
weight's shape and the row count, so a restart re-times nothing. The
decision is made again from the cached times (a changed margin applies at
once). ``DSPARK_DECISION_CACHE``: unset uses ``~/.cache/dspark/decisions``
(``$XDG_CACHE_HOME/dspark/decisions`` for an absolute ``XDG_CACHE_HOME``),
an absolute path or ``~/dir`` names the directory, one of
``dspark_core.switches.OFF``'s words turns it off (every build re-times).
A cached time can only choose between kernels that both give cuBLAS's bits
(the order check runs at every build, uncached): a damaged or forged file
can cost speed, never a token; an unreadable one is ignored and re-timed,
logged once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dspark_core import checks, switches
from dspark_core.contracts.limits import ORDERED_GEMM_DECIDE_MARGIN
from dspark_core.errors import spans

log = logging.getLogger("dspark.decode")

# DSpark's kernel runs a row count where cuBLAS's median time is at least
# (1 + MARGIN) times its own (the contract's, which the plan states).
MARGIN = ORDERED_GEMM_DECIDE_MARGIN
# Rounds of the alternating timing (each side's median of them is kept).
ROUNDS = 3
CUBLAS = "cuBLAS"
# The most row counts one decision covers (the ordered GEMM's limit).
MAX_ROWS = 64


def _positive_time(what: str, value: object) -> float:
    """``value`` as µs: a real number, positive and finite (TypeError,
    ValueError naming ``what``)."""
    return checks.fp32_number(f"{what} (µs)", value, low="positive")


def _margin(value: object) -> float:
    value = checks.fp32_number("a decision's margin", value, low="non-negative")
    if not value < 1:
        raise ValueError(f"a decision's margin is a number from 0 to below 1, not {value!r}")
    return value


@dataclass(frozen=True)
class RowDecision:
    """One row count's decision: ``kernel`` is the DSpark candidate taken
    (None: cuBLAS keeps the row count), ``cublas_us`` cuBLAS's median time
    and ``times_us`` each candidate's, as ``(name, µs)`` pairs."""

    m: int
    kernel: str | None
    cublas_us: float
    times_us: tuple[tuple[str, float], ...]
    margin: float = MARGIN

    @property
    def best(self) -> tuple[str, float] | None:
        """The fastest DSpark candidate ``(name, µs)``, None where none ran."""
        return min(self.times_us, key=lambda t: t[1]) if self.times_us else None

    @property
    def ratio(self) -> float | None:
        """cuBLAS's time over the fastest candidate's (above 1: DSpark faster)."""
        best = self.best
        return None if best is None else self.cublas_us / best[1]

    def reason(self) -> str:
        """Why cuBLAS keeps this row count (or why DSpark's kernel runs it), in words."""
        best = self.best
        if best is None:
            return f"m = {self.m}: no DSpark candidate runs this row count; cuBLAS keeps it"
        name, us = best
        ratio = f"{self.cublas_us:.2f} µs for cuBLAS against {us:.2f} for DSpark's {name} kernel " \
                f"({self.cublas_us / us:.3f}x)"
        if self.kernel is None:
            return f"cuBLAS kept at m = {self.m}: {ratio}, not {1 + self.margin:.2f}x or more"
        return f"DSpark's {self.kernel} kernel at m = {self.m}: {ratio}"

    def as_record(self) -> dict:
        """The times as a cache record (the decision itself is re-made on load)."""
        return {"m": self.m, "cublas_us": self.cublas_us, "times_us": dict(self.times_us)}


def decide_row(m: int, cublas_us: float, candidates: Mapping[str, float], margin: float = MARGIN) -> RowDecision:
    """The decision at ``m`` rows from cuBLAS's time and each DSpark
    candidate's (µs; module docstring). ValueError for a time that is not a
    finite positive number, a margin outside [0, 1) or a candidate named
    like cuBLAS."""
    m = checks.integer("the row count m", m, 1, MAX_ROWS)
    cublas_us = _positive_time(f"cuBLAS's time at m = {m}", cublas_us)
    margin = _margin(margin)
    if not isinstance(candidates, Mapping):
        raise TypeError(f"the candidates' times are a mapping of name to µs, not {type(candidates).__name__}")
    times = []
    for name, us in candidates.items():
        if not isinstance(name, str) or not name or name == CUBLAS:
            raise ValueError(f"a DSpark candidate is named by a non-empty string other than {CUBLAS!r}, "
                             f"not {checks.shown(name)}")
        times.append((name, _positive_time(f"the {name} kernel's time at m = {m}", us)))
    times.sort()
    best = min(times, key=lambda t: t[1]) if times else None
    wins = best is not None and cublas_us >= (1 + margin) * best[1]
    return RowDecision(m, best[0] if wins else None, cublas_us, tuple(times), margin)


def measure(rows: Iterable[int], sides: Mapping[str, Callable[[int], Callable[[], float] | None]],
            rounds: int = ROUNDS) -> dict[int, dict[str, float]]:
    """Each side's median µs per call at every row count of ``rows`` (module
    docstring): ``sides[name](m)`` gives that side's time-once function at
    ``m`` rows, or None where the side cannot run ``m`` (it is then left
    out of that row count's times). ``sides`` must hold ``CUBLAS``."""
    rounds = checks.integer("the timing rounds", rounds, 1, 101)
    if CUBLAS not in sides:
        raise ValueError(f"the sides timed must include {CUBLAS!r} (what a decision compares with)")
    out: dict[int, dict[str, float]] = {}
    for m in sorted({checks.integer("a row count", m, 1, MAX_ROWS) for m in rows}):
        timers = {name: make(m) for name, make in sides.items()}
        timers = {name: t for name, t in timers.items() if t is not None}
        if CUBLAS not in timers:
            raise ValueError(f"cuBLAS's side gave no timer at m = {m}")
        samples: dict[str, list[float]] = {name: [] for name in timers}
        for r in range(rounds):
            names = list(timers) if r % 2 == 0 else list(reversed(timers))
            for name in names:
                samples[name].append(_positive_time(f"the {name} side's time at m = {m}", timers[name]()))
        out[m] = {name: statistics.median(values) for name, values in samples.items()}
    return out


@dataclass
class GemmDecision:
    """One projection's decisions (``what``: its shape and role in words) on
    one card; ``cached``: the row counts whose times came from the cache."""

    what: str
    card: str
    rows: dict[int, RowDecision] = field(default_factory=dict)
    cached: frozenset[int] = frozenset()

    @property
    def dspark_rows(self) -> dict[int, str]:
        """The row counts DSpark's kernels run, each with its kernel's name."""
        return {m: d.kernel for m, d in self.rows.items() if d.kernel is not None}

    @property
    def cublas_rows(self) -> dict[int, str]:
        """The row counts cuBLAS keeps, each with the reason."""
        return {m: d.reason() for m, d in self.rows.items() if d.kernel is None}

    def summary(self) -> str:
        """The decisions as row-count ranges: who runs them and the range of
        cuBLAS / DSpark time ratios (``measured on`` the card)."""
        def who(m: int) -> str:
            d = self.rows[m]
            return f"DSpark ({d.kernel})" if d.kernel is not None else "cuBLAS"

        parts = []
        for a, b, name in spans(self.rows, who):
            ratios = [f"{self.rows[m].ratio:.2f}" for m in range(a, b + 1) if self.rows[m].ratio]
            low, high = (min(ratios, key=float), max(ratios, key=float)) if ratios else (None, None)
            span = "no candidate" if low is None else f"{low}x" if low == high else f"{low}-{high}x"
            parts.append(f"m = {a}{'' if a == b else f'-{b}'}: {name} ({span})")
        cached = f"; {len(self.cached)} row counts' times from the cache" if self.cached else ""
        return f"{self.what} on {self.card}: " + ("; ".join(parts) or "no row count timed") + cached


def decide(rows: Iterable[int], sides: Mapping[str, Callable[[int], Callable[[], float] | None]], what: str,
           card, fingerprint: str, shape: tuple[int, int], cache: DecisionCache | None = None,
           margin: float = MARGIN, rounds: int = ROUNDS) -> GemmDecision:
    """``GemmDecision`` of ``rows``: each row count's times from ``cache``
    where it holds them for this ``card`` (a ``CardFacts``), ``fingerprint``
    and ``shape``, else ``measure``d (and stored), then ``decide_row``.
    TypeError or ValueError for arguments of another kind, each checked
    before anything is timed."""
    from dspark_core.tools.card import CardFacts

    rows = sorted({checks.integer("a row count", m, 1, MAX_ROWS) for m in rows})
    margin = _margin(margin)
    checks.integer("the timing rounds", rounds, 1, 101)
    if not isinstance(sides, Mapping) or CUBLAS not in sides:
        raise TypeError(f"the sides timed are a mapping of name to timer maker that includes {CUBLAS!r}, not "
                        f"{checks.shown(sides)}")
    if not isinstance(card, CardFacts):
        raise TypeError(f"a decision's card is a CardFacts, not {checks.shown(card)}")
    if not isinstance(fingerprint, str) or not isinstance(what, str):
        raise TypeError("a decision's fingerprint and description are strings")
    if not (isinstance(shape, tuple) and len(shape) == 2):
        raise TypeError(f"a decision's weight shape is a tuple (n, k), not {checks.shown(shape)}")
    shape = tuple(checks.integer("a weight dimension", v, 1) for v in shape)
    if cache is not None and not isinstance(cache, DecisionCache):
        raise TypeError(f"a decision's cache is a DecisionCache or None, not {checks.shown(cache)}")
    keys = {m: decision_key(card.key(), fingerprint, shape, m, tuple(sorted(sides))) for m in rows}
    found = {m: cache.load(keys[m]) for m in rows} if cache is not None else {}
    found = {m: r for m, r in found.items() if r is not None and r["m"] == m}
    timed = measure([m for m in rows if m not in found], sides, rounds) if len(found) < len(rows) else {}
    result = GemmDecision(what, card.describe(), cached=frozenset(found))
    for m in rows:
        if m in found:
            cublas_us, candidates = found[m]["cublas_us"], found[m]["times_us"]
        else:
            cublas_us = timed[m][CUBLAS]
            candidates = {name: us for name, us in timed[m].items() if name != CUBLAS}
            if cache is not None:
                cache.store(keys[m], {"m": m, "cublas_us": cublas_us, "times_us": candidates})
        result.rows[m] = decide_row(m, cublas_us, candidates, margin)
    return result


def decision_key(card_key: str, fingerprint: str, shape: tuple[int, int], m: int, sides: tuple[str, ...]) -> str:
    """The cache's file name for one row count's times (module docstring)."""
    text = repr((card_key, fingerprint, tuple(int(v) for v in shape), int(m), tuple(sides)))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def default_directory() -> Path:
    return switches.cache_home("decisions")


def cache_directory(environ: Mapping[str, str] | None = None) -> Path | None:
    """The directory ``DSPARK_DECISION_CACHE`` names (module docstring):
    on by default, unlike the kernel cache (a cached time runs no code)."""
    env = os.environ if environ is None else environ
    text = env.get("DSPARK_DECISION_CACHE")
    if text is None or not str(text).strip():
        return default_directory()
    return switches.cache_setting("DSPARK_DECISION_CACHE", default_directory(), environ)


class DecisionCache:
    """Row counts' times on disk, a JSON file each (module docstring).
    ``directory`` None: nothing is read or written."""

    def __init__(self, directory: Path | None) -> None:
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"a decision cache's directory is a path or None, not {checks.shown(directory)}")
        self.directory = None if directory is None else Path(directory)
        self._warned: set[str] = set()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> DecisionCache:
        return cls(cache_directory(environ))

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning(message)

    def load(self, key: str) -> dict | None:
        """The record filed under ``key``, or None (absent, unreadable or
        not a record of positive finite times: re-timed, logged once)."""
        if self.directory is None:
            return None
        path = self.directory / f"{key}.json"
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
            m = record["m"]
            _positive_time("a cached cuBLAS time", record["cublas_us"])
            times = record["times_us"]
            if not isinstance(times, dict) or isinstance(m, bool) or not isinstance(m, int):
                raise ValueError("not a record")
            for name, us in times.items():
                _positive_time(f"a cached {name} time", us)
            return record
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._warn_once(f"the decision cache's {path} is ignored and re-timed: {e}")
            return None

    def store(self, key: str, record: dict) -> None:
        """File ``record`` under ``key`` (atomically: a reader sees the old
        file or the new, never a part); a failure is logged once, not raised."""
        if self.directory is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.directory / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(record, sort_keys=True))
            os.replace(tmp, self.directory / f"{key}.json")
        except OSError as e:
            self._warn_once(f"the decision cache cannot write to {self.directory}: {e}")


__all__ = ["CUBLAS", "MARGIN", "ROUNDS", "DecisionCache", "GemmDecision", "RowDecision", "cache_directory",
           "decide", "decide_row", "decision_key", "measure"]
