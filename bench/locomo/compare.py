"""The same variant in several LoCoMo result files: how many answers and retrieved blocks differ.

    .venv/bin/python -m bench.locomo.compare A.json B.json [...] [--variant LABEL] [--out FILE]

Two runs of one configuration on the same code must agree on every answer (tests/
test_determinism_server.py checks it on a small script); runs of different code tell how much
the code moved the answers. Per pair: questions in both, answers that differ, retrieved-span lists
that differ (when both files record them), and each file's F1 over those questions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import write_json

from .run import main_memart


def rows(path: Path, variant: str) -> dict[str, dict]:
    data = json.loads(path.read_text())
    return {k.split("|", 1)[1]: v for k, v in data["rows"].items() if k.startswith(variant + "|")}


def compare(a: dict[str, dict], b: dict[str, dict]) -> dict:
    both = sorted(set(a) & set(b))
    spans = [q for q in both if "retrieved_spans" in a[q] and "retrieved_spans" in b[q]]
    return {
        "questions": len(both),
        "answers_differ": sum(a[q]["prediction"] != b[q]["prediction"] for q in both),
        "spans_compared": len(spans),
        "spans_differ": sum(a[q]["retrieved_spans"] != b[q]["retrieved_spans"] for q in spans),
        "f1": [sum(r[q]["f1"] for q in both) / len(both) if both else None for r in (a, b)],
        "commits": [sorted({r[q].get("commit", "unrecorded") for q in both}) for r in (a, b)],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.locomo.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", type=Path, nargs="+")
    ap.add_argument("--variant", default=main_memart(64).label)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    loaded = [rows(f, args.variant) for f in args.files]
    pairs = [
        {"a": str(args.files[i]), "b": str(args.files[j]), **compare(loaded[i], loaded[j])}
        for i in range(len(loaded))
        for j in range(i + 1, len(loaded))
    ]
    for p in pairs:
        print(
            f"{p['a']} vs {p['b']}: {p['answers_differ']} of {p['questions']} answers differ, "
            f"{p['spans_differ']} of {p['spans_compared']} span lists; F1 {p['f1'][0]:.3f} vs {p['f1'][1]:.3f}"
        )
    if args.out:
        write_json(args.out, {"variant": args.variant, "pairs": pairs})


if __name__ == "__main__":
    main()
