"""The engine: the one part of sgl-memory that touches SGLang internals (see the layer table in
docs/architecture.md)."""
