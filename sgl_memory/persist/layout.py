"""Where a session's files lie in the store directory and what they take on disk: their names
(hashes of the ids), their sizes (a block several sessions link counted once), the partial writes of
writers that died, and the least recently used sessions removed to fit a quota.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from sgl_memory.persist.header import named_chunks, read_metadata
from sgl_memory.persist.records import CacheSpec
from sgl_memory.persist.shared import CHUNK_SUFFIX, collect, is_shared, remove_unlinked


def _alive(tmp_name: str) -> bool:
    """Whether the writer a temporary or chunk file is named after (w<pid>-...) is another live process."""
    pid = tmp_name[1:].split("-", 1)[0]
    if not tmp_name.startswith("w") or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def digest(*parts: str) -> str:
    """A file or directory name of the ids: a hash, so no id can name a path outside the store."""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:40]


def chunk_files(head: Path) -> list[Path]:
    """The chunk files on disk of the session whose head is `head` (named or not by it)."""
    return list(head.parent.glob(f"{head.stem}.*{CHUNK_SUFFIX}"))


class StoreLayout:
    """The store directory's session files as files: named, measured and removed (partial writes, the quota)."""

    def __init__(self, root: Path, spec: CacheSpec) -> None:
        self.root, self.spec = root, spec
        self.disk_bytes = 0  # of the session files, as of the last enforce_quota

    def remove_partial_writes(self) -> int:
        """Temporary files and chunks of writers that died before their head's rename: never
        loadable, only space. Both are named after their writer's pid; a live writer's (another
        server sharing the store) are left alone, and so is every chunk a head names. The store's
        copies of blocks that no session links any more go too (shared.py)."""
        if not self.root.exists():
            return 0
        stale = [t for t in self.root.glob("*/*/*.tmp") if not _alive(t.name)]
        named = set()
        for head in self.root.glob("*/*/*.safetensors"):
            try:
                named.update(c.name for c in named_chunks(read_metadata(head)))
            except Exception:  # unreadable: read() refuses it with the reason; its chunks stay
                named.update(p.name for p in chunk_files(head))
        stale += [
            c
            for c in self.root.glob(f"*/*/*{CHUNK_SUFFIX}")
            if not is_shared(c) and c.name not in named and not _alive(c.name.split(".", 1)[1])
        ]
        for path in stale:
            path.unlink(missing_ok=True)
        return len(stale) + collect(self._directories())

    def enforce_quota(self, quota_bytes: int) -> list[Path]:
        """Delete least recently used sessions (a head and its chunks) until the store fits in
        quota_bytes. Returns the heads removed. The store's bytes count each file once however many
        sessions link it; a session's removal frees its own files and the blocks no other session
        links (a link whose file has no other name but the store's copy). A copy no session links
        any more is removed on the way (the one scan of the store per write)."""
        sessions: dict[Path, list] = {}  # head path -> [head stat, bytes its removal frees]
        seen, total = set(), 0
        for path in self.root.glob("*/*/*"):
            try:
                if remove_unlinked(path):
                    continue
                stat = path.stat()
            except FileNotFoundError:  # another server sharing the store removed it meanwhile
                continue
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
            if is_shared(path):
                continue
            head = path.parent / (path.name.split(".", 1)[0] + ".safetensors")
            entry = sessions.setdefault(head, [None, 0])
            entry[1] += stat.st_size if stat.st_nlink <= 2 else 0
            if path == head:
                entry[0] = stat
        # a chunk without its head (a writer between the two, or one that died) is not a session
        files = sorted(
            ((stat, size, head) for head, (stat, size) in sessions.items() if stat is not None),
            key=lambda f: f[0].st_mtime,
        )
        removed = []
        while files and total > quota_bytes:
            _, size, oldest = files.pop(0)
            total -= size
            self._remove(oldest)
            removed.append(oldest)
        if removed:
            collect(self._directories())  # the copies only the removed sessions linked
        self.disk_bytes = total
        return removed

    def _directories(self) -> list[Path]:
        """The store's directories of session files (one per tenant and model)."""
        return [d for d in self.root.glob("*/*") if d.is_dir()]

    def _remove(self, head: Path) -> None:
        for path in [head, *chunk_files(head)]:
            path.unlink(missing_ok=True)

    def files(self, tenant: str | None, session_id: str) -> list[Path]:
        """The session's files on disk: its head (first, whether or not it exists) and its chunk files."""
        head = self.path(tenant, session_id)
        return [head, *chunk_files(head)]

    def size(self, tenant: str | None, session_id: str) -> int:
        """Bytes of the session's files: its head and its chunks (a block it shares with other
        sessions counted in full: what reading it takes)."""
        total = 0
        for path in self.files(tenant, session_id):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def path(self, tenant: str | None, session_id: str) -> Path:
        """The session's head: <tenant>/<model, config hash, TP rank>/<session>.safetensors, each a digest."""
        model = digest(self.spec.model_id, self.spec.config_hash, self.spec.shard)
        return self.root / digest("tenant", tenant or "") / model / f"{digest('session', session_id)}.safetensors"

    # --- encoding ------------------------------------------------------------------------------
