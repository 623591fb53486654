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


def test_sentencekv_is_paired_against_pages_at_the_same_points():
    from bench.sentencekv_points import summarise

    def row(method, trajectory, point, agreement, kl):
        return {
            "workload": "w",
            "method": method,
            "trajectory": trajectory,
            "point": point,
            "prompt_tokens": 100,
            "full_match": 0.0,
            "agreement": agreement,
            "kl": kl,
            "gold_match": 0.0,
            "kv_read_per_step": 10.0,
            "live_kv": 10,
        }

    rows = []
    for t, p in (("a", 0), ("a", 1), ("b", 0)):
        rows.append(row("full", t, p, 1.0, 0.0))
    rows += [
        row("quest@8", "a", 0, 0.5, 0.1),
        row("quest@8", "a", 1, 1.0, 0.2),
        row("quest@8", "b", 0, 0.5, None),
        row("sentencekv@8", "a", 0, 0.25, 0.4),
        row("sentencekv@8", "a", 1, 1.0, 0.5),
        row("sentencekv@8", "b", 0, 1.0, 0.3),
    ]
    rows += [
        row("sentencekv+system@8", "a", 0, 0.5, 0.1),
        row("sentencekv+system@8", "a", 1, 1.0, 0.1),
        row("sentencekv+system@8", "b", 0, 0.5, 0.2),
    ]
    by = {r["method"]: r for r in summarise(rows)}
    [skv] = by["sentencekv@8"]["paired"]
    assert skv["peer"] == "quest@8" and by["quest@8"]["paired"] == []
    # agreement: -0.25, 0, +0.5 over three points; KL: +0.3, +0.3 (b's pages have no KL: not paired)
    assert abs(skv["agreement"]["mean"] - 0.25 / 3) < 1e-12
    assert abs(skv["kl"]["mean"] - 0.3) < 1e-12
    # the system variant: its pages peer did not run, so it pairs against itself without the system
    [own] = by["sentencekv+system@8"]["paired"]
    assert own["peer"] == "sentencekv@8"
    assert abs(own["agreement"]["mean"] - (0.25 + 0.0 - 0.5) / 3) < 1e-12
    assert abs(own["kl"]["mean"] - (-0.3 - 0.4 - 0.1) / 3) < 1e-12
