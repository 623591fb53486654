"""Time to first token of the repairs of placed memory (sgl_memory/keep), side by side in one run:

1. **Segments** (KEEP's Figure 9): TTFT against the number of retrieved memory blocks, for full reuse
   (`recompute: none`, MemArt as placed), full recompute (`full`: the blocks' tokens prefilled
   again), CacheBlend and KEEP at one ratio; one server.
2. **Loading** (KEEP section 4.3): the placed KV behind a simulated slower tier (`keep.tier_bandwidth`),
   loaded when each layer starts (`sync`), while the layer before computes (`next_layer`), or that
   plus preloading the rows no later layer recomputes (`balanced`); one server each, KEEP at 64
   blocks: TTFT, the loader's busy time, the time the forward waited, and the share hidden.

Workload: the first `--transcript-tokens` of LoCoMo conversation 0 ingested as one session turn;
`--questions` of its questions (categories 1-4, stratified, seed 0) in memory mode with
`store: false`, greedy, 8 new tokens, streamed (TTFT is the first chunk, the probe included), each
in a radix namespace of its own (cold: nothing reused from the requests before it). One
warm-up question per server first (the pool's index is built on the first retrieval).

    .venv/bin/python -m bench.keep_ttft [--segments 8 16 32 64 128] [--questions 8] [--bandwidth 2e7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import uuid
from pathlib import Path

from tqdm import tqdm

from sgl_memory import models
from sgl_memory.core.config import to_yaml
from sgl_memory.keep.settings import KeepConfig
from sgl_memory.memart.settings import MemArtConfig
from bench import harness

from .common import RESULTS, write_json
from .locomo import data, prompts
from .locomo.run import cut, generate

METHODS = ("none", "full", "cacheblend", "keep")
LOADINGS = ("sync", "next_layer", "balanced")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.keep_ttft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--segments", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--transcript-tokens", type=int, default=6000)
    ap.add_argument("--ratio", type=float, default=0.3, help="keep and cacheblend: the share recomputed at layer 1")
    ap.add_argument("--bandwidth", type=float, default=2e7, help="bytes/s of the simulated tier in the loading part")
    ap.add_argument("--loading-segments", type=int, default=64)
    ap.add_argument("--out", type=Path, default=RESULTS / "keep_ttft.json")
    return ap.parse_args(argv)


def config(directory: Path, name: str, keep: dict) -> Path:
    path = directory / f"keep-ttft-{name}.yaml"
    # top_k blocks of 16 tokens placed alone: TTFT is measured against the number of blocks
    memory = MemArtConfig(
        enabled=True, block_size=16, cut="tokens", unit="block", placed_tokens=0, capacity_blocks=4096
    )
    path.write_text(to_yaml(memory, KeepConfig(enabled=True, **keep), harness.PERSIST_OFF))
    return path


def ask(server, ids, sid: str, method: str, top_k: int, ratio: float) -> dict:
    """One measured request, cold: a radix namespace of its own, so no method reuses the KV an earlier
    request of the same question left in the tree (a full recompute of the 8 best blocks would
    otherwise be the cached prefix of the 16 best's)."""
    field = {"session_id": sid, "memory": {"mode": "retrieve", "top_k": top_k, "store": False, "recompute": method}}
    if method in ("keep", "cacheblend"):
        field["keep"] = {"ratio": ratio}
    _, meta, _ = generate(server, ids, 8, field, extra_key=f"keep-ttft-{uuid.uuid4().hex}")
    m = meta.get("sgl_memory") or {}
    return {
        "ttft_s": meta["ttft_s"],
        "cached_tokens": meta.get("cached_tokens"),
        "prefill_tokens": m.get("prefill_tokens"),
        "memory_kv_tokens": m.get("memory_kv_tokens"),
        "recomputed_token_layers": m.get("recomputed_token_layers"),
        "recompute_share": m.get("recompute_share"),
        **{k: m.get(k) for k in ("load_ms", "load_wait_ms", "load_overlap", "load_bytes", "recompute_ms")},
    }


def serve(
    args, path: Path, ingest: list[int], questions: list[list[int]], plan: list[tuple[str, int]], bar
) -> list[dict]:
    """One server: ingest the transcript, warm up, then every (method, top_k) of `plan` per question."""
    server = harness.start(harness.our_command(args.model, "--memory-config", str(path)), path.with_suffix(".log"))
    try:
        sid = f"keep-ttft-{uuid.uuid4().hex[:8]}"
        generate(server, ingest, 1, {"session_id": sid})
        ask(server, questions[0], sid, "none", plan[0][1], args.ratio)  # warm-up: the pool's index
        rows = []
        for i, ids in enumerate(questions):
            for method, top_k in plan:
                rows.append(
                    {
                        "question": i,
                        "method": method,
                        "segments": top_k,
                        **ask(server, ids, sid, method, top_k, args.ratio),
                    }
                )
                bar.update()
        return rows
    finally:
        harness.stop(server)


def median(rows: list[dict], name: str) -> float | None:
    vals = [r[name] for r in rows if r.get(name) is not None]
    return statistics.median(vals) if vals else None


def summarize(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    names = (
        "ttft_s",
        "cached_tokens",
        "prefill_tokens",
        "memory_kv_tokens",
        "recomputed_token_layers",
        "recompute_share",
        "load_ms",
        "load_wait_ms",
        "load_overlap",
        "recompute_ms",
    )
    return [{**dict(zip(keys, k)), "tasks": len(g), **{n: median(g, n) for n in names}} for k, g in groups.items()]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for method in METHODS:
        rows = sorted((r for r in result["segments"] if r["method"] == method), key=lambda r: r["segments"])
        ax1.plot([r["segments"] for r in rows], [r["ttft_s"] for r in rows], marker="o", label=method)
    ax1.set_xlabel("retrieved segments (16-token blocks)")
    ax1.set_ylabel("TTFT, s (median)")
    ax1.set_title("TTFT vs retrieved segments")
    ax1.legend()
    rows = result["loading"]
    x = range(len(rows))
    ax2.bar([i - 0.2 for i in x], [r["load_ms"] or 0 for r in rows], 0.4, label="loader busy (ms)")
    ax2.bar([i + 0.2 for i in x], [r["load_wait_ms"] or 0 for r in rows], 0.4, label="forward waited (ms)")
    ax2.set_xticks(list(x), [f"{r['loading']}\nTTFT {r['ttft_s']:.2f}s" for r in rows])
    ax2.set_title(
        f"placed KV behind a {result['settings']['bandwidth'] / 1e6:.0f} MB/s tier, "
        f"KEEP at {result['settings']['loading_segments']} blocks"
    )
    ax2.legend()
    fig.suptitle(
        f"KEEP vs full recompute, CacheBlend, full reuse: {result['settings']['model']}, "
        f"median of {result['settings']['questions']} questions"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.resolve(args.model))
    conv = data.load(data.DATA)[0]
    transcript = data.render(cut(data.turns(conv), tokenizer, args.transcript_tokens))
    ingest = prompts.ingest_ids(tokenizer, transcript)
    picked = data.stratified(data.questions(conv, 0), args.questions, 0)
    questions = [prompts.question_only(tokenizer, q.question) for q in picked]
    logs = Path(tempfile.gettempdir()) / "sgl-memory-keep-ttft"
    logs.mkdir(exist_ok=True)
    plan = [(m, k) for k in args.segments for m in METHODS]
    total = len(questions) * (len(plan) + len(LOADINGS))
    with tqdm(total=total, desc="requests", disable=None) as bar:
        seg_rows = serve(args, config(logs, "segments", {"ratio": args.ratio}), ingest, questions, plan, bar)
        load_rows = []
        for loading in LOADINGS:
            path = config(logs, loading, {"ratio": args.ratio, "loading": loading, "tier_bandwidth": args.bandwidth})
            rows = serve(args, path, ingest, questions, [("keep", args.loading_segments)], bar)
            load_rows += [{**r, "loading": loading} for r in rows]
    settings = {
        "model": args.model,
        "questions": len(questions),
        "transcript_tokens": len(ingest),
        "ratio": args.ratio,
        "bandwidth": args.bandwidth,
        "loading_segments": args.loading_segments,
        "max_new_tokens": 8,
    }
    result = {
        "settings": settings,
        "segments": summarize(seg_rows, ("method", "segments")),
        "loading": summarize(load_rows, ("loading",)),
        "requests": seg_rows + load_rows,
    }
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    print(f"{'method':>10} {'segments':>8} {'TTFT s':>7} {'prefill':>8} {'cached':>7} {'recomp share':>12}")
    for r in result["segments"]:
        print(
            f"{r['method']:>10} {r['segments']:>8} {r['ttft_s']:7.3f} {r['prefill_tokens']:8.0f} "
            f"{r['cached_tokens'] or 0:7.0f} {r['recompute_share'] or 0:12.3f}"
        )
    for r in result["loading"]:
        print(
            f"{r['loading']:>10} TTFT {r['ttft_s']:.3f} s, loader {r['load_ms']:.0f} ms, "
            f"waited {r['load_wait_ms']:.0f} ms, hidden {r['load_overlap']}"
        )


if __name__ == "__main__":
    main()
