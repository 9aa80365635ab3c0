"""Multi-instruction building blocks; each function documents the instructions it emits."""
