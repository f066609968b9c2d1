"""A bare NIXL source peer: one registered buffer of known bytes, for transfer-adapter tests and benchmarks.

``python tests/source_procs/nixl_source_peer.py --dir D --name NAME --nbytes N [--seed S]``

Creates a NIXL agent ``NAME`` (UCX, listen and progress threads off), fills a
numpy buffer of ``N`` bytes with :func:`pattern_bytes` ``(S, N)``, registers
it, and writes into ``D``:

* ``metadata.bin`` — the agent's metadata (raw bytes, for ``add_remote_agent``);
* ``info.json`` — ``{"name", "base", "nbytes", "seed", "pid"}``;
* ``ready`` — last, only once the above are complete (readers wait for it).

It then calls ``get_new_notifs()`` every 2 ms — with the progress thread
off, a reader's READs stall unless this side makes progress — until a file
``stop`` appears in ``D`` (or ``--max-seconds`` pass), and tears NIXL down
in the order it survives (deregister, drop the agent) before writing
``stopped``. Importing this module does not import NIXL; :class:`PeerProcess`
starts one from a test or benchmark and stops it by its PID.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["pattern_bytes", "PeerProcess"]


def pattern_bytes(seed: int, nbytes: int) -> np.ndarray:
    """The ``nbytes`` pseudo-random bytes a peer started with ``--seed seed`` holds."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class PeerProcess:
    """This script running as a child process, files in ``directory``; ready when the constructor returns.

    ``info`` is the parsed ``info.json`` and ``metadata`` the agent's metadata.
    :meth:`stop` asks it to tear down and waits (then kills); :meth:`kill`
    sends SIGKILL. Exit codes are not judged: NIXL has been seen to segfault
    at interpreter exit after the peer's work was done.
    """

    def __init__(self, directory: Path, name: str, nbytes: int, *, seed: int = 1,
                 start_timeout_s: float = 30.0) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        env = dict(os.environ)
        env.setdefault("UCX_LOG_LEVEL", "fatal")  # a killed reader or peer makes UCX print errors we expect
        self._log = open(self.dir / "peer.log", "wb")
        self.proc = subprocess.Popen([sys.executable, __file__, "--dir", str(self.dir), "--name", name,
                                      "--nbytes", str(nbytes), "--seed", str(seed)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while not (self.dir / "ready").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                rc = self.proc.poll()
                self.kill()
                raise RuntimeError(f"NIXL source peer did not become ready (rc={rc}):\n{self.log()}")
            time.sleep(0.01)
        self.info: dict[str, Any] = json.loads((self.dir / "info.json").read_text())
        self.metadata: bytes = (self.dir / "metadata.bin").read_bytes()

    def log(self) -> str:
        return (self.dir / "peer.log").read_text(errors="replace")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the peer to tear down and exit; kill it if it has not within ``timeout_s``."""
        (self.dir / "stop").touch()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the peer (if still running) and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--name", required=True)
    p.add_argument("--nbytes", required=True, type=int)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--interval-ms", type=float, default=2.0)
    p.add_argument("--max-seconds", type=float, default=600.0, help="stop by itself after this long")
    args = p.parse_args()

    from nixl._api import nixl_agent, nixl_agent_config

    from remote_g2.ucx_modules import keep_one_verbs_stack

    keep_one_verbs_stack()
    buf = pattern_bytes(args.seed, args.nbytes)
    agent = nixl_agent(args.name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                                    backends=["UCX"]))
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    _write_atomic(args.dir / "metadata.bin", agent.get_agent_metadata())
    _write_atomic(args.dir / "info.json", json.dumps({"name": args.name, "base": buf.ctypes.data,
                                                      "nbytes": buf.nbytes, "seed": args.seed,
                                                      "pid": os.getpid()}).encode())
    _write_atomic(args.dir / "ready", b"")

    stop = args.dir / "stop"
    deadline = time.monotonic() + args.max_seconds
    while not stop.exists() and time.monotonic() < deadline:
        agent.get_new_notifs()  # drives the UCX worker; no notifications are expected
        time.sleep(args.interval_ms / 1000)

    agent.deregister_memory(reg)
    del agent
    _write_atomic(args.dir / "stopped", b"")
    return 0


if __name__ == "__main__":
    sys.exit(main())
