"""Start and stop a real server as a subprocess: used by the end-to-end tests and the benchmarks.

A server never outlives the process that started it: it gets SIGKILL when that process dies (even
by SIGKILL, through the kernel's parent-death signal; SGLang's own children follow their launcher),
and `stop_all` (atexit, and the test session's end) stops every server still registered.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

from sgl_memory.persist.settings import PersistConfig

START_TIMEOUT_S = 300
# persistence is on by default: a bench of another mechanism adds this section to its config
# (config.to_yaml) to run it alone
PERSIST_OFF = PersistConfig(enabled=False)


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    start_seconds: float = 0.0
    headers: dict = field(default_factory=dict)  # sent with every post (a session's routing key)
    dir: Path | None = None  # the directory its config names (session store, traces), where the test pool made one

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: dict, timeout: float = 600) -> requests.Response:
        return requests.post(self.url + path, json=body, headers=self.headers, timeout=timeout)

    def post_raw(self, path: str, data: bytes, timeout: float = 600) -> requests.Response:
        """A body sent as given (not serialised by us): malformed, huge or deeply nested JSON."""
        return requests.post(self.url + path, data=data, headers={"content-type": "application/json"}, timeout=timeout)

    def get(self, path: str, timeout: float = 30) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout)

    def requests_served(self) -> int:
        """Generate requests our server has finished (/sgl_memory/stats): which replica served one."""
        return self.get("/sgl_memory/stats").json()["requests"]

    def prometheus(self, prefix: str = "sgl_memory_") -> dict[tuple[str, tuple], float]:
        """Samples of GET /metrics (a server started with --enable-metrics) whose names start with
        prefix, keyed by (name, sorted label items)."""
        from prometheus_client.parser import text_string_to_metric_families

        samples = {}
        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                if sample.name.startswith(prefix):
                    samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

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


def start_router(workers: list[Server], log_path: Path, *flags: str, timeout: float = 120) -> Server:
    """SGLang's router (smg, the gateway sglang-router became) in front of `workers`, once it has
    registered every one of them (its /health answers before it has any). Consistent hashing of the
    routing-key header (sgl_memory.core.sessions.ROUTING_HEADER) keeps each session on one replica;
    a request to a replica that is gone is retried on another. Its metrics listen on a port of their
    own (29000 unless told: two routers would collide)."""
    command = [
        sys.executable,
        "-m",
        "smg.launch_router",
        "--worker-urls",
        *(w.url for w in workers),
        "--policy",
        "consistent_hashing",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn",
        *flags,
    ]
    router = start(command, log_path)
    deadline = time.monotonic() + timeout
    while True:
        ready = {w["url"] for w in router.get("/workers").json().get("workers", []) if w.get("is_healthy")}
        if ready >= {w.url for w in workers}:
            return router
        if time.monotonic() > deadline:
            stop(router)
            raise RuntimeError(
                f"the router registered {sorted(ready)} of {[w.url for w in workers]} in {timeout} s:\n"
                f"{router.log()[-2000:]}"
            )
        time.sleep(0.2)


def default_pool_tokens(model_path) -> int:
    """The tokens our launcher's default pool holds on this machine (its bytes at the compute dtype's KV)."""
    from sgl_memory import cpu_dtype, kv_pool

    return kv_pool.choose(Path(model_path), cpu_dtype.choose().kv_cache_dtype, None, None).tokens


def cpu_flags(model_path, attention_backend: str, pool_tokens: int | None = None) -> list[str]:
    """The CPU flags our launcher defaults to, spelled out for a plain SGLang server: the compute
    dtype it would choose here included (plain SGLang takes the model's bf16 otherwise, which an
    AVX2-only CPU converts through float32: its speeds were not comparable with ours), and
    --sleep-on-idle (an idle plain server otherwise busy-polls a core, which on two cores halved the
    speed of the server beside it: 10 min for test_intent_server's module instead of 6). The KV
    pool: `pool_tokens`, or what our launcher would size for this machine."""
    from sgl_memory import cpu_dtype

    pool = pool_tokens or default_pool_tokens(model_path)
    return [
        "--device",
        "cpu",
        "--attention-backend",
        attention_backend,
        "--disable-overlap-schedule",
        "--skip-server-warmup",
        "--sleep-on-idle",
        "--dtype",
        cpu_dtype.choose().dtype,
        "--max-total-tokens",
        str(pool),
    ]


def plain_sglang(model_path, *flags: str) -> tuple[list[str], dict]:
    """Plain SGLang (our plugin not loaded; only the CPU import work-arounds, which it cannot run without)."""
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", SGLANG_PLUGINS="none")
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), *flags], env


_RUNNING: list[Server] = []
PR_SET_PDEATHSIG = 1
try:  # resolved here, not in the forked child, where loading a library could deadlock
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent dies."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start(command: list[str], log_path: Path, env: dict | None = None) -> Server:
    """Run `command` plus host/port flags; return once /health answers 200 from this server."""
    return spawn(command, log_path, env).ready()


def _listens(proc: subprocess.Popen, port: int) -> bool:
    """Whether the server's process tree holds the listening socket on `port`."""
    try:
        root = psutil.Process(proc.pid)
        family = [root, *root.children(recursive=True)]
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
            for p in family
            for c in p.net_connections("tcp")
        )
    except psutil.NoSuchProcess:
        return False


def start_all(specs: list[tuple[list[str], Path, dict | None]]) -> list[Server]:
    """Several servers (command, log path, env) started at once; returns them in order once each
    answers /health. Most of a start is imports in one process at a time, so on two cores two
    starts together take little longer than one. On failure every one is stopped."""
    starting = [spawn(command, log_path, env) for command, log_path, env in specs]
    try:
        return [s.ready() for s in starting]
    except BaseException:
        for s in starting:
            s.abandon()
        raise


class Starting:
    """A server whose processes are started and which may not answer yet (spawn); `ready()` waits
    for it. The processes are started from the calling thread: a parent-death signal follows the
    thread that forked, so no worker thread may spawn a server that should outlive it.

    The port is free when picked, but another process may take it before the server binds it (a
    server started by another test, or one that was stopping): the server then cannot bind, and
    /health would reach the other one. Such a start is retried on a new port (`attempts` in all)."""

    def __init__(self, command: list[str], log_path: Path, env: dict | None, attempts: int = 3):
        self.command, self.log_path, self.env, self.attempts = command, log_path, env, attempts
        self.server, self.port, self.t0 = self._spawn()
        self.answered_at: float | None = (
            None  # when it first answered, seen by a watcher thread (a start's real length)
        )
        threading.Thread(target=self._watch, args=(self.server, self.port), daemon=True).start()

    def _answers(self, server: Server, port: int) -> bool:
        """Whether /health answers 200 from this server's own processes."""
        try:
            return requests.get(server.url + "/health", timeout=5).status_code == 200 and _listens(server.proc, port)
        except (requests.ConnectionError, requests.Timeout):
            return False

    def _watch(self, server: Server, port: int) -> None:
        while server is self.server and server.proc.poll() is None and time.monotonic() < self.t0 + START_TIMEOUT_S:
            if self._answers(server, port):
                self.answered_at = time.monotonic()
                return
            time.sleep(0.5)

    def _spawn(self) -> tuple[Server, int, float]:
        port = free_port()
        log = open(self.log_path, "w")
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [*self.command, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
            preexec_fn=_die_with_parent,
        )
        server = Server(f"http://127.0.0.1:{port}", proc, self.log_path)
        _RUNNING.append(server)
        return server, port, t0

    def ready(self) -> Server:
        """The server once /health answers from it (spawned again on a new port where another
        process took its port first)."""
        for attempt in range(self.attempts):
            if attempt:
                self.server, self.port, self.t0 = self._spawn()
                self.answered_at = None
                threading.Thread(target=self._watch, args=(self.server, self.port), daemon=True).start()
            if self._wait():
                return self.server
        raise RuntimeError(
            f"server could not bind a free port in {self.attempts} attempts:\n{self.server.log()[-2000:]}"
        )

    def abandon(self) -> None:
        stop(self.server, timeout=30)

    def _wait(self) -> bool:
        """True once /health answers from this server (at once for one that answered while nobody
        waited); False (stopped) when its port was taken first."""
        server, proc = self.server, self.server.proc
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} during start-up:\n{server.log()[-4000:]}")
            if "address already in use" in server.log():
                stop(server)
                return False
            if self.answered_at is not None or self._answers(server, self.port):
                server.start_seconds = (self.answered_at or time.monotonic()) - self.t0
                _check_pool(server, self.command)
                return True
            if time.monotonic() > self.t0 + START_TIMEOUT_S:
                stop(server)
                raise RuntimeError(f"server not healthy after {START_TIMEOUT_S}s:\n{server.log()[-4000:]}")
            time.sleep(0.5)


def spawn(command: list[str], log_path: Path, env: dict | None = None) -> Starting:
    """Start the server's processes and return without waiting for them (Starting.ready waits)."""
    return Starting(command, log_path, env)


def _check_pool(server: Server, command: list[str]) -> None:
    """A server started with --max-total-tokens N has a KV pool of N tokens, or this fails here
    (plain SGLang silently takes less when less memory is free; ours refuses to start)."""
    if "--max-total-tokens" not in command:
        return
    asked = int(command[command.index("--max-total-tokens") + 1])
    got = server.get("/server_info").json()["max_total_num_tokens"]
    if got < asked:
        stop(server)
        raise RuntimeError(
            f"the server's KV pool holds {got} tokens, not the {asked} it was started with "
            f"(too little free memory):\n{server.log()[-2000:]}"
        )


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
    if server in _RUNNING:
        _RUNNING.remove(server)
    return alive


@atexit.register
def stop_all() -> list[Server]:
    """Stop every server this process started and has not stopped; returns them."""
    left = list(_RUNNING)
    for server in left:
        stop(server, timeout=30)
    return left
