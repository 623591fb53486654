"""The GPU paths on a CUDA device, side by side with what they replace, in one run.

- MemArt block scoring (kernels/aabb_score.py): the Triton kernel vs the same bound in torch vs
  the exact per-key score the bound stands in for (q . k over every key, max per block), at the
  default model's shapes (24 layers, 14 query / 2 KV heads, head dim 64).
- Dropping the sentinel from the attention index lists (kernels/drop_sentinel.py): the Triton
  kernel vs torch's boolean-mask compaction plus a cumsum for the new indptr.
- SentenceKV's per-step KV index lists (kernels/step_kv_indices.py): the Triton kernel vs torch's
  boolean-mask gather of each request's read slots (the same lists; the gather syncs on its size).
- KEEP's layer loading (sgl_memory/keep/loading.py): placed KV from pinned host memory to the GPU on
  a copy stream, `sync` (each layer loads when it starts) vs `next_layer` and `balanced` (loads
  overlap the layer before), under a per-layer stand-in compute; and the same forward with every
  row already on the GPU (no tier).

Times are CUDA-event medians. Writes bench/results/gpu_paths.json and .png.

    python -m bench.gpu_paths        # on a machine with a CUDA device
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.common import write_json
from sgl_memory.keep.loading import LOADINGS, LayerLoader
from sgl_memory.kernels.aabb_score import aabb_scores_torch, aabb_scores_triton
from sgl_memory.kernels.drop_sentinel import drop_sentinel_
from sgl_memory.kernels.step_kv_indices import read_counts, step_kv_indices

RESULTS = Path(__file__).parent / "results"
LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 24, 14, 2, 64, 16


def timed(fn, repeats: int = 20) -> float:
    """Median milliseconds of fn() on the current stream, after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def block_scoring(tokens: int, blocks: int) -> dict:
    q = torch.randn(LAYERS, tokens, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(LAYERS, blocks, BLOCK, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    lo, hi = keys.amin(2), keys.amax(2)
    group = HEADS // KV_HEADS

    def exact():  # per layer, so the [T, H, keys] logits fit
        for layer in range(LAYERS):
            k = keys[layer].reshape(blocks * BLOCK, KV_HEADS, DIM).repeat_interleave(group, 1)
            logits = torch.einsum("thd,nhd->thn", q[layer].float(), k.float())
            logits.view(tokens, HEADS, blocks, BLOCK).amax(-1)

    return {
        "tokens": tokens,
        "blocks": blocks,
        "triton_ms": timed(lambda: aabb_scores_triton(q, lo, hi)),
        "torch_ms": timed(lambda: aabb_scores_torch(q, lo, hi)),
        "exact_keys_ms": timed(exact, repeats=5),
    }


def compaction(requests: int, slots: int, pruned: float) -> dict:
    sentinel = 0
    indptr = torch.arange(0, (requests + 1) * slots, slots, device="cuda", dtype=torch.int32)
    base = torch.randint(1, 1 << 20, (requests * slots,), device="cuda", dtype=torch.int32)
    base[torch.rand(base.numel(), device="cuda") < pruned] = sentinel

    def kernel():
        ptr, idx = indptr.clone(), base.clone()
        drop_sentinel_(ptr, idx, sentinel)

    def masked():
        keep = base != sentinel
        live = torch.zeros(base.numel() + 1, dtype=torch.int64, device="cuda")
        live[1:] = keep.cumsum(0)
        return live[indptr.long()].to(indptr.dtype), base[keep]  # the mask's gather syncs on its size

    return {
        "requests": requests,
        "slots": slots,
        "pruned": pruned,
        "triton_ms": timed(kernel),
        "torch_mask_ms": timed(masked),
    }


def step_lists(requests: int, width: int, read: float) -> dict:
    """One decode step's lists when each request reads a `read` share of its `width` positions
    (SentenceKV at budget/prompt = read), a tenth of its slots pruned to the sentinel."""
    sentinel = 0
    req_to_token = torch.randint(1, 1 << 20, (requests, width), device="cuda", dtype=torch.int32)
    req_to_token[torch.rand(requests, width, device="cuda") < 0.1] = sentinel
    rows = torch.arange(requests, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((requests,), width, device="cuda", dtype=torch.int32)
    reads = torch.rand(requests, width, device="cuda") < read
    out = torch.empty(requests * width, device="cuda", dtype=torch.int32)

    def masked():
        slots = req_to_token[rows.long()]
        return read_counts(req_to_token, rows, seq_lens, reads, sentinel), slots[reads & (slots != sentinel)]

    return {
        "requests": requests,
        "width": width,
        "read": read,
        "triton_ms": timed(lambda: step_kv_indices(req_to_token, rows, seq_lens, reads, sentinel, out)),
        "torch_mask_ms": timed(masked),
    }


def loading(rows: int, recompute: float) -> dict:
    """A KEEP forward over the default model's layers: each layer waits for its placed rows, then
    runs a stand-in compute; layer l recomputes a shrinking share of rows (KEEP's schedule), so it
    needs the others' placed KV."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(LAYERS, rows, KV_HEADS, DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(LAYERS, rows, KV_HEADS, DIM, generator=g).to(torch.bfloat16)
    work = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(rows, generator=g)

    def recomputed(layer: int) -> torch.Tensor:
        keep = torch.zeros(rows, dtype=torch.bool)
        keep[order[: int(rows * recompute * (1 - layer / LAYERS))]] = True
        return keep

    def forward(mode: str | None) -> tuple[float, dict]:
        loader = LayerLoader(k, v, "cuda", mode or "sync")
        if mode is None:  # every row already on the GPU: the compute alone
            loader.keys.copy_(k.cuda())
            loader.values.copy_(v.cuda())
            loader.loaded[:] = True
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for layer in range(LAYERS):
            need = ~recomputed(layer)
            loader.ready(layer, need)
            work @ work  # the layer's compute
            if layer + 1 < LAYERS:
                loader.want(layer + 1, ~recomputed(layer + 1), ~recomputed(layer + 1))
        end.record()
        torch.cuda.synchronize()
        loader.close()
        return start.elapsed_time(end), loader.metrics()

    out = {"rows": rows, "recompute": recompute}
    for mode in (None, *LOADINGS):
        forward(mode)  # warm-up
        runs = [forward(mode) for _ in range(9)]
        name = mode or "on_gpu"
        out[f"{name}_ms"] = statistics.median(t for t, _ in runs)
        out[f"{name}_overlap"] = runs[-1][1]["load_overlap"]
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    panels = [
        (
            "block scoring (ms)",
            result["block_scoring"],
            lambda r: f"T{r['tokens']} N{r['blocks']}",
            ["triton_ms", "torch_ms", "exact_keys_ms"],
        ),
        (
            "sentinel compaction (ms)",
            result["compaction"],
            lambda r: f"{r['requests']}x{r['slots']}",
            ["triton_ms", "torch_mask_ms"],
        ),
        (
            "SentenceKV step lists (ms)",
            result["step_lists"],
            lambda r: f"{r['requests']}x{r['width']}",
            ["triton_ms", "torch_mask_ms"],
        ),
        (
            "KEEP layer loading (ms per forward)",
            result["loading"],
            lambda r: f"{r['rows']} rows",
            ["on_gpu_ms", *(f"{m}_ms" for m in LOADINGS)],
        ),
    ]
    for ax, (title, rows, label, keys) in zip(axes, panels):
        width = 0.8 / len(keys)
        for i, key in enumerate(keys):
            ax.bar(
                [x + i * width for x in range(len(rows))], [r[key] for r in rows], width, label=key.removesuffix("_ms")
            )
        ax.set_xticks([x + width * (len(keys) - 1) / 2 for x in range(len(rows))], [label(r) for r in rows])
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"GPU paths on {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_paths", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_paths needs a CUDA device")
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "block_scoring": [block_scoring(t, n) for t, n in ((512, 1024), (512, 4096), (2048, 4096))],
        "compaction": [compaction(r, s, 0.5) for r, s in ((8, 8192), (64, 8192), (256, 32768))],
        "step_lists": [step_lists(r, w, 0.1) for r, w in ((8, 8192), (64, 8192), (64, 32768), (256, 32768))],
        "loading": [loading(rows, 0.3) for rows in (4096, 16384)],
    }
    write_json(args.out / "gpu_paths.json", result)
    plot(result, args.out / "gpu_paths.png")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
