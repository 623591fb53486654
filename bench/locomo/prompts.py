"""Token ids of every request, built with the model's own chat template.

All methods share the system instruction and the question wording; they differ only in what
context precedes the question: the whole transcript (full), retrieved turns (text), or nothing
in the prompt because the server places retrieved KV blocks before it (memart).
"""

from __future__ import annotations

import bisect

SYSTEM = "Answer the question about the conversation in a short phrase."
CONTEXT_HEADER = "Conversation:\n"


def chat_ids(tokenizer, user: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    # transformers 5 returns a BatchEncoding unless return_dict=False
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


def with_context(tokenizer, context: str, question: str) -> list[int]:
    return chat_ids(tokenizer, f"{CONTEXT_HEADER}{context}\n\nQuestion: {question}")


def question_only(tokenizer, question: str) -> list[int]:
    return chat_ids(tokenizer, f"Question: {question}")


def ingest_ids(tokenizer, transcript: str) -> list[int]:
    """The memory turn: plain transcript tokens, so every stored block holds dialogue and no chat markup."""
    return tokenizer(CONTEXT_HEADER + transcript, add_special_tokens=False)["input_ids"]


def chat_turn(tokenizer, transcript: str, ids: list[int], turn_of: list[int | None]) -> tuple[list[int], list]:
    """The transcript as a chat turn (system message, then the transcript as the user's message)
    and each token's turn in what a memory-mode request records of it, from the user message's
    opener on; `ids`, `turn_of`: ingest_ids of the transcript and its ingest_turn_of_tokens."""
    chat = chat_ids(tokenizer, CONTEXT_HEADER + transcript)
    at = next((i for i in range(len(chat) - len(ids) + 1) if chat[i : i + len(ids)] == ids), None)
    if at is None:
        raise ValueError("the chat template tokenizes the transcript differently from ingest_ids")
    opener = max(i for i in range(at) if chat[i] == chat[0])  # chatml: each message opens with <|im_start|>
    return chat, [None] * (at - opener) + list(turn_of) + [None] * (len(chat) - at - len(ids))


def ingest_turn_of_tokens(tokenizer, turns, every_line_dated: bool = False) -> list[int | None]:
    """For each token of the memory turn of these turns (ingest_ids of their transcript, rendered
    with `every_line_dated` as data.rendered), the chronological position of the turn it falls in
    (None for the header): where a retrieved KV block sits in the dialogue. Turns, not lines: a
    turn's text may hold line ends."""
    from . import data

    pieces = data.rendered(turns, every_line_dated)
    enc = tokenizer(CONTEXT_HEADER + "\n".join(pieces), add_special_tokens=False, return_offsets_mapping=True)
    starts, pos = [], len(CONTEXT_HEADER)
    for piece in pieces:
        starts.append(pos)
        pos += len(piece) + 1
    out = []
    for start, _ in enc["offset_mapping"]:
        turn = bisect.bisect_right(starts, start) - 1
        out.append(turn if turn >= 0 else None)
    return out


def session_ends(turns, token_turn: list[int | None]) -> list[int]:
    """Where each LoCoMo session's tokens end in ingest_ids (`token_turn`: ingest_turn_of_tokens of
    these turns), the last end being its length: the memory's turns when each session is sent as one."""
    lines = sorted(turns, key=lambda t: t.index)
    session = [None if i is None else lines[i].session for i in token_turn]
    ends = [
        j
        for j in range(1, len(session))
        if session[j] is not None and session[j - 1] is not None and session[j] != session[j - 1]
    ]
    return ends + [len(token_turn)]
