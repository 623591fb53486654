"""Plaintext memory baseline: the turns most similar to the question, within a token budget."""

from __future__ import annotations

from . import data


class TurnRetriever:
    """MiniLM embeddings of one conversation's turns, and each turn's token cost in the prompt."""

    def __init__(self, embedder, tokenizer, turns: list[data.Turn]):
        self.embedder, self.turns = embedder, turns
        # speaker and text, not the date: names carry the question's subject, dates only add noise
        self.vectors = embedder.encode(
            [f"{t.speaker}: {t.text}" for t in turns], normalize_embeddings=True, convert_to_tensor=True, batch_size=64
        )
        # the dated form bounds what a line can cost once it opens its session in the excerpt
        self.cost = [len(tokenizer(t.line(dated=True) + "\n", add_special_tokens=False)["input_ids"]) for t in turns]

    def ranked(self, question: str) -> list[data.Turn]:
        q = self.embedder.encode([question], normalize_embeddings=True, convert_to_tensor=True)[0]
        scores = self.vectors @ q
        return [self.turns[i] for i in scores.argsort(descending=True).tolist()]

    def pick(self, question: str, budget_tokens: int) -> list[data.Turn]:
        """Most similar first; a turn that would overflow is skipped so shorter ones can still fill the budget."""
        picked, used = [], 0
        for turn in self.ranked(question):
            if used + self.cost[turn.index] <= budget_tokens:
                picked.append(turn)
                used += self.cost[turn.index]
        return picked
