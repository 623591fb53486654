"""The pool tokens SGLang's scheduler already counts on for the work it has taken in: the rest of a
chunked prefill's prompt and the running requests' decode, as its PrefillAdder estimates them.

Room a mechanism takes from the pool (a restore's slots, a prefetch) must leave these: SGLang gives
a chunked prefill's next chunk its whole size when its budget says no room is left (the
continuation must finish to free its KV), so a restore that took the slots the budget counted on
made that allocation fail and stopped the scheduler (`Out of memory ... Try to allocate`, found by
`bench/agent_traces.py` at 4 tokens a block, 4x oversubscribed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler


def decode_estimate(req: Req, new_token_ratio: float) -> float:
    """The tokens the scheduler expects the request still to decode: its remaining budget, clipped
    as SGLang clips it, times the ratio SGLang learns from early stops (a request that ignores its
    end token decodes all of it)."""
    remaining = min(req.sampling_params.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
    return max(0, remaining) * (1.0 if req.sampling_params.ignore_eos else new_token_ratio)


def committed_tokens(scheduler: Scheduler) -> int:
    """The pool tokens the scheduler counts on now: every running request's decode estimate (the
    last prefill batch's included, merged into the running batch at the next step) and, for a
    chunked prefill under way, the prompt tokens it has still to prefill and its decode estimate."""
    chunked, ratio = scheduler.chunked_req, scheduler.new_token_ratio_tracker.current
    seen, total = set(), 0.0
    last = scheduler.last_batch
    batches = [scheduler.running_batch] + ([last] if last is not None and last.forward_mode.is_extend() else [])
    for batch in batches:
        for req in batch.reqs:
            if req is chunked or id(req) in seen or req.finished():
                continue
            seen.add(id(req))
            total += decode_estimate(req, ratio)
    if chunked is not None:
        total += max(0, len(chunked.origin_input_ids) - chunked.prefix_len)
        total += decode_estimate(chunked, ratio)
    return int(total + 0.999)
