"""The servers the benchmarks run against: a private ``redis-server`` and ``remote-g2 serve``, and HTTP ones.

Shared by ``bench_registry.py``, ``bench_registry_soak.py``,
``bench_peers.py`` and ``bench_routing.py`` (and ``tests/test_vllm_router.py``,
which starts the same ``vllm serve`` and router processes). Every server
binds 127.0.0.1 on a free port, starts in bounded time or raises, and is
stopped by its PID with :func:`stop` (or, with the processes it started, by
its process group with :func:`stop_group`).
"""

from __future__ import annotations

import json
import os
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["free_port", "start_redis", "start_registry", "stop", "stop_group", "wait_http", "post_json"]


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


def stop(proc: subprocess.Popen[Any]) -> None:
    """Stop one process we started, by its PID: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def stop_group(proc: subprocess.Popen[Any], timeout_s: float = 30) -> None:
    """Stop a process started with ``start_new_session=True`` and every process it started (``vllm serve``'s
    engine core, for one): SIGTERM to its group, then SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


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
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read()), dict(r.headers)
