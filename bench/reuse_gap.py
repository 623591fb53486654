"""Where reused KV memory loses against its recomputation, and which placed tokens carry the loss.

    .venv/bin/python -m bench.reuse_gap [--conversations 0 1 2] [--questions 20] [--placed 1024]

KV memory places a session's lines before a question with the KV they were computed with in their
own context (the conversation up to them), re-rotated to their new positions. A full recompute
gives the same tokens the KV of the assembled context. This measures, with transformers on the
dev LoCoMo questions (bench/fidelity's points), no server:

- the **deviation** of each placed token's reused KV from its recomputation, per layer
  (CacheBlend's measure: ||reused - recomputed||^2 / ||recomputed||^2 over the token's heads, keys
  and values apart), by where the token sits (`PARTS`);
- the **gain each part carries**: the gold answer's log-likelihood with the reused KV, with the
  recomputed KV, and with the recomputed KV of one part only over the reused KV of the rest (an
  oracle: a real partial recompute computes the part over the reused rest, so its KV is not quite
  the recomputed one). `share` = mean(part - reused) / mean(recomputed - reused), resampling
  questions; `tokens` is the part's share of the placed tokens;
- **dates**: the transcript renders a session's date before its first line only, so a placed line
  from the middle of a session has none (text retrieval's excerpt dates the first line it shows of
  each session). The same lines recorded with their date on every line (`dated`: an ingest that
  writes `[date] Speaker: text` per line) are placed reused and recomputed too.

The lines placed are the ones text retrieval picks within `--placed` tokens (MiniLM over the
turns, bench/locomo/retrieval.py), in chronological order, so text retrieval (its prompt: the
excerpt in the user message) is scored over the same evidence. The memory is each conversation's
transcript as bench/fidelity ingests it (one forward: a session's lines see every session before).
Writes bench/results/reuse_gap.json (per-question rows and the summary) and .png.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import RESULTS, provenance, read_jsonl, write_json
from bench.fidelity import points as P
from bench.locomo import data, metrics, prompts
from bench.locomo.retrieval import TurnRetriever
from sgl_memory import models

RUN_START = 8  # tokens of a placed run's start: a run is placed lines that were contiguous in the transcript
LINE_START = 4  # tokens of a line's start (the speaker's name and the colon)
CHUNK = 2048  # tokens per forward of a transcript (bounds the attention's transient memory)


@dataclass
class Memory:
    """One conversation's transcript as recorded: token ids, each token's turn, and every layer's
    keys before their rotation and values ([T, Hkv, D] each, the model's dtype)."""

    ids: list[int]
    turn_of: list[int | None]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    text_offsets: list[tuple[int, int]]
    text: str


def _projections(model):
    """Hooks that collect each layer's k_proj / v_proj outputs: the keys before RoPE."""
    keys, values, handles = {}, {}, []
    for i, layer in enumerate(model.model.layers):
        att = layer.self_attn
        handles.append(att.k_proj.register_forward_hook(lambda m, a, out, i=i: keys.setdefault(i, []).append(out[0])))
        handles.append(att.v_proj.register_forward_hook(lambda m, a, out, i=i: values.setdefault(i, []).append(out[0])))
    return keys, values, handles


def record(model, tokenizer, turns: list[data.Turn], dated: bool) -> Memory:
    """The transcript's forward, chunk by chunk over a growing cache, keeping every layer's K (pre-RoPE) and V."""
    lines = data.rendered(turns, every_line_dated=dated)
    text = prompts.CONTEXT_HEADER + "\n".join(lines)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    starts, pos = [], len(prompts.CONTEXT_HEADER)
    for line in lines:
        starts.append(pos)
        pos += len(line) + 1
    order = sorted(turns, key=lambda t: t.index)
    turn_of = []
    for start, _ in offsets:
        k = bisect.bisect_right(starts, start) - 1
        turn_of.append(order[k].index if k >= 0 else None)
    cfg = model.config
    hkv, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    keys, values, handles = _projections(model)
    try:
        cache = None
        with torch.inference_mode():
            for s in range(0, len(ids), CHUNK):
                out = model(
                    input_ids=torch.tensor([ids[s : s + CHUNK]]),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                cache = out.past_key_values
    finally:
        for h in handles:
            h.remove()
    n = len(model.model.layers)
    return Memory(
        ids,
        turn_of,
        [torch.cat(keys[i]).view(-1, hkv, dim) for i in range(n)],
        [torch.cat(values[i]).view(-1, hkv, dim) for i in range(n)],
        offsets,
        text,
    )


def rotate(model, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Keys [M, Hkv, D] rotated to `positions` by the model's own rotary embedding: [1, Hkv, M, D]."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    x = k.transpose(0, 1)[None]
    cos, sin = model.model.rotary_emb(x, positions[None])
    rotated, _ = apply_rotary_pos_emb(x, x, cos, sin)
    return rotated


def gold_loglik(logits: torch.Tensor, gold: list[int]) -> float:
    """Sum of the gold tokens' log-probabilities; logits [n, V] are the rows that predict them."""
    lp = torch.log_softmax(logits.float(), -1)
    return float(lp[torch.arange(len(gold)), torch.tensor(gold)].sum())


def forward(model, ids: list[int], gold: list[int], cache=None, start: int = 0):
    """The gold answer's log-likelihood after `ids` (over `cache` at positions from `start`) and the cache."""
    seq = torch.tensor([ids + gold])
    positions = torch.arange(start, start + seq.shape[1])[None]
    with torch.inference_mode():
        out = model(
            input_ids=seq, past_key_values=cache, position_ids=positions, use_cache=True, logits_to_keep=len(gold) + 1
        )
    return gold_loglik(out.logits[0, :-1], gold), out.past_key_values


def _cache(keys: list[torch.Tensor], values: list[torch.Tensor], config):
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k.clone(), v.clone(), i)
    return cache


def parts(mem: Memory, placed: list[int], answer: str) -> dict[str, torch.Tensor]:
    """[M] bool masks over the placed tokens (transcript indices `placed`, in order), by where each sits."""
    m = len(placed)
    out = {name: torch.zeros(m, dtype=torch.bool) for name in ("first token", "run starts", "line starts", "line ends")}
    out["first token"][0] = True
    turn = [mem.turn_of[j] for j in placed]
    for i in range(m):
        new_line = i == 0 or turn[i] != turn[i - 1]
        if new_line:
            contiguous = i > 0 and placed[i - 1] == placed[i] - 1
            # the first tokens of a line: of a run where the transcript before it is not placed
            span = LINE_START if contiguous else RUN_START
            (out["line starts"] if contiguous else out["run starts"])[i : i + span] = True
        if i == m - 1 or turn[i + 1] != turn[i]:
            out["line ends"][i] = True
    dates = torch.zeros(m, dtype=torch.bool)
    answers = torch.zeros(m, dtype=torch.bool)
    spans = [match.span() for match in re.finditer(r"\[[^\]\n]*\]", mem.text) if re.search(r"\d{4}", match.group())]
    needle = answer.strip().lower()
    found = [(a.start(), a.end()) for a in re.finditer(re.escape(needle), mem.text.lower())] if len(needle) >= 2 else []
    for i, j in enumerate(placed):
        a, b = mem.text_offsets[j]
        dates[i] = any(s < b and a < e for s, e in spans)
        answers[i] = any(s < b and a < e for s, e in found)
    out["dates"], out["answer span"] = dates, answers
    covered = torch.zeros(m, dtype=torch.bool)
    for v in out.values():
        covered |= v
    out["rest"] = ~covered
    out["all"] = torch.ones(m, dtype=torch.bool)  # the oracle's check: recomputed KV everywhere is the recompute
    return out


def question(
    model, mem: Memory, picked: list[data.Turn], pt: P.Point, answer: str, parts_of: bool, opening: int = 0
) -> dict:
    """One question's log-likelihoods and deviations for one recording of the memory; `opening`:
    the transcript's first lines, up to that many tokens, placed first as well (the server's own
    selection places them: its first key, at position 0, is the attention sink every query favours)."""
    picked_turns = {t.index for t in picked} | {mem.turn_of[j] for j in range(min(opening, len(mem.ids)))}
    placed = [j for j, t in enumerate(mem.turn_of) if t in picked_turns]
    m = len(placed)
    asked = pt.alternates["question"]
    fresh_ll, fresh = forward(model, [mem.ids[j] for j in placed] + asked, pt.gold)
    idx, positions = torch.tensor(placed), torch.arange(m)
    reused_k = [rotate(model, k[idx], positions).to(k.dtype) for k in mem.keys]
    reused_v = [v[idx].transpose(0, 1)[None] for v in mem.values]
    fresh_k = [fresh.layers[i].keys[:, :, :m] for i in range(len(reused_k))]
    fresh_v = [fresh.layers[i].values[:, :, :m] for i in range(len(reused_k))]

    def dev(a, b):  # [M] per token, summed over heads and dims: ||a - b||^2 / ||b||^2
        return ((a.float() - b.float()).pow(2).sum((0, 1, 3)) / b.float().pow(2).sum((0, 1, 3))).clamp_min(0)

    dk = torch.stack([dev(a, b) for a, b in zip(reused_k, fresh_k)])  # [L, M]
    dv = torch.stack([dev(a, b) for a, b in zip(reused_v, fresh_v)])

    def with_fresh(mask: torch.Tensor) -> float:
        w = mask[None, None, :, None]
        ks = [torch.where(w, f, r) for f, r in zip(fresh_k, reused_k)]
        vs = [torch.where(w, f, r) for f, r in zip(fresh_v, reused_v)]
        return forward(model, asked, pt.gold, _cache(ks, vs, model.config), m)[0]

    row = {"placed": m, "fresh": fresh_ll, "reused": with_fresh(torch.zeros(m, dtype=torch.bool))}
    # the first placed token recomputed (at position 0 a token sees only itself: it becomes the
    # attention sink that a token from the middle of the transcript is not), the rest reused
    first = torch.zeros(m, dtype=torch.bool)
    first[0] = True
    row["first token"] = with_fresh(first)
    if parts_of:
        masks = parts(mem, placed, answer)
        # CacheBlend's choice as an oracle: the 15% of tokens whose KV deviates most, averaged over layers
        masks["top 15% deviation"] = torch.zeros(m, dtype=torch.bool)
        masks["top 15% deviation"][(dk + dv).mean(0).topk(max(1, int(0.15 * m))).indices] = True
        row["parts"] = {
            name: {"tokens": int(mask.sum()), "ll": with_fresh(mask) if mask.any() else row["reused"]}
            for name, mask in masks.items()
        }
        row["deviation"] = {
            name: {"k": dk[:, mask].mean(1).tolist(), "v": dv[:, mask].mean(1).tolist()}
            for name, mask in masks.items()
            if mask.any()
        }
    return row


def share_interval(rows: list[dict], part: str) -> tuple[float, float, float]:
    """mean(part - reused) / mean(fresh - reused) over questions, with a percentile bootstrap interval."""
    from bench.common import ratio_interval

    return ratio_interval(
        [
            (r["plain"]["parts"][part]["ll"] - r["plain"]["reused"], r["plain"]["fresh"] - r["plain"]["reused"])
            for r in rows
        ]
    )


def summarize(rows: list[dict]) -> dict:
    from bench.common import bootstrap

    def mean(f):
        m, lo, hi = bootstrap([[f(r)] for r in rows])
        return {"mean": m, "lo": lo, "hi": hi}

    out = {
        "n": len(rows),
        "loglik": {
            "text retrieval": mean(lambda r: r["text"]),
            "reused": mean(lambda r: r["plain"]["reused"]),
            "reused, first token recomputed": mean(lambda r: r["plain"]["first token"]),
            "recomputed": mean(lambda r: r["plain"]["fresh"]),
        },
        "paired": {
            "recomputed - reused": mean(lambda r: r["plain"]["fresh"] - r["plain"]["reused"]),
            "first token recomputed - reused": mean(lambda r: r["plain"]["first token"] - r["plain"]["reused"]),
            "recomputed - first token recomputed": mean(lambda r: r["plain"]["fresh"] - r["plain"]["first token"]),
            "reused - text retrieval": mean(lambda r: r["plain"]["reused"] - r["text"]),
            "first token recomputed - text retrieval": mean(lambda r: r["plain"]["first token"] - r["text"]),
            "recomputed - text retrieval": mean(lambda r: r["plain"]["fresh"] - r["text"]),
        },
        "placed tokens": {"plain": sum(r["plain"]["placed"] for r in rows) / len(rows)},
        "parts": {},
    }
    if "dated" in rows[0]:  # the dated recording (not run with --opening)
        out["loglik"] |= {
            "dated, reused, first token recomputed": mean(lambda r: r["dated"]["first token"]),
            "dated, reused": mean(lambda r: r["dated"]["reused"]),
            "dated, recomputed": mean(lambda r: r["dated"]["fresh"]),
        }
        out["paired"] |= {
            "dated, first token recomputed - first token recomputed": mean(
                lambda r: r["dated"]["first token"] - r["plain"]["first token"]
            ),
            "dated, first token recomputed - text retrieval": mean(lambda r: r["dated"]["first token"] - r["text"]),
            "dated reused - reused": mean(lambda r: r["dated"]["reused"] - r["plain"]["reused"]),
            "dated reused - text retrieval": mean(lambda r: r["dated"]["reused"] - r["text"]),
            "dated recomputed - dated reused": mean(lambda r: r["dated"]["fresh"] - r["dated"]["reused"]),
        }
        out["placed tokens"]["dated"] = sum(r["dated"]["placed"] for r in rows) / len(rows)
    total = sum(r["plain"]["placed"] for r in rows)
    for part in rows[0]["plain"]["parts"]:
        s, lo, hi = share_interval(rows, part)
        layers = len(rows[0]["plain"]["deviation"]["rest"]["k"])
        have = [r for r in rows if part in r["plain"]["deviation"]] or None  # a part no question had
        out["parts"][part] = {
            "share": {"mean": s, "lo": lo, "hi": hi},
            "tokens": sum(r["plain"]["parts"][part]["tokens"] for r in rows) / total,
            "deviation_k": have
            and [sum(r["plain"]["deviation"][part]["k"][i] for r in have) / len(have) for i in range(layers)],
            "deviation_v": have
            and [sum(r["plain"]["deviation"][part]["v"][i] for r in have) / len(have) for i in range(layers)],
        }
    temporal = [r for r in rows if r["category"] == 2]
    if temporal and "dated" in rows[0]:  # LoCoMo's category 2: when something happened

        def paired(f):
            return dict(zip(("mean", "lo", "hi"), bootstrap([[f(r)] for r in temporal])))

        out["temporal"] = {
            "n": len(temporal),
            "first token recomputed - text retrieval": paired(lambda r: r["plain"]["first token"] - r["text"]),
            "dated, first token recomputed - text retrieval": paired(lambda r: r["dated"]["first token"] - r["text"]),
            "dated - undated, first token recomputed": paired(
                lambda r: r["dated"]["first token"] - r["plain"]["first token"]
            ),
        }
    return out


def plot(summary: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, p in summary["parts"].items():
        if p["deviation_k"]:
            a.plot(p["deviation_k"], label=name)
    a.set(xlabel="layer", ylabel="key deviation ||reused - recomputed||² / ||recomputed||²", yscale="log")
    a.legend(fontsize=7)
    names = list(summary["parts"])
    shares = [summary["parts"][n]["share"] for n in names]
    y = range(len(names))
    b.barh(
        y,
        [s["mean"] for s in shares],
        xerr=[[s["mean"] - s["lo"] for s in shares], [s["hi"] - s["mean"] for s in shares]],
    )
    b.set_yticks(list(y), [f"{n} ({summary['parts'][n]['tokens']:.0%} of tokens)" for n in names], fontsize=8)
    b.set(xlabel="share of full recompute's gain (oracle: that part's KV recomputed)")
    b.axvline(1.0, color="grey", lw=0.5)
    fig.suptitle(f"Reused KV memory against its recomputation, LoCoMo dev, N = {summary['n']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--conversations", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--questions", type=int, default=20, help="per conversation (bench/locomo's stratified pick)")
    ap.add_argument(
        "--placed", type=int, default=P.TEXT_BUDGET, help="tokens of lines placed (text retrieval's budget)"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--opening",
        type=int,
        default=0,
        help="also place the transcript's first lines up to this many tokens first, as the server's "
        "selection does (bench/locomo: 81-205 tokens); undated recording only; default --out reuse_gap_opening.json",
    )
    ap.add_argument("--out", default=None, help="default bench/results/reuse_gap.json")
    ap.add_argument("--report-only", action="store_true", help="summarize the rows file, run nothing")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    samples, embedder = data.load(), metrics.minilm()
    out = Path(args.out or RESULTS / ("reuse_gap_opening.json" if args.opening else "reuse_gap.json"))
    rows_path = out.with_suffix(".rows.jsonl")  # appended per question: a re-run resumes
    rows, t0 = read_jsonl(rows_path) if rows_path.exists() else [], time.perf_counter()
    done = {r["id"] for r in rows}
    for c in [] if args.report_only else args.conversations:
        if all(t.id in done for t in P.locomo(tokenizer, [c], args.questions)):
            continue
        turns = data.turns(samples[c])
        recordings = (False,) if args.opening else (False, True)
        memories = {dated: record(model, tokenizer, turns, dated) for dated in recordings}
        retriever = TurnRetriever(embedder, tokenizer, turns)
        trajectories = P.locomo(tokenizer, [c], args.questions)
        by_index = {q.qa_index: q for q in data.questions(samples[c], c)}
        for traj in tqdm([t for t in trajectories if t.id not in done], desc=f"conversation {c}"):
            q = by_index[int(traj.id.rsplit("-q", 1)[1])]
            pt = traj.points[0]
            picked = retriever.pick(q.question, args.placed)
            text_ll, _ = forward(model, pt.alternates["text"], pt.gold)
            rows.append(
                {
                    "id": traj.id,
                    "category": q.category,
                    "text": text_ll,
                    "plain": question(model, memories[False], picked, pt, q.answer, True, args.opening),
                }
                | ({} if args.opening else {"dated": question(model, memories[True], picked, pt, q.answer, False)})
            )
            with rows_path.open("a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    summary = summarize(rows)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "placed": args.placed,
        "opening": args.opening,
        "seconds": time.perf_counter() - t0,
        "summary": summary,
        "rows": rows,
        "provenance": provenance(),
    }
    write_json(out, result)
    plot(summary, out.with_suffix(".png"))
    print(json_table(summary))


def json_table(summary: dict) -> str:
    lines = [f"N = {summary['n']}"]
    for k, v in {**summary["loglik"], **summary["paired"]}.items():
        lines.append(f"{k:34s} {v['mean']:+.2f} [{v['lo']:+.2f}, {v['hi']:+.2f}]")
    for k, v in summary["parts"].items():
        s = v["share"]
        lines.append(f"{k:20s} tokens {v['tokens']:.1%}  share {s['mean']:+.2f} [{s['lo']:+.2f}, {s['hi']:+.2f}]")
    if "temporal" in summary:
        lines.append(f"temporal: {summary['temporal']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
