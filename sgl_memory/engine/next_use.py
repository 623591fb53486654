"""Eviction by next use: the tree evicts the paths a mechanism expects furthest ahead first
(KVHost.expect), the rest by last use, unless the operator chose another eviction policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sglang.srt.mem_cache.evict_policy import EvictionStrategy, LRUStrategy
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

from sgl_memory.core.side_tables import SideTable

# per tree node of a path no other path shares: when its path is next used (Mechanism-given, see `expect`)
NEXT_USE: SideTable[Callable[[float], float]] = SideTable("next use")


class NextUseStrategy(EvictionStrategy):
    """Eviction by predicted next use (furthest first), where a mechanism said when a path is next
    used (`expect`); by last use elsewhere. Last use is read as a prediction too: a path last used
    `age` seconds ago is expected back `age` seconds from now, so among paths nobody predicted this
    is SGLang's LRU, and predicted ones sort among them on one scale."""

    def get_priority(self, node: TreeNode) -> float:
        now = time.monotonic()
        when = NEXT_USE.get(node)
        return -(when(now) if when is not None else 2 * now - node.last_access_time)


def expect(tree: RadixCache, node: TreeNode | None, when: Callable[[float], float]) -> None:
    """The path of `tree` ending at `node` is next used at `when(now)` (KVHost.expect): the tree
    evicts by next use from now on, and the nodes of the path no other path shares carry `when`."""
    if not isinstance(tree.eviction_strategy, NextUseStrategy):
        if type(tree.eviction_strategy) is not LRUStrategy:
            return  # the operator chose another policy (--radix-eviction-policy): it stays
        tree.eviction_strategy = NextUseStrategy()
    while node is not None and node is not tree.root_node:
        NEXT_USE.set(node, when)
        parent = node.parent
        if parent is None or len(parent.children) > 1:
            break  # the parent is shared with another path: it keeps last-use order
        node = parent
