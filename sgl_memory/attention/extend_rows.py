"""Where each request's rows sit in an extend (prefill) forward batch.

The batch packs the new tokens of its requests one after another: request i's query, key and value
rows start where request i-1's end, and its first new token sits at position prefix_len (what the
radix tree already held). Query capture (intent pruning) and the probe capture (KV memory) both
read their requests' rows this way.
"""

from __future__ import annotations

from typing import NamedTuple


class ExtendRows(NamedTuple):
    rid: str
    start: int  # first row of the request in the batch's q / k / v
    prefix: int  # position of that row
    count: int


def extend_rows(forward_batch) -> list[ExtendRows]:
    prefix_lens = forward_batch.extend_prefix_lens_cpu or forward_batch.extend_prefix_lens.tolist()
    new_lens = forward_batch.extend_seq_lens_cpu or forward_batch.extend_seq_lens.tolist()
    rows, start = [], 0
    for rid, prefix, n in zip(forward_batch.rids, prefix_lens, new_lens):
        rows.append(ExtendRows(rid, start, prefix, n))
        start += n
    return rows
