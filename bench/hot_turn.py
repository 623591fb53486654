"""What a hot turn of a long session costs besides its new tokens' prefill.

A full-history chat client (an OpenAI-style agent) sends its whole conversation every turn. With the
history in the radix tree, the turn should cost the prefill of its new tokens (which attend to the
cached history) and little else; what else it costs (rendering the template, tokenizing, matching
the prefix, scheduling, the HTTP round trip) is the overhead this measures.

Sessions are LoCoMo dialogues cut to about 1k, 4k and 16k tokens (as bench/persist_restart.py). Per
server and length: the history is prefilled once, then TURNS hot turns each add the previous
answer and a new question (about 20-30 new tokens; the history is a radix hit), one output token
each. Per turn: the client's latency, and the server's prefill forward of the turn (SGLang's
`per_stage_req_latency_seconds{stage="prefill_forward"}`, from the batch's start to its result,
read from /metrics around each turn). Overhead = latency - prefill forward; mean and 95% bootstrap
interval over the turns, and over the turns after the first (with persistence the first hot turn
runs while the store writes the whole history the cold turn left). Side by side, in one run:

- plain SGLang (torch_native, its CPU default): its own prompt encode (the whole prompt each turn);
- ours, `--plain` (no mechanism): the chat prompt encoded in pieces, earlier messages from SGLang's
  segment cache (engine/prompt_encode.py);
- ours with persistence on (Q8 store): what a persistent session adds per turn.

And the store's own write of a turn at the longest length (no server; the model's KV shape, Q8):
the turn's new blocks, as the store writes a turn, against the whole session, as it wrote every
turn before chunk files; seconds and bytes written per turn.

Writes bench/results/hot_turn.json and .png.

    .venv/bin/python bench/hot_turn.py [--lengths 1024 4096 16384] [--turns 8] [--servers ours ...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tqdm import tqdm

from common import RESULTS, bootstrap, disk_bytes, provenance, write_json
from locomo import data
from persist_restart import FOLLOW_UPS, chat, chat_ids, dialogue, session_of_length, store_config
from sgl_memory import cpu_dtype, models
from bench import harness

POOL_TOKENS = 40000  # every session of the run fits: nothing is evicted between turns
STAGE = "sglang:per_stage_req_latency_seconds"


def prefill_forward(server) -> tuple[float, float]:
    """(sum of seconds, count) of the server's prefill-forward stage so far."""
    samples = server.prometheus(prefix=STAGE)
    total = count = 0.0
    for (name, labels), value in samples.items():
        if dict(labels).get("stage") != "prefill_forward":
            continue
        if name.endswith("_sum"):
            total += value
        elif name.endswith("_count"):
            count += value
    return total, count


def hot_turns(server, history: list[dict], turns: int, memory: dict | None) -> dict:
    answer = chat(server, history, 16, memory)[0]  # the history's prefill (cold)
    messages, rows = list(history), []
    for n in range(turns):
        messages = messages + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": FOLLOW_UPS[n % len(FOLLOW_UPS)]},
        ]
        before = prefill_forward(server)
        answer, usage, _, seconds = chat(server, messages, 1, memory)
        after = prefill_forward(server)
        assert after[1] - before[1] == 1, "one prefill per turn"
        forward = after[0] - before[0]
        new = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        rows.append(
            {
                "latency_s": seconds,
                "prefill_forward_s": forward,
                "overhead_s": seconds - forward,
                "prompt_tokens": usage["prompt_tokens"],
                "new_tokens": new,
            }
        )
    return {"turns": rows, **summarise(rows)}


def summarise(rows: list[dict]) -> dict:
    """Mean and 95% interval over the turns, and over the turns after the first: with persistence
    the first hot turn runs while the store writes the whole history the cold turn left (later
    turns' writes are their new blocks)."""
    summary = {}
    for key in ("latency_s", "prefill_forward_s", "overhead_s"):
        for name, part in ((key, rows), (f"{key}_after_first", rows[1:])):
            mean, lo, hi = bootstrap([[r[key]] for r in part])
            summary[name] = {"mean": mean, "ci95": [lo, hi]}
    return summary


def store_writes(model: str, tokens: int, turns: int, new_tokens: int, work: Path) -> dict:
    """The store's write of a turn of a `tokens`-token session in Q8 (the model's KV shape, the
    pool's dtype), side by side: the turn's new blocks (how the store writes a turn) against the
    whole session (how it wrote every turn before chunks: every block written and hashed again, into
    a store emptied first, so no block file is kept or linked). Seconds and bytes written per turn,
    after a first write of the history."""
    import json
    import shutil
    import time

    import torch

    from sgl_memory.persist.store import CacheSpec, SessionFiles

    config = json.loads((models.model_dir(model) / "config.json").read_text())
    heads = config["num_key_value_heads"]
    spec = CacheSpec(
        model,
        "bench",
        config["num_hidden_layers"],
        heads,
        config["hidden_size"] // config["num_attention_heads"],
        cpu_dtype.choose().dtype,
        1,
    )
    dtype = getattr(torch, spec.dtype)
    total = tokens + turns * new_tokens
    keys = torch.randn(spec.layers, total, heads, spec.head_dim).to(dtype)
    values = torch.randn(spec.layers, total, heads, spec.head_dim).to(dtype)
    out = {}
    for mode in ("new blocks", "whole session"):
        files = SessionFiles(work / mode.replace(" ", "-"), spec, quant="q8")
        record = files.continued(None, list(range(tokens)), 0, keys[:, :tokens], values[:, :tokens])
        files.write(None, "s", record, base=0)
        seconds, written = [], []
        for turn in range(1, turns + 1):
            n = tokens + turn * new_tokens
            start = len(record.token_ids) // files.block_size * files.block_size
            record = files.continued(record, list(range(n)), start, keys[:, start:n], values[:, start:n])
            if mode == "whole session":  # nothing on disk to keep or link: every block written and hashed
                shutil.rmtree(files.root, ignore_errors=True)
            before = {p.name: p.stat().st_size for p in files.root.glob("*/*/*")}
            t0 = time.perf_counter()
            files.write(None, "s", record, base=record.generation if mode == "new blocks" else None)
            seconds.append(time.perf_counter() - t0)
            written.append(disk_bytes(p for p in files.root.glob("*/*/*") if before.get(p.name) != p.stat().st_size))
        mean, lo, hi = bootstrap([[x] for x in seconds])
        out[mode] = {
            "write_s": {"mean": mean, "ci95": [lo, hi]},
            "bytes_per_turn": sum(written) / len(written),
            "turns": seconds,
        }
    return out


def servers(model: str, work: Path) -> dict:
    path = models.model_dir(model)
    pool = ["--max-total-tokens", str(POOL_TOKENS), "--enable-metrics"]
    plain, env = harness.plain_sglang(
        path, *harness.cpu_flags(path, "torch_native", POOL_TOKENS), "--enable-cache-report", "--enable-metrics"
    )
    return {
        "plain-sglang": (plain, env, None),
        "ours": (harness.our_command(model, *pool, "--plain"), None, None),
        "ours-persist-q8": (
            harness.our_command(model, *pool, "--memory-config", str(store_config(work, "q8"))),
            None,
            {},
        ),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(result["servers"])
    lengths = list(result["sessions"])
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        rows = result["servers"][name]
        xs = [i + j * width for i in range(len(lengths))]
        means = [rows[n]["overhead_s"]["mean"] * 1000 for n in lengths]
        errs = [
            [m - rows[n]["overhead_s"]["ci95"][0] * 1000 for m, n in zip(means, lengths)],
            [rows[n]["overhead_s"]["ci95"][1] * 1000 - m for m, n in zip(means, lengths)],
        ]
        ax.bar(xs, means, width, yerr=errs, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(lengths))], [f"{result['sessions'][n]} tok" for n in lengths])
    ax.set_ylabel("hot turn besides its prefill (ms)")
    ax.set_title(f"{result['model']}: a hot turn's overhead (mean, 95% CI)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--servers", nargs="*", default=None, help="a subset of the servers (default: all)")
    ap.add_argument("--out", type=Path, default=RESULTS / "hot_turn.json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.model_dir(args.model))
    conversations = data.load()
    turns = dialogue(conversations[0]) + dialogue(conversations[1])
    sessions = {str(n): session_of_length(tokenizer, turns, n) for n in args.lengths}
    result = {
        "model": args.model,
        "pool_dtype": cpu_dtype.choose().dtype,
        "turns": args.turns,
        **provenance(),
        "sessions": {n: len(chat_ids(tokenizer, m)) for n, m in sessions.items()},
        "servers": {},
    }
    with tempfile.TemporaryDirectory(prefix="hot-turn-") as tmp:
        work = Path(tmp)
        chosen = {k: v for k, v in servers(args.model, work).items() if args.servers is None or k in args.servers}
        for name, (command, env, memory) in tqdm(chosen.items(), desc="servers"):
            server = harness.start(command, work / f"{name}.log", env)
            try:
                result["servers"][name] = {
                    n: hot_turns(
                        server, history, args.turns, {"session_id": f"hot-{n}"} if memory is not None else None
                    )
                    for n, history in tqdm(sessions.items(), desc=name, leave=False)
                }
            finally:
                harness.stop(server)
            write_json(args.out, result)
        n = max(args.lengths)
        result["store_writes"] = {"tokens": n, "new_tokens": 25, **store_writes(args.model, n, 8, 25, work)}
        write_json(args.out, result)
    if result["servers"]:
        plot(result, args.out.with_suffix(".png"))
    for mode in ("new blocks", "whole session"):
        w = result["store_writes"][mode]
        print(
            f"store write of a turn, {mode}: {w['write_s']['mean'] * 1000:.0f} ms "
            f"[{w['write_s']['ci95'][0] * 1000:.0f}, {w['write_s']['ci95'][1] * 1000:.0f}], "
            f"{w['bytes_per_turn'] / 1e6:.1f} MB"
        )
    for name, rows in result["servers"].items():
        for n, row in rows.items():
            o, later, f = row["overhead_s"], row["overhead_s_after_first"], row["prefill_forward_s"]
            print(
                f"{name:16s} {result['sessions'][n]:6d} tok: overhead {o['mean'] * 1000:6.1f} ms "
                f"[{o['ci95'][0] * 1000:.1f}, {o['ci95'][1] * 1000:.1f}], "
                f"after the first turn {later['mean'] * 1000:6.1f} ms "
                f"[{later['ci95'][0] * 1000:.1f}, {later['ci95'][1] * 1000:.1f}], prefill {f['mean'] * 1000:6.1f} ms"
            )


if __name__ == "__main__":
    main()
