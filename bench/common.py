"""What every benchmark shares: the result envelope and its writer, percentiles, CPU time, processes and servers.

* **Results.** :func:`envelope` wraps a bench's fields in where and when it
  ran (``benchmark``, ``cpus``, ``host``, ``date``, ``commit``; the bench's
  own fields win on a clash); :func:`write_result` writes that as JSON and
  says so; :func:`write_json` writes any document whole (a reader never sees
  half a file).
* **Percentiles.** :func:`pct` is the one definition (the sample at rank
  ``int(q/100 * n)``, NaN for no sample); :func:`percentiles` summarises
  latencies as ``p50_<unit>``, ``p99_<unit>``, ``mean_<unit>`` and ``n``.
* **CPU time** from ``/proc``: :func:`proc_cpu_s` of one process,
  :func:`thread_cpu_s` of each thread of this one.
* **Processes.** Benches run as modules from the repository root
  (``python -m bench.<group>.<bench>``); a child that imports ``bench.*``
  gets the root through :func:`module_cmd` and :func:`child_env`.
  :func:`stop` ends one process by its PID; :func:`stop_group` and
  :func:`kill_group` end a process started with ``start_new_session=True``
  and everything it started, by its process group.
* **Servers** the benches run against: a private ``redis-server``
  (:func:`start_redis`), ``remote-g2 serve`` (:func:`start_registry`), and
  HTTP ones (:func:`wait_http`, :func:`post_json`). Each binds 127.0.0.1 on a
  :func:`free_port` and starts in bounded time or raises.

Imports nothing of the project, so any bench, a bench's child and the tests
(``from bench.common import ...``) can use it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["REPO", "envelope", "write_result", "write_json", "pct", "percentiles", "proc_cpu_s", "thread_cpu_s",
           "module_cmd", "child_env", "stop", "signal_group", "stop_group", "kill_group", "free_port", "start_redis",
           "start_registry", "wait_http", "post_json"]

#: The checkout the benches belong to (what ``python -m bench...`` runs from).
REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------- results


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def envelope(benchmark: str, /, **fields: Any) -> dict[str, Any]:
    """``fields`` with where and when the bench ran: its name, the CPUs, the host, the date and the commit."""
    return {"benchmark": benchmark, "cpus": os.cpu_count(), "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
            "commit": _commit(), **fields}


def write_json(path: str | os.PathLike[str], doc: Any, indent: int | None = 2) -> None:
    """``doc`` as JSON at ``path`` (its folder made), written beside and renamed: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=indent, default=str) + "\n")
    tmp.replace(path)


def write_result(path: str | os.PathLike[str], benchmark: str, /, **fields: Any) -> dict[str, Any]:
    """The :func:`envelope` of ``fields`` written to ``path``, and a line saying so; returns what was written."""
    doc = envelope(benchmark, **fields)
    write_json(path, doc)
    print(f"wrote {path}")
    return doc


# ----------------------------------------------------------------------------------------- percentiles


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``xs``: the sample at rank ``int(q/100 * n)`` of the sorted ``n`` (the upper
    median for ``q`` 50), NaN for no sample."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def percentiles(samples: Sequence[float], unit: str = "ms") -> dict[str, float]:
    """p50, p99 and mean of latencies in seconds, as ``p50_<unit>`` etc. (``ms`` or ``us``); zeros when empty."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    if not samples:
        return {f"p50_{unit}": 0.0, f"p99_{unit}": 0.0, f"mean_{unit}": 0.0, "n": 0}
    return {f"p50_{unit}": pct(samples, 50) * scale, f"p99_{unit}": pct(samples, 99) * scale,
            f"mean_{unit}": sum(samples) / len(samples) * scale, "n": len(samples)}


# ----------------------------------------------------------------------------------------- CPU time


def _stat_cpu_s(stat: str) -> float:
    """User + system seconds from the text of a ``/proc/.../stat`` (fields after the command's closing paren)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (0 once it is gone)."""
    try:
        return _stat_cpu_s(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return 0.0


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process so far, by name: a Python thread's own name,
    else the kernel's (``ZMQbg/IO/0``, OpenMP's and UCX's threads), with a ``#tid`` to keep threads apart."""
    named = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # (a thread that ended meanwhile)
        comm = stat.split(" (", 1)[1].rsplit(") ", 1)[0]
        tid = int(task.name)
        out[f"{named.get(tid, comm)}#{tid}"] = _stat_cpu_s(stat)
    return out


# ----------------------------------------------------------------------------------------- processes


def module_cmd(module: str, *args: str, python: str | os.PathLike[str] | None = None) -> list[str]:
    """The command that runs ``module`` (``bench.x.y``) with ``python`` (this one by default); run it with
    :func:`child_env` (or cwd :data:`REPO`) so that ``bench`` is importable."""
    return [str(python or sys.executable), "-m", module, *args]


def child_env(extra: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (this environment by default) with :data:`REPO` first on ``PYTHONPATH``, then ``extra``: a child,
    wherever its cwd and however it starts (``mpiexec``, ``ip netns exec``), imports ``bench.*`` from this tree."""
    env = dict(os.environ if base is None else base)
    path = [str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]]
    return {**env, "PYTHONPATH": os.pathsep.join(path), **(extra or {})}


def stop(proc: subprocess.Popen[Any]) -> None:
    """Stop one process we started, by its PID: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def signal_group(proc: subprocess.Popen[Any], sig: int) -> bool:
    """``sig`` to ``proc``'s process group; False when the group is gone."""
    try:
        os.killpg(proc.pid, sig)
        return True
    except ProcessLookupError:
        return False


def kill_group(proc: subprocess.Popen[Any], wait_s: float = 10) -> None:
    """SIGKILL to the process group of ``proc`` (started with ``start_new_session=True``), even when ``proc``
    itself has ended (what it started may not have), then reap ``proc``."""
    signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        pass


def stop_group(proc: subprocess.Popen[Any], timeout_s: float = 30) -> None:
    """Stop a process started with ``start_new_session=True`` and every process it started (``vllm serve``'s
    engine core, ``mpiexec``'s ranks): SIGTERM to its group, then :func:`kill_group` after ``timeout_s``."""
    if proc.poll() is None and signal_group(proc, signal.SIGTERM):
        try:
            proc.wait(timeout_s)
            return
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        kill_group(proc)


# ----------------------------------------------------------------------------------------- servers


def free_port() -> int:
    """A free loopback port below Linux's ephemeral range, so no outgoing connection takes it first."""
    for _ in range(200):
        port = random.randint(10000, 22000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found")


def start_redis(workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    """A private, non-persistent ``redis-server`` in ``workdir``; returns it and its URL once it answers."""
    import redis  # a registry-benchmark dependency, not needed to import this module

    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server not found (`make redis` installs it)")
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        for _ in range(200):
            try:
                client.ping()
                return proc, url
            except redis.ConnectionError:
                time.sleep(0.05)
    finally:
        client.close()
    stop(proc)
    raise SystemExit("redis-server did not start")


def start_registry(*store_args: str, workers: int = 1, log_path: str | None = None,
                   lease_ttl_s: float | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """``remote-g2 serve`` on a free port: the embedded store, or ``--redis-url U`` / ``--redis-cluster-url U``.

    Returns once it prints that it serves (at most 30 s); its stderr goes to
    ``log_path`` when given. ``lease_ttl_s``: the workers' lease (the server's
    default when None).
    """
    port = free_port()
    exe = Path(sys.executable).parent / "remote-g2"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "remote_g2.cli"]
    cmd += ["serve", "--bind", f"tcp://127.0.0.1:{port}", *store_args, "--workers", str(workers)]
    if lease_ttl_s is not None:
        cmd += ["--lease-ttl-s", str(lease_ttl_s)]
    err: Any = open(log_path, "ab") if log_path else None
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,
                                env={**os.environ, "REMOTE_G2_LOG_LEVEL": "WARNING"})
    finally:
        if err is not None:
            err.close()
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    ready = sel.select(30)
    sel.close()
    line = proc.stdout.readline().decode() if ready else ""
    if "serving on" not in line:
        stop(proc)
        raise RuntimeError(f"registry did not start: {line!r}" + (f"; see {log_path}" if log_path else ""))
    return proc, f"tcp://127.0.0.1:{port}"


def _tail(log: Path) -> str:
    return log.read_bytes()[-4000:].decode(errors="replace") if log.exists() else ""


def wait_http(url: str, proc: subprocess.Popen[Any], log: Path, timeout_s: float = 300) -> None:
    """Wait until ``url`` answers 200; RuntimeError, with the end of ``log``, if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited rc={proc.returncode}\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} never answered\n{_tail(log)}")


def post_json(url: str, body: dict[str, Any], timeout_s: float = 300, headers: dict[str, str] | None = None
              ) -> tuple[dict[str, Any], dict[str, str]]:
    """POST ``body`` as JSON, with ``headers`` too; the JSON answer and the answer's headers (an HTTP error raises)."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read()), dict(r.headers)
