"""CUDA timing for the benchmarks, the demos and the TP draft: graph capture
and CUDA-event medians, written once (torch only; nothing here runs on import).

- ``times_us(replay, reps, warmup, calls=..., before=...)``: microseconds
  per call of ``replay()`` between two CUDA events, one per rep;
  ``median_us`` their median;
- ``capture(fn, calls)``: ``fn`` warmed up once, then a CUDA graph of
  ``calls`` calls of it; its ``replay``;
- ``capture_on_side_stream(fns, launches)``: the same, warmed up and captured
  on a side stream, the calls cycled, replayed once before it is returned;
- ``gemms_replay(model, m)`` and ``weight_floor_us(model)``: the draft step's
  "GEMMs alone" graph and its weight-bytes floor at the current card's HBM
  peak (a ``DraftModel`` or a TP shard of one).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

HBM_BYTES_PER_S = 4.3e12  # an H200's measured streaming read: a figure of that card alone


def times_us(
    replay: Callable[[], object],
    reps: int,
    warmup: int = 0,
    *,
    calls: int = 1,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Microseconds per call of ``replay()``, one time per rep: ``warmup``
    untimed calls first (no sync after them), then ``reps`` timed ones, each
    between two fresh CUDA events on the current stream (the end event
    synchronized); each time is divided by ``calls`` (the calls one
    ``replay()`` makes). ``before()``, where given, runs ahead of each timed
    call, outside the events (a barrier, a sync)."""
    for _ in range(warmup):
        replay()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return times


def median_us(
    replay: Callable[[], object],
    reps: int,
    warmup: int = 0,
    *,
    calls: int = 1,
    before: Callable[[], object] | None = None,
) -> float:
    """The median of ``times_us(...)``."""
    return statistics.median(times_us(replay, reps, warmup, calls=calls, before=before))


def capture(fn: Callable[[], object], calls: int = 1, *, side_stream: bool = False) -> Callable[[], None]:
    """``fn()`` once (it compiles and warms up outside the capture), a device
    sync, then a CUDA graph of ``calls`` calls of ``fn``; returns its
    ``replay``. With ``side_stream`` the capture is entered from a fresh
    stream that waits on the current one (which waits on it after)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    if side_stream:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        torch.cuda.current_stream().wait_stream(side)
    else:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    return graph.replay


def capture_on_side_stream(fns: list, launches: int, *, wait: bool = True) -> Callable[[], None]:
    """A fresh stream (waiting on the current one where ``wait``): each of
    ``fns`` called once on it (warm-up and compiles), a device sync, a CUDA
    graph captured on it of ``launches`` calls cycling through ``fns``; then
    a sync, one untimed replay and a sync. Returns the graph's ``replay``."""
    stream = torch.cuda.Stream()
    if wait:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(launches):
                fns[i % len(fns)]()
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay


def _gemm_weights(layer) -> tuple:
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down)


def gemms_replay(model, m: int) -> Callable[[], None]:
    """The replay of a CUDA graph of the draft step's GEMMs alone over ``m``
    rows: per layer the QKV, o_proj, gate_up and down projections (same
    shapes, same cuBLAS calls: ``dspark_core.spec.layers.linear``) and nothing
    else. ``model``: a ``DraftModel`` or a TP shard (its own config)."""
    from dspark_core.spec.layers import linear

    c = model.config
    x = torch.zeros(m, c.hidden_size, dtype=torch.bfloat16, device="cuda")
    o_in = torch.zeros(m, c.q_size, dtype=torch.bfloat16, device="cuda")
    h = torch.zeros(m, c.intermediate_size, dtype=torch.bfloat16, device="cuda")

    def step():
        for layer in model.layers:
            linear(x, layer.self_attn.qkv_proj)
            linear(o_in, layer.self_attn.o_proj)
            linear(x, layer.mlp.gate_up)
            linear(h, layer.mlp.down)

    return capture(step)


def gemm_weight_bytes(model) -> int:
    """The bytes of the step's GEMM weights (those ``gemms_replay`` reads)."""
    return sum(w.numel() * w.element_size() for layer in model.layers for w in _gemm_weights(layer))


def step_case(model, m: int, context: int, device="cuda") -> tuple:
    """One benchmark step of ``m`` tokens after ``context`` cached ones:
    ``(x, step, caches)`` with ``x`` the embeddings of tokens ``0 .. m-1``,
    ``step`` a ``StepInputs.block`` of span ``context + m`` and empty caches
    with two blocks to spare."""
    from dspark_core.reference.model import StepInputs

    span = context + m
    step = StepInputs.block(context, m, device, span=span)
    x = model.embed_tokens(torch.arange(m, device=device))
    return x, step, model.make_caches(span // model.config.kv_block_size + 2, device)


def weight_floor_us(model, bytes_per_s: float | None = None) -> float:
    """Microseconds to read the step's GEMM weights once at ``bytes_per_s``
    (default: the current GPU's HBM peak, ``dspark_core.tools.card``; never
    another card's figure). ValueError where none is given and no CUDA GPU
    of a known peak is there."""
    if bytes_per_s is None:
        peak = None
        if torch.cuda.is_available():
            from dspark_core.tools.card import card_facts

            peak = card_facts().hbm_peak
        if peak is None:
            raise ValueError("weight_floor_us needs bytes_per_s: no CUDA GPU whose HBM peak is known is here")
        bytes_per_s = peak
    return gemm_weight_bytes(model) / bytes_per_s * 1e6


__all__ = [
    "HBM_BYTES_PER_S",
    "capture",
    "capture_on_side_stream",
    "gemm_weight_bytes",
    "gemms_replay",
    "median_us",
    "times_us",
    "step_case",
    "weight_floor_us",
]
