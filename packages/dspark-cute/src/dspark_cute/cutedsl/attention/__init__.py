"""The decode attention: ``paged`` (``PagedAttention``, the host class),
``direct`` (K and V read from global memory), ``staged`` (K and V staged in
shared memory, the o-gate fused) and ``common`` (what both kernels run)."""
