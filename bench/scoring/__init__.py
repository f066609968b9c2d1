"""Scoring API benchmarks: latency and scores per server CPU through a real server."""
