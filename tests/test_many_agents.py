"""bench/many_agents.py's workload and accounting, without a server: the replayed histories grow as
the recorded trajectory did (the model's answers never enter them), the pauses are seeded draws
of the stated distributions, and the ideal prefill counts every shared prefix once."""

from __future__ import annotations

import random
import statistics

import pytest

from bench import many_agents as M


def extends(longer: list[dict], shorter: list[dict]) -> bool:
    return longer[: len(shorter)] == shorter and len(longer) > len(shorter)


@pytest.mark.parametrize("workload", ["recall", "bfcl"])
def test_each_step_sends_the_recorded_history_that_the_step_before_grew_into(workload):
    trajectories = M.WORKLOADS[workload](2, 0)
    assert len(trajectories) == 2
    for t in trajectories:
        for before, after in zip(t.steps, t.steps[1:]):
            assert extends(after.messages, before.messages)
            added = after.messages[len(before.messages)]
            assert added["role"] == "assistant"  # the recorded answer, then what it waited for
            if before.pause == "user":  # an answer in words, then the user's next message
                assert not added.get("tool_calls") and after.messages[-1]["role"] == "user"
            else:
                assert added["tool_calls"][0]["function"]["name"] == before.pause
        assert t.steps[-1].pause == "" and all(s.pause for s in t.steps[:-1])


def test_a_template_without_tool_messages_gets_the_same_steps_in_words():
    t = M.recall_trajectories(1, 0, steps=4)[0]
    words = M.as_text(t)
    assert [s.pause for s in words.steps] == [s.pause for s in t.steps]
    for s, w in zip(t.steps, words.steps):
        assert len(w.messages) == len(s.messages) and w.tools is None
        assert {m["role"] for m in w.messages} <= {"system", "user", "assistant"}
        assert all(isinstance(m["content"], str) for m in w.messages)
        outputs = [m["content"] for m in s.messages if m["role"] == "tool"]
        assert all(any(o in m["content"] for m in w.messages) for o in outputs)


def test_pauses_are_seeded_draws_around_each_kinds_median():
    draws = [M.pause_seconds("web_search", 0, 0, k, 1.0) for k in range(2001)]
    assert draws == [M.pause_seconds("web_search", 0, 0, k, 1.0) for k in range(2001)]
    assert draws != [M.pause_seconds("web_search", 1, 0, k, 1.0) for k in range(2001)]
    assert statistics.median(draws) == pytest.approx(M.PAUSES["web_search"][0], rel=0.1)
    assert M.pause_seconds("an_unlisted_tool", 0, 0, 0, 2.0) == pytest.approx(2 * M.pause_seconds("api", 0, 0, 0, 1.0))


def test_hints_state_the_next_tools_median_and_the_last_step_as_done():
    t = M.recall_trajectories(1, 0, steps=4)[0]
    for step in t.steps[:-1]:
        expected = M.hints(step, 2.0)["agent"]["expected_tool_duration_ms"]
        assert expected == round(2000 * M.PAUSES.get(step.pause, M.PAUSES["api"])[0])  # the median, not the draw
    assert M.hints(t.steps[-1], 1.0) == {"agent": {"done": True}}
    from sgl_memory.core.request import parse

    assert parse({"session_id": "s", **M.hints(t.steps[0], 1.0)}).part("persist") is not None  # the server takes them


def test_the_ideal_prefill_counts_each_distinct_prefix_once():
    rng = random.Random(0)
    system = [rng.randrange(50) for _ in range(30)]
    prompts = []
    for _ in range(20):  # sessions that share the system prompt, each growing turn by turn
        ids = system + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
        for _ in range(rng.randrange(1, 5)):
            prompts.append(list(ids))
            ids += [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
    brute = {tuple(p[:n]) for p in prompts for n in range(1, len(p) + 1)}
    assert M.distinct_tokens(prompts) == len(brute)


def test_the_pool_is_the_contexts_over_the_oversubscription_and_holds_the_longest():
    assert M.pool_tokens([1000, 1000, 1000, 1000], 4) == 1000
    assert M.pool_tokens([1000, 1000, 1000, 1000], 2) == 2000
    assert M.pool_tokens([3000, 100, 100], 4) == 3000


def test_failures_and_stalls_are_counted_and_left_out_of_the_latencies():
    turns = [
        M.Turn(0, 0, 0.0, 0.5, 1.0, 100, 40),
        M.Turn(0, 1, 2.0, 0.2, 70.0, 150, 100),
        M.Turn(1, 0, 0.5, None, 3.0, error="500: boom"),
    ]
    s = M.summarize(turns, ideal=200, stall_s=60)
    assert (s["failed"], s["stalled"], s["requests"]) == (1, 1, 3)
    assert s["prefilled_tokens"] == 60 + 50 and s["prefilled_over_ideal"] == pytest.approx(110 / 200)
    assert s["jct_s"] == pytest.approx(72.0)
    assert s["ttft_p99_s"] == 0.5 and s["ttft_p50_s"] == 0.2
