"""Memory entries a client writes by key, and the static/dynamic groups they form (KEEP 4.1).

An entry is a piece of a session's memory that the client names (`key`) and may replace: a fact
about the world that a newer observation supersedes ("the apple is in the fridge" after "the apple
is on the table"). Its text's KV is computed alone, as a turn of the session's pool; that turn's
blocks are the entry's. Writing a key again replaces the entry: the old blocks leave the pool when
the new ones arrive, so a superseded fact is never recalled. Forgetting a key drops its blocks.

Entries are grouped by meaning: sentence-encoder embeddings, clustered online (an entry joins the
group with the nearest centroid if their cosine is at least `threshold`, else starts its own). A
group of two or more members none of which changed in the session's last `static_after` writes is
static: its members' tokens are prefilled once more as one text (the joint KV: full cross-attention
inside the group) and retrieval places that turn as one unit instead of the members' own blocks. A
write to a member makes the group dynamic again: the joint KV is dropped, members are retrieved on
their own until the group has been quiet for `static_after` writes, and then it is recomputed.

The book is the pool's (pool.py): the pool's lock guards it. Admission changes it in request
order (the scheduler thread); the turns that hold the KV arrive later, through the pool's ingest,
and `arrived` decides what a turn becomes, so a turn that a newer write made stale is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ENTRY, JOINT = "entry", "joint"  # what a tagged turn of the pool holds
ALONE = 2.0  # a group threshold no cosine reaches: every entry a group of its own (grouping off)


@dataclass
class Entry:
    """One memory entry a client wrote by key: its tokens, its embedding, its group and the pool
    turn that holds its KV."""

    key: str
    tokens: list[int]
    embedding: torch.Tensor | None  # [E] float32, unit norm; None where grouping is off
    group: int
    written: int  # the book's write counter at its last write
    turn: int | None = None  # the pool turn holding its KV, once ingested


@dataclass
class Group:
    """One group of entries by meaning: its members, its version and the pool turn holding its joint
    KV while it is static."""

    id: int
    members: list[str] = field(default_factory=list)  # entry keys, in the order they joined
    version: int = 0  # bumped at every change of its members
    changed: int = 0  # the write counter at the last change
    joint: int | None = None  # the pool turn holding its joint KV while it is static
    asked: bool = False  # the joint KV of this version was asked for (BookChange.due)


@dataclass
class BookChange:
    """What one write or forget did: pool turns whose blocks leave now (a replaced group's joint KV,
    a forgotten entry), and the tag its own turn will carry when ingested."""

    stale: set[int] = field(default_factory=set)
    tag: tuple | None = None


@dataclass
class EntryBook:
    """A session's entries by key and their groups: the writes and forgets in request order, and
    what each arriving turn becomes (`arrived`). The pool's lock guards it (pool.py)."""

    threshold: float  # cosine to a group's centroid to join it; above 1: every entry alone
    static_after: int  # writes without a member change that make a group static
    entries: dict[str, Entry] = field(default_factory=dict)
    groups: dict[int, Group] = field(default_factory=dict)
    writes: int = 0
    next_group: int = 0

    # --- changes, in request order ------------------------------------------------------------

    def write(self, key: str, tokens: list[int], embedding: torch.Tensor | None) -> BookChange:
        """A new entry, or a new text for `key`. Its old turn stays recallable until the new one
        arrives (`arrived`), so a retrieval in between still finds the fact."""
        self.writes += 1
        change = BookChange()
        old = self.entries.get(key)
        if old is not None:
            self._leave(old, change)
        group = self._assign(embedding)
        group.members.append(key)
        self._touch(group, change)
        self.entries[key] = Entry(key, tokens, embedding, group.id, self.writes, old.turn if old else None)
        change.tag = (ENTRY, key, self.writes)
        return change

    def forget(self, key: str) -> BookChange:
        """Drop an entry (a no-op for an unknown key): its turn leaves the pool now."""
        change = BookChange()
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.writes += 1
            self._leave(entry, change)
            if entry.turn is not None:
                change.stale.add(entry.turn)
        return change

    def due(self) -> list[Group]:
        """Groups that became static and whose joint KV nobody asked for yet (marked asked now)."""
        out = []
        for group in self.groups.values():
            quiet = self.writes - group.changed >= self.static_after
            if len(group.members) > 1 and group.joint is None and not group.asked and quiet:
                group.asked = True
                out.append(group)
        return out

    def joint_tag(self, group: Group) -> tuple:
        return (JOINT, group.id, group.version)

    def joint_tokens(self, group: Group) -> list[int]:
        return [t for key in group.members for t in self.entries[key].tokens]

    def arrived(self, tag: tuple, turn: int) -> tuple[bool, set[int]]:
        """A tagged turn was added to the pool: whether it stays, and the turns it replaces."""
        kind, name, stamp = tag
        if kind == ENTRY:
            entry = self.entries.get(name)
            if entry is None or entry.written != stamp:
                return False, set()  # forgotten or written again since
            old, entry.turn = entry.turn, turn
            return True, {old} - {None}
        group = self.groups.get(name)
        if group is None or group.version != stamp:
            return False, set()  # a member changed while the joint KV was computed
        old, group.joint = group.joint, turn
        return True, {old} - {None}

    # --- reading ----------------------------------------------------------------------------

    def hidden_turns(self) -> set[int]:
        """Turns retrieval does not see: the members' own turns of static groups (their joint
        turn stands for them)."""
        return {self.entries[key].turn for g in self.groups.values() if g.joint is not None for key in g.members} - {
            None
        }

    def unit_turns(self) -> dict[int, tuple]:
        """Turns placed whole, with the segment they form: an entry's turn, a static group's joint turn."""
        units = {e.turn: (ENTRY, e.key) for e in self.entries.values() if e.turn is not None}
        units.update({g.joint: (JOINT, g.id) for g in self.groups.values() if g.joint is not None})
        return units

    def summary(self) -> dict:
        groups = [{"id": g.id, "members": list(g.members), "static": g.joint is not None} for g in self.groups.values()]
        return {
            "entries": len(self.entries),
            "writes": self.writes,
            "groups": groups,
            "static_groups": sum(g["static"] for g in groups),
            "dynamic_groups": sum(not g["static"] for g in groups),
        }

    # --- internals --------------------------------------------------------------------------

    def _assign(self, embedding: torch.Tensor | None) -> Group:
        best, best_cos = None, self.threshold
        if embedding is not None:
            for group in self.groups.values():
                members = [self.entries[k].embedding for k in group.members if self.entries[k].embedding is not None]
                if not members:
                    continue
                centroid = torch.stack(members).mean(0)
                cos = float(centroid @ embedding / centroid.norm().clamp_min(1e-12))
                if cos >= best_cos:
                    best, best_cos = group, cos
        if best is None:
            best = self.groups[self.next_group] = Group(self.next_group)
            self.next_group += 1
        return best

    def _touch(self, group: Group, change: BookChange) -> None:
        """A member changed: the group is dynamic from now on."""
        group.version += 1
        group.changed = self.writes
        group.asked = False
        if group.joint is not None:
            change.stale.add(group.joint)
            group.joint = None

    def _leave(self, entry: Entry, change: BookChange) -> None:
        group = self.groups[entry.group]
        group.members.remove(entry.key)
        self._touch(group, change)
        if not group.members:
            del self.groups[group.id]

    # --- persistence (the pool's export) ------------------------------------------------------

    def export(self) -> dict[str, torch.Tensor]:
        if not self.entries and not self.groups:
            return {}
        entries = list(self.entries.values())
        keys = [e.key.encode() for e in entries]
        with_embedding = [e for e in entries if e.embedding is not None]
        out = {
            "book_meta": torch.tensor([self.writes, self.next_group], dtype=torch.int64),
            "entry_keys": torch.tensor(list(b"\x00".join(keys)), dtype=torch.uint8),
            # per entry: group, written, turn (-1: none yet), token count, has an embedding
            "entry_meta": torch.tensor(
                [
                    [e.group, e.written, -1 if e.turn is None else e.turn, len(e.tokens), e.embedding is not None]
                    for e in entries
                ],
                dtype=torch.int64,
            ).reshape(-1, 5),
            "entry_tokens": torch.tensor([t for e in entries for t in e.tokens], dtype=torch.int64),
            # per group: id, version, changed, joint turn (-1: dynamic); then its members by entry index
            "groups": torch.tensor(
                [[g.id, g.version, g.changed, -1 if g.joint is None else g.joint] for g in self.groups.values()],
                dtype=torch.int64,
            ).reshape(-1, 4),
            "group_members": torch.tensor(
                [[g.id, entries.index(self.entries[k])] for g in self.groups.values() for k in g.members],
                dtype=torch.int64,
            ).reshape(-1, 2),
        }
        if with_embedding:
            out["entry_embeddings"] = torch.stack([e.embedding for e in with_embedding])
        return out

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        if "book_meta" not in tensors:
            return
        self.writes, self.next_group = (int(x) for x in tensors["book_meta"])
        keys = bytes(tensors["entry_keys"].tolist()).split(b"\x00") if tensors["entry_keys"].numel() else []
        embeddings = iter(tensors.get("entry_embeddings", torch.zeros(0)))
        tokens, start, order = tensors["entry_tokens"].tolist(), 0, []
        for key, (group, written, turn, n, has) in zip(keys, tensors["entry_meta"].tolist()):
            entry = Entry(
                key.decode(),
                tokens[start : start + n],
                next(embeddings) if has else None,
                group,
                written,
                None if turn < 0 else turn,
            )
            self.entries[entry.key] = entry
            order.append(entry.key)
            start += n
        for gid, version, changed, joint in tensors["groups"].tolist():
            # not `asked`: a joint KV asked for before a restart never arrives, so it is asked again
            self.groups[gid] = Group(gid, [], version, changed, None if joint < 0 else joint)
        for gid, index in tensors["group_members"].tolist():
            self.groups[gid].members.append(order[index])
