"""Decision-point fidelity of every method against the full cache (see run.py)."""
