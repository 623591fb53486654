"""Compute dtype per CPU: prefill and decode tokens/s of the default model in bf16 and float32, on
this CPU and on an AVX2-only CPU, side by side in one run.

The AVX2-only CPU (an EPYC without AVX-512 or bf16 in hardware is one of the project's machines)
is this CPU told to use no more than AVX2: ATEN_CPU_CAPABILITY=avx2 for torch's own kernels,
ONEDNN_MAX_CPU_ISA=AVX2 for oneDNN's matmuls. On each CPU: our server in bf16, in float32, and
plain SGLang as it starts by default (the model's bf16, torch_native attention); on this CPU also
float32 compute over a bf16 KV pool (what a half-size pool would cost or save). Each server: cold
prefill of fresh prompts, a full radix hit, then greedy decode on the cached prompt. Also the MLP
matmul alone (F.linear at the model's shape), the number the choice rests on. The launcher's
choice for each CPU is recorded beside the measurements (sgl_memory/cpu_dtype.py).

Writes bench/results/cpu_dtype.{json,md,png}.

    .venv/bin/python bench/cpu_dtype.py [--lengths 512 4096]
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from common import RESULTS, generate, ours, parse_args, prompt_of_length, write_json
from sgl_memory import cpu_dtype, models
from bench import harness
from bench.harness import cpu_flags, plain_sglang

DECODE_TOKENS = 33  # 32 decode steps after the first token
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
CPUS = {"this CPU": {}, "AVX2-only": AVX2_ENV}
# (name, engine, --dtype, --kv-cache-dtype, CPUs it runs on)
VARIANTS = [
    ("ours bf16", "ours", "bfloat16", None, ("this CPU", "AVX2-only")),
    ("ours float32", "ours", "float32", None, ("this CPU", "AVX2-only")),
    ("ours float32, bf16 KV", "ours", "float32", "bfloat16", ("this CPU",)),
    ("plain SGLang (default bf16)", "plain", None, None, ("this CPU", "AVX2-only")),
]

GEMM = """
import json, time, torch
torch.set_num_threads(int(__import__("os").environ.get("THREADS", "2")))
out = {"capability": torch.backends.cpu.get_cpu_capability()}
x32, w32 = torch.randn(512, 896), torch.randn(4864, 896)  # the default model's MLP up-projection
for dtype in (torch.float32, torch.bfloat16):
    for m, reps in ((512, 20), (1, 300)):  # a prefill chunk, a decode step
        x, w = x32[:m].to(dtype), w32.to(dtype)
        for _ in range(3):
            torch.nn.functional.linear(x, w)
        t = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(x, w)
        out[f"{str(dtype)[6:]} m={m}"] = 2 * m * 896 * 4864 * reps / (time.perf_counter() - t) / 1e9
print(json.dumps(out))
"""


def gemm_gflops(env: dict) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", GEMM], env=dict(os.environ, **env), capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def measure(server, tokenizer, lengths, seed) -> dict:
    out = {}
    for n in tqdm(lengths, desc="lengths", leave=False):
        colds = [generate(server, prompt_of_length(tokenizer, n, seed + n + rep), 1)["e2e_latency"] for rep in range(2)]
        ids = prompt_of_length(tokenizer, n, seed + n)  # cached by the first cold prefill
        hit = generate(server, ids, 1)["e2e_latency"]
        decode = generate(server, ids, DECODE_TOKENS)["e2e_latency"]
        out[n] = {
            "cold_prefill_s": colds,
            "prefill_tok_per_s": n / (sum(colds) / len(colds)),
            "full_hit_s": hit,
            "decode_tok_per_s": (DECODE_TOKENS - 1) / max(decode - hit, 1e-9),
        }
    return out


def speedups(a: dict, b: dict) -> dict:
    """a's tokens/s over b's, per metric and length."""
    return {
        f"{metric.split('_')[0]} @{n}": a["by_length"][n][metric] / b["by_length"][n][metric]
        for metric in ("prefill_tok_per_s", "decode_tok_per_s")
        for n in a["by_length"]
    }


def command(engine: str, model: str, model_path, dtype, kv_dtype) -> tuple[list[str], dict | None]:
    flags = [*(["--dtype", dtype] if dtype else []), *(["--kv-cache-dtype", kv_dtype] if kv_dtype else [])]
    if engine == "ours":
        return ours(model, *flags)
    return plain_sglang(model_path, *cpu_flags(model_path, "torch_native"), *flags)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def table(result: dict) -> str:
    lengths = result["lengths"]
    head = "| CPU | server | " + " | ".join(f"prefill tok/s @{n}" for n in lengths)
    head += " | " + " | ".join(f"decode tok/s @{n}" for n in lengths) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(lengths))]
    for key, v in result["variants"].items():
        cells = [f"{v['by_length'][str(n)]['prefill_tok_per_s']:.0f}" for n in lengths]
        cells += [f"{v['by_length'][str(n)]['decode_tok_per_s']:.1f}" for n in lengths]
        lines.append(f"| {v['cpu']} | {v['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_md(result: dict, path: Path) -> None:
    lines = [
        f"# Compute dtype per CPU ({result['model']}, {result['cores']} cores)",
        "",
        f"CPU: {result['cpu_model']}; torch {result['torch']}.",
        "",
        "| CPU | torch capability | bf16 flags | launcher's choice | why |",
        "|---|---|---|---|---|",
    ]
    for name, c in result["cpus"].items():
        ch = c["choice"]
        lines.append(
            f"| {name} | {ch['cpu_capability']} | {', '.join(ch['bf16_flags']) or 'none'} "
            f"| {ch['dtype']} | {ch['reason']} |"
        )
    lines += [
        "",
        "MLP matmul (F.linear 512 x 896 by 4864 x 896, and one row), GFLOP/s:",
        "",
        "| CPU | float32 m=512 | bf16 m=512 | float32 m=1 | bf16 m=1 |",
        "|---|---|---|---|---|",
    ]
    for name, c in result["cpus"].items():
        g = c["gemm"]
        lines.append(
            f"| {name} | {g['float32 m=512']:.1f} | {g['bfloat16 m=512']:.1f} "
            f"| {g['float32 m=1']:.1f} | {g['bfloat16 m=1']:.1f} |"
        )
    lines += [
        "",
        "Servers (greedy, one request at a time; prefill: the mean of two fresh prompts):",
        "",
        table(result),
        "",
        "Ratios (the launcher's choice over the other dtype, same CPU, ours):",
        "",
    ]
    for name, r in result["ratios"].items():
        lines.append(f"- {name}: " + "; ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    lengths = result["lengths"]
    for key, v in result["variants"].items():
        style = "-" if v["cpu"] == "this CPU" else "--"
        for ax, metric in zip(axes, ("prefill_tok_per_s", "decode_tok_per_s")):
            ax.plot(lengths, [v["by_length"][str(n)][metric] for n in lengths], style, marker="o", label=key)
    for ax, title in zip(axes, ("cold prefill tok/s", "decode tok/s (cached prompt)")):
        ax.set_title(title)
        ax.set_xlabel("prompt tokens")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{result['model']}: bf16 vs float32 on {result['cpu_model']} and as an AVX2-only CPU (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parse_args(__doc__, [512, 4096])
    from transformers import AutoTokenizer

    model_path = models.fetch(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    import torch

    result = {
        "model": args.model,
        "lengths": args.lengths,
        "cores": os.cpu_count(),
        "cpu_model": cpu_model(),
        "torch": torch.__version__,
        "cpus": {},
        "variants": {},
    }
    for name, env in CPUS.items():
        gemm = gemm_gflops(env)  # its capability is torch's under that CPU's environment
        result["cpus"][name] = {
            "env": env,
            "choice": vars(cpu_dtype.choose_auto(gemm["capability"], cpu_dtype.cpu_flags())),
            "gemm": gemm,
        }
    runs = [(cpu, v) for v in VARIANTS for cpu in v[4]]
    with tempfile.TemporaryDirectory() as tmp:
        for cpu, (name, engine, dtype, kv_dtype, _) in tqdm(runs, desc="servers"):
            cmd, env = command(engine, args.model, model_path, dtype, kv_dtype)
            env = dict(env or os.environ, **CPUS[cpu])
            env.pop(cpu_dtype.ENV, None)
            key = f"{cpu}: {name}"
            server = harness.start(cmd, Path(tmp) / f"{len(result['variants'])}.log", env=env)
            try:
                info = server.get("/server_info").json()
                by_length = measure(server, tokenizer, args.lengths, args.seed)
            finally:
                harness.stop(server)
            result["variants"][key] = {
                "cpu": cpu,
                "name": name,
                "engine": engine,
                "dtype": info["dtype"],
                "kv_cache_dtype": info["kv_cache_dtype"],
                "by_length": {str(n): r for n, r in by_length.items()},
            }
    runs, result["ratios"] = result["variants"], {}
    for cpu, c in result["cpus"].items():
        chosen = "bf16" if c["choice"]["dtype"] == "bfloat16" else "float32"
        other = "float32" if chosen == "bf16" else "bf16"
        result["ratios"][f"{cpu}, {chosen} over {other}"] = speedups(
            runs[f"{cpu}: ours {chosen}"], runs[f"{cpu}: ours {other}"]
        )
    result["ratios"]["this CPU, float32 with a bf16 KV pool over a float32 pool"] = speedups(
        runs["this CPU: ours float32, bf16 KV"], runs["this CPU: ours float32"]
    )
    RESULTS.mkdir(exist_ok=True)
    write_json(RESULTS / "cpu_dtype.json", result)
    write_md(result, RESULTS / "cpu_dtype.md")
    plot(result, RESULTS / "cpu_dtype.png")
    print((RESULTS / "cpu_dtype.md").read_text())


if __name__ == "__main__":
    main()
