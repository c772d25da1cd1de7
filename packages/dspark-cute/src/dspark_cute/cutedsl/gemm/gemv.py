"""The one-token GEMV: ``y = x[1, K] @ W[N, K]^T`` in BF16 with FP32 sums in
the order ``dspark_core.spec.gemv`` states, bit for bit its ``gemv``.

A draft step at m = 1 streams its weights once per step, so each projection
is bound by HBM; as a PDL kernel the GEMV starts streaming its weight while
the small kernel before it still runs.

**Layout.** CTAs of 8 warps (256 threads); warp ``w`` of CTA ``c`` owns the
``rows_per_warp`` consecutive rows from ``(8 c + w) * rows_per_warp``
(``N / (8 rows_per_warp)`` CTAs). Lane ``l`` reads, for fragment ``f``
(0..K/256-1), the 16 bytes at columns ``256 f + 8 l`` .. ``+ 7`` of each of
its warp's rows (``ld.global.nc.L1::no_allocate.v4``: a warp reads 512
contiguous bytes of a row per load; the first ``depth`` fragments'
``ld.global.L1::no_allocate.v4``, which ptxas keeps before the PDL wait) and
the same 16 bytes of x
(``ld.global.v4``, cached: every warp reads x). The loads of fragment
``f + depth`` are issued before fragment ``f``'s arithmetic, so ``depth``
fragments per row are in flight per lane.

**Order** (``dspark_core.spec.gemv``, steps 1-5): each product ``mul.rn.f32``;
the fragment's 8 products pairwise (``ptx.fragment_sum``); the fragment sums
in order of ``f`` (``add.rn``); the warp butterfly (``ptx.warp_fold``, 16 ..
1); ``cvt.rn.bf16x2.f32`` of two rows' sums, stored by lane 0 as one 32-bit
word. No ``fma``.

**PDL** (``pdl``): the weight loads of the first ``depth`` fragments are
issued before ``griddepcontrol.wait`` (the weight is constant while the
decode runs; coherent loads, which ptxas keeps there, where it moved the
non-coherent ones after the wait: ``test_sass_pdl.py``), x's loads after
it; the dependents are released right after the wait (they still wait for
this grid's end before reading ``y``).
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Int32, Int64

from dspark_core.contracts.constants import GemvConstants, within_limits
from dspark_core.contracts.limits import GEMV_N_UNIT
from dspark_core.errors import Unsupported
from dspark_core.spec.gemv import FRAGMENT, LANES, VEC, gemv_unsupported
from dspark_core.switches import flag
from dspark_cute import ptx
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import (
    LazyPdl,
    check_operand,
    current_stream,
    describe,
    fake_stream,
    is_operand,
    jit_cache,
)

WARPS = 8  # warps per CTA
THREADS = WARPS * LANES
ROWS_PER_WARP = GEMV_N_UNIT // WARPS  # two rows' BF16 sums pack into one 32-bit store
DEPTH = 4  # fragments in flight per lane and row (the probe's best unroll)


class GemvKernel:
    """The traced GEMV of one ``GemvConstants`` (``n``, ``k``), ``pdl``,
    ``rows_per_warp`` (even) and ``depth``. Call: ``(x, weight, out,
    stream)``: the byte addresses (Int64) of x (BF16 ``[1, k]``, 16-byte
    aligned), the weight (BF16 ``[n, k]``, contiguous, 16-byte aligned) and
    y (BF16 ``[1, n]``, 4-byte aligned)."""

    def __init__(self, constants: GemvConstants, pdl: bool, rows_per_warp: int = ROWS_PER_WARP,
                 depth: int = DEPTH) -> None:
        check_settings(constants, rows_per_warp, depth)
        self.n, self.k = constants.n, constants.k
        self.pdl, self.rows, self.depth = bool(pdl), rows_per_warp, depth

    @cute.jit
    def __call__(self, x: Int64, weight: Int64, out: Int64, stream):
        self.kernel(x, weight, out).launch(
            grid=[self.n // (WARPS * self.rows), 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, x: Int64, weight: Int64, out: Int64):
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        _gemv_body(self, x, weight, out, Int64(cta) * WARPS + Int64(warp), lane)


def mainloop(k: int, rows_per_warp: int, depth: int, x, weight, warp_id, lane, before_x=None) -> tuple:
    """Trace one warp's rows of the GEMV (module docstring: layout, order):
    ``x``, ``weight`` the byte addresses (Int64) of x's row and of the
    weight (rows of ``k``), ``warp_id`` the warp's index over the grid
    (Int64). The weight loads of the first ``depth`` fragments are issued,
    then ``before_x()`` runs (the PDL wait), then x's loads. Returns
    ``(row0, sums)``: the warp's first row (Int64) and the FP32 sums of its
    ``rows_per_warp`` rows, the same in every lane (after the butterfly)."""
    # A plain function: its Python loops unroll at trace time (K is a constant).
    frags = k // FRAGMENT
    row0 = warp_id * rows_per_warp
    rows = [Int64(weight) + (row0 + r) * (k * 2) + Int64(lane) * (VEC * 2) for r in range(rows_per_warp)]
    x_lane = Int64(x) + Int64(lane) * (VEC * 2)
    w_words: dict = {}
    x_words: dict = {}

    def load_weight(f: int, first: bool = False) -> None:
        load = ptx.ld_global_na_v4 if first else ptx.ld_global_nc_v4  # (first: before the PDL wait)
        w_words[f] = [load(row + f * FRAGMENT * 2) for row in rows]

    def load_x(f: int) -> None:
        x_words[f] = ptx.ld_global_v4(x_lane + f * FRAGMENT * 2)

    ptx.weight_first(min(depth, frags), load_weight, load_x, before_x)
    acc: list = [None] * rows_per_warp
    for f in range(frags):
        if f + depth < frags:
            load_weight(f + depth)
            load_x(f + depth)
        xs = ptx.widen_bf16(x_words.pop(f))
        for r, words in enumerate(w_words.pop(f)):
            s = ptx.fragment_sum([ptx.mul_rn(w, xv) for w, xv in zip(ptx.widen_bf16(words), xs)])
            acc[r] = s if f == 0 else ptx.add_rn(acc[r], s)
    return row0, [ptx.warp_fold(a) for a in acc]


def pdl_release() -> None:
    """The GEMV's ``before_x`` under PDL: wait for the previous grid, then
    release the dependents (they still wait for this grid's end)."""
    ptx.pdl_wait()
    ptx.pdl_launch_dependents()


def _gemv_body(g: GemvKernel, x, weight, out, warp_id, lane) -> None:
    row0, sums = mainloop(g.k, g.rows, g.depth, x, weight, warp_id, lane,
                          before_x=pdl_release if g.pdl else None)
    for pair in range(g.rows // 2):
        word = ptx.pack_bf16x2_rn(sums[2 * pair], sums[2 * pair + 1])
        # Every lane holds the same sums; lane 0 stores (lane < 1).
        ptx.st_global_b32_if(Int64(out) + (row0 + 2 * pair) * 2, word, Int32(lane), Int32(1))


def check_settings(constants, rows_per_warp: int = ROWS_PER_WARP, depth: int = DEPTH) -> None:
    """Unsupported with a sentence unless the kernel covers ``constants``:
    its limits (``dspark_core.contracts.limits``: K a positive multiple of
    256, N of 16 at the default ``rows_per_warp``), N a multiple of the 8
    warps' rows at another (ValueError for launch settings it does not have)."""
    if not isinstance(constants, GemvConstants):
        raise ValueError(f"the GEMV takes GemvConstants, not {type(constants).__name__}")
    if not isinstance(rows_per_warp, int) or rows_per_warp not in (2, 4, 8):
        raise ValueError(f"a GEMV warp owns 2, 4 or 8 rows, not {rows_per_warp!r}")
    if not isinstance(depth, int) or not 1 <= depth <= 16:
        raise ValueError(f"a GEMV keeps 1 to 16 fragments in flight, not {depth!r}")
    c = within_limits(constants)
    if c.n % (WARPS * rows_per_warp):
        raise Unsupported(f"the GEMV takes N a positive multiple of {WARPS * rows_per_warp} (8 warps of "
                         f"{rows_per_warp} rows), not {c.n}")


def fake_args() -> tuple:
    """The compile signature of ``GemvKernel`` (no GPU memory needed)."""
    return (Int64(0), Int64(0), Int64(0), fake_stream())


@jit_cache("Gemv")
def compile_gemv(constants: GemvConstants, pdl: bool, rows_per_warp: int = ROWS_PER_WARP, depth: int = DEPTH):
    """The compiled ``GemvKernel`` of one variant."""
    return GemvKernel(constants, bool(pdl), rows_per_warp, depth), fake_args()


ops.define("gemv", "(str handle, Tensor x, Tensor(a!) out) -> ()")


class Gemv(LazyPdl):
    """The GEMV of ``constants`` bound to ``weight`` (BF16 ``[n, k]``,
    contiguous, 16-byte aligned, on CUDA). ``pdl``: programmatic dependent
    launch (default: sm_90+); ``rows_per_warp``, ``depth``: the launch
    settings (module docstring; they do not change the bits).

    ``run(x, out=None)``: ``x`` BF16 ``[1, k]`` -> BF16 ``[1, n]``, bit for
    bit ``dspark_core.spec.gemv.gemv(x, weight)``; ``problem`` / ``takes``
    say whether it takes the operands, ``launch`` runs without the checks;
    ``prepare()`` compiles before CUDA graph capture. Traced by
    torch.compile, a launch is the op ``torch.ops.dspark.gemv``."""

    OP = "gemv"

    def __init__(self, constants: GemvConstants, weight: torch.Tensor, *, pdl: bool | None = None,
                 rows_per_warp: int = ROWS_PER_WARP, depth: int = DEPTH) -> None:
        check_settings(constants, rows_per_warp, depth)
        why = gemv_unsupported(weight)
        if why is not None:
            raise Unsupported(f"the GEMV cannot take this weight: {why}")
        check_operand(weight, (constants.n, constants.k), torch.bfloat16, 16, "the GEMV's weight")  # CUDA too
        self.constants, self.weight, self.device = constants, weight, weight.device
        self.rows_per_warp, self.depth = rows_per_warp, depth
        self._pdl = None if pdl is None else flag(pdl, "pdl")
        self.op_handle = ops.register(self)

    def _kernel(self):
        return compile_gemv(self.constants, self.pdl, self.rows_per_warp, self.depth)

    def prepare(self) -> None:
        """Compile the one variant ``run`` launches."""
        self._kernel()

    def problem(self, x, out=None) -> str | None:
        """Why the kernel does not take these operands (a sentence), or None:
        ``x`` BF16 ``[1, k]`` contiguous and 16-byte aligned, ``out`` (if
        given) BF16 ``[1, n]`` contiguous and 4-byte aligned, both on the
        weight's device."""
        c = self.constants
        if is_operand(x, torch.bfloat16, (1, c.k), 16, self.device) and (
                out is None or is_operand(out, torch.bfloat16, (1, c.n), 4, self.device)):
            return None
        return (f"the GEMV takes x of bf16 [1, {c.k}] (contiguous, 16-byte aligned) and an output of bf16 "
                f"[1, {c.n}] (contiguous, 4-byte aligned) on {self.device}, not x {describe(x)} and out "
                f"{describe(out)}")

    def takes(self, x, out=None) -> bool:
        """Whether the kernel takes these operands (``problem`` is None)."""
        return self.problem(x, out) is None

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight^T`` (module docstring) into ``out`` if given; returned.
        ValueError with ``problem``'s sentence otherwise."""
        reason = self.problem(x, out)
        if reason is not None:
            raise ValueError(reason)
        return self.launch(x, out)

    def launch(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``run`` without its operand checks (for operands ``takes``)."""
        if out is None:
            out = torch.empty((1, self.constants.n), dtype=torch.bfloat16, device=x.device)
        ops.launch(self, x, out)
        return out

    def _launch_kernel(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self._kernel()(Int64(x.data_ptr()), Int64(self.weight.data_ptr()), Int64(out.data_ptr()), current_stream())


__all__ = ["DEPTH", "Gemv", "GemvKernel", "ROWS_PER_WARP", "THREADS", "WARPS", "check_settings", "compile_gemv",
           "fake_args", "mainloop", "pdl_release"]
