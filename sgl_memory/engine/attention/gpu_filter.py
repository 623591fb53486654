"""The sentinel filter for SGLang's GPU attention backends (Triton, FlashInfer).

Both build their per-forward KV index lists through `KVIndexTranslator.pack_read_stream`, which
gathers each request's slot-map row into `out` at offsets `indptr`. With intent pruning on, those
rows hold the sentinel slot at pruned positions; this AFTER hook drops the sentinel from the lists in place
(sgl_memory.kernels.drop_sentinel), so the unmodified GPU kernels read only kept entries.
Translated ids (a unified pool's page ids) are not slot ids and are left alone.
"""

from __future__ import annotations

from sgl_memory.engine import runtime
from sgl_memory.kernels.drop_sentinel import drop_sentinel_


def after_pack_read_stream(translated, translator, plan, *, indptr, out, **kwargs):
    sentinel = runtime.sentinel()
    if sentinel is not None and not translated:
        drop_sentinel_(indptr, out, sentinel)
    return None
