"""The one handle on this process's sgl-memory state, for hooks that run outside the radix tree.

SGLang builds one tree per scheduler process; ours binds itself here when it is built. The attention
backends read the sentinel slot through it, and the forward-batch hooks read a mechanism's
per-request state; everything else reaches the mechanisms through the tree itself.
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
    return getattr(_TREE, "sentinel", None)


def mechanism(name: str):
    """The enabled mechanism of that name, or None."""
    return _TREE.mechanism(name) if _TREE is not None else None
