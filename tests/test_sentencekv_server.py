"""SentenceKV in the real server, on the small model: with every sentence retrieved a request decodes
exactly as with the full cache and reads every position (counted independently from the prompt
and output lengths); with a small budget it reads what its settings allow, reproducibly; with
`system` on it reads the whole system message too; at page size 16 it answers and reads as at
page size 1; it runs beside intent pruning on one request; bad values are 400s naming the field;
its series reach Prometheus."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from servers import TEST_MODEL
from sgl_memory import models

pytestmark = pytest.mark.server

SINKS, RECENT, WINDOW = 4, 32, 32  # the section's defaults: always read besides the pool
FACTS = [
    f"The locker number {i} holds a {color} box with code {1000 + 37 * i}."
    for i, color in zip(range(40), ["red", "green", "blue", "white", "black"] * 8)
]
PROMPT = "Read the notes.\n" + " ".join(FACTS) + "\nQuestion: what is the code of the box in locker number 7? Answer:"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def server(all_server):
    """The suite's server with every mechanism on: SentenceKV with the section's defaults, intent
    with a budget no request of this module reaches unless it asks for less."""
    return all_server


def generate(server, field: dict, ids: list[int] | None = None) -> dict:
    # each request prefills its whole prompt: a prefill split differently at a cached prefix rounds
    # differently in bf16, which can flip a near-tie of the small model
    assert server.post("/flush_cache?timeout=60", {}).status_code == 200
    prompt = {"text": PROMPT} if ids is None else {"input_ids": ids}
    body = {
        **prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        "sgl_memory": field,
    }
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def full_reads(meta: dict) -> float:
    """A decode step j (1 .. T-1) of the full cache reads the prompt and j generated tokens."""
    length, steps = meta["prompt_tokens"], meta["completion_tokens"] - 1
    return sum(length + j for j in range(1, steps + 1)) / steps


@pytest.mark.parametrize("selection", ["sentence", "page"])
def test_with_every_sentence_retrieved_it_is_the_full_cache(server, selection):
    full = generate(server, {"sentencekv": {"enabled": False}})
    every = generate(server, {"sentencekv": {"budget": 1 << 20, "keep_factor": 1, "selection": selection}})
    assert every["output_ids"] == full["output_ids"]
    m, meta = every["meta_info"]["sgl_memory"], every["meta_info"]
    assert "sentences" not in (full["meta_info"].get("sgl_memory") or {})
    assert m["decode_steps"] == meta["completion_tokens"] - 1 == NEW_TOKENS - 1
    assert m["kv_read_per_step"] == pytest.approx(full_reads(meta))
    assert m["kept_tokens"] == meta["prompt_tokens"]
    assert m["sentences"] >= (len(FACTS) if selection == "sentence" else (meta["prompt_tokens"] - SINKS - RECENT) // 16)


@pytest.mark.parametrize("selection", ["sentence", "page"])
def test_a_small_budget_reads_the_always_read_the_retrieved_and_the_generated(server, selection):
    budget, factor = 48, 2
    out = generate(server, {"sentencekv": {"budget": budget, "keep_factor": factor, "selection": selection}})
    m, meta = out["meta_info"]["sgl_memory"], out["meta_info"]
    always = SINKS + max(RECENT, WINDOW)
    # the page baseline keeps every prompt token readable; sentences, the pool of keep_factor x budget
    assert m["kept_tokens"] == (always + budget * factor if selection == "sentence" else meta["prompt_tokens"])
    steps = meta["completion_tokens"] - 1
    generated = sum(range(1, steps + 1)) / steps
    assert always + generated < m["kv_read_per_step"] <= always + budget + generated
    assert m["kv_read_per_step"] < full_reads(meta) / 3
    assert 1 <= m["retrieved_sentences"] <= budget
    again = generate(server, {"sentencekv": {"budget": budget, "keep_factor": factor, "selection": selection}})
    assert again["output_ids"] == out["output_ids"]
    assert again["meta_info"]["sgl_memory"]["kv_read_per_step"] == m["kv_read_per_step"]


def test_system_on_reads_the_whole_system_message_at_every_step(server):
    """`system: true` adds the system message to the always-read positions: the prompt tokens a
    step may read grow from the sinks to the message's length (found here as the position of the
    second message opener), and every step reads them besides what it retrieves."""
    tok = AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))
    messages = [
        {"role": "system", "content": "You answer questions about the lockers in the notes. " * 6},
        {"role": "user", "content": PROMPT},
    ]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    system_end = ids.index(tok.convert_tokens_to_ids("<|im_start|>"), 1)
    assert system_end > SINKS
    budget, factor, recent = 48, 2, max(RECENT, WINDOW)
    plain = generate(server, {"sentencekv": {"budget": budget, "keep_factor": factor}}, ids)["meta_info"]
    on = generate(server, {"sentencekv": {"budget": budget, "keep_factor": factor, "system": True}}, ids)["meta_info"]
    assert plain["sgl_memory"]["kept_tokens"] == SINKS + recent + budget * factor
    assert on["sgl_memory"]["kept_tokens"] == system_end + recent + budget * factor
    steps = on["completion_tokens"] - 1
    generated = sum(range(1, steps + 1)) / steps
    assert (
        system_end + recent + generated
        < on["sgl_memory"]["kv_read_per_step"]
        <= system_end + recent + budget + generated
    )


def test_it_composes_with_intent_pruning_on_one_request(server):
    field = {"session_id": "skv-intent", "budget": 256}
    pruned = generate(server, {**field, "sentencekv": {"enabled": False}})
    both = generate(
        server, {**field, "session_id": "skv-intent-2", "sentencekv": {"budget": 1 << 20, "keep_factor": 1}}
    )
    m = both["meta_info"]["sgl_memory"]
    assert m["compression_events"] == 1 and pruned["meta_info"]["sgl_memory"]["compression_events"] == 1
    # every sentence retrieved over a pruned row: the pruned request's output, reading its live positions only
    assert both["output_ids"] == pruned["output_ids"]
    steps = both["meta_info"]["completion_tokens"] - 1
    assert m["kept_tokens"] == m["live_kv_tokens"] - both["meta_info"]["completion_tokens"]
    assert m["kv_read_per_step"] == pytest.approx(m["kept_tokens"] + sum(range(1, steps + 1)) / steps)


def test_at_page_size_16_it_reads_positions_as_at_page_size_1(all_server, paged_server):
    """The reads are token positions, which a page size does not change: on the server whose pool
    is allocated in pages of 16 (SentenceKV and persistence alone: intent refuses pages), every
    sentence retrieved is the full cache's output reading every position, and a small budget reads
    what it reads at page size 1, answering the same tokens."""
    server, paged = all_server, paged_server
    small = {"sentencekv": {"budget": 48, "keep_factor": 2}}
    at_one = generate(server, small)
    full = generate(paged, {"sentencekv": {"enabled": False}})
    every = generate(paged, {"sentencekv": {"budget": 1 << 20, "keep_factor": 1}})
    at_16 = generate(paged, small)
    assert every["output_ids"] == full["output_ids"]
    assert every["meta_info"]["sgl_memory"]["kv_read_per_step"] == pytest.approx(full_reads(every["meta_info"]))
    assert at_16["output_ids"] == at_one["output_ids"]
    m16, m1 = at_16["meta_info"]["sgl_memory"], at_one["meta_info"]["sgl_memory"]
    assert (m16["kept_tokens"], m16["kv_read_per_step"], m16["sentences"]) == (
        m1["kept_tokens"],
        m1["kv_read_per_step"],
        m1["sentences"],
    )


@pytest.mark.parametrize(
    "field, needle",
    [
        ({"budget": -1}, "sgl_memory.sentencekv.budget"),
        ({"window": "x"}, "sgl_memory.sentencekv.window"),
        ({"nope": 1}, "sgl_memory.sentencekv: unknown field(s) nope"),
        ([], "sgl_memory.sentencekv must be an object"),
    ],
)
def test_bad_values_are_400s_naming_the_field(server, field, needle):
    r = server.post("/generate", {"text": "hi", "sgl_memory": {"sentencekv": field}})
    assert r.status_code == 400 and needle in r.text, r.text


def test_its_series_reach_prometheus_and_the_stats(server):
    before = server.prometheus()
    out = generate(server, {"sentencekv": {"budget": 64}})
    after, stats = server.prometheus(), server.get("/sgl_memory/stats").json()
    grew = {
        name: after.get((name, ()), 0) - before.get((name, ()), 0)
        for name in ("sgl_memory_sentencekv_decode_steps_total", "sgl_memory_sentencekv_kept_tokens_total")
    }
    m = out["meta_info"]["sgl_memory"]
    assert grew == {
        "sgl_memory_sentencekv_decode_steps_total": m["decode_steps"],
        "sgl_memory_sentencekv_kept_tokens_total": m["kept_tokens"],
    }
    assert stats["totals"]["sentences"] >= m["sentences"] and stats["totals"]["decode_steps"] >= m["decode_steps"]
    info = server.get("/sgl_memory/info").json()["config"]
    assert info["sentencekv"]["enabled"] is True and info["sentencekv"]["budget"] == 1024
