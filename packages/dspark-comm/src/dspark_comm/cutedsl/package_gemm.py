"""The package GEMM: a row-parallel branch projection ``y = x[m, K] @ W^T``
(``W`` BF16 ``[N = H, K]``, ``K`` the rank's shard, 1 <= m <= 16) on the
skinny tensor-core main loop of ``dspark_cute.cutedsl.gemm.skinny.config``, with two
epilogues:

- **plain**: ``y`` rounded to BF16 into a ``[m, N]`` tensor (the test and
  fallback mode; the same values the publish epilogue publishes);
- **publish**: each rank's BF16 partial ``y`` goes straight into slot
  (``e``, rank, row) of every rank's mailbox, its own included
  (``st.relaxed.sys`` peer-to-peer stores of the mailbox's encoding, so no
  value can look empty), ``e`` the row's current epoch read from the own
  mailbox's header and not advanced; a ``FusedAllReduce(..., published=True)``
  or ``AllReduceBoundary.run(None, ..., published=True)`` launched next on the
  same stream then only consumes the partials (and advances the epochs). This
  is the contract of a published ``FusedAllReduce`` with the GEMM as
  the producer: the values in the mailbox are bit for bit those that
  the pushing all-reduce would store for the plain
  GEMM's output, so publish + consume equals plain GEMM + the same fused
  all-reduce, bit for bit.

**Layout.** One CTA per 64-row tile of ``W`` (``N / 64`` CTAs, ``tile_n`` =
64), ``k_warps`` warps splitting ``K`` (``SkinnyConfig``; default ``4 *
split_k``: the constants' ``split_k`` K-slices are realized inside the CTA
as warp slices, never across CTAs, so no output is summed by two CTAs). After
the main loop the warp partials meet in shared memory (``store_partials``);
in epilogue round ``r`` warp ``w`` takes token ``w + k_warps * r`` and lane
``l`` the output columns ``64 * tile + 2 l`` and ``+ 1`` (``reduced_pair``),
packed into one BF16x2 word (``cvt.rn.bf16x2.f32``), stored if the token is
below ``m``: ``out[token, column]`` (plain, ``st.global.b32``) or, encoded,
at ``slot_offset(e, rank, token) + 2 * column`` of every rank's buffer
(publish, ``st.relaxed.sys.global.b32``; 32 lanes store 128 contiguous
bytes). ``epilogue_token``, ``output_column``, ``plain_offset`` and
``publish_offset`` are those index maps as plain integer arithmetic (traced
here, emulated by the CPU tests against ``dspark_comm.protocol``).

With ``tile_n`` 16 (constants) the CTA owns one 16-row tile on the
register-direct main loop (``dspark_cute.cutedsl.gemm.skinny.direct``: ``N / 16`` CTAs,
the operands loaded straight into registers, ``stages`` steps in flight);
thread ``q`` of epilogue round ``r`` takes output word ``q + threads r``
(token ``word // 8``, columns ``16 tile + 2 (word % 8)`` and ``+ 1``). It
computes the same sums in the same order as the 64-row tiles, so the same
bits. It is the faster loop while every step of a warp's K-slice is in flight
at once, the slower one beyond; ``policy.draft_gemm_shape`` picks it for
shards of at most ``policy.DIRECT_MAX_STEPS`` steps per warp.

**Weight copies.** The ring main loop copies the weight in whole 128-byte
row pieces, two steps at a time (``SkinnyConfig.copy`` "rows",
``dspark_cute.cutedsl.gemm.skinny.rows``; ``ring_config``), wherever a warp's
steps are even, and otherwise each lane its own 16 bytes: the same MMAs on the
same words, so the same bits. Where x goes through such a ring (m > 1) the
warp copies it the same way, in 128-byte token rows (``RING_X_COPY``).

**Token tiles.** A call of ``m`` rows runs one of three compiled variants
(``PackageGemm.token_tile``): m = 1, m <= 8 (``n_tiles`` 1) and m <= 16
(``n_tiles`` 2). On the ring main loop the one-row variant loads x into
registers instead of copying it into the ring (``SkinnyConfig.x_regs``,
``RING_X_DEPTH``: faster at m = 1 only). All three issue the same
MMAs on the same operands for a row, so a row's bits do not depend on ``m``.

**Summation order** of ``y[n, r] = sum_k x[n, k] W[r, k]`` (the skinny main
loop's, ``dspark_cute.cutedsl.gemm.skinny.config``): each warp accumulates its K-slice in
FP32 from +0.0, one ``mma.sync.m16n8k16`` after another in K order (the
order inside one MMA is the tensor core's); the ``k_warps`` warp partials
are folded by halves with ``add.rn.f32`` (``p_w + p_(w + W_K/2)``, down to
one); the sum is rounded to BF16 once (``cvt.rn``). The summation order does
not depend on ``m`` (the 8- and 16-token variants give the same bits).

**Error bound** against the exact (float64) product, from
``dspark_cute.cutedsl.gemm.skinny.config`` (``output_error_bound``, re-exported here as
``error_bound``): with ``T = sum_k |x_k w_k|``, ``L = K / (16 W_K)``,
``d = log2 W_K``, ``beta = 2^-18``, ``u = 2^-24``:

    |out - y| <= (L beta + d u) (1 + 2^-9) T + K 2^-125 + 2^-8 |out| + 2^-134

(valid for ``L beta <= 2^-10``, which ``SkinnyConfig`` enforces). cuBLAS
obeys no such stated order; the GPU tests compare both against float64 with
this bound.

With ``pdl`` the weight copies of the first pipeline stages are issued before
the PDL wait, x (and, in publish mode, the epochs) read after it; dependents
are released after the main loop (a consumer's PDL wait still waits for this
grid's end before reading the mailbox).

``early_epochs`` (what ``PackageGemm`` launches in publish mode): every
epilogue round's epoch is loaded right after the PDL wait (before the main
loop's x copies) instead of in its round, so the loads' latency hides behind
the main loop; the same values are read at a point where the same kernels
have completed, so the bits are the same. ``PackageGemmKernel(...,
early_epochs=False)`` is the in-round kernel the compile tests keep.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64

from dspark_comm.cutedsl import package_gemm_shape as shape
from dspark_comm.cutedsl.gemm_epilogue import (
    MODES,
    check_mode,
    emit_word,
    fake_args,
    kernel_prologue,
    output_column,
    plain_offset,
    publish_offset,
)
from dspark_comm.cutedsl.package_gemm_shape import *  # noqa: F403 (re-exported: __all__ names them)
from dspark_comm.cutedsl.package_gemm_shape import (
    TILE_ROWS,
    check_constants,
    check_loop_options,
    default_shape,
    smem_bytes,
)
from dspark_comm.cutedsl.package_gemv import compile_package_gemv, one_row_unsupported
from dspark_comm.protocol import MailboxLayout, fallback_reason
from dspark_core.contracts.constants import PackageGemmConstants
from dspark_core.switches import flag
from dspark_cute import ptx
from dspark_cute.cutedsl.gemm.skinny import config as sg
from dspark_cute.cutedsl.gemm.skinny import direct as sd
from dspark_cute.cutedsl.gemm.skinny.ring import mainloop as ring_mainloop
from dspark_cute.cutedsl.gemm.skinny.tile import reduced_pair, store_partials
from dspark_cute.runtime import ops
from dspark_cute.runtime.host import (
    check_operand,
    current_stream,
    describe,
    is_operand,
    jit_cache,
    pdl_supported,
    smem_allocator,
)

# The bound of the module docstring (``dspark_cute.cutedsl.gemm.skinny.config``).
error_bound = sg.output_error_bound
projection_error_bound = sg.projection_error_bound


# ---------------------------------------------------------------- index maps
# Plain integer arithmetic, traced in the kernel and evaluated on Python ints
# by the CPU tests.


def epilogue_rounds(cfg: sg.SkinnyConfig) -> int:
    """Epilogue rounds: warp ``w`` takes tokens ``w + W_K * r`` below ``8 n_tiles``."""
    return -(-8 * cfg.n_tiles // cfg.k_warps)


def epilogue_token(cfg: sg.SkinnyConfig, warp, rnd: int):
    """The token (row of x and y) warp ``warp`` writes in round ``rnd``."""
    return warp + cfg.k_warps * rnd


# ---------------------------------------------------------------- the kernel


class PackageGemmKernel:
    """The traced package GEMM of one ``N``, ``SkinnyConfig``, mode, mailbox
    layout and rank (publish), and ``pdl``. Call: ``(x, weight, out, table,
    m, stream)``: the byte addresses (Int64) of x (BF16 ``[m, K]``, 16-byte
    aligned), the weight (BF16 ``[N, K]``, 16-byte aligned), the output (BF16
    ``[m, N]``; unused when publishing) and the mailbox's address table
    (``tp`` Int64; unused in plain mode), ``m`` Int32 (1 .. 8 n_tiles)."""

    def __init__(self, n: int, cfg: sg.SkinnyConfig, mode: str, layout: MailboxLayout | None, rank: int,
                 pdl: bool, early_epochs: bool = False, tile_rows: int = sg.TILE_ROWS) -> None:
        if tile_rows not in TILE_ROWS:
            raise ValueError(f"a package GEMM CTA computes {' or '.join(map(str, TILE_ROWS))} output features, "
                             f"not {tile_rows}")
        if n <= 0 or n % tile_rows:
            raise ValueError(f"the package GEMM computes {tile_rows} output features per CTA; N = {n} is not a "
                             f"positive multiple of {tile_rows}")
        check_loop_options(tile_rows, cfg.x_regs)
        check_mode(n, mode, layout, rank)
        self.n, self.cfg, self.mode, self.layout, self.rank, self.pdl = n, cfg, mode, layout, rank, pdl
        self.early_epochs = bool(early_epochs) and mode == "publish"
        self.tile_rows = tile_rows

    @cute.jit
    def __call__(self, x: Int64, weight: Int64, out: Int64, table: Int64, m: Int32, stream):
        self.kernel(x, weight, out, table, m).launch(
            grid=[self.n // self.tile_rows, 1, 1], block=[self.cfg.threads, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, x: Int64, weight: Int64, out: Int64, table: Int64, m: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        tile, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        ring = smem_allocator().allocate(smem_bytes(self.cfg, self.tile_rows), 128).toint()
        if cutlass.const_expr(self.tile_rows == sd.TILE_ROWS):
            _direct_body(self, x, weight, out, table, m, tidx, tile, warp, lane, ring)
        else:
            _gemm_body(self, x, weight, out, table, m, tidx, tile, warp, lane, ring)


def _gemm_body(k: PackageGemmKernel, x, weight, out, table, m, tidx, tile, warp, lane, ring) -> None:
    # A plain function: the DSL rewrites loops only in the kernel itself.
    cfg = k.cfg
    publish = k.mode == "publish"
    rounds = epilogue_rounds(cfg)
    bases, early, before_x = kernel_prologue(k, table, m, rounds,
                                             lambda rnd: Int32(epilogue_token(cfg, warp, rnd)))
    w_tile = Int64(weight) + Int64(tile) * (sg.TILE_ROWS * cfg.k * 2)
    acc = ring_mainloop(cfg, w_tile, Int64(x), m, ring, tidx, warp, lane, before_x=before_x)
    if k.pdl:
        # Dependents still wait for this grid's end before they read its output.
        ptx.pdl_launch_dependents()
    store_partials(cfg, acc, ring, warp, lane)
    col = output_column(Int64(tile), Int64(lane))
    for rnd in range(rounds):
        tok = Int32(epilogue_token(cfg, warp, rnd))
        a, b = reduced_pair(cfg, ring, tok, lane)
        word = ptx.pack_bf16x2_rn(a, b)
        # Publishing, a token at or beyond m reads row m - 1's epoch and stores nothing.
        tok_c = cutlass.min(tok, m - 1) if publish else tok
        emit_word(k, bases, out, word, tok, tok_c, col, m, early[rnd] if k.early_epochs else None)


def _direct_body(k: PackageGemmKernel, x, weight, out, table, m, tidx, tile, warp, lane, red) -> None:
    """The 16-row tile on the register-direct main loop (``skinny_direct``):
    the same values as ``_gemm_body``'s, stored or published the same way;
    thread ``tidx`` of round ``r`` takes one output word (``epilogue_word``)."""
    cfg = k.cfg
    rounds = sd.epilogue_rounds(cfg)
    bases, early, before_x = kernel_prologue(k, table, m, rounds, lambda rnd: words[rnd][0])
    w_tile = Int64(weight) + Int64(tile) * (sd.TILE_ROWS * cfg.k * 2)
    words = [sd.epilogue_word(cfg, Int32(tidx), rnd) for rnd in range(rounds)]
    acc = sd.mainloop(cfg, w_tile, Int64(x), m, warp, lane, before_x=before_x)
    if k.pdl:
        ptx.pdl_launch_dependents()
    sd.store_partials(cfg, acc, red, warp, lane)
    for rnd, (tok, row) in enumerate(words):
        # A word past m (or past the 8 n_tiles tokens) reads row m - 1's partials and stores nothing.
        tok_c = cutlass.min(tok, m - 1)
        a, b = sd.reduced_pair(cfg, red, tok_c, row)
        word = ptx.pack_bf16x2_rn(a, b)
        col = Int64(tile) * sd.TILE_ROWS + Int64(row)
        emit_word(k, bases, out, word, tok, tok_c, col, m, early[rnd] if k.early_epochs else None)


def compile_package_gemm(constants: PackageGemmConstants, cfg: sg.SkinnyConfig, mode: str,
                         layout: MailboxLayout | None, rank: int, pdl: bool, early_epochs: bool = False):
    """The compiled kernel of one variant (the mailbox, the rank and the
    early epochs count only where it publishes)."""
    publish = mode == "publish"
    return _compile_package_gemm(constants, cfg, mode, layout if publish else None, rank if publish else 0, pdl,
                                 bool(early_epochs) and publish)


@jit_cache("PackageGemm")
def _compile_package_gemm(constants: PackageGemmConstants, cfg: sg.SkinnyConfig, mode: str,
                          layout: MailboxLayout | None, rank: int, pdl: bool, early_epochs: bool):
    kernel = PackageGemmKernel(constants.hidden_size, cfg, mode, layout, rank, pdl, early_epochs, constants.tile_n)
    return kernel, fake_args()


# ---------------------------------------------------------------- host API


ops.define("package_gemm", "(str handle, Tensor x, Tensor(a!)? out, Tensor(b!)? mailbox, bool publish) -> ()")


class PackageGemm:
    """One rank's package GEMM of ``constants`` bound to its weight shard
    (module docstring).

    ``weight``: BF16 ``[hidden_size, k_shard]``, contiguous, 16-byte aligned,
    on CUDA. ``mailbox``: the TP group's ``dspark_comm.Mailbox`` of
    ``hidden_size`` columns (None: plain mode only); ``rank``: this rank
    (default and required: the mailbox's). ``k_warps``, ``stages``: the main
    loop's shape (``default_shape``); ``x_regs``: whether the ring main loop loads x into registers
    instead of copying it into the ring (``skinny_gemm.SkinnyConfig``: the
    same bits, so a row's bits never depend on the call's row count): None
    (default) for one-row calls only, with up to ``RING_X_DEPTH`` stages,
    True or False for every call
    (``scripts/probes/package_gemm_sweep.py`` times them); ``copy``: who
    copies the ring main loop's weight (``skinny_gemm.SkinnyConfig.copy``;
    the same bits): None (default) the warp's 128-byte row pieces wherever
    the warp's steps are even (``ring_config``), "rows" or "lane" always (under row copies x goes through the
    ring in token rows, ``RING_X_COPY``); ``pdl``: programmatic dependent
    launch (default: sm_90+); the publish epilogue loads its epochs before
    the main loop (``early_epochs``, module docstring); ``one_row_gemv`` (opt-in): a one-row call runs the
    one-token GEMV (``dspark_comm.cutedsl.package_gemv``) and sums in
    ``dspark_core.spec.gemv``'s order, not the skinny loop's, so its row may
    differ in the last bits from the same row in a call of more rows
    (ValueError where the GEMV cannot take the weight).

    - ``run(x, out=None)``: plain, returns BF16 ``[m, hidden_size]``;
    - ``run(x, publish=True)``: publishes the partial into the mailbox and
      returns None; every rank must publish the same row count, and the next
      mailbox call on this stream must be the consuming ``FusedAllReduce(...,
      published=True)`` or ``AllReduceBoundary.run(None, ..., published=True)``
      (``run_boundary`` does both);
    - ``takes(x, out=None, publish=False)``: whether ``run`` covers the
      operands (``1 <= m <= max_rows``, and ``m <= capacity`` to publish);
    - ``launch``: ``run`` without its checks; ``prepare()``: compile before
      CUDA graph capture (a compile during capture raises RuntimeError).

    Traced by torch.compile, a launch is the op
    ``torch.ops.dspark.package_gemm``; a publishing one names this rank's
    mailbox as what it writes, so the consuming boundary stays after it."""

    OP = "package_gemm"

    def __init__(self, constants: PackageGemmConstants, weight: torch.Tensor, mailbox=None,
                 rank: int | None = None, *, k_warps: int | None = None, stages: int | None = None,
                 x_regs: bool | None = None, pdl: bool | None = None, one_row_gemv: bool = False,
                 copy: str | None = None) -> None:
        c = constants
        check_constants(c)
        if x_regs not in (None, True, False):
            raise ValueError(f"x_regs is None (one-row calls), True or False, not {x_regs!r}")
        check_loop_options(c.tile_n, bool(x_regs))
        if copy is not None and c.tile_n != sg.TILE_ROWS:
            raise ValueError(f"copy is the ring main loop's (tile_n {sg.TILE_ROWS}); the register-direct one "
                             f"(tile_n {c.tile_n}) loads into registers")
        # Per token tile (0: one row, 1: m <= 8, 2: m <= 16) whether x goes
        # through registers: the register-direct loop always does, unasked.
        ring = c.tile_n == sg.TILE_ROWS
        xr = {0: ring if x_regs is None else x_regs, 1: bool(x_regs), 2: bool(x_regs)}
        shapes = {t: default_shape(c, k_warps, stages, max(t, 1), xr[t], copy) for t in (0, 1, 2)}
        kw = shapes[2][0]  # the same for every token tile (the sums must not depend on m)
        depth = {t: st for t, (_, st) in shapes.items()}
        # SkinnyConfig raises the ValueError for a shard or shape it cannot split.
        self.configs = {
            t: shape.ring_config(c.k_shard, kw, depth[t], max(t, 1), xr[t], copy) if ring
            else sg.SkinnyConfig(c.k_shard, kw, depth[t], max(t, 1), x_regs=xr[t]) for t in (0, 1, 2)}
        for cfg in self.configs.values():
            if smem_bytes(cfg, c.tile_n) > shape.MAX_SMEM_BYTES:
                raise ValueError(f"{cfg.stages} stages of {kw} warps ({8 * cfg.n_tiles} tokens) take "
                                 f"{smem_bytes(cfg, c.tile_n)} bytes of shared memory, above {shape.MAX_SMEM_BYTES}")
        self.layout = None
        if mailbox is not None:
            layout = getattr(mailbox, "layout", None)
            if not isinstance(layout, MailboxLayout):
                raise ValueError(f"a package GEMM publishes into a dspark_comm Mailbox, not "
                                 f"{type(mailbox).__name__}")
            if layout.hidden_size != c.hidden_size:
                raise ValueError(f"a package GEMM of {c.hidden_size} output features cannot publish into a "
                                 f"mailbox of {layout.hidden_size} columns")
            if rank is not None and rank != mailbox.rank:
                raise ValueError(f"rank {rank} given for the mailbox of rank {mailbox.rank}")
            self.layout = layout
            rank = mailbox.rank
        elif rank not in (None, 0):
            raise ValueError("a rank was given without a mailbox (plain mode needs neither)")
        check_operand(weight, (c.hidden_size, c.k_shard), torch.bfloat16, 16, "the package GEMM's weight")
        if mailbox is not None and weight.device != mailbox.device:
            raise ValueError(f"the weight is on {weight.device}, the mailbox on {mailbox.device}")
        self.constants, self.weight, self.mailbox = c, weight, mailbox
        self.rank = 0 if rank is None else rank
        self.device = weight.device
        self.k_warps, self.stages_by_tiles = kw, depth
        self.pdl = pdl_supported(self.device) if pdl is None else flag(pdl, "pdl")
        self.one_row_gemv = bool(one_row_gemv)
        if self.one_row_gemv:
            why = one_row_unsupported(c, weight)
            if why is not None:
                raise ValueError(f"the one-row GEMV cannot take this package GEMM: {why}")
        self.op_handle = ops.register(self)

    @property
    def stages(self) -> int:
        """The m <= 16 variant's stages (the m = 1 and m <= 8 ones' may
        differ: ``stages_by_tiles``, keyed by ``token_tile``)."""
        return self.stages_by_tiles[2]

    @staticmethod
    def token_tile(m: int) -> int:
        """The variant a call of ``m`` rows runs: 0 (one row), 1 (m <= 8) or 2 (m <= 16)."""
        return 0 if m == 1 else 1 if m <= 8 else 2

    @property
    def max_rows(self) -> int:
        return self.constants.max_rows

    def _kernel(self, m: int, publish: bool):
        mode = "publish" if publish else "plain"
        if m == 1 and self.one_row_gemv:
            return compile_package_gemv(self.constants, mode, self.layout, self.rank, self.pdl)
        return compile_package_gemm(self.constants, self.configs[self.token_tile(m)], mode, self.layout,
                                    self.rank, self.pdl, early_epochs=True)

    def prepare(self, publish: tuple = (False, True)) -> None:
        """Compile the variants ``run`` launches (one row, m <= 8 and m <=
        16 where ``max_rows`` reaches them; one row: the one-row GEMV's with
        ``one_row_gemv``), in the given modes (publish only with a mailbox).
        Call before CUDA graph capture."""
        rows = {1, min(2, self.max_rows), self.max_rows}  # one of each token_tile up to max_rows
        for pub in publish:
            if pub and self.mailbox is None:
                continue
            for m in sorted(rows):
                self._kernel(m, pub)

    def takes_rows(self, m: int, publish: bool = False) -> bool:
        """Whether a call of ``m`` rows runs (the row count alone: the same on
        every rank): ``1 <= m <= max_rows``, and within the mailbox's
        capacity to publish."""
        if not isinstance(m, int) or not 1 <= m <= self.max_rows:
            return False
        return not publish or (self.mailbox is not None and m <= self.layout.capacity)

    def problem(self, x, out=None, publish: bool = False) -> str | None:
        """Why ``run(x, out, publish)`` does not take these operands (a
        sentence), or None: ``x`` BF16 ``[m, k_shard]`` (``takes_rows(m)``)
        contiguous, 16-byte aligned, on the weight's device; ``out`` (plain;
        if given) BF16 ``[m, hidden_size]``, contiguous, 4-byte aligned, there
        too; publishing, a mailbox and no ``out``."""
        c = self.constants
        m = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else None
        if publish and self.mailbox is None:
            return "PackageGemm refuses this call: this package GEMM has no mailbox to publish into"
        if publish and out is not None:
            return "PackageGemm refuses this call: a publishing call writes the mailbox, not an output tensor"
        if publish and isinstance(m, int) and m > self.layout.capacity:
            return (f"PackageGemm refuses this call: no published call of {m} rows: "
                    f"{fallback_reason(m, self.layout.capacity)}")
        ok = (m is not None and self.takes_rows(m, publish)
              and is_operand(x, torch.bfloat16, (m, c.k_shard), 16, self.device)
              and (out is None or is_operand(out, torch.bfloat16, (m, c.hidden_size), 4, self.device)))
        if ok:
            return None
        return (f"PackageGemm refuses this call: it takes x of bf16 [m, {c.k_shard}] (1 <= m <= {c.max_rows}), "
                f"contiguous, 16-byte aligned, on the weight's device, and an output of bf16 [m, {c.hidden_size}] "
                f"there")

    def takes(self, x, out=None, publish: bool = False) -> bool:
        """Whether ``run(x, out, publish)`` takes these operands (``problem`` is None)."""
        return self.problem(x, out, publish) is None

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None, publish: bool = False):
        """Plain: ``x @ W^T`` as BF16 ``[m, hidden_size]`` (into ``out`` if
        given), returned. Publish: the partial into every rank's mailbox,
        returns None. ValueError with ``problem``'s sentence otherwise."""
        reason = self.problem(x, out, publish)
        if reason is not None:
            raise ValueError(reason)
        return self.launch(x, out, publish)

    def launch(self, x: torch.Tensor, out: torch.Tensor | None = None, publish: bool = False):
        """``run`` without its operand checks (for operands ``takes``)."""
        if publish:
            # The mailbox view only for a traced graph's dependencies (the kernel writes the peer table's).
            ops.launch(self, x, None, self.mailbox.words() if ops.tracing() else None, True)
            return None
        if out is None:
            out = torch.empty((x.shape[0], self.constants.hidden_size), dtype=torch.bfloat16, device=x.device)
        ops.launch(self, x, out, None, False)
        return out

    def _launch_kernel(self, x: torch.Tensor, out: torch.Tensor | None, mailbox: torch.Tensor | None,
                       publish: bool) -> None:
        m = x.shape[0]
        if publish:
            self.mailbox.check_open()
            self._kernel(m, True)(Int64(x.data_ptr()), Int64(self.weight.data_ptr()), Int64(0),
                                  Int64(self.mailbox.table.data_ptr()), Int32(m), current_stream())
            return
        self._kernel(m, False)(Int64(x.data_ptr()), Int64(self.weight.data_ptr()), Int64(out.data_ptr()),
                               Int64(0), Int32(m), current_stream())

    def run_boundary(self, x: torch.Tensor, boundary, stream: torch.Tensor, store_stream: bool,
                     out: torch.Tensor | None = None, new_stream: torch.Tensor | None = None):
        """The branch end in two launches: this GEMM publishing ``x @ W^T``,
        then ``boundary`` (an ``AllReduceBoundary`` over the same mailbox)
        consuming it with ``published=True``; returns ``(new_stream or None,
        out)`` as ``AllReduceBoundary.run``. Both checked before anything runs."""
        if getattr(boundary, "mailbox", None) is not self.mailbox or self.mailbox is None:
            raise ValueError("the boundary must run over this package GEMM's mailbox")
        reason = self.problem(x, None, publish=True)
        if reason is not None:
            raise ValueError(reason)
        # The boundary's operand checks, before the partial is published (a
        # published partial that is never consumed would break the rotation).
        shape = (x.shape[0], self.constants.hidden_size)
        reason = boundary.problem(None, stream, store_stream, out, new_stream, published=True)
        if reason is None and tuple(stream.shape) != shape:
            reason = f"the boundary's stream must have x's {shape[0]} rows: {list(shape)}, not {describe(stream)}"
        if reason is not None:
            raise ValueError(reason)
        self.launch(x, None, publish=True)
        return boundary.run(None, stream, store_stream, out, new_stream, published=True)


__all__ = [  # the launch-shape names first: package_gemm_shape's, re-exported
    *shape.__all__,
    "MODES",
    "PackageGemm",
    "PackageGemmKernel",
    "check_mode",
    "compile_package_gemm",
    "emit_word",
    "epilogue_rounds",
    "epilogue_token",
    "error_bound",
    "fake_args",
    "kernel_prologue",
    "output_column",
    "plain_offset",
    "projection_error_bound",
    "publish_offset",
]
