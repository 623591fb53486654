"""KV memory of one scheduler process (MemArt): record finished turns, retrieve blocks for a prompt.

Data flows one way:
- release (scheduler thread): a finished session request's new tokens are copied off the KV pool
  (recorder.py); a worker thread (pools.py) removes their rotation and cuts them into blocks of the
  session's pool (pool.py), off the request's path;
- probe (a prefill-only request the HTTP hook sends first, probe.py): its prompt's queries are
  captured at every attention layer as the layers receive them, their rotation removed (probes.py);
- admission of the memory-mode request (scheduler thread, retriever.py): the probe's queries score
  the session's blocks (retrieval.py); the chosen blocks (placer.py), in chronological order, go
  after the prompt's system message (whose KV the probe computed), re-rotated to the positions that
  follow it, and into the radix tree (tree_fill.py) under a key private to this session and block
  set; the request's token ids become [system] + [blocks' tokens] + [the rest of its own], so
  SGLang's prefix match reuses all of that and prefills only the request's new turn.

The tree key of an assembly is its tokens plus an extra key naming the tenant, the session and the
block ids: KV of a block depends on the context it was computed in, not only on its tokens, so an
assembly must never match KV of another assembly, of the session's plain history, or of another
session; the same assembly again (the same blocks) matches all of it.
"""

from __future__ import annotations

import logging

import torch

from sgl_memory.core import allocator, mechanism, metrics, prometheus
from sgl_memory.core.kvhost import KVHost
from sgl_memory.core.request import MemorySpec
from sgl_memory.core.requests import Lifetime
from sgl_memory.core.reuse import ReusedKV
from sgl_memory.core.rope import Rope
from sgl_memory.core.views import RequestView, SchedulerView
from sgl_memory.memart import settings as section
from sgl_memory.memart import writes
from sgl_memory.memart.edits import EntryEdits
from sgl_memory.memart.placer import Placer
from sgl_memory.memart.pool import MemArtPool
from sgl_memory.memart.pools import SessionPools, line_ends
from sgl_memory.memart.probe import send_probe
from sgl_memory.memart.probes import ProbeAdmission
from sgl_memory.memart.queries import ProbeCapture
from sgl_memory.memart.recorder import Recorder
from sgl_memory.memart.retriever import Retriever
from sgl_memory.memart.roles import Roles
from sgl_memory.memart.settings import MemArtConfig, MemArtRequest
from sgl_memory.memart.turns import MemArtTurn, Turns

logger = logging.getLogger(__name__)

# Prometheus series (HTTP process: per request; the pools' gauges are pools.py's)
RETRIEVALS = prometheus.counter("retrievals", "Memory-mode requests that retrieved blocks")
RETRIEVED_BLOCKS = prometheus.counter("retrieved_blocks", "Memory blocks placed before requests")
RETRIEVAL_SECONDS = prometheus.histogram("retrieval_seconds", "Memory retrieval time")
# what memory-mode prefills cost (reuse.prefill_cost): their ratio is the work done over a full prefill's
REUSED_TOKENS = prometheus.counter("memory_reused_tokens", "Placed tokens whose KV came from memory")
COMPUTED = prometheus.counter("memory_prefill_token_layers", "Token-layers memory-mode prefills computed")
FULL = prometheus.counter("memory_full_prefill_token_layers", "Token-layers a prefill without memory would compute")
# how a memory-mode request that placed nothing is labelled; the reason strings are the manager's
REFUSALS = {"no query pass": "no_probe", "no free KV slots": "no_kv_slots"}


@mechanism.register("memory")
class MemArtManager(mechanism.Mechanism, mechanism.KVPlacing):
    """The `memory` mechanism: its hooks, each handed to the object whose job it is: probe
    admission (`probe_passes`, probes.py), entry edits (`edits`, edits.py), retrieval
    (`retriever`, retriever.py) and placement (`placer`, placer.py), recording (`recorder`,
    recorder.py) and the session pools with their worker (`pools`, pools.py)."""

    # first (it runs after none; keep, persist and intent run after it): it puts retrieved blocks
    # before a memory-mode request's prompt, under a key of their own; at checkpoint it copies a
    # turn's prompt before intent prunes the row (what pruning drops stays recallable), and at
    # release queues the turn before persistence writes the session
    settings = MemArtConfig
    fields = ("memory",)
    # its request object and config checks (settings.py)
    parse_request = staticmethod(section.parse_request)
    check_request = staticmethod(section.check_request)
    check_config = staticmethod(section.check_config)
    schema = mechanism.MetricsSchema(
        marker="retrieved_blocks",
        summed=(
            "retrieved_blocks",
            "retrieval_ms",
            "reused_tokens",
            "prefill_token_layers",
            "full_prefill_token_layers",
        ),
    )
    kv_state = {"keys": "k", "values": "v"}  # of the pool's export (pool_io.export)
    # at TP > 1 its block scores are combined over the ranks (retrieval.py) and a merge breaks ties
    # without the rank's own key norms (eviction.py): every rank places the same blocks
    # (tests/test_tp_scores.py, tests/test_tp_server.py)
    page_refusal = "its assemblies are token-exact prefixes: blocks start at any position"

    @classmethod
    def observe(cls, metrics: dict, meta_info: dict) -> None:
        if metrics.get("retrieved_blocks"):
            RETRIEVALS.inc()
            RETRIEVED_BLOCKS.inc(metrics["retrieved_blocks"])
            RETRIEVAL_SECONDS.observe(metrics["retrieval_ms"] / 1000)
        if "full_prefill_token_layers" in metrics:  # memory's or its repairer's (both report the cost)
            REUSED_TOKENS.inc(metrics["reused_tokens"])
            COMPUTED.inc(metrics["prefill_token_layers"])
            FULL.inc(metrics["full_prefill_token_layers"])
        refused = metrics.get("memory_refused")
        if refused:
            reason = next((code for text, code in REFUSALS.items() if refused.startswith(text)), "other")
            prometheus.REFUSALS.labels(cls.name, reason).inc()

    @classmethod
    def mount(cls, app, config, engine) -> None:
        writes.mount(app, config, engine)

    @classmethod
    async def before_generate(cls, request, engine) -> None:
        await send_probe(request, engine)

    def __init__(self, config: MemArtConfig, tree: KVHost, rope: Rope):
        self.config, self.tree = config, tree
        self.layer_num = tree.pool.layer_num
        self.layers = max(1, round(self.layer_num * config.score_layers))  # the scoring layers
        self.pools = SessionPools(config, tree, rope, self.layers, self.name)
        self.roles = Roles(config.roles)
        self.turns: Turns = tree.requests.table("memory turns", Lifetime.REQUEST)
        self.probe_passes = ProbeAdmission(config, rope, self.layers, self.roles, tree.requests, self.turns)
        self.edits = EntryEdits(self.pools, self.turns)
        self.placer = Placer(config, tree, rope)
        self.retriever = Retriever(config, tree, self.roles, self.probe_passes, self.pools, self.placer, self.turns)
        self.recorder = Recorder(tree, self.pools)

    @classmethod
    def build(cls, config: MemArtConfig, tree: KVHost, ctx) -> MemArtManager:
        if ctx is None:
            raise ValueError("KV memory needs the scheduler's build context (the model's RoPE)")
        manager = cls(config, tree, Rope.from_hf_config(ctx.model_config.hf_config))
        allocator.fix_mmap_threshold()  # blocks and pools come and go: their memory must go back
        logger.info(
            "KV memory: blocks of %d tokens, top_k %d, %s-%s", config.block_size, config.top_k, config.norm, config.agg
        )
        return manager

    def subscriber(self) -> ProbeCapture:
        return self.probe_passes.running

    def placed_kv(self, req: RequestView) -> ReusedKV | None:
        return self.placer.placed.get(req.rid)

    def drain(self, timeout: float | None = None) -> bool:
        return self.pools.drain(timeout)

    def match_limit(self, req: RequestView) -> int | None:
        return self.probe_passes.match_limit(req)

    def open(self, scheduler: SchedulerView, req: RequestView, spec: MemorySpec) -> None:
        """Before any admission (a session restored from its file makes its pool here too)."""
        tokenizer = getattr(scheduler, "tokenizer", None)
        if self.config.cut == "lines" and self.pools.line_ends is None and tokenizer is not None:
            self.pools.line_ends = line_ends(tokenizer)

    def admit(self, scheduler: SchedulerView, req: RequestView, spec: MemorySpec) -> None:
        if spec.session_id is None or req.rid in self.turns:
            return
        owner = (spec.tenant or "", spec.session_id)
        query: MemArtRequest | None = spec.part(self.name)
        if query is None and spec.readonly:
            return  # nothing to record, nothing to place
        if query is None:
            self.turns.set(req.rid, MemArtTurn(owner, "record"))
        elif query.mode == "probe":
            self.probe_passes.admit(scheduler, req, owner, query.probe, query.placement)
        elif query.mode in ("write", "forget", "turns"):
            self.edits.admit(req, owner, query)
        elif query.mode == "text":  # its lines are in the prompt already (text.py): it only records
            self.retriever.turn(scheduler, req, owner, query, spec.readonly)
        else:
            self.retriever.admit(scheduler, req, owner, query, spec.readonly)

    # --- recording: the turn's prompt at the end of its prefill, its answer at release -----------

    def on_checkpoint(self, req: RequestView, tree: KVHost) -> None:
        """Copy the turn's prompt part off the pool at the end of its prefill, before intent (later
        by order) prunes the row: what pruning drops from the request stays recallable as KV (a
        probe's: the system message's KV at its release)."""
        state: MemArtTurn | None = self.turns.get(req.rid)
        if state is not None and state.mode == "probe":
            self.probe_passes.checkpoint(req, tree)
        else:
            self.recorder.checkpoint(req, tree, state)

    def on_release(self, req: RequestView) -> None:
        state: MemArtTurn | None = self.turns.get(req.rid)
        if state is None:
            return
        if state.mode == "probe":
            self.probe_passes.release(req)
            return
        if state.mode == "turns":
            metrics.attach(req, self.edits.transcript(self.pools.session(state.owner, create=False), self.config))
            return
        memory = self.pools.session(state.owner, create=True)
        if state.mode in ("write", "forget"):
            if state.store and not self.tree.disable:
                self.recorder.record(req, state, memory)
            # added here, not by the worker: the entries API answers with its entries in the pool,
            # and an entry is a line of text, cheap to unrotate
            memory.ingest(self.config.block_size)
            self.pools.bound(memory)
            metrics.attach(req, self.edits.answer(memory, req))
            return
        metrics.attach(req, state.metrics(req, len(memory.blocks), self.layer_num))
        if state.store and not self.tree.disable and self.recorder.record(req, state, memory):
            self.pools.submit(memory)

    # --- the session's pool, kept with the session by persistence ---------------------------------

    def export_session(self, key: tuple[str, str]) -> dict[str, torch.Tensor]:
        return self.pools.export(key)

    def describe_session(self, state: MemArtPool) -> dict:
        return self.pools.describe(state)

    def import_session(self, key: tuple[str, str], tensors: dict[str, torch.Tensor]) -> None:
        self.pools.load(key, tensors)
