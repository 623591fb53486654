"""Decision-point fidelity: each method scored against the full cache at the points of gold trajectories.

    .venv/bin/python -m bench.fidelity [--quick] [--workloads bfcl locomo] [--budgets 32 128]

All methods run on one sgl-memory server with intent on (KV memory's on a second one, a restored
session's on one per store format, after), each trajectory in one session per method (sessions
keep their pruned paths apart; what a path held before its first pruning is shared, so every
method starts from the reference's own KV).
At each point, as the server does it for an agent:
- request A is the agent's request there (the gold history, rendered by the chat template): its
  prefill, over the session's path as earlier points' events left it, gives the distribution of
  the gold action's first token (the agent's first token is sampled from the prefill), and its
  compression event prunes the session;
- request B (`readonly`) is the prompt plus the gold action, with input log-probabilities: the
  gold tokens are prefilled over the path A's event left, attending to exactly the live KV the
  agent's decode would read there, and B changes nothing in the session.
The next point's A then prefills the gold action and the new messages over that path, as the
agent's next request would. Where a workload's points carry them (LoCoMo), KV memory and text
retrieval serve the same gold action from other prompts: KV memory the question alone over what
it retrieves from the conversation's memory (one session per conversation, ingested once;
`store: false`, so questions stay independent; rows record whether B retrieved the blocks A
did), by retrieval unit (blocks, whole lines, lines with their turn's first block), placement
and with KEEP's repair; text retrieval the question over the turns MiniLM picks; both place at most 1024
tokens. An 8-bit pool's method (SGLang's fp8_e4m3, fp8_e5m2; our int8) is the full-cache session on a
server whose live KV pool is of that `--kv-cache-dtype`. A persisted method (q4, q8, bf16) is the full-cache session
on a server with persistence in that format, the tree flushed after every point: each point's A
restores the history the session's earlier points wrote (dequantized, as after a restart;
`restored_tokens` in its rows) and prefills only what is new. The reference is the full cache (a
budget no request reaches) in its own session, run first; a second full-cache session measures what
numerics alone move (it prefills the latest message over the reference's cached prefix, in other
chunks).

Per point and method (`<out>.points.jsonl`, appended as each trajectory ends; a re-run skips what it
holds):
- `gold_logprob`: the gold action's log-likelihood (sum over its tokens);
- `gold_match`: greedy decoding would emit exactly the gold action (the argmax is the gold token at
  every gold position, teacher-forced: the same condition as a greedy decode reproducing it);
- `full_match`: the method's argmax equals the full cache's at every gold position;
- `token_agreement`: the share of gold positions where it does (greedy agreement, teacher-forced);
- `kl`: mean over gold positions of KL(full cache || method) over the full cache's top-K tokens
  and one bucket for the rest (a lower bound of the whole-vocabulary KL);
- `live_kv`: prompt positions live after the point's event;
- `dtype`: the servers' compute dtype (`/sgl_memory/info`). A file holds one: bf16 rounds a point
  differently with how its prompt was prefilled (docs/getting-started.md), so a method is only paired
  with a reference of its own dtype; a run on a machine of another dtype stops before it scores.
`<out>` holds one row per (workload, method, budget): means with 95% bootstrap intervals
(trajectories resampled: points of one session are not independent) and paired differences to the
full cache; `.md` the table, `.png` the plot.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from bench.common import FULL_BUDGET, RESULTS, bootstrap, commit, ok, read_rows, write_json
from sgl_memory import models
from sgl_memory.core.config import to_yaml
from sgl_memory.intent.settings import IntentConfig
from sgl_memory.keep.settings import KeepConfig
from sgl_memory.memart.settings import MemArtConfig
from sgl_memory.persist.settings import PersistConfig
from bench import harness

from . import points as P

TOP_K = 20  # reference log-probabilities per gold position: the KL's support
CONFIG = IntentConfig(enabled=True, budget_floor=16)
# KV memory's methods run on a server of their own (after the others): with memory on, every
# full-history request of a session is recorded into its pool, a worker pass over the whole
# transcript per pruned session that the pruning methods do not need
# transcript; blocks are cut at lines, so that a placed block never holds the end of one line and
# the start of the next, and a method may place whole lines (memory.unit)
MEMORY_CONFIG = (CONFIG, MemArtConfig(enabled=True, cut="lines"), KeepConfig(enabled=True))
# a restored session's methods: the store's format is the server's, one server per format (its
# directory is added per run: a fresh store, so every restore is of this run's writes)
PERSISTED = ("q4", "q8", "bf16")
# an 8-bit live pool's methods: the full cache on a server whose pool is of that KV dtype (SGLang's
# fp8 or our int8; a pool's dtype is fixed at its start, so one server per dtype)
POOL_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")
SECTIONS: dict[str, tuple[object, ...]] = {
    "intent": (CONFIG, harness.PERSIST_OFF),
    "memory": (*MEMORY_CONFIG, harness.PERSIST_OFF),
    **{f"persist {q}": (CONFIG, PersistConfig(enabled=True, quant=q)) for q in PERSISTED},
    **{f"pool {d}": (CONFIG, harness.PERSIST_OFF) for d in POOL_DTYPES},
}
# a server's launch flags beyond its config
FLAGS = {f"pool {d}": ("--kv-cache-dtype", d) for d in POOL_DTYPES}
SERVERS = {name: to_yaml(*sections) for name, sections in SECTIONS.items()}


def server_config(name: str, head: Path | None, store: Path) -> str:
    """A server's config for a run: its SECTIONS, intent with the run's learned head (if one is
    given), a persisting server with its store in the run's `store` folder."""

    def run_section(section: object) -> object:
        if head is not None and isinstance(section, IntentConfig):
            return replace(section, head=str(head.resolve()))
        if name.startswith("persist") and isinstance(section, PersistConfig):
            return replace(section, dir=str(store / name.split()[1]))
        return section

    return to_yaml(*map(run_section, SECTIONS[name]))


BASELINES = ("streaming_llm", "snapkv", "h2o", "random")
INTENT = ("memory", "memory_pool", "query", "learned")
REFERENCE = "full cache"
NOISE = "full cache (2nd session)"
METRICS = ("gold_logprob", "gold_match", "full_match", "token_agreement", "kl")
DEFAULT = "intentkv-memory"  # IntentKV's rule as published: every other method is also paired against it
TEXT = "text retrieval"  # the baseline KV memory must beat (issue 29): paired against it where it ran
# KV memory places at most as many tokens as text retrieval picks (points.TEXT_BUDGET), headers
# included; the ranking it walks is long enough that the token budget, not top_k, binds
MEMORY_TOP_K = 1024


@dataclass(frozen=True)
class Method:
    name: str
    budget: int | None  # the history budget of a pruning method
    fields: dict  # the request's sgl_memory fields besides the session
    prompt: str = "history"  # the point's prompt it serves: the history, or one of Point.alternates
    server: str = "intent"  # the SERVERS config it needs

    @property
    def restores(self) -> bool:
        """Each point's history comes back from the store: the tree is flushed after every point,
        so the next one restores what the session wrote (as after a restart) and prefills the rest."""
        return self.server.startswith("persist")

    @property
    def recalls(self) -> bool:
        """It serves from KV memory: its session is the trajectory group's memory (ingested once),
        not the trajectory's own, on the memory server."""
        return "memory" in self.fields


def methods(budgets: list[int]) -> list[Method]:
    """The reference first. KV memory and text retrieval run where the points carry their prompts."""
    full = {"budget": FULL_BUDGET}
    out = [Method(REFERENCE, None, full), Method(NOISE, None, full)]
    for b in budgets:
        pruned = {"budget": b, "budget_mode": "history", "layout": "dead_slot"}
        out += [Method(f"intentkv-{s}", b, {**pruned, "scorer": s}) for s in INTENT]
        out.append(Method("intentkv-learned-adaptive", b, {**pruned, "scorer": "learned", "budget_mode": "adaptive"}))
        out += [Method(s, b, {**pruned, "scorer": s}) for s in BASELINES]
    retrieve = {"mode": "retrieve", "top_k": MEMORY_TOP_K, "placed_tokens": P.TEXT_BUDGET, "store": False}
    out += [Method(f"persisted {q}", None, full, server=f"persist {q}") for q in PERSISTED]
    out += [Method(f"{d} pool", None, full, server=f"pool {d}") for d in POOL_DTYPES]
    out += [
        Method(name, None, {**full, "memory": {**retrieve, **MEMORY_DEFAULTS, **memory}}, "question", "memory")
        for name, memory in MEMORY_METHODS.items()
    ]
    large = f"@{P.LARGE_BUDGET}"
    out += [Method(TEXT, None, full, "text"), Method(TEXT + " " + large, None, full, "text" + large)]
    return out


# KV memory by retrieval unit (memory.unit, memory.header), placement and repair, all at the same
# placed tokens; the other settings named, so that a change of the server's defaults leaves them
MEMORY_METHODS = {
    "kv memory, blocks": {"unit": "block"},
    "kv memory, lines": {"unit": "line"},
    "kv memory, lines + turn header": {"unit": "line", "header": "turn"},
    "kv memory, lines after system": {"unit": "line", "placement": "after_system"},
    "kv memory, lines + keep": {"unit": "line", "recompute": "keep"},
    "kv memory, lines + full recompute": {"unit": "line", "recompute": "full"},
    "kv memory, lines + starts": {"unit": "line", "recompute": "starts"},
    f"kv memory, lines @{P.LARGE_BUDGET}": {"unit": "line", "placed_tokens": P.LARGE_BUDGET},
    f"kv memory, lines + turn header @{P.LARGE_BUDGET}": {
        "unit": "line",
        "header": "turn",
        "placed_tokens": P.LARGE_BUDGET,
    },
}
MEMORY_DEFAULTS = {"header": "none", "placement": "first", "recompute": "none"}


def post(server, path: str, body: dict):
    return ok(server.post(path, body, timeout=3600), path)


def generate(server, body: dict) -> dict:
    return post(server, "/generate", body).json()["meta_info"]


def _memory(field: dict, readonly: bool = False) -> dict:
    """The request's sgl_memory field (readonly needs a session: a sessionless one changes nothing)."""
    return {"sgl_memory": {**field, "readonly": True} if readonly and "session_id" in field else field}


def _logprobs(entries) -> dict[int, float]:
    return {tok: lp for lp, tok, *_ in entries}


def score_point(server, pt: P.Point, prompt: list[int], field: dict, ref: dict | None) -> dict:
    """Per gold position, with `prompt` before the gold action: the gold token's log-probability,
    the argmax, and the log-probabilities of the reference's top tokens (with `ref`) or the top
    TOP_K (without: this is the reference)."""
    n = len(pt.gold)
    top = TOP_K if ref is None else 1
    asked = sorted({pt.gold[0], *(t for t, _ in ref["top"][0])}) if ref else [pt.gold[0]]
    a = generate(
        server,
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": top,
            "token_ids_logprob": asked,
            **_memory(field),
        },
    )
    first = _logprobs(a["output_token_ids_logprobs"][0])
    mem = a.get("sgl_memory") or {}
    out = {
        "gold": [first[pt.gold[0]]],
        "argmax": [a["output_top_logprobs"][0][0][1]],
        "ids": [first],
        "top": [[[t, lp] for lp, t, *_ in a["output_top_logprobs"][0]]],
        # intent reports what stayed live of the request's tokens, placed memory blocks included
        "live_kv": mem["live_kv_tokens"] - 2
        if "live_kv_tokens" in mem
        else len(prompt) + mem.get("memory_kv_tokens", 0),
        "events": mem.get("compression_events", 0),
        "restored": mem.get("restored_tokens", 0),
    }
    if n > 1:
        asked = sorted({*pt.gold, *(t for pos in ref["top"][1:] for t, _ in pos)}) if ref else sorted(set(pt.gold))
        b = generate(
            server,
            {
                "input_ids": prompt + pt.gold,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": len(prompt),
                "top_logprobs_num": top,
                "token_ids_logprob": asked,
                **_memory(field, readonly=True),
            },
        )
        # entry i is the token at len(history) + i; the first (gold[0], predicted by the prompt's
        # last row, which B does not compute) came from A
        tops, ids = b["input_top_logprobs"][1:n], b["input_token_ids_logprobs"][1:n]
        if len(tops) != n - 1:
            raise RuntimeError(f"{pt.label}: {len(tops)} input log-probabilities for {n - 1} gold tokens")
        # B's probe prefills the gold action too: bf16 rounding in the longer pass can flip a
        # near-tie of the block ranking, so B may read other blocks than A (recorded, not hidden)
        out["same_blocks"] = (b.get("sgl_memory") or {}).get("retrieved_spans") == mem.get("retrieved_spans")
        for i, (pos_top, pos_ids) in enumerate(zip(tops, ids), 1):
            got = _logprobs(pos_ids)
            out["gold"].append(got[pt.gold[i]])
            out["argmax"].append(pos_top[0][1])
            out["ids"].append(got)
            out["top"].append([[t, lp] for lp, t, *_ in pos_top])
    return out


def kl_rest(ref_top: list[list], method: dict[int, float]) -> float:
    """KL(reference || method) over the reference's top tokens plus one bucket for every other token."""
    p = [math.exp(lp) for _, lp in ref_top]
    q = [math.exp(method[t]) for t, _ in ref_top]
    p_rest, q_rest = max(1.0 - sum(p), 1e-12), max(1.0 - sum(q), 1e-12)
    return sum(a * (math.log(a) - math.log(max(b, 1e-30))) for a, b in zip(p, q) if a > 0) + p_rest * math.log(
        p_rest / q_rest
    )


def score_trajectory(server, traj: P.Trajectory, method: Method, field: dict, refs: list[dict] | None) -> list[dict]:
    """The trajectory's points in order in one session; `refs`: the reference's per point (None:
    this is the reference, whose rows keep its top tokens for the others)."""
    rows = []
    for i, pt in enumerate(traj.points):
        t0 = time.perf_counter()
        prompt = pt.history if method.prompt == "history" else pt.alternates[method.prompt]
        s = score_point(server, pt, prompt, field, None if refs is None else refs[i])
        if method.restores:
            post(server, "/flush_cache?timeout=600", {})  # waits for the session's write
        if refs is None:
            rows.append(
                {"point": i, "gold": s["gold"], "argmax": s["argmax"], "top": s["top"], "live_kv": s["live_kv"]}
            )
            continue
        r = refs[i]
        rows.append(
            {
                "point": i,
                "label": pt.label,
                "gold_tokens": len(pt.gold),
                "history_tokens": len(pt.history),
                "prompt_tokens": len(prompt),
                "live_kv": s["live_kv"],
                "events": s["events"],
                "restored_tokens": s["restored"],
                "same_blocks": s.get("same_blocks", True),
                "gold_logprob": sum(s["gold"]),
                "gold_match": s["argmax"] == pt.gold,
                "full_match": s["argmax"] == r["argmax"],
                "token_agreement": sum(a == b for a, b in zip(s["argmax"], r["argmax"])) / len(pt.gold),
                "kl": sum(kl_rest(rt, m) for rt, m in zip(r["top"], s["ids"])) / len(pt.gold),
                "ref_gold_logprob": sum(r["gold"]),
                "ref_gold_match": r["argmax"] == pt.gold,
                "wall_s": time.perf_counter() - t0,
            }
        )
    return rows


def aggregate(rows: list[dict], seed: int = 0) -> list[dict]:
    """One row per (workload, method, budget): means with bootstrap intervals over trajectories,
    and the paired difference to the full cache of gold log-likelihood and gold match."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["method"], r["budget"]), []).append(r)
    out = []
    for (workload, method, budget), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2] or 0, kv[0][1])):
        clusters: dict[str, list[dict]] = {}
        for r in rs:
            clusters.setdefault(r["trajectory"], []).append(r)

        def ci(value):
            return bootstrap([[value(r) for r in c] for c in clusters.values()], seed)

        row = {
            "workload": workload,
            "method": method,
            "budget": budget,
            "n": len(rs),
            "trajectories": len(clusters),
            "eff_live_kv": sum(r["live_kv"] / r["history_tokens"] for r in rs) / len(rs),
            "history_tokens": sum(r["history_tokens"] for r in rs) / len(rs),
            "wall_s": sum(r["wall_s"] for r in rs),
        }
        for m in METRICS:
            row[m], row[f"{m}_ci_low"], row[f"{m}_ci_high"] = ci(lambda r, m=m: float(r[m]))
        for m, ref in (("gold_logprob", "ref_gold_logprob"), ("gold_match", "ref_gold_match")):
            row[f"{m}_vs_full"], row[f"{m}_vs_full_ci_low"], row[f"{m}_vs_full_ci_high"] = ci(
                lambda r, m=m, ref=ref: float(r[m]) - float(r[ref])
            )
        row["ref_gold_match"] = sum(r["ref_gold_match"] for r in rs) / len(rs)
        row.update(_versus(rs, groups.get((workload, DEFAULT, budget), []), "default", seed))
        row.update(
            _versus(rs, next((g for (w, m, _), g in groups.items() if w == workload and m == TEXT), []), "text", seed)
        )
        out.append(row)
    return out


def _versus(rs: list[dict], other: list[dict], tag: str, seed: int) -> dict:
    """The paired difference (method - other) of gold log-likelihood and KL over the points both
    scored, with its bootstrap interval over trajectories (keys `*_vs_<tag>`)."""
    theirs = {(r["trajectory"], r["point"]): r for r in other}
    clusters: dict[str, list[tuple[dict, dict]]] = {}
    for r in rs:
        if (r["trajectory"], r["point"]) in theirs:
            clusters.setdefault(r["trajectory"], []).append((r, theirs[r["trajectory"], r["point"]]))
    if not clusters or rs is other:
        return {}
    out = {f"n_vs_{tag}": sum(len(c) for c in clusters.values())}
    for m in ("gold_logprob", "kl"):
        d = bootstrap([[float(a[m]) - float(b[m]) for a, b in c] for c in clusters.values()], seed)
        out[f"{m}_vs_{tag}"], out[f"{m}_vs_{tag}_ci_low"], out[f"{m}_vs_{tag}_ci_high"] = d
    return out


def table(rows: list[dict]) -> str:
    def ci(r, m, f):
        return f"{format(r[m], f)} [{format(r[m + '_ci_low'], f)}, {format(r[m + '_ci_high'], f)}]"

    head = (
        "| workload | method | budget | N (sessions) | live KV | gold log-lik. | vs full | gold match | vs full "
        "| = full cache | token agreement | KL |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['method']} | {r['budget'] or '-'} | {r['n']} ({r['trajectories']}) "
            f"| {r['eff_live_kv']:.2f} | {ci(r, 'gold_logprob', '.2f')} | {ci(r, 'gold_logprob_vs_full', '+.2f')} "
            f"| {ci(r, 'gold_match', '.3f')} | {ci(r, 'gold_match_vs_full', '+.3f')} | {ci(r, 'full_match', '.3f')} "
            f"| {ci(r, 'token_agreement', '.3f')} | {ci(r, 'kl', '.2g')} |"
        )
    for tag, other in (("default", f"{DEFAULT} at the same budget"), ("text", f"{TEXT} on the same questions")):
        paired = [r for r in rows if f"n_vs_{tag}" in r]
        if paired:
            lines += [
                "",
                f"Paired against {other} (method - it; positive log-likelihood and negative KL are better):",
                "",
                "| workload | method | budget | N | gold log-lik. | KL |",
                "|---|---|---|---|---|---|",
            ]
            for r in paired:
                lines.append(
                    f"| {r['workload']} | {r['method']} | {r['budget'] or '-'} | {r[f'n_vs_{tag}']} "
                    f"| {ci(r, f'gold_logprob_vs_{tag}', '+.2f')} | {ci(r, f'kl_vs_{tag}', '+.3f')} |"
                )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for r in [r for r in rows if r["workload"] == w]:
            err = [
                [r["gold_logprob_vs_full"] - r["gold_logprob_vs_full_ci_low"]],
                [r["gold_logprob_vs_full_ci_high"] - r["gold_logprob_vs_full"]],
            ]
            ax.errorbar(
                r["eff_live_kv"],
                r["gold_logprob_vs_full"],
                yerr=err,
                fmt="o",
                capsize=3,
                label=f"{r['method']}@{r['budget']}" if r["budget"] else r["method"],
            )
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(
            title=f"{w}: gold-action log-likelihood vs the full cache (95% CI)",
            xlabel="live KV / full cache (prompt positions)",
            ylabel="paired difference (nats per action)",
        )
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--workloads", nargs="+", default=list(P.SOURCES), choices=list(P.SOURCES))
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 128], help="history budgets (prompt positions)")
    ap.add_argument("--methods", nargs="+", default=None, help="method names to run (default: all)")
    ap.add_argument(
        "--head",
        type=Path,
        default=None,
        help="the learned scorer's head file (default: the one shipped for "
        "the model); give such a run an --out of its own",
    )
    ap.add_argument(
        "--only",
        type=Path,
        default=None,
        help="a file of trajectory ids, one per line: run only those "
        "(scripts/train_pruner.py writes a head's held-out ones)",
    )
    P.add_size_options(ap)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one BFCL task per category, one BCP question per conversation, 8 LoCoMo questions, one game, one budget",
    )
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--report-only", action="store_true", help="aggregate the points file, run nothing")
    ap.add_argument("--out", type=Path, default=RESULTS / "fidelity.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.bfcl_per_category, args.locomo_conversations, args.locomo_questions, args.textworld_games = 1, [0], 8, 1
        args.bcp_questions = 1
        args.budgets = args.budgets[:1]
    return args


def run(args, points_path: Path, refs_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.resolve(args.model))
    trajs = P.load(tokenizer, args.workloads, args)
    if args.only is not None:
        wanted = set(args.only.read_text().split())
        trajs = [t for t in trajs if t.id in wanted]
    ms = [m for m in methods(args.budgets) if args.methods is None or m.name in (*args.methods, REFERENCE)]
    done = {(r["trajectory"], r["method"], r["budget"]) for r in read_rows(points_path)}
    todo = [(t, m) for t in trajs for m in ms[1:] if (t.id, m.name, m.budget) not in done and servable(t, m)]
    run_id = f"fid-{int(time.time())}"  # fresh sessions per run: a resumed run never meets an old session's path
    # the run's own: a server reads its config file once, but two runs must not share logs
    logs = Path(tempfile.mkdtemp(prefix="sgl-memory-fidelity-"))
    refs: dict[str, list[dict]] = {}  # the reference per trajectory, computed once per run
    with tqdm(total=sum(len(t.points) for t, _ in todo), desc="points x methods", disable=None) as bar:
        # an 8-bit pool's methods are scored against the compute-dtype pool's reference, computed
        # on the first server (its own would be the 8-bit pool's): the trajectories they need
        by_pool = {t.id: t for t, m in todo if m.server in FLAGS}
        for name in SERVERS:
            phase = [(t, m) for t, m in todo if m.server == name]
            if name == "intent":
                phase += [(t, ms[0]) for t in by_pool.values() if not any(u is t for u, _ in phase)]
            if phase:
                (logs / "config.yaml").write_text(server_config(name, args.head, logs / "sessions"))
                cmd = harness.our_command(
                    args.model,
                    "--memory-config",
                    str(logs / "config.yaml"),
                    "--max-total-tokens",
                    str(args.max_total_tokens),
                    *FLAGS.get(name, ()),
                )
                server = harness.start(cmd, logs / "server.log")
                try:
                    dtype = held_dtype(points_path, server)
                    serve(
                        server,
                        trajs,
                        phase,
                        ms[0],
                        f"{run_id}-{name.replace(' ', '-')}",
                        points_path,
                        refs_path,
                        refs,
                        bar,
                        dtype,
                    )
                finally:
                    harness.stop(server)


def serve(
    server,
    trajs: list[P.Trajectory],
    todo: list[tuple],
    ref_method: Method,
    run_id: str,
    points_path: Path,
    refs_path: Path,
    refs: dict[str, list[dict]],
    bar,
    dtype: str | None,
) -> None:
    memories: set[str] = set()  # groups whose memory this server holds
    for traj in trajs:
        mine = [m for t, m in todo if t is traj]
        if not mine:
            continue
        # the reference runs first: the pruning methods start from its KV and every method is scored
        # against this run's reference (each point row keeps the reference's figures it used). The
        # memory and persist servers reuse the first server's (fresh servers answer alike:
        # test_determinism_server) or compute it without a session, so nothing of it is recorded.
        ref = refs.get(traj.id)
        shared = any(m.server == "intent" for m in mine)  # a method here reads the reference's session
        if ref is None and any(m.server in FLAGS for m in mine):
            raise RuntimeError(f"{traj.id}: an 8-bit pool's method needs the compute-dtype pool's reference first")
        if ref is None or shared:
            bar.set_description(f"{traj.id} {REFERENCE}")
            # sessionless, it still names the full budget: the server's default budget would prune it
            field = (
                {"session_id": f"{run_id}:{traj.id}:ref", **ref_method.fields} if shared else dict(ref_method.fields)
            )
            ref = refs[traj.id] = score_trajectory(server, traj, ref_method, field, None)
            with refs_path.open("a") as f:
                f.write(json.dumps({"trajectory": traj.id, "commit": commit(), "points": ref}) + "\n")
        for m in mine:
            if m is ref_method:
                continue  # only its reference was asked of this server (for the 8-bit pools)
            bar.set_description(f"{traj.id} {m.name}@{m.budget}")
            tag = "".join(c if c.isalnum() else "-" for c in m.name)  # session ids take no spaces
            session = f"{run_id}:{traj.group}:memory" if m.recalls else f"{run_id}:{traj.id}:{tag}@{m.budget}"
            if m.recalls and traj.group not in memories:
                bar.set_description(f"{traj.group} ingest")
                for ids in traj.ingest:
                    generate(
                        server,
                        {
                            "input_ids": ids,
                            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                            "sgl_memory": {"session_id": session, **ref_method.fields},
                        },
                    )
                memories.add(traj.group)
            rows = score_trajectory(server, traj, m, {"session_id": session, **m.fields}, ref)
            with points_path.open("a") as f:
                for r in rows:
                    f.write(
                        json.dumps(
                            {
                                "workload": traj.workload,
                                "trajectory": traj.id,
                                "method": m.name,
                                "budget": m.budget,
                                "commit": commit(),
                                "dtype": dtype,
                                **r,
                            }
                        )
                        + "\n"
                    )
            bar.update(len(rows))


def held_dtype(points_path: Path, server) -> str | None:
    """The server's compute dtype, if the points file holds no other (rows before the field: unknown)."""
    dtype = server.get("/sgl_memory/info").json()["dtype"]["dtype"]
    other = {r["dtype"] for r in read_rows(points_path) if r.get("dtype")} - {dtype}
    if other:
        raise SystemExit(
            f"{points_path} holds points computed in {', '.join(sorted(other))}; this server computes in {dtype}. "
            f"Give --out a file of its own, or set SGLMEMORY_DTYPE={min(other)} (docs/getting-started.md)"
        )
    return dtype


def servable(traj: P.Trajectory, m: Method) -> bool:
    """Whether the trajectory's points carry the method's prompt (and its memory)."""
    return m.prompt == "history" or (
        all(m.prompt in pt.alternates for pt in traj.points) and (not m.recalls or traj.ingest is not None)
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    points_path, refs_path = args.out.with_suffix(".points.jsonl"), args.out.with_suffix(".reference.jsonl")
    if not args.report_only:
        run(args, points_path, refs_path)
    points = read_rows(points_path)
    rows = aggregate(points)
    head = {"head": str(args.head)} if args.head is not None else {}
    dtype = sorted({r["dtype"] for r in points if r.get("dtype")})  # one, where the points record it
    write_json(args.out, {"model": args.model, "top_k": TOP_K, **head, "dtype": dtype, "rows": rows})
    args.out.with_suffix(".md").write_text(table(rows))
    plot(rows, args.out.with_suffix(".png"))
    print(table(rows))
