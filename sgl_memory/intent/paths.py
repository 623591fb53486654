"""Where a pruned path lives in the radix tree: only requests that accept its pruning can match it.

SGLang's radix tree is shared by every request on a server, and a path is found by its tokens. A
dead-slot path (pruned positions pointing at the sentinel, and KV computed after a pruning) must
not be found that way, or any request with the same tokens (another session, a request that asked
for no pruning, a retry under another budget) reads KV that someone else's scorer chose to drop.

A compression event changes a path from its first newly dropped position b on: before b every
entry is what the path held already, after it some positions are dead and the kept ones, copied
into slots of the path's own, are no longer shared with the path they came from. At b the key is
not the token t but a branch id: a negative id (no tokenizer emits one) derived from the pruning's
namespace (tenant, session, scorer, budget rule, layout) and t. Every event of a session adds one
branch along its path, so a path of a session that pruned at several turns carries several
(tree_fill.find_branches walks them). Therefore:

- a plain request walks the shared part and stops at the first branch, then computes its own
  unpruned continuation;
- the same session's next turn, with the same pruning, finds every branch on its path and puts
  the same ids in its own key, so it reuses the whole pruned prefix, dead positions included:
  its prefill attends to exactly what the earlier events kept;
- another session, or the same session under another budget, has other ids;
- the token is part of the id, so a path is matched only by the tokens that made it.

Ids are 63 bits of a mix of the namespace hash and the token; two namespaces of one tenant collide
at a position with probability about 2^-63 (tenants never share a path: theirs is in the extra key).
"""

from __future__ import annotations

import hashlib

import numpy as np

MASK63 = (1 << 63) - 1
MIX = 0x9E3779B97F4A7C15  # odd: token -> token * MIX mod 2^63 is one-to-one


def namespace(session_key: tuple[str, str], scorer: str, budget: int | str, layout: str) -> int:
    """A 63-bit hash that names a session (tenant, id) and its pruning (`budget`: the total budget,
    or "history:N" for a history budget of N)."""
    tenant, session = session_key
    digest = hashlib.blake2b(
        f"{tenant}\x00{session}\x00{scorer}\x00{budget}\x00{layout}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") >> 1


def branch_id(ns: int, token: int) -> int:
    """The key id in [-2^63, -1] that stands for `token` at a branch of namespace `ns`."""
    return -1 - ((ns + token * MIX) & MASK63)


def branch_ids(ns: int, tokens: np.ndarray) -> np.ndarray:
    """`branch_id` of every token (int64), computed in wrapping uint64 arithmetic: 2^63 divides
    2^64, so the low 63 bits are those of the exact sum."""
    with np.errstate(over="ignore"):
        mixed = (tokens.astype(np.uint64) * np.uint64(MIX) + np.uint64(ns)) & np.uint64(MASK63)
    return ~mixed.astype(np.int64)
