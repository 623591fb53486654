"""The hook manifest is applied by the plugin and checked against the installed SGLang."""

import pkgutil
import subprocess
import sys
from importlib.metadata import entry_points, version

import pytest

from sgl_memory import SGLANG_VERSION, plugin


def test_pinned_sglang_is_installed():
    assert version("sglang") == SGLANG_VERSION


def test_plugin_is_an_sglang_entry_point():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("sgl_memory") == "sgl_memory.plugin:load"


def test_every_manifest_target_and_hook_resolves():
    specs = plugin.manifest()
    assert specs
    plugin.check_patch_set(specs)
    for spec in specs:
        assert callable(pkgutil.resolve_name(spec.hook))
        assert spec.type in ("before", "after", "around", "replace")


def test_missing_target_is_refused_naming_target_and_installed_version():
    bogus = plugin.HookSpec(
        target="sglang.srt.managers.scheduler.Scheduler.no_such_method_anymore",
        type="around",
        hook="sgl_memory.engine.http_api.mount",
        process="all",
        sglang=SGLANG_VERSION,
        why="test",
    )
    with pytest.raises(plugin.PatchSetError) as exc:
        plugin.check_patch_set(plugin.manifest() + [bogus])
    msg = str(exc.value)
    assert "Scheduler.no_such_method_anymore" in msg
    assert f"installed sglang {version('sglang')}" in msg
    assert "http_server.launch_server" not in msg  # only the missing target is named


def test_radix_backend_is_registered_by_sglang_plugin_loader():
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins();"
        "from sglang.srt.mem_cache.registry import get_radix_cache_factory;"
        "from sgl_memory.engine.radix_cache import build; print(get_radix_cache_factory('sgl_memory') is build)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("True")


def test_a_kv_pool_smaller_than_asked_stops_start_up():
    """SGLang takes a smaller pool than --max-total-tokens when less memory is free; our tree's
    factory refuses to start on one (seen on a real server: "the KV pool holds 701359 tokens,
    fewer than --max-total-tokens 100000000")."""
    from types import SimpleNamespace

    from sgl_memory.engine.radix_cache import PoolTooSmall, check_pool_size

    shrunk = SimpleNamespace(size=663, page_size=1)
    with pytest.raises(PoolTooSmall, match="holds 663 tokens, fewer than --max-total-tokens 3000"):
        check_pool_size(shrunk, SimpleNamespace(max_total_tokens=3000))
    check_pool_size(SimpleNamespace(size=3000, page_size=1), SimpleNamespace(max_total_tokens=3000))
    check_pool_size(SimpleNamespace(size=2992, page_size=16), SimpleNamespace(max_total_tokens=3000))  # page-aligned
    check_pool_size(shrunk, SimpleNamespace(max_total_tokens=None))  # no size asked for: SGLang's choice stands
