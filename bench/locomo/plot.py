"""bench/results/locomo.png: answer quality per variant, and what each variant paid for it."""

from __future__ import annotations

from pathlib import Path

QUALITY = (
    ("f1", "token F1"),
    ("bleu1", "BLEU-1"),
    ("sim", "MiniLM similarity"),
    ("evidence_recall", "evidence recall"),
)


def plot(result: dict, path: Path, order: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    labels = sorted(summary, key=lambda s: (order.index(s) if s in order else len(order), s))
    if not labels:
        return
    x = range(len(labels))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 5))
    width = 0.8 / len(QUALITY)
    for j, (name, title) in enumerate(QUALITY):
        ax1.bar([i + j * width for i in x], [summary[s][name] or 0 for s in labels], width, label=title)
    ax1.set_xticks([i + 0.4 - width / 2 for i in x], labels, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("mean over questions")
    ax1.set_title("answer quality")
    ax1.legend(fontsize=8)
    for ax, names, title in (
        (
            ax2,
            (("prefill_tokens", "prefill"), ("kv_decode_tokens", "KV length in decode")),
            "tokens per question (log)",
        ),
        (ax3, (("wall_s", "wall"), ("e2e_latency", "server e2e")), "seconds per question"),
    ):
        w = 0.8 / len(names)
        for j, (name, legend) in enumerate(names):
            ax.bar([i + j * w for i in x], [summary[s][name] or 0 for s in labels], w, label=legend)
        ax.set_xticks([i + 0.4 - w / 2 for i in x], labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    ax2.set_yscale("log")
    n = {s: summary[s]["n"] for s in labels}
    fig.suptitle(f"LoCoMo, {result['settings']['model']}, questions per variant: {sorted(set(n.values()))}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_recompute(table: dict, path: Path) -> None:
    """Accuracy against time to first token per variant (KEEP's trade-off), and the share of the
    placed KV each recomputed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table["rows"] if r["ttft_s"] is not None]
    if not rows:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    for r in rows:
        ax1.scatter(r["ttft_s"], r["f1"], s=40)
        ax1.annotate(r["method"].split("-max")[-1].strip("-") or r["method"], (r["ttft_s"], r["f1"]), fontsize=7)
    ax1.set_xlabel("time to first token, s (mean)")
    ax1.set_ylabel("token F1 (mean)")
    ax1.set_title("accuracy vs TTFT")
    labels = [r["method"].split("-max")[-1].strip("-") or r["method"] for r in rows]
    ax2.bar(range(len(rows)), [r["recompute_share"] or 0 for r in rows])
    ax2.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    ax2.set_title("recomputed share of placed KV (tokens x layers)")
    fig.suptitle(
        f"LoCoMo recomputation of placed memory, {table['settings']['model']}, "
        f"questions: {sorted({r['tasks'] for r in rows})}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
