"""bench/agent_traces.py's replay of the recorded coding-agent traces, without a server.

References: the trace files themselves (two requests share a prefix exactly as far as their hash
ids agree; sub-agents are nested conversations), a brute-force median and percentile, and the
persist mechanism's own parser for the hints a replayed client sends."""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from bench import agent_traces as A
from sgl_memory import models
from sgl_memory.core.config import MemoryConfig
from sgl_memory.core.request import parse
from sgl_memory.engine.http_api import OPENAI, with_kv_hints

ARGS = argparse.Namespace(
    block_tokens=2, shared_share=1.0, think_scale=0.05, think_cap=8.0, max_output=16, max_requests=16, sessions=4
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(models.model_dir("smollm2-135m-instruct"))


def common(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_trace_loads_with_its_scales_and_its_sub_agents_as_children_of_the_request_after_them():
    path = A.TRACES / "trace_0274.json"  # the folder's trace with sub-agents
    raw = json.loads(path.read_text())["requests"]
    args = argparse.Namespace(**{**vars(ARGS), "max_requests": 1000})
    c = A.load(path, args)
    plain = [e for e in raw if e.get("type") != "subagent"]
    assert len(c.requests) == len(plain)
    for entry, r in zip(plain, c.requests):
        assert r.blocks == entry["hash_ids"]
        assert r.think_s == pytest.approx(min(8.0, entry["think_time"] * 0.05))
        assert r.out == max(1, min(16, round(entry["out"] / 64 * 2)))
        assert r.tool_call == (entry["stop"] == "tool_use")
    runs, i = [], 0  # each run of sub-agent entries belongs to the request that follows it
    while i < len(raw):
        n = 0
        while i < len(raw) and raw[i].get("type") == "subagent":
            n, i = n + 1, i + 1
        if i < len(raw):
            runs.append(n)
            i += 1
    assert [len(r.children) for r in c.requests] == runs and sum(runs) > 1
    child = next(ch for r in c.requests for ch in r.children)
    assert child.kind != "main" and child.requests and child.id.startswith(c.id + ".") and child.trace == c.id
    assert len(A.load(path, ARGS).requests) == 16  # --max-requests


def test_prompts_share_tokens_exactly_as_far_as_their_block_ids_agree_and_sessions_share_the_tool_prefix(tokenizer):
    text = A.Text(tokenizer, ARGS.block_tokens, 1.0)
    for word in text.words:
        assert len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1
    roots = A.pick(0, 3, ARGS)
    head = None
    for c in roots:
        ids = A.rendered(tokenizer, text, c)
        for k in range(1, len(c.requests)):
            blocks = common(c.requests[k - 1].blocks, c.requests[k].blocks)
            shared = common(ids[k - 1], ids[k])
            if blocks < len(c.requests[k - 1].blocks) and blocks > c.prefix_blocks:
                # the chat template's opening, then the system text up to the user message's marker
                # (a few tokens), then two tokens per shared block: the rest differs from the first block that differs
                assert blocks * 2 <= shared <= blocks * 2 + 16, (c.id, k, blocks, shared)
        head = head or ids[0]
        # every session's system text is the same tool prefix, as far as the shorter one's
        fewest = min(c.prefix_blocks, roots[0].prefix_blocks)
        assert common(head, ids[0]) >= fewest * 2
    alone = A.Text(tokenizer, ARGS.block_tokens, 0.0)  # no shared share: the sessions share only the template
    a, b = (A.rendered(tokenizer, alone, c)[0] for c in roots[:2])
    assert common(a, b) < 16


def test_with_a_message_per_request_the_latest_message_is_the_new_blocks_and_prompts_extend_each_other(tokenizer):
    """`--messages turns`: each request's blocks past what it shares with the request before it are
    its last user message; the messages hold every block in order; a request that extends the one
    before renders that one's prompt but its closing assistant header."""
    text, one = A.Text(tokenizer, ARGS.block_tokens, 1.0, turns=True), A.Text(tokenizer, ARGS.block_tokens, 1.0)
    extended = 0
    for c in A.pick(0, 3, ARGS):
        ids = A.rendered(tokenizer, text, c)
        for k, r in enumerate(c.requests):
            messages = text.messages(c, r)
            keys = [m["content"] for m in one.messages(c, r)]
            assert "".join(m["content"] for m in messages[1:]).replace(" ", "") == keys[1].replace(" ", "")
            if k == 0 or r.blocks[: c.prefix_blocks] != c.requests[k - 1].blocks[: c.prefix_blocks]:
                continue
            new = r.blocks[common(c.requests[k - 1].blocks, r.blocks) :]
            if new:  # the last message is exactly the new blocks' text
                want = "".join(text.block(f"{c.trace}:{h}") for h in new).strip()
                assert messages[-1]["content"] == want, (c.id, k)
            if r.blocks[: len(c.requests[k - 1].blocks)] == c.requests[k - 1].blocks and new:
                extended += 1
                assert common(ids[k - 1], ids[k]) >= len(ids[k - 1]) - 3, (c.id, k)
    assert extended > 10


def test_the_hints_a_replayed_client_sends_are_the_persist_mechanisms_hints():
    c = A.load(A.TRACES / "trace_0002.json", ARGS)
    for k, r in enumerate(c.requests):
        body = {"kv_hints": A.envelope(c, k, 0.4)}
        part = parse(with_kv_hints({"session_id": "s"}, body, OPENAI[0], MemoryConfig())).part("persist")
        if k == len(c.requests) - 1:
            assert part.done
        elif r.tool_call:
            assert part.expected_tool_duration_ms == 400 and not part.demote
        else:
            assert part.demote and part.expected_tool_duration_ms is None


def test_a_parent_waits_for_its_sub_agents_which_run_at_once(monkeypatch):
    """The replay with the server replaced by a recorder: children start together after the
    parent's request before them and the parent's next request goes after every child finished."""
    calls, lock = [], threading.Lock()

    def fake_send(server, messages, session, out, hints):
        start = time.perf_counter()
        time.sleep(0.3)  # long beside a thread's start on a loaded machine: children that run at once overlap
        with lock:
            calls.append((session, start, time.perf_counter()))
        return 0.01, 10, 0, {}

    monkeypatch.setattr(A, "send", fake_send)
    children = [
        A.Conversation(f"p.c{i}", "Explore", 0, [A.Request(0.0, [1], 1, True) for _ in range(2)]) for i in (0, 1)
    ]
    parent = A.Conversation(
        "p",
        "main",
        0,
        [
            A.Request(0.0, [1], 1, True),
            A.Request(0.0, [1, 2], 1, True, children),
            A.Request(0.0, [1, 2, 3], 1, False),
        ],
    )
    text = SimpleNamespace(messages=lambda c, r: [])
    turns = A.Replay(None, text, "sglang:lru", "t", 0, 0.0, False).run([parent], 0.0)
    assert len(turns) == 3 + 2 * 2
    parent_calls = [c for c in calls if c[0] == "t-0-p"]
    child_calls = [c for c in calls if c[0].startswith("t-0-p.c")]
    assert len(parent_calls) == 3 and len(child_calls) == 4
    assert min(c[1] for c in child_calls) >= parent_calls[0][2]  # started after the parent's first answer
    assert parent_calls[1][1] >= max(c[2] for c in child_calls)  # the parent waited for them
    first, second = sorted(child_calls, key=lambda c: c[1])[:2]
    assert second[1] < first[2]  # the two children ran at once: the second began before the first ended


def test_the_predictor_error_per_gap_class_against_a_brute_force_median():
    turns = [
        A.Turn("s", k, 0.0, 0.1, 0.1, gap_class=cls, predicted_gap_s=p, actual_gap_s=a)
        for k, (cls, p, a) in enumerate(
            [("tool", 1.0, 1.5), ("tool", 2.0, 1.0), ("tool", None, 3.0), ("answer", 5.0, 9.0), ("", None, None)]
        )
    ]
    out = A.predictor_error(turns)
    assert out["tool"]["gaps"] == 3 and out["tool"]["predicted"] == 2
    assert out["tool"]["median_error_s"] == pytest.approx(statistics.median([0.5, 1.0]))
    assert out["tool"]["median_gap_s"] == pytest.approx(1.5)
    assert out["answer"]["median_error_s"] == pytest.approx(4.0) and out["answer"]["p90_error_s"] == pytest.approx(4.0)


def test_the_pool_is_the_distinct_tokens_over_the_oversubscription_and_holds_the_longest():
    assert A.pool_for(8000, 1000, 4) == 2000
    assert A.pool_for(8000, 3000, 4) == 3064


def test_sibling_sub_agents_share_their_prompt_as_far_as_the_trace_says(tokenizer):
    """trace_0274's sub-agents start alike (their first requests' hash ids agree for 206 blocks),
    none of them with the parent's context; the replayed prompts say the same."""
    text = A.Text(tokenizer, ARGS.block_tokens, 1.0)
    c = A.load(A.TRACES / "trace_0274.json", argparse.Namespace(**{**vars(ARGS), "max_requests": 1000}))
    a, b = (ch for r in c.requests for ch in r.children[:2] if r.children)
    blocks = common(a.requests[0].blocks, b.requests[0].blocks)
    tokens = common(A.rendered(tokenizer, text, a)[0], A.rendered(tokenizer, text, b)[0])
    assert blocks > a.prefix_blocks and blocks * 2 <= tokens <= blocks * 2 + 16
    parent = A.rendered(tokenizer, text, c)[0]
    assert common(parent, A.rendered(tokenizer, text, a)[0]) < 16  # a sub-agent's prompt is not its parent's


def test_tlru_gets_its_config_as_sglangs_own_policy_reads_it():
    """SGLang's tlru runs with the replay's threshold and next-prompt estimate: the flag's JSON
    builds SGLang's own TLRUStrategy (which refuses a key it does not take), and the estimate is
    the brute-force median growth of a request over the one before, over every trace."""
    from sglang.srt.mem_cache.evict_policy import TLRUStrategy

    growth = []
    for path in sorted(A.TRACES.glob("trace_*.json")):
        for c in A.conversations([A.load(path, ARGS)]):
            growth += [len(c.requests[k].blocks) - len(c.requests[k - 1].blocks) for k in range(1, len(c.requests))]
    estimate = A.next_prompt(ARGS)
    assert estimate == max(1, round(statistics.median(growth) * ARGS.block_tokens))
    config = {"threshold": 1024, "next_prompt_estimate": estimate}
    cmd, _ = A.server_command("sglang:tlru", "smollm2-135m-instruct", 2048, Path("/tmp"), config)
    policy = TLRUStrategy(**json.loads(cmd[cmd.index("--radix-eviction-policy-config") + 1]))
    assert (policy.threshold, policy.next_prompt_estimate) == (1024, estimate)
    assert cmd[cmd.index("--radix-eviction-policy") + 1] == "tlru"
    lru, _ = A.server_command("sglang:lru", "smollm2-135m-instruct", 2048, Path("/tmp"), config)
    assert "--radix-eviction-policy-config" not in lru  # the config is tlru's alone
