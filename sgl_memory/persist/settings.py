"""Session persistence's settings: the `persist:` config section (it takes no per-request keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sgl_memory.core.config import require


@dataclass(frozen=True)
class PersistConfig:
    """Per-session persistent KV store: see sgl_memory/persist/README.md."""

    enabled: bool = False
    dir: str = "~/.cache/sgl-memory/sessions"
    # q8 by default: a Q4 restore changed half of the session's greedy answers (bench/persist_restart);
    # bf16 / fp32: unquantized (the pool's dtype: exact)
    quant: Literal["q4", "q8", "bf16", "fp32"] = "q8"
    kivi: bool = True  # keys grouped per channel over tokens (KIVI), values per token: see persist/README.md
    write_policy: Literal["on_finish", "off"] = "on_finish"  # off: restore from the store, never write
    quota_bytes: int = 8 << 30  # disk; least recently used session files go first
    warm_bytes: int = 1 << 30  # host memory for stored-form session KV (the warm tier)
    match_threshold: float = 0.5  # DIVERGE reuses the stored path when this share of its text matches

    def validate(self, path: str) -> None:
        require(self.quota_bytes >= 0, f"{path}.quota_bytes", "an integer >= 0")
        require(self.warm_bytes >= 0, f"{path}.warm_bytes", "an integer >= 0")
        require(0.0 <= self.match_threshold <= 1.0, f"{path}.match_threshold", "a number in [0, 1]")
