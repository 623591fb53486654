"""A mechanism from outside the package, for tests/test_plugin_mechanism.py: a server loads it
through its config (`plugins: [toy_mechanism]`), and nothing in sgl_memory names it.

It counts what it is asked to: each request that sets `sgl_memory.toy` gets, in its metrics, the
prompt's token count and first token id as the tree saw them at admission, and the note it sent.
It owns its config section, its request key, its metrics schema, a Prometheus counter and a route.
On the HTTP side it counts the requests with a toy field as they come in (before_generate), and a
note "echo" makes it send a pass of its own (note "pass") over the same prompt first, through the
engine API a mechanism gets (core/front.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_memory.core import mechanism, metrics, prometheus
from sgl_memory.core.config import require
from sgl_memory.core.request import FIELD, RequestPart, SpecError, object_at
from sgl_memory.core.slots import Slot


@dataclass(frozen=True)
class ToyConfig:
    enabled: bool = False
    max_note: int = 16

    def validate(self, path: str) -> None:
        require(self.max_note >= 1, f"{path}.max_note", "an integer >= 1")


@dataclass(frozen=True)
class ToyRequest(RequestPart):
    note: str = ""


SEEN: Slot[dict] = Slot("toy")
REQUESTS = prometheus.counter("toy_requests", "Requests the toy mechanism counted")


@mechanism.register("toy")
class ToyMechanism(mechanism.Mechanism):
    rank = 50  # after every built-in: it sees the prompt they made
    settings = ToyConfig
    fields = ("toy",)
    schema = mechanism.MetricsSchema(marker="toy_prompt_tokens", summed=("toy_prompt_tokens",), counted=("toy_note",))

    def __init__(self, config: ToyConfig):
        self.config = config

    @classmethod
    def build(cls, config, tree, ctx) -> ToyMechanism:
        return cls(config)

    @classmethod
    def parse_request(cls, raw: dict, internal: bool) -> ToyRequest | None:
        body, where = object_at(raw, "toy", ("note",))
        if body is None:
            return None
        note = body.get("note", "")
        if not isinstance(note, str):
            raise SpecError(f"{where}.note must be a string, got {note!r}")
        return ToyRequest(note)

    @classmethod
    def check_request(cls, part: ToyRequest, config) -> None:
        if len(part.note) > config.toy.max_note:
            raise SpecError(f"{FIELD}.toy.note is longer than toy.max_note ({config.toy.max_note})")

    @classmethod
    def observe(cls, metrics: dict, meta_info: dict) -> None:
        if "toy_prompt_tokens" in metrics:
            REQUESTS.inc()

    incoming = 0  # requests with a toy field seen on their way in (HTTP process)

    @classmethod
    def mount(cls, app, config, engine) -> None:
        @app.get("/sgl_memory/toy")
        async def toy():
            return {"max_note": config.toy.max_note, "incoming": cls.incoming, "context_len": engine.context_len()}

    @classmethod
    async def before_generate(cls, request, engine) -> None:
        field = request.fields()[0]
        if request.batched() or not isinstance(field, dict) or "toy" not in field:
            return
        cls.incoming += 1
        if field["toy"].get("note") == "echo":
            await engine.prefill({"toy": {"note": "pass"}}, like=request)

    def admit(self, scheduler, req, spec) -> None:
        part = spec.part(self.name)
        if part is not None:
            ids = list(req.origin_input_ids)
            SEEN.set(req, {"toy_prompt_tokens": len(ids), "toy_first_token": ids[0], "toy_note": part.note})

    def on_release(self, req) -> None:
        seen = SEEN.pop(req)
        if seen is not None:
            metrics.attach(req, seen)
