"""A search agent as an SGLang frontend program, one session per question, on sgl-memory.

The program is the loop of bench/agent's BrowseComp-Plus-shaped workload written with `sgl.function`:
at each step the model emits one action as JSON (constrained by a JSON schema: a tool and its
argument), the program runs the tool over the local corpus and appends its output, until the model
calls `answer`. `sgl_memory.frontend.MemoryEndpoint` sends the program's `session_id` and pruning
arguments as the `sgl_memory` field, so the session's history is pruned to a budget as it grows.

    python -m sgl_memory.launch_server --memory-config intent.yaml   # intent: {enabled: true}
    python examples/research_agent.py --url http://localhost:30000 --question "When did Melanie paint a sunrise?"

Run it from the repository root (it reads the corpus through bench/agent/bcp.py).
"""

from __future__ import annotations

import argparse
import json

import sglang as sgl

from bench.agent import bcp
from sgl_memory.frontend import MemoryEndpoint

ACTION = json.dumps(
    {
        "type": "object",
        "properties": {"tool": {"enum": ["search", "get_document", "answer"]}, "argument": {"type": "string"}},
        "required": ["tool", "argument"],
    }
)
ARGUMENT_NAMES = {"search": "query", "get_document": "docid"}
INSTRUCTIONS = (
    bcp.SYSTEM + ' Reply with one action as JSON: {"tool": "search", "argument": "<query>"}, '
    '{"tool": "get_document", "argument": "<docid>"} or {"tool": "answer", "argument": "<answer>"}.'
)


@sgl.function
def research(s, question, workload, session_id, budget=None, budget_mode=None, max_steps=6):
    s += sgl.system(INSTRUCTIONS)
    s += sgl.user(question)
    for step in range(max_steps):
        s += sgl.assistant(sgl.gen(f"action_{step}", max_tokens=96, json_schema=ACTION, temperature=0))
        try:
            action = json.loads(s[f"action_{step}"])
        except json.JSONDecodeError:  # cut off by max_tokens
            s += sgl.user("That action was cut off. Reply with one short JSON action.")
            continue
        if action["tool"] == "answer":
            s.set_var("answer", action["argument"])
            return
        s += sgl.user(
            "Tool output:\n" + workload.tool(action["tool"], {ARGUMENT_NAMES[action["tool"]]: action["argument"]})
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://localhost:30000")
    ap.add_argument("--question", default="When did Melanie paint a sunrise?")
    ap.add_argument("--session-id", default="research-1")
    ap.add_argument("--budget", type=int, default=512, help="history tokens kept live (budget_mode history)")
    args = ap.parse_args()
    sgl.set_default_backend(MemoryEndpoint(args.url))
    workload = bcp.Workload(bcp.Corpus(bcp.locomo_corpus()), [])
    state = research.run(
        question=args.question, workload=workload, session_id=args.session_id, budget=args.budget, budget_mode="history"
    )
    print("answer:", state["answer"] if "answer" in state else "(no answer within the step limit)")


if __name__ == "__main__":
    main()
