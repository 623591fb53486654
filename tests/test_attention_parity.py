"""Server level: greedy outputs of our CPU attention backend equal SGLang's torch_native backend,
both in float32: the suite's float32 server (its mechanisms act on no request here: none names a
session or exceeds intent's budget) against plain SGLang."""

from __future__ import annotations

import pytest

from greedy import REQUEST, parted_at

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
def servers(fp32_server, sglang_server):
    """Ours and the reference, float32 both (in bf16 a logit moves in steps of 0.125: ties flip on
    summation order)."""
    return fp32_server, sglang_server


def greedy(server, text):
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 12}, **REQUEST}
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_outputs_equal_torch_native(servers):
    """Greedy continuations agree token for token and in log-probability; where they part, it
    must be a tie to rounding on both servers (tests/greedy.py, float32's tolerance). In bf16 the
    cold 1.6k-token prompt parted at its second token, torch_native holding an exact tie there
    (-1.152 / -1.152) and ours a margin of 0.125: the failures seen under load were such flips."""
    server, reference_server = servers
    assert "sgl_memory_cpu" in server.get("/sgl_memory/info").json()["attention_backend"]
    cached = flips = 0
    for text in PROMPTS:
        ours = greedy(server, text)
        flips += parted_at(ours, greedy(reference_server, text), "float32", text[-40:]) is not None
        cached += ours["meta_info"]["cached_tokens"]
    assert flips <= 1, f"{flips} prompts parted from torch_native"
    assert cached > 2 * len(LONG) // 8  # the prefix paths were exercised, not only cold prefill
