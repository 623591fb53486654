"""Recomputation of placed memory blocks (KEEP, with CacheBlend as its baseline): see README.md."""
