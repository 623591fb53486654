"""IntentKV benchmark: multi-turn agent sessions whose tool outputs grow the context, one run.

Each session is a scripted agent trajectory (teacher-forced, so every configuration sees the same
prompts): a system prompt, a task, then per turn an assistant tool call, the tool's output (a file
listing with facts) and a follow-up question about a fact from an earlier turn; the server
generates the answer. Configurations, side by side on one server (the tree is flushed between them):
plain SGLang with full cache (its own server), our full cache, StreamingLLM / SnapKV / H2O on
`compact` and on `dead_slot`, IntentKV `query` and `memory` (dead_slot), at two budgets.

Reported per configuration (the IntentKV paper's metrics): PT (peak request tokens), live KV after
pruning, raw and effective KV reads over decode steps, radix prefix-hit rate, wall time, and
fidelity to our full cache (greedy-token agreement of the continuations; KL of the first decode
step's next-token distribution over the union of both top-20 lists). Writes
bench/results/intent_sessions.json and .png.

    .venv/bin/python bench/intent_sessions.py [--sessions 3] [--turns 8] [--budgets 512 1024]
"""

from __future__ import annotations

import argparse
import random
import re
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from common import RESULTS, kl, kv_costs, ok, pruning_methods, write_json
from sgl_memory import models
from sgl_memory.core.config import to_yaml
from sgl_memory.intent.settings import IntentConfig
from bench import harness

GEN_TOKENS = 16
TOP = 20

FILES = "alpha beta gamma delta omega sigma kappa theta".split()
OWNERS = "Ana Bo Chen Dee Eli Fay Gus Hal".split()


def trajectory(session: int, turns: int, seed: int) -> list[list[dict]]:
    """The chat messages of each turn's request: turn t holds every earlier turn plus its own."""
    rng = random.Random(seed * 1000 + session)
    facts: list[tuple[str, str, int]] = []
    messages = [
        {
            "role": "system",
            "content": "You are a code-audit agent. Use the read_file tool, keep track of owners and "
            "line counts, and answer questions briefly.",
        },
        {"role": "user", "content": f"Task {session}: audit the repository and answer my questions as you go."},
    ]
    requests, answer = [], ""
    for turn in range(turns):
        name = f"{rng.choice(FILES)}_{turn}.py"
        owner, lines = rng.choice(OWNERS), rng.randint(10, 999)
        facts.append((name, owner, lines))
        body = "\n".join(
            f"{i:03d}: def {rng.choice(FILES)}_{rng.randint(0, 99)}(x): "
            f"return x * {rng.randint(2, 9)}  # {rng.choice(OWNERS)}"
            for i in range(12)
        )
        messages += [
            {"role": "assistant", "content": f'{answer}read_file(path="{name}")'},
            {
                "role": "user",
                "content": f"<tool_response>\nfile {name}, owner {owner}, {lines} lines\n{body}\n</tool_response>",
            },
        ]
        asked = rng.choice(facts)
        question = {"role": "user", "content": f"Who owns {asked[0]} and how many lines does it have?"}
        requests.append(messages + [question])
        messages = messages + [question]
        answer = f"{asked[1]}, {asked[2]} lines. "
    return requests


def run_config(server, prompts: list[list[list[int]]], memory: dict | None, tag: str) -> dict:
    # every configuration starts from an empty tree: no run may reuse another's (pruned) prefixes
    ok(server.post("/flush_cache?timeout=60", {}), f"/flush_cache before {tag}")
    rows, t0 = [], time.perf_counter()
    for s, turns in enumerate(prompts):
        for ids in turns:
            body = {
                "input_ids": ids,
                "return_logprob": True,
                "top_logprobs_num": TOP,
                "sampling_params": {"temperature": 0, "max_new_tokens": GEN_TOKENS, "ignore_eos": True},
            }
            if memory is not None:
                # a session id of the configuration's name in the characters ids may use
                body["sgl_memory"] = dict(memory, session_id=re.sub(r"[^A-Za-z0-9._:@+=-]", "-", f"{tag}-{s}"))
            r = server.post("/generate", body)
            r.raise_for_status()
            out = r.json()
            meta = out["meta_info"]
            rows.append(
                {
                    "prompt_tokens": meta["prompt_tokens"],
                    "cached_tokens": meta["cached_tokens"],
                    "latency_s": meta["e2e_latency"],
                    "output_ids": out["output_ids"],
                    "top1": {str(t): lp for lp, t, *_ in meta["output_top_logprobs"][1]},
                    "sgl_memory": meta.get("sgl_memory"),
                }
            )
    return {"wall_s": time.perf_counter() - t0, "requests": rows}


def summarise(run: dict, reference: dict | None, prompt_lens: list[int]) -> dict:
    reqs = run["requests"]
    metrics = [r["sgl_memory"] or {} for r in reqs]
    out_len = [len(r["output_ids"]) for r in reqs]
    costs = [kv_costs(m, p, n) for m, p, n in zip(metrics, prompt_lens, out_len)]
    live, raw, eff = ([c[k] for c in costs] for k in ("live_kv_tokens", "raw_kv_reads", "eff_kv_reads"))
    summary = {
        "requests": len(reqs),
        "mean_peak_request_tokens": sum(p + n for p, n in zip(prompt_lens, out_len)) / len(reqs),
        "max_peak_request_tokens": max(p + n for p, n in zip(prompt_lens, out_len)),
        "mean_live_kv_tokens": sum(live) / len(live),
        "max_live_kv_tokens": max(live),
        "raw_kv_reads": sum(raw),
        "eff_kv_reads": sum(eff),
        "prefix_hit_rate": sum(r["cached_tokens"] for r in reqs) / sum(r["prompt_tokens"] for r in reqs),
        "wall_s": run["wall_s"],
        "compression_events": sum(m.get("compression_events", 0) for m in metrics),
        "scoring_ms_total": sum(m.get("scoring_ms", 0.0) for m in metrics),
    }
    if reference is not None:
        refs = reference["requests"]
        agree = [sum(a == b for a, b in zip(r["output_ids"], f["output_ids"])) / GEN_TOKENS for r, f in zip(reqs, refs)]
        summary["greedy_agreement"] = sum(agree) / len(agree)
        summary["next_token_kl"] = sum(kl(f["top1"], r["top1"]) for r, f in zip(reqs, refs)) / len(reqs)
    return summary


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"])
    panels = [
        ("prefix_hit_rate", "prefix-hit rate"),
        ("eff_kv_reads", "effective KV reads"),
        ("mean_live_kv_tokens", "mean live KV tokens"),
        ("wall_s", "wall time (s)"),
        ("greedy_agreement", "greedy agreement with full cache"),
        ("next_token_kl", "next-token KL vs full cache"),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3 * len(panels)), sharex=True)
    for ax, (key, title) in zip(axes, panels):
        values = [result["summary"][n].get(key, 0.0) for n in names]
        colors = [
            "tab:gray"
            if "full" in n
            else "tab:green"
            if "intentkv" in n
            else "tab:blue"
            if "dead_slot" in n
            else "tab:red"
            for n in names
        ]
        ax.bar(range(len(names)), values, color=colors)
        ax.set_title(title)
        if key == "next_token_kl":
            ax.set_yscale("symlog", linthresh=1e-6)  # spans 1e-6 .. 0.2
    axes[-1].set_xticks(range(len(names)), names, rotation=70, ha="right", fontsize=8)
    fig.suptitle(
        f"IntentKV on {result['model']}: {result['sessions']} sessions x {result['turns']} turns "
        "(red: compact, blue: dead_slot, green: IntentKV)"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-plain", action="store_true", help="leave out the plain-SGLang server")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    model_path = models.fetch(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [
        [
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
            for m in trajectory(s, args.turns, args.seed)
        ]
        for s in range(args.sessions)
    ]
    prompt_lens = [len(ids) for turns in prompts for ids in turns]
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_plain:
            cmd, env = harness.plain_sglang(model_path, *harness.cpu_flags(model_path, "torch_native"))
            server = harness.start(cmd, Path(tmp) / "plain.log", env=env)
            try:
                runs["plain sglang (full cache)"] = run_config(server, prompts, None, "plain")
            finally:
                harness.stop(server)
        config = Path(tmp) / "memory.yaml"
        config.write_text(to_yaml(IntentConfig(enabled=True), harness.PERSIST_OFF))
        server = harness.start(harness.our_command(args.model, "--memory-config", str(config)), Path(tmp) / "ours.log")
        try:
            for name, memory in tqdm(pruning_methods(args.budgets), desc="configurations"):
                runs[name] = run_config(server, prompts, memory, name)
        finally:
            harness.stop(server)
    reference = runs["full cache"]
    result = {
        "model": args.model,
        "sessions": args.sessions,
        "turns": args.turns,
        "budgets": args.budgets,
        "gen_tokens": GEN_TOKENS,
        "prompt_tokens": {"mean": sum(prompt_lens) / len(prompt_lens), "max": max(prompt_lens)},
        "summary": {name: summarise(run, reference, prompt_lens) for name, run in runs.items()},
        "runs": runs,
    }
    full = result["summary"]["full cache"]
    for s in result["summary"].values():
        s["wall_vs_full"] = s["wall_s"] / full["wall_s"]
        s["eff_reads_vs_full"] = s["eff_kv_reads"] / full["eff_kv_reads"]
    RESULTS.mkdir(exist_ok=True)
    write_json(RESULTS / "intent_sessions.json", result)
    plot(result, RESULTS / "intent_sessions.png")
    keys = (
        "prefix_hit_rate",
        "mean_live_kv_tokens",
        "eff_reads_vs_full",
        "wall_vs_full",
        "greedy_agreement",
        "next_token_kl",
    )
    for name, s in result["summary"].items():
        print(f"{name:38s} " + "  ".join(f"{k}={s.get(k, float('nan')):.4g}" for k in keys))


if __name__ == "__main__":
    main()
