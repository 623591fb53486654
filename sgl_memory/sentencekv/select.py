"""SentenceKV's two choices: the prompt tokens the prefill keeps (per layer), grouped into sentences
with a mean key each; and at each decode step, the sentences whose tokens the step reads.

Prefill (paper section 4.1): the observation window's attention scores every prompt token before
it, summed over the window's rows and the heads; the `pool` highest-scoring tokens of each layer
are the semantic pool, the rest is never read again. Each sentence with pool tokens gets, per KV
head, the mean of their keys (eq. 1).

Decode (section 4.2): the queries of the tokens of the sentence being generated are averaged per
layer (eq. 2); the mean scores each sentence by its dot product with the sentence's mean keys,
summed over heads, and the highest-scoring sentences are read, whole, while their tokens fit in the
budget. Every step also reads the always-read positions (the attention sinks, the window and the
recent rows) and the tokens generated so far.

The Quest-style baseline (selection "page") uses the same retrieval over fixed pages of every
prompt token, each summarised by its keys' element-wise bounds and scored by the step's own query
(kernels/aabb_score.py: the upper bound of q . k over the page, as KV memory scores its blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sgl_memory.kernels.aabb_score import aabb_scores_torch


@dataclass(frozen=True)
class SentenceTable:
    """One layer's retrievable tokens, grouped by sentence (or page)."""

    positions: torch.Tensor  # [p] the positions, ascending
    sentence: torch.Tensor  # [p] the (table's) sentence of each, 0 .. S-1
    sizes: torch.Tensor  # [S] tokens per sentence
    # [S, kv_heads, head_dim] float32: the mean key of each sentence (selection "sentence"), or
    # the element-wise minimum and maximum keys of each page (selection "page", `lo` and `hi`)
    vectors: torch.Tensor | None = None
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None


def top_tokens(scores: torch.Tensor, size: int) -> torch.Tensor:
    """Indices of the `size` highest scores (ties to the earlier index), ascending."""
    if size >= scores.numel():
        return torch.arange(scores.numel())
    return torch.argsort(scores, descending=True, stable=True)[:size].sort().values


def _grouped(positions: torch.Tensor, sentence_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, sentence = torch.unique(sentence_of[positions], return_inverse=True)
    return sentence, torch.bincount(sentence, minlength=ids.numel())


def sentence_table(positions: torch.Tensor, sentence_of: torch.Tensor, keys: torch.Tensor) -> SentenceTable:
    """The table of `positions` (ascending) whose sentences are `sentence_of[positions]` and keys
    `keys` [p, kv_heads, head_dim], with each sentence's mean key."""
    sentence, sizes = _grouped(positions, sentence_of)
    sums = torch.zeros(sizes.numel(), *keys.shape[1:], dtype=torch.float32)
    sums.index_add_(0, sentence, keys.float().cpu())
    return SentenceTable(positions, sentence, sizes, vectors=sums / sizes.view(-1, 1, 1))


def page_table(positions: torch.Tensor, page_of: torch.Tensor, keys: torch.Tensor) -> SentenceTable:
    """The same grouping by page, with each page's element-wise key bounds."""
    sentence, sizes = _grouped(positions, page_of)
    keys = keys.float().cpu()
    index = sentence.view(-1, 1, 1).expand_as(keys)
    shape = (sizes.numel(), *keys.shape[1:])
    lo = torch.full(shape, torch.inf).scatter_reduce(0, index, keys, "amin")
    hi = torch.full(shape, -torch.inf).scatter_reduce(0, index, keys, "amax")
    return SentenceTable(positions, sentence, sizes, lo=lo, hi=hi)


def sentence_scores(table: SentenceTable, q: torch.Tensor) -> torch.Tensor:
    """[S]: a query [heads, head_dim] against each sentence, summed over heads (a KV head's summary
    serves the query heads of its group): the dot product with the mean key, or a page's bound."""
    if table.vectors is None:
        return aabb_scores_torch(q.float()[None, None], table.lo[None], table.hi[None]).sum(dim=(0, 1, 2))
    sentences, kv_heads, dim = table.vectors.shape
    return torch.einsum("kgd,skd->s", q.float().view(kv_heads, -1, dim), table.vectors)


def retrieve(table: SentenceTable, q: torch.Tensor, budget: int) -> tuple[torch.Tensor, int]:
    """The positions of the best sentences for the query q, in order of score, while their tokens
    fit in `budget` (ascending), and how many sentences that is. Sentences longer than the budget
    are left out (they could never fit)."""
    if not table.sizes.numel():
        return table.positions, 0
    order = torch.argsort(sentence_scores(table, q), descending=True, stable=True)
    order = order[table.sizes[order] <= budget]  # a sentence longer than the budget never fits: it blocks no other
    fits = int((torch.cumsum(table.sizes[order], 0) <= budget).sum())
    chosen = torch.zeros(table.sizes.numel(), dtype=torch.bool)
    chosen[order[:fits]] = True
    return table.positions[chosen[table.sentence]], fits


class SentenceReads:
    """A request's decode-time reads (core/decode.py StepReads), from its tables."""

    def __init__(
        self,
        always: torch.Tensor,
        tables: list[SentenceTable],
        prompt_len: int,
        budget: int,
        interval: int,
        ends: np.ndarray,
    ):
        self.always, self.tables, self.prompt_len = always, tables, prompt_len
        self.budget, self.interval, self.ends = budget, interval, ends
        layers = len(tables)
        self.sums: list[torch.Tensor | None] = [None] * layers  # the sentence cache Q_s, summed, per layer
        self.count = 0  # queries in it
        self.retrieved: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)] * layers
        self.steps = 0
        self.last_layer: int | None = None
        self.reads = 0  # positions read, summed over steps and layers
        self.sentences = 0  # sentences retrieved, summed over steps and layers

    def positions(self, layer: int, q: torch.Tensor, token: int, length: int) -> torch.Tensor:
        if self.last_layer is None or layer <= self.last_layer:  # the step's first layer asking
            self.steps += 1
            # a step whose input token ends a sentence starts the next one: its query belongs there
            if 0 <= token < len(self.ends) and self.ends[token]:
                self.sums, self.count = [None] * len(self.tables), 0
            self.count += 1
        self.last_layer = layer
        q = q.float().cpu()
        by_sentence = self.tables[layer].vectors is not None  # pages (Quest) score with the step's own query
        if by_sentence:
            self.sums[layer] = q if self.sums[layer] is None else self.sums[layer] + q
        if (self.steps - 1) % self.interval == 0:
            query = self.sums[layer] / self.count if by_sentence else q
            self.retrieved[layer], n = retrieve(self.tables[layer], query, self.budget)
            self.sentences += n
        generated = torch.arange(self.prompt_len, length)
        out = torch.cat([torch.cat([self.always, self.retrieved[layer]]).sort().values, generated])
        self.reads += out.numel()
        return out

    def metrics(self) -> dict:
        layers, steps = len(self.tables), max(self.steps, 1)
        retrievals = max(-(-self.steps // self.interval), 1)
        return {
            "decode_steps": self.steps,
            "kv_read_per_step": self.reads / (steps * layers),
            "retrieved_sentences": self.sentences / (retrievals * layers),
        }
