"""Session KV persistence in one scheduler process: three tiers of a session's KV.

- hot: its token path in the radix tree (SGLang's own reuse);
- warm: its stored form (SessionRecord: token ids + encoded blocks) in host memory, up to
  `warm_bytes`, least recently used dropped first (only once it is on disk);
- cold: its safetensors file (store.py), up to `quota_bytes`.

At release (`capture`, scheduler thread) the KV of the request's path is copied out of the pool:
only the tokens from the first block the stored record does not already hold, so a turn costs a
copy of its own tokens, not of the session. A writer thread encodes the copy into blocks (warm)
and writes the file, off the request's path. At admission (`admit`, scheduler thread, before the
request is queued) the prompt is matched against the session's path as text (textmatch.py); when
the tree lacks part of what the prompt reuses, slots are reserved for that part, it is dequantized
into them on a thread of its own while the request waits in the queue (unpack.py), and at a later
scheduler step the path is inserted into the tree, so the scheduler's own prefix match finds it
and prefills only the rest.

Each session has two locks: `lock` guards its in-memory state (capture, encode, restore),
`io` serialises its file writes and loads; different sessions proceed in parallel.

Servers may share the store (replicas behind a router; one taking over a killed one's sessions).
Each server remembers the generation of a session's file it last read or wrote (store.py). A turn of
a session whose file has moved on since (another server served and stored it) first forgets what
this server holds of the session, every mechanism's state included, and loads the file: the
session continues from its newest stored turn wherever it lands. A write that finds the file moved
on (two servers serving one session at once) is refused and counted, never stored over the other.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import threading
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sgl_memory.core import mechanism, metrics, prometheus, tree_fill
from sgl_memory.core.request import MemorySpec
from sgl_memory.core.sessions import digest63, session_key
from sgl_memory.core.slots import Slot
from sgl_memory.persist import textmatch
from sgl_memory.persist.settings import AgentHints, PersistConfig
from sgl_memory.persist.settings import parse_request as parse_agent_hints
from sgl_memory.persist.store import ANY_NAMESPACE, CacheSpec, SessionFiles, SessionRecord, StoreError, WriteConflict
from sgl_memory.persist.unpack import Unpacker
from sgl_memory.core.worker import Worker

logger = logging.getLogger(__name__)

MAX_SESSIONS = 4096  # sessions whose token path is kept in memory; the rest are re-read from disk


@dataclass
class Captured:
    """One turn's path as copied off the pool at release: its KV from `start` (a block boundary)."""

    tokens: list[int]
    start: int
    keys: torch.Tensor
    values: torch.Tensor
    live: torch.Tensor | None  # of the whole path; None: every position is live
    branches: tuple[tuple[int, int], ...]
    extra_key: str | None


@dataclass
class Session:
    tenant: str | None
    session_id: str
    tokens: list[int] = field(default_factory=list)  # newest known path (record + pending)
    text: str | None = None  # decode(tokens), computed when first needed
    live: torch.Tensor | None = None  # of `tokens`, as the record's
    branches: tuple[tuple[int, int], ...] = ()
    extra_key: str | None = ANY_NAMESPACE
    record: SessionRecord | None = None  # the warm tier; lags `tokens` while `pending` is not empty
    pending: list[Captured] = field(default_factory=list)
    state_changed: bool = False  # another mechanism's state of the session changed since the last write
    on_disk: bool = False
    generation: int = 0  # of the session's file as this server last read or wrote it (store.py)
    stored_bytes: int = 0  # of its file, as this server last wrote or read it (0: none on disk)
    error: str | None = None  # the last write's failure, reported at the session's next turn
    # when its next turn is expected (eviction by next use): its last turn's end (time.monotonic),
    # the gaps its turns came back after (a moving average), and the last turn's hints
    finished_at: float | None = None
    gap: float | None = None
    expected_at: float | None = None
    keep_until: float | None = None
    done: bool = False
    prefetched: int = 0  # tokens brought back before its next turn arrived (prefetch), reported by that turn
    lock: threading.Lock = field(default_factory=threading.Lock)
    io: threading.Lock = field(default_factory=threading.Lock)

    def adopt(self, record: SessionRecord) -> None:
        self.tokens, self.text, self.record = record.token_ids, record.text, record
        self.live, self.branches, self.extra_key = record.live, record.branches, record.extra_key
        self.generation = record.generation

    def key(self):
        return session_key(self.tenant, self.session_id)


@dataclass
class PersistTurn:
    """What persistence did for one request, kept in its `TURNS` slot."""

    tenant: str | None
    session_id: str
    text_match: str | None = None
    restored_tokens: int = 0
    step_ms: float = 0.0  # the scheduler thread's time on the restore (every request waited for it)
    off_step_ms: float = 0.0  # the unpack thread's (dequantizing and the pool write, at TP 1)
    # where the restore's time went: the file (read and checked), the text match, dequantizing, the pool write
    parts_ms: dict[str, float] = field(default_factory=dict)
    restored_from: str | None = None
    refused: str | None = None
    reuse: int = 0  # stored tokens the (possibly rewritten) prompt repeats
    loaded: bool = False  # this request loaded the session from its file
    assembled: bool = (
        False  # a prompt assembled by a mechanism (MemorySpec.assembled): its path is not the session's history
    )
    reads_only: bool = False  # a pass that changes nothing (MemorySpec.reads_only): loads, never writes
    hints: AgentHints | None = None  # sgl_memory.agent: when the session's next turn comes
    prefetched_tokens: int = 0  # of the session's KV brought back before this turn arrived

    def metrics(self, error: str | None) -> dict:
        return {
            "text_match": self.text_match,
            "restored_tokens": self.restored_tokens,
            "restore_ms": round(self.step_ms + self.off_step_ms, 3) if self.restored_tokens else 0.0,
            "restore_step_ms": round(self.step_ms, 3) if self.restored_tokens else 0.0,
            "restored_from": self.restored_from,
            "prefetched_tokens": self.prefetched_tokens,
            "restore_parts_ms": {k: round(v, 3) for k, v in self.parts_ms.items()} if self.restored_tokens else None,
            "persist_refused": self.refused,
            "persist_error": error,
        }


TURNS: Slot[PersistTurn] = Slot("persist turn")  # per request
# why a turn loaded or restored nothing at TP > 1: the ranks' files (or the paths they matched) differ
RANKS_DIFFER = "the tensor-parallel ranks' copies of the session differ"


@dataclass
class Restore:
    """A restore decided, not done: the request's first `reuse` tokens, of which the tree holds
    what `match` found; the rest is decoded from `record` when it is placed."""

    req: object
    key: object
    match: object
    reuse: int
    record: SessionRecord | None  # None: the tree holds all of it (hot), nothing to decode
    live: torch.Tensor | None  # of the first `reuse` positions
    branches: tuple[tuple[int, int], ...]
    source: str

    @property
    def missing(self) -> int:
        return max(0, self.reuse - self.match.device_prefix_len)

    def cut(self, tree, reuse: int) -> Restore:
        """The same restore of the first `reuse` tokens only."""
        branches = tuple(b for b in self.branches if b[0] < reuse)
        key = tree.key(self.req.origin_input_ids[:reuse], self.req.extra_key, self.req.cache_salt, branches)
        live = None if self.live is None else self.live[:reuse]
        return Restore(self.req, key, self.match, reuse, self.record, live, branches, self.source)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLE_BYTES = 1 << 16  # read at three offsets of every weight file


def weights_digest(model_path) -> str:
    """What tells two checkpoints of one architecture apart (a fine-tune keeps the config): every
    weight file's name and size, and 64 KiB of its bytes at its start, middle and end. Cheap at
    start-up (a few hundred KiB read), and any re-training changes the sampled bytes. Empty for a
    model path that is not a local folder."""
    folder = Path(str(model_path)).expanduser()
    files = (
        sorted(p for p in folder.glob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
        if folder.is_dir()
        else []
    )
    h = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\x00{size}\x00".encode())
        with open(path, "rb") as f:
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest() if files else ""


def cache_spec(model_config, server_args, tree, tp_rank: int, tp_size: int) -> CacheSpec:
    """What a file must match to be loaded here: the model (name, and a hash of its config and its
    weights) and the layout of this rank's KV pool."""
    config = {
        k: v
        for k, v in model_config.hf_config.to_dict().items()
        if not k.startswith("_") and k != "transformers_version"
    }
    config["sgl_memory_weights"] = weights_digest(server_args.model_path)
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:32]
    name = server_args.served_model_name or server_args.model_path
    buffer = tree.pool.get_key_buffer(tree.layers()[0])
    return CacheSpec(
        str(name).rstrip("/").rsplit("/", 1)[-1],
        config_hash,
        tree.pool.layer_num,
        buffer.shape[-2],
        buffer.shape[-1],
        str(buffer.dtype).removeprefix("torch."),
        tree.page_size,
        f"tp{tp_rank}/{tp_size}",
    )


RESTORES = prometheus.counter("restores", "Session KV restored into the tree", ["source"])
RESTORED_TOKENS = prometheus.counter("restored_tokens", "Tokens restored from the session store")
RESTORE_SECONDS = prometheus.histogram("restore_seconds", "Session restore time")
WRITE_ERRORS = prometheus.counter("write_errors", "Session file writes that failed")
WRITE_CONFLICTS = prometheus.counter(
    "write_conflicts", "Session turns not stored: another server stored the session meanwhile"
)
PREFETCHED_TOKENS = prometheus.counter(
    "prefetched_tokens", "Session KV tokens brought back before their turn arrived (agent hints)"
)
DEFERRED = prometheus.counter(
    "restores_deferred", "Session restores deferred at admission: the held KV of waiting requests was at its bound"
)
NEXT_USE_ERROR = prometheus.histogram(
    "next_use_error_seconds", "How far a session's turn came from when it was expected (hints or learned gaps)"
)
SUPERSEDED = prometheus.counter(
    "sessions_superseded", "Sessions reloaded from their file: another server stored them since"
)
STORE_BYTES = prometheus.gauge("store_bytes", "Session files on disk")
WARM_BYTES = prometheus.gauge("store_warm_bytes", "Stored-form session KV in host memory")


@mechanism.register("persist")
class SessionPersistence(mechanism.Mechanism):
    # after memory and keep, before intent: its text-level match may replace a full-history
    # prompt's ids with the stored session's, and it restores their KV; intent then finds its
    # spans in the final tokens. At release it writes the session after memory queued its turn.
    order = 30
    settings = PersistConfig
    fields = ("agent",)
    parse_request = staticmethod(parse_agent_hints)
    follows_internal = True  # an entry write or forget changes the session: its file keeps that
    # at TP > 1 each rank writes its own file; the ranks load and restore a session together or
    # not at all (rank_range in open, _load, _agree; tests/test_tp_server.py)
    schema = mechanism.MetricsSchema(
        marker="text_match",
        summed=("restored_tokens", "restore_ms", "restore_step_ms", "prefetched_tokens"),
        counted=("text_match",),
        flagged=("persist_error", "persist_refused"),
    )

    @classmethod
    def observe(cls, metrics: dict, meta_info: dict) -> None:
        if metrics.get("restored_tokens"):
            RESTORES.labels(metrics.get("restored_from") or "unknown").inc()
            RESTORED_TOKENS.inc(metrics["restored_tokens"])
            RESTORE_SECONDS.observe(metrics["restore_ms"] / 1000)
        if metrics.get("persist_refused"):
            prometheus.REFUSALS.labels(
                cls.name, "ranks" if metrics["persist_refused"] == RANKS_DIFFER else "file"
            ).inc()

    def __init__(self, config: PersistConfig, tree, spec: CacheSpec):
        self.config, self.tree, self.spec = config, tree, spec
        self.files = SessionFiles(config.store_dir(), spec, quant=config.quant, kivi=config.kivi)
        # a session stays in memory while it holds turns that are nowhere else (not yet written, or
        # a write failed); the rest are re-read from disk when they come back
        tree.sessions.limit(
            self.name,
            MAX_SESSIONS,
            keep=lambda s: bool(s.pending) or s.state_changed or (bool(s.tokens) and not s.on_disk),
        )
        self.tokenizer = None
        self._gap: float | None = None  # the gaps every session's turns came back after (a moving average)
        # requests whose restore waits for room among the holds (before_prefill), in arrival order,
        # with where their session's KV was at admission (memory, or read from disk)
        self._deferred: dict[object, str] = {}
        # sessions a hint says come back at a time: their KV is brought back just before (_prefetch)
        self._expected_back: dict[tuple, Session] = {}
        self._writer = Worker(
            "sgl-memory-persist", self._write, lambda s: f"session {s.session_id!r} (tenant {s.tenant!r})"
        )
        # a request's restore is unpacked off the scheduler's step; at TP > 1 every rank must land a
        # restore at the same step, so there it is unpacked in the step that places it
        self._unpacker = Unpacker() if tree.tp_size == 1 else None
        if self.files.removed_partial:
            logger.info("session store: removed %d partial file(s) of writers that died", self.files.removed_partial)
        self._probe()

    @classmethod
    def build(cls, config: PersistConfig, tree, ctx) -> SessionPersistence:
        if ctx is None:
            raise ValueError("session persistence needs the scheduler's build context (model and pool layout)")
        spec = cache_spec(ctx.model_config, ctx.server_args, tree, ctx.tp_rank, ctx.tp_size)
        logger.info("session store: %s (%s, quant %s)", config.store_dir(), spec.model_id, config.quant)
        return cls(config, tree, spec)

    def _probe(self) -> None:
        try:
            self.files.root.mkdir(parents=True, exist_ok=True)
            probe = self.files.root / ".write-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            logger.error(
                "session store %s is not writable (%s): sessions are kept in memory only and every "
                "write is retried and reported; the server keeps serving",
                self.files.root,
                exc,
            )

    def _session(self, tenant: str | None, session_id: str, create: bool) -> Session | None:
        make = (lambda: Session(tenant, session_id)) if create else None
        return self.tree.sessions.get(session_key(tenant, session_id), self.name, make)

    def _decode_text(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    # --- admission: text match and restore ------------------------------------------------------

    def open(self, scheduler, req, spec: MemorySpec) -> None:
        """Load a session this server has not seen (or dropped) from its file, before any mechanism
        admits the request: the other mechanisms' state in the file goes back to them."""
        if req in TURNS or req.finished() or spec.session_id is None or self.tree.disable:
            return
        if self.tokenizer is None:
            self.tokenizer = scheduler.tokenizer
        state = TURNS.set(
            req,
            PersistTurn(
                spec.tenant,
                spec.session_id,
                assembled=spec.assembled,
                reads_only=spec.reads_only,
                hints=spec.part(self.name),
            ),
        )
        t0 = time.perf_counter()
        session = self._session(spec.tenant, spec.session_id, create=False)
        if session is not None and not spec.reads_only:
            state.prefetched_tokens, session.prefetched = session.prefetched, 0
            self._came_back(session)
        # each tensor-parallel rank reads its own file: every rank reloads where one must, or none
        _, (superseded, missing) = self.tree.rank_range(
            [session is not None and self._superseded(session), session is None]
        )
        if session is not None and (superseded or missing):
            if superseded:
                logger.info(
                    "session store: session %r (tenant %r) was stored by another server since this one last "
                    "did: reloading it",
                    spec.session_id,
                    spec.tenant,
                )
                SUPERSEDED.inc()
            self.tree.sessions.drop(session.key())  # every mechanism's state of it is older than the file
            session = None
        if session is None:
            state.loaded = self._load(state) is not None
        state.step_ms = state.parts_ms["file"] = (time.perf_counter() - t0) * 1000

    # --- eviction by next use --------------------------------------------------------------------

    GAP_WEIGHT = 0.5  # of the newest gap in a session's moving average (the server's: the same)

    def _came_back(self, session: Session) -> None:
        """A turn of the session arrived: learn the gap it came back after."""
        if session.finished_at is None:
            return
        now = time.monotonic()
        predicted = None if session.done else self._expected(session)
        if predicted is not None:
            NEXT_USE_ERROR.observe(abs(now - predicted))
        gap = now - session.finished_at
        session.gap = gap if session.gap is None else self.GAP_WEIGHT * gap + (1 - self.GAP_WEIGHT) * session.gap
        self._gap = gap if self._gap is None else self.GAP_WEIGHT * gap + (1 - self.GAP_WEIGHT) * self._gap
        session.finished_at = session.expected_at = session.keep_until = None
        self._expected_back.pop(session.key(), None)

    def _finished(self, session: Session, hints: AgentHints | None) -> None:
        """A turn of the session ended: its hints say when the next comes (or that none does)."""
        now = time.monotonic()
        session.finished_at, session.expected_at, session.keep_until, session.done = now, None, None, False
        if hints is not None:
            if hints.expected_tool_duration_ms is not None:
                session.expected_at = now + hints.expected_tool_duration_ms / 1000
                if self.config.prefetch_ms > 0 and self.tree.tp_size == 1:
                    self._expected_back[session.key()] = session
            if hints.cache_ttl_ms is not None:
                session.keep_until = now + min(hints.cache_ttl_ms, self.config.max_keep_ms) / 1000
            session.done = bool(hints.done)

    def _expected(self, session: Session) -> float | None:
        """When the idle session's next turn is expected (time.monotonic): its last turn's hint,
        else, with `eviction: learned`, that turn's end plus the gaps its turns came back after
        (this session's, else the server's); None when nothing says."""
        if session.expected_at is not None:
            return session.expected_at
        if self.config.eviction != "learned":
            return None
        gap = session.gap if session.gap is not None else self._gap
        return session.finished_at + gap if gap is not None and session.finished_at is not None else None

    def _next_use(self, session: Session, now: float) -> float:
        """The eviction order's next use (NextUseStrategy): now while a turn of it runs or a keep-for
        lasts; inf for a session that is done; when it is expected, and a session expected back
        already and not back yet as that much later; without any expectation, as far ahead as its
        last use is behind (LRU)."""
        if session.finished_at is None or (session.keep_until is not None and now < session.keep_until):
            return now
        if session.done:
            return math.inf
        when = self._expected(session)
        if when is None:
            return 2 * now - session.finished_at
        return when if when >= now else 2 * now - when

    def _expect(self, node, session: Session) -> None:
        """The tree orders the session's path ending at `node` by its next use (unless `last_use`)."""
        if self.config.eviction != "last_use":
            self.tree.expect(node, lambda now: self._next_use(session, now))

    def _decode(self, record: SessionRecord, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the record's positions [start, end) in the pool's dtype."""
        return self.files.decode(record, start, end, dtype=self.tree.pool.get_key_buffer(self.tree.layers()[0]).dtype)

    def _superseded(self, session: Session) -> bool:
        """Whether the session's file holds a generation this server neither read nor wrote."""
        with session.lock:
            if session.pending or session.state_changed or not session.io.acquire(blocking=False):
                return False  # a turn of its own is being stored: that write checks the file instead
            try:
                current = self.files.generation(session.tenant, session.session_id)
            finally:
                session.io.release()
            return current > 0 and current != session.generation  # 0: no file (never written, or removed for the quota)

    def admit(self, scheduler, req, spec: MemorySpec) -> None:
        state: PersistTurn | None = TURNS.get(req)
        if state is None or req.finished() or state.assembled:
            return  # an assembled prompt (recalled blocks before a new turn) is rebuilt by its mechanism
        t0 = time.perf_counter()
        session = self._session(spec.tenant, spec.session_id, create=False)
        prompt, plan = (req.origin_input_ids, req.origin_input_ids_unpadded), None
        if session is not None and session.tokens:  # else a new session
            if session.extra_key not in (ANY_NAMESPACE, req.extra_key):
                # stored under another namespace (another KV-memory assembly, another client key):
                # its KV was computed in another context and must not be found from this one
                state.text_match = textmatch.DISCARD
            else:
                self._match_text(scheduler, req, session, state)
                state.parts_ms["match"] = (time.perf_counter() - t0) * 1000
                if state.text_match != textmatch.DISCARD:
                    plan = self._plan(req, session, state, "disk" if state.loaded else "memory")
        plan = self._agree(req, prompt, plan, state)
        if plan is not None and not self._bring_back(plan, state):
            # restored before a later prefill batch: unpacked by then, or when the holds and the pool have room
            self._deferred[req] = plan.source
            if self._unpacker is None or not self._unpacker.running(req):
                DEFERRED.inc()
        state.step_ms += (time.perf_counter() - t0) * 1000

    def _load(self, state: PersistTurn) -> Session | None:
        """A session seen by an earlier server (or dropped from memory): its file, checked."""
        session = self._session(state.tenant, state.session_id, create=True)
        with session.lock, session.io:
            if session.tokens:  # another request of the session got here first
                return session
            record = self._read(state)
            if not self._every_rank_read_it(record, state):
                if record is not None:
                    session.generation = record.generation  # the next write replaces this file, not conflicts with it
                return None
            if record is None:
                return None
            session.adopt(record)
            session.on_disk, session.stored_bytes = True, self.files.size(state.tenant, state.session_id)
        self.tree.import_session(session.key(), record.state)
        record.state = {}  # the mechanisms hold it now; the warm tier keeps the path only
        return session

    def _every_rank_read_it(self, record: SessionRecord | None, state: PersistTurn) -> bool:
        """Whether every tensor-parallel rank read the same stored history (each its own file of
        it). A rank whose file lags (its write failed, or has not landed) or failed its checks
        makes every rank load none: ranks that held different paths or states would compute
        different batches."""
        low, high = self.tree.rank_range([record.history_digest() if record is not None else 0])
        if low == high:
            return True
        logger.error(
            "session store: the tensor-parallel ranks' files of session %r (tenant %r) hold different "
            "turns; loading none, the turn is served by normal prefill",
            state.session_id,
            state.tenant,
        )
        state.refused = RANKS_DIFFER
        return False

    def _read(self, state: PersistTurn) -> SessionRecord | None:
        """The session's file, checked; a file that fails a check is refused (logged, reported)."""
        try:
            return self.files.read(state.tenant, state.session_id)
        except StoreError as exc:
            logger.error(
                "session store: refused the file of session %r (tenant %r): %s; the turn is served by normal prefill",
                state.session_id,
                state.tenant,
                exc,
            )
            state.refused = str(exc)
            return None

    def _match_text(self, scheduler, req, session: Session, state: PersistTurn) -> None:
        if self.tokenizer is None:
            return  # --skip-tokenizer-init: token-level reuse only
        stored = session.tokens
        if session.text is None:
            session.text = self._decode_text(stored)
        prompt = list(req.origin_input_ids)
        result = textmatch.match(
            stored,
            session.text,
            prompt,
            self._decode_text(prompt),
            self._decode_text,
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            self.config.match_threshold,
        )
        state.text_match = result.outcome
        limit = getattr(scheduler, "max_req_input_len", None)
        if result.input_ids != prompt and not req.return_logprob and (limit is None or len(result.input_ids) <= limit):
            req.origin_input_ids = array("q", result.input_ids)
            req.origin_input_ids_unpadded = req.origin_input_ids
        ids = list(req.origin_input_ids)
        state.reuse = (
            result.reuse if ids[: result.reuse] == stored[: result.reuse] else tree_fill.common_prefix(stored, ids)
        )

    def _plan(self, req, session: Session, state: PersistTurn, source: str) -> Restore | None:
        """What of the session's path the request reuses, and where its KV is: the tree (hot) or the
        session's record (warm, or read from its file now); None when the stored path does not
        match."""
        tree = self.tree
        reuse = state.reuse - state.reuse % tree.page_size
        if reuse <= 0:
            return None
        with session.lock:
            stored, live = session.branches, session.live
        branches = stored
        key = tree.key(req.origin_input_ids[:reuse], req.extra_key, req.cache_salt, branches)
        match = tree.match(key)  # (re)takes the sentinel of a pruning tree
        if tree.sentinel is None and (branches or live is not None):
            # a pruned path past its first branch is only found by a pruning request, which this
            # server does not serve; before it the path is a plain one
            dead = torch.nonzero(~live).flatten() if live is not None else torch.zeros(0)
            reuse = min([reuse] + [pos for pos, _ in branches[:1]] + [int(d) for d in dead[:1]])
            branches, live = (), None
            key = tree.key(req.origin_input_ids[:reuse], req.extra_key, req.cache_salt)
            match = tree.match(key)
        if match.device_prefix_len >= reuse:
            return Restore(req, key, match, reuse, None, live, branches, source)  # hot: the tree holds it
        with session.lock:
            self._encode_pending(session)
            record = session.record
            if record is None:
                t0 = time.perf_counter()
                with session.io:
                    record = session.record = self._read(state)
                state.parts_ms["file"] = state.parts_ms.get("file", 0.0) + (time.perf_counter() - t0) * 1000
                source = "disk"
            if (
                record is None
                or record.token_ids[:reuse] != list(req.origin_input_ids[:reuse])
                or record.branches != stored
            ):
                return None
        return Restore(req, key, match, reuse, record, None if live is None else live[:reuse], branches, source)

    def _agree(self, req, prompt, plan: Restore | None, state: PersistTurn) -> Restore | None:
        """The restore every tensor-parallel rank does (each decided from its own copy of the
        session): of the same prompt (a text match that rewrote it on some ranks only is undone),
        as many tokens as the rank that can restore the fewest. `plan` itself without tensor
        parallelism."""
        (ids, reuse), (ids_high, _) = self.tree.rank_range(
            [digest63(array("q", req.origin_input_ids).tobytes()), plan.reuse if plan else 0]
        )
        if ids != ids_high:
            logger.error(
                "session store: the tensor-parallel ranks matched the prompt to different stored paths; "
                "restoring none, the turn is served by normal prefill"
            )
            req.origin_input_ids, req.origin_input_ids_unpadded = prompt
            state.refused = RANKS_DIFFER
            return None
        if plan is None or reuse <= 0:
            return None
        return plan.cut(self.tree, reuse) if reuse < plan.reuse else plan

    def _bring_back(self, plan: Restore, state: PersistTurn, final: bool = False) -> bool:
        """Hold the request's reused prefix in the tree until it runs, restoring first what the tree
        lacks of it. False, with nothing held, when the holds have no room for it (`_room_to_hold`),
        the pool has no free slots for it while requests run or are held that will free some, or
        its restore was started on the unpack thread (it lands at a later step, `_land`): the
        request then waits in the queue (before_prefill). `final`: nothing runs or is held that
        would free slots, so a request the pool has no room for is served by prefill instead."""
        tree = self.tree
        if not self._room_to_hold(plan.reuse):
            return False
        if not plan.missing:
            tree.hold(plan.req, plan.match.last_device_node, plan.reuse)
            return True
        if not final and tree.room() < plan.missing:
            return False  # checked before reserving: a request that waits for slots evicts nothing
        have = plan.match.device_prefix_len
        reserved = tree_fill.reserve(tree, plan.key, plan.match, None if plan.live is None else plan.live[have:])
        if reserved is None:
            if not final:
                return False  # the requests that run (or are held) will give their slots back
            logger.warning(
                "session store: no free KV slots to restore %d tokens of session %r, and no request runs "
                "or is held that would free some; prefilling instead",
                plan.missing,
                state.session_id,
            )
            return True
        # a record is never changed in place (a turn makes a new one): it is read without the session's lock
        unpack = functools.partial(self._unpack, plan.record, have, plan.reuse, reserved)
        if self._unpacker is not None and not final:
            self._unpacker.start(plan.req, plan.reuse, (plan, reserved), unpack)
            return False
        try:
            state.parts_ms.update(unpack())
        except BaseException:
            tree_fill.release(tree, reserved)
            raise
        self._landed(plan, reserved, state)
        return True

    def _unpack(self, record: SessionRecord, start: int, stop: int, reserved: tree_fill.Reserved) -> dict[str, float]:
        """Dequantize the record's positions [start, stop) into the reserved slots; the time of each part."""
        t0 = time.perf_counter()
        keys, values = self._decode(record, start, stop)
        t1 = time.perf_counter()
        tree_fill.write(self.tree, reserved, keys, values)
        return {"dequantize": (t1 - t0) * 1000, "pool_write": (time.perf_counter() - t1) * 1000}

    def _landed(self, plan: Restore, reserved: tree_fill.Reserved, state: PersistTurn) -> None:
        """The restored path goes into the tree, held for its request."""
        tree_fill.insert(self.tree, reserved)
        self.tree.hold(plan.req, self.tree.match(plan.key).last_device_node, plan.reuse)
        state.restored_tokens, state.restored_from = plan.missing, plan.source

    def _land(self) -> None:
        """Insert the restores the unpack thread finished into the tree, each held for its request,
        whatever their requests' places in the queue: a finished restore's slots are the pool's
        again only through the tree. A restore that failed gives its slots back; its request is
        served by prefill."""
        for job in self._unpacker.finished():
            plan, reserved = job.context
            state = TURNS.get(job.owner)
            self._deferred.pop(job.owner, None)
            try:
                parts = job.future.result()
            except Exception:
                logger.exception(
                    "session store: restoring session %r failed; prefilling instead",
                    state.session_id if state is not None else None,
                )
                tree_fill.release(self.tree, reserved)
                continue
            t0 = time.perf_counter()
            self._landed(plan, reserved, state)
            state.parts_ms.update(parts)
            state.off_step_ms += sum(parts.values())
            state.step_ms += (time.perf_counter() - t0) * 1000

    def _room_to_hold(self, tokens: int) -> bool:
        """Whether the holds take `tokens` more: within `hold_fraction` of the pool, or nothing is
        held (the first request waiting is never turned away). A restore being unpacked counts as
        held: it is, as soon as it lands."""
        held = self.tree.held_tokens() + (self._unpacker.tokens() if self._unpacker is not None else 0)
        return not held or held + tokens <= self.config.hold_fraction * self.tree.pool_tokens

    def before_prefill(self, scheduler, waiting: list, running: bool) -> list:
        """Land the restores unpacked since the last step; restore the deferred requests' KV, in
        the order they came, while the holds have room; the rest, and those being unpacked, wait
        out of this batch (so the scheduler does not prefill their histories). Then bring back the
        sessions expected back about now (prefetch)."""
        if self._unpacker is not None:
            self._land()
        if self._expected_back:
            self._prefetch()
        if not self._deferred:
            return []
        queued, back = set(waiting), []
        for req in list(self._deferred):
            state = TURNS.get(req)
            if req not in queued or req.finished() or state is None:
                self._forget(req)  # aborted, or it left the queue another way
                continue
            if self._unpacker is not None and self._unpacker.running(req):
                back.append(req)
                continue
            if back or not self._room_to_hold(state.reuse):  # checked before any file is read
                back.append(req)  # in arrival order: none is restored past one still waiting
                continue
            t0 = time.perf_counter()
            session = self._session(state.tenant, state.session_id, create=False)
            ids = (req.origin_input_ids, req.origin_input_ids_unpadded)
            plan = self._plan(req, session, state, self._deferred[req]) if session is not None else None
            plan = self._agree(req, ids, plan, state)
            final = not running and not self.tree.held_tokens()
            if plan is not None and not self._bring_back(plan, state, final):
                back.append(req)  # no free slots yet
                continue
            self._deferred.pop(req)
            state.step_ms += (time.perf_counter() - t0) * 1000
        return back

    def _prefetch(self) -> None:
        """Bring back the KV of each session whose hint says it returns within `prefetch_ms`, once,
        if the tree lacks it and the pool has room; it is then ordered for eviction by its expected
        return, which is about now. Its next turn then finds it in the tree (`prefetched_tokens`).
        Off at TP > 1: the ranks' clocks would not decide it at the same step."""
        now = time.monotonic()
        for key, session in list(self._expected_back.items()):
            if session.expected_at is None or session.finished_at is None:
                self._expected_back.pop(key)
            elif session.expected_at - self.config.prefetch_ms / 1000 <= now:
                self._expected_back.pop(key)
                session.prefetched = self._bring_back_idle(session)
                PREFETCHED_TOKENS.inc(session.prefetched)

    def _bring_back_idle(self, session: Session) -> int:
        """Restore an idle session's stored path into the tree (whole pages); the tokens restored."""
        tree = self.tree
        with session.lock:
            tokens, live, branches, extra_key = session.tokens, session.live, session.branches, session.extra_key
        n = len(tokens) - len(tokens) % tree.page_size
        if not n or extra_key == ANY_NAMESPACE or (tree.sentinel is None and (branches or live is not None)):
            return 0  # no path, or one only a pruning server restores: left to its turn's admission
        key = tree.key(tokens[:n], extra_key, None, branches)
        match = tree.match(key)
        have = match.device_prefix_len
        if have >= n or tree.room() < n - have:
            return 0
        with session.lock:
            record = session.record
        if record is None:
            try:
                with session.io:
                    record = self.files.read(session.tenant, session.session_id)
            except StoreError:
                return 0  # the turn's admission reads it again, and refuses it with the reason
        if record.token_ids[:n] != list(tokens[:n]) or record.branches != branches:
            return 0
        keys, values = self._decode(record, have, n)
        if not tree_fill.place(tree, key, match, keys, values, None if live is None else live[have:n]):
            return 0
        self._expect(tree.match(key).last_device_node, session)
        return n - have

    # --- release: capture the turn, write it off the request's path ------------------------------

    def on_drop(self, req) -> None:
        self._forget(req)

    def _forget(self, req) -> None:
        """The request left the queue: a restore being unpacked for it ends and gives its slots back."""
        self._deferred.pop(req, None)
        job = self._unpacker.abandon(req) if self._unpacker is not None else None
        if job is not None:
            tree_fill.release(self.tree, job.context[1])

    def on_release(self, req) -> None:
        """Capture the turn: the KV of the request's path that the stored record lacks, off the pool
        now (the slots are the tree's to evict), encoded and written by the worker."""
        state: PersistTurn | None = TURNS.get(req)
        if state is None:
            return
        self._forget(req)
        session = self._session(state.tenant, state.session_id, create=True)
        metrics.attach(req, state.metrics(session.error))
        if not state.reads_only:
            self._finished(session, state.hints)
        if self.config.write_policy == "off" or self.tree.disable or state.reads_only:
            return
        if state.assembled:
            # its path is assembled (recalled blocks before a new turn), not the session's history:
            # the stored path stays, and what the turn changed in the other mechanisms is written
            with session.lock:
                session.state_changed = True
            self._writer.submit(session)
            return
        path = tree_fill.held_path(self.tree, req)
        if not len(path):
            return
        self._expect(path.node, session)
        live = tree_fill.path_live(self.tree, path)
        live = None if bool(live.all()) else live
        with session.lock:
            same = self._same_prefix(session, path, live, req.extra_key)
            if same == len(path) == len(session.tokens):
                return
            start = same // self.files.block_size * self.files.block_size
            kv = tree_fill.copy_path(self.tree, path, start)
            session.pending.append(Captured(path.tokens, start, kv.keys, kv.values, live, path.branches, req.extra_key))
            session.tokens, session.text, session.live, session.branches, session.extra_key = (
                path.tokens,
                None,
                live,
                path.branches,
                req.extra_key,
            )
        self._writer.submit(session)

    def _same_prefix(self, session: Session, path: tree_fill.HeldPath, live, extra_key) -> int:
        """How many leading positions of the stored path the new one holds with the same KV (same
        namespace, tokens, branches and live mask), so only the rest is copied and encoded again."""
        if (session.record is None and not session.pending) or session.extra_key != extra_key:
            return 0
        if session.record is not None and (session.record.quant, session.record.kivi) != (
            self.config.quant,
            self.config.kivi,
        ):
            return 0  # written with other settings: re-encode all of it
        same = tree_fill.common_prefix(session.tokens, path.tokens)
        differ = set(session.branches) ^ set(path.branches)  # the keys part at the first branch not shared
        if differ:
            same = min(same, min(pos for pos, _ in differ))
        if session.live is not None or live is not None:
            old = session.live[:same] if session.live is not None else torch.ones(same, dtype=torch.bool)
            new = live[:same] if live is not None else torch.ones(same, dtype=torch.bool)
            differ = torch.nonzero(old != new).flatten()
            same = int(differ[0]) if differ.numel() else same
        return same

    def _encode_pending(self, session: Session) -> None:
        """Fold the captured turns into the stored form; caller holds session.lock."""
        for c in session.pending:
            session.record = self.files.continued(
                session.record,
                c.tokens,
                c.start,
                c.keys,
                c.values,
                extra_key=c.extra_key,
                branches=c.branches,
                live=c.live,
            )
        session.pending.clear()

    def _write(self, session: Session) -> None:
        with session.lock:
            if not session.pending and not session.state_changed:
                return  # an earlier queue entry of this session wrote it already
            session.state_changed = False
            self._encode_pending(session)
            if session.record is None and session.tokens:  # the warm tier dropped the path: it is on disk
                with session.io:
                    try:
                        session.record = self.files.read(session.tenant, session.session_id)
                    except StoreError as exc:
                        logger.error(
                            "session store: cannot re-read session %r (tenant %r) to write its state: %s",
                            session.session_id,
                            session.tenant,
                            exc,
                        )
                        return
            if session.record is None:  # a session of memory-mode turns only: its state, no path
                session.record = SessionRecord([], "", [], self.config.quant, self.config.kivi, self.files.block_size)
            record = session.record
            record.text = self._decode_text(record.token_ids) if self.tokenizer is not None else ""
            # what the other mechanisms hold for the session now (this turn's included: release
            # runs them first, by order, or their state changed before the turn ended)
            record.state, record.state_kv = self.tree.export_session(session.key(), skip=self)
            if session.tokens is record.token_ids:  # no newer turn: the next admission needs this text
                session.text = record.text
        with session.io:
            try:
                self.files.write(session.tenant, session.session_id, record, base=session.generation)
                session.generation = record.generation
            except WriteConflict as exc:
                WRITE_CONFLICTS.inc()
                logger.warning(
                    "session store: %s: this turn of session %r (tenant %r) is not stored; its next turn "
                    "continues from the stored one",
                    exc,
                    session.session_id,
                    session.tenant,
                )
                return
            except OSError as exc:
                WRITE_ERRORS.inc()
                session.error = f"writing the session file failed: {exc}"
                logger.error(
                    "session store: %s (session %r, tenant %r); it stays in memory, the server keeps serving",
                    session.error,
                    session.session_id,
                    session.tenant,
                )
                return
            finally:
                record.state, record.state_kv = {}, {}  # the mechanisms hold it; the warm tier keeps the path only
        session.on_disk, session.error = True, None
        session.stored_bytes = self.files.size(session.tenant, session.session_id)
        for path in self.files.enforce_quota(self.config.quota_bytes):
            logger.info("session store: quota %d bytes: removed %s", self.config.quota_bytes, path.name)
            for _, other in self.tree.sessions.slots(self.name):
                if self.files.path(other.tenant, other.session_id) == path:
                    other.on_disk, other.stored_bytes = False, 0
        STORE_BYTES.set(self.files.disk_bytes)
        WARM_BYTES.set(self._trim_warm())

    def _trim_warm(self) -> int:
        """Drop the stored form of least recently used sessions that are safely on disk; returns
        the bytes of stored form left in memory."""
        sessions = [session for _, session in self.tree.sessions.slots(self.name)]
        total = sum(s.record.nbytes() for s in sessions if s.record is not None)
        for session in sessions:
            if total <= self.config.warm_bytes:
                break
            if session.record is not None and session.on_disk and session.lock.acquire(blocking=False):
                try:
                    if not session.pending:
                        total -= session.record.nbytes()
                        session.record = None
                finally:
                    session.lock.release()
        return total

    def describe_session(self, slot: Session) -> dict:
        with slot.lock:
            live = len(slot.tokens) if slot.live is None else int(slot.live.sum())
            now = time.monotonic()
            when = self._next_use(slot, now) if slot.finished_at is not None else None
            return {
                "path_tokens": len(slot.tokens),
                "live_tokens": live,
                "stored_bytes": slot.stored_bytes if slot.on_disk else 0,
                # seconds until its next turn is expected (null: a turn of it runs, or none comes)
                "expected_back_s": round(when - now, 3) if when is not None and math.isfinite(when) else None,
            }

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every captured turn is written and every restore started is unpacked
        (flush_cache calls this before it empties the tree)."""
        return self._writer.drain(timeout) and (self._unpacker is None or self._unpacker.settle(timeout))
