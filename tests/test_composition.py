"""The composition of the enabled mechanisms (core/composition.py): each hook's combining rule, as
the module's table writes it, against mechanisms that answer what each test says; and the start-up
check's messages. The tree applying the rules is tests/test_radix_contract.py's."""

from __future__ import annotations

import pytest

from sgl_memory.core import composition, config, mechanism
from sgl_memory.core.composition import Composition
from sgl_memory.core.mechanism import CAPABILITIES, Mechanism
from sgl_memory.core.requests import Lifetime, RequestStore


def fake(name: str, after: tuple[str, ...] = (), log: list | None = None, **answers) -> Mechanism:
    """A mechanism named `name`, run after the mechanisms named in `after`, whose hooks in `answers`
    return the value given (and note their call in `log`); the others are the contract's defaults."""

    def answer(hook, value):
        def method(self, *args, **kwargs):
            if log is not None:
                log.append((name, hook))
            return value

        return method

    attrs = {hook: answer(hook, value) for hook, value in answers.items()}
    # the capabilities whose hooks it answers, their other hooks the contract's "no answer"
    caps = tuple(c for c in CAPABILITIES if set(answers) & set(c.__abstractmethods__))
    nothing = {h: answer(h, None) for c in caps for h in c.__abstractmethods__ if h not in answers}
    cls = type(
        f"Fake_{name}",
        (Mechanism, *caps),
        {"after": after, "settings": object, "build": classmethod(lambda c, *a: c()), **nothing, **attrs},
    )
    cls.name = name
    return cls()


class Req:
    def __init__(self, rid: str = "r"):
        self.rid, self.aborted = rid, False

    def finished(self) -> bool:
        return self.aborted


def test_hooks_run_in_order_and_every_open_before_the_first_admit():
    log = []
    spec = type("Spec", (), {"admits": lambda self, m: m.name != "skipped"})()
    mechanisms = [
        fake(n, after, log, open=None, admit=None, on_release=None)
        for n, after in (("c", ("b",)), ("a", ("skipped",)), ("b", ("a", "skipped")), ("skipped", ()))
    ]
    composed = Composition(mechanisms)
    assert [m.name for m in composed.mechanisms] == ["skipped", "a", "b", "c"]
    composed.admit(None, Req(), spec)
    assert log == [("a", "open"), ("b", "open"), ("c", "open"), ("a", "admit"), ("b", "admit"), ("c", "admit")]
    log.clear()
    composed.release(Req())
    assert log == [("skipped", "on_release"), ("a", "on_release"), ("b", "on_release"), ("c", "on_release")]


def test_an_admission_that_aborts_the_request_stops_the_later_ones():
    log, req = [], Req()

    class Refusing(Mechanism):
        settings = object
        name = "refusing"

        @classmethod
        def build(cls, *a):
            return cls()

        def admit(self, scheduler, r, spec):
            log.append(("refusing", "admit"))
            r.aborted = True

    spec = type("Spec", (), {"admits": lambda self, m: True})()
    Composition([Refusing(), fake("later", ("refusing",), log, admit=None)]).admit(None, req, spec)
    assert log == [("refusing", "admit")]


def test_the_order_follows_the_declarations_through_mechanisms_not_built():
    """A composition of some mechanisms keeps the order the registry's declarations give, also
    where the mechanism that links two is not among them; ties go by name."""
    mechanism.discover()
    assert [cls.name for cls in mechanism.ordered()] == ["memory", "keep", "persist", "intent", "sentencekv"]
    built = [fake("sentencekv", ("intent",)), fake("zeta"), fake("memory"), fake("x", ("sentencekv",))]
    assert [m.name for m in Composition(built).mechanisms] == ["memory", "sentencekv", "x", "zeta"]
    # through intent (registered, not built): sentencekv after intent after persist after memory
    linked = [fake("sentencekv", ("intent",)), fake("memory", ()), fake("a")]
    assert [m.name for m in Composition(linked).mechanisms] == ["a", "memory", "sentencekv"]
    assert [m.name for m in Composition([fake("late", ("memory",)), fake("memory")]).mechanisms] == ["memory", "late"]


def test_a_cycle_of_declarations_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"cycle among a \(after b\), b \(after a\)"):
        Composition([fake("a", ("b",)), fake("b", ("a",)), fake("c")])


def test_a_request_state_ends_with_its_row_or_the_request():
    """A row's state ends at every release (a retracted request is released unfinished) and at a
    drop; a request's at a finished release or a drop, and at an admission that refused it."""
    store = RequestStore()
    row, request = store.table("m row", Lifetime.ROW), store.table("m request", Lifetime.REQUEST)
    composed = Composition([fake("m")], store)

    def fill(req):
        row.set(req.rid, 1)
        request.set(req.rid, 2)

    retracted, done, dropped = Req("retracted"), Req("done"), Req("dropped")
    for req in (retracted, done, dropped):
        fill(req)
    composed.release(retracted)  # not finished: SGLang retracted it
    assert "retracted" not in row and request.get("retracted") == 2
    done.aborted = True  # finished
    composed.release(done)
    composed.drop(dropped)
    assert store.held() == {"m request": ["retracted"]}
    retracted.aborted = True
    composed.release(retracted)
    assert store.held() == {}

    refused = Req("refused")

    class Refuser(Mechanism):
        settings, name = object, "refuser"

        @classmethod
        def build(cls, *a):
            return cls()

        def admit(self, scheduler, r, spec):
            fill(r)
            r.aborted = True

    spec = type("Spec", (), {"admits": lambda self, m: True})()
    Composition([Refuser()], store).admit(None, refused, spec)
    assert store.held() == {}
    with pytest.raises(ValueError, match="exists already"):
        store.table("m row", Lifetime.ROW)


def test_the_least_match_limit_and_the_union_of_held_requests():
    composed = Composition([fake("a", match_limit=40), fake("b", match_limit=None), fake("c", match_limit=25)])
    assert composed.match_limit(Req()) == 25
    assert Composition([fake("a")]).match_limit(Req()) is None
    held = Composition([fake("a", before_prefill=["r1"]), fake("b", before_prefill=["r2", "r3"])])
    assert held.before_prefill(None, [], False) == ["r1", "r2", "r3"]


@pytest.mark.parametrize(
    "hook, call, what",
    [
        ("on_checkpoint", lambda c: c.checkpoint(Req(), None), "edits the request's row"),
        ("branches", lambda c: c.branches(Req()), "branches the request's path"),
        ("position_shift", lambda c: c.position_shift("r"), "shifts the request's positions"),
        ("step_reads", lambda c: c.step_reads("r"), "chooses the request's decode reads"),
        ("placed_kv", lambda c: c.placed_kv(Req()), "places KV for the request's repair"),
    ],
)
def test_at_most_one_mechanism_answers_for_a_request(hook, call, what):
    one = Composition([fake("a", **{hook: "answer"}), fake("b")])
    assert call(one) == "answer"
    assert call(Composition([fake("a"), fake("b")])) in (None, 0, ())  # no mechanism has the capability
    two = Composition([fake("a", **{hook: "answer"}), fake("quiet", **{hook: None}), fake("b", **{hook: "other"})])
    with pytest.raises(RuntimeError, match=f"^a and b each {what}; at most one mechanism may"):
        call(two)


def test_the_forward_asks_only_the_mechanisms_that_answer():
    class Sub:
        pass

    s, d = Sub(), Sub()
    composed = Composition([fake("a", subscriber=s), fake("b", subscriber=d, dropper=d), fake("c")])
    assert composed.subscribers == [s, d] and composed.droppers == [d]
    assert not composed.reads_steps and not composed.shifts_positions
    assert Composition([fake("a", step_reads=None)]).reads_steps
    assert Composition([fake("a", position_shift=0)]).shifts_positions


def test_session_state_goes_to_each_mechanism_under_its_own_name():
    got = {}

    class Keeper(Mechanism):
        settings, kv_state = object, {"keys": "k"}

        @classmethod
        def build(cls, *a):
            return cls()

        def export_session(self, key):
            return {"keys": f"{self.name} keys", "count": f"{self.name} count"}

        def import_session(self, key, tensors):
            got[self.name] = tensors

    a, b = type("A", (Keeper,), {"name": "a"})(), type("B", (Keeper,), {"name": "b"})()
    composed = Composition([a, b])
    out, kv = composed.export_session("s")
    assert out == {"a.keys": "a keys", "a.count": "a count", "b.keys": "b keys", "b.count": "b count"}
    assert kv == {"a.keys": "k", "b.keys": "k"}
    assert composed.export_session("s", skip=a)[0] == {"b.keys": "b keys", "b.count": "b count"}
    composed.import_session("s", {"a.keys": 1, "c.keys": 2})
    assert got == {"a": {"keys": 1}}


def test_the_start_up_check_names_every_problem(monkeypatch):
    composition.check(config.MemoryConfig())  # imports (registers) every mechanism
    monkeypatch.setattr(mechanism.REGISTRY["memory"], "conflicts", {"intent": "a reason"})
    cfg = config.from_dict({"intent": {"enabled": True}, "memory": {"enabled": True}})
    found = composition.problems(cfg, tp_size=2, page_size=16)
    assert "memory.enabled and intent.enabled together are not supported yet: a reason" in found  # by order
    assert any(p.startswith("intent needs page size 1 (got 16)") for p in found)
    with pytest.raises(config.ConfigError, match="together are not supported yet: a reason"):
        composition.check(cfg)


def test_the_architecture_page_gives_a_rule_for_every_hook():
    """docs/architecture.md's table of composition rules names every hook of a built mechanism (the
    contract's instance methods) once: a hook added to the contract without a rule fails here."""
    import inspect
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    section = text.split("## How mechanisms compose", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    named = [hook for cell in rows for hook in re.findall(r"`(\w+)`", cell)]
    hooks = {
        n
        for kind in (Mechanism, *mechanism.CAPABILITIES)
        for n, f in vars(kind).items()
        if inspect.isfunction(f) and not n.startswith("_")
    }
    assert sorted(named) == sorted(hooks)
