"""Sentences of a prompt, on token ids: a sentence ends after a token whose text ends with one of
the boundary characters (a trailing space ignored), or once it is `max_sentence` tokens long."""

from __future__ import annotations

import numpy as np
import torch


def boundary_tokens(tokenizer, characters: str) -> np.ndarray:
    """Per token id of the tokenizer's vocabulary: whether its text ends a sentence."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    characters = tuple(characters)
    ends = np.fromiter((t.rstrip(" ").endswith(characters) for t in texts), dtype=bool, count=len(texts))
    return ends


def sentence_ids(tokens: np.ndarray, ends: np.ndarray, max_sentence: int) -> torch.Tensor:
    """The sentence index of each position [n] (int64): sentence i + 1 starts after a boundary
    token of sentence i, or where sentence i reached max_sentence tokens."""
    n = len(tokens)
    known = (tokens >= 0) & (tokens < len(ends))
    is_end = np.zeros(n, dtype=bool)
    is_end[known] = ends[tokens[known]]
    starts = np.zeros(n, dtype=bool)
    if n:
        starts[0] = True
        starts[1:] = is_end[:-1]
    first = np.flatnonzero(starts)
    # cut every sentence into pieces of at most max_sentence tokens
    lengths = np.diff(np.append(first, n))
    pieces = -(-lengths // max_sentence)
    owner = np.repeat(np.arange(len(first)), lengths)
    offset = np.arange(n) - np.repeat(first, lengths)
    base = np.cumsum(pieces) - pieces
    return torch.from_numpy(base[owner] + offset // max_sentence).long() if n else torch.zeros(0, dtype=torch.long)
