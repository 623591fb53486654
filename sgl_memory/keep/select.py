"""Which placed rows the next layer recomputes: KEEP's segments by multi-hop importance, CacheBlend's
tokens by KV deviation, the segments' first tokens (`starts`), tokens at random (`random`, the
baseline). One class per method, registered under its `recompute` name.

A selector sees one layer of one request after the placed KV was written over the rows this layer
does not recompute (`LayerView`), and names the rows the next layer recomputes, among this layer's
(a row dropped at a layer has no hidden state after it, so the sets are nested).

Under tensor parallelism a rank holds a share of the heads: what a selector averages or sums over
heads it combines over the ranks (`LayerView.reduce`, the tree's reduce_heads) before ranking, so
every rank recomputes the same rows.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_memory.core.kvhost import Reduce, one_rank
from sgl_memory.core.registry import Registry


@dataclass
class LayerView:
    """One layer of one request as a selector sees it: the placed rows after the placed KV was
    written over those not recomputed, the new turn's rows, and which rows this layer recomputed."""

    q_mem: torch.Tensor  # [M, H, D] queries of the placed rows (meaningful where `candidates`)
    k_mem: torch.Tensor  # [M, Hkv, D] keys of the placed rows: recomputed where `candidates`, placed elsewhere
    v_mem: torch.Tensor  # [M, Hkv, Dv]
    q_turn: torch.Tensor  # [T, H, D] the rows after the placed ones: the request's new turn
    k_turn: torch.Tensor  # [T, Hkv, D]
    placed_k: torch.Tensor  # [M, Hkv, D] the placed KV of this layer (of the candidates only if the selector reads it)
    placed_v: torch.Tensor
    candidates: torch.Tensor  # [M] bool: the rows this layer recomputed
    segment: torch.Tensor  # [M] the segment index of each row
    reduce: Reduce = one_rank  # the tree's reduce_heads


SELECTORS: Registry[type[Selector]] = Registry("selector")  # the repairs KEEP carries out, by name


class Selector(ABC):
    """What a repair method provides (one subclass per `recompute` name, in SELECTORS): at each
    layer, the rows the next layer recomputes."""

    name: ClassVar[str]
    unit: ClassVar[str]  # what the ratio counts: "segment" or "token"
    # whether `select` reads the placed KV of the rows it recomputes (then every placed row is
    # loaded at every layer, as token-level recomputation must)
    reads_placed: ClassVar[bool] = False

    @abstractmethod
    def select(self, view: LayerView, n: int) -> torch.Tensor:
        """[M] bool: the rows the next layer recomputes, `n` units (whole segments, or tokens)
        among this layer's candidates (all of them when fewer are candidates)."""


def top(scores: torch.Tensor, eligible: torch.Tensor, n: int) -> torch.Tensor:
    """[len(scores)] bool: the n highest scores among the eligible entries, ties to the earlier one."""
    order = torch.sort(scores.masked_fill(~eligible, -math.inf), descending=True, stable=True).indices
    picked = torch.zeros_like(eligible)
    picked[order[: min(n, int(eligible.sum()))]] = True
    return picked


def _logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[H, n, K]: queries [n, H, D] against keys [K, Hkv, D], scaled, in float32. GQA: head h reads
    KV head h // (H / Hkv); the query heads are grouped instead of the keys repeated per head."""
    n, heads, dim = q.shape
    kv = k.shape[1]
    grouped = q.float().view(n, kv, heads // kv, dim)
    return torch.einsum("ngjd,kgd->gjnk", grouped, k.float()).reshape(heads, n, k.shape[0]) / math.sqrt(dim)


def turn_attention(view: LayerView) -> torch.Tensor:
    """[M] the new turn's attention to each placed token, averaged over heads and turn rows. Each
    turn row's softmax runs over the placed keys and the turn's keys up to itself (the system
    message before the blocks is left out: a row constant that does not change the ranking)."""
    m, t = view.k_mem.shape[0], view.k_turn.shape[0]
    logits = _logits(view.q_turn, torch.cat([view.k_mem, view.k_turn]))
    later = torch.ones(t, t, dtype=torch.bool, device=logits.device).triu(1)
    logits[:, :, m:] = logits[:, :, m:].masked_fill(later, -math.inf)
    return view.reduce(logits.softmax(-1)[:, :, :m].mean((0, 1)), "mean")


def segment_attention(view: LayerView, segments: int, which: torch.Tensor) -> torch.Tensor:
    """[S, S] cross-attention between placed segments, rows `which` [S] filled (the others zero):
    row a is how much segment a attends to segment b's tokens. A segment asks with one query per
    head, the mean of its candidate rows' queries, over the placed keys up to its last row (softmax,
    averaged over heads, summed over b's tokens); the diagonal is zero. One pooled row per segment
    instead of every row: a layer's propagation costs a segment count of query rows, not a token
    count (measured on LoCoMo at 64 blocks: the per-row version cost 150 ms of a 1.0 s TTFT)."""
    m = view.k_mem.shape[0]
    seg = view.segment.to(view.candidates.device)
    rows = view.candidates & which[seg]
    asking = which & torch.zeros(segments, dtype=torch.bool, device=seg.device).index_fill_(0, seg[rows], True)
    picked = asking.nonzero().squeeze(1)
    index = rows.nonzero().squeeze(1)
    sums = torch.zeros(segments, *view.q_mem.shape[1:], device=seg.device).index_add_(
        0, seg[index], view.q_mem[index].float()
    )
    counts = torch.zeros(segments, device=seg.device).index_add_(
        0, seg[index], torch.ones(len(index), device=seg.device)
    )
    pooled = sums[picked] / counts[picked, None, None]  # [P, H, D]
    last = torch.zeros(segments, dtype=torch.long, device=seg.device).scatter_reduce_(
        0, seg[index], index, "amax", include_self=False
    )
    logits = _logits(pooled, view.k_mem)
    later = torch.arange(m, device=seg.device)[None, :] > last[picked][:, None]
    weights = view.reduce(logits.masked_fill(later, -math.inf).softmax(-1).mean(0), "mean").to(seg.device)  # [P, M]
    cross = torch.zeros(segments, segments, device=seg.device)
    cross[picked] = torch.zeros(len(picked), segments, device=seg.device).index_add_(1, seg, weights)
    return cross.fill_diagonal_(0.0)


@SELECTORS.register("keep")
@dataclass
class MultiHop(Selector):
    """KEEP (section 4.2): importance starts as the new turn's attention to each segment; the top n
    segments form the relevant set, and each segment's importance becomes the mean of the turn's
    and the relevant segments' attention to it, until the set is stable or `hops` sets were formed.
    The turn stays a member of the average (KEEP's update names only the relevant set): a segment
    no placed segment attends to, such as the last one under causal attention, would otherwise
    lose the turn's evidence after one hop."""

    unit: ClassVar[str] = "segment"
    hops: int = 4

    def select(self, view: LayerView, n: int) -> torch.Tensor:
        segments = int(view.segment.max()) + 1 if len(view.segment) else 0
        seg = view.segment.to(view.candidates.device)
        eligible = torch.zeros(segments, dtype=torch.bool, device=seg.device).index_fill_(0, seg[view.candidates], True)
        query = torch.zeros(segments, device=seg.device).index_add_(0, seg, turn_attention(view).to(seg.device))
        chosen = top(query, eligible, n)
        if self.hops > 1 and n < int(eligible.sum()):
            # a segment's row of the cross-attention is computed when it first joins the set
            cross = torch.zeros(segments, segments, device=seg.device)
            known = torch.zeros(segments, dtype=torch.bool, device=seg.device)
            for _ in range(self.hops - 1):
                if bool((chosen & ~known).any()):
                    cross += segment_attention(view, segments, chosen & ~known).to(seg.device)
                    known |= chosen
                importance = (query + cross[chosen].sum(0)) / (1 + int(chosen.sum()))
                again = top(importance, eligible, n)
                if bool((again == chosen).all()):
                    break
                chosen = again
        return chosen[seg]


@SELECTORS.register("cacheblend")
@dataclass
class KVDeviation(Selector):
    """CacheBlend: the tokens whose recomputed KV deviates most from the placed KV (squared L2
    over the keys and values of every head) go on to the next layer."""

    unit: ClassVar[str] = "token"
    reads_placed: ClassVar[bool] = True

    def select(self, view: LayerView, n: int) -> torch.Tensor:
        dk = (view.k_mem.float() - view.placed_k.float()).pow(2).sum((1, 2))
        dv = (view.v_mem.float() - view.placed_v.float()).pow(2).sum((1, 2))
        return top(view.reduce(dk + dv, "sum").to(dk.device), view.candidates, n)


@SELECTORS.register("starts")
@dataclass
class SegmentStarts(Selector):
    """The first tokens of every placed segment, earliest first (ties to the earlier row, so the
    assembly's first token comes first): that token was computed mid-transcript, not as the
    attention sink a position-0 token is. Measured on LoCoMo (bench/reuse_gap.py): its reused KV
    deviates most, and recomputing it alone carries 0.94 of a full recompute's gain; the other
    segments' starts add nothing measurable. A fixed order, so every layer's set lies inside the
    one before."""

    unit: ClassVar[str] = "token"

    def select(self, view: LayerView, n: int) -> torch.Tensor:
        seg = view.segment.to(view.candidates.device)
        index = torch.arange(len(seg), device=seg.device)
        first = torch.full((int(seg.max()) + 1 if len(seg) else 0,), len(seg), device=seg.device)
        offset = index - first.scatter_reduce(0, seg, index, "amin")[seg]
        return top(-offset.float(), view.candidates, n)


@SELECTORS.register("random")
@dataclass
class RandomTokens(Selector):
    """Tokens in one fixed random order (seeded: a request repairs alike on every run and every
    rank): the baseline a chosen set must beat (CacheBlend measures its selection against random
    picks). The order is the same at every layer, so each layer's set lies inside the one before."""

    unit: ClassVar[str] = "token"
    seed: int = 0

    def select(self, view: LayerView, n: int) -> torch.Tensor:
        order = torch.rand(len(view.segment), generator=torch.Generator().manual_seed(self.seed))
        return top(order.to(view.candidates.device), view.candidates, n)


def ratio_at(layer: int, layers: int, ratio: float, decay: float) -> float:
    """The share of units layer `layer` recomputes: all at layer 0, `ratio` at layer 1, down to
    ratio ** (1 + decay) at the last layer (geometric in between, so ratio 1 stays 1 everywhere)."""
    if layer == 0:
        return 1.0
    return ratio ** (1 + decay * (layer - 1) / max(1, layers - 2))
