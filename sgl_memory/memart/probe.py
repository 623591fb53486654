"""The query pass of a memory-mode request, run from the HTTP side (Mechanism.before_generate: the
engine shows it every generate request, native and OpenAI).

Retrieval scores blocks with the prompt's queries at every layer, which exist only once the prompt
has gone through the model. So the request's prompt first goes out as a prefill-only pass (the
probe); the scheduler captures its queries (memart/probes.py). Then the request itself goes out
with the probe's id, and the scheduler retrieves with those queries before admitting it. The probe
prefills the request's tokens up to its question less what the radix tree caches of them (the
system message, an agent's tool docs, once a probe with the same start ran), reported as
`probe_tokens`.
"""

from __future__ import annotations

import uuid

from sgl_memory.core.config import from_env
from sgl_memory.core.request import FIELD, SpecError, check_served, parse
from sgl_memory.memart import text
from sgl_memory.memart.settings import MemArtConfig
from sgl_memory.memart.window import window


def memory_field(request) -> dict | None:
    """The request's (front.Incoming) `sgl_memory` field when it asks for memory mode; a SpecError
    if it cannot have it."""
    raws = request.fields()
    asking = [raw for raw in raws if parse(raw).part("memory") is not None]  # a client cannot pass a probe id
    if not asking:
        return None
    if request.batched():
        raise SpecError(f"{FIELD}.memory takes one prompt per request, not a batch")
    check_served(parse(asking[0]), from_env())
    return asking[0]


async def send_probe(request, engine) -> None:
    """Send the probe of a memory-mode request and point the request at it. A full-history request
    of a session past `memory.window` becomes one here (window.py). Text mode places lines instead
    and needs no probe (text.py)."""
    raw = memory_field(request)
    windowed = 0
    if raw is not None and raw["memory"].get("mode") == "text":
        await text.place(request, engine, raw, from_env().of(MemArtConfig))
        return
    if raw is None:
        raws = request.fields()
        if request.batched() or not isinstance(raws[0], dict):
            return
        config = from_env()
        memory = config.of(MemArtConfig)
        windowed = window(request, engine, memory, parse(raws[0])) if memory.enabled else 0
        if not windowed:
            return
        raw = {**raws[0], "memory": {"mode": "retrieve"}}
    probe_id = uuid.uuid4().hex
    # the placement tells the probe whether its request needs the system message's KV
    placement = {k: v for k, v in raw["memory"].items() if k == "placement"}
    await engine.prefill({**raw, "memory": {"mode": "probe", "probe": probe_id, **placement}}, like=request)
    request.set_field(
        {**raw, "memory": {**raw["memory"], "probe": probe_id, **({"windowed": windowed} if windowed else {})}}
    )
