"""A mechanism from outside the package, for tests/test_plugin_mechanism.py: a server loads it
through its config (`plugins: [toy_mechanism]`), and nothing in sgl_memory names it.

It counts what it is asked to: each request that sets `sgl_memory.toy` gets, in its metrics, the
prompt's token count and first token id as the tree saw them at admission, and the note it sent.
It owns its config section, its request key, its metrics schema, a Prometheus counter and a route.
On the HTTP side it counts the requests with a toy field as they come in (before_generate), and a
note "echo" makes it send a pass of its own (note "pass") over the same prompt first, through the
engine API a mechanism gets (core/front.py).

Inside the forward it uses every hook a mechanism has there, through the contract alone:
- a capture subscriber: the prompt rows of each toy request that layer 0 computed (where they
  start and how many), reported as `toy_rows_from` and `toy_rows`;
- a row edit: `hide: [a, b]` points prompt positions a..b-1 of the request's row at the tree's
  sentinel slot at its checkpoint (their own slots given back), so its decode steps do not read
  them; the row then stays out of the tree (a private edit);
- decode-time reads: `last: W` makes each decode step read only the last W positions of its
  sequence (its own token among them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_memory.core import mechanism, metrics, prometheus
from sgl_memory.core.config import require
from sgl_memory.core.request import FIELD, RequestPart, SpecError, object_at
from sgl_memory.core.requests import Lifetime, RequestTable


@dataclass(frozen=True)
class ToyConfig:
    enabled: bool = False
    max_note: int = 16

    def validate(self, path: str) -> None:
        require(self.max_note >= 1, f"{path}.max_note", "an integer >= 1")


@dataclass(frozen=True)
class ToyRequest(RequestPart):
    note: str = ""
    hide: tuple[int, int] | None = None
    last: int | None = None


class LastPositions:
    """A decode step's reads (core/decode.StepReads): the last `count` positions of the sequence."""

    def __init__(self, count: int):
        self.count = count

    def positions(self, layer: int, q: torch.Tensor, token: int, length: int) -> torch.Tensor:
        return torch.arange(max(0, length - self.count), length)


REQUESTS = prometheus.counter("toy_requests", "Requests the toy mechanism counted")


@mechanism.register("toy")
class ToyMechanism(mechanism.Mechanism, mechanism.DecodeReading):
    after = ("memory", "keep", "persist", "intent", "sentencekv")  # every built-in: it sees the prompt they made
    needs_sentinel = True  # `hide` points positions at the tree's sentinel slot
    settings = ToyConfig
    fields = ("toy",)
    schema = mechanism.MetricsSchema(marker="toy_prompt_tokens", summed=("toy_prompt_tokens",), counted=("toy_note",))

    def __init__(self, config: ToyConfig, tree):
        self.config = config
        # per request, from admission to its row's release: what it saw, [first position, rows]
        # layer 0 computed, its decode reads
        self.seen: RequestTable[dict] = tree.requests.table("toy seen", Lifetime.ROW)
        self.rows: RequestTable[list[int]] = tree.requests.table("toy rows", Lifetime.ROW)
        self.reads: RequestTable[LastPositions] = tree.requests.table("toy reads", Lifetime.ROW)

    @classmethod
    def build(cls, config, tree, ctx) -> ToyMechanism:
        return cls(config, tree)

    def subscriber(self) -> ToyMechanism:
        return self

    def step_reads(self, rid: str) -> LastPositions | None:
        return self.reads.get(rid)

    @classmethod
    def parse_request(cls, raw: dict, internal: bool) -> ToyRequest | None:
        body, where = object_at(raw, "toy", ("note", "hide", "last"))
        if body is None:
            return None
        note, hide, last = body.get("note", ""), body.get("hide"), body.get("last")
        if not isinstance(note, str):
            raise SpecError(f"{where}.note must be a string, got {note!r}")
        if hide is not None and not (
            isinstance(hide, list)
            and len(hide) == 2
            and all(isinstance(x, int) for x in hide)
            and 0 <= hide[0] < hide[1]
        ):
            raise SpecError(f"{where}.hide must be [start, end] with 0 <= start < end, got {hide!r}")
        if last is not None and (not isinstance(last, int) or isinstance(last, bool) or last < 1):
            raise SpecError(f"{where}.last must be an integer >= 1, got {last!r}")
        return ToyRequest(note, tuple(hide) if hide is not None else None, last)

    @classmethod
    def check_request(cls, part: ToyRequest, config) -> None:
        max_note = config.of(ToyConfig).max_note
        if len(part.note) > max_note:
            raise SpecError(f"{FIELD}.toy.note is longer than toy.max_note ({max_note})")

    @classmethod
    def observe(cls, metrics: dict, meta_info: dict) -> None:
        if "toy_prompt_tokens" in metrics:
            REQUESTS.inc()

    incoming = 0  # requests with a toy field seen on their way in (HTTP process)

    @classmethod
    def mount(cls, app, config, engine) -> None:
        @app.get("/sgl_memory/toy")
        async def toy():
            return {
                "max_note": config.of(ToyConfig).max_note,
                "incoming": cls.incoming,
                "context_len": engine.context_len(),
            }

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
            if part.hide is not None and part.hide[1] >= len(ids):
                req.set_finish_with_abort(
                    f"{FIELD}.toy.hide: the prompt has {len(ids)} tokens; its last is never hidden"
                )
                return
            self.seen.set(
                req.rid, {"toy_prompt_tokens": len(ids), "toy_first_token": ids[0], "toy_note": part.note, "part": part}
            )
            self.rows.set(req.rid, [-1, 0])

    # --- the capture subscriber (core/capture.Subscriber) ----------------------------------------

    def capturing(self) -> bool:
        return bool(self.rows)

    def bind(self, rows) -> list:
        return [(counts, r) for r in rows if (counts := self.rows.get(r.rid)) is not None]

    def first_read(self, part) -> int | None:
        return None  # it counts every row

    def take(self, bound, layer, q, k, v) -> None:
        if layer.layer_id == 0:
            for counts, r in bound:
                counts[0] = r.prefix if counts[0] < 0 else counts[0]
                counts[1] += r.count

    # --- the row edit, the decode reads --------------------------------------------------------

    def on_checkpoint(self, req, tree) -> mechanism.RowEdit | None:
        seen = self.seen.get(req.rid)
        if seen is None or req.finished():
            return None
        part: ToyRequest = seen["part"]
        if part.last is not None:
            self.reads.set(req.rid, LastPositions(part.last))
        if part.hide is None:
            return None
        row = tree.row(req)
        dropped = torch.arange(*part.hide)
        own = dropped[dropped >= req.kv.cache_protected_len]  # the tree's slots stay the tree's
        tree.free_real(row[own].to(torch.int64))
        row[dropped] = tree.sentinel
        return mechanism.RowEdit(dropped, own.numel(), private=True)

    def on_release(self, req) -> None:
        seen, rows = self.seen.get(req.rid), self.rows.get(req.rid)
        if seen is not None:
            metrics.attach(
                req, {k: v for k, v in seen.items() if k != "part"} | {"toy_rows_from": rows[0], "toy_rows": rows[1]}
            )
