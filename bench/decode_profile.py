"""Where a decode step's time goes: torch profiler traces of plain SGLang and ours, one run.

Each server decodes greedily after a cached prompt of each length while SGLang's own profiler
(`/start_profile`, CPU activity) records `PROFILE_STEPS` forward steps. From the trace, per decode
step (SGLang's `step[DECODE ...]` annotation): its wall time, the time inside top-level torch ops
(matrix products, attention, the rest) and the time outside them (the scheduler's and the model
runner's Python, and the gaps between ops). Variants: plain SGLang on `torch_native`, ours on
`torch_native` (the same attention: what our hooks add), and ours on its default `sgl_memory_cpu`.
Next to them, the floor of a one-token forward (weights and the context's KV read once at the
measured read bandwidth), decode tokens/s from a separate timed decode, and (py-spy, sampling the
scheduler process during a decode) the share of its samples whose innermost Python frame is ours.
Writes bench/results/decode_profile.json and .png.

    .venv/bin/python bench/decode_profile.py [--model qwen2.5-coder-0.5b-instruct] [--lengths 1024 4096]
"""

from __future__ import annotations

import collections
import gzip
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from tqdm import tqdm

from attention_backend import floors
from common import RESULTS, generate, ours, parse_args, prompt_of_length, read_bandwidth_gbs, write_json
from sgl_memory import models
from bench import harness
from bench.harness import cpu_flags, plain_sglang

PROFILE_STEPS = 12
DECODE_TOKENS = 33  # the timed decode: 32 steps after the prompt's last token
ATTENTION_OP = "attention"  # in the name of every attention op the traces hold (torch_native's and ours: aten SDPA)


def step_breakdown(trace: dict) -> dict:
    """Per decode step (ms): wall, inside top-level torch ops (matrix products, attention, other),
    outside them; with the heaviest ops by self time."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"].startswith("step[DECODE")), key=lambda e: e["ts"])
    if not steps:
        raise RuntimeError("the trace holds no decode step (SGLang's step[DECODE ...] annotation)")
    tid = steps[0]["tid"]
    spans = [(s["ts"], s["ts"] + s["dur"]) for s in steps]
    inside = sorted(
        (
            e
            for e in events
            if e["tid"] == tid
            and e.get("cat") == "cpu_op"
            and any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in spans)
        ),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    top, own = collections.Counter(), collections.Counter()
    open_ops: list[dict] = []
    for e in inside:
        while open_ops and open_ops[-1]["ts"] + open_ops[-1]["dur"] <= e["ts"]:
            open_ops.pop()
        if open_ops:
            own[open_ops[-1]["name"]] -= e["dur"]
        else:
            top[e["name"]] += e["dur"]
        own[e["name"]] += e["dur"]
        open_ops.append(e)
    n, ms = len(steps), 1 / 1000
    matmul = sum(t for name, t in top.items() if name in ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul"))
    attention = sum(t for name, t in top.items() if ATTENTION_OP in name.lower())
    in_ops = sum(top.values())
    wall = sum(s["dur"] for s in steps)
    return {
        "steps": n,
        "step_ms": wall / n * ms,
        "matmul_ms": matmul / n * ms,
        "attention_ms": attention / n * ms,
        "other_ops_ms": (in_ops - matmul - attention) / n * ms,
        "outside_ops_ms": (wall - in_ops) / n * ms,
        "top_self_ms": {name: t / n * ms for name, t in own.most_common(8)},
    }


def own_share(server, ids: list[int], out: Path) -> float | None:
    """Share of py-spy's samples of the scheduler process, during a decode, whose innermost Python
    frame is in sgl_memory: our Python and the torch calls it makes itself (without native frames
    py-spy charges a C call to the line that made it, so for our attention backend this includes
    its attention ops); what it calls in SGLang is not counted. None without py-spy."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        return None
    scheduler = max(psutil.Process(server.proc.pid).children(recursive=True), key=lambda p: p.memory_info().rss)
    decode = threading.Thread(target=generate, args=(server, ids, 80))
    decode.start()
    time.sleep(1)
    raw = out / "spy.txt"
    subprocess.run(
        [
            str(spy),
            "record",
            "--pid",
            str(scheduler.pid),
            "--duration",
            "4",
            "--rate",
            "200",
            "--format",
            "raw",
            "-o",
            str(raw),
        ],
        check=True,
        capture_output=True,
    )
    decode.join()
    total = own = 0
    for line in raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        total += int(count)
        own += int(count) * ("sgl_memory/" in stack.split(";")[-1])
    return own / total if total else None


def profile(server, tokenizer, n: int, seed: int, out: Path) -> dict:
    ids = prompt_of_length(tokenizer, n, seed + n)
    generate(server, ids, 1)  # the prompt into the cache: what follows is decode
    timed = generate(server, ids, DECODE_TOKENS)["e2e_latency"] - generate(server, ids, 1)["e2e_latency"]
    out.mkdir(parents=True)
    body = {
        "output_dir": str(out),
        "num_steps": PROFILE_STEPS,
        "activities": ["CPU"],
        "with_stack": False,
        "record_shapes": False,
    }
    r = server.post("/start_profile", body)
    if r.status_code != 200:
        raise RuntimeError(f"/start_profile: {r.status_code} {r.text[:200]}")
    generate(server, ids, PROFILE_STEPS + 4)
    deadline = time.monotonic() + 120  # the profiler writes its trace when its steps are done
    while not (found := list(out.glob("*.trace.json.gz"))) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not found:
        raise RuntimeError(f"no trace in {out}")
    time.sleep(2)  # written whole
    return {
        "decode_tok_per_s": (DECODE_TOKENS - 1) / timed,
        **step_breakdown(json.load(gzip.open(found[0]))),
        "own_python_share": own_share(server, ids, out),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = result["lengths"]
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4), squeeze=False)
    parts = [
        ("matmul_ms", "matrix products"),
        ("attention_ms", "attention"),
        ("other_ops_ms", "other torch ops"),
        ("outside_ops_ms", "outside torch ops (Python, gaps)"),
    ]
    for ax, n in zip(axes[0], lengths):
        names = list(result["variants"])
        bottom = [0.0] * len(names)
        for key, label in parts:
            values = [result["variants"][v][str(n)][key] for v in names]
            ax.bar(range(len(names)), values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.axhline(
            result["floor_one_token_s"][str(n)] * 1000, color="k", ls="--", label="floor: weights + KV read once"
        )
        ax.set_xticks(range(len(names)), [v.replace(" (", "\n(") for v in names], fontsize=8)
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"{n}-token context")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"decode step breakdown, {result['model']} (torch profiler)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parse_args(__doc__, [1024, 4096])

    from transformers import AutoTokenizer

    model_path = models.fetch(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    variants = {
        "plain sglang (torch_native)": plain_sglang(model_path, *cpu_flags(model_path, "torch_native")),
        "sgl-memory (torch_native)": ours(args.model, *cpu_flags(model_path, "torch_native")),
        "sgl-memory (sgl_memory_cpu, default)": ours(args.model, *cpu_flags(model_path, "sgl_memory_cpu")),
    }
    bandwidth = read_bandwidth_gbs()
    result = {
        "model": args.model,
        "lengths": args.lengths,
        "read_bandwidth_gbs": bandwidth,
        "variants": {},
        "floor_one_token_s": {str(n): s for n, s in floors(model_path, args.lengths, bandwidth).items()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (cmd, env)) in enumerate(tqdm(variants.items(), desc="servers")):
            server = harness.start(cmd, Path(tmp) / f"server{i}.log", env=env)
            try:
                result["variants"][name] = {
                    str(n): profile(server, tokenizer, n, args.seed, Path(tmp) / f"trace{i}-{n}") for n in args.lengths
                }
            finally:
                harness.stop(server)
    plain = result["variants"]["plain sglang (torch_native)"]
    result["over_plain"] = {
        name: {
            n: {
                "step": rows[n]["step_ms"] / plain[n]["step_ms"],
                "outside_ops": rows[n]["outside_ops_ms"] / plain[n]["outside_ops_ms"],
            }
            for n in rows
        }
        for name, rows in result["variants"].items()
    }
    result["step_over_floor"] = {
        name: {n: rows[n]["step_ms"] / 1000 / result["floor_one_token_s"][n] for n in rows}
        for name, rows in result["variants"].items()
    }
    RESULTS.mkdir(exist_ok=True)
    write_json(RESULTS / "decode_profile.json", result)
    plot(result, RESULTS / "decode_profile.png")
    print(json.dumps({k: result[k] for k in ("over_plain", "step_over_floor")}, indent=2))


if __name__ == "__main__":
    main()
