"""Probe admission, scheduler side: a query pass's prompt and capture, its release, the recent probes."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict

import torch

from sgl_memory.core import tree_fill
from sgl_memory.core.kvhost import KVHost
from sgl_memory.core.requests import Lifetime, RequestStore
from sgl_memory.core.rope import Rope
from sgl_memory.core.views import RequestView, SchedulerView
from sgl_memory.memart.queries import Probe, ProbeCapture, probe_end, scoring_positions
from sgl_memory.memart.roles import Roles
from sgl_memory.memart.settings import MemArtConfig
from sgl_memory.memart.turns import MemArtTurn, Turns

MAX_PROBES = 32  # recent probes kept for their request (a request with n > 1 samples uses its probe n times)


class ProbeAdmission:
    """Probe admission: a probe's prompt cut where its queries end, its scoring positions and
    capture (the running `ProbeCapture`, a capture.py subscriber), the tree prefix it may take
    (`match_limit`), the system message's KV and the computed length at its release, and the
    `MAX_PROBES` most recent probes, kept by probe id for the requests that follow them."""

    def __init__(
        self, config: MemArtConfig, rope: Rope, layers: int, roles: Roles, requests: RequestStore, turns: Turns
    ):
        self.config, self.layers, self.roles, self.turns = config, layers, roles, turns
        self.probes: OrderedDict[str, Probe] = OrderedDict()
        # the probes being prefilled (by request id, from admission to release) and their capture
        self.running = ProbeCapture(rope, requests.table("memory probes", Lifetime.ROW))
        self._lock = threading.Lock()

    def admit(
        self,
        scheduler: SchedulerView,
        req: RequestView,
        owner: tuple[str, str],
        probe_id: str | None,
        placement: str | None,
    ) -> None:
        ids = list(req.origin_input_ids)
        spans = self.roles.spans(scheduler, ids)
        markers = self.roles.markers
        tokenizer = getattr(scheduler, "tokenizer", None)
        end = probe_end(ids, spans, self.config.score_tokens, markers, tokenizer)
        if end < len(ids):
            # nothing past the turn scores the blocks; a longer prefill would only round the
            # queries differently in bf16 (and the same question could retrieve other blocks)
            ids = ids[:end]
            req.origin_input_ids = req.origin_input_ids_unpadded = array("q", ids)
            req.logprob_start_len = min(req.logprob_start_len, end - 1)
        scoring = scoring_positions(ids, spans, self.config.score_tokens, markers, tokenizer)
        after_system = (placement or self.config.placement) == "after_system"
        probe = Probe(owner, scoring, self.layers, len(ids), spans.system_end if after_system else 0)
        self.turns.set(req.rid, MemArtTurn(owner, "probe"))
        # Under the request's own key, like any prompt: the probe reuses what the tree caches of it
        # (match_limit) and leaves its prompt there for the session's next probe. A readonly request's
        # probe too: its prompt is not session state, and its release copies the system message.
        req.skip_radix_cache_insert = False
        self.running.probing.set(req.rid, probe)
        with self._lock:
            self.probes[probe_id] = probe
            while len(self.probes) > MAX_PROBES:
                self.probes.popitem(last=False)

    def match_limit(self, req: RequestView) -> int | None:
        # a probe takes what the tree caches of its prompt (the system message: an agent's tool docs)
        # up to its first scoring token; the scoring rows are computed, so the capture sees them
        probe = self.running.probing.get(req.rid)
        return probe.start if probe is not None else None

    def get(self, probe_id: str | None) -> Probe | None:
        """The probe a memory-mode request names, if it is still kept."""
        with self._lock:
            return self.probes.get(probe_id) if probe_id else None

    def checkpoint(self, req: RequestView, tree: KVHost) -> None:
        """At the probe's release (the row holds every position): the system message's KV, for a
        request that places its blocks after it."""
        probe = self.running.probing.get(req.rid)
        if probe is not None and probe.system_end and req.finished():
            slots = tree.row(req)[: probe.system_end].to(torch.int64)
            probe.system_kv = tree_fill.copy_slots(tree, slots)

    def release(self, req: RequestView) -> None:
        probe = self.running.probing.get(req.rid)
        if probe is not None:
            probe.prefilled = len(req.origin_input_ids) - req.cached_tokens
