"""TMA tensor maps of weights, in device memory.

``weight_tensormap(weight, box_rows)``: the ``CUtensorMap`` of a BF16
row-major ``weight [n, k]`` (rows ``weight.stride(0)`` elements apart: a
contiguous weight or a row-padded view; ``cuTensorMapEncodeTiled``: rank 2, boxes of 64
columns by ``box_rows`` rows, 128-byte swizzle, 256-byte L2 promotion, no
out-of-bounds fill), copied into a 128-byte device buffer that kernels read
through its global address (a tensor map may live in global memory; nothing
writes it after the copy, so no tensormap proxy fence is needed).

A map encodes only the address, the shape and the box, so maps are cached
by ``(device, address, n, k, row stride, box_rows)``: a new tensor at a freed weight's
address with the same shape reuses a map that is still right. Encode and
copy before CUDA-graph capture (``prepare()``): RuntimeError during one.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from dspark_cute.runtime.host import assert_not_capturing

BOX_COLUMNS = 64  # 128 bytes of BF16: the 128-byte swizzle's row
_cache: dict[tuple, torch.Tensor] = {}
_lock = threading.Lock()


def weight_tensormap(weight: torch.Tensor, box_rows: int) -> torch.Tensor:
    """The device copy (uint8 ``[128]``, 64-byte aligned) of ``weight``'s
    tensor map with ``box_rows``-row boxes (module docstring). ValueError for
    a weight that is not a contiguous, 16-byte aligned CUDA BF16 ``[n, k]``
    with ``k`` a multiple of 64, or ``box_rows`` outside 8 .. 256 (a
    multiple of 8)."""
    if not (isinstance(weight, torch.Tensor) and weight.is_cuda and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.stride(1) == 1 and weight.stride(0) >= weight.shape[1]
            and weight.stride(0) % 8 == 0 and weight.data_ptr() % 16 == 0 and weight.shape[1] % BOX_COLUMNS == 0):
        raise ValueError("a weight tensor map takes a 16-byte aligned CUDA BF16 [n, k] with k a multiple of "
                         f"{BOX_COLUMNS}, unit column stride and a row stride of k or more, a multiple of 8")
    if isinstance(box_rows, bool) or not isinstance(box_rows, int) or not 8 <= box_rows <= 256 or box_rows % 8:
        raise ValueError(f"a tensor map's boxes have 8 to 256 rows, a multiple of 8, not {box_rows!r}")
    n, k = (int(v) for v in weight.shape)
    stride = int(weight.stride(0))
    key = (weight.device.index, weight.data_ptr(), n, k, stride, box_rows)
    with _lock:
        found = _cache.get(key)
        if found is not None:
            return found
        assert_not_capturing("a weight tensor map")
        import cuda.bindings.driver as cuda

        u64, u32 = cuda.cuuint64_t, cuda.cuuint32_t
        err, tmap = cuda.cuTensorMapEncodeTiled(
            cuda.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, weight.data_ptr(),
            [u64(k), u64(n)], [u64(2 * stride)], [u32(BOX_COLUMNS), u32(box_rows)], [u32(1), u32(1)],
            cuda.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cuda.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cuda.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cuda.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        if err != cuda.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for a BF16 [{n}, {k}] weight, "
                               f"{box_rows}-row boxes")
        raw = ctypes.string_at(tmap.getPtr(), 128)
        device = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(weight.device)
        if device.data_ptr() % 64:
            raise RuntimeError("the caching allocator returned a tensor map buffer that is not 64-byte aligned")
        _cache[key] = device
        return device


def clear() -> None:
    """Drop every cached map."""
    with _lock:
        _cache.clear()


__all__ = ["BOX_COLUMNS", "clear", "weight_tensormap"]
