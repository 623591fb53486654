"""bench/sentencekv_points' comparison of a method's greedy decoding with the full cache's: KL only at
the steps whose preceding tokens both runs generated alike, never at step 0 (the prefill's), and the
matches by position, checked against values worked out by hand."""

from __future__ import annotations

import math

from bench.sentencekv_points import compare

SHARP = {1: math.log(0.9), 2: math.log(0.1)}  # p(1) = 0.9
FLAT = {1: math.log(0.5), 2: math.log(0.5)}


def kl_two(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_identical_runs():
    run = {"ids": [1, 1, 1], "top": [SHARP, SHARP, SHARP]}
    assert compare(run, run, [1, 1, 1]) == {"full_match": 1.0, "agreement": 1.0, "kl": 0.0, "gold_match": 1.0}


def test_kl_stops_at_the_first_difference_and_skips_step_zero():
    full = {"ids": [1, 1, 1, 1], "top": [SHARP, SHARP, SHARP, SHARP]}
    # differs at step 2: step 1 follows equal tokens, step 2's distribution too (its input is step 1's
    # token, equal in both), step 3 follows a different token and is not compared
    method = {"ids": [1, 1, 2, 1], "top": [FLAT, FLAT, {1: math.log(0.7), 2: math.log(0.3)}, {1: 0.0, 2: -30.0}]}
    got = compare(method, full, [1, 1, 2, 2])
    assert got["full_match"] == 0.0 and got["agreement"] == 0.75 and got["gold_match"] == 0.0
    assert math.isclose(got["kl"], (kl_two(0.9, 0.5) + kl_two(0.9, 0.7)) / 2, rel_tol=1e-9)


def test_difference_at_step_zero_leaves_no_kl():
    full = {"ids": [1, 2], "top": [SHARP, SHARP]}
    method = {"ids": [2, 2], "top": [SHARP, FLAT]}
    got = compare(method, full, [2, 2])
    assert got["kl"] is None and got["agreement"] == 0.5 and got["gold_match"] == 1.0
