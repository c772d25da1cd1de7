"""The projections: ``ordered`` (the ordered GEMM in cuBLAS's split order,
its host ``OrderedGemm``) with ``ordered_layout`` (its layout and launch
settings) and ``streamed`` (its TMA kernel), the pieces both trace from
(``mma``), the build-time timing against cuBLAS (``decide``) behind the
stand-in of the part before a projection (``lead``); ``skinny``
(the package GEMM's tensor-core main loops of 1 to 16 rows) and ``gemv``
(``Gemv``: the one-token GEMV)."""
