"""The ordered GEMM on the CPU: its index maps emulated (the copies into the
swizzled ring, ldmatrix, the m16n8k16 fragments) against x @ W^T on small
integers, its split chunks against ``SplitOrder.bounds``, its launch
settings and refusals; the compile checks and PTX audits are in
``test_compile_ordered_gemm.py``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dspark_core.contracts.constants import OrderedGemmConstants, ordered_gemm_constants, ordered_gemm_unsupported
from dspark_core.errors import Unsupported
from dspark_core.spec.split_order import SplitOrder, candidate_orders
from dspark_cute.cutedsl.gemm import ordered as og


def _ldmatrix(smem: np.ndarray, addresses: list[int], count: int) -> list[list[tuple[int, int]]]:
    """ldmatrix .x``count`` of b16: word ``i`` of lane ``l`` is the pair of
    elements ``2 (l & 3)`` and ``+ 1`` of row ``l >> 2`` of matrix ``i``,
    whose row ``r`` starts at the byte address lane ``8 i + r`` gives."""
    out = []
    for lane in range(32):
        words = []
        for i in range(count):
            addr = addresses[8 * i + (lane >> 2)] + 4 * (lane & 3)
            words.append((int(smem[addr // 2]), int(smem[addr // 2 + 1])))
        out.append(words)
    return out


def _emulate_chunk(lay: og.OrderedLayout, w_tile: np.ndarray, x_rows: np.ndarray) -> np.ndarray:
    """One chunk through the kernel's maps: ``w_tile`` [16 warps, chunk] and
    ``x_rows`` [8 n_tiles, chunk] (small integers) copied by every thread's
    copies into a ring slot, read back by every lane's ldmatrix and summed
    per the m16n8k16 fragment layout; returns [rows, tokens] (int64)."""
    smem = np.full((lay.total // 2,), -(2**20), dtype=np.int64)  # poison: any unwritten read shows
    for tid, j in itertools.product(range(lay.threads), range(lay.w_copies)):
        r, p = og.w_copy(lay, tid, j)
        off = og.swizzle(lay, r, p) // 2
        smem[off:off + 8] = w_tile[r, 8 * p:8 * p + 8]
    for tid, j in itertools.product(range(lay.threads), range(lay.x_copies)):
        idx, tok, p = og.x_copy(lay, tid, j)
        if idx < lay.x_pieces:
            off = (lay.x_ring + og.swizzle(lay, tok, p)) // 2
            smem[off:off + 8] = x_rows[tok, 8 * p:8 * p + 8]
    out = np.zeros((lay.rows, 8 * lay.n_tiles), dtype=np.int64)
    for warp in range(lay.warps):
        for kk in range(lay.steps):
            a = _ldmatrix(smem, [og.a_address(lay, warp, lane, kk) for lane in range(32)], 4)
            if lay.n_tiles == 1:
                b = [[w] for w in _ldmatrix(smem, [lay.x_ring + og.b_address(lay, lane, kk, 0) for lane in range(32)],
                                            2)]
                bs = [[lane_words[0] for lane_words in b]]
            else:
                bs = []
                for pr in range(lay.n_tiles // 2):
                    words = _ldmatrix(smem, [lay.x_ring + og.b_address(lay, lane, kk, pr) for lane in range(32)], 4)
                    bs += [[w[0:2] for w in words], [w[2:4] for w in words]]
            # The m16n8k16 fragments (PTX ISA): A rows g, g + 8 and columns
            # 2t.., 2t + 8..; B columns (k) 2t.., 2t + 8.. of token g; C rows
            # g, g + 8 and tokens 2t, 2t + 1.
            for nt in range(lay.n_tiles):
                a_mat = np.zeros((16, 16), dtype=np.int64)
                b_mat = np.zeros((16, 8), dtype=np.int64)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    (a0, a1), (a2, a3), (a4, a5), (a6, a7) = a[lane]
                    a_mat[g, 2 * t:2 * t + 2] = a0, a1
                    a_mat[g + 8, 2 * t:2 * t + 2] = a2, a3
                    a_mat[g, 2 * t + 8:2 * t + 10] = a4, a5
                    a_mat[g + 8, 2 * t + 8:2 * t + 10] = a6, a7
                    (b0, b1), (b2, b3) = bs[nt][lane]
                    b_mat[2 * t:2 * t + 2, g] = b0, b1
                    b_mat[2 * t + 8:2 * t + 10, g] = b2, b3
                d = a_mat @ b_mat
                for lane in range(32):
                    for reg in range(4):
                        row, tok = og.acc_coords(warp, lane, nt, reg)
                        g, t = lane >> 2, lane & 3
                        out[row, tok] += d[g + 8 * (reg >> 1), 2 * t + (reg & 1)]
                # Each MMA must take the 16 contiguous columns of its step,
                # in the weight's own order (no permutation of K).
                assert np.array_equal(a_mat, w_tile[16 * warp:16 * warp + 16, 16 * kk:16 * kk + 16])
                assert np.array_equal(b_mat.T, x_rows[8 * nt:8 * nt + 8, 16 * kk:16 * kk + 16])
    return out


@pytest.mark.parametrize("warps,n_tiles,chunk", [(1, 1, 64), (2, 2, 64), (4, 1, 64), (4, 4, 64), (8, 8, 64),
                                                 (4, 8, 64), (1, 1, 128), (2, 4, 128), (4, 2, 256), (1, 8, 256)])
def test_chunk_maps_give_the_product(warps, n_tiles, chunk, seed):
    lay = og.check_settings(n_tiles, warps, 3, chunk)
    rng = np.random.default_rng(seed)
    w = rng.integers(-8, 9, size=(lay.rows, chunk))
    x = rng.integers(-8, 9, size=(8 * n_tiles, chunk))
    got = _emulate_chunk(lay, w, x)
    np.testing.assert_array_equal(got, w @ x.T)


@pytest.mark.parametrize("chunk", og.CHUNKS)
def test_swizzle_is_conflict_free_and_a_permutation(chunk):
    lay = og.check_settings(1, 4, 2, chunk)
    for row in range(64):
        pieces = sorted(og.swizzle(lay, row, p) - row * lay.row_bytes for p in range(chunk // 8))
        assert pieces == [16 * p for p in range(chunk // 8)]
    # The 8 rows one ldmatrix phase reads for a piece land in 8 bank groups.
    for piece in range(chunk // 8):
        groups = {(og.swizzle(lay, r, piece) % 128) // 16 for r in range(8)}
        assert len(groups) == 8


@pytest.mark.parametrize("k", [256, 512, 1152, 2048, 4096, 8192, 16384, 24576])
def test_split_chunks_are_the_order_bounds(k):
    for order in candidate_orders(k):
        for chunk in og.CHUNKS:
            width, tc = og.fit_chunk(order, k, chunk)
            assert width <= chunk and k % width == 0
            spans = [og.split_chunks(k, tc, order.splits, s, chunk=width) for s in range(order.splits)]
            got = tuple((c * width, (c + n) * width) for c, n in spans)
            assert got == order.bounds(k), (order, chunk)
    assert og.fit_chunk(SplitOrder(64, 2), 8192, 256) == (256, 16)  # even splits: K / S in 256-column chunks
    assert og.fit_chunk(SplitOrder(64, 3), 8192, 256) == (64, 1)  # uneven 64-column tiles: 64-column chunks


def test_launch_settings_fit_and_cover():
    for n, splits, m in itertools.product([256, 1152, 4096, 8192, 9216, 32768], [1, 2, 3, 5, 8], [1, 5, 16, 33, 64]):
        n_tiles, warps, stages, chunk, l2 = og.launch_settings(n, splits, m, 132)
        lay = og.check_settings(n_tiles, warps, stages, chunk)
        assert 8 * n_tiles >= m and n % lay.rows == 0
        assert 2 <= stages <= 8 and lay.total <= og.SMEM_LIMIT
        ctas = n // lay.rows * splits
        assert 0 <= l2 <= 16 and ctas * l2 * lay.w_stage <= og.L2_PREFETCH_BYTES


def test_refusals():
    with pytest.raises(ValueError, match="token tiles"):
        og.check_settings(3, 4, 4)
    with pytest.raises(ValueError, match="warps"):
        og.check_settings(1, 3, 4)
    with pytest.raises(ValueError, match="stages"):
        og.check_settings(1, 4, 1)
    with pytest.raises(ValueError, match="shared memory"):
        og.check_settings(8, 8, 16)
    with pytest.raises(ValueError, match="columns wide"):
        og.check_settings(1, 4, 4, 96)
    with pytest.raises(ValueError, match="do not divide"):
        og.OrderedGemmKernel(192, 1, 4, 4, True, 128)
    with pytest.raises(Unsupported, match="multiple of 64"):
        og.OrderedGemmKernel(100, 1, 4, 4, True)
    assert "64-column" in og.order_problem(SplitOrder(32, 1), 8192)
    assert "fewer than" in og.order_problem(SplitOrder(256, 64), 8192)
    assert og.order_problem("2x128", 8192).startswith("an order is a SplitOrder")
    assert og.order_problem(SplitOrder(128, 5), 1152) is None
    w = torch.zeros(64, 100, dtype=torch.bfloat16)
    assert "multiple of 64" in ordered_gemm_unsupported(w)
    assert "bfloat16" in ordered_gemm_unsupported(torch.zeros(64, 64))
    assert ordered_gemm_unsupported(torch.zeros(48, 128, dtype=torch.bfloat16)) is None
    w = torch.zeros(48, 128, dtype=torch.bfloat16)
    for role in ("foo", "down_proj", None, 3):
        with pytest.raises(ValueError, match="role must be one of fc, qkv_proj"):
            ordered_gemm_constants(role, w)
    assert ordered_gemm_constants("markov_bias", w) == OrderedGemmConstants("markov_bias", 48, 128)
    with pytest.raises(ValueError, match="takes OrderedGemmConstants"):
        og.OrderedGemm(object(), torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA weight"):
        og.OrderedGemm(OrderedGemmConstants("o_proj", 64, 64), torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA weight"):
        og.ordered_gemm(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16),
                        SplitOrder(64, 1))


def test_n_tiles_for():
    assert [og.n_tiles_for(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [1, 1, 2, 2, 4, 4, 8, 8]


def test_the_rows_it_keeps_are_those_timed_faster_on_the_card(tmp_path):
    """``OrderedGemm.decide`` (stand-in timers and card): every row count the
    check bound is timed against cuBLAS; the faster kernel's settings are
    bound where it wins by the margin, the others go back to cuBLAS with the
    times as their reason; a second decision reads the cache and times
    nothing; no fixed rule of row counts or weight sizes remains."""
    from dspark_core.runtime import gemm_decide as gd
    from dspark_core.tools.card import CardFacts
    from dspark_cute.cutedsl.gemm import decide as timing

    card = CardFacts("NVIDIA H100 80GB HBM3", (9, 0), 132, "13.0", "13.1.0", "2.11.0", 3.35e12)

    def stand_in(n, k):
        gemm = og.OrderedGemm.__new__(og.OrderedGemm)
        gemm.constants, gemm.device, gemm.sms = OrderedGemmConstants("gate_up", n, k), "cpu", 132
        gemm._choose = lambda m, o: og.launch_settings(n, o.splits, m)
        gemm.prepare = lambda: None  # no compile on the CPU
        return gemm

    # A 512 MiB weight (above the old fixed rule's 64 MiB) at 1 .. 64 rows.
    gemm = stand_in(32768, 8192)
    assert gemm.candidate_rows == tuple(range(1, 65))
    orders = {m: SplitOrder(64, 1 if m != 3 else 2) for m in (1, 2, 3, 5, 16, 64)}
    gemm.bind_orders(orders, {4: "no order"})
    calls = []

    def side(name, us):
        def make(m):
            def once():
                calls.append((m, name))
                return us(m)
            return once
        return make

    sides = {gd.CUBLAS: side(gd.CUBLAS, lambda m: 190.0),
             timing.STREAMED: side(timing.STREAMED, lambda m: 179.0 if m <= 16 else 310.0),
             timing.CP_ASYNC: side(timing.CP_ASYNC, lambda m: 188.5 if m != 5 else 184.0)}
    cache = gd.DecisionCache(tmp_path)
    decision = gemm.decide(sides=sides, card=card, cache=cache)
    assert {m for m, _ in calls} == set(orders)
    assert decision.dspark_rows == {1: "streamed", 2: "streamed", 3: "streamed", 5: "streamed", 16: "streamed"}
    assert sorted(gemm.orders) == [1, 2, 3, 5, 16] and gemm.orders[3].splits == 2
    assert gemm._settings[1] == timing.candidates(32768, 1, 1, 132)[timing.STREAMED]
    assert gemm._settings[3] == timing.candidates(32768, 2, 3, 132)[timing.STREAMED]
    assert "cuBLAS kept at m = 64: 190.00 µs for cuBLAS against 188.50 for DSpark's cp.async kernel" \
        in gemm.reasons[64]
    assert gemm.reasons[4] == "no order" and gemm.decision is decision
    # The same shape again (another layer, a restart): from the cache, nothing timed.
    calls.clear()
    again = stand_in(32768, 8192)
    again.bind_orders(orders, {4: "no order"})
    assert again.decide(sides=sides, card=card, cache=cache).dspark_rows == decision.dspark_rows and not calls
    # Timed another way (back to back: lead_us=0), the cached times behind the lead part do not stand in.
    other = stand_in(32768, 8192)
    other.bind_orders(orders, {4: "no order"})
    other.decide(sides=sides, card=card, cache=cache, lead_us=0)
    assert {m for m, _ in calls} == set(orders)
    # Rebinding orders drops the decision (a new check needs a new one).
    again.bind_orders(orders)
    assert again.decision is None and 64 in again.orders


def test_row_counts_past_the_kernels_are_refused_in_words():
    """``n_tiles_for`` (and so ``candidate_run``'s settings): a row count
    outside 1 .. 64 or of another type is a ValueError or TypeError naming
    it, never a bare StopIteration."""
    for bad, kind in ((65, ValueError), (0, ValueError), (-3, ValueError), (True, TypeError), (4.0, TypeError)):
        with pytest.raises(kind, match="the row count m"):
            og.n_tiles_for(bad)
    assert og.n_tiles_for(np.int64(9)) == 2


def test_behind_takes_the_lead_part_off_once(monkeypatch):
    """``decide.behind``: a side's time is the pair's (lead part, call)
    less the part's alone, timed once a row count and shared by the sides,
    at least ``MIN_US``; without a lead the call is timed alone; the lead's
    µs is checked before anything runs."""
    from dspark_cute.cutedsl.gemm import decide as timing

    graphs = []

    def fake_graph_timer(call, copies):
        # What the captured graph holds: one call per copy. Stand-in times:
        # the lead part alone 10 µs, the pair 25, a call without a lead 18.
        results = [call(w) for w in copies]
        graphs.append(results)
        kind = "pair" if isinstance(results[0], tuple) else ("lead" if results[0] is None else "alone")
        return lambda: {"pair": 25.0, "lead": 10.0, "alone": 18.0}[kind]

    monkeypatch.setattr(timing, "graph_timer", fake_graph_timer)
    leads = []

    def lead(ns):
        leads.append(ns)

    shared: dict = {}
    timed = timing.behind(lead, 6.0, lambda w: "pair", [object(), object()], shared)
    assert timed() == 15.0 and timed() == 15.0
    other = timing.behind(lead, 6.0, lambda w: "pair", [object()], shared)
    assert other() == 15.0
    assert sum(1 for g in graphs if g[0] is None) == 1  # the part alone: one graph for both sides
    assert set(leads) == {6000}
    assert timing.behind(None, 6.0, lambda w: "x", [object()], {})() == 18.0
    fast = timing.behind(lead, 6.0, lambda w: "pair", [object()], {"us": 30.0})
    assert fast() == timing.MIN_US
    for bad in (-1.0, 1e4, float("nan"), True, "6"):
        with pytest.raises(ValueError, match="lead part's µs"):
            timing.gpu_sides(None, [], None, None, lead_us=bad)


def test_a_lead_part_that_fails_times_without_it_said_once(monkeypatch, caplog):
    """``decide._lead``: where the lead part's kernel fails to compile or
    launch, the timing goes on without it (each call back to back), the
    failure logged once."""
    import logging

    from dspark_cute.cutedsl.gemm import decide as timing
    from dspark_cute.cutedsl.gemm import lead

    def failing(release=True):
        raise RuntimeError("no cooperative timer here")

    monkeypatch.setattr(lead, "lead_launcher", failing)
    monkeypatch.setattr(timing, "_lead_refused", [])
    with caplog.at_level(logging.WARNING, logger="dspark.decode"):
        assert timing._lead() is None and timing._lead() is None
    lines = [r.getMessage() for r in caplog.records if "lead part" in r.getMessage()]
    assert len(lines) == 1 and "RuntimeError: no cooperative timer here" in lines[0]
