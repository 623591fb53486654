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
in intent/paths.py); the tree finds the branches on a request's path (`find_branches`) and inserts
its row with them (`with_branches`).
"""

from __future__ import annotations

import os.path
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

Branches = tuple[tuple[int, int], ...]  # (position, key id), ascending positions; () for a plain path
BranchIds = Callable[[np.ndarray], np.ndarray]  # a request's token ids (int64) -> the id each takes at a branch


def find_branches(root, key: RadixKey, ids_of: BranchIds) -> Branches:
    """The branches on `key`'s path in the tree below `root`: where the tree holds the branch id
    (`ids_of`) of the key's token. At a node boundary with both a plain child and a branch child the
    walk takes the branch: it is the request's own continuation. Read-only: no split, no
    access-time update."""
    n = len(key)
    ids = np.asarray(key.token_ids[:n], dtype=np.int64)
    branched = ids_of(ids)
    node, pos, found = root, 0, []
    while pos < n:
        probe = RadixKey(array("q", [int(branched[pos])]), key.extra_key, cache_salt=key.cache_salt).child_key()
        child = node.children.get(probe)
        if child is None:
            child = node.children.get(key.child_key_at(pos))
        if child is None:
            break
        held = np.asarray(child.key.token_ids[: len(child.key)], dtype=np.int64)
        m = min(len(held), n - pos)
        plain = held[:m] == ids[pos : pos + m]
        branch = held[:m] == branched[pos : pos + m]
        off = np.flatnonzero(~(plain | branch))
        matched = int(off[0]) if off.size else m
        found.extend((pos + int(i), int(branched[pos + i])) for i in np.flatnonzero(branch[:matched]))
        if matched < len(held):
            break
        node, pos = child, pos + matched
    return tuple(found)


def with_branches(token_ids, branches: Branches):
    """The key ids of a path with these branches (those beyond its end left out): a
    copy of the same sequence type, which the tree's key comparison requires, or `token_ids` itself
    when no branch falls inside it."""
    inside = [(p, i) for p, i in branches if p < len(token_ids)]
    if not inside:
        return token_ids
    ids = token_ids[:]
    for p, i in inside:
        ids[p] = i
    return ids


def pool_layers(pool) -> range:
    start = getattr(pool, "start_layer", 0) or 0  # pipeline parallelism: this rank's layers
    return range(start, start + pool.layer_num)


def alloc(tree, n: int) -> torch.Tensor | None:
    """n fresh slots, evicting for them; None when the tree cannot free enough."""
    allocator = tree.token_to_kv_pool_allocator
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    if allocator.available_size() < n:
        tree.evict(EvictParams(num_tokens=n - allocator.available_size()))
        # SGLang holds the frees of a batch's result processing in a free group until it ends, and
        # intent's compression event runs inside one: what eviction just freed would not count
        # until then (on a full pool every event failed). Ending the group and opening a new one
        # hands them back now; the group's caller still ends it.
        if allocator.available_size() < n and getattr(allocator, "free_group", None) is not None:
            allocator.free_group_end()
            allocator.free_group_begin()
    return allocator.alloc(n) if allocator.available_size() >= n else None


def copy_within(tree, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the KV of slots `src` into slots `dst` in every layer of the tree's pool (same
    positions: no RoPE change)."""
    pool = tree.token_to_kv_pool_allocator.get_kvcache()
    for layer in pool_layers(pool):
        pool.get_key_buffer(layer)[dst] = pool.get_key_buffer(layer)[src]
        pool.get_value_buffer(layer)[dst] = pool.get_value_buffer(layer)[src]


def place(tree, key, match, keys, values, live: torch.Tensor | None = None) -> bool:
    """Write keys/values [layers, n, heads, dim] for key[have:] (have = what `match` found) and insert
    the whole key; False when no slots can be freed for them (the caller prefills instead). `live`
    [n] (None: all live) marks the positions that hold KV; the others point at the tree's sentinel
    slot, which the tree must have."""
    have = match.device_prefix_len
    n = len(key.token_ids) - have
    live = torch.ones(n, dtype=torch.bool) if live is None else live.to(torch.bool).cpu()
    if not bool(live.all()) and getattr(tree, "sentinel", None) is None:
        raise ValueError("a pruned path can only be placed into a tree with a sentinel slot")
    pool = tree.token_to_kv_pool_allocator.get_kvcache()
    tree.inc_lock_ref(match.last_device_node)  # eviction for the new slots must spare the matched part
    try:
        slots = alloc(tree, int(live.sum()))
        if slots is None:
            return False
        everything = bool(live.all())
        # a fresh or quiet pool hands out one run of slots: a plain copy, not a scatter
        run = len(slots) > 0 and bool((slots.diff() == 1).all())
        rows = slice(int(slots[0]), int(slots[0]) + len(slots)) if run else slots
        for i, layer in enumerate(pool_layers(pool)):
            for buffer, kv in ((pool.get_key_buffer(layer), keys[i]), (pool.get_value_buffer(layer), values[i])):
                buffer[rows] = (kv if everything else kv[live]).to(slots.device)
        value = torch.full((n,), tree.sentinel if tree.sentinel is not None else -1, dtype=torch.int64)
        value[live] = slots.to(torch.int64).cpu()
        prefix = tree.path_device_indices(match.last_device_node)[:have].to(torch.int64)
        result = tree.insert(InsertParams(key=key, value=torch.cat([prefix, value.to(prefix.device)])))
        if result.prefix_len > have:  # cannot happen while the scheduler thread is ours; never leak
            tree.token_to_kv_pool_allocator.free(value[: result.prefix_len - have].to(prefix.device))
    finally:
        tree.dec_lock_ref(match.last_device_node)
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
    tokens: list[int]  # the leading tokens whose KV the tree holds under the namespace asked
    node: object  # the tree node where they end
    branches: Branches = ()  # where the path's key leaves its tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def key(self, extra_key: str | None, cache_salt=None) -> RadixKey:
        """The tree key of the path: its tokens, branch ids at its branches."""
        return path_key(self.tokens, self.branches, extra_key, cache_salt)


def path_key(tokens, branches: Branches, extra_key: str | None, cache_salt=None) -> RadixKey:
    return RadixKey(with_branches(array("q", tokens), branches), extra_key, cache_salt=cache_salt)


@dataclass
class PathKV:
    keys: torch.Tensor  # [layers, n, heads, dim], host memory
    values: torch.Tensor
    live: torch.Tensor  # [n] bool: False where the position was pruned (its slot is the sentinel)


def held_path(tree, req) -> HeldPath:
    """How much of a released request's tokens (prompt and output) the tree holds under the key the
    request inserted them with (a read: it may split a node, as every match does, but inserts and
    frees nothing)."""
    tokens = [*req.origin_input_ids, *req.output_ids]
    branches = tree.branches(req)
    match = tree.match_prefix(MatchPrefixParams(key=path_key(tokens, branches, req.extra_key, req.cache_salt)))
    n = match.device_prefix_len
    return HeldPath(tokens[:n], match.last_device_node, tuple(b for b in branches if b[0] < n))


def live_mask(tree, slots: torch.Tensor) -> torch.Tensor:
    """[n] bool, on the host: the slots that hold KV of their position (not the sentinel slot)."""
    sentinel = getattr(tree, "sentinel", None)
    return (slots != sentinel).cpu() if sentinel is not None else torch.ones(slots.numel(), dtype=torch.bool)


def path_live(tree, path: HeldPath) -> torch.Tensor:
    """[len(path)] bool: the positions of a held path that hold KV."""
    return live_mask(tree, tree.path_device_indices(path.node)[: len(path)])


def copy_slots(tree, slots: torch.Tensor) -> PathKV:
    """KV [layers, n, heads, dim] of these slots (a row's or a path's), copied off the pool to host
    memory, with their live mask (a pruned position's KV is the sentinel's: zeros)."""
    pool = tree.token_to_kv_pool_allocator.get_kvcache()
    keys = torch.stack([pool.get_key_buffer(i)[slots] for i in pool_layers(pool)]).cpu()
    values = torch.stack([pool.get_value_buffer(i)[slots] for i in pool_layers(pool)]).cpu()
    return PathKV(keys, values, live_mask(tree, slots))


def copy_path(tree, path: HeldPath, start: int, end: int | None = None) -> PathKV:
    """KV of positions [start, end) of a held path, copied off the pool, with its live mask."""
    return copy_slots(tree, tree.path_device_indices(path.node)[start : len(path) if end is None else end])
