"""One rank of a tensor-parallel DSpark draft on its GPU: what the two-GPU
draft tests, the TP2 draft benchmark and the TP2 demo build, written once.
Every function here is collective (call it on every rank, in the same order).

``TPDraftRank(rank, world, config)`` (in a process joined to the world group,
``dspark_comm.ranks.init_rank``): the reference draft of ``config`` (weights
seeded by ``config.seed`` on the CPU, so the same bits on every rank) moved to
GPU ``rank``, rank ``rank``'s shard of it (``dspark_core.reference.tp.shard_draft``:
its stock forward all-reduces the row-parallel partials with
``torch.distributed.all_reduce`` over NCCL; the whole draft is then freed), a
``TorchGroup`` over the world and a ``Mailbox`` of ``capacity`` rows over it.

- ``decode(exclude)``: the specialized decode of the shard
  (``dspark_core.runtime.build.build_draft_decode`` over the shard's
  description) with ``DraftAllReduce`` over
  the mailbox, both planned for this GPU at TP ``world`` with the installed
  kernels minus ``exclude``; ``(decode, adapter)``. With ``"package_gemm"``
  excluded the o_proj / down_proj GEMMs stay cuBLAS and every fused part is
  bit for bit the stock TP forward.
- ``context(n, seed)``: ``n`` BF16 hidden states (a CUDA generator seeded
  ``seed``: the same on every rank) and their positions ``0 .. n-1``;
  ``caches(states, span, decode)``: fresh caches of at least ``span`` slots
  with that context's K/V stored in slots ``0 .. n-1``, by ``decode``'s fused
  context chain where it covers the call, else by the stock chain.
- ``close()``: checks the mailbox (``MailboxTimeoutError`` if a kernel gave
  up), returns its status word, closes it.

``greedy(...)`` runs teacher-forced greedy decode steps on two paths side by
side (the stock tokens fed to both) and
``time_replays(...)`` times CUDA graph replays with the ranks released
together (their docstrings).
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from dspark_core.planner.policy import PACKAGE_GEMM  # the kernel name callers exclude (re-exported)

log = logging.getLogger("dspark.tp_draft")


class TPDraftRank:
    """One rank's shard, group and mailbox (module docstring)."""

    def __init__(self, rank: int, world: int, config=None, capacity: int = 16, timeout_s: float = 5.0,
                 one_gpu: bool = False) -> None:
        from dspark_comm.runtime.group import TorchGroup
        from dspark_comm.runtime.mailbox import Mailbox
        from dspark_core.reference.config import DraftConfig
        from dspark_core.reference.model import DraftModel
        from dspark_core.reference.tp import shard_draft

        self.rank, self.world = rank, world
        self.device = torch.device("cuda", 0 if one_gpu else rank)
        self.config = config if config is not None else DraftConfig()
        t0 = time.monotonic()
        model = DraftModel(self.config, device=self.device)
        # The stock forward's all-reduce: NCCL's, or on one GPU vLLM's custom one-stage order.
        self.all_reduce = rank_order_all_reduce if one_gpu else None
        self.shard = shard_draft(model, rank, world, self.all_reduce)
        del model
        torch.cuda.empty_cache()
        self.build_s = round(time.monotonic() - t0, 2)
        self.group = TorchGroup()
        self.mailbox = Mailbox(self.group, self.config.hidden_size, capacity, timeout_s=timeout_s)

    def decode(self, exclude=frozenset(), one_row_gemv: bool = False, ordered_gemm: bool = False):
        """``(decode, adapter)`` planned without the kernels ``exclude``
        (module docstring); ``one_row_gemv``: the package GEMMs' one-row calls
        on the one-token GEMV (``DraftAllReduce``); ``ordered_gemm``: the
        ordered GEMM opt-in (the exact package GEMM for o_proj and
        down_proj, the ordered GEMM for QKV and gate_up: cuBLAS's bits where
        the build-time check binds). RuntimeError where no part of the draft
        fuses."""
        from dspark_comm.draft import DraftAllReduce
        from dspark_core.reference.adapter import describe
        from dspark_core.runtime.build import build_draft_decode, draft_plan

        exclude = frozenset(exclude)
        # The opt-in package GEMM (not bit for bit the stock) runs unless exclude names it.
        package = PACKAGE_GEMM not in exclude
        draft = describe(self.shard)
        # The plan build_draft_decode makes too (one function: the two cannot drift).
        plan = draft_plan(draft, self.world, exclude, package_gemm=package, ordered_gemm=ordered_gemm)
        adapter = DraftAllReduce(self.mailbox, plan, draft, self.rank, one_row_gemv=one_row_gemv,
                                 reduce=self.all_reduce)
        decode = build_draft_decode(draft, all_reduce=adapter, exclude=exclude, package_gemm=package,
                                    ordered_gemm=ordered_gemm)
        if decode is None:
            raise RuntimeError(f"build_draft_decode kept the TP{self.world} draft stock on {self.device} "
                               "(the reason is in the log)")
        return decode, adapter

    def context(self, n: int, seed: int):
        """``(states, positions)``: ``n`` random BF16 hidden states, the same
        on every rank, at positions ``0 .. n-1``."""
        if n < 1:
            raise ValueError(f"a context of {n} tokens")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        states = torch.randn(n, self.config.hidden_size, generator=gen, device=self.device).bfloat16()
        return states, torch.arange(n, device=self.device)

    def caches(self, context, span: int, decode=None) -> list:
        """Fresh caches holding ``context``'s K/V (module docstring)."""
        states, positions = context
        if span < states.shape[0]:
            raise ValueError(f"a span of {span} slots cannot hold a context of {states.shape[0]} tokens")
        caches = self.shard.make_caches(-(-span // self.config.kv_block_size) + 1, self.device)
        if decode is None or not decode.store_context_kv(states, positions, caches, positions):
            self.shard.precompute_and_store_context_kv(states, positions, caches, positions)
        return caches

    def close(self) -> int:
        """Check, then close the mailbox; its last status word (0: healthy)."""
        try:
            self.mailbox.check()
            return self.mailbox.status()
        finally:
            self.mailbox.close()


def gather_through_host(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``x`` in rank order, on ``x``'s device, gathered over the
    world group through the CPU (gloo: the rank group on one GPU, where NCCL
    refuses two ranks). Collective."""
    import torch.distributed as dist

    host = x.detach().cpu()
    parts = [torch.empty_like(host) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, host)
    return [p.to(x.device) for p in parts]


def rank_order_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """vLLM's custom one-stage all-reduce of ``t`` (every rank's partial
    widened to FP32, added from rank 0's in rank order, rounded once) of the
    partials ``gather_through_host`` collects; in place, returns ``t``.
    Collective."""
    from dspark_comm.protocol import reference_sum
    from dspark_core.contracts.constants import FP32_RANK_ORDER

    t.copy_(reference_sum(gather_through_host(t), FP32_RANK_ORDER))
    return t


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy(model, stock, fused, stock_caches, fused_caches, first_tokens: torch.Tensor, start: int, steps: int,
           span: int, margin: float = 0.1) -> dict:
    """Greedy decode of ``steps`` steps of ``m = len(first_tokens)`` tokens on
    two paths, ``stock(hidden, step, caches)`` and ``fused(...)`` (each with
    its own caches), both fed the stock path's tokens (teacher forcing, the
    rule of dspark-cute's single-GPU greedy test): step ``i`` embeds the
    current tokens (``model.embed_tokens``), runs both paths at positions
    ``start + i m .. start + (i + 1) m - 1`` (``StepInputs.block``, ``span``
    wide), takes each path's logits (``model.logits``: FP32 through the LM
    head) and their argmax per row; the stock argmax is the next step's
    tokens. A step is a near tie where some row's stock top-two logits lie
    within ``margin`` (a flip a summation-order error may cause), else
    decisive.

    Returns ``steps``; ``tokens`` and ``fused_tokens`` (each path's argmax per
    step); ``agreed`` (steps whose tokens all agree); ``decisive`` and
    ``decisive_agreed`` (decisive steps, and those whose tokens agree: equal
    where the fused path follows the stock one); ``near_ties``;
    ``differ`` (``[step, smallest stock top-two gap over its differing rows]``
    for every step whose tokens differ); ``min_margin`` (the smallest stock
    top-two gap); ``max_logit_diff`` (the largest ``|stock - fused|`` logit);
    ``hidden_mismatches`` (elements of the two paths' hidden states that
    differ bit for bit, NaN equal to NaN, summed over the steps) and
    ``step_ms`` (each path's eager wall time per step, the median, with a
    device sync). Runs on any device (CPU tests)."""
    from dspark_core.reference.model import StepInputs
    from dspark_core.tools.compare import mismatches

    if steps < 1:
        raise ValueError(f"a greedy decode of {steps} steps")
    m = int(first_tokens.numel())
    device = first_tokens.device
    tokens = first_tokens.reshape(m)
    out = {"steps": steps, "tokens": [], "fused_tokens": [], "agreed": 0, "decisive": 0, "decisive_agreed": 0,
           "near_ties": 0, "differ": [], "min_margin": float("inf"), "max_logit_diff": 0.0,
           "hidden_mismatches": 0}
    times: dict = {"stock": [], "fused": []}
    for i in range(steps):
        step = StepInputs.block(start + i * m, m, device, span=span)
        x = model.embed_tokens(tokens)
        hiddens = {}
        for name, fn, caches in (("stock", stock, stock_caches), ("fused", fused, fused_caches)):
            _sync(device)
            t0 = time.perf_counter()
            hiddens[name] = fn(x, step, caches)
            _sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
        out["hidden_mismatches"] += int(mismatches(hiddens["fused"], hiddens["stock"]).sum())
        stock_logits = model.logits(hiddens["stock"]).float()
        fused_logits = model.logits(hiddens["fused"]).float()
        out["max_logit_diff"] = max(out["max_logit_diff"], float((stock_logits - fused_logits).abs().max()))
        want, got = stock_logits.argmax(-1), fused_logits.argmax(-1)
        top2 = stock_logits.topk(2, dim=-1).values
        gaps = top2[:, 0] - top2[:, 1]
        gap = float(gaps.min())
        out["min_margin"] = min(out["min_margin"], gap)
        same = bool((want == got).all())
        out["tokens"].append(want.tolist())
        out["fused_tokens"].append(got.tolist())
        out["agreed"] += same
        if gap < margin:
            out["near_ties"] += 1
        else:
            out["decisive"] += 1
            out["decisive_agreed"] += same
        if not same:
            out["differ"].append([i, float(gaps[want != got].min())])
        tokens = want
    out["step_ms"] = {k: round(statistics.median(v), 3) for k, v in times.items()}
    return out


def time_replays(replay, reps: int, warmup: int = 3, calls: int = 1) -> float:
    """Median microseconds of ``replay()`` (one CUDA graph replay) over
    ``reps`` timed calls, every rank released together before each: a
    ``torch.distributed`` barrier, then a device sync; CUDA events around
    the replay alone (``dspark_core.tools.timing.median_us``), each time divided
    by ``calls`` (the calls one replay makes). Collective."""
    import torch.distributed as dist

    from dspark_core.tools.timing import median_us

    if reps < 1:
        raise ValueError(f"{reps} timed replays")
    for _ in range(warmup):
        replay()
    torch.cuda.synchronize()

    def release():
        dist.barrier()
        torch.cuda.synchronize()

    return median_us(replay, reps, calls=calls, before=release)


__all__ = ["PACKAGE_GEMM", "TPDraftRank", "gather_through_host", "greedy", "rank_order_all_reduce",
           "time_replays"]
