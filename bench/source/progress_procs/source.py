"""One source of ``bench.source.bench_source_progress``: a RankAgent over a buffer of known bytes, in one progress mode.

    python -m bench.source.progress_procs.source MODE --mib N --seed S

A :class:`~remote_g2.source.rank_agent.RankAgent` (progress ``event`` or
``poll``; poll as while a reader on this host holds a lease, so it paces at
:meth:`ProgressPace.poll_interval_s("local")` for this ``UCX_TLS``)
over ``--mib`` MiB of :func:`pattern` bytes for ``--seed``. Prints one JSON
line ``{"metadata", "base", "nbytes", "mode", "pace", "poll_interval_s",
"pid"}`` (``poll_interval_s``: null in event mode; NIXL logs on stdout too:
the bench reads only lines starting with ``{``), then answers each ``cpu``
line on stdin with ``{"cpu_s", "t"}`` (this process's CPU seconds so far,
every thread's, NIXL's included, and ``time.monotonic()``) and exits on
``quit`` (or end of input).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """The bytes source ``seed`` holds: pseudo-random, so a block from the wrong offset or source never matches.

    ``bench/source/progress_procs/reader.py`` computes the same to check what it read.
    """
    return np.random.default_rng(0x5EED0000 + seed).integers(0, 256, nbytes, dtype=np.uint8)


def serve(mode: str, mib: int, seed: int) -> None:
    from remote_g2.memory.secondary_pool import MemoryRegion
    from remote_g2.source.config import SourceConfig
    from remote_g2.source.rank_agent import RankAgent

    buf = pattern(seed, mib << 20)
    pace = SourceConfig.from_env().with_overrides(progress=mode).progress_pace()  # REMOTE_G2_SOURCE_*_MS apply
    agent = RankAgent(f"bench-progress-src{seed}-{os.getpid()}", [MemoryRegion(buf.ctypes.data, buf.nbytes)],
                      readers=lambda: "local", pace=pace)  # the reader runs on this host
    try:
        agent.start_progress()
        print(json.dumps({"metadata": agent.metadata.hex(), "base": buf.ctypes.data, "nbytes": buf.nbytes,
                          "mode": agent.progress_mode, "pace": pace.describe(agent.progress_mode),
                          "poll_interval_s": pace.poll_interval_s("local") if agent.progress_mode == "poll" else None,
                          "pid": os.getpid()}), flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "cpu":
                print(json.dumps({"cpu_s": time.process_time(), "t": time.monotonic()}), flush=True)
            elif cmd == "quit":
                break
    finally:
        agent.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("event", "poll"))
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    args = p.parse_args()
    serve(args.mode, args.mib, args.seed)


if __name__ == "__main__":
    main()
