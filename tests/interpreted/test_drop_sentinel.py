"""Run by tests/test_kernels.py with TRITON_INTERPRET=1: the sentinel-dropping kernel, alone and
behind SGLang's own kv-index gather, against torch references."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_kernels.py"

from sgl_memory.kernels.drop_sentinel import drop_sentinel_, drop_sentinel_reference  # noqa: E402

SENTINEL = 7


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_dropping_the_sentinel_equals_reference(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 700, (5,), generator=g)
    indptr = torch.zeros(6, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    total = int(indptr[-1])
    indices = torch.randint(8, 5000, (total + 33,), generator=g, dtype=torch.int64).to(dtype)  # tail: unused space
    dead = torch.rand(total, generator=g) < 0.4
    indices[:total][dead] = SENTINEL
    want_indptr, want = drop_sentinel_reference(indptr, indices, SENTINEL)
    drop_sentinel_(indptr, indices, SENTINEL)
    assert indptr.tolist() == want_indptr.tolist()
    assert indices[: int(indptr[-1])].tolist() == want.tolist()


def test_behind_sglangs_gather_the_lists_equal_the_slot_map_without_the_sentinel():
    from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton

    g = torch.Generator().manual_seed(0)
    req_to_token = torch.randint(8, 9000, (6, 900), generator=g, dtype=torch.int32)
    req_to_token[torch.rand(6, 900, generator=g) < 0.3] = SENTINEL
    rows = torch.tensor([4, 1, 5], dtype=torch.int32)
    seq_lens = torch.tensor([900, 17, 412], dtype=torch.int32)
    indptr = torch.zeros(4, dtype=torch.int32)
    indptr[1:] = torch.cumsum(seq_lens, 0)
    out = torch.empty(int(indptr[-1]), dtype=torch.int32)
    create_flashinfer_kv_indices_triton[(3,)](req_to_token, rows, seq_lens, indptr, None, out, req_to_token.stride(0))
    drop_sentinel_(indptr, out, SENTINEL)
    for i, (row, n) in enumerate(zip(rows.tolist(), seq_lens.tolist())):
        slots = req_to_token[row, :n]
        assert out[int(indptr[i]) : int(indptr[i + 1])].tolist() == slots[slots != SENTINEL].tolist()
