"""Server level: greedy outputs of our CPU attention backend equal SGLang's torch_native backend."""

from __future__ import annotations

import pytest

from conftest import TEST_MODEL, start_server, stop_server

pytestmark = pytest.mark.server

LONG = "Notes from the agent's previous turns. " + " ".join(
    f"Step {i}: the tool returned status {i * 37 % 11} for file_{i % 9}.txt." for i in range(90)
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    LONG + " Summarise the statuses:",
    LONG + " Which file appeared most often?",  # shares LONG with the previous prompt: an extend over a cached prefix
    LONG + " Summarise the statuses:",  # a full hit
]


@pytest.fixture(scope="module")
def reference_server(tmp_path_factory):
    srv = start_server(TEST_MODEL, tmp_path_factory.mktemp("ref") / "server.log", "--attention-backend", "torch_native")
    yield srv
    stop_server(srv)


def greedy(server, text):
    r = server.post("/generate", {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 24}})
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_outputs_equal_torch_native(server, reference_server):
    assert "sgl_memory_cpu" in server.get("/sgl_memory/info").json()["attention_backend"]
    cached = 0
    for text in PROMPTS:
        ours, ref = greedy(server, text), greedy(reference_server, text)
        assert ours["output_ids"] == ref["output_ids"], text[-40:]
        cached += ours["meta_info"]["cached_tokens"]
    assert cached > 2 * len(LONG) // 8  # the prefix paths were exercised, not only cold prefill
