"""KEEP on an embodied workload whose memory changes every step: TextWorld cooking games.

The agent's memory is what it observed, written through the memory entries API
(`POST /sgl_memory/memory/write`, sgl_memory/memart/writes.py): one entry per object's place, per
container's state, per ingredient's condition and per map link it has seen (updated by key when the
world changes: dynamic), the recipe once read, each step it took with its outcome, and the
subgoals it finished (the last three never rewritten: their groups turn static and get a joint KV).
At every step a memory-mode request carries only the current observation and the valid commands; the
server places the retrieved entries before it.

Games: `tw-cooking` (recipe 2, take 2, go 6, open, cook, cut; fixed seeds), generated offline by
TextWorld's own Inform7 compiler. Play is teacher-forced along the game's walkthrough, so every
method sees the same states and the same memory: at each step, each method answers from the same
session, and its command (the valid command its answer names, or the nearest one by words) is
scored against the walkthrough's next command (next-action accuracy; the walkthrough is the
solution, so accuracy 1 solves the game). Methods (`sgl_memory.memory.recompute`): full reuse
(`none`, MemArt as placed), full recompute (`full`, the retrieved entries' text prefilled again),
CacheBlend and KEEP at one ratio, KEEP with one hop, and no memory at all (the observation alone);
then, on a server with `memory.groups: false`, KEEP without static groups. TTFT per step is the
first streamed chunk (the probe included). Last, at the final step of each game, TTFT against the
number of retrieved blocks (KEEP's Figure 9).

    .venv/bin/python -m bench.keep_textworld [--games 6] [--top-k 16] [--ratio 0.3]
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import uuid
from pathlib import Path

import requests
from tqdm import tqdm

from sgl_memory import models
from sgl_memory.core.config import to_yaml
from sgl_memory.keep.settings import KeepConfig
from sgl_memory.memart.settings import MemArtConfig
from bench import harness

from .common import RESULTS, ok, write_json
from .locomo.run import generate

# method -> the request's memory object and keep object (None: no memory, the observation alone)
METHODS = {
    "none": ({"recompute": "none"}, {}),
    "full": ({"recompute": "full"}, {}),
    "cacheblend": ({"recompute": "cacheblend"}, {}),
    "keep": ({"recompute": "keep"}, {}),
    "keep_one_hop": ({"recompute": "keep"}, {"hops": 1}),
    "no_memory": None,
}
SWEEP = ("none", "full", "cacheblend", "keep")
CONDITIONS = ("chopped", "sliced", "diced", "cooked", "fried", "roasted", "grilled", "burned", "raw")
DIRECTIONS = ("north_of", "south_of", "east_of", "west_of")
SYSTEM = (
    "You are playing a text adventure game. {objective} Your memory holds what you observed earlier. "
    "Answer with exactly one of the valid commands and nothing else."
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.keep_textworld", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--games", type=int, default=6)
    ap.add_argument("--seed", type=int, default=100, help="game seeds are seed, seed+1, ...")
    ap.add_argument(
        "--top-k", type=int, default=16, help="retrieved blocks per step (entries and static groups come whole)"
    )
    ap.add_argument("--ratio", type=float, default=0.3, help="keep and cacheblend: the share recomputed at layer 1")
    ap.add_argument(
        "--sweep", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="retrieved blocks for the TTFT curve"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "keep_textworld.json")
    return ap.parse_args(argv)


# --- games ---------------------------------------------------------------------------------------


def make_game(seed: int, directory: Path) -> str:
    import textworld
    from textworld.challenges import CHALLENGES
    from textworld.generator import compile_game

    path = directory / f"cooking-{seed}.z8"
    if path.exists():
        return str(path)
    options = textworld.GameOptions()
    options.seeds, options.path, options.force_recompile = seed, str(path), True
    settings = {
        "recipe": 2,
        "take": 2,
        "go": 6,
        "open": True,
        "cook": True,
        "cut": True,
        "drop": False,
        "recipe_seed": 0,
        "split": None,
    }
    _, make, _ = CHALLENGES["tw-cooking"]
    return compile_game(make(settings=settings, options=options), options)


def start(gamefile: str):
    import textworld
    from textworld import EnvInfos

    infos = EnvInfos(
        admissible_commands=True,
        objective=True,
        description=True,
        facts=True,
        score=True,
        max_score=True,
        extras=["walkthrough"],
    )
    return textworld.start(gamefile, request_infos=infos)


def clean(text: str) -> str:
    """An observation without TextWorld's banner and prompt marks, blank lines folded."""
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not re.fullmatch(r"[\W_$]*", ln.replace(" ", "")) and ln != ">"]
    return "\n".join(ln.lstrip("> ").strip() for ln in lines if not re.search(r"[\\$]{3,}", ln))


def entity(arg) -> str:
    return arg.name


def fact_entries(facts, seen: set[str]) -> dict[str, str]:
    """The memory entries of the facts about entities the agent has seen, keyed so that a change
    of the world rewrites the entry it changes (an object's place, a container's state, ...)."""
    out, conditions = {}, {}
    for fact in facts:
        names = [entity(a) for a in fact.arguments]
        if any(n in ("P", "RECIPE") or n.startswith("ingredient_") for n in names) or not all(
            n in seen or n == "I" for n in names
        ):
            continue
        name = fact.name
        if name in ("at", "in", "on") and len(names) == 2:
            what, where = names
            if where == "I":
                out[f"place:{what}"] = f"You are carrying the {what}."
            else:
                out[f"place:{what}"] = f"The {what} is {'on' if name == 'on' else 'in'} the {where}."
        elif name in ("open", "closed", "locked") and len(names) == 1:
            out[f"state:{names[0]}"] = f"The {names[0]} is {name}."
        elif name in CONDITIONS and len(names) == 1:
            conditions.setdefault(names[0], []).append(name)
        elif name in DIRECTIONS and len(names) == 2:
            a, b = names
            out[f"map:{a}:{name}:{b}"] = f"The {a} is {name.replace('_of', '')} of the {b}."
    for what, states in conditions.items():
        out[f"condition:{what}"] = f"The {what} is {' and '.join(sorted(states))}."
    return out


def seen_entities(text: str, facts) -> set[str]:
    low = text.lower()
    return {entity(a) for f in facts for a in f.arguments if entity(a).lower() in low}


def choose_command(answer: str, admissible: list[str]) -> str:
    """The valid command the answer names: exact, else the one sharing the most words with it."""
    said = answer.strip().splitlines()[0].strip().strip(".").lower() if answer.strip() else ""
    if said in admissible:
        return said
    words = set(re.findall(r"[a-z]+", said))
    return max(admissible, key=lambda c: (len(words & set(c.split())) / (len(set(c.split())) or 1), -len(c)))


# --- the server ----------------------------------------------------------------------------------


def write(server, session: str, entries: dict[str, str]) -> dict:
    body = {"session_id": session, "entries": [{"key": k, "text": t} for k, t in entries.items()]}
    return ok(requests.post(server.url + "/sgl_memory/memory/write", json=body, timeout=600), "memory write").json()


def ask(server, ids: list[int], session: str, method: tuple[dict, dict] | None, top_k: int, ratio: float) -> dict:
    field = None
    if method is not None:
        memory, keep = method
        field = {"session_id": session, "memory": {"mode": "retrieve", "top_k": top_k, "store": False, **memory}}
        if memory["recompute"] in ("keep", "cacheblend"):
            field["keep"] = {"ratio": ratio, **keep}
    text, meta, _ = generate(server, ids, 10, field)
    m = meta.get("sgl_memory") or {}
    segments = (m.get("retrieved_entries") or 0) + (m.get("retrieved_static_groups") or 0)
    return {
        "answer": text,
        "ttft_s": meta["ttft_s"],
        "prefill_tokens": m.get("prefill_tokens", meta.get("prompt_tokens")),
        "memory_kv_tokens": m.get("memory_kv_tokens", 0),
        "recomputed_token_layers": m.get("recomputed_token_layers", 0),
        "retrieved_blocks": m.get("retrieved_blocks", 0),
        "segments": segments,
        "static_groups_placed": m.get("retrieved_static_groups", 0),
    }


def server_config(directory: Path, groups: bool) -> Path:
    path = directory / f"keep-textworld{'' if groups else '-no-groups'}.yaml"
    memory = MemArtConfig(
        enabled=True, block_size=16, cut="tokens", unit="block", placed_tokens=0, groups=groups, static_after=3
    )
    path.write_text(to_yaml(memory, KeepConfig(enabled=True), harness.PERSIST_OFF))
    return path


def play(server, tokenizer, gamefile: str, methods: dict, args, bar, sweep: bool) -> tuple[list[dict], list[dict]]:
    """One game along its walkthrough; every method answers at every step from the same memory."""
    env = start(gamefile)
    state = env.reset()
    session = f"tw-{uuid.uuid4().hex[:8]}"
    system = SYSTEM.format(objective=clean(state["objective"]))
    walkthrough = list(state["extra.walkthrough"])
    seen, written, text, score, steps, curve = set(), {}, clean(state["description"]), 0, [], []
    book = {"static_groups": 0}
    for step, target in enumerate(walkthrough):
        seen |= seen_entities(text, state["facts"])
        entries = {k: v for k, v in fact_entries(state["facts"], seen).items() if written.get(k) != v}
        if entries:
            book = write(server, session, entries)["book"]
            written.update(entries)
        user = f"{text}\n\nValid commands: {', '.join(state['admissible_commands'])}\n\nWhat is the best next command?"
        ids = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": user}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for name, method in methods.items():
            out = ask(server, ids, session, method, args.top_k, args.ratio)
            command = choose_command(out.pop("answer"), state["admissible_commands"])
            steps.append(
                {
                    "method": name,
                    "step": step,
                    "target": target,
                    "command": command,
                    "correct": command == target,
                    "memory_entries": len(written),
                    "static_groups": book["static_groups"],
                    **out,
                }
            )
            bar.update()
        if sweep and step == len(walkthrough) - 1:
            for top_k in args.sweep:
                for name in SWEEP:
                    curve.append(
                        {"method": name, "top_k": top_k, **ask(server, ids, session, METHODS[name], top_k, args.ratio)}
                    )
        state, new_score, _ = env.step(target)
        feedback = clean(state.feedback)
        # what it did, one entry per step: never rewritten, so these groups turn static
        outcome = feedback.splitlines()[0][:160] if feedback else ""
        book = write(server, session, {f"step:{step}": f"Step {step + 1}: you did '{target}'. {outcome}"})["book"]
        written[f"step:{step}"] = target
        if target == "examine cookbook":
            book = write(server, session, {"recipe": feedback})["book"]
            written["recipe"] = feedback
        if new_score > score:
            done = f"done:{len([k for k in written if k.startswith('done:')])}"
            book = write(server, session, {done: f"Done: {target}."})["book"]
            written[done] = target
        score, text = new_score, feedback
    env.close()
    return steps, curve


def summarize(steps: list[dict]) -> list[dict]:
    rows = []
    for name in dict.fromkeys(s["method"] for s in steps):
        mine = [s for s in steps if s["method"] == name]
        med = lambda k: statistics.median(s[k] or 0 for s in mine)  # noqa: E731
        rows.append(
            {
                "method": name,
                "tasks": len(mine),
                "next_action_acc": round(sum(s["correct"] for s in mine) / len(mine), 4),
                "ttft_s": round(med("ttft_s"), 4),
                "prefill_tokens": med("prefill_tokens"),
                "recomputed_token_layers": med("recomputed_token_layers"),
                "memory_kv_tokens": med("memory_kv_tokens"),
                "segments": med("segments"),
            }
        )
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    rows = result["rows"]
    x = range(len(rows))
    ax1.bar(x, [r["next_action_acc"] for r in rows], color="tab:blue")
    ax1.set_xticks(list(x), [f"{r['method']}\nTTFT {r['ttft_s']:.2f}s" for r in rows], fontsize=8)
    ax1.set_ylabel("next-action accuracy")
    ax1.set_title(
        f"{result['settings']['games']} cooking games, {rows[0]['tasks']} steps, "
        f"top {result['settings']['top_k']} blocks"
    )
    for name in SWEEP:
        pts = {}
        for r in result["curve"]:
            if r["method"] == name:
                pts.setdefault(r["top_k"], []).append(r["ttft_s"])
        ks = sorted(pts)
        ax2.plot(ks, [statistics.median(pts[k]) for k in ks], marker="o", label=name)
    ax2.set_xlabel("retrieved blocks (top_k; entries and groups come whole)")
    ax2.set_ylabel("TTFT, s (median over games)")
    ax2.set_title("TTFT vs retrieved memory, last step of each game")
    ax2.legend()
    fig.suptitle(f"KEEP on TextWorld: {result['settings']['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.resolve(args.model))
    work = Path(tempfile.gettempdir()) / "sgl-memory-keep-textworld"
    work.mkdir(exist_ok=True)
    games = [make_game(args.seed + i, work) for i in tqdm(range(args.games), desc="games", disable=None)]
    lengths = [len(start(g).reset()["extra.walkthrough"]) for g in games]
    total = sum(lengths) * (len(METHODS) + 1)
    steps, curve = [], []
    with tqdm(total=total, desc="requests", disable=None) as bar:
        for groups, methods in ((True, METHODS), (False, {"keep_no_groups": METHODS["keep"]})):
            server = harness.start(
                harness.our_command(args.model, "--memory-config", str(server_config(work, groups))),
                work / f"server-{'groups' if groups else 'no-groups'}.log",
            )
            try:
                for i, game in enumerate(games):
                    s, c = play(server, tokenizer, game, methods, args, bar, sweep=groups)
                    steps += [{**r, "game": i} for r in s]
                    curve += [{**r, "game": i} for r in c]
            finally:
                harness.stop(server)
    settings = {
        "model": args.model,
        "games": args.games,
        "seeds": [args.seed + i for i in range(args.games)],
        "top_k": args.top_k,
        "ratio": args.ratio,
        "walkthrough_steps": lengths,
        "block_size": 16,
        "static_after": 3,
    }
    result = {"settings": settings, "rows": summarize(steps), "curve": curve, "steps": steps}
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    print(f"{'method':>15} {'acc':>6} {'TTFT s':>7} {'prefill':>8} {'recomputed':>10} {'segments':>8}")
    for r in result["rows"]:
        print(
            f"{r['method']:>15} {r['next_action_acc']:6.3f} {r['ttft_s']:7.3f} {r['prefill_tokens']:8.0f} "
            f"{r['recomputed_token_layers']:10.0f} {r['segments']:8.1f}"
        )


if __name__ == "__main__":
    main()
