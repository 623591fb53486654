"""sgl-memory's HTTP surface on SGLang's FastAPI app (hook: patches/hooks.yaml).

- `GET /sgl_memory/info` and `GET /sgl_memory/stats`;
- the per-request `sgl_memory` field on `/generate`, `/v1/chat/completions`, `/v1/completions` and
  `/v1/responses`: validated here (a bad field is a 400 before anything reaches the engine) and
  moved into SGLang's `custom_params`, which carries it to the scheduler; the session id and the
  tenant may come from headers instead (`x-session-id`, `x-tenant-id`: `with_headers`), a
  chain of `/v1/responses` is one session by itself (`with_chain`), and SGLang's own hint envelope
  (`kv_hints`, on every one of those routes) hands its actions to the mechanisms (`with_kv_hints`);
- bounds on those bodies that SGLang does not check: a size cap (413) and JSON nested too deeply
  to parse (400; SGLang's own parser would answer it with a 500);
- a prompt of zero tokens, or with a token id outside the vocabulary, is a 400 (TokenizerManager
  hook): SGLang's scheduler would crash on either and take the whole server down;
- a request whose shape SGLang's input processing cannot handle is a 400, not a 500;
- OpenAI responses get the request's metrics as a top-level `sgl_memory` object (native responses
  carry them in `meta_info`);
- `GET /sgl_memory/sessions`: the sessions the server holds, paged, no contents (`list_sessions`);
- `GET /sgl_memory/integrity`: the tree's integrity problems (engine/integrity.py), none
  when it is whole: an operator's (and the tests') check that every KV slot is owned once.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from contextvars import ContextVar
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from sglang.srt.managers.io_struct import GetInternalStateReq
from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

from sgl_memory import SGLANG_VERSION, __version__, cpu_dtype, kv_pool
from sgl_memory.core import mechanism, prometheus
from sgl_memory.core.config import MemoryConfig, SessionSources, from_env
from sgl_memory.core.request import FIELD, KV_HINTS, SpecError, check_id, check_served, encode, parse
from sgl_memory.core.metrics import STATS
from sgl_memory.engine import front
from sgl_memory.engine.hooks import INTEGRITY_KEY, SESSIONS_KEY

NATIVE = "/generate"
RESPONSES = "/v1/responses"
OPENAI = ("/v1/chat/completions", "/v1/completions", RESPONSES)
# /v1/responses bodies have no custom_params (SGLang's ResponsesRequest drops unknown fields): the
# field rides this context variable from the middleware to the to_sampling_params hook, both of
# which run in the request's own task
RESPONSES_FIELD: ContextVar = ContextVar("sgl_memory_responses_field", default=None)
MAX_BODY_BYTES = 64 << 20  # a full-context prompt is well under 1 MiB of JSON; a batch of them fits too
SESSION_HEADER, TENANT_HEADER = "x-session-id", "x-tenant-id"


def mount(server_args, *args, **kwargs):
    """BEFORE hook on `http_server.launch_server`: add the routes once, then let it start."""
    from sglang.srt.entrypoints.http_server import app

    if any(getattr(r, "path", None) == "/sgl_memory/info" for r in app.routes):
        return None
    config = from_env()
    prometheus.enable(server_args)
    choice = cpu_dtype.announced()
    dtype = (
        dataclasses.asdict(choice)
        if choice
        else {
            "dtype": server_args.dtype,
            "kv_cache_dtype": server_args.kv_cache_dtype,
            "source": "sglang",
            "reason": "not chosen by sgl_memory.launch_server (a GPU server, or SGLang's own launcher)",
        }
    )

    pool = kv_pool.announced()
    kv_pool_info = (
        dataclasses.asdict(pool)
        if pool
        else {"tokens": server_args.max_total_tokens, "source": "sglang (not sized by sgl_memory.launch_server)"}
    )

    @app.get("/sgl_memory/info")
    async def sgl_memory_info():
        return {
            "version": __version__,
            "sglang_version": SGLANG_VERSION,
            "radix_cache_backend": server_args.radix_cache_backend,
            "attention_backend": server_args.attention_backend,
            "dtype": dtype,
            "kv_pool": kv_pool_info,
            "config": config.as_dict(),
        }

    @app.get("/sgl_memory/stats")
    async def sgl_memory_stats():
        return STATS.snapshot()

    engine = front.TokenizerEngine()

    @app.get("/sgl_memory/sessions")
    async def sgl_memory_sessions(request: Request):
        try:
            page = session_page(dict(request.query_params), request.headers.raw, config.sessions)
        except (SpecError, PermissionError) as exc:
            status = 403 if isinstance(exc, PermissionError) else 400
            return JSONResponse(error_body(status, str(exc)), status_code=status)
        states = await scheduler_state(engine.manager, SESSIONS_KEY)
        return list_sessions((states[0] or []) if states else [], *page)

    @app.get("/sgl_memory/integrity")
    async def sgl_memory_integrity():
        problems = [p for state in await scheduler_state(engine.manager, INTEGRITY_KEY) for p in state or ()]
        return {"whole": not problems, "problems": problems}

    for cls in mechanism.ordered():
        cls.mount(app, config, engine)
    app.add_middleware(MemoryFieldMiddleware, config=config)
    return None


async def scheduler_state(manager, key: str) -> list:
    """Each scheduler's (one per data-parallel rank) answer under `key`: SGLang's internal-state
    request named by its rid, which tells sessions_state_hook what to compute (None where it did not)."""
    manager.auto_create_handle_loop()
    responses = await manager.get_internal_state_communicator(GetInternalStateReq(rid=key))
    return [response.internal_state.get(key) for response in responses]


def with_headers(raw, headers: list[tuple[bytes, bytes]], sources: SessionSources):
    """The request's `sgl_memory` field with what its headers name: `x-session-id` fills in a
    session id the field lacks (the field's own wins), `x-tenant-id` names the tenant where the
    operator allows it (a field naming another tenant is refused: the header is the gateway's).
    Raises SpecError naming the header."""
    found: dict[str, list[str]] = {SESSION_HEADER: [], TENANT_HEADER: []}
    for name, value in headers:
        key = name.decode("latin-1").lower()
        if key in found:
            found[key].append(value.decode("latin-1"))
    (session, tenant) = (_one(found[h], h) for h in (SESSION_HEADER, TENANT_HEADER))
    if (session is None and tenant is None) or not isinstance(raw, (dict, type(None))):
        return raw  # a field that is not an object: parse() refuses it
    field = dict(raw or {})
    if session is not None:
        if not sources.session_header:
            raise SpecError(
                f"header {SESSION_HEADER}: sessions named by a header are off on this server "
                "(sessions.session_header: false)"
            )
        field.setdefault("session_id", check_id(session, "session_id", f"header {SESSION_HEADER}"))
    if tenant is not None:
        if not sources.tenant_header:
            raise SpecError(
                f"header {TENANT_HEADER}: tenants named by a header are off on this server "
                "(sessions.tenant_header: false)"
            )
        check_id(tenant, "tenant", f"header {TENANT_HEADER}")
        if field.get("tenant", tenant) != tenant:
            raise SpecError(
                f"{FIELD}.tenant {field['tenant']!r} differs from header {TENANT_HEADER} {tenant!r}, "
                "which names the tenant here"
            )
        field["tenant"] = tenant
    return field


def with_chain(raw, body: dict):
    """/v1/responses: a chain of responses (each naming the one before as `previous_response_id`)
    is one session, named after the chain's first response. A response the client does not name
    (`request_id`) is named here `<first>.<hex>`, so its chain is found from its id alone, after a
    restart too. A session named by the field or a header wins; ids chosen by the client chain
    only one step (their first part names the session)."""
    if not isinstance(raw, (dict, type(None))) or (raw or {}).get("session_id"):
        return raw
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        return raw  # SGLang refuses it
    first = previous.split(".", 1)[0] if previous else None
    if "request_id" not in body:
        body["request_id"] = f"{first}.{uuid.uuid4().hex}" if first else f"resp_{uuid.uuid4().hex}"
    session = first or str(body["request_id"]).split(".", 1)[0]
    try:
        check_id(session, "session_id")
    except SpecError:
        return raw  # not an id a session can have: the response is served without one
    return {**(raw or {}), "session_id": session}


def with_kv_hints(raw, body: dict, path: str, config: MemoryConfig):
    """The request's `sgl_memory` field with the actions of SGLang's hint envelope (`kv_hints`,
    sglang/srt/managers/kv_hints.py) under the field's own `kv_hints`, for the mechanisms that read
    it (the persist mechanism validates the payloads of the actions it implements and ignores the
    rest). The envelope is checked as SGLang checks it: a malformed one is a SpecError (400).
    /generate keeps it in the body, which SGLang carries to the scheduler's request; the OpenAI
    routes, whose bodies have no such field, lose it once read."""
    if isinstance(raw, dict) and KV_HINTS in raw:
        raise SpecError(f"{FIELD}.{KV_HINTS} is the server's own key: send the envelope as the body's {KV_HINTS}")
    if KV_HINTS not in body:
        return raw
    value = body[KV_HINTS] if path == NATIVE else body.pop(KV_HINTS)
    if value is None or not isinstance(raw, (dict, type(None))):
        return raw  # no envelope; or a field that is not an object, which parse() refuses
    if isinstance(value, list):
        raise SpecError(f"{KV_HINTS}: one envelope per request here (a batch's list of envelopes is not read)")
    try:
        envelope = decode_kv_hints_envelope(value)
    except ValueError as exc:
        raise SpecError(f"{KV_HINTS}: {exc}") from None
    read = any(KV_HINTS in cls.fields and config.section(cls.name).enabled for cls in mechanism.ordered())
    if not read or not envelope.actions:
        return raw  # nothing here implements an action: ignored, as the envelope's contract says
    actions = [{"type": a.action_type, "version": a.action_version, "payload": a.payload} for a in envelope.actions]
    return {**(raw or {}), KV_HINTS: actions}


MAX_PAGE = 1000  # sessions per page of GET /sgl_memory/sessions


def session_page(
    query: dict[str, str], headers: list[tuple[bytes, bytes]], sources: SessionSources
) -> tuple[str | None, int, int]:
    """GET /sgl_memory/sessions' query: (tenant, offset, limit). A caller whose gateway names its
    tenant (x-tenant-id, where allowed) sees that tenant's sessions only: asking for another's is a
    PermissionError (403). Bad parameters: SpecError (400) naming the parameter."""
    unknown = sorted(set(query) - {"tenant", "offset", "limit"})
    if unknown:
        raise SpecError(f"unknown query parameter(s) {', '.join(unknown)}; allowed: tenant, offset, limit")
    offset, limit = _count(query, "offset", 0, 0, None), _count(query, "limit", 100, 1, MAX_PAGE)
    caller = with_headers(None, headers, sources)  # checks the header as the generate routes do
    caller = (caller or {}).get("tenant")
    asked = check_id(query.get("tenant"), "tenant", "query parameter tenant")
    if caller is not None and asked not in (None, caller):
        raise PermissionError(f"header {TENANT_HEADER} limits this caller to tenant {caller!r}")
    return caller or asked, offset, limit


def _count(query: dict[str, str], name: str, default: int, low: int, high: int | None) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) < low or (high is not None and int(raw) > high):
        raise SpecError(
            f"query parameter {name} must be an integer from {low}{f' to {high}' if high else ' up'}, got {raw!r}"
        )
    return int(raw)


def list_sessions(sessions: list[dict], tenant: str | None, offset: int, limit: int) -> dict:
    """One page of the sessions (as the scheduler described them), most recently used first, of
    one tenant where `tenant` is given (the default tenant: sessions that name none)."""
    if tenant is not None:
        sessions = [s for s in sessions if (s.get("tenant") or "") == tenant]
    ordered = sorted(sessions, key=lambda s: s.get("last_use", 0.0), reverse=True)
    return {"total": len(ordered), "offset": offset, "limit": limit, "sessions": ordered[offset : offset + limit]}


def _one(values: list[str], header: str) -> str | None:
    if len(set(values)) > 1:
        raise SpecError(f"header {header} is given {len(values)} times with different values")
    return values[0] if values else None


def move_field(path: str, body: dict, config: MemoryConfig) -> dict:
    """Validate and move the `sgl_memory` field into `custom_params`; raises SpecError."""
    if FIELD not in body:
        return body
    raw = body.pop(FIELD)
    check_served(parse(raw), config)
    if path == RESPONSES:
        RESPONSES_FIELD.set(raw)
    elif path == NATIVE:
        params = body.get("sampling_params")
        targets = params if isinstance(params, list) else [body.setdefault("sampling_params", params or {})]
        for sp in targets:
            if not isinstance(sp, dict):
                raise SpecError("sampling_params must be an object to carry sgl_memory")
            sp["custom_params"] = encode(sp.get("custom_params"), raw)
    else:
        custom = body.get("custom_params")
        if custom is not None and not isinstance(custom, dict):
            raise SpecError("custom_params must be an object to carry sgl_memory")
        body["custom_params"] = encode(custom, raw)
    return body


class MemoryFieldMiddleware:
    """Plain ASGI middleware: rewrites request bodies on the generate routes, and OpenAI JSON responses."""

    def __init__(self, app, config: MemoryConfig):
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send):
        path = scope.get("path")
        if scope["type"] != "http" or scope.get("method") != "POST" or (path != NATIVE and path not in OPENAI):
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY_BYTES:
                prometheus.BAD_REQUESTS.labels("size").inc()
                return await _send_error(send, 413, f"request body over {MAX_BODY_BYTES} bytes")
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            data = json.loads(body)
        except RecursionError:
            prometheus.BAD_REQUESTS.labels("json").inc()
            return await _send_error(send, 400, "request body is JSON nested too deeply to parse")
        except ValueError:
            data = None  # SGLang answers malformed JSON itself
        if isinstance(data, dict):
            try:
                raw = with_headers(data.get(FIELD), scope["headers"], self.config.sessions)
                if path == RESPONSES and self.config.sessions.response_chains:
                    raw = with_chain(raw, data)
                dropped = path != NATIVE and KV_HINTS in data  # read here: the body goes on without it
                raw = with_kv_hints(raw, data, path, self.config)
                if raw is not None:
                    body = json.dumps(move_field(path, {**data, FIELD: raw}, self.config)).encode()
                elif dropped:
                    body = json.dumps(data).encode()
            except SpecError as exc:
                prometheus.BAD_REQUESTS.labels("field").inc()
                return await _send_error(send, 400, str(exc))
        scope = dict(
            scope,
            headers=[(k, v) for k, v in scope["headers"] if k != b"content-length"]
            + [(b"content-length", str(len(body)).encode())],
        )
        request = _replay([{"type": "http.request", "body": body, "more_body": False}], receive)
        await self.app(scope, request, _with_metrics(send) if path in OPENAI else send)


def _replay(messages, receive):
    pending = list(messages)

    async def replay():
        return pending.pop(0) if pending else await receive()

    return replay


def _with_metrics(send):
    """Add the request's metrics as `sgl_memory` to an OpenAI response: a JSON one is buffered and
    rewritten; a streamed one (server-sent events) gets one more chunk before `data: [DONE]`."""
    state: dict[str, Any] = {"start": None, "chunks": [], "stream": None}

    async def wrapped(message):
        if message["type"] == "http.response.start":
            kind = dict(message.get("headers", [])).get(b"content-type", b"")
            if b"text/event-stream" in kind:
                state["stream"] = MetricsChunk()
            if b"application/json" not in kind:
                state["start"] = False
                return await send(message)
            state["start"] = message
            return None
        if state["stream"] is not None and message["type"] == "http.response.body":
            body = state["stream"].feed(message.get("body", b""), last=not message.get("more_body", False))
            return await send(dict(message, body=body))
        if state["start"] is False or message["type"] != "http.response.body":
            return await send(message)
        state["chunks"].append(message.get("body", b""))
        if message.get("more_body", False):
            return None
        body = b"".join(state["chunks"])
        try:
            data = json.loads(body)
            metrics = STATS.lookup(data.get("id")) if isinstance(data, dict) else None
            if metrics is not None:
                data[FIELD] = metrics
                body = json.dumps(data).encode()
        except (ValueError, RecursionError):
            pass  # not ours to rewrite: the response goes out as SGLang made it
        start = state["start"]
        headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
        await send(dict(start, headers=headers + [(b"content-length", str(len(body)).encode())]))
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return wrapped


class MetricsChunk:
    """A streamed chat or text completion's events, passed on as they come, with one chunk more
    before `data: [DONE]`: the response's id, object, model and creation time, no choices (as the
    usage chunk has), and `sgl_memory` (the request has finished when SGLang sends [DONE]). A
    streamed /v1/responses has no [DONE]: its last event's response (completed, or incomplete at
    max_output_tokens, or failed) gets it."""

    DONE = b"data: [DONE]"
    FINAL = tuple(b"event: response.%s\ndata: " % end for end in (b"completed", b"incomplete", b"failed"))

    def __init__(self):
        self.pending = b""  # an event not complete yet (a body message may end inside one)
        self.head: dict | None = None  # what the added chunk copies from the stream's first chunk

    def feed(self, data: bytes, last: bool) -> bytes:
        events = (self.pending + data).split(b"\n\n")
        self.pending = b"" if last else events.pop()
        out = []
        for event in events:
            if event.startswith(b"data: {") and self.head is None:
                try:
                    first = json.loads(event[len(b"data: ") :])
                    self.head = {k: first.get(k) for k in ("id", "object", "created", "model")}
                except (ValueError, RecursionError):
                    pass
            elif event.strip() == self.DONE and self.head is not None:
                metrics = STATS.lookup(self.head["id"])
                if metrics is not None:
                    out.append(b"data: " + json.dumps({**self.head, "choices": [], FIELD: metrics}).encode())
            elif event.startswith(self.FINAL):
                event = self._final(event)
            out.append(event)
        return b"\n\n".join(out) + (b"" if last else b"\n\n" if out else b"")

    def _final(self, event: bytes) -> bytes:
        head, data = event.split(b"data: ", 1)
        try:
            payload = json.loads(data)
            response = payload.get("response")
            metrics = STATS.lookup(response.get("id")) if isinstance(response, dict) else None
        except (ValueError, RecursionError, AttributeError):
            return event  # not ours to rewrite
        if metrics is None:
            return event
        response[FIELD] = metrics
        return head + b"data: " + json.dumps(payload).encode()


def responses_field_hook(result, request, *args, **kwargs):
    """AFTER hook on ResponsesRequest.to_sampling_params: a /v1/responses request's field goes into
    its sampling params' custom_params, as the other routes' does in their bodies."""
    raw = RESPONSES_FIELD.get()
    if raw is not None and isinstance(result, dict):
        result["custom_params"] = encode(result.get("custom_params"), raw)
    return result


def refuse_unservable_input(manager, obj, input_ids, *args, **kwargs):
    """BEFORE hook on TokenizerManager._validate_one_request, which every prompt passes after
    tokenization (native, OpenAI, batches, the memory probe). A ValueError here is answered with a
    400; past this point either of these would crash the scheduler, and with it the whole server:
    - zero tokens (the rotary embedding of zero rows);
    - a token id outside the model's vocabulary (the embedding lookup)."""
    if input_ids is None or getattr(obj, "input_embeds", None) is not None:
        return None
    if hasattr(obj, "contains_mm_input") and obj.contains_mm_input():
        return None  # the multimodal processor makes the ids
    if len(input_ids) == 0:
        raise ValueError("The input is empty: a prompt needs at least one token")
    vocab = manager.model_config.vocab_size
    low, high = min(input_ids), max(input_ids)
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids holds token id {low if low < 0 else high}, outside the vocabulary [0, {vocab})")
    return None


MALFORMED = (TypeError, IndexError, KeyError, AttributeError)


async def generate_hook(original, manager, obj, request=None):
    """AROUND hook on TokenizerManager.generate_request: the mechanisms' look at the request
    (engine/front.py's generate_hook), inside one rule for what goes wrong. Until the first output
    comes back, the request is being normalised, tokenised and validated: a shape of input SGLang's
    code does not expect (an empty list of sampling params, a list where an object goes) then
    surfaces as a TypeError, IndexError, KeyError or AttributeError, which SGLang answers with a
    500. It is the client's error: a ValueError, which SGLang answers with a 400. (One hook, not
    two on one target: SGLang warns at every start that stacked AROUND hooks may skip each other.)"""
    started = False
    try:
        async for out in front.generate_hook(original, manager, obj, request):
            started = True
            yield out
    except MALFORMED as exc:
        if started:
            raise
        raise ValueError(f"malformed request: {type(exc).__name__}: {exc}") from exc


ERROR_KINDS = {400: "BadRequestError", 403: "Forbidden", 413: "RequestTooLarge"}


def error_body(status: int, message: str) -> dict:
    """An error answer in the shape SGLang's OpenAI routes use."""
    return {"error": {"message": message, "type": ERROR_KINDS[status], "code": status}}


async def _send_error(send, status: int, message: str) -> None:
    await _send_json(send, status, error_body(status, message))


async def _send_json(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
