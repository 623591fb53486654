"""The tree and the slot accounting, checked whole: what the tests run on every server after each
module (GET /sgl_memory/integrity, through the scheduler's internal state) and a debug setting
runs before every batch (SGLMEMORY_CHECK_INTEGRITY=1, engine/admission.py).

SGLang's own checks count: at idle, free + evictable + protected slots equal the pool; with its
strict settings, the same while busy and no owner's page on the free list. This one names owners:
every page is held by exactly one of the tree, a running request, a reservation, the sentinel or
the free list, so it also finds a slot two nodes hold, a row pointing at a page nobody owns and
counters that drifted from the nodes they count.
"""

from __future__ import annotations

import torch

from sgl_memory.core import tree_fill
from sgl_memory.engine.dead_slots import COUNTED


def row_owners(scheduler) -> list:
    """The KV records that own a row of the slot map now (ReqKvInfo): the requests SGLang's own
    leak check counts (running, last batch, chunked) and its sessions' records."""
    reqs = scheduler.invariant_checker._requests_owning_rows()
    return [r.kv for r in reqs] + [kv for kv in scheduler.tree_cache.session_records().values() if kv.holds_kv]


def in_flight(scheduler) -> set[str]:
    """The ids of the requests the scheduler holds now: waiting, or owning a row (running, the last
    batch, chunked)."""
    return {r.rid for r in scheduler.waiting_queue} | {
        r.rid for r in scheduler.invariant_checker._requests_owning_rows()
    }


def request_state(tree, live: set[str]) -> list[str]:
    """Per-request state the mechanisms hold for requests that are not in flight (`live`): the
    composition ends a request's entries when it ends (core/requests.py), so any left is a leak."""
    return [
        f"{len(left)} request(s) not in flight hold {name} state (e.g. {left[0]!r})"
        for name, rids in tree.requests.held().items()
        if (left := sorted(set(rids) - live))
    ]


def check(tree, owners=()) -> list[str]:
    """Every problem with the tree and the slot accounting, one line each (none: whole). Every
    KV page of the pool is owned once: by the tree, by a request in `owners` (the part of its
    row past its protected prefix: SGLang's requests that hold rows, and session records), by a
    reservation (tree_fill.reserve), by the sentinel, or free; every position of an owner's row
    points at a page it or the tree owns (or at the sentinel); and the tree's size counters
    (evictable, protected, their sentinel entries) equal a recount over its nodes. It reads
    every node: a debug setting (engine/admission.py) and the tests run it, not the hot path."""
    if tree.disable:
        return []
    page, sentinel, problems = tree.page_size, tree.dead_slots.sentinel, []
    empty = torch.zeros(0, dtype=torch.int64)

    def cat(parts) -> torch.Tensor:
        parts = [x.to(torch.int64).cpu().flatten() for x in parts]
        return torch.cat(parts) if parts else empty

    def real(slots: torch.Tensor) -> torch.Tensor:
        return slots if sentinel is None else slots[slots != sentinel]

    def once(name: str, slots: torch.Tensor) -> None:
        repeated = slots.numel() - torch.unique(slots).numel()
        if repeated:
            problems.append(f"{repeated} slot(s) held twice by {name}")

    nodes, stack = [], list(tree.root_node.children.values())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    in_tree = real(cat(n.value for n in nodes if n.value is not None))
    once("the tree's nodes", in_tree)
    rows = tree.req_to_token_pool.req_to_token
    own_parts, paths = [], []
    for kv in owners:
        row = rows[kv.req_pool_idx, : kv.kv_allocated_len].to(torch.int64).cpu()
        own_parts.append(real(row[kv.cache_protected_len :]))
        paths.append((kv, real(row)))
    own = cat(own_parts)
    once("running requests' rows", own)
    reserved = tree_fill.reserved_slots(tree.host)  # reservations are the KV host's (tree_fill.reserve)
    free_pages = tree.token_to_kv_pool_allocator.get_all_free_pages()
    free = cat([] if free_pages is None else [free_pages])
    once("the free list", free)
    held = {
        "the tree": in_tree // page,
        "running requests": own // page,
        "reservations": reserved // page,
        "the free list": free,
    }
    names = list(held)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            both = torch.isin(torch.unique(held[a]), held[b]).sum()
            if both:
                problems.append(f"{int(both)} page(s) held by both {a} and {b}")
    owned = torch.unique(torch.cat([*held.values(), empty if sentinel is None else torch.tensor([sentinel // page])]))
    pages = tree.token_to_kv_pool_allocator.size // page  # pages 1..pages: page 0 is SGLang's padding
    lost = pages - int(((owned >= 1) & (owned <= pages)).sum())
    if lost:
        problems.append(f"{lost} page(s) owned by nobody (not in the tree, a row, a reservation or the free list)")
    mine = torch.cat([in_tree // page, own // page, reserved // page])
    for kv, row in paths:
        stray = int((~torch.isin(row // page, mine)).sum())
        if stray:
            problems.append(f"request row {kv.req_pool_idx}: {stray} position(s) point at a page nobody owns")
    evictable = protected = dead_evictable = dead_protected = 0
    for node in nodes:
        n = len(node.value) if node.value is not None else 0
        dead = tree.dead_slots.entries(node) if node in COUNTED else 0
        if node.lock_ref == 0:
            evictable, dead_evictable = evictable + n, dead_evictable + dead
        else:
            protected, dead_protected = protected + n, dead_protected + dead
    counted = (tree.evictable_size_, tree.protected_size_, *tree.dead_slots.counts())
    if counted != (evictable, protected, dead_evictable, dead_protected):
        problems.append(
            f"the tree counts (evictable, protected, their sentinel entries) {counted}, its nodes hold "
            f"{(evictable, protected, dead_evictable, dead_protected)}"
        )
    return problems
