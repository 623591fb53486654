"""BFCL v4 multi-turn: the tasks, BFCL's executable back-ends and BFCL's own checker.

Everything BFCL defines is imported from the pinned `bfcl-eval` package, not rewritten: the task
files with their function docs (`load_dataset_entry`), the docs' conversion to OpenAI tools
(`convert_to_tool`), the tool-call decoding (`convert_to_function_call`), the back-ends' execution
(`execute_multi_turn_func_call`), the held-out functions of `miss_func` and the prompt that hands
them over, the step limit, and the checker (`multi_turn_checker`: state and response checks after
every turn). The loop follows BFCL's function-calling handler (`inference_multi_turn_FC`): each
user turn is answered by steps of tool calls whose results go back as tool messages, until the
model answers in words; here that answer is the `respond` tool, because the small models need
`tool_choice: required` to call tools at all.

`multi_turn_long_context` is held out from development and training (README): `tasks` refuses it.
"""

from __future__ import annotations

import ast
import copy
import os
import tempfile
import uuid
from dataclasses import dataclass

# BFCL writes lock files under its project root (site-packages by default): keep them out of it
os.environ.setdefault("BFCL_PROJECT_ROOT", os.path.join(tempfile.gettempdir(), "sgl_memory_bfcl"))

from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC, MAXIMUM_STEP_LIMIT  # noqa: E402
from bfcl_eval.constants.enums import ModelStyle  # noqa: E402
from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker  # noqa: E402
from bfcl_eval.model_handler.utils import convert_to_function_call, convert_to_tool  # noqa: E402
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry  # noqa: E402

from .loop import Endpoint, Refused, label_next_calls  # noqa: E402

CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param")
HELD_OUT = ("multi_turn_long_context",)
RESPOND = {
    "type": "function",
    "function": {
        "name": "respond",
        "description": "Reply to the user in words and end your turn. Call it when the request is done, or when it "
        "cannot be done with the tools you have (then say what is missing).",
        "parameters": {
            "type": "object",
            "properties": {"message": {"type": "string", "description": "your reply"}},
            "required": ["message"],
        },
    },
}


@dataclass
class Task:
    category: str
    entry: dict  # BFCL's dataset entry, its function docs included
    ground_truth: list[list[str]]

    @property
    def id(self) -> str:
        return self.entry["id"]


def tasks(categories=None, limit: int | None = None) -> list[Task]:
    """The first `limit` tasks of each category (default: every development category), in BFCL's order."""
    out = []
    categories = categories or CATEGORIES
    for category in categories:
        if category in HELD_OUT or category not in CATEGORIES:
            raise ValueError(
                f"BFCL category {category!r} is not a development category; use {', '.join(CATEGORIES)}"
                + (" (it is held out for independent checks)" if category in HELD_OUT else "")
            )
        truth = {g["id"]: g["ground_truth"] for g in load_ground_truth_entry(category)}
        entries = load_dataset_entry(category)[:limit]
        out += [Task(category, e, truth[e["id"]]) for e in entries]
    return out


def tools(functions: list[dict]) -> list[dict]:
    return convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS) + [RESPOND]


def functions_at(task: Task, turn: int | None = None) -> list[dict]:
    """The function docs offered at a turn (None: by the last): the task's own plus every held-out
    one handed over by then."""
    held = task.entry.get("missed_function", {})
    return list(task.entry["function"]) + [
        d for t, docs in held.items() if turn is None or int(t) <= turn for d in docs
    ]


def tools_at(task: Task, turn: int) -> list[dict]:
    return tools(functions_at(task, turn))


def as_calls(task: Task, strings: list[str]) -> list[tuple[str, dict]]:
    """BFCL's call strings (its ground truth) as (name, keyword arguments); positional arguments take
    the names of the function doc's parameters in order."""
    docs = {d["name"]: d for d in functions_at(task)}
    out = []
    for s in strings:
        call = ast.parse(s, mode="eval").body
        params = list(docs[call.func.id]["parameters"]["properties"])
        kwargs = {params[i]: ast.literal_eval(a) for i, a in enumerate(call.args)}
        kwargs.update({k.arg: ast.literal_eval(k.value) for k in call.keywords})
        out.append((call.func.id, kwargs))
    return out


class Backends:
    """The task's BFCL back-end instances for one run. BFCL keeps them in a module-level dict under a
    name built from a model name and the task id; each run gets a name of its own (two methods
    running one task never share state) and `close` removes its instances."""

    def __init__(self, task: Task):
        self.task = task
        self.name = f"sglmem_{uuid.uuid4().hex[:12]}"
        self.names = {d["name"] for d in functions_at(task)}

    def execute(self, calls: list[tuple[str, dict]]) -> tuple[list[str], list[str]]:
        """Run calls in order; returns BFCL's call strings (what the checker replays) and the results.
        A call BFCL could not evaluate safely (unknown name, arguments that are not a JSON object,
        argument names that are not identifiers) is answered with an error and left out of the call
        strings."""
        strings, results = [], []
        for name, arguments in calls:
            if name not in self.names or "__unparsed__" in arguments or not all(k.isidentifier() for k in arguments):
                results.append(f"Error during execution: {name} is not a valid call of this task's functions")
                continue
            (string,) = convert_to_function_call([{name: arguments}])
            (result,), _ = multi_turn_utils.execute_multi_turn_func_call(
                [string],
                self.task.entry["initial_config"],
                self.task.entry["involved_classes"],
                self.name,
                self.task.id,
            )
            strings.append(string)
            results.append(result)
        return strings, results

    def score(self, turns: list[list[list[str]]]) -> dict:
        """BFCL's checker on the decoded calls of every turn (a list of steps, each a list of call strings)."""
        if len(turns) != len(self.task.ground_truth):
            return {"valid": False, "error_type": "multi_turn:force_terminated"}
        result = multi_turn_checker(
            turns, self.task.ground_truth, copy.deepcopy(self.task.entry), self.task.category, self.name
        )
        return {"valid": bool(result["valid"]), "error_type": result.get("error_type")}

    def close(self) -> None:
        prefix = self.name
        for key in [k for k in vars(multi_turn_utils) if k.startswith(prefix)]:
            delattr(multi_turn_utils, key)


def run(task: Task, endpoint: Endpoint, session_id: str, max_steps: int = MAXIMUM_STEP_LIMIT) -> dict:
    """One task through the server as BFCL's handler drives a model; returns the trajectory
    (`messages`, `steps` with each step's calls, results and costs), the non-completion reason
    (None, `turn_cap`, `overflow`, `error`) and BFCL's verdict."""
    backends = Backends(task)
    holdout = task.entry.get("missed_function", {})
    messages: list[dict] = []
    steps: list[dict] = []
    turns: list[list[list[str]]] = []
    reason = None
    try:
        for turn, asked in enumerate(task.entry["question"]):
            if str(turn) in holdout:  # BFCL's miss_func: the held-out functions arrive with this turn
                asked = [{"role": "user", "content": DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC}]
            messages += asked
            offered = tools_at(task, turn)
            decoded: list[list[str]] = []
            for step in range(max_steps + 2):
                if step > max_steps:  # BFCL's force-quit: more than MAXIMUM_STEP_LIMIT steps with calls
                    reason = "turn_cap"
                    break
                record = (reply := endpoint.ask(messages, offered, session_id)).record(turn, step, len(messages))
                steps.append(record)
                calls = [c for c in reply.calls if c.name != RESPOND["function"]["name"]]
                said = [c.arguments.get("message", "") for c in reply.calls if c not in calls]
                if calls:
                    strings, results = backends.execute([(c.name, c.arguments) for c in calls])
                    messages += reply.exchange(calls, results)
                    record.update(executed=strings, results=results)
                    if strings:
                        decoded.append(strings)
                if said or not calls:  # a reply in words ends the turn (BFCL: a step without calls)
                    messages.append(
                        {"role": "assistant", "content": " ".join(s for s in said if isinstance(s, str)) or reply.text}
                    )
                    break
            turns.append(decoded)
            if reason:
                break
    except Refused as exc:
        reason, error = exc.reason, str(exc)
    else:
        error = None
    try:
        verdict = backends.score(turns) if reason is None else {"valid": False, "error_type": reason}
    finally:
        backends.close()
    label_next_calls(steps)
    return {"messages": messages, "steps": steps, "decoded": turns, "reason": reason, "error": error, **verdict}
