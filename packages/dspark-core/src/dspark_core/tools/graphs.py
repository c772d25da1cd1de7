"""Whole-step CUDA graphs: one draft step of a fixed row count captured once
and replayed, for the stock forward and the specialized decode alike."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dspark_core.reference.model import StepInputs


class StepGraph:
    """``fn(hidden, step, caches)`` captured once for the shapes of
    ``hidden`` and ``step`` (its ``attn_slots`` width included).

    The inputs are copied into static buffers; the caches are captured by
    reference (a replay writes into the same cache tensors). Every kernel
    ``fn`` launches must be compiled before: ``warmup`` runs ``fn`` eagerly
    on a side stream first (as PyTorch requires), which also compiles lazily
    compiled kernels; a kernel that compiles during capture raises.
    ``replay(hidden, step)`` returns the static output (overwritten by the
    next replay: clone it to keep it)."""

    def __init__(
        self,
        fn: Callable[[torch.Tensor, StepInputs, list], torch.Tensor],
        hidden: torch.Tensor,
        step: StepInputs,
        caches: list,
        warmup: int = 2,
    ) -> None:
        if not hidden.is_cuda:
            raise ValueError("a StepGraph captures CUDA work: give it CUDA inputs")
        self.fn = fn
        self.caches = caches
        self.hidden = hidden.clone()
        self.step = StepInputs(step.positions.clone(), step.slots.clone(), step.attn_slots.clone())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(self.hidden, self.step, caches)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = fn(self.hidden, self.step, caches)

    def replay(self, hidden: torch.Tensor | None = None, step: StepInputs | None = None) -> torch.Tensor:
        """Copy the inputs given into the static buffers and replay."""
        if hidden is not None:
            if hidden.shape != self.hidden.shape or hidden.dtype != self.hidden.dtype:
                raise ValueError(
                    f"the graph was captured for hidden states {tuple(self.hidden.shape)} {self.hidden.dtype}"
                )
            self.hidden.copy_(hidden)
        if step is not None:
            self.step.copy_(step)
        self.graph.replay()
        return self.output
