"""Real coding-agent traffic on one server: concurrent sessions replay the recorded coding-agent
traces in ../shared/data/agent-traces/ (a seeded subset per run), side by side against SGLang's own
eviction policies.

A trace holds no text: per request its time, the client's think time before it, prompt and output
tokens, and one hash id per 64-token block (two requests share a prefix exactly as far as their ids
agree); sub-agents are nested conversations their parent waits for. The replay scales it, and every
scale is a flag written beside every result:

- each 64-token block becomes `--block-tokens` words of deterministic text keyed by its id (each word
  one token of the model's tokenizer, so a block is exactly that many tokens and two prompts share
  tokens exactly as far as their block ids agree);
- the tool definitions and system prompt that open every request (`tool_tokens + system_tokens`) are
  one text shared by every session of the same client (`--shared-share` of those blocks; the rest of
  them stay the trace's own), as clients of one version send the same tools;
- outputs: `out / 64 * --block-tokens` tokens, at least 1, at most `--max-output`; the answer itself
  is discarded (the trace is replayed: the next prompt is the recorded one);
- think time: `think_time * --think-scale`, at most `--think-cap` seconds;
- at most `--max-requests` requests of each conversation (its sub-agents' requests are their own).

Each session is a full-history OpenAI client: /v1/chat/completions with the system text and the rest
of the prompt as one user message, the session named by `x-session-id`, streamed (TTFT is the first
token). A sub-agent is a session of its own, started by its parent (several at once where the trace
has them back to back) and joined before the parent's next request.

The pool (`--max-total-tokens`) is the sessions' distinct tokens (every session's last prompt and
answer, each shared prefix once) over the oversubscription, and at least the longest context (where
that floor binds, the run's own oversubscription, distinct tokens over the pool, is written beside
the one asked for: `effective_oversubscription`).
Methods, each on a fresh server: plain SGLang's radix cache under `--radix-eviction-policy` lru, slru,
priority, tlru (its threshold `--tlru-threshold`, its next-prompt estimate the replay's median growth of
a request) and with `--enable-session-radix-cache` (bench/many_agents.py's commands), ours
`--plain` (every mechanism off), ours at its defaults (`ours:persist`), ours predicting each
session's return from the gaps its turns came back after (`ours:learned`: `persist.eviction:
learned`), and ours with each request
carrying SGLang's `kv_hints` envelope (`ours:kv_hints`: what the client knows when it sends a request:
a tool call's result comes back after the traces' median tool gap, an answer waits for the user
(`demote`), the last request is `done`), and ours at its defaults on an 8-bit pool (`ours:fp8`:
SGLang's `--kv-cache-dtype fp8_e4m3`; `ours:int8`: ours, codes and a scale per token and head) given
the float pool's bytes (`--kv-pool-bytes`: about twice a bf16 pool's tokens, four times a float32
one's), and ours with intent as the capacity lever (`ours:pressure`: a session's turns prune to a
history budget of 256 once the tree has had to evict, `intent.when: pressure`; bench/many_agents.py's
PRESSURE). Every row carries its pool's tokens and bytes.

Per method and oversubscription, intervals over seeds (95% bootstrap): job completion time, TTFT
p50 / p90 / p99, goodput (the share of requests whose TTFT is within `--ttft-bound` s), tokens
prefilled over the ideal (each distinct prefix once, across sessions), tokens restored and
prefetched, store bytes (ours; also over the distinct tokens at one byte a K or V value), failed
requests and requests slower than `--stall-s`; where the slowest 5% of turns waited (their restore's
wait for room, their own restore, their wait behind other requests, their own prefill, the
rest). For ours, the server's predicted return of each session (GET /sgl_memory/sessions'
`expected_back_s`, read when a turn ends, inside the think time) against the replay's real gap:
median and p90 of |predicted - actual| per gap class (after a tool call, after an answer).
Writes bench/results/agent_traces.json and .png.

    .venv/bin/python -m bench.agent_traces --quick       (sglang:lru, ours:persist, ours:kv_hints at 4x, one seed)
    .venv/bin/python -m bench.agent_traces --seeds 0 1 2 (the grid: hours on these CPUs)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
from transformers import AutoTokenizer

from bench import harness
from bench.common import RESULTS, disk_bytes, provenance, stream_chat, write_json
from bench.fidelity.points import _render
from bench.many_agents import (
    command,
    distinct_tokens,
    interval,
    method_tokens,
    percentile,
    pool_bytes,
    restore_totals,
)
from sgl_memory import kv_pool, models
from sgl_memory.core.tree_fill import common_prefix

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "agent-traces"
BLOCK = 64  # tokens per hash block in the traces
OVERSUBSCRIPTION = (1, 2, 4, 8)
METHODS = (
    "sglang:lru",
    "sglang:slru",
    "sglang:priority",
    "sglang:tlru",
    "sglang:session",
    "ours:plain",
    "ours:persist",
    "ours:learned",
    "ours:kv_hints",
    "ours:fp8",
    "ours:int8",
    "ours:pressure",
)
# The one-token words a block is written in: common English words, kept where the model's tokenizer
# makes " word" one token (so blocks concatenate without merging across them).
WORDS = (
    "the of and to in is was for on that with as by at from his an were are which this be or had not but "
    "one have they all their has been its two more when who will would there can if out so up no said what "
    "time new some could only into other these first than them may over year also after most then like "
    "made people part state back used years any many such city well where three work through under world "
    "because while between both each last long before great way since water high right name same school "
    "family group found number early life end small house day four second until five place old power "
    "during around general include called six book home must hand head often line main side among small "
    "against form later left local music area both told course three every once game play party point"
).split()


@dataclass
class Request:
    """One recorded request: when the client sends it after the one before, what it holds."""

    think_s: float  # the client's delay before sending it (scaled)
    blocks: list[int]  # hash ids of its 64-token blocks
    out: int  # output tokens (scaled)
    tool_call: bool  # its answer called a tool (the gap after it is a tool run, not the user)
    children: list[Conversation] = field(default_factory=list)  # sub-agents it starts, the parent waiting


@dataclass
class Conversation:
    id: str
    kind: str  # the client (main agent, or a sub-agent type): sessions of one kind share their tool prefix
    prefix_blocks: int  # the tool + system blocks that open each request
    requests: list[Request]
    trace: str = ""  # the trace it is from: its hash ids are the trace's (a parent's and its sub-agents' alike)


def load(path: Path, args) -> Conversation:
    """A trace file as a conversation, scaled by the args; sub-agent entries become the children of
    the request that follows them (the parent's next request waits for them)."""
    data = json.loads(path.read_text())
    return _conversation(data["id"], "main", data, data["requests"], args)


def _conversation(cid: str, kind: str, data: dict, entries: list[dict], args, trace: str = "") -> Conversation:
    prefix = (data.get("tool_tokens", 0) + data.get("system_tokens", 0)) // BLOCK
    out, pending = [], []
    for entry in entries:
        if entry.get("type") == "subagent":
            child_kind = entry.get("subagent_type") or "subagent"
            child_id = f"{cid}.{entry.get('agent_id')}"
            pending.append(_conversation(child_id, child_kind, entry, entry["requests"], args, trace or cid))
            continue
        if len(out) == args.max_requests:
            break
        out.append(
            Request(
                think_s=min(args.think_cap, entry.get("think_time", 0.0) * args.think_scale),
                blocks=list(entry["hash_ids"]),
                out=max(1, min(args.max_output, round(entry["out"] / BLOCK * args.block_tokens))),
                tool_call=entry.get("stop") == "tool_use",
                children=pending,
            )
        )
        pending = []
    return Conversation(cid, kind, prefix, out, trace or cid)


def pick(seed: int, count: int, args) -> list[Conversation]:
    """A seeded subset of the traces (sorted names, shuffled by the seed)."""
    paths = sorted(TRACES.glob("trace_*.json"))
    if not paths:
        raise SystemExit(f"no traces (trace_*.json) in {TRACES}: the replay reads the shared data folder")
    random.Random(seed).shuffle(paths)
    return [load(p, args) for p in paths[:count]]


class Text:
    """Deterministic text for blocks: a block's words depend only on its key, a shared prefix block's
    key is (client kind, position), every other block's (trace, hash id): a trace's sub-agents that
    start alike (the traces' siblings share their task prompt) share those blocks too."""

    def __init__(self, tokenizer, block_tokens: int, shared_share: float, turns: bool = False):
        self.words = [w for w in WORDS if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1]
        if len(self.words) < 32:
            raise SystemExit(f"only {len(self.words)} one-token words for this tokenizer")
        self.block_tokens, self.shared_share = block_tokens, shared_share
        self.turns = turns  # one user message per request's new blocks (else the whole history in one)

    def block(self, key: str) -> str:
        rng = random.Random(key)
        return "".join(" " + rng.choice(self.words) for _ in range(self.block_tokens))

    def messages(self, conversation: Conversation, request: Request) -> list[dict]:
        shared = round(conversation.prefix_blocks * self.shared_share)
        keys = [
            f"{conversation.kind}:{j}" if j < shared else f"{conversation.trace}:{h}"
            for j, h in enumerate(request.blocks)
        ]
        head = min(conversation.prefix_blocks, len(keys))
        starts = turn_starts(conversation, request, head) if self.turns else [head]
        return [
            {"role": "system", "content": "".join(map(self.block, keys[:head])).strip()},
            *(
                {"role": "user", "content": "".join(map(self.block, keys[a:b])).strip() or "Go on."}
                for a, b in zip(starts, [*starts[1:], len(keys)])
            ),
        ]


def turn_starts(conversation: Conversation, request: Request, head: int) -> list[int]:
    """Where the messages of `request` start (block indices, the first at `head`) when each request's
    new blocks (the previous answer and the new input, past the prefix it shares with the request
    before it) are a message of their own: the traces record no text, but a request's prompt is the
    one before it, its answer and what came back, so a client sends them as the history's messages.
    A message of an earlier request that the prefix no longer holds whole ends where it parts."""
    starts, before = [head], []
    for r in conversation.requests:
        shared = common_prefix(r.blocks, before)
        starts = [a for a in starts if a < max(shared, head + 1)] + ([shared] if shared > starts[-1] else [])
        before = r.blocks
        if r is request:
            return starts
    raise ValueError("the request is not one of the conversation's")


def conversations(root: list[Conversation]) -> list[Conversation]:
    """Every conversation of the run: the roots and, depth first, their sub-agents."""
    out = []
    for c in root:
        out.append(c)
        out += conversations([child for r in c.requests for child in r.children])
    return out


def rendered(tokenizer, text: Text, c: Conversation) -> list[list[int]]:
    """Each request's prompt as the server renders it (the chat template, as SGLang applies it)."""
    return [_render(tokenizer, text.messages(c, r), None, True) for r in c.requests]


# --- the replay -----------------------------------------------------------------------------------


@dataclass
class Turn:
    session: str
    step: int
    sent: float  # seconds after the run started
    ttft_s: float | None
    latency_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    waits: dict = field(default_factory=dict)  # where its wait went, as the server reports it (`waits`)
    gap_class: str = ""  # what the client waited for before sending it: "tool" or "answer" ("" for the first)
    predicted_gap_s: float | None = None  # the server's expected return, read when the turn before it ended
    actual_gap_s: float | None = None


def envelope(c: Conversation, k: int, tool_gap_s: float) -> dict:
    """The kv_hints a client knows to send with its k-th request: a tool call's result comes back
    after the median tool gap; an answer waits for the user (demote); the last request is done."""
    last = k == len(c.requests) - 1
    r = c.requests[k]
    if last:
        action = ("done", None)
    elif r.tool_call:
        action = ("prefetch", {"in_ms": max(0, round(tool_gap_s * 1000))})
    else:
        action = ("demote", None)
    kind, payload = action
    return {
        "protocol_version": "1",
        "message_id": f"{c.id}-{k}",
        "actions": [
            {"action_id": "0", "action_type": kind, "action_version": "1", **({"payload": payload} if payload else {})}
        ],
    }


def send(server: harness.Server, messages: list[dict], session: str, out: int, hints: dict | None):
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": out,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"kv_hints": hints} if hints else {}),
    }
    ttft, usage, memory = stream_chat(server, body, session, timeout=3600)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft, int(usage.get("prompt_tokens") or 0), int(cached), waits(memory)


def waits(memory: dict) -> dict:
    """Where a turn's time went before its first token, as the server reports it (ours): its
    restore's wait for room, its own restore (the scheduler's part and the unpack thread's), its
    wait behind other requests and its own prefill (None where the server does not say)."""
    persist = memory.get("persist") or memory

    def seconds(key: str) -> float | None:
        return None if persist.get(key) is None else persist[key] / 1000

    return {
        "deferred_s": (persist.get("restore_deferred_ms") or 0) / 1000,
        "restore_s": (persist.get("restore_ms") or 0) / 1000,
        "queued_s": seconds("queued_ms"),
        "prefill_s": seconds("turn_prefill_ms"),
        "restored_tokens": int(persist.get("restored_tokens") or 0),
        "prefetched_tokens": int(persist.get("prefetched_tokens") or 0),
    }


def expected_back(server: harness.Server, session: str) -> float | None:
    """The server's expected return of the session, in seconds from now (None: it says nothing)."""
    try:
        rows = server.get("/sgl_memory/sessions?limit=1000").json()["sessions"]
    except (requests.RequestException, ValueError, KeyError):
        return None
    row = next((r for r in rows if r.get("session_id") == session), None)
    return None if row is None else row.get("expected_back_s")


class Replay:
    """Every root conversation at once, one thread each, its sub-agents on threads of their own."""

    def __init__(self, server, text: Text, method: str, tag: str, seed: int, tool_gap_s: float, probe: bool):
        self.server, self.text, self.method, self.tag = server, text, method, tag
        self.seed, self.tool_gap_s, self.probe = seed, tool_gap_s, probe
        self.turns: list[Turn] = []
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()

    def run(self, roots: list[Conversation], stagger_s: float) -> list[Turn]:
        threads = [
            threading.Thread(
                target=self.session, args=(c, random.Random(f"start-{self.seed}-{i}").uniform(0, stagger_s))
            )
            for i, c in enumerate(roots)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.turns

    def session(self, c: Conversation, delay_s: float) -> None:
        time.sleep(delay_s)
        name = f"{self.tag}-{self.seed}-{c.id}"
        predicted, ended = None, 0.0
        for k, r in enumerate(c.requests):
            self.children(r.children)
            if k:  # the think time runs from the answer; the probe of the server's prediction is inside it
                time.sleep(max(0.0, ended + r.think_s - time.perf_counter()))
            sent = time.perf_counter()
            hints = envelope(c, k, self.tool_gap_s) if self.method == "ours:kv_hints" else None
            try:
                ttft, prompt, cached, wait = send(self.server, self.text.messages(c, r), name, r.out, hints)
                turn = Turn(name, k, sent - self.t0, ttft, time.perf_counter() - sent, prompt, cached, waits=wait)
            except Exception as exc:  # counted; the session goes on, as an agent would retry its next step
                turn = Turn(name, k, sent - self.t0, None, time.perf_counter() - sent, error=str(exc)[:300])
            if k:
                turn.gap_class = "tool" if c.requests[k - 1].tool_call else "answer"
                turn.predicted_gap_s, turn.actual_gap_s = predicted, sent - ended
            with self.lock:
                self.turns.append(turn)
            ended = time.perf_counter()
            back = expected_back(self.server, name) if self.probe and k + 1 < len(c.requests) else None
            predicted = None if back is None else time.perf_counter() - ended + back  # as a gap from the answer

    def children(self, children: list[Conversation]) -> None:
        """The sub-agents a request waits for: started together, joined before it is sent."""
        threads = [threading.Thread(target=self.session, args=(child, 0.0)) for child in children]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


# --- results --------------------------------------------------------------------------------------


def summarize(turns: list[Turn], ideal: int, args) -> dict:
    done = [t for t in turns if not t.error]
    ttfts = [t.ttft_s for t in done if t.ttft_s is not None]
    prefilled = sum(t.prompt_tokens - t.cached_tokens for t in done)
    return {
        "jct_s": max((t.sent + t.latency_s for t in turns), default=0.0),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "goodput": sum(t.ttft_s is not None and t.ttft_s <= args.ttft_bound for t in done) / max(1, len(turns)),
        "prompt_tokens": sum(t.prompt_tokens for t in done),
        "prefilled_tokens": prefilled,
        "ideal_tokens": ideal,
        "prefilled_over_ideal": prefilled / ideal if ideal else None,
        "requests": len(turns),
        "failed": len(turns) - len(done),
        "stalled": sum(t.latency_s > args.stall_s for t in done),
        "predictor": predictor_error(turns),
        "slowest": slowest(done),
        "errors": sorted({t.error for t in turns if t.error})[:3],
    }


def slowest(turns: list[Turn], share: float = 0.05) -> dict:
    """Where the slowest turns' time to first token went (the slowest `share` of them, at least
    one): its restore's wait for room, its own restore, its wait behind other requests and its
    own prefill (the server's report, where it gives one), the tokens it prefilled, and the rest
    of its time to first token (the HTTP and tokenizer path, and all of it where the server says nothing)."""
    timed = sorted((t for t in turns if t.ttft_s is not None), key=lambda t: t.ttft_s, reverse=True)
    tail = timed[: max(1, math.ceil(share * len(timed)))] if timed else []
    if not tail:
        return {}

    def mean(values) -> float:
        return sum(values) / len(tail)

    parts = {p: mean(t.waits.get(p) or 0.0 for t in tail) for p in ("deferred_s", "restore_s", "queued_s", "prefill_s")}
    return {
        "turns": len(tail),
        "ttft_s": mean(t.ttft_s for t in tail),
        **parts,
        "prefilled_tokens": mean(t.prompt_tokens - t.cached_tokens for t in tail),
        "rest_s": mean(t.ttft_s for t in tail) - sum(parts.values()),
    }


def predictor_error(turns: list[Turn]) -> dict:
    """|predicted - actual| of each session's return, per gap class (the server said nothing: not
    counted, and the count of such gaps given)."""
    out = {}
    for cls in ("tool", "answer"):
        gaps = [t for t in turns if t.gap_class == cls and t.actual_gap_s is not None]
        said = [abs(t.predicted_gap_s - t.actual_gap_s) for t in gaps if t.predicted_gap_s is not None]
        out[cls] = {
            "gaps": len(gaps),
            "predicted": len(said),
            "median_gap_s": statistics.median([t.actual_gap_s for t in gaps]) if gaps else None,
            "median_error_s": statistics.median(said) if said else None,
            "p90_error_s": percentile(said, 0.9),
        }
    return out


def one_byte_a_value(model: str) -> int:
    """One token's K and V over every layer at one byte a value (the store's Q8 default, its scales
    left out): what a distinct token costs the store at the least."""
    return kv_pool.bytes_per_token(models.model_dir(model), "fp8_e4m3")


def store_bytes(directory: Path) -> int:
    """What the session store takes on disk: each file once, however many sessions link it."""
    return disk_bytes((directory / "store").rglob("*"))


def server_command(
    method: str, model: str, pool: int, directory: Path, tlru: dict | None = None
) -> tuple[list[str], dict | None]:
    """The method's server on a pool of a float pool's `pool` tokens (bytes, for an 8-bit pool:
    bench/many_agents.py's command); `tlru` is SGLang's tlru policy's config."""
    if method == "ours:plain":
        return harness.our_command(model, "--plain", "--max-total-tokens", str(pool), "--enable-cache-report"), None
    policy_config = tlru if method == "sglang:tlru" else None
    return command("ours:persist" if method == "ours:kv_hints" else method, model, pool, directory, policy_config)


def run_one(method: str, args, roots, ideal: int, pool: int, seed: int, text: Text, directory: Path) -> dict:
    cmd, env = server_command(method, args.model, pool, directory, args.tlru)
    row = {
        "method": method,
        "seed": seed,
        "pool_tokens": method_tokens(method, args.model, pool),
        "pool_bytes": pool_bytes(args.model, pool),
    }
    try:
        server = harness.start(cmd, directory / "server.log", env)
    except Exception as exc:  # a method SGLang refuses on this engine is reported, not fatal
        return {**row, "runs": False, "why": str(exc)[-300:]}
    try:
        ours = method.startswith("ours") and method != "ours:plain"
        replay = Replay(server, text, method, method.replace(":", "-"), seed, args.tool_gap_s, ours)
        turns = replay.run(roots, args.stagger_s)
        row.update(runs=True, **summarize(turns, ideal, args))
        if ours:
            row.update(restore_totals(server), store_bytes=store_bytes(directory))
            row["prefetched_tokens"] = sum(t.waits.get("prefetched_tokens", 0) for t in turns)
        row["turns"] = [t.__dict__ for t in turns]
        return row
    finally:
        harness.stop(server)


METRICS = ("jct_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "goodput", "prefilled_over_ideal")
TOTALS = ("restored_tokens", "prefetched_tokens", "store_bytes", "store_over_distinct")


def aggregate(rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(r["method"], r["oversubscription"]) for r in rows}, key=lambda k: (k[1], k[0])):
        group = [r for r in rows if (r["method"], r["oversubscription"]) == key and r["runs"]]
        row = {"method": key[0], "oversubscription": key[1], "runs": bool(group)}
        if group:
            row["pool_tokens"], row["pool_bytes"] = group[0]["pool_tokens"], group[0]["pool_bytes"]
            row["effective_oversubscription"] = interval([r["effective_oversubscription"] for r in group])
            for metric in METRICS + TOTALS:
                values = [r[metric] for r in group if r.get(metric) is not None]
                if values:
                    row[metric] = interval(values)
            row["failed"] = sum(r["failed"] for r in group)
            row["stalled"] = sum(r["stalled"] for r in group)
        out.append(row)
    return out


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("jct_s", "job completion time (s)"),
        ("ttft_p99_s", "TTFT p99 (s)"),
        ("prefilled_over_ideal", "prefilled / ideal"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    for method in sorted({r["method"] for r in summary}):
        rows = [r for r in summary if r["method"] == method and r["runs"]]
        for ax, (metric, _) in zip(axes, panels):
            got = [r for r in rows if metric in r]
            ys = [r[metric]["mean"] for r in got]
            err = [
                [y - r[metric]["ci95"][0] for y, r in zip(ys, got)],
                [r[metric]["ci95"][1] - y for y, r in zip(ys, got)],
            ]
            ax.errorbar([r["oversubscription"] for r in got], ys, yerr=err, marker="o", capsize=3, label=method)
    for ax, (_, title) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("oversubscription (sessions' distinct tokens / KV pool)")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plan(seed: int, args, tokenizer, text: Text):
    """The seed's conversations, the ideal prefill (every request's distinct prefix once), the
    sessions' distinct tokens (their last contexts, shared prefixes once) and the longest context."""
    roots = pick(seed, args.sessions, args)
    prompts, contexts = [], []
    for c in conversations(roots):
        ids = rendered(tokenizer, text, c)
        prompts += ids
        if ids:
            contexts.append(ids[-1] + [-1 - len(contexts)] * c.requests[-1].out)  # its answer: its own tokens
    return roots, distinct_tokens(prompts), distinct_tokens(contexts), max(map(len, contexts)), len(prompts)


def pool_for(distinct: int, longest: int, oversubscription: float) -> int:
    return max(math.ceil(distinct / oversubscription), longest + 64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", choices=list(models.MODELS))
    ap.add_argument("--sessions", type=int, default=8, help="root conversations replayed at once")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--oversubscription", nargs="+", type=float, default=list(OVERSUBSCRIPTION))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--block-tokens", type=int, default=1, help="tokens each 64-token block is replayed as")
    ap.add_argument("--shared-share", type=float, default=1.0, help="of the tool+system blocks, shared by all")
    ap.add_argument("--think-scale", type=float, default=0.05)
    ap.add_argument("--think-cap", type=float, default=8.0, help="seconds")
    ap.add_argument("--max-output", type=int, default=16, help="tokens")
    ap.add_argument("--max-requests", type=int, default=16, help="per conversation")
    ap.add_argument("--stagger-s", type=float, default=2.0, help="sessions start within this many seconds")
    ap.add_argument("--tool-gap-s", type=float, default=None, help="kv_hints' prefetch: default the traces' median")
    ap.add_argument("--ttft-bound", type=float, default=5.0, help="seconds: goodput's bound")
    ap.add_argument("--stall-s", type=float, default=120.0, help="a request slower than this counts as stalled")
    ap.add_argument(
        "--tlru-threshold",
        type=int,
        default=1024,
        help="tokens: SGLang's tlru keeps of each conversation what leaves its next prefill at most this long "
        "(the test model prefills about 1,200 tokens in 5 s, the goodput bound, on a 2-core AVX2 CPU in float32)",
    )
    ap.add_argument(
        "--messages",
        choices=["one", "turns"],
        default="one",
        help="one: the history after the system text as one user message; turns: each request's new blocks "
        "a user message of their own (what pruning needs: the latest message is forced)",
    )
    ap.add_argument("--quick", action="store_true", help="sglang:lru, ours:persist, ours:kv_hints at 4x, seed 0")
    ap.add_argument("--out", default=str(RESULTS / "agent_traces.json"))
    args = ap.parse_args()
    if args.quick:
        args.methods, args.oversubscription, args.seeds = ["sglang:lru", "ours:persist", "ours:kv_hints"], [4], [0]
    if args.tool_gap_s is None:
        args.tool_gap_s = tool_gap(args)
    # tlru's next prompt: the replay's median growth of a request over the one before
    args.tlru = {"threshold": args.tlru_threshold, "next_prompt_estimate": next_prompt(args)}
    tokenizer = AutoTokenizer.from_pretrained(models.model_dir(args.model))
    text = Text(tokenizer, args.block_tokens, args.shared_share, args.messages == "turns")
    base = Path(tempfile.mkdtemp(prefix="agent-traces-"))
    plans, rows = {}, []
    runs = [(seed, over, method) for seed in args.seeds for over in args.oversubscription for method in args.methods]
    for n, (seed, over, method) in enumerate(runs, 1):
        if seed not in plans:
            plans[seed] = plan(seed, args, tokenizer, text)
            _, ideal, distinct, longest, count = plans[seed]
            print(
                f"seed {seed}: {count} requests, ideal prefill {ideal}, distinct {distinct}, longest {longest}",
                flush=True,
            )
        roots, ideal, distinct, longest, _ = plans[seed]
        pool = pool_for(distinct, longest, over)
        directory = base / f"{seed}-{over}-{method.replace(':', '-')}"
        directory.mkdir(parents=True)
        # the longest context's floor can bind: then the pool is larger than asked and the run is
        # at its own oversubscription, said beside the asked one (more --sessions reach the asked)
        effective = distinct / method_tokens(method, args.model, pool)
        floor = f" (the longest context's floor: {effective:.2f}x)" if effective < over * 0.99 else ""
        print(f"[{n}/{len(runs)}] seed {seed}, {over}x, {method}: pool {pool} tokens{floor}", flush=True)
        row = run_one(method, args, roots, ideal, pool, seed, text, directory)
        row["oversubscription"], row["effective_oversubscription"] = over, effective
        if row.get("store_bytes") is not None:  # against each distinct token stored once, at Q8
            row["store_over_distinct"] = row["store_bytes"] / (distinct * one_byte_a_value(args.model))
        print(
            "   ", {k: row.get(k) for k in ("jct_s", "ttft_p99_s", "prefilled_over_ideal", "failed", "why")}, flush=True
        )
        rows.append(row)
    summary = aggregate(rows)
    out = Path(args.out)
    config = {**vars(args), "traces": str(TRACES), "block": BLOCK}
    sessions = {
        str(s): {"ideal_tokens": p[1], "distinct_tokens": p[2], "longest": p[3], "requests": p[4]}
        for s, p in plans.items()
    }
    write_json(out, {"provenance": provenance(), "config": config, "plans": sessions, "summary": summary, "runs": rows})
    plot(summary, out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))


def folder(args) -> list[Conversation]:
    """Every conversation of every trace in the folder (sub-agents included), scaled by the args."""
    return [c for path in sorted(TRACES.glob("trace_*.json")) for c in conversations([load(path, args)])]


def next_prompt(args) -> int:
    """The median tokens a request adds to the one before it in its conversation, over every trace
    in the folder, as replayed (`--block-tokens` a block)."""
    growth = [len(b.blocks) - len(a.blocks) for c in folder(args) for a, b in zip(c.requests, c.requests[1:])]
    return max(1, round(statistics.median(growth) * args.block_tokens)) if growth else 1


def tool_gap(args) -> float:
    """The median scaled gap after a tool call over every trace in the folder: what a client's
    `prefetch` hint says (one number, as a client would configure it)."""
    gaps = [b.think_s for c in folder(args) for a, b in zip(c.requests, c.requests[1:]) if a.tool_call]
    return statistics.median(gaps) if gaps else 0.0


if __name__ == "__main__":
    main()
