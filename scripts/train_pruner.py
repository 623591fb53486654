"""Train the learned pruner head (IntentKV Phase 2, sgl_memory/intent/head.py) on agent traces.

Two steps, each resumable from its output directory:

    .venv/bin/python scripts/train_pruner.py collect --out runs/pruner [--families bfcl bcp textworld locomo]
    .venv/bin/python scripts/train_pruner.py train --out runs/pruner [--head PATH]

collect: the gold trajectories of `bench/fidelity` (BFCL base / miss_func / miss_param replays that
pass BFCL's checker, never long_context; the BCP-shaped oracle path; TextWorld walkthroughs; LoCoMo
dev questions over their whole transcript) are sent through a real server point by point, each
trajectory in one session, as the fidelity bench's agent requests are: the server prunes each
prompt with `scorer: learned` at the family's budget of the fidelity tables and an untrained head,
which keeps the rule scorer's set and writes the head's inputs at the compression event
(`intent.trace_dir`): the features are read by the server's own capture path, where inference
reads them. A point's labels are the values its next LOOKAHEAD gold actions name.

train: a history token is positive when its text is part of a literal occurrence (case ignored) of
one of those values (a tool call's argument values of 3+ characters and their words, else the
action's words; function words left out: `action_strings`); special tokens are ignored (the forced
spans are not candidates at all); rows without a positive are dropped. Sessions replay in turn
order (QueryMemory accumulated in the server as at inference). Loss (eq. 8): BCE with a positive
weight neg/pos clipped at `--pos-weight-max`, a pairwise softplus term of each positive against
the `--hard-negatives` highest-scoring negatives, a keep-probability penalty, and a unit-norm term
on the projected memory. AdamW, seeded; validation on whole trajectories (`held_out`), whose ids
go to `OUT/held_out.txt` so that `bench/fidelity --only` can score the head on exactly them.
Writes the head, `curves.json` and `curves.png`; reports the label statistics and, on validation,
the share of positives the head and the rule keep at the event's budget, per family.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import random
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fidelity import points as P  # noqa: E402
from sgl_memory import models  # noqa: E402
from bench import harness  # noqa: E402
from sgl_memory.intent.head import HeadShape, PrunerHead, backbone_spec  # noqa: E402

FAMILIES = ("bfcl", "bcp", "textworld", "locomo")
BUDGET = {
    "bfcl": 64,
    "bcp": 512,
    "textworld": 256,
    "locomo": 1024,
}  # history budgets of the fidelity tables (docs/intent.md)
LOOKAHEAD = 5  # a point's labels: the values of its next five gold actions (itself included)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/train_pruner.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--model", default=models.DEFAULT_MODEL)
    c.add_argument("--out", type=Path, default=ROOT / "runs" / "pruner")
    c.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    P.add_size_options(c)  # the fidelity tables' trajectories are the ones collected
    c.add_argument("--max-total-tokens", type=int, default=65536)
    t = sub.add_parser("train")
    t.add_argument("--model", default=models.DEFAULT_MODEL)
    t.add_argument("--out", type=Path, default=ROOT / "runs" / "pruner")
    t.add_argument(
        "--head", type=Path, default=None, help="where the trained head goes (default: OUT/head.safetensors)"
    )
    t.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES, help="the families trained on")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--pos-weight-max", type=float, default=20.0)
    t.add_argument("--hard-negatives", type=int, default=8)
    t.add_argument("--pair-weight", type=float, default=0.5)
    t.add_argument("--keep-weight", type=float, default=0.05)
    t.add_argument("--norm-weight", type=float, default=0.1)
    t.add_argument("--val-share", type=float, default=0.5)
    t.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def held_out(trajectory: str, share: float) -> bool:
    """Whether a trajectory is validation: a hash of its id, so every family splits alike and a
    trajectory's points never straddle the split."""
    return int(hashlib.sha256(trajectory.encode()).hexdigest(), 16) % 1000 < share * 1000


# --- collect -------------------------------------------------------------------------------------


def server_config(work: Path, head: Path) -> Path:
    path = work / "collect.yaml"
    path.write_text(
        f"intent:\n  enabled: true\n  scorer: learned\n  budget_mode: history\n  budget_floor: 16\n"
        f"  head: {head}\n  trace_dir: {work / 'traces'}\n"
    )
    return path


def collect(args) -> None:
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer

    from bench.common import ok

    path = models.resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    args.out.mkdir(parents=True, exist_ok=True)
    spec = backbone_spec(AutoConfig.from_pretrained(path))
    zero = args.out / "zero_head.safetensors"
    PrunerHead(HeadShape(spec["head_dim"])).save(zero, spec)
    labels_path = args.out / "labels.jsonl"
    done = {json.loads(line)["task"] for line in labels_path.open()} if labels_path.exists() else set()
    trajs = [t for t in P.load(tokenizer, args.families, args) if t.id not in done]
    # a run's own session ids: the traces of a trajectory an earlier run left half done stay unlabelled
    run = f"pruner-{int(time.time())}"
    cmd = harness.our_command(
        args.model,
        "--memory-config",
        str(server_config(args.out, zero)),
        "--max-total-tokens",
        str(args.max_total_tokens),
    )
    server = harness.start(cmd, args.out / "collect.log")
    try:
        with (
            labels_path.open("a") as sink,
            tqdm(total=sum(len(t.points) for t in trajs), desc="points", disable=None) as bar,
        ):
            for traj in trajs:
                session = f"{run}:{traj.id}"
                field = {
                    "session_id": session,
                    "budget": BUDGET[traj.workload],
                    "budget_mode": "history",
                    "scorer": "learned",
                }
                for pt in traj.points:
                    # two tokens: the compression event runs at the end of a prefill that decodes on
                    ok(
                        server.post(
                            "/generate",
                            {
                                "input_ids": pt.history,
                                "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                                "sgl_memory": field,
                            },
                            timeout=3600,
                        ),
                        f"{traj.id} {pt.label}: /generate",
                    )
                    bar.update()
                # request i + 1 of the session (its QueryMemory turn) is point i
                actions = [tokenizer.decode(pt.gold, skip_special_tokens=True) for pt in traj.points]
                steps = [
                    {"request": i + 1, "strings": [s for a in actions[i : i + LOOKAHEAD] for s in action_strings(a)]}
                    for i in range(len(actions))
                ]
                sink.write(
                    json.dumps({"task": traj.id, "family": traj.workload, "session": session, "steps": steps}) + "\n"
                )
                sink.flush()
    finally:
        harness.stop(server)


# function words never label a token: every prompt is full of them
STOPWORDS = frozenset(
    "the and for with from that this what when where which who whom whose why how did does was were are "
    "has have had not but you your his her its their they them she him our out into onto about after "
    "before over under than then there here".split()
)


def words(text: str) -> list[str]:
    return [w for w in re.findall(r"[^\W_]{3,}", text) if w.lower() not in STOPWORDS]


def action_strings(action: str) -> list[str]:
    """The values a gold action names: a tool call's argument values of 3+ characters (the chat
    template's `<tool_call>` JSON) and, of a value of several words, its words; else the words of
    its text (a command, an answer). Words: 3+ letters or digits, function words left out."""
    calls = re.findall(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", action, re.S)
    if not calls:
        return words(action)
    out = []

    def walk(v):
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif v is not None and not isinstance(v, bool):
            s = str(v)
            if len(s) >= 3:
                out.append(s)
                out.extend(words(s) if len(s.split()) > 1 else [])

    for call in calls:
        walk(json.loads(call).get("arguments"))
    return out


# --- train ---------------------------------------------------------------------------------------


def label_row(
    tokens: list[int], positions: torch.Tensor, strings: list[str], pieces: list[str], special: set[int]
) -> torch.Tensor:
    """[n] float labels of the candidates (1 positive, 0 negative, -1 ignored): a token is positive
    when its text overlaps an occurrence of one of `strings`, case ignored."""
    text, starts = "", []
    for t in tokens:
        starts.append(len(text))
        text += pieces[t].lower()  # per piece: the offsets stay those of the lowered whole
    hit = torch.zeros(len(tokens), dtype=torch.bool)
    for s in {s.lower() for s in strings}:
        at = text.find(s)
        while at >= 0:
            # the tokens from the one holding the first character through the one holding the last
            hit[bisect.bisect_right(starts, at) - 1 : bisect.bisect_left(starts, at + len(s))] = True
            at = text.find(s, at + 1)
    labels = hit[positions].float()
    labels[torch.tensor([tokens[p] in special for p in positions.tolist()], dtype=torch.bool)] = -1.0
    return labels


def load_rows(args, tokenizer) -> tuple[list[dict], dict]:
    from safetensors import safe_open

    sessions = {}
    for line in (args.out / "labels.jsonl").open():
        rec = json.loads(line)
        if rec["family"] in args.families:
            sessions[rec["session"]] = (rec["task"], rec["family"], {s["request"]: s["strings"] for s in rec["steps"]})
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    special = set(tokenizer.all_special_ids)
    rows, stats = [], {}
    for path in sorted((args.out / "traces").glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            if meta["session"] not in sessions:  # another family's, or a run that did not finish its trajectory
                continue
            task, family, steps = sessions[meta["session"]]
            row = {k: f.get_tensor(k) for k in f.keys()}
        st = stats.setdefault(
            family, {"events": 0, "dropped_unlabelled": 0, "dropped_no_positive": 0, "positives": 0, "candidates": 0}
        )
        st["events"] += 1
        strings = steps.get(int(meta["turn"]))
        if not strings:
            st["dropped_unlabelled"] += 1
            continue
        labels = label_row(row["tokens"].tolist(), row["positions"], strings, pieces, special)
        if not bool((labels == 1).any()):
            st["dropped_no_positive"] += 1
            continue
        st["positives"] += int((labels == 1).sum())
        st["candidates"] += int((labels >= 0).sum())
        rows.append(
            {
                **row,
                "labels": labels,
                "task": task,
                "family": family,
                "turn": int(meta["turn"]),
                "keep": int(row["keep"][0]),
            }
        )
    for family, st in stats.items():
        st["rows"] = sum(r["family"] == family for r in rows)
        st["positive_rate"] = st["positives"] / max(1, st["candidates"])
    return rows, stats


def loss_of(head: PrunerHead, row: dict, args) -> torch.Tensor:
    z = head.score(row["rule"], row["keys"], row["memory"], row["context"]).float()
    y = row["labels"]
    mask = y >= 0
    z, y = z[mask], y[mask]
    pos, neg = y == 1, y == 0
    weight = min(args.pos_weight_max, float(neg.sum()) / max(1.0, float(pos.sum())))
    bce = torch.nn.functional.binary_cross_entropy_with_logits(z, y, pos_weight=torch.tensor(weight))
    hard = z[neg].topk(min(args.hard_negatives, int(neg.sum()))).values if bool(neg.any()) else z[:0]
    pair = torch.nn.functional.softplus(hard[None, :] - z[pos][:, None]).mean() if hard.numel() else z.sum() * 0
    keep = torch.sigmoid(z).mean()
    memory = row["memory"] / row["memory"].norm().clamp_min(1e-12)
    norm = (head.memory_proj(memory).norm() - 1) ** 2
    return bce + args.pair_weight * pair + args.keep_weight * keep + args.norm_weight * norm


def recall_at_keep(scores: torch.Tensor, row: dict) -> float:
    """Share of the row's positives among the candidates kept at its event's budget."""
    top = torch.argsort(scores, descending=True, stable=True)[: row["keep"]]
    y = row["labels"]
    return float((y[top] == 1).sum()) / max(1, int((y == 1).sum()))


def evaluate(head: PrunerHead, rows: list[dict], args) -> dict:
    """Loss and the positives kept at the event's budget by the head and the rule, over all rows
    and per family (`by_family`)."""

    def measure(rs):
        with torch.no_grad():
            loss = sum(float(loss_of(head, r, args)) for r in rs) / max(1, len(rs))
            learned = sum(
                recall_at_keep(head.score(r["rule"], r["keys"], r["memory"], r["context"]), r) for r in rs
            ) / max(1, len(rs))
            rule = sum(recall_at_keep(r["rule"], r) for r in rs) / max(1, len(rs))
        return {"rows": len(rs), "loss": loss, "recall_learned": learned, "recall_rule": rule}

    families = sorted({r["family"] for r in rows})
    return {**measure(rows), "by_family": {f: measure([r for r in rows if r["family"] == f]) for f in families}}


def train(args) -> None:
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    path = models.resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    spec = backbone_spec(AutoConfig.from_pretrained(path))
    rows, stats = load_rows(args, tokenizer)
    if not rows:
        raise SystemExit(f"no labelled rows under {args.out}: run collect first ({stats})")
    val_tasks = {r["task"] for r in rows if held_out(r["task"], args.val_share)}
    train_rows = [r for r in rows if r["task"] not in val_tasks]
    val_rows = [r for r in rows if r["task"] in val_tasks]
    head = PrunerHead(HeadShape(spec["head_dim"]))
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    curves = {"step": [], "train_loss": [], "val": [], "epoch_end": []}
    curves["val"].append({"step": 0, **evaluate(head, val_rows, args)})
    # sessions in turn order (QueryMemory accumulated in the server as it does at inference);
    # the sessions' order is shuffled per epoch
    by_task: dict[str, list[dict]] = {}
    for r in train_rows:
        by_task.setdefault(r["task"], []).append(r)
    step = 0
    with tqdm(total=args.epochs * len(train_rows), desc="training rows", disable=None) as bar:
        for epoch in range(args.epochs):
            order = sorted(by_task)
            rng.shuffle(order)
            for task in order:
                for r in sorted(by_task[task], key=lambda r: r["turn"]):
                    loss = loss_of(head, r, args)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    step += 1
                    curves["step"].append(step)
                    curves["train_loss"].append(float(loss))
                    bar.update()
            curves["epoch_end"].append(step)
            curves["val"].append({"step": step, **evaluate(head, val_rows, args)})
    out = args.head or (args.out / "head.safetensors")
    recipe = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    head.save(out, spec, {"recipe": json.dumps(recipe), "label_stats": json.dumps(stats)})
    summary = {
        "stats": stats,
        "train_rows": len(train_rows),
        "val_rows": len(val_rows),
        "val_tasks": len(val_tasks),
        "final": curves["val"][-1],
        "initial": curves["val"][0],
        "gain": float(head.gain),
        "head": str(out),
        "sha256": hashlib.sha256(Path(out).read_bytes()).hexdigest(),
        "recipe": recipe,
    }
    (args.out / "curves.json").write_text(json.dumps({"summary": summary, "curves": curves}, indent=1))
    # the trajectories the head never saw: `python -m bench.fidelity --only OUT/held_out.txt` scores it there
    (args.out / "held_out.txt").write_text("".join(t + "\n" for t in sorted(val_tasks)))
    plot(curves, args.out / "curves.png")
    print(json.dumps(summary, indent=1))


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    window = 25
    loss = curves["train_loss"]
    smooth = [sum(loss[max(0, i - window) : i + 1]) / len(loss[max(0, i - window) : i + 1]) for i in range(len(loss))]
    ax1.plot(curves["step"], smooth, label=f"train (mean of {window})")
    ax1.plot([v["step"] for v in curves["val"]], [v["loss"] for v in curves["val"]], marker="o", label="validation")
    ax1.set_xlabel("step (one compression event)")
    ax1.set_ylabel("loss (eq. 8)")
    ax1.legend()
    ax2.plot(
        [v["step"] for v in curves["val"]],
        [v["recall_learned"] for v in curves["val"]],
        marker="o",
        label="learned head",
    )
    ax2.plot(
        [v["step"] for v in curves["val"]],
        [v["recall_rule"] for v in curves["val"]],
        linestyle="--",
        label="rule (Phase 1)",
    )
    ax2.set_xlabel("step")
    ax2.set_ylabel("validation: positives kept at the event's budget")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    collect(args) if args.cmd == "collect" else train(args)


if __name__ == "__main__":
    main()
