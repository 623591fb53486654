"""What a session's write to the store and its restore cost per pool dtype and store format.

A restore reads a session's file, decodes its blocks into the pool's dtype and writes them into the
pool's slots; a write copies the session's slots off the pool, encodes them in the store's format
and writes the file. With a Q8 store, a float pool dequantizes every value on restore and quantizes
it again on write; an 8-bit pool's own format (`persist.quant: auto` on an fp8 or int8 pool) is the
pool's bytes, copied both ways (the int8 pool's rows: codes and a scale per token and head). Side by
side in one run, with the store's own functions (no server; the model's KV shape, KV values drawn at
random): for each (pool dtype, store format) the milliseconds of each part over `--repeats` runs
(mean and 95% bootstrap interval), the file's bytes, and the restore's and the write's speed-up over
today's Q8 on the float pool this machine's launcher picks. Plain SGLang has no store: its
alternative to a restore is the prefill of the whole session (bench/persist_restart.py measures it
in a server).

Writes bench/results/store_format.json and .png.

    .venv/bin/python -m bench.store_format [--tokens 16384] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

from bench.common import RESULTS, bootstrap, disk_bytes, write_json
from sgl_memory import cpu_dtype, models
from sgl_memory.core import kv_rows, tree_fill
from sgl_memory.persist.store import CacheSpec, SessionFiles

# (pool dtype, store format): today's defaults on the float pools, the 8-bit pools requantizing
# through Q8 (as they did before their own format) and in their own format, and the exact bf16 store
ROWS = [
    ("float32", "q8"),
    ("bfloat16", "q8"),
    ("bfloat16", "bf16"),
    ("float8_e4m3fn", "q8"),
    ("float8_e4m3fn", "fp8_e4m3"),
    ("float8_e5m2", "q8"),
    ("float8_e5m2", "fp8_e5m2"),
    ("int8", "q8"),
    ("int8", "int8"),
]
RESTORE = ("read", "decode", "pool_write")
WRITE = ("copy_off_pool", "encode", "file_write")


class Pool:
    """A KV pool's buffers as the store's functions read them: one [slots, heads, row] per layer
    (a row: the head dim's values, or the int8 pool's packed codes and scale)."""

    dtype = torch.float32  # what packed rows decode to (the store copies them as they are)

    def __init__(self, layers: int, slots: int, heads: int, dim: int, dtype: torch.dtype) -> None:
        width = kv_rows.row_bytes(dim, dtype) // dtype.itemsize
        self.k = [torch.zeros(slots, heads, width, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(slots, heads, width, dtype=dtype) for _ in range(layers)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]


def model_spec(model: str, dtype: str) -> CacheSpec:
    config = json.loads((models.model_dir(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return CacheSpec(model, "bench", config["num_hidden_layers"], config["num_key_value_heads"], head_dim, dtype, 1)


def timed(parts: dict[str, list[float]], name: str, fn):
    t0 = time.perf_counter()
    out = fn()
    parts.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
    return out


def one_row(spec: CacheSpec, quant: str, tokens: int, repeats: int, work: Path) -> dict:
    """Write and restore a `tokens`-token session `repeats` times; ms per part, file bytes."""
    dtype = getattr(torch, spec.dtype)
    pool = Pool(spec.layers, tokens + 1, spec.kv_heads, spec.head_dim, dtype)
    g = torch.Generator().manual_seed(0)
    for buffer in (*pool.k, *pool.v):
        values = torch.randn(tokens, spec.kv_heads, spec.head_dim, generator=g)
        buffer[1:] = kv_rows.convert(values, dtype)
    tree = SimpleNamespace(pool=pool, layers=lambda: range(spec.layers), sentinel=None)
    slots = torch.arange(1, tokens + 1)
    parts: dict[str, list[float]] = {}
    size = 0
    for i in range(repeats):
        # a store of its own each time: an earlier run's block files would be linked, not written
        files = SessionFiles(work / f"{spec.dtype}-{quant}-{i}", spec, quant=quant)
        kv = timed(parts, "copy_off_pool", lambda: tree_fill.copy_slots(tree, slots, as_stored=True))
        record = timed(parts, "encode", lambda: files.record(range(tokens), "", kv.keys, kv.values))
        timed(parts, "file_write", lambda: files.write(None, "s", record))
        size = disk_bytes(files.root.rglob("*.*"))
        read = timed(parts, "read", lambda: files.read(None, "s"))
        keys, values = timed(parts, "decode", lambda: files.decode(read, dtype=dtype))
        reserved = tree_fill.Reserved(None, None, slots, torch.ones(tokens, dtype=torch.bool))
        timed(parts, "pool_write", lambda: tree_fill.write(tree, reserved, keys, values))
        shutil.rmtree(files.root)
    restored = pool.get_key_buffer(0)[slots]
    assert restored.dtype == dtype  # what the restore wrote is in the pool's dtype
    row: dict = {"pool": spec.dtype, "store": quant, "file_bytes": size}
    for name, values_ms in parts.items():
        mean, lo, hi = bootstrap([[x] for x in values_ms])
        row[f"{name}_ms"] = {"mean": mean, "ci95": [lo, hi], "runs": values_ms}
    for total, names in (("restore_ms", RESTORE), ("write_ms", WRITE)):
        runs = [sum(parts[n][i] for n in names) for i in range(repeats)]
        mean, lo, hi = bootstrap([[x] for x in runs])
        row[total] = {"mean": mean, "ci95": [lo, hi], "runs": runs}
    return row


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    labels = [f"{r['pool']}\n{r['store']}" for r in result["rows"]]
    for ax, (title, names) in zip(axes, (("restore", RESTORE), ("write", WRITE))):
        bottom = [0.0] * len(labels)
        for name in names:
            heights = [r[f"{name}_ms"]["mean"] for r in result["rows"]]
            ax.barh(labels, heights, left=bottom, label=name)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_title(f"{title} of a {result['tokens']}-token session (mean ms)")
        ax.set_xlabel("ms")
        ax.legend(fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"{result['model']}: pool dtype and store format", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "store_format.json")
    args = ap.parse_args()
    today = cpu_dtype.choose().dtype  # the float pool this machine's launcher picks
    result = {"model": args.model, "tokens": args.tokens, "repeats": args.repeats, "float_pool": today, "rows": []}
    with tempfile.TemporaryDirectory(prefix="store-format-") as tmp:
        for dtype, quant in tqdm(ROWS, desc="pool dtype, store format"):
            result["rows"].append(one_row(model_spec(args.model, dtype), quant, args.tokens, args.repeats, Path(tmp)))
    base = next(r for r in result["rows"] if (r["pool"], r["store"]) == (today, "q8"))
    for row in result["rows"]:
        row["restore_speedup"] = base["restore_ms"]["mean"] / row["restore_ms"]["mean"]
        row["write_speedup"] = base["write_ms"]["mean"] / row["write_ms"]["mean"]
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    for row in result["rows"]:
        print(
            f"{row['pool']:>14} {row['store']:>9}: restore {row['restore_ms']['mean']:8.1f} ms "
            f"({row['restore_speedup']:.2f}x), write {row['write_ms']['mean']:8.1f} ms ({row['write_speedup']:.2f}x), "
            f"{row['file_bytes'] / 1e6:.0f} MB"
        )


if __name__ == "__main__":
    main()
