"""Persistent per-session KV: quantization (quant.py), the file store (store.py), text-level prefix
matching (textmatch.py) and the scheduler-side tiers, capture and restore (manager.py and the
modules it wires together: see README.md's "Pieces")."""

MECHANISM = "manager"  # the module that registers this package's mechanism (core/mechanism.discover imports it)
