"""SentenceKV at agents' decision points: each decode-time method's greedy decoding against the full
cache's over the same cached prompt, at equal KV read per step.

The needle haystacks of bench/sentencekv.py do not separate the methods (every one finds the
needle where the full cache does). Here the prompts are bench/fidelity's decision points (`bcp` by
default: an oracle's search for a LoCoMo question, the evidence documents it reads, its answer;
histories of about 0.5-5k tokens) and the measure is fidelity to the full cache on what the agent
does next. Per trajectory (per conversation for LoCoMo's questions) the cache is flushed; per
point the history is prefilled once (a point extends the one before it, whose prefix the tree
holds), then every method decodes greedily as many tokens as the gold action has (at most
--max-new-tokens) over that cached prompt, with the top-20 log-probabilities of every step. Per point and method:
- `full_match`: the decoded tokens are the full cache's, all of them;
- `agreement`: the share of positions where they are (by position);
- `kl`: the mean, over the steps before the first difference (where the method has generated the
  same tokens as the full cache), of KL(full || method) over the two top-20 lists (common.kl).
  Step 0 is left out: its token comes from the prefill, which every method computes over the whole
  prompt (SentenceKV and pages select from step 1);
- `gold_match`: the decoded tokens are the gold action's (an accuracy, meaningful where the full
  cache's are: the tasks the model can do);
- `kv_read_per_step` (positions a step reads per layer, mean over steps) and `live_kv`.
Methods, per budget b (the prompt tokens a step reads from what it retrieves, besides the always-read
sinks and window, as in bench/sentencekv.py): `quest@b` (pages by key bounds, per step) and
`sentencekv@b` (the paper's method), against `full`; with --system also each with the system
message always read (`quest+system@b`, `sentencekv+system@b`: the section's `system` setting).
SnapKV is not here: it is intent pruning, whose decision-point fidelity bench/fidelity measures,
and with intent on, every request would prefill its latest message again (intent scores from its
queries), which at bcp's points is the tool's result of about 2.6k tokens; the server runs
SentenceKV alone. Intervals: 95% bootstrap over trajectories (the points of one trajectory are not
independent); gold_match paired against the full cache's, a method's agreement and KL against
its peers' at the same budget (PEERS). Points whose history is shorter than --min-prompt are not
scored (at the largest budget every method would read about all of it; bcp's searches).

    .venv/bin/python -m bench.sentencekv_points [--workloads bcp] [--bcp-questions 2] [--budgets 256] [--system]
    .venv/bin/python -m bench.sentencekv_points --rows bench/results/sentencekv_points.json  # summarise again

Writes bench/results/sentencekv_points.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tqdm import tqdm

from bench import harness
from bench.common import RESULTS, bootstrap, commit, generate, kl, ok, write_json
from bench.fidelity import points as P
from bench.sentencekv import methods, reads_and_live
from sgl_memory import models
from sgl_memory.core.config import to_yaml
from sgl_memory.sentencekv.settings import SentenceKVConfig

TOP = 20
FULL = "full"
METRICS = ("full_match", "agreement", "kl", "gold_match", "kv_read_per_step", "live_kv")
SYSTEM = "+system"  # a method with the system message always read (the section's `system`)
# what each method is paired against at the same budget: SentenceKV against the baseline the paper
# measures it against (Quest-style pages), a `system` variant against its peer with the same reads
# and against itself without them
PEERS = {
    "sentencekv": ("quest",),
    f"sentencekv{SYSTEM}": (f"quest{SYSTEM}", "sentencekv"),
    f"quest{SYSTEM}": ("quest",),
}
PAIRED = ("agreement", "kl")  # paired against the peer's at the same points


def decode(server, ids: list[int], field: dict, tokens: int) -> dict:
    """Greedy decoding of `tokens` tokens with the top-TOP log-probabilities of every step."""
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "top_logprobs_num": TOP,
        "sgl_memory": field,
        "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True},
    }
    out = ok(server.post("/generate", body, timeout=3600), "/generate").json()
    meta = out["meta_info"]
    return {
        "ids": out["output_ids"],
        "top": [{tok: lp for lp, tok, *_ in step} for step in meta["output_top_logprobs"]],
        "meta": meta,
    }


def compare(run: dict, full: dict, gold: list[int]) -> dict:
    """A method's decoding against the full cache's (and the gold action) at one point."""
    a, b = run["ids"], full["ids"]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
    # step i's distribution follows the same tokens in both runs only while i <= the first difference
    kls = [kl(full["top"][i], run["top"][i]) for i in range(1, min(same + 1, len(b)))]
    return {
        "full_match": float(a == b),
        "agreement": sum(x == y for x, y in zip(a, b)) / len(b),
        "kl": sum(kls) / len(kls) if kls else None,
        "gold_match": float(a == gold[: len(a)]),
    }


def run(args) -> list[dict]:
    from transformers import AutoTokenizer

    path = models.fetch(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    trajectories = P.load(tokenizer, args.workloads, args)
    named = [(FULL, methods(args.budgets[0], args.keep_factor)[0][1])]
    for b in args.budgets:
        for name, field in methods(b, args.keep_factor):
            if name in ("quest", "sentencekv"):
                named.append((f"{name}@{b}", field))
                if args.system:
                    named.append((f"{name}{SYSTEM}@{b}", {"sentencekv": {**field["sentencekv"], "system": True}}))
    scored = sum(len(pt.history) >= args.min_prompt for t in trajectories for pt in t.points)
    longest = max(len(pt.history) for t in trajectories for pt in t.points)
    total = str(2 * (longest + args.max_new_tokens) + 64)  # room for the longest prompt and what the tree still holds
    log_dir = Path(tempfile.mkdtemp(prefix="sentencekv-points-"))  # the server's log and config, not results
    config = log_dir / "sentencekv.memory.yaml"
    config.write_text(to_yaml(SentenceKVConfig(enabled=True), harness.PERSIST_OFF))
    print(
        f"{scored} points of {len(trajectories)} trajectories, longest {longest} tokens; server log: {log_dir}",
        flush=True,
    )
    rows = []
    server = harness.start(
        harness.our_command(args.model, "--memory-config", str(config), "--max-total-tokens", total),
        log_dir / "sentencekv.ours.log",
    )
    try:
        with tqdm(total=scored, desc="points") as bar:
            group = None
            for t in trajectories:
                # a group's trajectories (LoCoMo's questions of one conversation) share their long prefix
                if not t.group or t.group != group:
                    ok(server.post("/flush_cache?timeout=600", {}), "/flush_cache")
                group = t.group
                for i, pt in enumerate(t.points):
                    if len(pt.history) < args.min_prompt:
                        continue  # every method reads about all of a short prompt; the next point prefills it
                    generate(server, pt.history, 1, timeout=3600)
                    tokens = min(len(pt.gold), args.max_new_tokens)
                    runs = {name: decode(server, pt.history, field, tokens) for name, field in named}
                    for name, r in runs.items():
                        read, live = reads_and_live(name.split("@")[0].removesuffix(SYSTEM), {"meta": r["meta"]})
                        rows.append(
                            {
                                "workload": t.workload,
                                "trajectory": t.id,
                                "point": i,
                                "label": pt.label,
                                "method": name,
                                "prompt_tokens": len(pt.history),
                                "tokens": tokens,
                                "kv_read_per_step": read,
                                "live_kv": live,
                                **compare(r, runs[FULL], pt.gold),
                            }
                        )
                    bar.update()
    finally:
        harness.stop(server)
    return rows


def interval(clusters: list[list[float]]) -> dict:
    mean, lo, hi = bootstrap(clusters)
    return {"mean": mean, "ci95": [lo, hi]}


def summarise(rows: list[dict]) -> list[dict]:
    """Per workload and method: each metric's mean with its interval over trajectories; gold_match
    paired against the full cache's, and over the points where the full cache's is gold; a method
    with peers (PEERS) also paired against each (`paired`)."""
    out = []
    at = {(r["method"], r["trajectory"], r["point"]): r for r in rows}

    def full(r: dict) -> dict:
        return at[(FULL, r["trajectory"], r["point"])]

    for workload in dict.fromkeys(r["workload"] for r in rows):
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["workload"] == workload and r["method"] == method]
            trajs = list(dict.fromkeys(r["trajectory"] for r in mine))

            def clusters(value, keep=lambda r: True):
                return [
                    [value(r) for r in mine if r["trajectory"] == t and keep(r) and value(r) is not None] for t in trajs
                ]

            row = {
                "workload": workload,
                "method": method,
                "n": len(mine),
                "trajectories": len(trajs),
                "prompt_tokens": sum(r["prompt_tokens"] for r in mine) / len(mine),
            }
            for key in METRICS:
                row[key] = interval(clusters(lambda r, k=key: r[k]))
            row["gold_match_minus_full"] = interval(clusters(lambda r: r["gold_match"] - full(r)["gold_match"]))
            solved = clusters(lambda r: r["gold_match"], lambda r: full(r)["gold_match"] == 1.0)
            row["gold_match_where_full_solves"] = {**interval(solved), "n": sum(map(len, solved))}
            family, _, budget = method.partition("@")
            row["paired"] = []
            for peer in (f"{p}@{budget}" for p in PEERS.get(family, ())):
                if not any(r["method"] == peer for r in rows):
                    continue
                diffs = {"peer": peer}
                for key in PAIRED:

                    def diff(r, k=key):
                        other = at[(peer, r["trajectory"], r["point"])][k]
                        return None if r[k] is None or other is None else r[k] - other

                    diffs[key] = interval(clusters(diff))
                row["paired"].append(diffs)
            out.append(row)
    return out


def markdown(summary: list[dict], args, rows_commit: str) -> str:
    def cell(v, fmt=".2f"):
        return f"{v['mean']:{fmt}} [{v['ci95'][0]:{fmt}}, {v['ci95'][1]:{fmt}}]"

    lines = [
        f"# SentenceKV at decision points ({args.model}, commit {rows_commit})",
        "",
        f"Greedy decoding of the gold action's length (at most {args.max_new_tokens} tokens) over the same cached "
        f"prompt; SentenceKV keep_factor {args.keep_factor}. Intervals: 95% bootstrap over trajectories. KL: steps 1.. "
        "before the first difference from the full cache, top-20 lists. gold | full solves: the points where the full "
        f"cache decodes the gold action. `{SYSTEM}`: the system message always read. Paired: the method minus a peer "
        "at the same points and budget (SentenceKV against Quest-style pages; a system variant also against itself "
        "without).",
        "",
        "| workload | method | N points | full match | agreement | KL | gold match "
        "| gold - full | gold \\| full solves | KV read / step | live KV |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        solved = r["gold_match_where_full_solves"]
        lines.append(
            f"| {r['workload']} | {r['method']} | {r['n']} ({r['trajectories']} traj.) | {cell(r['full_match'])} "
            f"| {cell(r['agreement'])} | {cell(r['kl'], '.3f')} | {cell(r['gold_match'])} "
            f"| {cell(r['gold_match_minus_full'], '+.2f')} | {cell(solved)} (N={solved['n']}) "
            f"| {r['kv_read_per_step']['mean']:.0f} | {r['live_kv']['mean']:.0f} |"
        )
    lines += ["", "| workload | method | minus | agreement | KL |", "|---|---|---|---|---|"]
    for r in summary:
        for d in r["paired"]:
            lines.append(
                f"| {r['workload']} | {r['method']} | {d['peer']} | {cell(d['agreement'], '+.3f')} "
                f"| {cell(d['kl'], '+.3f')} |"
            )
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path) -> None:
    """Per metric, a group of bars per workload: every method but the full cache, with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (
        ("agreement", "greedy agreement with the full cache"),
        ("full_match", "whole action = full cache's"),
        ("kl", "KL(full || method), steps before the first difference"),
    )
    workloads = list(dict.fromkeys(r["workload"] for r in summary))
    names = list(dict.fromkeys(r["method"] for r in summary if r["method"] != FULL))
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4))
    for ax, (key, title) in zip(axes, keys):
        for i, name in enumerate(names):
            mine = [next(r for r in summary if r["workload"] == w and r["method"] == name) for w in workloads]
            ax.bar(
                [x + i * width for x in range(len(workloads))],
                [r[key]["mean"] for r in mine],
                width,
                yerr=[
                    [r[key]["mean"] - r[key]["ci95"][0] for r in mine],
                    [r[key]["ci95"][1] - r[key]["mean"] for r in mine],
                ],
                capsize=3,
                label=name,
            )
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(workloads))], workloads)
        ax.set_title(title, fontsize=9)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.sentencekv_points", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--workloads", nargs="+", default=["bcp"], choices=sorted(P.SOURCES))
    P.add_size_options(ap)
    ap.set_defaults(bcp_questions=2, bfcl_per_category=2, textworld_games=2, locomo_questions=4)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256])
    ap.add_argument("--keep-factor", type=float, default=2.0)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=1024, help="points with a shorter history are not scored")
    ap.add_argument(
        "--system", action="store_true", help=f"also each method with the system message always read ({SYSTEM})"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "sentencekv_points.json")
    ap.add_argument(
        "--rows",
        type=Path,
        help="summarise the rows of this earlier result again (no server; its settings and commit kept)",
    )
    args = ap.parse_args(argv)
    if args.rows:
        earlier = json.loads(args.rows.read_text())
        rows, rows_from = earlier["rows"], earlier.get("rows_from", earlier["provenance"])
        for key in ("model", "budgets", "keep_factor", "max_new_tokens", "workloads"):
            setattr(args, key, earlier[key])
        args.system = earlier.get("system", False)  # results from before the flag ran without it
    else:
        rows, rows_from = run(args), {"commit": commit()}
    summary = summarise(rows)
    write_json(
        args.out,
        {
            "model": args.model,
            "budgets": args.budgets,
            "keep_factor": args.keep_factor,
            "system": args.system,
            "max_new_tokens": args.max_new_tokens,
            "workloads": args.workloads,
            "rows_from": rows_from,
            "summary": summary,
            "rows": rows,
        },
    )
    args.out.with_suffix(".md").write_text(markdown(summary, args, rows_from["commit"]))
    plot(summary, args.out.with_suffix(".png"))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
