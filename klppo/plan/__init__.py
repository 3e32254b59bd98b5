"""``klppo plan``: what a config will do, worked out before any weight loads (batches, memory)."""
