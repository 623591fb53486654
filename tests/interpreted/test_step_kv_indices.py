"""Run by tests/test_kernels.py with TRITON_INTERPRET=1: a decode step's read-mask index lists
(SentenceKV) against the torch reference."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_kernels.py"

from sgl_memory.kernels.step_kv_indices import step_kv_indices, step_kv_indices_reference  # noqa: E402

SENTINEL = 3


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_lists_are_the_read_live_slots_in_position_order(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    req_to_token = torch.randint(8, 9000, (6, 700), generator=g).to(dtype)
    req_to_token[torch.rand(6, 700, generator=g) < 0.2] = SENTINEL  # pruned positions
    rows = torch.tensor([5, 0, 2, 3], dtype=torch.int32)
    seq_lens = torch.tensor([700, 1, 300, 0], dtype=torch.int32)
    reads = torch.rand(4, 700, generator=g) < 0.3
    reads[:, 0] = True
    out = torch.full((4 * 700,), -1, dtype=dtype)
    indptr = step_kv_indices(req_to_token, rows, seq_lens, reads, SENTINEL, out)
    want_indptr, want = step_kv_indices_reference(req_to_token, rows, seq_lens, reads, SENTINEL)
    assert indptr.tolist() == want_indptr.tolist()
    assert out[: int(indptr[-1])].tolist() == want.tolist()
    assert (out[int(indptr[-1]) :] == -1).all()  # nothing written past the lists
