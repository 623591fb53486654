"""sgl-memory's metrics on SGLang's own Prometheus endpoint (`--enable-metrics`, GET /metrics).

SGLang runs prometheus_client in multiprocess mode: every process writes its values to files in
PROMETHEUS_MULTIPROC_DIR, and the HTTP process's /metrics collects them all. So each value is
recorded in the process that knows it:
- per-request metrics in the HTTP process, as they arrive in meta_info (sgl_memory/metrics.py; streamed
  requests included), and the requests our validation refused (http_api.py);
- memory pool and session store sizes, and session file write errors, in the scheduler process.

Labels are mechanisms and small fixed sets of reasons, never a session id or a tenant, so the
number of series stays bounded whatever the traffic. Nothing here runs without `--enable-metrics`.
The metrics are created at their first use, not when enabled: prometheus_client picks its
multiprocess mode when it is imported, and in the HTTP process we are enabled before SGLang sets
its multiprocess directory.
"""

from __future__ import annotations

import threading

PREFIX = "sgl_memory_"
MECHANISMS = {"intent": "compression_events", "persist": "text_match", "memory": "retrieved_blocks"}
# how a memory-mode request that placed nothing is labelled; the reason strings are the manager's
MEMORY_REFUSALS = {"no query pass": "no_probe", "no free KV slots": "no_kv_slots"}
SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)

_enabled = False
_created: _Metrics | None = None
_lock = threading.Lock()  # the scheduler's threads (writer, memory worker) may be first


class _Metrics:
    def __init__(self):
        from prometheus_client import Counter, Gauge, Histogram

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, labels)

        self.requests = counter("requests", "Requests that carried a mechanism's metrics", ["mechanism"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of those requests", ["mechanism"])
        self.cached_tokens = counter("cached_tokens", "Prompt tokens that were radix prefix hits", ["mechanism"])
        self.compression_events = counter("compression_events", "IntentKV compression events")
        self.live_kv = counter("live_kv_tokens", "KV tokens live after pruning, summed over requests")
        self.peak_tokens = counter("peak_request_tokens", "Peak request tokens, summed over requests")
        self.kv_reads = counter("kv_reads", "KV entries attended over decode steps", ["kind"])
        self.budget_clamped = counter("budget_clamped", "Requests whose forced set exceeded the configured budget")
        self.restores = counter("restores", "Session KV restored into the tree", ["source"])
        self.restored_tokens = counter("restored_tokens", "Tokens restored from the session store")
        self.retrievals = counter("retrievals", "Memory-mode requests that retrieved blocks")
        self.retrieved_blocks = counter("retrieved_blocks", "Memory blocks placed before requests")
        self.refusals = counter("refusals", "A mechanism declined to act and the request was served without it",
                                ["mechanism", "reason"])  # fmt: skip
        self.bad_requests = counter("bad_requests", "Requests refused by sgl-memory's validation", ["reason"])
        self.write_errors = counter("write_errors", "Session file writes that failed")
        self.scoring = Histogram(PREFIX + "scoring_seconds", "IntentKV scoring time per compression event", buckets=SECONDS)
        self.restore = Histogram(PREFIX + "restore_seconds", "Session restore time", buckets=SECONDS)
        self.retrieval = Histogram(PREFIX + "retrieval_seconds", "Memory retrieval time", buckets=SECONDS)
        self.pool_bytes = Gauge(PREFIX + "memory_pool_bytes", "Host memory of the KV memory pools", multiprocess_mode="livesum")
        self.pool_blocks = Gauge(PREFIX + "memory_pool_blocks", "Blocks in the KV memory pools", multiprocess_mode="livesum")
        self.pool_tokens = Gauge(PREFIX + "memory_pool_tokens", "Tokens stored in the KV memory pools", multiprocess_mode="livesum")
        self.store_bytes = Gauge(PREFIX + "store_bytes", "Session files on disk", multiprocess_mode="livesum")
        self.warm_bytes = Gauge(PREFIX + "store_warm_bytes", "Stored-form session KV in host memory", multiprocess_mode="livesum")


def enable(server_args) -> None:
    """Record metrics in this process when the server runs with --enable-metrics."""
    global _enabled
    _enabled = _enabled or bool(getattr(server_args, "enable_metrics", False))


def _metrics() -> _Metrics | None:
    global _created
    if _created is None and _enabled:
        with _lock:
            if _created is None:
                _created = _Metrics()
    return _created


def record_request(metrics: dict, meta_info: dict) -> None:
    """One finished request's sgl_memory metrics (HTTP process)."""
    m = _metrics()
    if m is None:
        return
    for mechanism, marker in MECHANISMS.items():
        if marker not in metrics:
            continue
        m.requests.labels(mechanism).inc()
        m.prompt_tokens.labels(mechanism).inc(int(meta_info.get("prompt_tokens") or 0))
        m.cached_tokens.labels(mechanism).inc(int(meta_info.get("cached_tokens") or 0))
    if "compression_events" in metrics:
        m.compression_events.inc(metrics["compression_events"])
        m.live_kv.inc(metrics["live_kv_tokens"])
        m.peak_tokens.inc(metrics["peak_request_tokens"])
        m.kv_reads.labels("raw").inc(metrics["raw_kv_reads"])
        m.kv_reads.labels("eff").inc(metrics["eff_kv_reads"])
        if metrics["compression_events"]:
            m.scoring.observe(metrics["scoring_ms"] / 1000)
        if metrics.get("budget_reason"):
            m.budget_clamped.inc()
    if metrics.get("restored_tokens"):
        m.restores.labels(metrics.get("restored_from") or "unknown").inc()
        m.restored_tokens.inc(metrics["restored_tokens"])
        m.restore.observe(metrics["restore_ms"] / 1000)
    if metrics.get("persist_refused"):
        m.refusals.labels("persist", "file").inc()
    if metrics.get("retrieved_blocks"):
        m.retrievals.inc()
        m.retrieved_blocks.inc(metrics["retrieved_blocks"])
        m.retrieval.observe(metrics["retrieval_ms"] / 1000)
    refused = metrics.get("memory_refused")
    if refused:
        reason = next((code for text, code in MEMORY_REFUSALS.items() if refused.startswith(text)), "other")
        m.refusals.labels("memory", reason).inc()


def bad_request(reason: str) -> None:
    """A request our validation refused: `field` (the sgl_memory field), `json`, `size`."""
    if (m := _metrics()) is not None:
        m.bad_requests.labels(reason).inc()


def write_error() -> None:
    if (m := _metrics()) is not None:
        m.write_errors.inc()


def memory_pool(nbytes: int, blocks: int, tokens: int) -> None:
    if (m := _metrics()) is not None:
        m.pool_bytes.set(nbytes)
        m.pool_blocks.set(blocks)
        m.pool_tokens.set(tokens)


def store(disk_bytes: int, warm_bytes: int) -> None:
    if (m := _metrics()) is not None:
        m.store_bytes.set(disk_bytes)
        m.warm_bytes.set(warm_bytes)
