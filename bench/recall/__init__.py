"""Recall of a tool output many turns back: a generated agent task family (see run.py)."""
