"""Persistent session KV benchmark: the next turn after a server restart, and what Q4 / Q8 cost.

Sessions are LoCoMo dialogues (the two speakers as user and assistant) cut to about 1k, 4k and 16k
tokens of history. A writer server runs each session's first turn and stops; a fresh server then
receives the second turn. Side by side, in one run:

- plain SGLang (torch_native, its CPU default): no persistence, the second turn re-prefills all;
- our engine without the store: the same, on our CPU attention backend (cold re-prefill);
- our store with bf16, Q8 and Q4 files: the second turn restores the history from disk; then, the
  tree flushed, once more from the host-memory (warm) tier;
- SGLang's HiCache with its `file` storage backend, when it starts on this machine.

Time to first token is the latency of the turn with one output token. Bytes on disk per token
come from the files. Fidelity of Q8 / Q4 against bf16 is measured on the model itself
(transformers): the KV of a LoCoMo prefix is quantized and dequantized as the store does, then a
continuation is teacher-forced: next-token KL against the bf16 cache, perplexity, greedy (top-1)
agreement, plus agreement of a free greedy continuation. The restored servers' answers are also
compared with the cold server's. Writes bench/results/persist_restart.json and .png.

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

from common import RESULTS, ok, write_json
from sgl_memory import harness, models

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo" / "locomo_dev7.json"
SYSTEM = "You are a helpful assistant that remembers the whole conversation."
QUESTIONS = ("Summarise what we talked about in one sentence.", "What did I say first?")
QUANTS = ("bf16", "q8", "q4")


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
    path.write_text(f"persist:\n  enabled: true\n  dir: {directory / 'store'}\n  quant: {quant}\n")
    return path


def second_turn(first: list[dict], answer: str) -> list[dict]:
    return first + [{"role": "assistant", "content": answer}, {"role": "user", "content": QUESTIONS[1]}]


def run_store(model, quant, sessions, work: Path, answers: dict) -> dict:
    """Writer server: first turns; reader server: second turns from disk, then from memory."""
    d = work / quant
    d.mkdir()
    config = store_config(d, quant)
    writer = harness.start(harness.our_command(model, "--memory-config", str(config)), d / "writer.log")
    try:
        for n, first in sessions.items():
            answers.setdefault(n, chat(writer, first, 16, {"session_id": f"s{n}"})[0])
        ok(writer.post("/flush_cache?timeout=600", {}), "/flush_cache")  # every write done
    finally:
        harness.stop(writer)
    files = list((d / "store").glob("*/*/*.safetensors"))
    stored_bytes = sum(p.stat().st_size for p in files)
    stored_tokens = 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            stored_tokens += int(f.metadata()["tokens"])
    reader = harness.start(harness.our_command(model, "--memory-config", str(config)), d / "reader.log")
    rows = {}
    try:
        for n, first in sessions.items():
            messages = second_turn(first, answers[n])
            _, usage, metrics, seconds = chat(reader, messages, 1, {"session_id": f"s{n}"})
            answer = chat(reader, messages, 32, {"session_id": f"s{n}"})[0]
            rows[n] = {"ttft_s": seconds, "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                       "prompt_tokens": usage["prompt_tokens"], "restored_tokens": metrics.get("restored_tokens"),
                       "restore_ms": metrics.get("restore_ms"), "restored_from": metrics.get("restored_from"),
                       "text_match": metrics.get("text_match"), "answer": answer}  # fmt: skip
        ok(reader.post("/flush_cache?timeout=600", {}), "/flush_cache")
        for n, first in sessions.items():
            _, usage, metrics, seconds = chat(reader, second_turn(first, answers[n]), 1, {"session_id": f"s{n}"})
            rows[n].update(warm_ttft_s=seconds, warm_restored_from=metrics.get("restored_from"))
    finally:
        harness.stop(reader)
    return {"rows": rows, "stored_bytes": stored_bytes, "files": len(files), "stored_tokens": stored_tokens,
            "bytes_per_token": stored_bytes / max(stored_tokens, 1)}  # fmt: skip


def run_cold(command, env, sessions, answers, log: Path, memory: bool) -> dict:
    server = harness.start(command, log, env)
    rows = {}
    try:
        for n, first in sessions.items():
            messages = second_turn(first, answers[n])
            _, usage, _, seconds = chat(server, messages, 1, {"session_id": f"s{n}"} if memory else None)
            answer = chat(server, messages, 32, {"session_id": f"s{n}"} if memory else None)[0]
            rows[n] = {"ttft_s": seconds, "prompt_tokens": usage["prompt_tokens"],
                       "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"), "answer": answer}  # fmt: skip
    finally:
        harness.stop(server)
    return {"rows": rows}


def run_hicache(path, sessions, answers, work: Path) -> dict:
    """SGLang's HiCache with the file storage backend: write with one server, read with the next."""
    d = work / "hicache"
    d.mkdir()
    flags = [*harness.cpu_flags(path, "torch_native"), "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
             "--hicache-write-policy", "write_through"]  # fmt: skip
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
    cold = run_cold(cmd, env, sessions, answers, d / "reader.log", memory=False)
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
            out = model.generate(torch.cat([prefix, rest[:, :1]], 1), past_key_values=cache, max_new_tokens=free,
                                 do_sample=False)[0, prefix_tokens + 1 :].tolist()  # fmt: skip
        return logits.log_softmax(-1), out

    results, (ref_lp, ref_out) = {}, run("bf16")
    targets = rest[0, 1:]
    for variant in ("bf16", "q8", "q4", "q4-kivi"):
        lp, out = (ref_lp, ref_out) if variant == "bf16" else run(variant)
        kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
        nll = -lp[:-1].gather(1, targets.unsqueeze(1)).squeeze(1)
        results[variant] = {
            "next_token_kl_mean": float(kl.mean()), "next_token_kl_max": float(kl.max()),
            "perplexity": float(nll.mean().exp()), "top1_agreement": float((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean()),
            "free_greedy_agreement": sum(a == b for a, b in zip(out, ref_out)) / max(len(ref_out), 1),
        }  # fmt: skip
    return {"prefix_tokens": prefix_tokens, "continuation_tokens": int(rest.shape[1]), "variants": results}


def agreement(a: str, b: str, tokenizer) -> float:
    x, y = tokenizer.encode(a), tokenizer.encode(b)
    return sum(p == q for p, q in zip(x, y)) / max(len(x), len(y), 1)


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
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(lengths))], [f"{result['sessions'][n]} tok" for n in lengths])
    ax1.set_yscale("log")
    ax1.set_ylabel("time to first token after restart (s, log)")
    ax1.legend(fontsize=7)
    variants = result["fidelity"]["variants"]
    ax2.bar(list(variants), [variants[v]["next_token_kl_mean"] for v in variants])
    ax2.set_ylabel("mean next-token KL vs bf16 KV (nats)")
    for i, v in enumerate(variants):
        ax2.text(i, variants[v]["next_token_kl_mean"], f"ppl {variants[v]['perplexity']:.2f}", ha="center", va="bottom", fontsize=8)
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
    conversations = json.loads(DATA.read_text())
    # one LoCoMo conversation is about 15k tokens: the next one continues the 16k session
    turns = dialogue(conversations[args.conversation]) + dialogue(conversations[args.conversation + 1])
    sessions, answers = {}, {}
    for n in args.lengths:
        sessions[str(n)] = session_of_length(tokenizer, turns, n) + [{"role": "user", "content": QUESTIONS[0]}]
    result = {"model": args.model, "sessions": {n: len(chat_ids(tokenizer, m)) for n, m in sessions.items()},
              "ttft": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="persist-bench-") as tmp:
        work = Path(tmp)
        steps = [*(f"store-{q}" for q in QUANTS), "ours-cold", "plain-sglang-cold", "hicache-file"]
        for step in tqdm(steps, desc="configurations"):
            if step.startswith("store-"):
                result["ttft"][step] = run_store(args.model, step[6:], sessions, work, answers)
            elif step == "ours-cold":
                cmd = harness.our_command(args.model)
                result["ttft"][step] = run_cold(cmd, None, sessions, answers, work / "cold.log", memory=True)
            elif step == "plain-sglang-cold":
                cmd, env = harness.plain_sglang(path, *harness.cpu_flags(path, "torch_native"), "--enable-cache-report")
                result["ttft"][step] = run_cold(cmd, env, sessions, answers, work / "plain.log", memory=False)
            else:
                result["ttft"][step] = run_hicache(path, sessions, answers, work)
            save(result)  # a late failure keeps what ran
    cold = result["ttft"]["ours-cold"]["rows"]
    result["ratios"] = {
        mode: {n: {"cold_over_ttft": cold[n]["ttft_s"] / rows["rows"][n]["ttft_s"],
                   **({"cold_over_warm_ttft": cold[n]["ttft_s"] / rows["rows"][n]["warm_ttft_s"]} if "warm_ttft_s" in rows["rows"][n] else {}),
                   "answer_agreement_with_cold": agreement(rows["rows"][n]["answer"], cold[n]["answer"], tokenizer)}
               for n in sessions}
        for mode, rows in result["ttft"].items() if rows.get("rows")
    }  # fmt: skip
    save(result)
    result["fidelity"] = fidelity(path, tokenizer, turns)
    save(result)
    plot(result, RESULTS / "persist_restart.png")
    print(json.dumps({"ratios": result["ratios"], "bytes_per_token": {m: r.get("bytes_per_token") for m, r in result["ttft"].items()},
                      "fidelity": result["fidelity"]["variants"]}, indent=1))  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
