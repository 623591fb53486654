"""KV memory for sessions (MemArt): finished turns kept as KV blocks and brought back by relevance."""
