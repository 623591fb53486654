"""IntentKV as a capacity lever in the real server: `intent.when: pressure` (the `pressure` server:
SmolLM2-135M, a pool of 1,536 tokens, a history budget of 64, persistence on).

While the pool holds what it is asked to, a session's turns are served whole, as on a server that
does not prune. Once the tree has evicted to make room, a turn prunes to its budget, and the
session's later turns prune too and reuse its pruned path (without pressure: the path a pruned
session leaves is one only a pruning turn follows). A session written whole and evicted is restored
from the store and then pruned. The references are the requests' own token counts: the prompt held
whole, the budget plus the forced set live after an event, the pruned path a radix hit.
"""

from __future__ import annotations

import pytest
import requests

pytestmark = pytest.mark.server

BUDGET, QUERY_TAIL = 64, 16  # the pressure server's intent section (history budget)
SYSTEM = {"role": "system", "content": "You are a careful agent."}


@pytest.fixture(scope="module")
def server(pressure_server):
    intent = pressure_server.get("/sgl_memory/info").json()["config"]["intent"]
    assert (intent["when"], intent["budget"], intent["budget_mode"]) == ("pressure", BUDGET, "history")
    return pressure_server


def log(tag: str, steps: int) -> str:
    return f"Task {tag}: track the files. " + " ".join(
        f"Step {i}: tool read file_{i % 7}.txt and returned code {i * 31 % 97}." for i in range(steps)
    )


def opening(tag: str) -> list[dict]:
    """An agent session's history: its task with a long tool log, acknowledged (what pruning drops
    from; the latest user message is forced)."""
    return [SYSTEM, {"role": "user", "content": log(tag, 25)}, {"role": "assistant", "content": "Noted."}]


def chat(server, messages, session_id=None, max_tokens=4):
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    headers = {"x-session-id": session_id} if session_id else {}  # an agent client names its session so
    r = requests.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def turn(server, messages, session_id, question):
    """One more user turn of a full-history client; returns the response and the messages after it."""
    messages = [*messages, {"role": "user", "content": question}]
    out = chat(server, messages, session_id)
    return out, [*messages, out["choices"][0]["message"]]


def test_turns_are_served_whole_until_the_tree_evicts_then_pruned_and_the_pruned_path_is_reused(server):
    whole, a = turn(server, opening("a"), "a", "Which file was read most often?")
    m = whole["sgl_memory"]
    assert (m["pruned_for"], m["compression_events"], m["budget"]) == (None, 0, None), str(m)
    assert m["live_kv_tokens"] == whole["usage"]["prompt_tokens"] + whole["usage"]["completion_tokens"]
    for i in range(3):  # unnamed work over the 1,536-token pool: the tree evicts, a's path among it
        chat(server, [SYSTEM, {"role": "user", "content": log(f"filler {i}", 30)}])

    pressed, b = turn(server, opening("b"), "b", "Which file was read most often?")
    m, usage = pressed["sgl_memory"], pressed["usage"]
    assert (m["pruned_for"], m["compression_events"]) == ("pressure", 1), str(m)
    assert m["budget"] > BUDGET and m["live_kv_tokens"] == m["budget"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] > m["budget"] + 200

    again, _ = turn(server, b, "b", "Which file was read last?")
    m = again["sgl_memory"]
    assert (m["pruned_for"], m["compression_events"]) == ("session", 1), str(m)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"]  # the pruned path

    # a, written whole and evicted since: restored from the store, then pruned as pressure asks
    back, _ = turn(server, a, "a", "Which file was read last?")
    m = back["sgl_memory"]
    assert m["restored_from"] in ("memory", "disk") and m["restored_tokens"] > 0, str(m)  # the warm or cold tier
    assert (m["pruned_for"], m["compression_events"]) == ("pressure", 1), str(m)
