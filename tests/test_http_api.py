"""The HTTP layer's rewrites, without a server (engine/http_api.py).

Sessions named by headers (`with_headers`), against the rules the README states: `x-session-id`
fills in a session id the `sgl_memory` field lacks (the field's own wins); `x-tenant-id` names the
tenant only where the operator allows it, and then a field naming another tenant is refused; every
value is checked like the field's, the message naming the header.

Streamed OpenAI responses (`MetricsChunk`): SGLang's server-sent events pass through unchanged,
however the body messages cut them, with one chunk more before `data: [DONE]` carrying the
request's metrics."""

from __future__ import annotations

import json
import re

import pytest

from sgl_memory.core import config
from sgl_memory.core.config import SessionSources
from sgl_memory.core.request import SpecError, parse
from sgl_memory.core.metrics import STATS
from sgl_memory.core.sessions import SessionRegistry
from sgl_memory.engine.http_api import MetricsChunk, list_sessions, session_page, with_chain, with_headers

DEFAULT, GATEWAY = SessionSources(), SessionSources(tenant_header=True)


def headers(**named) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in named.items()]


@pytest.mark.parametrize(
    "raw, hdrs, sources, want",
    [
        (None, {}, DEFAULT, None),  # nothing named anywhere: no field
        (None, {"x_session_id": "agent-1"}, DEFAULT, {"session_id": "agent-1"}),
        ({"budget": 64}, {"x_session_id": "agent-1"}, DEFAULT, {"budget": 64, "session_id": "agent-1"}),
        ({"session_id": "body"}, {"x_session_id": "header"}, DEFAULT, {"session_id": "body"}),
        (None, {"x_session_id": "a", "x_tenant_id": "t1"}, GATEWAY, {"session_id": "a", "tenant": "t1"}),
        ({"tenant": "t1"}, {"x_tenant_id": "t1"}, GATEWAY, {"tenant": "t1"}),
    ],
)
def test_the_sources_combine_as_documented(raw, hdrs, sources, want):
    got = with_headers(raw, headers(**hdrs), sources)
    assert got == want
    if want is not None:
        spec = parse(got)
        assert (spec.session_id, spec.tenant) == (want.get("session_id"), want.get("tenant"))


@pytest.mark.parametrize(
    "raw, hdrs, sources, message",
    [
        (None, {"x_session_id": "../etc"}, DEFAULT, "header x-session-id '../etc' is refused"),
        (None, {"x_session_id": "x" * 300}, DEFAULT, "header x-session-id must be a non-empty string"),
        (
            None,
            {"x_tenant_id": "t1"},
            DEFAULT,
            "header x-tenant-id: tenants named by a header are off on this server (sessions.tenant_header: false)",
        ),
        (
            {"tenant": "other"},
            {"x_tenant_id": "t1"},
            GATEWAY,
            "sgl_memory.tenant 'other' differs from header x-tenant-id 't1'",
        ),
        (None, {"x_tenant_id": "a b"}, GATEWAY, "header x-tenant-id 'a b' is refused"),
        (None, {"x_session_id": "a"}, SessionSources(session_header=False), "sessions.session_header: false"),
    ],
)
def test_bad_or_refused_headers_are_a_spec_error_naming_the_header(raw, hdrs, sources, message):
    with pytest.raises(SpecError) as exc:
        with_headers(raw, headers(**hdrs), sources)
    assert message in str(exc.value)


def test_a_header_given_twice_with_different_values_is_refused_and_case_does_not_matter():
    twice = [(b"X-Session-Id", b"a"), (b"x-session-id", b"b")]
    with pytest.raises(SpecError, match="given 2 times"):
        with_headers(None, twice, DEFAULT)
    assert with_headers(None, [(b"X-Session-Id", b"a"), (b"x-session-id", b"a")], DEFAULT) == {"session_id": "a"}


def test_a_field_that_is_not_an_object_is_left_for_the_parser_to_refuse():
    assert with_headers("s1", headers(x_session_id="a"), DEFAULT) == "s1"
    with pytest.raises(SpecError, match="must be an object"):
        parse("s1")


def test_the_config_section_is_read_and_checked(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("sessions:\n  tenant_header: true\n")
    cfg = config.load(path)
    assert cfg.sessions == GATEWAY
    assert cfg.as_dict()["sessions"] == {"session_header": True, "tenant_header": True, "response_chains": True}
    path.write_text("sessions:\n  tenant_headers: true\n")
    with pytest.raises(config.ConfigError, match="sessions.tenant_headers: unknown key"):
        config.load(path)
    assert config.MemoryConfig().sessions == DEFAULT


def sse(*chunks) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)


@pytest.mark.parametrize("cut", [None, 1, 7, 64])
def test_a_streamed_response_gets_its_metrics_in_one_chunk_before_done(cut):
    rid = "chatcmpl-test-stream"
    STATS.record(rid, {"live_kv_tokens": 42}, {"prompt_tokens": 10})
    head = {"id": rid, "object": "chat.completion.chunk", "created": 7, "model": "m"}
    chunks = [{**head, "choices": [{"index": 0, "delta": {"content": w}}]} for w in ("Hel", "lo")]
    stream = sse(*chunks, {**head, "choices": [], "usage": {"prompt_tokens": 10}}, b"[DONE]")
    parts = [stream] if cut is None else [stream[i : i + cut] for i in range(0, len(stream), cut)]
    rewriter = MetricsChunk()
    out = b"".join(rewriter.feed(p, last=False) for p in parts) + rewriter.feed(b"", last=True)
    want = sse(
        *chunks,
        {**head, "choices": [], "usage": {"prompt_tokens": 10}},
        {**head, "choices": [], "sgl_memory": {"live_kv_tokens": 42}},
        b"[DONE]",
    )
    assert out == want


@pytest.mark.parametrize("end", ["completed", "incomplete"])  # incomplete: at max_output_tokens
@pytest.mark.parametrize("cut", [None, 5, 33])
def test_a_streamed_responses_request_gets_its_metrics_in_its_last_event(cut, end):
    rid = "resp_test_stream"
    STATS.record(rid, {"retrieved_blocks": 3}, {"prompt_tokens": 10})
    created = {"type": "response.created", "response": {"id": rid, "status": "in_progress"}}
    delta = {"type": "response.output_text.delta", "delta": "Hi"}
    done = {"type": f"response.{end}", "response": {"id": rid, "status": end, "output": []}}
    events = lambda last: b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"  # noqa: E731
        for e in (created, delta, last)
    )
    stream = events(done)
    parts = [stream] if cut is None else [stream[i : i + cut] for i in range(0, len(stream), cut)]
    rewriter = MetricsChunk()
    out = b"".join(rewriter.feed(p, last=False) for p in parts) + rewriter.feed(b"", last=True)
    assert out == events({**done, "response": {**done["response"], "sgl_memory": {"retrieved_blocks": 3}}})


def test_a_stream_of_a_request_without_metrics_passes_unchanged():
    head = {"id": "cmpl-unknown", "object": "text_completion", "created": 7, "model": "m"}
    stream = sse({**head, "choices": [{"index": 0, "text": "x"}]}, b"[DONE]")
    rewriter = MetricsChunk()
    assert rewriter.feed(stream, last=True) == stream


def test_a_chain_of_responses_is_one_session_named_after_its_first():
    first = {"input": "hi"}
    raw = with_chain(None, first)
    root = first["request_id"]
    assert root.startswith("resp_") and "." not in root and raw == {"session_id": root}
    second = {"input": "more", "previous_response_id": root}
    assert with_chain(None, second) == {"session_id": root} and second["request_id"].startswith(root + ".")
    third = {"input": "again", "previous_response_id": second["request_id"]}
    assert with_chain({"budget": 64}, third) == {"budget": 64, "session_id": root}
    assert len({first["request_id"], second["request_id"], third["request_id"]}) == 3


def test_a_session_named_otherwise_wins_and_odd_ids_name_none():
    body = {"previous_response_id": "resp_abc"}
    assert with_chain({"session_id": "mine"}, body) == {"session_id": "mine"} and "request_id" not in body
    assert with_chain(None, {"request_id": "client/id"}) is None  # not an id a session can have
    assert with_chain(None, {"request_id": "client-7"}) == {"session_id": "client-7"}
    assert with_chain(None, {"previous_response_id": 5}) is None


SESSIONS = [
    {"tenant": None, "session_id": "a", "last_use": 1.0},
    {"tenant": "t1", "session_id": "b", "last_use": 3.0},
    {"tenant": "t1", "session_id": "c", "last_use": 2.0},
    {"tenant": "t2", "session_id": "d", "last_use": 4.0},
]


def test_the_inspector_pages_most_recent_first_and_filters_by_tenant():
    page = list_sessions(SESSIONS, None, 1, 2)
    assert page["total"] == 4 and [s["session_id"] for s in page["sessions"]] == ["b", "c"]
    assert [s["session_id"] for s in list_sessions(SESSIONS, "t1", 0, 100)["sessions"]] == ["b", "c"]
    assert [s["session_id"] for s in list_sessions(SESSIONS, "", 0, 100)["sessions"]] == ["a"]  # the default tenant
    assert list_sessions(SESSIONS, "t1", 5, 10) == {"total": 2, "offset": 5, "limit": 10, "sessions": []}


def test_the_inspectors_query_and_who_may_see_what():
    assert session_page({}, [], DEFAULT) == (None, 0, 100)
    assert session_page({"tenant": "t1", "offset": "3", "limit": "1000"}, [], DEFAULT) == ("t1", 3, 1000)
    assert session_page({}, headers(x_tenant_id="t1"), GATEWAY) == ("t1", 0, 100)  # limited to its own
    assert session_page({"tenant": "t1"}, headers(x_tenant_id="t1"), GATEWAY) == ("t1", 0, 100)
    with pytest.raises(PermissionError, match="limits this caller to tenant 't1'"):
        session_page({"tenant": "t2"}, headers(x_tenant_id="t1"), GATEWAY)
    with pytest.raises(SpecError, match="sessions.tenant_header: false"):
        session_page({}, headers(x_tenant_id="t1"), DEFAULT)
    for query, needle in (
        ({"limit": "0"}, "limit must be an integer from 1 to 1000"),
        ({"limit": "1001"}, "limit"),
        ({"offset": "-2"}, "offset must be an integer from 0 up"),
        ({"offset": "1e3"}, "offset"),
        ({"sort": "x"}, "unknown query parameter(s) sort"),
        ({"tenant": "a/b"}, "query parameter tenant"),
    ):
        with pytest.raises(SpecError, match=re.escape(needle)):
            session_page(query, [], DEFAULT)


def test_the_registry_snapshot_tells_last_use_without_counting_as_one():
    registry = SessionRegistry()
    registry.get(("", "a"), "m", lambda: 1)
    registry.get(("t", "b"), "m", lambda: 2)
    registry.get(("", "a"), "m")  # a use: "a" is now the most recent
    snap = registry.snapshot()
    assert [key for key, _, _ in snap] == [("t", "b"), ("", "a")] and snap[1][1] >= snap[0][1] > 0
    assert registry.snapshot() == snap  # reading it changed nothing
    registry.pop(("", "a"), "m")
    assert [key for key, _, _ in registry.snapshot()] == [("t", "b")]
