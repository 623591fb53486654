"""Inputs an attacker would send, against the real server started the README's way (SmolLM2, no
sgl-memory mechanism on): every one is a 4xx with a message, and the server keeps serving.

Regression tests for issue 13's defects 1 (empty prompts killed the server), 2 (deeply nested
JSON was a 500), 5 (a client's `extra_key` could forge a tenant's radix namespace) and 6 (pruning
fields on a server without pruning were silently ignored)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.server

GREEDY = {"temperature": 0, "max_new_tokens": 2}


@pytest.fixture(scope="module")
def server(plain_server):
    return plain_server


def healthy(server) -> None:
    assert server.get("/health").status_code == 200
    r = server.post("/generate", {"text": "Still serving?", "sampling_params": GREEDY})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text


def message(r) -> str:
    body = r.json()
    return str(body.get("message") or body.get("error", {}).get("message") or body)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/generate", {"text": "", "sampling_params": GREEDY}),
        ("/generate", {"input_ids": [], "sampling_params": GREEDY}),
        ("/generate", {"text": ["A prompt.", ""], "sampling_params": GREEDY}),
        ("/generate", {"input_ids": [[1, 2, 3], []], "sampling_params": GREEDY}),
        ("/generate", {"text": "", "sampling_params": GREEDY, "sgl_memory": {"session_id": "empty"}}),
        ("/v1/completions", {"model": "default", "prompt": "", "max_tokens": 2}),
        ("/v1/completions", {"model": "default", "prompt": ["A prompt.", ""], "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "default", "messages": [], "max_tokens": 2}),
    ],
)
def test_an_empty_prompt_is_a_400_not_a_dead_server(server, path, body):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    assert "empty" in message(r).lower()
    healthy(server)


@pytest.mark.parametrize("ids", [[1, 2, -1], [1, 2, 10**6], [[5, 6], [7, 49152]]])
def test_a_token_id_outside_the_vocabulary_is_a_400_not_a_dead_server(server, ids):
    """Found by tests/test_fuzz_server.py: the embedding lookup crashed the scheduler."""
    r = server.post("/generate", {"input_ids": ids, "sampling_params": GREEDY})
    assert r.status_code == 400, r.text
    assert "outside the vocabulary" in message(r)
    healthy(server)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/completions"])
def test_json_nested_too_deeply_is_a_400(server, path):
    r = server.post_raw(path, nested(100_000).encode())
    assert r.status_code == 400, r.text
    assert "nested too deeply" in message(r)
    # nested as deep as the parser allows, inside a field SGLang validates: its own 400
    body = '{"text": "hi", "sampling_params": {"max_new_tokens": 2}, "lora_path": ' + nested(900) + "}"
    assert server.post_raw("/generate", body.encode()).status_code == 400
    healthy(server)


def test_a_body_over_the_cap_is_a_413(server):
    from sgl_memory.engine.http_api import MAX_BODY_BYTES

    r = server.post_raw("/generate", b'{"text": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}')
    assert r.status_code == 413, r.text
    healthy(server)


LEDGER = "Ledger of one tenant. " + " ".join(
    f"Entry {i}: account {i * 7919 % 1000} holds {i * 31 % 97} coins." for i in range(50)
)


def cached(server, **fields) -> int:
    r = server.post("/generate", {"text": LEDGER, "sampling_params": GREEDY, **fields})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


def test_a_client_extra_key_cannot_reach_a_tenants_namespace(server):
    tenant = {"sgl_memory": {"tenant": "victim"}}
    cached(server, **tenant)
    assert cached(server, **tenant) > 300  # the tenant's own path is cached
    for forged in ("\x00tenant:victim", "\\0tenant:victim", "\x00tenant:victim\x00", "x\x00tenant:victim"):
        assert cached(server, extra_key=forged) == 0, forged
        assert cached(server, extra_key=forged, sgl_memory={"tenant": "other"}) == 0, forged
    # a client's own extra_key still namespaces its requests, as in plain SGLang
    assert cached(server, extra_key="mine") == 0 and cached(server, extra_key="mine") > 300


@pytest.mark.parametrize(
    "field, key",
    [
        ({"budget": 64}, "intent.enabled"),
        ({"scorer": "snapkv"}, "intent.enabled"),
        ({"layout": "compact", "session_id": "s"}, "intent.enabled"),
        ({"session_id": "s", "memory": {"mode": "retrieve"}}, "memory.enabled"),
    ],
)
@pytest.mark.parametrize("api", ["native", "openai", "responses"])
def test_asking_for_a_mechanism_the_server_runs_without_is_a_400(server, field, key, api):
    if api == "native":
        r = server.post("/generate", {"text": "Prune me.", "sampling_params": GREEDY, "sgl_memory": field})
    elif api == "responses":
        r = server.post("/v1/responses", {"input": "Prune me.", "max_output_tokens": 4, "sgl_memory": field})
    else:
        r = server.post(
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": [{"role": "user", "content": "Prune me."}],
                "max_tokens": 2,
                "sgl_memory": field,
            },
        )
    assert r.status_code == 400, r.text
    assert key in message(r)
    # naming a session or a tenant asks for nothing a plain server lacks
    r = server.post(
        "/generate", {"text": "Hi.", "sampling_params": GREEDY, "sgl_memory": {"session_id": "s", "tenant": "t"}}
    )
    assert r.status_code == 200, r.text
