"""Transfer benchmarks: a remote fetch against raw NIXL (``transfer_procs/``), gathered reads (``gather_procs/``),
and the reference engine's time to first token."""
