"""Moving KV between the radix tree and the mechanisms' own stores, in both directions.

Into the tree (`place`): persistence (a session restored from its file) and KV memory (retrieved
blocks assembled before a request) both end the same way: the tree holds the first `have` tokens of
a key, and the KV of the rest is known. The rest goes into freshly allocated slots (evicting if
needed, the matched part locked meanwhile) and the whole path is inserted, so the next
`match_prefix` of the scheduler finds it and the request prefills only what follows. A path that
was pruned comes with its live mask: its dead positions point at this tree's sentinel slot and
take no slot of their own.

Out of the tree (`held_path`, `copy_path`): at a request's release, the path its tokens left in the
tree is matched under the request's own key and the KV of a stretch of it copied to host memory,
with the mask of positions that are live (a pruned position points at the sentinel slot and holds
no KV of its token).

Branches: a path whose KV is not what its tokens alone would give (pruned positions, KV computed
after a pruning) must be found only by the requests that accept it. Such a path leaves the shared
tree at a branch: from that position on its key holds a branch id instead of the token, an id no
tokenizer emits (negative), which only a request that computes the same ids matches. The mechanism
that makes such paths says how its requests' ids are computed (Mechanism.branch_ids: intent's are
in intent/paths.py); the tree finds the branches on a request's path and inserts its row with them
(`with_branches`).

Everything here goes through the KV host protocol (kvhost.py): no SGLang type is built here.
"""

from __future__ import annotations

import os.path
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass

import torch

from typing import TYPE_CHECKING, Any, TypeVar, cast

from sgl_memory.core import kv_rows
from sgl_memory.core.kvhost import Branches, KVHost, Match
from sgl_memory.core.side_tables import SideTable

if TYPE_CHECKING:
    from sgl_memory.core.views import RequestView

IdsT = TypeVar("IdsT", bound=MutableSequence[int])  # a key's ids: an array of the tree's type, or a list


def with_branches(token_ids: IdsT, branches: Branches) -> IdsT:
    """The key ids of a path with these branches (those beyond its end left out): a
    copy of the same sequence type, which the tree's key comparison requires, or `token_ids` itself
    when no branch falls inside it."""
    inside = [(p, i) for p, i in branches if p < len(token_ids)]
    if not inside:
        return token_ids
    ids = cast(IdsT, token_ids[:])  # the same sequence type: the tree compares keys of one type
    for p, i in inside:
        ids[p] = i
    return ids


def copy_within(tree: KVHost, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the KV of slots `src` into slots `dst` in every layer of the tree's pool (same
    positions: no RoPE change)."""
    pool = tree.pool
    for layer in tree.layers():
        pool.get_key_buffer(layer)[dst] = pool.get_key_buffer(layer)[src]
        pool.get_value_buffer(layer)[dst] = pool.get_value_buffer(layer)[src]


@dataclass
class Reserved:
    """Slots taken for the KV of key[have:] (`reserve`), written (`write`, on any thread) before
    the key goes into the tree (`insert`) or the slots go back (`release`). The matched part stays
    locked in between."""

    key: Any  # the tree's key (KVHost.key)
    match: Match
    slots: torch.Tensor  # one per live position
    live: torch.Tensor  # [len(key) - have] bool


# per tree: the slots reserved and not yet inserted or given back (reservation id -> slots): nothing
# else owns them meanwhile, so the tree's integrity check counts them as owned
RESERVATIONS: SideTable[dict[int, torch.Tensor]] = SideTable("reserved slots")


def reserved_slots(tree: KVHost) -> torch.Tensor:
    """Every slot reserved in `tree` now (int64, on the host)."""
    held = list(RESERVATIONS.get(tree, {}).values())
    return torch.cat(held).to(torch.int64).cpu() if held else torch.zeros(0, dtype=torch.int64)


def reserve(tree: KVHost, key: Any, match: Match, live: torch.Tensor | None = None) -> Reserved | None:
    """Slots for key[have:] (have = what `match` found), evicting if needed; None when no slots
    can be freed for them (nothing is kept). `live` [n] (None: all live) marks the positions that
    hold KV; the others will point at the tree's sentinel slot, which the tree must have."""
    n = len(key) - match.device_prefix_len
    live = torch.ones(n, dtype=torch.bool) if live is None else live.to(torch.bool).cpu()
    if not bool(live.all()) and tree.sentinel is None:
        raise ValueError("a pruned path can only be placed into a tree with a sentinel slot")
    tree.inc_lock_ref(match.last_device_node)  # eviction for the new slots must spare the matched part
    slots = tree.alloc_slots(int(live.sum()))
    if slots is None:
        tree.dec_lock_ref(match.last_device_node)
        return None
    reserved = Reserved(key, match, slots, live)
    (RESERVATIONS.get(tree) or RESERVATIONS.set(tree, {}))[id(reserved)] = slots
    return reserved


def write(tree: KVHost, reserved: Reserved, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write keys/values [layers, n, heads, dim] of key[have:] into the reserved slots. Touches no
    tree state: a restore runs it off the scheduler's thread (nothing else owns those slots)."""
    slots, live = reserved.slots, reserved.live
    everything = bool(live.all())
    # a fresh or quiet pool hands out one run of slots: a plain copy, not a scatter
    run = len(slots) > 0 and bool((slots.diff() == 1).all())
    rows = slice(int(slots[0]), int(slots[0]) + len(slots)) if run else slots
    pool = tree.pool
    for i, layer in enumerate(tree.layers()):
        for buffer, kv in ((pool.get_key_buffer(layer), keys[i]), (pool.get_value_buffer(layer), values[i])):
            # in the pool's own format: an 8-bit pool takes each value rounded to it, packed rows as they are
            buffer[rows] = kv_rows.convert(kv if everything else kv[live], buffer.dtype).to(slots.device)


def insert(tree: KVHost, reserved: Reserved) -> None:
    """Insert the whole key (its matched part's slots, then the reserved ones) and unlock."""
    have, live = reserved.match.device_prefix_len, reserved.live
    RESERVATIONS.get(tree, {}).pop(id(reserved), None)
    try:
        value = torch.full((len(live),), tree.sentinel if tree.sentinel is not None else -1, dtype=torch.int64)
        value[live] = reserved.slots.to(torch.int64).cpu()
        prefix = tree.path_slots(reserved.match.last_device_node)[:have].to(torch.int64)
        held = tree.insert_path(reserved.key, torch.cat([prefix, value.to(prefix.device)]))
        if held > have:  # another restore of the same path landed first: ours are duplicates
            tree.free_real(value[: held - have][live[: held - have]].to(prefix.device))
    finally:
        tree.dec_lock_ref(reserved.match.last_device_node)


def release(tree: KVHost, reserved: Reserved) -> None:
    """Give the reserved slots back unused, and unlock."""
    RESERVATIONS.get(tree, {}).pop(id(reserved), None)
    tree.free_real(reserved.slots)
    tree.dec_lock_ref(reserved.match.last_device_node)


def place(
    tree: KVHost, key: Any, match: Match, keys: torch.Tensor, values: torch.Tensor, live: torch.Tensor | None = None
) -> bool:
    """Write keys/values [layers, n, heads, dim] for key[have:] (have = what `match` found) and insert
    the whole key, all at once; False when no slots can be freed for them (the caller prefills
    instead)."""
    reserved = reserve(tree, key, match, live)
    if reserved is None:
        return False
    try:
        write(tree, reserved, keys, values)
    except BaseException:
        release(tree, reserved)
        raise
    insert(tree, reserved)
    return True


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the common prefix of two token lists (or strings, compared in C)."""
    if isinstance(a, str) and isinstance(b, str):
        return len(os.path.commonprefix([a, b]))
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class HeldPath:
    """The leading tokens of a released request that the tree holds under its key, the node where
    they end and where the path's key leaves its tokens."""

    tokens: list[int]  # the leading tokens whose KV the tree holds under the namespace asked
    node: object  # the tree node where they end
    branches: Branches = ()  # where the path's key leaves its tokens

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class PathKV:
    """The KV of a stretch of a held path, copied to host memory, with the mask of its live positions."""

    keys: torch.Tensor  # [layers, n, heads, dim], host memory, as the pool stores them or as values (copy_slots)
    values: torch.Tensor
    live: torch.Tensor  # [n] bool: False where the position was pruned (its slot is the sentinel)


def held_path(tree: KVHost, req: RequestView) -> HeldPath:
    """How much of a released request's tokens (prompt and output) the tree holds under the key the
    request inserted them with (a read: it may split a node, as every match does, but inserts and
    frees nothing)."""
    tokens = [*req.origin_input_ids, *req.output_ids]
    branches = tree.branches(req)
    match = tree.match(tree.key(tokens, req.extra_key, req.cache_salt, branches))
    n = match.device_prefix_len
    return HeldPath(tokens[:n], match.last_device_node, tuple(b for b in branches if b[0] < n))


def live_mask(tree: KVHost, slots: torch.Tensor) -> torch.Tensor:
    """[n] bool, on the host: the slots that hold KV of their position (not the sentinel slot)."""
    sentinel = tree.sentinel
    return (slots != sentinel).cpu() if sentinel is not None else torch.ones(slots.numel(), dtype=torch.bool)


def path_live(tree: KVHost, path: HeldPath) -> torch.Tensor:
    """[len(path)] bool: the positions of a held path that hold KV."""
    return live_mask(tree, tree.path_slots(path.node)[: len(path)])


def copy_slots(tree: KVHost, slots: torch.Tensor, as_stored: bool = False) -> PathKV:
    """KV [layers, n, heads, dim] of these slots (a row's or a path's), copied off the pool to host
    memory, with their live mask (a pruned position's KV is the sentinel's: zeros). Packed int8 rows
    come decoded to the pool's compute dtype, unless `as_stored` (the session store keeps them as
    they are); any other pool's rows come in its dtype."""
    pool = tree.pool

    def rows(buffer: torch.Tensor) -> torch.Tensor:
        stored = buffer[slots].cpu()
        return kv_rows.convert(stored, pool.dtype) if kv_rows.packed(stored) and not as_stored else stored

    keys = torch.stack([rows(pool.get_key_buffer(i)) for i in tree.layers()])
    values = torch.stack([rows(pool.get_value_buffer(i)) for i in tree.layers()])
    return PathKV(keys, values, live_mask(tree, slots))


def copy_path(tree: KVHost, path: HeldPath, start: int, end: int | None = None, as_stored: bool = False) -> PathKV:
    """KV of positions [start, end) of a held path, copied off the pool, with its live mask."""
    return copy_slots(tree, tree.path_slots(path.node)[start : len(path) if end is None else end], as_stored)
