"""One block size of ``bench.transfer.bench_transfer``, run: the source and target workers, started and stopped.

:func:`run_config` starts the source worker (``mpiexec -n TP python -m bench.transfer.transfer_procs.source_rank``),
waits until the registry shows its blocks, runs the target worker (``... transfer_procs.target_rank``, which makes
every measurement), reads back what the target wrote (its result and every rank's timestamps), checks that the
source's pins went back to zero, and stops both, whatever happened (:class:`Proc`: a worker in its own session,
stopped by its process group). Under ``--netns`` each worker starts on its own host (:func:`on_host`). What it
returns is the target's raw result plus the breakdowns of ``transfer_analysis``; a failure is a
:class:`BenchError`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, child_env, kill_group
from bench.transfer.transfer_analysis import TP, breakdown, stream_busy
from remote_g2.registry import RegistryClient

PROCS = "bench.transfer.transfer_procs"
MPIEXEC = Path(sys.executable).parent / "mpiexec"


class BenchError(Exception):
    """The run cannot give a result: a worker failed, stopped answering or read a wrong byte."""


def ucx_log_level() -> str:
    """The workers' ``UCX_LOG_LEVEL``: the environment's; unset, UCX's own default (``warn``).

    The bench used to force ``fatal``, which hid the one line saying why a
    transfer failed (issue 31: UCX over TCP dialling itself). It hid no
    expected noise: at ``warn`` a whole run, on one host and across
    namespaces over TCP, logs no UCX line at all. The workers' output goes to
    their logs (shown when a run fails; ``--keep-logs`` keeps them).
    """
    return os.environ.get("UCX_LOG_LEVEL") or "warn (UCX's default)"


class Proc:
    """A child (mpiexec and its ranks) in its own session, output to ``log``; stopped by its process group.

    ``ip netns exec`` execs its command, so a child started through it is still this process group's leader.
    """

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=REPO, env=child_env(env))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc)
        if not self._log.closed:
            self._log.close()

    def tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def _wait_file(path: Path, proc: Proc, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if not proc.alive() or time.monotonic() > deadline:
            raise BenchError(f"{what} (rc={proc.proc.poll()}):\n{proc.tail()}")
        time.sleep(0.05)


def on_host(hosts: dict[str, Any] | None, name: str, cmd: list[str]) -> list[str]:
    """``cmd`` run on host ``name`` (``ip netns exec``) under ``--netns``; as is otherwise."""
    return cmd if hosts is None else hosts[name].command(cmd)


def worker_env(hosts: dict[str, Any] | None, name: str) -> dict[str, str]:
    """What a worker on host ``name`` gets on top of this process's environment (nothing on one host)."""
    if hosts is None:
        return {}
    # Else UCX copies through shared memory between namespaces of one kernel. Nothing else: the source, left at
    # its default bind, binds and advertises the address it reaches the registry from (remote_g2/rpc/net_address.py).
    return {"UCX_TLS": os.environ.get("UCX_TLS") or "tcp"}


def run_config(kib: int, args: argparse.Namespace, registry: str, tmp: Path,
               hosts: dict[str, Any] | None = None) -> dict[str, Any]:
    per_rank = (args.mib << 20) // TP
    n = per_rank // (kib * 1024)
    src_dir, tgt_dir = tmp / f"src-{kib}", tmp / f"tgt-{kib}"
    src_dir.mkdir()
    tgt_dir.mkdir()
    ipc = tempfile.mkdtemp(prefix="rg2b-")  # short: unix socket paths are limited to 107 bytes
    worker = f"bench-src-{kib}k-{os.getpid()}"
    py = sys.executable
    bind = ["-bind-to", "core"] if args.bind == "core" else []  # mpiexec (hydra) binds each rank to a core
    link0 = hosts["source"].interface_bytes() if hosts else None
    src = Proc(on_host(hosts, "source", [
        str(MPIEXEC), *bind, "-n", str(TP), py, "-m", f"{PROCS}.source_rank", "--dir", str(src_dir),
        "--worker-id", worker, "--block-kib", str(kib), "--hashes", str(n), "--layout", args.source_layout,
        "--pool-pages", args.pool_pages, "--registry", registry, "--ipc-dir", ipc,
        "--peer-transport", args.peer_transport, "--raw-progress-us", str(args.raw_progress_us)]),
        src_dir / "mpiexec.log", worker_env(hosts, "source"))
    tgt: Proc | None = None
    try:
        _wait_file(src_dir / "endpoint.json", src, 90, "the source worker did not start")
        with RegistryClient(registry) as reg:
            deadline = time.monotonic() + 30
            while (rec := reg.worker_info(worker)) is None or rec.blocks != n:
                if time.monotonic() > deadline:
                    raise BenchError(f"the registry never showed the source's {n} blocks (last: {rec})")
                time.sleep(0.05)
        result_src = json.loads((src_dir / "endpoint.json").read_text())
        tgt = Proc(on_host(hosts, "target", [
            str(MPIEXEC), *bind, "-n", str(TP), py, "-m", f"{PROCS}.target_rank", "--dir", str(tgt_dir),
            "--registry", registry, "--worker-id", f"bench-tgt-{kib}k-{os.getpid()}", "--block-kib", str(kib),
            "--hashes", str(n), "--reps", str(args.reps), "--poll-us", str(args.poll_us),
            "--ipc-dir", ipc, *(["--registry-mirror"] if args.registry_mirror else []),
            "--peer-resolve", args.peer_resolve,
            "--stream-requests", str(args.stream_requests), "--stream-depth", str(args.stream_depth),
            "--stream-rounds", str(args.stream_rounds), "--stream-poll-us", str(args.stream_poll_us),
            "--source-dir", str(src_dir), "--source-worker-id", worker,
            *(["--raw-window"] if args.raw_progress_us >= 0 else [])]),
            tgt_dir / "mpiexec.log", worker_env(hosts, "target"))
        rc = tgt.wait(args.timeout_s)
        if rc is None:
            raise BenchError(f"the target worker did not finish in {args.timeout_s} s:\n{tgt.tail()}")
        if not (tgt_dir / "result.json").exists():  # results are written before NIXL is torn down
            raise BenchError(f"the target wrote no result (rc={rc}):\n{tgt.tail()}")
        result = json.loads((tgt_dir / "result.json").read_text())
        if "error" in result:
            raise BenchError(f"{kib} KiB: {result['error']}\n{result.get('traceback', '')}\n{tgt.tail()}")
        events = []
        for r in range(TP):
            path = tgt_dir / f"events-{r}.json"
            if not path.exists():
                raise BenchError(f"target rank {r} wrote no events (rc={rc}):\n{tgt.tail()}")
            events.append(json.loads(path.read_text()))
        result["target_rc"] = rc
        result["source_endpoint"] = result_src
        if hosts:  # what the source host sent over its link: the bytes read crossed it, not shared memory
            result["source_link_sent"] = hosts["source"].interface_bytes()[1] - link0[1]
        result["loadavg_after"] = os.getloadavg()
        result["pins_after"] = _source_pins_back_to_zero(src_dir, src)
    finally:
        if tgt is not None:
            tgt.kill()
        (src_dir / "stop").touch()
        if src.wait(20) is None:
            print(f"warning: the {kib} KiB source did not stop in 20 s; killed", file=sys.stderr)
        src.kill()
        shutil.rmtree(ipc, ignore_errors=True)
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for side, d in (("source", src_dir), ("target", tgt_dir)):
                if (d / "mpiexec.log").exists():
                    shutil.copy(d / "mpiexec.log", args.keep_logs / f"{kib}k-{side}.log")
    if args.events_json:  # every timestamp, absolute (CLOCK_MONOTONIC): to line up with `perf sched -k CLOCK_MONOTONIC`
        path = args.events_json.with_name(f"{args.events_json.stem}-{kib}k{args.events_json.suffix}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"block_kib": kib, "requests": result, "events": events}))
    if result.get("stream"):
        result["stream"]["busy"] = stream_busy(result["stream"], events)
    result["breakdown"], result["breakdown_rows"] = {}, {}
    for kind in ("full", "one"):
        result["breakdown"][kind], result["breakdown_rows"][kind] = breakdown(result[kind], events)
    result["breakdown"]["first_contact"], _ = breakdown({"e2e": [result["first_contact"]]}, events)
    return result


def _source_pins_back_to_zero(src_dir: Path, src: Proc) -> list[int]:
    """Every source rank's pin count, once a state written after now shows zero (10 s at most)."""
    t_call = time.time()
    deadline = time.monotonic() + 10
    pins: list[int] = [-1] * TP
    while time.monotonic() < deadline:
        for r in range(TP):
            try:
                st = json.loads((src_dir / f"state-{r}.json").read_text())
            except (OSError, ValueError):
                continue
            if st["t"] >= t_call:
                pins[r] = st["total_pins"]
        if all(p == 0 for p in pins):
            return pins
        time.sleep(0.05)
    raise BenchError(f"source pins did not return to zero: {pins}\n{src.tail()}")
