"""Model identity benchmarks: digesting a checkpoint's weights."""
