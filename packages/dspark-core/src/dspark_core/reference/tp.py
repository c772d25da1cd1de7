"""The reference draft sharded over a tensor-parallel group (Megatron style).

``shard_draft(model, rank, tp)`` returns rank ``rank``'s ``TPDraftModel``:

- column-parallel QKV: the rank's ``num_heads / tp`` query heads, its
  ``num_kv_heads / tp`` KV heads (heads and KV heads split in contiguous
  blocks, so query head ``h`` of the rank still reads KV head ``h // group``
  of the rank) and the o-gate rows of its query heads, in the stock row order
  q, k, v, o-gate;
- column-parallel ``gate_up``: the rank's ``intermediate_size / tp`` gate rows
  then its as many up rows;
- row-parallel ``o_proj`` and ``down``: the rank's block of input features
  (the columns of its heads, of its intermediate block), every one of the
  ``hidden_size`` output features;
- norms, connections, the embedding, the LM head and the RoPE table
  replicated.

A shard is a ``DraftModel`` of the shard's config (``config``: the heads, KV
heads and intermediate size per rank; ``full_config`` is the whole draft's), so
the planner and the executor read it as they read a draft: the same
attribute names, ``boundaries()``, one paged cache per layer of the rank's
KV heads (``make_caches``), and an ``o_proj`` / ``down`` whose K is the
rank's shard.

Its stock forward is ``DraftModel.forward`` with the row-parallel outputs
all-reduced: each layer's attention output (BF16 ``[m, H]``, the rank's
partial of ``o_proj``) and MLP output (the partial of ``down``) go through
``all_reduce(t)`` before their residual boundary, the BF16 sum replacing the
partial. The default ``all_reduce`` is ``torch.distributed.all_reduce`` (SUM)
over ``group`` (None: the world), in place. With NCCL at TP2 each output
element is the correctly rounded BF16 of ``a + b`` (the two ranks' BF16
partials added exactly and rounded once to nearest even: the sum of two BF16
values is exact in FP32, so FP32 accumulation and one rounding give that
value), which is ``rank_order_sum``; beyond TP2 NCCL's order and rounding are
not fixed (ring or tree, per algorithm and size), so a bitwise reference must
name its order (``dspark_comm.protocol.reference_sum``).

The TP forward equals the unsharded forward only up to the GEMM's summation
order: ``o_proj`` and ``down`` split their K over the ranks and round each
partial to BF16 before the sum, so they are compared within the bf16 GEMM
bound (``gemm_error_bound``), never bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from dspark_core.reference.config import DraftConfig
from dspark_core.reference.model import DraftModel
from dspark_core.spec.numerics import F32
from dspark_core.tools.compare import mismatches

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def check_tp(config: DraftConfig, tp: int, rank: int | None = None) -> None:
    """ValueError unless ``tp`` (and ``rank``) can shard ``config``: ``tp``
    at least 1 dividing the heads, the KV heads and the intermediate size,
    ``0 <= rank < tp``."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"a TP size is a positive integer, not {tp!r}")
    for what, n in (
        ("heads", config.num_heads),
        ("KV heads", config.num_kv_heads),
        ("intermediate features", config.intermediate_size),
    ):
        if n % tp:
            raise ValueError(f"TP{tp} does not divide the draft's {n} {what}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp):
        raise ValueError(f"a rank of a TP{tp} group is an integer in [0, {tp}), not {rank!r}")


def shard_config(config: DraftConfig, tp: int) -> DraftConfig:
    """The config of one rank's shard: heads, KV heads and the intermediate
    size divided by ``tp``; everything else as is."""
    check_tp(config, tp)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tp,
        num_kv_heads=config.num_kv_heads // tp,
        intermediate_size=config.intermediate_size // tp,
    )


def _qkv_sections(config: DraftConfig) -> list[int]:
    sizes = [config.q_size, config.kv_size, config.kv_size]
    if config.use_o_gate:
        sizes.append(config.q_size)
    return sizes


def _role(name: str) -> str:
    """How the parameter ``name`` is split: ``qkv``, ``gate_up`` (rows),
    ``columns`` (o_proj, down) or ``replicated``."""
    leaf = name.rsplit(".", 1)[-1]
    if name.startswith("layers.") and leaf == "qkv_proj":
        return "qkv"
    if name.startswith("layers.") and leaf == "gate_up":
        return "gate_up"
    if name.startswith("layers.") and leaf in ("o_proj", "down"):
        return "columns"
    return "replicated"


def shard_parameter(name: str, full: torch.Tensor, config: DraftConfig, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the whole draft's parameter ``name`` (a view
    or a new tensor; copy it before writing)."""
    check_tp(config, tp, rank)
    role = _role(name)
    if role == "qkv":
        return torch.cat([part.chunk(tp, dim=0)[rank] for part in full.split(_qkv_sections(config), dim=0)])
    if role == "gate_up":
        return torch.cat([part.chunk(tp, dim=0)[rank] for part in full.split(config.intermediate_size, dim=0)])
    if role == "columns":
        return full.chunk(tp, dim=1)[rank]
    return full


def gather_parameter(name: str, shards: list[torch.Tensor], config: DraftConfig) -> torch.Tensor:
    """The whole draft's parameter ``name`` from every rank's shard (rank
    order): the inverse of ``shard_parameter``; a replicated parameter must be
    equal on every rank (its rank-0 copy is returned)."""
    tp = len(shards)
    check_tp(config, tp)
    role = _role(name)
    if role in ("qkv", "gate_up"):
        sizes = _qkv_sections(config) if role == "qkv" else [config.intermediate_size] * 2
        per_rank = [s.split([n // tp for n in sizes], dim=0) for s in shards]
        return torch.cat([torch.cat([p[i] for p in per_rank]) for i in range(len(sizes))])
    if role == "columns":
        return torch.cat(shards, dim=1)
    for r, other in enumerate(shards[1:], 1):
        if other.shape != shards[0].shape or bool(mismatches(other, shards[0]).any()):
            raise ValueError(f"the replicated parameter {name} differs on rank {r}")
    return shards[0]


def rank_order_sum(partials: list[torch.Tensor]) -> torch.Tensor:
    """The BF16 partials (rank order) widened to FP32, added in rank order,
    rounded to BF16 once. At TP2 this is the correctly rounded ``bf16(a + b)``
    that NCCL's BF16 sum computes (module docstring)."""
    if not partials or any(p.dtype != torch.bfloat16 or p.shape != partials[0].shape for p in partials):
        raise ValueError("the rank-order sum takes BF16 partials of one shape")
    acc = partials[0].to(F32)
    for p in partials[1:]:
        acc = acc + p.to(F32)
    return acc.to(torch.bfloat16)


def torch_all_reduce(group=None) -> AllReduce:
    """``t -> torch.distributed.all_reduce(t, SUM, group)`` in place (NCCL on
    CUDA tensors, gloo on CPU ones), returning ``t``."""

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    return all_reduce


class TPDraftModel(DraftModel):
    """One rank's shard of a ``DraftModel`` (module docstring). Build it with
    ``shard_draft``. ``rank``, ``tp``, ``full_config``; ``all_reduce`` is the
    callable the stock forward sums the row-parallel partials with."""

    def __init__(self, model: DraftModel, rank: int, tp: int, all_reduce: AllReduce | None = None,
                 group=None) -> None:
        if not isinstance(model, DraftModel) or isinstance(model, TPDraftModel):
            raise ValueError(f"shard_draft takes a whole DraftModel, not {type(model).__name__}")
        full = model.config
        check_tp(full, tp, rank)
        super().__init__(shard_config(full, tp), device="meta")
        self.full_config = full
        self.rank, self.tp = rank, tp
        self.all_reduce = all_reduce if all_reduce is not None else torch_all_reduce(group)
        device = next(model.parameters()).device
        self.to_empty(device=device)
        # The RoPE table is a (non-persistent) buffer: share the whole draft's.
        self.rotary = model.rotary
        for layer in self.layers:
            layer.self_attn._rotary[0] = model.rotary
        theirs = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in self.named_parameters():
                src = shard_parameter(name, theirs[name], full, rank, tp)
                if src.shape != p.shape or src.dtype != p.dtype:
                    raise ValueError(f"{name}: a shard of {tuple(src.shape)} {src.dtype} for "
                                     f"{tuple(p.shape)} {p.dtype}")
                p.copy_(src)

    def reduce_branch(self, branch: torch.Tensor) -> torch.Tensor:
        """The shard's row-parallel partial all-reduced (``all_reduce``):
        ``DraftModel.forward`` of the shard sums each layer's attention and
        MLP output so before its boundary, and gives BF16 ``[m, H]``, the
        same on every rank."""
        return self.all_reduce(branch)


def shard_draft(model: DraftModel, rank: int, tp: int, all_reduce: AllReduce | None = None,
                group=None) -> TPDraftModel:
    """Rank ``rank``'s shard of ``model`` over a TP group of ``tp`` ranks, on
    ``model``'s device (a draft on ``"meta"`` gives a shard on ``"meta"``,
    enough to plan it). ``all_reduce``: the sum of the row-parallel partials
    (default ``torch.distributed.all_reduce`` over ``group``). ValueError
    where ``tp`` does not divide the heads, the KV heads or the intermediate
    size, or ``rank`` is not in ``[0, tp)``."""
    return TPDraftModel(model, rank, tp, all_reduce, group)


def gemm_error_bound(x: torch.Tensor, weight: torch.Tensor, tp: int) -> torch.Tensor:
    """An elementwise bound (FP32 ``[m, N]``) on ``|TP - whole|`` for one
    row-parallel projection ``x @ weight^T`` of BF16 operands, the TP result
    being each rank's BF16 partial over its ``K / tp`` block summed in FP32
    and rounded once, the whole one the BF16 GEMM over all of K. With
    ``a = |x| @ |weight|^T`` (in float64) and ``u = 2^-9`` (BF16's unit
    roundoff): each GEMM accumulates in FP32 (error at most ``K * 2^-24 * a``
    each, ``gamma_K``), the ``tp`` partials and the whole result round to
    BF16 (``u * a`` each at most, as ``|partial| <= a``), and the sum rounds
    once (``u * a``): ``(tp + 2) * u * a + 2 * K * 2^-24 * a``, widened by
    1% for the second-order terms."""
    k = x.shape[-1]
    a = x.double().abs() @ weight.double().abs().t()
    return ((tp + 2) * 2.0**-9 + 2 * k * 2.0**-24) * 1.01 * a


class LocalGroup:
    """A TP group of ``tp`` ranks as threads of one process (CPU tests, and a
    single-process reference of a TP forward): ``all_reduce(rank)`` is rank
    ``rank``'s all-reduce callable, which waits for every rank's partial and
    returns ``rank_order_sum`` of them (a new tensor, the same bits on every
    rank); ``all_gather(rank)`` is its gather of any object (every rank's, in
    rank order); ``run(fn)`` calls ``fn(rank)`` on one thread per rank and returns
    the results in rank order, re-raising the first error. Every wait is
    bounded by ``timeout_s``; a rank that fails breaks the others' waits."""

    def __init__(self, tp: int, timeout_s: float = 120.0) -> None:
        import threading

        if tp < 1:
            raise ValueError(f"a TP size is at least 1, not {tp}")
        self.tp = tp
        self._barrier = threading.Barrier(tp, timeout=timeout_s)
        self._slots: list[torch.Tensor | None] = [None] * tp
        self._objects: list = [None] * tp
        self.calls = 0

    def all_reduce(self, rank: int) -> AllReduce:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self._slots[rank] = t
            self._barrier.wait()
            out = rank_order_sum(self._slots)
            if rank == 0:
                self.calls += 1
            self._barrier.wait()  # nobody overwrites a slot before every rank has summed
            return out

        return reduce

    def all_gather(self, rank: int) -> Callable[[object], list]:
        def gather(obj: object) -> list:
            self._objects[rank] = obj
            self._barrier.wait()
            out = list(self._objects)
            self._barrier.wait()  # nobody overwrites a slot before every rank has read
            return out

        return gather

    def run(self, fn: Callable[[int], object]) -> list:
        import threading

        results: list = [None] * self.tp
        errors: list = [None] * self.tp

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as error:  # re-raised below
                errors[rank] = error
                self._barrier.abort()

        threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


__all__ = [
    "LocalGroup",
    "TPDraftModel",
    "check_tp",
    "gather_parameter",
    "gemm_error_bound",
    "rank_order_sum",
    "shard_config",
    "shard_draft",
    "shard_parameter",
    "torch_all_reduce",
]
