"""Bitwise comparison under the spec's one exception (NaN payloads).

Two tensors agree when their bit patterns are equal element by element
(-0.0 differs from +0.0, every subnormal and infinity is its own pattern),
except that any NaN equals any NaN: IEEE 754 leaves a NaN result's payload and
sign to the implementation, and CPUs and GPUs differ there (numerics.py).
"""

from __future__ import annotations

import torch

_INT_VIEW = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as the integer type of its width."""
    if t.dtype not in _INT_VIEW:
        raise ValueError(f"bits takes a floating tensor of 16, 32 or 64 bits, not {t.dtype}")
    return t.contiguous().view(_INT_VIEW[t.dtype])


def mismatches(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A boolean mask of the elements whose bits differ (NaN vs NaN agrees)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(
            f"bitwise comparison needs one dtype and shape, not {a.dtype}{tuple(a.shape)} "
            f"and {b.dtype}{tuple(b.shape)}"
        )
    b = b.to(a.device)
    differ = bits(a) != bits(b)
    return differ & ~(torch.isnan(a) & torch.isnan(b))


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Raise AssertionError naming the first differing elements unless
    ``actual`` and ``expected`` agree bit for bit (NaN payloads excepted)."""
    bad = mismatches(actual, expected)
    count = int(bad.sum())
    if count:
        idx = bad.nonzero()[:5].tolist()
        a, e = bits(actual).cpu(), bits(expected).cpu()
        samples = ", ".join(
            f"{tuple(i)}: {actual[tuple(i)].item()!r} (0x{int(a[tuple(i)]) & 0xFFFFFFFF:x}) vs "
            f"{expected[tuple(i)].item()!r} (0x{int(e[tuple(i)]) & 0xFFFFFFFF:x})"
            for i in idx
        )
        raise AssertionError(f"{what}: {count} of {bad.numel()} elements differ in bits; {samples}")
