"""A mechanism added from outside the package (tests/toy_mechanism.py) runs in the real server:
its config section, request key, validation, metrics, Prometheus series and route all come from
its own module, named in the config's `plugins:` list; no file of sgl_memory names it. Inside the
forward it captures a layer's rows, edits a request's row and chooses a decode step's reads, each
checked against SGLang's own accounting or a masked attention in transformers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from sgl_memory.core import config, mechanism, prometheus, request
from sgl_memory.core.request import SpecError

PACKAGE = Path(__file__).resolve().parent.parent / "sgl_memory"


@pytest.fixture
def toy_registered():
    """The toy registered in this process for one test, then taken out again (other tests see
    the built-in mechanisms only)."""
    mechanism.discover()  # the built-in ones first: they stay
    registry = mechanism.REGISTRY.snapshot()
    declared = dict(prometheus.DECLARED)
    cfg = config.from_dict({"plugins": ["toy_mechanism"], "toy": {"enabled": True, "max_note": 3}})
    yield cfg
    mechanism.REGISTRY.restore(registry)
    prometheus.DECLARED.clear()
    prometheus.DECLARED.update(declared)
    sys.modules.pop("toy_mechanism", None)


def test_the_package_never_names_the_toy():
    assert not any("toy" in p.read_text() for p in PACKAGE.rglob("*.py"))


def test_a_plugin_brings_its_section_request_key_and_checks(toy_registered):
    cfg = toy_registered
    assert cfg.section("toy").enabled and cfg.section("toy").max_note == 3 and cfg.plugins == ("toy_mechanism",)
    assert cfg.as_dict()["toy"] == {"enabled": True, "max_note": 3}
    assert [cls.name for cls in mechanism.ordered()][-1] == "toy"  # declared after every built-in
    spec = request.parse({"session_id": "s", "toy": {"note": "ab"}})
    assert spec.part("toy").note == "ab" and spec.asked == {"toy": ("toy",)}
    request.check_served(spec, cfg)
    with pytest.raises(SpecError, match=r"toy\.max_note"):
        request.check_served(request.parse({"toy": {"note": "abcd"}}), cfg)
    with pytest.raises(SpecError, match=r"sgl_memory\.toy: toy is off on this server \(toy\.enabled: false\)"):
        request.check_served(spec, config.from_dict({"plugins": ["toy_mechanism"]}))
    with pytest.raises(config.ConfigError, match=r"toy\.max_note"):
        config.from_dict({"plugins": ["toy_mechanism"], "toy": {"max_note": 0}})
    with pytest.raises(config.ConfigError, match="plugins: cannot import"):
        config.from_dict({"plugins": ["no_such_module_here"]})


def test_a_second_mechanism_cannot_take_a_key_another_owns(toy_registered):
    with pytest.raises(ValueError, match="belong to"):

        @mechanism.register("toy2")
        class Clash(mechanism.Mechanism):
            settings, fields = type(toy_registered.section("toy")), ("budget",)

            @classmethod
            def build(cls, config, tree, ctx):
                raise AssertionError


@pytest.fixture(scope="module")
def toy_server(fp32_b_server):
    """The suite's second float32 server: `plugins: [toy_mechanism]` with this directory on its
    PYTHONPATH, `toy.max_note` 8, intent's budget 96."""
    return fp32_b_server


def generate(server, ids, field=None):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
    if field is not None:
        body["sgl_memory"] = field
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def sample(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.server
def test_the_server_serves_a_plugin_mechanism_beside_the_built_in_ones(toy_server):
    before, stats_before = toy_server.prometheus(), toy_server.get("/sgl_memory/stats").json()
    route_before = toy_server.get("/sgl_memory/toy").json()
    ids = list(range(1000, 1120))  # 120 tokens: intent prunes them to its budget of 96
    plain = generate(toy_server, ids)
    toy = generate(toy_server, ids, {"toy": {"note": "hi"}})
    both = generate(toy_server, ids, {"session_id": "toy-s", "toy": {"note": "hi"}})
    # the toy reports what the client sent, and changes nothing it was not asked to
    for out in (toy, both):
        m = out["meta_info"]["sgl_memory"]
        assert (m["toy_prompt_tokens"], m["toy_first_token"], m["toy_note"]) == (len(ids), ids[0], "hi")
    assert toy["output_ids"] == plain["output_ids"]
    assert "toy_prompt_tokens" not in (plain["meta_info"].get("sgl_memory") or {})
    # intent ran on the same request (a session pruned to its budget), the toy beside it
    assert both["meta_info"]["sgl_memory"]["compression_events"] == 1
    # its own validation, with the key named
    for field, needle in (
        ({"toy": {"note": 5}}, "sgl_memory.toy.note must be a string"),
        ({"toy": {"note": "far too long"}}, "toy.max_note"),
        ({"toy": {"x": 1}}, "sgl_memory.toy: unknown field"),
    ):
        r = toy_server.post("/generate", {"input_ids": ids, "sgl_memory": field})
        assert r.status_code == 400 and needle in r.text, r.text
    # its HTTP side: it saw the two requests with a toy field come in (not the refused ones: the
    # field is checked before), and its own pass over a request's prompt reached the scheduler
    # without coming back through before_generate (it would count itself, and send its own pass)
    echo = generate(toy_server, ids, {"toy": {"note": "echo"}})
    assert echo["output_ids"] == plain["output_ids"]
    route = toy_server.get("/sgl_memory/toy").json()
    assert route["incoming"] - route_before["incoming"] == 3 and route["max_note"] == 8
    assert route["context_len"] == toy_server.get("/v1/models").json()["data"][0]["max_model_len"]
    # its route, its config section, its aggregates and its Prometheus series
    info = toy_server.get("/sgl_memory/info").json()["config"]
    assert info["toy"] == {"enabled": True, "max_note": 8} and info["plugins"] == ["toy_mechanism"]
    stats, after = toy_server.get("/sgl_memory/stats").json(), toy_server.prometheus()
    assert stats["totals"]["toy_prompt_tokens"] - stats_before["totals"]["toy_prompt_tokens"] == 4 * len(ids)
    counts, counted_before = stats["counts"]["toy_note"], stats_before["counts"].get("toy_note", {})
    assert {note: counts[note] - counted_before.get(note, 0) for note in counts} == {"hi": 2, "echo": 1, "pass": 1}
    assert sample(after, "sgl_memory_toy_requests_total") - sample(before, "sgl_memory_toy_requests_total") == 4
    grew = sample(after, "sgl_memory_requests_total", mechanism="toy") - sample(
        before, "sgl_memory_requests_total", mechanism="toy"
    )
    assert grew == 4


@pytest.fixture(scope="module")
def reference():
    """The served model in transformers, float32, eager attention (it takes a 4-D mask), and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from servers import TEST_MODEL
    from sgl_memory import models

    path = models.model_dir(TEST_MODEL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(path)


def first_step_logprobs(model, ids: list[int], first: int, visible: list[int] | None) -> torch.Tensor:
    """log-softmax of the token after ids + [first] where that last row attends only the positions
    `visible` (None: every one); every earlier row is plainly causal, as the server's prefill."""
    seq = torch.tensor([ids + [first]])
    n = seq.shape[1]
    mask = torch.zeros(1, 1, n, n).masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    if visible is not None:
        mask[0, 0, -1] = float("-inf")
        mask[0, 0, -1, visible] = 0.0
    with torch.no_grad():
        logits = model(seq, attention_mask=mask).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)


def first_step(server, ids: list[int], toy: dict) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A toy request decoding two tokens: its response, and the top log-probabilities of its first
    decode step (the second token) with their token ids."""
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 10,
        "sgl_memory": {"toy": toy, "intent": False},
    }
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    out = r.json()
    top = out["meta_info"]["output_top_logprobs"][1]
    return out, torch.tensor([lp for lp, _, *_ in top], dtype=torch.float64), torch.tensor([t for _, t, *_ in top])


def story(topic: str) -> str:
    return f"Notes on {topic}. " + " ".join(
        f"Entry {i}: the {topic} log says item {i * 13 % 29} moved to shelf {i % 5}." for i in range(12)
    )


@pytest.mark.server
def test_a_plugin_captures_rows_edits_a_row_and_chooses_decode_reads(toy_server, reference):
    """The toy's three forward hooks, in the real server, with no file of sgl_memory naming it:
    its capture saw exactly the rows SGLang says it prefilled; its row edit hid positions from the
    decode as a masked attention hides them; its decode reads gave a window attention's answer."""
    model, tok = reference
    # capture: the rows layer 0 computed are the prompt's uncached ones (SGLang's cached_tokens)
    ids = tok(story("warehouse") + " Which shelf holds item 7? Answer:")["input_ids"]
    for _ in range(2):  # the second finds the first's prefix in the tree
        out, _, _ = first_step(toy_server, ids, {})
        meta = out["meta_info"]
        m = meta["sgl_memory"]
        assert (m["toy_rows_from"], m["toy_rows"]) == (
            meta["cached_tokens"],
            meta["prompt_tokens"] - meta["cached_tokens"],
        )
    assert meta["cached_tokens"] > 0
    earlier = ids
    # row edit: positions 10..39 point at the sentinel from the checkpoint on
    ids = tok(story("library") + " Which shelf holds item 7? Answer:")["input_ids"]
    hide = (10, 40)
    out, got, top = first_step(toy_server, ids, {"hide": list(hide)})
    first, n = out["output_ids"][0], len(ids) + 1
    want = first_step_logprobs(model, ids, first, [p for p in range(n) if not hide[0] <= p < hide[1]])
    torch.testing.assert_close(got, want[top], atol=2e-3, rtol=0)
    assert (
        got - first_step_logprobs(model, ids, first, None)[top]
    ).abs().max() > 0.05  # hiding changed it: the test can fail
    # a private edit keeps the row out of the tree: the same prompt again finds only what it shares
    # with the earlier prompt
    again = generate(toy_server, ids)
    assert again["meta_info"]["cached_tokens"] == next(i for i, (a, b) in enumerate(zip(ids, earlier)) if a != b)
    # decode reads: the first decode step reads the last 16 positions only
    ids = tok(story("garage") + " Which shelf holds item 7? Answer:")["input_ids"]
    out, got, top = first_step(toy_server, ids, {"last": 16})
    first, n = out["output_ids"][0], len(ids) + 1
    want = first_step_logprobs(model, ids, first, list(range(n - 16, n)))
    torch.testing.assert_close(got, want[top], atol=2e-3, rtol=0)
    assert (got - first_step_logprobs(model, ids, first, None)[top]).abs().max() > 0.05
    # their checks, with the key named
    for toy, needle in (
        ({"hide": [5, 2]}, "toy.hide must be"),
        ({"last": 0}, "toy.last must be"),
        ({"hide": [0, 10_000]}, "toy.hide: the prompt has"),
    ):
        r = toy_server.post("/generate", {"input_ids": ids, "sgl_memory": {"toy": toy}})
        assert r.status_code == 400 and needle in r.text, r.text
