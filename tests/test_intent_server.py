"""IntentKV inside the real server (SmolLM2-135M, float32, intent pruning on).

References: plain SGLang's greedy tokens (budget at or above the length), and a transformers
forward of the same weights in which the dropped positions are masked (a pruned request's
next-token distribution)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import time

import pytest
import requests
import torch

from servers import TEST_MODEL
from sgl_memory import models

pytestmark = pytest.mark.server

QUERY_TAIL = 16  # the float32 server's intent section: budget 4096, scorer memory, query_tail 16, sinks 4,
# an adaptive budget within [32, 512], the zero-initialised learned head, training traces


@pytest.fixture(scope="module")
def servers(fp32_server, sglang_server):
    """Ours with intent on, and plain SGLang (the first test's reference), both float32."""
    info = fp32_server.get("/sgl_memory/info").json()["config"]["intent"]
    assert (info["budget"], info["scorer"], info["query_tail"], info["budget_floor"], info["budget_ceiling"]) == (
        4096,
        "memory",
        QUERY_TAIL,
        32,
        512,
    )
    return fp32_server, sglang_server


@pytest.fixture(scope="module")
def intent_server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))


def history(n_steps: int) -> str:
    return "Agent log. " + " ".join(
        f"Step {i}: tool read file_{i % 7}.txt and returned code {i * 31 % 97}." for i in range(n_steps)
    )


def generate(server, ids, max_new_tokens, memory=None, **extra):
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        **extra,
    }
    if memory is not None:
        body["sgl_memory"] = memory
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_budget_at_or_above_the_length_is_identical_to_plain_sglang(servers, tokenizer):
    intent_server, plain = servers
    for steps in (5, 40):
        ids = tokenizer(history(steps) + " The most common file is")["input_ids"]
        want = generate(plain, ids, 24)["output_ids"]
        for budget in (len(ids), len(ids) + 100):
            out = generate(intent_server, ids, 24, {"session_id": f"same-{steps}", "budget": budget})
            assert out["output_ids"] == want
            assert out["meta_info"]["sgl_memory"]["compression_events"] == 0


def test_a_request_with_intent_false_is_served_as_without_intent(servers, tokenizer):
    """`intent: false` on a server with intent on: a budget far below the prompt prunes nothing,
    the answer is plain SGLang's, and the same prompt again finds all of itself but the last token
    in the tree (intent would prefill its query span itself)."""
    intent_server, plain = servers
    ids = tokenizer(history(40) + " The most common file is")["input_ids"]
    want = generate(plain, ids, 24)["output_ids"]
    off = {"session_id": "intent-off", "budget": 64, "intent": False}
    first = generate(intent_server, ids, 24, off)
    again = generate(intent_server, ids, 24, off)
    for out in (first, again):
        m = out["meta_info"]["sgl_memory"]
        assert out["output_ids"] == want and not m.get("compression_events") and m.get("budget") is None, m
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1


def streaming_kept(n, budget, sinks=4):
    """StreamingLLM's kept set, written from its definition: sinks, most recent candidates, forced tail."""
    tail = n - QUERY_TAIL
    recent = budget - QUERY_TAIL - sinks
    return list(range(sinks)) + list(range(tail - recent, tail)) + list(range(tail, n))


def rotate(x, delta, theta):
    """Rotate post-RoPE rows x [..., D] by delta positions (HF Llama convention, rotate_half)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = delta.double().unsqueeze(-1) * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return (x.double() * cos + half.double() * sin).to(x.dtype)


def masked_reference_logprobs(ids, first_token, kept):
    """log-softmax of the next token after ids + [first_token], where the last row sees only kept
    prompt positions plus itself (every earlier row is plainly causal, as in the server's prefill)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        models.model_dir(TEST_MODEL), dtype=torch.float32, attn_implementation="eager"
    )
    seq = torch.tensor([ids + [first_token]])
    n = seq.shape[1]
    mask = torch.zeros(1, 1, n, n).masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    if kept is not None:
        last = torch.full((n,), float("-inf"))
        last[kept] = 0.0
        last[-1] = 0.0
        mask[0, 0, -1] = last
    with torch.no_grad():
        logits = model(seq, attention_mask=mask).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)


def test_pruned_next_token_distribution_equals_masked_reference(intent_server, tokenizer):
    ids = tokenizer(history(30) + " Which file was read most often? Answer:")["input_ids"]
    budget, sinks = 96, 4
    out = generate(
        intent_server,
        ids,
        2,
        {"session_id": "masked", "budget": budget, "scorer": "streaming_llm"},
        return_logprob=True,
        top_logprobs_num=10,
    )
    meta = out["meta_info"]
    assert meta["sgl_memory"]["compression_events"] == 1
    assert meta["sgl_memory"]["live_kv_tokens"] == budget + 2
    # the event's cost and the prefill it follows: the prefill's time sits within the request's
    m = meta["sgl_memory"]
    assert 0 < m["scoring_ms"] and 0 < m["prefill_ms"] < meta["e2e_latency"] * 1000
    kept = streaming_kept(len(ids), budget, sinks)
    first = out["output_ids"][0]
    top = meta["output_top_logprobs"][1]  # the second token: the first decode step, on pruned KV
    want = masked_reference_logprobs(ids, first, kept)
    unpruned = masked_reference_logprobs(ids, first, None)
    got = torch.tensor([lp for lp, _, *_ in top], dtype=torch.float64)
    tok = torch.tensor([t for _, t, *_ in top])
    assert torch.allclose(got, want[tok], atol=2e-3), (got, want[tok])
    assert (got - unpruned[tok]).abs().max() > 0.05  # pruning changed the distribution: the test can fail


def streaming_kept_live(live: list[int], n: int, budget: int, sinks: int = 4) -> list[int]:
    """StreamingLLM's kept set over the live positions of a row: the forced tail, the first `sinks`
    live candidates and the most recent ones, up to the budget."""
    forced = [p for p in live if p >= n - QUERY_TAIL]
    candidates = [p for p in live if p < n - QUERY_TAIL]
    recent = budget - len(forced) - sinks
    return candidates[:sinks] + candidates[len(candidates) - recent :] + forced


def events_reference_logprobs(ids, events):
    """log-softmax of every next token of `ids` in a transformers forward where each row attends
    causally, restricted, from an event's start on, to the positions that event kept (and the rows
    from its start on): a session's KV as its compression events left it. events: [(start, kept)]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        models.model_dir(TEST_MODEL), dtype=torch.float32, attn_implementation="eager"
    )
    n = len(ids)
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for start, kept in events:
        cols = torch.zeros(n, dtype=torch.bool)
        cols[kept] = True
        cols[start:] = True
        allowed[start:] &= cols
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        logits = model(torch.tensor([ids]), attention_mask=mask).logits[0]
    return torch.log_softmax(logits.double(), -1)


def test_a_sessions_next_turns_attend_to_what_its_events_kept(intent_server, tokenizer):
    """Pruning is the session's, not only its decode's: turn 2's prefill and turn 3's attend to the
    positions turns 1 and 2 kept, their KV taken from the session's pruned path (the whole history
    a radix hit, two branches deep). Reference: transformers with each event's kept set masked in,
    row by row; an unpruned forward must differ, so the test can fail."""
    budget = 96
    memory = {"session_id": "persisted-pruning", "budget": budget, "scorer": "streaming_llm"}
    ids = tokenizer(history(30) + " Which file was read most often? Answer:")["input_ids"]
    out = generate(intent_server, ids, 2, memory)
    events = [(len(ids), streaming_kept_live(list(range(len(ids))), len(ids), budget))]
    for question in (
        "Next, tool read file_3.txt and returned code 12. Which file was read last?",
        "Then tool read file_5.txt and returned code 40. Which code came last?",
    ):
        start = len(ids)  # the previous turn's first output token, its KV from a decode step on the pruned row
        ids = ids + out["output_ids"][:1] + tokenizer(" " + question)["input_ids"]
        out = generate(intent_server, ids, 2, memory, return_logprob=True, logprob_start_len=start + 1)
        meta = out["meta_info"]
        assert meta["sgl_memory"]["compression_events"] == 1
        assert meta["sgl_memory"]["copied_slots"] > 0  # the event dropped positions of the path it matched
        assert meta["cached_tokens"] >= start  # the pruned path
        got = [(lp, tok) for lp, tok, *_ in meta["input_token_logprobs"] if lp is not None]
        positions = range(len(ids) - len(got), len(ids))
        assert len(got) > 10 and [tok for _, tok in got] == [ids[p] for p in positions]
        want, plain = events_reference_logprobs(ids, events), events_reference_logprobs(ids, [])
        want_lp = torch.tensor([float(want[p - 1, ids[p]]) for p in positions], dtype=torch.float64)
        plain_lp = torch.tensor([float(plain[p - 1, ids[p]]) for p in positions], dtype=torch.float64)
        got_lp = torch.tensor([lp for lp, _ in got], dtype=torch.float64)
        assert torch.allclose(got_lp, want_lp, atol=2e-3), (len(events), (got_lp - want_lp).abs().max())
        assert (got_lp - plain_lp).abs().max() > 0.05, len(events)
        live = sorted(set(events[-1][1]) | set(range(start, len(ids))))
        events.append((len(ids), streaming_kept_live(live, len(ids), budget)))


def test_a_readonly_request_scores_a_continuation_on_the_pruned_path_and_changes_nothing(intent_server, tokenizer):
    """`readonly`: a continuation teacher-forced after a pruned turn attends to what that turn's
    event kept, as the turn's own decode did (transformers reference, the event masked in from the
    continuation on); it runs no event, leaves no path in the tree and no turn in QueryMemory."""
    budget = 96
    memory = {"session_id": "readonly-scoring", "budget": budget, "scorer": "streaming_llm"}
    ids = tokenizer(history(30) + " Which file was read most often? Answer:")["input_ids"]
    first = generate(intent_server, ids, 2, memory)["meta_info"]["sgl_memory"]
    assert first["compression_events"] == 1 and first["query_memory_turns"] == 1
    cont = tokenizer(" file_3.txt, read five times in the log above, more than any other file.")["input_ids"]
    scored = [
        generate(
            intent_server, ids + cont, 1, {**memory, "readonly": True}, return_logprob=True, logprob_start_len=len(ids)
        )["meta_info"]
        for _ in range(2)
    ]
    assert scored[0]["sgl_memory"]["compression_events"] == 0
    got = [(lp, tok) for lp, tok, *_ in scored[0]["input_token_logprobs"] if lp is not None]
    assert got == [(lp, tok) for lp, tok, *_ in scored[1]["input_token_logprobs"] if lp is not None]
    seq = ids + cont
    positions = range(len(seq) - len(got), len(seq))
    assert len(got) >= len(cont) - 1 and [tok for _, tok in got] == [seq[p] for p in positions]
    want = events_reference_logprobs(seq, [(len(ids), streaming_kept_live(list(range(len(ids))), len(ids), budget))])
    plain = events_reference_logprobs(seq, [])
    got_lp = torch.tensor([lp for lp, _ in got], dtype=torch.float64)
    want_lp = torch.tensor([float(want[p - 1, seq[p]]) for p in positions], dtype=torch.float64)
    plain_lp = torch.tensor([float(plain[p - 1, seq[p]]) for p in positions], dtype=torch.float64)
    assert torch.allclose(got_lp, want_lp, atol=2e-3), (got_lp - want_lp).abs().max()
    assert (got_lp - plain_lp).abs().max() > 0.05
    # nothing of it stays: the same prompt without the logprob cap matches only the turn's path
    again = generate(intent_server, seq, 1, {**memory, "readonly": True})["meta_info"]
    assert again["cached_tokens"] <= len(ids) + 1
    nxt = generate(intent_server, seq + tokenizer(" Which came last?")["input_ids"], 2, memory)["meta_info"][
        "sgl_memory"
    ]
    assert nxt["query_memory_turns"] == 2


def test_compact_next_token_distribution_equals_repacked_reference(intent_server, tokenizer):
    """The published compaction path, rebuilt on transformers' own KV cache: prefill the whole
    prompt, keep the StreamingLLM positions, move their keys to positions 0..K-1, decode at K."""
    from transformers import AutoModelForCausalLM, DynamicCache

    ids = tokenizer(history(30) + " Which file was read most often? Answer:")["input_ids"]
    budget = 96
    out = generate(
        intent_server,
        ids,
        2,
        {"session_id": "compact-ref", "budget": budget, "scorer": "streaming_llm", "layout": "compact"},
        return_logprob=True,
        top_logprobs_num=10,
    )
    assert out["meta_info"]["sgl_memory"]["compression_events"] == 1
    kept = torch.tensor(streaming_kept(len(ids), budget))
    model = AutoModelForCausalLM.from_pretrained(
        models.model_dir(TEST_MODEL), dtype=torch.float32, attn_implementation="eager"
    )
    theta = model.config.rope_parameters["rope_theta"]
    with torch.no_grad():
        full = model(torch.tensor([ids]), use_cache=True).past_key_values
        cache = DynamicCache()
        for i, layer in enumerate(full.layers):
            keys = rotate(layer.keys[:, :, kept], torch.arange(len(kept)) - kept, theta)
            cache.update(keys, layer.values[:, :, kept], i)
        first = out["output_ids"][0]
        logits = model(
            torch.tensor([[first]]),
            position_ids=torch.tensor([[len(kept)]]),
            past_key_values=cache,
            attention_mask=torch.ones(1, len(kept) + 1),
        ).logits[0, -1]
    want = torch.log_softmax(logits.double(), -1)
    top = out["meta_info"]["output_top_logprobs"][1]
    got = torch.tensor([lp for lp, _, *_ in top], dtype=torch.float64)
    tok = torch.tensor([t for _, t, *_ in top])
    assert torch.allclose(got, want[tok], atol=2e-3), (got, want[tok])


def chat(server, messages, memory, max_tokens=12):
    r = server.post(
        "/v1/chat/completions",
        {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "sgl_memory": memory},
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("layout", ["dead_slot", "compact"])
def test_second_turn_reuses_the_pruned_prefix_only_under_dead_slot(intent_server, layout):
    messages = [
        {"role": "system", "content": f"You are a careful agent ({layout} run)."},
        {"role": "user", "content": "Task: track the files. " + history(35)},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Which file came first?"},
    ]
    memory = {"session_id": f"turns-{layout}", "budget": 128, "layout": layout}
    first = chat(intent_server, messages, memory)
    assert first["sgl_memory"]["compression_events"] == 1
    assert first["sgl_memory"]["layout"] == layout
    messages += [first["choices"][0]["message"], {"role": "user", "content": "And which came last?"}]
    second = chat(intent_server, messages, memory)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    if layout == "dead_slot":
        assert cached >= first["usage"]["prompt_tokens"]
    else:
        assert cached < first["usage"]["prompt_tokens"] // 4
    assert second["sgl_memory"]["live_kv_tokens"] <= 128 + 12


@pytest.mark.parametrize(
    "memory, needle",
    [
        ({"scorer": "magic"}, "scorer 'magic' is unknown"),
        ({"session_id": 5}, "session_id must be a non-empty string"),
        ("not-an-object", "must be an object"),
        ({"budget": 3}, "is smaller than this request's forced set"),
        ({"budget": 2**64}, "budget must be an integer in [1, 2147483647]"),
        ({"scorer": {"name": "snapkv"}}, "is unknown; allowed"),
        ({"scorer": ["snapkv"]}, "is unknown; allowed"),
        ({"layout": {"dead": "slot"}}, "is unknown; allowed"),
        ({"budget_mode": "adaptive", "scorer": "snapkv"}, "budget_mode adaptive follows a scorer's attention mass"),
        ({"session_id": "ro", "readonly": "yes"}, "readonly must be true or false"),
        ({"readonly": True}, "readonly needs sgl_memory.session_id"),
    ],
)
@pytest.mark.parametrize("api", ["native", "openai"])
def test_bad_input_is_a_400_and_the_server_keeps_serving(intent_server, tokenizer, memory, needle, api):
    text = history(20) + " Done?"
    if api == "native":
        r = intent_server.post(
            "/generate", {"text": text, "sampling_params": {"max_new_tokens": 4}, "sgl_memory": memory}
        )
    else:
        r = intent_server.post(
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 4,
                "sgl_memory": memory,
            },
        )
    assert r.status_code == 400, r.text
    assert needle in r.text
    assert generate(intent_server, tokenizer("Still serving?")["input_ids"], 2)["meta_info"]["completion_tokens"] == 2


def agent_messages(tag: str, steps: int = 70) -> list[dict]:
    """System prompt, a long tool log, an acknowledgement and a question: a turn of an agent."""
    log = " ".join(f"Step {i}: tool read file_{i % 7}.txt and returned code {i * 31 % 97}." for i in range(steps))
    return [
        {"role": "system", "content": f"You are a careful agent ({tag})."},
        {"role": "user", "content": "Task: track the files. " + log},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Which file was read most often?"},
    ]


def answer(response) -> tuple[str, int]:
    return response["choices"][0]["message"]["content"], response["sgl_memory"]["live_kv_tokens"]


def test_a_pruned_path_is_read_only_by_its_own_session_and_pruning(intent_server):
    """Issue 13, defect 7: the dead-slot path session A leaves in the tree must not be matched by
    a plain request, another session, or the same tokens under another budget; A's next turn still
    reuses it. Reference: the same plain request in a tenant whose tree never saw a pruning."""
    messages = agent_messages("leak")
    fresh = answer(chat(intent_server, messages, {"tenant": "never-pruned"}))
    pruned = chat(intent_server, messages, {"session_id": "leak-A", "budget": 64})
    assert pruned["sgl_memory"]["compression_events"] == 1 and answer(pruned)[1] == 64 + 12
    plain = intent_server.post(
        "/v1/chat/completions", {"model": "default", "messages": messages, "max_tokens": 12, "temperature": 0}
    )
    assert answer(plain.json()) == fresh  # no sgl_memory field at all: unpruned, as on a fresh server
    assert answer(chat(intent_server, messages, {"session_id": "leak-B", "budget": 100000})) == fresh
    assert answer(chat(intent_server, messages, {"session_id": "leak-A", "budget": 4000})) == fresh
    # the session's next turn, same pruning: the whole pruned prefix is a radix hit
    messages += [pruned["choices"][0]["message"], {"role": "user", "content": "And which came last?"}]
    second = chat(intent_server, messages, {"session_id": "leak-A", "budget": 64})
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= pruned["usage"]["prompt_tokens"]
    assert second["sgl_memory"]["live_kv_tokens"] <= 64 + 12


INVENTORY = "Inventory. " + " ".join(f"Shelf {i}: {i * 13 % 89} springs and {i * 7 % 53} nuts." for i in range(60))


@pytest.mark.parametrize("scorer", ["snapkv", "h2o", "memory", "memory_pool"])
def test_the_kept_set_does_not_depend_on_what_the_cache_holds(intent_server, tokenizer, scorer):
    """Issue 13, defect 8: after a plain request cached the prompt, a pruning request must keep the
    same positions as the identical request in a tenant with an empty tree (the scorer's query rows
    were a cache hit, and only the uncached rows were scored). Compared on the distribution of the
    first token decoded over the pruned KV."""
    ids = tokenizer(f"{INVENTORY} ({scorer}) How many springs are on shelf 17? Answer:")["input_ids"]
    generate(intent_server, ids, 1)  # a plain request caches the whole prompt
    memory = {"session_id": f"cache-{scorer}", "scorer": scorer, "budget": 102}
    hit = generate(intent_server, ids, 2, memory, return_logprob=True, top_logprobs_num=10)
    assert hit["meta_info"]["cached_tokens"] > len(ids) // 2
    cold = generate(
        intent_server, ids, 2, {**memory, "tenant": f"cold-{scorer}"}, return_logprob=True, top_logprobs_num=10
    )
    assert cold["meta_info"]["cached_tokens"] == 0
    assert (
        hit["meta_info"]["sgl_memory"]["compression_events"]
        == cold["meta_info"]["sgl_memory"]["compression_events"]
        == 1
    )
    got, want = (torch.tensor([lp for lp, *_ in out["meta_info"]["output_top_logprobs"][1]]) for out in (hit, cold))
    assert [t for _, t, *_ in hit["meta_info"]["output_top_logprobs"][1]] == [
        t for _, t, *_ in cold["meta_info"]["output_top_logprobs"][1]
    ]
    assert torch.allclose(got, want, atol=1e-4), (got, want)


def test_a_zero_initialised_learned_head_keeps_the_rule_scorers_sets(intent_server, tokenizer):
    """Phase 2 at initialisation is Phase 1 (IntentKV 3.3): over a session's turns, so that
    QueryMemory accumulates, `scorer: learned` with the untrained head keeps exactly the positions
    `scorer: memory` keeps. Compared on the first decoded tokens' top-10 distributions, which are
    bit-equal only if the kept sets are (float32, same shapes)."""
    text = INVENTORY
    for turn in range(3):  # each turn appends a question: the session's pruned path grows past the budget again
        text += f" Question {turn}: how many nuts are on shelf {turn * 11 + 5}? Answer:"
        ids = tokenizer(text)["input_ids"]
        # a tenant each: neither request finds the other's prefix, so both prefills compute the same rows
        outs = [
            generate(
                intent_server,
                ids,
                2,
                {"session_id": "zero-head", "tenant": f"zero-{scorer}", "scorer": scorer, "budget": 150},
                return_logprob=True,
                top_logprobs_num=10,
            )
            for scorer in ("memory", "learned")
        ]
        rule, learned = (o["meta_info"] for o in outs)
        assert rule["cached_tokens"] == learned["cached_tokens"]
        assert rule["sgl_memory"]["compression_events"] == learned["sgl_memory"]["compression_events"] == 1
        assert rule["sgl_memory"]["query_memory_turns"] == learned["sgl_memory"]["query_memory_turns"] == turn + 1
        assert rule["output_top_logprobs"] == learned["output_top_logprobs"]


def test_an_adaptive_budget_follows_the_session_within_its_bounds(intent_server, tokenizer):
    """budget_mode adaptive: each turn prunes to the history budget the session's previous event
    left (plus the forced tail of these plain prompts), which moves by the configured step in the
    direction the event's signals say (grow when the scorer's mass left out is above grow_at, else
    shrink when the kept set repeats), within [budget_floor, budget_ceiling]."""
    history, budgets, events = INVENTORY, [], []
    for turn in range(5):
        # each turn adds more than a step's growth of the budget: the session's pruned path (kept
        # history only) plus the new note is over the next budget again, so every turn prunes
        history += f" Note {turn}: " + " ".join(
            f"shelf {turn * 3 + j} was restocked with {j * 7} nuts." for j in range(8)
        )
        ids = tokenizer(f"{history} Question: how many nuts are on shelf {turn * 3}? Answer:")["input_ids"]
        m = generate(
            intent_server,
            ids,
            2,
            {"session_id": "adaptive", "scorer": "memory", "budget": 64, "budget_mode": "adaptive"},
        )
        m = m["meta_info"]["sgl_memory"]
        budgets.append(m["budget"] - QUERY_TAIL)  # the history budget applied (the forced set is the tail)
        events.append(m["adaptive_budget"])
        assert m["compression_events"] == 1 and m["live_kv_tokens"] == m["budget"] + 2
    assert budgets[0] == 64
    for turn in range(4):
        signal, now, nxt = events[turn], budgets[turn], budgets[turn + 1]
        assert nxt == signal["next_budget"] and 32 <= nxt <= 512
        if signal["mass_beyond_budget"] > 0.3:
            assert nxt == min(512, math.ceil(now * 1.25))
        elif signal["kept_overlap"] is not None and signal["kept_overlap"] >= 0.9:
            assert nxt == max(32, math.floor(now / 1.25))
        else:
            assert nxt == now
    assert len(set(budgets)) > 1  # it moved


def test_the_learned_heads_training_rows_hold_the_keys_inference_reads(intent_server, tokenizer):
    """intent.trace_dir: each learned event writes the head's inputs. The candidates' key means
    equal the post-RoPE keys of a transformers float32 forward of the prompt, averaged over layers
    and KV heads, at the candidate positions; the forced spans are not candidates."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ids = tokenizer(f"{INVENTORY} Traced: how many springs are on shelf 3? Answer:")["input_ids"]
    generate(intent_server, ids, 2, {"session_id": "traced", "scorer": "learned", "budget": 150})
    rows = []
    for path in (intent_server.dir / "intent-traces").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            if f.metadata()["session"] == "traced":
                rows.append(({k: f.get_tensor(k) for k in f.keys()}, f.metadata()))
    ((row, meta),) = rows
    assert row["tokens"].tolist() == ids and meta["turn"] == "1"
    system_end, query_start = row["spans"].tolist()
    positions = row["positions"]
    assert positions.numel() == row["keys"].shape[0] == row["rule"].numel()
    assert bool(((positions >= system_end) & (positions < query_start)).all())
    assert abs(float(row["rule"].sum()) - 1.0) < 1e-4  # a share over the candidates
    model = AutoModelForCausalLM.from_pretrained(models.model_dir(TEST_MODEL), dtype=torch.float32)
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    keys = torch.stack([cache.layers[i].keys[0] for i in range(len(cache.layers))])  # [L, KVH, T, D], post-RoPE
    want = keys.mean(dim=(0, 1))[positions]
    assert torch.allclose(row["keys"], want, atol=2e-3), (row["keys"] - want).abs().max()
    assert torch.allclose(row["context"], keys.mean(dim=(0, 1))[query_start:], atol=2e-3)


def test_a_plain_request_over_the_configured_budget_is_served_with_its_forced_set(intent_server, tokenizer):
    """Issue 13, defect 9: a request that asked for no budget is not refused because the server's
    default budget (4096 here) is below its forced set; it keeps the forced set and says why."""
    rules = "Tool manual. " + " ".join(
        f"Rule {i}: call tool_{i % 11} with argument {i * 17 % 101}." for i in range(330)
    )
    messages = [{"role": "system", "content": rules}, *agent_messages("forced", steps=20)[1:]]
    r = intent_server.post(
        "/v1/chat/completions", {"model": "default", "messages": messages, "max_tokens": 4, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    m, usage = r.json()["sgl_memory"], r.json()["usage"]
    assert "only the forced set is kept" in m["budget_reason"] and m["budget"] > 4096
    assert m["compression_events"] == 1 and m["live_kv_tokens"] == m["budget"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] > m["budget"] + 200  # the history between the spans was pruned


def test_a_history_budget_prunes_below_the_tool_docs_and_the_next_turn_reuses_the_path(intent_server):
    """`budget_mode: history` (IntentKV's budget): the budget counts only the history between the
    system prefix and the latest message, so it may sit below an agent's tool docs. The live KV is
    the forced set plus the budget, where a total budget that small is a 400; the session's next
    turn (a larger forced set, so another applied budget) still reuses the pruned prefix."""
    rules = "Tool manual. " + " ".join(f"Rule {i}: call tool_{i % 11} with argument {i * 17 % 101}." for i in range(40))
    messages = [{"role": "system", "content": rules}, *agent_messages("history", steps=30)[1:]]
    memory = {"session_id": "history-budget", "budget": 32, "budget_mode": "history"}
    total = intent_server.post(
        "/v1/chat/completions",
        {"model": "default", "messages": messages, "max_tokens": 4, "sgl_memory": {"budget": 32}},
    )
    assert total.status_code == 400 and "budget_mode history" in total.text
    first = chat(intent_server, messages, memory, max_tokens=4)
    m, usage = first["sgl_memory"], first["usage"]
    forced = m["budget"] - 32
    assert forced > 300 and m["compression_events"] == 1  # the tool manual alone is over 300 tokens
    assert m["live_kv_tokens"] == m["budget"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] > m["budget"] + 200
    messages += [first["choices"][0]["message"], {"role": "user", "content": "And which file was read last of all?"}]
    second = chat(intent_server, messages, memory, max_tokens=4)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"]
    assert second["sgl_memory"]["budget"] - 32 > forced  # this turn's latest message is longer


def test_a_compressible_system_prompt_is_pruned_like_history(intent_server):
    """`system_prompt: compressible`: a total budget below the system prompt is served, and the
    system prompt's positions are among those pruned (the live KV is the budget, far below the
    system prompt's length); with the system prompt forced, the same budget is a 400."""
    rules = "Tool manual. " + " ".join(f"Rule {i}: call tool_{i % 11} with argument {i * 17 % 101}." for i in range(40))
    messages = [{"role": "system", "content": rules}, *agent_messages("system", steps=10)[1:]]
    body = {"model": "default", "messages": messages, "max_tokens": 4, "temperature": 0}
    forced = intent_server.post("/v1/chat/completions", {**body, "sgl_memory": {"budget": 64}})
    assert forced.status_code == 400 and "system_prompt compressible" in forced.text
    r = intent_server.post(
        "/v1/chat/completions", {**body, "sgl_memory": {"budget": 64, "system_prompt": "compressible"}}
    )
    assert r.status_code == 200, r.text
    m, usage = r.json()["sgl_memory"], r.json()["usage"]
    assert m["budget"] == 64 and m["compression_events"] == 1
    assert m["live_kv_tokens"] == 64 + usage["completion_tokens"] and usage["prompt_tokens"] > 64 + 400


def test_the_responses_api_carries_the_field_and_the_metrics(intent_server):
    """/v1/responses has no custom_params of its own: the field still reaches the scheduler (the
    pruning it asks for happens) and the response carries the metrics, as chat completions do."""
    rules = " ".join(f"Rule {i}: call tool_{i % 11} with argument {i * 17 % 101}." for i in range(60))
    model = intent_server.get("/v1/models").json()["data"][0]["id"]  # /v1/responses takes no "default"
    turns = [
        {"role": "user", "content": rules},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Which tool does rule 7 call?"},
    ]
    body = {"model": model, "input": turns, "max_output_tokens": 6, "temperature": 0}
    r = intent_server.post("/v1/responses", {**body, "sgl_memory": {"session_id": "responses-1", "budget": 64}})
    assert r.status_code == 200, r.text
    m = r.json()["sgl_memory"]
    assert m["budget"] == 64 and m["compression_events"] == 1 and m["session_key_source"] == "session_id"
    assert m["peak_request_tokens"] - m["live_kv_tokens"] > 300  # the history was pruned to the budget
    bad = intent_server.post("/v1/responses", {**body, "sgl_memory": {"budget": "many"}})
    assert bad.status_code == 400 and "budget" in bad.text


def test_concurrent_sessions_flush_and_stats(intent_server, tokenizer):
    scorers = ["memory", "query", "snapkv", "h2o", "streaming_llm", "random"]
    before = intent_server.get("/sgl_memory/stats").json()

    def session(i):
        ids = tokenizer(history(20 + i) + f" Session {i}: summarise.")["input_ids"]
        memory = {"session_id": f"conc-{i}", "budget": 64, "scorer": scorers[i % len(scorers)]}
        return [generate(intent_server, ids, 6, memory)["meta_info"]["sgl_memory"] for _ in range(2)]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(session, range(6)))
    assert all(m["live_kv_tokens"] == 64 + 6 for ms in results for m in ms)
    # the repeat reuses its session's pruned prefix: it prunes again only what it prefilled anew
    # (the scorer's query rows) beyond the budget
    assert all(first["compression_events"] == 1 and again["compression_events"] <= 1 for first, again in results)
    assert all(m["session_key_source"] == "session_id" for ms in results for m in ms)
    after = intent_server.get("/sgl_memory/stats").json()
    assert after["requests"] - before["requests"] == 12
    events = after["totals"]["compression_events"] - before["totals"]["compression_events"]
    assert events == sum(m["compression_events"] for ms in results for m in ms)
    assert 0 < after["prefix_hit_rate"] < 1
    # a flush drops the tree and the allocator's state; the sentinel is taken again on the next request
    assert intent_server.post("/flush_cache?timeout=30", {}).status_code == 200
    again = generate(intent_server, tokenizer(history(25) + " Again.")["input_ids"], 4, {"budget": 64})
    assert again["meta_info"]["sgl_memory"]["compression_events"] == 1
    assert again["meta_info"]["sgl_memory"]["session_key_source"] == "prefix_hash"


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def streamed(server, ids, max_new_tokens, memory) -> dict:
    """A streamed /generate request; returns the meta_info of its last chunk."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "sgl_memory": memory,
    }
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=600) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data: {")]
    return chunks[-1]["meta_info"]


def test_prometheus_and_stats_count_every_request_streamed_ones_too(intent_server, tokenizer):
    """GET /metrics (SGLang's own endpoint, --enable-metrics) carries sgl-memory's counters: their
    growth over a few requests equals the sums of what those requests reported, and a streamed
    request is counted (its last chunk carries its metrics)."""
    before, stats_before = intent_server.prometheus(), intent_server.get("/sgl_memory/stats").json()
    ids = tokenizer(history(30) + " Which file came first?")["input_ids"]
    reported = [
        generate(intent_server, ids, 4, {"session_id": "prom", "budget": 96})["meta_info"]["sgl_memory"],
        generate(intent_server, ids[:40], 3)["meta_info"]["sgl_memory"],
        streamed(intent_server, ids, 5, {"session_id": "prom-stream", "budget": 80})["sgl_memory"],
    ]
    assert reported[2]["compression_events"] == 1 and reported[2]["live_kv_tokens"] == 80 + 5
    bad = intent_server.post("/generate", {"text": "x", "sgl_memory": {"budget": "many"}})
    assert bad.status_code == 400
    after, stats_after = intent_server.prometheus(), intent_server.get("/sgl_memory/stats").json()

    def grew(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("sgl_memory_requests_total", mechanism="intent") == 3
    assert stats_after["requests"] - stats_before["requests"] == 3
    assert stats_after["completion_tokens"] - stats_before["completion_tokens"] == 4 + 3 + 5  # ignore_eos
    for key, name in (
        ("compression_events", "sgl_memory_compression_events_total"),
        ("live_kv_tokens", "sgl_memory_live_kv_tokens_total"),
        ("peak_request_tokens", "sgl_memory_peak_request_tokens_total"),
    ):
        assert grew(name) == sum(m[key] for m in reported), name
    assert grew("sgl_memory_kv_reads_total", kind="eff") == sum(m["eff_kv_reads"] for m in reported)
    assert grew("sgl_memory_scoring_seconds_count") == 2
    assert grew("sgl_memory_bad_requests_total", reason="field") == 1
    assert not any("session" in dict(labels) or "tenant" in dict(labels) for _, labels in after)  # bounded labels


def test_no_leak_reported_after_all_of_the_above(intent_server):
    time.sleep(3)  # idle: SGLang's strict idle check (available + evictable + protected == total) runs
    assert intent_server.get("/health").status_code == 200
    log = intent_server.log()
    assert "memory leak detected" not in log and "double free" not in log and "use-after-free" not in log
    assert requests.get(intent_server.url + "/sgl_memory/info").json()["config"]["intent"]["enabled"] is True
