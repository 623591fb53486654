import pytest

from sgl_memory.core import config, mechanism
from sgl_memory.intent.settings import IntentConfig
from sgl_memory.keep.settings import KeepConfig
from sgl_memory.memart.settings import MemArtConfig
from sgl_memory.persist.settings import PersistConfig
from sgl_memory.sentencekv.settings import SentenceKVConfig


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_valid_file_overrides_only_given_keys(tmp_path):
    cfg = config.load(write(tmp_path, "intent:\n  budget: 512\n  scorer: snapkv\nmemory:\n  agg: max\n  norm: rr\n"))
    intent, memory = cfg.of(IntentConfig), cfg.of(MemArtConfig)
    assert intent.budget == 512 and intent.scorer == "snapkv"
    assert intent.layout == "dead_slot"  # untouched default
    assert memory.agg == "max" and memory.norm == "rr"
    assert cfg.of(PersistConfig) == PersistConfig()


def test_empty_file_and_no_file_give_defaults(tmp_path):
    assert config.load(write(tmp_path, "")) == config.MemoryConfig()
    assert config.load(None) == config.MemoryConfig()


def test_example_config_is_valid_and_equals_defaults():
    from pathlib import Path

    example = Path(__file__).parent.parent / "configs" / "example.yaml"
    assert config.load(example) == config.MemoryConfig()


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            "intnet:\n  budget: 3\n",
            "intnet: unknown key; allowed keys: plugins, sessions, intent, keep, memory, persist",
        ),
        ("intent:\n  budgett: 3\n", "intent.budgett: unknown key"),
        (
            "intent:\n  scorer: magic\n",
            "intent.scorer: 'magic' is not allowed; allowed values: memory, memory_pool, query",
        ),
        (
            "persist:\n  quant: q2\n",
            "persist.quant: 'q2' is not allowed; allowed values: auto, q4, q8, bf16, fp32, fp8_e4m3, fp8_e5m2, int8",
        ),
        ("intent:\n  budget: 0\n", "intent.budget: invalid value; allowed: an integer in [1, 2147483647]"),
        ("intent:\n  budget: many\n", "intent.budget: 'many' is not allowed; expected an integer"),
        (
            "intent:\n  enabled: yes please\n",
            "intent.enabled: 'yes please' is not allowed; allowed values: true, false",
        ),
        ("intent:\n  decay: 1.5\n", "intent.decay: invalid value"),
        ("memory:\n  cut: tokens\n", "memory.unit: invalid value; allowed: block, or line with cut: lines"),
        ("memory:\n  placed_tokens: -2\n", "memory.placed_tokens: invalid value"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("intent: [1\n", "not valid YAML"),
    ],
)
def test_bad_input_names_the_key_and_allowed_values(tmp_path, text, needle):
    with pytest.raises(config.ConfigError) as exc:
        config.load(write(tmp_path, text))
    assert needle in str(exc.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(config.ConfigError, match="cannot read memory config"):
        config.load(tmp_path / "absent.yaml")


def test_every_combination_of_the_three_mechanisms_is_accepted(tmp_path):
    """intent, persist and memory compose: no pair and not all three is refused at start-up."""
    from sgl_memory.core.composition import check as check_config

    names = (IntentConfig, PersistConfig, MemArtConfig)
    combos = [(a,) for a in names] + [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]] + [names]
    for combo in combos:
        check_config(config.load(write(tmp_path, config.to_yaml(*(section(enabled=True) for section in combo)))))
    check_config(config.MemoryConfig())


def test_a_declared_conflict_is_refused_where_the_tree_is_built(tmp_path, monkeypatch):
    """A mechanism that cannot run beside another says so in `conflicts`; the guard runs in the
    tree's constructor (a plain sglang.launch_server with the plugin gets it) and names the pair."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_memory.core import mechanism
    from sgl_memory.core.composition import check as check_config
    from sgl_memory.engine.radix_cache import SglMemoryRadixCache

    check_config(config.MemoryConfig())  # imports (registers) every mechanism
    monkeypatch.setattr(mechanism.REGISTRY["memory"], "conflicts", {"intent": "a reason"})
    cfg = config.load(write(tmp_path, config.to_yaml(IntentConfig(enabled=True), MemArtConfig(enabled=True))))
    with pytest.raises(
        config.ConfigError, match="memory.enabled and intent.enabled together are not supported yet: a reason"
    ):
        check_config(cfg)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1)
    with pytest.raises(config.ConfigError):
        SglMemoryRadixCache(params, cfg)
    check_config(config.load(write(tmp_path, config.to_yaml(IntentConfig(enabled=True), PersistConfig(enabled=True)))))


def scale_matrix() -> dict[str, tuple[bool, bool]]:
    """The deployment docs' table of what each mechanism refuses: name -> (page size > 1, TP > 1)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "deployment.md").read_text()
    section = text.split("## Tensor parallelism and page size", 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1:4] for line in section.splitlines() if line.startswith("| `")]
    return {
        name.strip(" `"): (page.strip().startswith("refused"), tp.strip().startswith("refused"))
        for name, page, tp in rows
    }


@pytest.mark.parametrize("tp_size, page_size", [(2, 1), (1, 16), (2, 16)])
def test_a_mechanism_not_correct_at_a_tp_or_page_size_stops_start_up_with_its_reason(tmp_path, tp_size, page_size):
    """Each mechanism alone: start-up refuses TP 2 or page size 16 exactly where the deployment
    docs' table says it does, naming the mechanism; the tree's constructor refuses it too."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_memory.core import mechanism
    from sgl_memory.core.composition import check
    from sgl_memory.engine.radix_cache import SglMemoryRadixCache

    check(config.MemoryConfig())  # imports (registers) every mechanism
    matrix = scale_matrix()
    assert set(matrix) == set(mechanism.REGISTRY)
    for name, (page_refused, tp_refused) in matrix.items():
        cfg = config.load(write(tmp_path, config.to_yaml(mechanism.REGISTRY[name].settings(enabled=True))))
        refused = (page_size > 1 and page_refused) + (tp_size > 1 and tp_refused)
        if not refused:
            check(cfg, tp_size, page_size)
            continue
        with pytest.raises(config.ConfigError) as exc:
            check(cfg, tp_size, page_size)
        assert str(exc.value).count(f"{name} ") == refused, str(exc.value)
        params = CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=page_size
        )
        with pytest.raises(config.ConfigError, match=f"^{name} "):
            SglMemoryRadixCache(params, cfg, SimpleNamespace(tp_size=tp_size))  # the TP size of SGLang's build context
    check(config.plain(), 8, 64)  # every mechanism off: nothing to refuse
    check(config.MemoryConfig(), 8, 64)  # nor the default (persistence on) at any TP and page size


def test_named_options_are_the_registries(tmp_path):
    """The config's option lists (which the request field's validation reads) are the registries'
    key sets: a scorer or a norm added to its registry and not to the config would be unreachable."""
    from sgl_memory.intent.layouts import LAYOUTS
    from sgl_memory.intent.scorers import SCORERS
    from sgl_memory.memart.eviction import EVICTIONS
    from sgl_memory.memart.retrieval import AGGS, NORMS

    assert set(config.choices(IntentConfig, "scorer")) == set(SCORERS)
    assert set(config.choices(IntentConfig, "layout")) == set(LAYOUTS)
    assert set(config.choices(MemArtConfig, "norm")) == set(NORMS)
    assert set(config.choices(MemArtConfig, "agg")) == set(AGGS)
    assert set(config.choices(MemArtConfig, "eviction")) == set(EVICTIONS)


# A section of every built-in mechanism with several fields off their defaults (a bool, an int, a
# float, a string with a placeholder, a named option): the builder's round trip through the loader.
SAMPLES = {
    "intent": IntentConfig(enabled=True, budget=64, grow_at=0.5, scorer="snapkv", head="{dir}/head.safetensors"),
    "keep": KeepConfig(enabled=False, ratio=0.25, hops=2, drop_rows=False, loading="sync", trace_dir="{dir}/t"),
    "memory": MemArtConfig(enabled=True, top_k=4, score_layers=0.25, cut="tokens", unit="block", groups=False),
    "persist": PersistConfig(enabled=False, dir="{dir}/store", quant="bf16", kivi=False, prefetch_ms=0.0),
    "sentencekv": SentenceKVConfig(enabled=True, budget=100, keep_factor=3.0, system=True, boundaries=".\n"),
}


def registered() -> list[str]:
    mechanism.discover()
    return sorted(mechanism.REGISTRY)


@pytest.mark.parametrize("name", registered())
def test_the_builder_writes_what_the_loader_reads_back(tmp_path, name):
    """config.to_yaml of a section gives the YAML that loads back into that section, for every
    registered mechanism, and leaves every other section at its defaults."""
    assert name in SAMPLES, f"add a sample section of mechanism {name!r} to SAMPLES"
    section = SAMPLES[name]
    assert type(section) is mechanism.REGISTRY[name].settings
    cfg = config.load(write(tmp_path, config.to_yaml(section)))
    assert cfg.section(name) == section and cfg.of(type(section)) == section
    defaults = config.MemoryConfig()
    assert all(cfg.section(n) == defaults.section(n) for n in mechanism.REGISTRY if n not in (name, "keep"))


def test_the_builder_writes_enabled_and_only_the_changed_fields(tmp_path):
    """As short as a hand-written config: `enabled` always, the rest only where it is not the default
    (a section left out keeps the loader's defaults: keep follows memory); sessions and plugin
    sections too; a placeholder stays as written, for the test servers' directory."""
    assert config.to_yaml(IntentConfig(enabled=True, budget=64)) == "intent:\n  enabled: true\n  budget: 64\n"
    assert config.to_yaml(PersistConfig(enabled=False)) == "persist:\n  enabled: false\n"
    text = config.to_yaml(MemArtConfig(enabled=True), sessions=config.SessionSources(tenant_header=True))
    cfg = config.load(write(tmp_path, text))
    assert cfg.of(KeepConfig).enabled and cfg.sessions == config.SessionSources(tenant_header=True)
    placed = config.to_yaml(PersistConfig(enabled=True, dir="{dir}/store"))
    assert config.load(write(tmp_path, placed.replace("{dir}", "/d"))).of(PersistConfig).dir == "/d/store"
    raw = config.to_yaml(plugins=("toy_mechanism",), raw={"toy": {"enabled": True}})
    assert raw == "plugins:\n- toy_mechanism\ntoy:\n  enabled: true\n"


def test_a_wrong_field_or_section_fails_where_the_config_is_written():
    """The point of the typed builder: a misspelt key fails where the dataclass is built, not at a
    server's start-up; a class no mechanism declares, or a section given twice, are refused too."""
    with pytest.raises(TypeError, match="budgett"):
        IntentConfig(enabled=True, budgett=64)
    with pytest.raises(TypeError, match="no registered mechanism declares settings"):
        config.to_yaml(config.SessionSources())
    with pytest.raises(TypeError, match="given twice"):
        config.to_yaml(IntentConfig(), IntentConfig(budget=8))
    with pytest.raises(TypeError, match="given twice"):
        config.to_yaml(IntentConfig(), raw={"intent": {"enabled": True}})


def test_a_section_is_read_by_its_class():
    """config.of(Settings) returns the section typed as its class; section(name) the same object;
    a class no mechanism declares is refused with its name, and there are no attribute sections."""
    cfg = config.from_dict({"intent": {"budget": 7}})
    assert cfg.of(IntentConfig) is cfg.section("intent") and cfg.of(IntentConfig).budget == 7
    with pytest.raises(TypeError, match="SessionSources"):
        cfg.of(config.SessionSources)
    with pytest.raises(AttributeError):
        cfg.intent  # noqa: B018
