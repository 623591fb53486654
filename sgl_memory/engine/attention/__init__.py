"""Attention backends of sgl-memory (registered with SGLang from the plugin)."""
