"""Which cached positions a decode step attends, per layer: the seam for decode-time retrieval.

A mechanism that chooses, at every decode step and layer, the part of a request's KV its new token
reads (SentenceKV: the kept positions plus the sentences the step's query retrieves) answers
`Mechanism.step_reads` with a `StepReads` for the request. The engine's attention backend asks the
composition for them once per decode forward, asks each before its layer's decode attention and
reads exactly those positions of the request's slot map (the sentinel's left out); requests
without one read every position, as before. The KV not read stays in the pool.
"""

from __future__ import annotations

from typing import Protocol

import torch


class StepReads(Protocol):
    """What a mechanism provides for a request whose decode steps read only part of its KV
    (Mechanism.step_reads): the positions each step attends, per layer."""

    def positions(self, layer: int, q: torch.Tensor, token: int, length: int) -> torch.Tensor:
        """The positions [k] (int64, ascending, on the host) of the request's sequence that this
        decode step attends at `layer`; they must include `length - 1`, the step's own token.
        q: the step's post-RoPE query at this layer [heads, head_dim]; token: the step's input token
        id; length: the sequence length with the step's token. Called for layers 0, 1, ... in order
        within a step."""
