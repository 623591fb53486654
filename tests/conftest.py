"""Shared fixtures: real servers started through `python -m sgl_memory.launch_server`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sgl_memory import cpu_dtype
from bench import harness

TEST_MODEL = "smollm2-135m-instruct"
# The dtype a server started without --dtype computes in: the launcher's choice for this CPU, or
# SGLMEMORY_DTYPE's (a whole suite run in one dtype). A persisted session restores exactly when
# the store keeps the pool's own dtype.
SERVER_DTYPE = cpu_dtype.choose().dtype
EXACT_QUANT = {"bfloat16": "bf16", "float32": "fp32"}[SERVER_DTYPE]

# Kernel checks need TRITON_INTERPRET=1 from the start; tests/test_kernels.py runs them in a child.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpreted"]


# A test server's KV pool unless the test asks for another size. The launcher's default sizes it
# from free RAM (about 55k tokens, 2.4 GB for the test model in float32): zero-filling that takes
# seconds of every start and RAM the suite's second server may need; no test prompt comes near this.
TEST_POOL_TOKENS = "16384"


def command(model, *extra) -> list[str]:
    """Our launcher's command for a test server: the test's flags, a small pool unless it sets one."""
    if not any(str(a).split("=")[0] == "--max-total-tokens" for a in extra):
        extra = (*extra, "--max-total-tokens", TEST_POOL_TOKENS)
    return harness.our_command(model, *extra)


def start_server(model, log_path, *extra):
    return harness.start(command(model, *extra), log_path)


def start_servers(*specs):
    """Several test servers, each (model, log path, *flags), started at once (harness.start_all)."""
    return harness.start_all([(command(model, *extra), log_path, None) for model, log_path, *extra in specs])


stop_server = harness.stop


def load_example(name: str):
    """examples/<name>.py as a module (the examples are scripts, not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_sessionfinish(session, exitstatus):
    """Whatever happened to a fixture's teardown, no server outlives the suite."""
    left = harness.stop_all()
    if left:
        print(f"\nstopped {len(left)} server(s) a test left running: {', '.join(s.url for s in left)}")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = start_server(TEST_MODEL, tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    stop_server(srv)
