"""Decision points of gold trajectories: what each method is scored on.

A trajectory is one agent session along its gold path; each point is the prompt the agent's
request holds there (`history`, rendered by the model's chat template as the server renders it)
and the gold next action (`gold`: the assistant message's tokens through its end-of-turn token).
Sources:
- `bfcl`: BFCL multi-turn development tasks (base, miss_func, miss_param; never long_context)
  replayed along their ground truth through BFCL's back-ends (bench/agent/bfcl.py); a point is
  every step whose gold action is a tool call (the turn-ending reply has no gold text);
- `locomo`: a LoCoMo dev conversation as a session: each LoCoMo session's dialogue is one user
  message (acknowledged), then the questions of categories 1-4 in a fixed shuffled order, each a
  point whose gold action is the dataset's answer, which stays in the history for the next.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field

LOCOMO_SYSTEM = "Answer the question about the conversation in a short phrase."


@dataclass
class Point:
    history: list[int]  # the request's prompt, generation prompt included
    gold: list[int]  # the gold next action's tokens, end-of-turn token included
    label: str  # where it is: step / question


@dataclass
class Trajectory:
    workload: str
    id: str
    points: list[Point] = field(default_factory=list)


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, generation: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=True, return_dict=False))


def _templated(message: dict) -> dict:
    """A message as the server's chat template sees it: SGLang parses tool-call arguments from the
    OpenAI JSON string into an object before rendering."""
    m = copy.deepcopy(message)
    for call in m.get("tool_calls") or []:
        if isinstance(call["function"]["arguments"], str):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return m


def point(tokenizer, messages: list[dict], gold: dict, tools: list[dict] | None, label: str) -> Point:
    """The prompt before `gold` and gold's tokens: the conversation rendered with gold appended
    must extend the prompt (both are the template's own output), up to gold's end-of-turn token."""
    msgs = [_templated(m) for m in messages]
    history = _render(tokenizer, msgs, tools, True)
    whole = _render(tokenizer, msgs + [_templated(gold)], tools, False)
    if whole[: len(history)] != history:
        raise ValueError(f"{label}: the template does not render the gold action after the prompt")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rest = whole[len(history) :]
    return Point(history, rest[: rest.index(end) + 1] if end in rest else rest, label)


def bfcl(tokenizer, per_category: int, skip: int = 0) -> list[Trajectory]:
    """BFCL tasks replayed along their ground truth (no server: the replier answers with it)."""
    from bench.agent import bfcl as B
    from bench.agent.loop import Call, Reply

    out = []
    for task in B.tasks(list(B.CATEGORIES), limit=skip + per_category):
        if int(task.id.rsplit("_", 1)[1]) < skip:
            continue
        gold = [calls for truth in task.ground_truth for calls in ([B.as_calls(task, truth)] if truth else []) + [None]]
        traj = Trajectory("bfcl", task.id)

        class Replier:
            def ask(self, messages, tools, session_id, tool_choice="required"):
                calls = gold.pop(0) if gold else None
                if calls is None:  # the turn ends: BFCL's reply in words has no gold text to score
                    return Reply([Call("r", "respond", {"message": "Done."})], "", 0, 0, 0, 0.0)
                reply = Reply([Call(f"call_{i}", n, a) for i, (n, a) in enumerate(calls)], "", 0, 0, 0, 0.0)
                action = reply.exchange(reply.calls, [""] * len(calls))[0]
                traj.points.append(point(tokenizer, messages, action, tools, f"step {len(traj.points)}"))
                return reply

        result = B.run(task, Replier(), "gold")
        if result["reason"] is None and result["valid"]:  # only replays BFCL's checker passes
            out.append(traj)
    return out


def locomo(tokenizer, conversations: list[int], questions: int, seed: int = 0) -> list[Trajectory]:
    from bench.locomo import data

    samples = data.load()
    out = []
    for c in conversations:
        turns = data.turns(samples[c])
        messages = [{"role": "system", "content": LOCOMO_SYSTEM}]
        for s in sorted({t.session for t in turns}):
            part = [t for t in turns if t.session == s]
            messages += [{"role": "user", "content": data.render(part)}, {"role": "assistant", "content": "Noted."}]
        qs = data.questions(samples[c], c)
        random.Random(seed).shuffle(qs)
        traj = Trajectory("locomo", f"conv{c}")
        for q in qs[:questions]:
            messages.append({"role": "user", "content": f"Question: {q.question}"})
            answer = {"role": "assistant", "content": str(q.answer)}
            traj.points.append(point(tokenizer, messages, answer, None, f"q{q.qa_index}"))
            messages.append(answer)
        out.append(traj)
    return out


SOURCES = {"bfcl": bfcl, "locomo": locomo}
