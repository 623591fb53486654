"""memory.window's cut (memart/window.py) on real chat templates: the token-level cut of a rendered
conversation must equal the chat template's rendering of the messages a message-level rule keeps
(the system message, the latest user message that is not a tool result, and the exchanges that fit
in the window), for every window size; and a session's prompts are windowed only where they
continue the last one."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sgl_memory import models
from sgl_memory.core.spans import RoleMarkers, after_answer
from sgl_memory.memart.window import LastPrompts, cut

MODELS = (
    "smollm2-135m-instruct",
    "qwen2.5-coder-0.5b-instruct",
)  # tool results as "tool" messages / as Qwen's user ones


@pytest.fixture(scope="module", params=MODELS)
def tok(request):
    return AutoTokenizer.from_pretrained(models.model_dir(request.param))


def call(i: int) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "search", "arguments": f'{{"q": "item {i}"}}'}}
        ],
    }


def result(i: int, words: int) -> dict:
    return {"role": "tool", "tool_call_id": f"c{i}", "content": " ".join(f"row{i}-{j}" for j in range(words))}


AGENT = [{"role": "system", "content": "You search."}, {"role": "user", "content": "Find the owner of item 3."}] + [
    m for i in range(5) for m in (call(i), result(i, 3 + 7 * i))
]
CHAT = [{"role": "system", "content": "Be brief."}] + [
    {"role": r, "content": f"{r} message {i} " + "word " * (i * 3)} for i in range(7) for r in ("user", "assistant")
][:-1]
NO_SYSTEM = CHAT[1:]


def render(tok, messages, prompt=True):
    return tok.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True, return_dict=False)


def reference(tok, messages, window: int) -> list[int]:
    """The kept prompt, chosen message by message and rendered by the template."""
    system = messages[:1] if messages[0]["role"] == "system" else []
    whole = render(tok, messages)
    answers = [j for j in range(len(messages)) if messages[j]["role"] == "assistant"]
    newest = answers[-1] + 1 if answers else max(j for j, m in enumerate(messages) if m["role"] in ("user", "tool"))
    candidates = [j for j in answers if len(system) < j <= newest] + [newest]
    # the tail from message j holds what the whole prompt has beyond the rendering of messages[:j]
    start = next((j for j in candidates if len(whole) - len(render(tok, messages[:j], prompt=False)) <= window), newest)
    tasks = [j for j in range(len(system), start) if messages[j]["role"] == "user"]
    return render(tok, system + [messages[j] for j in tasks[-1:]] + messages[start:])


@pytest.mark.parametrize("messages", [AGENT, CHAT, NO_SYSTEM], ids=["agent", "chat", "no-system"])
@pytest.mark.parametrize("window", [0, 8, 30, 60, 90, 140, 10_000])
def test_the_cut_is_the_template_rendering_of_the_kept_messages(tok, messages, window):
    ids = render(tok, messages)
    want = reference(tok, messages, window)
    got = cut(ids, RoleMarkers.from_tokenizer(tok, "chatml"), window)
    if want == ids:
        assert got is None
    else:
        assert got is not None and got.ids == want and got.dropped == len(ids) - len(want)


def test_what_follows_the_last_answer_is_never_cut(tok):
    """Two tool results after the last call (one message each in SmolLM2's template, one user
    message in Qwen's): the turn's new part is all of them, however small the window."""
    messages = AGENT + [call(5), result(5, 40), result(6, 40)]
    ids = render(tok, messages)
    markers = RoleMarkers.from_tokenizer(tok, "chatml")
    new = after_answer(markers.messages(ids), len(ids))
    assert ids[new:] == render(tok, messages)[len(render(tok, messages[:-2], prompt=False)) :]
    got = cut(ids, markers, 1)
    assert got.ids[-(len(ids) - new) :] == ids[new:]


def test_a_session_is_windowed_only_where_its_prompt_continues_the_last_one():
    seen = LastPrompts(limit=2)
    a, b = ("t", "a"), ("t", "b")
    assert not seen.continues(a, [1, 2, 3])  # nothing seen: the memory may not hold it
    seen.remember(a, [1, 2, 3])
    assert seen.continues(a, [1, 2, 3, 4, 5]) and seen.continues(a, [1, 2, 3])
    assert not seen.continues(a, [1, 9, 3, 4]) and not seen.continues(a, [1, 2])  # edited, shorter
    assert not seen.continues(("u", "a"), [1, 2, 3, 4])  # another tenant's session of the same name
    seen.remember(b, [7])
    seen.remember(("t", "c"), [8])  # over the limit: a, the least recently used, is forgotten
    assert not seen.continues(a, [1, 2, 3, 4]) and seen.continues(b, [7, 1])


def test_a_window_of_exactly_the_last_exchanges_keeps_them_and_one_token_less_does_not(tok):
    ids, markers = render(tok, AGENT), RoleMarkers.from_tokenizer(tok, "chatml")
    tail = len(ids) - len(render(tok, AGENT[:8], prompt=False))  # the last two exchanges and the prompt
    assert cut(ids, markers, tail).ids == render(tok, AGENT[:2] + AGENT[8:])
    assert cut(ids, markers, tail - 1).ids == render(tok, AGENT[:2] + AGENT[10:])
