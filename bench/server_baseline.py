"""Foundation benchmark: our server vs plain SGLang, same model, same CPU flags, one run.

Measures start-up time, RSS of the whole process tree, cold prefill throughput, full radix-hit
latency and decode throughput. Writes bench/results/server_baseline.json and .png.

    .venv/bin/python bench/server_baseline.py [--model qwen2.5-coder-0.5b-instruct] [--lengths 1024 4096]
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from tqdm import tqdm

from common import RESULTS, generate, ours, parse_args, prompt_of_length, write_json
from sgl_memory import models
from bench import harness
from bench.harness import cpu_flags, plain_sglang

DECODE_TOKENS = 64


def measure(server, tokenizer, lengths, seed) -> dict:
    out = {"start_seconds": round(server.start_seconds, 2), "rss_bytes_idle": server.rss_bytes(), "by_length": {}}
    for n in tqdm(lengths, desc="lengths", leave=False):
        ids = prompt_of_length(tokenizer, n, seed + n)
        cold = generate(server, ids, 1)["e2e_latency"]
        hit = generate(server, ids, 1)["e2e_latency"]
        long_decode = generate(server, ids, DECODE_TOKENS)["e2e_latency"]  # prefix cached: this is decode time
        out["by_length"][n] = {
            "cold_prefill_s": cold,
            "prefill_tok_per_s": n / cold,
            "full_hit_s": hit,
            "hit_speedup": cold / hit,
            "decode_tok_per_s": (DECODE_TOKENS - 1) / max(long_decode - hit, 1e-9),
        }
    out["rss_bytes_after"] = server.rss_bytes()
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, res in result["variants"].items():
        ls = sorted(res["by_length"])
        rows = [res["by_length"][k] for k in ls]
        axes[0].plot(ls, [r["prefill_tok_per_s"] for r in rows], marker="o", label=name)
        axes[1].plot(ls, [r["hit_speedup"] for r in rows], marker="o", label=name)
        axes[2].plot(ls, [r["decode_tok_per_s"] for r in rows], marker="o", label=name)
    for ax, title in zip(axes, ["cold prefill tok/s", "full radix hit: speed-up over cold", "decode tok/s"]):
        ax.set_title(title)
        ax.set_xlabel("prompt tokens")
        ax.legend()
    fig.suptitle(f"{result['model']} on {os.cpu_count()} CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parse_args(__doc__, [1024, 4096])

    from transformers import AutoTokenizer

    model_path = models.fetch(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    flags = cpu_flags(model_path, "torch_native")  # same attention on both sides: this compares the servers
    variants = {"sgl-memory": ours(args.model, *flags), "plain sglang": plain_sglang(model_path, *flags)}
    result = {"model": args.model, "lengths": args.lengths, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (cmd, env) in tqdm(variants.items(), desc="servers"):
            server = harness.start(cmd, Path(tmp) / f"{name.replace(' ', '_')}.log", env=env)
            try:
                result["variants"][name] = measure(server, tokenizer, args.lengths, args.seed)
            finally:
                harness.stop(server)
    mine, plain = result["variants"]["sgl-memory"], result["variants"]["plain sglang"]
    result["ratios_ours_over_plain"] = {
        str(n): {
            k: mine["by_length"][n][k] / plain["by_length"][n][k]
            for k in ("prefill_tok_per_s", "decode_tok_per_s", "hit_speedup")
        }
        for n in args.lengths
    }
    RESULTS.mkdir(exist_ok=True)
    write_json(RESULTS / "server_baseline.json", result)
    plot(result, RESULTS / "server_baseline.png")
    print(json.dumps(result["ratios_ours_over_plain"], indent=2))


if __name__ == "__main__":
    main()
