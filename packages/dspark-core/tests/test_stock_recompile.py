"""The stock-recompile check: vLLM 0.33.0's stock kernels, recompiled and read
back, must still compute what dspark-core's spec says (a vLLM or Triton
upgrade must not silently break exactness).

CPU only. The compile checks run where vLLM (>= 0.33.0) and Triton (>= 3.8.0,
the pin of vLLM 0.33.0's torch) are installed: the ``tests-vllm`` session,
``.nox/tests-vllm`` (``nox -s tests-vllm``: vLLM 0.33.0 with its pins, the
DSpark packages installed editable; run this file there with
``.nox/tests-vllm/bin/python -m pytest -q packages/dspark-core/tests/test_stock_recompile.py``);
elsewhere they skip. What the trees mean is ``docs/stock-numerics.md``. The builder checks
(the first section) run everywhere.

1. The Triton kernels, compiled from vLLM's installed source with the
   installed Triton for sm_90a and sm_100a (``scripts/stock/compile_stock.py``:
   the specialization Triton's JIT derives from the stock launch):
   ``_rmsnorm_fwd_kernel`` at D = 8192 in the draft's variants (BF16 rows and
   BF16 output; BF16, FP32 or no weight; with and without the input scale)
   and FLA's ``layer_norm_gated_fwd_kernel`` (H = 64, D = 64). From each
   PTX, ``scripts/stock/ptx_expr.py`` derives one thread's expression trees:
   the thread sum it stores for the warp reduction, the argument of
   ``rsqrt.approx.ftz`` (or ``sqrt.approx.ftz``), and every value it stores.
   A small builder here constructs the same trees from the spec's
   description, mirroring ``numerics.thread_sum_of_squares`` (the leaves per
   arch), ``pairwise``, ``reduce_threads`` (the butterfly offsets of
   ``fold_halves``, the 8 warp sums through shared memory), ``inv_rms``
   (``fma(S, 2^-13, eps)``, ``rsqrt.approx.ftz``) and the output multiplies
   (``RN(RN(w + gc) * RN(r * x))``, one BF16 rounding); the trees must be
   equal up to commutation (which changes no bits). Two identities are
   applied to both sides first, each with its reason: an fma leaf of BF16
   elements ``fma(a, a, RN(b^2))`` is ``RN(RN(a^2) + RN(b^2))`` (BF16 squares
   are exact), and FLA's PTX ``div.full(S, 64) + eps`` is the ``FFMA S,
   0.015625, eps`` its SASS holds (checked there). The builder itself is
   checked against the spec's functions numerically (section 0), so the
   comparison is with the spec as coded.
2. Instruction-count fingerprints of each variant's SASS (``cuobjdump`` from
   Triton's wheel): the FMUL / FFMA / FADD (and the packed FMUL2 / FFMA2 /
   FADD2, FHADD.BF16) counts that say nothing was contracted or split beyond
   what the trees show.
3. vLLM's own CUDA kernels, from the cubins of its installed
   ``_C_stable_libtorch.abi3.so`` (``compile_stock.so_cubins``): the fused
   QK-norm + RoPE + KV-insert kernel's sequential FFMA chain of 8, its
   butterfly 4, 2, 1, ``FFMA S, 0.015625, eps``, ``rsqrtf`` (MUFU.RSQ with the
   subnormal scaling), the RoPE FMUL/FFMA pattern with its negated operand,
   four BF16 packs; the rotary kernel's same RoPE pattern; act_and_mul's
   accurate ``expf`` (FFMA.SAT, FFMA.RM, the Cody-Waite constants, MUFU.EX2),
   IEEE division (FCHK), ``up + 0.0``.

A failure names the variant and what differs.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_core.spec import layers as L
from dspark_core.spec import numerics as N

REPO = Path(__file__).resolve().parents[3]
STOCK = REPO / "scripts" / "stock"
PINS = {"vllm": "0.33.0", "triton": "3.8.0"}
ARCH_NAMES = {90: "sm_90a", 100: "sm_100a"}
H = 8192
# The draft's norm variants (x BF16, y BF16): (weight, input scale).
RMS_VARIANTS = [("bf16", False), ("bf16", True), ("fp32", False), ("fp32", True), ("none", False)]
NEG_LOG2E = float(np.float32(-1.4426950408889634))

sys.path.insert(0, str(STOCK))
import ptx_expr as PX  # noqa: E402

sys.path.remove(str(STOCK))


# ---------------------------------------------------------------------------
# The builder: the spec's trees as ptx_expr nodes.


def add(a, b):
    return ("add", a, b)


def mul(a, b):
    return ("mul", a, b)


def fma(a, b, c):
    return ("fma", a, b, c)


def const(v: float):
    return ("const", float(v))


def bfly(offset: int, v):
    return ("bfly", offset, v)


def pairwise(vals: list) -> tuple:
    """``numerics.pairwise``: neighbours first."""
    vals = list(vals)
    while len(vals) > 1:
        vals = [add(vals[i], vals[i + 1]) for i in range(0, len(vals), 2)]
    return vals[0]


def fold_offsets(n: int) -> list[int]:
    """The butterfly ``numerics.fold_halves`` documents: offsets n/2 .. 1."""
    out = []
    while n > 1:
        n //= 2
        out.append(n)
    return out


def butterfly(v, offsets):
    for off in offsets:
        v = add(v, bfly(off, v))
    return v


def thread_sum_of_squares(e: list, arch: str, input_scaled: bool):
    """``numerics.thread_sum_of_squares`` over a thread's 32 element nodes."""
    n = len(e)
    if arch == "sm_90a":
        return pairwise([fma(e[2 * k], e[2 * k], mul(e[2 * k + 1], e[2 * k + 1])) for k in range(n // 2)])
    if input_scaled:
        even = pairwise([fma(e[4 * j], e[4 * j], mul(e[4 * j + 2], e[4 * j + 2])) for j in range(n // 4)])
        odd = pairwise([fma(e[4 * j + 1], e[4 * j + 1], mul(e[4 * j + 3], e[4 * j + 3])) for j in range(n // 4)])
        return add(even, odd)
    q = [mul(v, v) for v in e]
    return add(pairwise(q[0::2]), pairwise(q[1::2]))


CTA = ("smem", "cta")  # thread t's load of smem[t & 7], the warp sums


def reduce_threads(t):
    """``numerics.reduce_threads``: ``(warp value stored to shared memory,
    the CTA's total from the shared loads)``."""
    return butterfly(t, fold_offsets(N.WARP)), butterfly(CTA, fold_offsets(N.WARPS))


def bf16_leaf(param: int, k: int):
    """Element ``k = 8 r + j`` of a thread's BF16 row: the lo/hi half of lane
    ``j // 2`` of its ``r``-th 16-byte load from ``param``."""
    r, j = divmod(k, N.VEC)
    return ("half", ("ld", param, r, j // 2), "hi" if j % 2 else "lo")


GAIN = ("smem", "*")  # an FP32 gain, brought to the x layout through shared memory


def rmsnorm_trees(arch: str, weight: str, scaled: bool, params: dict) -> dict:
    """The spec's trees (``layers.RMSNorm.forward``) for one thread of the
    stock norm at D = 8192: ``warp`` (the stored thread/warp sum), ``v``
    (rsqrt's input), ``out`` (the 16 stored bf16x2 words, in store order)."""
    x = [bf16_leaf(params["x_ptr"], k) for k in range(H // N.THREADS)]
    gc = ("param", params["gain_center"])
    if weight == "none":
        g = None
    elif weight == "bf16":
        g = [add(bf16_leaf(params["w_ptr"], k), gc) for k in range(len(x))]
    else:
        g = [GAIN] * len(x)
    v = [mul(g[k], x[k]) for k in range(len(x))] if scaled else x
    warp, total = reduce_threads(thread_sum_of_squares(v, arch, scaled))
    arg = fma(total, const(N.f32(1.0 / H)), ("param", params["eps"]))
    r = ("rsqrt.approx.ftz", arg)
    y = [mul(r, v[k]) if (g is None or scaled) else mul(g[k], mul(r, x[k])) for k in range(len(x))]
    out = [("bf16x2", y[2 * i + 1], y[2 * i]) for i in range(len(y) // 2)]
    return {"warp": warp, "v": arg, "out": out}


def fla_trees(params: dict) -> dict:
    """``layers.o_gate(arch="sm_90a")`` (FLA's kernel) for one lane of 16:
    ``v`` (the norm's ``fma(S, 2^-6, eps)``), ``rstd`` (stored), ``out``
    (the 2 stored bf16x2 words)."""
    x = [bf16_leaf(params["x"], k) for k in range(4)]
    g = [bf16_leaf(params["g"], k) for k in range(4)]
    s = add(fma(x[0], x[0], mul(x[1], x[1])), fma(x[2], x[2], mul(x[3], x[3])))
    s = butterfly(s, fold_offsets(16))
    v = fma(s, const(N.f32(1.0 / 64)), ("param", params["eps"]))
    rstd = ("div.full", const(1.0), ("sqrt.approx.ftz", v))
    sig = [("div.full", const(1.0), add(("ex2.approx", mul(gi, const(NEG_LOG2E))), const(1.0))) for gi in g]
    y = [mul(mul(x[i], rstd), sig[i]) for i in range(4)]
    return {"v": v, "rstd": rstd, "out": [("bf16x2", y[1], y[0]), ("bf16x2", y[3], y[2])]}


# ---------------------------------------------------------------------------
# 0. The builder is the spec: its trees evaluated on data equal the spec's functions.


class _Eval:
    """Evaluates builder nodes for all 256 threads of a CTA at once (torch
    FP32 ops, ``numerics.fma_rn``, the spec's approximate instructions):
    leaves read ``rows[param]`` in the stock layout; ``bfly`` permutes by
    ``tid ^ offset``; ``smem`` 'cta' reads the warp sums by ``tid & 7``."""

    def __init__(self, rows: dict, params: dict, lanes: int, per_lane: int):
        self.rows, self.params, self.lanes, self.per_lane = rows, params, lanes, per_lane
        self.tid = torch.arange(lanes)
        self.memo: dict[int, torch.Tensor] = {}
        self.warp: torch.Tensor | None = None
        self.scalars: dict[int, float] = {}
        self.gain: list[torch.Tensor] | None = None

    def leaf(self, param: int, r: int, lane: int, half: str) -> torch.Tensor:
        j = 2 * lane + (half == "hi")
        cols = r * self.lanes * self.per_lane + self.tid * self.per_lane + j
        return self.rows[param][:, cols]

    def __call__(self, node) -> torch.Tensor:
        key = id(node)
        if key in self.memo:
            return self.memo[key]
        kind = node[0]
        if kind == "half":
            _, (_, param, r, lane), half = node
            out = self.leaf(param, r, lane, half)
        elif kind == "param":
            out = torch.tensor(self.scalars[node[1]], dtype=torch.float32)
        elif kind == "const":
            out = torch.tensor(node[1], dtype=torch.float32)
        elif kind == "smem":
            out = self.warp[:, (self.tid & 7) * 32]
        elif kind == "bfly":
            v = self(node[2])
            out = v[:, self.tid ^ node[1]]
        elif kind in ("add", "mul"):
            a, b = self(node[1]), self(node[2])
            out = a + b if kind == "add" else a * b
        elif kind == "fma":
            out = N.fma_rn(self(node[1]), self(node[2]), self(node[3]))
        elif kind == "rsqrt.approx.ftz":
            out = N.rsqrt_approx_ftz(self(node[1]))
        elif kind == "sqrt.approx.ftz":
            out = N.sqrt_approx_ftz(self(node[1]))
        elif kind == "ex2.approx":
            out = N.ex2_approx(self(node[1]))
        elif kind == "div.full":
            out = N.rcp_full(self(node[2])) if node[1] == ("const", 1.0) else None
        else:
            raise ValueError(kind)
        self.memo[key] = out
        return out


RMS_PARAMS = {"x_ptr": 0, "y_ptr": 1, "w_ptr": 2, "eps": 7, "gain_center": 8}


@pytest.mark.parametrize("arch", N.ARCHS)
@pytest.mark.parametrize("weight,scaled", [("bf16", False), ("bf16", True), ("none", False)])
def test_the_builder_is_the_spec_row_norm(arch, weight, scaled, rng):
    """The builder's trees, evaluated thread by thread on random BF16 rows
    (special values included), give the spec's ``fma(s, 1/H, eps)`` and the
    spec's RMSNorm output, bit for bit."""
    m, eps, gc = 5, 1e-5, 1.0
    x = torch.from_numpy(rng.standard_normal((m, H)).astype(np.float32)).to(torch.bfloat16)
    x[0, :4] = torch.tensor([-0.0, float("inf"), 1e-39, 3e38])
    w = torch.from_numpy(rng.standard_normal(H).astype(np.float32) * 0.1).to(torch.bfloat16)
    trees = rmsnorm_trees(arch, weight, scaled, RMS_PARAMS)
    ev = _Eval({0: x.float(), 2: w.float().expand(m, H)}, RMS_PARAMS, N.THREADS, N.VEC)
    ev.scalars = {7: N.f32(eps), 8: N.f32(gc)}
    ev.warp = ev(trees["warp"])
    norm = L.RMSNorm(H, eps, has_weight=weight != "none", gain_center=gc, weight_before_norm=scaled, arch=arch)
    if norm.weight is not None:
        norm.weight.copy_(w)
    xs = x.float() if not scaled else norm.gain() * x.float()
    spec_v = N.fma_rn(N.row_sum_of_squares(xs, arch, scaled), torch.tensor(N.f32(1 / H)), torch.tensor(N.f32(eps)))
    got_v = ev(trees["v"])
    assert _same_bits(got_v, spec_v[:, None].expand_as(got_v)), (arch, weight, scaled)
    y = norm(x)
    for i, word in enumerate(trees["out"]):
        r, lane = divmod(i, 4)
        for part, node in (("hi", word[1]), ("lo", word[2])):
            cols = r * 2048 + ev.tid * 8 + 2 * lane + (part == "hi")
            assert _same_bits(ev(node).to(torch.bfloat16), y[:, cols]), (arch, weight, scaled, i, part)


def test_the_builder_is_the_spec_o_gate(rng):
    """The FLA builder, evaluated lane by lane (16 lanes of 4 per row), gives
    ``layers.o_gate(arch="sm_90a")``'s rstd and output, bit for bit."""
    rows = 24
    params = {"x": 0, "g": 1, "eps": 4}
    x = torch.from_numpy(rng.standard_normal((rows, 64)).astype(np.float32)).to(torch.bfloat16)
    g = torch.from_numpy(rng.standard_normal((rows, 64)).astype(np.float32) * 4).to(torch.bfloat16)
    x[0, :3] = torch.tensor([-0.0, 1e-39, float("inf")])
    g[1, :3] = torch.tensor([-100.0, 100.0, float("-inf")])
    trees = fla_trees(params)
    ev = _Eval({0: x.float(), 1: g.float()}, params, 16, 4)
    ev.scalars = {4: N.f32(1e-6)}
    y = L.o_gate(x[:, None], g[:, None], L.HeadNorm(64, 1e-6), arch="sm_90a")[:, 0]
    for i, word in enumerate(trees["out"]):
        for part, node in (("hi", word[1]), ("lo", word[2])):
            cols = ev.tid * 4 + 2 * i + (part == "hi")
            assert _same_bits(ev(node).to(torch.bfloat16), y[:, cols]), (i, part)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    from dspark_core.tools.compare import mismatches

    return not bool(mismatches(a.contiguous(), b.contiguous()).any())


# ---------------------------------------------------------------------------
# The stock, recompiled (skipped without vLLM and Triton).


def _installed(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed (the tests-vllm session runs this in vLLM's venv)")


@pytest.fixture(scope="module")
def stock():
    """``compile_stock`` with vLLM's modules importable, or a skip."""
    _installed("vllm")
    # vLLM keeps Triton's JIT functions only where the visible-device list is
    # explicitly empty (compile_stock sets it too); restored after the module.
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    try:
        triton = pytest.importorskip("triton", minversion=PINS["triton"])
        vllm = pytest.importorskip("vllm", minversion=PINS["vllm"])
        sys.path.insert(0, str(STOCK))
        try:
            import compile_stock as C
        finally:
            sys.path.remove(str(STOCK))
        from vllm.models.muse_spark.common.ops import fused_rmsnorm
        from vllm.third_party.flash_linear_attention.ops import fused_norm_gate

        versions = f"vLLM {vllm.__version__}, Triton {triton.__version__}"
        if (vllm.__version__, triton.__version__) != (PINS["vllm"], PINS["triton"]):
            print(f"note: {versions}, not the pins {PINS}: checking that the arithmetic is unchanged")
        yield {
            "C": C,
            "versions": versions,
            "rmsnorm": C._jit(fused_rmsnorm._rmsnorm_fwd_kernel),
            "fla": C._jit(fused_norm_gate.layer_norm_gated_fwd_kernel),
            "cuobjdump": str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"),
            "so": Path(vllm.__file__).parent / "_C_stable_libtorch.abi3.so",
        }
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def _rms_variant(C, weight: str, scaled: bool, t_spec: str = "any"):
    for name, sig, const_, aligned, _grid, warps, _match in C.rmsnorm_variants(["bf16"], H):
        if name == f"rmsnorm_D{H}_x-bf16_w-{weight}_is{int(scaled)}_y-bf16_T-{t_spec}":
            return name, sig, const_, aligned, warps
    raise AssertionError(f"compile_stock has no variant w-{weight} is{int(scaled)} T-{t_spec}")


def _param_index(fn, sig: dict) -> dict:
    runtime = [a for a in fn.arg_names if sig.get(a, "constexpr") != "constexpr"]
    return {a: i for i, a in enumerate(runtime)}


_COMPILED: dict = {}


def _compile(stock, kind: str, key, arch: int):
    """(PTX, cubin, runtime parameter indices) of one kernel, compiled once."""
    if (kind, key, arch) not in _COMPILED:
        C = stock["C"]
        if kind == "rmsnorm":
            name, sig, const_, aligned, warps = _rms_variant(C, *key)
            fn = stock["rmsnorm"]
        else:
            heads, t_spec = key
            name, sig, const_, aligned, _grid, warps, _match = next(
                v for v in C.fla_variants([heads]) if v[0] == f"fla_gate_H{heads}_D64_T-{t_spec}")
            fn = stock["fla"]
        k = C.compile_kernel(fn, sig, const_, aligned, warps, arch)
        _COMPILED[(kind, key, arch)] = (k.asm["ptx"], k.asm["cubin"], _param_index(fn, sig), name)
    return _COMPILED[(kind, key, arch)]


# -- comparing trees -----------------------------------------------------------


def _is_bf16_leaf(node) -> bool:
    return isinstance(node, tuple) and node[0] == "half"


def normalize(node, cta: int | None = None):
    """Both sides' identities: a shared load that is the CTA's warp-sum load
    (``cta``) -> ``("smem", "cta")``, any other shared load or unmodelled
    64-bit lane (an FP32 gain moved through shared memory) -> ``("smem",
    "*")``; ``fma(a, a, RN(b*b))`` of two BF16 elements -> ``RN(a*a) +
    RN(b*b)`` (their squares are exact); then ``ptx_expr.canon``."""
    memo: dict[int, object] = {}

    def go(n):
        if isinstance(n, list):
            return [go(v) for v in n]
        key = id(n)
        if key in memo:
            return memo[key]
        kind = n[0]
        if kind == "smem":
            out = ("smem", "cta") if n[1] in ("cta", cta) else ("smem", "*")
        elif kind == "lane" and n[1][0] == "reg":
            out = ("smem", "*")
        elif kind in ("ld", "param", "const", "reg", "half"):
            out = n
        elif kind == "bfly":
            out = ("bfly", n[1], go(n[2]))
        elif (kind == "fma" and _is_bf16_leaf(n[1]) and n[1] == n[2] and n[3][0] == "mul"
              and _is_bf16_leaf(n[3][1]) and n[3][1] == n[3][2]):
            out = ("add", ("mul", n[1], n[1]), ("mul", n[3][1], n[3][1]))
        else:
            out = (kind, *[go(a) for a in n[1:]])
        memo[key] = out
        return out

    return PX.canon(go(node))


def first_difference(a, b, path="") -> str | None:
    """Where two trees first differ, as a path and the two subtrees."""
    if a == b:
        return None
    if (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and a[0] == b[0]
            and a[0] not in ("ld", "param", "const", "smem", "reg")):
        for i, (x, y) in enumerate(zip(a[1:], b[1:])):
            d = first_difference(x, y, f"{path}/{a[0]}[{i}]")
            if d:
                return d
    fa, fb = (PX.fmt(t) if isinstance(t, tuple) else repr(t) for t in (a, b))
    return f"at {path or '/'}: the compiled code has {fa[:300]}, the spec {fb[:300]}"


def _cta_load(trace) -> int:
    """The shared load the rsqrt argument reads (the CTA's warp sums)."""
    ids = set()

    def walk(n):
        if isinstance(n, tuple):
            if n[0] == "smem":
                ids.add(n[1])
            for a in n[1:]:
                walk(a)

    walk(trace.calls["rsqrt.approx.ftz"][0][0])
    assert len(ids) == 1, ids
    return ids.pop()


def _check(what: str, compiled, spec, cta=None) -> None:
    a, b = normalize(compiled, cta), normalize(spec, cta)
    if a != b:
        raise AssertionError(f"{what}: the stock's compiled arithmetic no longer matches the spec; "
                             f"{first_difference(a, b)}")


# -- 1. the row norm -------------------------------------------------------------


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("weight,scaled", RMS_VARIANTS)
def test_stock_rmsnorm_trees_are_the_spec(weight, scaled, arch, stock):
    ptx, _, params, name = _compile(stock, "rmsnorm", (weight, scaled), arch)
    what = f"{name} {ARCH_NAMES[arch]} ({stock['versions']})"
    t = PX.trace(ptx)
    spec = rmsnorm_trees(ARCH_NAMES[arch], weight, scaled, params)
    cta = _cta_load(t)
    sums = [s for s in t.shared_stores if "bfly" in repr(s)]
    assert len(sums) == 1, f"{what}: {len(sums)} stores of a warp sum, not 1"
    _check(f"{what}: the thread and warp sum", sums[0], spec["warp"], cta)
    assert len(t.calls["rsqrt.approx.ftz"]) == 1 and set(t.calls) == {"rsqrt.approx.ftz"}, \
        f"{what}: approximate instructions {dict((k, len(v)) for k, v in t.calls.items())}"
    _check(f"{what}: rsqrt.approx.ftz's argument", t.calls["rsqrt.approx.ftz"][0][0], spec["v"], cta)
    outs = [v for param, vals in t.global_stores if param == params["y_ptr"] for v in vals]
    assert len(outs) == len(spec["out"]), f"{what}: {len(outs)} stored words, the spec {len(spec['out'])}"
    for i, (got, want) in enumerate(zip(outs, spec["out"])):
        _check(f"{what}: stored word {i} (elements {2 * i}, {2 * i + 1})", got, want, cta)
    if weight == "fp32":  # the gains moved through shared memory are RN(w + gc) of the weight's loads
        gains = [s for s in t.shared_stores if "bfly" not in repr(s)]
        gc = ("param", params["gain_center"])
        want = {PX.canon(add(("ld", params["w_ptr"], k, i), gc)) for k in range(8) for i in range(4)}
        assert {PX.canon(g) for g in gains} == want, f"{what}: the FP32 gains stored are not RN(w + gc)"


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("t_spec", ["one", "div16"])
def test_stock_rmsnorm_row_count_specializations_compute_the_same(t_spec, arch, stock):
    """Triton's JIT makes ``T == 1`` a constexpr and ``T % 16 == 0`` a hint:
    the same trees (only the address code differs)."""
    C = stock["C"]
    name, sig, const_, aligned, warps = _rms_variant(C, "bf16", False, t_spec)
    k = C.compile_kernel(stock["rmsnorm"], sig, const_, aligned, warps, arch)
    params = _param_index(stock["rmsnorm"], sig)
    t = PX.trace(k.asm["ptx"])
    spec = rmsnorm_trees(ARCH_NAMES[arch], "bf16", False, params)
    cta = _cta_load(t)
    what = f"{name} {ARCH_NAMES[arch]}"
    _check(f"{what}: rsqrt.approx.ftz's argument", t.calls["rsqrt.approx.ftz"][0][0], spec["v"], cta)
    outs = [v for param, vals in t.global_stores if param == params["y_ptr"] for v in vals]
    for i, (got, want) in enumerate(zip(outs, spec["out"], strict=True)):
        _check(f"{what}: stored word {i}", got, want, cta)


# Per thread, from the SASS: the notes' counts (stock-numerics.md, 1a) where they give them,
# the others as compiled with Triton 3.8.0 (2026-12-02).
RMS_SASS = {
    ("bf16", False, 90): dict(FMUL=80, FFMA=17, FADD=55),
    ("bf16", True, 90): dict(FMUL=80, FFMA=17, FADD=55),
    ("fp32", False, 90): dict(FMUL=80, FFMA=17, FADD=55),
    ("fp32", True, 90): dict(FMUL=80, FFMA=17, FADD=55),
    ("none", False, 90): dict(FMUL=48, FFMA=17, FADD=23),
    ("bf16", False, 100): dict(FMUL=96, FADD2=15, FADD=9, **{"FHADD.BF16": 32}, FFMA=1),
    ("bf16", True, 100): dict(FMUL=32, FMUL2=24, FFMA2=8, FADD2=23, FADD=9, FFMA=1),
    ("fp32", False, 100): dict(FMUL2=40, FFMA2=8, FADD2=7, FADD=41, FFMA=1),
    ("fp32", True, 100): dict(FMUL2=40, FFMA2=8, FADD2=7, FADD=41, FFMA=1),
    ("none", False, 100): dict(FMUL=64, FADD2=15, FADD=9, FFMA=1),
}
COUNTED = ("FMUL", "FFMA", "FADD", "FMUL2", "FFMA2", "FADD2", "FHADD.BF16", "SHFL.BFLY", "MUFU.RSQ",
           "F2FP.BF16.F32.PACK_AB", "MUFU.SQRT", "MUFU.RCP", "MUFU.EX2")


def _sass(stock, cubin: bytes, function: str | None = None) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        cmd = [stock["cuobjdump"], "-sass", *(["-fun", function] if function else []), str(path)]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


INSN = re.compile(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T]\s+)?([A-Z0-9_.]+)\s*([^;]*);")


def instructions(sass: str) -> list[tuple[str, str, list[str]]]:
    """``(predicate, mnemonic, operands)`` of each SASS instruction."""
    out = []
    for pred, op, args in INSN.findall(sass):
        operands = [a.strip().replace(".reuse", "") for a in args.split(",")] if args.strip() else []
        out.append((pred.strip(), op, operands))
    return out


def main_body(ins: list) -> list:
    """The instructions up to the kernel's (unpredicated) EXIT: what follows
    is a called subroutine (e.g. a division's slow path)."""
    end = next((i for i, (p, op, _) in enumerate(ins) if op == "EXIT" and not p), len(ins))
    return ins[: end + 1]


def counts(sass: str) -> dict[str, int]:
    c: dict[str, int] = {}
    for _, op, _ in instructions(sass):
        if op in COUNTED:
            c[op] = c.get(op, 0) + 1
    return c


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("weight,scaled", RMS_VARIANTS)
def test_stock_rmsnorm_sass_fingerprints(weight, scaled, arch, stock):
    _, cubin, _, name = _compile(stock, "rmsnorm", (weight, scaled), arch)
    got = counts(_sass(stock, cubin))
    want = {k: 0 for k in COUNTED} | dict(RMS_SASS[(weight, scaled, arch)])
    want.update({"SHFL.BFLY": 8, "MUFU.RSQ": 1, "F2FP.BF16.F32.PACK_AB": 16})
    got = {k: got.get(k, 0) for k in COUNTED}
    diff = {k: (got[k], want[k]) for k in COUNTED if got[k] != want[k]}
    assert not diff, f"{name} {ARCH_NAMES[arch]} ({stock['versions']}): SASS counts (compiled, expected): {diff}"


# -- 1b. FLA's o-gate (the stock's on sm_90) ----------------------------------------


@pytest.mark.parametrize("heads,t_spec", [(64, "div16"), (8, "any")])
def test_stock_fla_o_gate_trees_are_the_spec(heads, t_spec, stock):
    """H = 64 (TP1; its row counts are all multiples of 16) and H = 8 (TP8,
    the row-count specialization without the hint)."""
    ptx, cubin, params, name = _compile(stock, "fla", (heads, t_spec), 90)
    what = f"{name} sm_90a ({stock['versions']})"
    sass = _sass(stock, cubin)
    # ptxas turns PTX's div.full(S, 64) + eps into one FFMA S, 0.015625, eps:
    ffma = [ops for _, op, ops in instructions(sass) if op == "FFMA" and "0.015625" in ops]
    assert len(ffma) == 1, f"{what}: {len(ffma)} FFMA S, 0.015625, eps in the SASS, not 1"
    t = PX.trace(ptx)

    def fold_div(n):  # the SASS-checked identity, on the compiled side
        if isinstance(n, list):
            return [fold_div(v) for v in n]
        if not isinstance(n, tuple) or n[0] in ("ld", "param", "const", "smem", "reg", "half"):
            return n
        if n[0] == "bfly":
            return ("bfly", n[1], fold_div(n[2]))
        if n[0] == "add":
            for a, b in ((n[1], n[2]), (n[2], n[1])):
                if isinstance(b, tuple) and b[0] == "div.full" and b[2] == ("const", 64.0):
                    return fma(fold_div(b[1]), const(1.0 / 64), fold_div(a))
        return (n[0], *[fold_div(a) for a in n[1:]])

    spec = fla_trees({"x": params["x"], "g": params["g"], "eps": params["eps"]})
    assert sorted(t.calls) == ["div.full", "ex2.approx", "sqrt.approx.ftz"], f"{what}: {sorted(t.calls)}"
    _check(f"{what}: sqrt.approx.ftz's argument", fold_div(t.calls["sqrt.approx.ftz"][0][0]), spec["v"])
    _check(f"{what}: the stored rstd", fold_div(t.shared_stores[0]), spec["rstd"])
    outs = [v for param, vals in t.global_stores if param == params["y"] for v in vals]
    assert len(outs) == 2, f"{what}: {len(outs)} stored words"
    for i, (got, want) in enumerate(zip(outs, spec["out"])):
        _check(f"{what}: stored word {i}", fold_div(got), want)
    got = counts(sass)
    want = {"FMUL": 34, "FFMA": 3, "FADD": 9, "SHFL.BFLY": 4, "MUFU.SQRT": 1, "MUFU.RCP": 5, "MUFU.EX2": 4,
            "F2FP.BF16.F32.PACK_AB": 2}
    diff = {k: (got.get(k, 0), v) for k, v in want.items() if got.get(k, 0) != v}
    assert not diff, f"{what}: SASS counts (compiled, notes): {diff}"


def test_stock_fla_o_gate_on_sm_100a_is_not_the_stock_path(stock):
    """On sm_100 the stock runs FlashInfer's kernel for head 64
    (``layers.o_gate(arch="sm_100a")``), not FLA's: FLA compiled for sm_100a
    sums ``(x0^2 + x2^2) + (x1^2 + x3^2)`` (the notes), which is not the
    spec's FLA tree. Checked so a change there is seen."""
    ptx, _, params, name = _compile(stock, "fla", (64, "div16"), 100)
    t = PX.trace(ptx)
    x = [bf16_leaf(params["x"], k) for k in range(4)]
    q = [mul(v, v) for v in x]
    lane = add(add(q[0], q[2]), add(q[1], q[3]))
    got = t.calls["sqrt.approx.ftz"][0][0]
    s = next(a for a in (got[1], got[2]) if a[0] == "div.full")[1]
    _check(f"{name} sm_100a: the lane sum", s, butterfly(lane, fold_offsets(16)))


# -- 3. vLLM's CUDA kernels (SASS) ---------------------------------------------------

# The QK kernel's one-head-per-8-lanes instance (N = 1: what the stock host picks at decode sizes)
# with the FP32 table (every layer but the first) and the BF16 one (layer 0, after the context store).
SO_LABELS = ["qknorm_rope_kv_cs-fp32_hd64_n1_rope1_ins1", "qknorm_rope_kv_cs-bf16_hd64_n1_rope1_ins1",
             "silu_and_mul_bf16_vec16B", "silu_and_mul_bf16_vec32B", "rotary_bf16_cs-bf16_gptj"]


@pytest.fixture(scope="module")
def so_sass(stock):
    """label -> arch -> the SASS of that kernel, from vLLM's library."""
    C = stock["C"]
    out: dict = {}
    for arch, _name, data, hits in C.so_cubins(stock["so"], [90, 100], stock["cuobjdump"], labels=SO_LABELS):
        for label, mangled in hits.items():
            out.setdefault(label, {})[arch] = _sass(stock, data, mangled.decode())
    missing = [(lab, a) for lab in SO_LABELS for a in (90, 100) if a not in out.get(lab, {})]
    assert not missing, f"kernels not found in {stock['so']}: {missing}"
    return out


def _writes(operands: list[str]) -> str:
    return operands[0] if operands else ""


def qk_norm_pattern(sass: str) -> list[str]:
    """What of the fused QK-norm's documented arithmetic is missing (empty:
    all there): the sequential chain ``acc = FFMA e, e, acc`` from RZ (8),
    SHFL.BFLY 4, 2, 1 each with its FADD, ``FFMA S, 0.015625, eps``, rsqrtf
    (FSETP |v| < 2^-126, FMUL 2^24, MUFU.RSQ, FMUL 4096), 8 FMUL by the
    root, the RoPE's 8 FMUL and 8 FFMA (4 with a negated addend), 4 BF16
    packs, in that order."""
    ins = instructions(sass)
    problems = []
    start = next((i for i, (_, op, o) in enumerate(ins)
                  if op == "FFMA" and len(o) == 4 and o[1] == o[2] and o[3] == "RZ"), None)
    if start is None:
        return ["no chain start FFMA e, e, RZ"]
    acc, chain, i = _writes(ins[start][2]), 1, start + 1
    while i < len(ins) and chain < 8:
        _, op, o = ins[i]
        if op == "FFMA" and len(o) == 4 and o[1] == o[2] and o[3] == acc:
            acc, chain = o[0], chain + 1
        elif _writes(o) == acc and op not in ("BRA",):
            break
        i += 1
    if chain != 8:
        problems.append(f"an FFMA chain of {chain}, not 8")
    rest = ins[i:]
    shfl = [o[3] for _, op, o in rest if op == "SHFL.BFLY"][:3]
    if shfl != ["0x4", "0x2", "0x1"]:
        problems.append(f"butterfly offsets {shfl}, not 0x4, 0x2, 0x1")
    ops = [op for _, op, _ in rest]
    try:
        eps = next(k for k, (_, op, o) in enumerate(rest) if op == "FFMA" and o[2] == "0.015625")
        rsq = ops.index("MUFU.RSQ", eps)
    except (StopIteration, ValueError):
        return problems + ["no FFMA S, 0.015625, eps followed by MUFU.RSQ"]
    pre = rest[eps:rsq]
    if not any(op == "FSETP.GEU.AND" and "1.175494350822287508e-38" in o for _, op, o in pre):
        problems.append("no subnormal test before MUFU.RSQ (rsqrtf's non-ftz form)")
    if not any(op == "FMUL" and p and o[-1] == "16777216" for p, op, o in pre):
        problems.append("no predicated FMUL 2^24 before MUFU.RSQ")
    pack = ops.index("F2FP.BF16.F32.PACK_AB", rsq)
    window = rest[rsq + 1:pack]
    if not any(op == "FMUL" and p and o[-1] == "4096" for p, op, o in window):
        problems.append("no predicated FMUL 4096 after MUFU.RSQ")
    fmul = sum(1 for p, op, _ in window if op == "FMUL" and not p)
    neg = sum(1 for _, op, o in window if op == "FFMA" and len(o) == 4 and o[3].startswith("-"))
    plain = sum(1 for _, op, o in window if op == "FFMA" and len(o) == 4 and not o[3].startswith("-"))
    if (fmul, neg, plain) != (16, 4, 4):
        problems.append(f"between MUFU.RSQ and the packs: {fmul} FMUL, {neg} FFMA -R, {plain} FFMA "
                        f"(want 16 = 8 x*r + 8 RoPE products, 4 x' = fma(c, x, -s y), 4 y' = fma(s, x, c y))")
    packs = sum(1 for _, op, _ in rest[pack:pack + 8] if op == "F2FP.BF16.F32.PACK_AB")
    if packs != 4:
        problems.append(f"{packs} BF16 packs, not 4 (one rounding of the 8 values)")
    if ops.count("MUFU.RSQ") != 1:
        problems.append(f"{ops.count('MUFU.RSQ')} MUFU.RSQ")
    return problems


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("label", SO_LABELS[:2])
def test_stock_qk_norm_rope_sass(label, arch, so_sass, stock):
    problems = qk_norm_pattern(so_sass[label][arch])
    assert not problems, f"{label} sm_{arch} ({stock['versions']}): {problems}"


@pytest.mark.parametrize("label,n,arch", [("silu_and_mul_bf16_vec16B", 8, 90), ("silu_and_mul_bf16_vec16B", 8, 100),
                                          ("silu_and_mul_bf16_vec32B", 16, 100)])
def test_stock_act_and_mul_sass(label, n, arch, so_sass, stock):
    """Per thread, ``n`` elements: CUDA's accurate expf (FFMA.SAT, FFMA.RM
    with 12582913, FADD -12583039, FFMAs with log2(e)'s two parts, MUFU.EX2),
    ``den = FFMA scale, p, 1``, an IEEE division (MUFU.RCP, FCHK; its slow
    path, a subroutine after the kernel's EXIT, not counted), ``up +
    up_offset`` (FADD with the constant bank: ``up + 0.0``). The 32-byte
    instance runs on sm_100 only (the host takes it for major > 9)."""
    ins = main_body(instructions(so_sass[label][arch]))
    ops = [op for _, op, _ in ins]
    text = [" ".join(o) for _, _, o in ins]
    found = {
        "FFMA.SAT": ops.count("FFMA.SAT"),
        "FFMA.RM 12582913": sum(1 for (_, op, o) in ins if op == "FFMA.RM" and o[-1] == "12582913"),
        "FADD -12583039": sum(1 for (_, op, o) in ins if op == "FADD" and o[-1] == "-12583039"),
        "log2e hi": sum(1 for t in text if "1.4426950216293334961" in t),
        "log2e lo": sum(1 for t in text if "1.925963033500011079e-08" in t),
        "MUFU.EX2": ops.count("MUFU.EX2"),
        "FFMA scale, p, 1": sum(1 for (_, op, o) in ins if op == "FFMA" and o[-1] == "1"
                                and not any(a.startswith("-") for a in o[1:3])),
        "FCHK": ops.count("FCHK"),
        "FADD up, up_offset": sum(1 for (_, op, o) in ins if op == "FADD" and o[-1].startswith(("UR", "c["))),
    }
    bad = {k: v for k, v in found.items() if v != n}
    assert not bad, f"{label} sm_{arch} ({stock['versions']}): expected {n} of each, got {bad}"
    assert ops.count("MUFU.RCP") >= n and "MUFU.EX2.FTZ" not in ops


@pytest.mark.parametrize("arch", [90, 100])
def test_stock_context_rotary_sass(arch, so_sass, stock):
    """``rotary_embedding_kernel<bf16, bf16, false>``: per pair two FMUL and
    two FFMA, one with a negated addend (``x' = fma(c, x, -RN(s y))``, ``y' =
    fma(s, x, RN(c y))``), each result packed to BF16 alone."""
    ins = instructions(so_sass["rotary_bf16_cs-bf16_gptj"][arch])
    ffma = [o for _, op, o in ins if op == "FFMA"]
    neg = [o for o in ffma if len(o) == 4 and o[3].startswith("-")]
    packs = [o for _, op, o in ins if op == "F2FP.BF16.F32.PACK_AB"]
    fmul = [o for _, op, o in ins if op == "FMUL"]
    what = f"rotary sm_{arch} ({stock['versions']})"
    assert ffma and len(neg) * 2 == len(ffma), f"{what}: {len(neg)} of {len(ffma)} FFMA negate their addend"
    assert len(fmul) == len(ffma) and len(packs) == len(ffma), f"{what}: FMUL {len(fmul)}, packs {len(packs)}"
    assert all(o[1] == "RZ" for o in packs), f"{what}: each value is packed alone"
