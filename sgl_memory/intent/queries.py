"""The query capture of the pruner's requests: a sgl_memory/core/capture.py subscriber that hands the
post-RoPE query rows of each prompt being prefilled to the QueryCapture its admission made."""

from __future__ import annotations

from typing import Any

import torch

from sgl_memory.core.capture import ExtendRows, QueryCapture
from sgl_memory.core.requests import RequestTable


class PrefillQueries:
    """The pruner's capture subscriber: reads the query rows of the requests in the `captures` table
    (IntentPruner's) while their prompt is prefilled; the compression event takes the capture."""

    def __init__(self, captures: RequestTable[QueryCapture]):
        self.captures = captures

    def capturing(self) -> bool:
        return bool(self.captures)

    def bind(self, rows: list[ExtendRows]) -> list[tuple[QueryCapture, ExtendRows]]:
        """The requests of this forward whose prompt is being prefilled."""
        bound = []
        for r in rows:
            query_capture = self.captures.get(r.rid)
            if query_capture is not None and r.prefix < query_capture.length:
                bound.append((query_capture, r))
        return bound

    def first_read(self, part: tuple[QueryCapture, ExtendRows]) -> int:
        return part[0].first_read()

    def take(
        self,
        bound: list[tuple[QueryCapture, ExtendRows]],
        layer: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        for query_capture, r in bound:
            query_capture.add_rows(layer, q, r)
