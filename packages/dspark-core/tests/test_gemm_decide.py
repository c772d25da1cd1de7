"""The build-time decision by timing (``dspark_core.runtime.gemm_decide``)
with stand-in timers and cards: who runs each row count, the margin, the
alternating rounds, the cache (keyed by card, fingerprint, shape and row
count; damaged files re-timed), the summary, and bad input refused."""

from __future__ import annotations

import json
import logging
import math

import pytest

from dspark_core.runtime import gemm_decide as gd
from dspark_core.tools.card import CardFacts, hbm_peak

H100 = CardFacts("NVIDIA H100 80GB HBM3", (9, 0), 132, "13.0", "13.1.0", "2.11.0", 3.35e12)
H200 = CardFacts("NVIDIA H200", (9, 0), 132, "13.0", "13.1.0", "2.11.0", 4.8e12)


def stand_in_sides(table, calls=None):
    """Sides whose time-once functions return ``table[m][name]`` (a list: one
    value a call, in turn), recording each call in ``calls``."""
    def side(name):
        def make(m):
            if name not in table[m]:
                return None
            values = table[m][name]
            values = list(values) if isinstance(values, list) else [values]

            def once():
                if calls is not None:
                    calls.append((m, name))
                return values.pop(0) if len(values) > 1 else values[0]
            return once
        return make

    names = {n for row in table.values() for n in row}
    return {name: side(name) for name in names}


def test_decide_row_takes_dspark_only_past_the_margin(rng):
    base = float(rng.uniform(5, 200))
    won = gd.decide_row(1, base * 1.02, {"streamed": base, "cp.async": base * 1.05})
    assert won.kernel == "streamed" and math.isclose(won.ratio, 1.02)
    assert "DSpark's streamed kernel at m = 1" in won.reason()
    near = gd.decide_row(2, base * 1.005, {"streamed": base})
    assert near.kernel is None and "cuBLAS kept at m = 2" in near.reason() and "not 1.01x or more" in near.reason()
    slower = gd.decide_row(3, base, {"streamed": base * 1.3, "cp.async": base * 1.1})
    assert slower.kernel is None and slower.best == ("cp.async", base * 1.1)
    assert gd.decide_row(4, base * 1.005, {"streamed": base}, margin=0.0).kernel == "streamed"
    none = gd.decide_row(5, base, {})
    assert none.kernel is None and none.ratio is None and "no DSpark candidate" in none.reason()


@pytest.mark.parametrize("bad", [0, -1.0, 1e-46, float("nan"), float("inf"), 1e39, "5", None, True])
def test_decide_row_refuses_bad_times(bad):
    with pytest.raises((ValueError, TypeError), match=r"cuBLAS's time at m = 1 \(µs\) must be a"):
        gd.decide_row(1, bad, {"streamed": 1.0})
    with pytest.raises((ValueError, TypeError), match="the streamed kernel's time at m = 1"):
        gd.decide_row(1, 1.0, {"streamed": bad})


def test_decide_refuses_bad_arguments_before_timing():
    calls = []
    sides = stand_in_sides({1: {gd.CUBLAS: 1.0}}, calls)
    good = dict(rows=[1], sides=sides, what="x", card=H100, fingerprint="f", shape=(64, 64))
    for change, kind in ((dict(card="H100"), TypeError), (dict(shape=(64,)), TypeError),
                         (dict(shape=(64, 0)), ValueError), (dict(rounds=0), ValueError),
                         (dict(sides={"streamed": sides[gd.CUBLAS]}), TypeError), (dict(cache="dir"), TypeError),
                         (dict(rows=[0]), ValueError), (dict(margin=2.0), ValueError),
                         (dict(fingerprint=1), TypeError)):
        with pytest.raises(kind):
            gd.decide(**{**good, **change})
    assert not calls
    assert gd.decide(**good).rows[1].kernel is None


def test_decide_row_refuses_bad_rows_margins_and_names():
    with pytest.raises(ValueError, match="the row count m"):
        gd.decide_row(65, 1.0, {"streamed": 1.0})
    with pytest.raises(TypeError, match="the row count m"):
        gd.decide_row(1.0, 1.0, {"streamed": 1.0})
    for margin in (-0.1, 1.0, float("nan"), "0.01", True):
        with pytest.raises((ValueError, TypeError), match="margin"):
            gd.decide_row(1, 1.0, {"streamed": 1.0}, margin=margin)
    with pytest.raises(ValueError, match="other than 'cuBLAS'"):
        gd.decide_row(1, 1.0, {gd.CUBLAS: 1.0})
    with pytest.raises(TypeError, match="mapping of name to µs"):
        gd.decide_row(1, 1.0, [("streamed", 1.0)])


def test_measure_alternates_the_sides_and_keeps_medians():
    calls = []
    table = {1: {gd.CUBLAS: [10.0, 30.0, 11.0], "streamed": [9.0, 1.0, 9.5], "cp.async": 12.0},
             2: {gd.CUBLAS: 20.0, "cp.async": 19.0}}
    times = gd.measure([2, 1, 1], stand_in_sides(table, calls), rounds=3)
    assert times[1] == {gd.CUBLAS: 11.0, "streamed": 9.0, "cp.async": 12.0}
    assert times[2] == {gd.CUBLAS: 20.0, "cp.async": 19.0}  # no streamed timer at m = 2: left out
    firsts = [calls[i][1] for i in (0, 3, 6)]
    lasts = [calls[i][1] for i in (2, 5, 8)]
    assert firsts[0] == lasts[1] and firsts[1] == lasts[0]  # each round reverses the last one's order
    with pytest.raises(ValueError, match="must include 'cuBLAS'"):
        gd.measure([1], {"streamed": lambda m: lambda: 1.0})
    with pytest.raises(ValueError, match="cuBLAS's side gave no timer"):
        gd.measure([1], {gd.CUBLAS: lambda m: None})
    with pytest.raises(ValueError, match="the streamed side's time"):
        gd.measure([1], {gd.CUBLAS: lambda m: lambda: 1.0, "streamed": lambda m: lambda: float("nan")})


def test_decide_times_once_then_reads_the_cache(tmp_path, caplog):
    table = {m: {gd.CUBLAS: 10.0, "streamed": 9.0 if m <= 4 else 10.5, "cp.async": 9.8} for m in range(1, 9)}
    calls = []
    cache = gd.DecisionCache(tmp_path / "decisions")
    got = gd.decide(range(1, 9), stand_in_sides(table, calls), "the [8192, 4096] o_proj weight", H100, "fp1",
                    (8192, 4096), cache)
    assert got.dspark_rows == {1: "streamed", 2: "streamed", 3: "streamed", 4: "streamed",
                               5: "cp.async", 6: "cp.async", 7: "cp.async", 8: "cp.async"}
    assert calls and not got.cached
    assert got.summary().startswith("the [8192, 4096] o_proj weight on NVIDIA H100 80GB HBM3 (132 SMs, 3.35 TB/s")
    assert "m = 1-4: DSpark (streamed) (1.11x); m = 5-8: DSpark (cp.async) (1.02x)" in got.summary()
    calls.clear()
    again = gd.decide(range(1, 9), stand_in_sides(table, calls), "o_proj", H100, "fp1", (8192, 4096), cache)
    assert not calls and again.cached == frozenset(range(1, 9)) and again.dspark_rows == got.dspark_rows
    assert "8 row counts' times from the cache" in again.summary()
    # A stricter margin re-decides from the cached times, without timing.
    strict = gd.decide(range(1, 9), stand_in_sides(table, calls), "o_proj", H100, "fp1", (8192, 4096), cache,
                       margin=0.05)
    assert not calls and strict.dspark_rows == {m: "streamed" for m in range(1, 5)}
    assert "cuBLAS kept at m = 5" in strict.cublas_rows[5]
    # Another card, another fingerprint, another shape: timed afresh.
    for card, fp, shape in ((H200, "fp1", (8192, 4096)), (H100, "fp2", (8192, 4096)), (H100, "fp1", (9216, 8192))):
        calls.clear()
        gd.decide([1], stand_in_sides(table, calls), "x", card, fp, shape, cache)
        assert calls, (card.name, fp, shape)
    # A damaged file is ignored, logged once and re-timed (then rewritten).
    key = gd.decision_key(H100.key(), "fp1", (8192, 4096), 1, tuple(sorted(stand_in_sides(table))))
    (tmp_path / "decisions" / f"{key}.json").write_text('{"m": 1, "cublas_us": "fast"')
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="dspark.decode"):
        gd.decide([1], stand_in_sides(table, calls), "x", H100, "fp1", (8192, 4096), cache)
    assert calls and "is ignored and re-timed" in caplog.text
    record = json.loads((tmp_path / "decisions" / f"{key}.json").read_text())
    assert record == {"m": 1, "cublas_us": 10.0, "times_us": {"cp.async": 9.8, "streamed": 9.0}}


def test_a_forged_record_of_bad_times_is_not_taken(tmp_path):
    table = {1: {gd.CUBLAS: 10.0, "streamed": 9.0}}
    cache = gd.DecisionCache(tmp_path)
    key = gd.decision_key(H100.key(), "fp", (64, 64), 1, (gd.CUBLAS, "streamed"))
    for forged in ({"m": 1, "cublas_us": 10.0, "times_us": {"streamed": -1.0}},
                   {"m": 1, "cublas_us": float("inf"), "times_us": {}}, {"m": True, "cublas_us": 1.0, "times_us": {}},
                   {"m": 2, "cublas_us": 1.0, "times_us": {"streamed": 0.5}}, [1, 2]):
        (tmp_path / f"{key}.json").write_text(json.dumps(forged))
        calls = []
        got = gd.decide([1], stand_in_sides(table, calls), "x", H100, "fp", (64, 64), cache)
        assert calls and got.rows[1].kernel == "streamed", forged


def test_the_cache_directory_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert gd.cache_directory({}) == tmp_path / "dspark" / "decisions"
    assert gd.cache_directory({"DSPARK_DECISION_CACHE": "off"}) is None
    assert gd.cache_directory({"DSPARK_DECISION_CACHE": str(tmp_path / "d")}) == tmp_path / "d"
    with pytest.raises(ValueError, match="DSPARK_DECISION_CACHE"):
        gd.cache_directory({"DSPARK_DECISION_CACHE": "relative/dir"})
    off = gd.DecisionCache(None)
    off.store("k", {"m": 1})
    assert off.load("k") is None
    with pytest.raises(TypeError, match="a path or None"):
        gd.DecisionCache(5)


def test_an_unwritable_cache_costs_no_build(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    cache = gd.DecisionCache(blocked / "decisions")
    with caplog.at_level(logging.WARNING, logger="dspark.decode"):
        got = gd.decide([1], stand_in_sides({1: {gd.CUBLAS: 2.0, "streamed": 1.0}}), "x", H100, "fp", (64, 64),
                        cache)
    assert got.rows[1].kernel == "streamed" and "cannot write" in caplog.text


def test_hbm_peaks_come_from_the_card_not_another():
    assert hbm_peak("NVIDIA H100 80GB HBM3") == 3.35e12
    assert hbm_peak("NVIDIA H100 PCIe") == 2.0e12
    assert hbm_peak("NVIDIA H200") == 4.8e12
    assert hbm_peak("NVIDIA GH200 480GB") == 4.0e12
    assert hbm_peak("NVIDIA B200") == 8.0e12
    assert hbm_peak("Some Future GPU", 2_619_000, 5120) == pytest.approx(3.352e12, rel=1e-3)
    assert hbm_peak("Some Future GPU") is None
    with pytest.raises(TypeError, match="a card's name is a str"):
        hbm_peak(None)
    assert H100.key() != H200.key() and len(H100.key()) == 16
    assert "3.35 TB/s HBM peak" in H100.describe()
