"""SGLang's hint envelope (`kv_hints`, sglang/srt/managers/kv_hints.py), without a server: the HTTP
layer checks it as SGLang does and hands its actions over in the `sgl_memory` field; the persist
mechanism reads the actions it implements (RFC #27574's names) as its `agent` hints.

The reference for each action is the `agent` object it stands for (docs/requests.md's table): the
same request written with `sgl_memory.agent` parses to the same hints. The server honouring them:
tests/test_many_sessions_server.py."""

from __future__ import annotations

import re

import pytest

from sgl_memory.core.config import MemoryConfig
from sgl_memory.core.request import SpecError, parse
from sgl_memory.engine.http_api import NATIVE, OPENAI, with_kv_hints
from sgl_memory.persist.settings import PersistConfig

ON, OFF = MemoryConfig(), MemoryConfig(persist=PersistConfig(enabled=False))


def envelope(*actions: tuple[str, dict | None], version: str = "1") -> dict:
    return {
        "protocol_version": "1",
        "message_id": "m-1",
        "actions": [
            {
                "action_id": f"a{i}",
                "action_type": kind,
                "action_version": version,
                **({} if p is None else {"payload": p}),
            }
            for i, (kind, p) in enumerate(actions)
        ],
    }


def hints(raw: dict | None):
    return parse(raw).part("persist")


@pytest.mark.parametrize(
    "actions, agent",
    [
        ([("retain", {"ttl_ms": 60_000})], {"cache_ttl_ms": 60_000}),
        ([("pin", {"ttl_ms": 5_000})], {"cache_ttl_ms": 5_000}),
        ([("retain", {"ttl_ms": 1_000}), ("pin", {"ttl_ms": 9_000})], {"cache_ttl_ms": 9_000}),  # the longest keep
        ([("prefetch", {"in_ms": 1_500})], {"expected_tool_duration_ms": 1_500}),
        ([("demote", None)], {"demote": True}),
        ([("demote", {})], {"demote": True}),
        ([("done", None)], {"done": True}),
        ([("share", {"with": "x"}), ("done", None)], {"done": True}),  # a type not implemented: ignored
    ],
)
@pytest.mark.parametrize("path", [NATIVE, *OPENAI])
def test_each_action_is_the_agent_hint_it_names_on_every_route(actions, agent, path):
    body = {"kv_hints": envelope(*actions)}
    raw = with_kv_hints({"session_id": "s"}, body, path, ON)
    assert hints(raw) == hints({"session_id": "s", "agent": agent})
    # /generate keeps the envelope (SGLang carries it to the scheduler's request); an OpenAI body has no such field
    assert ("kv_hints" in body) == (path == NATIVE)


def test_the_agent_object_wins_where_both_say_and_the_envelope_fills_in_the_rest():
    raw = with_kv_hints(
        {"session_id": "s", "agent": {"cache_ttl_ms": 100}},
        {"kv_hints": envelope(("retain", {"ttl_ms": 9_000}), ("prefetch", {"in_ms": 700}))},
        NATIVE,
        ON,
    )
    assert hints(raw) == hints({"agent": {"cache_ttl_ms": 100, "expected_tool_duration_ms": 700}})


@pytest.mark.parametrize(
    "actions, field",
    [
        ([("retain", {})], "kv_hints.actions[0].payload.ttl_ms is required"),
        ([("pin", {"ttl_ms": 0})], "kv_hints.actions[0].payload.ttl_ms must be an integer"),
        ([("pin", {"ttl_ms": 1.5})], "kv_hints.actions[0].payload.ttl_ms must be an integer"),
        ([("retain", {"ttl_ms": True})], "kv_hints.actions[0].payload.ttl_ms must be an integer"),
        ([("done", None), ("prefetch", {"in_ms": "soon"})], "kv_hints.actions[1].payload.in_ms must be an integer"),
        ([("prefetch", {"in_ms": -1})], "kv_hints.actions[0].payload.in_ms must be an integer"),
        ([("demote", {"now": True})], "kv_hints.actions[0].payload: unknown field(s) now"),
        ([("retain", {"ttl_ms": 10, "tier": "gpu"})], "kv_hints.actions[0].payload: unknown field(s) tier"),
    ],
)
def test_a_payload_of_the_wrong_shape_is_refused_naming_the_field(actions, field):
    raw = with_kv_hints({"session_id": "s"}, {"kv_hints": envelope(*actions)}, NATIVE, ON)
    with pytest.raises(SpecError, match=re.escape(field)):
        parse(raw)


def test_another_version_of_a_known_action_is_ignored():
    raw = with_kv_hints({"session_id": "s"}, {"kv_hints": envelope(("retain", {"ttl": "x"}), version="2")}, NATIVE, ON)
    assert hints(raw) is None


@pytest.mark.parametrize(
    "value, message",
    [
        ({"message_id": "m", "actions": []}, "protocol_version"),  # SGLang's envelope requires it
        ({"protocol_version": "1", "message_id": "m", "actions": [{"action_type": "done"}]}, "action_id"),
        ("retain", "Malformed kv_hints"),
        ([envelope(("done", None))], "one envelope per request"),
    ],
)
def test_a_malformed_envelope_is_refused_as_sglang_refuses_it(value, message):
    with pytest.raises(SpecError, match=message):
        with_kv_hints(None, {"kv_hints": value}, NATIVE, ON)


def test_a_server_that_implements_no_action_ignores_the_envelope_but_still_checks_it():
    body = {"kv_hints": envelope(("retain", {"ttl_ms": 5}))}
    assert with_kv_hints({"session_id": "s"}, body, OPENAI[0], OFF) == {"session_id": "s"}
    assert "kv_hints" not in body  # read, and not passed on to SGLang's OpenAI request
    with pytest.raises(SpecError):
        with_kv_hints(None, {"kv_hints": {"actions": 3}}, NATIVE, OFF)


@pytest.mark.parametrize("body", [{}, {"kv_hints": envelope(("done", None))}])
def test_the_fields_own_key_is_not_a_second_way_in(body):
    with pytest.raises(SpecError, match="the server's own key"):
        with_kv_hints({"session_id": "s", "kv_hints": [{"type": "done", "version": "1"}]}, body, NATIVE, ON)
