"""vLLM 0.33.0's Triton unified attention (the TRITON_ATTN backend's
``kernel_unified_attention`` and ``reduce_segments``), the binaries
``scripts/stock/compile_stock.py --parts attention`` builds with Triton 3.8.0
and ``launch_stock.unified_attention`` launches as vLLM's host would for the
draft's decode (2D, or the split-softmax 3D kernel and the reduction),
against dspark-core's spec attention (``dspark_core.spec.attention.
paged_attention``) on the same operands.

Bit equality is not expected, and not asserted in general: the two compute
softmax(q . k / 8) @ V differently. The Triton kernel takes the scores from a
BF16 tensor-core product with FP32 accumulation, runs an online softmax over
tiles of 16 or 32 slots (``exp`` as ``ex2.approx`` of a scaled argument),
rounds each weight ``p_j`` to BF16 before the ``P @ V`` tensor-core product
while summing the unrounded FP32 ``p_j`` into the denominator, divides with
``div.full.f32`` and, on the 3D path, merges 16 segments' partials; the spec
sums exact FP32 terms in 128 fixed lanes and divides once (IEEE). The bound
asserted follows from that: with ``u = 2^-8`` (the BF16 unit roundoff) and
``V`` the largest ``|v|`` over the row's valid slots of its KV head, the
Triton result before its final rounding is within ``u V`` of the exact
softmax average (the weights' BF16 rounding, each ``|dp_j| <= u p_j``, over a
denominator of the unrounded weights), the spec's within ``u |o|`` after
rounding, each output rounding adds ``u |o|``; the FP32 rest (scores,
``exp``, rescaling, division) stays far below ``2^-12 V``. So ``|triton -
spec| <= u V + u (|triton| + |spec|) + 2^-12 V`` elementwise, which is
asserted, together with a bound on the median error that a wrong mask or a
missed page would break.

Exact equality is asserted where the arithmetic is trivially exact: every
request one query token over one cached slot (its own), so the one weight is
``exp(0) = 1`` on both sides, the Triton denominator 1 and the output the V
row itself, bit for bit, on the 2D and the 3D path.

GPU (marker ``gpu``, an sm_90 device; a skip with the reason where
``.device/stock`` lacks the attention): the benchmark's shapes (64 heads
over 8 KV heads of 64, KV block 16; requests x N from 1 x 1 to 128 x 4,
so both paths and every compiled specialization of the reference draft's
rows run), 0 to 300 cached tokens, random page order, the LBHNC and LBNHC
cache layouts, q a row-strided view of a QKV-like output (as vLLM's
``Attention.forward`` hands it over) and contiguous; the TP shards' heads.
CPU: ``paged_metadata`` on the spec's operands and its refusals, the
launcher's refusals, the manifest's entries, the launches packed for the
benchmark's shapes against the compiled jsons, and (in vLLM's venv,
``.nox/tests-vllm``) the launcher's plan, variant names and every argument
value against vLLM's own ``unified_attention`` host code run on the CPU with
its kernels recorded (``compile_stock.record_unified_attention``).

Fresh seeded random data: the seed is printed (repeat with DSPARK_SEED).
Run: ``python -m pytest -q packages/dspark-cute/tests/test_gpu_triton_attention_stock.py``
(on the device: ``source .device/env.sh`` first, carry ``.device/stock``)."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import struct

import pytest
import torch
from cute_testing import requires_cuda
from stock import load_compile_stock, stock_dir, stock_manifest, stock_part_or_skip

from dspark_core.demo_stock import load_script
from dspark_core.spec.attention import paged_attention
from dspark_core.spec.layers import PagedKVCache

BF16 = torch.bfloat16
D, BS = 64, 16  # the reference draft's head size and KV block (DraftConfig)
U = 2.0 ** -8  # BF16's unit roundoff


def attention_manifest() -> list[dict] | None:
    return stock_manifest("unified_attention")


def stock_attention_or_skip():
    return stock_part_or_skip("unified_attention", "unified attention", "attention")


def load_launcher():
    return load_script("launch_stock")


def step_slots(requests: int, n: int, context: int, block_size: int = BS, gen=None, shuffle: bool = False):
    """The draft step's ``attn_slots`` (``stock_step.StepBatch``'s form):
    request r's query token k attends slots of positions ``0 .. context +
    k``, -1 past them; its pages whole blocks, in order or shuffled.
    Returns ``(attn_slots int64 [R n, context + n], number of pages)``."""
    span = context + n
    per = -(-span // block_size)
    pages = torch.randperm(requests * per, generator=gen) if shuffle else torch.arange(requests * per)
    pages = pages.view(requests, per)
    j = torch.arange(span)
    slots = pages[:, j // block_size] * block_size + j % block_size  # [R, span]
    rows = slots[:, None, :].expand(requests, n, span).clone()
    rows[j[None, None, :].expand_as(rows) > (context + torch.arange(n))[None, :, None]] = -1
    return rows.reshape(requests * n, span), requests * per


# ---------------------------------------------------------------- CPU
def test_paged_metadata_of_the_step():
    """The step's slots give vLLM's metadata: N-token requests, seq_len =
    context + N, the pages in the given order, the table padded with zeros."""
    ls = load_launcher()
    gen = torch.Generator().manual_seed(0)
    slots, pages = step_slots(3, 4, 29, gen=gen, shuffle=True)
    meta = ls.paged_metadata(slots, BS, table_width=8)
    assert meta["cu_seqlens_q"].tolist() == [0, 4, 8, 12] and meta["seqused_k"].tolist() == [33] * 3
    assert meta["max_seqlen_q"] == 4 and meta["max_seqlen_k"] == 33
    table = meta["block_table"]
    assert table.dtype == torch.int32 and table.shape == (3, 8) and (table[:, 3:] == 0).all()
    last = slots.view(3, 4, -1)[:, -1]
    assert torch.equal(table[:, :3].long(), last[:, ::BS] // BS)
    one = ls.paged_metadata(step_slots(1, 1, 5)[0], BS)
    assert one["cu_seqlens_q"].tolist() == [0, 1] and one["block_table"].shape == (1, 1)


def test_paged_metadata_refusals():
    ls = load_launcher()
    slots, _ = step_slots(2, 2, 20)
    holed = slots.clone()
    holed[0, 3] = -1
    with pytest.raises(ValueError, match="prefix"):
        ls.paged_metadata(holed, BS)
    split = slots.clone()
    split[:, 5] += 1  # slot 5 off its page's row
    with pytest.raises(ValueError, match="whole pages"):
        ls.paged_metadata(split, BS)
    with pytest.raises(ValueError, match="table_width"):
        ls.paged_metadata(slots, BS, table_width=1)


def launch_args(requests: int, n: int, context: int, heads: int = 64, kv_heads: int = 8, strided_q: bool = True,
                device="cpu", layout: str = "LBHNC", n_spec: int = 4, gen=None, shuffle: bool = False):
    """``unified_attention``'s arguments for one draft step (the benchmark's
    form: ``TritonAttention``) over a fresh cache; returns ``(args dict,
    cache, attn_slots)``."""
    ls = load_launcher()
    slots, pages = step_slots(requests, n, context, gen=gen, shuffle=shuffle)
    m = requests * n
    cache = PagedKVCache(pages + 1, kv_heads, BS, D, device, layout)
    if strided_q:  # the QKV projection's rows [q | k | v | o-gate], q a row-strided view
        q = torch.zeros(m, 2 * heads * D + 2 * kv_heads * D, dtype=BF16, device=device)[:, :heads * D]
        q = q.view(m, heads, D)
    else:
        q = torch.zeros(m, heads, D, dtype=BF16, device=device)
    meta = ls.paged_metadata(slots.to(device), BS, table_width=512)
    key_cache, value_cache = cache.tensor.transpose(1, 2).split(D, dim=-1)
    scale = torch.ones((), dtype=torch.float32, device=device).expand(requests, kv_heads)
    args = dict(q=q, k=key_cache, v=value_cache, out=torch.empty(m, heads, D, dtype=BF16, device=device),
                cu_seqlens_q=meta["cu_seqlens_q"], max_seqlen_q=meta["max_seqlen_q"], seqused_k=meta["seqused_k"],
                max_seqlen_k=meta["max_seqlen_k"], softmax_scale=D ** -0.5, causal=True, window_size=(-1, -1),
                block_table=meta["block_table"], softcap=0, q_descale=None, k_descale=scale, v_descale=scale,
                **ls.unified_attention_scratch(heads, kv_heads, D, n_spec, device))
    return args, cache, slots.to(device)


def test_launcher_refusals():
    """What was not compiled is refused, with the reason, before the driver."""
    ls = load_launcher()
    args, _, _ = launch_args(2, 4, 20)
    for change, error, match in ((dict(causal=False), ValueError, "causal"),
                                 (dict(window_size=(127, 0)), ValueError, "window"),
                                 (dict(softcap=0.0), TypeError, "int 0"),
                                 (dict(q=args["q"].float()), TypeError, "q must be"),
                                 (dict(seqused_k=args["seqused_k"].long()), TypeError, "seqused_k must be")):
        with pytest.raises(error, match=match):
            ls.unified_attention_launches(**dict(args, **change))


# The benchmark's steps (m = requests x N, N = 4; m = 1 one token) and a few more
# shapes; 3D up to 8 requests of 4 tokens (2 q blocks each, 16 at most), 2D above.
BENCH_SHAPES = [(1, 1), (1, 4), (2, 4), (4, 4), (8, 4), (16, 4), (32, 4), (64, 4), (128, 4)]


def test_attention_manifest_entries():
    """Each compiled variant: its cubin's SHA-256, the kernel, 4 warps, the
    draft's constexprs (causal, no window, softcap, sinks or FP8, head 64,
    KV block 16, 8 heads a KV head: BLOCK_M 16, BLOCK_Q 2; 3D: tile 16, 16
    segments; 2D: tile 32), its name the one compile_stock derives from
    them, no scratch memory, under 48 KiB of shared memory."""
    entries = attention_manifest()
    if not entries:
        pytest.skip(f"{stock_dir()} has no unified attention (compile_stock.py --parts attention)")
    cs = load_compile_stock()
    assert {e["arch"] for e in entries} >= {"sm_90a"}
    for e in entries:
        meta = json.loads((stock_dir() / "triton" / e["json"]).read_text())
        cubin = (stock_dir() / "triton" / meta["cubin"]).read_bytes()
        assert hashlib.sha256(cubin).hexdigest() == meta["sha256"]
        c = meta["constexprs"]
        assert meta["threads"] == 128 and meta["global_scratch_size"] == 0 and meta["shared"] <= 48 * 1024
        assert c["HEAD_SIZE"] == D and c["BLOCK_Q"] == 2 and c["NUM_SEGMENTS_PER_SEQ"] in (1, 16)
        ints = cs.UATTN_INTS if meta["kind"] == "uattn" else cs.UREDUCE_INTS
        specs = "".join("1" if k in c else ("D" if k in meta["divisibility_16"] else "x") for k in ints)
        if meta["kind"] == "uattn":
            assert meta["kernel"] == "kernel_unified_attention"
            assert c["USE_CAUSAL"] and not c["SLIDING_WINDOW"] and not c["USE_SOFTCAP"] and not c["USE_SINKS"]
            assert c["KV_QUANT_MODE"] == 0 and not c["USE_FP8"] and c["BLOCK_SIZE"] == BS
            assert c["num_queries_per_kv"] == 8 and c["BLOCK_M"] == 16
            assert c["TILE_SIZE"] == (16 if c["IS_3D"] else 32)
            assert meta["variant"] == cs.uattn_variant_name(c, specs)
        else:
            assert meta["kernel"] == "reduce_segments" and c["TILE_SIZE"] == 16
            assert meta["variant"] == cs.ureduce_variant_name(c, specs)
        names = [p["name"] for p in meta["params"]]
        assert names[-2:] == ["global_scratch", "profile_scratch"]
        offsets = [p["offset"] for p in meta["params"]]
        assert offsets == sorted(offsets) and offsets[-1] + 8 == meta["param_bytes"]


@pytest.mark.parametrize("heads,kv", [(64, 8), (32, 4), (8, 1)])
@pytest.mark.parametrize("requests,n", BENCH_SHAPES)
def test_launches_pack_for_the_benchmark(monkeypatch, requests, n, heads, kv):
    """The launches the benchmark makes, stopped at the driver (CPU tensors,
    ``_arch`` 90): each variant compiled, the path vLLM's rule picks, the
    grids, and every parameter packed at its cubin offset."""
    if not attention_manifest():
        pytest.skip(f"{stock_dir()} has no unified attention (compile_stock.py --parts attention)")
    ls = load_launcher()
    monkeypatch.setattr(ls, "_arch", lambda device: 90)
    monkeypatch.setattr(ls, "_aligned", lambda *ts: None)
    args, _, _ = launch_args(requests, n, 256, heads, kv)
    launches = ls.unified_attention_launches(**args)
    m = requests * n
    threshold = 128 // kv
    is_3d = requests * -(-n // 2) <= threshold
    assert [meta["kind"] for meta, _, _ in launches] == (["uattn", "ureduce"] if is_3d else ["uattn"])
    meta, values, grid = launches[0]
    assert meta["constexprs"]["IS_3D"] == is_3d and meta["arch"] == "sm_90a"
    assert grid == (m // 2 + requests, kv, 16 if is_3d else 1)
    if is_3d:
        assert launches[1][2] == (m, heads, 1)
    for meta, values, _ in launches:
        packed = ls._pack(meta["params"], dict(values, global_scratch=0, profile_scratch=0), meta["param_bytes"])
        for p in meta["params"][:-2]:
            v = values[p["name"]]
            v = v.data_ptr() if isinstance(v, torch.Tensor) else v
            fmt = {"fp32": "<f", "i32": "<i", "i64": "<q"}.get(p["type"], "<Q")
            assert struct.unpack_from(fmt, packed, p["offset"])[0] == v, p["name"]


@pytest.fixture(scope="module")
def tua():
    """vLLM's ``triton_unified_attention`` module with Triton's JIT functions
    (vLLM keeps them only where the visible-device list is explicitly empty
    on a machine without a driver; restored after the module), or a skip."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    try:
        pytest.importorskip("triton", minversion="3.8.0")
        pytest.importorskip("vllm", minversion="0.33.0")
        from vllm.v1.attention.ops import triton_unified_attention as module

        if not hasattr(module.triton, "next_power_of_2"):
            pytest.skip("vLLM was imported with Triton disabled (no driver and CUDA_VISIBLE_DEVICES unset)")
        yield module
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


class _Recorder:
    """A Triton kernel's ``kernel[grid](**kwargs)`` that records ``(name, grid, kwargs)`` in ``calls``."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda **kwargs: self.calls.append((self.name, tuple(grid), kwargs))


def vllm_launches(tua, args: dict) -> list:
    """vLLM's ``unified_attention`` on ``args`` (the rest as
    ``TritonAttentionImpl.forward`` passes them for the draft), its two
    kernels recorded instead of run."""
    from vllm.v1.kv_cache_interface import KVQuantMode

    calls: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tua, "kernel_unified_attention", _Recorder("kernel_unified_attention", calls))
        mp.setattr(tua, "reduce_segments", _Recorder("reduce_segments", calls))
        tua.unified_attention(**args, alibi_slopes=None, use_alibi_sqrt=False, sinks=None, output_scale=None,
                              mm_prefix_range=None, rswa_prefix_lens=None, rswa_window=None,
                              kv_quant_mode=KVQuantMode.NONE, k_scale_cache=None, v_scale_cache=None,
                              chunk_lookback=-1, use_td=False, mm_prefix_clamp_sliding_window=False)
    return calls


def test_plan_names_and_values_are_vllm_hosts(tua):
    """In vLLM's venv: for the draft's heads (and 16 / 32 heads a KV head),
    requests x N from 1 x 1 to 200 x 12 around every switch, and scratch too
    small for the tokens, ``unified_attention_launches`` on the operands
    that vLLM's own ``unified_attention`` is run on (its kernels recorded,
    ``compile_stock.record_unified_attention``'s arguments) makes the same
    launches: the kernels and grids, constexprs that agree, the variant name
    of Triton's JIT specialization of vLLM's arguments, and every runtime
    argument's value (the same tensors' addresses, the same ints and
    floats)."""
    cs, ls = load_compile_stock(), load_launcher()
    params = set(inspect.signature(ls.unified_attention_launches).parameters) - {"root"}
    checked = set()
    for heads, kv in ((64, 8), (32, 4), (8, 1), (64, 4), (64, 2)):
        for requests in (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 200):
            for n in (1, 2, 3, 4, 5, 8, 9, 12):
                for n_spec in (n, 1):
                    args, _, _ = launch_args(requests, n, 37, heads, kv, strided_q=requests % 2 == 0, n_spec=n_spec)
                    calls = vllm_launches(tua, args)
                    with pytest.MonkeyPatch.context() as mp:
                        mp.setattr(ls, "_uattn_meta", lambda prefix, variant, const, device, root: {
                            "kind": prefix[:-1], "variant": variant, "const": const, "shared": 0})
                        launches = ls.unified_attention_launches(**{k: v for k, v in args.items() if k in params})
                    assert len(launches) == len(calls)
                    for (meta, values, grid), (kernel, vgrid, kwargs) in zip(launches, calls):
                        assert meta["kind"] == {"kernel_unified_attention": "uattn", "reduce_segments": "ureduce"}[
                            kernel]
                        assert grid == tuple(vgrid) + (1,) * (3 - len(vgrid)), (kernel, requests, n)
                        sig, const, aligned, warps = cs.jit_specialization(cs._jit(getattr(tua, kernel)), kwargs)
                        assert warps == 4 and all(const[k] == v for k, v in meta["const"].items())
                        ints = cs.UATTN_INTS if meta["kind"] == "uattn" else cs.UREDUCE_INTS
                        name_of = cs.uattn_variant_name if meta["kind"] == "uattn" else cs.ureduce_variant_name
                        assert meta["variant"] == name_of(const, cs._specs(ints, sig, const, aligned))
                        for name in sig:
                            want, got = kwargs[name], values[name]
                            if isinstance(want, torch.Tensor):
                                want, got = want.data_ptr(), got.data_ptr()
                            assert want == got and type(want) is type(got), (name, want, got)
                        checked.add(meta["variant"].split("_")[1] if meta["kind"] == "uattn" else "reduce")
    assert checked == {"2d", "3d", "reduce"}


def test_compiled_cubin_is_the_jits(tua):
    """In vLLM's venv: ``compile_kernel`` with the specialization
    ``jit_specialization`` reads off vLLM's launch (constexprs by name, the
    enum as its int) gives the cubin Triton's JIT itself compiles from that
    launch (its options and constexprs as bound): the carried binary is the
    one vLLM would run. One 3D variant, sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    cs = load_compile_stock()
    (kernel, _, kwargs), _ = cs.record_unified_attention(64, 8, 2, 4)
    fn = cs._jit(getattr(tua, kernel))
    sig, const, aligned, warps = cs.jit_specialization(fn, kwargs)
    ours = cs.compile_kernel(fn, sig, const, aligned, warps, 90).asm["cubin"]
    backend = make_backend(GPUTarget("cuda", 90, 32))
    kw = dict(kwargs, debug=False)
    bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(**kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, options)
    jit = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                         options=options.__dict__).asm["cubin"]
    assert hashlib.sha256(ours).digest() == hashlib.sha256(jit).digest()


# ---------------------------------------------------------------- GPU
def spec_and_triton(ops, requests, n, context, heads=64, kv=8, layout="LBHNC", strided_q=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    args, cache, slots = launch_args(requests, n, context, heads, kv, strided_q, "cuda", layout, gen=gen,
                                     shuffle=True)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen).to(BF16))
    args["q"].copy_(torch.randn(args["q"].shape, generator=gen).to(BF16))
    args["out"].fill_(float("nan"))
    ops.unified_attention(**args)
    want = paged_attention(args["q"].contiguous(), cache, slots, kv)
    return args["out"], want, cache, slots


def triton_bound(got, want, cache, slots, kv):
    """The elementwise bound of the module docstring: ``u V + u (|a| + |b|) + 2^-12 V``."""
    valid = slots >= 0
    _, v = cache.gather(slots.clamp_min(0))  # [m, S, kv, D]
    vmax = torch.where(valid[:, :, None, None], v.float().abs(), 0.0).amax(dim=(1, 3))  # [m, kv]
    vmax = vmax.repeat_interleave(got.shape[1] // kv, dim=1)[:, :, None]
    return (U + 2.0 ** -12) * vmax + U * (got.float().abs() + want.float().abs())


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("context", [0, 3, 256, 300])
@pytest.mark.parametrize("requests,n", BENCH_SHAPES + [(8, 8), (3, 5)])
def test_unified_attention_binary_is_close_to_the_spec(seed, requests, n, context, layout):
    ops = stock_attention_or_skip()
    got, want, cache, slots = spec_and_triton(ops, requests, n, context, layout=layout,
                                              strided_q=(requests + context) % 2 == 0, seed=seed)
    assert not got.isnan().any()
    err = (got.float() - want.float()).abs()
    bound = triton_bound(got, want, cache, slots, 8)
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    # A wrong mask or page would move whole rows by O(V); the rounding noise is a few BF16 ulps.
    assert err.median().item() <= 4 * U * want.float().abs().median().item() + 1e-3
    equal = (got.view(torch.int16) == want.view(torch.int16)).float().mean().item()
    print(f"{requests} x {n} after {context}: max |err| {err.max().item():.3g}, {100 * equal:.1f}% equal bits")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("heads,kv,requests,n", [(32, 4, 8, 4), (32, 4, 32, 4), (8, 1, 64, 4), (8, 1, 128, 4)])
def test_unified_attention_binary_tp_shards(seed, heads, kv, requests, n):
    ops = stock_attention_or_skip()
    got, want, cache, slots = spec_and_triton(ops, requests, n, 256, heads, kv, seed=seed)
    err = (got.float() - want.float()).abs()
    assert (err <= triton_bound(got, want, cache, slots, kv)).all()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("requests", [1, 4, 16, 17, 40])  # 3D up to 16 requests of one token, 2D above
def test_unified_attention_binary_exact_on_one_slot(seed, requests):
    """One query token a request over its own slot only: V's row, bit for
    bit, as the spec gives (module docstring)."""
    ops = stock_attention_or_skip()
    got, want, cache, slots = spec_and_triton(ops, requests, 1, 0, seed=seed)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    _, v = cache.gather(slots[:, 0])  # [m, kv, D]
    assert torch.equal(got.view(requests, 8, 8, D), v[:, :, None, :].expand(requests, 8, 8, D))
