"""LoCoMo QA with KV memory (MemArt) against the whole transcript and plaintext retrieval, one run.

Methods, all on our server (`--memory-config` with a `memory:` section):

- full: the whole transcript and the question in the prompt; the radix cache keeps the transcript
  prefix across the questions of one conversation.
- text: the turns most similar to the question by MiniLM, in chronological order, within a token
  budget equal to the KV length MemArt placed for the same question (top_k x block_size if no
  MemArt result is recorded).
- memart: the transcript is ingested once per conversation as a session turn; each question then
  carries only itself and retrieves KV blocks (`store: false`, so questions stay independent).
- defaults: what a user gets from `memory: enabled: true` and nothing else (lines, 2,048 placed
  tokens, keep on with memory), its repair (`recompute: starts`, the default) against reuse alone
  (`none`), text retrieval at the same placed tokens and the whole transcript, on one server;
  `dated`: the same memory of a transcript with its session's date on every line; `chat`: the
  transcript sent as agents send a turn, a memory-mode chat message after the system message, so
  the memory holds no token computed at position 0 (the attention sink `starts` restores), with
  reuse alone, with the default repair, and in the server's text mode (`memory: {mode: text}`: the
  same memory's lines ranked by MiniLM, placed as prompt text, memart/text.py).
  `int8`: the chat memory's defaults and the whole transcript, each in the compute-dtype pool and
  in an int8 pool (`--kv-cache-dtype int8`, the same tokens), paired ("vs float pool").
  Ablations (per request, same server): the other three norm x agg combinations; MemArt's AABB
  bound instead of each block's best key (with rr-max, the paper's choice for Qwen, and with
  softmax-max); the blocks after the system message instead of first. Block size 8 with top_k
  doubled runs on its own server (same KV budget).

Questions: per conversation, `--questions-per-conversation` questions of categories 1-4, stratified
by category with a fixed seed (the `qa` lists are grouped by category, so the first N would miss
categories). Scores: token F1, BLEU-1 and MiniLM similarity; costs: prefill tokens, KV length in
decode, latency. The results file is written after every question and a re-run skips what it holds.

    .venv/bin/python -m bench.locomo [--conversations 0 1] [--methods full text memart norm-agg block8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import requests
from tqdm import tqdm

from bench.common import bootstrap, commit, ok, write_json
from sgl_memory import models
from sgl_memory.core.config import to_yaml
from sgl_memory.keep.settings import KeepConfig
from sgl_memory.memart.settings import MemArtConfig
from bench import harness

from . import data, metrics, prompts
from .retrieval import TurnRetriever

RESULTS = Path(__file__).resolve().parents[1] / "results"
METHOD_GROUPS = (
    "memart",
    "norm-agg",
    "aabb",
    "placement",
    "block8",
    "full",
    "text",
    "recompute",
    "repairs",
    "defaults",
    "dated",
    "chat",
    "int8",
)
RATIOS = (0.1, 0.3)  # keep and cacheblend recomputation ratios (the share at layer 1) of the recompute group
MAIN_NORM, MAIN_AGG = "softmax", "max"  # the server's defaults (bench/locomo/retrieval_study.py)
LONG_REQUEST_S = 3600  # a cold 24k-token prefill on 2 cores takes minutes


@dataclass(frozen=True)
class Variant:
    method: str  # full | text | memart
    block_size: int = 16  # of the server it runs on
    top_k: int = 0
    norm: str = MAIN_NORM
    agg: str = MAIN_AGG
    scoring: str = "exact"  # a block's logit: its best key's, or the AABB bound (MemArt's)
    placement: str = "first"  # of the memory blocks: first (MemArt), or after the system message
    recompute: str = "none"  # what repairs the placed blocks (sgl_memory/keep): none | keep | cacheblend | full
    ratio: float | None = None  # keep / cacheblend: the share recomputed at layer 1
    hops: int | None = None  # keep: importance propagation rounds (None: the server's)
    compact: bool = True  # of the server it runs on: keep drops the rows it does not recompute (False: full cost)
    cut: str = "tokens"  # of the server it runs on (memory.cut): lines: no block spans two dialogue turns
    turns: str = "transcript"  # the memory's turns: the transcript as one, or each LoCoMo session as one
    header: str = "none"  # placed with each chosen block: the first block of its turn and/or line
    # of the server it runs on: bench (block unit, top_k blocks, the fields above) or defaults (the
    # memory section's defaults; a memart request then names only its recompute)
    config: str = "bench"
    # how the memory records the transcript (RECORDINGS): plain (from position 0, one record turn),
    # dated (the same with a date on every line) or chat (a memory-mode chat turn)
    recording: str = "plain"
    mode: str = "retrieve"  # a memart variant's memory mode: retrieve (KV blocks) or text (its lines as text)
    # of the server it runs on: its live KV pool's `--kv-cache-dtype` (auto: the compute dtype)
    kv_dtype: str = "auto"

    def __post_init__(self):
        if self.recording != "plain" and self.method != "memart":
            raise ValueError("recording is how a memory records its transcript; text and full read the transcript")
        if self.recording not in RECORDINGS or (self.recording == "chat" and self.turns != "transcript"):
            raise ValueError(f"recording {self.recording!r} with turns {self.turns!r}")
        if self.mode != "retrieve" and (self.method, self.config) != ("memart", "defaults"):
            raise ValueError("a memory mode other than retrieve runs as a user sends it: memart at the defaults")

    @property
    def server(self) -> tuple[str, int, bool, str, str]:
        return self.config, self.block_size, self.compact, self.cut, self.kv_dtype

    @property
    def label(self) -> str:
        """The variant's name; one in an 8-bit pool is its compute-dtype twin's with the pool named."""
        return self.base_label + ("" if self.kv_dtype == "auto" else POOL_SUFFIX + self.kv_dtype)

    @property
    def base_label(self) -> str:
        if self.method == "full":
            return "full"
        if self.config == "defaults":
            if self.method == "text":
                return "text-defaults"
            if self.mode == "text":
                return "memory-defaults-text-mode" + ("" if self.recording == "plain" else f"-{self.recording}")
            return f"memory-defaults-{self.recompute}" + ("" if self.recording == "plain" else f"-{self.recording}")
        if self.method == "text":
            return f"text-k{self.top_k}"  # budget from the main MemArt variant at this top_k
        suffix = ("-aabb" if self.scoring == "aabb" else "") + (
            "-after-system" if self.placement == "after_system" else ""
        )
        suffix += "-session-turns" if self.turns == "sessions" else ""
        suffix += f"-cut-{self.cut}" if self.cut != "tokens" else ""
        suffix += f"-header-{self.header}" if self.header != "none" else ""
        if self.recompute != "none":
            suffix += f"-{self.recompute}" + (f"-r{self.ratio}" if self.ratio is not None else "")
            suffix += f"-hops{self.hops}" if self.hops is not None else ""
            suffix += "" if self.compact else "-no-drop"
        return f"memart-bs{self.block_size}-k{self.top_k}-{self.norm}-{self.agg}{suffix}"


def main_memart(top_k: int) -> Variant:
    return Variant("memart", 16, top_k)


RECORDINGS = ("plain", "dated", "chat")
POOL_SUFFIX = "-pool-"  # of a variant's label whose server's pool is not of the compute dtype
DEFAULTS_REUSE = Variant("memart", config="defaults", recompute="none")
# the agent case's memory: the transcript recorded as a chat turn, at the defaults (repair included)
CHAT_DEFAULTS = replace(DEFAULTS_REUSE, recompute="starts", recording="chat")


def variants(groups: list[str], top_k: int) -> list[Variant]:
    """In run order: MemArt first, so the text baseline can match each question's KV length; one
    variant per label (the whole transcript is one method whichever group names it)."""
    out = []
    for group in METHOD_GROUPS:
        if group not in groups:
            continue
        if group == "memart":
            out.append(main_memart(top_k))
        elif group == "norm-agg":
            out += [
                Variant("memart", 16, top_k, n, a)
                for n in ("rr", "softmax")
                for a in ("max", "sum")
                if (n, a) != (MAIN_NORM, MAIN_AGG)
            ]
        elif group == "aabb":  # MemArt's compressed keys, with the paper's choice for Qwen and ours
            out += [
                Variant("memart", 16, top_k, "rr", "max", scoring="aabb"),
                Variant("memart", 16, top_k, scoring="aabb"),
            ]
        elif group == "placement":
            out.append(Variant("memart", 16, top_k, placement="after_system"))  # [system][blocks][question]
        elif group == "block8":
            out.append(Variant("memart", 8, top_k * 2))  # same KV tokens as block 16
        elif group == "recompute":  # KEEP against full recompute and CacheBlend (sgl_memory/keep)
            out.append(Variant("memart", 16, top_k, recompute="full"))
            out += [Variant("memart", 16, top_k, recompute="keep", ratio=r) for r in RATIOS]
            out.append(Variant("memart", 16, top_k, recompute="keep", ratio=RATIOS[-1], hops=1))  # without multi-hop
            out.append(
                Variant("memart", 16, top_k, recompute="keep", ratio=RATIOS[-1], compact=False)
            )  # without row dropping
            out += [Variant("memart", 16, top_k, recompute="cacheblend", ratio=r) for r in RATIOS]
        elif (
            group == "repairs"
        ):  # the two cheap repairs: blocks within turns (sessions, lines), headers placed with blocks
            sessions = Variant("memart", 16, top_k, turns="sessions")
            out += [
                sessions,
                replace(sessions, header="turn"),
                replace(sessions, cut="lines"),
                replace(sessions, cut="lines", header="turn_line"),
                replace(sessions, cut="lines", header="turn_line", recompute="keep", ratio=RATIOS[-1]),
            ]
        elif group == "defaults":  # reuse first: the text baseline's budget is its placed tokens
            out += [
                DEFAULTS_REUSE,
                replace(DEFAULTS_REUSE, recompute="starts"),
                Variant("text", config="defaults"),
                Variant("full", config="defaults"),
            ]
        elif group == "dated":  # the defaults' memory of a client that dates every line it records
            out.append(replace(DEFAULTS_REUSE, recompute="starts", recording="dated"))
        elif group == "chat":  # a memory with no sink recorded: reuse alone against the default repair
            chat = replace(DEFAULTS_REUSE, recording="chat")
            out += [chat, CHAT_DEFAULTS, replace(chat, mode="text")]
        elif group == "int8":  # the agent case's default memory and the whole transcript, each in both pools
            pair = [CHAT_DEFAULTS, Variant("full", config="defaults")]
            out += pair + [replace(v, kv_dtype="int8") for v in pair]
        else:
            out.append(Variant(group, 16, top_k))
    labels = [v.label for v in out]
    return [v for i, v in enumerate(out) if v.label not in labels[:i]]


@dataclass
class Conversation:
    index: int
    turns: list[data.Turn]
    transcript: str
    questions: list[data.Question]
    ingest_ids: list[int] = field(default_factory=list)
    token_turn: list[int | None] = field(default_factory=list)  # ingest token -> its turn (chronological position)
    # the other recordings (Variant.recording): the ids sent, and each token's turn in the turn the
    # memory records (for chat, from the user message's opener: the system message is not recorded)
    recordings: dict[str, tuple[list[int], list[int | None]]] = field(default_factory=dict)
    retriever: TurnRetriever | None = None

    def memory_turn(self, recording: str) -> tuple[list[int], list[int | None]]:
        """What a memory variant ingests: its token ids, and each recorded token's turn."""
        return (self.ingest_ids, self.token_turn) if recording == "plain" else self.recordings[recording]

    def session_ends(self, recording: str = "plain") -> list[int]:
        """Where each LoCoMo session's tokens end in the ingested ids (the memory turns of `turns: sessions`)."""
        return prompts.session_ends(self.turns, self.memory_turn(recording)[1])

    def evidence_recall(
        self, q: data.Question, spans: list[list[int]], starts: list[int], recording: str = "plain"
    ) -> float | None:
        """Share of the question's evidence turns that a retrieved block overlaps (MemArt rows);
        `starts`: where each memory turn starts in the ingested ids (a block's offset is within its turn)."""
        if not q.evidence:
            return None
        lines = sorted(self.turns, key=lambda t: t.index)
        token_turn = self.memory_turn(recording)[1]
        covered = {
            lines[i].dia_id
            for turn, offset, n in spans
            for i in token_turn[starts[turn] + offset : starts[turn] + offset + n]
            if i is not None
        }
        return sum(e in covered for e in q.evidence) / len(q.evidence)


def cut(turns: list[data.Turn], tokenizer, max_tokens: int | None) -> list[data.Turn]:
    """The first turns whose transcript fits in max_tokens (small test models have short contexts)."""
    if not max_tokens:
        return turns
    kept, used = [], 0
    for t in turns:
        used += len(tokenizer(t.line(dated=True) + "\n", add_special_tokens=False)["input_ids"])
        if used > max_tokens:
            break
        kept.append(t)
    return kept


def conversations(args, tokenizer) -> list[Conversation]:
    samples = data.load(args.data)
    out = []
    for i in args.conversations:
        turns = cut(data.turns(samples[i]), tokenizer, args.max_transcript_tokens)
        transcript = data.render(turns)
        qs = data.stratified(data.questions(samples[i], i), args.questions_per_conversation, args.seed)
        plain = prompts.ingest_ids(tokenizer, transcript), prompts.ingest_turn_of_tokens(tokenizer, turns)
        dated = (
            prompts.ingest_ids(tokenizer, "\n".join(data.rendered(turns, every_line_dated=True))),
            prompts.ingest_turn_of_tokens(tokenizer, turns, every_line_dated=True),
        )
        recordings = {"dated": dated, "chat": prompts.chat_turn(tokenizer, transcript, *plain)}
        out.append(Conversation(i, turns, transcript, qs, *plain, recordings))
    return out


class Results:
    """The JSON file, rewritten (atomically) after every question so an interrupted run resumes."""

    def __init__(self, path: Path, settings: dict, fresh: bool):
        self.path = path
        self.data = {"settings": settings, "transcripts": {}, "ingest": {}, "rows": {}}
        if path.exists() and not fresh:
            old = json.loads(path.read_text())
            if old.get("settings") != settings:
                raise SystemExit(
                    f"{path} was written with other settings {old.get('settings')}; pass --fresh or another --out"
                )
            self.data.update(old)

    @staticmethod
    def key(label: str, q: data.Question) -> str:
        return f"{label}|c{q.conversation}|q{q.qa_index}"

    def row(self, label: str, q: data.Question) -> dict | None:
        return self.data["rows"].get(self.key(label, q))

    def add(self, label: str, q: data.Question, row: dict) -> None:
        self.data["rows"][self.key(label, q)] = {**row, "commit": commit()}  # a resumed file mixes runs
        self.save()

    def save(self) -> None:
        self.data.pop("provenance", None)
        write_json(self.path, self.data)


def generate(
    server, input_ids: list[int], max_new_tokens: int, memory: dict | None = None, extra_key: str | None = None
) -> tuple[str, dict, float]:
    """The answer, its meta_info with `ttft_s` added (the first streamed chunk, measured here: the
    probe of a memory-mode request included), and the wall time. `extra_key`: SGLang's radix-cache
    namespace; a fresh one keeps the request from reusing what earlier requests left in the tree."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "stream": True,
    }
    if extra_key is not None:
        body["extra_key"] = extra_key
    if memory is not None:
        body["sgl_memory"] = memory
    t0 = time.perf_counter()
    ttft, last = None, None
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=LONG_REQUEST_S) as r:
        ok(r, "/generate")
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            ttft = time.perf_counter() - t0 if ttft is None else ttft
            last = json.loads(line[len(b"data:") :])
    wall = time.perf_counter() - t0
    return last["text"], {**last["meta_info"], "ttft_s": ttft}, wall


def server_config(
    directory: Path, block_size: int, top_k: int, memory_on: bool, capacity_blocks: int, compact: bool, cut: str
) -> Path:
    """The benchmark's own memory server: block units, top_k blocks placed, capacity for every transcript."""
    path = (
        directory
        / f"locomo-bs{block_size}{'' if compact else '-no-drop'}{'' if cut == 'tokens' else '-cut-' + cut}.yaml"
    )
    memory = MemArtConfig(
        enabled=memory_on,
        block_size=block_size,
        top_k=top_k,
        norm=MAIN_NORM,
        agg=MAIN_AGG,
        capacity_blocks=capacity_blocks,
        cut=cut,
        unit="block",  # top_k blocks of block_size, as every variant here counts them
        placed_tokens=0,
    )
    # the recompute variants' repairs
    path.write_text(to_yaml(memory, KeepConfig(enabled=memory_on, compact=compact), harness.PERSIST_OFF))
    return path


def defaults_config(directory: Path) -> Path:
    """What a user writes to turn memory on (keep follows it); persistence off so runs stay independent."""
    path = directory / "locomo-defaults.yaml"
    path.write_text(to_yaml(MemArtConfig(enabled=True), harness.PERSIST_OFF))
    return path


def server_flags(model: str, convs: list[Conversation], recordings: set[str], kv_dtype: str = "auto") -> list[str]:
    """A KV pool that holds every transcript ingested in the recordings this server runs plus one
    full-transcript request (the same tokens whatever the pool's dtype: its fidelity is measured
    here, not its capacity)."""
    need = sum(len(c.memory_turn(r)[0]) for c in convs for r in recordings | {"plain"})
    need += 2 * max(len(c.ingest_ids) for c in convs) + 4096
    default = harness.default_pool_tokens(models.model_dir(model))
    return ["--max-total-tokens", str(max(default, need)), "--kv-cache-dtype", kv_dtype]


class Runner:
    """Asks one server every pending question of the variants that run on it."""

    def __init__(self, args, tokenizer, embedder, results: Results, bar):
        self.args, self.tokenizer, self.embedder, self.results, self.bar = args, tokenizer, embedder, results, bar
        self.nonce = uuid.uuid4().hex[:8]  # a fresh memory session per server start

    def ingest(self, server, conv: Conversation, variant: Variant) -> tuple[str, list[int]]:
        """A memory session of the conversation, and where its turns start in ingest_ids: the whole
        transcript as one turn, or (turns: sessions) one full-history request per LoCoMo session,
        each prefilling only its session (the radix cache holds the rest), which memory records as
        the session's next turn (its one answer token has no KV, so each turn starts where the
        request before it ended)."""
        recording = "" if variant.recording == "plain" else f"-{variant.recording}"
        sid = f"locomo-{self.nonce}-bs{variant.block_size}-{variant.turns}{recording}-c{conv.index}"
        ids = conv.memory_turn(variant.recording)[0]
        ends = conv.session_ends(variant.recording) if variant.turns == "sessions" else [len(ids)]
        # plain and dated: a record turn (the whole prompt, from position 0); chat: a memory-mode
        # turn, which records what follows the system message
        field = {"session_id": sid} | ({"memory": {"mode": "retrieve"}} if variant.recording == "chat" else {})
        wall, meta = 0.0, {}
        for end in ends:
            _, meta, seconds = generate(server, ids[:end], 1, field)
            wall += seconds
        record = {
            "session_id": sid,
            "tokens": len(ids),
            "turns": len(ends),
            "wall_s": wall,
            "e2e_latency": meta.get("e2e_latency"),
            "sgl_memory": meta.get("sgl_memory"),
        }
        key = f"bs{variant.block_size}-{variant.turns}{recording}|c{conv.index}"
        self.results.data["ingest"].setdefault(key, []).append(record)
        self.results.save()
        return sid, [0] + ends[:-1]

    def text_budget(self, variant: Variant, q: data.Question) -> tuple[int, str]:
        main = DEFAULTS_REUSE if variant.config == "defaults" else main_memart(variant.top_k)
        ref = self.results.row(main.label, q)
        if ref and ref.get("memory_kv_tokens"):
            return ref["memory_kv_tokens"], "memart"
        return variant.top_k * 16, "top_k x block_size"

    def prompt(self, variant: Variant, conv: Conversation, q: data.Question, sid: str | None):
        """Input ids, the sgl_memory field, and what the row should record about the context."""
        if variant.method == "full":
            return prompts.with_context(self.tokenizer, conv.transcript, q.question), None, {}
        if variant.method == "text":
            budget, source = self.text_budget(variant, q)
            picked = conv.retriever.pick(q.question, budget)
            excerpt = data.render(picked)
            found = {t.dia_id for t in picked}
            extra = {
                "budget_tokens": budget,
                "budget_source": source,
                "context_turns": len(picked),
                "context_tokens": len(self.tokenizer(excerpt, add_special_tokens=False)["input_ids"]),
                "evidence_recall": sum(e in found for e in q.evidence) / len(q.evidence) if q.evidence else None,
            }
            return prompts.with_context(self.tokenizer, excerpt, q.question), None, extra
        if variant.config == "defaults" and variant.mode == "text":
            memory = {"session_id": sid, "memory": {"mode": "text", "store": False}}
            return prompts.question_only(self.tokenizer, q.question), memory, {}
        if variant.config == "defaults":
            memory = {"session_id": sid, "memory": {"mode": "retrieve", "store": False, "recompute": variant.recompute}}
            return prompts.question_only(self.tokenizer, q.question), memory, {}
        memory = {
            "session_id": sid,
            "memory": {
                "mode": "retrieve",
                "top_k": variant.top_k,
                "norm": variant.norm,
                "agg": variant.agg,
                "scoring": variant.scoring,
                "placement": variant.placement,
                "store": False,
                "recompute": variant.recompute,
                "header": variant.header,
            },
        }
        keep = {k: v for k, v in (("ratio", variant.ratio), ("hops", variant.hops)) if v is not None}
        if keep:
            memory["keep"] = keep
        return prompts.question_only(self.tokenizer, q.question), memory, {}

    def ask(
        self, server, variant: Variant, conv: Conversation, q: data.Question, sid: str | None, starts: list[int]
    ) -> None:
        ids, memory, extra = self.prompt(variant, conv, q, sid)
        text, meta, wall = generate(server, ids, self.args.max_new_tokens, memory)
        if variant.method == "memart":
            spans = (meta.get("sgl_memory") or {}).get("retrieved_spans") or []
            extra["evidence_recall"] = conv.evidence_recall(q, spans, starts, variant.recording)
        self.results.add(variant.label, q, score(self.embedder, variant, q, ids, text, meta, wall, extra))
        self.bar.update()

    def serve(self, server, todo: dict[Variant, dict[int, list[data.Question]]], convs: list[Conversation]) -> None:
        for conv in convs:
            sessions: dict[tuple[int, str, str], tuple[str, list[int]]] = {}
            for variant, by_conv in todo.items():
                if not by_conv.get(conv.index):
                    continue
                self.bar.set_description(f"c{conv.index} {variant.label}")
                sid, starts = None, [0]
                if variant.method == "memart":
                    key = (variant.block_size, variant.turns, variant.recording)
                    if key not in sessions:
                        self.bar.set_description(f"c{conv.index} ingest {variant.label}")
                        sessions[key] = self.ingest(server, conv, variant)
                    sid, starts = sessions[key]
                if variant.method == "text" and conv.retriever is None:
                    conv.retriever = TurnRetriever(self.embedder, self.tokenizer, conv.turns)
                for q in by_conv[conv.index]:
                    self.ask(server, variant, conv, q, sid, starts)


def score(
    embedder, variant: Variant, q: data.Question, ids: list[int], text: str, meta: dict, wall: float, extra: dict
) -> dict:
    prediction = text.strip()
    mem = meta.get("sgl_memory") or {}
    prompt_tokens = len(ids)
    cached = meta.get("cached_tokens") or 0
    memory_kv = mem.get("memory_kv_tokens") or 0
    completion = meta.get("completion_tokens") or 0
    return {
        "method": variant.method,
        "variant": variant.label,
        "conversation": q.conversation,
        "qa_index": q.qa_index,
        "category": q.category,
        "question": q.question,
        "answer": q.answer,
        "prediction": prediction,
        "f1": metrics.token_f1(prediction, q.answer),
        "bleu1": metrics.bleu1(prediction, q.answer),
        "sim": metrics.similarity(embedder, prediction, q.answer),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "memory_kv_tokens": memory_kv,
        "prefill_tokens": mem.get("prefill_tokens", prompt_tokens - cached),
        "kv_decode_tokens": prompt_tokens + memory_kv + completion,
        "completion_tokens": completion,
        "e2e_latency": meta.get("e2e_latency"),
        "ttft_s": meta.get("ttft_s"),
        "wall_s": wall,
        **{
            k: mem[k]
            for k in (
                "retrieved_blocks",
                "retrieved_spans",
                "probe_tokens",
                "retrieval_ms",
                "recompute",
                "reused_tokens",
                "recomputed_token_layers",
                "prefill_token_layers",
                "full_prefill_token_layers",
                "prefill_work_share",
                "recompute_share",
                "recompute_ms",
                "repair_ms",
                "recompute_dropped_rows",
                "text_lines",
                "text_tokens",
            )
            if k in mem
        },
        **extra,
    }


MEANS = (
    "f1",
    "bleu1",
    "sim",
    "evidence_recall",
    "prefill_tokens",
    "kv_decode_tokens",
    "memory_kv_tokens",
    "e2e_latency",
    "ttft_s",
    "wall_s",
    "reused_tokens",
    "recomputed_token_layers",
    "prefill_work_share",
    "repair_ms",
    "recompute_share",
    "text_tokens",
)


def _mean(rows: list[dict], name: str) -> float | None:
    vals = [r[name] for r in rows if r.get(name) is not None]
    return sum(vals) / len(vals) if vals else None


def summarize(results: Results, convs: list[Conversation] | None) -> dict:
    """Means per variant and per category, over this run's questions only (None: every row), so
    variants compare like for like."""
    asked = None if convs is None else {(q.conversation, q.qa_index) for c in convs for q in c.questions}
    by_label: dict[str, list[dict]] = {}
    for row in results.data["rows"].values():
        if asked is None or (row["conversation"], row["qa_index"]) in asked:
            by_label.setdefault(row["variant"], []).append(row)
    text = next((rows for label, rows in by_label.items() if label.startswith("text-")), [])
    refs = {"text": text, "full": by_label.get("full", []), "reuse": by_label.get(DEFAULTS_REUSE.label, [])}
    refs["chat_reuse"] = by_label.get(replace(DEFAULTS_REUSE, recording="chat").label, [])
    refs["chat_defaults"] = by_label.get(CHAT_DEFAULTS.label, [])
    summary = {}
    for label, rows in by_label.items():
        cats = sorted({r["category"] for r in rows})
        # an 8-bit pool's variant against its twin in the compute-dtype pool: what the pool dtype costs
        twin = {"compute_pool": by_label.get(label.split(POOL_SUFFIX)[0], [])} if POOL_SUFFIX in label else {}
        summary[label] = {
            "n": len(rows),
            **{m: _mean(rows, m) for m in MEANS},
            **intervals(rows, refs | twin),
            "by_category": {str(c): of_category([r for r in rows if r["category"] == c], refs) for c in cats},
        }
    return summary


def of_category(rows: list[dict], refs: dict[str, list[dict]]) -> dict:
    """One category's questions: their means, and F1 paired against text retrieval and the chat
    memory's defaults (the agent case's choice of mode), with intervals."""
    chosen = {k: refs[k] for k in ("text", "chat_defaults")}
    return {"n": len(rows), **{m: _mean(rows, m) for m in ("f1", "bleu1", "sim")}, **intervals(rows, chosen)}


def intervals(rows: list[dict], refs: dict[str, list[dict]]) -> dict:
    """95% bootstrap intervals over questions: F1, and F1 paired against each reference method
    (text retrieval, the whole transcript, reuse at the defaults of plain and of chat-recorded
    memory, the chat-recorded memory's defaults; an 8-bit pool's variant also against itself in
    the compute-dtype pool, `compute_pool`) on the questions both answered:
    `f1_vs_<name>`, its `_ci` and its `n_vs_<name>`."""
    _, low, high = bootstrap([[r["f1"]] for r in rows])
    out = {"f1_ci": [low, high]}
    for name, ref in refs.items():
        theirs = {(r["conversation"], r["qa_index"]): r["f1"] for r in ref}
        pairs = [
            [r["f1"] - theirs[r["conversation"], r["qa_index"]]]
            for r in rows
            if (r["conversation"], r["qa_index"]) in theirs
        ]
        if pairs and ref and rows[0]["variant"] != ref[0]["variant"]:  # not paired with itself
            out[f"f1_vs_{name}"], low, high = bootstrap(pairs)
            out[f"f1_vs_{name}_ci"], out[f"n_vs_{name}"] = [low, high], len(pairs)
    return out


def ingest_cost(results: Results) -> dict[str, float]:
    """Mean seconds of one transcript ingestion per block size."""
    out = {}
    for key, records in results.data["ingest"].items():
        out.setdefault(key.split("|")[0], []).extend(r["wall_s"] for r in records)
    return {bs: sum(v) / len(v) for bs, v in out.items()}


def pending(
    results: Results, vs: list[Variant], convs: list[Conversation], context: int
) -> dict[tuple, dict[Variant, dict]]:
    """Per server (config, block size, row dropping, cut): variant -> conversation -> questions
    without a result yet. A memory turn longer than the model's `context` is not asked (a dated
    transcript is about 45% longer: over the default model's 32k for conversations 2-6)."""
    out: dict[tuple, dict[Variant, dict]] = {}
    for v in vs:
        for c in convs:
            if v.method == "memart" and len(c.memory_turn(v.recording)[0]) > context:
                print(f"{v.label}: conversation {c.index} left out, its memory turn is over {context} tokens")
                continue
            qs = [q for q in c.questions if results.row(v.label, q) is None]
            if qs:
                out.setdefault(v.server, {}).setdefault(v, {})[c.index] = qs
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.locomo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--conversations", type=int, nargs="+", default=[0], help="indices into the data file")
    ap.add_argument(
        "--questions-per-conversation",
        type=int,
        default=40,
        help="stratified by category, fixed seed; 0 or more than there are: all (categories 1-4)",
    )
    ap.add_argument("--methods", nargs="+", default=list(METHOD_GROUPS), choices=METHOD_GROUPS)
    ap.add_argument("--top-k", type=int, default=64, help="MemArt blocks at block size 16 (doubled at 8)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument(
        "--max-transcript-tokens",
        type=int,
        default=None,
        help="keep the first turns within this many tokens (for short-context test models)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=data.DATA)
    ap.add_argument("--out", type=Path, default=RESULTS / "locomo.json")
    ap.add_argument("--fresh", action="store_true", help="ignore an existing results file")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="print the table of every row in --out, with intervals; run and write nothing",
    )
    ap.add_argument(
        "--table",
        type=Path,
        default=None,
        help="also write the per-variant summary here as a list `rows` (with a plot beside it)",
    )
    args = ap.parse_args(argv)
    if args.questions_per_conversation <= 0:
        args.questions_per_conversation = 1 << 30
    return args


def settings(args) -> dict:
    """What makes rows comparable: a results file only resumes under the same settings."""
    return {
        "model": args.model,
        "max_new_tokens": args.max_new_tokens,
        "max_transcript_tokens": args.max_transcript_tokens,
        "system": prompts.SYSTEM,
        "data": str(args.data),
    }


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _vs(s: dict, ref: str) -> str:
    key = f"f1_vs_{ref}"
    return "{:+.3f} [{:+.3f}, {:+.3f}]".format(s[key], *s[f"{key}_ci"]) if key in s else "-"


def report(result: dict, vs_order: list[str], ingest: dict[str, float]) -> None:
    """The table, with seconds per question: the cost a reader compares first; then F1 per
    question category, paired against text retrieval and the chat memory's defaults ("vs float
    pool": an 8-bit pool's variant against itself in the compute-dtype pool)."""
    summary = result["summary"]
    print(
        f"{'variant':48} {'n':>4} {'F1':>6} {'95% CI':>13} {'vs text':>21} {'vs full':>21} {'vs reuse':>21} "
        f"{'vs chat KV':>21} {'vs float pool':>21} {'BLEU1':>6} {'sim':>6} {'recall':>6} "
        f"{'prefill':>8} {'KV dec':>7} {'TTFT':>6} {'s/q':>7}"
    )
    order = sorted(summary, key=lambda s: (vs_order.index(s) if s in vs_order else len(vs_order), s))
    for label in order:
        s = summary[label]
        ci = "[{:.3f}, {:.3f}]".format(*s["f1_ci"]) if "f1_ci" in s else "-"
        vs = [_vs(s, r) for r in ("text", "full", "reuse", "chat_defaults", "compute_pool")]
        print(
            f"{label:48} {s['n']:>4} {_fmt(s['f1'], '6.3f')} {ci:>13} {vs[0]:>21} {vs[1]:>21} {vs[2]:>21} "
            f"{vs[3]:>21} {vs[4]:>21} {_fmt(s['bleu1'], '6.3f')} "
            f"{_fmt(s['sim'], '6.3f')} {_fmt(s['evidence_recall'], '6.3f')} {_fmt(s['prefill_tokens'], '8.0f')} "
            f"{_fmt(s['kv_decode_tokens'], '7.0f')} {_fmt(s['ttft_s'], '6.2f')} {_fmt(s['wall_s'], '7.2f')}"
        )
    print(f"\n{'variant':48} {'category':>8} {'n':>4} {'F1':>6} {'vs text':>21} {'vs chat KV':>21}")
    for label in order:
        for c, s in summary[label]["by_category"].items():
            vs = f"{_vs(s, 'text'):>21} {_vs(s, 'chat_defaults'):>21}"
            print(f"{label:48} {c:>8} {s['n']:>4} {_fmt(s['f1'], '6.3f')} {vs}")
    for bs, seconds in ingest.items():
        print(f"memart ingestion {bs}: {seconds:.1f} s per conversation")


def main(argv=None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    if args.report_only:
        results = Results(args.out, None, True)
        results.data.update(json.loads(args.out.read_text()))
        report({"summary": summarize(results, None)}, [], results.data.get("ingest_s_per_conversation", {}))
        return
    from transformers import AutoConfig, AutoTokenizer

    from .plot import plot, plot_recompute

    tokenizer = AutoTokenizer.from_pretrained(models.resolve(args.model))
    convs = conversations(args, tokenizer)
    results = Results(args.out, settings(args), args.fresh)
    for c in convs:
        results.data["transcripts"][str(c.index)] = {
            "turns": len(c.turns),
            "tokens": len(c.ingest_ids),
            "questions": len(c.questions),
        }
    vs = variants(args.methods, args.top_k)
    context = AutoConfig.from_pretrained(models.resolve(args.model)).max_position_embeddings
    work = pending(results, vs, convs, context)
    total = sum(len(qs) for by_v in work.values() for by_c in by_v.values() for qs in by_c.values())
    embedder = metrics.minilm()
    # kept after the run: a failed request is read in the server's log
    logs = Path(tempfile.gettempdir()) / "sgl-memory-locomo"
    logs.mkdir(exist_ok=True)
    with tqdm(total=total, desc="questions", disable=None) as bar:
        runner = Runner(args, tokenizer, embedder, results, bar)
        for key in sorted(work, reverse=True):
            kind, block_size, compact, cut_at, kv_dtype = key
            todo = work[key]
            top_k = next((v.top_k for v in todo if v.method == "memart"), args.top_k)
            memory_on = any(v.method == "memart" for v in todo)
            # the memory section stays off when no MemArt variant runs: the other methods do not need it
            capacity = max(4096, sum(math.ceil(len(c.ingest_ids) / block_size) + 64 for c in convs))
            if kind == "defaults":
                config = defaults_config(logs)
            else:
                config = server_config(logs, block_size, top_k, memory_on, capacity, compact, cut_at)
            flags = server_flags(args.model, convs, {v.recording for v in todo}, kv_dtype)
            command = harness.our_command(args.model, "--memory-config", str(config), *flags)
            log = logs / f"{config.stem}{'' if kv_dtype == 'auto' else '-' + kv_dtype}.log"
            bar.set_description(f"starting server {config.stem}")
            server = harness.start(command, log)
            try:
                runner.serve(server, todo, convs)
            except Exception:
                print(f"server log {log}, last lines:\n{server.log()[-3000:]}")
                raise
            finally:
                harness.stop(server)
    result = results.data
    result["summary"] = summarize(results, convs)
    result["ingest_s_per_conversation"] = ingest_cost(results)
    results.save()
    plot(result, args.out.with_suffix(".png"), [v.label for v in vs])
    report(result, [v.label for v in vs], result["ingest_s_per_conversation"])
    if args.table:
        table = {"settings": settings(args), "questions_file": str(args.out), "rows": table_rows(result["summary"], vs)}
        args.table.write_text(json.dumps(table, indent=1))
        plot_recompute(table, args.table.with_suffix(".png"))


def table_rows(summary: dict, vs: list[Variant]) -> list[dict]:
    """One row per variant of this run: accuracy, time to first token, prefill and recomputation."""
    rows = []
    for v in vs:
        s = summary.get(v.label)
        if s is None:
            continue
        rows.append(
            {
                "method": v.label,
                "recompute": v.recompute if v.method == "memart" else v.method,
                "ratio": v.ratio,
                "hops": v.hops,
                "tasks": s["n"],
                "f1": s["f1"],
                "bleu1": s["bleu1"],
                "evidence_recall": s["evidence_recall"],
                "ttft_s": s["ttft_s"],
                "prefill_tokens": s["prefill_tokens"],
                "reused_tokens": s["reused_tokens"],
                "recomputed_token_layers": s["recomputed_token_layers"],
                "prefill_work_share": s["prefill_work_share"],
                "repair_ms": s["repair_ms"],
                "recompute_share": s["recompute_share"],
                "by_category": s["by_category"],
            }
        )
    return rows
