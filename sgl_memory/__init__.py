"""sgl-memory: KV-cache-centric memory for LLM agents, inside SGLang's radix cache.

Kept import-light on purpose: `cpu_compat` runs from a .pth at every interpreter start-up.
"""

__version__ = "0.1.0"
SGLANG_VERSION = "0.5.23"
