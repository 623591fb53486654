"""Persistent session KV benchmark: the next turn after a server restart, and what Q4 / Q8 cost.

Sessions are LoCoMo dialogues (the two speakers as user and assistant) cut to about 1k, 4k and 16k
tokens of history. A writer server runs each session's first turn and stops; a fresh server then
receives the second turn. Side by side, in one run:

- plain SGLang (torch_native, its CPU default): no persistence, the second turn re-prefills all;
- our engine without the store: the same, on our CPU attention backend (cold re-prefill);
- our store with exact (the pool's dtype: bf16 or fp32), Q8 and Q4 files: the second turn restores
  the history from disk (the files
  dropped from the page cache; REPEATS sessions per length, the median reported); then, the tree
  flushed, once more from the host-memory (warm) tier, and once with everything in the tree (hot);
- SGLang's HiCache with its `file` storage backend, when it starts on this machine.

Time to first token is the latency of the turn with one output token. Each store row also has its
restore's floor, measured in this run (`restore_floor`: the file read at the disk's bandwidth,
dequantizing, one copy into mapped memory) and the restore's parts as the server reports them.
Bytes on disk per token come from the files. After the restore every configuration answers
len(FOLLOW_UPS) follow-up questions (greedy, ANSWER_TOKENS tokens). A Q8 / Q4 store's answers are
compared with the exact store's, which restores the session's KV bit for bit and so answers as the
session would have without the restart (tests/test_persist_server.py holds that); every
configuration's are also compared with the cold re-prefill's, which differ from the session's by
bf16 rounding alone (a prefill computes in other chunks than the session did). Each comparison:
the share of same answers and the token agreement, with 95% intervals. Fidelity of Q8 / Q4 against bf16
is also measured on the model itself (transformers): the KV of a LoCoMo prefix is quantized and
dequantized as the store does, then a continuation is teacher-forced: next-token KL against the
bf16 cache, perplexity, greedy (top-1) agreement, plus agreement of a free greedy continuation.
Writes bench/results/persist_restart.json and .png.

    .venv/bin/python bench/persist_restart.py [--lengths 1024 4096 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from common import RESULTS, bootstrap, ok, write_json
from locomo import data
from sgl_memory import cpu_dtype, models
from sgl_memory.core.config import to_yaml
from sgl_memory.persist.settings import PersistConfig
from sgl_memory.persist.shared import is_shared
from bench import harness

SYSTEM = "You are a helpful assistant that remembers the whole conversation."
FIRST = "Summarise what we talked about in one sentence."
# the second turn, asked after the restart: each is a request of its own over the same history, so
# the restored answers are compared with the cold ones on len(FOLLOW_UPS) answers per length
FOLLOW_UPS = (
    "What did I say first?",
    "What is my name?",
    "What did we talk about last?",
    "Name one thing I told you about my family.",
    "What hobbies have I mentioned?",
    "Where did I say I went recently?",
    "What is your name?",
    "Which of my plans did I mention?",
    "What did you advise me to do?",
    "Who did I mention besides my family?",
    "What made me happy lately?",
    "What am I worried about?",
)
ANSWER_TOKENS = 32
EXACT = {"bfloat16": "bf16", "float32": "fp32"}[cpu_dtype.choose().dtype]  # the pool's own dtype: stored as is
QUANTS = (EXACT, "q8", "q4")


def dialogue(conversation: dict) -> list[dict]:
    conv = conversation["conversation"]
    a = conv["speaker_a"]
    turns = []
    for n in range(1, 100):
        for turn in conv.get(f"session_{n}", []):
            role = "user" if turn["speaker"] == a else "assistant"
            if turns and turns[-1]["role"] == role:
                turns[-1]["content"] += "\n" + turn["text"]
            else:
                turns.append({"role": role, "content": turn["text"]})
    return turns


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)


def session_of_length(tokenizer, turns: list[dict], n: int) -> list[dict]:
    """System + dialogue turns up to about n tokens, ending with a user turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in turns:
        if len(chat_ids(tokenizer, messages + [turn])) > n:
            break
        messages.append(turn)
    if messages[-1]["role"] != "user":
        messages.pop()
    return messages


def chat(server, messages, max_tokens, memory=None):
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if memory:
        body["sgl_memory"] = memory
    t0 = time.perf_counter()
    r = server.post("/v1/chat/completions", body)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"], out.get("sgl_memory") or {}, seconds


def store_config(directory: Path, quant: str) -> Path:
    path = directory / f"persist-{quant}.yaml"
    path.write_text(to_yaml(PersistConfig(enabled=True, dir=str(directory / "store"), quant=quant)))
    return path


def second_turn(first: list[dict], answer: str, question: str = FOLLOW_UPS[0]) -> list[dict]:
    return first + [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]


def answer_all(server, first: list[dict], answer: str, memory: dict | None) -> list[str]:
    """The greedy answer to every follow-up over this history."""
    return [chat(server, second_turn(first, answer, q), ANSWER_TOKENS, memory)[0] for q in FOLLOW_UPS]


REPEATS = 3  # sessions per length and configuration, each restored from disk on its own


def drop_from_page_cache(files) -> None:
    """So that the next read of these files reads the disk, as after a reboot."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def restore_floor(root: Path, session_id: str) -> dict:
    """What restoring a session cannot go below on this machine, measured here: reading its file
    from the disk (at the bandwidth this read measures), dequantizing its blocks (the store's own
    decode), and one copy of the KV into memory that is already mapped (the pool write, no scatter)."""
    from sgl_memory.persist.store import CacheSpec, SessionFiles

    with safe_open(str(next(root.glob("*/*/*.safetensors"))), "pt") as f:
        meta = f.metadata()  # every file of the store has this server's spec and format
    files = SessionFiles(
        root, CacheSpec(**json.loads(meta["spec"])), meta["quant"], meta["kivi"] == "True", int(meta["block_size"])
    )
    session_files = files.files(None, session_id)  # its head and chunks
    drop_from_page_cache(session_files)
    t0 = time.perf_counter()
    for file in session_files:
        with open(file, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass
    read_s = time.perf_counter() - t0
    record = files.read(None, session_id)
    t0 = time.perf_counter()
    keys, values = files.decode(record)
    dequantize_s = time.perf_counter() - t0
    pool = torch.ones_like(keys), torch.ones_like(values)  # touched: a running server's pool is mapped
    t0 = time.perf_counter()
    pool[0].copy_(keys), pool[1].copy_(values)
    write_s = time.perf_counter() - t0
    size = files.size(None, session_id)
    return {
        "bytes": size,
        "read_s": read_s,
        "disk_mb_per_s": size / read_s / 1e6,
        "dequantize_s": dequantize_s,
        "write_s": write_s,
        "floor_s": read_s + dequantize_s + write_s,
    }


def run_store(model, quant, sessions, work: Path, answers: dict) -> dict:
    """Writer server: first turns, REPEATS sessions per length. Reader server: per length, each
    session's second turn restored from disk (the tree flushed before each), the follow-up answers,
    the same turn again from host memory (warm) and with everything in the tree (hot: what the
    turn costs besides the restore)."""
    d = work / quant
    d.mkdir()
    config = store_config(d, quant)
    writer = harness.start(harness.our_command(model, "--memory-config", str(config)), d / "writer.log")
    try:
        for n, first in sessions.items():
            answers.setdefault(n, chat(writer, first, 16, {"session_id": f"s{n}-0"})[0])
            for r in range(REPEATS):  # the same history: a radix hit after the first
                chat(writer, first, 16, {"session_id": f"s{n}-{r}"})
        ok(writer.post("/flush_cache?timeout=600", {}), "/flush_cache")  # every write done
    finally:
        harness.stop(writer)
    files = list((d / "store").glob("*/*/*"))  # the sessions' heads and chunks
    # each session's files, a block it shares with the repeats counted in each (the format's bytes a token)
    stored_bytes = sum(p.stat().st_size for p in files if not is_shared(p))
    stored_tokens = 0
    for file in (p for p in files if p.suffix == ".safetensors"):  # a head holds the path's token count
        with safe_open(str(file), "pt") as f:
            stored_tokens += int(f.metadata()["tokens"])
    floors = {n: restore_floor(d / "store", f"s{n}-0") for n in sessions}
    drop_from_page_cache(files)
    reader = harness.start(harness.our_command(model, "--memory-config", str(config)), d / "reader.log")
    rows = {}
    try:
        for n, first in sessions.items():
            messages = second_turn(first, answers[n])
            runs = []
            for r in range(REPEATS):
                ok(reader.post("/flush_cache?timeout=600", {}), "/flush_cache")
                _, usage, metrics, seconds = chat(reader, messages, 1, {"session_id": f"s{n}-{r}"})
                runs.append(
                    {
                        "ttft_s": seconds,
                        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                        "prompt_tokens": usage["prompt_tokens"],
                        "restored_tokens": metrics.get("restored_tokens"),
                        "restore_ms": metrics.get("restore_ms"),
                        "restore_parts_ms": metrics.get("restore_parts_ms"),
                        "restored_from": metrics.get("restored_from"),
                        "text_match": metrics.get("text_match"),
                    }
                )
            median = sorted(runs, key=lambda run: run["ttft_s"])[len(runs) // 2]
            rows[n] = {
                **median,
                "runs": runs,
                "floor": floors[n],
                "answers": answer_all(reader, first, answers[n], {"session_id": f"s{n}-0"}),
            }
            ok(reader.post("/flush_cache?timeout=600", {}), "/flush_cache")
            _, _, metrics, seconds = chat(reader, messages, 1, {"session_id": f"s{n}-0"})
            rows[n].update(warm_ttft_s=seconds, warm_restored_from=metrics.get("restored_from"))
            rows[n]["hot_ttft_s"] = chat(reader, messages, 1, {"session_id": f"s{n}-0"})[3]
    finally:
        harness.stop(reader)
    return {
        "rows": rows,
        "stored_bytes": stored_bytes,
        "files": len(files),
        "stored_tokens": stored_tokens,
        "bytes_per_token": stored_bytes / max(stored_tokens, 1),
    }


def run_cold(command, env, sessions, answers, log: Path, memory: bool, follow_ups: bool = True) -> dict:
    """The second turn re-prefilled whole (the sessions share their start: the tree is flushed
    before each, so none is a prefix hit), then the follow-up answers where they are compared."""
    server = harness.start(command, log, env)
    rows = {}
    try:
        for n, first in sessions.items():
            messages = second_turn(first, answers[n])
            field = {"session_id": f"s{n}"} if memory else None
            ok(server.post("/flush_cache?timeout=600", {}), "/flush_cache")
            _, usage, _, seconds = chat(server, messages, 1, field)
            rows[n] = {
                "ttft_s": seconds,
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            }
            if follow_ups:
                rows[n]["answers"] = answer_all(server, first, answers[n], field)
    finally:
        harness.stop(server)
    return {"rows": rows}


def run_hicache(path, sessions, answers, work: Path) -> dict:
    """SGLang's HiCache with the file storage backend: write with one server, read with the next."""
    d = work / "hicache"
    d.mkdir()
    flags = [
        *harness.cpu_flags(path, "torch_native"),
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "file",
        "--hicache-write-policy",
        "write_through",
    ]
    cmd, env = harness.plain_sglang(path, *flags)
    env = dict(env, SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=str(d / "store"))
    try:
        writer = harness.start(cmd, d / "writer.log", env)
    except RuntimeError as exc:
        lines = [ln for ln in str(exc).splitlines() if "Error" in ln or "error" in ln]
        return {"status": "does not start on this machine", "error": (lines or [str(exc)])[-1][:400]}
    try:
        for n, first in sessions.items():
            chat(writer, first, 16)
    finally:
        harness.stop(writer)
    cold = run_cold(cmd, env, sessions, answers, d / "reader.log", memory=False, follow_ups=False)
    return {"status": "ran", **cold}


def fidelity(path, tokenizer, turns, prefix_tokens=2048, continuation=512, free=32) -> dict:
    """KV of a LoCoMo prefix stored as each quantization, then a teacher-forced continuation."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from sgl_memory.persist.quant import BITS, dequantize, quantize

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = chat_ids(tokenizer, [{"role": "system", "content": SYSTEM}, *turns])
    ids = torch.tensor(ids[: prefix_tokens + continuation]).unsqueeze(0)
    prefix, rest = ids[:, :prefix_tokens], ids[:, prefix_tokens:]

    def run(variant):
        with torch.no_grad():
            cache = DynamicCache()
            model(prefix, past_key_values=cache, use_cache=True)
            for layer in cache.layers:
                for name in ("keys", "values"):
                    x = getattr(layer, name)  # [1, kv_heads, tokens, head_dim]
                    if variant != "bf16":
                        kivi = variant == "q4-kivi" and name == "keys"
                        bits = BITS[variant.split("-")[0]]
                        q = quantize(x.transpose(1, 2), bits, axis=1 if kivi else -1)
                        setattr(layer, name, dequantize(q, x.dtype).transpose(1, 2).contiguous())
            snapshot = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
            logits = model(rest, past_key_values=cache, use_cache=True).logits[0].float()
            for layer, (k, v) in zip(cache.layers, snapshot):  # back to the prefix only
                layer.keys, layer.values = k, v
            out = model.generate(
                torch.cat([prefix, rest[:, :1]], 1), past_key_values=cache, max_new_tokens=free, do_sample=False
            )[0, prefix_tokens + 1 :].tolist()
        return logits.log_softmax(-1), out

    results, (ref_lp, ref_out) = {}, run("bf16")
    targets = rest[0, 1:]
    for variant in ("bf16", "q8", "q4", "q4-kivi"):
        lp, out = (ref_lp, ref_out) if variant == "bf16" else run(variant)
        kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
        nll = -lp[:-1].gather(1, targets.unsqueeze(1)).squeeze(1)
        results[variant] = {
            "next_token_kl_mean": float(kl.mean()),
            "next_token_kl_max": float(kl.max()),
            "perplexity": float(nll.mean().exp()),
            "top1_agreement": float((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean()),
            "free_greedy_agreement": sum(a == b for a, b in zip(out, ref_out)) / max(len(ref_out), 1),
        }
    return {"prefix_tokens": prefix_tokens, "continuation_tokens": int(rest.shape[1]), "variants": results}


def token_agreement(a: str, b: str, tokenizer) -> float:
    x, y = tokenizer.encode(a), tokenizer.encode(b)
    return sum(p == q for p, q in zip(x, y)) / max(len(x), len(y), 1)


def agreement(answers: list[str], reference: list[str], tokenizer) -> dict:
    """Answers against a reference configuration's, per follow-up: the share that is the same text,
    and the mean share of positions with the same token, each with a 95% bootstrap interval."""
    same = [[float(a == b)] for a, b in zip(answers, reference)]
    tokens = [[token_agreement(a, b, tokenizer)] for a, b in zip(answers, reference)]
    (e, e_lo, e_hi), (t, t_lo, t_hi) = bootstrap(same), bootstrap(tokens)
    return {
        "n": len(same),
        "same_answer": e,
        "same_answer_ci": [e_lo, e_hi],
        "token_agreement": t,
        "token_agreement_ci": [t_lo, t_hi],
    }


def ratios(row: dict, cold: dict, exact: dict, tokenizer) -> dict:
    """A configuration's turn against the cold re-prefill; for a store, where its time went: the
    restore against its floor, and the rest of the time to first token against the same turn with
    everything in the tree (hot); its answers against the exact store's and the cold ones."""
    out = {"cold_over_ttft": cold["ttft_s"] / row["ttft_s"]}
    if "warm_ttft_s" in row:
        out["cold_over_warm_ttft"] = cold["ttft_s"] / row["warm_ttft_s"]
    if row.get("floor"):
        out["restore_over_floor"] = row["restore_ms"] / 1000 / row["floor"]["floor_s"]
        out["ttft_besides_restore_and_hot_s"] = row["ttft_s"] - row["restore_ms"] / 1000 - row["hot_ttft_s"]
    if "answers" in row:
        out["answers_vs_exact_store"] = agreement(row["answers"], exact["answers"], tokenizer)
        out["answers_vs_cold"] = agreement(row["answers"], cold["answers"], tokenizer)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(result["sessions"], key=int)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    modes = [m for m in result["ttft"] if result["ttft"][m].get("rows")]
    width = 0.8 / max(len(modes), 1)
    for j, mode in enumerate(modes):
        rows = result["ttft"][mode]["rows"]
        ax1.bar([i + j * width for i in range(len(lengths))], [rows[n]["ttft_s"] for n in lengths], width, label=mode)
    ax1.set_xticks(
        [i + 0.4 - width / 2 for i in range(len(lengths))], [f"{result['sessions'][n]} tok" for n in lengths]
    )
    ax1.set_yscale("log")
    ax1.set_ylabel("time to first token after restart (s, log)")
    ax1.legend(fontsize=7)
    variants = result["fidelity"]["variants"]
    ax2.bar(list(variants), [variants[v]["next_token_kl_mean"] for v in variants])
    ax2.set_ylabel("mean next-token KL vs bf16 KV (nats)")
    for i, v in enumerate(variants):
        ax2.text(
            i,
            variants[v]["next_token_kl_mean"],
            f"ppl {variants[v]['perplexity']:.2f}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save(result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    write_json(RESULTS / "persist_restart.json", result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--conversation", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = models.model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    conversations = data.load()
    # one LoCoMo conversation is about 15k tokens: the next one continues the 16k session
    turns = dialogue(conversations[args.conversation]) + dialogue(conversations[args.conversation + 1])
    sessions, answers = {}, {}
    for n in args.lengths:
        sessions[str(n)] = session_of_length(tokenizer, turns, n) + [{"role": "user", "content": FIRST}]
    result = {
        "model": args.model,
        "pool_dtype": cpu_dtype.choose().dtype,
        "sessions": {n: len(chat_ids(tokenizer, m)) for n, m in sessions.items()},
        "ttft": {},
    }
    with tempfile.TemporaryDirectory(prefix="persist-bench-") as tmp:
        work = Path(tmp)
        steps = [*(f"store-{q}" for q in QUANTS), "ours-cold", "plain-sglang-cold", "hicache-file"]
        for step in tqdm(steps, desc="configurations"):
            if step.startswith("store-"):
                result["ttft"][step] = run_store(args.model, step[6:], sessions, work, answers)
            elif step == "ours-cold":
                cmd = harness.our_command(args.model, "--plain")  # no store: persistence is on by default
                result["ttft"][step] = run_cold(cmd, None, sessions, answers, work / "cold.log", memory=True)
            elif step == "plain-sglang-cold":
                cmd, env = harness.plain_sglang(path, *harness.cpu_flags(path, "torch_native"), "--enable-cache-report")
                result["ttft"][step] = run_cold(
                    cmd, env, sessions, answers, work / "plain.log", memory=False, follow_ups=False
                )
            else:
                result["ttft"][step] = run_hicache(path, sessions, answers, work)
            save(result)  # a late failure keeps what ran
    cold, exact = result["ttft"]["ours-cold"]["rows"], result["ttft"][f"store-{EXACT}"]["rows"]
    result["ratios"] = {
        mode: {n: ratios(rows["rows"][n], cold[n], exact[n], tokenizer) for n in sessions}
        for mode, rows in result["ttft"].items()
        if rows.get("rows")
    }
    save(result)
    result["fidelity"] = fidelity(path, tokenizer, turns)
    save(result)
    plot(result, RESULTS / "persist_restart.png")
    print(
        json.dumps(
            {
                "ratios": result["ratios"],
                "bytes_per_token": {m: r.get("bytes_per_token") for m, r in result["ttft"].items()},
                "fidelity": result["fidelity"]["variants"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
