"""DSpark's fused CuTe DSL kernels, bit for bit the ``dspark_core`` spec.

Modules: ``ptx`` (traced PTX building blocks: rounded FP32 arithmetic,
conversions, 16-byte vector memory access, the row tree, PDL), ``host``
(operands, compile cache, capture guard, CPU PTX capture), ``row_norm``
(``RowNorm``: one ``RMSNorm`` over rows) and ``boundary`` (``DraftBoundary``:
post-norm, gated FP32 residual and pre-norm in one kernel).

The kernel classes are imported lazily (``dspark_cute.RowNorm``), so importing
the package does not load the CuTe DSL.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["DraftBoundary", "RowNorm"]


def __getattr__(name: str):
    if name == "RowNorm":
        from .row_norm import RowNorm

        return RowNorm
    if name == "DraftBoundary":
        from .boundary import DraftBoundary

        return DraftBoundary
    raise AttributeError(f"module 'dspark_cute' has no attribute {name!r}")
