"""Placed KV from the tier that holds it into the layer's working buffer, ahead of the layer that
reads it (KEEP section 4.3, layer-balanced memory loading).

A repaired request needs, before each layer l's attention, the placed KV of the rows layer l does
not recompute. Those rows are known once layer l-1 chose its successors, so their load can run
while layer l-1 computes (`next_layer`). Early layers recompute many rows and load few; late
layers the opposite, which leaves the loader idle early and the compute waiting late. A row not
recomputed at layer l is never recomputed again (it has no hidden state after l-1), so an idle
loader can already load it for every later layer (`balanced`): the late layers then find most of
their rows in place. `sync` loads each layer when it starts, on the forward's own thread.

The tier is the host memory the session's blocks live in. On a GPU the copy engine is the loader:
`want` enqueues the copies at once, pinned host to device on a stream of its own, and they run
while the GPU still computes the layers queued before them; the layer waits on an event. (A host
thread there only added hand-offs: measured slower than `sync` on an H100, bench/gpu_paths.py.) On
this CPU both sides are host memory and a thread of its own does the copies, and a tier slower than
the compute is simulated by holding each copy to `bandwidth` bytes per second (on either device).
"""

from __future__ import annotations

import threading
import time

import torch

LOADINGS = ("sync", "next_layer", "balanced")


class LayerLoader:
    """Loads rows of a request's placed KV [layers, M, heads, dim] into a working buffer of the
    same shape; `ready(layer, rows)` returns once those rows of that layer are there."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, device, mode: str, bandwidth: float = 0.0):
        if mode not in LOADINGS:
            raise ValueError(f"loading {mode!r}: one of {', '.join(LOADINGS)}")
        self.mode, self.bandwidth, self.device = mode, bandwidth, torch.device(device)
        cuda = self.device.type == "cuda"
        self.src_k, self.src_v = keys, values
        self.keys = torch.empty_like(keys, device=self.device)
        self.values = torch.empty_like(values, device=self.device)
        layers, m = keys.shape[:2]
        self.loaded = torch.zeros(layers, m, dtype=torch.bool)  # rows in the working buffer
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.events: dict[int, object] = {}  # layer -> CUDA event of its last copy
        self.lock = threading.Condition()
        self.wanted: dict[int, torch.Tensor] = {}  # layer -> rows asked for and not yet loaded
        self.guaranteed = torch.zeros(m, dtype=torch.bool)  # rows no later layer recomputes
        self.after = 0  # the layers after this one may be preloaded with `guaranteed`
        self.closed = False
        self.load_s = 0.0  # time spent copying (and held by the simulated tier)
        self.wait_s = 0.0  # time the forward waited for rows
        self.bytes = 0
        self.thread = None
        if mode != "sync" and not (cuda and bandwidth == 0):
            self.thread = threading.Thread(target=self._run, name="sgl-memory-keep-loader", daemon=True)
            self.thread.start()

    # --- the forward's side -----------------------------------------------------------------------

    def want(self, layer: int, rows: torch.Tensor, guaranteed: torch.Tensor) -> None:
        """Layer `layer` will need `rows` [M] bool; `guaranteed` rows are recomputed at no layer
        from `layer` on (what a balanced loader may preload for the layers after it)."""
        if self.mode == "sync" or layer >= self.loaded.shape[0]:
            return
        if self.thread is None:  # a GPU: enqueue on the copy stream now
            self._copy(layer, rows & ~self.loaded[layer])
            if self.mode == "balanced":  # every later layer's guaranteed rows, in one copy
                self._copy(layer + 1, guaranteed & ~self.loaded[layer + 1 :].all(0), self.loaded.shape[0])
            return
        with self.lock:
            self.wanted[layer] = rows & ~self.loaded[layer]
            self.guaranteed = guaranteed.clone()
            self.after = layer
            self.lock.notify()

    def ready(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The working buffer of `layer` ([M, heads, dim] keys and values), with `rows` loaded."""
        t0 = time.perf_counter()
        if self.thread is None:
            self._copy(layer, rows & ~self.loaded[layer])
        else:
            with self.lock:
                missing = rows & ~self.loaded[layer]
                if bool(missing.any()):
                    self.wanted[layer] = missing | self.wanted.get(layer, torch.zeros_like(missing))
                    self.lock.notify()
                    while bool((rows & ~self.loaded[layer]).any()):
                        self.lock.wait()
        event = self.events.get(layer)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self.wait_s += time.perf_counter() - t0
        return self.keys[layer], self.values[layer]

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify()
        if self.thread is not None:
            self.thread.join()

    def metrics(self) -> dict:
        hidden = 1.0 - self.wait_s / self.load_s if self.load_s > 0 else None
        return {
            "load_ms": round(self.load_s * 1000, 3),
            "load_wait_ms": round(self.wait_s * 1000, 3),
            "load_bytes": self.bytes,
            "load_overlap": None if hidden is None else round(max(0.0, hidden), 4),
        }

    # --- the loader's side ------------------------------------------------------------------------

    def _next(self) -> tuple[int, torch.Tensor] | None:
        """What to load now (lock held): a layer the forward asked for, the earliest first; else,
        balanced, the guaranteed rows of the earliest later layer that lacks them."""
        for layer in sorted(self.wanted):
            rows = self.wanted.pop(layer) & ~self.loaded[layer]
            if bool(rows.any()):
                return layer, rows
        if self.mode == "balanced":
            for layer in range(self.after + 1, self.loaded.shape[0]):
                rows = self.guaranteed & ~self.loaded[layer]
                if bool(rows.any()):
                    return layer, rows
        return None

    def _run(self) -> None:
        while True:
            with self.lock:
                job = self._next()
                while job is None and not self.closed:
                    self.lock.wait()
                    job = self._next()
                if self.closed:
                    return
            self._copy(*job)
            with self.lock:
                self.lock.notify_all()

    def _copy(self, layer: int, rows: torch.Tensor, stop: int | None = None) -> None:
        """Load `rows` [M] bool into layers layer .. stop - 1 (default: the one layer)."""
        if not bool(rows.any()):
            return
        t0 = time.perf_counter()
        layers = slice(layer, layer + 1 if stop is None else stop)
        index = rows.nonzero().squeeze(1)
        if self.stream is not None:
            # The rows are gathered into pinned memory, so the copies run asynchronously on the copy
            # stream (from pageable memory they would hold this thread until done); the caching
            # host allocator keeps each staging buffer until the stream has read it.
            staged = [
                torch.index_select(
                    src[layers],
                    1,
                    index,
                    out=torch.empty(
                        (src[layers].shape[0], index.numel(), *src.shape[2:]), dtype=src.dtype, pin_memory=True
                    ),
                )
                for src in (self.src_k, self.src_v)
            ]
            with torch.cuda.stream(self.stream):
                at = index.pin_memory().to(self.device, non_blocking=True)
                self.keys[layers].index_copy_(1, at, staged[0].to(self.device, non_blocking=True))
                self.values[layers].index_copy_(1, at, staged[1].to(self.device, non_blocking=True))
                event = torch.cuda.Event()
                event.record(self.stream)
            # the copy stream runs in order: a layer's newest event covers its earlier copies too
            self.events.update(dict.fromkeys(range(layers.start, layers.stop), event))
        else:
            self.keys[layers][:, index] = self.src_k[layers][:, index]
            self.values[layers][:, index] = self.src_v[layers][:, index]
        size = int(index.numel()) * (self.src_k[0][0].nbytes + self.src_v[0][0].nbytes) * (layers.stop - layers.start)
        if self.bandwidth > 0:  # the simulated tier: the copy takes as long as `bandwidth` allows
            time.sleep(max(0.0, size / self.bandwidth - (time.perf_counter() - t0)))
        with self.lock:
            self.loaded[layers] |= rows
        self.bytes += size
        self.load_s += time.perf_counter() - t0
