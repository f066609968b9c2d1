"""Start reference engine workers under ``mpiexec`` and talk to them: :class:`EngineProcess`, :class:`EngineClient`.

Used by ``remote-g2 demo``, the end-to-end tests and ``bench/bench_e2e.py``.
Each worker runs in its own session (mpiexec and its ranks share one process
group), is asked to shut down over its API, and is killed by its process
group only if it does not exit in time. Every wait is bounded. A worker can
run inside a network namespace (``netns``: a "host" of
:mod:`remote_g2.adapters.reference.netns`); its API is then a Unix socket, which the caller
reaches from any namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from remote_g2.errors import RemoteG2Error
from remote_g2.adapters.reference.netns import Host
from remote_g2.rpc.client import RpcClient

from .messages import (
    CacheMode,
    EngineEvict,
    EngineResult,
    EngineResults,
    EngineShutdown,
    EngineStats,
    EngineStatsReply,
    EngineSubmit,
)

__all__ = ["sweep_stale_mpi_shm", "EngineClient", "EngineProcess", "mpiexec_path", "signal_group", "stop_group"]


def mpiexec_path() -> str:
    """The venv's ``mpiexec`` (the ``mpich`` wheel), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def sweep_stale_mpi_shm(min_age_s: float = 60.0, directory: str = "/dev/shm",
                        prefix: str = "mpich_shm_") -> list[str]:
    """Remove MPICH's shared-memory segments no live process maps, older than ``min_age_s``; their names.

    MPICH's ranks unlink them on a clean exit; a rank killed by SIGKILL (a
    test's crash, a timed-out stop) leaves its segments in ``/dev/shm``, a
    RAM-backed filesystem, for good. A segment still mapped by any process
    (read from ``/proc/*/maps``), or younger than ``min_age_s`` (a worker
    still starting may not have mapped it yet), is kept.
    """
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return []
    now = time.time()
    old = set()
    for n in names:
        try:
            if now - os.stat(os.path.join(directory, n)).st_mtime >= min_age_s:
                old.add(n)
        except OSError:
            continue
    if not old:
        return []
    mapped: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if directory in text:
            mapped.update(n for n in old if f"{directory}/{n}" in text)
    removed = []
    for n in sorted(old - mapped):
        try:
            os.unlink(os.path.join(directory, n))
            removed.append(n)
        except OSError:
            pass
    return removed


def signal_group(proc: subprocess.Popen[Any], sig: int) -> bool:
    """``sig`` to the process group of ``proc`` (started in its own session); False when the group is gone.

    The demo's and the reference engine's one copy of ``bench.common``'s group stop: the installed package cannot
    import ``bench/``."""
    try:
        os.killpg(proc.pid, sig)
        return True
    except ProcessLookupError:
        return False


def stop_group(proc: subprocess.Popen[Any], timeout_s: float = 10.0, kill_wait_s: float = 5.0) -> None:
    """SIGTERM to the process group of ``proc`` if it still runs, SIGKILL after ``timeout_s``; reaps ``proc``."""
    if proc.poll() is not None:
        return
    if signal_group(proc, signal.SIGTERM):
        try:
            proc.wait(timeout_s)
            return
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
    proc.wait(kill_wait_s)


class EngineClient:
    """A client of one engine's API (rank 0)."""

    def __init__(self, endpoint: str, *, timeout_s: float = 10.0) -> None:
        self.rpc = RpcClient(endpoint, timeout_ms=timeout_s * 1000)

    def submit(self, request_id: str, prompt: list[int], max_new_tokens: int, *, cache: CacheMode = "all",
               pause_after_lookup_ms: int = 0) -> None:
        self.rpc.call(EngineSubmit(request_id, list(prompt), max_new_tokens, cache, pause_after_lookup_ms))

    def wait(self, request_ids: list[str], *, timeout_s: float = 60.0,
             poll_s: float = 0.005) -> dict[str, EngineResult]:
        """Block until every request finished (``TimeoutError`` naming the missing ones)."""
        want, got = set(request_ids), {}
        deadline = time.monotonic() + timeout_s
        while want - got.keys():
            for r in self.rpc.call(EngineResults(sorted(want - got.keys()))).results:
                got[r.request_id] = r
            if want - got.keys():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"requests {sorted(want - got.keys())} not finished within {timeout_s} s")
                time.sleep(poll_s)
        return got

    def generate(self, request_id: str, prompt: list[int], max_new_tokens: int, *, cache: CacheMode = "all",
                 timeout_s: float = 60.0) -> EngineResult:
        self.submit(request_id, prompt, max_new_tokens, cache=cache)
        return self.wait([request_id], timeout_s=timeout_s)[request_id]

    def paused(self) -> list[str]:
        """Requests held between their remote lookup and their load (the ``pause_after_lookup_ms`` knob)."""
        return list(self.stats().paused)

    def stats(self) -> EngineStatsReply:
        return self.rpc.call(EngineStats())

    def evict(self, hashes: list[bytes]) -> int:
        return int(self.rpc.call(EngineEvict(list(hashes))).removed)

    def shutdown(self) -> None:
        self.rpc.call(EngineShutdown())

    def close(self) -> None:
        self.rpc.close()


class EngineProcess:
    """``mpiexec -n tp`` reference engine worker ``worker_id``; ``args`` go to the server module.

    Ready when rank 0 wrote its ready file (``start_timeout_s``); ``client``
    talks to it; :meth:`stop` shuts it down (API, then SIGTERM, then SIGKILL
    of its process group) and returns mpiexec's exit code. Its temporary
    directory (ready file, IPC sockets, and the log unless ``log_dir`` is
    given) is removed once the processes are gone; :meth:`log_tail` still
    answers from the log's last megabyte, kept in memory.

    ``netns`` (a :class:`remote_g2.adapters.reference.netns.Host`, or a namespace's name) runs
    the worker inside that network namespace (``ip netns exec NS mpiexec
    ...``: the same PID and process group, so stopping still signals only
    this worker's group). Its API then binds ``ipc://`` in the temporary
    directory (unless ``args`` give ``--bind``): TCP into the namespace is
    not routable from the caller's, a Unix socket is.

    UCX logs at ``UCX_LOG_LEVEL`` from ``env`` or the environment, ``error``
    when neither sets it: a failed NIXL load leaves UCX's reason in the log.
    """

    def __init__(self, worker_id: str, *, tp: int = 1, args: list[str] | None = None, log_dir: str | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 90.0,
                 netns: Host | str | None = None) -> None:
        self.worker_id, self.tp = worker_id, tp
        self.netns: str | None = netns.netns if isinstance(netns, Host) else netns
        self._tmp = tempfile.mkdtemp(prefix="rg2e-")  # short: IPC socket paths live here
        self._kept_log: bytes | None = None  # the log's end, once the temporary directory (holding it) is gone
        self._tmp_removed = False
        self.log_path = Path(log_dir or self._tmp) / f"engine-{worker_id}.log"
        ready = Path(self._tmp) / "ready.json"
        args = list(args or [])
        if self.netns is not None and "--bind" not in args:
            args += ["--bind", f"ipc://{os.path.join(self._tmp, 'api.sock')}"]
        cmd = [mpiexec_path(), "-n", str(tp), sys.executable, "-m", "remote_g2.adapters.reference.server",
               "--worker-id", worker_id, "--ready-file", str(ready), "--ipc-dir", os.path.join(self._tmp, "ipc"),
               *args]
        if self.netns is not None:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        full_env = {**os.environ, "REMOTE_G2_LOG_LEVEL": "WARNING", **(env or {})}
        full_env.setdefault("UCX_LOG_LEVEL", "error")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=full_env)
        deadline = time.monotonic() + start_timeout_s
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                rc = self.proc.poll()
                self.kill()
                self._log.close()
                raise RuntimeError(f"engine {worker_id} (TP={tp}) did not start (rc={rc}):\n{self.log_tail()}")
            time.sleep(0.02)
        self.info: dict[str, Any] = json.loads(ready.read_text())
        self.endpoint: str = self.info["endpoint"]
        self.client = EngineClient(self.endpoint)

    def log_tail(self, n: int = 4000) -> str:
        if self._kept_log is not None:
            return self._kept_log[-n:].decode(errors="replace")
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> int:
        """Shut down cleanly if possible; kill the process group otherwise. Returns the exit code."""
        if self.proc.poll() is None:
            try:
                self.client.shutdown()
            except RemoteG2Error:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGTERM)
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.kill()
        self.client.close()
        self._log.close()
        self._remove_tmp()
        return int(self.proc.returncode if self.proc.returncode is not None else -9)

    def leftover(self) -> bool:
        """Whether any process of this worker (mpiexec or a rank: its process group) is still alive."""
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        """Remove the temporary directory once no process of this worker is left (keeping the log's end)."""
        if self._tmp_removed or self.leftover():
            return
        if self.log_path.parent == Path(self._tmp):
            try:
                with open(self.log_path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(0, f.tell() - (1 << 20)))
                    self._kept_log = f.read()
            except OSError:
                self._kept_log = b""
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp_removed = True
        sweep_stale_mpi_shm()  # a killed rank cannot unlink its MPICH segments: they would pile up in RAM

    def _signal(self, sig: int) -> None:
        signal_group(self.proc, sig)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
