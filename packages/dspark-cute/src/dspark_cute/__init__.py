"""DSpark's fused CuTe DSL kernels, bit for bit the ``dspark_core`` spec.

Subpackages: ``ptx`` (every traced PTX primitive), ``runtime`` (the host
side: operands, the capture guard, the compile cache, CPU PTX capture) and
``cutedsl`` (the kernels and their host classes: ``norms``, ``context``,
``qkv``, ``attention``, ``gating``, ``gemm``, ``prefetch``). ``_provides``
names each kernel's host class for the ``dspark.kernels`` entry point.

The host classes are importable from here lazily (``dspark_cute.RowNorm``),
so importing the package does not load the CuTe DSL.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "RowNorm": "dspark_cute.cutedsl.norms.row_norm",
    "DraftBoundary": "dspark_cute.cutedsl.norms.boundary",
    "ContextNorms": "dspark_cute.cutedsl.norms.context_norms",
    "ContextKvStore": "dspark_cute.cutedsl.context.store",
    "ContextChain": "dspark_cute.cutedsl.context.chain",
    "QKVEpilogue": "dspark_cute.cutedsl.qkv.epilogue",
    "PagedAttention": "dspark_cute.cutedsl.attention.paged",
    "OGate": "dspark_cute.cutedsl.gating.o_gate",
    "MlpActivation": "dspark_cute.cutedsl.gating.mlp_activation",
    "Gemv": "dspark_cute.cutedsl.gemm.gemv",
    "WeightPrefetch": "dspark_cute.cutedsl.prefetch",
    "WeightPrefetcher": "dspark_cute.cutedsl.prefetch",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dspark_cute' has no attribute {name!r}")
