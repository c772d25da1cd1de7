"""Every draft step size vLLM 0.33.0 captures, on one GPU: the reference
draft's ``DraftDecode`` with the plugin's sm_90a kernel set, each step
captured in a CUDA graph with PDL on and replayed on fresh inputs, bit for
bit dspark-core's eager spec path (hidden states and every KV cache).

Row counts (``CAPTURED_ROWS``): for N speculative tokens a draft step has
requests x N rows, padded to a size the draft's ``DFlashCudaGraphManager``
captured: ``CudaGraphManager._init_candidates``
(``vllm/v1/worker/gpu/cudagraph_utils.py``) with ``decode_query_len = N``
(``DSparkSpeculator.num_query_per_req``) over the capture sizes
``VllmConfig._set_cudagraph_sizes`` (``vllm/config/vllm.py``) gives a GPU
deployment of ``max_num_seqs`` 256 and ``max_num_batched_tokens`` 8192
(``FULL_DECODE_ONLY``: the FULL descriptors). The capture sizes are 1, 2,
4, the multiples of 8 below 256 and of 16 from 256 up to the ceiling (512
off sm_100), and the target's uniform decode sizes (N + 1 tokens times a
request count, where they fit); each is rounded up to a multiple of N and
kept where that is at most the ceiling and ``max_num_seqs * N`` (so 12 and
20 at N = 4 come from the target's 10 and 20). The device machine has
no vLLM, so the lists are written out here;
``packages/dspark-vllm/tests/test_gpu_rows_sizes.py`` checks them against
vLLM's own computation (``test_lifecycle.captured_rows``), and the kernel
set against ``dspark_vllm.planning.exact_kernels("sm_90a")``.

A step of R = rows / N requests as vLLM's speculator shapes it: request r
has a context of ``CONTEXT - (r * 5 + shift) % 64`` tokens (a shared prefix
of slots ``0 .. CONTEXT-1``, the rest masked) and N query tokens at the next
positions, written to slots of its own past ``CONTEXT``; token j of it
attends to its context and its query tokens ``0 .. j``. The capture runs on
one step (``shift`` 0, hidden states of one seed), the replay on another
(``shift`` 3, other hidden states with -0.0, a subnormal, 65504 and -3e4),
its static output and every query slot of the caches poisoned with NaN
before the replay. Each graph is dropped after its check (its private pool
freed), as every kernel was compiled once, before the first capture.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from dspark_core.contracts.kernels import kernel_class
from dspark_core.planner import policy
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import DraftConfig
from dspark_core.reference.model import DraftModel, StepInputs
from dspark_core.runtime.build import build_draft_decode
from dspark_core.tools.compare import assert_bitwise
from dspark_core.tools.graphs import StepGraph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nox -s tests-sm90)"),
]

SEED = int(os.environ.get("DSPARK_SEED", time.time_ns() % 2**31))
print(f"DSPARK_SEED={SEED}")

# dspark_vllm.planning.exact_kernels("sm_90a") (checked on the CPU where vLLM is installed).
VLLM_EXACT_SM90 = frozenset({policy.ROW_NORM, policy.BOUNDARY, policy.CONTEXT_CHAIN, policy.QKV_EPILOGUE,
                             policy.O_GATE, policy.MLP_ACTIVATION, policy.ORDERED_GEMM})

# The draft step sizes vLLM 0.33.0 captures at N speculative tokens (module docstring).
CAPTURED_ROWS = {
    3: [3, 6, 9, 18, 24, 33, 42, 48, 57, 66, 72, 81, 90, 96, 105, 114, 120, 129, 138, 144, 153, 162, 168, 177,
        186, 192, 201, 210, 216, 225, 234, 240, 249, 258, 273, 288, 306, 321, 336, 354, 369, 384, 402, 417, 432,
        450, 465, 480, 498],
    4: [4, 8, 12, 16, 20, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152, 160, 168,
        176, 184, 192, 200, 208, 216, 224, 232, 240, 248, 256, 272, 280, 288, 304, 320, 336, 352, 360, 368, 384,
        400, 416, 432, 440, 448, 464, 480, 496, 512],
    8: [8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152, 160, 168, 176, 184,
        192, 200, 208, 216, 224, 232, 240, 248, 256, 272, 288, 304, 320, 336, 352, 360, 368, 384, 400, 416, 432,
        448, 464, 480, 496, 504, 512],
}
CONTEXT = 256  # a multiple of the block size: the query slots are whole blocks past it
MAX_ROWS = 512


def requests_step(rows: int, n: int, shift: int, device="cuda") -> StepInputs:
    """``rows / n`` requests of ``n`` query tokens each (module docstring);
    ``attn_slots`` of width ``CONTEXT + n`` for every shift, so a capture
    and its replay share one shape."""
    if rows % n:
        raise ValueError(f"a step of {rows} rows is not whole requests of {n} tokens")
    r = torch.arange(rows // n).repeat_interleave(n)
    j = torch.arange(n).repeat(rows // n)
    context = CONTEXT - (r * 5 + shift) % 64
    positions = context + j
    slots = CONTEXT + r * n + j
    cols = torch.arange(CONTEXT + n).expand(rows, CONTEXT + n)
    attn = torch.where(cols < CONTEXT, cols, CONTEXT + r[:, None] * n + cols - CONTEXT)
    valid = torch.where(cols < CONTEXT, cols < context[:, None], cols - CONTEXT <= j[:, None])
    attn = torch.where(valid, attn, torch.full_like(attn, -1))
    return StepInputs(positions.to(device), slots.to(device), attn.to(device))


def _hidden(rows: int, hidden_size: int, seed: int, special: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden_size, generator=gen)
    if special:
        x[-1, :4] = torch.tensor([-0.0, 1e-40, 65504.0, -3.0e4])
    return x.to(torch.bfloat16).cuda()


def _poison_queries(caches) -> None:
    for cache in caches:
        cache.tensor[CONTEXT // cache.block_size:].fill_(float("nan"))


@pytest.fixture(scope="module")
def draft():
    """The reference draft, its decode with the plugin's sm_90a kernels (no
    L2 prefetch, as the plugin builds it; every kernel compiled by
    ``prepare``), and the eager and graph caches with the context stored."""
    model = DraftModel(DraftConfig(seed=SEED % 10_000), device="cuda")
    decode = build_draft_decode(describe(model), prefetch=False,
                                kernels={k: kernel_class(k) for k in VLLM_EXACT_SM90})
    assert decode is not None and decode.prepared
    block = model.config.kv_block_size
    blocks = (CONTEXT + MAX_ROWS) // block + 1
    eager, graphed = model.make_caches(blocks, "cuda"), model.make_caches(blocks, "cuda")
    for cache in (*eager, *graphed):
        cache.tensor.fill_(float("nan"))  # poisoned: a slot nobody wrote shows
    gen = torch.Generator().manual_seed(SEED + 1)
    states = torch.randn(CONTEXT, model.config.hidden_size, generator=gen).to(torch.bfloat16).cuda()
    positions = torch.arange(CONTEXT, device="cuda")
    model.precompute_and_store_context_kv(states, positions, eager, positions)
    assert decode.store_context_kv(states, positions, graphed, positions)  # the fused context chain
    for ref, got in zip(eager, graphed):
        assert_bitwise(got.tensor, ref.tensor, "context caches")
    return model, decode, eager, graphed


def test_the_plugins_kernels_are_bound_with_pdl_and_take_512_rows(draft):
    _, decode, _, _ = draft
    kernels = [decode.input_norm, *decode.boundaries, *decode.epilogues, *decode.o_gates, *decode.activations]
    assert decode.context is not None and all(k is not None for k in kernels), \
        "a kernel of the plugin's sm_90a set was not bound"
    kernels += [decode.context.norms, decode.context.store]  # the chain launches these two
    assert all(k.pdl is True for k in kernels), "PDL is off for a bound kernel on this GPU"
    assert decode.max_rows is not None and decode.max_rows >= MAX_ROWS


@pytest.mark.parametrize("n", sorted(CAPTURED_ROWS))
def test_every_captured_size_replays_the_eager_spec_bits(draft, n, caplog):
    """Every size of N: captured (the warm-up and capture steps), replayed
    on fresh inputs over poisoned outputs, bit for bit the eager spec step;
    no bound kernel refused a step (none "ran stock")."""
    model, decode, eager, graphed = draft
    caplog.set_level(logging.WARNING, logger="dspark.decode")
    hidden = model.config.hidden_size
    for rows in CAPTURED_ROWS[n]:
        what = f"N={n} rows={rows}"
        _poison_queries(eager)
        _poison_queries(graphed)
        graph = StepGraph(decode.run, _hidden(rows, hidden, SEED + rows, False), requests_step(rows, n, 0),
                          graphed, warmup=1)
        x, step = _hidden(rows, hidden, SEED + 7 * rows + n, True), requests_step(rows, n, 3)
        _poison_queries(graphed)
        graph.output.fill_(float("nan"))
        got = graph.replay(x, step)
        want = model(x, step, eager)
        assert_bitwise(got, want, f"{what}: hidden states of the replay")
        for i, (ref, out) in enumerate(zip(eager, graphed)):
            assert_bitwise(out.tensor, ref.tensor, f"{what}: layer {i}'s KV cache after the replay")
        del graph, got
    ran_stock = [r.getMessage() for r in caplog.records if "ran stock" in r.getMessage()]
    assert not ran_stock, f"N={n}: kernels refused steps: {ran_stock}"
