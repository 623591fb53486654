"""The test model in float32 under transformers, its attention reading K and V as it computes them
and, second, through a pool's rows (core/kv_rows.py: every row encoded and decoded, the prompt's own
included): each one's log-probability of every prompt token after the first. Run as a script in
the environment of the server it is compared with: quantization rounds, so a K computed by other
CPU kernels (AVX2 against AVX-512, one ulp apart) can land on another code.

    echo '{"model": DIR, "ids": [...]}' | python tests/rows_reference.py  ->  {"float": [...], "rows": [...]}
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sgl_memory.core import kv_rows


def through_rows(module, query, key, value, mask, **kw):
    key, value = (kv_rows.decode(kv_rows.encode(x), torch.float32) for x in (key, value))
    return sdpa_attention_forward(module, query, key, value, mask, **kw)


def prompt_logprobs(model_dir: str, ids: list[int], attention: str) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention)
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


if __name__ == "__main__":
    asked = json.load(sys.stdin)
    AttentionInterface.register("sgl_memory_rows", through_rows)
    json.dump(
        {
            name: prompt_logprobs(asked["model"], asked["ids"], impl)
            for name, impl in (("float", "sdpa"), ("rows", "sgl_memory_rows"))
        },
        sys.stdout,
    )
