"""The GPU row test (tests/test_gpu_rows.py) runs where vLLM is not
installed, so it writes out the draft step sizes vLLM 0.33.0 captures and
the plugin's sm_90a kernel set: both must be vLLM's and the plugin's own.
Its step builder is checked here too, on the CPU: vLLM's speculator shape
(requests x N rows) and a spec forward over it that reads no poisoned slot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from test_lifecycle import dirs, sizes  # noqa: E402,F401 (fixtures: vLLM's own capture sizes)

from dspark_vllm import planning  # noqa: E402

GPU_TEST = Path(__file__).resolve().parents[3] / "tests" / "test_gpu_rows.py"


@pytest.fixture(scope="module")
def rows_test():
    spec = importlib.util.spec_from_file_location("dspark_gpu_rows", GPU_TEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("dspark_gpu_rows", module)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_tests_row_counts_are_the_ones_vllm_captures(rows_test, sizes):  # noqa: F811 (the fixture)
    assert set(rows_test.CAPTURED_ROWS) <= set(sizes)
    for n, rows in rows_test.CAPTURED_ROWS.items():
        assert rows == sizes[n], f"N = {n}"
    assert max(max(r) for r in rows_test.CAPTURED_ROWS.values()) == rows_test.MAX_ROWS


def test_the_gpu_tests_kernel_set_is_the_plugins(rows_test):
    assert rows_test.VLLM_EXACT_SM90 == planning.exact_kernels("sm_90a")


def test_the_step_is_requests_of_n_tokens(rows_test):
    step = rows_test.requests_step(6, 3, 0, device="cpu")
    assert step.positions.tolist() == [256, 257, 258, 251, 252, 253]
    assert step.slots.tolist() == [256, 257, 258, 259, 260, 261]
    row = step.attn_slots[4].tolist()  # request 1, its token 1: context 0..250, its slots 259, 260
    assert row[:251] == list(range(251)) and row[251:256] == [-1] * 5 and row[256:] == [259, 260, -1]
    with pytest.raises(ValueError, match="whole requests"):
        rows_test.requests_step(7, 3, 0, device="cpu")


@pytest.mark.parametrize("rows, n", [(12, 3), (16, 8)])
def test_a_spec_step_reads_no_poisoned_slot(rows_test, rows, n):
    """Over caches whose every slot past the context is NaN, the spec's
    step of both shifts writes each query's K/V and answers finite values:
    the GPU test's poison can only show where a kernel writes or reads
    outside the step's slots."""
    from dspark_core.reference.config import small_config
    from dspark_core.reference.model import DraftModel

    model = DraftModel(small_config(seed=rows), device="cpu")
    caches = model.make_caches((rows_test.CONTEXT + rows) // model.config.kv_block_size + 1, "cpu")
    states = torch.randn(rows_test.CONTEXT, model.config.hidden_size).to(torch.bfloat16)
    positions = torch.arange(rows_test.CONTEXT)
    model.precompute_and_store_context_kv(states, positions, caches, positions)
    for shift in (0, 3):
        rows_test._poison_queries(caches)
        step = rows_test.requests_step(rows, n, shift, device="cpu")
        x = torch.randn(rows, model.config.hidden_size).to(torch.bfloat16)
        out = model(x, step, caches)
        assert torch.isfinite(out.float()).all(), f"shift {shift}: a poisoned slot was read"
        for cache in caches:
            b = cache.block_size
            for slot in step.slots.tolist():
                assert torch.isfinite(cache.tensor[slot // b, :, slot % b].float()).all(), f"slot {slot} unwritten"
            past = rows_test.CONTEXT + rows  # the first slot no query writes: still poisoned
            assert torch.isnan(cache.tensor[past // b, :, past % b].float()).all()
