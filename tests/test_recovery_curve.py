"""The recovery curve's arithmetic (bench/recovery_curve.py): the share of a full recompute's gain a
repair recovers, against values worked out by hand, and its interval around them."""

from __future__ import annotations

import pytest

from bench.recovery_curve import repairs, summarize


def test_the_cases_are_the_two_ends_then_each_selector_at_each_ratio():
    assert repairs(["cacheblend", "random"], [0.1, 0.5]) == [
        ("none", "none", None),
        ("full", "full", None),
        ("cacheblend@0.1", "cacheblend", 0.1),
        ("cacheblend@0.5", "cacheblend", 0.5),
        ("random@0.1", "random", 0.1),
        ("random@0.5", "random", 0.5),
    ]


def test_recovered_is_the_mean_gain_over_the_mean_full_gain():
    cases = repairs(["random"], [0.3])
    # full gains 2 and 6 (mean 4); the repair gains 1 and 2 (mean 1.5): 0.375 of the full gain
    rows = [
        {"ll": {"none": -10.0, "full": -8.0, "random@0.3": -9.0}, "share": {"full": 1.0, "random@0.3": 0.1}},
        {"ll": {"none": -7.0, "full": -1.0, "random@0.3": -5.0}, "share": {"full": 1.0, "random@0.3": 0.3}},
    ]
    by_case = {s["case"]: s for s in summarize(rows, cases)}
    assert by_case["full"]["recovered"]["mean"] == 1.0 and by_case["full"]["recomputed_share"] == 1.0
    got = by_case["random@0.3"]
    assert got["recovered"]["mean"] == pytest.approx(1.5 / 4) and got["recomputed_share"] == pytest.approx(0.2)
    # resampling the two questions: the interval runs from the second one's share to the first's
    assert got["recovered"]["lo"] == pytest.approx(2 / 6) and got["recovered"]["hi"] == pytest.approx(1 / 2)
    assert got["n"] == 2
