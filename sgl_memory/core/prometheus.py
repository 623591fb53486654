"""sgl-memory's metrics on SGLang's own Prometheus endpoint (`--enable-metrics`, GET /metrics).

SGLang runs prometheus_client in multiprocess mode: every process writes its values to files in
PROMETHEUS_MULTIPROC_DIR, and the HTTP process's /metrics collects them all. So each value is
recorded in the process that knows it:
- per-request metrics in the HTTP process, as they arrive in meta_info (engine/hooks.py;
  streamed requests included): the per-mechanism request counts here, each mechanism's own series
  in its `Mechanism.observe`; and the requests our validation refused (engine/http_api.py, engine/admission.py);
- sizes (memory pools, the session store) and write errors in the scheduler process.

A mechanism declares its series at module level with `counter`, `histogram` and `gauge`; every name
gets the `sgl_memory_` prefix. Labels are mechanisms and small fixed sets of reasons, never a session
id or a tenant, so the number of series stays bounded whatever the traffic. Nothing here records
without `--enable-metrics`. A series is created at its first use, not where it is declared:
prometheus_client picks its multiprocess mode when it is imported, and in the HTTP process we are
enabled before SGLang sets its multiprocess directory.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from sgl_memory.core import mechanism

PREFIX = "sgl_memory_"
SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
WAITS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)  # a request's waits: seconds to minutes

_enabled = False
_lock = threading.Lock()  # the scheduler's threads (writer, memory worker) may be first
DECLARED: dict[str, Series] = {}  # full name -> series, every one declared in this process


class Series:
    """A Prometheus series declared now and created at its first use; a no-op while disabled.
    `labels(...)` selects a labelled child as prometheus_client does."""

    def __init__(self, kind: str, name: str, doc: str, labels: Sequence[str] = (), **options: Any) -> None:
        self.kind, self.name, self.doc, self.label_names, self.options = (
            kind,
            PREFIX + name,
            doc,
            tuple(labels),
            options,
        )
        self._made = None
        if self.name in DECLARED:
            raise ValueError(f"Prometheus series {self.name} is declared twice")
        DECLARED[self.name] = self

    def _series(self) -> Any:
        if self._made is None and _enabled:
            import prometheus_client

            with _lock:
                if self._made is None:
                    make = {
                        "counter": prometheus_client.Counter,
                        "histogram": prometheus_client.Histogram,
                        "gauge": prometheus_client.Gauge,
                    }[self.kind]
                    self._made = make(self.name, self.doc, self.label_names, **self.options)
        return self._made

    def labels(self, *values: str) -> _Child:
        return _Child(self, values)

    def inc(self, amount: float = 1) -> None:
        if (s := self._series()) is not None:
            s.inc(amount)

    def observe(self, value: float) -> None:
        if (s := self._series()) is not None:
            s.observe(value)

    def set(self, value: float) -> None:
        if (s := self._series()) is not None:
            s.set(value)


class _Child:
    """One labelled child of a Series (`Series.labels`): records under those label values, a no-op while disabled."""

    def __init__(self, series: Series, values: tuple):
        self.series, self.values = series, values

    def inc(self, amount: float = 1) -> None:
        if (s := self.series._series()) is not None:
            s.labels(*self.values).inc(amount)

    def observe(self, value: float) -> None:
        if (s := self.series._series()) is not None:
            s.labels(*self.values).observe(value)


def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Series:
    return Series("counter", name, doc, labels)


def histogram(name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = SECONDS) -> Series:
    return Series("histogram", name, doc, labels, buckets=tuple(buckets))


def gauge(name: str, doc: str) -> Series:
    """A size the scheduler processes hold: the value on /metrics is their sum (live processes only)."""
    return Series("gauge", name, doc, multiprocess_mode="livesum")


REQUESTS = counter("requests", "Requests that carried a mechanism's metrics", ["mechanism"])
PROMPT_TOKENS = counter("prompt_tokens", "Prompt tokens of those requests", ["mechanism"])
CACHED_TOKENS = counter("cached_tokens", "Prompt tokens that were radix prefix hits", ["mechanism"])
REFUSALS = counter(
    "refusals", "A mechanism declined to act and the request was served without it", ["mechanism", "reason"]
)
BAD_REQUESTS = counter("bad_requests", "Requests refused by sgl-memory's validation: field, json, size", ["reason"])


def enable(server_args: Any) -> None:
    """Record metrics in this process when the server runs with --enable-metrics."""
    global _enabled
    _enabled = _enabled or bool(getattr(server_args, "enable_metrics", False))


def record_request(metrics: dict, meta_info: dict) -> None:
    """One finished request's sgl_memory metrics (HTTP process)."""
    if not _enabled:
        return
    for cls in mechanism.ordered():
        if cls.schema.marker in metrics:
            REQUESTS.labels(cls.name).inc()
            PROMPT_TOKENS.labels(cls.name).inc(int(meta_info.get("prompt_tokens") or 0))
            CACHED_TOKENS.labels(cls.name).inc(int(meta_info.get("cached_tokens") or 0))
        cls.observe(metrics, meta_info)
