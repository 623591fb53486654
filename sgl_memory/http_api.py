"""sgl-memory's own HTTP routes, mounted on SGLang's FastAPI app (hook: patches/hooks.yaml)."""

from __future__ import annotations

import dataclasses

from sgl_memory import SGLANG_VERSION, __version__
from sgl_memory.config import from_env


def mount(server_args, *args, **kwargs):
    """BEFORE hook on `http_server.launch_server`: add the routes once, then let it start."""
    from sglang.srt.entrypoints.http_server import app

    if any(getattr(r, "path", None) == "/sgl_memory/info" for r in app.routes):
        return None
    config = from_env()

    @app.get("/sgl_memory/info")
    async def sgl_memory_info():
        return {
            "version": __version__,
            "sglang_version": SGLANG_VERSION,
            "radix_cache_backend": server_args.radix_cache_backend,
            "attention_backend": server_args.attention_backend,
            "config": dataclasses.asdict(config),
        }

    return None
