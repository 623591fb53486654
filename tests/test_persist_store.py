"""The session KV file store: round trips per quantization and pool dtype (bf16 and float32: the
launcher picks the dtype from the CPU; the 8-bit pools, whose own format stores their bytes), files
of one pool dtype restored into another, turns that write their new blocks only, full blocks that
several sessions hold stored once, refusal of damaged or foreign files, atomic writes under a killed
writer, ids that cannot escape the store, tenant isolation."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from sgl_memory.persist.quant import RAW, error_bound, quantize
from sgl_memory.persist.shared import is_shared
from sgl_memory.persist.store import CacheSpec, SessionFiles, StoreError, WriteConflict

SPEC = CacheSpec("toy-model", "cfg123", layers=3, kv_heads=2, head_dim=64, dtype="bfloat16", page_size=1)


POOL_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
# half a step of each pool dtype relative to the value: the most a value moves when rounded into it
HALF_STEP = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}


def kv(tokens=600, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.layers, tokens, SPEC.kv_heads, SPEC.head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def session(files, tokens=600, seed=0):
    return files.record(list(range(100, 100 + tokens)), "<|im_start|>user\nhello", *kv(tokens, seed))


@pytest.mark.parametrize("pool", list(POOL_DTYPES))
@pytest.mark.parametrize(
    "quant, kivi",
    [(raw, False) for raw in ("bf16", "fp32", "fp8_e4m3", "fp8_e5m2")] + [("q8", False), ("q4", False), ("q4", True)],
)
def test_round_trip(tmp_path, quant, kivi, pool):
    dtype = POOL_DTYPES[pool]
    files = SessionFiles(tmp_path, dataclasses.replace(SPEC, dtype=pool), quant=quant, kivi=kivi)
    keys, values = kv(dtype=dtype)
    files.write("t1", "s1", files.record(range(100, 700), "text", keys, values))
    got = files.read("t1", "s1")
    assert got.token_ids == list(range(100, 700)) and got.text == "text"
    got_keys, got_values = files.decode(got, dtype=dtype)
    assert got_keys.dtype == got_values.dtype == dtype
    part_keys, part_values = files.decode(got, 250, 530, dtype=dtype)  # a range across block boundaries
    assert torch.equal(part_keys, got_keys[:, 250:530]) and torch.equal(part_values, got_values[:, 250:530])
    if quant in RAW:  # values as a pool of the stored dtype holds them: each rounded once, if at all
        assert got.blocks[0]["k"].dtype == RAW[quant]
        for stored, original in ((got_keys, keys), (got_values, values)):
            assert torch.equal(stored.float(), original.to(RAW[quant]).float())
        if RAW[quant] in (dtype, torch.float32):  # the pool's own format, or wider: exact
            assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    else:
        bits = {"q8": 8, "q4": 4}[quant]
        for stored, original, axis in ((got_keys, keys, 1 if kivi else -1), (got_values, values, -1)):
            for start in range(0, 600, 256):  # blocks are quantized on their own
                block = original[:, start : start + 256].float()
                bound = error_bound(quantize(block, bits, axis=axis))
                # + the rounding of the dequantized value into the pool's dtype
                rounding = (block.abs() + bound) * HALF_STEP[dtype] + 1e-6
                err = (stored[:, start : start + 256].float() - block).abs()
                assert (err <= bound + rounding).all()


def test_a_pruned_path_round_trips_with_its_key_live_mask_and_session_state(tmp_path):
    """A pruned path is found in the tree by its namespace and branch ids, and its dead
    positions hold no KV; the other mechanisms' state (QueryMemory, the memory pool) rides along
    exactly, whatever the quantization of the KV."""
    files = SessionFiles(tmp_path, SPEC, quant="q4")
    record = session(files, tokens=300)
    live = torch.rand(300, generator=torch.Generator().manual_seed(1)) > 0.3
    state = {
        "intent.query_memory": torch.randn(3, 4, 64),
        "memory.tokens": torch.arange(7),
        "memory.values": torch.randn(3, 7, 2, 64).bfloat16(),
    }
    record = dataclasses.replace(
        record, extra_key="\x00tenant:t1", branches=((41, -123456789), (97, -5)), live=live, state=state
    )
    files.write("t1", "s1", record)
    got = files.read("t1", "s1")
    assert got.extra_key == "\x00tenant:t1" and got.branches == ((41, -123456789), (97, -5))
    assert torch.equal(got.live, live) and set(got.state) == set(state)
    for name, t in state.items():
        assert torch.equal(got.state[name], t) and got.state[name].dtype == t.dtype
    files.write("t1", "s2", session(files, tokens=10))  # a plain path: every position live, no state
    plain = files.read("t1", "s2")
    assert plain.extra_key is None and plain.branches == () and plain.live is None and plain.state == {}


def test_two_ranks_files_of_one_turn_share_a_history_digest_and_other_turns_do_not(tmp_path):
    """Tensor-parallel ranks hold other heads (floating KV and state differ) of the same history:
    the same digest. A turn behind (tokens), another live mask, branch, namespace, state tensor or
    an integer state value is another history."""
    g = torch.Generator().manual_seed(2)
    files = SessionFiles(tmp_path, SPEC, quant="fp32")
    live = torch.rand(300, generator=g) > 0.3

    def rank(seed=0, **changes):
        record = dataclasses.replace(
            session(files, tokens=300, seed=seed),
            live=live,
            branches=((41, -7),),
            extra_key="\x00t",
            state={"intent.query_memory": torch.randn(3, 1, 64, generator=g), "memory.tokens": torch.arange(7)},
        )
        return dataclasses.replace(record, **changes)

    rank_0, rank_1 = rank(0), rank(1)
    assert not torch.equal(rank_0.state["intent.query_memory"], rank_1.state["intent.query_memory"])
    assert rank_0.history_digest() == rank_1.history_digest()
    others = [
        rank(token_ids=rank_0.token_ids[:280]),
        rank(live=~live),
        rank(branches=((41, -8),)),
        rank(extra_key=None),
        rank(state={**rank_0.state, "memory.tokens": torch.arange(1, 8)}),
        rank(state={**rank_0.state, "memory.keys": torch.zeros(1)}),
    ]
    assert all(other.history_digest() != rank_0.history_digest() for other in others)
    assert all(0 <= r.history_digest() < 2**63 for r in [rank_0, *others])


@pytest.mark.parametrize("quant, kivi", [("bf16", False), ("fp32", False), ("q8", False), ("q4", True)])
def test_state_that_holds_kv_is_stored_in_the_files_quantization_and_the_rest_exactly(tmp_path, quant, kivi):
    """The memory pool's keys and values are KV ([layers, tokens, heads, dim]): stored like the
    session's blocks (bf16 / fp32: as held, float32 keys included); the QueryMemory is stored exactly."""
    files = SessionFiles(tmp_path, SPEC, quant=quant, kivi=kivi)
    keys, values = torch.randn(3, 70, 2, 64), torch.randn(3, 70, 2, 64).bfloat16()
    query_memory = torch.randn(3, 4, 64)
    state = {"memory.keys": keys, "memory.values": values, "intent.query_memory": query_memory}
    record = dataclasses.replace(
        session(files, tokens=10), state=state, state_kv={"memory.keys": "k", "memory.values": "v"}
    )
    path = files.write(None, "s", record)
    got = files.read(None, "s").state
    assert torch.equal(got["intent.query_memory"], query_memory)
    for name, original, axis in (("memory.keys", keys, 1 if kivi else -1), ("memory.values", values, -1)):
        assert got[name].dtype == original.dtype and got[name].shape == original.shape
        if quant in ("bf16", "fp32"):
            assert torch.equal(got[name], original)
        else:
            bound = error_bound(quantize(original.float(), {"q8": 8, "q4": 4}[quant], axis=axis))
            assert ((got[name].float() - original.float()).abs() <= bound + original.float().abs() * 2**-7 + 1e-3).all()
    plain_size = files.write(None, "plain", dataclasses.replace(record, state_kv={})).stat().st_size
    if quant == "q4":
        assert path.stat().st_size < 0.4 * plain_size  # float32 keys and bf16 values at about half a byte


def test_a_file_written_before_namespaces_were_stored_restores_into_any(tmp_path):
    """Files of the first format carry no namespace: they restore as before (into the request's)."""
    from safetensors.torch import load_file, save_file

    from sgl_memory.persist import header, store

    files = SessionFiles(tmp_path, SPEC, quant="bf16")
    path = files.write(None, "old", session(files, tokens=10))
    meta = {k: v for k, v in header.read_metadata(path).items() if k not in ("extra_key", "branches", "checksum")}
    tensors = load_file(path)
    meta["checksum"] = header.checksum(tensors, meta)
    save_file(tensors, path, metadata=meta)
    got = files.read(None, "old")
    assert got.extra_key == store.ANY_NAMESPACE and got.branches == () and got.live is None


def test_a_file_with_one_branch_of_the_earlier_format_reads_as_a_one_branch_path(tmp_path):
    from safetensors.torch import load_file, save_file

    from sgl_memory.persist import header

    files = SessionFiles(tmp_path, SPEC, quant="bf16")
    path = files.write(None, "old", dataclasses.replace(session(files, tokens=10), branches=((4, -99),)))
    meta = {k: v for k, v in header.read_metadata(path).items() if k not in ("branches", "checksum")}
    meta["branch"] = "[4, -99]"
    tensors = load_file(path)
    meta["checksum"] = header.checksum(tensors, meta)
    save_file(tensors, path, metadata=meta)
    assert files.read(None, "old").branches == ((4, -99),)


@pytest.mark.parametrize("pool", list(POOL_DTYPES))
def test_bytes_on_disk_per_quantization(tmp_path, pool):
    """What a file costs follows the store's format, not the pool's dtype: a float32 pool's Q4
    file is as small as a bf16 pool's."""
    spec = dataclasses.replace(SPEC, dtype=pool)
    tokens = 1024
    elements = 2 * spec.layers * tokens * spec.kv_heads * spec.head_dim  # keys and values
    sizes = {}
    for quant in ("fp32", "bf16", "q8", "q4"):
        files = SessionFiles(tmp_path / quant, spec, quant=quant)
        files.write(None, "s", files.record(range(tokens), "t", *kv(tokens, dtype=POOL_DTYPES[pool])))
        sizes[quant] = files.size(None, "s")
    for quant, per_element in (("fp32", 4), ("bf16", 2), ("q8", 1 + 4 / 64), ("q4", 0.5 + 4 / 64)):
        # the tensors' bytes plus a header and token ids of a few KB
        assert elements * per_element <= sizes[quant] <= elements * per_element + 32 * 1024, (quant, sizes)


def chunk_files(files, tenant, session_id) -> list:
    return sorted(files.files(tenant, session_id)[1:])


def test_damaged_and_foreign_files_are_refused(tmp_path):
    files = SessionFiles(tmp_path, SPEC, quant="q4")
    path = files.write(None, "s", session(files))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # a flipped bit in the head's tensor data (its token ids)
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksum mismatch"):
        files.read(None, "s")
    files.write(None, "s", session(files))
    chunk = chunk_files(files, None, "s")[0]
    data = bytearray(chunk.read_bytes())
    data[-100] ^= 0xFF  # a flipped bit in a block
    chunk.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksum mismatch in its chunk"):
        files.read(None, "s")
    files.write(None, "s", session(files))
    path.write_bytes(path.read_bytes()[:5000])  # truncated
    with pytest.raises(StoreError, match="unreadable"):
        files.read(None, "s")
    files.write(None, "s", session(files))
    other = SessionFiles(tmp_path, dataclasses.replace(SPEC, head_dim=128), quant="q4")
    other_path = other.path(None, "s")
    other_path.parent.mkdir(parents=True, exist_ok=True)
    other_path.write_bytes(path.read_bytes())  # the file of another model under this model's name
    with pytest.raises(StoreError, match="another model"):
        other.read(None, "s")


@pytest.mark.parametrize("quant", ["q8", "bf16", "fp8_e4m3"])
def test_a_file_of_a_pool_in_another_dtype_restores_into_this_pools_dtype(tmp_path, quant):
    """The same store on a CPU where the launcher chose the other dtype, or an 8-bit pool's files
    read by a float pool: the KV is converted into this pool's dtype, as the writing pool's values."""
    writers = {"q8": "float32", "bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn"}
    written = POOL_DTYPES[writers[quant]]
    files = SessionFiles(tmp_path, dataclasses.replace(SPEC, dtype=writers[quant]), quant=quant)
    keys, values = kv(dtype=written)
    files.write(None, "s", files.record(range(100, 700), "text", keys, values))
    reference = files.decode(files.read(None, "s"), dtype=torch.float32)  # what the writing pool restores
    for reader in ("float32", "bfloat16"):
        other = SessionFiles(tmp_path, dataclasses.replace(SPEC, dtype=reader), quant="q8")
        got = other.decode(other.read(None, "s"), dtype=POOL_DTYPES[reader])
        for stored, expected in zip(got, reference):
            assert stored.dtype == POOL_DTYPES[reader] and torch.equal(stored, expected.to(POOL_DTYPES[reader]))


def test_ids_cannot_escape_and_tenants_never_share(tmp_path):
    files = SessionFiles(tmp_path / "store", SPEC)
    for sid in ("../../etc/passwd", "/abs/path", "a\x00b", ".."):
        assert files.path("x", sid).resolve().is_relative_to((tmp_path / "store").resolve())
    a, b = session(files, seed=1), session(files, seed=2)
    files.write("tenant-a", "same", a)
    files.write("tenant-b", "same", b)
    assert files.path("tenant-a", "same") != files.path("tenant-b", "same")
    got = files.decode(files.read("tenant-a", "same"))[0].float()
    a_keys, b_keys = files.decode(a)[0].float(), files.decode(b)[0].float()
    assert (got - a_keys).norm() < (got - b_keys).norm() / 3  # tenant a's KV, not b's
    assert files.read("tenant-c", "same") is None


WRITER = """
import sys, torch
from sgl_memory.persist.store import CacheSpec, SessionFiles
spec = CacheSpec("toy-model", "cfg123", 3, 2, 64, "bfloat16", 1)
n = int(sys.argv[2])
files = SessionFiles(sys.argv[1], spec, quant="bf16")
kv = files.record(range(n), "t", torch.randn(3, n, 2, 64).bfloat16(), torch.randn(3, n, 2, 64).bfloat16())
print("ready", flush=True)
while True:
    files.write(None, "s", kv)
"""


def test_a_writer_killed_mid_write_leaves_only_loadable_files(tmp_path):
    files = SessionFiles(tmp_path, SPEC, quant="bf16")
    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(60_000)], stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.05 + 0.15 * attempt)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kv = files.read(None, "s")  # raises if a torn file sits under the session's name
        assert kv is None or len(kv.token_ids) == 60_000
    # a store opened after the crashes removes the writers' temporary files and the chunks no head names
    (files.path(None, "s").parent / "left-by-a-dead-writer.tmp").write_bytes(b"partial")
    assert SessionFiles(tmp_path, SPEC).removed_partial >= 1
    assert not list(tmp_path.glob("*/*/*.tmp"))
    record = files.read(None, "s")
    assert record is None or {p.name for p in chunk_files(files, None, "s")} == {c.name for c in record.chunks}


def test_quota_evicts_least_recently_used(tmp_path):
    files = SessionFiles(tmp_path, SPEC, quant="q4")
    for i in range(4):
        files.write(None, f"s{i}", session(files, tokens=256, seed=i))
        os.utime(files.path(None, f"s{i}"), (1000 + i, 1000 + i))
    files.read(None, "s0")  # s0 becomes the most recently used
    size = files.size(None, "s1")
    removed = files.enforce_quota(int(size * 2.5))
    assert removed == [files.path(None, "s1"), files.path(None, "s2")]
    assert files.read(None, "s0") is not None and files.read(None, "s3") is not None
    assert not chunk_files(files, None, "s1") and files.size(None, "s1") == 0  # a session goes with its chunks
    assert files.disk_bytes == files.size(None, "s0") + files.size(None, "s3")


def test_a_fine_tune_with_the_same_config_is_another_model(tmp_path):
    """Issue 13: a checkpoint with an identical HF config but other weights must not load the
    first one's session files: the spec's hash covers the weight files' names, sizes and bytes."""
    from types import SimpleNamespace

    from sgl_memory.persist.identity import cache_spec

    def checkpoint(name: str, data: bytes):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "llama"}')
        (folder / "model.safetensors").write_bytes(data)
        return folder

    g = torch.Generator().manual_seed(0)
    weights = torch.randint(0, 256, (400_000,), dtype=torch.uint8, generator=g).numpy().tobytes()
    tuned = bytearray(weights)
    tuned[200_000:200_010] = bytes(10)  # one small change where no header lives
    hf_config = SimpleNamespace(to_dict=lambda: {"model_type": "llama", "hidden_size": 64})
    pool = SimpleNamespace(layer_num=2, get_key_buffer=lambda layer: torch.zeros(8, 2, 32, dtype=torch.bfloat16))
    tree = SimpleNamespace(pool=pool, page_size=1, layers=lambda: range(2))  # the KV host's part it reads

    def spec(folder):
        args = SimpleNamespace(model_path=str(folder), served_model_name="m")
        return cache_spec(SimpleNamespace(hf_config=hf_config), args, tree, 0, 1)

    base = spec(checkpoint("base", weights))
    assert spec(checkpoint("copy", weights)) == base  # the same weights elsewhere: the same model
    assert spec(checkpoint("tuned", bytes(tuned))).config_hash != base.config_hash
    assert spec(checkpoint("longer", weights + b"\0")).config_hash != base.config_hash
    files = SessionFiles(tmp_path / "store", base, quant="bf16")
    keys, values = kv(tokens=8)
    files.write(None, "s", files.record(range(8), "x", keys, values))
    assert SessionFiles(tmp_path / "store", spec(tmp_path / "tuned"), quant="bf16").read(None, "s") is None


def test_a_write_that_continues_an_older_generation_is_refused(tmp_path):
    """Two servers sharing the store (replicas) see one linear history per session: a writer says
    which generation its record continues, and a file that moved on since is not replaced."""
    a, b = SessionFiles(tmp_path, SPEC, quant="bf16"), SessionFiles(tmp_path, SPEC, quant="bf16")
    assert a.generation(None, "s") == 0
    first = session(a, tokens=10, seed=1)
    a.write(None, "s", first, base=0)
    assert first.generation == 1 == b.generation(None, "s")
    seen_by_b = b.read(None, "s")
    assert seen_by_b.generation == 1
    a.write(None, "s", session(a, tokens=20, seed=2), base=1)  # a continues generation 1: stored as 2
    with pytest.raises(WriteConflict, match="generation 2"):
        b.write(None, "s", session(b, tokens=30, seed=3), base=seen_by_b.generation)  # b continues 1 too: refused
    assert len(b.read(None, "s").token_ids) == 20 and b.generation(None, "s") == 2
    assert not list(tmp_path.glob("*/*/*.tmp"))  # the refused write left nothing behind
    with pytest.raises(WriteConflict):
        b.write(None, "s", session(b, tokens=30, seed=3), base=0)  # a new session of b's meets a's file
    # a file removed for the quota, or one that cannot be read, blocks no write
    a.path(None, "s").unlink()
    b.write(None, "s", session(b, tokens=30, seed=3), base=2)
    a.path(None, "s").write_bytes(b"not a safetensors file")
    assert a.generation(None, "s") == -1
    a.write(None, "s", session(a, tokens=40, seed=4), base=2)
    assert len(b.read(None, "s").token_ids) == 40


SHARER = """
import os, sys, random, torch
from sgl_memory.persist.store import CacheSpec, SessionFiles, WriteConflict
root, name, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
files = SessionFiles(root, CacheSpec("toy-model", "cfg123", 3, 2, 64, "bfloat16", 1), quant="bf16")

def content(tenant, sid, generation):
    # what generation g of a session holds: its tokens and a KV value name the tenant, session and g
    code = 8 * "ab".index(tenant) + int(sid[1:]) + 16 * (generation % 8)
    n = 100 + 97 * generation % 400
    return [code, generation] + list(range(n)), float(code)

log = open(os.path.join(root, f"acks-{name}"), "a")
rng = random.Random(seed)
print("ready", flush=True)
while True:
    tenant, sid = rng.choice("ab"), f"s{rng.randrange(4)}"
    record = files.read(tenant, sid)  # StoreError (a torn or foreign file) ends the process: the test sees it
    base = 0 if record is None else record.generation
    if record is not None:
        tokens, code = content(tenant, sid, base)
        assert record.token_ids == tokens, (tenant, sid, base)
        keys, _ = files.decode(record)
        assert bool((keys == code).all()), (tenant, sid, base)
    tokens, code = content(tenant, sid, base + 1)
    kv = torch.full((3, len(tokens), 2, 64), code, dtype=torch.bfloat16)
    try:
        files.write(tenant, sid, files.record(tokens, sid, kv, kv.clone()), base=base)
    except WriteConflict:
        continue
    log.write(f"{tenant} {sid} {base + 1}\\n")
    log.flush()
    os.fsync(log.fileno())
"""


def test_servers_sharing_the_store_and_killed_at_random_lose_tear_or_mix_no_session(tmp_path):
    """Two processes read and write the same sessions of two tenants as fast as they can, each one
    killed (SIGKILL) at random points and restarted. Every write a process acknowledged is in the
    store or was superseded by a later generation, no generation of a session was stored twice (one
    history), every file read back whole holds its own tenant's and session's content, and a store
    opened afterwards removes what the dead writers left."""
    import random

    rng = random.Random(0)

    def start(name, seed):
        proc = subprocess.Popen([sys.executable, "-c", SHARER, str(tmp_path), name, str(seed)], stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        return proc

    procs, kills = {}, 0
    try:
        procs["p0"], procs["p1"] = start("p0", 0), start("p1", 1)
        for round in range(6):
            time.sleep(rng.uniform(0.2, 0.8))
            for name, proc in procs.items():
                assert proc.poll() is None, f"{name} stopped by itself: a read failed its checks"
            victim = rng.choice(sorted(procs))
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs[victim].wait()
            kills += 1
            procs[victim] = start(victim, 100 + round)
        time.sleep(0.5)
        assert all(proc.poll() is None for proc in procs.values())
    finally:  # a failed check must not leave the other writer running
        for proc in procs.values():
            proc.kill()
            proc.wait()

    acks = [line.split() for name in procs for line in (tmp_path / f"acks-{name}").read_text().splitlines()]
    assert len(acks) > 50, "the writers must get through many writes"
    stored = [(t, s, int(g)) for t, s, g in acks]
    assert len(stored) == len(set(stored)), "two writers stored the same generation of a session"
    files = SessionFiles(tmp_path, SPEC, quant="bf16")
    assert not list(tmp_path.glob("*/*/*.tmp"))
    named = {c.name for t in "ab" for i in range(4) if (r := files.read(t, f"s{i}")) is not None for c in r.chunks}
    chunks = list(tmp_path.glob("*/*/*.chunk"))
    assert {p.name for p in chunks if not is_shared(p)} == named  # no chunk of a dead writer is left
    assert all(p.stat().st_nlink > 1 for p in chunks if is_shared(p))  # nor a block no session links
    for tenant in "ab":
        for sid in (f"s{i}" for i in range(4)):
            acked = [g for t, s, g in stored if (t, s) == (tenant, sid)]
            record = files.read(tenant, sid)
            if not acked:
                continue
            assert record is not None and record.generation >= max(acked), (tenant, sid)
            code = 8 * "ab".index(tenant) + int(sid[1:]) + 16 * (record.generation % 8)
            assert record.token_ids[:2] == [code, record.generation]
            assert bool((files.decode(record)[0] == code).all())
    assert kills == 6


def turns(files, keys, values, lengths, session_id="s"):
    """A session's turns as the server writes them: each turn's path is the previous one's plus new
    tokens, its KV from the block that holds the previous path's end; yields (record, chunk files
    the write added)."""
    record, before = None, set()
    for n in lengths:
        start = 0 if record is None else len(record.token_ids) // files.block_size * files.block_size
        record = files.continued(record, list(range(n)), start, keys[:, start:n], values[:, start:n])
        files.write(None, session_id, record, base=record.generation)
        now = {p.name for p in chunk_files(files, None, session_id)}
        yield record, now - before
        before = now


def test_a_turn_writes_the_blocks_it_added_and_reads_back_whole(tmp_path):
    """30 turns of 20 tokens on 16-token blocks: every turn reads back as the session's KV (bit for
    bit), the files on disk are the chunks the head names (one per block), each turn writes the
    blocks from the one that held the previous path's end (the blocks it added, and the partial one
    it completed), so the blocks written over the session are a fraction of rewriting the whole path
    each turn."""
    files = SessionFiles(tmp_path, SPEC, quant="bf16", block_size=16)
    keys, values = kv(tokens=600)
    written = whole = previous = 0
    for record, added in turns(files, keys, values, range(20, 601, 20)):
        n = len(record.token_ids)
        got = files.read(None, "s")
        got_keys, got_values = files.decode(got)
        assert (
            got.token_ids == list(range(n))
            and torch.equal(got_keys, keys[:, :n])
            and torch.equal(got_values, values[:, :n])
        )
        assert {c.name for c in got.chunks} == {p.name for p in chunk_files(files, None, "s")}
        assert len(got.chunks) == len(got.blocks)
        this_turn = sum(c.count for c in got.chunks if c.name in added)
        assert this_turn == len(got.blocks) - previous // 16, (n, this_turn)
        written, whole, previous = written + this_turn, whole + len(got.blocks), n
    assert written <= whole / 3, (written, whole)


def test_a_path_that_changes_inside_rewrites_from_the_change(tmp_path):
    """A turn whose path differs from the stored one from some block on (a pruning event, an
    edited history): the blocks before it stay where they are, the rest is written again, and the
    chunks nothing names any more are removed."""
    files = SessionFiles(tmp_path, SPEC, quant="bf16", block_size=16)
    keys, values = kv(tokens=400)
    *_, (record, _) = turns(files, keys, values, [100, 200, 300])
    other_keys, other_values = kv(tokens=400, seed=5)
    record = files.continued(record, list(range(250)), 64, other_keys[:, 64:250], other_values[:, 64:250])
    assert record.dirty == 4
    files.write(None, "s", record, base=record.generation)
    got_keys, _ = files.decode(files.read(None, "s"))
    assert torch.equal(got_keys[:, :64], keys[:, :64]) and torch.equal(got_keys[:, 64:], other_keys[:, 64:250])
    assert {p.name for p in chunk_files(files, None, "s")} == {c.name for c in record.chunks}


def test_a_head_of_the_first_format_is_read_and_its_next_write_stores_every_block(tmp_path):
    """A store written before chunks (format 1: the blocks in the session's one file) reads as it
    did; the session's next turn writes a head of this format with all of its blocks in chunks."""
    from safetensors.torch import load as load_tensors
    from safetensors.torch import save_file

    from sgl_memory.persist import header

    files = SessionFiles(tmp_path, SPEC, quant="bf16", block_size=16)
    keys, values = kv(tokens=100)
    record = files.record(range(100), "t", keys, values)
    path = files.write(None, "old", record)
    chunks = chunk_files(files, None, "old")
    meta = {k: v for k, v in header.read_metadata(path).items() if k not in ("chunks", "checksum")}
    meta["format_version"] = "1"
    tensors = load_tensors(path.read_bytes())
    for chunk in chunks:
        tensors.update(load_tensors(chunk.read_bytes()))
        chunk.unlink()
    meta["checksum"] = header.checksum(tensors, meta)
    save_file(tensors, path, metadata=meta)
    old = files.read(None, "old")
    assert old.chunks == () and old.dirty == 0 and torch.equal(files.decode(old)[0], keys)
    more_keys, more_values = kv(tokens=130, seed=3)
    new = files.continued(old, list(range(130)), 96, more_keys[:, 96:], more_values[:, 96:])
    files.write(None, "old", new, base=old.generation)
    got = files.read(None, "old")
    assert header.read_metadata(path)["format_version"] == str(header.FORMAT_VERSION)
    assert torch.equal(files.decode(got)[0], torch.cat([keys[:, :96], more_keys[:, 96:]], dim=1))


def test_a_reader_whose_head_was_replaced_meanwhile_reads_the_new_one(tmp_path, monkeypatch):
    """A writer replaces the head and removes the chunks it no longer names between a reader's read
    of the head and of a chunk: the reader reads the new head (never a missing or mixed path)."""
    from sgl_memory.persist.reads import CheckedReader

    files = SessionFiles(tmp_path, SPEC, quant="bf16", block_size=16)
    first, second = kv(tokens=64, seed=1), kv(tokens=64, seed=2)
    files.write(None, "s", files.record(range(64), "t", *first))
    read_blocks = CheckedReader._read_blocks
    calls = []

    def racing(self, path, meta, tensors, chunks):
        calls.append(meta["generation"])
        if len(calls) == 1:  # another server's turn lands between the head and its chunks
            files.write(None, "s", files.record(range(64), "t", *second))
        return read_blocks(self, path, meta, tensors, chunks)

    monkeypatch.setattr(CheckedReader, "_read_blocks", racing)
    got = files.read(None, "s")
    assert calls == ["1", "2"] and torch.equal(files.decode(got)[0], second[0])


def store_bytes(root) -> int:
    """Bytes the store takes on disk: each file once, however many names it has (an independent
    count of what enforce_quota reports)."""
    inodes = {(p.stat().st_dev, p.stat().st_ino): p.stat().st_size for p in root.rglob("*") if p.is_file()}
    return sum(inodes.values())


def sharing(prefix_tokens=40, own=(10, 30), seed=0):
    """Sessions whose paths open with the same `prefix_tokens` tokens and KV (a shared tool prefix,
    one radix node's slots), then tokens and KV of their own: (tokens, keys, values) each."""
    keys, values = kv(tokens=prefix_tokens, seed=seed)
    out = []
    for i, n in enumerate(own):
        k, v = kv(tokens=n, seed=seed + 1 + i)
        tokens = list(range(prefix_tokens)) + list(range(1000 * (i + 1), 1000 * (i + 1) + n))
        out.append((tokens, torch.cat([keys, k], dim=1), torch.cat([values, v], dim=1)))
    return out


def test_full_blocks_several_sessions_hold_are_stored_once_and_read_back_as_each_wrote_them(tmp_path):
    """Two sessions open with the same 40 tokens of KV on 16-token blocks: their two full blocks of
    it are one file each on disk (the store's bytes count them once), each session reads back its own
    KV bit for bit, and the partial block where they part stays each one's own."""
    files = SessionFiles(tmp_path, SPEC, quant="bf16", block_size=16)
    paths = sharing()
    for i, (tokens, keys, values) in enumerate(paths):
        files.write(None, f"s{i}", files.record(tokens, "t", keys, values))
    for i, (tokens, keys, values) in enumerate(paths):
        got = files.read(None, f"s{i}")
        got_keys, got_values = files.decode(got)
        assert got.token_ids == tokens and torch.equal(got_keys, keys) and torch.equal(got_values, values)
    inodes = [{c.stat().st_ino for c in chunk_files(files, None, f"s{i}")} for i in range(2)]
    assert len(inodes[0] & inodes[1]) == 2  # blocks 0 and 1 (tokens 0-31); block 2 (32-47) differs
    files.enforce_quota(1 << 40)
    assert files.disk_bytes == store_bytes(tmp_path)
    shared_bytes = sum(c.stat().st_size for c in chunk_files(files, None, "s0") if c.stat().st_ino in inodes[1])
    assert shared_bytes and files.disk_bytes == files.size(None, "s0") + files.size(None, "s1") - shared_bytes


def test_the_same_tokens_with_other_kv_share_nothing(tmp_path):
    """Blocks are matched by their bytes, not their tokens: a session whose path has the same tokens
    but other KV (another model's run, a recomputed prefix) reads back its own."""
    files = SessionFiles(tmp_path, SPEC, quant="bf16", block_size=16)
    for i in range(2):
        files.write(None, f"s{i}", files.record(list(range(48)), "t", *kv(tokens=48, seed=i)))
    for i in range(2):
        assert torch.equal(files.decode(files.read(None, f"s{i}"))[0], kv(tokens=48, seed=i)[0])
    files.enforce_quota(1 << 40)
    assert files.disk_bytes == files.size(None, "s0") + files.size(None, "s1") == store_bytes(tmp_path)


def test_a_shared_block_stays_while_a_session_links_it_and_goes_with_the_last(tmp_path):
    """The quota removes the least recently used sharer: the other still reads whole; when it goes
    too, no block of either is left on disk."""
    files = SessionFiles(tmp_path, SPEC, quant="bf16", block_size=16)
    paths = sharing()
    for i, (tokens, keys, values) in enumerate(paths):
        files.write(None, f"s{i}", files.record(tokens, "t", keys, values))
        os.utime(files.path(None, f"s{i}"), (1000 + i, 1000 + i))
    assert files.enforce_quota(files.size(None, "s1")) == [files.path(None, "s0")]
    tokens, keys, _ = paths[1]
    assert torch.equal(files.decode(files.read(None, "s1"))[0], keys)
    assert files.disk_bytes == files.size(None, "s1") == store_bytes(tmp_path)
    assert files.enforce_quota(0) == [files.path(None, "s1")]
    assert not list(tmp_path.glob("*/*/*.chunk")) and files.disk_bytes == 0


def test_without_hard_links_each_session_keeps_its_own_copy(tmp_path, monkeypatch):
    """A filesystem that refuses hard links: every session still reads back whole, each with its own copy."""

    def refuse(src, dst):
        raise PermissionError(1, "Operation not permitted", str(src))

    monkeypatch.setattr(os, "link", refuse)
    files = SessionFiles(tmp_path, SPEC, quant="bf16", block_size=16)
    paths = sharing()
    for i, (tokens, keys, values) in enumerate(paths):
        files.write(None, f"s{i}", files.record(tokens, "t", keys, values))
    for i, (tokens, keys, _) in enumerate(paths):
        assert torch.equal(files.decode(files.read(None, f"s{i}"))[0], keys)
    files.enforce_quota(1 << 40)
    assert files.disk_bytes == files.size(None, "s0") + files.size(None, "s1") == store_bytes(tmp_path)


def test_a_dead_writers_link_no_head_names_is_removed_and_then_its_block(tmp_path):
    """A writer killed between linking a block and renaming its head leaves a link no head names
    (and the block's only copy): a store opened later removes both; a named one stays."""
    files = SessionFiles(tmp_path, SPEC, quant="bf16", block_size=16)
    tokens, keys, values = sharing()[0]
    head = files.write(None, "s", files.record(tokens, "t", keys, values))
    dead = head.parent / f"{'0' * 40}.w999999999-{'ab' * 20}.chunk"
    copy = head.parent / f"blk-{'ab' * 20}.chunk"
    copy.write_bytes(b"a block")
    os.link(copy, dead)
    assert SessionFiles(tmp_path, SPEC).removed_partial == 2
    assert not dead.exists() and not copy.exists()
    assert torch.equal(files.decode(files.read(None, "s"))[0], keys)
