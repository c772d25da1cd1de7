"""The stock eager layers of the DSpark draft: the executable numeric spec.

Each forward is the exact arithmetic a fused kernel must reproduce bit for
bit, written with the rounded operations of ``dspark_core.spec.numerics`` (read its
docstring first: the row tree, the head tree, ``inv_rms`` and the NaN
exception). Inputs of BF16, FP16 or FP32 are widened to FP32 exactly; every
FP32 operation below rounds once to nearest even; "rounded to bf16" is
``cvt.rn.bf16.f32``.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_core.spec.numerics import (
    F32,
    check_head_width,
    check_row_width,
    head_sum,
    inv_rms,
    round_to,
    row_sum,
    sigmoid_rn,
    silu_rn,
)

WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_eps(eps: float) -> None:
    if not eps >= 0.0:  # NaN fails too
        raise ValueError(f"a norm's eps must be a non-negative number, not {eps}")


def _check_dtype(dtype: torch.dtype, allowed, what: str) -> None:
    if dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{what} must be one of {names}, not {dtype}")


class RMSNorm(nn.Module):
    """RMSNorm of rows of ``hidden_size`` columns (a multiple of 2048).

    With ``x`` the row widened to FP32 and ``g = w + c`` (the weight widened
    to FP32, ``c`` the gain center rounded to FP32 first, like ``eps``, then
    one rounded FP32 addition; note that it turns a -0.0 weight into +0.0
    when the center is 0.0):

    - ``weight_before_norm``: ``x = x * g``; then ``s = row_sum(x * x)`` (each
      square rounded, the row tree), ``r = inv_rms(s, H, eps)``,
      ``y = x * r``;
    - otherwise: ``s = row_sum(x * x)``, ``r = inv_rms(s, H, eps)``,
      ``y = (x * r) * g`` (without a weight, ``y = x * r``);

    then ``y`` rounded to ``out_dtype`` (nearest even). ``eps`` is rounded to
    FP32 once. Rows are independent; any leading shape is kept.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        has_weight: bool = True,
        weight_dtype: torch.dtype = torch.bfloat16,
        gain_center: float = 0.0,
        weight_before_norm: bool = False,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        check_row_width(hidden_size)
        _check_dtype(out_dtype, OUT_DTYPES, "the norm's output dtype")
        if has_weight:
            _check_dtype(weight_dtype, WEIGHT_DTYPES, "the norm weight's dtype")
        if weight_before_norm and not has_weight:
            raise ValueError("a weightless norm cannot scale its input by a weight")
        _check_eps(eps)
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.has_weight = has_weight
        self.gain_center = float(gain_center)
        self.weight_before_norm = weight_before_norm
        self.out_dtype = out_dtype
        self.weight = (
            nn.Parameter(torch.ones(hidden_size, dtype=weight_dtype), requires_grad=False)
            if has_weight
            else None
        )

    def gain(self) -> torch.Tensor | None:
        """``w + gain_center`` in FP32, or None without a weight."""
        if self.weight is None:
            return None
        return self.weight.to(F32) + self.gain_center

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"RMSNorm({self.hidden_size}) takes rows of {self.hidden_size} "
                f"columns, not {x.shape[-1]}"
            )
        if out_dtype is not None:
            _check_dtype(out_dtype, OUT_DTYPES, "the norm's output dtype")
        x = x.to(F32)
        g = self.gain()
        if g is not None and self.weight_before_norm:
            x = x * g
        r = inv_rms(row_sum(x * x), self.hidden_size, self.eps)
        y = x * r.unsqueeze(-1)
        if g is not None and not self.weight_before_norm:
            y = y * g
        return y.to(out_dtype or self.out_dtype)


class HeadNorm(nn.Module):
    """RMSNorm of each ``head_dim``-wide head (QK-norm, the context K-norm, the
    o-norm): ``x`` widened to FP32, ``s = head_sum(x * x)`` (the head tree),
    ``r = inv_rms(s, D, eps)``, ``y = x * r`` (then ``* g`` with a weight,
    ``g = w`` in FP32), rounded to BF16. Takes ``[..., D]``."""

    def __init__(self, head_dim: int, eps: float = 1e-6, *, has_weight: bool = False) -> None:
        super().__init__()
        check_head_width(head_dim)
        _check_eps(eps)
        self.head_dim = head_dim
        self.eps = float(eps)
        self.has_weight = has_weight
        self.weight = (
            nn.Parameter(torch.ones(head_dim, dtype=torch.bfloat16), requires_grad=False)
            if has_weight
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"HeadNorm({self.head_dim}) takes heads of {self.head_dim}, not {x.shape[-1]}")
        x = x.to(F32)
        y = x * inv_rms(head_sum(x * x), self.head_dim, self.eps).unsqueeze(-1)
        if self.weight is not None:
            y = y * self.weight.to(F32)
        return y.to(torch.bfloat16)


class GatedResidual(nn.Module):
    """The norm-preserving gated residual connection: FP32
    ``alpha * stream + beta * branch``, each product rounded, then their sum
    rounded; ``alpha`` and ``beta`` are FP32 ``[H]``. ``stream`` and
    ``branch`` are widened to FP32 exactly; the result is FP32."""

    def __init__(self, hidden_size: int, alpha: float = 1.0, beta: float = 1.0) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.alpha = nn.Parameter(torch.full((hidden_size,), alpha, dtype=F32), requires_grad=False)
        self.beta = nn.Parameter(torch.full((hidden_size,), beta, dtype=F32), requires_grad=False)

    def forward(self, stream: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        h = self.hidden_size
        if stream.shape != branch.shape or stream.shape[-1:] != (h,):
            raise ValueError(
                f"the gated residual takes a stream and a branch of one shape [..., {h}], not "
                f"{tuple(stream.shape)} and {tuple(branch.shape)}"
            )
        return self.alpha * stream.to(F32) + self.beta * branch.to(F32)


def residual_boundary(
    post: RMSNorm,
    conn: GatedResidual,
    pre: RMSNorm,
    branch: torch.Tensor,
    stream: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One residual boundary of the draft, ``(new_stream, out)``:

    1. ``p = post(branch)`` rounded to BF16 (the post-norm's output);
    2. ``new_stream = conn(stream, p)``: FP32 ``alpha * stream + beta * p``;
    3. ``out = pre(new_stream rounded to BF16)`` rounded to ``out_dtype``.

    ``branch`` is BF16 ``[m, H]`` read as is (-0.0, subnormals, infinities
    and NaN included); ``stream`` is FP32 or BF16 ``[m, H]``."""
    p = post(branch, out_dtype=torch.bfloat16)
    new_stream = conn(stream, p)
    return new_stream, pre(new_stream.to(torch.bfloat16), out_dtype=out_dtype)


class Rotary(nn.Module):
    """GPT-J rotary embedding over whole heads of ``head_dim`` columns.

    The table ``cos_sin`` is ``[max_position, head_dim]`` of ``table_dtype``
    (BF16 by default, or FP32): columns ``j < D/2`` hold ``cos(p * f_j)``,
    columns ``D/2 + j`` hold ``sin(p * f_j)``, ``f_j = theta ** (-2j / D)``,
    computed in float64 by torch on the CPU, rounded to FP32, and (for a
    BF16 table) that rounded to BF16: two roundings, torch's conversion.
    The table is an operand, not part of the arithmetic: float64 ``pow``,
    ``cos`` and ``sin`` are not correctly rounded, so its bits are those of
    this torch build's CPU math library (another library may differ in the
    last place); every device and both decode paths read this one table's
    bits, which is what makes RoPE exact across them.

    ``forward(x, positions)`` rotates the pair ``(a, b) = (x_2j, x_(2j+1))``
    of every head with ``c, s`` of the row's position (widened to FP32):
    ``a' = a * c - b * s`` and ``b' = b * c + a * s``, each product and the
    sum/difference rounded once (no FMA), the result rounded to BF16."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float = 10000.0,
        table_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"GPT-J RoPE takes an even head size, not {head_dim}")
        _check_dtype(table_dtype, (torch.bfloat16, torch.float32), "the RoPE table's dtype")
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = float(theta)
        j = torch.arange(head_dim // 2, dtype=torch.float64)
        freqs = self.theta ** (-2.0 * j / head_dim)
        angles = torch.arange(max_position, dtype=torch.float64)[:, None] * freqs[None, :]
        table = torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)
        self.register_buffer("cos_sin", table.to(table_dtype).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x``: ``[m, heads, D]``; ``positions``: integer ``[m]``."""
        if positions.is_floating_point() or positions.is_complex():
            raise ValueError(f"RoPE positions must be integers, not {positions.dtype}")
        # (The check reads the positions on the host: skipped under graph capture.)
        if not capturing() and positions.numel() and (
            int(positions.min()) < 0 or int(positions.max()) >= self.max_position
        ):
            raise ValueError(f"RoPE positions must lie in [0, {self.max_position})")
        half = self.head_dim // 2
        cs = self.cos_sin.to(x.device)[positions.long()].to(F32)
        c, s = cs[:, None, :half], cs[:, None, half:]
        x = x.to(F32)
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = b * c + a * s
        return out.to(torch.bfloat16)


class PagedKVCache:
    """A paged BF16 KV cache ``tensor`` ``[num_blocks, kv_heads, block_size,
    2 * D]``: K then V in the last dim. Slot ``s`` is row ``s % block_size``
    of block ``s // block_size``.

    One scratch block lies past ``tensor`` in the same allocation: ``insert``
    sends a negative slot's row there instead of skipping it with a
    data-dependent branch, so the insert is CUDA-graph capturable and
    ``tensor`` gets exactly the writes of ``kv_insert``."""

    def __init__(self, num_blocks: int, kv_heads: int, block_size: int, head_dim: int, device=None) -> None:
        self._storage = torch.zeros(
            (num_blocks + 1, kv_heads, block_size, 2 * head_dim), dtype=torch.bfloat16, device=device
        )
        self.tensor = self._storage[:num_blocks]
        self.block_size = block_size
        self.head_dim = head_dim
        self.num_slots = num_blocks * block_size

    def insert(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``k``, ``v`` (BF16 ``[m, kv_heads, D]``) at ``slots`` (int
        ``[m]``); a negative slot skips its row (its K/V are not written to
        ``tensor``). Outside graph capture, a slot beyond the cache raises
        ValueError (the check reads the slots on the host)."""
        if not capturing():
            _check_insert(self.tensor, k, v, slots)
        rows = torch.where(slots >= 0, slots, torch.full_like(slots, self.num_slots)).long()
        self._storage[rows // self.block_size, :, rows % self.block_size] = torch.cat([k, v], dim=-1).to(
            self._storage.dtype
        )

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (``[..., kv_heads, D]``) at non-negative ``slots``."""
        blocks, rows = slots // self.block_size, slots % self.block_size
        kv = self.tensor[blocks, :, rows]  # [..., kv_heads, 2D]
        return kv[..., : self.head_dim], kv[..., self.head_dim :]


def capturing() -> bool:
    """Whether host reads must be skipped: the current CUDA stream is
    capturing a graph, or torch.compile is tracing (its code may later run
    inside a capture, so it is traced without the host-side range checks)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_insert(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    num_blocks, heads, bs, width = cache.shape
    d = width // 2
    if k.shape[-2:] != (heads, d) or v.shape != k.shape or slots.shape != k.shape[:1]:
        raise ValueError(f"the KV insert takes k and v of [m, {heads}, {d}] and slots of [m]")
    keep = slots >= 0
    if keep.any() and int(slots[keep].max()) >= num_blocks * bs:
        raise ValueError(f"a slot beyond the cache's {num_blocks * bs} slots")
    # Which of two rows for one slot would land is unspecified (index_put's
    # order on CUDA): the spec forbids it.
    if keep.any() and torch.unique(slots[keep]).numel() != int(keep.sum()):
        raise ValueError("the KV insert takes distinct slots; a non-negative slot repeats")


def kv_insert(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """The cache insert: ``cache[s // bs, h, s % bs] = cat(k[i, h], v[i, h])``
    for every row ``i`` with ``s = slots[i] >= 0``; a negative slot skips.
    K and V are stored in the cache's dtype (an FP32 row is rounded to BF16).
    Raises ValueError for a slot beyond the cache or a repeated slot."""
    _check_insert(cache, k, v, slots)
    bs = cache.shape[2]
    keep = slots >= 0
    s = slots[keep].long()
    cache[s // bs, :, s % bs] = torch.cat([k[keep], v[keep]], dim=-1).to(cache.dtype)


def o_gate(attn: torch.Tensor, gate: torch.Tensor, norm: HeadNorm) -> torch.Tensor:
    """The o-norm with its sigmoid o-gate, per head: ``n = norm(attn)`` (BF16),
    ``out = n * sigmoid_rn(gate)`` (FP32, the product rounded once), rounded
    to BF16. ``attn``, ``gate``: ``[m, heads, D]``."""
    return (norm(attn).to(F32) * sigmoid_rn(gate)).to(torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` in the weight's dtype: a device GEMM (cuBLAS, or the
    CPU's BLAS), outside the device-independent spec; both decode paths of one
    device run the same one."""
    return torch.matmul(x.to(weight.dtype), weight.t())


class GatedMLP(nn.Module):
    """The gated SiLU MLP: ``gu = linear(x, gate_up)`` (BF16 ``[m, 2I]``,
    gate rows first), ``h = silu_rn(g) * u`` (FP32, the product rounded once)
    rounded to BF16, then ``linear(h, down)`` (BF16 ``[m, H]``)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up = nn.Parameter(
            torch.zeros(2 * intermediate_size, hidden_size, dtype=torch.bfloat16), requires_grad=False
        )
        self.down = nn.Parameter(
            torch.zeros(hidden_size, intermediate_size, dtype=torch.bfloat16), requires_grad=False
        )

    def activation(self, gu: torch.Tensor) -> torch.Tensor:
        """``round_bf16(silu_rn(g) * u)`` of the gate-up output."""
        g, u = gu.split(self.intermediate_size, dim=-1)
        return (silu_rn(g) * u.to(F32)).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.activation(linear(x, self.gate_up)), self.down)


__all__ = [
    "GatedMLP",
    "GatedResidual",
    "HeadNorm",
    "PagedKVCache",
    "RMSNorm",
    "Rotary",
    "kv_insert",
    "linear",
    "o_gate",
    "residual_boundary",
    "round_to",
]
