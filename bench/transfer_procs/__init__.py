"""Rank scripts and shared helpers of ``bench/bench_transfer.py`` (a synthetic source and target worker)."""
