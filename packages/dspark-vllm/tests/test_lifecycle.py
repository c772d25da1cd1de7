"""The plugin's draft class driven through vLLM 0.33.0's own sequence for a
DSpark draft, step by step as vLLM's model runner and speculator run it,
with vLLM's objects, on the CPU:

1. construction and load: ``GPUModelRunner.load_model`` ->
   ``DSparkSpeculator.load_draft_model`` -> ``load_dspark_model`` ->
   ``get_model`` (the registry's class, ``load_weights``, then the loader's
   ``process_weights_after_loading``, which builds the decode);
2. the memory-profiling run: ``GPUModelRunner.profile_run`` ->
   ``_dummy_run(skip_attn=True, is_profile=True)`` ->
   ``DFlashSpeculator.propose(dummy_run=True, skip_attn_for_dummy_run=True)``:
   ``precompute_and_store_context_kv`` without slots, then
   ``_generate_draft`` -> ``_run_model`` under ``set_forward_context(None,
   ...)`` with no KV cache bound: vLLM's stock forward, no kernel launched;
3. the minimal cache bind of ``cudagraph_utils.
   _init_minimal_kv_cache_for_profiling`` (``min(max_num_reqs,
   max_cudagraph_capture_size)`` blocks, ``create_kv_cache_views`` and each
   layer's ``bind_kv_cache``), then the profiling capture
   (``profile_cudagraph_memory`` -> ``capture_model(profile_only=True)`` ->
   ``DFlashSpeculator.capture``): context slots set to ``PAD_SLOT_ID``, and
   per descriptor ``DFlashCudaGraphManager.capture``'s warmup and capture
   forwards (``_prepare_dflash_inputs_to_capture``: ``InputBatch.make_dummy``
   queries, zeroed block tables, ``get_dummy_slot_mappings``' PAD slots;
   ``_prepare_graph_forward``'s context K/V store over PAD slots;
   ``_run_model`` with the built attention metadata): fused, vLLM's bits,
   nothing written into the cache;
4. the teardown (``_teardown_profiling_state`` -> ``clear_layer_kv_caches``:
   every layer's ``kv_cache`` an empty tensor);
5. the real bind, its warmup and capture forwards, then real steps (context
   K/V at real slots, a query block of requests x N rows): fused and equal to
   vLLM's forward and cache, bit for bit.

The row counts are vLLM's own: for N = 3..8 speculative tokens, the sizes
``DFlashCudaGraphManager`` (vLLM's ``CudaGraphManager._init_candidates``
with ``decode_query_len = DSparkSpeculator.num_query_per_req = N``) captures
from the capture sizes ``VllmConfig._set_cudagraph_sizes`` gives a GPU
deployment (``max_num_seqs`` 256: up to 512 rows). The plugin takes every
one (a capture-mode forward of each, recorded), and runs a spread of them
against vLLM's forward (512 rows at N = 8, 3 at N = 3, one each at N =
4..7: a CPU runs the draft's BF16 GEMMs slowly, about 5 s a 512-row step).

Stand-ins: the kernels are ``_stubs`` (vLLM's stock ops behind the kernel
contract), vLLM's CUDA-only ops ``_draft``'s CPU patches, the attention
metadata the reference attention's (query starts, sequence lengths, block
table: what ``build_attn_metadata`` gives FlashAttention, in the test
backend's form), and no CUDA graph is recorded (a CPU has none): the
capture forward is the forward ``torch.cuda.graph`` would record.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest

pytest.importorskip("vllm")

import _draft  # noqa: E402
import _stubs  # noqa: E402
import torch  # noqa: E402
from test_executor import _specialized  # noqa: E402

from dspark_core.planner import policy  # noqa: E402

SEED = int(os.environ.get("DSPARK_SEED") or time.time_ns() % (2**31 - 1))
MAX_NUM_SEQS = 256  # enough requests for every capture size up to 512 rows
PAD = -1  # vLLM's PAD_SLOT_ID (checked below)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from dspark_vllm.plugin import register

    register()
    return _draft.checkpoint_dir(tmp_path_factory, "lifecycle")


def captured_rows(config, n: int) -> list[int]:
    """The draft step sizes vLLM captures at ``n`` speculative tokens (module docstring)."""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    config.speculative_config.num_speculative_tokens = n
    config.model_config.enforce_eager = False
    config.scheduler_config.max_num_seqs = MAX_NUM_SEQS
    config.scheduler_config.max_num_batched_tokens = 8192
    cc = config.compilation_config
    cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    cc.max_cudagraph_capture_size = cc.cudagraph_capture_sizes = None
    config._set_cudagraph_sizes()
    platform = type(current_platform)
    saved = platform._global_graph_pool
    platform._global_graph_pool = object()  # the CPU platform has no graph pool to hand out
    try:
        manager = CudaGraphManager(config, torch.device("cpu"), CUDAGraphMode.FULL_DECODE_ONLY, decode_query_len=n)
    finally:
        platform._global_graph_pool = saved
    return sorted(d.num_tokens for d in manager._capture_descs[CUDAGraphMode.FULL])


@pytest.fixture(scope="module")
def sizes(dirs):
    from vllm.config import CompilationConfig

    found = {}
    for n in range(3, 9):
        config = _draft.vllm_config(*dirs[:2], "auto")
        _draft.init_dist(config)
        config.compilation_config = CompilationConfig()
        found[n] = captured_rows(config, n)
    return found


def test_vllm_captures_draft_steps_of_up_to_512_rows(sizes):
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    assert PAD_SLOT_ID == PAD
    for n, rows in sizes.items():
        assert rows[0] == n and all(r % n == 0 for r in rows) and 480 <= rows[-1] <= 512, (n, rows)
    assert sizes[4][-1] == sizes[8][-1] == 512 and sizes[3][-1] == 498


def _context(model, config, rows: int, slots: torch.Tensor | None, metadata):
    from vllm.forward_context import BatchDescriptor, set_forward_context

    names = model.get_draft_kv_cache_layer_names()
    return set_forward_context(None if metadata is None else {n: metadata for n in names}, config,
                               num_tokens=rows, batch_descriptor=BatchDescriptor(num_tokens=rows),
                               slot_mapping=None if slots is None else {n: slots for n in names})


def _capture_forward(model, config, n: int, rows: int, states: torch.Tensor) -> torch.Tensor:
    """One warmup or capture forward of ``rows`` rows at ``n`` tokens a
    request, as ``DFlashCudaGraphManager.capture`` runs it (module docstring):
    the context store over PAD slots, then the dummy queries (ids and
    positions zero, one query block of ``n`` a request, sequence length
    ``n``, block table zeros: the null block, PAD slots)."""
    reqs = rows // n
    contexts = min(reqs * (n + 1), states.shape[0])
    with torch.inference_mode():
        model.precompute_and_store_context_kv(states[:contexts], torch.zeros(contexts, dtype=torch.int64),
                                              torch.full((contexts,), PAD, dtype=torch.int64))
        metadata = {"query_start_loc": [r * n for r in range(reqs + 1)], "seq_lens": [n] * reqs,
                    "block_table": torch.zeros(reqs, 1, dtype=torch.int64)}
        with _context(model, config, rows, torch.full((rows,), PAD, dtype=torch.int64), metadata):
            return model(input_ids=torch.zeros(rows, dtype=torch.int64),
                         positions=torch.zeros(rows, dtype=torch.int64), inputs_embeds=None)


def _real_step(model, config, n: int, reqs: int, ctx: int, states: torch.Tensor, anchors: torch.Tensor):
    """A real draft step: each request's ``ctx`` context rows stored at its
    slots (its own blocks after the null block), then its query block of
    ``n`` rows (the anchor, then the mask token) at the positions after."""
    bs = _draft.BLOCK
    per = -(-(ctx + n) // bs)
    table = torch.arange(1, 1 + reqs * per, dtype=torch.int64).view(reqs, per)

    def slots(r, positions):
        return table[r][positions // bs] * bs + positions % bs

    ctx_pos = torch.arange(ctx).repeat(reqs)
    ctx_slots = torch.cat([slots(r, torch.arange(ctx)) for r in range(reqs)])
    q_pos = torch.arange(ctx, ctx + n).repeat(reqs)
    q_slots = torch.cat([slots(r, torch.arange(ctx, ctx + n)) for r in range(reqs)])
    ids = torch.full((reqs, n), _draft.MASK_ID, dtype=torch.int64)
    ids[:, 0] = anchors[:reqs]
    metadata = {"query_start_loc": [r * n for r in range(reqs + 1)], "seq_lens": [ctx + n] * reqs,
                "block_table": table}
    with torch.inference_mode():
        model.precompute_and_store_context_kv(states[: reqs * ctx], ctx_pos, ctx_slots)
        with _context(model, config, reqs * n, q_slots, metadata):
            return model(input_ids=ids.flatten(), positions=q_pos, inputs_embeds=None)


def _bind(built, blocks: int):
    return [c for c in _draft.kv_caches(built.model, built.config, num_blocks=blocks)]


def _same(got, want, what):
    assert torch.equal(got, want), (what, (got.float() - want.float()).abs().max())


def _kinds():
    kinds = [c[0] for c in _stubs.CALLS]
    _stubs.CALLS.clear()
    return {k: kinds.count(k) for k in set(kinds)}


STEP = {"row_norm": 1, "boundary": 4, "qkv_epilogue": 2, "o_gate": 2, "mlp_activation": 2}


def test_vllms_sequence_from_load_to_captured_steps(dirs, sizes):
    print(f"DSPARK_SEED={SEED}")
    gen = torch.Generator().manual_seed(SEED)
    with pytest.MonkeyPatch.context() as mp:
        ours = _specialized(dirs, mp, policy.ALL_KERNELS)
    stock = _draft.build(*dirs, "auto")
    model = ours.model
    # 1. Built at load, every kernel bound and compiled; every captured size taken.
    assert model.dspark.decode is not None and model.dspark.max_rows >= 512
    hidden = _draft.HIDDEN
    states = model.combine_hidden_states(torch.randn(4096, hidden * 2, generator=gen))
    anchors = torch.randint(0, _draft.VOCAB - 1, (MAX_NUM_SEQS,), generator=gen)

    # 2. The memory-profiling run: no slots, no metadata, no cache bound: vLLM's forward, no kernel.
    assert all(a.kv_cache.numel() == 0 for a in model.model._attn_layers)
    _stubs.CALLS.clear()
    outs = []
    for built in (ours, stock):
        with torch.inference_mode():
            built.model.precompute_and_store_context_kv(states[:40], torch.arange(40))
            with _context(built.model, built.config, 32, None, None):
                outs.append(built.model(input_ids=torch.zeros(32, dtype=torch.int64),
                                        positions=torch.arange(32), inputs_embeds=None))
    assert _stubs.CALLS == []
    _same(*outs, "the profiling run")

    # 3. The minimal bind and the profiling capture (warmup, then capture), fused, vLLM's bits.
    minimal = min(MAX_NUM_SEQS, 512)
    caches = [_bind(ours, minimal), _bind(stock, minimal)]
    for rows in (sizes[4][6],):
        for _phase in ("warmup", "capture"):
            got = _capture_forward(model, ours.config, 4, rows, states)
            assert _kinds() == {"context_chain": 1, **STEP}, rows
            _same(got, _capture_forward(stock.model, stock.config, 4, rows, states), f"capture of {rows} rows")
    assert all(not c.any() for c in caches[0]) and all(not c.any() for c in caches[1])  # PAD slots wrote nothing

    # 4. The teardown to empty tensors.
    from vllm.v1.worker.utils import clear_layer_kv_caches

    for built in (ours, stock):
        clear_layer_kv_caches(built.model.modules())
    assert all(a.kv_cache.numel() == 0 for a in model.model._attn_layers)
    with torch.inference_mode():
        assert model.dspark.store_context(states[:4], torch.arange(4), torch.arange(4)) is False

    # 5. The real bind: capture forwards for a spread of vLLM's sizes at every N, then real steps.
    blocks = 1 + MAX_NUM_SEQS * 2
    caches = [_bind(ours, blocks), _bind(stock, blocks)]
    for n, rows_list in sizes.items():
        for rows in {3: (rows_list[0],), 8: (rows_list[-1],)}.get(n, (rows_list[len(rows_list) // 8],)):
            got = _capture_forward(model, ours.config, n, rows, states)
            assert _kinds() == {"context_chain": 1, **STEP}, (n, rows)
            _same(got, _capture_forward(stock.model, stock.config, n, rows, states), f"N={n}, {rows} rows")
    assert all(not c.any() for c in caches[0])
    for n, reqs, ctx in ((8, 16, 9), (3, 21, 5), (5, 3, 20)):
        got = _real_step(model, ours.config, n, reqs, ctx, states, anchors)
        assert _kinds() == {"context_chain": 1, **STEP}, (n, reqs)
        _same(got, _real_step(stock.model, stock.config, n, reqs, ctx, states, anchors), f"N={n}, {reqs} requests")
        for a, b in zip(*caches):
            _same(a, b, f"the KV cache after N={n}, {reqs} requests")
    assert any(c.any() for c in caches[0])


def test_every_size_vllm_captures_runs_fused(dirs, sizes):
    """Each (N, rows) vLLM captures, N = 3..8: the plugin's forward takes it
    (the decode's run is recorded, not computed: the sizes' arithmetic is
    the other test's)."""
    with pytest.MonkeyPatch.context() as mp:
        built = _specialized(dirs, mp, policy.ALL_KERNELS)
    model = built.model
    taken = []
    with contextlib.ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        mp.setattr(model.dspark.decode, "run", lambda hidden, positions: taken.append(positions.shape[0]) or hidden)
        _bind(built, 2)
        for rows in (r for rows_list in sizes.values() for r in rows_list):
            metadata = {"query_start_loc": [0, rows], "seq_lens": [rows], "block_table": torch.zeros(1, 1)}
            zeros = torch.zeros(rows, dtype=torch.int64)
            with torch.inference_mode(), _context(model, built.config, rows, torch.full((rows,), PAD), metadata):
                model(input_ids=zeros, positions=zeros, inputs_embeds=None)
    assert taken == [r for rows in sizes.values() for r in rows]
    assert sum(len(rows) for rows in sizes.values()) > 250 and max(taken) == 512
