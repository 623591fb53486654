"""Repair of placed memory blocks (keep) inside the real server (SmolLM2-135M, float32: the suite's
float32 server, memory and keep on).

A session states facts over full-history turns (test_memart_server's); memory-mode questions then
place four 16-token blocks after the system message and ask for a repair. References: a full
prefill of the request's own tokens by transformers in float32 (the KV at every placed position
and layer), the same tokens sent as a plain request (the greedy answer), the KV a request
with nothing recomputed after layer 0 stored (what the placed KV is at each layer), and the same
repair asked with `drop_rows: false` (every row computed, the placed KV written over the rows not
recomputed)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from servers import TEST_MODEL
from sgl_memory import models
from sgl_memory.keep.select import ratio_at
from test_memart_server import QUESTION, SYSTEM, generate, render, state_facts

pytestmark = pytest.mark.server

BLOCK, TOP_K = 16, 4  # the float32 server's block size; the blocks each question places
# float32: bf16 matmuls round a row differently with the row count of the pass (as the probe's
# system message, or a layer that dropped rows, has), which flips near-tie greedy tokens
FULL_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))


@pytest.fixture(scope="module")
def keep_server(fp32_server):
    config = fp32_server.get("/sgl_memory/info").json()["config"]
    assert (
        config["keep"]["drop_rows"]
        and config["memory"]["block_size"] == BLOCK
        and config["memory"]["placement"] == "after_system"
    )
    return fp32_server


@pytest.fixture(scope="module")
def stated(keep_server, tok):
    return state_facts(keep_server, tok, "keep")


@pytest.fixture(scope="module")
def reference_model():
    return AutoModelForCausalLM.from_pretrained(models.model_dir(TEST_MODEL), torch_dtype=torch.float32).eval()


def ask(server, tok, recompute: str, **extra) -> tuple[dict, dict | None]:
    """A memory-mode question; its answer and (for a repair) the trace the server wrote."""
    q = render(tok, SYSTEM + [{"role": "user", "content": QUESTION}])
    out = generate(
        server,
        q,
        {
            "session_id": "s",
            "tenant": "keep",
            "memory": {"top_k": TOP_K, "store": False, "recompute": recompute},
            **({"keep": extra} if extra else {}),
        },
    )
    path = server.dir / "keep-traces" / f"{out['meta_info']['id']}.safetensors"
    return out, (load_file(str(path)) if path.exists() else None)


def full_prefill(model, trace: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (post-RoPE) and values [L, M, Hkv, D] of the placed positions in a float32 prefill of the prompt."""
    start, m = int(trace["start"]), trace["keys"].shape[1]
    with torch.no_grad():
        cache = model(trace["tokens"][None], use_cache=True).past_key_values
    keys = torch.stack([layer.keys[0].transpose(0, 1)[start : start + m] for layer in cache.layers])
    values = torch.stack([layer.values[0].transpose(0, 1)[start : start + m] for layer in cache.layers])
    return keys, values


def relative(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """[L, M] per-token relative L2 error over heads and dims."""
    return (got.float() - want).norm(dim=(2, 3)) / want.norm(dim=(2, 3))


def test_ratio_one_is_a_full_prefill_of_the_same_tokens(keep_server, tok, stated, reference_model):
    out, trace = ask(keep_server, tok, "keep", ratio=1.0)
    m = out["meta_info"]["sgl_memory"]
    layers, placed = trace["keys"].shape[:2]
    assert placed == BLOCK * TOP_K and m["memory_kv_tokens"] == placed and m["recompute"] == "keep"
    assert (
        bool(trace["selected"].bool().all())
        and m["recompute_share"] == 1.0
        and m["recomputed_token_layers"] == placed * layers
    )
    keys, values = full_prefill(reference_model, trace)
    assert float(relative(trace["keys"], keys).max()) < FULL_TOLERANCE
    assert float(relative(trace["values"], values).max()) < FULL_TOLERANCE
    # the same tokens as a plain prompt, and the same blocks prefilled as text (recompute: full)
    plain = generate(keep_server, trace["tokens"].tolist(), None)
    full, _ = ask(keep_server, tok, "full")
    assert out["output_ids"] == plain["output_ids"] == full["output_ids"]
    # both computed every uncached token at every layer: as text (full), or placed and then all
    # recomputed (keep at ratio 1), which the cost says as reused tokens recomputed at every layer
    f = full["meta_info"]["sgl_memory"]
    uncached = len(trace["tokens"]) - int(trace["start"])
    assert f["recompute_share"] == 1.0 and (f["prefill_tokens"], f["reused_tokens"]) == (uncached, 0)
    assert (m["prefill_tokens"], m["reused_tokens"]) == (uncached - placed, placed)
    for cost in (f, m):
        assert cost["prefill_token_layers"] == cost["full_prefill_token_layers"] == uncached * layers
        assert cost["prefill_work_share"] == 1.0


@pytest.mark.parametrize("method,ratio", [("keep", 0.5), ("cacheblend", 0.3), ("starts", 0.1), ("random", 0.3)])
def test_a_repair_recomputes_nested_rows_and_stores_the_placed_kv_elsewhere(
    keep_server, tok, stated, reference_model, method, ratio
):
    out, trace = ask(keep_server, tok, method, ratio=ratio)
    _, reused = ask(keep_server, tok, "keep", ratio=0.0)  # layer 0 recomputed, the placed KV after it
    assert torch.equal(trace["tokens"], reused["tokens"])
    selected = trace["selected"].bool()
    layers, placed = selected.shape
    m = out["meta_info"]["sgl_memory"]
    assert m["recomputed_per_layer"] == selected.sum(1).tolist() and m["recomputed_token_layers"] == int(selected.sum())
    assert m["recompute_share"] == pytest.approx(int(selected.sum()) / (layers * placed), abs=1e-6)
    assert bool(selected[0].all()) and not bool(reused["selected"][1:].bool().any())
    for layer in range(1, layers):
        assert not bool((selected[layer] & ~selected[layer - 1]).any()), "a row dropped at a layer came back"
        units = TOP_K if method == "keep" else placed
        want = math.ceil(ratio_at(layer, layers, ratio, 0.5) * units) * (BLOCK if method == "keep" else 1)
        assert int(selected[layer].sum()) == want
        if method == "keep":  # whole blocks
            assert all(len(set(block.tolist())) == 1 for block in selected[layer].view(TOP_K, BLOCK))
    # the rows a layer did not recompute hold the placed KV, bit for bit
    dropped = ~selected
    assert torch.equal(trace["keys"][dropped], reused["keys"][dropped]) and torch.equal(
        trace["values"][dropped], reused["values"][dropped]
    )
    # layers 0 and 1 see an all-recomputed layer before them: their recomputed rows are a full
    # prefill's, and the placed ones (computed in another context) are far from it
    keys, values = full_prefill(reference_model, trace)
    err_k, err_v = relative(trace["keys"], keys), relative(trace["values"], values)
    assert float(err_k[0].max()) < FULL_TOLERANCE
    assert float(err_k[1][selected[1]].max()) < FULL_TOLERANCE and float(err_v[1][selected[1]].max()) < FULL_TOLERANCE
    assert float(relative(reused["keys"], keys)[1].max()) > 0.1


@pytest.mark.parametrize("method", ["keep", "cacheblend"])
def test_dropping_the_rows_gives_the_attention_of_writing_over_them(keep_server, tok, stated, method):
    """The compacted prefill (rows dropped from the hidden states after the layer that stops
    recomputing them) against the full-cost one (`drop_rows: false`): the same rows chosen at every
    layer, the same KV (float32: within the rounding of matmuls over other row counts), the same answer."""
    dropped, dropped_trace = ask(keep_server, tok, method, ratio=0.3)
    full_cost, full_cost_trace = ask(keep_server, tok, method, ratio=0.3, drop_rows=False)
    assert dropped["meta_info"]["sgl_memory"]["recompute_dropped_rows"] is True
    assert full_cost["meta_info"]["sgl_memory"]["recompute_dropped_rows"] is False
    assert torch.equal(dropped_trace["tokens"], full_cost_trace["tokens"])
    assert torch.equal(dropped_trace["selected"], full_cost_trace["selected"])
    assert float(relative(dropped_trace["keys"], full_cost_trace["keys"].float()).max()) < 1e-4
    assert float(relative(dropped_trace["values"], full_cost_trace["values"].float()).max()) < 1e-4
    assert dropped["output_ids"] == full_cost["output_ids"]


def test_reuse_prefills_only_the_question_and_a_repair_the_blocks_too(keep_server, tok, stated):
    before = keep_server.prometheus()
    none, trace = ask(keep_server, tok, "none")
    keep, keep_trace = ask(keep_server, tok, "keep")
    after = keep_server.prometheus()
    q = render(tok, SYSTEM + [{"role": "user", "content": QUESTION}])
    system = int(keep_trace["start"])
    assert trace is None and none["meta_info"]["sgl_memory"]["recompute"] == "none"
    n, k = none["meta_info"]["sgl_memory"], keep["meta_info"]["sgl_memory"]
    asked, placed, layers = len(q) - system, BLOCK * TOP_K, keep_trace["selected"].shape[0]
    # either way the prompt's own tokens (the question) are what was prefilled; reuse adds nothing
    # to that, the repair the placed rows it recomputed, token by layer, as its trace records them
    assert (n["prefill_tokens"], n["reused_tokens"], n["recomputed_token_layers"]) == (asked, placed, 0)
    recomputed = int(keep_trace["selected"].sum())
    assert (k["prefill_tokens"], k["reused_tokens"], k["recomputed_token_layers"]) == (asked, placed, recomputed)
    for cost, work in ((n, asked * layers), (k, asked * layers + recomputed)):
        assert cost["full_prefill_token_layers"] == (asked + placed) * layers and cost["prefill_token_layers"] == work
        assert cost["prefill_work_share"] == pytest.approx(work / ((asked + placed) * layers), abs=1e-6)
    assert 0 < k["recompute_share"] < 1 and k["recompute_refused"] is None
    assert k["repair_ms"] >= k["recompute_ms"] > 0
    # /metrics sums the same fields over the two requests
    for key in ("reused_tokens", "prefill_token_layers", "full_prefill_token_layers"):
        series = (f"sgl_memory_memory_{key}_total", ())
        assert after[series] - before.get(series, 0) == n[key] + k[key], key


@pytest.mark.parametrize(
    "field,needle",
    [
        ({"memory": {"recompute": "all"}}, "recompute"),
        ({"keep": {"ratio": -0.1}}, "keep.ratio"),
        ({"keep": {"hops": 100}}, "keep.hops"),
    ],
)
def test_bad_recompute_requests_are_400s(keep_server, field, needle):
    r = keep_server.post(
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "sgl_memory": {"session_id": "s", **field}},
    )
    assert r.status_code == 400 and needle in r.text
