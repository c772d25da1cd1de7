"""Every traced PTX primitive of the DSpark kernels, one flat namespace
(``from dspark_cute import ptx; ptx.add_rn(a, b)``).

Each helper is plain Python that emits MLIR while a ``@cute.kernel`` is
traced (call it from a kernel or from a function a kernel calls). Values:
``Float32`` for FP32 values, ``Uint32`` for raw 32-bit words (a bf16x2 or
fp16x2 pair, an FP32 bit pattern), ``Int64`` for global byte addresses,
``Int32`` for shared ones. By theme:

- ``cta``: the reference CTA of the row tree (``THREADS``, ``VEC``, ``WARP``,
  ``WARPS``, ``CHUNK``, ``FRAGMENT_BYTES``);
- ``arith``: rounded FP32 operations (``add_rn`` .. ``sqrt_rn``, ``neg_f32``,
  ``max_nan``), bit casts, BF16/FP16 conversions, the BF16 tensor-core MMA;
- ``memory``: global and shared loads and stores, ``cp.async``, L2 prefetch;
- ``bulk``: ``cp.async.bulk`` copies, the ``mbarrier`` they complete on, the
  streamed GEMM's epilogue scalars;
- ``sync``: PDL, the warp barrier, the mailbox's system-scope
  loads, stores and polls;
- ``reduce``: the row tree and the other fixed-order folds;
- ``math``: the exponentials, ``exp_rn`` (the reference attention's) and
  ``expf`` (CUDA's accurate ``expf``: the stock activation's);
- ``markov``: the Markov step's ``tanhf``, argmax keys and grid-wide
  reduction atomics;
- ``stock``: the stock kernels' fused multiply-add and approximate
  instructions (``fma_rn``, ``rsqrt_approx_ftz``, ...) and ``pairwise``.

Inline asm is emitted by ``inline.asm`` alone.
"""

from . import arith, bulk, cta, markov, math, memory, reduce, stock, sync
from .arith import *  # noqa: F403
from .bulk import *  # noqa: F403
from .cta import *  # noqa: F403
from .markov import *  # noqa: F403
from .math import *  # noqa: F403
from .memory import *  # noqa: F403
from .reduce import *  # noqa: F403
from .stock import *  # noqa: F403
from .sync import *  # noqa: F403

__all__ = [  # noqa: PLE0604
    *arith.__all__,
    *bulk.__all__,
    *cta.__all__,
    *markov.__all__,
    *math.__all__,
    *memory.__all__,
    *reduce.__all__,
    *stock.__all__,
    *sync.__all__,
]
