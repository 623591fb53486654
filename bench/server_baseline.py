"""Foundation benchmark: our server vs plain SGLang, same model, same CPU flags, one run.

Measures start-up time, RSS of the whole process tree, cold prefill throughput, full radix-hit
latency and decode throughput. Writes bench/results/server_baseline.json and .png.

    .venv/bin/python bench/server_baseline.py [--model qwen2.5-coder-0.5b-instruct] [--lengths 1024 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from sgl_memory import harness, launch_server, models

RESULTS = Path(__file__).parent / "results"
DECODE_TOKENS = 64


def prompt_of_length(tokenizer, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    words = "agent tool memory cache session radix prefix token query answer turn history".split()
    text = " ".join(rng.choice(words) for _ in range(n * 2))
    return tokenizer(text)["input_ids"][:n]


def latency(server, input_ids, max_new_tokens) -> float:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    r = server.post("/generate", body)
    r.raise_for_status()
    return r.json()["meta_info"]["e2e_latency"]


def measure(server, tokenizer, lengths, seed) -> dict:
    out = {"start_seconds": round(server.start_seconds, 2), "rss_bytes_idle": server.rss_bytes(), "by_length": {}}
    for n in tqdm(lengths, desc="lengths", leave=False):
        ids = prompt_of_length(tokenizer, n, seed + n)
        cold = latency(server, ids, 1)
        hit = latency(server, ids, 1)
        long_decode = latency(server, ids, DECODE_TOKENS)  # prefix cached: this is decode time
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    model_path = models.fetch(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    cpu_flags = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
                 "--skip-server-warmup", "--max-total-tokens", str(launch_server.default_max_total_tokens(model_path))]
    plain_env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", SGLANG_PLUGINS="none")  # none: ours not loaded
    variants = {
        "sgl-memory": (harness.our_command(args.model, *cpu_flags), None),
        "plain sglang": ([sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), *cpu_flags], plain_env),
    }
    result = {"model": args.model, "lengths": args.lengths, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (cmd, env) in tqdm(variants.items(), desc="servers"):
            server = harness.start(cmd, Path(tmp) / f"{name.replace(' ', '_')}.log", env=env)
            try:
                result["variants"][name] = measure(server, tokenizer, args.lengths, args.seed)
            finally:
                harness.stop(server)
    ours, plain = result["variants"]["sgl-memory"], result["variants"]["plain sglang"]
    result["ratios_ours_over_plain"] = {
        str(n): {k: ours["by_length"][n][k] / plain["by_length"][n][k] for k in ("prefill_tok_per_s", "decode_tok_per_s", "hit_speedup")}
        for n in args.lengths
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "server_baseline.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "server_baseline.png")
    print(json.dumps(result["ratios_ours_over_plain"], indent=2))


if __name__ == "__main__":
    main()
