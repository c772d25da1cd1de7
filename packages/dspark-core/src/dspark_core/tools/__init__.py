"""Tools around a draft: bitwise comparison, CUDA graph capture of a step, timing."""
