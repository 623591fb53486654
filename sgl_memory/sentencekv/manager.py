"""SentenceKV in the server: one mechanism that captures each request's observation window during its
prefill, builds its sentence tables when the prefill ends, and hands the attention backend its
per-step reads (core/decode.py) until the request is released. It rewrites no token, no row and no
tree path: the prompt's KV stays in the pool, and a decode step reads only part of it.

Runs on the CPU attention backend (`sgl_memory_cpu`), whose decode path reads the positions a
request's StepReads gives per layer. SGLang's GPU backends build one index list per forward for
every layer; start-up refuses them (the index-list kernel, kernels/step_kv_indices.py, is
tested under TRITON_INTERPRET, not wired into them).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from sgl_memory.core import kv_rows, mechanism, metrics, prometheus
from sgl_memory.core.attention import attention_probs
from sgl_memory.core.capture import ExtendRows, QueryCapture
from sgl_memory.core.request import MemorySpec
from sgl_memory.core.requests import Lifetime, RequestStore, RequestTable
from sgl_memory.core.spans import RoleMarkers, find_spans
from sgl_memory.sentencekv import settings as section
from sgl_memory.sentencekv.segment import boundary_tokens, sentence_ids
from sgl_memory.sentencekv.select import SentenceReads, page_table, sentence_table, top_tokens
from sgl_memory.sentencekv.settings import SentenceKVConfig

CPU_BACKEND = "sgl_memory_cpu"

DECODE_STEPS = prometheus.counter("sentencekv_decode_steps", "Decode steps served with SentenceKV reads")
KV_READ = prometheus.counter(
    "sentencekv_kv_read_tokens", "KV positions read per layer by SentenceKV decode steps, summed over steps"
)
RETRIEVED = prometheus.counter(
    "sentencekv_retrieved_sentences",
    "Sentences a SentenceKV retrieval reads (mean per retrieval and layer of each request), summed over requests",
)
KEPT = prometheus.counter(
    "sentencekv_kept_tokens", "Prompt tokens SentenceKV kept readable (always-read plus the semantic pool)"
)
SELECT_SECONDS = prometheus.histogram(
    "sentencekv_select_seconds", "SentenceKV's work at the end of a prefill (scores, pool, sentence tables)"
)


@mechanism.register("sentencekv")
class SentenceKV(mechanism.Mechanism, mechanism.DecodeReading):
    """The `sentencekv` mechanism: captures each request's observation window in its prefill, builds
    its sentence tables when the prefill ends, and hands the attention backend its per-step reads
    until the request is released."""

    # after intent pruning: a row it pruned is read through the sentinel-free slots, and its
    # compact layout (positions moved) is served with the full cache instead
    after = ("intent",)
    settings = SentenceKVConfig
    fields = ("sentencekv",)
    tp_refusal = "each rank would choose the sentences from its own KV heads' scores"
    parse_request = staticmethod(section.parse_request)
    schema = mechanism.MetricsSchema(
        marker="sentences",
        summed=("sentences", "kept_tokens", "retrieved_sentences", "kv_read_per_step", "decode_steps", "sentencekv_ms"),
        counted=("sentencekv_skipped",),
    )

    @classmethod
    def observe(cls, m: dict, meta_info: dict) -> None:
        if "sentences" not in m:
            return
        KEPT.inc(m["kept_tokens"])
        DECODE_STEPS.inc(m["decode_steps"])
        KV_READ.inc(m["kv_read_per_step"] * m["decode_steps"])
        RETRIEVED.inc(m["retrieved_sentences"])
        SELECT_SECONDS.observe(m["sentencekv_ms"] / 1000)

    def __init__(self, config: SentenceKVConfig, requests: RequestStore):
        self.config = config
        self.ends: np.ndarray | None = None  # per token id: ends a sentence (from the tokenizer, at first use)
        self.markers = RoleMarkers(None, {})  # the chat template's role markers (from the tokenizer, at first use)
        # from admission to the prefill's end: the request's settings, its observation window's
        # capture, and whether it prefills its own window (its prompt is not assembled)
        self.plans: RequestTable[SentenceKVConfig] = requests.table("sentencekv plans", Lifetime.ROW)
        self.captures: RequestTable[QueryCapture] = requests.table("sentencekv captures", Lifetime.ROW)
        self.own_window: RequestTable[bool] = requests.table("sentencekv own window", Lifetime.ROW)
        # from the prefill's end to the release: its decode reads and its prefill's metrics
        self.reads: RequestTable[SentenceReads] = requests.table("sentencekv reads", Lifetime.ROW)
        self.done: RequestTable[dict] = requests.table("sentencekv metrics", Lifetime.ROW)

    @classmethod
    def build(cls, config: SentenceKVConfig, tree, ctx) -> SentenceKV:
        args = getattr(ctx, "server_args", None)
        for flag in ("attention_backend", "decode_attention_backend"):
            backend = getattr(args, flag, None)
            if backend not in (None, CPU_BACKEND):
                raise ValueError(
                    f"sentencekv reads a per-layer position list at each decode step, which only the {CPU_BACKEND} "
                    f"attention backend takes; this server's {flag} is {backend}"
                )
        if getattr(args, "enable_mixed_chunk", False):
            # a mixed batch's decode rows are planned as an extend: they would read every position
            raise ValueError(
                "sentencekv reads its positions in decode batches only; "
                "--enable-mixed-chunk puts decode steps in mixed ones"
            )
        return cls(config, tree.requests)

    def subscriber(self) -> SentenceKV:
        return self  # it reads its requests' observation windows

    def step_reads(self, rid: str) -> SentenceReads | None:
        return self.reads.get(rid)

    # --- admission --------------------------------------------------------------------------------

    def admit(self, scheduler, req, spec: MemorySpec) -> None:
        asked = spec.part(self.name)
        cfg = asked.over(self.config) if asked is not None else self.config
        if not cfg.enabled or req.finished() or req.rid in self.plans:
            return
        if self.ends is None:
            tokenizer = getattr(scheduler, "tokenizer", None)
            # without a tokenizer (--skip-tokenizer-init) sentences are cut at max_sentence only
            self.ends = (
                boundary_tokens(tokenizer, self.config.boundaries) if tokenizer is not None else np.zeros(0, dtype=bool)
            )
            self.markers = RoleMarkers.from_tokenizer(tokenizer, self.config.roles)
        length = len(req.origin_input_ids)
        self.plans.set(req.rid, cfg)
        self.captures.set(req.rid, QueryCapture(length, length, cfg.window))
        if not spec.assembled:
            self.own_window.set(req.rid, True)

    def match_limit(self, req) -> int | None:
        # the window's query rows are computed by the request's own prefill, never taken from the
        # cache; but not where another mechanism assembled the prompt from KV it placed (memory
        # blocks), which the window must not recompute: there the window is the rows the prefill
        # computes (the new turn), the cached rows of it left at zero, which add the same share of
        # attention to every token and so leave the scores' order as it is
        query_capture = self.captures.get(req.rid)
        return query_capture.window_start if query_capture is not None and req.rid in self.own_window else None

    # --- the observation window's queries (a capture.py subscriber) --------------------------------

    def capturing(self) -> bool:
        return bool(self.captures)

    def bind(self, rows: list[ExtendRows]) -> list[tuple[QueryCapture, ExtendRows]]:
        return [
            (c, r) for r in rows if (c := self.captures.get(r.rid)) is not None and r.prefix + r.count > c.window_start
        ]

    def first_read(self, part) -> int:
        return part[0].first_read()

    def take(self, bound, layer, q, k, v) -> None:
        for query_capture, r in bound:
            query_capture.add_rows(layer, q, r)

    # --- the end of the prefill: the pool, the sentences, the reads ----------------------------------

    def on_checkpoint(self, req, tree):
        cfg = self.plans.get(req.rid)
        if cfg is None or req.finished() or not req.output_ids:
            return None
        self.plans.pop(req.rid)
        query_capture = self.captures.pop(req.rid)
        if tree.position_shift(req.rid):
            self.done.set(
                req.rid, {"sentencekv_skipped": "compact layout"}
            )  # its row no longer holds the prompt by position
            return None
        window = query_capture.q_window() if query_capture is not None else torch.zeros(0)
        if not window.numel() or window.shape[0] != tree.pool.layer_num:
            self.done.set(req.rid, {"sentencekv_skipped": "no window"})  # its prompt's last rows were not computed here
            return None
        t0 = time.perf_counter()
        reads, kept, sentences = self._reads(req, tree, cfg, window)
        if reads is None:
            self.done.set(req.rid, {"sentencekv_skipped": "short prompt"})  # every live token is read anyway
            return None
        self.done.set(
            req.rid, {"sentences": sentences, "kept_tokens": kept, "sentencekv_ms": (time.perf_counter() - t0) * 1000}
        )
        self.reads.set(req.rid, reads)
        return None

    def _reads(self, req, tree, cfg: SentenceKVConfig, window: torch.Tensor) -> tuple[SentenceReads | None, int, int]:
        """The request's reads (None when every prompt token is read anyway), the prompt tokens a
        step may read, and the sentences of its pool (mean over layers)."""
        tokens = np.asarray(req.origin_input_ids, dtype=np.int64)
        length = len(tokens)
        slots = tree.row(req)[:length].to(torch.int64)
        live = (slots != tree.sentinel).cpu() if tree.sentinel is not None else torch.ones(length, dtype=torch.bool)
        positions = torch.arange(length)
        scored_end = length - cfg.window  # the window's rows score the tokens before it
        # the system message, where asked: without role markers (or a system message) it is empty
        first = max(cfg.sinks, find_spans(req.origin_input_ids, self.markers, 0).system_end if cfg.system else 0)
        always = live & ((positions < first) | (positions >= min(scored_end, length - cfg.recent)))
        candidates = positions[live & ~always]
        if not candidates.numel():
            return None, int(live.sum()), 0
        pool = tree.pool
        tables = []
        if cfg.selection == "page":  # the Quest-style baseline: every token, fixed pages, no prefill scores
            pages = positions // cfg.page_size
            for layer in range(pool.layer_num):
                keys = kv_rows.values(pool.get_key_buffer(layer)[slots[candidates]])
                tables.append(page_table(candidates, pages, keys))
        else:
            sentence_of = sentence_ids(tokens, self.ends, cfg.max_sentence)
            # the window attends every live token before it (the sinks too: the paper's positions
            # 1..L-N); the candidates' share of that attention scores them
            scored = positions[live & (positions < scored_end)]
            is_candidate = ~always[scored]
            for layer in range(pool.layer_num):
                keys = kv_rows.values(pool.get_key_buffer(layer)[slots[scored]])
                scores = attention_probs(keys, window[layer]).sum(dim=(0, 1)).cpu()[is_candidate]
                chosen = top_tokens(scores, cfg.pool)
                tables.append(
                    sentence_table(
                        candidates[chosen], sentence_of, keys[is_candidate.to(keys.device)][chosen.to(keys.device)]
                    )
                )
        kept = int(always.sum()) + min(cfg.pool, candidates.numel())
        sentences = round(sum(t.sizes.numel() for t in tables) / len(tables))
        return SentenceReads(positions[always], tables, length, cfg.budget, cfg.interval, self.ends), kept, sentences

    # --- release --------------------------------------------------------------------------------------

    def on_release(self, req) -> None:
        reads, done = self.reads.get(req.rid), self.done.get(req.rid)
        if done is None:
            return
        if reads is not None:
            done.update(reads.metrics())
        metrics.attach(req, done)
