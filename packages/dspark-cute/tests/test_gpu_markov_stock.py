"""The probabilistic Markov step (``MarkovSampleStep`` through
``loop.run_probabilistic_loop``) against vLLM 0.33.0's own probabilistic
loop: ``DSparkSpeculator._sample_sequential`` with ``draft_logits`` set, run
op for op (``stock_probabilistic_loop``: ``markov_embed``, ``markov_bias``'s
``F.linear``, the add, ``apply_output_logit_transform``'s ``float() * M`` and
``C * tanh(x / C)``, the cast into the BF16 scatter buffer and its
``index_copy_`` at ``arange(V) + d2t``, then ``gumbel_sample`` at
``sample_pos - 1`` with the cache column ``_step_cols[i]``) where the
sampler is vLLM's Triton ``_gumbel_sample_kernel`` itself: the binary
``scripts/stock/compile_stock.py --parts gumbel`` builds with Triton 3.8.0
(``.device/stock``, ``stock.py``'s launcher ``stock_gumbel_sample``), then
ATen's argmax over the block maxima and the gather, as vLLM's host does.

GPU (marker ``gpu``, an sm_90 device; a skip with the reason where
``.device/stock`` lacks the Gumbel kernel): tokens and the whole logits
cache bit for bit, the tokens poisoned first; rows at temperature 0 (one of
them the row of planted saturation ties, which then decide the argmax across
1024-column blocks), an inert row (``idx_map`` -1: nothing cached), -inf
rows and half -inf rows; no NaN (vLLM's Triton argmax then depends on its
reduction tree: the stated exception of ``dspark_core.spec.gumbel``); R = 1
(``idx_map[:, i]`` then is the buffer itself, unaligned at odd steps) and up
to 8 steps (the column pointer unaligned at steps other than 0 and 4), so
every compiled alignment variant runs. CPU: the manifest's Gumbel entries
and the launcher's variant names agree with the compiler's.

Fresh seeded random data: the seed is printed (repeat with DSPARK_SEED).
Run: ``python -m pytest -q packages/dspark-cute/tests/test_gpu_markov_stock.py``."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F
from cute_testing import requires_cuda
from stock import load_compile_stock, stock_dir, stock_manifest, stock_part_or_skip
from test_gpu_markov import MULT, check_sampled_loop, make_sample_step, sample_requests

from dspark_core.demo_stock import load_script

BF16 = torch.bfloat16
VOCABS = (202752, 32768, 4096, 512)  # compile_stock's default --gumbel-vocabs


def gumbel_manifest() -> list[dict] | None:
    return stock_manifest("gumbel")


def stock_gumbel_or_skip():
    return stock_part_or_skip("gumbel", "Gumbel sampler", "gumbel")


def stock_probabilistic_loop(ops, base, prev, w1, w2, cap, d2t, idx_map, temperature, seeds, sample_pos, cache,
                             cols, buf):
    """vLLM's probabilistic Markov loop in its own ops with the stock Gumbel binary (module docstring)."""
    r, n, v = base.shape
    out = torch.empty(r, n, dtype=torch.int64, device=base.device)
    scatter = torch.arange(v, device=base.device) + d2t
    for i in range(n):
        logits = base[:, i] + F.linear(F.embedding(prev, w1), w2)[..., :v]
        logits = logits.float() * MULT
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        rows = buf[:r]
        rows.index_copy_(1, scatter, logits.to(rows.dtype))
        out[:, i] = ops.stock_gumbel_sample(rows, idx_map[:, i], temperature, seeds, sample_pos[:, i] - 1, True,
                                            True, logits_cache=cache, logits_cache_col=cols[i])
        prev = out[:, i]
    return out


def planted_base(gen, r, n, vocab, scale=8.0):
    """BF16 ``[r, n, vocab]``: random rows, one all -inf, one half -inf, one with
    four saturating values (soft-cap ties, in different blocks at large V);
    returns it and the flat (row * n + step) index of the tie row."""
    rows = (torch.randn(r * n, vocab, generator=gen, device="cuda") * scale).to(BF16)
    k = r * n
    rows[(k - 1) // 3] = float("-inf")
    rows[(2 * k) // 3, ::2] = float("-inf")
    tie = k - 1
    rows[tie, torch.linspace(0, vocab - 1, 4, device="cuda").long()] = 3e4
    return rows.view(r, n, vocab), tie


SAMPLES = [(1, 8, 384, 512, 30.0), (7, 4, 32000, 202752, 30.0), (64, 3, 32000, 32768, None),
           (3, 8, 2048, 4096, 30.0), (2, 5, 32000, 202752, None)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("r,n,vocab,vt,cap", SAMPLES)
def test_probabilistic_loop_matches_vllm_gumbel_binary(seed, r, n, vocab, vt, cap):
    ops = stock_gumbel_or_skip()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    reqs = 2 * r + 1
    step, w1, w2, m = make_sample_step(gen, vocab, vt, cap)
    base, tie = planted_base(gen, r, n, vocab)
    prev = torch.randint(0, vt, (r,), generator=gen, device="cuda")
    # vLLM's buffers (sample_requests), int32 step columns, the BF16 cache [reqs, N, V_target].
    requests = idx_map, temperature, seeds, sample_pos = sample_requests(gen, r, n, reqs)
    tie_req = int(idx_map[tie // n, 0])
    if tie_req >= 0:
        temperature[tie_req] = 0.0  # plain argmax: the planted ties decide it (first index)
    cols = torch.arange(n, dtype=torch.int32, device="cuda")
    cache = torch.full((reqs, n, vt), 7.0, dtype=BF16, device="cuda")
    want_cache = cache.clone()
    buf = torch.full((reqs, vt), float("-inf"), dtype=BF16, device="cuda")
    want = stock_probabilistic_loop(ops, base, prev, w1, w2, cap, m, *requests, want_cache, cols, buf)
    assert ((want >= 0) & (want < vt)).all(), "the stock loop sampled outside the target vocabulary"
    check_sampled_loop(step, base, prev, w2, requests, cache, want, want_cache)


def load_launcher():
    """``scripts/stock/launch_stock.py`` (``load_script``), binaries or none."""
    return load_script("launch_stock")


def test_launcher_names_the_compiled_variants():
    """For every vocabulary, step count and pointer alignment the compiler
    enumerates, the launcher derives the same variant name from the launch's
    int arguments and addresses; the specializations are Triton's (1, D, x)."""
    cs, ls = load_compile_stock(), load_launcher()
    names = {v[0] for v in cs.gumbel_variants(VOCABS, range(1, 9))}
    seen = set()
    for vocab in VOCABS:
        for n in range(1, 9):
            ints = cs.gumbel_ints(vocab, n)
            for col in (0x1000, 0x1004, 0x1008):
                for idx in (0x2000, 0x2008):
                    name = ls.gumbel_variant(ints, col, idx)
                    assert name == cs.gumbel_variant_name(ints, col % 16 == 0, idx % 16 == 0)
                    seen.add(name)
    assert seen == names
    # 202752 = 198 blocks (neither), 32768 = 32 blocks (a multiple of 16), 512 = 1 block (a constexpr).
    assert {n.split("_")[1] for n in names} == {"xxDDDDD", "DDDDDDD", "11DDDDD"}
    assert cs.gumbel_ints(202752, 4)["logits_cache_stride_0"] == 4 * 202752


def test_gumbel_manifest_entries():
    """Where ``.device/stock`` holds the Gumbel sampler: each manifest entry's
    json names a cubin whose SHA-256 it records, the kernel's runtime
    parameters in vLLM's order (the ints equal to 1 absent: constexprs) with
    cubin offsets, then Triton's two scratch pointers, and no scratch memory."""
    entries = gumbel_manifest()
    if not entries:
        pytest.skip(f"{stock_dir()} has no Gumbel sampler (compile_stock.py --parts gumbel)")
    order = ["local_argmax_ptr", "local_argmax_stride", "local_max_ptr", "local_max_stride", "logits_cache_ptr",
             "logits_cache_stride_0", "logits_cache_stride_1", "logits_cache_col_ptr", "logits_cache_source_ptr",
             "logits_cache_source_stride", "logits_ptr", "logits_stride", "expanded_idx_mapping_ptr", "seeds_ptr",
             "pos_ptr", "temp_ptr", "vocab_size"]
    assert {e["arch"] for e in entries} >= {"sm_90a"}
    for e in entries:
        meta = json.loads((stock_dir() / "triton" / e["json"]).read_text())
        cubin = (stock_dir() / "triton" / meta["cubin"]).read_bytes()
        assert hashlib.sha256(cubin).hexdigest() == meta["sha256"]
        assert meta["kernel"] == "_gumbel_sample_kernel" and meta["threads"] == 128
        const = meta["constexprs"]
        assert const["BLOCK_SIZE"] == 1024 and const["IS_DRAFTING"] and const["APPLY_TEMPERATURE"]
        assert not const["USE_FP64"] and not const["PER_TOKEN_COL"]
        names = [p["name"] for p in meta["params"]]
        assert names == [a for a in order if a not in const] + ["global_scratch", "profile_scratch"]
        offsets = [p["offset"] for p in meta["params"]]
        assert offsets == sorted(offsets) and offsets[-1] + 8 == meta["param_bytes"]
        assert meta["global_scratch_size"] == 0 and meta["profile_scratch_size"] == 0


def test_stock_gumbel_sample_refuses_other_launches():
    """The launcher refuses, with the reason, what was not compiled (no device
    needed: it checks before touching the driver)."""
    ls = load_launcher()
    logits = torch.zeros(2, 512, dtype=BF16)
    i64 = torch.zeros(2, dtype=torch.int64)
    t = torch.zeros(3)
    cache = torch.zeros(3, 2, 512, dtype=BF16)
    col = torch.zeros((), dtype=torch.int32)
    with pytest.raises(ValueError, match="probabilistic launch"):
        ls.stock_gumbel_sample(logits, i64, t, i64, i64, True, True, cache, col, use_fp64=True)
    with pytest.raises(ValueError, match="0-dim int32"):
        ls.stock_gumbel_sample(logits, i64, t, i64, i64, True, True, cache, col.long())
    with pytest.raises(TypeError, match="logits must be torch.bfloat16"):
        ls.stock_gumbel_sample(logits.float(), i64, t, i64, i64, True, True, cache, col)
    with pytest.raises(ValueError, match="at least V wide"):
        ls.stock_gumbel_sample(logits, i64, t, i64, i64, True, True, cache[..., :256], col)



@pytest.mark.parametrize("r,n,step,vt", [(7, 4, 2, 202752), (1, 8, 3, 512), (1, 8, 4, 512), (64, 3, 0, 32768)])
def test_stock_gumbel_sample_packs_the_launch(monkeypatch, r, n, step, vt):
    """The launch the GPU test makes, stopped at the driver (CPU tensors,
    ``_arch`` 90): the variant picked has a compiled json, the grid is ``(R,
    cdiv(V, 1024), 1)``, and every parameter packs at its cubin offset with
    the address or value vLLM's host would pass."""
    if not gumbel_manifest():
        pytest.skip(f"{stock_dir()} has no Gumbel sampler (compile_stock.py --parts gumbel)")
    import struct

    ls = load_launcher()
    calls = []
    monkeypatch.setattr(ls, "_arch", lambda device: 90)
    monkeypatch.setattr(ls, "_aligned", lambda *ts: None)
    monkeypatch.setattr(ls, "_launch_triton", lambda meta, root, values, grid, pdl: calls.append((meta, values, grid)))
    reqs = 2 * r + 1
    buf = torch.full((reqs, vt), float("-inf"), dtype=BF16)
    idx_map = torch.arange(r * n, dtype=torch.int64).view(r, n)
    sample_pos = torch.arange(r * n, dtype=torch.int64).view(r, n)
    cache = torch.zeros(reqs, n, vt, dtype=BF16)
    cols = torch.arange(n, dtype=torch.int32)
    temperature, seeds = torch.ones(reqs), torch.zeros(reqs, dtype=torch.int64)
    ls.stock_gumbel_sample(buf[:r], idx_map[:, step], temperature, seeds, sample_pos[:, step] - 1, True, True,
                           logits_cache=cache, logits_cache_col=cols[step])
    (meta, values, grid), = calls
    nb = -(-vt // 1024)
    assert grid == (r, nb, 1) and meta["arch"] == "sm_90a"
    assert meta["variant"].endswith(f"_col{'a' if step % 4 == 0 else 'u'}_idx{'a' if r > 1 or step % 2 == 0 else 'u'}")
    want = {"logits_cache_ptr": cache.data_ptr(), "logits_cache_col_ptr": cols.data_ptr() + 4 * step,
            "logits_ptr": buf.data_ptr(), "logits_cache_source_ptr": buf.data_ptr(), "seeds_ptr": seeds.data_ptr(),
            "temp_ptr": temperature.data_ptr(), "logits_cache_stride_0": n * vt, "logits_cache_stride_1": vt,
            "logits_cache_source_stride": vt, "logits_stride": vt, "vocab_size": vt, "local_argmax_stride": nb,
            "local_max_stride": nb}
    if r == 1:
        want["expanded_idx_mapping_ptr"] = idx_map.data_ptr() + 8 * step  # idx_map[:, i] itself (contiguous)
    packed = ls._pack(meta["params"], dict(values, global_scratch=0, profile_scratch=0), meta["param_bytes"])
    for p in meta["params"]:
        if p["name"] in want:
            fmt = "<q" if p["size"] == 8 else "<i"
            assert struct.unpack_from(fmt, packed, p["offset"])[0] == want.pop(p["name"]), p["name"]
    assert set(want) <= set(meta["constexprs"])  # only the ints equal to 1 were not runtime parameters
    assert all(meta["constexprs"][k] == 1 for k in want)
