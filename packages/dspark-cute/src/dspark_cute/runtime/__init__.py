"""The host side of the kernels: operands, the capture guard, the compile
cache (``host.jit_cache``), PTX capture on the CPU."""
