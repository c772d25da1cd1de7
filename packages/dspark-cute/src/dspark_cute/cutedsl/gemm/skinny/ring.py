"""The skinny GEMM's ring main loop (``config``'s docstring states its layout,
summation order and error bound): the BF16 weight streamed once with 16-byte
``cp.async`` copies into a shared-memory ring, each lane copying the words it
later reads (``copy`` "lane"); ``copy`` "rows" runs ``rows.mainloop``
instead (the warp copies 128-byte row pieces; the same MMAs on the same
words)."""

from __future__ import annotations

from cutlass import Int32, Int64

from dspark_cute import ptx
from dspark_cute.cutedsl.gemm.skinny import rows
from dspark_cute.cutedsl.gemm.skinny.config import W_LOADS, SkinnyConfig, ring_offset, weight_offset, x_offset, x_token
from dspark_cute.cutedsl.gemm.skinny.tile import min_i32, prologue, step_mmas, zero_accumulators


def mainloop(cfg: SkinnyConfig, w_tile, x, m, ring, tid, warp, lane, before_x=None) -> list:
    """Trace the main loop of one 64-row tile: ``w_tile`` the byte address
    (Int64) of the tile's first weight row, ``x`` of x's first row, ``m``
    the token count (Int32), ``ring`` the shared-memory ring (Int32,
    ``cfg.ring_bytes``, 16-byte aligned). ``before_x()`` runs after the
    weight copies of the first ``stages`` steps, before any x load.
    With ``cfg.x_regs`` x's words are loaded into registers (``ld.global``)
    when the ring copies of their step are issued, instead of copied into
    the ring. Returns the accumulators ``acc[i][n_tile]`` (4 FP32 each,
    ``acc_coords``), this warp's partial sums over its K-slice."""
    if cfg.copy == "rows":
        return rows.mainloop(cfg, w_tile, x, m, ring, tid, warp, lane, before_x)
    tokens = [x_token(lane, nt, m, minimum=min_i32) for nt in range(cfg.n_tiles)]
    x_words: dict = {}  # x_regs: step -> its x words, loaded ahead

    def copy_weight(step: int, stage: int) -> None:
        for load in range(W_LOADS):
            src = Int64(w_tile) + Int64(weight_offset(cfg, warp, lane, step, load)) * 2
            ptx.cp_async_16(Int32(ring) + ring_offset(cfg, tid, stage, load), src, cfg.l2_prefetch)

    def copy_x(step: int, stage: int) -> None:
        for nt, tok in enumerate(tokens):
            src = Int64(x) + Int64(x_offset(cfg, warp, lane, step, tok)) * 2
            if cfg.x_regs:
                x_words.setdefault(step, []).append(ptx.ld_global_v4(src))
            else:
                ptx.cp_async_16(Int32(ring) + ring_offset(cfg, tid, stage, W_LOADS + nt), src, cfg.l2_prefetch)

    prologue(cfg.stages, lambda p: copy_weight(p, p), lambda p: copy_x(p, p), cfg.x_regs, before_x)
    acc = zero_accumulators(cfg)
    for s in range(cfg.steps):
        stage = s % cfg.stages
        # Committed so far: stages + s groups (one per step, empty at the end);
        # step s's is complete once at most stages - 1 are pending.
        ptx.cp_async_wait(cfg.stages - 1)
        words = [ptx.ld_shared_v4(Int32(ring) + ring_offset(cfg, tid, stage, load)) for load in range(cfg.ring_loads)]
        if cfg.x_regs:
            words += x_words.pop(s)
        step_mmas(cfg, words, acc)
        # Refill the slot just read (its values are in registers, consumed
        # by the MMAs above) with the step `stages` ahead.
        if s + cfg.stages < cfg.steps:
            copy_weight(s + cfg.stages, stage)
            copy_x(s + cfg.stages, stage)
        ptx.cp_async_commit()
    ptx.cp_async_wait(0)
    return acc


__all__ = ["mainloop"]
