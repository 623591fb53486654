"""Offline study of MemArt block retrieval on LoCoMo: which scoring choices find the evidence turns.

Replicates the server's retrieval (position-free keys of the ingested transcript cut into 16-token
blocks, AABB bounds of the probe queries, per-row normalisation over blocks, aggregation over
tokens, mean over layers and heads, top-k) with transformers on CPU, then varies one choice at a
time: normalisation x aggregation, layers, scoring tokens, bound (AABB vs exact per-key max vs
block centroid) and how heads combine. The measure is evidence recall: the share of a question's
evidence turns that some retrieved block overlaps, at 32, 64 and 128 blocks.

Questions: the 24 the LoCoMo benchmark used on conversation 1 (stratified, seed 0), the other 57
of that conversation as a held-out check on choices picked from the 24, and all 81.

    .venv/bin/python -m bench.locomo.retrieval_study [--fresh]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from itertools import product
from pathlib import Path

import torch

from bench.common import write_json
from sgl_memory import models
from sgl_memory.core.spans import RoleMarkers, find_spans
from sgl_memory.memart.retrieval import AGGS, NORMS, aabb_logits, block_scores, top_blocks

from . import data, prompts

CONVERSATION = 1
BLOCK = 16
RR_C = 60.0
KS = (32, 64, 128)
BENCH_QUESTIONS = 24
CHUNK = 1024
CACHE = Path("/tmp/sgl_memory_retrieval_study")
OUT = Path(__file__).resolve().parents[1] / "results" / "locomo_retrieval_study.json"
DEFAULT = ("aabb", "rr", "max", "query", "mean", "all")  # the server's retrieval today

# Layer sets, by name; "L<i>" single layers are added in the layer family.
BANDS = {
    "all": range(24),
    ">=4": range(4, 24),
    ">=8": range(8, 24),
    ">=12": range(12, 24),
    ">=16": range(16, 24),
    "6-17": range(6, 18),
    "<12": range(0, 12),
    "<6": range(0, 6),
}


# ---------------------------------------------------------------- model passes (cached in /tmp)


def load_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.model_dir(models.DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    # bf16 like the server's KV cache; this CPU has avx512_bf16, so it is not slower than float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    return tok, model


class Capture:
    """Outputs of one projection (k_proj or q_proj) of every layer: pre-RoPE, bias included."""

    def __init__(self, model, proj: str):
        self.rows: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            self.handles.append(getattr(layer.self_attn, proj).register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def hook(module, args, out):
            self.rows.setdefault(i, []).append(out[0].detach().clone())  # batch 1 -> [T, heads * D]

        return hook

    def stacked(self, head_dim: int) -> torch.Tensor:
        """[L, T, heads, D] in the model's dtype."""
        layers = [torch.cat(self.rows[i]) for i in sorted(self.rows)]
        return torch.stack([x.reshape(x.shape[0], -1, head_dim) for x in layers])

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.inference_mode()
def ingest_keys(model, ids: list[int], head_dim: int) -> torch.Tensor:
    """Pre-RoPE keys [L, T, Hkv, D] of the whole ingest sequence, one causal pass in chunks."""
    from transformers import DynamicCache

    cap, cache = Capture(model, "k_proj"), DynamicCache()
    t0 = time.time()
    for s in range(0, len(ids), CHUNK):
        # logits_to_keep=1: the LM head over 150k vocab for every token would cost more than the layers
        model(input_ids=torch.tensor([ids[s : s + CHUNK]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        print(f"  ingest {min(s + CHUNK, len(ids))}/{len(ids)} tokens, {time.time() - t0:.0f} s", flush=True)
    cap.close()
    return cap.stacked(head_dim)


@torch.inference_mode()
def question_queries(model, ids: list[int], head_dim: int) -> torch.Tensor:
    cap = Capture(model, "q_proj")
    model(input_ids=torch.tensor([ids]), logits_to_keep=1)
    cap.close()
    return cap.stacked(head_dim)


def cached(name: str, fresh: bool, make):
    path = CACHE / name
    if path.exists() and not fresh:
        return torch.load(path)
    value = make()
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.save(value, path)
    return value


# ---------------------------------------------------------------- the conversation and its questions


class Setup:
    def __init__(self, tok):
        sample = data.load()[CONVERSATION]
        turns = data.turns(sample)
        self.transcript = data.render(turns)
        self.ids = prompts.ingest_ids(tok, self.transcript)
        token_turn = prompts.ingest_turn_of_tokens(tok, turns)
        lines = sorted(turns, key=lambda t: t.index)
        self.n_blocks = math.ceil(len(self.ids) / BLOCK)
        self.block_dias = [
            {lines[i].dia_id for i in token_turn[b * BLOCK : (b + 1) * BLOCK] if i is not None}
            for b in range(self.n_blocks)
        ]
        self.known_dias = {t.dia_id for t in turns}
        everything = data.questions(sample, CONVERSATION)
        bench = {q.qa_index for q in data.stratified(list(everything), BENCH_QUESTIONS, seed=0)}
        self.questions = [q for q in everything if q.evidence]
        self.sets = {
            "bench24": [q.qa_index for q in self.questions if q.qa_index in bench],
            "other": [q.qa_index for q in self.questions if q.qa_index not in bench],
            "all": [q.qa_index for q in self.questions],
        }
        self.markers = RoleMarkers.from_tokenizer(tok, "chatml")

    def recall(self, q: data.Question, blocks: list[int]) -> float:
        covered = set().union(*(self.block_dias[b] for b in blocks))
        return sum(e in covered for e in q.evidence) / len(q.evidence)


def token_sets(tok, markers, question: str) -> tuple[list[int], dict[str, list[int]]]:
    """The prompt ids and, per scoring choice, the positions whose queries score the blocks."""
    ids = prompts.question_only(tok, question)
    n = len(ids)
    query_start = find_spans(ids, markers, n).query_start
    # the question text by character offsets in the rendered template, so the "Question:" prefix
    # and the chat markup stay out whatever the tokenizer merges at the edges
    messages = [{"role": "system", "content": prompts.SYSTEM}, {"role": "user", "content": f"Question: {question}"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids, "rendered template does not tokenize to the prompt ids"
    start = text.rindex(question)
    end = start + len(question)
    qtext = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > start and a < end and i >= query_start]
    return ids, {"all": list(range(n)), "query": list(range(query_start, n)), "question": qtext, "last": [n - 1]}


# ---------------------------------------------------------------- bounds: raw logits [L, T, H, N]


def aabb_boxes(keys: torch.Tensor, n_blocks: int, size: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    lo = torch.stack([keys[:, b * size : (b + 1) * size].amin(1) for b in range(n_blocks)], 1)
    hi = torch.stack([keys[:, b * size : (b + 1) * size].amax(1) for b in range(n_blocks)], 1)
    return lo, hi  # [L, N, Hkv, D]


def centroids(keys: torch.Tensor, n_blocks: int) -> torch.Tensor:
    return torch.stack([keys[:, b * BLOCK : (b + 1) * BLOCK].mean(1) for b in range(n_blocks)], 1)


def exact_logits(q: torch.Tensor, keys: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """max over a block's keys of q.k / sqrt(D): what the AABB bound over-estimates."""
    L, T, H, D = q.shape
    Hkv = keys.shape[2]
    pad = n_blocks * BLOCK - keys.shape[1]
    out = []
    for layer in range(L):  # one layer at a time keeps the [T, H, tokens] product to ~30 MB
        s = torch.einsum("tkgd,nkd->tkgn", q[layer].reshape(T, Hkv, H // Hkv, D), keys[layer])
        s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
        out.append(s.reshape(T, H, n_blocks, BLOCK).amax(-1))
    return torch.stack(out) / math.sqrt(D)


def centroid_logits(q: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    L, T, H, D = q.shape
    Hkv = cent.shape[2]
    s = torch.einsum("ltkgd,lnkd->ltkgn", q.reshape(L, T, Hkv, H // Hkv, D), cent)
    return s.reshape(L, T, H, -1) / math.sqrt(D)


def sub_box_logits(q: torch.Tensor, keys: torch.Tensor, n_blocks: int, size: int) -> torch.Tensor:
    """A block's bound as the max over boxes of `size` tokens: a tighter bound at BLOCK/size times
    the boxes, which the server's kernel could score as they are."""
    lo, hi = aabb_boxes(keys, math.ceil(keys.shape[1] / size), size)
    s = aabb_logits(q, lo, hi)
    s = torch.nn.functional.pad(s, (0, n_blocks * (BLOCK // size) - s.shape[-1]), value=float("-inf"))
    return s.reshape(*s.shape[:-1], n_blocks, BLOCK // size).amax(-1)


def all_bounds(q, lo, hi, keys, cent, n_blocks, query_start) -> dict[str, tuple[torch.Tensor, int]]:
    """Raw logits per bound, with the first prompt position their rows cover. Only the server's
    AABB is scored over every prompt token; the rest start at the query span, which holds every
    other token set, since "all tokens" loses to it for the AABB and scoring fewer rows keeps the
    study within its time budget. The kv-group forms give one row per KV head, not per query head."""
    L, T, H, D = q.shape
    Hkv = lo.shape[2]
    qs = q[:, query_start:]
    aabb = aabb_logits(q, lo, hi)
    return {
        "aabb": (aabb, 0),
        "exact": (exact_logits(qs, keys, n_blocks), query_start),
        "centroid": (centroid_logits(qs, cent), query_start),
        "aabb-sub4": (sub_box_logits(qs, keys, n_blocks, 4), query_start),
        "aabb-sub8": (sub_box_logits(qs, keys, n_blocks, 8), query_start),
        # the group's query heads averaged before the bound: one query vector per KV head
        "aabb-kvq": (aabb_logits(qs.reshape(L, -1, Hkv, H // Hkv, D).mean(3), lo, hi), query_start),
        # the group's bounds averaged before normalising: one vote per KV head
        "aabb-kvlogit": (aabb[:, query_start:].reshape(L, -1, Hkv, H // Hkv, n_blocks).mean(3), query_start),
    }


# ---------------------------------------------------------------- scores and recall


def per_layer(normed: torch.Tensor, agg: str, tokens: list[int], heads: str) -> torch.Tensor:
    """Normalised rows [L, T, H, N] -> per-layer block scores [L, N]; layer sets are means of these
    rows, which is what block_scores' mean over (layers, heads) gives for the mean-over-heads case."""
    a = AGGS[agg](normed[:, tokens], 1)  # [L, H, N]
    return a.mean(1) if heads == "mean" else a.amax(1)


def question_scores(bounds: dict[str, tuple[torch.Tensor, int]], tsets: dict[str, list[int]], rr_c: float = RR_C):
    """Every (bound, norm, agg, tokens, heads) -> [L, N]. Rows are normalised over the blocks once
    per bound and norm, then sliced by token set, since normalisation never mixes tokens."""
    out = {}
    for bound, (logits, first) in bounds.items():
        for norm in NORMS:
            normed = NORMS[norm](logits, rr_c)
            for agg, tokens, heads in product(AGGS, tsets, ("mean", "max")):
                if min(tsets[tokens]) >= first:
                    rows = [t - first for t in tsets[tokens]]
                    out[(bound, norm, agg, tokens, heads)] = per_layer(normed, agg, rows, heads)
    return out


def layer_index(name: str) -> list[int]:
    return [int(name[1:])] if name.startswith("L") and name[1:].isdigit() else list(BANDS[name])


def recalls(setup: Setup, q: data.Question, scores: torch.Tensor) -> list[float]:
    return [setup.recall(q, top_blocks(scores, k)) for k in KS]


def random_baseline(setup: Setup, q: data.Question, draws: int = 200) -> list[float]:
    rng = random.Random(q.qa_index)
    return [sum(setup.recall(q, rng.sample(range(setup.n_blocks), k)) for _ in range(draws)) / draws for k in KS]


# ---------------------------------------------------------------- variant families


def name(v: tuple) -> str:
    bound, norm, agg, tokens, heads, layers = v
    return f"{bound}/{norm}-{agg}/tok={tokens}/heads={heads}/layers={layers}"


def fam_default() -> list[tuple]:
    return [DEFAULT]


def fam_norm_agg() -> list[tuple]:
    return [("aabb", n, a, "query", "mean", "all") for n in NORMS for a in AGGS]


def fam_layers() -> list[tuple]:
    singles = [("aabb", "rr", "max", "query", "mean", f"L{i}") for i in range(24)]
    bands = [("aabb", n, a, "query", "mean", b) for n, a in (("rr", "max"), ("softmax", "sum")) for b in BANDS]
    return singles + bands


def fam_tokens() -> list[tuple]:
    return [
        ("aabb", n, a, t, "mean", "all")
        for n, a in (("rr", "max"), ("rr", "sum"), ("softmax", "sum"))
        for t in ("all", "query", "question", "last")
    ]


def fam_bounds() -> list[tuple]:
    return [
        (b, n, a, t, "mean", "all")
        for b in ("aabb", "aabb-sub8", "aabb-sub4", "exact", "centroid")
        for n, a in (("rr", "max"), ("softmax", "sum"), ("softmax", "max"))
        for t in ("query", "question")
    ]


def fam_heads() -> list[tuple]:
    return [
        (b, "rr", "max", "query", h, "all")
        for b, h in (("aabb", "mean"), ("aabb", "max"), ("aabb-kvq", "mean"), ("aabb-kvlogit", "mean"))
    ]


def fam_grid() -> list[tuple]:
    """Every combination with layer bands (no single layers): the families above vary one choice
    from the default, and the best choices need not add up."""
    bounds = ("aabb", "aabb-sub8", "aabb-sub4", "exact", "centroid", "aabb-kvq", "aabb-kvlogit")
    grid = product(bounds, NORMS, AGGS, ("all", "query", "question", "last"), ("mean", "max"), BANDS)
    return [v for v in grid if v[0] == "aabb" or v[3] != "all"]


FAMILIES = {
    "1 default": fam_default,
    "2 norm x agg": fam_norm_agg,
    "3 layers": fam_layers,
    "4 tokens": fam_tokens,
    "5 bound": fam_bounds,
    "6 heads": fam_heads,
}
RR_CONSTANTS = (1.0, 10.0, 60.0, 200.0)


# ---------------------------------------------------------------- the run


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def overlap(sets: list[set[int]]) -> float:
    """Mean share of its top-64 blocks that one question has in common with another."""
    pairs = [(a, b) for n, a in enumerate(sets) for b in sets[n + 1 :]]
    return mean([len(a & b) / len(a) for a, b in pairs])


def summarize(per_q: dict[int, list[float]], qids: list[int]) -> dict[str, float]:
    return {f"recall@{k}": round(mean([per_q[i][j] for i in qids]), 4) for j, k in enumerate(KS)}


def paired(per_q: dict, base: dict, qids: list[int], j: int = 1) -> dict[str, float]:
    """Mean difference to the default at 64 blocks and its standard error over questions."""
    d = [per_q[i][j] - base[i][j] for i in qids]
    m = mean(d)
    se = (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
    return {"diff@64": round(m, 4), "se": round(se, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fresh", action="store_true", help="recompute the model passes cached in /tmp")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    t_start = time.time()

    tok, model = load_model()
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    setup = Setup(tok)
    print(
        f"conversation {CONVERSATION}: {len(setup.ids)} ingest tokens, {setup.n_blocks} blocks, "
        f"{len(setup.questions)} questions with evidence",
        flush=True,
    )
    missing = sorted({e for q in setup.questions for e in q.evidence} - setup.known_dias)
    if missing:
        print(f"  evidence ids absent from the transcript (never recallable): {missing}")

    keys = cached(
        f"keys_conv{CONVERSATION}_bf16.pt", args.fresh, lambda: ingest_keys(model, setup.ids, head_dim)
    ).float()
    lo, hi = aabb_boxes(keys, setup.n_blocks)
    cent = centroids(keys, setup.n_blocks)

    prompts_of = {q.qa_index: token_sets(tok, setup.markers, q.question) for q in setup.questions}
    queries = cached(
        f"queries_conv{CONVERSATION}_bf16.pt",
        args.fresh,
        lambda: {i: question_queries(model, ids, head_dim) for i, (ids, _) in prompts_of.items()},
    )
    print(f"model passes ready, {time.time() - t_start:.0f} s", flush=True)

    variants = {}
    for fam, make in FAMILIES.items():
        for v in make():
            variants.setdefault(v, fam)
    for v in fam_grid():
        variants.setdefault(v, "grid")

    results: dict[tuple, dict[int, list[float]]] = {v: {} for v in variants}
    rr_const: dict[float, dict[int, list[float]]] = {c: {} for c in RR_CONSTANTS}
    rand: dict[int, list[float]] = {}
    picked: dict[tuple, list[set[int]]] = {v: [] for v in variants}
    for n, q in enumerate(setup.questions):
        i = q.qa_index
        qf = queries[i].float()
        tsets = prompts_of[i][1]
        bounds = all_bounds(qf, lo, hi, keys, cent, setup.n_blocks, tsets["query"][0])
        table = question_scores(bounds, tsets)
        # the derived path must be the server's function exactly
        server = block_scores(aabb_logits(qf[:, tsets["query"]], lo, hi), "rr", "max", RR_C)
        assert torch.allclose(server, table[DEFAULT[:5]].mean(0), atol=1e-6), "default does not match block_scores"
        for v in variants:
            scores = table[v[:5]][layer_index(v[5])].mean(0)
            results[v][i] = recalls(setup, q, scores)
            picked[v].append(set(top_blocks(scores, 64)))
        for c in RR_CONSTANTS:
            rr_const[c][i] = recalls(setup, q, block_scores(aabb_logits(qf[:, tsets["query"]], lo, hi), "rr", "max", c))
        rand[i] = random_baseline(setup, q)
        if n % 10 == 0:
            print(f"  scored {n + 1}/{len(setup.questions)} questions, {time.time() - t_start:.0f} s", flush=True)

    base = results[DEFAULT]
    out = {
        "settings": {
            "model": models.DEFAULT_MODEL,
            "dtype": "bfloat16 model, float32 keys/queries",
            "conversation": CONVERSATION,
            "block_size": BLOCK,
            "rr_constant": RR_C,
            "ingest_tokens": len(setup.ids),
            "blocks": setup.n_blocks,
            "questions": {k: len(v) for k, v in setup.sets.items()},
            "default": name(DEFAULT),
            "missing_evidence_ids": missing,
        },
        "variants": {},
    }

    def record(label: str, fam: str, per_q: dict, sets: list[set[int]] | None = None) -> None:
        entry = {"family": fam, **summarize(per_q, setup.sets["bench24"])}
        if sets:
            entry["overlap@64"] = round(overlap(sets), 4)
        for s in ("other", "all"):
            entry[s] = summarize(per_q, setup.sets[s])
        entry["all"].update(paired(per_q, base, setup.sets["all"]))
        out["variants"][label] = entry

    record("random blocks", "0 baseline", rand)
    for v, fam in variants.items():
        record(name(v), fam, results[v], picked[v])
    for c in RR_CONSTANTS:
        record(name(DEFAULT) + f"/rr_c={c:g}", "7 rr constant", rr_const[c])
    write_json(args.out, out)

    report(out)
    print(f"\nwrote {args.out}, {time.time() - t_start:.0f} s")
    return 0


def report(out: dict) -> None:
    rows = out["variants"]
    head = (
        f"{'variant':64} {'@32':>6} {'@64':>6} {'@128':>6} "
        f"| {'oth@64':>6} {'all@64':>6} {'dAll':>6} {'se':>5} {'ovl':>5}"
    )

    def line(label, e):
        a = e["all"]
        return (
            f"{label:64} {e['recall@32']:6.3f} {e['recall@64']:6.3f} {e['recall@128']:6.3f} | "
            f"{e['other']['recall@64']:6.3f} {a['recall@64']:6.3f} {a['diff@64']:+6.3f} {a['se']:5.3f} "
            f"{e.get('overlap@64', float('nan')):5.2f}"
        )

    q = out["settings"]["questions"]
    print(
        f"\nrecall on bench24 ({q['bench24']} q) at 32/64/128 blocks "
        f"| @64 on the other {q['other']}, on all {q['all']}, "
        f"difference to the default on all (paired, with standard error), top-64 overlap between questions"
    )
    print(head)
    for fam in sorted({e["family"] for e in rows.values()} - {"grid"}):
        print(f"-- {fam}")
        for label, e in rows.items():
            if e["family"] == fam:
                print(line(label, e))
    # picked on the 24, so the "other" column is the held-out check of each choice
    grid = list(rows.items())
    boxes = [(label, e) for label, e in grid if label.startswith("aabb")]
    for subset, title in ((grid, "all variants"), (boxes, "box bounds (what the AABB index can give)")):
        print(f"-- best 12 of {len(subset)} {title}, by recall@64 on bench24")
        for label, e in sorted(subset, key=lambda e: e[1]["recall@64"], reverse=True)[:12]:
            print(line(label, e))


if __name__ == "__main__":
    raise SystemExit(main())
