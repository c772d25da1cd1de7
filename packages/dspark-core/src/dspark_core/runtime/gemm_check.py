"""The build-time check that lets DSpark own a projection: for each row count,
find the ``SplitOrder`` (``dspark_core.spec.split_order``) in which the live
cuBLAS sums that projection, then confirm that DSpark's ordered GEMM gives
cuBLAS's bits in it; elsewhere cuBLAS keeps the projection, with the reason.

cuBLAS picks its kernel and its split by heuristics per (shape, row count,
library build), so nothing here assumes an order: the check asks the library
that vLLM itself calls (``F.linear`` in the same process), on the bound
weight, every time a decode is built. A cuBLAS upgrade can then cost speed,
never a token.

``find_order(reference, candidate, k, probes)``: ``reference(x)`` is the
stock projection (cuBLAS) of a probe ``x``, ``candidate(x, order)`` DSpark's
GEMM in ``order``; the candidates (``candidate_orders``, the last found
order first) are tried on the first probe until one gives identical bits,
which must then hold on every other probe too (a coincidence on one probe is
skipped). Bits are compared as ``tools.compare.mismatches`` does (NaN
payloads excepted). ``check_rows`` does it for every row count, passing each
found order on as the next one's first guess (cuBLAS's choice changes with
the row count in steps).

The probes (``probes``) are built to make orders visible: standard normal
values (every FP32 rounding of a partial sum shows), values spread over
2^-12 .. 2^12, -0.0, BF16 subnormals, and a probe with an infinity and a
NaN (the special values' propagation). Seeded: the seed is part of the
result, so a refusal can be replayed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from dspark_core import checks
from dspark_core.errors import spans
from dspark_core.spec.split_order import MAX_SPLITS, TILES, SplitOrder, candidate_orders
from dspark_core.tools.compare import mismatches

# The check's default seed (its probes; fixed, so a refusal replays).
SEED = 20261204
# Finite magnitudes the "spread" probe covers (powers of two).
SPREAD = 12
# The special values' probe: the share of -0.0 and of subnormals.
SPECIAL_SHARE = 0.01


@dataclass(frozen=True)
class Finding:
    """One row count's answer: the ``order`` cuBLAS's bits came in (None
    where none of the ``tried`` candidates gave them, with the ``reason``)."""

    m: int
    order: SplitOrder | None
    tried: int
    reason: str | None = None


@dataclass
class CheckResult:
    """Every row count's finding for one projection of ``k`` columns, and the seed."""

    k: int
    seed: int
    findings: dict[int, Finding] = field(default_factory=dict)

    @property
    def orders(self) -> dict[int, SplitOrder]:
        return {m: f.order for m, f in self.findings.items() if f.order is not None}

    @property
    def refused(self) -> dict[int, str]:
        return {m: f.reason for m, f in self.findings.items() if f.order is None}

    def summary(self) -> str:
        """The orders found as row-count ranges, and the refused rows, in words."""
        def what(m: int) -> str:
            order = self.findings[m].order
            return order.describe() if order is not None else "cuBLAS (no order found)"

        return "; ".join(f"m = {a}{'' if a == b else f'-{b}'}: {w}" for a, b, w in spans(self.findings, what))


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def probes(m: int, k: int, device, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The check's BF16 ``[m, k]`` probes (module docstring), named, from ``seed``."""
    if checks.as_int(m) is None or m < 1:
        raise ValueError(f"a probe has a positive int of rows, not {m!r}")
    if checks.as_int(k) is None or k < 1:
        raise ValueError(f"a probe has a positive int of columns, not {k!r}")
    m, k = int(m), int(k)
    seed = checks.integer("a probe's seed", seed, 0, 2**63 - 1)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(fn, *shape, **kw):
        return fn(*shape, generator=gen, device=device, **kw)

    normal = draw(torch.randn, m, k)
    spread = draw(torch.randn, m, k) * torch.exp2(draw(torch.randint, -SPREAD, SPREAD + 1, (m, k)).float())
    special = draw(torch.randn, m, k)
    pick = draw(torch.rand, m, k)
    special = torch.where(pick < SPECIAL_SHARE, torch.full_like(special, -0.0), special)
    tiny = torch.exp2(draw(torch.randint, -133, -126, (m, k)).float())  # BF16 subnormals
    special = torch.where((pick >= SPECIAL_SHARE) & (pick < 2 * SPECIAL_SHARE), tiny, special)
    nonfinite = draw(torch.randn, m, k)
    spots = draw(torch.randint, 0, m * k, (2,))
    nonfinite.view(-1)[spots[0]] = float("inf")
    nonfinite.view(-1)[spots[1]] = float("nan")
    return [(name, _bf16(t)) for name, t in
            (("normal", normal), ("spread", spread), ("special", special), ("inf and nan", nonfinite))]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` agree bit for bit (NaN payloads excepted)."""
    return a.shape == b.shape and a.dtype == b.dtype and not bool(mismatches(a, b).any())


def find_order(reference: Callable[[torch.Tensor], torch.Tensor],
               candidate: Callable[[torch.Tensor, SplitOrder], torch.Tensor],
               k: int, named_probes: list[tuple[str, torch.Tensor]], first: SplitOrder | None = None,
               tiles: tuple[int, ...] = TILES, max_splits: int = MAX_SPLITS,
               confirm: Callable[[SplitOrder], str | None] | None = None) -> Finding:
    """The first candidate order whose bits equal ``reference``'s on every
    probe (module docstring) and that ``confirm`` (where given) accepts
    (None; else a sentence why not, and the search goes on), or a refusal
    naming how close the candidates came."""
    if not named_probes:
        raise ValueError("the check needs at least one probe")
    m = named_probes[0][1].shape[0]
    wanted = [None] * len(named_probes)
    wanted[0] = reference(named_probes[0][1])
    tried, near = 0, None
    for order in candidate_orders(k, tiles, max_splits, first):
        tried += 1
        if not same_bits(candidate(named_probes[0][1], order), wanted[0]):
            continue
        for i, (name, x) in enumerate(named_probes[1:], start=1):
            if wanted[i] is None:
                wanted[i] = reference(x)
            if not same_bits(candidate(x, order), wanted[i]):
                near = near or f"{order.describe()} matched the {named_probes[0][0]} probe but not the {name} probe"
                break
        else:
            why = confirm(order) if confirm is not None else None
            if why is None:
                return Finding(m, order, tried)
            near = near or why
    why = (f"none of {tried} split orders ({', '.join(map(str, tiles))}-column tiles, 1 to {max_splits} splits) "
           f"gives cuBLAS's bits at m = {m}")
    return Finding(m, None, tried, why + (f"; {near}" if near else ""))


def check_rows(reference: Callable[[torch.Tensor], torch.Tensor],
               candidate: Callable[[torch.Tensor, SplitOrder], torch.Tensor],
               k: int, rows: Iterable[int], device, seed: int, confirm=None, **search) -> CheckResult:
    """``find_order`` at every row count of ``rows`` (each with its own
    probes from ``seed + m``), the last order found tried first;
    ``confirm(m, order)`` where given is ``find_order``'s ``confirm`` at m."""
    result = CheckResult(k, seed)
    last = None
    for m in sorted(set(rows)):
        accept = None if confirm is None else (lambda order, m=m: confirm(m, order))
        found = find_order(reference, candidate, k, probes(m, k, device, seed + m), first=last, confirm=accept,
                           **search)
        result.findings[m] = found
        last = found.order or last
    return result


# Weight rows the candidates run on (the order of an output does not depend
# on how many outputs a launch has, so the search runs on a slice and only
# the confirmation on the whole weight).
SEARCH_ROWS = 256
# The confirmation compares at least this many outputs (rounds of the four
# probes, at most CONFIRM_ROUNDS): a wrong order differs in a few outputs per
# thousand, so a small shape at one row needs several rounds to show it.
MIN_COMPARED = 2**18
CONFIRM_ROUNDS = 64


def check_projection(weight: torch.Tensor, rows: Iterable[int], run_order, seed: int,
                     reference: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                     search_rows: int = SEARCH_ROWS, min_compared: int = MIN_COMPARED, **search) -> CheckResult:
    """``check_rows`` for the projection ``x @ weight^T``: the reference is
    ``reference(x, weight)`` (default ``F.linear``: what vLLM calls) on the
    whole weight, the candidates ``run_order(x, weight_slice, order)`` on
    its first ``search_rows`` rows (compared with the reference's first
    ``search_rows`` outputs); an order found there is accepted only once it
    gives the reference's bits on the whole weight too (``run_order(x,
    weight, order)`` on fresh probes, rounds of them until at least
    ``min_compared`` outputs are compared, at most ``CONFIRM_ROUNDS``); else
    the search goes on (cuBLAS may sum some output tiles in another order)."""
    import torch.nn.functional as F

    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.numel() > 0):
        shown = (f"{weight.dtype} {list(weight.shape)}" if isinstance(weight, torch.Tensor)
                 else type(weight).__name__)
        raise ValueError(f"the build-time check takes a non-empty 2-D bfloat16 weight, not {shown}")
    seed = checks.integer("the check's seed", seed, 0, 2**63 - 1)
    search_rows = checks.integer("the check's search_rows", search_rows, 1)
    min_compared = checks.integer("the check's min_compared", min_compared, 1)
    if reference is None:
        reference = F.linear
    n, k = weight.shape
    sub = weight[:min(search_rows, n)]
    cols = sub.shape[0]

    def whole(m: int, order: SplitOrder) -> str | None:
        rounds = min(CONFIRM_ROUNDS, max(1, -(-min_compared // (4 * m * n))))
        for r in range(rounds):
            for name, x in probes(m, k, weight.device, seed + 1000 + m + 7919 * r):
                bad = int(mismatches(run_order(x, weight, order), reference(x, weight)).sum())
                if bad:
                    return (f"{order.describe()} gave cuBLAS's bits on the first {cols} outputs but {bad} of "
                            f"{m * n} differ on the whole weight ({name} probe)")
        return None

    return check_rows(lambda x: reference(x, weight)[:, :cols], lambda x, o: run_order(x, sub, o), k, rows,
                      weight.device, seed, confirm=whole, **search)


__all__ = ["CheckResult", "Finding", "SEARCH_ROWS", "SEED", "SPECIAL_SHARE", "SPREAD", "check_projection", "check_rows",
           "find_order", "probes", "same_bits"]
