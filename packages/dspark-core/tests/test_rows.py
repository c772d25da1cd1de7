"""The rows statement of the kernel contract (``contracts.kernels.MAX_ROWS``,
``rows_taken``) and the executor's ``DraftDecode.max_rows``, the most rows
a step takes on every kernel it binds, over the reference draft with the
contract's stand-in kernels of ``test_decode``."""

from __future__ import annotations

import pytest
from test_decode import ALL, CALLS, FULL, KERNELS, FakeActivation, _assert_same, _both

from dspark_core.contracts import kernels as K
from dspark_core.planner import policy
from dspark_core.planner.plan import plan_draft
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import small_config
from dspark_core.reference.model import DraftModel
from dspark_core.runtime.decode import DraftDecode


def test_every_kernel_states_its_rows():
    assert set(K.MAX_ROWS) == K.ALL_KERNELS
    # The tiled kernels take one decode step's tile; the rest take the row count at run time.
    assert {n for n, rows in K.MAX_ROWS.items() if rows == K.MAX_DECODE_ROWS} == {
        K.ALL_REDUCE_BOUNDARY, K.PACKAGE_GEMM}
    for name in (K.ROW_NORM, K.BOUNDARY, K.CONTEXT_CHAIN, K.QKV_EPILOGUE, K.O_GATE, K.MLP_ACTIVATION):
        assert K.MAX_ROWS[name] == K.ANY_ROWS == 2**31 - 1
    assert K.MAX_ROWS[K.GEMV] == 1 and K.MAX_ROWS[K.ATTENTION] == 65535 and K.MAX_ROWS[K.WEIGHT_PREFETCH] is None
    # vLLM captures draft steps of up to 512 rows: every untiled step kernel takes them.
    assert all(K.MAX_ROWS[n] >= 512 for n in (K.ROW_NORM, K.BOUNDARY, K.QKV_EPILOGUE, K.ATTENTION, K.O_GATE,
                                              K.MLP_ACTIVATION))


class _Stated:
    def __init__(self, max_rows):
        self.max_rows = max_rows


def test_rows_taken_reads_a_host_classs_own_bound_first():
    assert K.rows_taken(K.O_GATE) == K.ANY_ROWS
    assert K.rows_taken(K.O_GATE, object()) == K.ANY_ROWS  # states none: the contract's
    assert K.rows_taken(K.O_GATE, _Stated(4096)) == 4096
    assert K.rows_taken(K.O_GATE, _Stated(None)) == K.ANY_ROWS
    for bad in (0, -3, 2.0, True, "16"):
        with pytest.raises(TypeError, match="max_rows must be a positive int"):
            K.rows_taken(K.MLP_ACTIVATION, _Stated(bad))
    with pytest.raises(KeyError):
        K.rows_taken("softmax")


def _prepared(kernels, target=ALL) -> DraftDecode:
    draft = describe(DraftModel(small_config()))
    decode = DraftDecode(draft, plan_draft(draft, target), kernels=kernels)
    assert decode.max_rows is None  # not prepared yet
    decode.prepare()
    return decode


class _CappedActivation(FakeActivation):
    rows = max_rows = 5  # the stand-in refuses calls beyond it (test_decode.Kernel.problem)


def test_the_decode_takes_the_least_of_its_step_kernels_rows(gen):
    # The staged attention is bound (65535 rows); nothing else bound states less.
    assert _prepared(KERNELS).max_rows == 65535
    assert _prepared(KERNELS, ALL.without({policy.ATTENTION})).max_rows == K.ANY_ROWS
    capped = _prepared({**KERNELS, policy.MLP_ACTIVATION: _CappedActivation})
    assert capped.max_rows == 5
    # The one-row GEMV does not count.
    assert _prepared(KERNELS, FULL.opt_in({policy.GEMV})).max_rows == 65535
    # Only the context chain bound: no step kernel.
    only_context = ALL.without(policy.ALL_KERNELS - {policy.CONTEXT_CHAIN})
    decode = _prepared(KERNELS, only_context)
    assert decode.context is not None and decode.max_rows is None
    # A step beyond a kernel's rows runs that part stock, the rest fused, the stock bits.
    model = DraftModel(small_config())
    draft = describe(model)
    decode = DraftDecode(draft, plan_draft(draft, ALL), kernels={**KERNELS, policy.MLP_ACTIVATION: _CappedActivation})
    decode.prepare()
    for m in (5, 6):
        CALLS.clear()
        _assert_same(_both(model, decode, m, gen))
        kinds = [c[0] for c in CALLS]
        assert kinds.count("mlp_activation") == (2 if m == 5 else 0) and kinds.count("boundary") == 4
