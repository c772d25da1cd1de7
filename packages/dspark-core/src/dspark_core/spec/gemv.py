"""The one-token projection in a stated order (the GEMV): the spec of the
opt-in kernel that replaces the stock cuBLAS projections of a draft step at
m = 1.

A stock projection ``linear(x, W)`` is the library's GEMM, whose summation
order is its own (and changes with its heuristics). ``gemv(x, W)`` is the
same product ``y[r] = sum_k x[k] W[r, k]`` (``x`` BF16 ``[1, K]``, ``W``
BF16 ``[N, K]``, ``y`` BF16 ``[1, N]``) with every rounding stated, so it
gives the same bits on CPU and on CUDA and the kernel is tested bit for bit
against it. Per output row ``r``:

1. the products ``p_k = x[k] * W[r, k]`` in FP32 (``mul.rn``: exact, since a
   product of two BF16 has at most 16 significant bits, except where it
   underflows FP32's normal range, where it rounds once to nearest; no
   flush to zero);
2. column ``k = 256 f + 8 l + j`` belongs to lane ``l`` (0..31), fragment
   ``f`` (0..K/256-1), element ``j`` (0..7); each fragment's 8 products add
   pairwise: ``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))``;
3. each lane adds its fragment sums in order of ``f``: ``((s_0 + s_1) +
   s_2) + ...``;
4. the 32 lane sums fold by halves (``s_l + s_(l+16)``, then 8, 4, 2, 1: the
   butterfly of one warp);
5. the sum is rounded to BF16 once (nearest even).

Steps 2-4 are the row tree of ``dspark_core.spec.numerics`` with one warp in
place of a CTA (its step 5 is absent). Every addition is ``add.rn``; there
is no fused multiply-add. NaN results are NaN (payloads are the devices',
as everywhere in the spec). Error against the exact product: at most
``(K/256 + 7) * 2^-24 * sum |x_k W_rk|`` in FP32 (a chain of K/256 - 1
fragment additions, 3 inside a fragment, 5 in the fold), plus the BF16
rounding and underflow, which ``error_bound`` states.

The decode uses it for ``qkv_proj``, ``o_proj``, ``gate_up`` and ``down`` at
m = 1 where the caller opts in (``policy.OPT_IN``): the step then equals the
stock forward with each of those projections computed by ``gemv`` (the GPU
tests check exactly that), not the stock forward's cuBLAS bits.
"""

from __future__ import annotations

import torch

from dspark_core.spec.numerics import F32, fold_halves

LANES = 32  # lanes of the warp that owns a row
VEC = 8  # columns a lane reads per fragment (16 bytes of BF16)
FRAGMENT = LANES * VEC  # columns per fragment row of the warp



def fragment_sum(v: torch.Tensor) -> torch.Tensor:
    """The pairwise sum of the last dim's 8 values:
    ``((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))``."""
    v = v[..., 0::2] + v[..., 1::2]
    v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0] + v[..., 1]

def gemv_unsupported(weight: torch.Tensor) -> str | None:
    """Why ``weight`` cannot be a GEMV operand, or None: BF16 ``[N, K]``
    with ``K`` a positive multiple of 256 and ``N`` a positive multiple of 16
    (a 256-thread CTA owns 16 rows, two per warp)."""
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return "a weight that is not a 2-D bf16 matrix"
    n, k = weight.shape
    if k <= 0 or k % FRAGMENT:
        return f"{k} input features, not a positive multiple of {FRAGMENT}"
    if n <= 0 or n % 16:
        return f"{n} output features, not a positive multiple of 16"
    return None


def lane_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Steps 1-3: FP32 ``[N, 32]``, lane ``l``'s sum of each row."""
    k = weight.shape[1]
    frags = k // FRAGMENT
    products = weight.to(F32).reshape(-1, frags, LANES, VEC) * x.to(F32).reshape(1, frags, LANES, VEC)
    sums = fragment_sum(products)  # [N, frags, 32]
    total = sums[:, 0]
    for f in range(1, frags):
        total = total + sums[:, f]
    return total


def gemv(x: torch.Tensor, weight: torch.Tensor, rows_per_chunk: int = 4096) -> torch.Tensor:
    """``x @ weight^T`` in the order of the module docstring: BF16 ``[1, N]``
    from BF16 ``x [1, K]`` (or ``[K]``) and ``weight [N, K]``, on their
    device (computed ``rows_per_chunk`` rows at a time to bound memory).
    ValueError for other operands."""
    why = gemv_unsupported(weight)
    if why is not None:
        raise ValueError(f"the GEMV cannot take this weight: {why}")
    n, k = weight.shape
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.numel() != k or x.dim() not in (1, 2) \
            or (x.dim() == 2 and x.shape[0] != 1):
        raise ValueError(f"the GEMV takes one bf16 row of {k} features (x of [1, {k}]), not "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    out = torch.empty(n, dtype=torch.bfloat16, device=weight.device)
    xr = x.reshape(k).to(weight.device)
    for r0 in range(0, n, rows_per_chunk):
        w = weight[r0:r0 + rows_per_chunk]
        out[r0:r0 + w.shape[0]] = fold_halves(lane_sums(xr, w)).to(torch.bfloat16)
    return out.reshape(1, n)


def error_bound(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The bound on ``|out - y|`` (float64 ``[1, N]``) for the exact ``y``:
    ``(K/256 + 7) 2^-24 T (1 + 2^-20) + K 2^-149 + 2^-8 |out| + 2^-134``,
    ``T = sum_k |x_k W_rk|`` (the FP32 additions; the products' underflow;
    the BF16 rounding)."""
    k = weight.shape[1]
    t = x.reshape(1, k).double().abs() @ weight.double().abs().t()
    chain = (k // FRAGMENT + 7) * 2.0**-24 * (1 + 2.0**-20)
    return chain * t + k * 2.0**-149 + out.double().abs() * 2.0**-8 + 2.0**-134


__all__ = ["FRAGMENT", "LANES", "VEC", "error_bound", "gemv", "gemv_unsupported", "lane_sums"]
