"""LoCoMo conversations as dated turns, one rendering shared by every method, and the question subset."""

from __future__ import annotations

import json
import os
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

# The one place the LoCoMo development conversations are read from: outside the repository, in the
# workplace's shared folder next to the checkout, or wherever SGLMEMORY_LOCOMO names (README:
# "Outside the repository" lists what needs them).
DATA = Path(
    os.environ.get("SGLMEMORY_LOCOMO")
    or Path(__file__).resolve().parents[3] / "shared" / "data" / "locomo" / "locomo_dev7.json"
)
ADVERSARIAL = 5  # category without a gold answer; the MemArt paper leaves it out as well


@dataclass(frozen=True)
class Turn:
    index: int  # chronological position in the conversation
    session: int
    date: str
    speaker: str
    text: str
    dia_id: str

    def line(self, dated: bool) -> str:
        return f"[{self.date}] {self.speaker}: {self.text}" if dated else f"{self.speaker}: {self.text}"


@dataclass(frozen=True)
class Question:
    conversation: int
    qa_index: int  # position in the conversation's `qa` list: stable across runs and subsets
    question: str
    answer: str
    category: int
    evidence: tuple[str, ...]


def load(path: Path = DATA) -> list[dict]:
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"the LoCoMo development conversations are not at {path}: set SGLMEMORY_LOCOMO to their "
            "locomo_dev7.json (see the README, 'Data outside the repository')"
        )
    return json.loads(Path(path).read_text())


def _session_numbers(conv: dict) -> list[int]:
    # `session_N_date_time` keys exist beyond the last held session, so count the turn lists only
    return sorted(int(k.split("_")[1]) for k, v in conv.items() if k.startswith("session_") and isinstance(v, list))


def _text(turn: dict) -> str:
    # shared photos are part of what was said: several answers name what a picture showed
    caption = turn.get("blip_caption")
    return f"{turn['text']} [shares {caption}]" if caption else turn["text"]


def turns(sample: dict) -> list[Turn]:
    conv = sample["conversation"]
    out: list[Turn] = []
    for n in _session_numbers(conv):
        date = conv.get(f"session_{n}_date_time", "")
        for t in conv[f"session_{n}"]:
            out.append(Turn(len(out), n, date, t["speaker"], _text(t), t.get("dia_id", "")))
    return out


def render(selected: list[Turn]) -> str:
    """One line per turn in chronological order, whatever order the turns were picked in.

    Only a session's first shown turn carries the session date: a date on every line makes the
    transcripts about 45% longer (over the 32k context of the default model for 4 of 7).
    """
    return "\n".join(rendered(selected))


def rendered(selected: list[Turn], every_line_dated: bool = False) -> list[str]:
    """Each turn's text in `render` (chronological; a turn's text may hold line ends of its own);
    `every_line_dated`: each with its session's date, as a memory that records lines alone needs
    (a placed line from the middle of a session has no date before it otherwise)."""
    lines, session = [], None
    for t in sorted(selected, key=lambda t: t.index):
        lines.append(t.line(dated=every_line_dated or t.session != session))
        session = t.session
    return lines


def questions(sample: dict, conversation: int) -> list[Question]:
    """Every question with a gold answer (answers can be ints in the data)."""
    out = []
    for i, qa in enumerate(sample["qa"]):
        if qa["category"] == ADVERSARIAL or qa.get("answer") is None:
            continue
        out.append(
            Question(conversation, i, qa["question"], str(qa["answer"]), qa["category"], tuple(qa.get("evidence", ())))
        )
    return out


def stratified(qs: list[Question], n: int, seed: int = 0) -> list[Question]:
    """n questions in about the categories' proportions, picked with a fixed seed.

    The `qa` lists are grouped by category (single-hop last), so the first n would leave
    categories out. Each category is shuffled on its own and its r-th question placed at
    (r + 0.5) / size on one shared scale; the first n on that scale are taken. That keeps every
    category's share within one question of proportional and makes a larger n keep what a smaller
    n picked (a re-run with more questions reuses the results it has). Returned in data order.
    """
    by_cat: dict[int, list[Question]] = defaultdict(list)
    for q in qs:
        by_cat[q.category].append(q)
    scale = []
    for c, members in by_cat.items():
        random.Random(f"{seed}-{c}").shuffle(members)
        scale += [((r + 0.5) / len(members), c, q) for r, q in enumerate(members)]
    picked = [q for _, _, q in sorted(scale, key=lambda x: x[:2])[:n]]
    return sorted(picked, key=lambda q: q.qa_index)
