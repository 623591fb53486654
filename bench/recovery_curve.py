"""The reuse gap's recovery curve: how much of a full recompute's likelihood gain a partial repair of
placed KV memory recovers, against the share it recomputes, by how it chooses the tokens.

    .venv/bin/python -m bench.recovery_curve [--conversations 0 1 2 3] [--questions 20]
        [--ratios 0.05 0.15 0.3 0.5] [--selectors cacheblend random] [--quick] [--out PATH]

One server: ours, KV memory at its defaults (the default model). Each development LoCoMo
conversation is recorded as an agent records it (the transcript as a memory-mode chat turn:
bench/locomo's `chat` recording, no placed token at position 0). Each question's gold answer is
then scored teacher-forced (its tokens' log-likelihood after the question, SGLang's input
log-probabilities from the answer's first token) with the blocks the question retrieves placed
after the system message, and repaired: not at all (`recompute: none`), fully (`full`: the blocks
prefilled as text with the question), and by each selector at each ratio (`recompute: cacheblend`
chooses by KV deviation as CacheBlend does, `random` the baseline; `keep.ratio`: the share at layer
1, all of them at layer 0, fewer deeper, as the server schedules it). The retrieval is the same in
every case (the probe does not depend on the repair), so the cases differ only in the repair.

Recovered: mean(ll(repair) - ll(none)) / mean(ll(full) - ll(none)), 95% bootstrap over questions;
its x is the share of the placed tokens' token-layers the repair recomputed, as each response
reports it (`recompute_share`). Writes bench/results/recovery_curve.json and .png (`--out`).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from bench import harness
from bench.common import RESULTS, ratio_interval, write_json
from bench.locomo import data, prompts
from bench.locomo.run import DEFAULTS_REUSE, Results, Runner, conversations, defaults_config, server_flags
from sgl_memory import models


def answer_ll(server, ids: list[int], start: int, memory: dict) -> tuple[float, dict]:
    """The log-likelihood of ids[start:] after ids[:start] (teacher-forced), and the response's sgl_memory."""
    r = server.post(
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": start,
            "sgl_memory": memory,
        },
    )
    if r.status_code != 200:
        raise RuntimeError(f"/generate answered {r.status_code}: {r.text[:500]}")
    meta = r.json()["meta_info"]
    # the first entry is the prompt's last row before the answer (None where it was a cache hit):
    # the answer's first token's log-probability is the one after it
    lps = [lp for lp, *_ in meta["input_token_logprobs"]]
    return sum(lp for lp in lps[1:] if lp is not None), meta.get("sgl_memory") or {}


def repairs(selectors: list[str], ratios: list[float]) -> list[tuple[str, str, float | None]]:
    """(label, recompute, keep.ratio) of every case, the two ends first."""
    return [("none", "none", None), ("full", "full", None)] + [(f"{s}@{r}", s, r) for s in selectors for r in ratios]


def summarize(rows: list[dict], cases: list[tuple[str, str, float | None]]) -> list[dict]:
    out = []
    for label, recompute, ratio in cases[1:]:
        pairs = [(r["ll"][label] - r["ll"]["none"], r["ll"]["full"] - r["ll"]["none"]) for r in rows]
        mean, lo, hi = ratio_interval(pairs)
        shares = [r["share"][label] for r in rows]
        out.append(
            {
                "case": label,
                "recompute": recompute,
                "ratio": ratio,
                "n": len(rows),
                "recovered": {"mean": mean, "lo": lo, "hi": hi},
                "recomputed_share": sum(shares) / len(shares),
            }
        )
    return out


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for recompute in sorted({s["recompute"] for s in summary} - {"full"}):
        pts = sorted((s for s in summary if s["recompute"] == recompute), key=lambda s: s["recomputed_share"])
        x = [s["recomputed_share"] for s in pts]
        y = [s["recovered"]["mean"] for s in pts]
        err = [[m - s["recovered"]["lo"] for s, m in zip(pts, y)], [s["recovered"]["hi"] - m for s, m in zip(pts, y)]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=recompute)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="full recompute")
    ax.axhline(0.8, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("placed token-layers recomputed (share)")
    ax.set_ylabel("share of a full recompute's likelihood gain")
    ax.set_title(f"recovery curve (N = {summary[0]['n']} questions)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--conversations", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--questions", type=int, default=20, help="per conversation (bench/locomo's stratified pick)")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.15, 0.3, 0.5])
    ap.add_argument("--selectors", nargs="+", default=["cacheblend", "random"])
    ap.add_argument("--max-transcript-tokens", type=int, default=None, help="the first turns within this many")
    ap.add_argument("--quick", action="store_true", help="one conversation, 4 questions, ratio 0.15 (minutes)")
    ap.add_argument("--out", type=Path, default=RESULTS / "recovery_curve.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations, args.questions, args.ratios = args.conversations[:1], 4, [0.15]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.resolve(args.model))
    picked = argparse.Namespace(
        data=data.DATA,
        conversations=args.conversations,
        max_transcript_tokens=args.max_transcript_tokens,
        questions_per_conversation=args.questions,
        seed=0,
    )
    convs = conversations(picked, tokenizer)
    chat = replace(DEFAULTS_REUSE, recording="chat")
    cases = repairs(args.selectors, args.ratios)
    logs = Path(tempfile.mkdtemp(prefix="recovery-curve-"))
    recorded = Results(logs / "ingest.json", {"model": args.model}, True)  # the ingest's own record
    command = harness.our_command(
        args.model, "--memory-config", str(defaults_config(logs)), *server_flags(args.model, convs, {"chat"})
    )
    server = harness.start(command, logs / "server.log")
    rows = []
    try:
        with tqdm(total=sum(len(c.questions) for c in convs) * len(cases), desc="requests", disable=None) as bar:
            runner = Runner(args, tokenizer, None, recorded, bar)
            for conv in convs:
                sid, _ = runner.ingest(server, conv, chat)
                for q in conv.questions:
                    question = prompts.question_only(tokenizer, q.question)
                    answer = tokenizer(q.answer, add_special_tokens=False)["input_ids"]
                    row = {"conversation": conv.index, "qa_index": q.qa_index, "category": q.category}
                    row |= {"ll": {}, "share": {}, "answer_tokens": len(answer)}
                    for label, recompute, ratio in cases:
                        memory = {"session_id": sid, "memory": {"mode": "retrieve", "store": False}}
                        memory["memory"]["recompute"] = recompute
                        if ratio is not None:
                            memory["keep"] = {"ratio": ratio}
                        ll, m = answer_ll(server, question + answer, len(question), memory)
                        row["ll"][label], row["share"][label] = ll, m.get("recompute_share", 0.0)
                        bar.update()
                    rows.append(row)
    except Exception:
        print(f"server log {logs / 'server.log'}, last lines:\n{server.log()[-3000:]}")
        raise
    finally:
        harness.stop(server)
    summary = summarize(rows, cases)
    settings = {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)}
    write_json(args.out, {"settings": settings, "summary": summary, "rows": rows})
    plot(summary, args.out.with_suffix(".png"))
    for s in summary:
        r = s["recovered"]
        share = s["recomputed_share"]
        print(f"{s['case']:>16} share {share:.3f}  recovered {r['mean']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}]")


if __name__ == "__main__":
    main()
