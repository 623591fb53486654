"""The GPU paths against the CPU ones: the compiled Triton kernels, KEEP's loader on a copy stream,
the selectors, the scorers (the learned head's inputs come off the GPU), key re-rotation and Q4.

Each check computes the same thing from the same inputs on the host (float64 or the CPU path the
rest of the suite verifies) and on a CUDA device. Skipped where there is no CUDA device: this
machine's CI has none, so they run when a session is lent one (see README "GPU checks")."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from sgl_memory.intent import scorers  # noqa: E402
from sgl_memory.intent.head import HeadShape, PrunerHead  # noqa: E402
from sgl_memory.intent.sessions import unit_rows  # noqa: E402
from sgl_memory.keep.loading import LOADINGS, LayerLoader  # noqa: E402
from sgl_memory.keep.select import REGISTRY, LayerView  # noqa: E402
from sgl_memory.kernels.aabb_score import aabb_scores, aabb_scores_torch  # noqa: E402
from sgl_memory.kernels.compact_kv_indices import drop_sentinel_, drop_sentinel_reference  # noqa: E402
from sgl_memory.persist.quant import dequantize, quantize  # noqa: E402
from sgl_memory.rope import Rope  # noqa: E402

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
def test_the_compiled_sentinel_compaction_equals_the_per_request_reference(index_dtype):
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


def view(seed: int, device) -> LayerView:
    g = torch.Generator().manual_seed(seed)
    sizes = (5, 16, 3, 9, 16)
    m = sum(sizes)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    segment = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    cand = torch.rand(m, generator=g) < 0.8
    parts = (r(m, 4, 8), r(m, 2, 8), r(m, 2, 8), r(7, 4, 8), r(7, 2, 8), r(m, 2, 8), r(m, 2, 8), cand, segment)
    return LayerView(*(p.to(device) for p in parts))


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_selector_picks_on_the_gpu_what_it_picks_on_the_host(name):
    for seed in range(4):
        for n in (1, 2, 10):
            host = REGISTRY[name]().select(view(seed, "cpu"), n)
            gpu = REGISTRY[name]().select(view(seed, CUDA), n)
            assert torch.equal(gpu.cpu(), host), (seed, n)


def scoring_inputs(device, head: PrunerHead | None, n: int = 64) -> scorers.ScoringInputs:
    g = torch.Generator().manual_seed(5)
    layers, heads, kv_heads, dim = 3, 4, 2, 16
    keys = [(torch.randn(n, kv_heads, dim, generator=g) * 3).to(device) for _ in range(layers)]
    query = [(torch.randn(6, kv_heads, dim, generator=g) * 3).to(device) for _ in range(layers)]
    return scorers.ScoringInputs(
        layer_keys=lambda: iter(keys), positions=torch.arange(n), q_mean=torch.randn(layers, heads, dim, generator=g),
        q_window=torch.randn(layers, 5, heads, dim, generator=g), memory=unit_rows(torch.randn(layers, heads, dim, generator=g)),
        keep=n // 4, seed=1, sinks=4, kernel=5, query_keys=lambda: iter(query), head=head,
    )  # fmt: skip


def trained_head() -> PrunerHead:
    head = PrunerHead(HeadShape(16))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        head.out.weight.copy_(torch.randn(head.out.weight.shape, generator=g))
        head.out.bias.fill_(0.3)
    return head


@pytest.mark.parametrize("name", ["memory", "query", "snapkv", "h2o", "learned"])
def test_every_scorer_keeps_on_gpu_keys_the_set_it_keeps_on_host_keys(name):
    head = trained_head() if name == "learned" else None
    scorer = scorers.get(name)
    host = scorers.select(scorer.score(scoring_inputs("cpu", head)), 16)
    gpu = scorers.select(scorer.score(scoring_inputs(CUDA, head)), 16)
    assert torch.equal(torch.as_tensor(gpu).cpu(), torch.as_tensor(host))


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
