"""The GPU paths against the CPU ones: the compiled Triton kernels, KEEP's loader on a copy stream,
the selectors, the scorers (the learned head's inputs come off the GPU), key re-rotation and Q4.

Each check computes the same thing from the same inputs on the host (float64 or the CPU path the
rest of the suite verifies) and on a CUDA device. Skipped where there is no CUDA device: this
machine's CI has none, so they run when a session is lent one (see "GPU checks" in docs/testing.md)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_intent_head import inputs as head_inputs  # noqa: E402
from test_intent_head import trained  # noqa: E402
from test_intent_units import make_inputs as rule_inputs  # noqa: E402
from test_keep_units import view as keep_view  # noqa: E402

from sgl_memory.intent import scorers  # noqa: E402
from sgl_memory.keep.loading import LOADINGS, LayerLoader  # noqa: E402
from sgl_memory.keep.select import SELECTORS, LayerView  # noqa: E402
from sgl_memory.kernels.aabb_score import aabb_scores, aabb_scores_torch  # noqa: E402
from sgl_memory.kernels.drop_sentinel import drop_sentinel_, drop_sentinel_reference  # noqa: E402
from sgl_memory.kernels.step_kv_indices import step_kv_indices, step_kv_indices_reference  # noqa: E402
from sgl_memory.persist.quant import dequantize, quantize  # noqa: E402
from sgl_memory.sentencekv.select import SentenceReads, page_table, sentence_table  # noqa: E402
from sgl_memory.core.rope import Rope  # noqa: E402

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L, T, H, N, Hkv, D", [(2, 37, 14, 300, 2, 64), (1, 5, 4, 65, 4, 128), (3, 70, 8, 7, 1, 48)])
def test_the_compiled_block_score_kernel_equals_the_float64_score(dtype, L, T, H, N, Hkv, D):
    g = torch.Generator().manual_seed(N + T)
    q = torch.randn(L, T, H, D, generator=g).to(dtype)
    keys = torch.randn(L, N, 4, Hkv, D, generator=g).to(dtype)
    lo, hi = keys.amin(2), keys.amax(2)
    want = aabb_scores_torch(q.double(), lo.double(), hi.double()).double()
    got = aabb_scores(q.to(CUDA), lo.to(CUDA), hi.to(CUDA))
    assert got.is_cuda and got.dtype == torch.float32
    # 16-bit inputs are exact in TF32 and their products exact in float32: only the sum rounds
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_the_compiled_sentinel_drop_equals_the_per_request_reference(index_dtype):
    g = torch.Generator().manual_seed(3)
    sentinel = 0
    lengths = [0, 1, 5, 1023, 1024, 1025, 4000, 17]
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=index_dtype)
    indices = torch.randint(1, 10_000, (int(indptr[-1]),), generator=g, dtype=index_dtype)
    indices[torch.rand(indices.numel(), generator=g) < 0.4] = sentinel
    indices[int(indptr[4]) : int(indptr[5])] = sentinel  # a request whose every slot was pruned
    want_indptr, want = drop_sentinel_reference(indptr, indices, sentinel)
    d_indptr, d_indices = indptr.to(CUDA), indices.to(CUDA)
    drop_sentinel_(d_indptr, d_indices, sentinel)
    assert torch.equal(d_indptr.cpu(), want_indptr)
    assert torch.equal(d_indices[: int(want_indptr[-1])].cpu(), want)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_the_compiled_step_read_lists_equal_the_per_request_reference(index_dtype):
    g = torch.Generator().manual_seed(5)
    req_to_token = torch.randint(1, 10_000, (8, 5000), generator=g).to(index_dtype)
    req_to_token[torch.rand(8, 5000, generator=g) < 0.2] = 0  # the sentinel
    rows = torch.tensor([7, 0, 3, 1], dtype=torch.int32)
    seq_lens = torch.tensor([5000, 1, 1025, 0], dtype=torch.int32)
    reads = torch.rand(4, 5000, generator=g) < 0.1
    want_indptr, want = step_kv_indices_reference(req_to_token, rows, seq_lens, reads, 0)
    out = torch.empty(4 * 5000, dtype=index_dtype, device=CUDA)
    indptr = step_kv_indices(req_to_token.to(CUDA), rows.to(CUDA), seq_lens.to(CUDA), reads.to(CUDA), 0, out)
    assert torch.equal(indptr.cpu(), want_indptr)
    assert torch.equal(out[: int(want_indptr[-1])].cpu(), want)


@pytest.mark.parametrize("mode", LOADINGS)
def test_the_loader_copies_each_layers_rows_to_the_gpu_on_its_own_stream(mode):
    g = torch.Generator().manual_seed(1)
    layers, m = 8, 300
    keys, values = torch.randn(layers, m, 2, 64, generator=g), torch.randn(layers, m, 2, 64, generator=g)
    loader = LayerLoader(keys.to(torch.bfloat16), values.to(torch.bfloat16), CUDA, mode)
    assert (loader.stream is not None) and loader.keys.is_cuda
    selected = torch.ones(m, dtype=torch.bool)
    try:
        for layer in range(layers):
            need = ~selected
            k, v = loader.ready(layer, need)
            # read on the forward's stream, after the event ready() made it wait for
            assert torch.equal(k[need.to(CUDA)].cpu(), keys[layer][need].to(torch.bfloat16))
            assert torch.equal(v[need.to(CUDA)].cpu(), values[layer][need].to(torch.bfloat16))
            selected = selected & (torch.rand(m, generator=g) < 0.7)
            loader.want(layer + 1, ~selected, ~selected)
    finally:
        loader.close()
    assert loader.bytes > 0


def on_gpu(v: LayerView) -> LayerView:
    """The view with every tensor on the GPU (`reduce` is the tree's function, not a tensor)."""
    return replace(
        v, **{f.name: getattr(v, f.name).to(CUDA) for f in fields(v) if isinstance(getattr(v, f.name), torch.Tensor)}
    )


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_every_selector_picks_on_the_gpu_what_it_picks_on_the_host(name):
    for seed in range(4):
        cand = torch.rand(49, generator=torch.Generator().manual_seed(seed)) < 0.8
        for n in (1, 2, 10):
            host = SELECTORS[name]().select(keep_view(seed, candidates=cand), n)
            gpu = SELECTORS[name]().select(on_gpu(keep_view(seed, candidates=cand)), n)
            assert torch.equal(gpu.cpu(), host), (seed, n)


def keys_on_gpu(x: scorers.ScoringInputs) -> scorers.ScoringInputs:
    """The same inputs with the pool's keys on the GPU, as a CUDA server's pool holds them."""
    moved = lambda keys: None if keys is None else (lambda: (k.to(CUDA) for k in keys()))  # noqa: E731
    return replace(x, layer_keys=moved(x.layer_keys), query_keys=moved(x.query_keys))


@pytest.mark.parametrize("name", ["memory", "query", "snapkv", "h2o", "learned"])
def test_every_scorer_keeps_on_gpu_keys_the_set_it_keeps_on_host_keys(name):
    x = head_inputs(5, n=64, head=trained(2)) if name == "learned" else rule_inputs(n=64, seed=5)[0]
    scorer = scorers.get(name)
    host = scorers.select(scorer.score(x), 16)
    gpu = scorers.select(scorer.score(keys_on_gpu(x)), 16)
    assert torch.equal(gpu.cpu(), host)


@pytest.mark.parametrize("table", [sentence_table, page_table])
def test_sentencekv_reads_from_gpu_keys_and_queries_what_it_reads_from_host_ones(table):
    """A CUDA server's pool keys and decode queries are on the GPU: the tables built from them and
    each step's reads (SentenceKV's sentences, the Quest-style pages) are the host's."""
    g = torch.Generator().manual_seed(11)
    layers, pool, prompt = 3, 120, 400
    positions = [torch.randperm(prompt, generator=g)[:pool].sort().values for _ in range(layers)]
    groups = torch.arange(prompt) // 17
    keys = torch.randn(layers, pool, 2, 64, generator=g).to(torch.bfloat16)
    queries = torch.randn(4, layers, 14, 64, generator=g).to(torch.bfloat16)
    ends = torch.rand(1000, generator=g) < 0.1

    def steps(device):
        tables = [table(positions[i], groups, keys[i].to(device)) for i in range(layers)]
        reads = SentenceReads(torch.tensor([0, 1, 399]), tables, prompt, budget=60, interval=2, ends=ends.numpy())
        return [
            reads.positions(layer, queries[s, layer].to(device), s * 7, prompt + s).tolist()
            for s in range(4)
            for layer in range(layers)
        ]

    assert steps(CUDA) == steps("cpu")


def test_re_rotating_gpu_keys_equals_the_host():
    rope = Rope(64, 1_000_000.0)
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(50, 2, 64, generator=g).to(torch.bfloat16)
    delta = torch.randint(-5000, 5000, (50,), generator=g)
    got = rope.rotate(keys.to(CUDA), delta.to(CUDA))
    assert got.is_cuda
    torch.testing.assert_close(got.cpu().float(), rope.rotate(keys, delta).float(), rtol=0, atol=1e-2)


@pytest.mark.parametrize("bits, axis", [(4, -1), (8, -1), (4, 0)])
def test_quantizing_on_the_gpu_stores_the_host_codes(bits, axis):
    x = torch.randn(256, 2, 64, generator=torch.Generator().manual_seed(bits)).to(torch.bfloat16)
    host, gpu = quantize(x, bits, axis=axis), quantize(x.to(CUDA), bits, axis=axis)
    assert torch.equal(gpu.codes.cpu(), host.codes)
    torch.testing.assert_close(dequantize(gpu).cpu(), dequantize(host), rtol=0, atol=1e-2)


@pytest.mark.parametrize("bits, axis", [(4, 0), (8, 2)])
def test_decoding_into_a_gpu_buffer_slice_equals_the_host_decode(bits, axis):
    """The restore's shape: 200 tokens (a short last KIVI group of 8) decoded into the middle of a
    larger CUDA buffer, as the session store does; nothing outside the slice is touched."""
    x = torch.randn(200, 2, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    host = quantize(x, bits, axis=axis)
    gpu = quantize(x.to(CUDA), bits, axis=axis)
    buffer = torch.full((300, 2, 64), 5.0, dtype=torch.bfloat16, device=CUDA)
    dequantize(gpu, out=buffer[50:250])
    torch.testing.assert_close(buffer[50:250].cpu(), dequantize(host), rtol=0, atol=1e-2)
    assert bool((buffer[:50] == 5).all()) and bool((buffer[250:] == 5).all())
