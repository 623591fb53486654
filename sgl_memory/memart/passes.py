"""The HTTP side's internal memory passes: a prefill-only request the scheduler answers in its
metrics (writes, forgets, joint groups, text mode's read of the recorded turns).

The passes carry `sgl_memory.memory` modes a client cannot send: they go out as the engine's own
passes (core/front.py), which no mechanism's before_generate sees.
"""

from __future__ import annotations

from sgl_memory.core.request import FIELD, SpecError


def one_token(engine) -> list[int]:
    """The prompt of a pass that only asks: one token, never stored."""
    return engine.tokenize("\n")[:1]


async def internal_pass(
    engine, owner: dict, memory: dict, input_ids: list[int], answer: str = "memory_book"
) -> dict | list:
    """Send one pass and return the scheduler's `answer` from its metrics (MemArtTurn): the
    session's book after a write or forget, its recorded turns after a `turns` pass."""
    meta = await engine.prefill({**owner, "memory": memory}, input_ids=input_ids)
    finish = meta.get("finish_reason") or {}
    if finish.get("type") == "abort":
        raise SpecError(f"the engine refused the memory pass: {finish.get('message')}")
    found = meta.get(FIELD, {}).get(answer)
    if found is None:
        raise RuntimeError(f"the memory pass came back without its {answer}")
    return found
