"""Answer scores as the LoCoMo and MemArt papers report them: token F1, BLEU-1, embedding similarity.

Normalisation follows LoCoMo's evaluation (lowercase, no punctuation, no articles or "and"),
without its Porter stemming, so no extra dependency enters the benchmark. BLEU-1 uses the same
tokens: clipped unigram precision times the brevity penalty, against the one gold answer.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter

from sgl_memory.memart import encoder

_DROP = re.compile(r"\b(a|an|the|and)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def tokens(text: str) -> list[str]:
    return _DROP.sub(" ", str(text).lower().translate(_PUNCT)).split()


def token_f1(prediction: str, answer: str) -> float:
    pred, gold = tokens(prediction), tokens(answer)
    common = sum((Counter(pred) & Counter(gold)).values())
    if not pred or not gold or common == 0:
        return float(pred == gold)  # two empty answers agree; one empty side scores 0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def bleu1(prediction: str, answer: str) -> float:
    pred, gold = tokens(prediction), tokens(answer)
    if not pred or not gold:
        return 0.0
    clipped = sum((Counter(pred) & Counter(gold)).values())
    # a short prediction can reach precision 1 with one right word; the penalty charges what it left out
    brevity = 1.0 if len(pred) > len(gold) else math.exp(1 - len(gold) / len(pred))
    return brevity * clipped / len(pred)


def minilm():
    """The sentence embedder used for both the text-retrieval baseline and the similarity score
    (the one the server groups memory entries with)."""
    return encoder.minilm()


def similarity(embedder, prediction: str, answer: str) -> float:
    if not prediction.strip():
        return 0.0
    a, b = embedder.encode([prediction, answer], normalize_embeddings=True, convert_to_tensor=True)
    return float((a * b).sum())
