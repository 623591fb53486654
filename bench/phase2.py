"""IntentKV Phase 2 on the agent harness: the learned head against Phase 1, the published
heuristics and the full cache, on both workloads, in one run.

Per workload it runs `python -m bench.agent` (same server, tasks and agreement pass for every
method) with: the full cache; per budget IntentKV `learned` (Phase 2), `memory` (Phase 1, which is
also Appendix B's `residual` ablation), the `memory` and `x_attn` ablations of the head, the head
with an adaptive budget starting at that budget, and SnapKV / H2O / StreamingLLM on `dead_slot`.
Budgets are history budgets chosen to bite on each workload: BFCL's history over the first turns
is a few hundred tokens, the BCP-shaped runs' search results a few thousand.

Writes under --out (default bench/results/): `phase2.json` with a list `rows` (method, budget,
workload, tasks, true_acc, next_action_agreement, eff_live_kv, prefix_hit, wall_s, plus KV reads,
the scoring overhead per event and the agreement's point count) and `adaptive_vs_fixed` (each
adaptive run against the fixed-budget head at equal live KV); `phase2.md`; `phase2.png`. The
per-workload files of bench.agent sit in `phase2_bfcl/` and `phase2_bcp/`; a re-run resumes from
them, and once they are complete only rebuilds the summary.

    .venv/bin/python -m bench.phase2 [--workloads bfcl bcp]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.agent import run as agent
from bench.common import RESULTS, write_json

METHODS = [
    "full cache",
    "intentkv-learned*",
    "intentkv-memory/*",
    "snapkv/dead_slot*",
    "h2o/dead_slot*",
    "streaming_llm/dead_slot*",
]
WORKLOADS = {
    # the three BFCL tasks the pruner head never saw (scripts/train_pruner.py holds them out)
    "bfcl": [
        "--budgets",
        "32",
        "128",
        "--limit",
        "200",
        "--max-steps",
        "5",
        "--tasks",
        "multi_turn_base_50",
        "multi_turn_miss_func_100",
        "multi_turn_miss_param_150",
    ],
    # one question from each of three LoCoMo conversations over the search tool
    "bcp": ["--budgets", "256", "1024", "--limit", "1", "--max-steps", "6", "--tasks", "locomo-c[012]-*"],
}
KEYS = (
    "method",
    "budget",
    "workload",
    "tasks",
    "true_acc",
    "next_action_agreement",
    "agreement_points",
    "eff_live_kv",
    "eff_kv_reads_vs_full",
    "prefix_hit",
    "wall_s",
    "wall_vs_full",
    "scoring_overhead",
)


def rows_of(workload: str, out: Path) -> list[dict]:
    result = json.loads((out / f"phase2_{workload}" / f"agent_{workload}.json").read_text())
    return [{k: r.get(k) for k in KEYS} | {"workload": workload} for r in result["rows"]]


def adaptive_vs_fixed(rows: list[dict]) -> list[dict]:
    """Each adaptive run against the learned head at fixed budgets at the same mean effective live
    KV: the fixed runs' agreement interpolated linearly in live KV between the two that bracket it
    (None where none do)."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        fixed = sorted(
            (r for r in rows if r["workload"] == workload and r["method"].startswith("intentkv-learned/")),
            key=lambda r: r["eff_live_kv"],
        )
        for r in (
            r for r in rows if r["workload"] == workload and r["method"].startswith("intentkv-learned-adaptive/")
        ):
            pair = next(
                ((a, b) for a, b in zip(fixed, fixed[1:]) if a["eff_live_kv"] <= r["eff_live_kv"] <= b["eff_live_kv"]),
                None,
            )
            at = None
            if pair and None not in (pair[0]["next_action_agreement"], pair[1]["next_action_agreement"]):
                a, b = pair
                w = (r["eff_live_kv"] - a["eff_live_kv"]) / max(b["eff_live_kv"] - a["eff_live_kv"], 1e-9)
                at = a["next_action_agreement"] + w * (b["next_action_agreement"] - a["next_action_agreement"])
            out.append(
                {
                    "workload": workload,
                    "method": r["method"],
                    "eff_live_kv": r["eff_live_kv"],
                    "next_action_agreement": r["next_action_agreement"],
                    "fixed_at_equal_live_kv": at,
                    "fixed": [[f["budget"], f["eff_live_kv"], f["next_action_agreement"]] for f in fixed],
                }
            )
    return out


def plot(rows: list[dict], path: Path) -> None:
    """Next-action agreement against effective live KV, a panel per workload; Phase 2 green, its
    ablations and adaptive budget light green, Phase 1 blue, the heuristics red, full cache grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(7 * len(workloads), 5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for r in (r for r in rows if r["workload"] == workload and r["next_action_agreement"] is not None):
            family = r["method"].split("/")[0]
            color = {"intentkv-learned": "tab:green", "intentkv-memory": "tab:blue", "full cache": "tab:gray"}.get(
                family, "yellowgreen" if family.startswith("intentkv-learned") else "tab:red"
            )
            ax.scatter(r["eff_live_kv"], r["next_action_agreement"], color=color, s=50, alpha=0.8)
            ax.annotate(
                r["method"].replace("/dead_slot", ""),
                (r["eff_live_kv"], r["next_action_agreement"]),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
        ax.set_title(f"{workload} ({max(r['tasks'] for r in rows if r['workload'] == workload)} tasks)")
        ax.set_xlabel("effective live KV (tokens, per-task peak, mean)")
        ax.set_ylabel("next-action agreement with the full cache")
        ax.set_ylim(-0.05, 1.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.phase2", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    for workload in args.workloads:
        agent.main(
            [
                "--workload",
                workload,
                *WORKLOADS[workload],
                "--agreement",
                "--methods",
                *METHODS,
                "--out",
                str(args.out / f"phase2_{workload}"),
            ]
        )
    rows = [row for w in WORKLOADS if (args.out / f"phase2_{w}").exists() for row in rows_of(w, args.out)]
    write_json(args.out / "phase2.json", {"rows": rows, "adaptive_vs_fixed": adaptive_vs_fixed(rows)})
    (args.out / "phase2.md").write_text(agent.table(rows, KEYS))
    plot(rows, args.out / "phase2.png")
    print(agent.table(rows, KEYS))


if __name__ == "__main__":
    main()
