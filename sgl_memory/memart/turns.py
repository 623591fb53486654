"""What memory did for each request: its `MemArtTurn`, kept in the tree's request store (`Turns`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sgl_memory.core import reuse, tree_fill
from sgl_memory.core.mechanism import repairer
from sgl_memory.core.requests import RequestTable
from sgl_memory.core.views import RequestView

# every request memory acts on, as long as the request: a retracted one records its turn at its end
Turns = RequestTable["MemArtTurn"]


@dataclass
class MemArtTurn:
    """What memory did for one request, kept in its `Turns` table."""

    owner: tuple[str, str]
    # "record" (full-history turn), "retrieve", "text", "probe", "write" (an entry or a joint KV),
    # "forget", "turns" (text mode's read of the session's token ids)
    mode: str
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
    text_span: tuple[int, int] | None = None  # mode "text": the placed lines' positions, not recorded
    text_lines: int = 0

    def metrics(self, req: RequestView, memory_blocks: int, layers: int) -> dict:
        out = {
            "retrieved_blocks": self.retrieved_blocks,
            "retrieved_turns": self.retrieved_turns,
            "retrieved_spans": self.retrieved_spans,
            "memory_kv_tokens": self.memory_end - self.memory_start,
            "probe_tokens": self.probe_tokens,
            "retrieval_ms": round(self.retrieval_ms, 3),
            "memory_blocks": memory_blocks,
            "memory_refused": self.refused,
        }
        if self.mode == "text":
            start, end = self.text_span or (0, 0)
            out |= {"text_lines": self.text_lines, "text_tokens": end - start}
            return out | reuse.prefill_cost(len(req.origin_input_ids), req.cached_tokens, 0, False, 0, layers)
        if self.mode != "retrieve":
            return out | {"prefill_tokens": len(req.origin_input_ids) - req.cached_tokens}
        out["windowed_tokens"] = self.windowed
        out["recompute"] = self.recompute
        out.update(self.units)
        placed = self.memory_end - self.memory_start
        if repairer(self.recompute) is not None and placed:
            return out  # the repairer reports what the prefill cost (reuse.prefill_cost)
        # reused as a prefix hit (none) or prefilled as text (full): no layer repairs them
        full = self.recompute == "full" and placed > 0
        out |= reuse.prefill_cost(len(req.origin_input_ids), req.cached_tokens, 0 if full else placed, False, 0, layers)
        out["recompute_share"] = 1.0 if full else 0.0
        return out
