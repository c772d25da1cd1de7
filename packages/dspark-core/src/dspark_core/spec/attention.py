"""The draft's attention over the paged KV cache, as an exact spec.

``paged_attention(q, cache, attn_slots, num_kv_heads)`` computes, for token
``i`` and query head ``h`` (its KV head ``g = h // (heads / kv_heads)``), over
the slots ``j = 0 .. S-1`` of row ``i`` of ``attn_slots`` whose value
``attn_slots[i, j]`` is non-negative (the *valid* slots; a negative one is
masked), with ``k_j``, ``v_j`` the BF16 K and V rows of KV head ``g`` at that
cache slot, widened to FP32 exactly:

1. ``s_j = head_sum(q * k_j) * SCALE``: the 64 products (exact: BF16 times
   BF16 fits FP32), summed by the head tree (``head_sum``: pair sums, then folded halves), the sum
   times ``SCALE = fp32(1 / sqrt(D))`` rounded once (0.125 for D = 64, exact);
2. ``mx = max_j s_j`` over the valid slots (a NaN score makes ``mx`` NaN; no
   valid slot makes it ``-inf``);
3. ``p_j = exp_rn(s_j - mx)`` (the difference rounded once);
4. the *lane sums*: the slot axis is dealt round-robin to ``LANES`` = 128
   partial sums, slot ``j`` to lane ``j % 128``; each lane starts at +0.0 and
   adds, in increasing ``j``, its valid slots' terms, each addition rounded:
   ``l_t = (((+0.0 + p_j0) + p_j1) + ...)`` and, per column ``d``,
   ``a_t[d] = (((+0.0 + p_j0 * v_j0[d]) + ...)`` (each product rounded once,
   never fused with the addition);
5. the 128 lane sums fold by halves (``numerics.fold_halves``: lane ``t`` plus
   lane ``t + 64``, then ``+ 32``, ... ``+ 1``) into ``l`` and ``a[d]``;
6. ``out[d] = round_bf16(a[d] / l)`` (IEEE division). With no valid slot this
   is ``0 / 0``, a NaN: what the fused kernels compute, but no result of
   vLLM's (its draft rows each attend at least their own slot), so
   ``paged_attention`` refuses such a row (``check_some_valid``, outside
   CUDA-graph capture) unless asked for the kernels' NaN
   (``empty_rows="nan"``, what their tests compare).

This is softmax(q . k / sqrt(D)) @ V in FP32 with every rounding and every sum
order fixed, so the same bits come out on CPU and CUDA, and a kernel whose
thread ``t`` of 128 walks the slots ``t, t + 128, ...`` reproduces it exactly.
``attn_slots`` must lie below the cache's slot count (ValueError otherwise,
checked outside CUDA-graph capture).
"""

from __future__ import annotations

import math

import torch

from dspark_core import checks
from dspark_core.spec.layers import capturing
from dspark_core.spec.numerics import exp_rn, f32, fold_halves

F32 = torch.float32
LANES = 128  # the lane sums of step 4: one per thread of the fused kernel's CTA


def head_sum(v: torch.Tensor) -> torch.Tensor:
    """The head tree over FP32 ``[..., D]``: the GPT-J pair sums ``v_2j +
    v_(2j+1)`` (the pair lane j holds), then folded by halves."""
    return fold_halves(v[..., 0::2] + v[..., 1::2])


def scale(head_dim: int) -> float:
    """``SCALE``: ``1 / sqrt(head_dim)`` (float64) rounded to FP32;
    ``head_dim`` a positive int (``checks.integer``)."""
    return f32(1.0 / math.sqrt(checks.integer("head_dim", head_dim, 1)))


def check_attention(q: torch.Tensor, cache, attn_slots: torch.Tensor, num_kv_heads: int) -> None:
    """The ValueErrors of ``paged_attention`` that need no host read (and
    TypeErrors for arguments of another kind)."""
    for name, t in (("the queries q", q), ("attn_slots", attn_slots)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention takes {name} as a tensor, not {checks.shown(t)}")
    if not all(hasattr(cache, a) for a in ("head_dim", "tensor", "num_slots", "gather")):
        raise TypeError(f"attention takes the cache as a spec.layers.PagedKVCache, not {type(cache).__name__}")
    num_kv_heads = checks.integer("num_kv_heads", num_kv_heads)
    if q.dim() != 3 or q.dtype != torch.bfloat16:
        raise ValueError(f"attention takes BF16 queries [m, heads, D], not {q.dtype} {tuple(q.shape)}")
    m, heads, d = q.shape
    if num_kv_heads < 1 or heads % num_kv_heads:
        raise ValueError(f"{heads} query heads do not split into groups over {num_kv_heads} KV heads")
    if cache.head_dim != d or cache.tensor.shape[1] != num_kv_heads:
        raise ValueError(
            f"the cache holds {cache.tensor.shape[1]} KV heads of {cache.head_dim}, the queries want "
            f"{num_kv_heads} of {d}"
        )
    if attn_slots.dim() != 2 or attn_slots.shape[0] != m or attn_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"attention takes integer attn_slots [{m}, S], not {attn_slots.dtype} "
                         f"{tuple(attn_slots.shape)}")


NO_VALID_SLOT = "a row of attn_slots with no valid (non-negative) slot: attention over no slot is 0 / 0"


def _check_slots(cache, attn_slots: torch.Tensor) -> None:
    if attn_slots.numel() and int(attn_slots.max()) >= cache.num_slots:
        raise ValueError(f"an attention slot beyond the cache's {cache.num_slots} slots")


def check_some_valid(attn_slots: torch.Tensor) -> None:
    """ValueError (``NO_VALID_SLOT``) where a row of ``attn_slots`` ``[m, S]``
    has no valid slot (one host read): the refusal a caller makes before
    attending, so that no NaN comes of it."""
    if attn_slots.shape[0] and (attn_slots.shape[1] == 0 or bool((attn_slots < 0).all(dim=1).any())):
        raise ValueError(NO_VALID_SLOT)


def lane_sums(terms: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Steps 4 and 5 over the slot axis (dim 1) of ``terms`` ``[m, S, ...]``
    FP32 with ``valid`` ``[m, S]``: lane ``j % 128`` adds its valid terms in
    increasing ``j`` from +0.0, then the 128 lanes fold by halves.
    Returns ``[m, ...]``."""
    m, s = terms.shape[:2]
    rest = terms.shape[2:]
    chunks = -(-s // LANES)
    pad = chunks * LANES - s
    if pad:
        terms = torch.cat([terms, terms.new_zeros((m, pad, *rest))], dim=1)
        valid = torch.cat([valid, valid.new_zeros((m, pad))], dim=1)
    terms = terms.reshape(m, chunks, LANES, *rest)
    valid = valid.reshape(m, chunks, LANES, *([1] * len(rest)))
    acc = terms.new_zeros((m, LANES, *rest))
    for c in range(chunks):
        # A masked term is not added at all (adding +0.0 would turn -0.0 into +0.0).
        acc = torch.where(valid[:, c], acc + terms[:, c], acc)
    # Lanes to the last dim for fold_halves.
    return fold_halves(acc.movedim(1, -1))


def paged_attention(q: torch.Tensor, cache, attn_slots: torch.Tensor, num_kv_heads: int, *,
                    empty_rows: str = "refuse") -> torch.Tensor:
    """Attention of BF16 ``q`` ``[m, heads, D]`` over ``cache`` (a
    ``layers.PagedKVCache``) at ``attn_slots`` ``[m, S]`` (negative: masked),
    steps 1-6 of the module docstring. Returns BF16 ``[m, heads, D]``.
    ``empty_rows``: ``"refuse"`` (ValueError ``NO_VALID_SLOT`` for a row
    with no valid slot, checked outside capture) or ``"nan"`` (the fused
    kernels' 0 / 0 there)."""
    if empty_rows not in ("refuse", "nan"):
        raise ValueError(f"empty_rows must be 'refuse' or 'nan', not {empty_rows!r}")
    check_attention(q, cache, attn_slots, num_kv_heads)
    if not capturing():
        _check_slots(cache, attn_slots)
        if empty_rows == "refuse":
            check_some_valid(attn_slots)
    m, heads, d = q.shape
    group = heads // num_kv_heads
    valid = attn_slots >= 0
    k, v = cache.gather(attn_slots.clamp_min(0))  # [m, S, kv, D] BF16
    qf = q.to(F32).reshape(m, 1, num_kv_heads, group, d)
    # [m, S, kv, group]: one score per (slot, head), heads grouped by KV head.
    scores = head_sum(qf * k.to(F32).unsqueeze(3)) * torch.full((), scale(d), dtype=F32, device=q.device)
    masked = torch.where(valid[:, :, None, None], scores, torch.full_like(scores, float("-inf")))
    mx = torch.amax(masked, dim=1, keepdim=True)  # NaN-propagating; -inf with no valid slot
    p = exp_rn(scores - mx)
    total = lane_sums(p, valid)  # [m, kv, group]
    # [m, S, kv, group, D]: each term p_j * v_j[d] rounded once.
    acc = lane_sums(p.unsqueeze(-1) * v.to(F32).unsqueeze(3), valid)  # [m, kv, group, D]
    out = acc / total.unsqueeze(-1)
    return out.reshape(m, heads, d).to(torch.bfloat16)


__all__ = ["LANES", "NO_VALID_SLOT", "check_attention", "check_some_valid", "lane_sums", "paged_attention",
           "scale"]
