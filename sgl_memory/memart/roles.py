"""Where a prompt's messages are: the tokenizer's role markers, read at the first request that needs them."""

from __future__ import annotations

from sgl_memory.core.spans import RoleMarkers, Spans, find_spans
from sgl_memory.core.views import SchedulerView


class Roles:
    """The role markers of one chat template family (memory.roles) and the spans they find in a
    prompt, shared by the probe's admission (what it computes, which positions score) and the
    memory-mode request's (where its turn starts)."""

    def __init__(self, family: str):
        self.family = family
        self.markers: RoleMarkers | None = None  # from the tokenizer, at the first request

    def of(self, scheduler: SchedulerView) -> RoleMarkers:
        if self.markers is None:
            self.markers = RoleMarkers.from_tokenizer(getattr(scheduler, "tokenizer", None), self.family)
        return self.markers

    def spans(self, scheduler: SchedulerView, ids: list[int]) -> Spans:
        return find_spans(ids, self.of(scheduler), len(ids))
