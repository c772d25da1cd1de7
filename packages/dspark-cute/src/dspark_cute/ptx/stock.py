"""The instructions vLLM 0.33.0's stock kernels compute with beyond the
rounded ``add``/``sub``/``mul``/``div`` of ``arith``: the fused multiply-add
and the approximate instructions, each one inline PTX instruction so the
kernels run exactly what ``dspark_core.spec.numerics`` names (``fma_rn``,
``rsqrt_approx_ftz``, ``rsqrt_approx``, ``sqrt_approx_ftz``, ``rcp_full``,
``rcp_approx_ftz``, ``ex2_approx``, ``ex2_approx_ftz``), and the pairwise
tree of neighbours (``pairwise``, the spec's)."""

from __future__ import annotations

from cutlass import Float32
from cutlass.cutlass_dsl import T, dsl_user_op

from .arith import add_rn
from .inline import asm, f32


@dsl_user_op
def fma_rn(a, b, c, *, loc=None, ip=None) -> Float32:
    """``a * b + c`` rounded once (``fma.rn.f32``)."""
    return Float32(asm(T.f32(), [f32(a, loc, ip), f32(b, loc, ip), f32(c, loc, ip)],
                       "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", False, loc, ip))


def _unary(name: str, text: str, doc: str):
    @dsl_user_op
    def fn(a, *, loc=None, ip=None) -> Float32:
        return Float32(asm(T.f32(), [f32(a, loc, ip)], text, "=f,f", False, loc, ip))

    fn.__name__ = name
    fn.__doc__ = doc
    return fn


rsqrt_approx_ftz = _unary("rsqrt_approx_ftz", "rsqrt.approx.ftz.f32 $0, $1;",
                          "``rsqrt.approx.ftz.f32`` (MUFU.RSQ; the Triton norm's ``tl.rsqrt``).")
rsqrt_approx = _unary("rsqrt_approx", "rsqrt.approx.f32 $0, $1;",
                      "``rsqrt.approx.f32``: CUDA's ``rsqrtf`` (MUFU.RSQ with the subnormal scaling).")
sqrt_approx_ftz = _unary("sqrt_approx_ftz", "sqrt.approx.ftz.f32 $0, $1;", "``sqrt.approx.ftz.f32`` (MUFU.SQRT).")
rcp_approx_ftz = _unary("rcp_approx_ftz", "rcp.approx.ftz.f32 $0, $1;", "``rcp.approx.ftz.f32`` (MUFU.RCP).")
ex2_approx = _unary("ex2_approx", "ex2.approx.f32 $0, $1;", "``ex2.approx.f32`` (MUFU.EX2, subnormals kept).")
ex2_approx_ftz = _unary("ex2_approx_ftz", "ex2.approx.ftz.f32 $0, $1;", "``ex2.approx.ftz.f32`` (MUFU.EX2).")


@dsl_user_op
def rcp_full(a, *, loc=None, ip=None) -> Float32:
    """``div.full.f32(1, a)`` (MUFU.RCP with its range fix-ups; Triton's
    ``1.0 / x`` without ``div_rn``)."""
    return Float32(asm(T.f32(), [f32(a, loc, ip)], "div.full.f32 $0, 0f3F800000, $1;", "=f,f", False, loc, ip))


def pairwise(values: list) -> Float32:
    """``values`` summed by a pairwise tree of neighbours, ``v_2i + v_(2i+1)``
    (each ``add.rn``) level by level; a count that is not a power of two is
    padded with +0.0 (which changes no value of a sum of squares)."""
    values = list(values)
    while len(values) > 1:
        if len(values) % 2:
            values.append(Float32(0.0))
        values = [add_rn(values[2 * i], values[2 * i + 1]) for i in range(len(values) // 2)]
    return values[0]


__all__ = ["ex2_approx", "ex2_approx_ftz", "fma_rn", "pairwise", "rcp_approx_ftz", "rcp_full", "rsqrt_approx",
           "rsqrt_approx_ftz", "sqrt_approx_ftz"]
