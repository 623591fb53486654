"""Q4 / Q8 group quantization of KV blocks: round-trip error against the float input, within the
analytic bound for every element, for each layout (per-token groups; KIVI per-channel keys)."""

from __future__ import annotations

import pytest
import torch

from sgl_memory.persist.quant import dequantize, error_bound, quantize


def kv_like(tokens=300, heads=2, dim=64, seed=0):
    """KV-shaped data with a few outlier channels, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, dim, generator=g)
    x[:, :, [3, 17, 40]] *= 12.0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("axis", [-1, 0])  # per token (groups along head_dim) | KIVI keys (along tokens)
@pytest.mark.parametrize("seed", range(3))
def test_round_trip_is_within_the_bound(bits, axis, seed):
    x = kv_like(seed=seed)
    q = quantize(x, bits, axis=axis)
    err = (dequantize(q, torch.float32) - x.float()).abs()
    assert (err <= error_bound(q)).all()
    # and the bound itself is tight: at most about half a quantisation step per group
    levels = (1 << bits) - 1
    span = x.float().abs().max()
    assert err.max() <= span * 2 / levels


def test_q8_is_more_precise_than_q4_and_kivi_suits_keys():
    x = kv_like(seed=5).float()

    def rel(bits, axis):
        return ((dequantize(quantize(x, bits, axis=axis), torch.float32) - x).norm() / x.norm()).item()

    assert rel(8, -1) < rel(4, -1) / 8
    # outliers sit in fixed channels: grouping along tokens keeps them out of the other channels' groups
    assert rel(4, 0) < rel(4, -1)


def test_storage_size():
    x = kv_like(tokens=256)
    q4, q8 = quantize(x, 4), quantize(x, 8)
    values = x.numel()
    assert q4.nbytes() == values // 2 + values // 64 * 4  # half a byte per value + fp16 scale and bias per 64
    assert q8.nbytes() == values + values // 64 * 4
    assert q4.nbytes() / (values * 2) == pytest.approx(0.28125)


def test_ragged_groups_and_constant_groups():
    x = torch.randn(5, 3, 50)  # 50 is not a multiple of the group
    q = quantize(x, 4)
    assert dequantize(q, torch.float32).shape == x.shape
    assert ((dequantize(q, torch.float32) - x).abs() <= error_bound(q)).all()
    flat = torch.full((4, 64), 0.75)
    assert torch.equal(dequantize(quantize(flat, 4), torch.float32), flat)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_short_last_group_keeps_its_own_range(bits):
    """A session's last KIVI group holds fewer than 64 tokens; its error must be what those tokens
    alone would give (reference: the tail quantized as a group of its own length), not the error
    of a range stretched to zero by padding. Here the channel sits near 20, as outlier key
    channels do."""
    g = torch.Generator().manual_seed(7)
    x = 20.0 + torch.rand(64 + 28, 1, 4, generator=g)  # one full group, then a tail of 28 tokens
    tail = x[64:]
    got = dequantize(quantize(x, bits, axis=0), torch.float32)[64:]
    alone = dequantize(quantize(tail, bits, axis=0, group=28), torch.float32)
    assert torch.allclose(got, alone)
    step = (tail.amax(0) - tail.amin(0)) / ((1 << bits) - 1)
    assert ((got - tail).abs() <= step * 0.5 + 20.0 * 2.0**-10 + 1e-6).all()
