"""The scheduler's admission hook: each memory mechanism sees a new request before it is queued.

A tenant is a namespace in the radix tree too: its requests get the tenant in their `extra_key`
(which SGLang already uses to keep LoRA adapters apart), so no request matches KV another tenant
computed, even for the same tokens. The field is parsed once, here (a bad one is a 400), and
every mechanism gets the parsed spec. Persistence runs next: its text-level match may rewrite the
prompt's token ids, which intent pruning then reads to find its spans. KV memory (never on together
with either) puts a memory-mode request's retrieved blocks before its prompt."""

from __future__ import annotations

from sgl_memory.intent.pruner import get_pruner
from sgl_memory.intent.request import SpecError, of_request


def admit_hook(scheduler, req, *args, **kwargs):
    """BEFORE hook on Scheduler._add_request_to_queue (patches/hooks.yaml)."""
    if args[:1] == (True,) or kwargs.get("is_retracted") or req.finished():
        return None  # a retracted request was admitted once already
    try:
        spec = of_request(req)
    except SpecError as exc:
        req.set_finish_with_abort(str(exc))
        return None
    if spec.tenant is not None:
        req.extra_key = f"{req.extra_key or ''}\x00tenant:{spec.tenant}"
    persist = getattr(scheduler.tree_cache, "persist", None)
    if persist is not None:
        persist.admit(scheduler, req, spec)
    memart = getattr(scheduler.tree_cache, "memart", None)
    if memart is not None:
        memart.admit(scheduler, req, spec)
    pruner = get_pruner()
    if pruner is not None:
        pruner.admit(scheduler, req, spec)
    return None
