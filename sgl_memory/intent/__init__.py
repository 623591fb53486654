"""IntentKV: cross-turn intent pruning with a dead-slot layout that keeps radix reuse (see README.md here)."""

MECHANISM = "pruner"  # the module that registers this package's mechanism (core/mechanism.discover imports it)
