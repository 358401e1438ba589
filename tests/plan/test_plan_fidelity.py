"""The fidelity table's logic (dantinox/plan/fidelity.py): cells from predicted intervals and replay numbers,
and the verdict of issue 22's acceptance. Pure numbers, no engine; the reference values are worked by hand."""

import pytest

from dantinox.plan.fidelity import fidelity_cell, fidelity_verdict, replay_spread
from dantinox.plan.uncertainty import interval


def iv(median, low, high):
    return {"median": median, "low": low, "high": high}


def test_spread_is_the_largest_distance_from_the_replay_median():
    assert replay_spread([10.0, 11.0, 13.0]) == pytest.approx(2 / 11)   # median 11, |13 - 11| / 11
    assert replay_spread([5.0]) == 0.0
    assert replay_spread([0.0, 0.0]) == 0.0


def test_cell_inside_gap_and_tolerance():
    c = fidelity_cell("light", "ttft_p99", iv(40.0, 30.0, 50.0), [44.0, 48.0, 50.0])
    assert c["inside"] and c["replay"] == {"median": 48.0, "low": 44.0, "high": 50.0, "values": [44.0, 48.0, 50.0]}
    assert c["gap"] == pytest.approx((40 - 48) / 48)                    # -16.7 %
    assert c["spread"] == pytest.approx(4 / 48)                         # 8.3 % < the 10 % floor
    assert c["tolerance"] == pytest.approx(0.10) and not c["gap_ok"]
    wide = fidelity_cell("light", "ttft_p99", iv(40.0, 30.0, 50.0), [30.0, 48.0, 70.0])
    assert wide["tolerance"] == pytest.approx(22 / 48) and wide["gap_ok"]   # the replay's own spread wins
    out = fidelity_cell("near capacity", "tpot_p50", iv(1.0, 0.9, 1.1), [1.2, 1.3])
    assert not out["inside"]


def test_throughput_tolerance_is_five_percent_and_none_edges_are_outside():
    t = fidelity_cell("light", "output_tokens_per_s", iv(104.0, 100.0, 108.0), [100.0])
    assert t["tolerance"] == 0.05 and t["gap_ok"] and t["inside"]      # +4 %, and 100 <= 100 <= 108
    t2 = fidelity_cell("light", "output_tokens_per_s", iv(106.0, 100.0, 108.0), [100.0])
    assert not t2["gap_ok"]
    assert not fidelity_cell("light", "ttft_p99", iv(None, None, None), [1.0])["inside"]
    with pytest.raises(ValueError, match="replays"):
        fidelity_cell("light", "ttft_p99", iv(1.0, 1.0, 1.0), [])


def _cells(inside_flags, gap=0.0, tps_gap=0.0, load="light"):
    cells = []
    for i, inside in enumerate(inside_flags):
        rep = 100.0
        pred = rep * (1 + gap)
        low, high = (pred - 50, pred + 50) if inside else (pred + 1, pred + 2)
        cells.append(fidelity_cell(load, ("ttft_p99", "tpot_p50")[i % 2], iv(pred, low, high), [rep]))
    cells.append(fidelity_cell(load, "output_tokens_per_s", iv(100 * (1 + tps_gap), 0, 1e9), [100.0]))
    return cells


def test_verdict_counts_only_judged_loads_and_needs_eighty_percent_inside():
    four_of_five = _cells([True, True, True, True, False])
    v = fidelity_verdict(four_of_five)
    assert (v["inside"], v["latency_cells"], v["inside_ok"], v["passed"]) == (4, 5, True, True)
    v = fidelity_verdict(_cells([True, True, True, False, False]))
    assert (v["inside"], v["inside_ok"], v["passed"]) == (3, False, False)
    overloaded = _cells([False] * 4, load="overloaded")
    assert fidelity_verdict(four_of_five + overloaded)["latency_cells"] == 5
    assert not fidelity_verdict(overloaded)["passed"]                   # nothing judged: not passed


def test_verdict_fails_on_a_gap_or_on_throughput():
    v = fidelity_verdict(_cells([True, True], gap=0.15))
    assert v["inside_ok"] and not v["gaps_ok"] and v["median_abs_gap"] == pytest.approx(0.15)
    assert not v["passed"]
    v = fidelity_verdict(_cells([True, True], tps_gap=-0.06))
    assert v["gaps_ok"] and not v["throughput_ok"] and not v["passed"]


def test_a_planner_interval_feeds_a_cell():
    pred = interval([40.0, 44.0, 52.0], "range")
    c = fidelity_cell("light", "ttft_p99", pred, [47.0, 49.0, 50.0])
    assert c["inside"] and c["gap"] == pytest.approx((44 - 49) / 49)
