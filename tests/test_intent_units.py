"""IntentKV pieces without a model: QueryMemory and sessions, spans, scorers, layouts, the request
field, RoPE re-rotation. References are written out independently (loops, explicit formulas)."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from sgl_memory.intent import scorers
from sgl_memory.intent.layouts import apply_dead_slot, freeable
from sgl_memory.core.request import SpecError, parse
from sgl_memory.intent.settings import IntentConfig
from sgl_memory.intent.sessions import AdaptiveBudget, QueryMemory, resolve_key
from sgl_memory.core.sessions import SessionRegistry
from sgl_memory.core.spans import RoleMarkers, find_spans
from sgl_memory.core.rope import Rope

# --- the query capture ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", [0, 6])
def test_a_capture_whose_request_lost_rows_before_its_span_takes_what_it_takes_from_all_rows(window):
    """A row dropper (KEEP) may drop a request's rows before the first one the capture reads; the
    capture then gets the request's rows with their positions, packed among another request's. Its
    span sums and window must be those of the whole rows fed in order (written out as a loop)."""
    from types import SimpleNamespace

    from sgl_memory.core.capture import ExtendRows, QueryCapture

    heads, dim, prefix, n, span = 2, 4, 10, 20, 22
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=heads, qk_head_dim=dim)
    q = torch.randn(n, heads * dim, generator=torch.Generator().manual_seed(0))
    whole = QueryCapture(span, prefix + n, window)
    whole.add_rows(layer, q, ExtendRows("r", 0, prefix, n))
    assert whole.first_read() == min(span, prefix + n - window if window else prefix + n)
    kept = torch.tensor([p for p in range(prefix, prefix + n) if p >= whole.first_read() or p % 3 == 0])
    other = torch.randn(5, heads * dim)  # another request's rows come first in the forward
    packed = torch.cat([other, q[kept - prefix]])
    cut = QueryCapture(span, prefix + n, window)
    cut.add_rows(layer, packed, ExtendRows("r", 5, prefix, len(kept), positions=kept))
    rows = q.view(n, heads, dim)
    want_sum = sum(rows[p - prefix] for p in range(span, prefix + n))
    assert torch.allclose(cut.q_mean()[0], want_sum / (prefix + n - span)) and torch.allclose(
        cut.q_mean(), whole.q_mean()
    )
    assert torch.equal(cut.q_window(), whole.q_window())


# --- QueryMemory and sessions ------------------------------------------------------------------


def test_query_memory_follows_the_recurrence_and_stays_unit_norm():
    torch.manual_seed(0)
    decay = 0.8
    memory = QueryMemory(decay)
    expected = None
    for turn in range(6):
        q = torch.randn(3, 4, 8) * (turn + 1) * 10
        got = memory.update(q)
        for layer in range(3):
            for head in range(4):
                row = q[layer, head]
                if expected is None:
                    want = row / row.norm()
                else:
                    mix = decay * expected[layer, head] + (1 - decay) * row
                    want = mix / mix.norm()
                assert torch.allclose(got[layer, head], want, atol=1e-6)
        expected = got.clone()
        assert torch.allclose(got.norm(dim=-1), torch.ones(3, 4), atol=1e-6)
    assert memory.updates == 6


def test_session_registry_bounds_each_mechanisms_slots_least_recently_used_first():
    registry = SessionRegistry()
    registry.limit("intent", 2)
    registry.limit("persist", 1, keep=lambda value: value == "unwritten")
    a = registry.get(("", "a"), "intent", lambda: QueryMemory(0.5))
    registry.get(("", "b"), "intent", lambda: QueryMemory(0.5))
    assert registry.get(("", "a"), "intent") is a  # touches a
    registry.get(("", "c"), "intent", lambda: QueryMemory(0.5))  # drops b's slot, the least recently used
    assert registry.get(("", "b"), "intent") is None and registry.get(("", "a"), "intent") is a
    assert registry.count("intent") == 2 and registry.dropped["intent"] == 1
    # another mechanism's slot of the same session is its own: a bound on one leaves the other
    registry.get(("", "a"), "persist", lambda: "unwritten")
    registry.get(("", "c"), "persist", lambda: "written")  # a's slot must stay: c's is the new one
    assert registry.count("persist") == 2  # over the bound until a's turn is written
    registry.get(("", "d"), "persist", lambda: "written")
    assert [k for k, _ in registry.states("persist")] == [("", "a"), ("", "d")]
    assert registry.get(("", "a"), "intent") is a
    # tenants never share a session
    assert registry.get(("t2", "a"), "intent") is None
    registry.pop(("", "a"), "intent")
    registry.pop(("", "a"), "persist")
    assert ("", "a") not in [k for k, _ in registry.states("intent") + registry.states("persist")]


def test_concurrent_sessions_never_touch_each_other():
    registry = SessionRegistry()
    registry.limit("intent", 64)
    vectors = {f"s{i}": torch.randn(2, 2, 4) for i in range(8)}

    def memory(key):
        return registry.get(("", key), "intent", lambda: QueryMemory(0.9))

    def run(key):
        for _ in range(50):
            memory(key).update(vectors[key])

    threads = [threading.Thread(target=run, args=(k,)) for k in vectors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key, v in vectors.items():
        # a fixed input is a fixed point of the recurrence: any foreign update would move it
        assert torch.allclose(memory(key).state, v / v.norm(dim=-1, keepdim=True), atol=1e-6)
        assert memory(key).updates == 50


def test_session_key_resolution_order_and_tenant_namespaces():
    tokens = list(range(100))
    key = lambda **kw: resolve_key(
        **{
            "session_id": None,
            "tenant": None,
            "sglang_session": None,
            "token_ids": tokens,
            "session_span": (10, 20),
            "prefix_tokens": 64,
            "rid": "r1",
            **kw,
        }
    )
    assert key(session_id="s")[1] == "session_id"
    assert key(sglang_session="g")[1] == "sglang_session"
    assert key()[1] == "session_span"
    assert key(session_span=None)[1] == "prefix_hash"
    assert key(session_span=None, token_ids=tokens[:10])[1] == "request"
    assert key(session_id="s")[0] != key(session_id="s", tenant="t2")[0]
    assert key(session_span=None)[0] == resolve_key(None, None, None, tokens[:64] + [7], None, 64, "r2")[0]
    assert (
        key(session_span=None, token_ids=tokens[:10])[0]
        != resolve_key(None, None, None, tokens[:10], None, 64, "r2")[0]
    )
    # an explicit id is the (tenant, id) every mechanism shares; derived keys cannot spell a client id
    assert key(session_id="s", tenant="t") == (("t", "s"), "session_id")
    assert all(key(**kw)[0][1].startswith("\x00") for kw in ({"sglang_session": "g"}, {}, {"session_span": None}))


# --- spans -------------------------------------------------------------------------------------


class ToyTokenizer:
    """ChatML with one token per word: enough to place role markers."""

    vocab = {"<|im_start|>": 1, "system": 2, "user": 3, "assistant": 4, "tool": 5, "<|im_end|>": 6}
    unk_token_id = 0

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token, 0)

    def encode(self, text, add_special_tokens=False):
        return [self.vocab.get(w, 9) for w in text.split()]


def render(messages):
    out = []
    for role, n in messages:
        out += [1, ToyTokenizer.vocab[role]] + [9] * n + [6]
    return out + [1, 4]  # assistant header


def test_spans_protect_system_and_latest_user_message():
    markers = RoleMarkers.from_tokenizer(ToyTokenizer(), "chatml")
    tokens = render([("system", 5), ("user", 10), ("assistant", 4), ("user", 7)])
    spans = find_spans(tokens, markers, query_tail=3)
    assert spans.source == "roles"
    assert spans.system_end == 8  # the system message, through its end marker
    assert spans.query_start == 8 + 13 + 7  # the second user message's opener
    assert spans.session_span == (8, 21)  # the first user message
    assert spans.forced_count(len(tokens)) == 8 + (len(tokens) - spans.query_start)


def test_spans_fall_back_to_the_tail_without_markers():
    spans = find_spans(list(range(50, 90)), RoleMarkers(None, {}), query_tail=6)
    assert (spans.system_end, spans.query_start, spans.source) == (0, 34, "tail")


# --- scorers -----------------------------------------------------------------------------------


def make_inputs(n=40, layers=3, heads=6, kv_heads=2, dim=8, window=5, keep=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, kv_heads, dim, generator=g) for _ in range(layers)]
    return scorers.ScoringInputs(
        layer_keys=lambda: iter(keys),
        positions=torch.arange(n) * 2 + 3,
        q_mean=torch.randn(layers, heads, dim, generator=g),
        q_window=torch.randn(layers, window, heads, dim, generator=g),
        memory=torch.nn.functional.normalize(torch.randn(layers, heads, dim, generator=g), dim=-1),
        keep=keep,
        seed=seed,
        sinks=3,
        kernel=5,
    ), keys


def brute_rule(keys, rows):
    """Mean over layers and query heads of softmax_i(row . k_i / sqrt(d)); KV head = h // group."""
    total = None
    for layer, k in enumerate(keys):
        heads, kv_heads = rows.shape[1], k.shape[1]
        acc = torch.zeros(k.shape[0], dtype=torch.float64)
        for h in range(heads):
            logits = torch.tensor([float(rows[layer, h] @ k[i, h // (heads // kv_heads)]) for i in range(k.shape[0])])
            acc += torch.softmax(logits.double() / math.sqrt(k.shape[-1]), 0) / heads
        total = acc if total is None else total + acc
    return total / len(keys)


def test_memory_scorer_is_the_rule_score_of_the_session_memory():
    x, keys = make_inputs()
    assert torch.allclose(scorers.get("memory").score(x).double(), brute_rule(keys, x.memory), atol=1e-5)


def test_memory_pool_scorer_is_the_rule_score_max_pooled_along_positions():
    x, keys = make_inputs(seed=5)
    rule = brute_rule(keys, x.memory)
    want = torch.tensor([max(rule[max(0, i - 2) : i + 3]) for i in range(40)])  # kernel 5
    assert torch.allclose(scorers.get("memory_pool").score(x).double(), want, atol=1e-5)


def test_query_scorer_uses_the_unit_current_query():
    x, keys = make_inputs(seed=1)
    unit = x.q_mean / x.q_mean.norm(dim=-1, keepdim=True)
    assert torch.allclose(scorers.get("query").score(x).double(), brute_rule(keys, unit), atol=1e-5)


def test_snapkv_pools_window_attention():
    x, keys = make_inputs(seed=2)
    total = torch.zeros(40, dtype=torch.float64)
    for layer, k in enumerate(keys):
        votes = sum(brute_rule([k], x.q_window[layer, r].unsqueeze(0)) for r in range(5)) / 5
        pooled = torch.tensor([max(votes[max(0, i - 2) : i + 3]) for i in range(40)])
        total += pooled
    assert torch.allclose(scorers.get("snapkv").score(x).double(), total / 3, atol=1e-5)


def test_streaming_llm_keeps_sinks_and_the_most_recent():
    x, _ = make_inputs(keep=10)
    chosen = scorers.select(scorers.get("streaming_llm").score(x), x.keep).tolist()
    assert chosen == [0, 1, 2] + list(range(33, 40))


def test_h2o_keeps_a_recent_floor_and_heavy_hitters():
    x, keys = make_inputs(keep=10, seed=3)
    chosen = scorers.select(scorers.get("h2o").score(x), x.keep).tolist()
    assert chosen[-5:] == list(range(35, 40))
    mass = sum(brute_rule(keys[l : l + 1], x.q_window[l, r].unsqueeze(0)) for l in range(3) for r in range(5))
    heavy = sorted(torch.argsort(mass[:35], descending=True)[:5].tolist())
    assert chosen[:5] == heavy


def test_select_is_top_k_by_brute_force():
    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        scores = torch.randn(30, generator=g)
        keep = int(torch.randint(1, 30, (1,), generator=g))
        want = sorted(sorted(range(30), key=lambda i: -float(scores[i]))[:keep])
        assert scorers.select(scores, keep).tolist() == want


def test_random_scorer_is_seeded():
    x, _ = make_inputs()
    assert torch.equal(scorers.get("random").score(x), scorers.get("random").score(x))


def test_unknown_scorer_names_the_allowed_ones():
    with pytest.raises(
        KeyError, match="allowed: h2o, learned, memory, memory_pool, query, random, snapkv, streaming_llm"
    ):
        scorers.get("magic")


# --- layouts -----------------------------------------------------------------------------------


def test_alias_aware_free_skips_sentinel_kept_and_duplicates():
    sentinel = 99
    dropped = torch.tensor([5, 99, 7, 7, 8])
    kept = torch.tensor([8, 11])  # 8 is still referenced at a kept position (an alias)
    assert freeable(dropped, kept, sentinel).tolist() == [5, 7]


def test_dead_slot_frees_only_private_dropped_slots():
    sentinel = 0
    row = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 0, 0], dtype=torch.int32)
    freed = []
    edit = apply_dead_slot(row, torch.tensor([0, 3, 6, 7]), 8, protected=3, sentinel=sentinel, free=freed.append)
    assert row.tolist() == [10, 0, 0, 13, 0, 0, 16, 17, 0, 0]
    assert edit.dropped.tolist() == [1, 2, 4, 5]
    assert torch.cat(freed).tolist() == [14, 15]  # 11, 12 belong to the tree (protected prefix)


# --- the request field -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, needle",
    [
        ("x", "must be an object"),
        ({"budget": 0}, "budget must be an integer in [1, 2147483647]"),
        ({"budget": True}, "budget must be an integer"),
        ({"budget": 2**64}, "budget must be an integer in [1, 2147483647]"),
        ({"scorer": "magic"}, "scorer 'magic' is unknown"),
        ({"budget_mode": "all"}, "budget_mode 'all' is unknown"),
        ({"scorer": {"name": "snapkv"}}, "scorer {'name': 'snapkv'} is unknown"),
        ({"scorer": ["snapkv"]}, "scorer ['snapkv'] is unknown"),
        ({"layout": "sideways"}, "layout 'sideways' is unknown"),
        ({"layout": {}}, "layout {} is unknown"),
        ({"memory": {"mode": ["retrieve"]}, "session_id": "s"}, "memory.mode ['retrieve'] is unknown"),
        ({"memory": {"norm": {"x": 1}}, "session_id": "s"}, "memory.norm {'x': 1} is unknown"),
        ({"session_id": 5}, "session_id must be a non-empty string"),
        ({"session_id": ""}, "session_id must be a non-empty string"),
        ({"sesion_id": "a"}, "unknown field(s) sesion_id"),
        ({"intent": "off"}, "sgl_memory.intent must be true or false"),
    ],
)
def test_bad_request_field(raw, needle):
    with pytest.raises(SpecError) as exc:
        parse(raw)
    assert needle in str(exc.value)


def test_request_field_overrides_the_config():
    from sgl_memory.intent.settings import IntentConfig

    spec = parse({"session_id": "a", "budget": 7, "scorer": "h2o"})
    cfg = spec.part("intent").over(IntentConfig(budget=100, layout="compact"))
    assert (cfg.budget, cfg.scorer, cfg.layout, cfg.budget_mode) == (7, "h2o", "compact", "total")
    assert parse({"budget_mode": "history"}).part("intent").over(IntentConfig()).budget_mode == "history"
    assert parse({"session_id": "a"}).part("intent") is None  # no pruning key: no part
    # `intent: false` leaves intent out of the request; a server without intent refuses the key
    off = parse({"session_id": "a", "intent": False})
    assert off.part("intent").over(IntentConfig(enabled=True)).enabled is False and off.asked["intent"] == ("intent",)
    from sgl_memory.core import config
    from sgl_memory.core.request import check_served

    with pytest.raises(SpecError, match=r"sgl_memory\.intent: intent is off on this server"):
        check_served(off, config.from_dict({}))


# --- RoPE re-rotation --------------------------------------------------------------------------


def rope_reference(x, pos, theta):
    """HF Llama rotary embedding written out: x * cos + rotate_half(x) * sin at position pos."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.cat([pos * inv, pos * inv])
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * torch.cos(ang) + half * torch.sin(ang)


def test_rerotated_key_equals_the_key_computed_at_the_new_position():
    torch.manual_seed(0)
    rope = Rope(head_dim=64, theta=1e6)
    raw = torch.randn(20, 2, 64, dtype=torch.float64)
    old = torch.randint(0, 5000, (20,))
    new = torch.randint(0, 5000, (20,))
    cached = torch.stack([rope_reference(raw[i], int(old[i]), 1e6) for i in range(20)])
    moved = rope.rotate(cached, new - old)
    want = torch.stack([rope_reference(raw[i], int(new[i]), 1e6) for i in range(20)])
    assert torch.allclose(moved, want, atol=1e-9)


def test_rope_refuses_scaled_variants():
    class Cfg:
        rope_scaling = {"rope_type": "yarn"}
        hidden_size, num_attention_heads = 64, 4

    with pytest.raises(ValueError, match="yarn"):
        Rope.from_hf_config(Cfg())


# --- who reads a pruned path, and whose namespace a client can name ---------------------------


def test_branch_ids_are_negative_and_name_namespace_and_token():
    from sgl_memory.intent.paths import branch_id, branch_ids, namespace

    spaces = {
        namespace(key, scorer, budget, "dead_slot")
        for key in (("", "a"), ("", "b"), ("t", "a"), ("", "ta"))
        for scorer in ("memory", "snapkv")
        for budget in (64, 65)
    }
    assert len(spaces) == 16 and all(0 <= ns < 2**63 for ns in spaces)
    assert namespace(("", "a"), "memory", 64, "dead_slot") == namespace(("", "a"), "memory", 64, "dead_slot")
    tokens = [0, 1, 2, 151643, 2**31 - 1]
    ids = {branch_id(ns, t) for ns in spaces for t in tokens}
    assert len(ids) == len(spaces) * len(tokens) and all(-(2**63) <= i < 0 for i in ids)
    # the vectorized form against the exact integer arithmetic it stands for
    for ns in spaces:
        want = [-1 - ((ns + t * 0x9E3779B97F4A7C15) % 2**63) for t in tokens]
        assert branch_ids(ns, np.array(tokens, dtype=np.int64)).tolist() == want


def test_find_branches_walks_every_branch_of_the_session_on_the_path():
    """A tree holding a plain path, a session's pruned path with a branch at a node boundary and a
    second one inside its node (two events), a later event's branch that starts earlier, and
    another session's branch."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    from sgl_memory.intent.paths import branch_id, branch_ids
    from sgl_memory.engine.radix_cache import find_branches as find_with
    from sgl_memory.core.tree_fill import with_branches

    def find_branches(root, key, ns):
        return find_with(root, key, lambda ids: branch_ids(ns, ids))

    a, b = 11, 22  # two namespaces
    tree = RadixCache.create_simulated()
    plain = array("q", [1, 2, 3, 4, 5, 6, 7, 8])
    two = ((3, branch_id(a, 4)), (6, branch_id(a, 7)))
    tree.insert(InsertParams(key=RadixKey(plain)))
    tree.insert(InsertParams(key=RadixKey(with_branches(plain, two))))
    tree.insert(InsertParams(key=RadixKey(with_branches(array("q", [9, 8, 7, 6]), ((2, branch_id(b, 7)),)))))
    assert find_branches(tree.root_node, RadixKey(plain), a) == two
    assert find_branches(tree.root_node, RadixKey(plain[:6]), a) == two[:1]  # the key ends before the second
    assert find_branches(tree.root_node, RadixKey(plain), b) == ()  # b's branches are on another path
    assert find_branches(tree.root_node, RadixKey(array("q", [9, 8, 7, 6])), b) == ((2, branch_id(b, 7)),)
    assert find_branches(tree.root_node, RadixKey(array("q", [9, 8, 5, 6])), b) == ()  # another token: not its branch
    assert find_branches(tree.root_node, RadixKey(array("q", [1, 2, 9])), a) == ()  # the path leaves before the branch
    # a later event dropped position 1: its branch there wins over the older path through 2
    tree.insert(InsertParams(key=RadixKey(with_branches(plain, ((1, branch_id(a, 2)),)))))
    assert find_branches(tree.root_node, RadixKey(plain), a) == ((1, branch_id(a, 2)),)
    assert list(with_branches(plain, two)) == [1, 2, 3, branch_id(a, 4), 5, 6, branch_id(a, 7), 8] and list(
        plain
    ) == list(range(1, 9))
    assert with_branches(plain, ()) is plain and with_branches([1, 2], ((1, -7), (5, -8))) == [1, -7]


@pytest.mark.parametrize("key", [None, "lora-a", "a\x00tenant:x", "\\0tenant:x", "\\", "\x00", "a\\\x00b"])
def test_a_client_extra_key_never_contains_the_namespace_separator(key):
    from sgl_memory.engine.admission import client_namespace

    escaped = client_namespace(key)
    assert escaped is None if not key else "\x00" not in escaped
    others = ["a\x00tenant:x", "\\0tenant:x", "\\", "\x00", "a\\\x00b", "lora-a", "\\\\"]
    assert all(client_namespace(o) != escaped for o in others if o != key)  # injective: no two clients meet


def test_a_mechanism_the_server_runs_without_is_refused_naming_its_key():
    from sgl_memory.core.config import MemoryConfig, plain
    from sgl_memory.intent.settings import IntentConfig
    from sgl_memory.memart.settings import MemArtConfig
    from sgl_memory.core.request import check_served

    off = plain()
    for raw, key in (
        ({"budget": 9}, "intent.enabled"),
        ({"scorer": "h2o", "layout": "compact"}, "intent.enabled"),
        ({"session_id": "s", "memory": {}}, "memory.enabled"),
    ):
        with pytest.raises(SpecError, match=key):
            check_served(parse(raw), off)
    check_served(parse({"session_id": "s", "tenant": "t"}), off)  # naming a session asks for nothing
    check_served(parse({"budget": 9}), MemoryConfig(intent=IntentConfig(enabled=True)))
    check_served(parse({"session_id": "s", "memory": {}}), MemoryConfig(memory=MemArtConfig(enabled=True)))


# --- adaptive budget ---------------------------------------------------------------------------


def test_the_adaptive_budget_grows_on_mass_left_out_and_shrinks_on_a_repeated_kept_set():
    cfg = IntentConfig(
        budget_mode="adaptive", budget_floor=50, budget_ceiling=120, grow_at=0.3, shrink_at=0.9, budget_step=1.5
    )
    b = AdaptiveBudget(60)
    assert b.after_event(0.5, torch.arange(10), 100, cfg) is None and b.current == 90  # first event: no overlap yet
    assert (
        b.after_event(0.4, torch.arange(10), 110, cfg) == 1.0 and b.current == 120
    )  # growth wins; capped at the ceiling
    # the same ten kept again, plus positions past the previous prompt (they do not count)
    assert (
        b.after_event(0.1, torch.cat([torch.arange(10), torch.tensor([115, 116])]), 120, cfg) == 1.0 and b.current == 80
    )
    # half of the previous kept set changed: no move
    assert (
        b.after_event(0.1, torch.tensor([0, 1, 2, 3, 4, 5, 30, 31, 32, 33, 34, 35]), 130, cfg) == 0.5
        and b.current == 80
    )
    assert (
        b.after_event(0.0, torch.tensor([0, 1, 2, 3, 4, 5, 30, 31, 32, 33, 34, 35]), 140, cfg) == 1.0
        and b.current == 53
    )
    assert (
        b.after_event(0.0, torch.tensor([0, 1, 2, 3, 4, 5, 30, 31, 32, 33, 34, 35]), 150, cfg) == 1.0
        and b.current == 50
    )  # floor


# --- intent.when pressure: pruning as a capacity lever -------------------------------------------


def test_when_pressure_prunes_only_after_an_eviction_and_a_pruned_session_keeps_pruning():
    """`when: pressure`: a request is served whole unless the tree evicted within the window; one
    admitted then prunes, and its session's later turns prune (and follow its pruned path, the same
    namespace) without pressure. A request's `when: always` prunes regardless."""
    from types import SimpleNamespace

    from sgl_memory.core.requests import Lifetime, RequestStore
    from sgl_memory.intent.apply import RowLayout
    from sgl_memory.intent.planner import Planner
    from sgl_memory.intent.sessions import SessionMemories

    ages: list[float] = []  # seconds since each eviction, the latest last
    asked: list[float] = []

    def evicted_within(seconds: float) -> bool:
        asked.append(seconds)
        return bool(ages) and ages[-1] <= seconds

    store, memories = RequestStore(), SessionMemories(SessionRegistry(), "intent", 0.9)
    config = IntentConfig(enabled=True, when="pressure", pressure_window_s=30, budget=8, budget_mode="history")
    tables = [store.table(name, Lifetime.REQUEST) for name in ("shifts", "plans", "captures")]
    planner = Planner(config, "intent", None, memories, RowLayout(tables[0]), *tables[1:], evicted_within)
    planner.markers = RoleMarkers.from_tokenizer(ToyTokenizer(), "chatml")
    tokens = render([("system", 5), ("user", 30), ("assistant", 10), ("user", 4)])

    def plan(rid, session, **keys):
        req = SimpleNamespace(rid=rid, origin_input_ids=tokens, session_id=None)
        return planner.plan(req, parse({"session_id": session, **keys}))

    whole = plan("a", "s1")
    assert (whole.enabled, whole.gate, whole.namespace, whole.session_key) == (False, None, 0, None)
    assert asked == [30]
    ages.append(40.0)  # outside the window
    assert not plan("b", "s1").enabled
    ages.append(10.0)
    pressed = plan("c", "s1")
    assert (pressed.enabled, pressed.gate) == (True, "pressure") and pressed.namespace != 0
    assert pressed.budget == 8 + pressed.spans.forced_count(len(tokens))
    memories.memory(("", "s1")).update(torch.ones(2, 2, 4))  # what its compression event does
    ages.clear()
    again = plan("d", "s1")
    assert (again.enabled, again.gate, again.namespace) == (True, "session", pressed.namespace)
    assert not plan("e", "s2").enabled
    assert plan("f", "s2", when="always").enabled
    ages.append(1.0)  # under pressure, a request whose history is within the budget has nothing to drop
    history = len(tokens) - pressed.spans.forced_count(len(tokens))
    assert plan("f2", "s3", budget=history).gate is None and plan("f3", "s3", budget=history - 1).gate == "pressure"
    ages.clear()
    with pytest.raises(SpecError, match="when 'later' is unknown"):
        parse({"when": "later"})
    # a session the server derived from the tokens is not followed: every request opening alike is it
    unnamed = SimpleNamespace(rid="g", origin_input_ids=tokens, session_id=None)
    ages.append(1.0)
    derived = planner.plan(unnamed, parse({}))
    assert derived.gate == "pressure" and derived.key_source not in ("session_id", "sglang_session")
    memories.memory(derived.session_key).update(torch.ones(2, 2, 4))
    ages.clear()
    assert not planner.plan(unnamed, parse({})).enabled
