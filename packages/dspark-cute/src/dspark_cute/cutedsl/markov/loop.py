"""The greedy Markov stage with the fused step (``greedy.MarkovStep``): vLLM
0.33.0's greedy loop (``dspark_core.spec.markov``) in 1 + 2N launches
instead of about 9N.

``run_greedy_loop(step, base, prev, w2, tokens, embed)``, for ``base`` the
BF16 base logits ``[R, N, V]`` and ``prev`` the anchors ``[R]``:

1. ``embed[:R] = w1[prev]`` (``torch.index_select``: the stock's
   ``nn.Embedding`` gather, a copy);
2. for each step ``i``: ``bias = F.linear(embed[:R], w2)[:, :V]``, the
   stock's own cuBLAS call on the same shapes (so the same bits), then one
   ``MarkovStep`` launch writing ``tokens[:, i]`` and, except at the last
   step, the next step's ``embed[:R]``.

Every launch is capturable in a CUDA graph once ``step.prepare()`` has run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark_cute.cutedsl.markov.greedy import MarkovStep


def check_loop_operands(step: MarkovStep, base, prev, w2, tokens, embed) -> None:
    """ValueError unless ``run_greedy_loop`` takes these operands: ``base``
    BF16 ``[R, N, vocab]``; ``prev`` an int32/int64 ``[R]``; ``w2`` BF16
    ``[Vpad >= vocab, rank]``; ``tokens`` int64 ``[R, N]``; ``embed`` BF16
    contiguous ``[>= R, rank]``; then each step's operands as ``step.problem``
    checks them (the first step's bias stands in for every step's)."""
    c = step.constants
    if not isinstance(base, torch.Tensor) or base.dim() != 3:
        raise ValueError(f"the base logits must be a [requests, steps, {c.vocab}] tensor")
    r, n, v = base.shape
    if not isinstance(prev, torch.Tensor) or prev.dtype not in (torch.int32, torch.int64) or tuple(prev.shape) != (r,):
        raise ValueError(f"the anchors must be int32 or int64 [{r}]")
    if not isinstance(w2, torch.Tensor) or w2.dtype != torch.bfloat16 or w2.dim() != 2 or w2.shape[0] < v \
            or w2.shape[1] != c.rank:
        raise ValueError(f"w2 must be bfloat16 [>= {v}, {c.rank}]")
    if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != (r, n):
        raise ValueError(f"the tokens must be [{r}, {n}]")
    if not isinstance(embed, torch.Tensor) or embed.dim() != 2 or embed.shape[0] < r:
        raise ValueError(f"the embedding buffer must have at least {r} rows")
    bias = torch.empty(r, w2.shape[0], dtype=torch.bfloat16, device=base.device)[:, :v]
    reason = step.problem(base[:, 0], bias, tokens[:, 0], embed[:r], n > 1)
    if reason is not None:
        raise ValueError(reason)


def run_greedy_loop(step: MarkovStep, base: torch.Tensor, prev: torch.Tensor, w2: torch.Tensor,
                    tokens: torch.Tensor, embed: torch.Tensor, bias_fn=None) -> None:
    """The module docstring's loop on operands ``check_loop_operands``
    takes (not checked here: a graph replays it). ``bias_fn(e)``: step 2's
    GEMM where the caller has the stock's own function (vLLM's
    ``markov_bias``, which is ``F.linear(e, w2)[:, :V]`` on CUDA); it must
    return the layout ``F.linear`` does."""
    r, n, v = base.shape
    e = embed[:r]
    torch.index_select(step.w1, 0, prev, out=e)
    for i in range(n):
        bias = F.linear(e, w2)[:, :v] if bias_fn is None else bias_fn(e)
        step.launch(base[:, i], bias, tokens[:, i], e, i < n - 1)


def run_probabilistic_loop(step, base: torch.Tensor, prev: torch.Tensor, w2: torch.Tensor, tokens: torch.Tensor,
                           embed: torch.Tensor, idx_map: torch.Tensor, temperature: torch.Tensor,
                           seeds: torch.Tensor, sample_pos: torch.Tensor, cache: torch.Tensor, bias_fn=None) -> None:
    """The probabilistic stage with ``sample.MarkovSampleStep`` (``step``):
    the loop of ``run_greedy_loop`` with one ``MarkovSampleStep`` launch a
    step, which samples over the target vocabulary and writes the logits
    cache's column ``i``; ``idx_map`` and ``sample_pos`` are vLLM's ``[R, N]``
    views (the kernel reads ``sample_pos - 1``)."""
    r, n, v = base.shape
    e = embed[:r]
    torch.index_select(step.w1, 0, prev, out=e)
    for i in range(n):
        bias = F.linear(e, w2)[:, :v] if bias_fn is None else bias_fn(e)
        step.launch(base[:, i], bias, tokens[:, i], e, i < n - 1, idx_map[:, i], temperature, seeds,
                    sample_pos[:, i], cache, i)


__all__ = ["check_loop_operands", "run_greedy_loop", "run_probabilistic_loop"]
