"""Traced PTX building blocks of the DSpark CuTe DSL kernels.

Every helper here is plain Python that emits MLIR while a ``@cute.kernel`` is
traced (call it from a kernel or from a plain Python function a kernel calls).
The arithmetic is inline PTX with an explicit rounding mode and no ``.ftz``,
so the compiler cannot contract a product and a sum into an FMA, flush
subnormals, or swap in an approximation: each helper is exactly the IEEE
operation that ``dspark_core.spec.numerics`` specifies.

Values: ``Float32`` for FP32 values, ``Uint32`` for raw 32-bit words (a bf16x2
or fp16x2 pair, an FP32 bit pattern), ``Int64`` for global addresses in bytes.
A "fragment" is a Python list of 8 ``Float32``: the 8 consecutive columns one
thread holds (``dspark_core.spec.numerics`` row tree, step 1).

Memory helpers take byte addresses (``Int64``) in the global space; the
kernels compute them from a pointer argument's ``toint()``. Every global load
is emitted as a side-effecting asm statement, so the compiler keeps it in
program order relative to ``pdl_wait`` (a load of data written by the previous
kernel must stay after the wait).

API summary (all traced):

- arithmetic: ``add_rn``, ``sub_rn``, ``mul_rn``, ``div_rn``, ``sqrt_rn``;
- bits: ``f32_bits`` (host: a float to its FP32 bit pattern, rounded to
  nearest even), ``f32_const``, ``as_f32``, ``as_u32``;
- conversions: ``bf16x2_to_f32``, ``f16x2_to_f32``, ``pack_bf16x2_rn``,
  ``pack_f16x2_rn``, ``round_bf16x2``, ``round_bf16`` (a list, pair by pair);
- memory: ``ld_global_v4``, ``st_global_v4``, ``ld_f32x8``, ``ld_bf16x8``,
  ``ld_f16x8``, ``ld_row8`` (by dtype name), ``st_f32x8``, ``st_bf16x8``,
  ``st_f16x8``, ``st_row8``; ``ld_shared_f32``, ``st_shared_f32``;
- reductions: ``fragment_sum``, ``thread_sum``, ``warp_fold``, ``cta_fold``,
  ``row_sum`` (the whole row tree), ``inv_rms``;
- launch order: ``pdl_wait``, ``pdl_launch_dependents``;
- clusters (a row split over the CTAs of a cluster, sm_90+): ``cluster_id_x``,
  ``cluster_rank``, ``cluster_arrive``, ``cluster_wait``, ``ld_dsmem_f32``,
  ``cluster_row_sum``.
"""

from __future__ import annotations

import struct

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# The reference CTA of the row tree (dspark_core.spec.numerics).
THREADS = 256
VEC = 8
WARP = 32
WARPS = THREADS // WARP
CHUNK = THREADS * VEC
# Bytes of one 8-column fragment by dtype name.
FRAGMENT_BYTES = {"bf16": 16, "fp16": 16, "fp32": 32}


def _asm(result_type, operands, text: str, constraints: str, side_effects: bool, loc, ip):
    return llvm.inline_asm(
        result_type,
        operands,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _f(value, loc, ip):
    return Float32(value).ir_value(loc=loc, ip=ip)


def _u(value, loc, ip):
    return Uint32(value).ir_value(loc=loc, ip=ip)


def _l(value, loc, ip):
    return Int64(value).ir_value(loc=loc, ip=ip)


# ---------------------------------------------------------------- arithmetic


def _binary(op: str):
    @dsl_user_op
    def fn(a, b, *, loc=None, ip=None) -> Float32:
        return Float32(
            _asm(T.f32(), [_f(a, loc, ip), _f(b, loc, ip)], f"{op}.rn.f32 $0, $1, $2;",
                 "=f,f,f", False, loc, ip)
        )

    fn.__name__ = f"{op}_rn"
    fn.__doc__ = f"``a {op} b`` in FP32 (``{op}.rn.f32``), rounded once to nearest even."
    return fn


add_rn = _binary("add")
sub_rn = _binary("sub")
mul_rn = _binary("mul")
div_rn = _binary("div")


@dsl_user_op
def sqrt_rn(a, *, loc=None, ip=None) -> Float32:
    """``sqrt(a)`` in FP32 (``sqrt.rn.f32``), correctly rounded."""
    return Float32(_asm(T.f32(), [_f(a, loc, ip)], "sqrt.rn.f32 $0, $1;", "=f,f", False, loc, ip))


# ---------------------------------------------------------------- bits


def f32_bits(value: float) -> int:
    """Host side: the FP32 bit pattern of ``value`` rounded to nearest even
    (the value ``torch.tensor(value, dtype=float32)`` holds)."""
    return struct.unpack("<I", struct.pack("<f", float(value)))[0]


@dsl_user_op
def as_f32(word, *, loc=None, ip=None) -> Float32:
    """The 32-bit word ``word`` read as an FP32 (a bit cast)."""
    return Float32(llvm.bitcast(T.f32(), _u(word, loc, ip), loc=loc, ip=ip))


@dsl_user_op
def as_u32(value, *, loc=None, ip=None) -> Uint32:
    """The bit pattern of FP32 ``value`` (a bit cast)."""
    return Uint32(llvm.bitcast(T.i32(), _f(value, loc, ip), loc=loc, ip=ip))


def f32_const(value: float) -> Float32:
    """The FP32 constant nearest ``value`` (ties to even), built from its bits
    so that no compiler rounding of a Python double is involved."""
    return as_f32(Uint32(f32_bits(value)))


# ---------------------------------------------------------------- conversions


def bf16x2_to_f32(word) -> tuple:
    """``(lo, hi)``: the two BF16 of a packed word widened to FP32 exactly
    (their bits shifted into the high half; -0.0, subnormals, inf and NaN
    payloads kept)."""
    w = Uint32(word)
    return as_f32(w << Uint32(16)), as_f32(w & Uint32(0xFFFF0000))


@dsl_user_op
def f16x2_to_f32(word, *, loc=None, ip=None) -> tuple:
    """``(lo, hi)``: the two FP16 of a packed word widened to FP32 exactly
    (``cvt.f32.f16``, no ``.ftz``)."""
    pair = _asm(
        llvm.StructType.get_literal([T.f32(), T.f32()]),
        [_u(word, loc, ip)],
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
        "=f,=f,r",
        False,
        loc,
        ip,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), pair, [i], loc=loc, ip=ip)) for i in range(2))


@dsl_user_op
def pack_bf16x2_rn(lo, hi, *, loc=None, ip=None) -> Uint32:
    """``lo`` and ``hi`` each rounded to BF16 (nearest even, subnormals kept,
    overflow to inf) and packed, ``lo`` in the low half
    (``cvt.rn.bf16x2.f32``)."""
    return Uint32(
        _asm(T.i32(), [_f(hi, loc, ip), _f(lo, loc, ip)], "cvt.rn.bf16x2.f32 $0, $1, $2;",
             "=r,f,f", False, loc, ip)
    )


@dsl_user_op
def pack_f16x2_rn(lo, hi, *, loc=None, ip=None) -> Uint32:
    """``lo`` and ``hi`` each rounded to FP16 (nearest even, subnormals kept,
    overflow to inf) and packed, ``lo`` in the low half
    (``cvt.rn.f16x2.f32``)."""
    return Uint32(
        _asm(T.i32(), [_f(hi, loc, ip), _f(lo, loc, ip)], "cvt.rn.f16x2.f32 $0, $1, $2;",
             "=r,f,f", False, loc, ip)
    )


def round_bf16x2(a, b) -> tuple:
    """``(a, b)`` each rounded to BF16 (nearest even) and widened back to
    FP32: ``x.to(bfloat16).to(float32)``."""
    return bf16x2_to_f32(pack_bf16x2_rn(a, b))


def round_bf16(values: list) -> list:
    """``values`` (an even count of FP32) each rounded to BF16 and widened
    back, pair by pair in order (``round_bf16x2``)."""
    out = []
    for j in range(0, len(values), 2):
        out.extend(round_bf16x2(values[j], values[j + 1]))
    return out


# ---------------------------------------------------------------- global memory


def _ld_global_v4(opcode: str, addr, loc, ip) -> list:
    words = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_l(addr, loc, ip)],
        f"{opcode}.v4.b32 {{$0, $1, $2, $3}}, [$4];",
        "=r,=r,=r,=r,l",
        True,
        loc,
        ip,
    )
    return [Uint32(llvm.extractvalue(T.i32(), words, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def ld_global_v4(addr, *, loc=None, ip=None) -> list:
    """Four 32-bit words from the 16-byte aligned global byte address
    ``addr`` (one ``ld.global.v4.b32``), kept in program order."""
    return _ld_global_v4("ld.global", addr, loc, ip)


@dsl_user_op
def ld_global_nc_v4(addr, *, loc=None, ip=None) -> list:
    """``ld_global_v4`` through the non-coherent path without an L1 line
    (``ld.global.nc.L1::no_allocate.v4.b32``): for data that no kernel writes
    while this one runs and that is read once (a weight streamed by a GEMV)."""
    return _ld_global_v4("ld.global.nc.L1::no_allocate", addr, loc, ip)


@dsl_user_op
def st_global_v4(addr, words, *, loc=None, ip=None) -> None:
    """Store four 32-bit words at the 16-byte aligned global byte address
    ``addr`` (one ``st.global.v4.b32``)."""
    _asm(
        None,
        [_l(addr, loc, ip)] + [_u(w, loc, ip) for w in words],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        True,
        loc,
        ip,
    )


def ld_f32x8(addr) -> list:
    """8 FP32 from ``addr`` (32 bytes: two 16-byte loads)."""
    words = ld_global_v4(addr) + ld_global_v4(Int64(addr) + 16)
    return [as_f32(w) for w in words]


def ld_bf16x8(addr) -> list:
    """8 BF16 from ``addr`` (one 16-byte load), widened to FP32 exactly."""
    out = []
    for w in ld_global_v4(addr):
        out.extend(bf16x2_to_f32(w))
    return out


def ld_f16x8(addr) -> list:
    """8 FP16 from ``addr`` (one 16-byte load), widened to FP32 exactly."""
    out = []
    for w in ld_global_v4(addr):
        out.extend(f16x2_to_f32(w))
    return out


def ld_row8(dtype: str, base, column) -> list:
    """The 8 values of a ``dtype`` ("bf16", "fp16" or "fp32") vector from
    element ``column`` of the array at byte address ``base``, as FP32."""
    size = FRAGMENT_BYTES[dtype] // VEC
    addr = Int64(base) + Int64(column) * size
    return {"bf16": ld_bf16x8, "fp16": ld_f16x8, "fp32": ld_f32x8}[dtype](addr)


def st_f32x8(addr, values) -> None:
    """Store 8 FP32 at ``addr`` (two 16-byte stores)."""
    words = [as_u32(v) for v in values]
    st_global_v4(addr, words[:4])
    st_global_v4(Int64(addr) + 16, words[4:])


def st_bf16x8(addr, values) -> None:
    """Store 8 FP32 rounded to BF16 (nearest even) at ``addr`` (one 16-byte
    store)."""
    st_global_v4(addr, [pack_bf16x2_rn(values[2 * i], values[2 * i + 1]) for i in range(4)])


def st_f16x8(addr, values) -> None:
    """Store 8 FP32 rounded to FP16 (nearest even) at ``addr`` (one 16-byte
    store)."""
    st_global_v4(addr, [pack_f16x2_rn(values[2 * i], values[2 * i + 1]) for i in range(4)])


def st_row8(dtype: str, base, column, values) -> None:
    """Store 8 FP32 ``values`` rounded to ``dtype`` at element ``column`` of
    the array at byte address ``base``."""
    size = FRAGMENT_BYTES[dtype] // VEC
    addr = Int64(base) + Int64(column) * size
    {"bf16": st_bf16x8, "fp16": st_f16x8, "fp32": st_f32x8}[dtype](addr, values)


# ---------------------------------------------------------------- shared memory


@dsl_user_op
def st_shared_f32(addr, value, *, loc=None, ip=None) -> None:
    """Store FP32 ``value`` at the shared-memory byte address ``addr`` (Int32)."""
    _asm(None, [Int32(addr).ir_value(loc=loc, ip=ip), _f(value, loc, ip)],
         "st.shared.f32 [$0], $1;", "r,f", True, loc, ip)


@dsl_user_op
def ld_shared_f32(addr, *, loc=None, ip=None) -> Float32:
    """The FP32 at the shared-memory byte address ``addr`` (Int32)."""
    return Float32(_asm(T.f32(), [Int32(addr).ir_value(loc=loc, ip=ip)],
                        "ld.shared.f32 $0, [$1];", "=f,r", True, loc, ip))


# ---------------------------------------------------------------- the row tree


def fragment_sum(v: list) -> Float32:
    """Row tree step 2: ``((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))``."""
    pairs = [add_rn(v[2 * i], v[2 * i + 1]) for i in range(4)]
    return add_rn(add_rn(pairs[0], pairs[1]), add_rn(pairs[2], pairs[3]))


def thread_sum(fragment_sums: list) -> Float32:
    """Row tree step 3: ``((f_0 + f_1) + f_2) + ...`` in order of ``k``."""
    total = fragment_sums[0]
    for f in fragment_sums[1:]:
        total = add_rn(total, f)
    return total


def warp_fold(value) -> Float32:
    """Row tree step 4: the warp butterfly ``s + shfl.bfly(s, o)`` for
    ``o`` = 16, 8, 4, 2, 1; every lane ends with the warp's sum (lane ``l``
    adds ``s_l + s_(l^o)``, bitwise the spec's ``s_l + s_(l+o)``)."""
    s = Float32(value)
    for offset in (16, 8, 4, 2, 1):
        s = add_rn(s, cute.arch.shuffle_sync_bfly(s, offset=offset))
    return s


def cta_fold(warp_sum, sums_addr, warp, lane) -> Float32:
    """Row tree step 5: lane 0 of each warp stores its warp sum at
    ``sums_addr + 4 * warp`` (shared memory, 8 FP32 reserved for this fold
    alone), a CTA barrier, then every thread reads the 8 sums and folds them
    by halves: ``(w0 + w4, w1 + w5, w2 + w6, w3 + w7)``, then 2, then 1."""
    # A predicated store: only lane 0 writes (the same value sits in every lane).
    _store_if_lane0(lane, Int32(sums_addr) + Int32(warp) * 4, warp_sum)
    cute.arch.barrier()
    w = [ld_shared_f32(Int32(sums_addr) + 4 * i) for i in range(WARPS)]
    while len(w) > 1:
        half = len(w) // 2
        w = [add_rn(w[i], w[i + half]) for i in range(half)]
    return w[0]


@dsl_user_op
def _store_if_lane0(lane, addr, value, *, loc=None, ip=None) -> None:
    _asm(
        None,
        [Int32(lane).ir_value(loc=loc, ip=ip), Int32(addr).ir_value(loc=loc, ip=ip),
         _f(value, loc, ip)],
        "{ .reg .pred p; setp.eq.u32 p, $0, 0; @p st.shared.f32 [$1], $2; }",
        "r,r,f",
        True,
        loc,
        ip,
    )


def row_sum(fragments: list, sums_addr, warp, lane) -> Float32:
    """The row tree (``dspark_core.spec.numerics.row_sum``) of the squares of one
    thread's ``fragments`` (a list per ``k`` of 8 FP32): each value squared
    (``mul.rn``), steps 2-5; the row's sum of squares, in every thread.
    ``sums_addr``: 8 FP32 of shared memory for this sum alone."""
    sums = [fragment_sum([mul_rn(v, v) for v in f]) for f in fragments]
    return cta_fold(warp_fold(thread_sum(sums)), sums_addr, warp, lane)


def inv_rms(total, n: int, eps: float) -> Float32:
    """``dspark_core.spec.numerics.inv_rms``: ``1 / sqrt(total / n + eps)`` as
    ``div.rn``, ``add.rn``, ``sqrt.rn``, ``div.rn`` (``n`` and ``eps`` FP32
    constants, rounded to nearest even)."""
    var = add_rn(div_rn(total, f32_const(float(n))), f32_const(eps))
    return div_rn(f32_const(1.0), sqrt_rn(var))


# ---------------------------------------------------------------- launch order


def pdl_wait() -> None:
    """``griddepcontrol.wait``: block until the grid this launch depends on
    (programmatic dependent launch) has completed and its memory is visible;
    a no-op without a PDL dependency."""
    cute.arch.griddepcontrol_wait()


def pdl_launch_dependents() -> None:
    """``griddepcontrol.launch_dependents``: let the next PDL kernel start
    launching (it must still ``pdl_wait`` before reading what this grid
    writes)."""
    cute.arch.griddepcontrol_launch_dependents()


def weight_first(ahead: int, load_weight, load_x, before_x=None) -> None:
    """The prologue of the main loops that load into registers (the GEMV,
    ``skinny_direct``): ``load_weight(s)`` for the first ``ahead`` steps
    (the weight is constant while the decode runs, so its loads may precede
    the PDL wait), then ``before_x()`` where given (the wait), then
    ``load_x(s)`` for the same steps (x is the previous kernel's output)."""
    for s in range(ahead):
        load_weight(s)
    if before_x is not None:
        before_x()
    for s in range(ahead):
        load_x(s)


# ---------------------------------------------------------------- clusters


@dsl_user_op
def cluster_id_x(*, loc=None, ip=None) -> Int32:
    """``%clusterid.x``: the index of this CTA's cluster along x."""
    return Int32(_asm(T.i32(), [], "mov.u32 $0, %clusterid.x;", "=r", False, loc, ip))


@dsl_user_op
def cluster_rank(*, loc=None, ip=None) -> Int32:
    """``%cluster_ctarank``: this CTA's rank in its cluster."""
    return Int32(_asm(T.i32(), [], "mov.u32 $0, %cluster_ctarank;", "=r", False, loc, ip))


@dsl_user_op
def cluster_arrive(*, loc=None, ip=None) -> None:
    """``barrier.cluster.arrive.release.aligned``: this thread's shared-memory
    writes become visible to the cluster's threads that then wait."""
    _asm(None, [], "barrier.cluster.arrive.release.aligned;", "", True, loc, ip)


@dsl_user_op
def cluster_wait(*, loc=None, ip=None) -> None:
    """``barrier.cluster.wait.acquire.aligned``: wait until every thread of
    the cluster has arrived (and see what they wrote before arriving)."""
    _asm(None, [], "barrier.cluster.wait.acquire.aligned;", "", True, loc, ip)


@dsl_user_op
def ld_dsmem_f32(addr, rank, *, loc=None, ip=None) -> Float32:
    """The FP32 at shared-memory byte address ``addr`` (Int32, this CTA's
    window) of the cluster's CTA ``rank`` (``mapa`` + ``ld.shared::cluster``)."""
    return Float32(
        _asm(
            T.f32(),
            [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
            "{ .reg .b32 ra; mapa.shared::cluster.u32 ra, $1, $2; ld.shared::cluster.f32 $0, [ra]; }",
            "=f,r,r",
            True,
            loc,
            ip,
        )
    )


def cluster_row_sum(fragment, ranks: int, fsum_addr, sums_addr, tidx, warp, lane) -> Float32:
    """The row tree of the squares of a row split over a cluster of
    ``ranks`` CTAs, CTA ``k`` holding fragment ``k`` of every reference
    thread (``dspark_core.spec.numerics``: the cluster layout). Thread ``t``:

    1. squares its 8 values and forms their fragment sum (step 2), stored at
       ``fsum_addr + 4 t`` of its CTA's shared memory (256 FP32 reserved);
    2. a cluster barrier (arrive.release, wait.acquire);
    3. reads fragment sums ``k = 0 .. ranks-1`` of reference thread ``t``
       from CTA ``k`` and adds them in order of ``k`` (step 3);
    4. the warp butterfly and the cross-warp fold (steps 4-5, ``sums_addr``:
       8 FP32 of this CTA's shared memory).

    Every CTA of the cluster returns the same sum. The caller must keep its
    CTA alive until the others have read ``fsum_addr`` (a later cluster
    barrier)."""
    f = fragment_sum([mul_rn(v, v) for v in fragment])
    st_shared_f32(Int32(fsum_addr) + Int32(tidx) * 4, f)
    cluster_arrive()
    cluster_wait()
    addr = Int32(fsum_addr) + Int32(tidx) * 4
    total = thread_sum([ld_dsmem_f32(addr, Int32(k)) for k in range(ranks)])
    return cta_fold(warp_fold(total), sums_addr, warp, lane)


__all__ = [
    "CHUNK",
    "FRAGMENT_BYTES",
    "THREADS",
    "VEC",
    "WARP",
    "WARPS",
    "add_rn",
    "as_f32",
    "as_u32",
    "bf16x2_to_f32",
    "cluster_arrive",
    "cluster_id_x",
    "cluster_rank",
    "cluster_row_sum",
    "cluster_wait",
    "cta_fold",
    "div_rn",
    "f16x2_to_f32",
    "f32_bits",
    "f32_const",
    "fragment_sum",
    "inv_rms",
    "ld_bf16x8",
    "ld_f16x8",
    "ld_f32x8",
    "ld_dsmem_f32",
    "ld_global_nc_v4",
    "ld_global_v4",
    "ld_row8",
    "ld_shared_f32",
    "mul_rn",
    "pack_bf16x2_rn",
    "pack_f16x2_rn",
    "pdl_launch_dependents",
    "pdl_wait",
    "round_bf16",
    "round_bf16x2",
    "row_sum",
    "sqrt_rn",
    "st_bf16x8",
    "st_f16x8",
    "st_f32x8",
    "st_global_v4",
    "st_row8",
    "st_shared_f32",
    "sub_rn",
    "thread_sum",
    "warp_fold",
    "weight_first",
]
