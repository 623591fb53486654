"""What a mechanism sees of SGLang's scheduler-side objects: the request and the scheduler, as
protocols.

The hooks of `mechanism.Mechanism` receive SGLang's own `Req` and `Scheduler`; these protocols are
all of them a mechanism (or the core floor) may touch. Each member is listed in
patches/contacts.yaml (kind `field`, per package that touches it, read or written), which the
plugin checks against the installed SGLang at start-up; tests/test_manifest.py holds the two equal
and holds the code to the list, so an SGLang upgrade that renames a field stops start-up naming
it instead of serving requests without it.
"""

from __future__ import annotations

from array import array
from typing import Any, Protocol


class KVRecord(Protocol):
    """The request's KV bookkeeping (SGLang's ReqKvInfo), read only."""

    req_pool_idx: int  # its row of the slot map
    cache_protected_len: int  # the row's prefix the tree protects (the rest is the request's own)


class RequestView(Protocol):
    """What a mechanism may touch of SGLang's `Req` (each member listed in patches/contacts.yaml)."""

    rid: str  # per-request state beside the request is keyed by it
    origin_input_ids: array  # the prompt's token ids; an admission may rewrite them
    origin_input_ids_unpadded: array  # rewritten with them
    output_ids: list[int]  # the tokens generated so far
    extra_key: str | None  # the radix namespace (tenant, LoRA, ours: kvhost.namespace)
    cache_salt: str | None
    cached_tokens: int  # prompt tokens the tree held at admission
    logprob_start_len: int  # where prompt log-probabilities start: kept inside a rewritten prompt
    return_logprob: bool
    sampling_params: Any  # its custom_params carry the sgl_memory field
    session_id: str | None  # SGLang's own (streaming) session id
    skip_radix_cache_insert: bool  # set: nothing of the request enters the tree
    customized_info: dict | None  # SGLang's per-request output extension: our metrics ride in it
    time_stats: Any  # forward_entry_time: when its prefill started
    kv: KVRecord

    def finished(self) -> bool: ...

    def set_finish_with_abort(self, error_msg: str) -> None:
        """End the request with a client error (a 400 with the message)."""


class SchedulerView(Protocol):
    """What a mechanism may touch of SGLang's `Scheduler` (each member listed in patches/contacts.yaml)."""

    tokenizer: Any  # None under --skip-tokenizer-init
    model_config: Any
    max_req_input_len: int  # the longest prompt it admits
