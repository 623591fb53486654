"""SentenceKV: sentence-level KV with decode-time retrieval (see README.md)."""

MECHANISM = "manager"  # the module that registers this package's mechanism (core/mechanism.discover imports it)
