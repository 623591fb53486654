"""Restores unpacked off the scheduler's step: dequantizing a session's stored KV and writing it into
the slots reserved for it run on a thread of their own.

A restore used to dequantize and write the pool on the scheduler's thread, and every batch waited
for it (10-80 ms at 1-2k tokens on a CPU; more for a long session). Now the scheduler reserves the
slots (it owns the allocator and the tree) and starts a job; the request waits in the queue, the
batches go on; at a later step the scheduler inserts the finished path into the tree and holds it
for the request (manager.SessionPersistence.before_prefill). Nothing else owns the reserved slots
meanwhile, so the job writes them without a lock.

A job's slots are reserved while it runs, so what the jobs take is bounded by the pool, and each
finishes without waiting for anything: a job never holds up another request for longer than its
own unpacking.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass


@dataclass
class Job:
    """One restore unpacking off the scheduler's step: the request it is for, its reused prefix,
    what landing it needs and its future."""

    owner: object  # the request the restore is for
    tokens: int  # the request's reused prefix, to be held once the job lands
    context: object  # what the scheduler needs to land it (plan.Restore, the reserved slots)
    future: Future  # -> the parts' times in ms; raises what the unpacking raised


class Unpacker:
    """Jobs on one daemon thread (a second would only share the same cores), one per owner."""

    def __init__(self):
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sgl-memory-unpack")
        self._jobs: dict[object, Job] = {}

    def start(self, owner, tokens: int, context, work: Callable[[], dict[str, float]]) -> None:
        assert owner not in self._jobs, "one restore per request at a time"
        self._jobs[owner] = Job(owner, tokens, context, self._thread.submit(work))

    def running(self, owner) -> bool:
        return owner in self._jobs

    def finished(self) -> list[Job]:
        """The jobs done since the last call (failed ones included: `future.result()` raises),
        taken out, in the order they were started."""
        done = [job for job in self._jobs.values() if job.future.done()]
        for job in done:
            del self._jobs[job.owner]
        return done

    def abandon(self, owner) -> Job | None:
        """Take the owner's job out, after it has ended (its writes must be over before its slots
        are given back)."""
        job = self._jobs.pop(owner, None)
        if job is not None:
            wait([job.future])
        return job

    def tokens(self) -> int:
        """The prefixes the running jobs' requests will hold once they land: counted with the holds."""
        return sum(job.tokens for job in self._jobs.values())

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every job started so far has ended (they land at the next step); False if
        `timeout` passed first."""
        return not wait([job.future for job in self._jobs.values()], timeout).not_done
