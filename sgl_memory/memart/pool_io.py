"""A session pool as flat tensors and back: what persistence stores of a session's memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sgl_memory.memart.blocks import Block

if TYPE_CHECKING:
    from sgl_memory.memart.pool import MemArtPool


def export(pool: MemArtPool) -> dict[str, torch.Tensor]:
    """The pool as flat tensors (its blocks concatenated, per-block and per-token metadata
    alongside), exact: a pool loaded from them retrieves, places and merges what this one would."""
    store, evictor = pool.store, pool.evictor
    with pool.lock:
        blocks = list(store.blocks.values())
        meta = torch.tensor(
            [store.turns, store.clock, store.next_id, evictor.evicted, evictor.merged], dtype=torch.int64
        )
        path = torch.tensor(pool.path, dtype=torch.int64)
        book = pool.book.export()
        if not blocks:
            return {"meta": meta, "path": path, **book}
        column = lambda name: torch.tensor([getattr(b, name) for b in blocks], dtype=torch.int64)  # noqa: E731
        return {
            "meta": meta,
            "path": path,
            "ids": column("id"),
            "used": column("used"),
            "covers": column("covers"),
            "made": torch.tensor([b.made for b in blocks], dtype=torch.float64),
            "lengths": torch.tensor([len(b.tokens) for b in blocks], dtype=torch.int64),
            "tokens": torch.tensor([t for b in blocks for t in b.tokens], dtype=torch.int64),
            "origin": torch.tensor([o for b in blocks for o in b.origin], dtype=torch.int64),
            "positions": torch.cat([b.positions for b in blocks]),
            "keys": torch.cat([b.keys for b in blocks], 1),
            "values": torch.cat([b.values for b in blocks], 1),
            **book,
        }


def load(pool: MemArtPool, tensors: dict[str, torch.Tensor]) -> None:
    """Take the state `export` gave (into an empty pool); the index is computed from the keys.
    Files of earlier formats: without per-token origins, a turn and offset per block; without
    positions, keys stored position-free in float32 (the same keys at position 0)."""
    store, evictor = pool.store, pool.evictor
    with pool.lock:
        store.turns, store.clock, store.next_id, evictor.evicted, evictor.merged = (int(x) for x in tensors["meta"])
        pool.path = tensors["path"].tolist()
        pool.book.load(tensors)
        if "ids" not in tensors:
            return
        tokens, keys, values = tensors["tokens"].tolist(), tensors["keys"], tensors["values"]
        lengths = tensors["lengths"].tolist()
        if "origin" in tensors:
            origin = [tuple(o) for o in tensors["origin"].tolist()]
        else:
            origin = [
                (turn, offset + j)
                for turn, offset, n in zip(tensors["turn"].tolist(), tensors["offset"].tolist(), lengths)
                for j in range(n)
            ]
        covers = tensors["covers"].tolist() if "covers" in tensors else lengths
        keys = keys.to(values.dtype)
        positions = (
            tensors["positions"].to(torch.int32)
            if "positions" in tensors
            else torch.zeros(len(tokens), dtype=torch.int32)
        )
        first = store.score.append(store.free_keys(keys, positions))
        start = 0
        for i, n in enumerate(lengths):
            store.add(
                Block(
                    int(tensors["ids"][i]),
                    tokens[start : start + n],
                    keys[:, start : start + n].clone(),
                    values[:, start : start + n].clone(),
                    positions[start : start + n].clone(),
                    origin[start : start + n],
                    float(tensors["made"][i]),
                    int(tensors["used"][i]),
                    covers[i],
                    first + start,
                )
            )
            start += n
        evictor.fit()
