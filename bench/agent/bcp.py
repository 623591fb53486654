"""A BrowseComp-Plus-shaped deep-research workload: a search agent over a fixed local corpus.

The agent has BCP's tools, `search(query)` (the top-k documents by BM25, each as docid, title and
a snippet of its first words) and `get_document(docid)` (the whole text), plus `answer(answer)`,
which ends the task. Tool outputs grow the conversation the way BCP's do, which is what the
pruning methods are measured on. Search results are frozen per query string in a cache that
every method of a run shares (and a resumed run reloads), so compression never changes retrieval.

Data:
- offline, shipped: every session of the LoCoMo development conversations (`../shared/data/locomo/`)
  is one document, titled with its conversation, session number and date; the questions are their
  QA items of categories 1-4 (stratified, `bench/locomo/data.py`), the gold answers theirs;
- BCP's own files when a user has them: `--bcp-corpus` (jsonl with BCP's `docid`, `text` and
  optionally `title` / `url`) and `--bcp-queries` (the decrypted queries, jsonl with `query_id`,
  `query`, `answer`).

Judging follows BCP's evaluation (a judge labels each completed answer correct or not): by default
a normalised match (every token of the gold answer, normalised as LoCoMo's evaluation does, appears
in the prediction), which a small model can be scored by; with `--judge llm`, BCP's LLM judge
asked on the same server (`llm_judge`; the normalised match is kept beside it); LoCoMo token F1
alongside either.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.common import read_jsonl
from bench.locomo import data as locomo
from bench.locomo.metrics import token_f1, tokens

from .loop import Endpoint, Refused, label_next_calls

TOP_K = 5
SNIPPET_WORDS = 384  # BCP's snippets are the first 512 tokens of a document
MAX_STEPS = 10  # tool-use turns per query before the turn cap
SYSTEM = (
    "You are a deep-research agent. Answer the user's question from the documents you can search. Use "
    "search to find documents and get_document to read one in full. When you know the answer, call answer "
    "with the exact answer only, as short as possible."
)


def _tool(name: str, description: str, **params: str) -> dict:
    properties = {p: {"type": "string", "description": d} for p, d in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(params)},
        },
    }


TOOLS = [
    _tool(
        "search",
        f"Search the documents; returns the top {TOP_K} with docid, title and the beginning of the text.",
        query="what to search for",
    ),
    _tool("get_document", "The full text of one document.", docid="a docid from the search results"),
    _tool("answer", "Give the final answer and end the task.", answer="the exact answer, short"),
]


@dataclass(frozen=True)
class Document:
    docid: str
    title: str
    text: str


@dataclass(frozen=True)
class Task:
    category: str
    id: str
    question: str
    answer: str


class Corpus:
    """BM25 (bm25s) over title + text, with the frozen per-query result cache."""

    def __init__(self, docs: list[Document], cache_path: Path | None = None):
        import bm25s

        self.docs = docs
        self.by_id = {d.docid: d for d in docs}
        self._bm25s = bm25s
        self.index = bm25s.BM25()
        self.index.index(
            bm25s.tokenize([f"{d.title}\n{d.text}" for d in docs], stopwords="en", show_progress=False),
            show_progress=False,
        )
        self.cache_path = cache_path
        self.cache: dict[str, list[str]] = (
            json.loads(cache_path.read_text()) if cache_path and cache_path.exists() else {}
        )
        self.lock = threading.Lock()

    def search(self, query: str, k: int = TOP_K) -> list[Document]:
        with self.lock:
            if query not in self.cache:
                q = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
                ids = []
                if q.vocab:  # a query of stopwords only finds nothing
                    found, scores = self.index.retrieve(q, k=min(k, len(self.docs)), show_progress=False)
                    ids = [self.docs[int(i)].docid for i, s in zip(found[0], scores[0]) if s > 0]
                self.cache[query] = ids
                if self.cache_path:
                    self.cache_path.write_text(json.dumps(self.cache))
            return [self.by_id[i] for i in self.cache[query]]


def locomo_corpus() -> list[Document]:
    docs = []
    for c, sample in enumerate(locomo.load()):
        by_session: dict[int, list] = {}
        for turn in locomo.turns(sample):
            by_session.setdefault(turn.session, []).append(turn)
        for n, turns in by_session.items():
            title = f"LoCoMo conversation {c}, session {n} ({turns[0].date})"
            docs.append(Document(f"c{c}s{n}", title, "\n".join(t.line(dated=False) for t in turns)))
    return docs


def locomo_tasks(limit: int | None) -> list[Task]:
    """`limit` questions per conversation (stratified over categories 1-4), every conversation."""
    out = []
    for c, sample in enumerate(locomo.load()):
        qs = locomo.questions(sample, c)
        for q in locomo.stratified(qs, limit or len(qs)):
            out.append(Task(f"locomo_cat{q.category}", f"locomo-c{c}-q{q.qa_index}", q.question, q.answer))
    return out


def bcp_corpus(path: Path) -> list[Document]:
    return [
        Document(str(r["docid"]), r.get("title") or r.get("url") or str(r["docid"]), r["text"])
        for r in read_jsonl(path)
    ]


def bcp_tasks(path: Path, limit: int | None) -> list[Task]:
    return [Task("bcp", f"bcp-{r['query_id']}", r["query"], str(r["answer"])) for r in read_jsonl(path)[:limit]]


def judge(prediction: str, gold: str) -> bool:
    """Normalised match: every gold token (with its count) appears among the prediction's tokens."""
    want, have = Counter(tokens(gold)), Counter(tokens(prediction))
    return bool(want) and not (want - have)


JUDGE_PROMPT = """Decide whether the response below answers the question correctly, judged only against the
correct answer given.

Question: {question}
Response: {response}
Correct answer: {gold}

Report the final exact answer the response gives (None if it gives none), say in one sentence whether
it differs in any meaningful way from the correct answer (do not solve the question yourself, do not
argue for another answer), then whether it is correct: true only if it matches the correct answer or
is within a small margin for a number."""
JUDGEMENT = {
    "type": "function",
    "function": {
        "name": "judgement",
        "description": "The verdict on the response.",
        "parameters": {
            "type": "object",
            "required": ["extracted_final_answer", "reasoning", "correct"],
            "properties": {
                "extracted_final_answer": {"type": "string"},
                "reasoning": {"type": "string"},
                "correct": {"type": "boolean"},
            },
        },
    },
}


def llm_judge(url: str, question: str, response: str, gold: str, max_tokens: int = 256) -> dict:
    """BCP's LLM judge (its grader's fields: the extracted final answer, the reasoning, correct yes /
    no), asked on the server at `url` with no `sgl_memory` field. The verdict is a named tool call,
    so the server's constrained decoding always returns the fields, from a small model too; a
    verdict cut off or unparsed counts as incorrect."""
    reply = Endpoint(url, None, max_tokens).ask(
        [{"role": "user", "content": JUDGE_PROMPT.format(question=question, response=response, gold=gold)}],
        [JUDGEMENT],
        session_id="",
        tool_choice={"type": "function", "function": {"name": "judgement"}},
    )
    verdict = reply.calls[0].arguments if reply.calls else {}
    return {**verdict, "valid": verdict.get("correct") is True}


def snippet(doc: Document, words: int = SNIPPET_WORDS) -> str:
    return " ".join(doc.text.split()[:words])


def render(docs: list[Document], words: int = SNIPPET_WORDS) -> str:
    if not docs:
        return "No documents found."
    return "\n\n".join(f"[{d.docid}] {d.title}\n{snippet(d, words)}" for d in docs)


class Workload:
    """What run.py drives: tasks and how one runs; built from the CLI's data options. Shorter
    snippets than BCP's make every search result, and so every prefill after one, cheaper (tests)."""

    def __init__(self, corpus: Corpus, tasks: list[Task], llm_judge: bool = False, snippet_words: int = SNIPPET_WORDS):
        self.corpus, self.todo, self.llm_judge, self.snippet_words = corpus, tasks, llm_judge, snippet_words

    def tasks(self, categories=None, limit: int | None = None) -> list[Task]:
        return [t for t in self.todo if categories is None or t.category in categories]

    def tools_at(self, task: Task, turn: int) -> list[dict]:
        return TOOLS

    def tool(self, name: str, arguments: dict) -> str:
        if name == "search" and isinstance(arguments.get("query"), str):
            return render(self.corpus.search(arguments["query"]), self.snippet_words)
        if name == "get_document" and isinstance(arguments.get("docid"), str):
            doc = self.corpus.by_id.get(arguments["docid"].strip().strip("[]"))
            return f"{doc.title}\n{doc.text}" if doc else f"No document with docid {arguments['docid']!r}."
        return f"Error: {name} needs its argument as a string."

    def run(self, task: Task, endpoint: Endpoint, session_id: str, max_steps: int = MAX_STEPS) -> dict:
        """One query: tool calls until `answer` or the turn cap. Non-completion reasons as BCP's:
        `turn_cap`, `overflow`, `error`, `empty` (an empty final answer)."""
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]
        steps: list[dict] = []
        reason, error, prediction = None, None, None
        try:
            for step in range(max_steps + 1):
                if step == max_steps:
                    reason = "turn_cap"
                    break
                record = (reply := endpoint.ask(messages, TOOLS, session_id)).record(0, step, len(messages))
                steps.append(record)
                final = [c for c in reply.calls if c.name == "answer"]
                calls = [c for c in reply.calls if c.name != "answer"]
                if calls:
                    record["results"] = [self.tool(c.name, c.arguments) for c in calls]
                    messages += reply.exchange(calls, record["results"])
                if final or not reply.calls:
                    given = final[0].arguments.get("answer") if final else reply.text
                    prediction = given.strip() if isinstance(given, str) else ""
                    messages.append({"role": "assistant", "content": prediction})
                    reason = None if prediction else "empty"
                    break
        except Refused as exc:
            reason, error = exc.reason, str(exc)
        label_next_calls(steps)
        match = reason is None and judge(prediction, task.answer)
        verdict = {"match": match}
        if self.llm_judge and reason is None:
            verdict["judge"] = llm_judge(endpoint.url, task.question, prediction, task.answer)
        valid = verdict["judge"]["valid"] if "judge" in verdict else match
        f1 = token_f1(prediction, task.answer) if reason is None else 0.0
        return {
            "messages": messages,
            "steps": steps,
            "reason": reason,
            "error": error,
            "prediction": prediction,
            "gold": task.answer,
            "valid": valid,
            "f1": f1,
            "error_type": reason,
            **verdict,
        }
