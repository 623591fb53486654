"""An 8-bit KV pool in the real server, sized by `--kv-pool-bytes`, every mechanism on it: SGLang's
`--kv-cache-dtype fp8_e4m3` (the pool's `fp8` server) and ours, `int8` (codes and a scale per token
and head; the `int8` server, float32). Each test runs on both, but the last (int8's rows against
an independent model of them).

References: the model's config (what a token's KV takes at one byte a value), SGLang's own count of
its pool (/server_info) and dtype, the same server's answers from its tree and its full cache (a
restore from disk, memory blocks placed at their own positions, a repair at ratio 1 against the
blocks prefilled as text, SentenceKV retrieving every sentence), and the tree's integrity check
before every batch (the server's environment), and for int8 transformers' model of the same
weights whose attention reads the cached positions' rows through kv_rows and a prefill's own as
computed (tests/rows_reference.py). How close the
answers are to a bf16 pool's is the fidelity benchmark's to say, not a test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from transformers import AutoTokenizer

import test_sentencekv_server as sentencekv
from servers import CATALOGUE, FP8_POOL_BYTES, TEST_MODEL, fixture_name
from sgl_memory import models
from sgl_memory.persist.header import head_metadata, named_chunks
from test_memart_server import ALONE, QUESTION, generate, render, retrieve, state_facts
from test_persist_server import SYSTEM, chat, flush, history, session_file

pytestmark = pytest.mark.server

# per server: its KV dtype, the bytes a head's row of one token takes beside its head dim's values,
# and the safetensors dtype of the store's own format (a write stores the pool's bytes)
POOLS = {"fp8": ("fp8_e4m3", 0, "F8_E4M3"), "int8": ("int8", 2, "I8")}


@pytest.fixture(scope="module", params=list(POOLS))
def server_name(request):
    return request.param


@pytest.fixture(scope="module")
def eight_bit(server_name, request):
    """The 8-bit server of this run of the module's tests (conftest: `server_name` names it)."""
    return request.getfixturevalue(fixture_name(server_name))


def test_the_pools_bytes_hold_a_token_at_one_byte_a_value(eight_bit, server_name):
    cfg = json.loads((models.model_dir(TEST_MODEL) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype, scale_bytes, _ = POOLS[server_name]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (head_dim + scale_bytes)  # K and V
    pool = eight_bit.get("/sgl_memory/info").json()["kv_pool"]
    assert (pool["kv_cache_dtype"], pool["bytes_per_token"], pool["source"]) == (dtype, per_token, "--kv-pool-bytes")
    # about twice what the same bytes hold in bf16, four times float32
    assert pool["tokens"] == FP8_POOL_BYTES // per_token
    info = eight_bit.get("/server_info").json()
    assert info["max_total_num_tokens"] == pool["tokens"]
    # SGLang's own flag: its fp8 value, or (int8 being ours) the compute dtype it was left to choose
    assert info["kv_cache_dtype"] == (dtype if dtype.startswith("fp8") else "auto")


def test_a_session_restored_from_disk_into_the_8_bit_pool_answers_as_from_the_tree(eight_bit, server_name):
    """No warm tier: after a flush the second turn's history comes back from the store's file, which
    holds the pool's own bytes (`quant: auto` on an 8-bit pool: nothing requantized), and the greedy
    answer is the one the tree gave."""
    turns = ["Name three primary colours.", "Which of them is the sky's?"]
    first, _, _ = chat(eight_bit, [SYSTEM, {"role": "user", "content": turns[0]}], "fp8-restore", max_tokens=16)
    messages = history(turns[:1], [first]) + [{"role": "user", "content": turns[1]}]
    from_tree, usage, metrics = chat(eight_bit, messages, "fp8-restore", max_tokens=16)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert metrics["restored_tokens"] == 0 and cached > 0
    flush(eight_bit)
    head = session_file(eight_bit.dir / "store", "fp8-restore")
    meta = head_metadata(head)
    dtype, _, stored = POOLS[server_name]
    assert meta and meta["quant"] == dtype, meta
    for chunk in named_chunks(meta):
        with safe_open(head.parent / chunk.name, "pt") as f:
            # one byte a value (an int8 row's scale in its last two), nothing else
            assert {f.get_slice(name).get_dtype() for name in f.keys()} == {stored}
    restored, usage, metrics = chat(eight_bit, messages, "fp8-restore", max_tokens=16)
    assert metrics["restored_from"] == "disk" and metrics["restored_tokens"] > 0, metrics
    assert usage["prompt_tokens_details"]["cached_tokens"] >= cached  # the history came back, not prefilled
    assert restored == from_tree


def test_pruning_keeps_its_budget_in_the_8_bit_pool(eight_bit):
    """IntentKV's eviction compacts the request's kept rows inside the 8-bit pool (the integrity
    check runs before every batch), and the session's next turn is served on the pruned path."""
    text = " ".join(f"Step {i}: the tool read file_{i % 7}.py and found {i * 3} lines." for i in range(60))
    messages = [
        SYSTEM,
        {"role": "user", "content": text},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Which file was read most often?"},
    ]
    budget = 96
    answer, _, metrics = chat(eight_bit, messages, "fp8-prune", budget=budget, scorer="streaming_llm", max_tokens=8)
    assert metrics["compression_events"] == 1 and metrics["live_kv_tokens"] == budget + 8, metrics
    again, _, _ = chat(
        eight_bit,
        messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}],
        "fp8-prune",
        max_tokens=8,
    )
    assert again
    assert eight_bit.get("/sgl_memory/integrity").json()["whole"] is True


# --- the mechanisms that place, recompute and read pool rows, on the 8-bit pool ------------------

MEMORY, REFERENCE = "fp8-memory", "fp8-reference"  # the session's tenant and the reference's


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))


@pytest.fixture(scope="module")
def stated(eight_bit, tok):
    """The same facts stated in two tenants' sessions: one recalled as KV memory, one the reference."""
    return {tenant: state_facts(eight_bit, tok, tenant) for tenant in (MEMORY, REFERENCE)}


def test_every_memory_block_placed_in_the_8_bit_pool_answers_as_the_full_history(eight_bit, tok, stated):
    """KV memory copies a session's blocks out of the 8-bit pool and places them back: with no
    system message they go back to their own positions, so the placed KV is the pool's bytes again
    and the answer is the full history's (the reference tenant's path, from its tree)."""
    q = tok.encode(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    got = generate(eight_bit, q, {"session_id": "s", "tenant": MEMORY, "memory": retrieve(top_k=1000), **ALONE})
    assert got["meta_info"]["sgl_memory"]["memory_kv_tokens"] == len(stated[MEMORY])
    want = generate(eight_bit, stated[REFERENCE] + q, {"session_id": "s", "tenant": REFERENCE, **ALONE})
    assert want["meta_info"]["cached_tokens"] >= len(stated[REFERENCE]) - 1
    assert got["output_ids"] == want["output_ids"]


def test_keep_writes_its_recomputed_rows_into_the_8_bit_pool(eight_bit, tok, stated):
    """Memory placed after the system message and repaired: KEEP at ratio 1 recomputes every placed
    row at every layer and writes it into the 8-bit pool, which must answer as the same blocks
    prefilled as text (`recompute: full`); its default ratio recomputes a part."""
    layers = json.loads((models.model_dir(TEST_MODEL) / "config.json").read_text())["num_hidden_layers"]
    q = render(tok, [SYSTEM, {"role": "user", "content": QUESTION}])

    def ask(recompute: str, **keep) -> dict:
        memory = {"top_k": 4, "store": False, "recompute": recompute}
        field = {"session_id": "s", "tenant": MEMORY, "memory": memory, **ALONE, **({"keep": keep} if keep else {})}
        return generate(eight_bit, q, field)

    every, full, part = ask("keep", ratio=1.0), ask("full"), ask("keep")
    m = every["meta_info"]["sgl_memory"]
    placed = m["memory_kv_tokens"]
    assert placed == 4 * 16 and m["recompute"] == "keep" and m["recompute_share"] == 1.0, m
    assert m["recomputed_token_layers"] == placed * layers
    assert every["output_ids"] == full["output_ids"]
    share = part["meta_info"]["sgl_memory"]["recompute_share"]
    assert 0 < share < 1 and part["meta_info"]["sgl_memory"]["recompute_refused"] is None
    assert eight_bit.get("/sgl_memory/integrity").json()["whole"] is True


def test_sentencekv_reads_the_8_bit_pool_as_the_full_cache_when_it_retrieves_every_sentence(eight_bit):
    """SentenceKV's tables are built from the 8-bit pool's keys and its decode steps read the pool
    through index lists: with every sentence retrieved it decodes as the full cache does and reads
    every position; with a small budget it reads a third or less, reproducibly."""
    full = sentencekv.generate(eight_bit, {"sentencekv": {"enabled": False}})
    every = sentencekv.generate(eight_bit, {"sentencekv": {"budget": 1 << 20, "keep_factor": 1}})
    assert every["output_ids"] == full["output_ids"]
    assert every["meta_info"]["sgl_memory"]["kv_read_per_step"] == pytest.approx(
        sentencekv.full_reads(every["meta_info"])
    )
    small = [sentencekv.generate(eight_bit, {"sentencekv": {"budget": 48, "keep_factor": 2}}) for _ in range(2)]
    read = small[0]["meta_info"]["sgl_memory"]["kv_read_per_step"]
    assert read < sentencekv.full_reads(small[0]["meta_info"]) / 3
    again = small[1]["meta_info"]["sgl_memory"]["kv_read_per_step"]
    assert small[1]["output_ids"] == small[0]["output_ids"] and again == read


def test_the_int8_pools_cached_rows_are_read_through_kv_rows_and_a_prefills_own_rows_as_computed(int8_server):
    """The independent reference: transformers' model of the same weights in float32 (as the int8
    server computes), its attention reading the K and V rows of the positions the server had cached
    encoded and decoded as the pool stores them, and the prompt's new positions as computed
    (tests/rows_reference.py, run in the server's environment: the same CPU kernels, so the same
    codes). A prompt prefilled whole is the float model's; the same prompt's second half over its
    cached first half is the rows model's up to summation order, and far from the float model's and
    from a model that reads the new positions back from the pool too: the int8 path adds nothing to
    the quantization, the quantization is there, and it is applied once."""
    tok = AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))
    boxes = enumerate(["red", "blue", "green"] * 8)
    facts = " ".join(f"Fact {i}: the {colour} box holds {i * 7 % 13} keys." for i, colour in boxes)
    # a session of its own: its first half is cached by the first request only
    ids = render(tok, [SYSTEM, {"role": "user", "content": facts + " " + QUESTION + " (int8 rows)"}])
    half = len(ids) // 2
    # ALONE: the server's pruning and SentenceKV stay out of the rows read
    whole = generate(int8_server, ids[:half], ALONE, n=1, return_logprob=True, logprob_start_len=0)
    assert whole["meta_info"]["cached_tokens"] == 0
    out = generate(int8_server, ids, ALONE, n=1, return_logprob=True, logprob_start_len=half)
    cached = out["meta_info"]["cached_tokens"]
    assert 0 < cached <= half
    reference = json.loads(
        subprocess.run(
            [sys.executable, str(Path(__file__).with_name("rows_reference.py"))],
            input=json.dumps({"model": str(models.model_dir(TEST_MODEL)), "ids": ids, "cached": cached}),
            env={**os.environ, **CATALOGUE["int8"].env},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )

    def apart(a, b):
        return sum(abs(x - y) for x, y in zip(a, b)) / len(a)

    first = [lp for lp, *_ in whole["meta_info"]["input_token_logprobs"][1:]]
    assert apart(first, reference["float"][: half - 1]) < 1e-3
    # the first is the cached row's (not computed); the rest are the second half's own rows'
    served = [lp for lp, *_ in out["meta_info"]["input_token_logprobs"][1:]]
    rows, every, float_ = (reference[k][half:] for k in ("rows", "every", "float"))
    assert len(served) == len(rows) == len(ids) - half - 1
    # measured: 1.2e-5 against the rows model, which is 0.0071 from the float model and 0.018 from
    # reading every row back (an AVX2-only EPYC)
    assert apart(served, rows) < 1e-3 < 3e-3 < min(apart(rows, float_), apart(rows, every))
