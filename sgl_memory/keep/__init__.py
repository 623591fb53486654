"""Recomputation of placed memory blocks (KEEP, with CacheBlend as its baseline): see README.md."""

MECHANISM = "manager"  # the module that registers this package's mechanism (core/mechanism.discover imports it)
