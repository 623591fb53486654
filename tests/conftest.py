"""Shared fixtures: real servers started through `python -m sgl_memory.launch_server`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

TEST_MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 300


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: dict, timeout: float = 300) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=timeout)

    def get(self, path: str, timeout: float = 30) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, log_path: Path, *extra: str) -> Server:
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sgl_memory.launch_server", "--model", model, "--host", "127.0.0.1", "--port", str(port), *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up:\n{server.log()[-4000:]}")
        try:
            if requests.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except requests.ConnectionError:
            pass
        time.sleep(1)
    stop_server(server)
    raise RuntimeError(f"server not healthy after {START_TIMEOUT_S}s:\n{server.log()[-4000:]}")


def stop_server(server: Server, timeout: float = 60) -> list[psutil.Process]:
    """SIGTERM the launcher; return the processes of the server still alive afterwards."""
    try:
        family = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    _, alive = psutil.wait_procs(family, timeout=timeout)
    for p in alive:  # never leave a stray server behind, even when the test fails
        p.kill()
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return alive


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = start_server(TEST_MODEL, tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    stop_server(srv)
