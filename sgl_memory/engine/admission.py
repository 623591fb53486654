"""The scheduler's admission hook: each memory mechanism sees a new request before it is queued.

Namespaces in the radix tree live in SGLang's `extra_key` (which it already uses to keep LoRA
adapters apart): a tenant, a memory assembly, a probe each append one (kvhost.namespace). A
client may send an `extra_key` of its own, so before anything is appended the client's part is
escaped to a string without NUL (`client_namespace`): no client value can then spell one of ours,
and the tenant namespace comes from `sgl_memory.tenant` alone. The field is parsed once, here (a
bad one is a 400), and the tree admits the request through each of its mechanisms with the parsed
spec, by order (the order in which they rewrite the prompt)."""

from __future__ import annotations

import functools
import os

from sgl_memory.core import prometheus
from sgl_memory.core.config import MemoryConfig
from sgl_memory.core.kvhost import namespace
from sgl_memory.core.request import SpecError, check_served, of_request
from sgl_memory.core.side_tables import SideTable
from sgl_memory.engine import integrity
from sgl_memory.engine.radix_cache import SglMemoryRadixCache

ADMITTED: SideTable[bool] = SideTable("admitted")  # a request this hook saw (a retracted one comes back through it)
# The debug setting: the tree's integrity (integrity.py) checked before every batch
# is formed, the scheduler stopped at the first problem. It reads the whole tree each time.
CHECK_INTEGRITY_ENV = "SGLMEMORY_CHECK_INTEGRITY"
CHECK_EVERY_STEP = os.environ.get(CHECK_INTEGRITY_ENV) == "1"


@functools.cache
def _off() -> MemoryConfig:
    """What a server runs when its tree is not ours (or is disabled): no mechanism."""
    return MemoryConfig()


def client_namespace(extra_key: str | None) -> str | None:
    """An injective escape of a client's extra_key that never contains NUL, the separator of the
    namespaces sgl-memory appends: `\\` becomes `\\\\` and NUL becomes `\\0`."""
    if not extra_key or ("\x00" not in extra_key and "\\" not in extra_key):
        return extra_key or None
    return extra_key.replace("\\", "\\\\").replace("\x00", "\\0")


def admit_hook(scheduler, req, *args, **kwargs):
    """BEFORE hook on Scheduler._add_request_to_queue (patches/hooks.yaml)."""
    if args[:1] == (True,) or kwargs.get("is_retracted") or req.finished() or req in ADMITTED:
        return None  # admitted once already (a retracted request comes back through here)
    ADMITTED.set(req, True)
    req.extra_key = client_namespace(req.extra_key)
    tree = scheduler.tree_cache
    try:
        spec = of_request(req)
        check_served(spec, _off() if getattr(tree, "disable", True) else getattr(tree, "memory_config", None) or _off())
    except SpecError as exc:
        prometheus.BAD_REQUESTS.labels("field").inc()
        req.set_finish_with_abort(str(exc))
        return None
    if spec.tenant is not None:
        req.extra_key = namespace(req.extra_key, "tenant", spec.tenant)
    if getattr(tree, "composition", None):
        tree.admit(scheduler, req, spec)
    return None


def dropped_hook(result, scheduler, req, *args, **kwargs):
    """AFTER hook on Scheduler._release_aborted_request (patches/hooks.yaml). A request aborted
    before it held a KV row (a client that went away while it waited in the queue) never reaches
    the tree's release: the per-request state its admission made is dropped here. One that holds a
    row is released by the tree as any other, right after."""
    tree = scheduler.tree_cache
    if req in ADMITTED and not req.kv.holds_kv and getattr(tree, "composition", None):
        tree.on_drop(req)
    return None


def prefill_hook(original, scheduler, running_batch, *args, **kwargs):
    """AROUND hook on Scheduler.get_new_batch_prefill (patches/hooks.yaml). The mechanisms see the
    waiting queue first (persistence restores a deferred session's KV when the tree can hold it);
    for this batch only, a request they hold back (its KV not back yet) is out of the queue, so the
    scheduler does not prefill what is about to be restored, and the requests the tree holds KV for
    come first (Holds.held_first). The queue then goes back to its order, and the tree lets go of
    the holds of the requests that left it (Holds.after_prefill)."""
    tree = scheduler.tree_cache
    if CHECK_EVERY_STEP and isinstance(tree, SglMemoryRadixCache) and not tree.disable:
        problems = integrity.check(tree, integrity.row_owners(scheduler))
        if problems:
            raise RuntimeError(
                f"{CHECK_INTEGRITY_ENV}: the tree's integrity failed before a batch: {'; '.join(problems)}"
            )
    if not getattr(tree, "composition", None):
        return original(scheduler, running_batch, *args, **kwargs)
    # the batch that runs now (the last prefill merged in), not scheduler.running_batch, which lags it;
    # a chunked prefill under way runs too (its next chunk needs the room it was admitted with)
    running = not running_batch.is_empty() or scheduler.chunked_req is not None
    held_back = set(tree.composition.before_prefill(scheduler, scheduler.waiting_queue, running))
    holds = tree.holds
    if not held_back and not holds.held_tokens():
        plan = original(scheduler, running_batch, *args, **kwargs)  # the queue as SGLang keeps it
    else:
        order = list(scheduler.waiting_queue)
        scheduler.waiting_queue = holds.held_first([r for r in order if r not in held_back])
        try:
            plan = original(scheduler, running_batch, *args, **kwargs)
        finally:
            left = set(scheduler.waiting_queue)
            # their places in the queue as it was; a request the batch put back (preempted) after
            back = [r for r in order if r in left or r in held_back]
            placed = set(back)
            scheduler.waiting_queue = back + [r for r in scheduler.waiting_queue if r not in placed]
    holds.after_prefill(scheduler, scheduled=plan.batch_to_run is not None, idle=plan.running_batch.is_empty())
    return plan
