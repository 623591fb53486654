"""SGLang's CPU float8_e4m3 KV pool, read by our attention backend.

SGLang 0.5.23 builds a CPU pool of `--kv-cache-dtype fp8_e4m3` (one byte a value, its per-layer
scale 1) only for its `intel_amx` attention kernels, and refuses it otherwise ("CPU FP8 KV cache
requires Intel AMX support"). `sgl_memory_cpu` reads any pool dtype: each part of a request's KV it
attends is cast to the query's dtype as it is read (engine/attention/merged.py), so no float copy of
the pool is made. When every attention backend configured is ours, the hook answers SGLang's check
for it; SGLang still builds and writes the pool. `fp8_e5m2` needs no hook (SGLang checks only e4m3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from sgl_memory.engine.attention.cpu_backend import BACKEND_NAME


def reads_cpu_fp8(configurator) -> bool:
    """A CPU float8_e4m3 pool that only our backend reads."""
    from sglang.srt.mem_cache import kv_cache_configurator as module

    return (
        module.current_platform.is_cpu()
        and configurator.kv_cache_dtype == torch.float8_e4m3fn
        and set(module.attention_backends()) == {BACKEND_NAME}
    )


@contextlib.contextmanager
def _checked_for_ours() -> Iterator[None]:
    """SGLang's check asks whether the CPU has AMX and the backends are `intel_amx`: for the
    duration of the pool's configuration both are answered yes, since our backend is the reader."""
    from sglang.srt.mem_cache import kv_cache_configurator as module

    saved = module.cpu_has_amx_support, module.attention_backends
    module.cpu_has_amx_support, module.attention_backends = (lambda: True), (lambda: ("intel_amx", "intel_amx"))
    try:
        yield
    finally:
        module.cpu_has_amx_support, module.attention_backends = saved


def configure_hook(original, configurator, *args, **kwargs):
    """AROUND hook on KVCacheConfigurator.configure (patches/hooks.yaml)."""
    if not reads_cpu_fp8(configurator):
        return original(configurator, *args, **kwargs)
    with _checked_for_ours():
        return original(configurator, *args, **kwargs)
