"""The agent benchmark: every method on the same tasks in one run, resumable, with traces.

Methods: on one sgl-memory server with intent on (its radix cache flushed between methods, so no
method reuses another's prefixes) our full cache and, per budget, StreamingLLM / SnapKV / H2O on
`compact` and on `dead_slot` and IntentKV `query`, `memory` and `learned` (bench/common.py
`pruning_methods`), IntentKV `memory` with the system prompt compressible, and the learned head's
ablations and adaptive budget (bench/phase2.py runs those); then `kv memory` (our server with KV
memory on: each request carries the system prompt, the last user message and the last
`--memory-window` exchanges, and the session's memory brings back the rest as KV blocks); then
`plain` (plain SGLang, full cache, its own server). Budgets are history budgets (`budget_mode:
history`, the IntentKV paper's): BFCL's tool docs alone are 1.6k-4.7k tokens and sit in the system
prompt, which a total budget would have to hold.

With --agreement, each method also gets the full cache's conversation at each of its decision
points (teacher-forced) and its next call is compared with the full cache's.

Files under --out (default bench/results/), for workload W:
- `agent_W.tasks.jsonl`: one row per (method, task), appended as each task ends; a re-run skips
  the (method, task) pairs it holds (delete the file to start over);
- `agent_W.traces.jsonl`: one trajectory per (method, task) (format in bench/agent/__init__.py);
- `agent_W.agreement.jsonl`: per (method, task), decision points and agreements;
- `agent_W.json`: `rows`, one per method and budget, aggregated from the task rows; `agent_W.md`
  the same as a table; `agent_W.png` accuracy against effective live KV per method.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import tempfile
import time
from pathlib import Path

import requests
from tqdm import tqdm

from bench.common import RESULTS, commit, pruning_methods, read_rows, write_json
from sgl_memory import models
from sgl_memory.core.config import to_yaml
from sgl_memory.intent.settings import IntentConfig
from sgl_memory.memart.settings import MemArtConfig
from bench import harness

from . import bcp, bfcl
from .loop import Endpoint, Refused, message_tokens

WORKLOADS = ("bfcl", "bcp")
# the adaptive methods' floor sits below the smallest fixed budget so their budget can move both ways
INTENT_CONFIG = IntentConfig(enabled=True, budget_floor=16)
MEMORY_CONFIG = MemArtConfig(enabled=True)
REFERENCE = "full cache"  # our server without pruning: what next-action agreement compares with
# KV memory: each request carries the system prompt (the tool docs), the last user message and the
# last --memory-window exchanges; the session's memory places its most relevant earlier blocks after
# the system prompt, so the tool docs stay one prefix every step reuses.
KV_MEMORY = ("kv memory", {"memory": {"placement": "after_system"}})


def methods(budgets: list[int]) -> list[tuple[str, dict | None]]:
    """(name, the request's `sgl_memory` fields; None for plain SGLang), plain first."""
    out: list[tuple[str, dict | None]] = [("plain", None), KV_MEMORY]
    for name, fields in pruning_methods(budgets):
        out.append((name, fields if name == "full cache" else {**fields, "budget_mode": "history"}))
    for b in budgets:
        # the same IntentKV with the system prompt (the tool docs) compressible: which of the two is right
        out.append(
            (
                f"intentkv-memory+system/dead_slot@{b}",
                {
                    "budget": b,
                    "budget_mode": "history",
                    "system_prompt": "compressible",
                    "scorer": "memory",
                    "layout": "dead_slot",
                },
            )
        )
        # Phase 2's Appendix-B ablations (`residual` off is Phase 1, intentkv-memory) and its adaptive
        # budget, which starts at b and moves within the server's [budget_floor, budget_ceiling]
        learned = {"budget": b, "budget_mode": "history", "scorer": "learned", "layout": "dead_slot"}
        for ablation in ("memory", "x_attn"):
            out.append((f"intentkv-learned-no-{ablation}/dead_slot@{b}", {**learned, "ablation": ablation}))
        out.append((f"intentkv-learned-adaptive/dead_slot@{b}", {**learned, "budget_mode": "adaptive"}))
    return out


def server_of(fields: dict | None) -> str:
    """Which server a method runs on: plain SGLang, ours with intent on, or ours with KV memory on
    (its own: memory records every session's turns, which would cost the other methods)."""
    return "plain" if fields is None else "memory" if "memory" in fields else "intent"


def budget_of(fields: dict | None) -> int | None:
    """The method's history budget (an adaptive one's starting budget); None: no pruning."""
    return None if not fields or fields.get("budget_mode") not in ("history", "adaptive") else fields["budget"]


def session_id(method: str, task_id: str, run: str) -> str:
    """A session per (method, task, run): ids allow letters, digits and . _ : @ + = -"""
    clean = "".join(c if c.isalnum() or c in "._:@+=-" else "-" for c in method)
    return f"{run}:{clean}:{task_id}"


def task_row(method: str, fields: dict | None, task, result: dict, wall_s: float) -> dict:
    steps = result["steps"]
    prompt, cached = sum(s["prompt_tokens"] for s in steps), sum(s["cached_tokens"] for s in steps)
    return {
        "method": method,
        "budget": budget_of(fields),
        "task": task.id,
        "category": task.category,
        "completed": result["reason"] is None,
        "reason": result["reason"],
        "valid": result["valid"],
        "error_type": result.get("error_type"),
        "steps": len(steps),
        "tool_calls": sum(len(s.get("results", [])) for s in steps),
        "pt": max((s["peak_request_tokens"] for s in steps), default=0),
        "eff_live_kv": max((s["live_kv_tokens"] for s in steps), default=0),
        "raw_kv_reads": sum(s["raw_kv_reads"] for s in steps),
        "eff_kv_reads": sum(s["eff_kv_reads"] for s in steps),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_hit": cached / prompt if prompt else 0.0,
        "wall_s": wall_s,
        "f1": result.get("f1"),
        "commit": commit(),  # a resumed file mixes runs
        **event_costs([s["metrics"] for s in steps]),
    }


def event_costs(metrics: list[dict]) -> dict:
    """The compression events' scoring time and the prefill time they follow, summed over the steps
    that had one and a prefill time (0 for methods that never prune)."""
    timed = [m for m in metrics if m.get("compression_events") and m.get("prefill_ms")]
    return {
        "events": len(timed),
        "scoring_ms": sum(m["scoring_ms"] for m in timed),
        "prefill_ms": sum(m["prefill_ms"] for m in timed),
    }


def aggregate(rows: list[dict], agreements: list[dict] = ()) -> list[dict]:
    """One row per method: BCP's Compl / Raw / True Acc (here Raw = accuracy among completed tasks,
    True = accuracy over all, a non-completion counted wrong), the means of the system costs, and
    the next-action agreement with the full cache over every decision point measured."""
    out = []
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == method]
        done = [r for r in rs if r["completed"]]
        mean = lambda key, of=rs: sum(r[key] for r in of) / len(of) if of else None  # noqa: E731
        out.append(
            {
                "method": method,
                "budget": rs[0]["budget"],
                "tasks": len(rs),
                "compl": len(done) / len(rs),
                "raw": sum(r["valid"] for r in done) / len(done) if done else None,
                "true_acc": sum(r["valid"] for r in rs) / len(rs),
                "pt": mean("pt"),
                "eff_live_kv": mean("eff_live_kv"),
                "raw_kv_reads": mean("raw_kv_reads"),
                "eff_kv_reads": mean("eff_kv_reads"),
                "prefix_hit": sum(r["cached_tokens"] for r in rs) / max(sum(r["prompt_tokens"] for r in rs), 1),
                "wall_s": mean("wall_s"),
                "tool_calls": mean("tool_calls"),
                "steps": mean("steps"),
                "f1": mean("f1") if all(r.get("f1") is not None for r in rs) else None,
                # scoring time over the prefill time of the same requests (IntentKV's target: under 5%)
                "scoring_overhead": sum(r.get("scoring_ms", 0) for r in rs) / sum(r.get("prefill_ms", 0) for r in rs)
                if any(r.get("prefill_ms") for r in rs)
                else None,
                "non_completion": {
                    k: sum(r["reason"] == k for r in rs) for k in ("turn_cap", "overflow", "error", "empty")
                },
                **agreement_of([a for a in agreements if a["method"] == method]),
            }
        )
    full = next((r for r in out if r["method"] == REFERENCE), None)
    for r in out:  # ratios to our full cache, as the benchmarks quote them
        r["wall_vs_full"] = r["wall_s"] / full["wall_s"] if full else None
        r["eff_kv_reads_vs_full"] = r["eff_kv_reads"] / full["eff_kv_reads"] if full and full["eff_kv_reads"] else None
    return out


def agreement_of(rows: list[dict]) -> dict:
    points = sum(r["points"] for r in rows)
    return {
        "next_action_agreement": sum(r["agree"] for r in rows) / points if points else None,
        "agreement_points": points,
    }


def agreement(work, task, endpoint: Endpoint, reference: dict, session: str) -> dict:
    """Teacher-forced next-action agreement with the full cache: at each of its decision points the
    method gets the full cache's conversation up to there (in one session, in order, so its pruning
    evolves along that trajectory) and its first call, name and arguments, is compared with the full
    cache's. A refused request counts as a disagreement."""
    agree = 0
    for step in reference["steps"]:
        try:
            reply = endpoint.ask(reference["messages"][: step["prefix"]], work.tools_at(task, step["turn"]), session)
        except Refused:
            continue
        agree += [[c.name, c.arguments] for c in reply.calls][:1] == step["calls"][:1]
    return {"agree": agree, "points": len(reference["steps"])}


def append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


TABLE = (
    "method",
    "tasks",
    "compl",
    "raw",
    "true_acc",
    "f1",
    "next_action_agreement",
    "pt",
    "eff_live_kv",
    "eff_kv_reads_vs_full",
    "prefix_hit",
    "wall_vs_full",
    "scoring_overhead",
    "tool_calls",
)


def table(rows: list[dict], cols: tuple[str, ...] = TABLE) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    """True Acc and next-action agreement against effective live KV, one marker per method and
    budget (the IntentKV paper's figure): grey full cache, red compact, blue dead_slot, green IntentKV,
    purple KV memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    markers = "osD^v<>Xph*P"
    for i, r in enumerate(rows):
        family = r["method"].split("@")[0]
        color = (
            "tab:purple"
            if family == KV_MEMORY[0]
            else "tab:gray"
            if r["budget"] is None
            else "tab:green"
            if "intentkv" in family
            else "tab:blue"
            if "dead_slot" in family
            else "tab:red"
        )
        for ax, key in zip(axes, ("true_acc", "next_action_agreement")):
            if r.get(key) is not None:
                ax.scatter(
                    r["eff_live_kv"],
                    r[key],
                    color=color,
                    marker=markers[i % len(markers)],
                    s=60,
                    label=f"{r['method']} ({r['tasks']} tasks)",
                    alpha=0.8,
                )
    for ax, label in zip(axes, ("True Acc", "next-action agreement with the full cache")):
        ax.set_xlabel("effective live KV (tokens, per-task peak, mean)")
        ax.set_ylabel(label)
        ax.set_ylim(-0.05, 1.05)
    axes[0].legend(fontsize=7, loc="upper right")  # every method has a True Acc marker
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def workload(args):
    """The workload's tasks and runner: the bfcl module, or a BCP-shaped corpus and its questions."""
    if args.workload == "bfcl":
        return bfcl
    if bool(args.bcp_corpus) != bool(args.bcp_queries):
        raise SystemExit("--bcp-corpus and --bcp-queries go together")
    docs = bcp.bcp_corpus(args.bcp_corpus) if args.bcp_corpus else bcp.locomo_corpus()
    todo = bcp.bcp_tasks(args.bcp_queries, args.limit) if args.bcp_queries else bcp.locomo_tasks(args.limit)
    return bcp.Workload(
        bcp.Corpus(docs, args.out / "agent_bcp.search_cache.json"),
        todo,
        llm_judge=args.judge == "llm",
        snippet_words=args.snippet_words,
    )


def start(kind: str, model: str, work: Path):
    model_path = models.fetch(model)
    if kind == "plain":
        spec = models.MODELS.get(model)
        parser = ["--tool-call-parser", spec.tool_call_parser] if spec and spec.tool_call_parser else []
        cmd, env = harness.plain_sglang(
            model_path, *harness.cpu_flags(model_path, "torch_native"), "--enable-cache-report", *parser
        )
        return harness.start(cmd, work / "plain.log", env=env)
    (work / "memory.yaml").write_text(
        to_yaml(INTENT_CONFIG if kind == "intent" else MEMORY_CONFIG, harness.PERSIST_OFF)
    )
    return harness.start(harness.our_command(model, "--memory-config", str(work / "memory.yaml")), work / f"{kind}.log")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=WORKLOADS, default="bfcl")
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument(
        "--methods", nargs="+", default=["*"], help="method names or shell patterns, e.g. plain 'intentkv-*'"
    )
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument(
        "--categories",
        nargs="+",
        default=None,
        help="BFCL categories (default: every development one); bcp: locomo_cat1..4 or bcp",
    )
    ap.add_argument("--tasks", nargs="+", default=["*"], help="task ids or shell patterns, e.g. multi_turn_base_1")
    ap.add_argument("--limit", type=int, default=2, help="tasks per BFCL category / LoCoMo conversation / BCP file")
    ap.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="steps with calls per turn before the turn cap (bfcl: BFCL's 20; bcp: 10)",
    )
    ap.add_argument("--bcp-corpus", type=Path, help="BCP's corpus jsonl (docid, text[, title, url])")
    ap.add_argument("--bcp-queries", type=Path, help="BCP's decrypted queries jsonl (query_id, query, answer)")
    ap.add_argument(
        "--judge",
        choices=("match", "llm"),
        default="match",
        help="bcp: the normalised-match judge, or BCP's LLM judge on the run's own server",
    )
    ap.add_argument(
        "--snippet-words", type=int, default=bcp.SNIPPET_WORDS, help="words of each search hit's text (bcp)"
    )
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--agreement",
        action="store_true",
        help="also measure next-action agreement with the full cache (a teacher-forced pass per method)",
    )
    ap.add_argument(
        "--memory-window",
        type=int,
        default=2,
        help="kv memory: the exchanges (a call and its results) each request carries after the last user message",
    )
    ap.add_argument(
        "--url",
        help="an sgl-memory server already running with intent (and, for kv memory, memory) on; its "
        "radix cache is flushed between methods; default: the benchmark starts its own",
    )
    ap.add_argument(
        "--memory-window-tokens",
        type=int,
        default=None,
        help="kv memory: the most tokens those exchanges hold (older ones are left out; the last is always sent)",
    )
    args = ap.parse_args(argv)
    if args.memory_window < 0:
        ap.error("--memory-window takes a number of exchanges >= 0")
    if args.memory_window_tokens is not None and args.memory_window_tokens < 0:
        ap.error("--memory-window-tokens takes a number of tokens >= 0")

    args.out.mkdir(parents=True, exist_ok=True)
    work = workload(args)
    chosen = [(n, f) for n, f in methods(args.budgets) if any(fnmatch.fnmatchcase(n, p) for p in args.methods)]
    if not chosen:
        raise SystemExit(f"no method matches {args.methods}; methods: {', '.join(n for n, _ in methods(args.budgets))}")
    todo = [
        t
        for t in work.tasks(args.categories, limit=args.limit)
        if any(fnmatch.fnmatchcase(t.id, p) for p in args.tasks)
    ]
    stem = args.out / f"agent_{args.workload}"
    rows_path, traces_path = stem.with_suffix(".tasks.jsonl"), stem.with_suffix(".traces.jsonl")
    agreement_path = stem.with_suffix(".agreement.jsonl")
    done = {(r["method"], r["task"]) for r in read_rows(rows_path)}
    run_id = time.strftime("%Y%m%d%H%M%S")
    steps = {} if args.max_steps is None else {"max_steps": args.max_steps}

    references = {t["task"]: t for t in read_rows(traces_path) if t["method"] == REFERENCE}
    count = None
    if args.memory_window_tokens is not None:
        from transformers import AutoTokenizer

        count = message_tokens(AutoTokenizer.from_pretrained(models.model_dir(args.model)))
    agreed = {(r["method"], r["task"]) for r in read_rows(agreement_path)}

    def wanted(name: str, task) -> bool:
        return (name, task.id) not in done or (args.agreement and name != REFERENCE and (name, task.id) not in agreed)

    def run_methods(url: str, group: list[tuple[str, dict | None]]) -> None:
        for name, fields in group:
            if fields is not None:  # each method starts from an empty tree: none reuses another's prefixes
                requests.post(url + "/flush_cache?timeout=60", timeout=120).raise_for_status()
            endpoint = Endpoint(url, fields, args.max_tokens)
            if server_of(fields) == "memory":
                endpoint.window, endpoint.window_tokens, endpoint.count = (
                    args.memory_window,
                    args.memory_window_tokens,
                    count,
                )
            for task in tqdm([t for t in todo if wanted(name, t)], desc=name):
                if (name, task.id) not in done:
                    t0 = time.perf_counter()
                    result = work.run(task, endpoint, session_id(name, task.id, run_id), **steps)
                    row = task_row(name, fields, task, result, time.perf_counter() - t0)
                    trace = {
                        "workload": args.workload,
                        "model": args.model,
                        "method": name,
                        "fields": fields,
                        "task": task.id,
                        "category": task.category,
                        **result,
                    }
                    append(traces_path, trace)
                    append(rows_path, row)
                    if name == REFERENCE:
                        references[task.id] = trace
                if args.agreement and name != REFERENCE and task.id in references and (name, task.id) not in agreed:
                    score = agreement(
                        work, task, endpoint, references[task.id], session_id(name, task.id, run_id + "-agree")
                    )
                    append(agreement_path, {"method": name, "task": task.id, **score})

    for kind in ("intent", "memory", "plain"):  # the full cache first: the reference the others are compared with
        group = [(n, f) for n, f in chosen if server_of(f) == kind and any(wanted(n, t) for t in todo)]
        if not group:
            continue
        if args.url:
            if kind == "plain":
                raise SystemExit("method plain runs on a plain SGLang server the benchmark starts: leave out --url")
            run_methods(args.url.rstrip("/"), group)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            server = start(kind, args.model, Path(tmp))
            try:
                run_methods(server.url, group)
            finally:
                harness.stop(server)
    rows = aggregate(read_rows(rows_path), read_rows(agreement_path))
    write_json(stem.with_suffix(".json"), {"workload": args.workload, "model": args.model, "rows": rows})
    (stem.with_suffix(".md")).write_text(table(rows))
    plot(rows, stem.with_suffix(".png"), f"{args.workload} on {args.model}")
    print(table(rows))
