"""The suite's server pool (tests/servers.py) without a server: the run order against the rules
written out by hand, and a run of a plan in which a server is a stand-in process (`sleep`), so
that what the pool starts, keeps and stops can be counted."""

from __future__ import annotations

import subprocess

import pytest

from bench import harness
from servers import MAX_LIVE, Pool, Spec, run_order


def test_the_run_order_groups_tests_by_server_and_puts_enders_after_the_servers_last_user():
    f = frozenset
    uses = [f({"b"}), f(), f({"a"}), f({"a", "b"}), f({"b"}), f({"a"}), f()]
    ends = [set(), set(), {"a"}, set(), set(), set(), {"*"}]
    # no server first; then a's group (the order of collection), its ender after its last user;
    # b's group; the test that ends "*" last of all
    assert run_order(uses, ends, ("a", "b")) == [1, 3, 5, 2, 0, 4, 6]


class Stand:
    """A server's start, standing in for harness.Starting: a `sleep` process, ready at once."""

    started: list[str] = []

    def __init__(self, command, log, env):
        self.server = harness.Server("http://127.0.0.1:9", subprocess.Popen(["sleep", "60"]), log)
        Stand.started.append(log.name.split(".")[0])

    def ready(self):
        self.server.start_seconds = 0.01
        return self.server

    def abandon(self):
        harness.stop(self.server)


CATALOGUE = {name: Spec(f"stand-in {name}") for name in ("a", "b", "c")}


@pytest.fixture
def pool(tmp_path):
    Stand.started = []
    pool = Pool(tmp_path, CATALOGUE, spawn=Stand)
    yield pool
    pool.close()


def run(pool, plan, during=None):
    """Each test of the plan entered, its servers asked for, left; the servers up after each."""
    pool.plan(plan)
    up = []
    for i, (_, needs) in enumerate(plan):
        pool.enter(i, marked=True)
        assert len(pool.live) + len(pool.starting) <= MAX_LIVE
        for name in sorted(needs):
            assert pool.get(name).proc.poll() is None
        if during:
            during(i)
        pool.leave(i)
        assert len(pool.live) + len(pool.starting) <= MAX_LIVE
        up.append(sorted(pool.live) + sorted(f"{n}?" for n in pool.starting))
    return up


def test_each_server_starts_once_ahead_of_its_first_test_and_stops_after_its_last(pool):
    f = frozenset
    plan = [
        ("m0", f()),
        ("m1", f({"a"})),
        ("m1", f({"a"})),
        ("m2", f({"a", "b"})),
        ("m3", f({"b"})),
        ("m3", f({"c"})),
        ("m4", f()),
    ]
    up = run(pool, plan)
    assert Stand.started == ["a", "b", "c"] and [s.why for s in pool.starts] == ["ahead", "ahead", "ahead"]
    # a is started (and b beside it) before the first test that needs it; each stops after its last test
    assert up == [["a?", "b?"], ["a", "b?"], ["a", "b?"], ["b", "c?"], ["c?"], [], []]
    assert pool.left_alive == []


def test_a_test_that_stops_a_server_frees_it_for_its_module_and_a_later_module_starts_it_again(pool):
    f = frozenset
    plan = [("m1", f({"a"})), ("m1", f({"a"})), ("m2", f({"a"}))]

    def restart(i):
        if i == 0:
            pool.stop("a")

    run(pool, plan, restart)
    assert Stand.started == ["a", "a"] and [s.why for s in pool.starts][-1] == "again"
    assert "a" not in pool.needs[1] and "a" in pool.needs[2]


def test_a_server_a_test_asks_for_mid_module_stays_up_for_the_modules_later_tests(pool):
    f = frozenset
    plan = [("m1", f({"a"})), ("m1", f({"a"})), ("m2", f())]
    seen = {}

    def restart_as_b(i):
        if i == 0:
            pool.stop("a")
            seen["b"] = pool.get("b")  # the module goes on with b
        if i < 2:
            assert seen["b"].proc.poll() is None and "b" in pool.live

    run(pool, plan, restart_as_b)
    assert "b" in pool.needs[1] and "b" not in pool.live  # stopped after the module's last test


def test_a_server_is_only_started_for_a_test_marked_server(pool):
    pool.plan([("m", frozenset({"a"}))])
    pool.enter(0, marked=False)
    with pytest.raises(RuntimeError, match="not marked `server`"):
        pool.get("a")


def test_a_dead_server_is_started_again_and_a_failed_start_is_not_retried(pool):
    pool.plan([("m", frozenset({"a"})), ("m", frozenset({"a"}))])
    pool.enter(0, marked=True)
    first = pool.get("a")
    first.proc.kill()
    first.proc.wait()
    assert pool.get("a") is not first and Stand.started == ["a", "a"]

    class Broken(Stand):
        def ready(self):
            raise RuntimeError("server exited with 1 during start-up")

    pool.spawn = Broken
    pool.stop("a")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="during start-up"):
            pool.get("a")
    assert Stand.started == ["a", "a", "a"]  # tried once
