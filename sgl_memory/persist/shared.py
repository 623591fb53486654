"""Full blocks stored once however many sessions hold them.

A full block (`block_size` tokens) is a chunk file of one block named by its checksum, which covers
its tensors and its place in the path (store.py): `blk-<checksum>.chunk`, the store's copy. Each
session that holds the block names a hard link to that copy in its head. Sessions that share a
prefix in the radix tree share its pool slots, so their captures encode the same bytes: the tool
definitions and system prompt every session of an agent opens with are written once, and a
sub-agent's copy of its parent's context is its parent's. The filesystem counts the links: a
session removed (the quota) takes its links with it, and a copy no session links any more is
removed by `collect`. The blocks are matched by their bytes, not by their tokens, so a session never
reads KV it did not write. Where hard links fail (a filesystem without them), a session keeps its
own copy, as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

SHARED_PREFIX = "blk-"
CHUNK_SUFFIX = ".chunk"


def link_block(head: Path, checksum: str, save: Callable[[], str]) -> tuple[Path, bool]:
    """The session's link (beside its head `head`) to the block whose file's checksum is
    `checksum`: to the store's copy where there is one, else to the file `save()` writes (a
    temporary name), which becomes the store's copy. Returns the link and whether this call made it.
    The link is named after this writer (w<pid>), so another server's start-up sweep leaves it alone
    until this writer's head names it."""
    link = head.parent / f"{head.stem}.w{os.getpid()}-{checksum[:40]}{CHUNK_SUFFIX}"
    if link.exists():  # an earlier turn of this writer linked the same block
        return link, False
    shared = head.parent / f"{SHARED_PREFIX}{checksum[:40]}{CHUNK_SUFFIX}"
    try:
        os.link(shared, link)
        return link, True
    except FileNotFoundError:  # no copy yet (or `collect` just removed it): this writer's becomes it
        pass
    except OSError:  # no hard links on this filesystem: the session keeps its own copy
        os.replace(save(), link)
        return link, True
    tmp = save()
    try:
        os.link(tmp, shared)
    except OSError:  # another writer's copy came first (or no hard links): this one stays the session's own
        pass
    os.replace(tmp, link)
    return link, True


def is_shared(path: Path) -> bool:
    """Whether `path` is the store's copy of a block (no session's file of its own)."""
    return path.name.startswith(SHARED_PREFIX)


def remove_unlinked(path: Path) -> bool:
    """Remove `path` if it is the store's copy of a block and no session links it (no other link);
    whether it did. A copy a writer links meanwhile keeps its link: only the store's name for it
    goes, and the next writer of the block writes it again. FileNotFoundError: it is gone already."""
    if is_shared(path) and path.stat().st_nlink == 1:
        path.unlink()
        return True
    return False


def collect(directories: list[Path]) -> int:
    """Remove the store's copies no session links any more in `directories`; returns how many."""
    removed = 0
    for directory in directories:
        for path in directory.glob(f"{SHARED_PREFIX}*{CHUNK_SUFFIX}"):
            try:
                removed += remove_unlinked(path)
            except FileNotFoundError:
                pass
    return removed
