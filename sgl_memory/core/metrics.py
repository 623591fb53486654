"""Server-wide aggregates of the per-request `sgl_memory` metrics (GET /sgl_memory/stats), as
each registered mechanism's MetricsSchema declares them.

They are collected in the HTTP process, where every finished request's meta_info passes through
SGLang's tokenizer manager; the scheduler process only attaches metrics to its requests.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

from sgl_memory.core import mechanism
from sgl_memory.core.request import FIELD

if TYPE_CHECKING:
    from sgl_memory.core.views import RequestView

RECENT = 4096  # per-request metrics kept for the OpenAI response rewrite (by response id)


class Stats:
    """What every registered mechanism's MetricsSchema asks for, over the requests so far."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.totals: Counter[str] = Counter()
        self.maxima: dict[str, float] = {}
        self.counts: dict[str, Counter[str]] = {}
        self.flags: Counter[str] = Counter()
        self.recent: OrderedDict[str, dict] = OrderedDict()

    def record(self, rid: str | None, metrics: dict, meta_info: dict) -> None:
        schemas = [cls.schema for cls in mechanism.ordered()]
        with self._lock:
            self.requests += 1
            self.prompt_tokens += int(meta_info.get("prompt_tokens") or 0)
            self.cached_tokens += int(meta_info.get("cached_tokens") or 0)
            self.completion_tokens += int(meta_info.get("completion_tokens") or 0)
            for schema in schemas:
                for key in schema.summed:
                    self.totals[key] += metrics.get(key) or 0
                for key in schema.maxed:
                    self.maxima[key] = max(self.maxima.get(key, 0), metrics.get(key) or 0)
                for key in schema.counted:
                    if metrics.get(key):
                        self.counts.setdefault(key, Counter())[metrics[key]] += 1
                for key in schema.flagged:
                    self.flags[key] += bool(metrics.get(key))
            if rid is not None:
                self.recent[rid] = metrics
                while len(self.recent) > RECENT:
                    self.recent.popitem(last=False)

    def lookup(self, rid: str | None) -> dict | None:
        if rid is None:
            return None
        with self._lock:
            return self.recent.get(rid)

    def snapshot(self) -> dict:
        keys = [cls.schema for cls in mechanism.ordered()]
        with self._lock:
            n = max(self.requests, 1)
            totals = {key: self.totals[key] for schema in keys for key in schema.summed}
            return {
                "requests": self.requests,
                "prefix_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens,
                "totals": totals,
                "means": {key: total / n for key, total in totals.items()},
                "maxima": {key: self.maxima.get(key, 0) for schema in keys for key in schema.maxed},
                "counts": {key: dict(self.counts.get(key, {})) for schema in keys for key in schema.counted},
                "flags": {key: self.flags[key] for schema in keys for key in schema.flagged},
            }


STATS = Stats()


def attach(req: RequestView, fields: dict) -> None:
    """Merge fields into the request's sgl_memory metrics (one dict, sent when it finishes)."""
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info.setdefault(FIELD, [{}])[0].update(fields)
