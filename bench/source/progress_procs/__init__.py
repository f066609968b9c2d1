"""The processes of ``bench.source.bench_source_progress``: a source in one progress mode, and a bare NIXL reader."""
