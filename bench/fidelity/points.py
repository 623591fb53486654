"""Decision points of gold trajectories: what each method is scored on.

A trajectory is one agent session along its gold path; each point is the prompt the agent's
request holds there (`history`, rendered by the model's chat template as the server renders it)
and the gold next action (`gold`: the assistant message's tokens through its end-of-turn token).
Sources:
- `bfcl`: BFCL multi-turn development tasks (base, miss_func, miss_param; never long_context)
  replayed along their ground truth through BFCL's back-ends (bench/agent/bfcl.py); a point is
  every step whose gold action is a tool call (the turn-ending reply has no gold text);
- `locomo`: LoCoMo dev questions (categories 1-4, `bench/locomo`'s stratified pick), each its own
  trajectory of one point: the prompt is the whole transcript as one user message, acknowledged,
  then the question (what the reference and the pruning methods serve), the gold action is the
  dataset's answer. A point also carries the prompts of the methods that replace the transcript
  (`alternates`): the question alone (KV memory places retrieved blocks before it; the memory is
  the conversation, ingested once per `group`) and the question after the turns text retrieval
  picks within the same KV budget (and within twice that). The memory records each LoCoMo session as one turn (a request
  that extends the one before by the session's lines). Questions are independent (one session each), so the intervals
  resample questions (of three conversations: they say nothing of other conversations);
- `bcp`: the BCP-shaped search workload along an oracle's path (search, read the evidence, answer),
  LoCoMo dev questions of every conversation, a point per action;
- `textworld`: TextWorld cooking games played along their walkthroughs, a point every step.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

TEXT_BUDGET = 1024  # tokens of retrieved turns: what KV memory places (its `placed_tokens`)
LARGE_BUDGET = 2048  # the same at twice the context: alternate "text@2048"


@dataclass
class Point:
    history: list[int]  # the request's prompt, generation prompt included
    gold: list[int]  # the gold next action's tokens, end-of-turn token included
    label: str  # where it is: step / question
    alternates: dict[str, list[int]] = field(default_factory=dict)  # other methods' prompts for the same gold


@dataclass
class Trajectory:
    workload: str
    id: str
    points: list[Point] = field(default_factory=list)
    group: str = ""  # trajectories that share a memory (a LoCoMo conversation)
    # the requests that record the memory, once per group, in order: each extends the one before
    # and is recorded as the memory's next turn (a LoCoMo conversation: one per session)
    ingest: list[list[int]] | None = None


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, generation: bool) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation, tokenize=True, return_dict=False
        )
    )


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


def _asked(context: str | None, question: str) -> list[dict]:
    """The messages of a LoCoMo question: the conversation (or an excerpt) is a user message of
    its own, acknowledged, before the question's, so that pruning, which keeps the latest user
    message whole, can drop it; without a context, the question alone (KV memory's prompt)."""
    from bench.locomo import prompts

    before = []
    if context is not None:
        before = [
            {"role": "user", "content": prompts.CONTEXT_HEADER + context},
            {"role": "assistant", "content": "Noted."},
        ]
    return [
        {"role": "system", "content": prompts.SYSTEM},
        *before,
        {"role": "user", "content": f"Question: {question}"},
    ]


def locomo(tokenizer, conversations: list[int], questions: int, seed: int = 0) -> list[Trajectory]:
    from bench.locomo import data, metrics, prompts
    from bench.locomo.retrieval import TurnRetriever

    samples, embedder = data.load(), metrics.minilm()
    out = []
    for c in conversations:
        turns = data.turns(samples[c])
        transcript = data.render(turns)
        ids = prompts.ingest_ids(tokenizer, transcript)
        ingest = [ids[:end] for end in prompts.session_ends(turns, prompts.ingest_turn_of_tokens(tokenizer, turns))]
        retriever = TurnRetriever(embedder, tokenizer, turns)
        for q in data.stratified(data.questions(samples[c], c), questions, seed):
            answer, label = {"role": "assistant", "content": str(q.answer)}, f"q{q.qa_index} cat{q.category}"
            pt = point(tokenizer, _asked(transcript, q.question), answer, None, label)
            contexts = {
                "question": None,
                "text": data.render(retriever.pick(q.question, TEXT_BUDGET)),
                f"text@{LARGE_BUDGET}": data.render(retriever.pick(q.question, LARGE_BUDGET)),
            }
            for name, context in contexts.items():
                other = point(tokenizer, _asked(context, q.question), answer, None, label)
                if other.gold != pt.gold:  # gold log-likelihoods compare only over the same tokens
                    raise ValueError(f"{label}: the template renders the answer differently after the {name} prompt")
                pt.alternates[name] = other.history
            out.append(Trajectory("locomo", f"conv{c}-q{q.qa_index}", [pt], f"conv{c}", ingest))
    return out


BCP_DOCUMENTS = 2  # evidence documents an oracle reads at most: a history of about 5k tokens


def bcp(tokenizer, per_conversation: int, seed: int = 0) -> list[Trajectory]:
    """The BCP-shaped search workload (bench/agent/bcp.py over its offline corpus, a document per
    LoCoMo dev session) along an oracle's path: search with the question, read the sessions its
    evidence names (the first BCP_DOCUMENTS, in order), answer with the gold answer. A point per
    action, so the last one's likelihood (the answer's value) needs what the documents said, and
    the search results and documents before it are what pruning chooses among. Questions whose
    evidence names no session are skipped."""
    import re

    from bench.agent import bcp as B
    from bench.agent.loop import Call, Reply
    from bench.locomo import data

    work = B.Workload(B.Corpus(B.locomo_corpus()), [])
    out = []
    for c, sample in enumerate(data.load()):
        for q in data.stratified(data.questions(sample, c), per_conversation, seed):
            docs = list(dict.fromkeys(f"c{c}s{n}" for e in q.evidence for n in re.findall(r"D(\d+):", e)))
            docs = [d for d in docs if d in work.corpus.by_id][:BCP_DOCUMENTS]
            if not docs:
                continue
            actions = [
                ("search", {"query": q.question}),
                *(("get_document", {"docid": d}) for d in docs),
                ("answer", {"answer": q.answer}),
            ]
            messages = [{"role": "system", "content": B.SYSTEM}, {"role": "user", "content": q.question}]
            traj = Trajectory("bcp", f"c{c}-q{q.qa_index}")
            for i, (name, arguments) in enumerate(actions):
                call = Call(f"call_{i}", name, arguments)
                turn = Reply([call], "", 0, 0, 0, 0.0).exchange([call], [work.tool(name, arguments)])
                traj.points.append(point(tokenizer, messages, turn[0], B.TOOLS, f"{name} cat{q.category}"))
                messages += turn
            out.append(traj)
    return out


TEXTWORLD_SEED = 200  # games seed .. seed + n - 1 (bench/keep_textworld plays 100-105)
TEXTWORLD_SYSTEM = (
    "You are playing a text adventure game. {objective} Answer with exactly one of the valid commands and nothing else."
)


def textworld(tokenizer, games: int, seed: int = TEXTWORLD_SEED) -> list[Trajectory]:
    """TextWorld cooking games (bench/keep_textworld's settings) played along their walkthroughs as
    an agent's conversation: each user message is the last observation (the game's feedback) with
    the valid commands, each gold action the walkthrough's next command, so a point is every step
    and its history every observation and command before it (the recipe read, the rooms seen).
    Walkthrough commands that the game does not list as valid there are no-ops and are skipped."""
    import tempfile
    from pathlib import Path

    from bench import keep_textworld as tw

    work = Path(tempfile.gettempdir()) / "sgl-memory-textworld"
    work.mkdir(exist_ok=True)
    out = []
    for g in range(seed, seed + games):
        env = tw.start(tw.make_game(g, work))
        state = env.reset()
        messages = [{"role": "system", "content": TEXTWORLD_SYSTEM.format(objective=tw.clean(state["objective"]))}]
        traj, text = Trajectory("textworld", f"game{g}"), tw.clean(state["description"])
        for step, command in enumerate(state["extra.walkthrough"]):
            if command not in state["admissible_commands"]:
                continue  # a no-op of the walkthrough ("open fridge" once it is open): not a decision
            messages.append(
                {"role": "user", "content": f"{text}\n\nValid commands: {', '.join(state['admissible_commands'])}"}
            )
            gold = {"role": "assistant", "content": command}
            traj.points.append(point(tokenizer, messages, gold, None, f"step {step}"))
            messages.append(gold)
            state, _, _ = env.step(command)
            text = tw.clean(state.feedback)
        env.close()
        out.append(traj)
    return out


SOURCES = {"bfcl": bfcl, "bcp": bcp, "locomo": locomo, "textworld": textworld}


def add_size_options(ap) -> None:
    """The options that size each workload's trajectories (bench/fidelity's and
    scripts/train_pruner's), with the sizes of the fidelity tables (docs/intent.md) as defaults."""
    ap.add_argument("--bfcl-per-category", type=int, default=30)
    ap.add_argument("--bcp-questions", type=int, default=14, help="per LoCoMo dev conversation (about 3.2 points each)")
    ap.add_argument("--locomo-conversations", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--locomo-questions", type=int, default=110, help="per conversation")
    ap.add_argument("--textworld-games", type=int, default=19, help="cooking games of about 17 steps")


def load(tokenizer, workloads: list[str], args) -> list[Trajectory]:
    """The trajectories of `workloads`, sized by `args` (add_size_options)."""
    out = []
    for w in workloads:
        if w == "bfcl":
            out += bfcl(tokenizer, args.bfcl_per_category)
        elif w == "bcp":
            out += bcp(tokenizer, args.bcp_questions)
        elif w == "textworld":
            out += textworld(tokenizer, args.textworld_games)
        else:
            out += locomo(tokenizer, args.locomo_conversations, args.locomo_questions)
    return out
