"""Scorers: which candidate history tokens of a request stay live. One small class per policy.

A scorer maps a request's candidates (live positions outside the forced set) to one score each;
the pruner keeps the `keep` highest. One set is chosen for all layers and heads, because the slot
map that realises it is per request, not per layer.

Under tensor parallelism a rank holds a share of the heads, so what a scorer averages or sums over
heads it combines over the ranks (`ScoringInputs.reduce`, the tree's reduce_heads) before anything
that is not linear in it (max-pooling, the learned head): every rank then holds the scores one rank
with all the heads would compute, and keeps the same positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_memory.core.attention import attention_probs
from sgl_memory.core.kvhost import Reduce, one_rank
from sgl_memory.core.registry import Registry
from sgl_memory.intent.head import PrunerHead, layer_head_mean
from sgl_memory.intent.sessions import unit_rows


@dataclass
class ScoringInputs:
    """What a scorer reads of one request: its candidates' keys and positions, the queries captured
    in its prefill, the session memory, how many to keep and, for the learned scorer, its head."""

    layer_keys: Callable[[], Iterator[torch.Tensor]]  # per layer: candidates' post-RoPE keys [n, KVH, D]
    positions: torch.Tensor  # [n] absolute positions of the candidates, ascending
    q_mean: torch.Tensor  # [layers, H, D] mean post-RoPE query over the actionable span
    q_window: torch.Tensor  # [layers, W, H, D] the prompt's last W query rows
    memory: torch.Tensor | None  # [layers, H, D] the session's QueryMemory after this request's update
    keep: int
    seed: int
    sinks: int
    kernel: int
    # learned: per layer, the post-RoPE keys of the live query positions [m, KVH, D]; the head; its ablation
    query_keys: Callable[[], Iterator[torch.Tensor]] | None = None
    head: PrunerHead | None = None
    ablation: str = "none"
    features: dict | None = None  # learned: filled with the head's inputs when given (intent.trace_dir)
    reduce: Reduce = one_rank  # the tree's reduce_heads


class Scorer:
    """How an intent scorer ranks a request's history positions (registered in SCORERS by name)."""

    name: str = ""  # set by SCORERS.register
    needs_queries = False  # reads the span's mean query (and the session memory built from it)
    needs_window = False  # reads the prompt's last W query rows

    def score(self, x: ScoringInputs) -> torch.Tensor:
        raise NotImplementedError


SCORERS: Registry[type[Scorer]] = Registry("scorer")  # the names `intent.scorer` takes


def get(name: str) -> Scorer:
    """A scorer of the kind named (a KeyError naming the allowed ones otherwise)."""
    return SCORERS[name]()


def rule_score(
    x: ScoringInputs, rows: torch.Tensor, each_layer: Callable[[torch.Tensor], None] | None = None
) -> torch.Tensor:
    """IntentKV eq. 3: softmax of (query state . key) over candidates, averaged over heads and layers.
    rows: [layers, H, D] (one state per layer) or [layers, R, H, D]. `each_layer(keys)` sees every
    layer's candidate keys on the way (one read of the pool for the learned head's features too)."""
    total = torch.zeros(x.positions.numel())
    layers = 0
    for layer, keys in enumerate(x.layer_keys()):
        r = rows[layer]
        total += attention_probs(keys, r if r.dim() == 3 else r.unsqueeze(0)).mean(dim=(0, 1)).cpu()
        if each_layer is not None:
            each_layer(keys)
        layers += 1
    return x.reduce(total / max(layers, 1), "mean")


@SCORERS.register("query")
class QueryScorer(Scorer):
    """The current request's query span only (IntentKV `query` mode)."""

    needs_queries = True

    def score(self, x):
        return rule_score(x, unit_rows(x.q_mean))


@SCORERS.register("memory")
class MemoryScorer(Scorer):
    """The session's QueryMemory, which has absorbed every earlier turn's query (IntentKV `memory`)."""

    needs_queries = True

    def score(self, x):
        return rule_score(x, x.memory)


def pooled(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Each position's score raised to the largest within `kernel` positions around it (SnapKV's
    max-pool smoothing): a kept token brings its neighbours, so a name or a value of several tokens
    is kept whole rather than as its most attended piece."""
    return F.max_pool1d(scores.view(1, 1, -1), kernel, stride=1, padding=kernel // 2).view(-1)


@SCORERS.register("memory_pool")
class MemoryPoolScorer(Scorer):
    """The QueryMemory rule's scores max-pooled along positions (`kernel`); the server's default
    (bench/fidelity, docs/intent.md: ahead of the rule as published on BFCL, TextWorld and the BCP-shaped
    workload, not separated from it on LoCoMo)."""

    needs_queries = True

    def score(self, x):
        return pooled(rule_score(x, x.memory), x.kernel)


@SCORERS.register("learned")
class LearnedScorer(Scorer):
    """IntentKV Phase 2: the memory rule score plus the learned residual head (head.py)."""

    needs_queries = True

    def score(self, x):
        memory = unit_rows(x.q_mean) if x.ablation == "memory" else x.memory
        key_means = []
        rule = rule_score(x, memory, lambda keys: key_means.append(keys.float().mean(dim=1).cpu()))
        # the head runs on the host, beside the rule's shares: its inputs come off the pool's device
        context = layer_head_mean(x.query_keys()).cpu() if x.query_keys is not None else None
        keys = x.reduce(torch.stack(key_means).mean(0), "mean")
        memory_mean = x.reduce(memory.float().mean(dim=(0, 1)).cpu(), "mean")
        if context is not None:
            context = x.reduce(context, "mean")
        if x.features is not None:
            x.features.update(
                rule=rule, keys=keys, memory=memory_mean, context=keys[:0] if context is None else context
            )
        with torch.no_grad():
            return x.head.score(rule, keys, memory_mean, context, x.ablation)


@SCORERS.register("streaming_llm")
class StreamingLLMScorer(Scorer):
    """Attention sinks plus the most recent window (Xiao et al.)."""

    def score(self, x):
        s = x.positions.double()
        s[: x.sinks] = math.inf
        return s


@SCORERS.register("snapkv")
class SnapKVScorer(Scorer):
    """Attention of the prompt's last W query rows, max-pooled along positions (Li et al.)."""

    needs_window = True

    def score(self, x):
        # each layer's head mean is pooled on its own: the layers' means are combined over the ranks first
        per_layer = [
            attention_probs(keys, x.q_window[layer]).mean(dim=(0, 1)).cpu() for layer, keys in enumerate(x.layer_keys())
        ]
        if not per_layer:
            return torch.zeros(x.positions.numel())
        per_layer = x.reduce(torch.stack(per_layer), "mean")
        return sum(pooled(layer, x.kernel) for layer in per_layer) / len(per_layer)


@SCORERS.register("h2o")
class H2OScorer(Scorer):
    """Heavy hitters: attention accumulated over the observed query rows, with a recent-window floor
    holding half the budget (Zhang et al., ratio mode). The rows accumulated are the prompt's last W
    query rows: summing over every prefill row would cost a full n x n attention per layer."""

    needs_window = True

    def score(self, x):
        total = torch.zeros(x.positions.numel(), dtype=torch.float64)
        for layer, keys in enumerate(x.layer_keys()):
            total += attention_probs(keys, x.q_window[layer]).sum(dim=(0, 1)).double().cpu()
        total = x.reduce(total, "sum")
        recent = x.keep // 2
        if recent:
            total[-recent:] = math.inf
        return total


@SCORERS.register("random")
class RandomScorer(Scorer):
    """Random positions, seeded from the session and the prompt (a baseline)."""

    def score(self, x):
        gen = torch.Generator().manual_seed(x.seed)
        return torch.rand(x.positions.numel(), generator=gen)


def select(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` highest scores, ascending (ties go to the earlier position)."""
    if keep >= scores.numel():
        return torch.arange(scores.numel())
    order = torch.argsort(scores, descending=True, stable=True)
    return order[:keep].sort().values
