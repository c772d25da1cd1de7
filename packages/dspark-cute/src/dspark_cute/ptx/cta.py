"""The reference CTA of the row tree (``dspark_core.spec.numerics``): 256
threads of 8-column fragments, thread ``t`` holding columns ``t * 8 + k *
2048 .. + 7``; the bytes of one fragment by dtype name."""

THREADS = 256
VEC = 8
WARP = 32
WARPS = THREADS // WARP
CHUNK = THREADS * VEC
FRAGMENT_BYTES = {"bf16": 16, "fp16": 16, "fp32": 32}

__all__ = ["CHUNK", "FRAGMENT_BYTES", "THREADS", "VEC", "WARP", "WARPS"]
