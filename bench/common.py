"""Helpers shared by the benchmarks: prompts of exact token length, timed requests, our server's
command line, the pruning methods compared side by side and their per-request KV costs, and the
machine's memory bandwidth (plain SGLang's command line is in bench.harness)."""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from datetime import datetime, timezone
from functools import cache
from pathlib import Path

import requests
import torch

ROOT = Path(__file__).resolve().parents[1]
# a benchmark run as a script (`python bench/intent_sessions.py`) has bench/ on its path, not the
# repository: the harness is imported as the package module either way
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sgl_memory import models  # noqa: E402
from bench import harness  # noqa: E402

RESULTS = Path(__file__).parent / "results"


@cache
def commit() -> str:
    """The code a result came from: HEAD's hash, with `+dirty` when tracked files differ from it
    (a result from uncommitted code names no commit that reproduces it); `unknown` outside git.
    Results files do not count: a run rewrites its own, and an earlier run's uncommitted results
    change no code."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = (
            subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", ":!bench/results"], cwd=ROOT).returncode != 0
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def provenance() -> dict:
    """What every result file records: the commit it was produced from and when."""
    return {"commit": commit(), "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_rows(path: Path) -> list[dict]:
    """A resumable results file's rows; none before its first run."""
    return read_jsonl(path) if Path(path).exists() else []


def write_json(path: Path, result: dict, indent: int = 1) -> None:
    """A result file with its provenance, written atomically (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({**result, "provenance": provenance()}, indent=indent))
    tmp.replace(path)


def parse_args(doc: str, default_lengths: list[int], **extra: dict) -> argparse.Namespace:
    """The flags every server benchmark takes: model, context lengths, seed; and a benchmark's own
    (`extra`: flag name without dashes -> add_argument's keywords)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--lengths", type=int, nargs="+", default=default_lengths)
    ap.add_argument("--seed", type=int, default=0)
    for name, keywords in extra.items():
        ap.add_argument(f"--{name}", **keywords)
    return ap.parse_args()


def prompt_of_length(tokenizer, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    words = "agent tool memory cache session radix prefix token query answer turn history".split()
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer(" ".join(rng.choice(words) for _ in range(n)))["input_ids"]
    return ids[:n]


def disk_bytes(paths) -> int:
    """Bytes the files take on disk: each file once, however many names (hard links) it has, as
    the session store links a block every session that holds it shares."""
    stats = [p.stat() for p in paths if p.is_file()]
    return sum({(f.st_dev, f.st_ino): f.st_size for f in stats}.values())


def ok(r, what: str):
    """The response, or a RuntimeError carrying the server's answer: a bench never scores an error body."""
    if r.status_code != 200:
        raise RuntimeError(f"{what} answered {r.status_code}: {r.text[:500]}")
    return r


def generate(server, input_ids: list[int], max_new_tokens: int, timeout: float = 600) -> dict:
    """Greedy /generate on token ids; returns meta_info (e2e_latency, cached_tokens, ...). With one
    new token it is a prefill that leaves the prompt's KV in the tree (a long one needs a longer timeout)."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    return ok(server.post("/generate", body, timeout=timeout), "/generate").json()["meta_info"]


def stream(server, ids: list[int], max_tokens: int, field: dict | None) -> tuple[str, float, dict]:
    """Greedy streamed /generate: (text, TTFT in s, the final meta_info); the server's headers sent (a
    router's routing key)."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}}
    if field is not None:
        body["sgl_memory"] = field
    t0 = time.perf_counter()
    ttft, last = None, None
    with requests.post(server.url + "/generate", json=body, headers=server.headers, stream=True, timeout=1800) as r:
        ok(r, "/generate")
        for raw in r.iter_lines():
            if not raw.startswith(b"data:") or raw.strip() == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(raw[5:])
    if last is None or "text" not in last:
        raise RuntimeError(f"the stream ended without a result: {last}")
    return last["text"], ttft, last["meta_info"]


def stream_chat(server, body: dict, session: str, timeout: float = 1800) -> tuple[float | None, dict, dict]:
    """A streamed /v1/chat/completions (`body` asks for the stream and its usage), the session
    named by `x-session-id`: (TTFT in s, the usage, the response's `sgl_memory` metrics; {} when
    the server sends none)."""
    t0, ttft, usage, memory = time.perf_counter(), None, {}, {}
    with requests.post(
        server.url + "/v1/chat/completions", json=body, headers={"x-session-id": session}, stream=True, timeout=timeout
    ) as r:
        ok(r, "/v1/chat/completions")
        for raw in r.iter_lines():
            if not raw.startswith(b"data:") or raw.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(raw[5:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
            memory = chunk.get("sgl_memory") or memory
    return ttft, usage, memory


def ours(model: str, *flags: str) -> tuple[list[str], None]:
    """Our server with every mechanism off (`--plain`: persistence is on by default): what the
    plugin costs by itself."""
    return harness.our_command(model, "--plain", *flags), None


FULL_BUDGET = 1 << 30  # a budget no request reaches: our server's full cache
BASELINE_SCORERS = ("streaming_llm", "snapkv", "h2o")  # the published heuristics, on both layouts
INTENT_SCORERS = ("query", "memory", "learned")


def pruning_methods(budgets: list[int]) -> list[tuple[str, dict]]:
    """(name, the request's `sgl_memory` pruning fields) for our full cache, then per budget the
    baselines on `compact` (their published path) and on `dead_slot`, and IntentKV on `dead_slot`."""
    methods = [("full cache", {"budget": FULL_BUDGET})]
    for b in budgets:
        for scorer in BASELINE_SCORERS:
            for layout in ("compact", "dead_slot"):
                methods.append((f"{scorer}/{layout}@{b}", {"budget": b, "scorer": scorer, "layout": layout}))
        for scorer in INTENT_SCORERS:
            methods.append((f"intentkv-{scorer}/dead_slot@{b}", {"budget": b, "scorer": scorer, "layout": "dead_slot"}))
    return methods


def kv_costs(metrics: dict | None, prompt_tokens: int, output_tokens: int) -> dict:
    """One request's live KV and raw / effective KV reads over its decode steps (the IntentKV
    paper's metrics). Plain SGLang reports no `sgl_memory` metrics: its are the unpruned ones."""
    m = metrics or {}
    steps = max(output_tokens - 1, 0)
    raw = m.get("raw_kv_reads", steps * prompt_tokens + steps * (steps + 1) // 2)
    return {
        "live_kv_tokens": m.get("live_kv_tokens", prompt_tokens + output_tokens),
        "raw_kv_reads": raw,
        "eff_kv_reads": m.get("eff_kv_reads", raw),
    }


def read_bandwidth_gbs(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Sustained read bandwidth of this machine (sum over a large bf16 buffer), GB/s."""
    buf = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    buf.sum()
    t0 = time.perf_counter()
    for _ in range(repeats):
        buf.sum()
    return nbytes * repeats / (time.perf_counter() - t0) / 1e9


def bootstrap(
    clusters: list[list[float]], seed: int = 0, level: float = 0.95, resamples: int = 2000
) -> tuple[float, float, float]:
    """The mean over every value and its percentile bootstrap interval, resampling whole clusters
    (values of one session are not independent draws; independent values are clusters of one)."""
    sums = [(sum(c), len(c)) for c in clusters if c]
    if not sums:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    means = []
    for _ in range(resamples):
        pick = [sums[rng.randrange(len(sums))] for _ in sums]
        means.append(sum(s for s, _ in pick) / sum(n for _, n in pick))
    means.sort()
    tail = (1 - level) / 2
    mean = sum(s for s, _ in sums) / sum(n for _, n in sums)
    return mean, means[int(tail * resamples)], means[min(resamples - 1, int((1 - tail) * resamples))]


def ratio_interval(
    pairs: list[tuple[float, float]], seed: int = 0, level: float = 0.95, resamples: int = 2000
) -> tuple[float, float, float]:
    """sum(a) / sum(b) over (a, b) pairs (a share of a gain: mean(part) / mean(whole)) and its
    percentile bootstrap interval, resampling pairs."""

    def ratio(sample):
        total = sum(b for _, b in sample)
        return sum(a for a, _ in sample) / total if total else float("nan")

    if not pairs:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    draws = sorted(ratio([pairs[rng.randrange(len(pairs))] for _ in pairs]) for _ in range(resamples))
    tail = (1 - level) / 2
    return ratio(pairs), draws[int(tail * resamples)], draws[min(resamples - 1, int((1 - tail) * resamples) - 1)]


def kl(p_top: dict, q_top: dict) -> float:
    """KL(p || q) over the union of two top-k lists, each renormalised; a token missing from one list
    gets that list's smallest probability (an upper bound on its true mass)."""
    keys = set(p_top) | set(q_top)
    p_floor, q_floor = min(p_top.values()), min(q_top.values())
    p = {k: math.exp(p_top.get(k, p_floor)) for k in keys}
    q = {k: math.exp(q_top.get(k, q_floor)) for k in keys}
    zp, zq = sum(p.values()), sum(q.values())
    return sum(p[k] / zp * math.log((p[k] / zp) / (q[k] / zq)) for k in keys)
