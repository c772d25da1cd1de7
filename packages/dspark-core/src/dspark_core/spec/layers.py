"""The stock eager layers of the DSpark draft as vLLM 0.33.0 runs them on
CUDA: the executable numeric spec each fused kernel reproduces bit for bit.

Each forward is the arithmetic of the stock kernel named in its docstring,
written with ``dspark_core.spec.numerics`` (read its docstring first: the
row norm's tree per architecture, ``fma_rn`` and the approximate
instructions). Inputs of BF16, FP16 or FP32 are widened to FP32 exactly;
every FP32 operation rounds once to nearest even unless it says otherwise;
"rounded to bf16" is ``cvt.rn.bf16.f32``. Where the stock's tree depends on
the GPU, a layer takes ``arch`` (``numerics.ARCHS``; default: the device's,
``stock_arch``, sm_90a on a CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_core import checks
from dspark_core.spec.numerics import (
    F32,
    check_arch,
    check_head_width,
    check_row_width,
    ex2_approx,
    ex2_approx_ftz,
    expf,
    f32,
    fma_rn,
    fold_halves,
    inv_rms,
    pairwise,
    rcp_approx_ftz,
    rcp_full,
    round_to,
    row_sum_of_squares,
    rsqrt_approx,
    rsqrt_approx_ftz,
    sqrt_approx_ftz,
)
from dspark_core.switches import flag

WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_eps(eps: float) -> float:
    """``eps`` as a float: a non-negative number finite in FP32 (the stock
    rounds it to FP32), as ``DraftConfig`` takes it; TypeError or ValueError."""
    return checks.fp32_number("a norm's eps", eps, low="non-negative")


def _size(name: str, value, heads: bool = False) -> int:
    """``value`` as an int from 1 to the kernels' bound on a size (heads:
    on a head count), ``contracts.limits``' (imported on first use: that
    module reads the spec); TypeError or ValueError naming ``name``."""
    from dspark_core.contracts import limits

    return checks.integer(name, value, 1, limits.MAX_HEADS if heads else limits.MAX_SIZE)


def _check_rows(x, what: str) -> None:
    """TypeError unless ``x`` is a tensor of BF16, FP16 or FP32 (the dtypes
    a layer widens to FP32 exactly): an integer or FP64 tensor is refused,
    not cast."""
    if not isinstance(x, torch.Tensor) or x.dtype not in OUT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{what} must be a bfloat16, float16 or float32 tensor, not {got}")


def _check_dtype(dtype: torch.dtype, allowed, what: str) -> None:
    names = ", ".join(str(d).replace("torch.", "") for d in allowed)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what} must be a torch dtype, one of {names}, not {checks.shown(dtype)}")
    if dtype not in allowed:
        raise ValueError(f"{what} must be one of {names}, not {dtype}")


def stock_arch(device) -> str:
    """The architecture whose stock arithmetic a layer on ``device`` follows:
    sm_100a on a GPU of compute capability 10, else sm_90a (a CPU included)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10:
        return "sm_100a"
    return "sm_90a"


class RMSNorm(nn.Module):
    """RMSNorm of rows of ``hidden_size`` columns (a multiple of 2048), as
    the stock Triton norm (``fused_rmsnorm_fwd``, single tile) computes it.

    With ``x`` the row widened to FP32 and ``g = w + c`` (the weight widened,
    plus the gain center ``c`` as FP32, always added: a -0.0 weight with a
    0.0 center gives +0.0):

    - ``weight_before_norm`` (``MuseSpark1xRMSNormWithInputScale``):
      ``v = g * x``; ``s = row_sum_of_squares(v)`` (its tree for ``arch``,
      the input-scaled leaves on sm_100a); ``r = inv_rms(s, H, eps)``;
      ``y = r * v``;
    - otherwise: ``s = row_sum_of_squares(x)``, ``r = inv_rms(s, H, eps)``,
      ``y = g * (r * x)`` (without a weight, ``y = r * x``);

    ``inv_rms`` is ``rsqrt.approx.ftz(fma(s, 1/H, eps))``; then ``y`` rounded
    to ``out_dtype``. ``eps`` and the center are FP32 (rounded once). Rows are
    independent; any leading shape is kept. ``arch``: None follows the input's
    device (``stock_arch``). The trees are the stock's for BF16 rows (every
    draft norm's input); for FP32 or FP16 rows the stock kernel reduces in
    other orders (``numerics``)."""

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
        arch: str | None = None,
    ) -> None:
        super().__init__()
        hidden_size = _size("RMSNorm's hidden_size", check_row_width(hidden_size, "RMSNorm's hidden_size"))
        self.arch = None if arch is None else check_arch(arch)
        _check_dtype(out_dtype, OUT_DTYPES, "the norm's output dtype")
        weighted, scaled = flag(has_weight, "has_weight"), flag(weight_before_norm, "weight_before_norm")
        if weighted:
            _check_dtype(weight_dtype, WEIGHT_DTYPES, "the norm weight's dtype")
        if scaled and not weighted:
            raise ValueError("a weightless norm cannot scale its input by a weight")
        self.hidden_size = hidden_size
        self.eps = _check_eps(eps)
        self.has_weight = has_weight
        self.gain_center = checks.fp32_number("the norm's gain center", gain_center)
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
        return self.weight.to(F32) + f32(self.gain_center)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        _check_rows(x, "the norm's input")
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"RMSNorm({self.hidden_size}) takes rows of {self.hidden_size} "
                f"columns, not {x.shape[-1]}"
            )
        if out_dtype is not None:
            _check_dtype(out_dtype, OUT_DTYPES, "the norm's output dtype")
        arch = self.arch or stock_arch(x.device)
        x = x.to(F32)
        g = self.gain()
        scaled = g is not None and self.weight_before_norm
        if scaled:
            x = g * x
        r = inv_rms(row_sum_of_squares(x, arch, scaled), self.hidden_size, self.eps).unsqueeze(-1)
        y = r * x
        if g is not None and not scaled:
            y = g * y
        return y.to(out_dtype or self.out_dtype)


class HeadNorm(nn.Module):
    """A weightless per-head RMSNorm over ``head_dim`` columns: its ``eps``
    (FP32). The stock draft runs three of them, each its own kernel:
    ``qk_norm_rope`` (the decode QK-norm), ``k_norm_context`` (the context
    chain's K-norm) and ``o_gate`` (the o-norm with its sigmoid gate)."""

    def __init__(self, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        head_dim = check_head_width(head_dim, "HeadNorm's head_dim")
        self.head_dim = head_dim
        self.eps = _check_eps(eps)
        self.register_parameter("weight", None)


def _check_heads(x: torch.Tensor, d: int, what: str) -> None:
    if x.shape[-1] != d:
        raise ValueError(f"{what} takes heads of {d} columns, not {x.shape[-1]}")


def qk_norm_rope(x: torch.Tensor, norm: HeadNorm, positions: torch.Tensor | None = None,
                 rotary: Rotary | None = None) -> torch.Tensor:
    """vLLM's fused QK-norm + RoPE (``fused_muse_spark_qknorm_rope_kv_insert``)
    of heads ``x`` ``[m, heads, 64]``: lane ``l`` of a head's 8 holds its
    elements ``8l .. 8l+7``; its sum is the chain ``fma(e7, e7, ... fma(e0,
    e0, 0))``; the 8 lane sums fold by halves (xor 4, 2, 1); ``r =
    rsqrt(fma(S, 1/64, eps))`` (``rsqrtf``); ``n = e * r`` in FP32; with
    ``rotary``, GPT-J RoPE at ``positions`` on the FP32 ``n``
    (``Rotary.rotate``); one rounding to BF16."""
    _check_rows(x, "the QK-norm's heads")
    _check_heads(x, norm.head_dim, "the QK-norm")
    d = norm.head_dim
    e = x.to(F32).reshape(*x.shape[:-1], d // 8, 8)
    acc = torch.zeros(e.shape[:-1], dtype=F32, device=x.device)
    for j in range(8):
        acc = fma_rn(e[..., j], e[..., j], acc)
    total = fold_halves(acc)
    v = fma_rn(total, torch.full_like(total, f32(1.0 / d)), torch.full_like(total, f32(norm.eps)))
    n = x.to(F32) * rsqrt_approx(v).unsqueeze(-1)
    if rotary is not None:
        n = rotary.rotate(n, positions)
    return n.to(torch.bfloat16)


def k_norm_context(k: torch.Tensor, norm: HeadNorm) -> torch.Tensor:
    """The context chain's K-norm (``precompute_and_store_context_kv``, ATen):
    ``q = k * k``; per 64-wide row ``s_l = q_l + q_(l+32)`` (l < 32), folded
    by halves (shfl-down 16 .. 1); ``mean = t * 2^-6``; ``v = mean + eps``;
    ``r = torch.rsqrt(v)`` (``rsqrtf``); ``k * r`` rounded to BF16."""
    _check_rows(k, "the K-norm's keys")
    _check_heads(k, norm.head_dim, "the K-norm")
    half = norm.head_dim // 2
    kf = k.to(F32)
    q = kf * kf
    total = fold_halves(q[..., :half] + q[..., half:])
    mean = total * torch.full_like(total, f32(1.0 / norm.head_dim))
    r = rsqrt_approx(mean + torch.full_like(mean, f32(norm.eps)))
    return (kf * r.unsqueeze(-1)).to(torch.bfloat16)


class GatedResidual(nn.Module):
    """The norm-preserving gated residual connection: FP32
    ``alpha * stream + beta * branch``, each product rounded, then their sum
    rounded; ``alpha`` and ``beta`` are FP32 ``[H]``. ``stream`` and
    ``branch`` are widened to FP32 exactly; the result is FP32."""

    def __init__(self, hidden_size: int, alpha: float = 1.0, beta: float = 1.0) -> None:
        super().__init__()
        hidden_size = _size("the gated residual's hidden_size", hidden_size)
        alpha = checks.fp32_number("the residual alpha", alpha)
        beta = checks.fp32_number("the residual beta", beta)
        self.hidden_size = hidden_size
        self.alpha = nn.Parameter(torch.full((hidden_size,), alpha, dtype=F32), requires_grad=False)
        self.beta = nn.Parameter(torch.full((hidden_size,), beta, dtype=F32), requires_grad=False)

    def forward(self, stream: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        _check_rows(stream, "the residual stream")
        _check_rows(branch, "the residual branch")
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
    (FP32 by default, as vLLM's ``rope_use_fp32_in_outer_product``; or BF16):
    columns ``j < D/2`` hold ``cos(p * f_j)``, columns ``D/2 + j`` ``sin(p *
    f_j)``, ``f_j = theta ** (-2j / D)``, computed in float64 by torch on the
    CPU and rounded to the table's dtype. The table is an operand, not part
    of the arithmetic: every device and both decode paths read this one
    table's bits. The context chain rotates with the table cast to BF16
    (``context_table``), as the stock's rotary op casts its cache to the
    keys' dtype.

    ``rotate(x, positions, table)`` turns the pair ``(x, y) = (x_2j,
    x_(2j+1))`` of every head, with ``c, s`` of the row's position widened
    to FP32, into ``x' = fma(c, x, -(s * y))`` and ``y' = fma(s, x, c * y)``
    (each product rounded, then one fused multiply-add: the stock CUDA
    rotary kernels' form), in FP32. ``forward`` is ``rotate`` rounded to BF16."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float = 10000.0,
        table_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if _size("Rotary's head_dim", head_dim, heads=True) % 2:
            raise ValueError(f"Rotary's head_dim: GPT-J RoPE takes an even head size, not {head_dim}")
        _check_dtype(table_dtype, (torch.bfloat16, torch.float32), "the RoPE table's dtype")
        self.head_dim = head_dim
        self.max_position = _size("Rotary's max_position", max_position)
        # DraftConfig's rope_theta: a base of 1 or below (0 gives inf and NaN frequencies) is refused.
        self.theta = checks.fp32_number("the RoPE base theta", theta, above=1.0)
        j = torch.arange(head_dim // 2, dtype=torch.float64)
        freqs = self.theta ** (-2.0 * j / head_dim)
        angles = torch.arange(max_position, dtype=torch.float64)[:, None] * freqs[None, :]
        table = torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)
        self.register_buffer("cos_sin", table.to(table_dtype).contiguous(), persistent=False)

    def context_table(self) -> torch.Tensor:
        """The table the context chain rotates with: ``cos_sin`` in BF16."""
        return self.cos_sin.to(torch.bfloat16)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[m, heads, D]`` rotated in FP32 at integer ``positions``
        ``[m]`` (class docstring); ``table`` defaults to ``cos_sin``."""
        _check_rows(x, "the rotated heads")
        if positions.is_floating_point() or positions.is_complex():
            raise ValueError(f"RoPE positions must be integers, not {positions.dtype}")
        if positions.shape != x.shape[:1]:
            raise ValueError(f"RoPE takes one position per row: {x.shape[0]} rows, {list(positions.shape)} positions")
        # (The check reads the positions on the host: skipped under graph capture.)
        if not capturing() and positions.numel() and (
            int(positions.min()) < 0 or int(positions.max()) >= self.max_position
        ):
            raise ValueError(f"RoPE positions must lie in [0, {self.max_position})")
        table = self.cos_sin if table is None else table
        half = self.head_dim // 2
        cs = table.to(x.device)[positions.long()].to(F32)
        c, s = cs[:, None, :half], cs[:, None, half:]
        x = x.to(F32)
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = fma_rn(c, a, -(s * b))
        out[..., 1::2] = fma_rn(s, a, c * b)
        return out

    def forward(self, x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """``rotate`` rounded to BF16."""
        return self.rotate(x, positions, table).to(torch.bfloat16)


# Physical orders of a layer's logical [blocks, kv_heads, block_size, 2D]
# cache, by vLLM's KVCacheLayout names of the layer-outermost ones: the
# permutation that gives the logical view of the physical allocation.
CACHE_LAYOUTS = {"LBHNC": (0, 1, 2, 3), "LBNHC": (0, 2, 1, 3)}


class PagedKVCache:
    """A paged BF16 KV cache ``tensor`` ``[num_blocks, kv_heads, block_size,
    2 * D]``: K then V in the last dim. Slot ``s`` is row ``s % block_size``
    of block ``s // block_size``. ``layout``: its physical order
    (``CACHE_LAYOUTS``): LBHNC, ``tensor`` contiguous, or LBNHC
    (``[block][token][head]`` rows, vLLM's default on sm_90), ``tensor`` a
    strided view.

    One scratch block lies past ``tensor`` in the same allocation: ``insert``
    sends a negative slot's row there instead of skipping it with a
    data-dependent branch, so the insert is CUDA-graph capturable and
    ``tensor`` gets exactly the writes of ``kv_insert``."""

    def __init__(self, num_blocks: int, kv_heads: int, block_size: int, head_dim: int, device=None,
                 layout: str = "LBHNC") -> None:
        if not isinstance(layout, str) or layout not in CACHE_LAYOUTS:
            raise ValueError(f"the KV cache layout must be one of {', '.join(CACHE_LAYOUTS)}, not "
                             f"{checks.shown(layout)}")
        num_blocks = _size("the cache's num_blocks", num_blocks)
        kv_heads = _size("the cache's kv_heads", kv_heads, heads=True)
        block_size = _size("the cache's block_size", block_size)
        head_dim = _size("the cache's head_dim", head_dim, heads=True)
        order = CACHE_LAYOUTS[layout]
        logical = (num_blocks + 1, kv_heads, block_size, 2 * head_dim)
        physical = torch.zeros([logical[i] for i in order], dtype=torch.bfloat16, device=device)
        self._storage = physical.permute(*order)  # each order is its own inverse
        self.layout = layout
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
    _check_rows(k, "the inserted K")
    _check_rows(v, "the inserted V")
    if not isinstance(slots, torch.Tensor) or slots.is_floating_point() or slots.is_complex() \
            or slots.dtype == torch.bool:
        raise TypeError(f"the KV insert's slots must be an integer tensor, not "
                        f"{getattr(slots, 'dtype', type(slots).__name__)}")
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


_NEG_LOG2E = f32(-1.4426950408889634)  # 0xBFB8AA3B


def o_gate(attn: torch.Tensor, gate: torch.Tensor, norm: HeadNorm, arch: str | None = None) -> torch.Tensor:
    """The o-norm with its sigmoid o-gate per head (``attn``, ``gate``
    ``[m, heads, D]``, BF16), as the stock runs it on ``arch``:

    - sm_90a, FLA's Triton ``layer_norm_gated_fwd_kernel``: lane ``l`` of 16
      holds ``x_4l .. x_4l+3``, its sum ``fma(x0, x0, x1 * x1) + fma(x2, x2,
      x3 * x3)``; the 16 sums fold by halves; ``v = fma(S, 1/D, eps)``;
      ``rstd = div.full(1, sqrt.approx.ftz(v))``; ``h = x * rstd``;
      ``sig = div.full(1, ex2.approx(g * -log2 e) + 1)``; ``y = h * sig``;
    - sm_100a, FlashInfer's ``rmsnorm_sigmoid_gate``: up to 256 rows (``m *
      heads``) lane ``l`` of 32 holds ``x_2l, x_2l+1``, above lane ``l`` of 8
      holds ``x_8l .. x_8l+7``; squares rounded, summed pairwise in the lane,
      the lane sums pairwise (xor 1, 2, ...); ``inv = rsqrt.approx.ftz(fma(S,
      1/D, eps))``; ``sig = rcp.approx.ftz(ex2.approx.ftz(g * -log2 e) + 1)``;
      ``y = sig * (x * inv)``;

    rounded to BF16."""
    _check_rows(attn, "the o-gate's attention")
    _check_rows(gate, "the o-gate's gate")
    _check_heads(attn, norm.head_dim, "the o-norm")
    if gate.shape != attn.shape:
        raise ValueError(f"the o-gate takes a gate of the attention's shape {list(attn.shape)}, not "
                         f"{list(gate.shape)}")
    arch = check_arch(stock_arch(attn.device) if arch is None else arch)
    d = norm.head_dim
    x, g = attn.to(F32), gate.to(F32)
    rows = x.shape[0] * x.shape[1] if x.dim() == 3 else x.numel() // d
    if arch == "sm_90a":
        q = x.reshape(*x.shape[:-1], d // 4, 4)
        pair = [fma_rn(q[..., i], q[..., i], q[..., i + 1] * q[..., i + 1]) for i in (0, 2)]
        lanes = pair[0] + pair[1]
    else:
        per = 2 if rows <= 256 else 8
        q = (x * x).reshape(*x.shape[:-1], d // per, per)
        lanes = pairwise(q)
    total = fold_halves(lanes) if arch == "sm_90a" else pairwise(lanes)
    v = fma_rn(total, torch.full_like(total, f32(1.0 / d)), torch.full_like(total, f32(norm.eps))).unsqueeze(-1)
    z = g * torch.full_like(g, _NEG_LOG2E)
    if arch == "sm_90a":
        h = x * rcp_full(sqrt_approx_ftz(v))
        sig = rcp_full(ex2_approx(z) + 1.0)
        return (h * sig).to(torch.bfloat16)
    sig = rcp_approx_ftz(ex2_approx_ftz(z) + 1.0)
    return (sig * (x * rsqrt_approx_ftz(v))).to(torch.bfloat16)


def silu_and_mul(gu: torch.Tensor, intermediate: int) -> torch.Tensor:
    """vLLM's ``SiluAndMul`` (``act_and_mul_kernel``) of BF16 ``gu [m, 2I]``
    (gate columns first): ``a = x / (expf(-x) + 1)`` (CUDA's accurate
    ``expf``, IEEE division) rounded to BF16, then ``a * (up + 0.0)`` rounded
    to BF16 (``up + 0.0`` turns a -0.0 up into +0.0)."""
    _check_rows(gu, "the activation's gate-up rows")
    intermediate = checks.integer("the activation's intermediate size (intermediate)", intermediate, 1)
    if gu.shape[-1] != 2 * intermediate:
        raise ValueError(f"the activation takes gate-up rows of 2 * intermediate = {2 * intermediate} columns, "
                         f"not {list(gu.shape)}")
    g, u = gu.to(F32).split(intermediate, dim=-1)
    a = (g / (expf(-g) + 1.0)).to(torch.bfloat16).to(F32)
    return (a * (u + 0.0)).to(torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` in the weight's dtype: a device GEMM (cuBLAS, or the
    CPU's BLAS), outside the device-independent spec; both decode paths of one
    device run the same one."""
    return torch.matmul(x.to(weight.dtype), weight.t())


class GatedMLP(nn.Module):
    """vLLM's ``LlamaMLP``: ``gu = linear(x, gate_up)`` (BF16 ``[m, 2I]``,
    gate rows first), ``h = silu_and_mul(gu)``, then ``linear(h, down)``
    (BF16 ``[m, H]``)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        hidden_size = _size("GatedMLP's hidden_size", hidden_size)
        intermediate_size = _size("GatedMLP's intermediate_size", intermediate_size)
        self.intermediate_size = intermediate_size
        self.gate_up = nn.Parameter(
            torch.zeros(2 * intermediate_size, hidden_size, dtype=torch.bfloat16), requires_grad=False
        )
        self.down = nn.Parameter(
            torch.zeros(hidden_size, intermediate_size, dtype=torch.bfloat16), requires_grad=False
        )

    def activation(self, gu: torch.Tensor) -> torch.Tensor:
        """``silu_and_mul`` of the gate-up output."""
        return silu_and_mul(gu, self.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.activation(linear(x, self.gate_up)), self.down)


__all__ = [
    "GatedMLP",
    "GatedResidual",
    "HeadNorm",
    "PagedKVCache",
    "RMSNorm",
    "Rotary",
    "k_norm_context",
    "kv_insert",
    "linear",
    "o_gate",
    "qk_norm_rope",
    "residual_boundary",
    "round_to",
    "silu_and_mul",
    "stock_arch",
]
