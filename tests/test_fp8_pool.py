"""An 8-bit KV pool (SGLang's `--kv-cache-dtype fp8_e4m3|fp8_e5m2` on CPU, read by our attention
backend): what our code writes into it is each value rounded to the pool's dtype (reference: torch's
own cast), and SGLang's AMX check is answered only for a CPU e4m3 pool our backend alone reads.
Attention over such a pool: tests/test_cpu_attention.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache import kv_cache_configurator as configurator_module

from sgl_memory.core import tree_fill
from sgl_memory.engine import fp8_pool
from sgl_memory.engine.attention.cpu_backend import BACKEND_NAME


class Fp8Pool:
    """Two layers of [slots, 2 heads, 8], stored as SGLang stores fp8: uint8 bytes viewed as fp8."""

    layer_num = 2

    def __init__(self, size: int, dtype: torch.dtype):
        self.k = [torch.zeros(size, 2, 8, dtype=torch.uint8) for _ in range(self.layer_num)]
        self.v = [torch.zeros(size, 2, 8, dtype=torch.uint8) for _ in range(self.layer_num)]
        self.dtype = dtype

    def get_key_buffer(self, layer):
        return self.k[layer].view(self.dtype)

    def get_value_buffer(self, layer):
        return self.v[layer].view(self.dtype)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("slots", [torch.arange(5, 12), torch.tensor([3, 9, 4, 20, 17, 1, 30])])
def test_a_restore_writes_each_value_rounded_to_the_pools_dtype(dtype, slots):
    pool = Fp8Pool(32, dtype)
    tree = SimpleNamespace(pool=pool, layers=lambda: range(pool.layer_num))
    keys, values = (3 * torch.randn(2, len(slots), 2, 8, dtype=torch.bfloat16) for _ in range(2))
    live = torch.ones(len(slots), dtype=torch.bool)
    tree_fill.write(tree, SimpleNamespace(slots=slots, live=live), keys, values)
    for layer in range(pool.layer_num):
        assert torch.equal(pool.get_key_buffer(layer)[slots].float(), keys[layer].to(dtype).float())
        assert torch.equal(pool.get_value_buffer(layer)[slots].float(), values[layer].to(dtype).float())
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not pool.k[0][untouched].any()


def answers_inside():
    """What SGLang's check reads, asked while the pool is configured."""
    return configurator_module.cpu_has_amx_support(), tuple(configurator_module.attention_backends())


@pytest.mark.parametrize(
    "dtype, backends, answered",
    [
        (torch.float8_e4m3fn, (BACKEND_NAME, BACKEND_NAME), True),
        (torch.float8_e4m3fn, ("torch_native", BACKEND_NAME), False),  # another reader: SGLang's check stands
        (torch.float8_e5m2, (BACKEND_NAME, BACKEND_NAME), False),  # SGLang does not check e5m2
        (torch.bfloat16, (BACKEND_NAME, BACKEND_NAME), False),
    ],
)
def test_sglangs_check_is_answered_only_for_an_e4m3_pool_our_backend_alone_reads(
    monkeypatch, dtype, backends, answered
):
    monkeypatch.setattr(configurator_module.current_platform, "is_cpu", lambda: True)
    monkeypatch.setattr(configurator_module, "attention_backends", lambda: backends)
    monkeypatch.setattr(configurator_module, "cpu_has_amx_support", lambda: False)
    inside = fp8_pool.configure_hook(lambda configurator: answers_inside(), SimpleNamespace(kv_cache_dtype=dtype))
    assert inside == ((True, ("intel_amx", "intel_amx")) if answered else (False, backends))
    assert answers_inside() == (False, backends)  # as it was, after the pool is configured


def test_sglangs_names_come_back_when_configuring_fails(monkeypatch):
    monkeypatch.setattr(configurator_module.current_platform, "is_cpu", lambda: True)
    monkeypatch.setattr(configurator_module, "attention_backends", lambda: (BACKEND_NAME,))
    monkeypatch.setattr(configurator_module, "cpu_has_amx_support", lambda: False)

    def fails(configurator):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        fp8_pool.configure_hook(fails, SimpleNamespace(kv_cache_dtype=torch.float8_e4m3fn))
    assert answers_inside() == (False, (BACKEND_NAME,))
