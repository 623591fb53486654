"""Soak and fault run against real servers: many concurrent agent sessions, client disconnects, and
kill -9 of the server while it writes session files. Writes bench/results/soak.json and .png.

Two parts, each on its own servers (SmolLM2 by default, a small KV pool):

- `sessions`: N concurrent sessions x M turns, once per mechanism config (intent pruning, session
  persistence, KV memory with memory-mode turns), each session in one of four tenants and holding
  a secret word of its own that it states in its first turn. Some requests are dropped by the
  client mid-generation (a read timeout shorter than the request). Checks, per config:
  - no answer is a 5xx (a dropped request is counted, not checked);
  - no session's output ever contains another session's secret (a random made-up word: the model
    can only produce it from KV that held it);
  - the server's resident memory (all its processes) stays bounded: at the end of the run (the
    median of its last tenth) it is within `--rss-slack` of where it was at half-time (the median
    of the tenth around the middle); the least-squares trend over the second half and the memory
    pools' bytes (Prometheus gauge, sampled with the RSS) are reported beside it.
- `kill`: T trials of: start a persistence server on one store, run turns of a few sessions, kill
  -9 the whole server at a random moment (half of the trials while a session file is being
  written, the rest at a random delay), then check the store offline and on a restarted server:
  - every session file on disk loads and passes its checksum (writes are atomic renames);
  - the restarted server removes partial files and refuses none of the stored sessions;
  - each session's next turn is served (200) and restores from the store or prefills cleanly.

    .venv/bin/python scripts/soak.py [--sessions 32 --turns 20 --trials 100]
    .venv/bin/python scripts/soak.py --parts kill --trials 5      # a quick look

Each part merges what it measured into --out as it goes (a long run cut short keeps its finished
parts and trials), so the two parts can also run as two processes side by side.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import json
import os
import random
import signal
import statistics
import string
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import provenance  # noqa: E402
from bench import harness  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
# host-memory caps small enough to bind within the run, so "RSS stays bounded" tests them
CONFIGS = {
    "intent": "intent:\n  enabled: true\n  budget: 256\n",
    "persist": "persist:\n  enabled: true\n  dir: {store}\n  quant: q4\n  warm_bytes: 67108864\n",
    "memory": "memory:\n  enabled: true\n  top_k: 8\n  pool_bytes: 268435456\n",
}
SYSTEM = "You are a terse assistant for an agent. Repeat facts exactly when asked."
TOPICS = ["the weather", "a file listing", "a unit test", "the build log", "a shopping list", "a train timetable"]


def secret(rng: random.Random) -> str:
    """A made-up word no tokenizer knows as one token and no model writes by chance."""
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(3)) + "-" + str(rng.randint(1000, 9999))


class RssSampler(threading.Thread):
    """(seconds, RSS bytes of the server's processes, its memory pools' bytes or None) every interval."""

    def __init__(self, server, interval: float = 1.0):
        super().__init__(daemon=True)
        self.server, self.interval, self.samples, self.done = server, interval, [], threading.Event()

    def run(self):
        t0 = time.monotonic()
        while not self.done.wait(self.interval):
            try:
                pools = self.server.prometheus().get(("sgl_memory_memory_pool_bytes", ()))
                self.samples.append((time.monotonic() - t0, self.server.rss_bytes(), pools))
            except Exception:  # a process of the server ended between listing and reading it
                pass


def rss_trend(samples: list[tuple[float, int, float | None]]) -> dict:
    """Where RSS went after half-time: its level at half-time (the median of the tenth of the
    samples around the middle), at the end (the median of the last tenth), and the least-squares
    slope over the second half as growth over that half relative to the half-time level."""
    n = len(samples)
    if n < 20:
        return {"rss_half_mb": None, "rss_end_mb": None, "rss_second_half_trend": None}
    tenth = n // 10
    half = statistics.median(b for _, b, _ in samples[n // 2 - tenth // 2 : n // 2 + tenth // 2 + 1])
    end = statistics.median(b for _, b, _ in samples[-tenth:])
    second = samples[n // 2 :]
    slope = statistics.linear_regression([t for t, _, _ in second], [b for _, b, _ in second]).slope
    return {
        "rss_half_mb": round(half / 2**20),
        "rss_end_mb": round(end / 2**20),
        "rss_second_half_trend": round(slope * (second[-1][0] - second[0][0]) / half, 4),
    }


def session_run(
    server, config: str, sid: int, turns: int, secrets: dict, rng: random.Random, stats: dict, lock
) -> None:
    tenant = f"t{sid % 4}"
    field = {"session_id": f"s{sid}", "tenant": tenant}
    messages = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"My secret word is {secrets[sid]}. Keep it. Now tell me about {rng.choice(TOPICS)}.",
        },
    ]
    for turn in range(turns):
        memory_mode = config == "memory" and turn >= 2 and turn % 3 == 0
        body = {"model": "m", "max_tokens": 16, "temperature": 0.7, "seed": rng.randint(0, 2**31)}
        if memory_mode:  # only the new turn; the server places the session's memory blocks first
            body["messages"] = [messages[0], {"role": "user", "content": "What is my secret word?"}]
            body["sgl_memory"] = {**field, "memory": {"mode": "retrieve"}}
        else:
            body["messages"] = messages
            body["sgl_memory"] = field
        drop = rng.random() < 0.08  # the client gives up mid-request
        try:
            r = requests.post(
                server.url + "/v1/chat/completions", json=body, timeout=rng.uniform(0.05, 0.5) if drop else 600
            )
        except requests.exceptions.RequestException:
            with lock:
                stats["dropped"] += 1
            continue
        with lock:
            stats["requests"] += 1
            stats["status"][str(r.status_code)] = stats["status"].get(str(r.status_code), 0) + 1
        if r.status_code != 200:
            with lock:
                stats["errors"].append(f"s{sid} turn {turn}: {r.status_code} {r.text[:200]}")
            continue
        answer = r.json()["choices"][0]["message"]["content"] or ""
        leaked = [w for other, w in secrets.items() if other != sid and w in answer]
        if leaked:
            with lock:
                stats["leaks"].append(f"s{sid} turn {turn} answered with another session's secret {leaked}")
        if not memory_mode:
            messages.append({"role": "assistant", "content": answer})
            messages.append({"role": "user", "content": f"Turn {turn}: now tell me about {rng.choice(TOPICS)}."})


def run_sessions(args, config: str, workdir: Path) -> dict:
    d = workdir / config
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.yaml").write_text(CONFIGS[config].format(store=d / "store"))
    server = harness.start(
        harness.our_command(
            args.model,
            "--memory-config",
            str(d / "memory.yaml"),
            "--max-total-tokens",
            str(args.pool),
            "--enable-metrics",
        ),
        d / "server.log",
    )
    rng = random.Random(args.seed)
    secrets = {i: secret(rng) for i in range(args.sessions)}
    stats = {"requests": 0, "dropped": 0, "status": {}, "errors": [], "leaks": []}
    lock = threading.Lock()
    sampler = RssSampler(server)
    sampler.start()
    t0 = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(args.sessions) as pool:
            futures = [
                pool.submit(
                    session_run,
                    server,
                    config,
                    i,
                    args.turns,
                    secrets,
                    random.Random(args.seed * 1000 + i),
                    stats,
                    lock,
                )
                for i in range(args.sessions)
            ]
            for f in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc=f"sessions [{config}]"):
                f.result()
        healthy = server.get("/health").status_code == 200
    finally:
        sampler.done.set()
        sampler.join()
        harness.stop(server)
    wall = time.monotonic() - t0
    rss = sampler.samples
    half = len(rss) // 2
    first, second = max((b for _, b, _ in rss[:half]), default=0), max((b for _, b, _ in rss[half:]), default=0)
    trend = rss_trend(rss)
    log = (d / "server.log").read_text(errors="replace")
    return {
        "config": config,
        "sessions": args.sessions,
        "turns": args.turns,
        "wall_s": round(wall, 1),
        **stats,
        "five_xx": sum(n for code, n in stats["status"].items() if code.startswith("5")),
        "healthy_after": healthy,
        "scheduler_crashed": "Scheduler hit an exception" in log,
        "rss_peak_first_half_mb": round(first / 2**20),
        "rss_peak_second_half_mb": round(second / 2**20),
        **trend,
        "rss_bounded": trend["rss_end_mb"] is not None
        and trend["rss_end_mb"] <= trend["rss_half_mb"] * (1 + args.rss_slack),
        "rss_series": [(round(t, 1), round(b / 2**20)) for t, b, _ in rss],
        "pool_series": [(round(t, 1), round(p / 2**20, 1)) for t, _, p in rss if p is not None],
    }


def check_store(store: Path) -> dict:
    """Every session file on disk loads through the store's own read path (checksum, spec, owner)."""
    from sgl_memory.persist.header import read_metadata
    from sgl_memory.persist.store import CacheSpec, SessionFiles

    files = sorted(store.glob("*/*/*.safetensors"))
    bad = []
    for path in files:
        try:
            meta = read_metadata(path)
            reader = SessionFiles(store, CacheSpec(**json.loads(meta["spec"])))
            if reader.path(meta["tenant"] or None, meta["session_id"]) != path:
                raise ValueError("not where its owner's file goes")
            reader.read(meta["tenant"] or None, meta["session_id"])
        except Exception as exc:  # any failure to load is what this looks for
            bad.append(f"{path.name}: {type(exc).__name__}: {exc}")
    return {"files": len(files), "unloadable": bad, "partial": len(list(store.glob("*/*/*.tmp")))}


def post_until_killed(url: str, body: dict) -> None:
    try:
        requests.post(url, json=body, timeout=600)
    except requests.exceptions.RequestException:
        pass  # the server was killed under it: that is the point


def kill_trials(args, workdir: Path) -> dict:
    d = workdir / "kill"
    d.mkdir(parents=True, exist_ok=True)
    store = d / "store"
    (d / "memory.yaml").write_text(CONFIGS["persist"].format(store=store).replace("q4", "bf16"))
    command = harness.our_command(
        args.model, "--memory-config", str(d / "memory.yaml"), "--max-total-tokens", str(args.pool)
    )
    rng = random.Random(args.seed)
    sessions = [f"k{i}" for i in range(4)]
    history = {s: [{"role": "system", "content": SYSTEM}] for s in sessions}
    trials, failures = [], []
    for trial in tqdm(range(args.trials), desc="kill -9 trials"):
        for s in sessions:  # a session past ~4k tokens starts over: its next file replaces the stored one
            # (about 2.2 characters a token in these turns: 16000 characters grew past the 8192-token
            # context of the test model, and 24 of 100 turns were answered 400)
            if sum(len(m["content"] or "") for m in history[s]) > 8000:
                history[s] = history[s][:1]
        server = harness.start(command, d / f"trial-{trial % 2}.log")
        during_write = trial % 2 == 0
        info = {"trial": trial, "during_write": during_write}
        try:
            # the restarted server: partial files of the last kill are gone, no stored session refused
            info["partial_removed"] = "partial file" in server.log()
            for s in sessions:
                history[s].append(
                    {
                        "role": "user",
                        "content": f"Trial {trial}: "
                        + " ".join(f"item {i} costs {rng.randint(1, 99)}." for i in range(rng.randint(20, 120))),
                    }
                )
                r = requests.post(
                    server.url + "/v1/chat/completions",
                    json={
                        "model": "m",
                        "messages": history[s],
                        "max_tokens": 8,
                        "temperature": 0,
                        "sgl_memory": {"session_id": s},
                    },
                    timeout=600,
                )
                if r.status_code != 200:
                    failures.append(f"trial {trial} {s}: {r.status_code} {r.text[:200]}")
                    continue
                m = r.json()["sgl_memory"]
                if m.get("persist_refused"):
                    failures.append(f"trial {trial} {s}: a stored file was refused: {m['persist_refused']}")
                history[s].append(r.json()["choices"][0]["message"])
                info.setdefault("restored_tokens", []).append(m.get("restored_tokens", 0))
            # the kill: while a session file is being written, or at a random moment of a turn
            s = rng.choice(sessions)
            body = {
                "model": "m",
                "messages": history[s]
                + [
                    {
                        "role": "user",
                        "content": "Once more, longer: "
                        + " ".join(f"row {i} is {rng.randint(1, 99)}." for i in range(200)),
                    }
                ],
                "max_tokens": 8,
                "sgl_memory": {"session_id": s},
            }
            threading.Thread(
                target=post_until_killed, args=(server.url + "/v1/chat/completions", body), daemon=True
            ).start()
            deadline = time.monotonic() + (60 if during_write else rng.uniform(0.2, 4.0))
            while time.monotonic() < deadline and not (during_write and list(store.glob("*/*/*.tmp"))):
                time.sleep(0.005)
            info["killed_with_partial_file"] = bool(list(store.glob("*/*/*.tmp")))
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(timeout=60)
        finally:
            harness.stop(server)
        info.update(check_store(store))
        if info["unloadable"]:
            failures.append(f"trial {trial}: files that do not load: {info['unloadable']}")
        trials.append(info)
        save(args.out, {"kill": kill_summary(trials, failures, None)})  # a long run keeps what it did
    # the last restart: every session is served after the last kill
    server = harness.start(command, d / "final.log")
    try:
        for s in sessions:
            r = requests.post(
                server.url + "/v1/chat/completions",
                json={
                    "model": "m",
                    "messages": history[s] + [{"role": "user", "content": "Done?"}],
                    "max_tokens": 4,
                    "sgl_memory": {"session_id": s},
                },
                timeout=600,
            )
            if r.status_code != 200 or r.json()["sgl_memory"].get("persist_refused"):
                failures.append(f"final {s}: {r.status_code} {r.text[:200]}")
        partial_after = len(list(store.glob("*/*/*.tmp")))
    finally:
        harness.stop(server)
    return kill_summary(trials, failures, partial_after)


def kill_summary(trials: list, failures: list, partial_after: int | None) -> dict:
    """partial_after is None until the final restart ran (a run cut short says so)."""
    return {
        "trials": len(trials),
        "killed_during_write": sum(t["killed_with_partial_file"] for t in trials),
        "files_checked": sum(t["files"] for t in trials),
        "unloadable_files": sum(len(t["unloadable"]) for t in trials),
        "partial_files_after_final_restart": partial_after,
        "failures": failures,
        "per_trial": trials,
    }


def save(out: str, parts: dict) -> dict:
    """Merge `parts` into the result file under a lock: the parts may run as separate processes
    (`--parts sessions` beside `--parts kill`), each adding what it measured."""
    path = Path(out)
    # locked through its directory: a lock file removed after use could be held by one process
    # while another locks the file that replaced it
    lock = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = json.loads(path.read_text()) if path.exists() else {}
        result.update(parts, provenance=provenance())
        sessions, kill = result.get("sessions", []), result.get("kill", {})
        result["passed"] = all(
            r["five_xx"] == 0
            and not r["leaks"]
            and r["healthy_after"]
            and not r["scheduler_crashed"]
            and r["rss_bounded"]
            for r in sessions
        ) and (not kill or (not kill["failures"] and kill["partial_files_after_final_restart"] == 0))
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
    finally:
        os.close(lock)  # releases the lock
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in result.get("sessions", []):
        series = run["rss_series"]
        ax.plot(
            [t for t, _ in series],
            [mb for _, mb in series],
            label=f"{run['config']} ({run['sessions']} sessions x {run['turns']} turns)",
        )
    ax.set_xlabel("seconds")
    ax.set_ylabel("server RSS (MB, all processes)")
    ax.set_title("Soak: resident memory of the server under concurrent sessions")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--parts", nargs="+", default=["sessions", "kill"], choices=["sessions", "kill"])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--pool", type=int, default=20000, help="--max-total-tokens of every server")
    ap.add_argument(
        "--rss-slack", type=float, default=0.05, help="RSS at the end over RSS at half-time, at most 1 + this"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = ap.parse_args()
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    with tempfile.TemporaryDirectory(prefix="sgl-memory-soak-") as tmp:
        if "sessions" in args.parts:
            runs = []
            for config in args.configs:
                runs.append(run_sessions(args, config, Path(tmp)))
                save(args.out, {"sessions": runs, "sessions_args": settings})
        if "kill" in args.parts:
            save(args.out, {"kill": kill_trials(args, Path(tmp)), "kill_args": settings})
    result = save(args.out, {})
    out = Path(args.out)
    plot(result, out.with_suffix(".png"))
    sessions, kill = result.get("sessions", []), result.get("kill", {})
    for r in sessions:
        print(
            f"{r['config']}: {r['requests']} requests, {r['dropped']} dropped by the client, 5xx {r['five_xx']}, "
            f"leaks {len(r['leaks'])}, RSS at half-time {r['rss_half_mb']} MB, at the end {r['rss_end_mb']} MB "
            f"(second-half trend {r['rss_second_half_trend']}), "
            f"{r['wall_s']} s"
        )
    if kill:
        print(
            f"kill -9: {kill['trials']} trials ({kill['killed_during_write']} during a file write), "
            f"{kill['files_checked']} file loads checked, {kill['unloadable_files']} unloadable, "
            f"failures {len(kill['failures'])}"
        )
    print("passed" if result["passed"] else "FAILED", "->", out)
    raise SystemExit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
