"""L2 weight prefetch: start bringing the first bytes of every row of the next
GEMM's weight into L2 while the latency-bound kernels before that GEMM run.

A draft step at m = 1 streams about 1 GB of weights through GEMMs separated
by kernels that leave HBM idle (norms, boundaries, attention, activations: a
few µs each). ``WeightPrefetchKernel`` issues, for rows ``r < rows`` and
128-byte lines ``l < lines``, ``prefetch.global.L2::evict_last [base + r *
row_bytes + l * 128]``: no register is written, nothing is stored and
nothing waits for the lines, so it changes no value anywhere; the next GEMM
finds its first k-columns of every row in L2 (every CTA of a row-tiled GEMM
starts at k = 0, so the first bytes of each row are what it reads first).

Layout: a 1-D grid of ``ctas`` CTAs of ``threads`` threads; global thread
``g`` takes rows ``g, g + ctas * threads, ...`` and issues each such row's
``lines`` prefetches in order.

The executor's use (``WeightPrefetcher``) is the PDL variant (``pdl=True``):
launched on the executor's stream right after the first small kernel S that
follows the previous GEMM, as a programmatic dependent of S. It triggers its
own dependents first (``griddepcontrol.launch_dependents``), issues its
prefetches while S runs (S triggers right after its own wait), and ends with
``griddepcontrol.wait``: it completes only once S has completed and flushed,
so whatever follows it in the stream (a PDL kernel's wait, or a cuBLAS GEMM's
stream order) still sees S's results. One extra node on the same stream, no
cross-stream edge. ``pdl=False`` is the plain kernel (the probe's).

Bytes a row of 256-512 help the next GEMM, larger chunks slow it (the
package's README has the probe's figures).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64

from dspark_cute import ptx
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import current_stream, fake_stream, jit_cache

LINE = 128
# The probe's launch shape: enough CTAs to issue a few MB quickly.
CTAS = 32
THREADS = 256
# Rows are Int32 in the kernel, stepped by the grid's threads.
MAX_ROWS = 2**31 - CTAS * THREADS


class WeightPrefetchKernel:
    """The traced prefetch of one launch shape. Call: ``(base, rows,
    row_bytes, lines, stream)``: ``base`` the weight's address (Int64),
    ``rows`` Int32, ``row_bytes`` the row stride in bytes (Int64), ``lines``
    the 128-byte lines to prefetch per row (Int32, ``lines * 128 <=
    row_bytes``). ``pdl``: the inline variant (module docstring), launched
    as a programmatic dependent: it triggers its dependents first and waits
    for its primary last."""

    def __init__(self, ctas: int = CTAS, threads: int = THREADS, pdl: bool = False) -> None:
        self.ctas, self.threads, self.pdl = ctas, threads, pdl

    @cute.jit
    def __call__(self, base: Int64, rows: Int32, row_bytes: Int64, lines: Int32, stream):
        self.kernel(base, rows, row_bytes, lines).launch(
            grid=[self.ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, base: Int64, rows: Int32, row_bytes: Int64, lines: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.pdl):
            # Let the kernel after this one launch now: it waits for this grid.
            ptx.pdl_launch_dependents()
        first = Int32(cta) * self.threads + Int32(tidx)
        for r in cutlass.range(first, rows, self.ctas * self.threads, unroll=1):
            row = Int64(base) + Int64(r) * Int64(row_bytes)
            for line in cutlass.range(lines, unroll=1):
                ptx.prefetch_l2_evict_last(row + Int64(line) * LINE)
        if cutlass.const_expr(self.pdl):
            # Complete only after the primary (the small kernel before this
            # one) has: what follows in the stream may read its results.
            ptx.pdl_wait()


def fake_args() -> tuple:
    """The compile signature of ``WeightPrefetchKernel`` (no GPU memory needed)."""
    return (Int64(0), Int32(1), Int64(LINE), Int32(1), fake_stream())


@jit_cache("WeightPrefetch")
def compile_weight_prefetch(ctas: int = CTAS, threads: int = THREADS, pdl: bool = False):
    """The compiled ``WeightPrefetchKernel`` of a launch shape and variant."""
    return WeightPrefetchKernel(ctas, threads, pdl), fake_args()


def check_bytes_per_row(nbytes, what: str = "prefetch bytes per row") -> None:
    """ValueError unless ``nbytes`` is a positive int multiple of 128 (whole lines)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < LINE or nbytes % LINE:
        raise ValueError(f"{what} must be a positive multiple of {LINE} bytes, not {nbytes!r}")


def prefetch_lines(weight: torch.Tensor, bytes_per_row: int) -> int:
    """The 128-byte lines per row that a prefetch of ``bytes_per_row`` bytes
    covers in ``weight`` (at most its row, rounded down to whole lines).
    ValueError unless ``weight`` is a 2-D CUDA tensor whose rows are
    contiguous and ``bytes_per_row`` a positive multiple of 128."""
    check_bytes_per_row(bytes_per_row)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"a weight prefetch takes a 2-D weight tensor, not {getattr(weight, 'shape', weight)!r}")
    if weight.stride(1) != 1:
        raise ValueError(f"a weight prefetch takes a weight with contiguous rows, not strides {weight.stride()}")
    if not 1 <= weight.shape[0] <= MAX_ROWS:
        raise ValueError(f"a weight prefetch takes 1 to {MAX_ROWS} rows, not {weight.shape[0]}")
    if not weight.is_cuda:
        raise ValueError(f"a weight prefetch takes a CUDA weight, not one on {weight.device}")
    row_bytes = weight.shape[1] * weight.element_size()
    return min(bytes_per_row, row_bytes) // LINE


class WeightPrefetch:
    """The L2 prefetch of the first ``bytes_per_row`` bytes of each row of a
    weight (module docstring), one launch on the current stream; ``pdl``
    picks the inline variant. Call ``prepare()`` before CUDA graph capture
    (a compile during capture raises RuntimeError)."""

    def __init__(self, ctas: int = CTAS, threads: int = THREADS, pdl: bool = False) -> None:
        if not (isinstance(ctas, int) and 1 <= ctas <= 1024 and isinstance(threads, int)
                and threads in (32, 64, 128, 256, 512, 1024)):
            raise ValueError(f"a weight prefetch launches 1 to 1024 CTAs of 32 to 1024 threads (a power of two), "
                             f"not {ctas} x {threads}")
        self.ctas, self.threads, self.pdl = ctas, threads, bool(pdl)

    def prepare(self) -> None:
        """Compile the kernel (one variant: every operand is a runtime value)."""
        compile_weight_prefetch(self.ctas, self.threads, self.pdl)

    def problem(self, weight, bytes_per_row) -> str | None:
        """Why ``run(weight, bytes_per_row)`` does not take these operands
        (``prefetch_lines``' sentence), or None."""
        try:
            prefetch_lines(weight, bytes_per_row)
        except ValueError as error:
            return str(error)
        return None

    def takes(self, weight, bytes_per_row) -> bool:
        """Whether ``run`` takes these operands (``problem`` is None)."""
        return self.problem(weight, bytes_per_row) is None

    def run(self, weight: torch.Tensor, bytes_per_row: int) -> None:
        """Prefetch the first ``bytes_per_row`` bytes of every row of
        ``weight`` into L2 (ValueError for operands ``prefetch_lines``
        refuses); a row shorter than one line prefetches nothing."""
        lines = prefetch_lines(weight, bytes_per_row)
        if lines:
            self.launch(weight, lines)

    def launch(self, weight: torch.Tensor, lines: int) -> None:
        """``run`` for checked operands and ``lines`` lines a row."""
        kernel = compile_weight_prefetch(self.ctas, self.threads, self.pdl)
        kernel(Int64(weight.data_ptr()), Int32(weight.shape[0]), Int64(weight.stride(0) * weight.element_size()),
               Int32(lines), current_stream())


class WeightPrefetcher:
    """The executor's side of the prefetch: ``fork(weight, role)`` right
    after a GEMM names the next GEMM's weight; ``kick()`` right after the
    first small kernel that follows launches the PDL variant on the current
    stream; ``join()`` right before the next GEMM drops a fork not kicked.
    ``bytes_per_row[role]`` bytes a row are prefetched (a role missing there
    prefetches nothing). Every call is CUDA-graph capturable. While
    torch.compile traces, it prefetches nothing: the prefetch writes no
    tensor, so it has no custom op (a compiled graph would drop it) and
    changes no result."""

    ROLES = ("qkv_proj", "o_proj", "gate_up", "down")

    def __init__(self, bytes_per_row: dict[str, int], device, prefetch: WeightPrefetch | None = None) -> None:
        unknown = set(bytes_per_row) - set(self.ROLES)
        if unknown:
            raise ValueError(f"prefetch roles are {self.ROLES}, not {sorted(unknown)}")
        for role, nbytes in bytes_per_row.items():
            check_bytes_per_row(nbytes, f"the {role} prefetch")
        self.bytes_per_row = dict(bytes_per_row)
        self.device = torch.device(device)
        self.kernel = prefetch or WeightPrefetch(pdl=True)
        self._lines: dict[tuple, int] = {}  # checked weights: (address, shape, stride, role) -> lines
        self._recorded: tuple | None = None  # (weight, lines) forked, not yet kicked
        self.pending = False
        self.prepared = False

    def prepare(self) -> None:
        """Compile the kernel (before capture)."""
        self.kernel.prepare()
        self.prepared = True

    def _lines_of(self, weight: torch.Tensor, role: str) -> int:
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), role)
        lines = self._lines.get(key)
        if lines is None:
            lines = self._lines[key] = prefetch_lines(weight, self.bytes_per_row[role])
        return lines

    def fork(self, weight: torch.Tensor, role: str) -> None:
        if not self.prepared:
            raise RuntimeError("WeightPrefetcher.prepare() has not run")
        if role not in self.bytes_per_row or ops.tracing():
            return
        lines = self._lines_of(weight, role)
        if lines:
            self._recorded = (weight, lines)
            self.pending = True

    def kick(self) -> None:
        if self._recorded is not None:
            weight, lines = self._recorded
            self._recorded = None
            self.kernel.launch(weight, lines)

    def join(self) -> None:
        self._recorded = None
        self.pending = False


__all__ = [
    "CTAS",
    "LINE",
    "THREADS",
    "WeightPrefetch",
    "WeightPrefetchKernel",
    "WeightPrefetcher",
    "check_bytes_per_row",
    "compile_weight_prefetch",
    "fake_args",
    "prefetch_lines",
]
