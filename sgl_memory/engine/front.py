"""The HTTP process's engine API for mechanisms (core/front.py), over SGLang's tokenizer manager,
and the hook that shows each incoming generate request to the mechanisms (patches/hooks.yaml).
"""

from __future__ import annotations

import functools
import uuid
from contextvars import ContextVar
from typing import cast

from sglang.srt.managers.io_struct import GenerateReqInput

from sgl_memory.core import mechanism
from sgl_memory.core.front import Incoming
from sgl_memory.core.request import decode, encode
from sgl_memory.core.spans import RoleMarkers

# Set while a mechanism's own pass goes through generate_request (it runs in the caller's task):
# such a pass skips every before_generate, so a pass cannot trigger another.
_OWN_PASS: ContextVar = ContextVar("sgl_memory_own_pass", default=False)


class IncomingRequest:
    """core.front.Incoming over SGLang's GenerateReqInput (native and OpenAI requests alike)."""

    def __init__(self, obj: GenerateReqInput):
        self.obj = obj

    def fields(self) -> list:
        params = self.obj.sampling_params
        listed = params if isinstance(params, list) else [params]
        return [decode(p.get("custom_params")) if isinstance(p, dict) else None for p in listed]

    def batched(self) -> bool:
        obj = self.obj
        if isinstance(obj.sampling_params, list) or isinstance(obj.text, list):
            return True
        return isinstance(obj.input_ids, list) and bool(obj.input_ids) and isinstance(obj.input_ids[0], list)

    def set_field(self, raw: dict) -> None:
        self.obj.sampling_params = _with_field(self.obj.sampling_params, raw)

    def prompt_ids(self) -> list[int] | None:
        ids = self.obj.input_ids
        if self.batched() or not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            return None
        return ids

    def prompt_text(self) -> str | None:
        text = self.obj.text
        return text if isinstance(text, str) and self.obj.input_ids is None and not self.batched() else None

    def set_prompt_ids(self, ids: list[int]) -> None:
        # SGLang tokenizes `text` only where no ids are given; the text goes so the two never disagree
        self.obj.input_ids, self.obj.text = list(ids), None

    def reads_prompt_logprobs(self) -> bool:
        start = self.obj.logprob_start_len
        return bool(self.obj.return_logprob) and isinstance(start, int) and start >= 0


@functools.lru_cache(maxsize=4)
def _markers(tokenizer, family: str) -> RoleMarkers:
    return RoleMarkers.from_tokenizer(tokenizer, family)


def _with_field(params: dict | None, raw: dict, **overrides) -> dict:
    params = params or {}
    return {**params, **overrides, "custom_params": encode(params.get("custom_params"), raw)}


class TokenizerEngine:
    """core.front.Engine over the tokenizer manager: the one given to generate_request's hook, or
    (for a route) the app's, looked up when first used since it exists only once the server runs."""

    def __init__(self, manager=None):
        self._manager = manager

    @property
    def manager(self):
        if self._manager is None:
            from sglang.srt.entrypoints.http_server import get_global_state  # the app's module: loaded by then

            self._manager = get_global_state().tokenizer_manager
        return self._manager

    def tokenize(self, text: str) -> list[int]:
        return self.manager.tokenizer.encode(text, add_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        return self.manager.tokenizer(text)["input_ids"]  # as TokenizerManager._tokenize_texts does

    def decode(self, ids: list[int]) -> str:
        return self.manager.tokenizer.decode(ids, skip_special_tokens=True)

    def markers(self, family: str) -> RoleMarkers:
        return _markers(self.manager.tokenizer, family)

    def context_len(self) -> int:
        return self.manager.context_len

    async def prefill(self, raw: dict, input_ids: list[int] | None = None, like: Incoming | None = None) -> dict:
        rid = f"sgl-memory-pass-{uuid.uuid4().hex}"
        if like is not None:
            src = cast(IncomingRequest, like).obj  # the requests a mechanism is shown are this engine's
            obj = GenerateReqInput(
                text=src.text,
                input_ids=src.input_ids,
                lora_path=src.lora_path,
                extra_key=src.extra_key,
                sampling_params=_with_field(src.sampling_params, raw, max_new_tokens=0, n=1),
                rid=rid,
            )
        else:
            obj = GenerateReqInput(
                input_ids=input_ids, sampling_params=_with_field(None, raw, max_new_tokens=0), rid=rid
            )
        token = _OWN_PASS.set(True)
        try:
            out = None
            async for out in self.manager.generate_request(obj, None):
                pass
        finally:
            _OWN_PASS.reset(token)
        return (out or {}).get("meta_info", {})


async def generate_hook(original, manager, obj, request=None):
    """TokenizerManager.generate_request, as the AROUND hook (http_api.generate_hook) calls it:
    every mechanism that looks at incoming requests (Mechanism.before_generate) sees this one, in
    order, before it goes out; the mechanisms' own passes go as they are."""
    if isinstance(obj, GenerateReqInput) and not _OWN_PASS.get():
        engine, incoming = TokenizerEngine(manager), IncomingRequest(obj)
        for cls in mechanism.ordered():
            await cls.before_generate(incoming, engine)
    async for out in original(manager, obj, request):
        yield out
