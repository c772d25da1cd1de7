"""An epilogue another model brings to the mailbox all-reduce: the bias of a
row-parallel projection added after its all-reduce (as in models whose
``o_proj`` has a bias), in the same kernel.

``AddBiasEpilogue``: ``out = bf16(allreduce(x) + bias)``, the sum widened to
FP32, one ``add.rn.f32`` with the BF16 bias widened, one ``cvt.rn`` to BF16;
bit for bit ``(stock_all_reduce(x).float() + bias.float()).to(bfloat16)``.
The README shows it in use (a test helper: the two-GPU suite runs it).
"""

from __future__ import annotations

from cutlass import Int64

from dspark_comm.cutedsl.allreduce import Epilogue, RowContext
from dspark_cute import ptx


class AddBiasEpilogue(Epilogue):
    """Operands: the BF16 ``[H]`` bias, the BF16 ``[m, H]`` output."""

    operands = ("bias", "out")

    def early(self, ctx: RowContext):
        # The bias is a constant: loaded before the PDL wait.
        return [ptx.ld_row8("bf16", ctx.operands[0], col) for col in ctx.columns]

    def finish(self, ctx: RowContext, bias, values: list) -> None:
        out_row = Int64(ctx.operands[1]) + Int64(ctx.row) * (2 * ctx.hidden_size)
        for col, b, v in zip(ctx.columns, bias, values):
            ptx.st_row8("bf16", out_row, col, [ptx.add_rn(x, y) for x, y in zip(v, b)])


__all__ = ["AddBiasEpilogue"]
