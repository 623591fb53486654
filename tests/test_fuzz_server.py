"""Property-based fuzzing of the real server's request surface (hypothesis).

Generated bodies for `/generate`, `/v1/chat/completions` and `/v1/completions`, with and without
the `sgl_memory` field (well-formed, mis-typed or random), against one server with intent pruning,
KV memory (its window too), KEEP, persistence and a plugin mechanism on (the suite's second
float32 server). Every answer must be a 200 or a 4xx that carries a message, never a 5xx or a dropped
connection, and the server must still serve a normal request afterwards.

The run is derandomized (a fixed seed) and bounded: SGLMEMORY_FUZZ_EXAMPLES examples per
endpoint (default 60). `scripts/fuzz.sh` runs a longer one. Generated token budgets stay small
(at most 3 new tokens, short prompts) so that a valid request costs a fraction of a second.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.server

EXAMPLES = int(os.environ.get("SGLMEMORY_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def fuzz_server(fp32_b_server):
    return fp32_b_server


# --- values --------------------------------------------------------------------------------------

text = st.text(st.characters(codec="utf-8"), max_size=60)  # NUL, surrogates excluded by the codec, emoji, RTL
words = st.lists(
    st.sampled_from(["agent", "tool", "file", "read", "the", "42", " ", "\n", "é", "<|im_start|>"]), max_size=40
).map("".join)
ints = st.one_of(st.integers(-3, 12), st.integers(-(2**70), 2**70), st.sampled_from([2**31, 2**63, 2**64, -(2**63)]))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True), text)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=12,
)


def either(good, bad=json_values):
    """Mostly a well-formed value, sometimes anything."""
    return st.one_of(good, good, good, bad)


# a malformed sampling_params that is never a dict: a dict without max_new_tokens means SGLang's
# default of 128 tokens, valid and slow
not_a_dict = st.one_of(scalars, st.lists(json_values, max_size=3))
# a token count that is wrong but never "until the context is full" (null), which is valid and slow
tokens = either(st.integers(0, 3), st.sampled_from([-1, 10**9, 2**64, "4", 2.5, [], {}]))


ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,20}", fullmatch=True)
memory_query = st.fixed_dictionaries(
    {},
    optional={
        "mode": either(st.sampled_from(["retrieve", "probe", "recall"])),
        "top_k": either(st.integers(0, 40)),
        "norm": either(st.sampled_from(["softmax", "rr"])),
        "store": either(st.booleans()),
        "probe": either(text),
    },
)
sgl_memory = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "session_id": either(ids),
            "tenant": either(ids),
            "budget": either(st.integers(1, 200)),
            "scorer": either(st.sampled_from(["memory", "query", "snapkv", "h2o", "streaming_llm", "random"])),
            "layout": either(st.sampled_from(["dead_slot", "compact"])),
            "memory": either(memory_query),
        },
    ),
    json_values,
)
maybe_field = st.one_of(st.just({}), st.builds(lambda v: {"sgl_memory": v}, sgl_memory))
sampling = st.fixed_dictionaries(
    {"max_new_tokens": tokens},
    optional={
        "temperature": either(st.floats(0, 2)),
        "top_p": either(st.floats(0, 1)),
        "n": either(st.integers(1, 2)),
        "stop": either(st.lists(words, max_size=2)),
        "ignore_eos": st.booleans(),
    },
)

generate_body = st.builds(
    lambda prompt, params, field, stream, extra: {**prompt, "sampling_params": params, **field, **stream, **extra},
    st.one_of(
        st.builds(lambda t: {"text": t}, st.one_of(words, text, st.lists(words, min_size=1, max_size=2))),
        st.builds(lambda t: {"input_ids": t}, st.lists(st.one_of(st.integers(0, 48000), ints), max_size=30)),
    ),
    either(sampling, not_a_dict),
    maybe_field,
    st.sampled_from([{}, {"stream": True}]),
    st.sampled_from([{}, {"extra_key": "\x00tenant:x"}, {"session_params": {"id": "nope"}}, {"return_logprob": True}]),
)
message = st.fixed_dictionaries(
    {
        "role": either(st.sampled_from(["system", "user", "assistant", "tool"])),
        "content": either(st.one_of(words, text)),
    }
)
chat_body = st.builds(
    lambda messages, tokens, field, stream: {
        "model": "default",
        "messages": messages,
        "max_tokens": tokens,
        **field,
        **stream,
    },
    either(st.lists(message, max_size=4)),
    tokens,
    maybe_field,
    st.sampled_from([{}, {"stream": True}]),
)
completion_body = st.builds(
    lambda prompt, tokens, field: {"model": "default", "prompt": prompt, "max_tokens": tokens, **field},
    either(st.one_of(words, st.lists(words, max_size=2), st.lists(st.integers(0, 48000), max_size=20))),
    tokens,
    maybe_field,
)


# --- the property --------------------------------------------------------------------------------


def answered_cleanly(server, path: str, body) -> None:
    r = server.post_raw(path, json.dumps(body).encode(), timeout=300)  # NaN and Infinity included, as Python sends them
    assert r.status_code < 500, f"{path} {r.status_code}: {r.text[:500]}\nbody: {body!r}"[:2000]
    if r.status_code >= 400:
        assert r.text.strip(), f"{path} {r.status_code} without a message"


@FUZZ
@given(body=generate_body)
def test_fuzzed_native_generate(fuzz_server, body):
    answered_cleanly(fuzz_server, "/generate", body)


@FUZZ
@given(body=chat_body)
def test_fuzzed_chat_completions(fuzz_server, body):
    answered_cleanly(fuzz_server, "/v1/chat/completions", body)


@FUZZ
@given(body=completion_body)
def test_fuzzed_completions(fuzz_server, body):
    answered_cleanly(fuzz_server, "/v1/completions", body)


def test_the_server_is_healthy_after_the_fuzzing(fuzz_server):
    assert fuzz_server.get("/health").status_code == 200
    # ignore_eos: a sampled first token may be the end of text, which says nothing about serving
    r = fuzz_server.post(
        "/generate", {"text": "Still serving?", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    )
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3, r.text
    log = fuzz_server.log()
    assert "Scheduler hit an exception" not in log and "memory leak detected" not in log and "double free" not in log
