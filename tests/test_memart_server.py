"""KV memory (MemArt) inside the real server (SmolLM2-135M, memory on).

A session states facts over several full-history turns; memory-mode requests then carry only a
question. References: the same turns under another tenant followed by a plain request whose prompt
is the session's whole path plus the question (retrieving every block must give exactly its greedy
answer: the blocks go back to their own positions, so the KV is bit-identical), and the fact itself
for a small top_k."""

from __future__ import annotations

import json
import time

import pytest
import requests
from transformers import AutoTokenizer

from greedy import REQUEST, parted_at
from servers import SERVER_DTYPE, TEST_MODEL
from sgl_memory import models

pytestmark = pytest.mark.server

A, REF = (
    "memart-a",
    "memart-ref",
)  # the session's tenant and the reference's (the suite's other tests use other tenants)
# KV memory alone on the server with every mechanism on: intent and SentenceKV left out of a request
# whose prefilled and cached tokens are counted (each prefills the rows it reads itself: the
# latest message, the last 32 rows)
ALONE = {"intent": False, "sentencekv": {"enabled": False}}

SYSTEM = [{"role": "system", "content": "You are a brief, helpful assistant."}]
FACTS = [
    "Remember this: my cat is called Pepper.",
    "I went hiking on Saturday.",
    "The weather was sunny and warm.",
    "I made soup for dinner.",
    "Tomorrow I will read a book.",
]
QUESTION = "What is my cat called?"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))


@pytest.fixture(scope="module")
def mem_server(all_server):
    # blocks of 16 tokens, placed alone (not the default lines): these tests count blocks
    memory = all_server.get("/sgl_memory/info").json()["config"]["memory"]
    assert (memory["block_size"], memory["top_k"], memory["cut"], memory["unit"], memory["placed_tokens"]) == (
        16,
        4,
        "tokens",
        "block",
        0,
    )
    return all_server


def render(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def system_end(tok, ids):
    """Where the first message (the system message) ends: the second message opener."""
    opener = tok.convert_tokens_to_ids("<|im_start|>")
    return [i for i, t in enumerate(ids) if t == opener][1]


def question_rows(tok, ids):
    """What a probe of this prompt computes at least: its last message from the text on (the tree
    may give it what it caches before that)."""
    opener = tok.convert_tokens_to_ids("<|im_start|>")
    last = max(i for i, t in enumerate(ids[:-1]) if t == opener and tok.decode([ids[i + 1]]) == "user")
    return len(ids) - next(j + 1 for j in range(last, len(ids)) if "\n" in tok.decode([ids[j]]))


def generate(server, ids, memory, n=6, status=200, **params):
    sampling = {"max_new_tokens": n, "temperature": 0}
    r = server.post("/generate", {"input_ids": ids, "sampling_params": sampling, "sgl_memory": memory, **params})
    assert r.status_code == status, r.text
    return r.json()


def state_facts(server, tok, tenant, session="s"):
    """FACTS as full-history turns of one session; returns the session's KV path (the last turn's
    prompt and output, less the output's last token, whose KV is never computed)."""
    ids = render(tok, SYSTEM + [{"role": "user", "content": FACTS[0]}])
    for i in range(len(FACTS)):
        out = generate(server, ids, {"session_id": session, "tenant": tenant})["output_ids"]
        if i + 1 < len(FACTS):
            ids = (
                ids
                + out
                + tok.encode(
                    f"\n<|im_start|>user\n{FACTS[i + 1]}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
                )
            )
    return ids + out[:-1]


@pytest.fixture(scope="module")
def pool_before(mem_server):
    """The memory pool gauges before this module's sessions recorded anything (the server's other
    sessions, of other tests, are in them too)."""
    return mem_server.prometheus()


@pytest.fixture(scope="module")
def stated(mem_server, tok, pool_before):
    return {tenant: state_facts(mem_server, tok, tenant) for tenant in (A, REF)}


def retrieve(top_k=None, store=False, **extra):
    return {"mode": "retrieve", "store": store, **({"top_k": top_k} if top_k else {}), **extra}


def test_every_block_retrieved_equals_the_full_history_prompt(mem_server, tok, stated):
    # no system message: the blocks go first, at their own positions, so the KV is bit-identical
    q = tok.encode(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    got = generate(mem_server, q, {"session_id": "s", "tenant": A, "memory": retrieve(top_k=1000), **ALONE})
    m = got["meta_info"]["sgl_memory"]
    assert m["memory_kv_tokens"] == len(stated[A]) and m["retrieved_turns"] == list(range(len(FACTS)))
    assert m["prefill_tokens"] == len(q) and question_rows(tok, q) <= m["probe_tokens"] <= len(q)
    # the reference tenant's turns were computed the same way; its tree holds the path
    want = generate(mem_server, stated[REF] + q, {"session_id": "s", "tenant": REF, **ALONE})
    assert want["meta_info"]["cached_tokens"] >= len(stated[REF]) - 1
    assert got["output_ids"] == want["output_ids"]


def test_prometheus_pool_size_is_what_the_sessions_recorded(mem_server, tok, stated, pool_before):
    """The memory pool gauges (GET /metrics) against the pools' contents as retrieval reports them:
    every block of both sessions retrieved, and their bytes from the model's shape: keys and values
    in the pool's dtype (bf16 or float32, as the launcher chose) and an int32 position per token,
    what the KV pool holds per token and 4 bytes; the index, the scoring layers' keys (the first
    half) once more, in a buffer that may hold an eighth more rows than it uses. The gauges grew
    by that since before the two sessions recorded their turns."""
    from transformers import AutoConfig

    from sgl_memory.memart.settings import MemArtConfig

    cfg = AutoConfig.from_pretrained(models.model_dir(TEST_MODEL))
    per_layer = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    per_value = cfg.num_hidden_layers * per_layer
    scored = round(cfg.num_hidden_layers * MemArtConfig().score_layers) * per_layer
    q = tok.encode(
        "<|im_start|>user\nWhat did I do on Saturday?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    before = mem_server.prometheus()
    pools = [
        generate(mem_server, q, {"session_id": "s", "tenant": t, "memory": retrieve(top_k=1000)})["meta_info"][
            "sgl_memory"
        ]
        for t in (A, REF)
    ]
    blocks = sum(m["retrieved_blocks"] for m in pools)
    tokens = sum(m["memory_kv_tokens"] for m in pools)
    assert pools[0]["memory_kv_tokens"] == len(stated[A]) and blocks == sum(m["memory_blocks"] for m in pools)

    def grown(samples, name):
        return samples[(name, ())] - pool_before.get((name, ()), 0)

    deadline = time.monotonic() + 10  # the gauges are set by the memory worker once a turn is in its pool
    while (
        grown(after := mem_server.prometheus(), "sgl_memory_memory_pool_blocks") != blocks
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert (
        grown(after, "sgl_memory_memory_pool_blocks") == blocks
        and grown(after, "sgl_memory_memory_pool_tokens") == tokens
    )
    value_bytes = {"bfloat16": 2, "float32": 4}[SERVER_DTYPE]
    kv_bytes, index_bytes = tokens * (2 * per_value * value_bytes + 4), tokens * scored * value_bytes
    assert kv_bytes + index_bytes <= grown(after, "sgl_memory_memory_pool_bytes") <= kv_bytes + 1.125 * index_bytes
    grew = after[("sgl_memory_retrievals_total", ())] - before.get(("sgl_memory_retrievals_total", ()), 0)
    assert (
        grew == 2
        and after[("sgl_memory_retrieved_blocks_total", ())] - before.get(("sgl_memory_retrieved_blocks_total", ()), 0)
        == blocks
    )


def test_memory_mode_answers_an_early_fact_prefilling_only_the_question(mem_server, tok, stated):
    q = render(tok, SYSTEM + [{"role": "user", "content": QUESTION}])
    memory = {"session_id": "s", "tenant": A, "memory": retrieve(top_k=4), **ALONE}
    first = generate(mem_server, q, memory, n=16, **REQUEST)
    m = first["meta_info"]["sgl_memory"]
    assert m["retrieved_blocks"] == 4 and 0 in m["retrieved_turns"]  # the turn that states the fact
    turn0 = render(tok, SYSTEM + [{"role": "user", "content": FACTS[0]}])
    pepper = next(p for p in range(len(turn0)) if "Pepper" in tok.decode(turn0[: p + 1]))
    assert any(turn == 0 and offset <= pepper < offset + n for turn, offset, n in m["retrieved_spans"])
    assert m["memory_kv_tokens"] == 64 and m["prefill_tokens"] == len(q)
    assert first["meta_info"]["prompt_tokens"] == 64 + len(q) and question_rows(tok, q) <= m["probe_tokens"] <= len(q)
    assert "Pepper" in first["text"], first["text"]
    # the same assembled prefix again: the radix tree holds it, and the question with it; its greedy
    # answer is the first one's up to rounding (in bf16 a one-token extend over the cached rows
    # flipped a near-tie that the question's own prefill did not: tests/greedy.py)
    again = generate(mem_server, q, memory, n=16, **REQUEST)
    assert (
        again["meta_info"]["cached_tokens"] >= 64 + len(q) - 1
        and again["meta_info"]["sgl_memory"]["prefill_tokens"] <= 1
    )
    parted_at(again, first, SERVER_DTYPE)


def test_a_prompt_that_carries_its_answer_retrieves_for_the_question(mem_server, tok, stated):
    """The probe stops at the header of the message after the question: a prompt that goes on
    into an assistant turn (continued, or teacher-forced to score an answer) probes the question's
    tokens only, so it retrieves the blocks the question alone does, and its own tokens are all
    there after them."""
    q = render(tok, SYSTEM + [{"role": "user", "content": QUESTION}])
    answer = tok.encode("Your cat is called Pepper.<|im_end|>", add_special_tokens=False)
    memory = {"session_id": "s", "tenant": A, "memory": retrieve(top_k=4)}
    alone = generate(mem_server, q, memory)["meta_info"]
    carried = generate(mem_server, q + answer, memory)["meta_info"]
    # the second probe takes what the first one left in the tree up to the question
    assert (
        carried["sgl_memory"]["probe_tokens"] == question_rows(tok, q) <= alone["sgl_memory"]["probe_tokens"] <= len(q)
    )
    assert carried["sgl_memory"]["retrieved_spans"] == alone["sgl_memory"]["retrieved_spans"]
    assert carried["prompt_tokens"] == alone["prompt_tokens"] + len(answer)


def logprobs(server, ids, memory, **params):
    r = server.post(
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            **params,
            "sgl_memory": memory,
        },
    )
    assert r.status_code == 200, r.text
    return [lp for lp, *_ in r.json()["meta_info"]["input_token_logprobs"]]


def test_input_logprobs_of_a_memory_request_are_its_own_tokens(mem_server, tok, stated):
    """logprob_start_len counts in the client's prompt: with every block placed first, the answer's
    input log-probabilities equal those of the plain request holding the session's whole path (the
    same KV at the same positions); after the system message and without a start, there are as
    many as plain SGLang returns for the client's prompt."""
    answer = tok.encode("Your cat is called Pepper.<|im_end|>", add_special_tokens=False)
    q = tok.encode(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    # a tenant of its own: other tests add turns to tenant a's session
    path = state_facts(mem_server, tok, "memart-lp")
    memory = {"session_id": "s", "tenant": "memart-lp", "memory": retrieve(top_k=1000), **ALONE}
    got = logprobs(mem_server, q + answer, memory, logprob_start_len=len(q))
    assert path == stated[REF]
    want = logprobs(
        mem_server,
        stated[REF] + q + answer,
        {"session_id": "s", "tenant": REF, **ALONE},
        logprob_start_len=len(stated[REF] + q),
    )
    assert len(got) == len(want) == len(answer)
    # the first is the prompt's last row's, which a cached prompt does not compute (None in both);
    # the two prefills split where each one's cache ends (earlier tests cached parts of both), which
    # in a bf16 pool moves a log-probability by up to a few 1e-2 (the bug this catches put the
    # blocks' own log-probabilities here: 184 of them for 7 tokens, several nats apart)
    assert max(abs(a - b) for a, b in zip(got[1:], want[1:])) < 0.05
    plain = {"session_id": "s", "tenant": REF, **ALONE}
    assert len(logprobs(mem_server, q, memory)) == len(logprobs(mem_server, q, plain))
    s = render(tok, SYSTEM + [{"role": "user", "content": QUESTION}])
    after = {**memory, "memory": retrieve(top_k=4, placement="after_system")}
    assert len(logprobs(mem_server, s + answer, after, logprob_start_len=len(s))) == len(answer)
    assert len(logprobs(mem_server, s, after)) == len(logprobs(mem_server, s, plain))


def test_blocks_after_the_system_message(mem_server, tok, stated):
    """placement after_system: [system message][blocks][question]; the system message's KV is the
    probe's, so only the question after it is prefilled, and the assembly composes with the tree."""
    q = render(tok, SYSTEM + [{"role": "user", "content": QUESTION}])
    memory = {"session_id": "s", "tenant": A, "memory": retrieve(top_k=4, placement="after_system"), **ALONE}
    first = generate(mem_server, q, memory)
    m = first["meta_info"]["sgl_memory"]
    assert m["memory_kv_tokens"] == 64 and m["prefill_tokens"] == len(q) - system_end(tok, q)
    assert first["meta_info"]["prompt_tokens"] == 64 + len(q)
    again = generate(mem_server, q, memory)
    assert again["meta_info"]["sgl_memory"]["prefill_tokens"] <= 1 and again["output_ids"] == first["output_ids"]


def test_header_blocks_are_placed_with_the_chosen_ones(mem_server, tok):
    """header turn in the server: what was chosen stays, only turns' first blocks are added, every
    turn placed has its first block, in chronological order (which blocks a header adds is
    `choose`'s unit test: on these sessions retrieval picks each turn's first block itself)."""
    story = (
        "Stock count: 4821 bolts, 9930 nuts, 7712 washers, 1203 hinges, 5540 screws, 3381 rivets, 6619 nails. "
        "By the way, I bought a new bicycle, and the bicycle is bright orange."
    )
    ids = tok.encode("Notes of the week.\n", add_special_tokens=False)
    generate(mem_server, ids, {"session_id": "week", "tenant": A}, n=1)
    generate(mem_server, ids + tok.encode(story, add_special_tokens=False), {"session_id": "week", "tenant": A}, n=1)
    q = render(tok, SYSTEM + [{"role": "user", "content": "What colour is my new bicycle?"}])
    for top_k in (1, 2, 3):
        plain = generate(mem_server, q, {"session_id": "week", "tenant": A, "memory": retrieve(top_k=top_k)})
        headed = generate(
            mem_server, q, {"session_id": "week", "tenant": A, "memory": retrieve(top_k=top_k, header="turn")}
        )
        chosen = {tuple(x) for x in plain["meta_info"]["sgl_memory"]["retrieved_spans"]}
        got = [tuple(x) for x in headed["meta_info"]["sgl_memory"]["retrieved_spans"]]
        assert chosen <= set(got) and got == sorted(got) and len(got) == len(set(got))
        assert all(offset == 0 for _, offset, _ in set(got) - chosen)
        assert {turn for turn, _, _ in got} <= {turn for turn, offset, _ in got if offset == 0}


def test_another_sessions_memory_is_never_retrieved(mem_server, tok, stated):
    q = render(tok, SYSTEM + [{"role": "user", "content": QUESTION}])
    for memory in (
        {"session_id": "other", "tenant": A},
        {"session_id": "s", "tenant": "memart-stranger"},
        {"session_id": "s"},
    ):
        out = generate(mem_server, q, {**memory, "memory": retrieve(top_k=1000)})
        m = out["meta_info"]["sgl_memory"]
        assert m["retrieved_blocks"] == 0 and m["memory_kv_tokens"] == 0 and m["memory_blocks"] == 0, memory
        # nothing is placed before the question (shared radix prefixes of the same tenant are not memory)
        assert out["meta_info"]["prompt_tokens"] == len(q) and "Pepper" not in out["text"]


def test_memory_turns_are_stored_unless_told_not_to(mem_server, tok):
    q = render(tok, SYSTEM + [{"role": "user", "content": "My dog is called Rex."}])
    generate(mem_server, render(tok, SYSTEM + [{"role": "user", "content": FACTS[0]}]), {"session_id": "grow"})
    before = generate(mem_server, q, {"session_id": "grow", "memory": retrieve(store=False)})["meta_info"]["sgl_memory"]
    kept = generate(mem_server, q, {"session_id": "grow", "memory": retrieve(store=True)}, n=8)
    after = generate(mem_server, q, {"session_id": "grow", "memory": retrieve(store=False)})["meta_info"]["sgl_memory"]
    assert kept["meta_info"]["sgl_memory"]["memory_blocks"] == before["memory_blocks"]  # counted before its own turn
    # the turn is its last message and its output (less the last output token, which has no KV):
    # not the system message, which every memory-mode request repeats, and not the placed blocks
    new_tokens = len(q) - system_end(tok, q) + 8 - 1
    assert after["memory_blocks"] == before["memory_blocks"] + -(-new_tokens // 16)
    # the same with the blocks after the system message
    generate(mem_server, q, {"session_id": "grow", "memory": retrieve(store=True, placement="after_system")}, n=8)
    last = generate(mem_server, q, {"session_id": "grow", "memory": retrieve(store=False)})["meta_info"]["sgl_memory"]
    assert last["memory_blocks"] == after["memory_blocks"] + -(-(len(q) - system_end(tok, q) + 7) // 16)


def test_openai_api_and_streaming_carry_memory_mode(mem_server, stated):
    body = {
        "model": "m",
        "messages": SYSTEM + [{"role": "user", "content": QUESTION}],
        "max_tokens": 12,
        "temperature": 0,
        "sgl_memory": {"session_id": "s", "tenant": A, "memory": retrieve(top_k=4)},
    }
    r = mem_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert "Pepper" in r.json()["choices"][0]["message"]["content"] and r.json()["sgl_memory"]["retrieved_blocks"] == 4
    with requests.post(
        mem_server.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=300
    ) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines(decode_unicode=True) if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Pepper" in text
    # the last chunk (no choices, as OpenAI's usage chunk) reports the streamed request's recall
    assert chunks[-1]["choices"] == [] and chunks[-1]["sgl_memory"]["retrieved_blocks"] == 4, chunks[-1]


@pytest.mark.parametrize(
    "memory, needle",
    [
        ({"session_id": "s", "memory": {"mode": "recall"}}, "mode 'recall' is unknown"),
        ({"memory": {"mode": "retrieve"}}, "needs sgl_memory.session_id"),
        ({"session_id": "s", "memory": {"probe": "x"}}, "unknown field(s) probe"),
        ({"session_id": "s", "memory": {"top_k": -3}}, "top_k must be an integer"),
        ({"session_id": "s", "memory": {"unit": "line"}}, "memory.cut: tokens"),  # this server's blocks know no lines
        (
            {"session_id": "s", "memory": {"mode": "text", "recompute": "full"}},
            "mode 'text' places the session's lines",
        ),
        ({"session_id": "s", "memory": {"mode": "turns"}}, "mode 'turns' is unknown"),  # the server's own pass
    ],
)
def test_bad_memory_requests_are_400s(mem_server, memory, needle):
    r = mem_server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "sgl_memory": memory})
    assert r.status_code == 400 and needle in r.text, r.text
    # past the HTTP layer (custom_params set directly), the tokenizer-side hook refuses it as well
    direct = {
        "text": "hi",
        "sampling_params": {"max_new_tokens": 2, "custom_params": {"sgl_memory": json.dumps(memory)}},
    }
    r = mem_server.post("/generate", direct)
    assert r.status_code == 400 and needle in r.text, r.text
    empty = {"text": "", "sampling_params": {"max_new_tokens": 2}, "sgl_memory": {"session_id": "s", "memory": {}}}
    r = mem_server.post("/generate", empty)  # a memory-mode turn of no tokens: its probe would crash the scheduler
    assert r.status_code == 400 and "empty" in r.text, r.text
    batch = {
        "text": ["a", "b"],
        "sampling_params": {"max_new_tokens": 2},
        "sgl_memory": {"session_id": "s", "memory": {}},
    }
    r = mem_server.post("/generate", batch)
    assert r.status_code == 400 and "one prompt per request" in r.text, r.text
    assert mem_server.get("/health").status_code == 200


def test_memory_mode_on_a_server_without_memory_is_a_400(plain_server):
    r = plain_server.post(
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "sgl_memory": {"session_id": "s", "memory": {}}},
    )
    assert r.status_code == 400 and "memory.enabled: false" in r.text, r.text


def test_frontend_program_with_a_session_answers_from_memory(mem_server, stated):
    import sglang as sgl

    from sgl_memory.frontend import MemoryEndpoint

    @sgl.function
    def ask(s, question, session_id, tenant, memory=None):
        s += sgl.system(SYSTEM[0]["content"])
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))

    backend = MemoryEndpoint(mem_server.url, chat_template_name="chatml")  # SmolLM2 speaks ChatML
    state = ask.run(question=QUESTION, session_id="s", tenant=A, memory=retrieve(top_k=4), backend=backend)
    assert "Pepper" in state["answer"], state.text()
    assert state.get_meta_info("answer")["sgl_memory"]["retrieved_blocks"] == 4


def test_parallel_samples_all_use_the_memory(mem_server, tok, stated):
    """n > 1: SGLang runs one request per sample, and each must find the probe's queries."""
    q = render(tok, SYSTEM + [{"role": "user", "content": QUESTION}])
    body = {
        "input_ids": q,
        "sampling_params": {"max_new_tokens": 8, "n": 2, "temperature": 0.7},
        "sgl_memory": {"session_id": "s", "tenant": A, "memory": retrieve(top_k=4)},
    }
    r = mem_server.post("/generate", body)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 2
    for out in outs:
        assert out["meta_info"]["sgl_memory"]["memory_kv_tokens"] == 64 and out["meta_info"][
            "prompt_tokens"
        ] == 64 + len(q)


# an agent's system message: tool docs the session's every request repeats
TOOL_DOCS = "You can call these tools:\n" + "\n".join(
    f'{{"name": "{name}", "description": "{what}", '
    f'"parameters": {{"type": "object", "properties": {{"{arg}": {{"type": "string"}}}}}}}}'
    for name, what, arg in [
        ("get_weather", "The weather in a city today", "city"),
        ("book_table", "Books a table at a restaurant", "restaurant"),
        ("send_email", "Sends an email to a contact", "to"),
        ("find_flight", "Finds flights between two airports", "route"),
        ("play_music", "Plays a song on the speaker", "song"),
        ("set_alarm", "Sets an alarm for a time", "time"),
        ("convert", "Converts an amount between currencies", "amount"),
        ("translate", "Translates a sentence", "text"),
    ]
)
AGENT_TURNS = [
    "My favourite restaurant is Luigi's on Elm Street.",
    "Book me a flight from Oslo to Rome, I land at noon.",
    "My sister Ana lives in Lisbon and loves jazz.",
    "The meeting with Tom moved to Friday at 9.",
    "Which restaurant do I like?",
    "When is the meeting with Tom?",
    "Where does Ana live?",
]


def test_a_probe_that_reuses_the_cached_prefix_chooses_the_blocks_a_full_probe_does(mem_server, tok):
    """The probe takes what the tree caches of its prompt up to the question (an agent's tool docs,
    computed once) and computes the rest. Reference: the same probe after a cache flush, which
    computes every token as the probe did before it reused the tree. At every turn of a session,
    with the blocks after the system message as an agent's requests place them, the two choose the
    same blocks, and the reusing one prefills no more than the question's message."""
    system = [{"role": "system", "content": TOOL_DOCS}]
    session = {"session_id": "agent", "tenant": "memart-probe-reuse"}
    for i, text in enumerate(AGENT_TURNS):
        ids = render(tok, system + [{"role": "user", "content": text}])
        assert mem_server.post("/flush_cache?timeout=60", {}).status_code == 200
        full = generate(mem_server, ids, {**session, "memory": retrieve(top_k=4, placement="after_system")}, n=1)[
            "meta_info"
        ]["sgl_memory"]
        reused = generate(
            mem_server, ids, {**session, "memory": retrieve(top_k=4, placement="after_system", store=True)}
        )
        m = reused["meta_info"]["sgl_memory"]
        assert full["probe_tokens"] == len(ids) and m["probe_tokens"] <= len(ids) - system_end(tok, ids)
        assert m["retrieved_spans"] == full["retrieved_spans"], f"turn {i}"
        assert (m["retrieved_blocks"] > 0) == (i > 0)


# --- text mode: the session's recorded lines placed as prompt text (memart/text.py) ---------------

TEXT_HEADER = "Earlier in this conversation:\n"  # the server's memory.text_header (asserted below)


def with_lines(tok, question, lines):
    """The prompt a client would build itself: the lines open the question's message."""
    ids = render(tok, SYSTEM + [{"role": "user", "content": question}])
    user = [i for i, t in enumerate(ids) if t == tok.convert_tokens_to_ids("<|im_start|>")][-2]
    at = user + 3  # after its opener, "user" and the line end
    assert tok.decode(ids[user:at]) == "<|im_start|>user\n"
    return ids[:at] + tok.encode(TEXT_HEADER + "\n".join(lines) + "\n\n", add_special_tokens=False) + ids[at:]


def test_text_mode_places_the_lines_minilm_ranks_first_as_a_client_would(mem_server, tok, stated, minilm):
    """The session recorded once (full-history turns, as KV) answers in text mode too. Reference:
    the session's text split into lines here, ranked by MiniLM against the question by brute
    force, the top two placed by the client itself in a plain request (no session): the same
    prompt, the same greedy answer; nothing of it reused as KV."""
    assert mem_server.get("/sgl_memory/info").json()["config"]["memory"]["text_header"] == TEXT_HEADER
    text = tok.decode(stated[A], skip_special_tokens=True)
    lines = list(
        dict.fromkeys(s.strip() for s in text.split("\n") if s.strip() not in ("", "system", "user", "assistant"))
    )
    scores = minilm.encode(lines, normalize_embeddings=True) @ minilm.encode([QUESTION], normalize_embeddings=True)[0]
    best = sorted(sorted(range(len(lines)), key=lambda i: -scores[i])[:2])
    want_ids = with_lines(tok, QUESTION, [lines[i] for i in best])
    assert "Remember this: my cat is called Pepper." in [lines[i] for i in best]

    q = render(tok, SYSTEM + [{"role": "user", "content": QUESTION}])
    text_mode = {"mode": "text", "top_k": 2, "store": False}
    got = generate(mem_server, q, {"session_id": "s", "tenant": A, "memory": text_mode, **ALONE})
    want = generate(mem_server, want_ids, ALONE)
    assert got["meta_info"]["prompt_tokens"] == len(want_ids)
    assert got["output_ids"] == want["output_ids"]
    m = got["meta_info"]["sgl_memory"]
    assert m["text_lines"] == 2 and m["text_tokens"] == len(want_ids) - len(q)
    assert m["reused_tokens"] == 0 and m["prefill_work_share"] == 1.0 and m["retrieved_blocks"] == 0
    assert m["prefill_tokens"] == len(want_ids) - got["meta_info"]["cached_tokens"]
    # the same session in KV mode, unchanged by the text-mode read
    kv = generate(mem_server, q, {"session_id": "s", "tenant": A, "memory": retrieve(top_k=4), **ALONE})
    assert kv["meta_info"]["sgl_memory"]["retrieved_blocks"] == 4
    # the same prompt sent as text (/generate `text`): tokenized as SGLang tokenizes it, then the same
    assert tok(tok.decode(q))["input_ids"] == q  # the text stands for these ids
    as_text = mem_server.post(
        "/generate",
        {
            "text": tok.decode(q),
            "sampling_params": {"max_new_tokens": len(got["output_ids"]), "temperature": 0},
            "sgl_memory": {"session_id": "s", "tenant": A, "memory": text_mode, **ALONE},
        },
    )
    assert as_text.status_code == 200, as_text.text
    assert as_text.json()["output_ids"] == got["output_ids"]
    assert as_text.json()["meta_info"]["prompt_tokens"] == len(want_ids)
    # another tenant's session of the same id holds other lines: never these
    other = generate(mem_server, q, {"session_id": "s", "tenant": "memart-nobody", "memory": text_mode})
    assert other["meta_info"]["sgl_memory"]["text_lines"] == 0 and other["meta_info"]["prompt_tokens"] == len(q)


def test_a_text_mode_turn_records_its_message_and_answer_not_the_lines(mem_server, tok):
    """Its lines are the session's memory already: what it records is what a KV-mode turn records
    (its last message and its answer, in blocks of 16)."""
    session = {"session_id": "text-grow"}
    generate(mem_server, render(tok, SYSTEM + [{"role": "user", "content": FACTS[0]}]), session)
    q = render(tok, SYSTEM + [{"role": "user", "content": "My dog is called Rex."}])
    before = generate(mem_server, q, {**session, "memory": retrieve()})["meta_info"]["sgl_memory"]
    kept = generate(mem_server, q, {**session, "memory": {"mode": "text"}}, n=8)
    assert kept["meta_info"]["sgl_memory"]["text_lines"] >= 1  # it placed lines
    after = generate(mem_server, q, {**session, "memory": retrieve()})["meta_info"]["sgl_memory"]
    assert after["memory_blocks"] == before["memory_blocks"] + -(-(len(q) - system_end(tok, q) + 7) // 16)
