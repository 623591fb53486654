"""One long agent session, side by side: plain SGLang, intent pruning, KV memory, all three, and
all three with a server restart at the midpoint, in one run.

The session is a LoCoMo development conversation (`../shared/data/locomo/`) fed to the assistant
two dialogue lines per user turn (the assistant acknowledges each in a few tokens), with a question
about an early part of the conversation interleaved every `--question-every` turns: a QA item of
categories 1-4 whose evidence was shown at least `--min-age` turns before. Every method sees the
same turns in the same order:

- plain: plain SGLang, the whole history in every request, until the model's context is full;
- intent: our server with intent pruning (budget `--budget`), the whole history, until the context
  is full (pruning bounds the live KV, not the prompt);
- memory: our server with KV memory; each request carries the system message and its own turn,
  and the server places the session's relevant blocks before it;
- all: intent + persistence + memory in one server; each request carries the system message, the
  last `--window` exchanges and its own turn; memory places blocks before it, intent prunes the
  whole to the budget, persistence writes the session (QueryMemory and memory pool) after each turn;
- all+restart: the same, and the server is stopped and started again (on the same session store)
  at the midpoint;
- all-cap-lru, all-cap-merge: `all` with each session's memory capped at `--capacity` blocks,
  over capacity dropping the least recently retrieved blocks (lru) or folding them into their
  neighbours (merge): bounded host memory, and what it costs in recall.

Per turn: TTFT (time to the first streamed chunk), prompt tokens, prefill tokens (prompt - cached,
plus the memory probe's tokens), live KV tokens during decode, the host memory of the memory pools
(Prometheus gauge); per question, token F1 of the answer and evidence recall: the share of the
question's evidence turns whose KV the request holds (in its prompt for the full-history methods,
among the retrieved blocks' turns for the memory methods), which does not depend on the model's
ability to answer. Writes bench/results/long_session.json and .png.

    .venv/bin/python bench/long_session.py [--turns 200] [--methods plain intent memory all all+restart]
    .venv/bin/python bench/long_session.py --methods all-cap-merge --update   # re-run one method, keep the rest
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from common import RESULTS, stream, write_json
from locomo import data
from locomo.metrics import token_f1
from sgl_memory import models
from sgl_memory.core.config import to_yaml
from sgl_memory.intent.settings import IntentConfig
from sgl_memory.memart.settings import MemArtConfig
from sgl_memory.persist.settings import PersistConfig
from bench import harness

SYSTEM = (
    "You are a memory assistant. Acknowledge each part of the conversation in a few words; "
    "answer questions about it in a short phrase."
)
METHODS = ("plain", "intent", "memory", "all", "all+restart", "all-cap-lru", "all-cap-merge")
ACK_TOKENS, ANSWER_TOKENS = 8, 16


def session(turn_count: int, every: int, min_age: int) -> list[dict]:
    """The user turns: {'text', 'question', 'answer'} (question turns carry their gold answer)."""
    sample = data.load()[0]
    lines = data.turns(sample)
    questions = [q for q in data.questions(sample, 0) if q.category in (1, 2, 3, 4)]
    shown_at: dict[str, int] = {}  # dia_id -> the user turn that showed it
    out, line, used = [], 0, set()
    while len(out) < turn_count and line < len(lines):
        if len(out) % every == every - 1:
            ready = [
                q
                for q in questions
                if q.qa_index not in used
                and q.evidence
                and all(e in shown_at and shown_at[e] <= len(out) - min_age for e in q.evidence)
            ]
            if ready:
                q = ready[0]
                used.add(q.qa_index)
                evidence = sorted({shown_at[e] for e in q.evidence})
                out.append(
                    {"text": f"Question: {q.question}", "question": True, "answer": q.answer, "evidence": evidence}
                )
                continue
        pair = lines[line : line + 2]
        line += 2
        for t in pair:
            shown_at[t.dia_id] = len(out)
        text = "\n".join(t.line(dated=t.index == 0 or lines[t.index - 1].session != t.session) for t in pair)
        out.append({"text": text, "question": False, "answer": None})
    return out


def config(method: str, budget: int, store: Path, capacity: int) -> str:
    memory = MemArtConfig(enabled=True, block_size=16, top_k=16, cut="tokens", unit="block", placed_tokens=0)
    if method.startswith("all-cap-"):
        memory = replace(memory, capacity_blocks=capacity, eviction=method.removeprefix("all-cap-"))
    sections = {
        "intent": IntentConfig(enabled=True, budget=budget),
        "memory": memory,
        "persist": PersistConfig(enabled=True, dir=str(store)),
    }
    names = ["intent", "persist", "memory"] if method.startswith("all") else [method]
    # persistence is on by default: intent and memory alone run without it
    return to_yaml(*(sections[n] for n in names), *(() if "persist" in names else (harness.PERSIST_OFF,)))


def start(method: str, model: str, work: Path, budget: int, capacity: int):
    path = models.model_dir(model)
    log = work / f"{method.replace('+', '-')}-{time.time():.0f}.log"
    if method == "plain":
        cmd, env = harness.plain_sglang(path, *harness.cpu_flags(path, "torch_native"), "--enable-metrics")
        return harness.start(cmd, log, env)
    cfg = work / f"{method.replace('+', '-')}.yaml"
    cfg.write_text(config(method, budget, work / f"store-{method}", capacity))
    return harness.start(harness.our_command(model, "--memory-config", str(cfg), "--enable-metrics"), log)


def pool_gauge(server, name: str) -> float:
    return sum(server.prometheus(f"sgl_memory_memory_pool_{name}").values())


def kv_bytes_per_token(model: str) -> int:
    """What the server's KV pool holds per token, in the KV dtype the launcher picks on this machine."""
    from sgl_memory import cpu_dtype, kv_pool

    return kv_pool.bytes_per_token(models.model_dir(model), cpu_dtype.choose().kv_cache_dtype)


def run_method(method: str, turns: list[dict], tokenizer, args, work: Path) -> list[dict]:
    server = start(method, args.model, work, args.budget, args.capacity)
    rows, history = [], [{"role": "system", "content": SYSTEM}]
    context = getattr(tokenizer, "model_max_length", 8192)
    try:
        for i, turn in enumerate(tqdm(turns, desc=method)):
            if method == "all+restart" and i == len(turns) // 2:
                harness.stop(server)
                server = start(method, args.model, work, args.budget, args.capacity)
            user = {"role": "user", "content": turn["text"]}
            if method in ("plain", "intent"):
                messages = history + [user]
            elif method == "memory":
                messages = [history[0], user]
            else:
                messages = [history[0]] + history[1:][-2 * args.window :] + [user]
            ids = list(
                tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
            )
            max_tokens = ANSWER_TOKENS if turn["question"] else ACK_TOKENS
            if len(ids) + max_tokens > context:
                rows.append({"method": method, "turn": i, "overflow": True})
                break
            field = None
            if method != "plain":
                field = {"session_id": "long-session"}
                if method != "intent":
                    field["memory"] = {}
            try:
                text, ttft, meta = stream(server, ids, max_tokens, field)
            except RuntimeError as exc:  # the server refused it (a context or KV-pool limit): as BCP's overflow
                rows.append({"method": method, "turn": i, "overflow": True, "error": str(exc)[:300]})
                break
            ours = meta.get("sgl_memory") or {}
            row = {
                "method": method,
                "turn": i,
                "question": turn["question"],
                "ttft_s": ttft,
                "prompt_tokens": meta["prompt_tokens"],
                "cached_tokens": meta.get("cached_tokens", 0),
                "probe_tokens": ours.get("probe_tokens", 0),
                "live_kv_tokens": ours.get("live_kv_tokens", meta["prompt_tokens"] + meta["completion_tokens"]),
                "retrieved_blocks": ours.get("retrieved_blocks"),
                "restored_tokens": ours.get("restored_tokens"),
            }
            row["prefill_tokens"] = row["prompt_tokens"] - row["cached_tokens"] + row["probe_tokens"]
            row["pool_bytes"] = pool_gauge(server, "bytes") if method != "plain" else 0
            row["pool_tokens"] = pool_gauge(server, "tokens") if method != "plain" else 0
            if turn["question"]:
                row["f1"] = token_f1(text, turn["answer"])
                held = (
                    set(ours.get("retrieved_turns") or [])
                    if method not in ("plain", "intent")
                    else set(turn["evidence"])
                )
                row["evidence_recall"] = sum(e in held for e in turn["evidence"]) / len(turn["evidence"])
            rows.append(row)
            history += [user, {"role": "assistant", "content": text}]
    finally:
        harness.stop(server)
    return rows


def summary(rows: list[dict], turns: int, kv_per_token: int) -> dict:
    done = [r for r in rows if not r.get("overflow")]
    last = done[-1] if done else {}
    per_token = last["pool_bytes"] / last["pool_tokens"] if last.get("pool_tokens") else None
    late = [r for r in done if r["turn"] >= turns // 2]
    qs = [r["f1"] for r in done if "f1" in r]
    recall = [r["evidence_recall"] for r in done if "evidence_recall" in r]
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    return {
        "turns_served": len(done),
        "overflow_at": next((r["turn"] for r in rows if r.get("overflow")), None),
        "questions": len(qs),
        "f1": mean(qs),
        "evidence_recall": mean(recall),
        "ttft_s_first_half": mean([r["ttft_s"] for r in done if r["turn"] < turns // 2]),
        "ttft_s_second_half": mean([r["ttft_s"] for r in late]),
        "prefill_tokens_second_half": mean([r["prefill_tokens"] for r in late]),
        "live_kv_tokens_last": done[-1]["live_kv_tokens"] if done else None,
        "pool_bytes_last": last.get("pool_bytes"),
        "pool_tokens_last": last.get("pool_tokens"),
        # the memory pool's host bytes per stored token over the KV pool's bytes per token
        "pool_bytes_per_token_vs_kv_pool": per_token / kv_per_token if per_token else None,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fields = [
        ("ttft_s", "TTFT (s)"),
        ("prefill_tokens", "prefill tokens"),
        ("live_kv_tokens", "live KV tokens"),
        ("pool_bytes", "memory pool (bytes)"),
    ]
    fig, axes = plt.subplots(1, len(fields) + 1, figsize=(5 * (len(fields) + 1), 4))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for ax, (key, label) in zip(axes, fields):
        for m in methods:
            pts = [(r["turn"], r[key]) for r in rows if r["method"] == m and not r.get("overflow")]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=m, lw=1)
        ax.set_xlabel("turn")
        ax.set_title(label)
    ax = axes[-1]
    for m in methods:
        pts = [(r["turn"], r["evidence_recall"]) for r in rows if r["method"] == m and "evidence_recall" in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=m, lw=1, ms=3)
    ax.set_xlabel("turn")
    ax.set_title("evidence recall (questions about early turns)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--window", type=int, default=3, help="exchanges of history the `all` methods resend")
    ap.add_argument("--question-every", type=int, default=10)
    ap.add_argument("--min-age", type=int, default=40)
    ap.add_argument("--capacity", type=int, default=128, help="memory blocks per session of the all-cap methods")
    ap.add_argument("--update", action="store_true", help="replace only these methods' rows in the results file")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.model_dir(args.model))
    turns = session(args.turns, args.question_every, args.min_age)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            rows += run_method(method, turns, tokenizer, args, Path(tmp))
    out = RESULTS / "long_session.json"
    previous = {}
    if args.update and out.exists():  # keep the other methods' rows of an earlier run with the same session
        earlier = json.loads(out.read_text())
        if earlier["turns"] != len(turns) or earlier["model"] != args.model:
            raise SystemExit(f"--update: {out} holds another session ({earlier['turns']} turns of {earlier['model']})")
        rows = sorted(
            [r for r in earlier["rows"] if r["method"] not in args.methods] + rows,
            key=lambda r: METHODS.index(r["method"]),
        )
        # what the re-run methods measured before, side by side with what they measure now
        previous = {m: earlier["summary"][m] for m in args.methods if m in earlier["summary"]}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    per_token = kv_bytes_per_token(args.model)
    result = {
        "model": args.model,
        "turns": len(turns),
        "questions": sum(t["question"] for t in turns),
        "args": vars(args),
        "kv_pool_bytes_per_token": per_token,
        "summary": {m: summary([r for r in rows if r["method"] == m], len(turns), per_token) for m in methods},
        "previous": previous,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    write_json(out, result)
    plot(rows, RESULTS / "long_session.png")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
