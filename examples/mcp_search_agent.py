"""Your own agent on sgl-memory: tools from an MCP server, the model through the OpenAI client.

The agent lists the MCP server's tools (here the BrowseComp-Plus-shaped `search` and `get_document`,
bench/agent/mcp_server.py; any MCP server works), offers them to the model with an `answer` tool,
and runs the calls the model makes through MCP until it answers. Every request names its session
and a history budget in the `sgl_memory` field, so the server prunes the growing tool output
(IntentKV) and reuses the session's prefix between steps.

    python -m sgl_memory.launch_server --memory-config intent.yaml      # intent: {enabled: true}
    python examples/mcp_search_agent.py --question "When did Melanie paint a sunrise?"

By default it starts the MCP server itself over stdio; `--mcp http://host:8000/mcp` uses a running
one (streamable HTTP). Run it from the repository root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from contextlib import asynccontextmanager

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamablehttp_client
from openai import OpenAI

ANSWER = {
    "type": "function",
    "function": {
        "name": "answer",
        "description": "Give the final answer and end the task.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    },
}
# tokens per reply: a call fits in the first; the forced answer gets room for a sentence or two
# (cut short, its JSON does not parse and the agent returns nothing)
MAX_TOKENS, ANSWER_TOKENS = 96, 256
SYSTEM = (
    "You are a deep-research agent. Use search to find documents and get_document to read one. "
    "When you know the answer, call answer with the exact answer only."
)


@asynccontextmanager
async def connect(mcp):
    """An MCP client session: `mcp` is a URL (streamable HTTP) or the parameters of a server to start
    over stdio."""
    transport = streamablehttp_client(mcp) if isinstance(mcp, str) else stdio_client(mcp)
    async with transport as (read, write, *_), ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def research(question: str, url: str, mcp, session_id: str, budget: int = 512, max_steps: int = 6) -> dict:
    """Returns the answer (None only if the model's last, forced answer did not parse) and each step's
    calls, tool outputs and `sgl_memory` metrics."""
    llm = OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none")
    async with connect(mcp) as tools_server:
        listed = await tools_server.list_tools()
        tools = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description or "", "parameters": t.inputSchema},
            }
            for t in listed.tools
        ] + [ANSWER]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        steps, last = [], False
        for i in range(max_steps):
            # the last step must answer: a bounded agent always returns one
            last = last or i == max_steps - 1
            choice = {"type": "function", "function": {"name": "answer"}} if last else "required"
            response = llm.chat.completions.create(
                model="default",
                messages=messages,
                tools=tools,
                tool_choice=choice,
                temperature=0,
                max_tokens=ANSWER_TOKENS if last else MAX_TOKENS,
                extra_body={"sgl_memory": {"session_id": session_id, "budget": budget, "budget_mode": "history"}},
            )
            message = response.choices[0].message
            step = {"calls": [], "outputs": [], "sgl_memory": response.model_extra.get("sgl_memory")}
            steps.append(step)
            calls = message.tool_calls or []
            for call in calls:
                arguments = json.loads(call.function.arguments or "{}")
                step["calls"].append([call.function.name, arguments])
                if call.function.name == "answer":
                    return {"answer": arguments.get("answer"), "steps": steps}
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content,
                    "tool_calls": [c.model_dump(exclude_none=True) for c in calls],
                }
            )
            for call in calls:
                result = await tools_server.call_tool(call.function.name, json.loads(call.function.arguments or "{}"))
                output = "\n".join(part.text for part in result.content if part.type == "text") or "null"
                step["outputs"].append(output)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
            if last:
                break  # the forced answer did not parse
            # a reply without a call ends the research: the next step is the forced answer
            last = not calls
        return {"answer": None, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://localhost:30000")
    ap.add_argument("--mcp", help="a running MCP server's URL (default: start bench.agent.mcp_server over stdio)")
    ap.add_argument("--question", default="When did Melanie paint a sunrise?")
    ap.add_argument("--session-id", default="mcp-agent-1")
    ap.add_argument("--budget", type=int, default=512, help="history tokens kept live (budget_mode history)")
    args = ap.parse_args()
    mcp = args.mcp or StdioServerParameters(
        command=sys.executable, args=["-m", "bench.agent.mcp_server", "--transport", "stdio"]
    )
    result = asyncio.run(research(args.question, args.url, mcp, args.session_id, args.budget))
    print("answer:", result["answer"])


if __name__ == "__main__":
    main()
