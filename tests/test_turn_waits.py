"""Where a session turn's wait for its first token went (PersistTurn.waited), from the stamps the
pinned SGLang's own request clock (SchedulerReqTimeStats) sets as the scheduler does: queued, its
first forward, its prefill's end. Reference: the intervals written by hand."""

from __future__ import annotations

import pytest
from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

from sgl_memory.persist.session import PersistTurn


def stamps(queued: float, forward: float | None, finished: float | None) -> SchedulerReqTimeStats:
    stats = SchedulerReqTimeStats()
    stats.set_wait_queue_entry_time(queued)
    if forward is not None:
        stats.set_forward_entry_time(forward)
    if finished is not None:
        stats.set_prefill_finished_time(finished)
    return stats


def test_a_restored_turn_splits_its_wait_into_room_restore_queue_and_prefill():
    turn = PersistTurn(None, "s", opened_at=100.0, restored_tokens=50, step_ms=30.0, off_step_ms=170.0)
    turn.deferred_ms = 1500.0
    turn.waited(stamps(100.01, forward=104.0, finished=104.75))
    # 4 s from admission to its first forward: 1.5 s for room, 0.2 s its restore, the rest queued
    assert turn.queued_ms == pytest.approx(4000 - 1500 - 200)
    assert turn.prefill_ms == pytest.approx(750)
    metrics = turn.metrics(None)
    assert metrics["queued_ms"] == pytest.approx(2300) and metrics["turn_prefill_ms"] == pytest.approx(750)
    assert metrics["restore_ms"] == pytest.approx(200)


def test_a_turn_that_restored_nothing_spent_its_whole_wait_queued():
    turn = PersistTurn(None, "s", opened_at=10.0, step_ms=3.0)  # a file read, nothing restored
    turn.waited(stamps(10.0, forward=12.5, finished=13.0))
    assert turn.queued_ms == pytest.approx(2500) and turn.prefill_ms == pytest.approx(500)


def test_a_turn_that_never_ran_reports_no_wait():
    turn = PersistTurn(None, "s", opened_at=10.0)
    turn.waited(stamps(10.0, forward=None, finished=None))  # aborted in the queue
    assert turn.metrics(None)["queued_ms"] is None and turn.metrics(None)["turn_prefill_ms"] is None


def test_overlapping_clocks_never_give_a_negative_queue():
    """The unpack thread's time overlaps the queue; a restore longer than the wait is not a negative wait."""
    turn = PersistTurn(None, "s", opened_at=0.0, restored_tokens=10, off_step_ms=900.0)
    turn.waited(stamps(0.0, forward=0.5, finished=0.6))
    assert turn.queued_ms == 0.0
