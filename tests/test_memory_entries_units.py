"""Memory entries without a server: the book (groups, replacement, static transitions), the pool's
view of it (hidden members, units, KEEP segments), persistence, and the API's body checks."""

from __future__ import annotations

import pytest
import torch

from sgl_memory.memart.pool import MemArtPool
from sgl_memory.memart.entries import EntryBook
from sgl_memory.memart.writes import parse_forget, parse_write
from sgl_memory.core.request import SpecError

L, H, D = 2, 2, 4


def clusters(seed: int, sizes: list[int], noise: float = 0.05) -> list[tuple[int, torch.Tensor]]:
    """Unit embeddings around orthogonal directions, one direction per cluster, shuffled: (cluster, vector)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for c, n in enumerate(sizes):
        for _ in range(n):
            v = torch.zeros(16)
            v[c] = 1.0
            v = v + noise * torch.randn(16, generator=g)
            out.append((c, v / v.norm()))
    order = torch.randperm(len(out), generator=g).tolist()
    return [out[i] for i in order]


@pytest.mark.parametrize("seed", range(4))
def test_entries_group_by_their_embeddings(seed):
    book = EntryBook(threshold=0.5, static_after=3)
    truth = {}
    for i, (cluster, vector) in enumerate(clusters(seed, [3, 2, 4, 1])):
        book.write(f"e{i}", [i], vector)
        truth[f"e{i}"] = cluster
    got = sorted(sorted(g.members) for g in book.groups.values())
    want = sorted(sorted(k for k, c in truth.items() if c == cluster) for cluster in set(truth.values()))
    assert got == want


def test_grouping_off_keeps_every_entry_alone_and_never_static():
    book = EntryBook(threshold=2.0, static_after=1)
    for i in range(4):
        book.write(f"e{i}", [i], torch.ones(4) / 2)  # identical embeddings
    assert len(book.groups) == 4 and book.due() == []


def test_a_group_becomes_static_after_quiet_writes_and_dynamic_at_a_member_write():
    book = EntryBook(threshold=0.5, static_after=2)
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    book.write("a1", [1], a)
    book.write("a2", [2], a)  # group A changed at write 2
    book.write("b1", [3], b)
    assert book.due() == []  # one write since A changed
    book.write("b2", [4], b)
    (group,) = book.due()  # two writes since A changed; B changed at write 4
    assert group.members == ["a1", "a2"] and book.joint_tokens(group) == [1, 2]
    assert book.due() == []  # asked once
    stays, replaced = book.arrived(book.joint_tag(group), turn=10)
    assert stays and replaced == set() and group.joint == 10
    for key, turn in (("a1", 0), ("a2", 1)):
        book.entries[key].turn = turn
    assert book.hidden_turns() == {0, 1}
    change = book.write("a1", [5], a)  # a member changes: the joint KV goes now
    assert change.stale == {10} and group.joint is None and book.hidden_turns() == set()


def test_a_joint_kv_computed_across_a_member_change_is_dropped():
    book = EntryBook(threshold=0.5, static_after=1)
    a = torch.tensor([1.0, 0.0])
    book.write("a1", [1], a)
    book.write("a2", [2], a)
    book.write("x", [3], torch.tensor([0.0, 1.0]))
    (group,) = [g for g in book.due() if "a1" in g.members]
    tag = book.joint_tag(group)
    book.write("a2", [4], a)  # while the joint pass ran
    assert book.arrived(tag, turn=7) == (False, set())


def test_a_replaced_entry_keeps_its_old_turn_until_the_new_one_arrives():
    book = EntryBook(threshold=2.0, static_after=3)
    first = book.write("k", [1], None).tag
    assert book.arrived(first, turn=0) == (True, set())
    second = book.write("k", [2], None).tag
    assert book.entries["k"].turn == 0  # still recallable in between
    third = book.write("k", [3], None).tag
    assert book.arrived(second, turn=1) == (False, set())  # stale: written again since
    assert book.arrived(third, turn=2) == (True, {0})
    change = book.forget("k")
    assert change.stale == {2} and "k" not in book.entries and book.groups == {}
    assert book.forget("k").stale == set()


def kv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g)


def pool_with_entries(static_after=1):
    pool = MemArtPool(capacity=64, block_size=4, book=EntryBook(threshold=0.5, static_after=static_after))
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    pool.add_turn(list(range(100, 106)), *kv(6, 0), 4)  # a chat turn, untagged
    for i, (key, emb, n) in enumerate((("a1", a, 6), ("a2", a, 3), ("b1", b, 5))):
        tag = pool.book.write(key, list(range(10 * i, 10 * i + n)), emb).tag
        pool.add_turn(list(range(10 * i, 10 * i + n)), *kv(n, i + 1), 4, tag)
    return pool


def turn_blocks(pool, turn):
    return [b.id for b in pool.blocks.values() if b.origin[0][0] == turn]


def test_the_pool_hides_static_members_and_places_units_whole():
    pool = pool_with_entries()
    (group,) = [g for g in pool.book.due() if g.members == ["a1", "a2"]]
    tokens = pool.book.joint_tokens(group)
    pool.add_turn(tokens, *kv(len(tokens), 9), 4, pool.book.joint_tag(group))
    joint_turn = group.joint
    assert joint_turn == 4
    visible = set(pool.index().ids)
    hidden = set(turn_blocks(pool, 1) + turn_blocks(pool, 2))
    assert hidden and visible == set(pool.blocks) - hidden
    joint = turn_blocks(pool, joint_turn)
    units = pool.book.unit_turns()
    assert len(joint) == 3 and all(pool.unit(b, units) == joint for b in joint)
    b1 = turn_blocks(pool, 3)
    assert pool.unit(b1[1], units) == b1
    chat = turn_blocks(pool, 0)
    assert pool.unit(chat[1], units) == [chat[1]]
    # KEEP's segments: each chat block alone, an entry's blocks together, the group's together
    blocks = [pool.blocks[i] for i in sorted(chat + b1 + joint)]
    assert pool.segments(blocks, units) == [4, 2, 5, 9]
    # the member changes: joint KV dropped now, members visible again
    pool.drop_turns(pool.book.write("a2", [7, 7], torch.tensor([1.0, 0.0])).stale)
    assert not turn_blocks(pool, joint_turn) and set(pool.index().ids) == set(pool.blocks)


def test_an_exported_pool_with_entries_loads_equal():
    pool = pool_with_entries()
    (group,) = [g for g in pool.book.due() if len(g.members) == 2]
    tokens = pool.book.joint_tokens(group)
    pool.add_turn(tokens, *kv(len(tokens), 9), 4, pool.book.joint_tag(group))
    loaded = MemArtPool(capacity=64, block_size=4, book=EntryBook(threshold=0.5, static_after=1))
    loaded.load(pool.export())
    assert loaded.book.summary() == pool.book.summary()
    for key, entry in pool.book.entries.items():
        other = loaded.book.entries[key]
        assert (other.tokens, other.group, other.written, other.turn) == (
            entry.tokens,
            entry.group,
            entry.written,
            entry.turn,
        )
        assert torch.equal(other.embedding, entry.embedding)
    assert loaded.index().ids == pool.index().ids
    assert all(loaded.unit(b, loaded.book.unit_turns()) == pool.unit(b, pool.book.unit_turns()) for b in pool.blocks)


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {"entries": [{"key": "a", "text": "x"}]},
        {"session_id": "s"},
        {"session_id": "s", "entries": {}},
        {"session_id": "s", "entries": [{"key": 3, "text": "x"}]},
        {"session_id": "s", "entries": [{"key": "a"}]},
        {"session_id": "s", "entries": [{"key": "a", "text": ""}]},
        {"session_id": "s", "entries": [{"key": "a", "text": "x"}], "more": 1},
        {"session_id": "s", "entries": [{"key": "a", "text": "x" * 70000}]},
    ],
)
def test_bad_write_bodies_are_refused(body):
    with pytest.raises(SpecError):
        parse_write(body)


def test_write_and_forget_bodies_parse():
    assert parse_write({"session_id": "s", "tenant": "t", "entries": [{"key": "a", "text": "x  \n"}]}) == (
        "s",
        "t",
        [("a", "x\n")],
    )
    assert parse_forget({"session_id": "s", "keys": ["a", "b"]}) == ("s", None, ["a", "b"])
    with pytest.raises(SpecError):
        parse_forget({"session_id": "s", "keys": [""]})
