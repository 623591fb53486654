"""The memory entries API, HTTP side: write, replace and forget a session's memory entries by key.

    POST /sgl_memory/memory/write   {"session_id", "tenant"?, "entries": [{"key", "text"}, ...]}
    POST /sgl_memory/memory/forget  {"session_id", "tenant"?, "keys": [...]}
    GET  /sgl_memory/memory?session_id=...&tenant=...

An entry's text is stored as one line (trailing whitespace becomes one newline) and its KV is
computed alone: each write is a prefill-only pass through the engine whose prompt is the text,
recorded by the scheduler as the entry's turn of the session's pool (recorder.py). Writing a key
again replaces the entry; forgetting drops it; both take effect for every request admitted after
the call returns. Entries are grouped by MiniLM embeddings computed here (encoder.py); when the
scheduler reports a group that became static, this side sends the pass that computes its joint KV.
Every answer carries the session's book: its entries, groups and which groups are static.

The passes are the engine's own (passes.py).
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import ORJSONResponse

from sgl_memory.core.config import MemoryConfig
from sgl_memory.core.request import MAX_ID_LEN, SpecError, check_id
from sgl_memory.memart.encoder import embed
from sgl_memory.memart.passes import internal_pass, one_token
from sgl_memory.memart.settings import MemArtConfig

MAX_ENTRIES = 1024  # per call
MAX_TEXT_CHARS = 1 << 16
MAX_JOINT_PASSES = 64  # per call: a joint pass reports groups that became static meanwhile


def _body(data, listed: str) -> tuple[str, str | None, list]:
    if not isinstance(data, dict):
        raise SpecError("the body must be a JSON object")
    unknown = sorted(set(data) - {"session_id", "tenant", listed})
    if unknown:
        raise SpecError(f"unknown field(s) {', '.join(unknown)}; allowed: session_id, tenant, {listed}")
    owner = owner_of(data.get("session_id"), data.get("tenant"))
    items = data.get(listed)
    if not isinstance(items, list) or not items or len(items) > MAX_ENTRIES:
        raise SpecError(f"{listed} must be a list of 1 to {MAX_ENTRIES} items")
    return owner["session_id"], owner.get("tenant"), items


def owner_of(session_id, tenant) -> dict:
    """The `sgl_memory` fields naming the session a pass acts on (ids checked as requests' are)."""
    if session_id is None:
        raise SpecError("session_id is required: memory belongs to a session")
    tenant = check_id(tenant, "tenant")
    return {"session_id": check_id(session_id, "session_id"), **({"tenant": tenant} if tenant else {})}


def _key(value, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN:
        raise SpecError(f"{where} must be a non-empty string of at most {MAX_ID_LEN} characters")
    return value


def parse_write(data) -> tuple[str, str | None, list[tuple[str, str]]]:
    session_id, tenant, items = _body(data, "entries")
    entries = []
    for i, item in enumerate(items):
        where = f"entries[{i}]"
        if not isinstance(item, dict) or set(item) != {"key", "text"}:
            raise SpecError(f"{where} must be an object with exactly key and text")
        text = item["text"]
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_TEXT_CHARS:
            raise SpecError(f"{where}.text must be a non-blank string of at most {MAX_TEXT_CHARS} characters")
        entries.append((_key(item["key"], f"{where}.key"), text.rstrip() + "\n"))
    if len({key for key, _ in entries}) < len(entries):
        raise SpecError("entries: a key appears twice in one call")
    return session_id, tenant, entries


def parse_forget(data) -> tuple[str, str | None, list[str]]:
    session_id, tenant, keys = _body(data, "keys")
    return session_id, tenant, [_key(k, f"keys[{i}]") for i, k in enumerate(keys)]


async def _joint(engine, owner: dict, book: dict, joint: list[dict]) -> dict:
    """Send the joint-KV pass of every group the book reports static (and of those the passes
    themselves report), so the call returns with its groups' KV computed."""
    due = list(book.pop("due"))
    for _ in range(MAX_JOINT_PASSES):
        if not due:
            break
        group = due.pop(0)
        book = await internal_pass(
            engine, owner, {"mode": "write", "group": group["group"], "version": group["version"]}, group["tokens"]
        )
        joint.append({"group": group["group"], "tokens": len(group["tokens"])})
        due += book.pop("due")
    return book


def mount(app, config: MemoryConfig, engine) -> None:
    def refuse(message: str, status: int = 400):
        return ORJSONResponse(status_code=status, content={"error": {"message": message}})

    def serving() -> None:
        if not config.of(MemArtConfig).enabled:
            raise SpecError("KV memory is off on this server (memory.enabled: false)")

    async def parsed(request: Request, parse):
        serving()
        try:
            data = await request.json()
        except ValueError:
            raise SpecError("the body is not valid JSON") from None
        return parse(data)

    @app.post("/sgl_memory/memory/write")
    async def memory_write(request: Request):
        try:
            session_id, tenant, entries = await parsed(request, parse_write)
            tokenized = [engine.tokenize(text) for _, text in entries]
            limit = engine.context_len() - 1
            for (key, _), ids in zip(entries, tokenized):
                if len(ids) > limit:
                    raise SpecError(f"entry {key!r} is {len(ids)} tokens; the context holds {limit}")
            embeddings = (
                (await asyncio.to_thread(embed, [t for _, t in entries]))
                if config.of(MemArtConfig).groups
                else [None] * len(entries)
            )
            owner = owner_of(session_id, tenant)
            written, joint, book = [], [], None
            for (key, _), ids, embedding in zip(entries, tokenized, embeddings):
                pass_ = {"mode": "write", "entry": key, **({"embedding": embedding} if embedding is not None else {})}
                book = await internal_pass(engine, owner, pass_, ids)
                written.append({"key": key, "tokens": len(ids)})
                book = await _joint(engine, owner, book, joint)
        except SpecError as exc:
            return refuse(str(exc))
        groups = {key: g["id"] for g in book["groups"] for key in g["members"]}
        for item in written:
            item["group"] = groups.get(item["key"])
        return {"session_id": session_id, "written": written, "joint": joint, "book": book}

    @app.post("/sgl_memory/memory/forget")
    async def memory_forget(request: Request):
        try:
            session_id, tenant, keys = await parsed(request, parse_forget)
            owner = owner_of(session_id, tenant)
            book = await _forget(owner, keys)
        except SpecError as exc:
            return refuse(str(exc))
        return {"session_id": session_id, "forgotten": keys, "book": book}

    @app.get("/sgl_memory/memory")
    async def memory_book(session_id: str | None = None, tenant: str | None = None):
        try:
            serving()
            book = await _forget(owner_of(session_id, tenant), [])
        except SpecError as exc:
            return refuse(str(exc))
        return {"session_id": session_id, "book": book}

    async def _forget(owner: dict, keys: list[str]) -> dict:
        """A forget pass (no keys: the book as it stands). Its prompt is one token, never stored."""
        book = await internal_pass(engine, owner, {"mode": "forget", "forget": keys}, one_token(engine))
        return await _joint(engine, owner, book, [])
