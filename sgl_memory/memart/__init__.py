"""KV memory for sessions (MemArt): finished turns kept as KV blocks and brought back by relevance."""

MECHANISM = "manager"  # the module that registers this package's mechanism (core/mechanism.discover imports it)
