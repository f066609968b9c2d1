"""Process entry points and shared helpers for tests/test_source*.py and bench/source/bench_source.py."""
