"""bench/fidelity without a server: its decision points and its KL against brute-force references."""

from __future__ import annotations

import math
import random

import pytest

from bench.fidelity import points as P
from bench.fidelity.run import kl_rest
from sgl_memory import models


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.resolve(models.DEFAULT_MODEL))


def exact_kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def distribution(rng: random.Random, n: int, sharp: float) -> list[float]:
    w = [math.exp(sharp * rng.gauss(0, 1)) for _ in range(n)]
    return [x / sum(w) for x in w]


@pytest.mark.parametrize("seed", range(5))
def test_the_top_k_kl_is_the_exact_kl_of_the_merged_rest_and_a_lower_bound(seed):
    """Over the reference's top tokens plus one bucket for the rest it equals, brute force, the KL
    of the two distributions with every other token merged into one outcome; and merging never
    raises a KL (log-sum inequality), so it is at most the whole-vocabulary KL."""
    rng = random.Random(seed)
    p, q = distribution(rng, 500, 2.0), distribution(rng, 500, 2.0)
    top = sorted(range(500), key=lambda i: -p[i])[:20]
    rest = [i for i in range(500) if i not in top]
    merged_p = [p[i] for i in top] + [sum(p[i] for i in rest)]
    merged_q = [q[i] for i in top] + [sum(q[i] for i in rest)]
    got = kl_rest([[i, math.log(p[i])] for i in top], {i: math.log(q[i]) for i in top})
    assert got == pytest.approx(exact_kl(merged_p, merged_q), rel=1e-9, abs=1e-12)
    assert got <= exact_kl(p, q) + 1e-12
    assert kl_rest([[i, math.log(p[i])] for i in top], {i: math.log(p[i]) for i in top}) == pytest.approx(0, abs=1e-12)


def test_locomo_points_are_independent_questions_with_every_methods_prompt(tokenizer):
    """A LoCoMo trajectory is one stratified dev question. Its prompt is the whole transcript (a
    user message of its own, so pruning may drop it) and then the question, as the chat template
    renders them; its gold is the dataset's answer through the end-of-turn token, and the same
    tokens follow each alternate prompt (the question alone, for KV memory; the question after
    retrieved turns within the text budget, every turn the transcript's own); the group's memory
    is the transcript's tokens, recorded a LoCoMo session per turn."""
    from bench.locomo import data, prompts

    trajs = P.locomo(tokenizer, [1], 5)
    sample = data.load()[1]
    qs = data.stratified(data.questions(sample, 1), 5)
    transcript = data.render(data.turns(sample))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert [t.id for t in trajs] == [f"conv1-q{q.qa_index}" for q in qs]
    for traj, q in zip(trajs, qs):
        (pt,) = traj.points
        assert traj.group == "conv1" and traj.ingest[-1] == prompts.ingest_ids(tokenizer, transcript)
        # one request per LoCoMo session, each extending the one before by that session's lines
        sessions = sorted({(t.session, t.date) for t in data.turns(sample)})
        assert len(traj.ingest) == len(sessions)
        for (_, date), before, ids in zip(sessions, [[]] + traj.ingest, traj.ingest):
            assert ids[: len(before)] == before and tokenizer.decode(ids[len(before) :]).lstrip("\n").startswith(
                f"{prompts.CONTEXT_HEADER if not before else ''}[{date}] "
            )
        assert pt.alternates["question"] == prompts.question_only(tokenizer, q.question)
        assert pt.gold[-1] == end and tokenizer.decode(pt.gold[:-1]) == str(q.answer)
        for prompt, context in ((pt.history, transcript), (pt.alternates["text"], None)):
            text = tokenizer.decode(prompt)
            assert text.endswith(f"<|im_start|>user\nQuestion: {q.question}<|im_end|>\n<|im_start|>assistant\n")
            excerpt = text.split(prompts.CONTEXT_HEADER, 1)[1].split("<|im_end|>")[0]
            if context is not None:
                assert excerpt == context
            else:  # a picked turn that opens its session in the excerpt carries the date the transcript may not
                assert 0 < len(tokenizer(excerpt)["input_ids"]) <= P.TEXT_BUDGET
                assert all(line.split("] ", 1)[-1] in transcript for line in excerpt.split("\n"))


def test_bfcl_points_are_gold_tool_calls_of_replays_that_pass_the_checker(tokenizer):
    """A BFCL trajectory is kept only when its ground-truth replay passes BFCL's checker; each
    point's gold is a tool call message whose calls are the ground truth's, in order, and the next
    point of the same trajectory extends prompt + gold (but where the tool docs change)."""
    import json
    import re

    from bench.agent import bfcl as B

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    trajs = P.bfcl(tokenizer, 1)
    assert trajs and all(t.points for t in trajs)
    for traj in trajs:
        task = next(t for t in B.tasks(list(B.CATEGORIES), limit=1) if t.id == traj.id)
        want = [B.as_calls(task, truth) for truth in task.ground_truth if truth]
        got = []
        for pt, nxt in zip(traj.points, traj.points[1:] + [None]):
            text = tokenizer.decode(pt.gold)
            calls = [json.loads(m) for m in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)]
            got.append([(c["name"], c["arguments"]) for c in calls])
            if nxt is not None and nxt.history[: len(pt.history) + len(pt.gold)] != pt.history + pt.gold:
                # miss_func: a turn adds the missing function, so the tool docs (system prompt) change
                first = next(i for i, (x, y) in enumerate(zip(pt.history, nxt.history)) if x != y)
                assert "miss_func" in traj.id and first < pt.history.index(end)
        assert got == [[(n, a) for n, a in calls] for calls in want]


def test_a_locomo_chat_recording_maps_each_recorded_token_to_its_line(tokenizer):
    """bench/locomo's chat recording: the transcript as the user's message after the system
    message. What a memory-mode request records starts at the user message's opener (the system
    message is not the turn), and each recorded token maps to the dialogue line it decodes into."""
    from bench.locomo import data, prompts

    turns = data.turns(data.load()[1])
    transcript = data.render(turns)
    ids, turn_of = prompts.ingest_ids(tokenizer, transcript), prompts.ingest_turn_of_tokens(tokenizer, turns)
    chat, recorded = prompts.chat_turn(tokenizer, transcript, ids, turn_of)
    assert chat == prompts.chat_ids(tokenizer, prompts.CONTEXT_HEADER + transcript)
    turn = chat[len(chat) - len(recorded) :]
    assert tokenizer.decode(turn[:3]).startswith("<|im_start|>user\n")
    assert "system" not in tokenizer.decode(turn)[:40]
    lines = data.rendered(turns)
    for k in random.Random(0).sample(range(len(lines)), 8):
        text = tokenizer.decode([t for t, owner in zip(turn, recorded) if owner == k])
        assert text.strip() == lines[k].strip(), k


def test_bcp_points_search_read_the_evidence_sessions_and_answer_with_the_gold(tokenizer):
    """A BCP-shaped trajectory is one LoCoMo question along an oracle's path: its gold calls are
    search(the question), get_document of the sessions the dataset's evidence names (read from the
    data file apart from the source), answer(the dataset's answer); each next prompt extends prompt
    + gold by the tool's output, which holds the document's lines."""
    import json
    import re

    from bench.locomo import data

    samples = data.load()
    trajs = P.bcp(tokenizer, 2)
    assert len(trajs) >= len(samples)
    for traj in trajs:
        c, qa = (int(x) for x in re.fullmatch(r"c(\d+)-q(\d+)", traj.id).groups())
        raw = samples[c]["qa"][qa]
        sessions = list(dict.fromkeys(int(n) for e in raw["evidence"] for n in re.findall(r"D(\d+):", e)))
        want = [
            ("search", {"query": raw["question"]}),
            *(("get_document", {"docid": f"c{c}s{n}"}) for n in sessions[: P.BCP_DOCUMENTS]),
            ("answer", {"answer": str(raw["answer"])}),
        ]
        got = []
        for pt, nxt in zip(traj.points, traj.points[1:] + [None]):
            (call,) = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", tokenizer.decode(pt.gold), re.S)
            got.append((json.loads(call)["name"], json.loads(call)["arguments"]))
            if nxt is not None:
                assert nxt.history[: len(pt.history) + len(pt.gold)] == pt.history + pt.gold
            if got[-1][0] == "get_document":
                n = int(got[-1][1]["docid"].split("s")[1])
                first = samples[c]["conversation"][f"session_{n}"][0]
                assert f"{first['speaker']}: {first['text'][:40]}" in tokenizer.decode(nxt.history[len(pt.history) :])
        assert got == want


def test_textworld_points_are_the_walkthrough_and_each_extends_the_one_before(tokenizer):
    """A TextWorld trajectory is one game along its walkthrough: each gold action is the
    walkthrough's next valid command (read from the game file again, apart from the source) through
    the end-of-turn token, after the valid commands the game lists there (a walkthrough command it
    does not list changes nothing and is no point); the next point's prompt extends prompt + gold
    by the game's feedback to that command; the game ends won."""
    import tempfile
    from pathlib import Path

    from bench import keep_textworld as tw

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (traj,) = P.textworld(tokenizer, 1, seed=P.TEXTWORLD_SEED)
    env = tw.start(tw.make_game(P.TEXTWORLD_SEED, Path(tempfile.gettempdir()) / "sgl-memory-textworld"))
    state = env.reset()
    walkthrough = list(state["extra.walkthrough"])
    points = iter(zip(traj.points, traj.points[1:] + [None]))
    for command in walkthrough:
        if command not in state["admissible_commands"]:
            continue  # a no-op ("open fridge" once it is open): not stepped, or the move counter would differ
        pt, nxt = next(points)
        assert tokenizer.decode(pt.gold) == f"{command}<|im_end|>" and pt.gold[-1] == end
        valid = tokenizer.decode(pt.history).rsplit("Valid commands: ", 1)[1].split("<|im_end|>")[0].split(", ")
        assert valid == state["admissible_commands"]
        state, _, _ = env.step(command)
        if nxt is not None:
            assert nxt.history[: len(pt.history) + len(pt.gold)] == pt.history + pt.gold
            assert tw.clean(state.feedback) in tokenizer.decode(nxt.history[len(pt.history) + len(pt.gold) :])
    assert next(points, None) is None and state["won"]
    env.close()


def test_every_methods_server_config_loads_and_a_persisted_method_restores_in_its_own_format():
    import yaml

    from bench.fidelity.run import FLAGS, PERSISTED, POOL_DTYPES, SERVERS, methods
    from sgl_memory.core import config
    from sgl_memory.memart.settings import MemArtConfig
    from sgl_memory.persist.settings import PersistConfig

    loaded = {name: config.from_dict(yaml.safe_load(text)) for name, text in SERVERS.items()}
    ms = methods([32])
    assert {m.server for m in ms} == set(SERVERS)
    persisted = [m for m in ms if m.restores]
    assert sorted(m.name for m in persisted) == sorted(f"persisted {q}" for q in PERSISTED)
    for m in persisted:
        cfg = loaded[m.server]
        assert cfg.of(PersistConfig).enabled and m.name == f"persisted {cfg.of(PersistConfig).quant}"
        assert not cfg.of(MemArtConfig).enabled and m.fields == ms[0].fields  # the full cache, restored
    assert not any(cfg.of(PersistConfig).enabled for name, cfg in loaded.items() if name in ("intent", "memory"))
    pools = [m for m in ms if m.server in FLAGS]  # the 8-bit pools: the full cache on a server of that KV dtype
    assert sorted(m.name for m in pools) == sorted(f"{d} pool" for d in POOL_DTYPES)
    for m in pools:
        assert FLAGS[m.server] == ("--kv-cache-dtype", m.name.split()[0]) and m.fields == ms[0].fields


def test_a_points_file_holds_one_compute_dtype(tmp_path):
    """A run on a server of another dtype stops before it scores; rows without the field are unknown."""
    import json

    from bench.fidelity.run import held_dtype

    class Server:  # answers /sgl_memory/info as the server does
        def __init__(self, dtype):
            self.info = {"dtype": {"dtype": dtype, "kv_cache_dtype": dtype}}

        def get(self, path):
            assert path == "/sgl_memory/info"
            return type("Response", (), {"json": lambda _: self.info})()

    points = tmp_path / "f.points.jsonl"
    assert held_dtype(points, Server("float32")) == "float32"  # no file yet
    points.write_text(json.dumps({"trajectory": "a", "method": "m"}) + "\n")
    assert held_dtype(points, Server("bfloat16")) == "bfloat16"  # an old row: dtype unknown
    with points.open("a") as f:
        f.write(json.dumps({"trajectory": "b", "method": "m", "dtype": "bfloat16"}) + "\n")
    assert held_dtype(points, Server("bfloat16")) == "bfloat16"
    with pytest.raises(SystemExit, match="holds points computed in bfloat16; this server computes in float32"):
        held_dtype(points, Server("float32"))


def test_a_locomo_pool_variant_runs_on_its_own_server_and_pairs_with_its_compute_dtype_twin(tmp_path):
    """bench/locomo's int8 group: each variant twice, once per pool; the 8-bit one names its pool,
    runs on a server started with `--kv-cache-dtype int8` and otherwise the twin's, and its F1 is
    paired with the twin's on the questions both answered (a plain mean of the differences)."""
    from bench.locomo import run

    vs = run.variants(["int8"], 64)
    assert len(vs) == 4 and len({v.label for v in vs}) == 4
    twins = {v.label: v for v in vs if v.kv_dtype == "auto"}
    for v in (v for v in vs if v.kv_dtype == "int8"):
        twin = twins[v.base_label]
        assert v.server[:-1] == twin.server[:-1] and v.server != twin.server
        assert v.label != twin.label
    conv = run.Conversation(0, [], "", [], ingest_ids=[1] * 100)
    flags = run.server_flags(models.DEFAULT_MODEL, [conv], {"plain"}, "int8")
    assert flags[flags.index("--kv-cache-dtype") + 1] == "int8"
    assert flags[:2] == run.server_flags(models.DEFAULT_MODEL, [conv], {"plain"})[:2]  # the same tokens
    chat = next(v for v in vs if v.kv_dtype == "int8" and v.method == "memart")
    rng = random.Random(0)
    f1 = {(c, q): rng.random() for c in range(2) for q in range(30)}
    off = {(c, q): rng.choice([0.0, 0.0, -0.5, 0.25]) for c in range(2) for q in range(30)}
    results = run.Results(tmp_path / "r.json", {}, True)
    for (c, q), x in f1.items():
        for label, value in ((chat.base_label, x), (chat.label, x + off[c, q])):
            if label == chat.label and q >= 25:  # the 8-bit run stopped early: pairs are the common questions
                continue
            results.data["rows"][f"{label}|c{c}|q{q}"] = {
                "variant": label,
                "conversation": c,
                "qa_index": q,
                "category": 1 + q % 4,
                "f1": value,
            }
    summary = run.summarize(results, None)
    common = [off[k] for k in f1 if k[1] < 25]
    assert summary[chat.label]["n_vs_compute_pool"] == len(common) == 50
    assert summary[chat.label]["f1_vs_compute_pool"] == pytest.approx(sum(common) / len(common))
    low, high = summary[chat.label]["f1_vs_compute_pool_ci"]
    assert low <= sum(common) / len(common) <= high
    assert "f1_vs_compute_pool" not in summary[chat.base_label]
