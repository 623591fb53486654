"""Recall of a tool output many turns back: accuracy per method on generated agent sessions.

    .venv/bin/python -m bench.recall [--lengths 2048 4096 8192] [--per-length 24] [--methods full ...] [--quick]

Each session (bench/recall/sessions.py) is sent as an agent sends it: one request per step, the
conversation so far with the tools (the scripted tool call and its output appended each time, and
each earlier hop's question; 2 tokens generated, so a pruning method's compression event runs on
every step), then the last question,
answered greedily (32 tokens) over whatever KV the method left live. Sessions of one length cycle
through the four shapes, 1-3 hops (half of them one hop) and depths 0.1 / 0.5 / 0.9; a length is
reached by the number of steps. Methods: `full` (our server, nothing pruned), and per history
budget the pruning scorers on `dead_slot` (IntentKV memory / query / learned, SnapKV, H2O,
StreamingLLM, random). Each method's sessions run in a tenant of their own.

Files: `bench/results/recall.rows.jsonl` (one row per session and method, appended; a re-run skips
what it holds), `recall.json` (accuracy per length and method with 95% bootstrap intervals, paired
differences against the full cache and against the default scorer at the same budget, effective
live KV, prefix hit, wall), `recall.md`, `recall.png`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from bench.common import FULL_BUDGET, RESULTS, bootstrap, commit, ok, read_rows, write_json
from sgl_memory import models
from sgl_memory.core.config import to_yaml
from sgl_memory.intent.settings import IntentConfig
from bench import harness

from . import sessions as S

CONFIG = to_yaml(IntentConfig(enabled=True, budget_floor=16), harness.PERSIST_OFF)
SCORERS = ("memory", "memory_pool", "query", "learned", "snapkv", "h2o", "streaming_llm", "random")
DEFAULT = "memory"  # IntentKV's rule as published: every scorer is paired against it
HOPS = (1, 2, 1, 3)  # half one hop
DEPTHS = (0.1, 0.5, 0.9)
ANSWER_TOKENS = 32


def methods(budgets: list[int]) -> dict[str, dict]:
    """name -> the request's pruning fields."""
    out = {"full": {"budget": FULL_BUDGET}}  # an intent server prunes to its configured budget otherwise
    for b in budgets:
        for s in SCORERS:
            out[f"{s}@{b}"] = {"budget": b, "budget_mode": "history", "scorer": s, "layout": "dead_slot"}
    return out


def render(tokenizer, messages: list[dict]) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tools=S.TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def plan(tokenizer, lengths: list[int], per_length: int) -> list[tuple[int, S.Session]]:
    """Sessions per target length: steps grown until the whole prompt reaches the length."""
    out = []
    for length in lengths:
        for i in range(per_length):
            shape, hops, depth = (
                S.SHAPES[i % len(S.SHAPES)],
                HOPS[(i // len(S.SHAPES)) % len(HOPS)],
                DEPTHS[i % len(DEPTHS)],
            )
            steps = hops + 1
            while (n := len(render(tokenizer, (s := S.generate(i, steps, shape, hops, depth)).messages))) < length:
                steps += max(1, (length - n) // 400)
            out.append((length, s))
    return out


def ask(server, ids: list[int], field: dict, n: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    if field:
        body["sgl_memory"] = field
    return ok(server.post("/generate", body, timeout=3600), "/generate").json()


def run_session(server, tokenizer, session: S.Session, name: str, fields: dict, run_id: str) -> dict:
    """The session step by step in its own session id and tenant; the question's answer and costs."""
    field = {
        "session_id": f"{run_id}:{session.seed}:{len(session.messages)}",
        "tenant": f"recall-{name.replace('@', '-')}",
        **fields,
    }
    t0 = time.perf_counter()
    prompt = cached = 0
    # the agent's requests: after the task, each tool output and each earlier hop's question
    ends = [i + 1 for i, m in enumerate(session.messages[:-1]) if m["role"] in ("user", "tool")]
    for end in ends:
        ids = render(tokenizer, session.messages[:end])
        meta = ask(server, ids, field, 2)["meta_info"]
        prompt, cached = prompt + len(ids), cached + meta.get("cached_tokens", 0)
    ids = render(tokenizer, session.messages)
    out = ask(server, ids, field, ANSWER_TOKENS)
    meta = out["meta_info"]
    mem = meta.get("sgl_memory") or {}
    prompt, cached = prompt + len(ids), cached + meta.get("cached_tokens", 0)
    return {
        "prediction": out["text"],
        "correct": S.correct(out["text"], session.answer),
        "prompt_tokens": len(ids),
        "live_kv": mem.get("live_kv_tokens", len(ids) + meta.get("completion_tokens", 0)),
        "prefix_hit": cached / prompt,
        "wall_s": time.perf_counter() - t0,
    }


def _share(rows: list[dict], key: str, value) -> float | None:
    """Accuracy over the rows with row[key] == value (hops; shape counts one-hop sessions only,
    the multi-hop ones always end on the same lookups)."""
    rs = [r for r in rows if r[key] == value and (key != "shape" or r["hops"] == 1)]
    return sum(r["correct"] for r in rs) / len(rs) if rs else None


def _paired(rs: list[dict], against: list[dict]) -> tuple:
    """Accuracy minus the other method's on the same sessions, with its interval (None where none is shared)."""
    other = {r["seed"]: r["correct"] for r in against}
    diffs = [[float(r["correct"]) - float(other[r["seed"]])] for r in rs if r["seed"] in other]
    return (*bootstrap(diffs), len(diffs)) if diffs and rs is not against else (None, None, None, 0)


def aggregate(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["length"], r["method"]), []).append(r)
    out = []
    for (length, method), rs in sorted(groups.items()):
        acc, lo, hi = bootstrap([[float(r["correct"])] for r in rs])
        vs_full = _paired(rs, groups.get((length, "full"), []))
        budget = method.partition("@")[2]  # the default scorer at the same budget: what part 5 of issue 29 must beat
        vs_default = _paired(rs, groups.get((length, f"{DEFAULT}@{budget}"), [])) if budget else (None, None, None, 0)
        out.append(
            {
                "length": length,
                "method": method,
                "n": len(rs),
                "accuracy": acc,
                "ci_low": lo,
                "ci_high": hi,
                "vs_full": vs_full[0],
                "vs_full_ci_low": vs_full[1],
                "vs_full_ci_high": vs_full[2],
                "n_paired": vs_full[3],
                "vs_default": vs_default[0],
                "vs_default_ci_low": vs_default[1],
                "vs_default_ci_high": vs_default[2],
                "by_hops": {h: _share(rs, "hops", h) for h in (1, 2, 3)},
                "by_shape": {k: _share(rs, "shape", k) for k in S.SHAPES},
                "prompt_tokens": sum(r["prompt_tokens"] for r in rs) / len(rs),
                "eff_live_kv": sum(r["live_kv"] for r in rs) / len(rs),
                "prefix_hit": sum(r["prefix_hit"] for r in rs) / len(rs),
                "wall_s": sum(r["wall_s"] for r in rs) / len(rs),
            }
        )
    return out


def table(rows: list[dict]) -> str:
    def shares(d: dict) -> str:
        return " / ".join("-" if v is None else f"{v:.2f}" for v in d.values())

    def diff(r: dict, key: str) -> str:
        return "-" if r[key] is None else f"{r[key]:+.2f} [{r[key + '_ci_low']:+.2f}, {r[key + '_ci_high']:+.2f}]"

    lines = [
        f"| length | method | N | accuracy [95% CI] | vs full, paired | vs {DEFAULT}, paired | 1 / 2 / 3 hops "
        f"| one hop: {' / '.join(S.SHAPES)} | prompt | live KV | prefix hit | s / session |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        lines.append(
            f"| {r['length']} | {r['method']} | {r['n']} | {r['accuracy']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] "
            f"| {diff(r, 'vs_full')} | {diff(r, 'vs_default')} | {shares(r['by_hops'])} | {shares(r['by_shape'])} "
            f"| {r['prompt_tokens']:.0f} | {r['eff_live_kv']:.0f} "
            f"| {r['prefix_hit']:.2f} | {r['wall_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in sorted({r["method"] for r in rows}):
        rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["length"])
        x = [r["length"] for r in rs]
        ax.errorbar(
            x,
            [r["accuracy"] for r in rs],
            yerr=[[r["accuracy"] - r["ci_low"] for r in rs], [r["ci_high"] - r["accuracy"] for r in rs]],
            marker="o",
            capsize=3,
            label=method,
        )
    ax.set(
        xscale="log",
        xlabel="session length (tokens)",
        ylabel="accuracy (95% CI)",
        ylim=(0, 1.05),
        title="recall of a tool output many turns back",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_sessions(args, tokenizer, todo: list[tuple[int, S.Session, str]], ms: dict[str, dict], rows_path: Path) -> None:
    run_id = f"recall-{int(time.time())}"
    logs = Path(tempfile.gettempdir()) / "sgl-memory-recall"
    logs.mkdir(exist_ok=True)
    (logs / "config.yaml").write_text(CONFIG)
    server = harness.start(
        harness.our_command(args.model, "--memory-config", str(logs / "config.yaml")), logs / "server.log"
    )
    try:
        for length, session, name in tqdm(todo, desc="sessions x methods", disable=None):
            row = run_session(server, tokenizer, session, name, ms[name], run_id)
            row.update(
                length=length,
                seed=session.seed,
                method=name,
                shape=session.shape,
                hops=session.hops,
                depth=session.depth,
                steps=sum(m["role"] == "tool" for m in session.messages),
                answer=session.answer,
                commit=commit(),
            )
            with rows_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
    finally:
        harness.stop(server)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.recall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--per-length", type=int, default=24)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 1024], help="history budgets (prompt positions)")
    ap.add_argument("--methods", nargs="+", default=None, help="method names (default: all)")
    ap.add_argument(
        "--quick", action="store_true", help="2048 tokens, 4 sessions, the full cache and two scorers at one budget"
    )
    ap.add_argument("--report-only", action="store_true", help="run nothing: summarise every row the rows file holds")
    ap.add_argument("--out", type=Path, default=RESULTS / "recall.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.lengths, args.per_length, args.budgets = [2048], 4, args.budgets[:1]
        args.methods = args.methods or ["full", f"memory@{args.budgets[0]}", f"streaming_llm@{args.budgets[0]}"]
    return args


def main(argv=None) -> None:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(models.resolve(args.model))
    rows_path = args.out.with_suffix(".rows.jsonl")
    if args.report_only:
        rows = aggregate(read_rows(rows_path))
    else:
        todo_sessions = plan(tokenizer, args.lengths, args.per_length)
        ms = {k: v for k, v in methods(args.budgets).items() if args.methods is None or k in args.methods}
        done = {(r["length"], r["seed"], r["method"]) for r in read_rows(rows_path)}
        todo = [(length, s, m) for length, s in todo_sessions for m in ms if (length, s.seed, m) not in done]
        if todo:
            run_sessions(args, tokenizer, todo, ms, rows_path)
        wanted = {(length, s.seed) for length, s in todo_sessions}
        rows = aggregate([r for r in read_rows(rows_path) if (r["length"], r["seed"]) in wanted and r["method"] in ms])
    write_json(args.out, {"model": args.model, "rows": rows})
    args.out.with_suffix(".md").write_text(table(rows))
    plot(rows, args.out.with_suffix(".png"))
    print(table(rows))
