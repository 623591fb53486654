"""`memory.window` (the server cuts a full-history request and recalls the rest as KV) against the
full cache, the agent benchmark's client-side window, and plain truncation, at many decision points.

A LoCoMo dialogue of about --length tokens opens a conversation that goes on with the follow-up
questions of bench/persist_restart.py, each a decision point; the history after it holds the full
cache's answer (every method is judged at the reference's decision points). The sessions' first
request is the whole dialogue (a full-history turn, recorded into the session's memory). One
server, KV memory on with `window: --window` and `placed_tokens: --placed-tokens`, answers each
question five ways:
- full cache: the whole history, no session (never cut): the reference;
- server window: the whole history under a session id and no `memory` object: the server cuts it;
- client window: what bench/agent sends for `kv memory` (loop.windowed: the system message, the
  last user message and the exchanges after it, here the question alone) in explicit memory mode;
- truncation: the server window's prompt (window.cut) with no session: what the recall adds;
- question only: the system message and the question, no session: what the history adds at all.
At each point: whether the first greedy token is the full cache's, the share of the first
--tokens greedy tokens before the first difference, and the KL divergence of the first token's
top-20 distribution from the full cache's (common.kl: over the union of the two top-20 lists,
renormalised; a token missing from a list takes that list's smallest probability). 95% intervals
resample whole dialogues. Writes bench/results/window_fidelity.json and .png.

    python bench/window_fidelity.py --model qwen2.5-coder-0.5b-instruct --dialogues 3
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tqdm import tqdm
from transformers import AutoTokenizer

from common import RESULTS, bootstrap, kl, ok, write_json
from locomo import data
from persist_restart import FOLLOW_UPS, dialogue, session_of_length
from bench.agent.loop import windowed
from sgl_memory import models
from sgl_memory.core.config import to_yaml
from sgl_memory.core.spans import RoleMarkers
from sgl_memory.memart.settings import MemArtConfig
from sgl_memory.memart.window import cut
from bench import harness

METHODS = ("full cache", "server window", "client window", "truncation", "question only")
TOP = 20


def generate(server, ids: list[int], field: dict | None, tokens: int) -> dict:
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "top_logprobs_num": TOP,
        "logprob_start_len": -1,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0},
    }
    if field is not None:
        body["sgl_memory"] = field
    out = ok(server.post("/generate", body), "generate").json()
    meta = out["meta_info"]
    first = {tok: lp for lp, tok, _ in meta["output_top_logprobs"][0]}
    return {
        "ids": out["output_ids"],
        "first": first,
        "prompt_tokens": meta["prompt_tokens"],
        "prefill_tokens": meta["prompt_tokens"] - meta["cached_tokens"],
        "metrics": meta.get("sgl_memory") or {},
    }


def prefix_share(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), 1)


def run(args) -> dict:
    tok = AutoTokenizer.from_pretrained(models.model_dir(args.model))
    markers = RoleMarkers.from_tokenizer(tok, "chatml")
    render = lambda messages: tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="window-fidelity-"))
    config = work / "memory.yaml"
    memory = MemArtConfig(enabled=True, placement="after_system", window=args.window, placed_tokens=args.placed_tokens)
    config.write_text(to_yaml(memory, harness.PERSIST_OFF))
    server = harness.start(
        harness.our_command(args.model, "--memory-config", str(config), "--max-total-tokens", "32768"),
        work / "server.log",
    )
    points = []
    try:
        for d, conversation in enumerate(data.load()[: args.dialogues]):
            history = session_of_length(tok, dialogue(conversation), args.length)
            # the sessions' first request: the whole dialogue, recorded; its answer is history
            sessions = {m: {"session_id": f"{m.replace(' ', '-')}-{d}"} for m in ("server window", "client window")}
            first = {m: generate(server, render(history), s, args.first_tokens) for m, s in sessions.items()}
            history.append(
                {"role": "assistant", "content": tok.decode(first["server window"]["ids"], skip_special_tokens=True)}
            )
            for question in tqdm(FOLLOW_UPS[: args.questions], desc=f"dialogue {d}"):
                messages = history + [{"role": "user", "content": question}]
                full = render(messages)
                kept = cut(full, markers, args.window)
                prompts = {
                    "full cache": (full, None),
                    "server window": (full, sessions["server window"]),
                    "client window": (
                        render(windowed(messages, 2)),
                        {**sessions["client window"], "memory": {"mode": "retrieve"}},
                    ),
                    "truncation": (kept.ids if kept else full, None),
                    "question only": (render([messages[0], messages[-1]]), None),
                }
                out = {m: generate(server, ids, field, args.tokens) for m, (ids, field) in prompts.items()}
                ref = out["full cache"]
                points.append(
                    {
                        "dialogue": d,
                        "question": question,
                        "windowed_tokens": out["server window"]["metrics"].get("windowed_tokens", 0),
                        **{
                            m: {
                                "first_token": float(o["ids"][:1] == ref["ids"][:1]),
                                "prefix": prefix_share(ref["ids"], o["ids"]),
                                "kl": kl(ref["first"], o["first"]),
                                "prompt_tokens": o["prompt_tokens"],
                                "prefill_tokens": o["prefill_tokens"],
                                "text": tok.decode(o["ids"], skip_special_tokens=True),
                                "retrieved_blocks": o["metrics"].get("retrieved_blocks", 0),
                            }
                            for m, o in out.items()
                        },
                    }
                )
                history = messages + [
                    {"role": "assistant", "content": tok.decode(ref["ids"], skip_special_tokens=True)}
                ]
    finally:
        harness.stop(server)
    summary = {}
    for m in METHODS:
        row = {}
        for key in ("first_token", "prefix", "kl", "prompt_tokens", "prefill_tokens"):
            clusters = [
                [p[m][key] for p in points if p["dialogue"] == d] for d in sorted({p["dialogue"] for p in points})
            ]
            mean, lo, hi = bootstrap(clusters)
            row[key] = {"mean": mean, "ci95": [lo, hi]}
        summary[m] = row
    return {
        "model": args.model,
        "window": args.window,
        "placed_tokens": args.placed_tokens,
        "length": args.length,
        "points": len(points),
        "dialogues": args.dialogues,
        "summary": summary,
        "rows": points,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (
        ("first_token", "first greedy token = full cache's"),
        ("prefix", "share of greedy tokens before the first difference"),
        ("kl", "KL of the first token (top 20)"),
    )
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4))
    for ax, (key, title) in zip(axes, keys):
        rows = [result["summary"][m][key] for m in METHODS]
        ax.bar(
            range(len(METHODS)),
            [r["mean"] for r in rows],
            yerr=[[r["mean"] - r["ci95"][0] for r in rows], [r["ci95"][1] - r["mean"] for r in rows]],
            capsize=4,
        )
        ax.set_xticks(range(len(METHODS)), METHODS, rotation=30, ha="right")
        ax.set_title(title, fontsize=9)
    fig.suptitle(
        f"{result['model']}, window {result['window']} of ~{result['length']}-token dialogues, N={result['points']}"
    )
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--dialogues", type=int, default=3)
    ap.add_argument("--questions", type=int, default=len(FOLLOW_UPS))
    ap.add_argument("--length", type=int, default=4096, help="tokens of dialogue history")
    ap.add_argument("--window", type=int, default=512, help="memory.window: tokens of the latest messages kept")
    ap.add_argument(
        "--placed-tokens", type=int, default=1024, help="memory.placed_tokens: recalled tokens per request at most"
    )
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens compared per point")
    ap.add_argument("--first-tokens", type=int, default=8, help="the answer to the dialogue, part of the history")
    ap.add_argument("--out", type=Path, default=RESULTS / "window_fidelity.json")
    args = ap.parse_args(argv)
    result = run(args)
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    for m in METHODS:
        s = result["summary"][m]
        print(
            f"{m:14s} " + "  ".join(f"{k} {s[k]['mean']:.3f} [{s[k]['ci95'][0]:.3f}, {s[k]['ci95'][1]:.3f}]" for k in s)
        )


if __name__ == "__main__":
    main()
