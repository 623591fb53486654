"""A mechanism added from outside the package (tests/toy_mechanism.py) runs in the real server:
its config section, request key, validation, metrics, Prometheus series and route all come from
its own module, named in the config's `plugins:` list; no file of sgl_memory names it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sgl_memory.core import config, mechanism, prometheus, request
from sgl_memory.core.request import SpecError

PACKAGE = Path(__file__).resolve().parent.parent / "sgl_memory"


@pytest.fixture
def toy_registered():
    """The toy registered in this process for one test, then taken out again (other tests see
    the built-in mechanisms only)."""
    mechanism.discover()  # the built-in ones first: they stay
    registry = dict(mechanism.REGISTRY)
    declared = dict(prometheus.DECLARED)
    cfg = config.from_dict({"plugins": ["toy_mechanism"], "toy": {"enabled": True, "max_note": 3}})
    yield cfg
    mechanism.REGISTRY.clear()
    mechanism.REGISTRY.update(registry)
    prometheus.DECLARED.clear()
    prometheus.DECLARED.update(declared)
    sys.modules.pop("toy_mechanism", None)


def test_the_package_never_names_the_toy():
    assert not any("toy" in p.read_text() for p in PACKAGE.rglob("*.py"))


def test_a_plugin_brings_its_section_request_key_and_checks(toy_registered):
    cfg = toy_registered
    assert cfg.toy.enabled and cfg.toy.max_note == 3 and cfg.plugins == ("toy_mechanism",)
    assert cfg.as_dict()["toy"] == {"enabled": True, "max_note": 3}
    assert [cls.name for cls in mechanism.ordered()][-1] == "toy"  # rank 50: after every built-in
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
            rank, settings, fields = 60, type(toy_registered.toy), ("budget",)

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
    for field, needle in (({"toy": {"note": 5}}, "sgl_memory.toy.note must be a string"),
                          ({"toy": {"note": "far too long"}}, "toy.max_note"), ({"toy": {"x": 1}}, "sgl_memory.toy: unknown field")):  # fmt: skip
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
    grew = sample(after, "sgl_memory_requests_total", mechanism="toy") - sample(before, "sgl_memory_requests_total", mechanism="toy")
    assert grew == 4
