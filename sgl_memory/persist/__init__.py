"""Persistent per-session KV (issue 5, in progress): quantization of KV blocks for the session store."""
