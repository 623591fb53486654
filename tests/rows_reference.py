"""The test model in float32 under transformers: each prompt token's log-probability (after the
first) as the model computes it (`float`), and as a server whose KV pool stores rows in another
format computes it (core/kv_rows.py: each row encoded and decoded) when the prompt's first `cached`
positions came from the pool's cache: those positions prefilled first, as the request that cached
them did, their K and V put through the rows, then the rest prefilled over them, attending its own
rows as computed (`rows`; engine/attention/cpu_backend.py); and as one forward whose attention
reads every row through the pool, its own included (`every`: what reading a prefill's rows back
from the pool would give). Run as a script in the environment of the server it is compared with:
quantization rounds, so a K computed by other CPU kernels (AVX2 against AVX-512, one ulp apart) can
land on another code.

    echo '{"model": DIR, "ids": [...], "cached": N}' | python tests/rows_reference.py
      ->  {"float": [...], "rows": [...], "every": [...]}
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sgl_memory.core import kv_rows


def held(x: torch.Tensor) -> torch.Tensor:
    """What a pool's rows give back of K or V [..., head_dim]."""
    return kv_rows.decode(kv_rows.encode(x), torch.float32)


def through_rows(module, query, key, value, mask, **kw):
    return sdpa_attention_forward(module, query, held(key), held(value), mask, **kw)


def logprobs(logits: torch.Tensor, ids: list[int]) -> list[float]:
    """Each token's after the first, from the logits of every position [len, vocab]."""
    return logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def run(model_dir: str, ids: list[int], cached: int) -> dict[str, list[float]]:
    out = {}
    every = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sgl_memory_rows")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        out["every"] = logprobs(every(torch.tensor([ids])).logits[0], ids)
        out["float"] = logprobs(model(torch.tensor([ids])).logits[0], ids)
        first = model(torch.tensor([ids[:cached]]), use_cache=True)
        kv = first.past_key_values
        for layer in kv.layers:
            layer.keys, layer.values = held(layer.keys), held(layer.values)
        rest = model(torch.tensor([ids[cached:]]), past_key_values=kv)
    out["rows"] = logprobs(torch.cat([first.logits[0], rest.logits[0]]), ids)
    return out


if __name__ == "__main__":
    asked = json.load(sys.stdin)
    AttentionInterface.register("sgl_memory_rows", through_rows)
    json.dump(run(asked["model"], asked["ids"], asked["cached"]), sys.stdout)
