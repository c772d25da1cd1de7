"""Host side of the DSpark CuTe DSL kernels: operands, compiles, PTX capture.

- ``assert_not_capturing(what)``: RuntimeError during CUDA graph capture (a
  compile must happen before capture: ``prepare()`` every variant first);
  ``stream_capturing()``: whether the current CUDA stream is capturing.
- ``CUTE_DTYPES`` / ``cute_dtype``: dtype names ("bf16", "fp16", "fp32") and
  torch dtypes to CuTe numeric types.
- ``to_cute(t, align)`` / ``to_cute_dynamic(t, align, divisibility)``: a
  torch tensor viewed as a ``cute.Tensor`` (``from_dlpack``, the given byte
  alignment asserted), the latter with its shape dynamic (one compile for
  every row count).
- ``ptr(t, align)`` / ``fake_ptr(dtype, align)``: a global ``cute.Pointer`` to
  a tensor's data, or a null one of the same type for compile signatures (the
  DSpark kernels take pointers plus a runtime row count; no GPU memory is
  needed to compile).
- ``fake_tensor(dtype, shape, align)``: ``make_fake_compact_tensor`` shorthand.
- ``current_stream()`` / ``fake_stream()``: the torch stream as a CUstream,
  or a placeholder for compile signatures.
- ``check_operand(t, shape, dtype, align, name)``: ValueError with a sentence
  unless ``t`` is a contiguous CUDA tensor of that shape, dtype and alignment;
  ``is_operand(t, dtype, shape, align, device)``: the same test as a bool
  (the kernels' ``takes``), with the device; ``describe(t)``: an operand's
  dtype, shape, strides and device, for such sentences;
  ``cache_tensor(cache)``: a KV cache's tensor (given a tensor or a
  ``PagedKVCache``).
- ``jit_cache(what)``: the decorator of every kernel's compile function:
  one compile per process for each distinct constants and variant flags
  (and, opted in, one per machine: ``disk_cache``).
- ``compile_kernel(obj, *args)``: ``cute.compile`` after the capture guard.
- ``compile_ptx(obj, *fake_args, arch)``: the PTX of ``obj`` for ``arch``
  ("sm_90a", "sm_100a"), compiled without loading it (works without a GPU).
- ``pdl_supported(device)``, ``sm_count(device)``;
- ``smem_allocator()``: the DSL's shared-memory allocator (inside a kernel).
"""

from __future__ import annotations

import functools
import glob
import inspect
import os
import tempfile
import threading
from collections.abc import Callable, Hashable
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float16, Float32
from cutlass.base_dsl.compiler import PostCompileHookContext
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream, make_ptr

from dspark_cute.runtime import disk_cache

CUTE_DTYPES = {"bf16": BFloat16, "fp16": Float16, "fp32": Float32}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def cute_dtype(dtype) -> type:
    """The CuTe numeric type of a dtype name or a torch dtype."""
    name = DTYPE_NAMES.get(dtype, dtype)
    if name not in CUTE_DTYPES:
        raise ValueError(f"expected one of bf16, fp16, fp32 (or their torch dtypes), not {dtype}")
    return CUTE_DTYPES[name]


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without
    CUDA). Unlike ``dspark_core.spec.layers.capturing``, not while torch.compile
    traces."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def assert_not_capturing(what: str) -> None:
    """Raise RuntimeError if the current CUDA stream is capturing a graph:
    compiling ``what`` there would break the capture (prepare it before)."""
    if stream_capturing():
        raise RuntimeError(
            f"{what} would compile during CUDA graph capture; call its prepare() before capturing"
        )


def to_cute(t: torch.Tensor, align: int) -> cute.Tensor:
    """``t`` viewed as a static-shape ``cute.Tensor`` whose data is assumed
    ``align``-byte aligned (checked here)."""
    if t.data_ptr() % align:
        raise ValueError(f"expected a tensor aligned to {align} bytes")
    return from_dlpack(t.detach(), assumed_align=align)


def to_cute_dynamic(t: torch.Tensor, align: int, divisibility: int = 1) -> cute.Tensor:
    """``to_cute`` with a dynamic compact shape: 1-D ``t`` of a length
    divisible by ``divisibility`` (so one compile serves every length)."""
    if t.dim() != 1 or t.numel() % divisibility:
        raise ValueError(f"expected a 1-D tensor of a multiple of {divisibility} elements")
    return to_cute(t, align).mark_compact_shape_dynamic(
        mode=0, stride_order=(0,), divisibility=divisibility
    )


def ptr(t: torch.Tensor, align: int = 16):
    """A global ``cute.Pointer`` to ``t``'s data (its dtype), assumed
    ``align``-byte aligned (checked here)."""
    address = t.data_ptr()
    if address % align:
        raise ValueError(f"expected a tensor aligned to {align} bytes")
    return make_ptr(cute_dtype(t.dtype), address, cute.AddressSpace.gmem, assumed_align=align)


def fake_ptr(dtype, align: int = 16):
    """A null global pointer of ``dtype`` (name or torch dtype) and alignment:
    the compile-time stand-in of ``ptr``."""
    return make_ptr(cute_dtype(dtype), 0, cute.AddressSpace.gmem, assumed_align=align)


def fake_tensor(dtype, shape: tuple, align: int = 16):
    """A compact fake ``cute.Tensor`` (row-major) for compile signatures."""
    order = tuple(reversed(range(len(shape))))
    return make_fake_compact_tensor(
        cute_dtype(dtype), shape, stride_order=order, assumed_align=align
    )


def current_stream():
    """torch's current CUDA stream as a ``cuda.CUstream``."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def fake_stream():
    """A stream placeholder for compile signatures."""
    return make_fake_stream()


def check_operand(t, shape: tuple, dtype: torch.dtype, align: int, name: str) -> None:
    """ValueError unless ``t`` is a contiguous CUDA tensor of ``shape`` and
    ``dtype`` whose data is ``align``-byte aligned."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch tensor, not {type(t).__name__}")
    if (
        tuple(t.shape) != tuple(shape)
        or t.dtype != dtype
        or not t.is_contiguous()
        or not t.is_cuda
        or t.data_ptr() % align
    ):
        raise ValueError(
            f"{name} must be a contiguous CUDA {dtype} tensor of shape {tuple(shape)} "
            f"aligned to {align} bytes, not {t.dtype} {tuple(t.shape)} on {t.device}"
        )


def is_operand(t, dtype: torch.dtype, shape: tuple, align: int, device=None) -> bool:
    """Whether ``t`` is a torch tensor on CUDA of ``dtype`` and ``shape``,
    contiguous, its data ``align``-byte aligned and (unless ``device`` is
    None) on ``device``: checked in that order, each only where the ones
    before hold."""
    return (
        isinstance(t, torch.Tensor)
        and t.is_cuda
        and t.dtype == dtype
        and tuple(t.shape) == tuple(shape)
        and t.is_contiguous()
        and t.data_ptr() % align == 0
        and (device is None or t.device == device)
    )


def cache_tensor(cache):
    """The tensor of a KV cache given as a tensor or as a ``PagedKVCache``
    (its ``tensor``)."""
    return cache.tensor if isinstance(getattr(cache, "tensor", None), torch.Tensor) else cache


def describe(t) -> str:
    """``t``'s dtype, shape, strides and device (its type where it is no
    tensor), for the operand checks' sentences."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)} with strides {list(t.stride())} on {t.device}"


def pdl_supported(device=None) -> bool:
    """Whether kernels on ``device`` may launch with programmatic dependent
    launch (compute capability 9.0 or newer)."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


# Bytes per element by dtype name (the constants' dtype strings).
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


class LazyPdl:
    """Mixin of a kernel host class: ``pdl`` is the constructor's choice, or
    (None) whether its ``device`` supports programmatic dependent launch,
    asked on first use."""

    device = None
    _pdl: bool | None = None

    @property
    def pdl(self) -> bool:
        """Whether launches use programmatic dependent launch (sm_90+)."""
        if self._pdl is None:
            self._pdl = pdl_supported(self.device)
        return self._pdl


def sm_count(device=None) -> int:
    """The SM count of ``device`` (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def cooperative_supported() -> bool:
    """Whether the CuTe DSL in use launches cooperatively (the launch's
    ``cooperative=True``: 4.8 has it, 4.3.5 does not)."""
    import dataclasses

    try:
        from cutlass.base_dsl.dsl import BaseDSL

        return any(f.name == "cooperative" for f in dataclasses.fields(BaseDSL.LaunchConfig))
    except (ImportError, AttributeError, TypeError):  # a DSL whose launch configuration is laid out otherwise
        return False


def smem_allocator():
    """A new shared-memory allocator of the CuTe DSL in use (call it inside a
    kernel): ``cutlass.memory.SmemAllocator`` where the DSL has it (4.8,
    which deprecates ``cutlass.utils.SmemAllocator``), else
    ``cutlass.utils.SmemAllocator`` (4.3.5, the supported range's low end).
    The one place the kernels name it."""
    try:
        from cutlass.memory import SmemAllocator
    except ImportError:
        from cutlass.utils import SmemAllocator
    return SmemAllocator()


def compile_kernel(obj: Any, *args, what: str | None = None, options: str | None = None):
    """``cute.compile(obj, *args)`` once it is checked that no CUDA graph is
    being captured (RuntimeError otherwise)."""
    assert_not_capturing(what or type(obj).__name__)
    if options:
        return cute.compile(obj, *args, options=options)
    return cute.compile(obj, *args)


def _key_of(value) -> Hashable:
    """A compile-cache key part: a constants object's ``key()`` (a stable
    hash of its exact field bits, with its type), else the value itself."""
    key = getattr(value, "key", None)
    if callable(key):
        return (type(value).__qualname__, key())
    return value


def jit_cache(what: str):
    """Decorator of a kernel's compile function ``fn(*settings) -> (kernel,
    fake_args)``: the decorated function returns the compiled kernel,
    ``cute.compile(kernel, *fake_args)`` once per process for each distinct
    ``settings`` (the constants, keyed by their ``key()``, the PDL flag and
    the variant flags; defaults filled in), thread safe. A compile checks
    first that no CUDA graph is being captured (RuntimeError naming
    ``what``: ``prepare()`` before capture). With ``DSPARK_KERNEL_CACHE``
    set, a compile first looks in the on-disk cache and writes what it
    compiles there (``disk_cache``). ``fn.cache`` holds the kernels,
    ``fn.cache_clear()`` empties it, ``fn.build(*settings)`` is ``fn``
    itself (the kernel object and its compile signature, uncompiled)."""

    def decorate(fn: Callable):
        signature = inspect.signature(fn)
        lock = threading.Lock()

        @functools.wraps(fn)
        def compiled(*args, **kwargs):
            cache = compiled.cache
            fast = (tuple(_key_of(a) for a in args), tuple(sorted((k, _key_of(v)) for k, v in kwargs.items())))
            kernel = cache.get(fast)
            if kernel is not None:
                return kernel
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            full = (tuple(_key_of(a) for a in bound.args), ())
            with lock:
                kernel = cache.get(full)
                if kernel is None:
                    assert_not_capturing(what)
                    disk_key = disk_cache.key(fn, bound.args) if disk_cache.directory() else None
                    kernel = disk_cache.load(disk_key) if disk_key else None
                    if kernel is None:
                        obj, fake_args = fn(*bound.args)
                        kernel = compile_kernel(obj, *fake_args, what=what)
                        if disk_key:
                            disk_cache.store(disk_key, kernel)
                    cache[full] = kernel
                cache[fast] = kernel
            return kernel

        compiled.cache = {}
        compiled.cache_clear = lambda: compiled.cache.clear()
        compiled.build = fn
        return compiled

    return decorate


class _StopAfterCompile(Exception):
    """Raised from the post-compile hook: the PTX is written, skip the load."""


def compile_ptx(obj: Any, *fake_args, arch: str = "sm_90a") -> str:
    """The PTX that ``cute.compile(obj, *fake_args)`` generates for ``arch``
    ("sm_90a", "sm_100a", ...), without loading the module, so it needs no
    GPU or driver (on a CPU machine set ``CUTE_DSL_ARCH`` too, or the DSL
    guesses one). The compile runs with ``--keep-ptx`` into a temporary
    directory and a post-compile hook that stops before the module load."""
    assert_not_capturing(type(obj).__name__)
    dsl = cutlass.cutlass_dsl.CuTeDSL._get_dsl()

    def stop(_module) -> None:
        raise _StopAfterCompile()

    with tempfile.TemporaryDirectory(prefix="dspark-ptx-") as tmp:
        error: BaseException | None = None
        try:
            with PostCompileHookContext(dsl.compiler_provider, stop):
                cute.compile(
                    obj, *fake_args, options=f"--gpu-arch {arch} --keep-ptx --dump-dir {tmp}"
                )
        except Exception as e:  # the hook's stop arrives wrapped by the DSL
            error = e
        files = glob.glob(os.path.join(tmp, "*.ptx"))
        if not files:
            raise RuntimeError(f"no PTX was written for {arch}") from error
        with open(files[0], "rb") as f:
            # The dump ends with a NUL byte.
            return f.read().rstrip(b"\0").decode()


__all__ = [
    "CUTE_DTYPES",
    "DTYPE_NAMES",
    "TORCH_DTYPES",
    "assert_not_capturing",
    "check_operand",
    "compile_kernel",
    "cooperative_supported",
    "compile_ptx",
    "current_stream",
    "cute_dtype",
    "describe",
    "fake_ptr",
    "fake_stream",
    "fake_tensor",
    "is_operand",
    "jit_cache",
    "pdl_supported",
    "ptr",
    "sm_count",
    "smem_allocator",
    "stream_capturing",
    "to_cute",
    "to_cute_dynamic",
]
