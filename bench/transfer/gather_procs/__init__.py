"""Rank scripts of ``bench.transfer.bench_gather`` (a source and a target worker under ``mpiexec``)."""
