"""The pool tokens SGLang's scheduler counts on (engine/committed.py), which a restore or a prefetch
must leave: checked against the estimate written out from its definition for a scheduler whose
running batch, last prefill batch and chunked prefill are set by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from sgl_memory.engine.committed import committed_tokens
from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS


def req(max_new, decoded=0, ignore_eos=False, prompt=0, prefix=0, finished=False):
    return SimpleNamespace(
        sampling_params=SimpleNamespace(max_new_tokens=max_new, ignore_eos=ignore_eos),
        output_ids=[0] * decoded,
        origin_input_ids=[0] * prompt,
        prefix_len=prefix,
        finished=lambda: finished,
    )


def batch(reqs, extend=False):
    return SimpleNamespace(reqs=reqs, forward_mode=SimpleNamespace(is_extend=lambda: extend))


def scheduler(running, last=None, chunked=None, ratio=0.5):
    return SimpleNamespace(
        running_batch=batch(running),
        last_batch=last,
        chunked_req=chunked,
        new_token_ratio_tracker=SimpleNamespace(current=ratio),
    )


def test_the_scheduler_and_its_requests_have_what_the_estimate_reads():
    """The names the estimate reads on SGLang's pinned version (the fakes below stand for them)."""
    import inspect

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker

    scheduler_source = inspect.getsource(Scheduler)
    for name in ("self.running_batch", "self.last_batch", "self.chunked_req", "self.new_token_ratio_tracker"):
        assert name in scheduler_source, name
    assert "self.current" in inspect.getsource(NewTokenRatioTracker)
    assert isinstance(getattr(Req, "prefix_len", None), property) or "self.prefix_len" in inspect.getsource(Req)
    assert "self.origin_input_ids" in inspect.getsource(Req)


def test_running_requests_count_their_remaining_decode_at_the_learned_ratio():
    a, b = req(100, decoded=10), req(40, ignore_eos=True)
    assert committed_tokens(scheduler([a, b])) == math.ceil(90 * 0.5 + 40)


def test_the_last_prefill_batch_counts_once_and_a_finished_request_not_at_all():
    a, b, done = req(20), req(30), req(50, finished=True)
    last = batch([a, b, done], extend=True)
    assert committed_tokens(scheduler([a], last=last)) == math.ceil((20 + 30) * 0.5)
    assert committed_tokens(scheduler([a], last=batch([b]))) == math.ceil(20 * 0.5)  # a decode batch: merged


def test_a_chunked_prefill_counts_the_prompt_it_has_still_to_prefill():
    chunked = req(16, prompt=6491, prefix=4096)
    running = req(16, decoded=4)
    last = batch([chunked, running], extend=True)
    assert committed_tokens(scheduler([running], last=last, chunked=chunked)) == math.ceil(
        (6491 - 4096) + 16 * 0.5 + 12 * 0.5
    )


@pytest.mark.parametrize("max_new", [CLIP_MAX_NEW_TOKENS - 1, CLIP_MAX_NEW_TOKENS, 10 * CLIP_MAX_NEW_TOKENS])
def test_a_long_budget_is_clipped_as_sglang_clips_it(max_new):
    assert committed_tokens(scheduler([req(max_new, ignore_eos=True)])) == min(max_new, CLIP_MAX_NEW_TOKENS)
