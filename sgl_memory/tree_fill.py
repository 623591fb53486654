"""Putting KV that was computed elsewhere into the radix tree, so SGLang's own prefix match reuses it.

Persistence (a session restored from its file) and KV memory (retrieved blocks assembled before a
request) both end the same way: the tree holds the first `have` tokens of a key, and the KV of the
rest is known. The rest goes into freshly allocated slots (evicting if needed, the matched part
locked meanwhile) and the whole path is inserted, so the next `match_prefix` of the scheduler finds
it and the request prefills only what follows.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams


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
