"""The query pass of a memory-mode request, run from the HTTP side (AROUND hook on
TokenizerManager.generate_request, so the native and the OpenAI APIs both get it).

Retrieval scores blocks with the prompt's queries at every layer, which exist only once the prompt
has gone through the model. So the hook first sends the same prompt as a prefill-only request (the
probe); the scheduler captures its queries (memart/manager.py). Then the request itself goes out
with the probe's id, and the scheduler retrieves with those queries before admitting it. The probe
prefills the request's tokens up to its question less what the radix tree caches of them (the
system message, an agent's tool docs, once a probe with the same start ran), reported as
`probe_tokens`.
"""

from __future__ import annotations

import uuid

from sglang.srt.managers.io_struct import GenerateReqInput

from sgl_memory.core.config import from_env
from sgl_memory.memart.writes import INTERNAL
from sgl_memory.core.request import FIELD, SpecError, check_served, decode, encode, parse


def _raw_field(sampling_params) -> dict | None:
    return decode((sampling_params or {}).get("custom_params"))


def memory_field(obj) -> dict | None:
    """The request's `sgl_memory` field when it asks for memory mode; a SpecError if it cannot have it."""
    if not isinstance(obj, GenerateReqInput):
        return None
    params = obj.sampling_params
    if isinstance(params, list):
        if any(parse(_raw_field(p)).part("memory") is not None for p in params if isinstance(p, dict)):
            raise SpecError(f"{FIELD}.memory takes one prompt per request, not a batch")
        return None
    if not isinstance(params, dict):
        return None
    raw = _raw_field(params)
    spec = parse(raw)  # internal=False: a client cannot pass a probe id of its own
    if spec.part("memory") is None:
        return None
    check_served(spec, from_env())
    if isinstance(obj.text, list) or (isinstance(obj.input_ids, list) and obj.input_ids and isinstance(obj.input_ids[0], list)):
        raise SpecError(f"{FIELD}.memory takes one prompt per request, not a batch")
    return raw


def _with_field(params: dict, raw: dict, **params_overrides) -> dict:
    return {**params, **params_overrides, "custom_params": encode(params.get("custom_params"), raw)}


async def generate_hook(original, manager, obj, request=None):
    raw = None if INTERNAL.get() else memory_field(obj)  # the entries API's own passes go as they are
    if raw is not None:
        probe_id = uuid.uuid4().hex
        # the placement tells the probe whether its request needs the system message's KV
        placement = {k: v for k, v in raw["memory"].items() if k == "placement"}
        probe_raw = {**raw, "memory": {"mode": "probe", "probe": probe_id, **placement}}
        probe = GenerateReqInput(text=obj.text, input_ids=obj.input_ids, lora_path=obj.lora_path, extra_key=obj.extra_key,
                                 sampling_params=_with_field(obj.sampling_params, probe_raw, max_new_tokens=0, n=1),
                                 rid=f"sgl-memory-probe-{probe_id}")  # fmt: skip
        async for _ in original(manager, probe, None):
            pass
        obj.sampling_params = _with_field(obj.sampling_params, {**raw, "memory": {**raw["memory"], "probe": probe_id}})
    async for out in original(manager, obj, request):
        yield out
