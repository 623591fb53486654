"""Our int8 KV pool (`--kv-cache-dtype int8`): packed rows of 8-bit codes with an fp16 scale per
token and head (sgl_memory/core/kv_rows.py, sgl_memory/engine/int8_pool.py).

References: the rows read by hand (codes times the fp16 scale in a row's last two bytes) and a
symmetric quantizer written here in float64; the pool built by SGLang's own constructor; a restore,
a store round trip and a compaction against the values they started from. Attention over the pool:
tests/test_cpu_attention.py; in the server: tests/test_fp8_pool_server.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache import kv_cache_configurator as configurator_module
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sgl_memory import kv_pool
from sgl_memory.core import kv_rows, tree_fill
from sgl_memory.core.rope import Rope
from sgl_memory.engine import int8_pool
from sgl_memory.engine.attention.cpu_backend import BACKEND_NAME
from sgl_memory.intent.layouts import apply_compact
from sgl_memory.persist.codec import BlockCodec
from sgl_memory.persist.records import CacheSpec


def held(rows: torch.Tensor) -> torch.Tensor:
    """What packed rows hold, read by hand, in float64."""
    return rows[..., :-2].double() * rows[..., -2:].contiguous().view(torch.float16).double()


def step_of(values: torch.Tensor) -> torch.Tensor:
    """A row's quantization step as a symmetric 8-bit quantizer sets it: its largest magnitude over
    127, rounded to fp16 (float64, [..., 1])."""
    return (values.double().abs().amax(-1, keepdim=True) / 127).to(torch.float16).double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_holds_its_values_to_half_a_step_of_its_own_scale(dtype):
    g = torch.Generator().manual_seed(0)
    # rows of very different magnitudes (a key outlier head beside a quiet one), and a zero row
    x = torch.randn(50, 2, 64, generator=g) * torch.tensor([0.01, 30.0]).view(1, 2, 1)
    x[7] = 0
    x = x.to(dtype)
    rows = kv_rows.encode(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 2, 66)
    step = step_of(x)
    assert torch.equal(rows[..., -2:].contiguous().view(torch.float16).double(), step)  # the scale as stored
    err = (held(rows) - x.double()).abs()
    assert bool((err <= step / 2 + 1e-12).all())
    assert not held(rows[7]).any()  # a zero row stays zero
    assert rows[..., :-2].abs().max() <= 127
    assert rows[..., :-2].abs().amax(-1)[x.abs().amax(-1) > 0].min() == 127  # each row's largest value is a full code


def test_decoding_gives_the_held_values_and_rows_round_trip_through_float32_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    rows = kv_rows.encode(torch.randn(40, 3, 32, generator=g) * 5)
    assert torch.equal(kv_rows.decode(rows, torch.float32).double(), held(rows))
    assert torch.equal(kv_rows.decode(rows, torch.bfloat16), held(rows).to(torch.bfloat16))  # rounded once
    # a restore or memory placement writes decoded values back: the same codes and scales
    assert torch.equal(kv_rows.encode(kv_rows.decode(rows, torch.float32)), rows)
    assert kv_rows.convert(rows, torch.int8) is rows
    assert kv_rows.head_dim(rows) == 32 and kv_rows.head_dim(held(rows)) == 32
    assert kv_rows.row_bytes(64, torch.int8) == 66 and kv_rows.row_bytes(64, torch.bfloat16) == 128


def sglang_pool(size: int = 64, layers: int = 2) -> int8_pool.Int8KVPool:
    return int8_pool.Int8KVPool(
        size=size,
        page_size=1,
        dtype=torch.float32,
        head_num=2,
        head_dim=64,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def test_sglangs_pool_with_our_rows_quantizes_each_write_and_sizes_its_bytes():
    """Built by SGLang's own constructor; set_kv_buffer (the attention backend's write) stores each
    token's head to half a step of its own scale, and SGLang's byte count is the packed rows'."""
    pool = sglang_pool()
    assert pool.get_key_buffer(1).shape == (65, 2, 66) and pool.get_key_buffer(1).dtype == torch.int8
    assert pool.get_kv_size_bytes() == (2 * 65 * 2 * 66, 2 * 65 * 2 * 66)
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(3, 2, 64, generator=g) * 4 for _ in range(2))
    loc = torch.tensor([5, 6, 9])
    pool.set_kv_buffer(SimpleNamespace(layer_id=1), loc, k, v)
    for buffer, x in ((pool.get_key_buffer(1), k), (pool.get_value_buffer(1), v)):
        assert bool(((held(buffer[loc]) - x.double()).abs() <= step_of(x) / 2 + 1e-12).all())
    assert not pool.get_key_buffer(0).any() and not pool.get_key_buffer(1)[:5].any()
    with pytest.raises(ValueError, match="no KV scales"):
        pool.set_kv_buffer(SimpleNamespace(layer_id=0), loc, k, v, k_scale=2.0)


@pytest.mark.parametrize(
    "announced, backends, kind, want",
    [
        ("int8", (BACKEND_NAME,), "mha", int8_pool.Int8KVPool),
        ("int8", (BACKEND_NAME,), "mla", MHATokenToKVPool),  # only the MHA pool is replaced
        ("bfloat16", (BACKEND_NAME,), "mha", MHATokenToKVPool),
        (None, (BACKEND_NAME,), "mha", MHATokenToKVPool),
        ("int8", ("torch_native",), "mha", ValueError),
    ],
)
def test_the_hook_builds_our_pool_only_when_the_launcher_chose_it_for_our_backend(
    monkeypatch, announced, backends, kind, want
):
    if announced is None:
        monkeypatch.delenv(kv_pool.POOL_ENV, raising=False)
    else:
        monkeypatch.setenv(kv_pool.POOL_ENV, kv_pool.PoolSize(1 << 20, 100, announced, 6336, "test").to_json())
    monkeypatch.setattr(configurator_module, "attention_backends", lambda: backends)

    def original(configurator, *, kind, default):
        return default

    def chosen():
        return int8_pool.pool_class_hook(original, None, kind=kind, default=MHATokenToKVPool)

    if want is ValueError:
        with pytest.raises(ValueError, match="read by the sgl_memory_cpu attention backend only"):
            chosen()
    else:
        assert chosen() is want


def host(pool) -> SimpleNamespace:
    """The KV host's part of a tree that tree_fill reads: the pool and its layers, no sentinel."""
    return SimpleNamespace(pool=pool, layers=lambda: range(pool.layer_num), sentinel=None)


@pytest.mark.parametrize("slots", [torch.arange(5, 12), torch.tensor([3, 9, 4, 20, 17, 1, 30])])
def test_a_restore_of_values_is_quantized_and_a_copy_comes_back_as_values_or_as_stored(slots):
    pool = sglang_pool(40)
    tree = host(pool)
    g = torch.Generator().manual_seed(3)
    keys, values = (3 * torch.randn(2, len(slots), 2, 64, generator=g) for _ in range(2))
    tree_fill.write(tree, SimpleNamespace(slots=slots, live=torch.ones(len(slots), dtype=torch.bool)), keys, values)
    copied = tree_fill.copy_slots(tree, slots)
    stored = tree_fill.copy_slots(tree, slots, as_stored=True)
    assert copied.keys.dtype == torch.float32 and stored.keys.dtype == torch.int8
    assert torch.equal(copied.keys.double(), held(stored.keys))
    assert torch.equal(copied.values.double(), held(stored.values))
    assert bool(((held(stored.keys) - keys.double()).abs() <= step_of(keys) / 2 + 1e-12).all())
    # the stored rows written back elsewhere are the same bytes (a restore of the pool's own format)
    elsewhere = torch.arange(32, 32 + len(slots))
    everything = torch.ones(len(slots), dtype=torch.bool)
    tree_fill.write(tree, SimpleNamespace(slots=elsewhere, live=everything), stored.keys, stored.values)
    assert torch.equal(tree_fill.copy_slots(tree, elsewhere, as_stored=True).keys, stored.keys)


SPEC = CacheSpec("m", "h", 2, 2, 64, "int8", 1, "tp0/1")


@pytest.mark.parametrize("quant", ["int8", "q8", "bf16"])
def test_the_store_keeps_the_pools_rows_as_they_are_and_converts_every_other_way(quant):
    """`int8` (the int8 pool's own format, `persist.quant: auto` there): a write stores the packed
    rows and a restore into the same pool gets them back byte for byte; a float pool restores them
    decoded. Files of another format restore into the int8 pool as its own quantization of their values."""
    g = torch.Generator().manual_seed(4)
    values = 2 * torch.randn(2, 300, 2, 64, generator=g)
    rows = kv_rows.encode(values)
    codec = BlockCodec(SPEC, quant, kivi=quant == "q8", block_size=256)
    record = codec.record(list(range(300)), "", rows, rows)
    back_packed, _ = codec.decode(record, 10, 290, dtype=torch.int8)
    back_float, _ = codec.decode(record, 10, 290, dtype=torch.float32)
    assert back_packed.shape == (2, 280, 2, 66) and back_float.shape == (2, 280, 2, 64)
    if quant == "int8":
        assert record.blocks[0]["k"].dtype == torch.int8
        assert torch.equal(back_packed, rows[:, 10:290])
        assert torch.equal(back_float.double(), held(rows[:, 10:290]))
    else:
        # the file holds the pool's values to its own precision; the pool requantizes what it reads
        assert torch.equal(back_packed, kv_rows.encode(back_float))
        assert bool(((back_float.double() - held(rows[:, 10:290])).abs() <= step_of(values[:, 10:290])).all())


def test_a_compaction_moves_rows_re_rotated_and_requantized():
    """IntentKV's compaction re-packs kept rows at new positions: keys re-rotated as values (then a
    new scale), values copied byte for byte. Reference: the rotation of the values the rows held."""
    pool = sglang_pool(64, layers=1)
    g = torch.Generator().manual_seed(5)
    slots = torch.arange(10, 30)
    k, v = (torch.randn(20, 2, 64, generator=g) for _ in range(2))
    pool.set_kv_buffer(SimpleNamespace(layer_id=0), slots, k, v)
    before_k, before_v = pool.get_key_buffer(0)[slots].clone(), pool.get_value_buffer(0)[slots].clone()
    row = torch.zeros(32, dtype=torch.int64)
    row[:20] = slots
    kept = torch.tensor([0, 3, 4, 9, 15, 19])
    fresh = torch.arange(40, 46)
    rope = Rope(64, 10000.0)
    edit = apply_compact(row, kept, 20, 0, 0, lambda n: fresh, lambda s: None, pool.k_buffer, pool.v_buffer, rope)
    assert edit is not None and torch.equal(row[:6], fresh)
    assert torch.equal(pool.get_value_buffer(0)[fresh], before_v[kept])
    want = rope.rotate(held(before_k[kept]), torch.arange(6) - kept)
    assert bool(((held(pool.get_key_buffer(0)[fresh]) - want).abs() <= step_of(want) / 2 + 1e-6).all())


@pytest.mark.parametrize("reader", ["int8", "float32", "bfloat16"])
def test_an_int8_pools_session_file_restores_into_any_pool(tmp_path, reader):
    """On disk (safetensors): the int8 pool's file holds its rows; the same pool reads them back byte
    for byte, a float pool (another server's dtype) reads the values they hold, rounded to its dtype."""
    from sgl_memory.persist.store import SessionFiles

    g = torch.Generator().manual_seed(6)
    keys, values = (kv_rows.encode(2 * torch.randn(2, 600, 2, 64, generator=g)) for _ in range(2))
    files = SessionFiles(tmp_path, SPEC, quant="int8")
    files.write(None, "s", files.record(range(100, 700), "text", keys, values))
    other = SessionFiles(tmp_path, dataclasses.replace(SPEC, dtype=reader), quant="q8")
    dtype = getattr(torch, reader)
    got_keys, got_values = other.decode(other.read(None, "s"), 250, 530, dtype=dtype)
    for got, rows in ((got_keys, keys[:, 250:530]), (got_values, values[:, 250:530])):
        if reader == "int8":
            assert torch.equal(got, rows)
        else:
            assert got.dtype == dtype and torch.equal(got, held(rows).to(dtype))
