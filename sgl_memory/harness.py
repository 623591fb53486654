"""Start and stop a real server as a subprocess: used by the end-to-end tests and the benchmarks."""

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
import requests

START_TIMEOUT_S = 300


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    start_seconds: float = 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: dict, timeout: float = 600) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=timeout)

    def post_raw(self, path: str, data: bytes, timeout: float = 600) -> requests.Response:
        """A body sent as given (not serialised by us): malformed, huge or deeply nested JSON."""
        return requests.post(self.url + path, data=data, headers={"content-type": "application/json"}, timeout=timeout)

    def get(self, path: str, timeout: float = 30) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout)

    def rss_bytes(self) -> int:
        """Resident memory of the launcher and every process it started."""
        root = psutil.Process(self.proc.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def our_command(model: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sgl_memory.launch_server", "--model", model, *extra]


def cpu_flags(model_path, attention_backend: str) -> list[str]:
    """The CPU flags our launcher defaults to, spelled out for a plain SGLang server."""
    from sgl_memory import launch_server

    return ["--device", "cpu", "--attention-backend", attention_backend, "--disable-overlap-schedule",
            "--skip-server-warmup", "--max-total-tokens", str(launch_server.default_max_total_tokens(model_path))]  # fmt: skip


def plain_sglang(model_path, *flags: str) -> tuple[list[str], dict]:
    """Plain SGLang (our plugin not loaded; only the CPU import work-arounds, which it cannot run without)."""
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", SGLANG_PLUGINS="none")
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), *flags], env


def start(command: list[str], log_path: Path, env: dict | None = None) -> Server:
    """Run `command` plus host/port flags; return once /health answers 200."""
    port = free_port()
    log = open(log_path, "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = t0 + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up:\n{server.log()[-4000:]}")
        try:
            if requests.get(server.url + "/health", timeout=5).status_code == 200:
                server.start_seconds = time.monotonic() - t0
                return server
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    stop(server)
    raise RuntimeError(f"server not healthy after {START_TIMEOUT_S}s:\n{server.log()[-4000:]}")


def stop(server: Server, timeout: float = 60) -> list[psutil.Process]:
    """SIGTERM the launcher; return the server's processes still alive afterwards (then killed)."""
    try:
        root = psutil.Process(server.proc.pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    _, alive = psutil.wait_procs(family, timeout=timeout)
    for p in alive:  # never leave a stray server behind, even when the caller fails
        p.kill()
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return alive
