"""Train the learned pruner head (IntentKV Phase 2, sgl_memory/intent/head.py) on agent traces.

Two steps, each resumable from its output directory:

    .venv/bin/python scripts/train_pruner.py collect --out runs/pruner [--per-category 40]
    .venv/bin/python scripts/train_pruner.py train --out runs/pruner [--head PATH]

collect: BFCL multi-turn sessions (multi_turn_base, miss_func, miss_param; never long_context, and
never the tasks the agent benchmark evaluates on) are replayed through a real server along their
ground truth: at every step the server sees the conversation so far (tool docs, questions, the
ground-truth calls and their results from BFCL's back-ends) and prunes it with `scorer: learned`
and an untrained head, which keeps the rule scorer's set and writes the head's inputs at the
compression event (`intent.trace_dir`): the features are read by the server's own capture path,
where inference reads them. Each step's labels are the next five ground-truth calls.

train: a history token is positive when its text is part of a literal occurrence of an argument
value (3+ characters) of one of the next five calls; special tokens are ignored (the forced spans
are not candidates at all); rows without a positive are dropped. Sessions replay in turn order
(QueryMemory accumulated in the server as at inference). Loss (eq. 8): BCE with a positive weight
neg/pos clipped at `--pos-weight-max`, a pairwise softplus term of each positive against the
`--hard-negatives` highest-scoring negatives, a keep-probability penalty, and a unit-norm term on
the projected memory. AdamW, seeded; validation by task. Writes the head, `curves.json` and
`curves.png`; reports the label statistics and, on validation, the share of positives the head and
the rule keep at the event's budget.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.agent.loop import Call, Endpoint  # noqa: E402
from sgl_memory import harness, models  # noqa: E402
from sgl_memory.intent.head import HeadShape, PrunerHead, backbone_spec  # noqa: E402

EVALUATED = {"multi_turn_base_50", "multi_turn_miss_func_100", "multi_turn_miss_param_150"}  # bench/agent's quick profile
BUDGET = 64  # history budget of the collection: the event fires at every step with history


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/train_pruner.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--model", default=models.DEFAULT_MODEL)
    c.add_argument("--out", type=Path, default=ROOT / "runs" / "pruner")
    c.add_argument("--per-category", type=int, default=40)
    c.add_argument("--url", default=None, help="a running server configured for collection (see server_config)")
    t = sub.add_parser("train")
    t.add_argument("--model", default=models.DEFAULT_MODEL)
    t.add_argument("--out", type=Path, default=ROOT / "runs" / "pruner")
    t.add_argument("--head", type=Path, default=None, help="where the trained head goes (default: OUT/head.safetensors)")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--pos-weight-max", type=float, default=20.0)
    t.add_argument("--hard-negatives", type=int, default=8)
    t.add_argument("--pair-weight", type=float, default=0.5)
    t.add_argument("--keep-weight", type=float, default=0.05)
    t.add_argument("--norm-weight", type=float, default=0.1)
    t.add_argument("--val-share", type=float, default=0.2)
    t.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


# --- collect -------------------------------------------------------------------------------------


def server_config(work: Path, head: Path) -> Path:
    path = work / "collect.yaml"
    path.write_text(f"intent:\n  enabled: true\n  scorer: learned\n  budget: {BUDGET}\n  budget_mode: history\n"
                    f"  head: {head}\n  trace_dir: {work / 'traces'}\n")  # fmt: skip
    return path


def collect(args) -> None:
    from tqdm import tqdm
    from transformers import AutoConfig

    from bench.agent import bfcl

    args.out.mkdir(parents=True, exist_ok=True)
    spec = backbone_spec(AutoConfig.from_pretrained(models.resolve(args.model)))
    zero = args.out / "zero_head.safetensors"
    PrunerHead(HeadShape(spec["head_dim"])).save(zero, spec)
    labels_path = args.out / "labels.jsonl"
    done = {json.loads(line)["task"] for line in labels_path.open()} if labels_path.exists() else set()
    tasks = [t for t in bfcl.tasks(limit=args.per_category) if t.id not in EVALUATED and t.id not in done]
    server = None
    if args.url is None:
        server = harness.start(harness.our_command(args.model, "--memory-config", str(server_config(args.out, zero))),
                               args.out / "collect.log")  # fmt: skip
    url = args.url or server.url
    try:
        with labels_path.open("a") as sink:
            for task in tqdm(tasks, desc="BFCL sessions", disable=None):
                session = f"pruner-{task.id}"
                # two tokens: the compression event runs at the end of a prefill that decodes on
                endpoint = GoldEndpoint(url, memory={}, max_tokens=2, replies=gold_replies(task, bfcl))
                result = bfcl.run(task, endpoint, session)
                steps = [{"request": i + 1, "next_calls": s["next_calls"]} for i, s in enumerate(result["steps"])]
                sink.write(json.dumps({"task": task.id, "session": session, "valid": result["valid"], "steps": steps}) + "\n")
                sink.flush()
    finally:
        if server is not None:
            harness.stop(server)


def gold_replies(task, bfcl) -> list[list[tuple[str, dict]]]:
    """The replies an agent that follows the ground truth gives, in the order bfcl.run asks: per
    turn its calls (if any), then the words that end the turn."""
    respond = (bfcl.RESPOND["function"]["name"], {"message": "Done."})
    out = []
    for truth in task.ground_truth:
        calls = bfcl.as_calls(task, truth)
        out += ([calls] if calls else []) + [[respond]]
    return out


@dataclass
class GoldEndpoint(Endpoint):
    """Sends each step to the server (its compression event writes the row) and answers with the
    ground truth instead of the model's reply."""

    replies: list = field(default_factory=list)

    def ask(self, messages, tools, session_id, tool_choice="required"):
        reply = super().ask(messages, tools, session_id, tool_choice="auto")
        calls = self.replies.pop(0) if self.replies else []
        return replace(reply, calls=[Call(f"call_{i}", name, args) for i, (name, args) in enumerate(calls)])


# --- train ---------------------------------------------------------------------------------------


def argument_strings(calls) -> list[str]:
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

    for name, arguments in calls:
        if name != "respond":  # the gold replay's turn ends, not a tool call
            walk(arguments)
    return out


def label_row(tokens: list[int], positions: torch.Tensor, strings: list[str], pieces: list[str], special: set[int]) -> torch.Tensor:
    """[n] float labels of the candidates (1 positive, 0 negative, -1 ignored)."""
    text, starts = "", []
    for t in tokens:
        starts.append(len(text))
        text += pieces[t]
    ends = starts[1:] + [len(text)]
    hit = torch.zeros(len(tokens), dtype=torch.bool)
    for s in set(strings):
        at = text.find(s)
        while at >= 0:
            lo, hi = at, at + len(s)
            for i in range(len(tokens)):
                if starts[i] < hi and ends[i] > lo:
                    hit[i] = True
            at = text.find(s, at + 1)
    labels = hit[positions].float()
    labels[torch.tensor([tokens[p] in special for p in positions.tolist()], dtype=torch.bool)] = -1.0
    return labels


def load_rows(args, tokenizer) -> tuple[list[dict], dict]:
    from safetensors import safe_open

    sessions = {}
    for line in (args.out / "labels.jsonl").open():
        rec = json.loads(line)
        sessions[rec["session"]] = (rec["task"], {s["request"]: s["next_calls"] for s in rec["steps"]})
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    special = set(tokenizer.all_special_ids)
    rows, stats = [], {"events": 0, "dropped_no_positive": 0, "dropped_unlabelled": 0, "positives": 0, "candidates": 0}
    for path in sorted((args.out / "traces").glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            row = {k: f.get_tensor(k) for k in f.keys()}
        stats["events"] += 1
        task, steps = sessions.get(meta["session"], (None, {}))
        calls = steps.get(int(meta["turn"]))
        if not calls:
            stats["dropped_unlabelled"] += 1
            continue
        labels = label_row(row["tokens"].tolist(), row["positions"], argument_strings(calls), pieces, special)
        if not bool((labels == 1).any()):
            stats["dropped_no_positive"] += 1
            continue
        stats["positives"] += int((labels == 1).sum())
        stats["candidates"] += int((labels >= 0).sum())
        rows.append({**row, "labels": labels, "task": task, "turn": int(meta["turn"]), "keep": int(row["keep"][0])})
    stats["rows"] = len(rows)
    stats["positive_rate"] = stats["positives"] / max(1, stats["candidates"])
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
    with torch.no_grad():
        loss = sum(float(loss_of(head, r, args)) for r in rows) / max(1, len(rows))
        learned = sum(recall_at_keep(head.score(r["rule"], r["keys"], r["memory"], r["context"]), r) for r in rows) / max(1, len(rows))
        rule = sum(recall_at_keep(r["rule"], r) for r in rows) / max(1, len(rows))
    return {"loss": loss, "recall_learned": learned, "recall_rule": rule}


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
    val_tasks = {r["task"] for r in rows if int(hashlib.sha256(r["task"].encode()).hexdigest(), 16) % 1000 < args.val_share * 1000}
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
    summary = {"stats": stats, "train_rows": len(train_rows), "val_rows": len(val_rows), "val_tasks": len(val_tasks),
               "final": curves["val"][-1], "initial": curves["val"][0], "gain": float(head.gain), "head": str(out),
               "sha256": hashlib.sha256(Path(out).read_bytes()).hexdigest(), "recipe": recipe}  # fmt: skip
    (args.out / "curves.json").write_text(json.dumps({"summary": summary, "curves": curves}, indent=1))
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
    ax2.plot([v["step"] for v in curves["val"]], [v["recall_learned"] for v in curves["val"]], marker="o", label="learned head")
    ax2.plot([v["step"] for v in curves["val"]], [v["recall_rule"] for v in curves["val"]], linestyle="--", label="rule (Phase 1)")
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
