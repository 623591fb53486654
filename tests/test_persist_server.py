"""Persistent session KV inside the real server (SmolLM2-135M, persistence on, the pool in the dtype
the launcher picks for this CPU).

The reference for a restarted session is the same conversation on a server that never restarted:
with unquantized storage in the pool's own dtype (bf16 or fp32) the restored KV is bit-identical,
so greedy answers must be equal (the quantized formats: tests/test_persist_restore_answers.py).
The restart: the suite's `all` server runs the conversations, and their session files go into the
store of its second server, `all_b` (the same configuration, a store of its own, which never saw
these sessions), as a restarted server finds them on disk. Faults are produced for real: files
damaged on disk, a server SIGKILLed while its writer has a temporary file open, a file-size limit
(the write fails as on a full disk), a directory that cannot be created. The fault server (the
suite's `paged` one) runs at page size 16 (the GPU default): what it restores is cut to whole pages."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from servers import EXACT_QUANT
from sgl_memory.persist.layout import digest
from sgl_memory.persist.store import CacheSpec, SessionFiles

pytestmark = pytest.mark.server

CONVERSATIONS = [
    ["Name one large sea.", "Which countries border it?", "What is its deepest point?"],
    ["Give me a word that rhymes with cat.", "Use it in a sentence.", "Now make the sentence longer."],
    ["What is 12 plus 30?", "Multiply that by two.", "Is the result even?"],
    ["Suggest a name for a grey cat.", "Why that name?", "Suggest one more."],
]
SYSTEM = {"role": "system", "content": "You are a brief, helpful assistant."}
PAGE = 16  # the fault server's page size


# Persistence alone on the server with every mechanism on: intent and SentenceKV left out of a request
# whose cached tokens are counted (each prefills the rows it reads itself: the latest message, the
# last 32 rows)
ALONE = {"intent": False, "sentencekv": {"enabled": False}}


def chat(server, messages, session_id=None, tenant=None, max_tokens=8, **field):
    memory = {k: v for k, v in (("session_id", session_id), ("tenant", tenant)) if v} | field
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "sgl_memory": memory}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"], out.get("sgl_memory")


def run_turns(server, user_turns, session_id, tenant=None, **field):
    """Turns of one conversation; returns [(answer, usage, metrics)] per turn."""
    messages, results = [SYSTEM], []
    for text in user_turns:
        messages.append({"role": "user", "content": text})
        answer, usage, metrics = chat(server, messages, session_id, tenant, **field)
        messages.append({"role": "assistant", "content": answer})
        results.append((answer, usage, metrics))
    return results


def history(user_turns, answers):
    messages = [SYSTEM]
    for text, answer in zip(user_turns, answers):
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
    return messages


def flush(server):
    """Empty the tree; the store's writer finishes every captured turn first."""
    assert server.post("/flush_cache?timeout=60", {}).status_code == 200


def session_file_of(store: Path, tenant: str, session_id: str) -> Path:
    return next(
        iter(store.glob(f"{digest('tenant', tenant)}/*/{digest('session', session_id)}.safetensors")),
        store / "absent",
    )


def session_file(store: Path, session_id: str) -> Path:
    found = list(store.glob(f"*/*/{digest('session', session_id)}.safetensors"))
    assert len(found) <= 1
    return found[0] if found else store / "absent"


# --- restart --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def restarted(all_server, all_b_server, pool):
    """Server A runs every conversation to its end (the reference) and a copy of each to its second
    turn, persistence alone (ALONE); the copies' files go into server B's store. Each copy is its
    own tenant, so no copy reuses another's KV through the tree and every copy computes the same
    tokens the same way.
    Returns (B, B's store, reference answers, {copy tenant: per conversation [(answer, usage)]})."""
    a, b = all_server, all_b_server
    reference = [
        [t[0] for t in run_turns(a, conv, f"s{i}", tenant="ref", **ALONE)] for i, conv in enumerate(CONVERSATIONS)
    ]
    copies = {"rs": [run_turns(a, conv[:2], f"s{i}", tenant="rs", **ALONE) for i, conv in enumerate(CONVERSATIONS)]}
    copies["ta"] = [run_turns(a, CONVERSATIONS[0][:2], "shared", tenant="ta", **ALONE)]
    flush(a)  # every turn is written
    pool.copy_sessions(a, b, *copies)
    # B takes tenants from x-tenant-id (a gateway in front sets it): the header tests below
    assert b.get("/sgl_memory/info").json()["config"]["sessions"]["tenant_header"] is True
    return b, b.dir / "store", reference, copies


def third_turn(i, turns):
    """The third request of conversation i, after the copy's own first two turns."""
    conv = CONVERSATIONS[i]
    return history(conv[:2], [answer for answer, _, _ in turns]) + [{"role": "user", "content": conv[2]}]


def test_exact_restart_prefills_only_new_tokens_and_answers_like_a_server_that_never_restarted(restarted):
    b, _, reference, copies = restarted
    for i, turns in enumerate(copies["rs"]):
        assert [t[0] for t in turns] == reference[i][:2]  # the copy computed what the reference did
        answer, usage, metrics = chat(b, third_turn(i, turns), f"s{i}", tenant="rs", **ALONE)
        assert metrics["restored_from"] == "disk" and metrics["restored_tokens"] > 0, (i, metrics, usage)
        assert metrics["restore_ms"] > 0 and metrics["text_match"] in ("extend", "exact", "diverge")
        # the stored history is the whole second turn, its prompt and its answer (the answer's last
        # token has no KV yet); conversations restored before this one share the system prompt
        second = turns[1][1]
        assert (
            usage["prompt_tokens_details"]["cached_tokens"] >= second["prompt_tokens"] + second["completion_tokens"] - 1
        )
        assert answer == reference[i][2]


def test_tenants_with_identical_prompts_never_share_a_file_or_a_load(restarted):
    b, store, _, copies = restarted
    messages = third_turn(0, copies["ta"][0])
    _, usage, other = chat(b, messages, "shared", tenant="tb")
    assert other["restored_tokens"] == 0 and other["text_match"] is None  # tb has no stored session
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # nor the tree's copy of anyone else's
    _, _, own = chat(b, messages, "shared", tenant="ta")
    assert own["restored_from"] == "disk" and own["restored_tokens"] > 0
    flush(b)
    files = [p for p in store.glob("*/*/*.safetensors") if p.name == f"{digest('session', 'shared')}.safetensors"]
    assert len(files) == 2 and files[0].parent.parent != files[1].parent.parent


def test_prometheus_counts_restores_and_the_store_size(restarted):
    """GET /metrics against what the response reported and what lies on disk."""
    b, store, _, copies = restarted
    flush(b)  # the tree is empty: the turn below restores its session
    before = b.prometheus()
    t0 = time.perf_counter()
    _, _, metrics = chat(b, third_turn(1, copies["rs"][1]), "s1", tenant="rs")
    wall_ms = (time.perf_counter() - t0) * 1000
    flush(b)  # its own turn is written: the store gauge is set after every write
    after = b.prometheus()
    assert metrics["restored_tokens"] > 0
    # where its wait went: each part once in the histogram, as the response said; together no more
    # than the client waited for the whole answer, and its prefill took some of it
    parts = {
        "deferred": "restore_deferred_ms",
        "restore": "restore_ms",
        "queued": "queued_ms",
        "prefill": "turn_prefill_ms",
    }
    assert metrics["turn_prefill_ms"] > 0 and metrics["queued_ms"] >= 0, metrics
    assert sum(metrics[key] for key in parts.values()) <= wall_ms, (metrics, wall_ms)
    for part, key in parts.items():
        label = (("part", part),)
        for series, value in (("_count", 1), ("_sum", metrics[key] / 1000)):
            name = "sgl_memory_turn_wait_seconds" + series
            assert after[(name, label)] - before.get((name, label), 0) == pytest.approx(value, abs=1e-6), part
    source = (("source", metrics["restored_from"]),)
    assert after[("sgl_memory_restores_total", source)] - before.get(("sgl_memory_restores_total", source), 0) == 1
    assert (
        after[("sgl_memory_restored_tokens_total", ())] - before.get(("sgl_memory_restored_tokens_total", ()), 0)
        == metrics["restored_tokens"]
    )
    assert after[("sgl_memory_store_bytes", ())] == disk_bytes(store)  # heads and chunks, each file once
    persisted = ("sgl_memory_requests_total", (("mechanism", "persist"),))
    assert after[persisted] == before.get(persisted, 0) + 1


def disk_bytes(store: Path) -> int:
    """What the store takes on disk: each file once, however many sessions link it."""
    files = [p.stat() for p in store.glob("*/*/*")]
    return sum({(f.st_dev, f.st_ino): f.st_size for f in files}.values())


def test_sessions_that_open_alike_store_the_blocks_they_share_once(restarted, all_server, pool):
    """Two sessions of one tenant open with the same long system prompt (an agent's tool
    definitions): the second reads the first's KV in the tree, so the store's full blocks of it are
    one file on disk that both sessions' heads link; the store's bytes count it once. A server that
    never held them (`all`, the same configuration) finds the files on disk and answers their next
    turns as the server that wrote them did from its tree."""
    b, store, _, _ = restarted
    tools = {"role": "system", "content": long_text("tools", 60)}  # about 670 tokens: two full blocks
    turns = {}
    for sid, question in (("blk-a", "Which entry is last?"), ("blk-b", "Which entry is first?")):
        messages = [tools, {"role": "user", "content": question}]
        answer, usage, _ = chat(b, messages, sid, tenant="blk", max_tokens=8, **ALONE)
        turns[sid] = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    reference = {sid: chat(b, m, sid, tenant="blk", max_tokens=8, **ALONE) for sid, m in turns.items()}
    flush(b)  # every turn written
    chunks = [
        {p.stat().st_ino for p in store.glob(f"*/*/{session_file_of(store, 'blk', s).stem}.*.chunk")} for s in turns
    ]
    shared = chunks[0] & chunks[1]
    assert len(shared) >= 2, chunks  # the system prompt's full blocks
    linked = [p for p in store.glob("*/*/*.chunk") if p.stat().st_ino in shared]
    assert all(p.stat().st_nlink == 3 for p in linked)  # the store's copy and each session's link
    assert disk_bytes(store) < sum(p.stat().st_size for p in store.glob("*/*/*"))
    pool.copy_sessions(b, all_server, "blk")
    for sid, messages in turns.items():
        answer, usage, metrics = chat(all_server, messages, sid, tenant="blk", max_tokens=8, **ALONE)
        assert metrics["restored_from"] == "disk" and metrics["restored_tokens"] > 0, metrics
        assert answer == reference[sid][0]
        cached = reference[sid][1]["prompt_tokens_details"]["cached_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= cached, (usage, reference[sid][1])


def test_an_openai_client_names_its_session_by_header_alone(restarted):
    """The `openai` SDK as an agent framework drives it: no `sgl_memory` field, the session in the
    `x-session-id` header. The session's turn is stored under that id and its next turn matches
    it; a streamed turn's metrics come in its last chunk and its answer is the one the same request
    gets unstreamed; the field's own id wins over the header's; the x-tenant-id header (on for this
    server) names the tenant's own file; a bad id, or a field naming another tenant than the
    header, is a 400 naming the header.

    The streamed request's reference is the same request unstreamed, sent just before it: both
    then find the same prefix in the tree and prefill the same rows. The session's first answer
    is no reference: that request prefilled more of the prompt, and a prefill of other rows rounds
    otherwise in bf16, which flipped the small model's near-tie first token on an AVX512-BF16 CPU
    ("The planet I'm" against "One planet is Europa")."""
    from openai import BadRequestError, OpenAI

    b, store, _, _ = restarted
    client = OpenAI(base_url=b.url + "/v1", api_key="none", default_headers={"x-session-id": "hdr-1"})

    def ask(text, history=(), **extra):
        messages = [SYSTEM, *history, {"role": "user", "content": text}]
        return client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0, **extra)

    def persisted(response) -> dict:
        return (response.model_extra or {}).get("sgl_memory") or {}

    first = ask("Name one planet.")
    assert "text_match" in persisted(first) and persisted(first)["text_match"] is None  # a new session
    said = [
        {"role": "user", "content": "Name one planet."},
        {"role": "assistant", "content": first.choices[0].message.content},
    ]
    assert persisted(ask("And one moon?", said))["text_match"] in ("extend", "exact")  # its next turn
    # streamed: the metrics come in the last chunk (no choices), the answer is the unstreamed one's
    again = ask("Name one planet.")
    chunks = list(ask("Name one planet.", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == again.choices[0].message.content
    assert not chunks[-1].choices and "text_match" in persisted(chunks[-1])
    assert not any(persisted(c) for c in chunks[:-1])
    ask("Name one moon.", extra_body={"sgl_memory": {"session_id": "hdr-2"}})
    flush(b)
    assert session_file(store, "hdr-1").exists() and session_file(store, "hdr-2").exists()
    ask("Name one star.", extra_headers={"x-tenant-id": "acme"})
    flush(b)
    assert session_file_of(store, "", "hdr-1").exists() and session_file_of(store, "acme", "hdr-1").exists()
    refused = (
        ({"x-session-id": "../up"}, {}, "header x-session-id '../up' is refused"),
        ({"x-tenant-id": "acme"}, {"sgl_memory": {"tenant": "other"}}, "differs from header x-tenant-id 'acme'"),
    )
    for headers, body, needle in refused:
        with pytest.raises(BadRequestError, match=re.escape(needle)):
            ask("Hello?", extra_headers=headers, extra_body=body)
    assert ask("Still there?").choices[0].message.content


def test_the_session_inspector_pages_sessions_and_keeps_a_tenant_to_its_own(restarted):
    """GET /sgl_memory/sessions: every session the server holds, most recently used first, sizes
    and no contents; a caller whose gateway names its tenant sees that tenant's sessions only, and
    asking for another's is a 403; bad paging is a 400 naming the parameter."""
    b, store, _, _ = restarted
    run_turns(b, ["Name one bird."], "insp-a", tenant="insp")
    run_turns(b, ["Name one fish."], "insp-b", tenant="insp")
    flush(b)
    everything = b.get("/sgl_memory/sessions?limit=1000").json()
    rows = {(s["tenant"], s["session_id"]): s for s in everything["sessions"]}
    assert everything["total"] == len(rows) >= 2 and {("insp", "insp-a"), ("insp", "insp-b")} <= set(rows)
    assert [s["last_use"] for s in everything["sessions"]] == sorted(
        (s["last_use"] for s in everything["sessions"]), reverse=True
    )
    for sid in ("insp-a", "insp-b"):
        row = rows[("insp", sid)]
        assert row["path_tokens"] > 0 and row["live_tokens"] == row["path_tokens"]
        head = session_file_of(store, "insp", sid)
        assert row["stored_bytes"] == sum(p.stat().st_size for p in [head, *head.parent.glob(f"{head.stem}.*.chunk")])
        assert not {"tokens", "text", "keys"} & set(row)
    # SGLang's own internal-state readers (GET /server_info, which routers and dashboards poll) get
    # SGLang's answer alone: the sessions and the tree's walk are paid for by their own endpoints
    (state,) = b.get("/server_info").json()["internal_states"]
    assert state and not {"sgl_memory_sessions", "sgl_memory_integrity"} & set(state), sorted(state)
    # a tenant's caller: its own sessions, paged
    own = requests.get(b.url + "/sgl_memory/sessions?limit=1", headers={"x-tenant-id": "insp"}).json()
    assert own["total"] == 2 and [s["session_id"] for s in own["sessions"]] == ["insp-b"]
    second = requests.get(b.url + "/sgl_memory/sessions?limit=1&offset=1", headers={"x-tenant-id": "insp"}).json()
    assert [s["session_id"] for s in second["sessions"]] == ["insp-a"]
    other = requests.get(b.url + "/sgl_memory/sessions?tenant=rs", headers={"x-tenant-id": "insp"})
    assert other.status_code == 403 and "limits this caller to tenant 'insp'" in other.text
    for query, needle in (
        ("limit=0", "limit must be an integer from 1 to 1000"),
        ("offset=-1", "offset must be"),
        ("limit=abc", "limit must be"),
        ("page=2", "unknown query parameter(s) page"),
        ("tenant=..", "query parameter tenant '..' is refused"),
    ):
        r = b.get(f"/sgl_memory/sessions?{query}")
        assert r.status_code == 400 and needle in r.text, (query, r.text)


def test_a_chain_of_responses_is_one_session(restarted):
    """/v1/responses through the `openai` SDK, no field, no header: each response names the one
    before; the chain is stored as one session named after its first response, and each later
    response's prompt (SGLang resends the chain's history) matches it."""
    from openai import OpenAI

    b, store, _, _ = restarted
    client = OpenAI(base_url=b.url + "/v1", api_key="none")
    model = client.models.list().data[0].id  # the Responses API refuses a model name the server does not serve
    first = client.responses.create(model=model, input="Name one river.", max_output_tokens=4, temperature=0)
    second = client.responses.create(
        model=model, input="And one lake?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    third = client.responses.create(
        model=model, input="And a sea?", previous_response_id=second.id, max_output_tokens=4, temperature=0
    )
    assert second.id.startswith(first.id + ".") and third.id.startswith(first.id + ".")
    for later in (second, third):
        assert (later.model_extra or {}).get("sgl_memory", {}).get("text_match") in ("extend", "exact"), (
            later.model_extra
        )
    # streamed, the metrics come in the last event's response (incomplete: max_output_tokens ends it)
    events = list(
        client.responses.create(
            model=model,
            input="And a bay?",
            previous_response_id=third.id,
            max_output_tokens=4,
            temperature=0,
            stream=True,
        )
    )
    last = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete") and last.id.startswith(first.id + ".")
    assert (last.model_extra or {}).get("sgl_memory", {}).get("text_match") in ("extend", "exact"), last.model_extra
    flush(b)
    assert session_file(store, first.id).exists()
    assert not session_file(store, second.id).exists() and not session_file(store, third.id).exists()


@pytest.mark.parametrize(
    "memory",
    [
        {"session_id": "../../etc/passwd"},
        {"session_id": "a/b"},
        {"session_id": "ok", "tenant": ".."},
        {"session_id": "x\x00y"},
    ],
)
def test_ids_crafted_to_escape_the_store_are_refused(restarted, memory):
    b, store, _, _ = restarted
    flush(b)
    before = sorted(p for p in store.rglob("*") if p.is_file())
    body = {
        "model": "m",
        "messages": [SYSTEM, {"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "sgl_memory": memory,
    }
    r = b.post("/v1/chat/completions", body)
    assert r.status_code == 400 and "is refused" in r.text
    flush(b)
    assert sorted(p for p in store.rglob("*") if p.is_file()) == before
    assert chat(b, [SYSTEM, {"role": "user", "content": "hi"}], "fine")[0]  # still serving


# --- faults ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fault_server(paged_server):
    """Page size 16, an exact store with no warm tier (every restore reads the file), a pool of 3008
    tokens (eviction)."""
    persist = paged_server.get("/sgl_memory/info").json()["config"]["persist"]
    assert (persist["quant"], persist["warm_bytes"]) == (EXACT_QUANT, 0)
    return paged_server, paged_server.dir, paged_server.dir / "store"


def long_text(tag: str, n: int) -> str:
    return f"Log {tag}: " + " ".join(f"entry {i} of {tag} is {i * 37 % 101}." for i in range(n))


def test_damaged_or_foreign_files_are_refused_and_the_turn_is_prefilled(fault_server):
    server, _, store = fault_server
    first = {}
    for kind in ("corrupt", "truncated", "foreign"):
        first[kind] = run_turns(server, [f"Remember the word {kind}."], f"d-{kind}")[0]
    flush(server)
    corrupt = session_file(store, "d-corrupt")
    data = bytearray(corrupt.read_bytes())
    data[-200] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    truncated = session_file(store, "d-truncated")
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    # a well-formed file of another model (other head count) under this session's name
    other = CacheSpec("another-model", "0" * 32, 30, 4, 64, "bfloat16", 1)
    files = SessionFiles(store.parent / "other-store", other, quant="bf16")
    kv = torch.zeros(30, 8, 4, 64)
    files.write(None, "d-foreign", files.record(range(8), "x", kv, kv))
    session_file(store, "d-foreign").write_bytes(files.path(None, "d-foreign").read_bytes())
    for kind, needle in (("corrupt", "checksum mismatch"), ("truncated", "unreadable"), ("foreign", "another model")):
        messages = history([f"Remember the word {kind}."], [first[kind][0]]) + [
            {"role": "user", "content": "Which word?"}
        ]
        answer, usage, metrics = chat(server, messages, f"d-{kind}")
        assert needle in (metrics["persist_refused"] or ""), metrics
        # prefilled: at most the system prompt, shared with the other sessions' turns, is cached
        assert (
            metrics["restored_tokens"] == 0
            and usage["prompt_tokens_details"]["cached_tokens"] < first[kind][1]["prompt_tokens"]
        )
        assert answer
    log = server.log()
    assert log.count("refused the file of session") >= 3 and "served by normal prefill" in log


def test_a_session_evicted_from_the_tree_is_restored_from_disk_in_whole_pages(fault_server):
    """The reference is the same turn while the tree still held the first (under another tenant: its
    own path): the tree reuses whole pages of it, the restore puts back whole pages, so both prefill
    the same rows from the same KV and answer alike."""
    server, _, _ = fault_server
    turns = [long_text("ev", 40) + " Summarise the log in one line."]
    ((answer, usage, _),) = run_turns(server, turns, "ev")
    messages = history(turns, [answer]) + [{"role": "user", "content": "And the first entry?"}]
    run_turns(server, turns, "ev", tenant="hot")
    hot, hot_usage, _ = chat(server, messages, "ev", tenant="hot")
    for i in range(4):  # other work fills the 3008-token pool: ev's nodes are evicted
        chat(server, [SYSTEM, {"role": "user", "content": long_text(f"filler{i}", 60)}], max_tokens=4)
    restored, usage2, metrics = chat(server, messages, "ev")
    assert metrics["restored_from"] == "disk" and metrics["restored_tokens"] > 0
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    assert cached % PAGE == 0 and cached >= usage["prompt_tokens"] // PAGE * PAGE
    assert cached == hot_usage["prompt_tokens_details"]["cached_tokens"] and restored == hot


@pytest.mark.server(ends="paged")
def test_a_server_killed_while_writing_leaves_no_file_that_loads(fault_server, pool):
    server, _, store = fault_server
    turns = [long_text("big", 110) + " Count the entries."]
    flush(server)  # no other session's write is under way
    threading.Thread(target=lambda: run_turns(server, turns, "big"), daemon=True).start()
    deadline, tmp = time.monotonic() + 120, []
    while not tmp and time.monotonic() < deadline:
        tmp = list(store.glob("*/*/*.tmp"))
    assert tmp, "the writer never opened a temporary file"
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)
    pool.stop(server)  # reaps what the kill left
    assert list(store.glob("*/*/*.tmp"))  # killed mid-write: the partial file is there (and a chunk no head names) ...
    assert not session_file(store, "big").exists()  # ... and nothing under the session's name
    # a new server on the store: it removes the partial file and serves the session by prefill;
    # it runs under a 3 MB file-size limit, so a full block's write (5.9 MB in bf16) fails as on a full disk
    f = pool.get("paged_limited")
    assert f.dir == server.dir and "--fsize=3000000" in pool.catalogue["paged_limited"].prefix
    try:
        assert re.search(r"removed \d+ partial file", f.log())  # the temporary file (and the chunks no head names)
        assert not list(store.glob("*/*/*.tmp")) and not list(store.glob(f"*/*/{digest('session', 'big')}.*.chunk"))
        _, _, metrics = chat(f, [SYSTEM, {"role": "user", "content": turns[0]}], "big")
        assert metrics["restored_tokens"] == 0 and metrics["text_match"] is None
        # full disk: the turn's write fails; the next turn reports it, and the server keeps serving
        flush(f)
        assert "writing the session file failed" in f.log()
        _, _, metrics = chat(f, [SYSTEM, {"role": "user", "content": "Short question?"}], "big")
        assert "File too large" in (metrics["persist_error"] or ""), metrics
        flush(f)  # this turn's path is one partial block: written or not, no temporary file stays
        assert not list(store.glob("*/*/*.tmp"))
        # unwritable directory: the tenant's directory name is taken by a regular file
        (store / digest("tenant", "blocked")).write_text("not a directory")
        run_turns(f, ["Hello there."], "u1", tenant="blocked")
        flush(f)
        _, _, metrics = chat(f, [SYSTEM, {"role": "user", "content": "Hello again."}], "u1", tenant="blocked")
        assert "writing the session file failed" in (metrics["persist_error"] or ""), metrics
        assert chat(f, [SYSTEM, {"role": "user", "content": "Still there?"}])[0]
    finally:
        pool.stop(f)
