"""An 8-bit KV pool in the real server (`--kv-cache-dtype fp8_e4m3`, sized by `--kv-pool-bytes`;
the pool's `fp8` server, with persistence and intent on it).

References: the model's config (what a token's KV takes at one byte a value), SGLang's own count of
its pool (/server_info) and dtype, the same server's answer from its tree (a restore from disk must
give it back), and the tree's integrity check before every batch (the server's environment).
How close its answers are to a bf16 pool's is the fidelity benchmark's to say, not a test's.
"""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from servers import FP8_POOL_BYTES, TEST_MODEL
from sgl_memory import models
from sgl_memory.persist.header import head_metadata, named_chunks
from test_persist_server import SYSTEM, chat, flush, history, session_file

pytestmark = pytest.mark.server


def test_the_pools_bytes_hold_a_token_at_one_byte_a_value(fp8_server):
    cfg = json.loads((models.model_dir(TEST_MODEL) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim  # K and V, one byte each
    pool = fp8_server.get("/sgl_memory/info").json()["kv_pool"]
    assert (pool["kv_cache_dtype"], pool["bytes_per_token"], pool["source"]) == (
        "fp8_e4m3",
        per_token,
        "--kv-pool-bytes",
    )
    assert pool["tokens"] == FP8_POOL_BYTES // per_token  # twice what the same bytes hold in bf16
    info = fp8_server.get("/server_info").json()
    assert info["max_total_num_tokens"] == pool["tokens"] and info["kv_cache_dtype"] == "fp8_e4m3"


def test_a_session_restored_from_disk_into_the_8_bit_pool_answers_as_from_the_tree(fp8_server):
    """No warm tier: after a flush the second turn's history comes back from the store's file, which
    holds the pool's own bytes (`quant: auto` on an 8-bit pool: nothing requantized), and the greedy
    answer is the one the tree gave."""
    turns = ["Name three primary colours.", "Which of them is the sky's?"]
    first, _, _ = chat(fp8_server, [SYSTEM, {"role": "user", "content": turns[0]}], "fp8-restore", max_tokens=16)
    messages = history(turns[:1], [first]) + [{"role": "user", "content": turns[1]}]
    from_tree, usage, metrics = chat(fp8_server, messages, "fp8-restore", max_tokens=16)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert metrics["restored_tokens"] == 0 and cached > 0
    flush(fp8_server)
    head = session_file(fp8_server.dir / "store", "fp8-restore")
    meta = head_metadata(head)
    assert meta and meta["quant"] == "fp8_e4m3", meta
    for chunk in named_chunks(meta):
        with safe_open(head.parent / chunk.name, "pt") as f:
            assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"F8_E4M3"}  # one byte a value, no scales
    restored, usage, metrics = chat(fp8_server, messages, "fp8-restore", max_tokens=16)
    assert metrics["restored_from"] == "disk" and metrics["restored_tokens"] > 0, metrics
    assert usage["prompt_tokens_details"]["cached_tokens"] >= cached  # the history came back, not prefilled
    assert restored == from_tree


def test_pruning_keeps_its_budget_in_the_8_bit_pool(fp8_server):
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
    answer, _, metrics = chat(fp8_server, messages, "fp8-prune", budget=budget, scorer="streaming_llm", max_tokens=8)
    assert metrics["compression_events"] == 1 and metrics["live_kv_tokens"] == budget + 8, metrics
    again, _, _ = chat(
        fp8_server,
        messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}],
        "fp8-prune",
        max_tokens=8,
    )
    assert again
    assert fp8_server.get("/sgl_memory/integrity").json()["whole"] is True
