"""Moving KV between the radix tree and the mechanisms' own stores, in both directions.

Into the tree (`place`): persistence (a session restored from its file) and KV memory (retrieved
blocks assembled before a request) both end the same way: the tree holds the first `have` tokens of
a key, and the KV of the rest is known. The rest goes into freshly allocated slots (evicting if
needed, the matched part locked meanwhile) and the whole path is inserted, so the next
`match_prefix` of the scheduler finds it and the request prefills only what follows.

Out of the tree (`held_path`, `copy_path`): at a request's release, the path its tokens left in the
tree is matched and the KV of a stretch of it copied to host memory, with the mask of positions that
are live (a pruned position points at the sentinel slot and holds no KV of its token).
"""

from __future__ import annotations

import os.path
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey


def pool_layers(pool) -> range:
    start = getattr(pool, "start_layer", 0) or 0  # pipeline parallelism: this rank's layers
    return range(start, start + pool.layer_num)


def alloc(tree, n: int) -> torch.Tensor | None:
    allocator = tree.token_to_kv_pool_allocator
    if allocator.available_size() < n:
        tree.evict(EvictParams(num_tokens=n - allocator.available_size()))
    return allocator.alloc(n) if allocator.available_size() >= n else None


def place(tree, key, match, keys, values) -> bool:
    """Write keys/values [layers, n, heads, dim] for key[have:] (have = what `match` found) and insert
    the whole key; False when no slots can be freed for them (the caller prefills instead)."""
    have = match.device_prefix_len
    pool = tree.token_to_kv_pool_allocator.get_kvcache()
    tree.inc_lock_ref(match.last_device_node)  # eviction for the new slots must spare the matched part
    try:
        slots = alloc(tree, len(key.token_ids) - have)
        if slots is None:
            return False
        for i, layer in enumerate(pool_layers(pool)):
            pool.get_key_buffer(layer)[slots] = keys[i].to(slots.device)
            pool.get_value_buffer(layer)[slots] = values[i].to(slots.device)
        prefix = tree.path_device_indices(match.last_device_node)[:have].to(torch.int64)
        result = tree.insert(InsertParams(key=key, value=torch.cat([prefix, slots.to(torch.int64)])))
        if result.prefix_len > have:  # cannot happen while the scheduler thread is ours; never leak
            tree.token_to_kv_pool_allocator.free(slots[: result.prefix_len - have])
    finally:
        tree.dec_lock_ref(match.last_device_node)
    return True


def copy_out(tree, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [layers, n, heads, dim] of these slots, copied off the pool to host memory."""
    pool = tree.token_to_kv_pool_allocator.get_kvcache()
    keys = torch.stack([pool.get_key_buffer(i)[slots] for i in pool_layers(pool)]).cpu()
    values = torch.stack([pool.get_value_buffer(i)[slots] for i in pool_layers(pool)]).cpu()
    return keys, values


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

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class PathKV:
    keys: torch.Tensor  # [layers, n, heads, dim], host memory
    values: torch.Tensor
    live: torch.Tensor  # [n] bool: False where the position was pruned (its slot is the sentinel)


def held_path(tree, tokens: list[int], extra_key: str | None, cache_salt=None) -> HeldPath:
    """How much of `tokens` the tree holds in this namespace (a read: it may split a node, as every
    match does, but inserts and frees nothing)."""
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)))
    return HeldPath(tokens[: match.device_prefix_len], match.last_device_node)


def copy_path(tree, path: HeldPath, start: int, end: int | None = None) -> PathKV:
    """KV of positions [start, end) of a held path, copied off the pool, with its live mask."""
    slots = tree.path_device_indices(path.node)[start : len(path) if end is None else end]
    keys, values = copy_out(tree, slots)
    sentinel = getattr(tree, "sentinel", None)
    live = slots != sentinel if sentinel is not None else torch.ones(slots.numel(), dtype=torch.bool)
    return PathKV(keys, values, live.cpu())
