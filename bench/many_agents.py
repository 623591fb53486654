"""Many agents, one server: M agent sessions at once, each replaying a recorded trajectory with tool
pauses between its requests, on a KV pool their contexts oversubscribe.

The work does not depend on the model's answers: a session sends, step by step, the full history
its recorded trajectory had at that step (the recorded answers, tool outputs and user turns, not
what the model says), then waits as the agent would for what comes next (a tool's output, or the
user's next message), and sends the next step. Trajectories:

- `recall`: the generated recall family (bench/recall/sessions.py): a system prompt with four tools,
  a task, tool calls with 100-150-token outputs, questions at the end;
- `bfcl`: BFCL v4 multi-turn tasks replayed along their ground truth (the replays BFCL's checker
  passes, as bench/fidelity takes them).

Each pause is drawn from a log-normal distribution per tool kind (`PAUSES`: median seconds and
sigma), seeded by (seed, session, step). The medians are assumptions of this benchmark, not read
from traces: an HTTP API (orders, BFCL's simulated APIs), a log search, a directory listing, a web
search, a user's next message. `--pause-scale` multiplies them all.

Clients: `openai` (full history to /v1/chat/completions, streamed, the session named by the
`x-session-id` header: the drop-in path) or `native` (/generate on the chat template's token ids,
the session named in the `sgl_memory` field on our server). The pool (`--max-total-tokens`) is the
sessions' contexts (each session's last prompt and answer) divided by the oversubscription, and at
least the longest context.

Side by side in one run, per oversubscription and seed, each on a fresh server: plain SGLang with its
radix cache under the `lru` policy and the others named in `--policies`, plain SGLang with
`--enable-session-radix-cache`, and ours with persistence on: `ours:persist` its defaults (Q8, the
warm host tier, restored KV held until its request runs, idle sessions evicted by next use learned
from the gaps their turns came back after), `ours:last_use` the same with SGLang's LRU order, and
`ours:hints` the defaults with each request's `sgl_memory.agent` hints (the next tool's median
pause, `done` on a session's last step), and the defaults on an 8-bit pool (`ours:fp8`: SGLang's
fp8_e4m3; `ours:int8`: ours, a scale per token and head), and the defaults with intent as the capacity
lever (`ours:pressure`: turns prune to a history budget once the pool is under pressure,
`intent.when: pressure`). Every method's pool takes the same bytes:
the float pool's (the compute dtype this machine's launcher picks) of that many tokens, which an
8-bit pool is given as `--kv-pool-bytes` and turns into about twice a bf16 pool's tokens, four
times a float32 one's; each row carries its pool's tokens and bytes.

Per run: job completion time (the first request sent to the last answer), TTFT per request (p50,
p99), tokens prefilled (prompt minus cached, summed) over the ideal (the distinct token prefixes of
every request: a shared system prompt counts once), tokens restored from the store and the
restores' time, all of it and the scheduler step's part (ours), requests that failed and requests
slower than `--stall-s`. Intervals: 95% bootstrap over seeds.
Writes bench/results/many_agents.json and .png.

    .venv/bin/python -m bench.many_agents --quick          (two methods, 1x and 4x, one seed: ~10 min here)
    .venv/bin/python -m bench.many_agents --model qwen2.5-coder-0.5b-instruct --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests
from transformers import AutoTokenizer

from bench import harness
from bench.common import RESULTS, bootstrap, provenance, stream, stream_chat, write_json
from bench.fidelity.points import _render, _templated
from sgl_memory import cpu_dtype, kv_pool, models
from sgl_memory.core.config import to_yaml
from sgl_memory.intent.settings import IntentConfig
from sgl_memory.persist.settings import PersistConfig

# Tool pauses: (median seconds, log-normal sigma) per tool kind; a tool not listed pauses as "api".
PAUSES = {
    "api": (0.4, 0.6),  # an HTTP API call: BFCL's simulated APIs, get_orders
    "search_logs": (0.8, 0.6),
    "list_files": (0.1, 0.5),
    "web_search": (1.5, 0.6),
    "user": (3.0, 0.5),  # the user reads the answer and writes the next message
}
ANSWER_TOKENS = 16  # each request's answer is discarded (the trajectory is replayed), so kept short
OVERSUBSCRIPTION = (1, 2, 4, 8)
METHODS = (
    "sglang:lru",
    "sglang:slru",
    "sglang:priority",
    "sglang:tlru",
    "sglang:session",
    "ours:persist",
    "ours:last_use",
    "ours:learned",
    "ours:hints",
    "ours:fp8",
    "ours:int8",
    "ours:pressure",
)
# intent as the capacity lever (`ours:pressure`): a session's turns prune to this history budget once
# the pool is under pressure (intent.when pressure). 256: TextWorld's decision points at this
# budget keep 0.47 of the KV with no difference in gold log-likelihood (bench/results/fidelity.md)
PRESSURE = IntentConfig(enabled=True, when="pressure", budget=256, budget_mode="history")
# methods on an 8-bit KV pool, given the float pool's bytes (--kv-pool-bytes): more tokens, same memory
EIGHT_BIT = {"ours:fp8": "fp8_e4m3", "ours:int8": "int8"}


@dataclass
class Step:
    messages: list[dict]  # the full history the client sends
    tools: list[dict] | None
    pause: str  # what the agent then waits for: a tool's name, "user", or "" after the last step


@dataclass
class Trajectory:
    id: str
    steps: list[Step]


def recall_trajectories(count: int, seed: int, steps: int = 20) -> list[Trajectory]:
    """`count` recall sessions of `steps` tool steps (about 130 tokens each), the shapes in turn."""
    from bench.recall import sessions as R

    out = []
    for i in range(count):
        s = R.generate(seed * 1000 + i, steps, R.SHAPES[i % len(R.SHAPES)], 1, 0.5)
        points = [j for j, m in enumerate(s.messages) if m["role"] == "assistant"] + [len(s.messages)]
        trajectory = []
        for j in points:
            following = s.messages[j] if j < len(s.messages) else None
            pause = (
                ""
                if following is None
                else following["tool_calls"][0]["function"]["name"]
                if following.get("tool_calls")
                else "user"
            )
            trajectory.append(Step(s.messages[:j], R.TOOLS, pause))
        out.append(Trajectory(f"recall-{seed}-{i}", trajectory))
    return out


def bfcl_trajectories(count: int, seed: int) -> list[Trajectory]:
    """BFCL tasks replayed along their ground truth (no server): each request the agent loop makes,
    with the gold calls as the answer; only replays BFCL's checker passes."""
    from bench.agent import bfcl as B
    from bench.agent.loop import Call, Reply

    tasks = B.tasks(list(B.CATEGORIES))
    random.Random(seed).shuffle(tasks)
    out = []
    for task in tasks:
        gold = [calls for truth in task.ground_truth for calls in ([B.as_calls(task, truth)] if truth else []) + [None]]
        asked: list[Step] = []

        class Replier:
            def ask(self, messages, tools, session_id, tool_choice="required"):
                calls = gold.pop(0) if gold else None
                asked.append(Step(copy.deepcopy(messages), tools, calls[0][0] if calls else "user"))
                if calls is None:
                    return Reply([Call("r", "respond", {"message": "Done."})], "", 0, 0, 0, 0.0)
                return Reply([Call(f"call_{i}", n, a) for i, (n, a) in enumerate(calls)], "", 0, 0, 0, 0.0)

        result = B.run(task, Replier(), "gold")
        if result["reason"] is None and result["valid"] and asked:
            asked[-1].pause = ""
            out.append(Trajectory(task.id, asked))
        if len(out) == count:
            break
    return out


WORKLOADS = {"recall": recall_trajectories, "bfcl": bfcl_trajectories}


def as_text(trajectory: Trajectory) -> Trajectory:
    """The trajectory for a chat template without tool messages (SmolLM2's): a call becomes the
    assistant's words, a tool's output a user message, no tools offered. Same pauses, same lengths
    within the template's few tokens."""

    def text(m: dict) -> dict:
        if m.get("tool_calls"):
            calls = "; ".join(
                f"{c['function']['name']}({json.dumps(c['function']['arguments'])})" for c in m["tool_calls"]
            )
            return {"role": "assistant", "content": f"{m.get('content') or ''}Calling {calls}".strip()}
        if m["role"] == "tool":
            return {"role": "user", "content": f"Tool output: {m['content']}"}
        return {"role": m["role"], "content": m.get("content") or ""}

    return Trajectory(trajectory.id, [Step([text(m) for m in s.messages], None, s.pause) for s in trajectory.steps])


def pause_seconds(kind: str, seed: int, session: int, step: int, scale: float) -> float:
    median, sigma = PAUSES.get(kind, PAUSES["api"])
    rng = random.Random(f"{seed}-{session}-{step}")
    return scale * median * math.exp(sigma * rng.gauss(0, 1))


def prompt_ids(tokenizer, step: Step) -> list[int]:
    """The step's prompt as the server renders it (SGLang parses tool-call arguments first)."""
    return _render(tokenizer, [_templated(m) for m in step.messages], step.tools, True)


def distinct_tokens(prompts: list[list[int]]) -> int:
    """Tokens of the prompts with every shared prefix counted once: the prefill of a cache that never
    forgets (the ideal)."""
    root: dict = {}
    total = 0
    for ids in prompts:
        node = root
        for t in ids:
            if t not in node:
                node[t] = {}
                total += 1
            node = node[t]
    return total


def pool_tokens(contexts: list[int], oversubscription: float) -> int:
    """The pool the sessions' contexts oversubscribe by `oversubscription`, and at least the longest."""
    return max(math.ceil(sum(contexts) / oversubscription), max(contexts))


# --- clients --------------------------------------------------------------------------------------


@dataclass
class Turn:
    session: int
    step: int
    sent: float  # seconds after the run started
    ttft_s: float | None
    latency_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


def _openai_message(m: dict) -> dict:
    """A recorded message as the OpenAI API takes it: tool-call arguments as a JSON string."""
    m = copy.deepcopy(m)
    for call in m.get("tool_calls") or []:
        if not isinstance(call["function"]["arguments"], str):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return m


def send_openai(
    server: harness.Server, step: Step, session: str, field: dict | None, tokenizer
) -> tuple[float | None, int, int]:
    body = {
        "model": "default",
        "messages": [_openai_message(m) for m in step.messages],
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if step.tools:
        body["tools"] = step.tools
    if field:
        body["sgl_memory"] = field
    ttft, usage, _ = stream_chat(server, body, session)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft, int(usage.get("prompt_tokens") or 0), int(cached)


def send_native(
    server: harness.Server, step: Step, session: str, field: dict | None, tokenizer
) -> tuple[float | None, int, int]:
    _, ttft, meta = stream(
        server, prompt_ids(tokenizer, step), ANSWER_TOKENS, None if field is None else {"session_id": session, **field}
    )
    return ttft, int(meta.get("prompt_tokens") or 0), int(meta.get("cached_tokens") or 0)


CLIENTS = {"openai": send_openai, "native": send_native}


def hints(step: Step, scale: float) -> dict:
    """What an agent framework knows when it sends a step: which tool the answer will call (the
    recorded trajectory's next tool), so its typical latency (the median of its kind, not the
    draw), or that the session ends with this answer."""
    if not step.pause:
        return {"agent": {"done": True}}
    return {"agent": {"expected_tool_duration_ms": round(scale * PAUSES.get(step.pause, PAUSES["api"])[0] * 1000)}}


def replay(
    server: harness.Server,
    trajectories: list[Trajectory],
    client: str,
    method: str,
    tokenizer,
    seed: int,
    scale: float,
    tag: str,
) -> list[Turn]:
    """Every trajectory at once, one thread each; a session starts after a seeded stagger of up to
    one median user pause (agents do not all start in the same second). On our server each request
    names its session (the header, or the native field), and `ours:hints` adds the agent's hints."""
    send, turns, lock, t_run = CLIENTS[client], [], threading.Lock(), time.perf_counter()

    def one(i: int, trajectory: Trajectory) -> None:
        time.sleep(random.Random(f"start-{seed}-{i}").uniform(0, scale * PAUSES["user"][0]))
        for k, step in enumerate(trajectory.steps):
            sent = time.perf_counter()
            try:
                field = None if not method.startswith("ours") else hints(step, scale) if method == "ours:hints" else {}
                ttft, prompt, cached = send(server, step, f"{tag}-{seed}-{i}", field, tokenizer)
                turn = Turn(i, k, sent - t_run, ttft, time.perf_counter() - sent, prompt, cached)
            except Exception as exc:  # counted, and the session goes on as an agent would retry its next step
                turn = Turn(i, k, sent - t_run, None, time.perf_counter() - sent, error=str(exc)[:300])
            with lock:
                turns.append(turn)
            if step.pause:
                time.sleep(pause_seconds(step.pause, seed, i, k, scale))

    threads = [threading.Thread(target=one, args=(i, t), daemon=True) for i, t in enumerate(trajectories)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return turns


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def summarize(turns: list[Turn], ideal: int, stall_s: float) -> dict:
    done = [t for t in turns if not t.error]
    ttfts = [t.ttft_s for t in done if t.ttft_s is not None]
    prefilled = sum(t.prompt_tokens - t.cached_tokens for t in done)
    return {
        "jct_s": max((t.sent + t.latency_s for t in turns), default=0.0),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "prompt_tokens": sum(t.prompt_tokens for t in done),
        "prefilled_tokens": prefilled,
        "ideal_tokens": ideal,
        "prefilled_over_ideal": prefilled / ideal if ideal else None,
        "requests": len(turns),
        "failed": len(turns) - len(done),
        "stalled": sum(t.latency_s > stall_s for t in done),
        "errors": sorted({t.error for t in turns if t.error})[:3],
    }


# --- servers --------------------------------------------------------------------------------------


def pool_bytes(model: str, tokens: int) -> int:
    """What `tokens` of KV take in the compute dtype this machine's launcher picks: every method's
    pool in bytes (the 8-bit pool's methods get these bytes, the rest these tokens)."""
    return tokens * kv_pool.bytes_per_token(models.model_dir(model), cpu_dtype.choose().dtype)


def method_tokens(method: str, model: str, tokens: int) -> int:
    """The tokens a method's pool holds when a float pool of `tokens` takes its bytes."""
    if method not in EIGHT_BIT:
        return tokens
    return pool_bytes(model, tokens) // kv_pool.bytes_per_token(models.model_dir(model), EIGHT_BIT[method])


def command(
    method: str, model: str, pool: int, directory: Path, policy_config: dict | None = None
) -> tuple[list[str], dict | None]:
    """The method's server on a pool of a float pool's `pool` tokens (its bytes, for an 8-bit pool);
    `policy_config` is SGLang's `--radix-eviction-policy-config` (tlru's threshold and next-prompt
    estimate, slru's protected threshold) for a plain SGLang method."""
    kind, variant = method.split(":")
    path = models.model_dir(model)
    if kind == "sglang":
        extra = ["--enable-session-radix-cache"] if variant == "session" else ["--radix-eviction-policy", variant]
        if policy_config:
            extra += ["--radix-eviction-policy-config", json.dumps(policy_config)]
        return harness.plain_sglang(
            path, *harness.cpu_flags(path, "torch_native", pool), "--enable-cache-report", *extra
        )
    config = directory / "memory.yaml"
    eviction = variant if variant in ("last_use", "learned") else PersistConfig.eviction
    persist = PersistConfig(enabled=True, dir=str(directory / "store"), eviction=eviction)
    config.write_text(to_yaml(persist, *([PRESSURE] if variant == "pressure" else [])))
    # the pool as an operator gives it: tokens, or an 8-bit pool's bytes
    size = ["--max-total-tokens", str(pool)]
    if method in EIGHT_BIT:
        size = ["--kv-pool-bytes", str(pool_bytes(model, pool)), "--kv-cache-dtype", EIGHT_BIT[method]]
    return harness.our_command(model, *size, "--enable-cache-report", "--memory-config", str(config)), None


def restore_totals(server: harness.Server) -> dict:
    """Tokens restored from the store, the restores' time and the part of it the scheduler's step
    spent (the rest ran on the unpack thread), summed over the run's requests."""
    try:
        totals = server.get("/sgl_memory/stats").json().get("totals", {})
    except (requests.RequestException, ValueError):
        totals = {}
    return {
        "restored_tokens": int(totals.get("restored_tokens", 0)),
        "restore_s": totals.get("restore_ms", 0) / 1000,
        "restore_step_s": totals.get("restore_step_ms", 0) / 1000,
    }


def run_one(
    method: str, args, trajectories: list[Trajectory], ideal: int, pool: int, seed: int, tokenizer, directory: Path
) -> dict:
    cmd, env = command(method, args.model, pool, directory)
    log = directory / "server.log"
    try:
        server = harness.start(cmd, log, env)
    except Exception as exc:  # a method SGLang refuses on this engine is reported, not fatal
        last = (
            [line for line in log.read_text(errors="replace").splitlines() if "Error" in line][-1:]
            if log.exists()
            else []
        )
        return {
            "method": method,
            "seed": seed,
            "pool_tokens": method_tokens(method, args.model, pool),
            "pool_bytes": pool_bytes(args.model, pool),
            "runs": False,
            "why": (last or [str(exc)])[0][-300:],
        }
    try:
        turns = replay(
            server, trajectories, args.client, method, tokenizer, seed, args.pause_scale, method.replace(":", "-")
        )
        row = {
            "method": method,
            "seed": seed,
            "pool_tokens": method_tokens(method, args.model, pool),
            "pool_bytes": pool_bytes(args.model, pool),
            "runs": True,
            **summarize(turns, ideal, args.stall_s),
        }
        if method.startswith("ours"):
            row.update(restore_totals(server))
        return row
    finally:
        harness.stop(server)


def interval(values: list[float]) -> dict:
    mean, lo, hi = bootstrap([[v] for v in values])
    return {"mean": mean, "ci95": [lo, hi], "n": len(values)}


def aggregate(rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(r["method"], r["oversubscription"]) for r in rows}, key=lambda k: (k[1], k[0])):
        group = [r for r in rows if (r["method"], r["oversubscription"]) == key and r["runs"]]
        if not group:
            out.append({"method": key[0], "oversubscription": key[1], "runs": False})
            continue
        row = {"method": key[0], "oversubscription": key[1], "runs": True}
        row["pool_tokens"], row["pool_bytes"] = group[0]["pool_tokens"], group[0].get("pool_bytes")
        for metric in ("jct_s", "ttft_p50_s", "ttft_p99_s", "prefilled_over_ideal"):
            row[metric] = interval([r[metric] for r in group if r[metric] is not None])
        for metric in ("restored_tokens", "restore_s", "restore_step_s"):
            if metric in group[0]:
                row[metric] = interval([r[metric] for r in group])
        row["failed"] = sum(r["failed"] for r in group)
        row["stalled"] = sum(r["stalled"] for r in group)
        out.append(row)
    return out


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method in sorted({r["method"] for r in summary}):
        rows = [r for r in summary if r["method"] == method and r["runs"]]
        xs = [r["oversubscription"] for r in rows]
        for ax, metric in zip(axes, ("jct_s", "ttft_p99_s")):
            ys = [r[metric]["mean"] for r in rows]
            err = [
                [y - r[metric]["ci95"][0] for y, r in zip(ys, rows)],
                [r[metric]["ci95"][1] - y for y, r in zip(ys, rows)],
            ]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=method)
    for ax, title in zip(axes, ("job completion time (s)", "TTFT p99 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("oversubscription (sessions' contexts / KV pool)")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", choices=list(models.MODELS))
    ap.add_argument("--workload", default="recall", choices=list(WORKLOADS))
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--steps", type=int, default=20, help="tool steps per recall session (BFCL's are its own)")
    ap.add_argument("--client", default="openai", choices=list(CLIENTS))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--oversubscription", nargs="+", type=float, default=list(OVERSUBSCRIPTION))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--pause-scale", type=float, default=1.0)
    ap.add_argument("--stall-s", type=float, default=60.0, help="a request slower than this counts as stalled")
    ap.add_argument(
        "--quick", action="store_true", help="sglang:lru and ours:persist at 1x and 4x, seed 0, 8 sessions of 12 steps"
    )
    ap.add_argument("--out", default=str(RESULTS / "many_agents.json"))
    args = ap.parse_args()
    if args.quick:
        args.methods, args.oversubscription, args.seeds, args.sessions, args.steps = (
            ["sglang:lru", "ours:persist"],
            [1, 4],
            [0],
            8,
            12,
        )
    tokenizer = AutoTokenizer.from_pretrained(models.model_dir(args.model))
    rows, base = [], Path(tempfile.mkdtemp(prefix="many-agents-"))
    runs = [(seed, over, method) for seed in args.seeds for over in args.oversubscription for method in args.methods]
    plans = {}
    for n, (seed, over, method) in enumerate(runs, 1):
        if seed not in plans:
            trajectories = WORKLOADS[args.workload](
                args.sessions, seed, **({"steps": args.steps} if args.workload == "recall" else {})
            )
            if "tool" not in (tokenizer.chat_template or ""):
                trajectories = [as_text(t) for t in trajectories]
            rendered = [[prompt_ids(tokenizer, s) for s in t.steps] for t in trajectories]
            prompts = [p for r in rendered for p in r]
            contexts = [len(r[-1]) + ANSWER_TOKENS for r in rendered]
            plans[seed] = (trajectories, distinct_tokens(prompts), contexts)
            print(
                f"seed {seed}: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens as rendered here, "
                f"{plans[seed][1]} distinct (the ideal prefill)",
                flush=True,
            )
        trajectories, ideal, contexts = plans[seed]
        directory = base / f"{seed}-{over}-{method.replace(':', '-')}"
        directory.mkdir(parents=True)
        print(
            f"[{n}/{len(runs)}] seed {seed}, {over}x, {method}: pool {pool_tokens(contexts, over)} tokens", flush=True
        )
        row = run_one(method, args, trajectories, ideal, pool_tokens(contexts, over), seed, tokenizer, directory)
        row["oversubscription"] = over
        print(
            "   ",
            {k: v for k, v in row.items() if k in ("jct_s", "ttft_p99_s", "prefilled_over_ideal", "failed", "why")},
            flush=True,
        )
        rows.append(row)
    summary = aggregate(rows)
    out = Path(args.out)
    result = {
        "provenance": provenance(),
        "config": {**vars(args), "pauses": PAUSES, "answer_tokens": ANSWER_TOKENS},
        "sessions_contexts": {str(s): p[2] for s, p in plans.items()},
        "summary": summary,
        "runs": rows,
    }
    write_json(out, result)
    plot(summary, out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
