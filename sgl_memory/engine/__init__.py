"""The engine: the one part of sgl-memory that touches SGLang internals (see the README's layer table)."""
