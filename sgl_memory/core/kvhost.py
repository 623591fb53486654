"""The radix tree as a mechanism sees it: the KV host protocol.

A mechanism gets the tree in `Mechanism.build` and reaches the KV cache only through what is listed
here (the engine's `TreeHost`, engine/tree_host.py, implements it over the radix tree and is what a
mechanism is handed as `tree`; tree_fill.py builds placement and copying on top of it). Keys, match
results and tree nodes are the engine's: a mechanism passes them back, it never looks inside. The
KV pool is SGLang's, read through its buffer accessors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sgl_memory.core.requests import RequestStore
from sgl_memory.core.sessions import SessionKey, SessionRegistry

if TYPE_CHECKING:
    from sgl_memory.core.mechanism import Mechanism
    from sgl_memory.core.reuse import ReusedKV
    from sgl_memory.core.views import RequestView

Branches = tuple[tuple[int, int], ...]  # (position, key id), ascending positions; () for a plain path
# KVHost.reduce_heads: (a per-rank aggregate over heads, "mean" or "sum") -> the one over every rank's heads
Reduce = Callable[[torch.Tensor, str], torch.Tensor]


def one_rank(x: torch.Tensor, op: str) -> torch.Tensor:
    """reduce_heads without tensor parallelism (and where no tree is at hand: unit tests, tools)."""
    return x


def namespace(extra_key: str | None, kind: str, *names: str) -> str:
    """A request's extra key with one more namespace: `\x00kind[:name:...]`. Paths are matched only
    under the same extra key (SGLang keeps LoRA adapters apart with it), so a tenant, a memory
    assembly or a server's own pass gets KV of its own. The engine escapes a client's own extra key
    first (engine/admission.py), so no client value spells one of these."""
    return f"{extra_key or ''}\x00{kind}" + "".join(f":{n}" for n in names)


# The engine's handles, which a mechanism passes back and never looks inside: a path's key in the
# tree (`key`), and a node of the tree (where a match ends).
TreeKey = Any
Node = Any


class Match(Protocol):
    """What a mechanism reads of a tree match: how many of the key's first tokens the tree holds,
    and the node where they end."""

    device_prefix_len: int  # how many of the key's first tokens the tree holds
    last_device_node: Node  # where they end (a handle for `path_slots`, `inc_lock_ref`)


class KVPool(Protocol):
    """What a mechanism reads of SGLang's KV pool: its number of layers and each layer's key and
    value buffers. A buffer's rows are in the pool's format (kv_rows.py: values of its dtype, or
    packed int8 rows); what computes with them converts them there, what writes them too."""

    layer_num: int
    dtype: torch.dtype  # the values' dtype (a packed pool's compute dtype, which it decodes to)

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        """[slots, kv heads, head dim] of one layer (post-RoPE keys; head dim + 2 bytes when packed)."""

    def get_value_buffer(self, layer: int) -> torch.Tensor: ...


class KVHost(Protocol):
    """What a mechanism may ask of the tree (implemented by the engine's TreeHost)."""

    # read-only: the tree's, read through (the sentinel is taken again after flush_cache)

    @property
    def sessions(self) -> SessionRegistry:
        """Every mechanism's per-session state, one each."""

    @property
    def requests(self) -> RequestStore:
        """Every mechanism's per-request state (requests.py), ended by the composition."""

    @property
    def disable(self) -> bool:
        """The server runs without a radix cache: nothing is ever held."""

    @property
    def page_size(self) -> int: ...

    @property
    def tp_size(self) -> int:
        """The tensor-parallel group's size (1: none); a rank's pool holds its share of the KV heads."""

    @property
    def sentinel(self) -> int | None:
        """The slot pruned positions point at (None: no pruning runs here)."""

    @property
    def pool(self) -> KVPool:
        """The KV pool (this rank's layers: `layers()`)."""

    def layers(self) -> range:
        """The pool's layer ids on this rank."""

    def reduce_heads(self, x: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """`x`, an aggregate over this rank's attention heads (a mean or a sum per position),
        combined over the tensor-parallel group, so that every rank holds what all the heads give
        and chooses the same positions: `mean` averages over the ranks (each holds an equal share of
        the heads, or the same replicated KV head), `sum` adds. `x` itself without tensor
        parallelism. A collective: every rank calls it at the same point of the same request."""

    def rank_range(self, values: Sequence[int]) -> tuple[list[int], list[int]]:
        """The least and the greatest of each of `values` over the tensor-parallel group's ranks:
        how a mechanism whose decision rests on a rank's own files or threads (a session file read,
        a write in flight) makes every rank take the same one (equal ranges: the ranks agree; the
        least of a count: what every rank can do). `(values, values)` without tensor parallelism.
        A collective: every rank calls it at the same point of the same request."""

    def row(self, req: RequestView) -> torch.Tensor:
        """The request's slot map row: position -> KV slot."""

    def slot_map(self) -> torch.Tensor:
        """Every request row's slot map [rows, context] (a forward's rows name their row index)."""

    def key(
        self, tokens: Sequence[int], extra_key: str | None, cache_salt: str | None = None, branches: Branches = ()
    ) -> TreeKey:
        """The tree key of a path: its tokens under a namespace, branch ids at its branches."""

    def match(self, key: TreeKey) -> Match:
        """What the tree holds of `key` (it may split a node, as every match does)."""

    def insert_path(self, key: TreeKey, slots: torch.Tensor) -> int:
        """Insert `key` with these slots [len(key)]; returns how much of it the tree held already."""

    def path_slots(self, node: Node) -> torch.Tensor:
        """The slots of the path from the root to `node`."""

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        """n fresh slots, evicting unlocked paths for them; None when not enough can be freed."""

    def free_real(self, slots: torch.Tensor) -> None:
        """Give back slots that hold no sentinel entry."""

    def inc_lock_ref(self, node: Node) -> Any:
        """Keep the path to `node` from eviction until `dec_lock_ref`."""

    def dec_lock_ref(self, node: Node) -> Any: ...

    def hold(self, req: RequestView, node: Node, tokens: int) -> None:
        """Keep the path to `node` (`tokens` long) in the tree for a waiting request until its prefill
        is scheduled (the scheduler locks its prefix then), it is dropped, or nothing can run
        while requests wait (then every hold goes). KV brought back for a request must still be
        there when it runs; the caller bounds what it holds (`held_tokens`, `pool_tokens`)."""

    def held_tokens(self) -> int:
        """Tokens held for waiting requests now (each hold counts its whole path)."""

    @property
    def pool_tokens(self) -> int:
        """The KV pool's size in tokens."""

    def room(self) -> int:
        """Slots a mechanism may take now: the free ones and those eviction can free, less those the
        engine's scheduler counts on for the work it has taken in (a chunked prefill's rest, the
        running requests' decode)."""

    def evicted_within(self, seconds: float) -> bool:
        """Whether the tree evicted KV to make room in the last `seconds`: the pool is under
        pressure, not holding what it was asked to keep. The same answer on every tensor-parallel
        rank (a collective there: every rank asks at the same point of the same request)."""

    def expect(self, node: Node, when: Callable[[float], float]) -> None:
        """The path ending at `node` is next used at `when(now)` (time.monotonic seconds; inf: not
        again): under pool pressure the tree evicts the paths used furthest ahead first, the nodes
        of this path that no other path shares included, and the rest by last use. Ignored when the
        operator chose an eviction policy other than SGLang's default LRU."""

    def branches(self, req: RequestView) -> Branches:
        """Where the request's key takes branch ids instead of its tokens."""

    def export_session(
        self, key: SessionKey, skip: Mechanism | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Every mechanism's state of the session (but `skip`'s): tensors and which of them are KV."""

    def import_session(self, key: SessionKey, tensors: dict[str, torch.Tensor]) -> None: ...

    def position_shift(self, rid: str) -> int:
        """How far the request's model positions run from SGLang's (Mechanism.position_shift of the
        mechanism that re-packed its row; 0: none)."""

    def placed_kv(self, req: RequestView) -> ReusedKV | None:
        """The KV a mechanism placed among the request's new tokens for a repair (reuse.ReusedKV,
        Mechanism.placed_kv), or None."""
