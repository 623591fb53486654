"""The HTTP side's view of an incoming request (engine/front.py IncomingRequest), on SGLang's own
request objects: each prompt's sgl_memory field, whether it is a batch, and the field rewritten."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput

from sgl_memory.core.request import FIELD, SpecError
from sgl_memory.engine.front import IncomingRequest


def params(raw) -> dict:
    return {"max_new_tokens": 3, "custom_params": {FIELD: json.dumps(raw), "other": 1}}


@pytest.mark.parametrize(
    "obj, fields, batched",
    [
        (GenerateReqInput(text="hi"), [None], False),
        (GenerateReqInput(text="hi", sampling_params=params({"session_id": "s"})), [{"session_id": "s"}], False),
        (GenerateReqInput(input_ids=[1, 2], sampling_params={"max_new_tokens": 1}), [None], False),
        (GenerateReqInput(text=["a", "b"], sampling_params=params({"x": 1})), [{"x": 1}], True),
        (GenerateReqInput(input_ids=[[1], [2]]), [None], True),
        (GenerateReqInput(text="a", sampling_params=[params({"a": 1}), {"max_new_tokens": 1}]), [{"a": 1}, None], True),
        (GenerateReqInput(text="a", sampling_params=[]), [], True),
    ],
)
def test_fields_and_batches_as_the_request_carries_them(obj, fields, batched):
    incoming = IncomingRequest(obj)
    assert incoming.fields() == fields and incoming.batched() == batched


def test_set_field_replaces_only_the_field():
    obj = GenerateReqInput(text="hi", sampling_params=params({"session_id": "s"}))
    IncomingRequest(obj).set_field({"session_id": "t"})
    assert obj.sampling_params["max_new_tokens"] == 3 and obj.sampling_params["custom_params"]["other"] == 1
    assert IncomingRequest(obj).fields() == [{"session_id": "t"}]


def test_a_field_that_is_not_json_is_a_spec_error():
    obj = GenerateReqInput(text="hi", sampling_params={"custom_params": {FIELD: "{nope"}})
    with pytest.raises(SpecError, match="not valid JSON"):
        IncomingRequest(obj).fields()


def test_a_client_process_knows_every_mechanisms_keys_before_it_parses_a_field():
    """frontend.MemoryEndpoint builds the field from request.keys() in a client's process, which
    never parsed a field: the built-in mechanisms' keys must be there all the same (they were not
    until 2026-11-27, and a frontend program's memory mode was silently dropped)."""
    code = "from sgl_memory.core.request import keys; print(' '.join(keys()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert {"session_id", "tenant", "budget", "memory", "keep"} <= set(out), out
