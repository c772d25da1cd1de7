"""The draft's Markov stage on DSpark kernels: ``greedy.MarkovStep``, the
fused greedy step after the stock bias GEMM (``dspark_core.spec.markov``)."""
