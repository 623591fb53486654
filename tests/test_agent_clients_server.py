"""Clients that send the whole history and no `sgl_memory` body field, on one real server with
pruning and KV memory on and `memory.window` set (SmolLM2-135M: the suite's second float32 server).

- The server's window is the client-side one: a full-history session, windowed by the server, must
  answer, retrieve and place exactly as a second session whose client sends the same turns itself,
  cut message by message (tests/test_memart_window.py's reference, rendered by the template) and in
  explicit memory mode, and a fact from turn 1 that left the window must come back as KV.
- Real clients from PyPI (the openai SDK, the OpenAI Agents SDK, LangGraph over LangChain's OpenAI
  chat model), as examples/framework_agents.py runs them, run multi-turn tool-using agents naming
  their session by the `x-session-id` header alone; the server's responses (read off the clients'
  HTTP transport) must show the session
  recognised: the system prompt reused from the tree, one QueryMemory turn more per request, and
  the windowed turns recalling the session's first fact from its memory.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from conftest import load_example
from servers import TEST_MODEL
from sgl_memory import models
from test_memart_window import reference

pytestmark = pytest.mark.server

WINDOW = 128
BUDGET = 96
SYSTEM = {"role": "system", "content": "You are a brief assistant."}
FACT = "My locker code is 4812. Please remember it."
TOPICS = ["rivers", "owls", "copper", "tea", "glaciers", "violins"]
QUESTION = "What is my locker code?"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))


@pytest.fixture(scope="module")
def server(fp32_b_server):
    config = fp32_b_server.get("/sgl_memory/info").json()["config"]
    memory = config["memory"]
    assert (config["intent"]["budget"], config["intent"]["query_tail"], memory["window"]) == (BUDGET, 16, WINDOW)
    assert (
        memory["block_size"],
        memory["top_k"],
        memory["cut"],
        memory["unit"],
        memory["placed_tokens"],
        memory["placement"],
    ) == (16, 8, "tokens", "block", 0, "after_system")
    return fp32_b_server


def generate(server, ids, field, n=8):
    r = server.post(
        "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}, "sgl_memory": field}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], out["meta_info"]["sgl_memory"]


def render(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def fact_in(metrics, tok) -> bool:
    """Whether the placed spans hold the fact's number from turn 1 (the pool's turn 0)."""
    turn_1 = render(tok, [SYSTEM, {"role": "user", "content": FACT}])
    code = tok.encode(" 4812", add_special_tokens=False)
    at = next(i for i in range(len(turn_1)) if turn_1[i : i + len(code)] == code)
    return any(turn == 0 and offset <= at < offset + n for turn, offset, n in metrics["retrieved_spans"])


def test_the_server_window_is_the_client_window_and_recalls_turn_1(server, tok):
    messages, windowed = [SYSTEM], 0
    for i, text in enumerate([FACT] + [f"Tell me one short fact about {t}." for t in TOPICS] + [QUESTION]):
        messages.append({"role": "user", "content": text})
        full = render(tok, messages)
        got, metrics = generate(server, full, {"session_id": "w", "tenant": "server"})
        kept = reference(tok, messages, WINDOW)
        if i > 0 and kept != full:  # the client's own cut, in explicit memory mode (the first request goes whole)
            want, ref = generate(server, kept, {"session_id": "w", "tenant": "client", "memory": {"mode": "retrieve"}})
            assert metrics["windowed_tokens"] == len(full) - len(kept) > 0
            for key in ("retrieved_blocks", "retrieved_spans", "memory_kv_tokens", "memory_blocks", "live_kv_tokens"):
                assert metrics[key] == ref[key], key
            windowed += 1
        else:
            want, ref = generate(server, full, {"session_id": "w", "tenant": "client"})
            assert "windowed_tokens" not in metrics and metrics.get("retrieved_blocks", 0) == 0
        assert got == want, (i, tok.decode(got), tok.decode(want))
        messages.append({"role": "assistant", "content": tok.decode(got, skip_special_tokens=True)})
    assert windowed >= 3
    assert FACT not in tok.decode(kept)  # the question's request left turn 1 out ...
    assert fact_in(metrics, tok), metrics["retrieved_spans"]  # ... and the memory placed it back


# --- real clients: examples/framework_agents.py, run as the example runs them --------------------


def assert_one_session_with_memory(responses: list[dict], last: int) -> None:
    """The server recognised one session in the client's requests; `last`: how many of them (at the
    end) answer the question about turn 1."""
    metrics = [r["sgl_memory"] for r in responses]
    # one QueryMemory turn more per request: every request reached the same session
    turns = [m["query_memory_turns"] for m in metrics]
    assert turns == list(range(turns[0], turns[0] + len(turns))), turns
    # from the second request on, the system prompt with the tool docs comes from the tree
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in responses[1:])
    # the history outgrew the window: later requests were cut and served from the session's memory,
    # and the question about turn 1 got turn 1 back as KV
    assert any(m.get("windowed_tokens") for m in metrics[:-last])
    assert any(m.get("windowed_tokens") and 0 in m["retrieved_turns"] for m in metrics[-last:]), metrics[-last:]


@pytest.mark.parametrize("framework, per_turn", [("openai", 2), ("agents-sdk", 1), ("langgraph", 1)])
def test_a_framework_agent_names_its_session_by_header_alone(server, framework, per_turn):
    """The openai SDK's loop makes two requests a turn (a required call, an answer from its result);
    the Agents SDK and LangGraph one (a required call whose result ends the turn)."""
    example = load_example("framework_agents")
    responses = example.FRAMEWORKS[framework](server.url, f"client-{framework}")
    assert len(responses) == len(example.TURNS) * per_turn
    assert_one_session_with_memory(responses, last=per_turn)
