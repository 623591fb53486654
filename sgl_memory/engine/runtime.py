"""The one handle on this process's sgl-memory state, for hooks that run outside the radix tree.

SGLang builds one tree per scheduler process; ours binds itself here when it is built. The attention
backends read the sentinel slot through it, and the forward hooks the mechanisms' composition
(what they capture, drop, shift and read); everything else reaches the mechanisms through the tree.
"""

from __future__ import annotations

_TREE = None


def bind(tree) -> None:
    global _TREE
    _TREE = tree


def tree():
    return _TREE


def sentinel() -> int | None:
    """The KV slot pruned positions point at, or None when no pruning runs here."""
    return None if _TREE is None else _TREE.dead_slots.sentinel


def composition():
    """The enabled mechanisms of this process's tree (core/composition.py), or None before one is
    built or when the tree is disabled."""
    return None if _TREE is None or _TREE.disable else _TREE.composition
