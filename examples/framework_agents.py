"""Agent frameworks on sgl-memory with no `sgl_memory` body field: the session is the
`x-session-id` header, and the server's `memory.window` turns their full-history requests into
memory mode (the latest messages stay, older turns come back as KV).

Three clients, each a multi-turn agent with one tool (`lookup`) that names its session by header:
the `openai` SDK (its own loop: a required call, then an answer from the result), the OpenAI Agents
SDK, and a LangGraph agent over LangChain's OpenAI chat model (each: one required call per user
turn, whose result ends the turn). Every request's `sgl_memory` metrics are read off the client's
HTTP transport (the frameworks keep them to themselves) and printed.

    cat > memory.yaml <<'EOF'
    intent: {enabled: true, budget: 96}
    memory: {enabled: true, placement: after_system, window: 128}
    EOF
    python -m sgl_memory.launch_server --model smollm2-135m-instruct --memory-config memory.yaml --port 30000
    python examples/framework_agents.py --framework langgraph --session demo-1

Pinned clients: `openai`, `openai-agents==0.6.2`, `langgraph==1.2.24`, `langchain-openai==1.1.9`
(scripts/requirements-dev.txt). The tool is sent `strict`, so the server constrains the call's
arguments to its schema: a 135M model writes them as `[]` otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import requests

SYSTEM = "You are a brief assistant. Use the lookup tool to read items."
TURNS = [
    "My locker code is 4812. Please remember it.",
    "Look up item A.",
    "Look up item B.",
    "Look up item C.",
    "What is my locker code?",
]


def lookup(item: str) -> str:
    """Read the sensors of an item."""
    return (
        f"Item {item}: "
        + ", ".join(f"sensor {j} read {(ord(item[:1] or 'x') * 37 + j * 11) % 100}" for j in range(12))
        + "."
    )


LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": lookup.__doc__,
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"item": {"type": "string"}},
            "required": ["item"],
            "additionalProperties": False,
        },
    },
}


class Transport:
    """The server's chat completion responses as a client's HTTP transport received them."""

    def __init__(self):
        self.responses: list[dict] = []

    def sync(self) -> httpx.Client:
        return httpx.Client(event_hooks={"response": [self._read]}, timeout=300)

    def asynchronous(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"response": [self._aread]}, timeout=300)

    def _read(self, response):
        response.read()
        self._keep(response)

    async def _aread(self, response):
        await response.aread()
        self._keep(response)

    def _keep(self, response):
        if response.url.path.endswith("/chat/completions"):
            if response.status_code != 200:
                raise RuntimeError(f"the server answered {response.status_code}: {response.text[:500]}")
            self.responses.append(response.json())


def model_name(url: str) -> str:
    return requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def run_openai_sdk(url: str, session: str, turns=TURNS) -> list[dict]:
    from openai import OpenAI

    transport = Transport()
    client = OpenAI(
        base_url=url + "/v1", api_key="none", default_headers={"x-session-id": session}, http_client=transport.sync()
    )
    model, messages = model_name(url), [{"role": "system", "content": SYSTEM}]
    for text in turns:
        messages.append({"role": "user", "content": text})
        out = client.chat.completions.create(
            model=model, messages=messages, tools=[LOOKUP_TOOL], tool_choice="required", temperature=0, max_tokens=64
        )
        call = out.choices[0].message.tool_calls[0]
        messages.append({"role": "assistant", "content": "", "tool_calls": [call.model_dump()]})
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": lookup(json.loads(call.function.arguments)["item"])}
        )
        out = client.chat.completions.create(
            model=model, messages=messages, tools=[LOOKUP_TOOL], tool_choice="none", temperature=0, max_tokens=16
        )
        messages.append({"role": "assistant", "content": out.choices[0].message.content or ""})
    return transport.responses


def run_agents_sdk(url: str, session: str, turns=TURNS) -> list[dict]:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # its traces go to OpenAI's servers by default
    transport = Transport()

    async def run() -> None:
        client = AsyncOpenAI(
            base_url=url + "/v1",
            api_key="none",
            default_headers={"x-session-id": session},
            http_client=transport.asynchronous(),
        )
        # the SDK's chat completions path sends tools without `strict`; `extra_body` sends the same one with it
        agent = Agent(
            name="reader",
            instructions=SYSTEM,
            tools=[function_tool(lookup)],
            model=OpenAIChatCompletionsModel(model_name(url), client),
            tool_use_behavior="stop_on_first_tool",
            model_settings=ModelSettings(
                temperature=0, max_tokens=64, tool_choice="required", extra_body={"tools": [LOOKUP_TOOL]}
            ),
        )
        history: list = []
        for text in turns:
            result = await Runner.run(agent, history + [{"role": "user", "content": text}], max_turns=2)
            history = result.to_input_list()

    asyncio.run(run())
    return transport.responses


def run_langgraph(url: str, session: str, turns=TURNS) -> list[dict]:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    transport = Transport()
    model = ChatOpenAI(
        model=model_name(url),
        base_url=url + "/v1",
        api_key="none",
        temperature=0,
        max_tokens=64,
        default_headers={"x-session-id": session},
        http_client=transport.sync(),
    )
    lookup_tool = tool(lookup, return_direct=True)
    graph = create_react_agent(
        model.bind_tools([lookup_tool], tool_choice="required", strict=True), [lookup_tool], prompt=SYSTEM
    )
    messages: list = []
    for text in turns:
        messages = graph.invoke({"messages": messages + [("user", text)]}, {"recursion_limit": 4})["messages"]
        if messages[-1].type != "tool":
            raise RuntimeError(f"the turn ended without the tool's result: {messages[-1]!r}")
    return transport.responses


FRAMEWORKS = {"openai": run_openai_sdk, "agents-sdk": run_agents_sdk, "langgraph": run_langgraph}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://localhost:30000")
    ap.add_argument("--framework", choices=FRAMEWORKS, default="openai")
    ap.add_argument("--session", default="framework-demo")
    args = ap.parse_args(argv)
    for i, response in enumerate(FRAMEWORKS[args.framework](args.url, args.session)):
        m = response.get("sgl_memory") or {}
        print(
            f"request {i + 1}: prompt {response['usage']['prompt_tokens']} tokens, "
            f"cached {(response['usage'].get('prompt_tokens_details') or {}).get('cached_tokens')}, "
            f"QueryMemory turns {m.get('query_memory_turns')}, windowed {m.get('windowed_tokens', 0)}, "
            f"recalled turns {m.get('retrieved_turns', [])}"
        )


if __name__ == "__main__":
    main()
