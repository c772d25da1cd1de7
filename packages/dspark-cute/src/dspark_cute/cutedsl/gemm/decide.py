"""The ordered GEMM's build-time timing (``OrderedGemm.decide``): at each
row count its check bound, each candidate kernel against cuBLAS on the
bound weight, on this GPU; ``dspark_core.runtime.gemm_decide`` makes the
decision and caches the times.

The candidates of a row count (``candidates``): the streamed kernel
(``streamed_settings``, where it has a tile for the weight) and the
``cp.async`` kernel (``launch_settings``), each summing in the bound order
(the same bits: the settings move no value). cuBLAS is timed as vLLM calls
it (``F.linear``, or the caller's ``reference``).

How one side is timed (``graph_timer``): its calls cycle over copies of the
weight (the weight and clones, ``WORKING_SET`` times the L2 cache in all, at
most ``MAX_COPIES``), so that every call reads its weight from HBM as in a
draft step, which streams some 3 GB of weights between two calls of one
projection; each copy is called once eagerly (compiles, tensor maps), then
``calls`` calls (a multiple of the copies, about ``GRAPH_BYTES`` of weight)
are captured in one CUDA graph with the launch settings and PDL the decode
runs, and a time is the median µs per call of ``REPLAYS`` replays. The
copies are freed when the decision is made.

Each call is timed as the step runs it (``gpu_sides``' ``lead_us``): behind
``lead.LeadPart``, the stand-in of the latency-bound part a projection
follows, which releases its PDL dependents at its start and spins
``LEAD_US``. DSpark's kernels launch with PDL and have their weight prologue
in flight during it; cuBLAS's start when it ends. A side's time is the
pair's minus the part's alone (timed the same way, once a row count), at
least ``MIN_US``: the µs the projection adds to the step.
"""

from __future__ import annotations

import itertools
import logging
import math

import torch

from dspark_core.runtime import gemm_decide
from dspark_core.tools.timing import median_us
from dspark_cute.cutedsl.gemm.ordered_layout import launch_settings
from dspark_cute.cutedsl.gemm.streamed import streamed_settings

log = logging.getLogger("dspark.decode")

# The weight copies cover this many times the GPU's L2 cache.
WORKING_SET = 3
MAX_COPIES = 16
# Weight bytes one graph reads (its calls: at least 4, at most 128).
GRAPH_BYTES = 1 << 30
MIN_CALLS, MAX_CALLS = 4, 128
REPLAYS = 3
STREAMED, CP_ASYNC = "streamed", "cp.async"
# The part before each timed call: µs it spins (the step's norms, gates and
# boundaries take a few µs to some 16 at small row counts), and the least
# time a side is given once the part's own time is taken off.
LEAD_US = 6.0
MIN_US = 0.1


# Where the streamed kernel is the default before a decision (measured on an
# H200, 2026-12-04: faster than the cp.async one for the o_proj and
# Markov-bias weights at m <= 4); ``OrderedGemm.decide`` replaces the default
# by what is faster on the user's GPU, at each row count.
STREAMED_MAX_ROWS = 4
STREAMED_MAX_BYTES = 64 << 20


def choose_settings(n: int, k: int, splits: int, m: int, sms: int) -> tuple:
    """The launch settings of ``m`` rows over a ``[n, k]`` weight in
    ``splits`` splits on ``sms`` SMs before a decision (``OrderedGemm.decide``
    times both kernels and keeps the faster): the streamed kernel's
    (``streamed_settings``) for at most ``STREAMED_MAX_ROWS`` rows over at
    most ``STREAMED_MAX_BYTES`` of weight, else the ``cp.async`` kernel's
    (``launch_settings``). Speed only: both give the same bits."""
    if m <= STREAMED_MAX_ROWS and 2 * n * k <= STREAMED_MAX_BYTES:
        settings = streamed_settings(n, splits, m, sms)
        if settings is not None:
            return settings
    return launch_settings(n, splits, m, sms)


# ``OrderedGemm.decide``'s default cache: the process's one, from the environment.
DEFAULT = object()
_decision_cache = None


def default_decision_cache() -> gemm_decide.DecisionCache:
    """The process's decision cache (``DSPARK_DECISION_CACHE``, read once):
    every ordered GEMM of the process shares it, so the same shape and row
    count are timed once (both layers of a draft have the same shapes)."""
    global _decision_cache
    if _decision_cache is None:
        _decision_cache = gemm_decide.DecisionCache.from_environment()
    return _decision_cache


def candidates(n: int, splits: int, m: int, sms: int) -> dict[str, tuple]:
    """The candidate kernels' launch settings at ``m`` rows of ``splits``
    splits over ``n`` outputs on ``sms`` SMs (module docstring)."""
    out = {}
    streamed = streamed_settings(n, splits, m, sms)
    if streamed is not None:
        out[STREAMED] = streamed
    out[CP_ASYNC] = launch_settings(n, splits, m, sms)
    return out


def weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """``weight`` and as many clones as make ``WORKING_SET`` times the L2
    cache (at most ``MAX_COPIES`` in all)."""
    l2 = getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 50 << 20)
    nbytes = weight.numel() * weight.element_size()
    count = max(1, min(MAX_COPIES, math.ceil(WORKING_SET * l2 / max(1, nbytes))))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def graph_timer(call, copies: list[torch.Tensor]):
    """A time-once function (µs per call) of ``call(weight)`` captured over
    ``copies`` in one CUDA graph (module docstring)."""
    nbytes = copies[0].numel() * copies[0].element_size()
    calls = max(MIN_CALLS, min(MAX_CALLS, math.ceil(GRAPH_BYTES / max(1, nbytes))))
    calls = max(len(copies), calls // len(copies) * len(copies))
    for w in copies:  # compiles, tensor maps and workspaces before the capture
        call(w)
    torch.cuda.synchronize()
    cycle = itertools.cycle(copies)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call(next(cycle))
    return lambda: median_us(graph.replay, REPLAYS, warmup=1, calls=calls)


_lead_refused: list[str] = []


def _lead():
    """The lead part's launcher, compiled and launched once; None (the
    calls then timed back to back, as before the lead part) where either
    raises, logged once with the error and not tried again."""
    from dspark_cute.cutedsl.gemm.lead import lead_launcher

    if _lead_refused:
        return None
    try:
        lead = lead_launcher()
        lead(1000)
        torch.cuda.synchronize()
        return lead
    except Exception as error:  # noqa: BLE001 (any failure: time without the part, and say why)
        _lead_refused.append(str(error))
        log.warning("The GEMM timing runs without the lead part (its kernel failed: %s: %s); each call is "
                    "timed back to back.", type(error).__name__, error)
        return None


def lead_failed() -> bool:
    """Whether the lead part failed in this process (its calls then timed back to back)."""
    return bool(_lead_refused)


def behind(lead, lead_us: float, call, copies: list[torch.Tensor], lead_alone: dict):
    """``graph_timer`` of ``call`` with the lead part of ``lead_us`` before
    each call, its time less the part's alone (``lead_alone``: the part's
    timer's result once, shared by the sides), at least ``MIN_US``; without
    a ``lead``, ``graph_timer(call, copies)``."""
    if lead is None:
        return graph_timer(call, copies)
    ns = round(lead_us * 1000)
    pair = graph_timer(lambda w: (lead(ns), call(w)), copies)

    def timed() -> float:
        if "us" not in lead_alone:
            lead_alone["us"] = graph_timer(lambda w: lead(ns), copies)()
        return max(MIN_US, pair() - lead_alone["us"])

    return timed


def gpu_sides(gemm, copies: list[torch.Tensor], launch, workspace, reference=None, seed: int = 0,
              lead_us: float = LEAD_US) -> dict:
    """The sides ``gemm_decide.measure`` times for the bound ``gemm`` (an
    ``OrderedGemm``): cuBLAS (``reference(x, weight)``, default
    ``F.linear``) and each candidate of ``candidates``, over ``copies``,
    each call behind a lead part of ``lead_us`` µs (0: none; module
    docstring); ``launch(x, weight, out, order, workspace, settings)`` runs
    a candidate, ``workspace(n, m, splits)`` makes its split-K scratch."""
    if isinstance(lead_us, bool) or not isinstance(lead_us, (int, float)) or not 0 <= lead_us <= 1000:
        raise ValueError(f"the lead part's µs must be a number in [0, 1000], not {lead_us!r}")
    reference = reference or torch.nn.functional.linear
    n, k = gemm.constants.n, gemm.constants.k
    gen = torch.Generator(device=gemm.device).manual_seed(seed)
    lead = _lead() if lead_us > 0 else None
    alone: dict[int, dict] = {}

    def x_of(m: int) -> torch.Tensor:
        return torch.randn(m, k, generator=gen, device=gemm.device).to(torch.bfloat16)

    def cublas(m: int):
        x = x_of(m)
        return behind(lead, lead_us, lambda w: reference(x, w), copies, alone.setdefault(m, {}))

    def kernel(name: str):
        def make(m: int):
            order = gemm.orders[m]
            settings = candidates(n, order.splits, m, gemm.sms).get(name)
            if settings is None:
                return None
            x, out = x_of(m), torch.empty(m, n, dtype=torch.bfloat16, device=gemm.device)
            ws = workspace(n, m, order.splits)
            return behind(lead, lead_us, lambda w: launch(x, w, out, order, ws, settings), copies,
                          alone.setdefault(m, {}))
        return make

    return {gemm_decide.CUBLAS: cublas, STREAMED: kernel(STREAMED), CP_ASYNC: kernel(CP_ASYNC)}


__all__ = ["CP_ASYNC", "GRAPH_BYTES", "LEAD_US", "MAX_COPIES", "MIN_US", "STREAMED", "STREAMED_MAX_BYTES",
           "STREAMED_MAX_ROWS", "WORKING_SET", "behind", "candidates", "choose_settings", "default_decision_cache",
           "gpu_sides", "graph_timer", "lead_failed", "weight_copies"]
