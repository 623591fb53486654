"""Replicas behind SGLang's router (smg, consistent hashing of the routing-key header), one session
store shared by both (SmolLM2-135M, persistence on, stored in the pool's own dtype: a restored
session's KV is bit-identical to the KV its turns computed).

The replicas are the suite's `all` and `all_b` servers (one configuration, each with a store of
its own); the tenants these tests use have one directory that both stores hold (a link in B's
store to A's), so every file of their sessions is in one place for both replicas, as on one store.

- affinity: every turn of a session that sends its routing key reaches one replica, which reuses
  the session's path from its radix tree (nothing restored from the store);
- a session whose turns land on both replicas (no affinity) continues from its newest stored turn
  on each, and answers as the same conversation on one server does;
- failover: a replica killed with SIGKILL; its session's next turn goes through the router to the
  other replica, which restores it from the shared store.

The store's own two-writer safety (generations, kill -9 at random points) is tested on the store in
tests/test_persist_store.py."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from bench import harness
from sgl_memory.core.sessions import ROUTING_HEADER, routing_key
from sgl_memory.persist.header import read_metadata
from sgl_memory.persist.layout import digest
from test_persist_server import ALONE, CONVERSATIONS, SYSTEM, chat, run_turns, session_file

pytestmark = pytest.mark.server


def share(a, b, tenant: str) -> None:
    """The tenant's directory of A's store is B's too: both replicas read and write its sessions there."""
    shared = a.dir / "store" / digest("tenant", tenant)
    shared.mkdir(parents=True, exist_ok=True)
    (b.dir / "store" / shared.name).symlink_to(shared, target_is_directory=True)


@pytest.fixture(scope="module")
def replicas(all_server, all_b_server, tmp_path_factory):
    """Replicas A and B, the tenants' directories shared, and the router in front of them (it sends
    a request to the replicas serving the model it names: both serve "m", which
    test_persist_server's chat names); returns (A, B, router, A's store)."""
    a, b = all_server, all_b_server
    for tenant in ("affinity", "moves"):
        share(a, b, tenant)
    router = harness.start_router([a, b], tmp_path_factory.mktemp("router") / "router.log")
    yield a, b, router, a.dir / "store"
    harness.stop(router)


def served(replicas_, turn):
    """Run `turn()`; returns (its result, the replica that served it), told by their request counts."""
    before = [r.requests_served() for r in replicas_]
    result = turn()
    after = [r.requests_served() for r in replicas_]
    changed = [r for r, x, y in zip(replicas_, before, after) if y != x]
    assert len(changed) == 1, (before, after)
    return result, changed[0]


def routed(router, session_id, tenant=None):
    """The router as a client of this session sees it: every request carries the session's routing key."""
    return dataclasses.replace(router, headers={ROUTING_HEADER: routing_key(tenant, session_id)})


def generation(store, session_id) -> int:
    path = session_file(store, session_id)
    return int(read_metadata(path)["generation"]) if path.exists() else 0


def wait_for_generation(store, session_id, at_least: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while generation(store, session_id) < at_least:
        assert time.monotonic() < deadline, f"session {session_id} not stored at generation {at_least}"
        time.sleep(0.1)


def turn(server, messages, text, session_id, tenant=None):
    """One user turn appended to `messages` (and its answer, once it comes); returns (answer, usage, metrics)."""
    messages.append({"role": "user", "content": text})
    answer, usage, metrics = chat(server, messages, session_id, tenant, **ALONE)
    messages.append({"role": "assistant", "content": answer})
    return answer, usage, metrics


def test_every_turn_of_a_session_reaches_one_replica_through_the_router(replicas):
    """Sessions are started until each replica is the home of two (the hash of a key depends on the
    replicas' addresses, which are new ports each run); then each one's later turns all reach its
    home and find its path in that replica's tree."""
    a, b, router, _ = replicas
    sessions = {a.url: [], b.url: []}
    for k in range(40):  # the ring may give one replica most keys: enough sessions that each gets two
        if min(map(len, sessions.values())) >= 2:
            break
        session, messages, conv = f"affinity-{k}", [SYSTEM], CONVERSATIONS[k % len(CONVERSATIONS)]
        (_, usage, metrics), home = served(
            (a, b), lambda: turn(routed(router, session, "affinity"), messages, conv[0], session, "affinity")
        )
        if len(sessions[home.url]) < 2:
            sessions[home.url].append((session, messages, conv, [(home.url, usage, metrics)]))
    assert min(map(len, sessions.values())) >= 2, "40 sessions hashed to one replica: the router is not spreading them"
    for session, messages, conv, seen in (s for per_home in sessions.values() for s in per_home):
        for text in conv[1:]:
            (_, usage, metrics), replica = served(
                (a, b), lambda: turn(routed(router, session, "affinity"), messages, text, session, "affinity")
            )
            seen.append((replica.url, usage, metrics))
        assert len({url for url, _, _ in seen}) == 1, (session, [url for url, _, _ in seen])
        for (_, before, _), (_, usage, metrics) in zip(seen, seen[1:]):
            assert not metrics.get("restored_tokens"), metrics  # its home's tree held the session's path
            assert (
                usage["prompt_tokens_details"]["cached_tokens"]
                >= before["prompt_tokens"] + before["completion_tokens"] - 1
            )


def test_a_session_served_by_both_replicas_continues_from_its_newest_stored_turn(replicas):
    """Without affinity (turns 1 and 3 on A, turn 2 on B): B loads what A stored, and A, whose own copy
    of the session is older than the file B stored, reloads it; every answer is the one the same
    conversation gets on one server. A tenant of its own: no other test's path is in either tree."""
    a, b, _, store = replicas
    conv, session = CONVERSATIONS[0], "moves"
    reference = [answer for answer, _, _ in run_turns(a, conv, "moves-reference", tenant="reference", **ALONE)]
    messages, got = [SYSTEM], []
    for n, (server, text) in enumerate(zip((a, b, a), conv)):
        got.append(turn(server, messages, text, session, "moves"))
        wait_for_generation(store, session, n + 1)  # a turn is stored off the request's path, after its answer
    assert [answer for answer, _, _ in got] == reference
    for _, _, metrics in got[1:]:
        assert metrics["restored_from"] == "disk" and metrics["restored_tokens"] > 0, metrics
    assert generation(store, session) == 3  # one history: A's turn 3 continued B's turn 2


@pytest.mark.server(ends="all_b")
def test_a_killed_replicas_session_continues_on_the_other_through_the_router(replicas, pool):
    """Runs last of B's tests: it kills B. The session is one whose home is B (the suite's later
    tests use A). The session's turn 2 is not waited for before the kill (it may or may not be
    stored by then); turn 1 is. A tenant of its own, as above."""
    a, b, router, store = replicas
    conv = CONVERSATIONS[1]
    for k in range(40):  # a tenant each: A's tree holds nothing of the one whose home is B
        session = tenant = f"failover-{k}"
        share(a, b, tenant)
        client, messages = routed(router, session, tenant), [SYSTEM]
        first, home = served((a, b), lambda: turn(client, messages, conv[0], session, tenant))
        if home is b:
            break
    assert home is b, "40 sessions hashed to A: the router is not spreading them"
    wait_for_generation(store, session, 1)
    second, again = served((a, b), lambda: turn(client, messages, conv[1], session, tenant))
    assert again is home
    os.killpg(home.proc.pid, signal.SIGKILL)
    home.proc.wait()
    pool.stop(home)  # reaps what the kill left
    (answer, _, metrics), _ = served((a,), lambda: turn(client, messages, conv[2], session, tenant))
    assert metrics["restored_from"] == "disk" and metrics["restored_tokens"] > 0, metrics
    # a tenant of its own, as cold at its first turn as the session was on B: under "reference"
    # the tree held the system message (the test above), a prefill split otherwise, which in bf16
    # flipped the test model's near-tie first token ("Alec." against "Aw, wow.", an AMX Xeon)
    reference = [answer for answer, _, _ in run_turns(a, conv, "reference", tenant="failover-reference", **ALONE)]
    assert [first[0], second[0], answer] == reference
