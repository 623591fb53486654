"""IntentKV: cross-turn intent pruning with a dead-slot layout that keeps radix reuse (see README.md here)."""
