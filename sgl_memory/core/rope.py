"""Rotary position embedding arithmetic on cached keys: moving a post-RoPE key to another position.

RoPE rotates each pair of channels by position * inv_freq, so a key cached at position p becomes the
key of position p' by one more rotation of (p' - p) * inv_freq; no pre-RoPE key is needed. Only the
plain (unscaled) rotation of Llama / Qwen2 models is supported; `Rope.from_hf_config` refuses others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Rope:
    """One model's plain rotary embedding (head dim, base, layout), which moves post-RoPE keys to other positions."""

    head_dim: int
    theta: float
    neox: bool = True  # rotate halves (Llama / Qwen2 in HF layout), not interleaved pairs

    @classmethod
    def from_hf_config(cls, cfg: Any) -> Rope:
        params = getattr(cfg, "rope_parameters", None) or {}
        scaling = getattr(cfg, "rope_scaling", None) or {}
        kind = scaling.get("rope_type", scaling.get("type", params.get("rope_type", "default")))
        if kind not in (None, "default"):
            raise ValueError(f"re-rotating keys is not supported for rope_type {kind!r}")
        theta = getattr(cfg, "rope_theta", None) or params.get("rope_theta") or 10000.0
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(int(head_dim), float(theta))

    def inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """keys [n, heads, head_dim] rotated by delta [n] positions (any sign), in float64 math."""
        angles = delta.double().unsqueeze(-1) * self.inv_freq().to(delta.device)  # [n, D/2]
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        k = keys.double()
        if self.neox:
            a, b = k[..., : self.head_dim // 2], k[..., self.head_dim // 2 :]
            out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            a, b = k[..., 0::2], k[..., 1::2]
            out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        return out.to(keys.dtype)

    def rotate_layers(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Keys [L, n, heads, head_dim] of every layer rotated by delta [n] positions."""
        L, n, h, d = keys.shape
        flat = keys.permute(1, 0, 2, 3).reshape(n, L * h, d)
        return self.rotate(flat, delta).reshape(n, L, h, d).permute(1, 0, 2, 3).contiguous()
