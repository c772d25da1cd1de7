"""The CuTe DSL kernels and their host classes, by layer: ``norms``,
``context``, ``qkv``, ``attention``, ``gating``, ``gemm``, ``prefetch``;
``heads`` holds the traced pieces of a head the qkv and context kernels share."""
