"""`--kv-cache-dtype int8`: a KV pool of packed int8 rows, a scale per token and head (ours).

SGLang's 8-bit pools (fp8_e4m3, fp8_e5m2) store each value unscaled, with a float8's 3 or 2 mantissa
bits. This pool stores each token's head as 8-bit codes against that head's own scale
(core/kv_rows.py: the scale sits in the row), which is the store's Q8 precision at one byte a value
and two a head. It is SGLang's MHA pool with other buffers: SGLang still allocates slots, calls
`set_kv_buffer` from the attention backend (which quantizes here) and hands the buffers to the
backend; only our CPU backend reads them (it decodes each part of a request's KV as it attends it),
so the pool is refused on any other backend and the launcher refuses it on a GPU.

The launcher takes the value (SGLang's flag has no `int8`), passes SGLang `auto` (the compute
dtype, which this pool decodes to) and announces the choice (kv_pool.announced); the hook on
SGLang's pool-class choice then builds this class.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from sgl_memory import kv_pool
from sgl_memory.core import kv_rows
from sgl_memory.engine.attention.cpu_backend import BACKEND_NAME

DTYPE_NAME = "int8"  # the launcher's --kv-cache-dtype value


class Int8KVPool(MHATokenToKVPool):
    """SGLang's MHA pool whose K and V buffers hold packed int8 rows [slots, heads, head_dim + 2]."""

    def _create_buffers(self):
        if self.kv_cache_layout != "nhd" or self.is_quantized_kv_cache or self.post_capture_active:
            raise ValueError(f"--kv-cache-dtype {DTYPE_NAME} holds one row per token slot (NHD), unquantized")
        self.store_dtype = kv_rows.PACKED
        slots = self.size + self.page_size  # SGLang's padded slot 0 page included

        def rows(dim: int) -> list[torch.Tensor]:
            width = kv_rows.row_bytes(dim, kv_rows.PACKED)
            return [torch.zeros((slots, self.head_num, width), dtype=kv_rows.PACKED) for _ in range(self.layer_num)]

        self.k_buffer, self.v_buffer = rows(self.head_dim), rows(self.v_head_dim)
        # the scales live in the rows: SGLang's scale and dequantization buffers stay absent
        self.k_scale_buffer = self.v_scale_buffer = None
        self.native_k_scale_buffer = self.native_v_scale_buffer = None
        self.dq_k_buffer = self.dq_v_buffer = None
        self._kv_buffer_descs = self._build_kv_buffer_descs()
        self._init_data_ptrs_and_strides()

    # SGLang's base views a buffer whose store dtype differs as the compute dtype; these rows are read
    # packed and decoded by the reader (core/kv_rows.py)
    def _get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id - self.start_layer]

    def _get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id - self.start_layer]

    def set_kv_buffer(
        self,
        layer,
        loc_info,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale=None,
        v_scale=None,
        layer_id_override: int | None = None,
        dcp_kv_mask=None,
    ) -> None:
        """Quantize the new tokens' K and V into their slots (each row its own scale)."""
        if k_scale is not None or v_scale is not None or dcp_kv_mask is not None:
            # a checkpoint's fp8 KV scales, or decode context parallelism: neither applies to these rows
            raise ValueError(f"--kv-cache-dtype {DTYPE_NAME} takes no KV scales and no dcp mask")
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        self.k_buffer[layer_id - self.start_layer][loc] = kv_rows.encode(cache_k)
        self.v_buffer[layer_id - self.start_layer][loc] = kv_rows.encode(cache_v)


def chosen() -> bool:
    """The launcher chose this pool for the server this process belongs to."""
    pool = kv_pool.announced()
    return pool is not None and pool.kv_cache_dtype == DTYPE_NAME


def pool_class_hook(original, configurator, *args, **kwargs) -> type:
    """AROUND hook on KVCacheConfigurator._resolve_kv_pool_class (patches/hooks.yaml): the MHA pool
    is ours when the launcher chose int8 and our backend is the only reader."""
    cls = original(configurator, *args, **kwargs)
    if kwargs.get("kind") != "mha" or not chosen():
        return cls
    from sglang.srt.mem_cache import kv_cache_configurator as module

    if set(module.attention_backends()) != {BACKEND_NAME}:
        raise ValueError(f"--kv-cache-dtype {DTYPE_NAME} is read by the {BACKEND_NAME} attention backend only")
    if cls is not MHATokenToKVPool:
        raise ValueError(f"--kv-cache-dtype {DTYPE_NAME} replaces SGLang's MHA pool, not {cls.__name__}")
    return Int8KVPool
