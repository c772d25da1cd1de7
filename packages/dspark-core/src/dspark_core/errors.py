"""DSpark's exceptions.

``Unsupported`` is a refusal: a part of a draft that the fused kernels do not
reproduce. The planner catches exactly this type and keeps that part's stock
modules, reporting the message. Bad input raises ``ValueError`` or
``TypeError`` with a sentence; anything else is a bug and propagates.
``listed`` writes a collection into such a sentence, cut where it is long,
``quoted`` one value (a name of a million characters is cut too) and
``spans`` / ``ranges`` row counts as runs (``1-4, 8``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

# The most items a message lists (a config of 200,000 unknown keys is not
# answered with all of them).
LISTED = 10
# The longest value a message quotes (a string of a million characters is cut).
SHOWN = 60


class Unsupported(ValueError):
    """A part the fused kernels do not reproduce: the planner keeps its stock modules and reports the message."""


def quoted(value: object) -> str:
    """``value``'s ``repr`` for a message, cut at ``SHOWN`` characters:
    ``'xxx...' (1002 characters)``."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


def listed(items: Iterable[object], limit: int = LISTED) -> str:
    """``items`` for a message, sorted by their ``repr``, as a list of at
    most ``limit`` of them (each ``quoted``) and how many more: ``['a', 'b',
    ... (3 more)]``."""
    texts = sorted(quoted(item) for item in items)
    more = f", ... ({len(texts) - limit} more)" if len(texts) > limit else ""
    return f"[{', '.join(texts[:limit])}{more}]"


def spans(values: Iterable[int], key: Callable[[int], object] = lambda _: None) -> list[tuple[int, int, object]]:
    """``(first, last, key)`` of each run of consecutive integers of
    ``values`` (sorted, duplicates dropped) that share ``key(value)``."""
    runs: list[tuple[int, int, object]] = []
    for v in sorted(set(values)):
        k = key(v)
        if runs and runs[-1][1] == v - 1 and runs[-1][2] == k:
            runs[-1] = (runs[-1][0], v, k)
        else:
            runs.append((v, v, k))
    return runs


def ranges(values: Iterable[int]) -> str:
    """Integers as runs: ``1-4, 8, 16`` ("" for none)."""
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b, _ in spans(values))
