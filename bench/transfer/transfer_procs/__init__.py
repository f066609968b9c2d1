"""Rank scripts and shared helpers of ``bench.transfer.bench_transfer`` (a synthetic source and target worker)."""
