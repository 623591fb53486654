"""Where pruning loses on BFCL: the fidelity rows split by how much of the gold call is copied
out of the history that pruning may drop.

    .venv/bin/python -m bench.fidelity.copying [--points bench/results/fidelity.points.jsonl]

For each BFCL decision point the trajectories are rebuilt (no server) and the gold call's token
3-grams are matched against the prompt: `copied` is the share found in the compressible history
(between the system prompt and the latest message) and nowhere in the forced part. Points are
split into quartiles of `copied`; per quartile, each method's gold log-likelihood against the full
cache and against IntentKV memory, with 95% intervals resampling trajectories. Writes
`<points>.copying.json` beside the points file.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from bench.common import RESULTS, bootstrap, read_rows, write_json
from sgl_memory import models
from sgl_memory.core.spans import RoleMarkers, find_spans

from . import points as P

BASE = "intentkv-memory"
QUARTILES = 4


def _grams(ids: list[int]) -> set[tuple[int, ...]]:
    return {tuple(ids[i : i + 3]) for i in range(len(ids) - 2)}


def copied_share(point: P.Point, markers: RoleMarkers) -> float:
    spans = find_spans(point.history, markers, len(point.history))
    history = _grams(point.history[spans.system_end : spans.query_start])
    forced = _grams(point.history[: spans.system_end] + point.history[spans.query_start :])
    gold = _grams(point.gold)
    return sum(g in history and g not in forced for g in gold) / max(1, len(gold))


def split(rows: list[dict], shares: dict[tuple[str, int], float]) -> list[dict]:
    by_point: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)
    for r in rows:
        if r["workload"] == "bfcl" and (r["trajectory"], r["point"]) in shares:
            by_point[(r["trajectory"], r["point"])][r["method"]] = r
    keys = sorted((k for k, v in by_point.items() if BASE in v), key=lambda k: shares[k])
    methods = sorted({m for v in by_point.values() for m in v if v[m].get("budget") is not None})
    out = []
    for q in range(QUARTILES):
        part = keys[q * len(keys) // QUARTILES : (q + 1) * len(keys) // QUARTILES]
        for m in methods:
            vs_full: dict[str, list[float]] = defaultdict(list)
            vs_base: dict[str, list[float]] = defaultdict(list)
            for k in part:
                r = by_point[k].get(m)
                if r is None:
                    continue
                vs_full[k[0]].append(r["gold_logprob"] - r["ref_gold_logprob"])
                vs_base[k[0]].append(r["gold_logprob"] - by_point[k][BASE]["gold_logprob"])
            full, base = bootstrap(list(vs_full.values())), bootstrap(list(vs_base.values()))
            out.append(
                {
                    "quartile": q + 1,
                    "copied_low": shares[part[0]],
                    "copied_high": shares[part[-1]],
                    "method": m,
                    "n": sum(map(len, vs_full.values())),
                    "vs_full": full[0],
                    "vs_full_ci": full[1:],
                    f"vs_{BASE}": base[0],
                    f"vs_{BASE}_ci": base[1:],
                }
            )
    return out


def main(argv=None) -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(prog="python -m bench.fidelity.copying", description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=Path, default=RESULTS / "fidelity.points.jsonl")
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    args = ap.parse_args(argv)
    rows = read_rows(args.points)
    tokenizer = AutoTokenizer.from_pretrained(models.resolve(args.model))
    markers = RoleMarkers.from_tokenizer(tokenizer, "chatml")
    per_category = max(int(r["trajectory"].rsplit("_", 1)[1]) for r in rows if r["workload"] == "bfcl") + 1
    shares = {
        (t.id, i): copied_share(p, markers) for t in P.bfcl(tokenizer, per_category) for i, p in enumerate(t.points)
    }
    result = split(rows, shares)
    write_json(args.points.with_suffix(".copying.json"), {"rows": result})
    print("| copied share | method | N | vs full | vs IntentKV memory |\n|---|---|---|---|---|")
    for r in result:
        lo, hi = r[f"vs_{BASE}_ci"]
        print(
            f"| {r['copied_low']:.2f}-{r['copied_high']:.2f} | {r['method']} | {r['n']} | {r['vs_full']:+.1f} "
            f"[{r['vs_full_ci'][0]:+.1f}, {r['vs_full_ci'][1]:+.1f}] | {r[f'vs_{BASE}']:+.1f} [{lo:+.1f}, {hi:+.1f}] |"
        )


if __name__ == "__main__":
    main()
