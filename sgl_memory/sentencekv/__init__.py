"""SentenceKV: sentence-level KV with decode-time retrieval (see README.md)."""
