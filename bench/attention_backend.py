"""CPU attention benchmark: SGLang's torch_native backend vs our sgl_memory_cpu, one run, same model,
and ours on an 8-bit pool (SGLang's `--kv-cache-dtype fp8_e4m3` and our `int8`, the same tokens:
each part of the KV it attends is cast or decoded to the compute dtype as it is read).

For each context length: cold prefill, full radix hit (the same prompt again: 1 token extended over a
cached prefix), an extend of 64 new tokens over the cached prefix, and decode tokens/s at that
context (DECODE_REPEATS requests of DECODE_TOKENS steps: the 8-bit pools' decode step over the
float pool's, with a bootstrap interval over the requests); then the decode throughput of 8
concurrent requests over 2k-token contexts. Next to them, the floor of a one-token forward on
this machine: weights read once plus the context's KV, both in the compute dtype, over the measured
read bandwidth. Writes bench/results/attention_backend.json and .png (`--out`).

    .venv/bin/python bench/attention_backend.py [--model qwen2.5-coder-0.5b-instruct]
        [--lengths 1024 4096 8192 10240 16384] [--variants plain ours ours-fp8 ours-int8] [--out PATH]
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from common import (
    RESULTS,
    generate,
    ours,
    parse_args,
    prompt_of_length,
    ratio_interval,
    read_bandwidth_gbs,
    write_json,
)
from sgl_memory import cpu_dtype, kv_pool, models
from bench import harness
from bench.harness import cpu_flags, plain_sglang

NEW_TOKENS = 64
DECODE_TOKENS = 32
DECODE_REPEATS = 3  # decode requests per length: the step's interval
BATCH = 8  # concurrent decoding requests in the batched-decode measurement
BATCH_CONTEXT = 2048
VARIANTS = {
    "plain": "torch_native (plain sglang)",
    "ours": "sgl_memory_cpu (ours)",
    "ours-fp8": "sgl_memory_cpu, fp8_e4m3 pool (ours)",
    "ours-int8": "sgl_memory_cpu, int8 pool (ours)",
}
EIGHT_BIT = {"ours-fp8": "fp8_e4m3", "ours-int8": "int8"}  # variant -> --kv-cache-dtype


def measure(server, tokenizer, lengths, seed) -> dict:
    out = {}
    for n in tqdm(lengths, desc="lengths", leave=False):
        ids = prompt_of_length(tokenizer, n, seed + n)
        more = prompt_of_length(tokenizer, NEW_TOKENS, seed - n)
        cold = generate(server, ids, 1)
        hit = generate(server, ids, 1)
        extend = generate(server, ids + more, 1)
        # each a full hit, then DECODE_TOKENS decode steps
        decodes = [generate(server, ids, DECODE_TOKENS + 1) for _ in range(DECODE_REPEATS)]
        steps = [max(d["e2e_latency"] - hit["e2e_latency"], 1e-9) / DECODE_TOKENS for d in decodes]
        assert hit["cached_tokens"] >= n - 1 and extend["cached_tokens"] >= n - 1, (hit, extend)
        out[n] = {
            "cold_prefill_s": cold["e2e_latency"],
            "full_hit_s": hit["e2e_latency"],
            "extend_64_s": extend["e2e_latency"],
            "decode_step_s": steps,
            "decode_tok_per_s": len(steps) / sum(steps),
            "hit_speedup_over_cold": cold["e2e_latency"] / hit["e2e_latency"],
        }
    return out


def batched_decode(server, tokenizer, seed) -> float:
    """Tokens/s of BATCH requests decoding together, each over its own cached BATCH_CONTEXT prompt."""
    prompts = [prompt_of_length(tokenizer, BATCH_CONTEXT, seed + 17 * i) for i in range(BATCH)]
    for ids in prompts:
        generate(server, ids, 1)  # cache the prompts: what follows is decode only
    t0 = time.perf_counter()
    with ThreadPoolExecutor(BATCH) as pool:
        list(pool.map(lambda ids: generate(server, ids, DECODE_TOKENS + 1), prompts))
    return BATCH * DECODE_TOKENS / (time.perf_counter() - t0)


def floors(model_path: Path, lengths, bandwidth_gbs: float, dtype: str) -> dict:
    """Seconds of one token's forward if it only had to read the weights and the context's KV once,
    both held in the compute dtype `dtype` (the server's: float32 weights are twice the bf16 file).
    The input embedding is left out where the model has its own output head: a token reads one row
    of it."""
    from safetensors import safe_open

    sizes = {}
    for f in model_path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as tensors:
            sizes |= {k: math.prod(tensors.get_slice(k).get_shape()) for k in tensors.keys()}
    read = sum(sizes.values())
    if any("lm_head" in k for k in sizes):
        read -= sum(n for k, n in sizes.items() if "embed_tokens" in k)
    weights = read * kv_pool.ELEMENT_BYTES.get(dtype, 2)
    kv = kv_pool.bytes_per_token(model_path, dtype)
    return {n: (weights + n * kv) / (bandwidth_gbs * 1e9) for n in lengths}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("cold_prefill_s", "cold prefill (s)"),
        ("full_hit_s", "full radix hit (s)"),
        ("extend_64_s", f"extend {NEW_TOKENS} on cached prefix (s)"),
        ("decode_tok_per_s", "decode tok/s"),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(17, 3.8))
    for name, rows in result["variants"].items():
        ls = sorted(int(k) for k in rows)
        for ax, (key, _) in zip(axes, metrics):
            ax.plot(ls, [rows[str(n)][key] for n in ls], marker="o", label=name)
    ls = sorted(int(k) for k in result["floor_one_token_s"])
    axes[1].plot(ls, [result["floor_one_token_s"][str(n)] for n in ls], "k--", label="floor (bytes / bandwidth)")
    axes[3].plot(ls, [1 / result["floor_one_token_s"][str(n)] for n in ls], "k--", label="floor")
    for ax, (key, title) in zip(axes, metrics):
        ax.set_title(title)
        ax.set_xlabel("context tokens")
        if key != "decode_tok_per_s":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']}: torch_native vs sgl_memory_cpu attention")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parse_args(
        __doc__,
        [1024, 4096, 8192, 10240, 16384],
        variants={"nargs": "+", "choices": list(VARIANTS), "default": list(VARIANTS)},
        out={"type": Path, "default": RESULTS / "attention_backend.json"},
    )

    from transformers import AutoTokenizer

    model_path = models.fetch(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    commands = {
        "plain": plain_sglang(model_path, *cpu_flags(model_path, "torch_native")),
        "ours": ours(args.model, *cpu_flags(model_path, "sgl_memory_cpu")),
        **{
            v: ours(args.model, *cpu_flags(model_path, "sgl_memory_cpu"), "--kv-cache-dtype", dtype)
            for v, dtype in EIGHT_BIT.items()
        },
    }
    variants = {VARIANTS[k]: commands[k] for k in args.variants}
    bandwidth = read_bandwidth_gbs()
    dtype = cpu_dtype.choose().dtype  # what cpu_flags gives every server here
    result = {
        "model": args.model,
        "read_bandwidth_gbs": bandwidth,
        "variants": {},
        "compute_dtype": dtype,
        "floor_one_token_s": {str(n): s for n, s in floors(model_path, args.lengths, bandwidth, dtype).items()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, (cmd, env) in tqdm(variants.items(), desc="servers"):
            server = harness.start(cmd, Path(tmp) / "server.log", env=env)
            try:
                result["variants"][name] = {
                    str(n): row for n, row in measure(server, tokenizer, args.lengths, args.seed).items()
                }
                result.setdefault("batched_decode_tok_per_s", {})[name] = batched_decode(server, tokenizer, args.seed)
            finally:
                harness.stop(server)
    rows = result["variants"]
    plain, mine = (rows.get(VARIANTS[k]) for k in ("plain", "ours"))
    if plain and mine:
        result["ours_over_plain_speedup"] = {
            n: {k: plain[n][k] / mine[n][k] for k in ("cold_prefill_s", "full_hit_s", "extend_64_s")}
            | {"decode_tok_per_s": mine[n]["decode_tok_per_s"] / plain[n]["decode_tok_per_s"]}
            for n in mine
        }
    if mine:
        result["ours_hit_over_floor"] = {n: mine[n]["full_hit_s"] / result["floor_one_token_s"][n] for n in mine}
    for variant, dtype in EIGHT_BIT.items():  # an 8-bit pool's decode step over the float pool's: (ratio, low, high)
        eight = rows.get(VARIANTS[variant])
        if mine and eight:
            result.setdefault("eight_bit_decode_step_over_float", {})[dtype] = {
                n: ratio_interval(list(zip(eight[n]["decode_step_s"], mine[n]["decode_step_s"]))) for n in eight
            }
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    summary = ("ours_over_plain_speedup", "ours_hit_over_floor", "eight_bit_decode_step_over_float")
    summary += ("batched_decode_tok_per_s",)
    print(json.dumps({k: result[k] for k in summary if k in result}, indent=2))


if __name__ == "__main__":
    main()
