"""What a session file must match to be loaded here: the model it was computed by (its name, and
hashes of its config and of its weights) and the layout of this rank's KV pool."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgl_memory.core import kv_rows
from sgl_memory.persist.store import CacheSpec

if TYPE_CHECKING:
    from sgl_memory.core.kvhost import KVHost

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLE_BYTES = 1 << 16  # read at three offsets of every weight file


def weights_digest(model_path: str | Path) -> str:
    """What tells two checkpoints of one architecture apart (a fine-tune keeps the config): every
    weight file's name and size, and 64 KiB of its bytes at its start, middle and end. Cheap at
    start-up (a few hundred KiB read), and any re-training changes the sampled bytes. Empty for a
    model path that is not a local folder."""
    folder = Path(str(model_path)).expanduser()
    files = (
        sorted(p for p in folder.glob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
        if folder.is_dir()
        else []
    )
    h = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\x00{size}\x00".encode())
        with open(path, "rb") as f:
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest() if files else ""


def cache_spec(model_config: Any, server_args: Any, tree: KVHost, tp_rank: int, tp_size: int) -> CacheSpec:
    """What a file must match to be loaded here: the model (name, and a hash of its config and its
    weights) and the layout of this rank's KV pool."""
    config = {
        k: v
        for k, v in model_config.hf_config.to_dict().items()
        if not k.startswith("_") and k != "transformers_version"
    }
    config["sgl_memory_weights"] = weights_digest(server_args.model_path)
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:32]
    name = server_args.served_model_name or server_args.model_path
    buffer = tree.pool.get_key_buffer(tree.layers()[0])
    return CacheSpec(
        str(name).rstrip("/").rsplit("/", 1)[-1],
        config_hash,
        tree.pool.layer_num,
        buffer.shape[-2],
        kv_rows.head_dim(buffer),
        str(buffer.dtype).removeprefix("torch."),
        tree.page_size,
        f"tp{tp_rank}/{tp_size}",
    )
