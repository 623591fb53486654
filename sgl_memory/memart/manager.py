"""KV memory of one scheduler process (MemArt): record finished turns, retrieve blocks for a prompt.

Data flows one way:
- release (scheduler thread): a finished session request's new tokens are copied off the KV pool;
  a worker thread removes their rotation and cuts them into blocks of the session's pool
  (blocks.py), off the request's path;
- probe (a prefill-only request the HTTP hook sends first, probe.py): its prompt's queries are
  captured at every attention layer as the layers receive them, their rotation removed;
- admission of the memory-mode request (scheduler thread): the probe's queries score the session's
  blocks (retrieval.py); the chosen blocks, in chronological order, go after the prompt's system
  message (whose KV the probe computed), re-rotated to the positions that follow it, and into the
  radix tree (tree_fill.py) under a key private to this session and block set; the request's token
  ids become [system] + [blocks' tokens] + [the rest of its own], so SGLang's prefix match reuses
  all of that and prefills only the request's new turn.

The tree key of an assembly is its tokens plus an extra key naming the tenant, the session and the
block ids: KV of a block depends on the context it was computed in, not only on its tokens, so an
assembly must never match KV of another assembly, of the session's plain history, or of another
session; the same assembly again (the same blocks) matches all of it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from sgl_memory.core import allocator, mechanism, metrics, prometheus, tree_fill
from sgl_memory.memart import writes
from sgl_memory.memart.probe import send_probe
from sgl_memory.memart.blocks import Block
from sgl_memory.memart.pool import MemArtPool
from sgl_memory.memart.entries import ALONE, EntryBook
from sgl_memory.memart.retrieval import score_blocks, top_blocks
from sgl_memory.memart.placement import assemble, choose
from sgl_memory.memart.queries import Probe, ProbeCapture, probe_end, scoring_positions
from sgl_memory.memart import settings as section
from sgl_memory.memart.settings import MemArtConfig, MemArtRequest
from sgl_memory.core.request import MemorySpec
from sgl_memory.core.kvhost import namespace
from sgl_memory.core.reuse import REPAIRS, ReusedKV
from sgl_memory.core.rope import Rope
from sgl_memory.core.slots import Slot
from sgl_memory.core.spans import RoleMarkers, after_answer, find_spans
from sgl_memory.core.worker import Worker

logger = logging.getLogger(__name__)

MAX_SESSIONS = 1024  # session pools kept; the least recently used beyond are dropped
MAX_PROBES = 32  # recent probes kept for their request (a request with n > 1 samples uses its probe n times)


@dataclass
class MemArtTurn:
    """What memory did for one request, kept in its `TURNS` slot."""

    owner: tuple[str, str]
    mode: str  # "record" (full-history turn), "retrieve", "probe", "write" (an entry or a joint KV), "forget"
    store: bool = True
    recompute: str = "none"  # what repairs the placed blocks (MemArtConfig.recompute)
    memory_start: int = 0  # the placed blocks are positions [memory_start, memory_end) of the request
    memory_end: int = 0
    turn_start: int = 0  # where what the request adds to the session starts (after the placed blocks)
    windowed: int = 0  # history tokens the HTTP side left out of a full-history request (memory.window)
    retrieved_blocks: int = 0
    retrieved_turns: list[int] = field(default_factory=list)
    retrieved_spans: list[list[int]] = field(
        default_factory=list
    )  # [turn, offset in turn, tokens] per run (Block.spans)
    probe_tokens: int = 0
    retrieval_ms: float = 0.0
    refused: str | None = None
    prompt_kv: tree_fill.PathKV | None = None  # the turn's prompt part, copied before pruning
    prompt_kv_start: int = 0
    tag: tuple | None = None  # mode "write": what its turn holds (EntryBook)
    units: dict = field(default_factory=dict)  # mode "retrieve": entries and static groups placed whole

    def metrics(self, req, memory_blocks: int, layers: int) -> dict:
        out = {
            "prefill_tokens": len(req.origin_input_ids) - req.cached_tokens,
            "retrieved_blocks": self.retrieved_blocks,
            "retrieved_turns": self.retrieved_turns,
            "retrieved_spans": self.retrieved_spans,
            "memory_kv_tokens": self.memory_end - self.memory_start,
            "probe_tokens": self.probe_tokens,
            "retrieval_ms": round(self.retrieval_ms, 3),
            "memory_blocks": memory_blocks,
            "memory_refused": self.refused,
        }
        if self.mode == "retrieve":
            out["windowed_tokens"] = self.windowed
            out["recompute"] = self.recompute
            if self.recompute not in REPAIRS:  # the keep mechanism reports its own
                full = self.recompute == "full" and self.memory_end > self.memory_start
                out["recomputed_tokens"] = (self.memory_end - self.memory_start) * layers if full else 0
                out["recompute_share"] = 1.0 if full else 0.0
            out.update(self.units)
        return out


TURNS: Slot[MemArtTurn] = Slot("memory turn")  # per request


# Prometheus series (HTTP process: per request; scheduler process: the pools)
RETRIEVALS = prometheus.counter("retrievals", "Memory-mode requests that retrieved blocks")
RETRIEVED_BLOCKS = prometheus.counter("retrieved_blocks", "Memory blocks placed before requests")
RETRIEVAL_SECONDS = prometheus.histogram("retrieval_seconds", "Memory retrieval time")
POOL_BYTES = prometheus.gauge("memory_pool_bytes", "Host memory of the KV memory pools")
POOL_BLOCKS = prometheus.gauge("memory_pool_blocks", "Blocks in the KV memory pools")
POOL_TOKENS = prometheus.gauge("memory_pool_tokens", "Tokens stored in the KV memory pools")
# how a memory-mode request that placed nothing is labelled; the reason strings are the manager's
REFUSALS = {"no query pass": "no_probe", "no free KV slots": "no_kv_slots"}


@mechanism.register("memory")
class MemArtManager(mechanism.Mechanism):
    # first: it puts retrieved blocks before a memory-mode request's prompt, under a key of their
    # own; at checkpoint it copies a turn's prompt before intent prunes the row (what pruning drops
    # stays recallable), and at release queues the turn before persistence writes the session
    order = 10
    settings = MemArtConfig
    fields = ("memory",)
    # its request object and config checks (settings.py)
    parse_request = staticmethod(section.parse_request)
    check_request = staticmethod(section.check_request)
    check_config = staticmethod(section.check_config)
    schema = mechanism.MetricsSchema(marker="retrieved_blocks", summed=("retrieved_blocks", "retrieval_ms"))
    kv_state = {"keys": "k", "values": "v"}  # of the pool's export (MemArtPool.export)
    # at TP > 1 its block scores are combined over the ranks (retrieval.py) and a merge breaks ties
    # without the rank's own key norms (blocks.py): every rank places the same blocks
    # (tests/test_tp_scores.py, tests/test_tp_server.py)
    page_refusal = "its assemblies are token-exact prefixes: blocks start at any position"

    @classmethod
    def observe(cls, metrics: dict, meta_info: dict) -> None:
        if metrics.get("retrieved_blocks"):
            RETRIEVALS.inc()
            RETRIEVED_BLOCKS.inc(metrics["retrieved_blocks"])
            RETRIEVAL_SECONDS.observe(metrics["retrieval_ms"] / 1000)
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

    def __init__(self, config: MemArtConfig, tree, rope: Rope):
        self.config, self.tree, self.rope = config, tree, rope
        self.layer_num = tree.pool.layer_num
        self.layers = max(1, round(self.layer_num * config.score_layers))  # the scoring layers
        tree.sessions.limit(self.name, MAX_SESSIONS, keep=lambda pool: pool.busy())
        self.probes: OrderedDict[str, Probe] = OrderedDict()
        self.running_probes = ProbeCapture(rope)  # the probes being prefilled (rid -> probe) and their capture
        self.placed: dict[str, ReusedKV] = {}  # rid -> KV placed for a repair (keep), until its release
        self.markers: RoleMarkers | None = None
        self.line_ends: frozenset[int] | None = None  # memory.cut lines: from the tokenizer, at the first request
        self._lock = threading.Lock()
        self._worker = Worker("sgl-memory-memart", self._work, lambda m: f"a session memory of {len(m.blocks)} blocks")

    @classmethod
    def build(cls, config: MemArtConfig, tree, ctx) -> MemArtManager:
        if ctx is None:
            raise ValueError("KV memory needs the scheduler's build context (the model's RoPE)")
        manager = cls(config, tree, Rope.from_hf_config(ctx.model_config.hf_config))
        allocator.fix_mmap_threshold()  # blocks and pools come and go: their memory must go back
        logger.info(
            "KV memory: blocks of %d tokens, top_k %d, %s-%s", config.block_size, config.top_k, config.norm, config.agg
        )
        return manager

    def subscriber(self) -> ProbeCapture:
        return self.running_probes

    def placed_kv(self, req) -> ReusedKV | None:
        return self.placed.get(req.rid)

    def drain(self, timeout: float | None = None) -> bool:
        return self._worker.drain(timeout)

    # --- probe capture (a capture.py subscriber) -------------------------------------------------

    def match_limit(self, req) -> int | None:
        # a probe takes what the tree caches of its prompt (the system message: an agent's tool docs)
        # up to its first scoring token; the scoring rows are computed, so the capture sees them
        probe = self.running_probes.probing.get(req.rid)
        return probe.start if probe is not None else None

    def session(self, owner: tuple[str, str], create: bool) -> MemArtPool | None:
        # grouping off: no entry reaches the threshold, so each is a group of its own and never static
        book = lambda: EntryBook(self.config.group_threshold if self.config.groups else ALONE, self.config.static_after)  # noqa: E731
        make = (
            (
                lambda: MemArtPool(
                    self.config.capacity_blocks,
                    self.config.eviction,
                    self.config.block_size,
                    rope=self.rope,
                    score_layers=self.layers,
                    book=book(),
                    norm_ties=self.tree.tp_size == 1,
                )
            )
            if create
            else None
        )
        pool = self.tree.sessions.get(owner, self.name, make)
        if pool is not None:
            pool.line_ends = self.line_ends
        return pool

    def open(self, scheduler, req, spec: MemorySpec) -> None:
        """Before any admission (a session restored from its file makes its pool here too)."""
        tokenizer = getattr(scheduler, "tokenizer", None)
        if self.config.cut == "lines" and self.line_ends is None and tokenizer is not None:
            self.line_ends = line_ends(tokenizer)

    # --- admission -------------------------------------------------------------------------------

    def admit(self, scheduler, req, spec: MemorySpec) -> None:
        if spec.session_id is None or req in TURNS:
            return
        owner = (spec.tenant or "", spec.session_id)
        query: MemArtRequest | None = spec.part(self.name)
        if query is None and spec.readonly:
            return  # nothing to record, nothing to place
        if query is None:
            TURNS.set(req, MemArtTurn(owner, "record"))
        elif query.mode == "probe":
            self._admit_probe(scheduler, req, owner, query.probe, query.placement)
        elif query.mode in ("write", "forget"):
            self._admit_edit(req, owner, query)
        else:
            state = TURNS.set(
                req,
                MemArtTurn(
                    owner,
                    "retrieve",
                    store=query.store and not spec.readonly,
                    recompute=query.recompute or self.config.recompute,
                ),
            )
            # what the client added after the last answer (all of it: two tool results are two
            # messages in some templates), else its last message; not the history it resends
            ids = list(req.origin_input_ids)
            start = after_answer(self._markers(scheduler).messages(ids), len(ids))
            state.turn_start = start if start is not None else self._spans(scheduler, ids).query_start
            state.windowed = query.windowed
            t0 = time.perf_counter()
            self._retrieve(scheduler, req, state, query)
            state.retrieval_ms = (time.perf_counter() - t0) * 1000

    def _markers(self, scheduler) -> RoleMarkers:
        if self.markers is None:
            self.markers = RoleMarkers.from_tokenizer(getattr(scheduler, "tokenizer", None), self.config.roles)
        return self.markers

    def _spans(self, scheduler, ids: list[int]):
        return find_spans(ids, self._markers(scheduler), len(ids))

    def _admit_probe(self, scheduler, req, owner, probe_id: str | None, placement: str | None) -> None:
        ids = list(req.origin_input_ids)
        spans = self._spans(scheduler, ids)
        tokenizer = getattr(scheduler, "tokenizer", None)
        end = probe_end(ids, spans, self.config.score_tokens, self.markers, tokenizer)
        if end < len(ids):
            # nothing past the turn scores the blocks; a longer prefill would only round the
            # queries differently in bf16 (and the same question could retrieve other blocks)
            ids = ids[:end]
            req.origin_input_ids = req.origin_input_ids_unpadded = array("q", ids)
            req.logprob_start_len = min(req.logprob_start_len, end - 1)
        scoring = scoring_positions(ids, spans, self.config.score_tokens, self.markers, tokenizer)
        after_system = (placement or self.config.placement) == "after_system"
        probe = Probe(owner, scoring, self.layers, len(ids), spans.system_end if after_system else 0)
        TURNS.set(req, MemArtTurn(owner, "probe"))
        # Under the request's own key, like any prompt: the probe reuses what the tree caches of it
        # (match_limit) and leaves its prompt there for the session's next probe. A readonly request's
        # probe too: its prompt is not session state, and its release copies the system message.
        req.skip_radix_cache_insert = False
        self.running_probes.probing[req.rid] = probe
        with self._lock:
            self.probes[probe_id] = probe
            while len(self.probes) > MAX_PROBES:
                self.probes.popitem(last=False)

    def _admit_edit(self, req, owner, query) -> None:
        """An entries API pass (memart/writes.py): the book changes now, in request order; a write's
        KV is its prompt, computed alone and recorded at release under its tag."""
        memory = self.session(owner, create=True)
        state = TURNS.set(req, MemArtTurn(owner, query.mode, store=query.mode == "write"))
        with memory.lock:
            if query.mode == "forget":
                for key in query.forget:
                    memory.drop_turns(memory.book.forget(key).stale)
            elif query.entry is not None:
                embedding = None if query.embedding is None else torch.tensor(query.embedding, dtype=torch.float32)
                change = memory.book.write(query.entry, list(req.origin_input_ids), embedding)
                memory.drop_turns(change.stale)
                state.tag = change.tag
            else:
                state.tag = ("joint", query.group, query.version)
        # its own key: an entry's KV is its text's alone and must not be matched by another path
        req.extra_key = namespace(req.extra_key, f"memory-{query.mode}")
        if query.mode == "forget":
            req.skip_radix_cache_insert = True

    def _retrieve(self, scheduler, req, state: MemArtTurn, query) -> None:
        with self._lock:
            probe = self.probes.get(query.probe) if query.probe else None
        memory = self.session(state.owner, create=False)
        if probe is None or probe.owner != state.owner or not probe.rows:
            state.refused = "no query pass for this request"
            return
        state.probe_tokens = probe.prefilled
        if memory is None:
            return  # nothing remembered yet
        memory.ingest(self.config.block_size)  # turns the worker has not added yet
        index = memory.index()
        ids = index.ids
        if not ids:
            return
        q = probe.queries()
        scores = score_blocks(
            q,
            index,
            query.scoring or self.config.scoring,
            query.norm or self.config.norm,
            query.agg or self.config.agg,
            self.config.rr_constant,
            reduce=self.tree.reduce_heads,
        )
        limit = getattr(scheduler, "max_req_input_len", None)
        budgets = [limit - len(req.origin_input_ids)] if limit else []
        placed = query.placed_tokens if query.placed_tokens is not None else self.config.placed_tokens
        budgets += [placed] if placed else []
        ranked = [ids[i] for i in top_blocks(scores, query.top_k or self.config.top_k)]
        blocks = memory.take(
            choose(
                memory,
                ranked,
                query.header or self.config.header,
                min(budgets, default=None),
                query.unit or self.config.unit,
            )
        )
        if blocks:
            self._place(req, state, memory, blocks, probe, query)

    def _place(self, req, state: MemArtTurn, memory: MemArtPool, blocks: list[Block], probe: Probe, query) -> None:
        """[system message] [blocks] [the rest of the prompt], a conversation's own order; or
        [blocks] [prompt] (MemArt's concatenation). Reused as placed (`recompute: none`), the
        blocks are a prefix hit; with a repair or a full recompute they are prefilled as part of
        the request, and only the system message comes from the tree."""
        prompt = list(req.origin_input_ids)
        units = memory.book.unit_turns()  # entries and static groups: placed whole, one segment each
        after_system = (query.placement or self.config.placement) == "after_system"
        system = probe.system_end if after_system and probe.system_kv is not None else 0
        memory_tokens = [t for b in blocks for t in b.tokens]
        tokens = prompt[:system] + memory_tokens
        if state.recompute == "starts" and not system and int(blocks[0].positions[0]) == 0:
            # the first block began its turn's prompt: its first token was computed at position 0,
            # the attention sink that `starts` restores, so the blocks are reused as placed
            state.recompute = "none"
        digest = hashlib.blake2b(array("q", [b.id for b in blocks]).tobytes(), digest_size=12).hexdigest()
        names = [state.owner[1], digest]
        placed = tokens
        if state.recompute != "none":
            # a full recompute of these blocks is the same KV for every request that places them
            # (their tokens in this order); a repair's depends on the request's turn too
            names += [state.recompute] + ([query.probe] if state.recompute in REPAIRS else [])
            placed = tokens[:system]
        extra_key = namespace(req.extra_key, "memory", *names)
        key = self.tree.key(placed, extra_key, req.cache_salt)
        match = self.tree.match(key)
        have = match.device_prefix_len
        if have < len(placed):
            if state.recompute != "none":
                keys, values = probe.system_kv.keys, probe.system_kv.values
            else:
                keys, values = assemble(blocks, self.rope, at=system)
                if system:
                    system_k, system_v = probe.system_kv.keys, probe.system_kv.values
                    keys, values = (
                        torch.cat([system_k.to(keys.dtype), keys], 1),
                        torch.cat([system_v.to(values.dtype), values], 1),
                    )
            if not tree_fill.place(self.tree, key, match, keys[:, have:], values[:, have:]):
                state.refused = "no free KV slots for the memory blocks"
                logger.warning(
                    "memory: no free KV slots for %d memory tokens of session %r; answering without memory",
                    len(placed),
                    state.owner[1],
                )
                return
        if state.recompute in REPAIRS:
            keys, values = assemble(blocks, self.rope, at=system)
            lines = (query.unit or self.config.unit) == "line"  # a placed line is one segment
            self.placed[req.rid] = ReusedKV(
                system, keys, values, memory.segments(blocks, units, lines), state.recompute
            )
        req.origin_input_ids = array("q", tokens + prompt[system:])
        req.origin_input_ids_unpadded = req.origin_input_ids
        # SGLang resolved the client's logprob_start_len against the prompt it sent (it also caps
        # the prefix match there): from the system message on, the prompt now sits after the blocks,
        # so input log-probabilities stay those of the client's own tokens
        if req.logprob_start_len >= system:
            req.logprob_start_len += len(tokens) - system
        req.extra_key = extra_key
        state.memory_start, state.memory_end, state.retrieved_blocks = system, len(tokens), len(blocks)
        if state.turn_start >= system:
            state.turn_start += len(memory_tokens)
        state.retrieved_turns = sorted(set().union(*(b.turns() for b in blocks)))
        state.retrieved_spans = [span for b in blocks for span in b.spans()]
        placed = {units[t] for b in blocks for t in b.turns() if t in units}
        if placed:
            state.units = {
                "retrieved_entries": sum(kind == "entry" for kind, _ in placed),
                "retrieved_static_groups": sum(kind == "joint" for kind, _ in placed),
            }

    # --- recording: the turn's prompt at the end of its prefill, its answer at release -----------

    def _turn_start(self, state: MemArtTurn, memory: MemArtPool, tokens: list[int]) -> int:
        if state.mode == "record":
            # a full-history request: what the session's last one did not hold already
            return tree_fill.common_prefix(memory.path, tokens)
        if state.mode == "write":
            return 0  # the prompt is the entry's text
        # what it added after the last answer (admit): the history it carries was recorded when it
        # was new, and the system message and the placed blocks are not the turn
        return state.turn_start

    def on_checkpoint(self, req, tree):
        """Copy the turn's prompt part off the pool at the end of its prefill, before intent (later
        by order) prunes the row: what pruning drops from the request stays recallable as KV."""
        state: MemArtTurn | None = TURNS.get(req)
        if state is not None and state.mode == "probe":
            probe = self.running_probes.probing.get(req.rid)
            if probe is not None and probe.system_end and req.finished():  # its release: the row holds every position
                slots = tree.row(req)[: probe.system_end].to(torch.int64)
                probe.system_kv = tree_fill.copy_slots(tree, slots)
            return None
        if state is None or not state.store or state.prompt_kv is not None:
            return None
        if req.finished() or not req.output_ids or tree.disable:
            return None  # not the end of the prefill
        prompt = list(req.origin_input_ids)
        start = self._turn_start(state, self.session(state.owner, create=True), prompt)
        # a prefix matched from a pruned path may hold dead positions: the live mask leaves them out
        slots = tree.row(req)[start : len(prompt)].to(torch.int64)
        state.prompt_kv, state.prompt_kv_start = tree_fill.copy_slots(tree, slots), start
        return None

    def on_drop(self, req) -> None:
        self.running_probes.probing.pop(req.rid, None)
        self.placed.pop(req.rid, None)

    def on_release(self, req) -> None:
        self.placed.pop(req.rid, None)
        state: MemArtTurn | None = TURNS.get(req)
        if state is None:
            return
        if state.mode == "probe":
            probe = self.running_probes.probing.pop(req.rid, None)
            if probe is not None:
                probe.prefilled = len(req.origin_input_ids) - req.cached_tokens
            return
        memory = self.session(state.owner, create=True)
        if state.mode in ("write", "forget"):
            if state.store and not self.tree.disable:
                self._record(req, state, memory)
            # added here, not by the worker: the entries API answers with its entries in the pool,
            # and an entry is a line of text, cheap to unrotate
            memory.ingest(self.config.block_size)
            self._bound_pools(memory)
            metrics.attach(req, self._book_metrics(memory, req))
            return
        metrics.attach(req, state.metrics(req, len(memory.blocks), self.layer_num))
        if state.store and not self.tree.disable and self._record(req, state, memory):
            self._worker.submit(memory)

    def _record(self, req, state: MemArtTurn, memory: MemArtPool) -> bool:
        """Submit the turn's KV to the pool (its worker or the caller adds it); False if none."""
        # tokens whose KV exists (the last output token has none), under the request's own key
        path = tree_fill.held_path(self.tree, req)
        prompt = list(req.origin_input_ids)
        if state.prompt_kv is not None:
            # the prompt as it was before pruning, then the answer off the tree (never pruned)
            start, kv, tokens = state.prompt_kv_start, state.prompt_kv, prompt
            if len(path) > len(prompt) and path.tokens[: len(prompt)] == prompt:
                tail = tree_fill.copy_path(self.tree, path, len(prompt))
                tokens = path.tokens
                kv = tree_fill.PathKV(
                    torch.cat([kv.keys, tail.keys], 1),
                    torch.cat([kv.values, tail.values], 1),
                    torch.cat([kv.live, tail.live]),
                )
            state.prompt_kv = None
        else:  # released before its prefill ended (aborted, or a prefill-only write): what the tree holds of it
            start, tokens = self._turn_start(state, memory, path.tokens), path.tokens
            kv = tree_fill.copy_path(self.tree, path, start) if len(path) > start else None
        if state.mode == "record":
            memory.path = tokens
        if kv is None or len(tokens) <= start:
            return False
        if state.mode == "write" and len(tokens) > len(prompt):  # the entry is its text, not an answer
            n = len(prompt) - start
            tokens, kv = tokens[: len(prompt)], tree_fill.PathKV(kv.keys[:, :n], kv.values[:, :n], kv.live[:n])
        live = kv.live
        positions = torch.arange(start, len(tokens))[live]
        kept = [t for t, keep in zip(tokens[start:], live.tolist()) if keep]
        if kept:
            memory.submit(kept, positions, kv.keys[:, live], kv.values[:, live], state.tag)
        return bool(kept)

    def _book_metrics(self, memory: MemArtPool, req) -> dict:
        """An entries pass's answer: the book as it stands, and the groups that just became static,
        with the tokens of their joint KV (the HTTP side sends that pass next, memart/writes.py)."""
        with memory.lock:
            out = memory.book.summary()
            out["due"] = [
                {"group": g.id, "version": g.version, "tokens": memory.book.joint_tokens(g)} for g in memory.book.due()
            ]
        out["prefill_tokens"] = len(req.origin_input_ids) - req.cached_tokens
        return {"memory_book": out}

    # --- the session's pool, kept with the session by persistence ---------------------------------

    def export_session(self, key) -> dict[str, torch.Tensor]:
        memory = self.session(key, create=False)
        if memory is None:
            return {}
        memory.ingest(self.config.block_size)  # turns still queued belong to it
        return memory.export()

    def describe_session(self, slot: MemArtPool) -> dict:
        with slot.lock:
            return {
                "memory_turns": slot.turns,
                "memory_blocks": len(slot.blocks),
                "memory_tokens": slot.tokens,
                "memory_bytes": slot.bytes,
            }

    def import_session(self, key, tensors: dict[str, torch.Tensor]) -> None:
        memory = self.session(key, create=True)
        if not memory.blocks and not memory.turns:
            memory.load(tensors)
            self._bound_pools(memory)

    def _work(self, memory: MemArtPool) -> None:
        memory.ingest(self.config.block_size)
        self._bound_pools(memory)

    def _bound_pools(self, current: MemArtPool) -> None:
        """All pools together within memory.pool_bytes: the least recently used sessions' pools are
        dropped whole; if the session just added to is still over, its own blocks are evicted by policy."""
        pools = self.tree.sessions.slots(self.name)
        total = sum(pool.bytes for _, pool in pools)
        for owner, pool in pools:
            if total <= self.config.pool_bytes:
                break
            if pool is not current and not pool.busy():
                self.tree.sessions.pop(owner, self.name)
                total -= pool.bytes
                logger.info(
                    "memory: pool_bytes %d reached: dropped the memory of session %r", self.config.pool_bytes, owner[1]
                )
        if total > self.config.pool_bytes:
            current.trim(max(0, current.bytes - (total - self.config.pool_bytes)))
        pools = [pool for _, pool in self.tree.sessions.slots(self.name)]
        POOL_BYTES.set(sum(m.bytes for m in pools))
        POOL_BLOCKS.set(sum(len(m.blocks) for m in pools))
        POOL_TOKENS.set(sum(m.tokens for m in pools))


def line_ends(tokenizer) -> frozenset[int]:
    """The token ids whose text ends a line (memory.cut lines)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return frozenset(i for i, text in enumerate(texts) if text.endswith("\n"))
