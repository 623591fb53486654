"""The KV pool sized in bytes: what an operator has is memory, not a token count, and what a token
costs depends on the KV dtype (the default model's K and V take 24.6 KB a token in float32, 12.3 KB
in bf16, 6.1 KB at one byte a value).

An int8 pool (`--kv-cache-dtype int8`, ours: engine/int8_pool.py) holds a value in one byte and
adds a 2-byte scale per token and head (core/kv_rows.py): 6.3 KB a token for the default model.

The launcher turns `--kv-pool-bytes` (or its default: a share of free RAM on CPU) into SGLang's
`--max-total-tokens` at the pool's KV dtype; a `--max-total-tokens` the user gives wins. The choice
is exported (POOL_ENV) for /sgl_memory/info and the start-up log.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from sgl_memory.core import kv_rows

POOL_ENV = "SGLMEMORY_KV_POOL"  # the launcher's choice, as JSON, for /sgl_memory/info
RAM_FRACTION = 0.15  # the default's share of the RAM free at start-up
MAX_DEFAULT_BYTES = 2 << 30  # the default's ceiling: a bigger pool only when asked for
MIN_TOKENS = 8192  # the default's floor: a few sessions of the default model's context
# bytes of one K or V value; a dtype SGLang resolves itself (`auto`: the model's, bf16 here) counts 2
ELEMENT_BYTES = {"float32": 4, "float": 4, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
INT8 = "int8"  # our packed pool's --kv-cache-dtype value
UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}


class PoolSizeError(ValueError):
    """A pool size that names no number of bytes."""


def parse_bytes(text: str) -> int:
    """`2GiB`, `512MiB`, `1.5G` (powers of 1000), `3000000` (bytes) -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if match is None:
        raise PoolSizeError(f"--kv-pool-bytes {text!r}: give bytes, e.g. 2GiB, 512MiB, 1.5G or 3000000")
    size = int(float(match.group(1)) * UNITS[match.group(2) or ""])
    if size <= 0:
        raise PoolSizeError(f"--kv-pool-bytes {text!r}: the pool needs some bytes")
    return size


def bytes_per_token(model_path: Path, kv_dtype: str) -> int:
    """One token's K and V over every layer at the KV dtype, from the model's config."""
    cfg = json.loads((model_path / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rows = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads)  # K and V of each head
    if kv_dtype == INT8:
        return rows * kv_rows.row_bytes(head_dim, kv_rows.PACKED)
    return rows * head_dim * ELEMENT_BYTES.get(kv_dtype, 2)


@dataclass(frozen=True)
class PoolSize:
    """The pool the launcher asked SGLang for: its bytes, the tokens they hold at its KV dtype, and
    where the size came from (`--kv-pool-bytes`, `--max-total-tokens` or `default`)."""

    bytes: int
    tokens: int
    kv_cache_dtype: str
    bytes_per_token: int
    source: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def log_line(self) -> str:
        return (
            f"sgl-memory: KV pool {self.bytes / (1 << 30):.2f} GiB = {self.tokens:,} tokens at {self.kv_cache_dtype} "
            f"({self.bytes_per_token:,} bytes a token; from {self.source})"
        )


def default_bytes(per_token: int, available: int | None = None) -> int:
    """A share of the RAM free now, within [MIN_TOKENS' bytes, MAX_DEFAULT_BYTES]."""
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    return max(MIN_TOKENS * per_token, min(MAX_DEFAULT_BYTES, int(available * RAM_FRACTION)))


def choose(model_path: Path, kv_dtype: str, asked_bytes: str | None, asked_tokens: str | None) -> PoolSize:
    """The pool's size: the user's tokens win, then the user's bytes, then the default (the launcher
    asks only on CPU or when told: SGLang sizes a GPU's pool from its memory)."""
    per_token = bytes_per_token(model_path, kv_dtype)
    if asked_tokens is not None:
        if not asked_tokens.isdigit():
            raise PoolSizeError(f"--max-total-tokens {asked_tokens!r}: give a number of tokens")
        tokens = int(asked_tokens)
        return PoolSize(tokens * per_token, tokens, kv_dtype, per_token, "--max-total-tokens")
    if asked_bytes is not None:
        size, source = parse_bytes(asked_bytes), "--kv-pool-bytes"
    else:
        ceiling = f"{MAX_DEFAULT_BYTES / (1 << 30):g} GiB"
        size, source = default_bytes(per_token), f"default: {RAM_FRACTION:.0%} of free RAM, at most {ceiling}"
    tokens = size // per_token
    if tokens < 1:
        raise PoolSizeError(f"--kv-pool-bytes {asked_bytes}: less than one token's KV ({per_token} bytes)")
    return PoolSize(tokens * per_token, tokens, kv_dtype, per_token, source)


def export(size: PoolSize | None) -> None:
    """Hand the choice to /sgl_memory/info (the HTTP process reads it from the environment)."""
    if size is None:
        os.environ.pop(POOL_ENV, None)
    else:
        os.environ[POOL_ENV] = size.to_json()


def announced() -> PoolSize | None:
    """The launcher's choice, in any process it started (None: not started by it, or no choice)."""
    raw = os.environ.get(POOL_ENV)
    return PoolSize(**json.loads(raw)) if raw else None
