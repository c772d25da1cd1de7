"""The symmetric mailbox: one buffer per rank of a TP group, every peer's
buffer mapped into every rank's address space, set up and freed collectively.

``Mailbox(group, hidden_size, capacity)`` allocates this rank's buffer of
``MailboxLayout.total_bytes`` (``protocol``), exchanges the buffers' handles
over the TP group (``group.all_gather_bytes``; never the world) and maps the
peers' buffers. Two backends:

- ``"cuda_ipc"``: ``cuMemAlloc`` and legacy CUDA IPC handles
  (``cuIpcGetMemHandle`` / ``cuIpcOpenMemHandle`` with lazy peer access), any
  ``TPGroup``;
- ``"torch_symm"``: PyTorch symmetric memory (``symm_mem.empty`` +
  ``rendezvous``), a ``TorchGroup`` only.

``"auto"`` tries CUDA IPC and, where any rank fails (the ranks agree over the
group, so none is left waiting), PyTorch symmetric memory. Multicast (NVLS)
is never used: peers are reached by peer-to-peer stores alone.

The buffer starts with every data word empty (``MARKER``), every epoch 0 and
the status 0; ``table`` is a CUDA int64 ``[tp]`` tensor of every rank's
buffer address as mapped here (the kernels' only view of the mailbox).
``check()`` raises ``MailboxTimeoutError`` once a kernel gave up waiting
(``poll()``: the same from an earlier asynchronous copy, never waiting);
``reset()`` (collective) empties the buffer again; ``close()`` (collective)
unmaps and frees. All ranks must construct, reset and close together.
"""

from __future__ import annotations

import ctypes

import torch

from dspark_comm.protocol import (
    HEADER_BYTES,
    MAX_CAPACITY,
    STATUS_OFFSET,
    STATUS_TIMEOUT,
    MailboxLayout,
)
from dspark_comm.runtime.group import TorchGroup, TPGroup
from dspark_core import checks

BACKENDS = ("auto", "cuda_ipc", "torch_symm")


class MailboxTimeoutError(RuntimeError):
    """A mailbox kernel gave up waiting for a peer's partial."""


class _RawCuda:
    """A CUDA byte range as an object torch can view (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


def _view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(_RawCuda(ptr, nbytes), device=device)


def _check(result, what: str):
    from cuda.bindings import driver as cu

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    return values[0] if len(values) == 1 else values


def _check_ptrs(ptrs: list[int], tp: int) -> None:
    if len(ptrs) != tp or any(p % 16 for p in ptrs):
        raise RuntimeError(f"the mailbox buffers are not {tp} 16-byte aligned addresses: {ptrs}")


class _CudaIpcBuffers:
    """This rank's ``cuMemAlloc`` buffer and the peers' mapped through legacy
    CUDA IPC handles (64 bytes each, all-gathered over the group)."""

    def __init__(self, group: TPGroup, nbytes: int) -> None:
        from cuda.bindings import driver as cu

        self.own: int | None = None
        self.opened: list[int] = []
        ok, raw = True, bytes(64)
        try:
            # torch made its primary context current on this thread; use it.
            ctx = _check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
            if int(ctx) == 0:
                primary = _check(cu.cuDevicePrimaryCtxRetain(group.device.index), "cuDevicePrimaryCtxRetain")
                _check(cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
            self.own = int(_check(cu.cuMemAlloc(nbytes), "cuMemAlloc"))
            handle = _check(cu.cuIpcGetMemHandle(cu.CUdeviceptr(self.own)), "cuIpcGetMemHandle")
            raw = ctypes.string_at(handle.getPtr(), 64)
        except Exception:
            ok = False
        handles = group.all_gather_bytes(raw)
        try:
            group.agree(ok, "allocating the mailbox buffer (cuMemAlloc, cuIpcGetMemHandle)")
        except RuntimeError:
            self.free()
            raise
        self.ptrs: list[int] = []
        error = None
        try:
            flags = int(cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            for rank, data in enumerate(handles):
                if rank == group.rank:
                    self.ptrs.append(self.own)
                    continue
                handle = cu.CUipcMemHandle()
                ctypes.memmove(handle.getPtr(), data, 64)
                ptr = int(_check(cu.cuIpcOpenMemHandle(handle, flags), f"cuIpcOpenMemHandle of rank {rank}"))
                self.opened.append(ptr)
                self.ptrs.append(ptr)
        except Exception as e:
            error = e
        try:
            group.agree(error is None, f"mapping the peers' mailbox buffers (CUDA IPC: {error})")
        except RuntimeError:
            # Every rank unmaps its peers' buffers before any owner frees its own.
            self.close_imports()
            group.barrier()
            self.free()
            raise

    def close_imports(self) -> None:
        from cuda.bindings import driver as cu

        for ptr in self.opened:
            cu.cuIpcCloseMemHandle(cu.CUdeviceptr(ptr))
        self.opened = []

    def free(self) -> None:
        from cuda.bindings import driver as cu

        if self.own is not None:
            cu.cuMemFree(cu.CUdeviceptr(self.own))
            self.own = None


class _TorchSymmBuffers:
    """A PyTorch symmetric-memory buffer and its rendezvous over the group."""

    def __init__(self, group: TPGroup, nbytes: int) -> None:
        if not isinstance(group, TorchGroup):
            raise ValueError("the torch_symm mailbox backend needs a TorchGroup")
        import torch.distributed._symmetric_memory as symm_mem

        self.tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=group.device)
        self.handle = symm_mem.rendezvous(self.tensor, group.group_name)
        self.ptrs = [int(p) for p in self.handle.buffer_ptrs]

    def close_imports(self) -> None:
        pass

    def free(self) -> None:
        self.handle = None
        self.tensor = None


class Mailbox:
    """The symmetric mailbox of a TP group (module docstring). Collective:
    every rank of ``group`` constructs it with the same ``hidden_size``,
    ``capacity`` and ``backend``. ``timeout_s``: how long a kernel polls for
    a peer's partial before it gives up and flags the mailbox (a float of
    seconds, default 5)."""

    def __init__(self, group: TPGroup, hidden_size: int, capacity: int = 16, *,
                 timeout_s: float = 5.0, backend: str = "auto") -> None:
        if not isinstance(group, TPGroup):
            raise ValueError(f"a mailbox is built over a TPGroup, not {type(group).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"a mailbox backend is one of {', '.join(BACKENDS)}, not {backend!r}")
        timeout_s = checks.duration("the poll timeout timeout_s", timeout_s, 1e-3, 3600.0)
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"a mailbox holds 1 to {MAX_CAPACITY} rows per call, not {capacity}")
        if group.device.type != "cuda":
            raise ValueError(f"a mailbox lives on a CUDA device, not {group.device}")
        self.layout = MailboxLayout(group.size, hidden_size, capacity)
        self.group, self.rank, self.device = group, group.rank, group.device
        self.timeout_s = float(timeout_s)
        self.timeout_ns = int(self.timeout_s * 1e9)
        self._status_host = self._status_event = None  # poll()'s copy of the status word
        nbytes = self.layout.total_bytes
        with torch.cuda.device(self.device):
            torch.zeros(1, device=self.device)  # the primary context, current on this thread
            self._buffers, self.backend, self._local = self._allocate(group, nbytes, backend)
            self.ptrs = list(self._buffers.ptrs)
            self.table = torch.tensor(self.ptrs, dtype=torch.int64, device=self.device)
            self._fill()
            torch.cuda.synchronize(self.device)
        group.barrier()

    @staticmethod
    def _allocate(group: TPGroup, nbytes: int, backend: str):
        """``(buffers, backend name, the local buffer as a uint8 tensor)``."""
        if backend in ("auto", "cuda_ipc"):
            try:
                buffers = _CudaIpcBuffers(group, nbytes)
            except Exception:
                if backend == "cuda_ipc" or not isinstance(group, TorchGroup):
                    raise
            else:
                local, error = None, None
                try:
                    local = _view(buffers.ptrs[group.rank], nbytes, group.device)
                    _check_ptrs(buffers.ptrs, group.size)
                except Exception as e:
                    error = e
                try:
                    group.agree(error is None, f"viewing the CUDA IPC mailbox ({error})")
                    return buffers, "cuda_ipc", local
                except RuntimeError:
                    buffers.close_imports()
                    group.barrier()
                    buffers.free()
                    if backend == "cuda_ipc" or not isinstance(group, TorchGroup):
                        raise
        buffers = _TorchSymmBuffers(group, nbytes)
        _check_ptrs(buffers.ptrs, group.size)
        return buffers, "torch_symm", buffers.tensor

    def _fill(self) -> None:
        words = self._local.view(torch.int32)
        words[: HEADER_BYTES // 4].zero_()
        words[HEADER_BYTES // 4:].fill_(-1)  # MARKER

    @property
    def closed(self) -> bool:
        return self._buffers is None

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the mailbox is closed")

    def words(self) -> torch.Tensor:
        """This rank's buffer as int32 words (a view; for tests and debugging)."""
        self.check_open()
        return self._local.view(torch.int32)

    def status(self) -> int:
        """The status word (0: healthy); synchronizes the current stream."""
        self.check_open()
        return int(self.words()[STATUS_OFFSET // 4].item()) & 0xFFFFFFFF

    def failure(self) -> str | None:
        """Why the mailbox failed, or None (synchronizes)."""
        code = self.status()
        if not code:
            return None
        if code & STATUS_TIMEOUT:
            return (
                f"rank {self.rank} gave up waiting ({self.timeout_s} s) for row {(code >> 8) & 0xFFFF} "
                f"from rank {code & 0xFF}; every later call returns at once until reset()"
            )
        return f"unknown mailbox status {code:#x}"

    def check(self) -> None:
        """Raise ``MailboxTimeoutError`` if a kernel gave up (synchronizes)."""
        reason = self.failure()
        if reason:
            raise MailboxTimeoutError(reason)

    def poll(self) -> None:
        """``check()`` without waiting for the device: raise
        ``MailboxTimeoutError`` where the status word copied by an earlier
        ``poll`` (once that copy completed: ``check()`` then says why) is not
        0, then copy it again, asynchronously on the current stream into
        pinned host memory (at most one copy in flight). Nothing while the
        current stream is capturing a CUDA graph. So a host hook that runs at
        every step sees a kernel that gave up at most a few steps later,
        without a synchronization per step."""
        self.check_open()
        if torch.cuda.is_current_stream_capturing():
            return
        if self._status_event is None:
            self._status_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            self._status_event = torch.cuda.Event()
        elif not self._status_event.query():
            return
        elif int(self._status_host[0]):
            self.check()
        self._status_host.copy_(self.words()[STATUS_OFFSET // 4:STATUS_OFFSET // 4 + 1], non_blocking=True)
        self._status_event.record()

    def reset(self) -> None:
        """Collective: wait for this rank's work, then empty the buffer, zero
        the epochs and the status on every rank together."""
        self.check_open()
        torch.cuda.synchronize(self.device)
        self.group.barrier()
        self._status_host = self._status_event = None  # a copy from before the reset says nothing now
        self._fill()
        torch.cuda.synchronize(self.device)
        self.group.barrier()

    def close(self) -> None:
        """Collective: wait for the work in flight, unmap the peers' buffers
        and free this rank's (idempotent)."""
        if self.closed:
            return
        torch.cuda.synchronize(self.device)
        self.group.barrier()
        self._local = None
        self.table = None
        buffers, self._buffers = self._buffers, None
        # Every rank unmaps its peers' buffers before any owner frees its own.
        buffers.close_imports()
        self.group.barrier()
        buffers.free()
        self.group.barrier()

    def __enter__(self) -> Mailbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["BACKENDS", "Mailbox", "MailboxTimeoutError"]
