"""One side of a READ between two processes, for tests/test_rank_agent.py.

``source MODE``: a RankAgent (source/rank_agent.py) in progress MODE over a
4 MiB buffer of known bytes; prints ``{"metadata", "base", "nbytes",
"mode"}`` as one JSON line, then, for each ``cpu`` line on stdin, this
process's CPU seconds since the agent started; exits on ``quit``.

``reader``: reads that JSON from stdin, then READs the whole buffer
``--reads`` times with a bare NIXL agent (each READ gets 10 s), checks the
bytes and prints ``{"ok", "seconds"}``.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

NBYTES = 4 << 20


def _pattern() -> np.ndarray:
    return (np.arange(NBYTES, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


def source(mode: str) -> None:
    from remote_g2.secondary_pool import MemoryRegion
    from remote_g2.source.progress_pace import ProgressPace
    from remote_g2.source.rank_agent import RankAgent
    import os

    buf = _pattern()
    pace = ProgressPace(mode=mode, ucx_tls=os.environ.get("UCX_TLS"))
    agent = RankAgent(f"progress-pair-src-{os.getpid()}", [MemoryRegion(buf.ctypes.data, buf.nbytes)],
                      busy=lambda: True, pace=pace)
    agent.start_progress()
    t0 = time.process_time()
    print(json.dumps({"metadata": agent.metadata.hex(), "base": buf.ctypes.data, "nbytes": buf.nbytes,
                      "mode": agent.progress_mode}), flush=True)
    for line in sys.stdin:
        if line.strip() == "cpu":
            print(json.dumps({"cpu_s": time.process_time() - t0}), flush=True)
        elif line.strip() == "quit":
            break
    agent.close()


def reader(reads: int) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    info = json.loads(sys.stdin.readline())
    dst = np.zeros(NBYTES, dtype=np.uint8)
    agent = nixl_agent("progress-pair-reader", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    reg = agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(bytes.fromhex(info["metadata"]))
    local = agent.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
    remote = agent.get_xfer_descs([(info["base"], info["nbytes"], 0)], "DRAM")
    t0 = time.monotonic()
    ok = True
    for _ in range(reads):
        dst[:] = 0
        handle = agent.initialize_xfer("READ", local, remote, peer)
        state = agent.transfer(handle)
        deadline = time.monotonic() + 10
        while state not in ("DONE", "ERR") and time.monotonic() < deadline:
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        ok = ok and state == "DONE" and bool(np.array_equal(dst, _pattern()))
        if not ok:
            break
    print(json.dumps({"ok": ok, "seconds": time.monotonic() - t0}), flush=True)
    agent.deregister_memory(reg)


if __name__ == "__main__":
    if sys.argv[1] == "source":
        source(sys.argv[2])
    else:
        reader(int(sys.argv[2]))
