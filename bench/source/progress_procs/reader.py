"""The reader of ``bench/source/bench_source_progress.py``: a bare NIXL agent READing from every source at once.

    python -m bench.source.progress_procs.reader     (driven over stdin/stdout by the bench)

Reads one JSON line on stdin: ``{"sources": [{"metadata", "base", "nbytes",
"seed"}, ...], "reps", "block_kib", "timeout_s"}``. Creates a NIXL agent with
no progress thread (``check_xfer_state`` drives it), registers one
destination buffer with room for every source, loads each source's
metadata and prepares one READ per source: the whole source buffer as
descriptors of ``block_kib`` KiB, listed in a shuffled order (two neighbours
in the list are never contiguous, so nothing can coalesce them).

Then, answering on stdout with JSON lines (NIXL logs there too: the bench
reads only lines starting with ``{``):

1. a warm-up (its wire-up included), checked byte for byte → ``{"event": "ready", "setup_s", "warmup_s",
   "descriptors_per_source"}``;
2. on a ``go`` line, ``reps`` timed repetitions: every source's READ posted at once, then
   ``check_xfer_state`` on all until every one is ``DONE`` (``timeout_s`` each, else an error); the
   destination is zeroed before the last one, untimed → ``{"event": "done", "rep_s": [...]}``;
3. the last READ's bytes checked → ``{"event": "checked"}``, and exit 0.

Any failure → ``{"event": "error", "error", "wrong_bytes"}`` and exit 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

from bench.source.progress_procs.source import pattern as source_pattern


class WrongBytes(Exception):
    pass


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def block_descs(base: int, block: int, order: np.ndarray) -> list[tuple[int, int, int]]:
    """Descriptor ``k`` covers block ``order[k]`` from ``base``."""
    return [(base + int(i) * block, block, 0) for i in order]


class Reader:
    """The agent, the destination and one prepared READ per source."""

    def __init__(self, sources: list[dict[str, Any]], block_kib: int, timeout_s: float) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        from remote_g2.ucx_modules import keep_one_verbs_stack

        self.timeout_s = timeout_s
        self.sources = sources
        self.offsets = [sum(s["nbytes"] for s in sources[:i]) for i in range(len(sources))]
        self.dst = np.zeros(sum(s["nbytes"] for s in sources), dtype=np.uint8)
        keep_one_verbs_stack()  # (remote_g2.ucx_modules: a host's rdma-core would crash this process at exit)
        self.agent = nixl_agent(f"bench-progress-reader-{os.getpid()}",
                                nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                                  backends=["UCX"]))
        self.reg = self.agent.register_memory([(self.dst.ctypes.data, self.dst.nbytes, 0, "")], "DRAM")
        self.peers: list[str] = []
        self.handles: list[Any] = []
        block = block_kib << 10
        rng = np.random.default_rng(1234)
        for s, off in zip(sources, self.offsets):
            peer = self.agent.add_remote_agent(bytes.fromhex(s["metadata"]))
            self.peers.append(peer)
            order = rng.permutation(s["nbytes"] // block)
            local = self.agent.get_xfer_descs(block_descs(self.dst.ctypes.data + off, block, order),
                                              "DRAM")
            remote = self.agent.get_xfer_descs(block_descs(s["base"], block, order), "DRAM")
            self.handles.append(self.agent.initialize_xfer("READ", local, remote, peer))
        self.descriptors = len(order)
        pattern = source_pattern
        self.expected = [pattern(s["seed"], s["nbytes"]) for s in sources]

    def read_all(self) -> float:
        """Post every source's READ at once; poll until all are DONE. Returns the seconds taken."""
        t0 = time.monotonic()
        states = [self.agent.transfer(h) for h in self.handles]
        deadline = t0 + self.timeout_s
        while True:
            for i, h in enumerate(self.handles):
                if states[i] == "PROC":
                    states[i] = self.agent.check_xfer_state(h)
            if "ERR" in states:
                raise RuntimeError(f"READ from source {states.index('ERR')} failed (states {states})")
            if all(s == "DONE" for s in states):
                return time.monotonic() - t0
            if time.monotonic() > deadline:
                raise RuntimeError(f"READs not done after {self.timeout_s:g} s (states {states})")

    def check(self, what: str) -> None:
        for i, (off, want) in enumerate(zip(self.offsets, self.expected)):
            got = self.dst[off:off + want.nbytes]
            if not np.array_equal(got, want):
                bad = int(np.flatnonzero(got != want)[0])
                raise WrongBytes(f"{what}: source {i} byte {bad} is {got[bad]}, expected {want[bad]}")

    def close(self) -> None:
        for h in self.handles:
            try:
                self.agent.release_xfer_handle(h)
            except Exception:
                pass
        for peer in self.peers:
            try:
                self.agent.remove_remote_agent(peer)
            except Exception:
                pass
        self.agent.deregister_memory(self.reg)


def run(cfg: dict[str, Any]) -> None:
    t0 = time.monotonic()
    reader = Reader(cfg["sources"], cfg["block_kib"], cfg["timeout_s"])
    try:
        setup_s = time.monotonic() - t0
        warmup_s = reader.read_all()
        reader.check("warm-up")
        emit({"event": "ready", "setup_s": setup_s, "warmup_s": warmup_s,
              "descriptors_per_source": reader.descriptors})
        if sys.stdin.readline().strip() != "go":
            raise RuntimeError("expected 'go' on stdin")
        rep_s = []
        for i in range(cfg["reps"]):
            if i == cfg["reps"] - 1:
                reader.dst[:] = 0  # so that the check below sees what the last READ wrote
            rep_s.append(reader.read_all())
        emit({"event": "done", "rep_s": rep_s})
        reader.check("last READ")
        emit({"event": "checked"})
    finally:
        reader.close()


def main() -> int:
    try:
        run(json.loads(sys.stdin.readline()))
    except WrongBytes as e:
        emit({"event": "error", "error": str(e), "wrong_bytes": True})
        return 1
    except Exception as e:
        emit({"event": "error", "error": f"{type(e).__name__}: {e}", "wrong_bytes": False})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
