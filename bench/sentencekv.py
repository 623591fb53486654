"""SentenceKV against the full cache, SnapKV and a Quest-style page selection, side by side in one run,
then plain SGLang on the same prompts.

Workload: generated haystacks (varied filler sentences, one needle sentence holding a code, placed
at several depths, and `--distractors` sentences of the same form naming other vaults, at random
places) at several context lengths, with a question at the end; greedy, 16 new tokens. Per
haystack the prompt is prefilled once (cache flushed, one token generated), then every method runs
over that cached prompt: each recomputes only what it must (SentenceKV and SnapKV their
observation window), so all of them read the same prompt KV and a method's prefill is not timed.
Per request: whether the answer holds the needle's code, the agreement of the generated tokens with
the full cache's, the decode speed (streamed: first to last token; each step's time is kept in the
request rows, so one long haystack's speeds still have an interval over its steps), the KV positions a decode step
reads per layer, and the prompt KV that must stay readable (live_kv).

Methods, at the same KV read per step where they have a budget: `full` (our server, every
position); `snapkv` (prefill-time only: intent pruning with the SnapKV scorer keeps sinks + recent +
budget positions in all, its forced spans, the system prompt and the question, among them); `quest`
(decode-time pages of 16 tokens by key bounds, every token kept); `sentencekv` (the paper's method:
a pool of keep_factor x budget, sentences by mean keys, the mean query of the sentence being
generated); `plain sglang` (a second server, SGLang's torch_native backend, full cache). SGLang's
own decode-time sparsity (`--enable-hisparse`, srt/mem_cache/sparsity, a Quest algorithm) needs the
fa3 attention backend (Hopper GPUs): it does not run on this CPU.

    .venv/bin/python -m bench.sentencekv --contexts 2048 4096 8192 --needles 2 --distractors 7

Writes bench/results/sentencekv.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import requests

from bench.common import RESULTS, bootstrap, generate, ok, write_json

from bench import harness
from sgl_memory import models
from sgl_memory.core.config import to_yaml
from sgl_memory.intent.settings import IntentConfig
from sgl_memory.sentencekv.settings import SentenceKVConfig

FILLER_NAMES = "Ava Ben Chloe Dev Elena Farid Greta Hugo Iris Jonas Kiri Liam Mona Nils Omar Pia".split()
FILLER_THINGS = "lamp ledger kettle map violin crate rope lantern compass basket mirror anchor".split()
FILLER_PLACES = "the attic,the harbour,the library,the garden,the workshop,the cellar,the station,the bakery".split(",")
FILLER_VERBS = "moved,painted,repaired,sold,borrowed,hid,cleaned,weighed".split(",")
VAULTS = "otter falcon lynx heron bison gecko walrus marten ibex puffin tapir koala".split()
ALWAYS = 4 + 32  # SentenceKV's sinks and recent rows (the section's defaults): read at every step
NEW_TOKENS = 16


def haystack(tokenizer, context: int, depth: float, seed: int, distractors: int = 0) -> tuple[list[int], str]:
    """A chat prompt of about `context` tokens: filler sentences, the needle at `depth` of them and
    `distractors` needles of other vaults (other codes) at random places, then the question as the
    next user message (an agent's turn: SnapKV's pruning keeps the latest message whole). Returns
    (token ids, the answer's code)."""
    if distractors >= len(VAULTS):
        raise ValueError(f"at most {len(VAULTS) - 1} distractors (one per other vault)")
    rng = random.Random(seed)
    vaults = rng.sample(VAULTS, distractors + 1)
    codes = rng.sample(range(10_000, 100_000), distractors + 1)
    vault, code = vaults[0], str(codes[0])
    question = f"What is the secret code of the {vault} vault? Answer with the code only."
    sentences, tokens = [], 0
    budget = context - 100 - 14 * (distractors + 1)  # the chat template, the reply, the question, the needles
    while tokens < budget:
        s = (
            f"On day {rng.randrange(1, 400)}, {rng.choice(FILLER_NAMES)} {rng.choice(FILLER_VERBS)} the "
            f"{rng.choice(FILLER_THINGS)} in {rng.choice(FILLER_PLACES)}."
        )
        sentences.append(s)
        tokens += len(tokenizer.encode(" " + s, add_special_tokens=False))
    for other, other_code in zip(vaults[1:], codes[1:]):
        sentences.insert(rng.randrange(len(sentences) + 1), f"The secret code of the {other} vault is {other_code}.")
    sentences.insert(int(depth * len(sentences)), f"The secret code of the {vault} vault is {code}.")
    messages = [
        {"role": "user", "content": "Notes:\n" + " ".join(sentences)},
        {"role": "assistant", "content": "I have read the notes."},
        {"role": "user", "content": question},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False), code


def methods(budget: int, factor: float) -> list[tuple[str, dict]]:
    off = {"sentencekv": {"enabled": False}}  # the server's intent budget is past any prompt: no pruning
    return [
        ("full", off),
        ("snapkv", {**off, "budget": ALWAYS + budget, "scorer": "snapkv", "layout": "dead_slot"}),
        ("quest", {"sentencekv": {"selection": "page", "budget": budget}}),
        ("sentencekv", {"sentencekv": {"selection": "sentence", "budget": budget, "keep_factor": factor}}),
    ]


def streamed(server, ids: list[int], field: dict | None) -> dict:
    """One greedy request, streamed: its text, token ids, metrics and decode speed."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    }
    if field is not None:
        body["sgl_memory"] = field
    times, last = [], None
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=3600) as r:
        ok(r, "/generate")
        for line in r.iter_lines():
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                last = json.loads(line[5:])
                times.append(time.perf_counter())
    meta = last["meta_info"]
    steps = meta["completion_tokens"] - 1
    return {
        "text": last["text"],
        "output_ids": last["output_ids"],
        "meta": meta,
        "step_s": [b - a for a, b in zip(times, times[1:])],
        "decode_tok_s": steps / (times[-1] - times[0]) if steps > 0 and times[-1] > times[0] else float("nan"),
    }


def reads_and_live(name: str, out: dict) -> tuple[float, int]:
    """KV positions a decode step reads per layer (mean over steps) and the prompt KV kept readable."""
    meta, m = out["meta"], out["meta"].get("sgl_memory") or {}
    prompt, steps = meta["prompt_tokens"], meta["completion_tokens"] - 1
    generated = sum(range(1, steps + 1)) / max(steps, 1)
    if "kv_read_per_step" in m:
        return m["kv_read_per_step"], m["kept_tokens"]
    live = m["live_kv_tokens"] - meta["completion_tokens"] if name == "snapkv" else prompt
    if name == "snapkv" and live >= prompt:
        raise RuntimeError(f"snapkv left a {prompt}-token prompt unpruned (see the server log)")
    return live + generated, live


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(len(b), 1)


def run_server(server, cases, named_fields) -> dict:
    """Per haystack: the cache flushed, the prompt prefilled once, then every method over it."""
    out = {}
    for key, (ids, code) in cases.items():
        ok(server.post("/flush_cache?timeout=600", {}), "/flush_cache")
        generate(server, ids, 1, timeout=3600)
        for name, field in named_fields:
            r = streamed(server, ids, field)
            read, live = reads_and_live(name, r)
            out[(name, *key)] = {
                "correct": code in r["text"],
                "output_ids": r["output_ids"],
                "decode_tok_s": r["decode_tok_s"],
                "step_s": r["step_s"],
                "kv_read_per_step": read,
                "live_kv": live,
                "prompt_tokens": r["meta"]["prompt_tokens"],
            }
            print(
                f"{name:>12} ctx={key[0]} depth={key[1]} seed={key[2]}: correct={out[(name, *key)]['correct']} "
                f"read={read:.0f} tok/s={r['decode_tok_s']:.2f}",
                flush=True,
            )
    return out


def summarise(per: dict, contexts: list[int], names: list[str]) -> list[dict]:
    """Per method and context, and over every context ("all"): accuracy, its difference from the full
    cache's on the same haystacks (paired), agreement with the full cache's tokens, speed, reads."""
    rows = []
    for name in names:
        for ctx in [*contexts, "all"]:
            cells = [(k, v) for k, v in per.items() if k[0] == name and ctx in (k[1], "all")]
            if not cells:
                continue
            full = [per[("full", *k[1:])] for k, _ in cells]
            acc = bootstrap([[float(v["correct"])] for _, v in cells])
            diff = bootstrap([[float(v["correct"]) - float(f["correct"])] for (_, v), f in zip(cells, full)])
            agree = bootstrap([[agreement(v["output_ids"], f["output_ids"])] for (_, v), f in zip(cells, full)])
            speed = bootstrap([[v["decode_tok_s"]] for _, v in cells])
            ratio = bootstrap([[v["decode_tok_s"] / f["decode_tok_s"]] for (_, v), f in zip(cells, full)])
            rows.append(
                {
                    "method": name,
                    "context": ctx,
                    "n": len(cells),
                    "accuracy": acc[0],
                    "accuracy_ci": [acc[1], acc[2]],
                    "accuracy_minus_full": diff[0],
                    "accuracy_minus_full_ci": [diff[1], diff[2]],
                    "agreement_with_full": agree[0],
                    "agreement_ci": [agree[1], agree[2]],
                    "decode_tok_s": speed[0],
                    "decode_tok_s_ci": [speed[1], speed[2]],
                    "decode_speed_vs_full": ratio[0],
                    "decode_speed_vs_full_ci": [ratio[1], ratio[2]],
                    "kv_read_per_step": sum(v["kv_read_per_step"] for _, v in cells) / len(cells),
                    "live_kv": sum(v["live_kv"] for _, v in cells) / len(cells),
                    "prompt_tokens": sum(v["prompt_tokens"] for _, v in cells) / len(cells),
                }
            )
    return rows


def markdown(rows: list[dict], args) -> str:
    lines = [
        f"# SentenceKV vs full cache, SnapKV, Quest-style pages, plain SGLang ({args.model})",
        "",
        f"budget {args.budget} (SentenceKV keep_factor {args.keep_factor}), {args.distractors} distractor needles, "
        f"{NEW_TOKENS} greedy tokens; intervals: 95% bootstrap; accuracy - full and speed / full: per haystack "
        "against the full cache's; agreement: generated tokens equal to the full cache's, by position; 'all': every "
        "context pooled.",
        "",
        "| method | context | N | accuracy | accuracy - full | agreement with full | decode tok/s | speed / full "
        "| KV read / step | live KV |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['context']} | {r['n']} "
            f"| {r['accuracy']:.2f} [{r['accuracy_ci'][0]:.2f}, {r['accuracy_ci'][1]:.2f}] "
            f"| {r['accuracy_minus_full']:+.2f} "
            f"[{r['accuracy_minus_full_ci'][0]:+.2f}, {r['accuracy_minus_full_ci'][1]:+.2f}] "
            f"| {r['agreement_with_full']:.2f} [{r['agreement_ci'][0]:.2f}, {r['agreement_ci'][1]:.2f}] "
            f"| {r['decode_tok_s']:.2f} [{r['decode_tok_s_ci'][0]:.2f}, {r['decode_tok_s_ci'][1]:.2f}] "
            f"| {r['decode_speed_vs_full']:.2f} "
            f"[{r['decode_speed_vs_full_ci'][0]:.2f}, {r['decode_speed_vs_full_ci'][1]:.2f}] "
            f"| {r['kv_read_per_step']:.0f} | {r['live_kv']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["context"] != "all"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == name]
        x = [r["context"] for r in mine]
        axes[0].errorbar(
            x,
            [r["accuracy"] for r in mine],
            yerr=[
                [r["accuracy"] - r["accuracy_ci"][0] for r in mine],
                [r["accuracy_ci"][1] - r["accuracy"] for r in mine],
            ],
            marker="o",
            capsize=3,
            label=name,
        )
        axes[1].plot(x, [r["decode_tok_s"] for r in mine], marker="o", label=name)
        axes[2].plot(x, [r["kv_read_per_step"] for r in mine], marker="o", label=name)
    for ax, title in zip(axes, ("needle accuracy", "decode tokens/s", "KV positions read per step and layer")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
    axes[2].set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--needles", type=int, default=2, help="haystacks per context and depth")
    ap.add_argument("--distractors", type=int, default=7, help="needles of other vaults per haystack")
    ap.add_argument(
        "--budget", type=int, default=256, help="tau: prompt tokens a step reads besides the always-read ones"
    )
    ap.add_argument("--keep-factor", type=float, default=2.0)
    ap.add_argument("--skip-plain", action="store_true", help="leave out the plain-SGLang server")
    ap.add_argument(
        "--plain-max-context",
        type=int,
        default=4096,
        help="plain SGLang (torch_native pads every prefill to a full causal attention) only up to this context",
    )
    ap.add_argument("--out", default=str(RESULTS / "sentencekv.json"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    path = models.fetch(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    cases = {
        (ctx, depth, seed): haystack(tokenizer, ctx, depth, seed, args.distractors)
        for ctx in args.contexts
        for depth in args.depths
        for seed in range(args.needles)
    }
    # twice the longest prompt: the prefilled prompt stays cached while SnapKV's pruning copies what it
    # keeps into slots of its own (on a pool of one prompt it found none and left the prompt unpruned)
    total = str(2 * max(len(ids) for ids, _ in cases.values()) + 2 * NEW_TOKENS + 64)
    log_dir = Path(tempfile.mkdtemp(prefix="sentencekv-bench-"))  # the servers' logs and config, not results
    print(f"server logs: {log_dir}", flush=True)
    config = log_dir / "sentencekv.memory.yaml"
    config.write_text(
        to_yaml(SentenceKVConfig(enabled=True), IntentConfig(enabled=True, budget=1073741824), harness.PERSIST_OFF)
    )
    named = methods(args.budget, args.keep_factor)
    server = harness.start(
        harness.our_command(args.model, "--memory-config", str(config), "--max-total-tokens", total),
        log_dir / "sentencekv.ours.log",
    )
    try:
        per = run_server(server, cases, named)
    finally:
        harness.stop(server)
    names = [n for n, _ in named]
    if not args.skip_plain:
        command, env = harness.plain_sglang(path, *harness.cpu_flags(path, "torch_native"))
        command[command.index("--max-total-tokens") + 1] = total
        plain = harness.start(command, log_dir / "sentencekv.plain.log", env)
        try:
            short = {k: v for k, v in cases.items() if k[0] <= args.plain_max_context}
            per.update(run_server(plain, short, [("plain sglang", None)]))
        finally:
            harness.stop(plain)
        names.append("plain sglang")
    rows = summarise(per, args.contexts, names)
    out = Path(args.out)
    write_json(
        out,
        {
            "model": args.model,
            "budget": args.budget,
            "keep_factor": args.keep_factor,
            "new_tokens": NEW_TOKENS,
            "distractors": args.distractors,
            "depths": args.depths,
            "needles": args.needles,
            "rows": rows,
            "requests": [
                {
                    "method": k[0],
                    "context": k[1],
                    "depth": k[2],
                    "seed": k[3],
                    **{
                        f: v[f]
                        for f in ("correct", "decode_tok_s", "step_s", "kv_read_per_step", "live_kv", "prompt_tokens")
                    },
                }
                for k, v in per.items()
            ],
        },
    )
    out.with_suffix(".md").write_text(markdown(rows, args))
    plot(rows, out.with_suffix(".png"))
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
