"""Scale-out: one replica against two behind SGLang's router, under a multi-session agent load, and
the failover of sessions when a replica dies.

Side by side, in one run, on the same servers (persistence on, one store both replicas share):

- `one replica`: every session's requests go straight to replica A (B idles: it sleeps when idle);
- `router, routing key`: A and B behind smg (`--policy consistent_hashing`), each request carrying
  its session's routing key (sgl_memory.core.sessions.routing_key): a session stays on one replica;
- `router, no key`: the same router, requests without the key: the router places each one on its
  own, so a session's turns land on either replica and the one that lacks its path restores it from
  the store or prefills it.

The load: SESSIONS agent sessions at once, each a client looping over TURNS turns; a turn's prompt
is the previous prompt, its answer and a new message of NEW_TOKENS tokens (tokens, not text: every
configuration computes the same lengths). Each configuration has sessions of its own (other ids,
other tokens), so none reuses another's KV; both replicas serve a warm-up session first (the first
requests a server serves pay one-time costs). Per configuration: turns per second over the whole load,
TTFT per turn (streamed: the first chunk), prefix hit (cached / prompt tokens of turns 2..TURNS),
the tokens restored from the store, and the turns that were restored (landed where the session's
path was not in the tree).

Failover: FAILOVER sessions homed on one replica (their first turn went there) run TURNS turns
through the router with their key; once every turn is stored, that replica gets SIGKILL, and each
session's next turn goes through the router to the survivor, which restores the session from the
store. Its TTFT (request sent to first token: the router's retry included) is compared with the
same prompt prefilled cold on the survivor (another tenant: nothing of it in the tree), per session,
and the first one's time from the kill to its first token is reported.

The default model is the small one: what is measured here is routing, prefix reuse and restores,
not answers; on two cores two replicas share the same cores, so throughput cannot grow with a
second replica here (on a GPU machine each replica has its own accelerator).
Writes bench/results/scale_out.json and .png.

    .venv/bin/python -m bench.scale_out [--sessions 6 --turns 5 --failover 3]   (about 10 min here)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import signal
import statistics
import tempfile
import threading
import time
import zlib
from pathlib import Path

from bench import harness
from bench.common import RESULTS, bootstrap, provenance, stream, write_json
from sgl_memory import cpu_dtype, models
from sgl_memory.core.config import to_yaml
from sgl_memory.core.sessions import ROUTING_HEADER, routing_key
from sgl_memory.persist.settings import PersistConfig
from sgl_memory.persist.header import read_metadata

SESSIONS, TURNS, FAILOVER = 6, 5, 3
FIRST_TOKENS, NEW_TOKENS, ANSWER_TOKENS = 512, 96, 16
MODEL = "smollm2-135m-instruct"
POOL_TOKENS = "32768"


def words(rng: random.Random, tokenizer, n: int) -> list[int]:
    vocab = "agent tool memory cache session radix prefix token query answer turn history search result file".split()
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer(" ".join(rng.choice(vocab) for _ in range(n)), add_special_tokens=False)["input_ids"]
    return ids[:n]


@dataclasses.dataclass
class Turn:
    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    restored_tokens: int
    ttft_s: float


def run_session(
    client, session: str, tokenizer, seed: int, turns: int, tenant: str | None = None
) -> tuple[list[Turn], list[int]]:
    """A session's turns on `client` (a server, or the router with or without the session's key);
    returns its turns and the prompt its next turn would send."""
    rng = random.Random(seed)
    ids, out = words(rng, tokenizer, FIRST_TOKENS), []
    field = {"session_id": session, **({"tenant": tenant} if tenant else {})}
    for n in range(turns):
        text, ttft, meta = stream(client, ids, ANSWER_TOKENS, field)
        ours = meta.get("sgl_memory") or {}
        out.append(
            Turn(
                session, n, meta["prompt_tokens"], meta.get("cached_tokens", 0), ours.get("restored_tokens") or 0, ttft
            )
        )
        ids = ids + tokenizer(text, add_special_tokens=False)["input_ids"] + words(rng, tokenizer, NEW_TOKENS)
    return out, ids


def keyed(router, session: str):
    return dataclasses.replace(router, headers={ROUTING_HEADER: routing_key(None, session)})


def load(name: str, client_of, replicas, tokenizer, sessions: int, turns: int) -> dict:
    """Every session at once, each in its own thread; a summary of the configuration's turns and of
    how its requests fell on the replicas."""
    results: dict[str, list[Turn]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        session = f"{name.replace(' ', '').replace(',', '.')}-{i}"  # an id of the allowed characters
        try:
            results[session] = run_session(client_of(session), session, tokenizer, zlib.crc32(session.encode()), turns)[
                0
            ]
        except BaseException as exc:  # reported after the others finish
            errors.append(exc)

    before = [r.requests_served() for r in replicas]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    served = [r.requests_served() - n for r, n in zip(replicas, before)]
    if errors:
        raise errors[0]
    later = [[t for t in session if t.turn > 0] for session in results.values()]
    hit = bootstrap([[t.cached_tokens / t.prompt_tokens for t in s] for s in later])
    ttft = bootstrap([[t.ttft_s for t in s] for s in results.values()])
    return {
        "name": name,
        "sessions": sessions,
        "turns": turns,
        "wall_s": wall,
        "turns_per_s": sessions * turns / wall,
        "requests_per_replica": served,
        "ttft_s": {
            "mean": ttft[0],
            "ci95": ttft[1:],
            "median": statistics.median(t.ttft_s for s in results.values() for t in s),
        },
        "prefix_hit": {
            "mean": hit[0],
            "ci95": hit[1:],
            "pooled": sum(t.cached_tokens for s in later for t in s) / sum(t.prompt_tokens for s in later for t in s),
        },
        "restored_tokens": sum(t.restored_tokens for s in later for t in s),
        "restored_turns": sum(t.restored_tokens > 0 for s in later for t in s),
        "later_turns": sum(map(len, later)),
        "rows": [dataclasses.asdict(t) for s in results.values() for t in s],
    }


def stored_generation(store: Path) -> dict[str, int]:
    """Session id -> the generation of its file."""
    return {meta["session_id"]: int(meta["generation"]) for meta in map(read_metadata, store.glob("*/*/*.safetensors"))}


def failover(a, b, router, store: Path, tokenizer, count: int, turns: int) -> dict:
    """Sessions homed on one replica, that replica killed, their next turns on the other."""
    homes: dict[str, list] = {a.url: [], b.url: []}
    i = 0
    while max(len(v) for v in homes.values()) < count:  # find session ids the router hashes to one replica
        session = f"failover-{i}"
        before = {s.url: s.requests_served() for s in (a, b)}
        run_session(keyed(router, session), session, tokenizer, 1000 + i, 1)
        home = next(s.url for s in (a, b) if s.requests_served() != before[s.url])
        homes[home].append((session, 1000 + i))
        i += 1
    home_url = max(homes, key=lambda url: len(homes[url]))
    home, survivor = (a, b) if home_url == a.url else (b, a)
    chosen = homes[home_url][:count]
    prompts = {}
    for session, seed in chosen:
        _, prompts[session] = run_session(keyed(router, session), session, tokenizer, seed, turns)
    deadline = time.monotonic() + 60
    while any(stored_generation(store).get(s, 0) < turns for s, _ in chosen):  # stored off the request's path
        assert time.monotonic() < deadline, "sessions not stored in 60 s"
        time.sleep(0.1)
    os.killpg(home.proc.pid, signal.SIGKILL)
    killed_at = time.perf_counter()
    home.proc.wait()
    rows = []
    for n, (session, _) in enumerate(chosen):
        sent = time.perf_counter()
        _, ttft, meta = stream(keyed(router, session), prompts[session], ANSWER_TOKENS, {"session_id": session})
        restored = (meta.get("sgl_memory") or {}).get("restored_tokens") or 0
        _, cold, cold_meta = stream(
            survivor, prompts[session], ANSWER_TOKENS, {"session_id": session, "tenant": "cold"}
        )
        rows.append(
            {
                "session": session,
                "prompt_tokens": meta["prompt_tokens"],
                "restored_tokens": restored,
                "failover_ttft_s": ttft,
                "cold_ttft_s": cold,
                "cold_cached_tokens": cold_meta.get("cached_tokens", 0),
                "kill_to_first_token_s": sent - killed_at + ttft if n == 0 else None,
            }
        )
    ratio = bootstrap([[r["failover_ttft_s"] / r["cold_ttft_s"]] for r in rows])
    return {
        "sessions": len(rows),
        "turns_before_kill": turns,
        "rows": rows,
        "ttft_ratio_failover_over_cold": {"mean": ratio[0], "ci95": ratio[1:]},
        "kill_to_first_token_s": rows[0]["kill_to_first_token_s"],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = result["configs"]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    names = [c["name"] for c in configs]
    for ax, key, label in (
        (axes[0], "turns_per_s", "turns / s"),
        (axes[1], "ttft_s", "TTFT (s), mean"),
        (axes[2], "prefix_hit", "prefix hit, turns 2.."),
    ):
        values = [c[key]["mean"] if isinstance(c[key], dict) else c[key] for c in configs]
        errs = (
            [
                [v - c[key]["ci95"][0] for v, c in zip(values, configs)],
                [c[key]["ci95"][1] - v for v, c in zip(values, configs)],
            ]
            if isinstance(configs[0][key], dict)
            else None
        )
        ax.bar(names, values, yerr=errs, capsize=4, color=["#888", "#2a7", "#d73"])
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=15)
    rows = result["failover"]["rows"]
    axes[3].bar(
        ["restored on survivor", "cold prefill"],
        [statistics.mean(r["failover_ttft_s"] for r in rows), statistics.mean(r["cold_ttft_s"] for r in rows)],
        color=["#2a7", "#888"],
    )
    axes[3].set_title(f"failover TTFT (s), N = {len(rows)}")
    fig.suptitle(
        f"scale-out, {result['model']}, {result['sessions']} sessions x {result['turns']} turns at once "
        f"({result['provenance']['commit'][:10]})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--sessions", type=int, default=SESSIONS)
    ap.add_argument("--turns", type=int, default=TURNS)
    ap.add_argument("--failover", type=int, default=FAILOVER)
    ap.add_argument("--out", type=Path, default=RESULTS / "scale_out.json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.resolve(args.model))
    work = Path(tempfile.mkdtemp(prefix="scale-out-"))
    store = work / "store"
    config = work / "memory.yaml"
    config.write_text(to_yaml(PersistConfig(enabled=True, dir=str(store))))
    flags = ("--memory-config", str(config), "--max-total-tokens", POOL_TOKENS)
    a, b = harness.start_all(
        [
            (harness.our_command(args.model, *flags), work / "a.log", None),
            (harness.our_command(args.model, *flags), work / "b.log", None),
        ]
    )
    router = harness.start_router([a, b], work / "router.log")
    try:
        for replica in (
            a,
            b,
        ):  # a replica's first requests pay one-time costs (--skip-server-warmup): not in a configuration's numbers
            run_session(replica, "warmup", tokenizer, 0, 2, tenant="warmup")
        configs = [
            load("one replica", lambda session: a, (a, b), tokenizer, args.sessions, args.turns),
            load(
                "router, routing key",
                lambda session: keyed(router, session),
                (a, b),
                tokenizer,
                args.sessions,
                args.turns,
            ),
            load("router, no key", lambda session: router, (a, b), tokenizer, args.sessions, args.turns),
        ]
        for c in configs:
            print(
                f"{c['name']:>22}: {c['turns_per_s']:.3f} turns/s (requests per replica {c['requests_per_replica']}), "
                f"TTFT {c['ttft_s']['mean']:.2f} s, "
                f"prefix hit {c['prefix_hit']['pooled']:.2f}, {c['restored_turns']}/{c['later_turns']} turns restored"
            )
        fail = failover(a, b, router, store, tokenizer, args.failover, args.turns)
        print(
            f"failover: TTFT restored / cold {fail['ttft_ratio_failover_over_cold']['mean']:.2f} "
            f"{fail['ttft_ratio_failover_over_cold']['ci95']}, "
            f"kill to first token {fail['kill_to_first_token_s']:.2f} s"
        )
    finally:
        for server in (router, a, b):  # the failover killed one: stopping it only unregisters it
            harness.stop(server)
    result = {
        "model": args.model,
        "dtype": cpu_dtype.choose().dtype,
        "sessions": args.sessions,
        "turns": args.turns,
        "first_tokens": FIRST_TOKENS,
        "new_tokens": NEW_TOKENS,
        "answer_tokens": ANSWER_TOKENS,
        "router": "smg 1.13.0, --policy consistent_hashing",
        "configs": configs,
        "failover": fail,
    }
    write_json(args.out, result)
    plot({**result, "provenance": provenance()}, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
