"""One agent decision through the public OpenAI API, as any user's agent makes it.

The agent sends the whole conversation with its tools on every step (the server's radix cache, and
with sgl-memory the session's pruned path, make the resent history cheap); `tool_choice` is
"required" because the small models answer in text instead of calling a tool under "auto",
so every workload gives the model a tool that ends its turn or its task.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import requests

from bench.common import kv_costs
from sgl_memory.core.tree_fill import common_prefix


class Refused(RuntimeError):
    """A request the server did not answer; `reason` is the BCP non-completion it ends a task with."""

    reason = "error"


class Overflow(Refused):
    """The conversation no longer fits the model's context."""

    reason = "overflow"


class ServerError(Refused):
    """Any other refused or failed request."""


@dataclass
class Call:
    id: str
    name: str
    arguments: dict

    def message(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


@dataclass
class Reply:
    calls: list[Call]
    text: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    latency_s: float
    finish_reason: str | None = None  # "length": cut off by max_tokens (a call cut off there is lost)
    metrics: dict = field(default_factory=dict)  # the response's `sgl_memory` object ({} on plain SGLang)
    prompt_ids: list[int] = field(default_factory=list)  # the prompt's token ids as the server tokenised it
    output_ids: list[int] = field(default_factory=list)
    shared: int = 0  # how many leading prompt ids equal the session's previous prompt's

    def record(self, turn: int, step: int, prefix: int) -> dict:
        """The step's trace record: where it stood (`prefix`: how many messages its request held),
        what the model emitted, the server's metrics and the step's costs."""
        return {
            "turn": turn,
            "step": step,
            "prefix": prefix,
            "calls": [[c.name, c.arguments] for c in self.calls],
            "text": self.text,
            "metrics": self.metrics,
            **self.costs(),
            "token_ids": {"shared": self.shared, "prompt": self.prompt_ids[self.shared :], "output": self.output_ids},
        }

    def exchange(self, calls: list[Call], results: list[str]) -> list[dict]:
        """The messages the agent appends for calls it ran: its assistant message with them, then one
        tool message per result."""
        return [
            {"role": "assistant", "content": self.text or None, "tool_calls": [c.message() for c in calls]},
            *({"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, results)),
        ]

    def costs(self) -> dict:
        """The step's system cost: request size, prefix hit, live KV and KV reads."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "peak_request_tokens": self.prompt_tokens + self.output_tokens,
            "latency_s": self.latency_s,
            "finish_reason": self.finish_reason,
            **kv_costs(self.metrics, self.prompt_tokens, self.output_tokens),
        }


def windowed(messages: list[dict], exchanges: int, tokens: int | None = None, count=None) -> list[dict]:
    """What a KV-memory request carries: the system message, the last user message and the last
    `exchanges` exchanges after it (each from an assistant message on, so tool results keep their
    call); the server brings back the rest from the session's memory. With `tokens`, the oldest of
    those exchanges are left out as long as the ones kept hold more (`count`: a message's tokens),
    the last one always kept whole (its results are what the next step acts on)."""
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(system) - 1)
    tail = messages[last_user + 1 :]
    starts = [i for i, m in enumerate(tail) if m["role"] == "assistant"]
    first = max(len(starts) - exchanges, 0) if exchanges else len(starts)
    if tokens is not None:
        sizes = [sum(count(m) for m in tail[a:b]) for a, b in zip(starts, [*starts[1:], len(tail)])]
        while first < len(starts) - 1 and sum(sizes[first:]) > tokens:
            first += 1
    cut = starts[first] if first < len(starts) else len(tail)
    return system + messages[len(system) : last_user + 1][-1:] + tail[cut:]


def message_tokens(tokenizer):
    """A message's tokens as `windowed` counts them: its text and its calls' JSON (not the markup)."""
    return lambda m: len(
        tokenizer.encode((m.get("content") or "") + json.dumps(m.get("tool_calls") or ""), add_special_tokens=False)
    )


@dataclass
class Endpoint:
    """A server and what a method adds to each request: the `sgl_memory` field (None: plain SGLang)
    and, for KV memory, the window of messages it sends (None: the whole conversation)."""

    url: str
    memory: dict | None = None
    max_tokens: int = 256
    timeout_s: float = 600
    window: int | None = None
    window_tokens: int | None = None  # with window: the most tokens its exchanges hold (windowed)
    count: Callable[[dict], int] | None = None
    last_prompt: tuple[str, list[int]] = ("", [])  # (session, ids): what the next prompt's ids are stored against

    def ask(self, messages: list[dict], tools: list[dict], session_id: str, tool_choice="required") -> Reply:
        if self.window is not None:
            messages = windowed(messages, self.window, self.window_tokens, self.count)
        body = {
            "model": "default",
            "messages": messages,
            "tools": tools,
            "tool_choice": tool_choice,
            "temperature": 0,
            "max_tokens": self.max_tokens,
            "return_token_ids": True,
        }
        if self.memory is not None:
            body["sgl_memory"] = {**self.memory, "session_id": session_id}
        t0 = time.perf_counter()
        r = requests.post(self.url + "/v1/chat/completions", json=body, timeout=self.timeout_s)
        latency = time.perf_counter() - t0
        if r.status_code != 200:
            text = r.text[:500]
            if r.status_code == 400 and ("context length" in text or "longer than" in text):
                raise Overflow(text)
            raise ServerError(f"{r.status_code}: {text}")
        out = r.json()
        message = out["choices"][0]["message"]
        calls = []
        for i, call in enumerate(message.get("tool_calls") or []):
            raw = call["function"]["arguments"] or "{}"
            try:
                arguments = json.loads(raw)
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):  # kept for the trace; no back-end runs it
                arguments = {"__unparsed__": raw}
            calls.append(Call(call.get("id") or f"call_{i}", call["function"]["name"], arguments))
        usage = out["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        ids = out["choices"][0].get("prompt_token_ids") or []
        before = self.last_prompt[1] if self.last_prompt[0] == session_id else []
        shared = common_prefix(ids, before)
        self.last_prompt = (session_id, ids)
        return Reply(
            calls,
            message.get("content") or "",
            usage["prompt_tokens"],
            cached,
            usage["completion_tokens"],
            latency,
            out["choices"][0].get("finish_reason"),
            out.get("sgl_memory") or {},
            ids,
            out["choices"][0].get("response_token_ids") or [],
            shared,
        )


def prompt_token_ids(steps: list[dict]) -> list[list[int]]:
    """Each step's whole prompt ids from a trace, whose steps store theirs after what they share with
    the previous step's (`token_ids`: `shared`, `prompt`)."""
    out: list[list[int]] = []
    for step in steps:
        ids = step["token_ids"]
        out.append((out[-1][: ids["shared"]] if out else []) + ids["prompt"])
    return out


def label_next_calls(steps: list[dict], k: int = 5) -> None:
    """Future-action labels, as IntentKV trains its pruner on: each step gets `next_calls`, the
    [name, arguments] of the next k calls the agent made after it (later steps only)."""
    calls = [(i, call) for i, step in enumerate(steps) for call in step["calls"]]
    for i, step in enumerate(steps):
        step["next_calls"] = [call for j, call in calls if j > i][:k]
