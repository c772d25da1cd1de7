"""The draft's Markov stage on DSpark kernels: one launch a step after the
stock bias GEMM, ``greedy.MarkovStep`` (``dspark_core.spec.markov``),
``sample.MarkovSampleStep`` (vLLM's Gumbel sample and logits cache,
``dspark_core.spec.gumbel``) and the loops around them (``loop``); or,
greedy, one launch a step with the bias GEMM in it in cuBLAS's order where
the build-time check found it (``bias_step.MarkovBiasStep``); or the same
steps, all N in one cooperative launch with ``w2`` held on chip
(``persistent.MarkovPersistentLoop``)."""
