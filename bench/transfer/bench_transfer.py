"""End-to-end remote fetch vs a raw NIXL READ of the same descriptors vs memcpy, TP=2 -> 2 (issue 5, "Measured").

Everything real, on this machine: a registry (memory store) in this process
(``--registry-bind``, default ``tcp://127.0.0.1:0``);
a source worker ``mpiexec -n 2 bench/transfer/transfer_procs/source_rank.py`` whose
ranks each hold a HostPool of ``--mib / 2`` MiB in blocks of ``B`` KiB (known
bytes; stored in a random order, so each block is one READ descriptor; with
``--source-layout contiguous`` everything coalesces to one per rank), and
a target worker ``mpiexec -n 2 bench/transfer/transfer_procs/target_rank.py`` with the
real target client (NIXL over UCX; on one host UCX copies with ``cma``).

Per block size, target rank 0 times R requests end to end — ``lookup`` (registry
RPC) -> ``start_load`` (resolve RPC to the source, IPC fan-out to rank 1, each
rank plans and issues its own READ) -> ``get_finished`` once the client's
``wait_finished`` says an outcome is posted (``--poll-us N``: poll every N µs
instead; a polling thread takes the CPUs the same-host READs copy with) —
every request moving ``--mib`` MiB into the same destination blocks, the
lease released without waiting. The ranks run wherever the kernel puts
them; ``--bind core`` has ``mpiexec`` bind each rank to a core, as engines
deploy TP ranks (the kernel then cannot queue one rank's thread behind the
other's copy: see "late starts" in the output and ``docs/target.md``).
Interleaved with them (order alternating each round, so noise hits all):

* ``raw``: each target rank re-issues, from a second bare NIXL agent of its
  own, exactly the descriptors its client READ used, both ranks starting at
  one shared instant; the time is until the slower rank's READ is done;
* ``memcpy``: each rank copies the same number of bytes with numpy, same start.

Then the sustained rate (``--stream-requests K``, default 8; 0 skips it):
``--stream-rounds`` alternating rounds of K full-size requests kept
``--stream-depth`` (default 2) in flight, as an engine with several requests
loading at once, polling ``get_finished`` every ``--stream-poll-us`` (1 ms: an
engine polls once per step), against the same K raw READs with as many
posted at once; GB/s over the whole round, and how much of it each rank
spent copying. Every destination copy is checked after the last.

The target's first request is a 1-block load from the source it never talked
to: its *first contact* (the source's metadata fetched, UCX connected),
reported apart with its phases. The first full-size request and the raw
warm-up are checked byte for byte on every rank (and excluded from the
medians, with the first request's time reported); so is the last request
(its destination zeroed first). A wrong byte aborts the bench. The same is
then done with 1-block requests (the per-request fixed cost).

The raw baseline reads from a bare NIXL agent each source rank keeps on the
same pool memory (``transfer_procs/source_rank.py``), not from the source
service's agent, so it owes nothing to the service's progress pacing (it
used to read from the service's agent, which no lease keeps busy during a
raw READ: over TCP that raw READ waited for the service's 20 ms idle
progress and looked slow). With ``--raw-progress-us N`` (N >= 0; the default
under ``--netns``: 200) the source drives that agent every N µs (0:
continuously) inside a window the target opens around each raw measurement
only: over UCX TCP a READ is emulated in software and completes only as
fast as the source makes progress. 200 µs is the fastest raw measured here,
for 64 MiB and for 1 block (2 vCPUs, 2026-11-26, ms full / 1-block: 0
(spinning) 70 / 6.5, 20: 46 / 3.4, 100: 44 / 3.1, 200: 45 / 2.2, 1000:
43 / 3.0, 2000: 47 / 4.1, 5000: 52 / 7.2, 20 ms idle: 162 / 21): two source
ranks spinning take the CPUs the target ranks and the kernel's TCP need.

``--netns``: the same across three network namespaces on one box
(``remote_g2.adapters.reference.netns``: registry, source host, target host, on a private
subnet; needs root): this process makes them, then runs the bench again
inside the registry's namespace, which starts each worker with
``ip netns exec <host> mpiexec ...``. ``UCX_TLS`` is ``tcp`` on both sides
(unless set in the environment), or UCX would copy through shared memory
between namespaces of one kernel. The registry binds its subnet address;
the source takes its settings from the environment like an engine
(``REMOTE_G2_SOURCE_*``). Every namespace and every process in it is
removed at the end, whatever happened. The goals checked there are issue 31's:
e2e >= 0.8 of raw at 64 MiB, a 1-block load <= 2x a raw 1-block READ.

``UCX_LOG_LEVEL`` is the environment's (see ``ucx_log_level``).

Every rank timestamps the client's steps (RPCs, READ posts, hand-offs); the
medians of those phases are the breakdown table.

    python -m bench.transfer.bench_transfer [--blocks-kib 64,1024] [--mib 64] [--reps 20] [--stream-requests 8]
                                   [--stream-depth 2] [--registry-mirror] [--bind none|core] [--json out.json]
                                   [--events-json ev.json] [--registry-bind tcp://HOST:PORT]
                                   [--netns] [--raw-progress-us N]

The code, by part: ``transfer_run`` (one block size: the workers started,
waited for and stopped), ``transfer_analysis`` (the measurements per mode,
summarized), ``transfer_report`` (the tables); the ranks are
``transfer_procs/``; this module: the command line, the registry and
``--netns``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, child_env, write_result
from bench.transfer.transfer_analysis import TP, summarize
from bench.transfer.transfer_report import nixl_version, print_tables
from bench.transfer.transfer_run import MPIEXEC, BenchError, Proc, run_config, ucx_log_level
from remote_g2.memory.host_memory import thp_mode
from remote_g2.registry import MemoryStore, RegistryServer

__all__ = ["main", "BenchError", "MPIEXEC", "Proc"]  # bench_gather starts its workers with these

TARGET_RATIO = 0.70  # e2e / raw at full size, one host (issue 5)
NETNS_TARGET_RATIO = 0.80  # across namespaces over UCX TCP (issue 31)
NETNS_ONE_BLOCK_GOAL = 2.0  # a 1-block load at most this many times a raw 1-block READ (issue 31)
HOST_NAMES = ("registry", "source", "target")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks-kib", default="64,1024", help="block sizes per rank-slice, KiB, comma-separated")
    p.add_argument("--mib", type=int, default=64, help="bytes per request over both ranks, MiB (at most 512)")
    p.add_argument("--reps", type=int, default=20, help="timed requests per size (median; at most 100)")
    p.add_argument("--source-layout", choices=("scattered", "contiguous"), default="scattered",
                   help="scattered: one descriptor per block; contiguous: one per rank (everything coalesces)")
    p.add_argument("--pool-pages", choices=("huge", "4k"), default="huge",
                   help="the source pool in 2 MiB transparent huge pages (HostPool's default) or 4 KiB pages; "
                        "the target's destination is a numpy array, which numpy backs with huge pages itself")
    p.add_argument("--bind", choices=("none", "core"), default="none",
                   help="core: mpiexec binds each source and target rank to a core of its own, as engines run "
                        "their TP ranks (rank r of each worker on core r); none: the kernel places every thread")
    p.add_argument("--poll-us", type=float, default=0.0,
                   help="get_finished polling interval (µs); 0 (default): the bench's loop blocks in the client's "
                        "wait_finished() until the outcome is posted, as an engine watching finished_fd() would")
    p.add_argument("--timeout-s", type=float, default=150.0, help="per block size, for the target worker")
    p.add_argument("--registry-mirror", action="store_true",
                   help="the target looks up in an in-process registry mirror instead of asking the server")
    p.add_argument("--peer-resolve", choices=("on", "off"), default="on",
                   help="on (the default): after the first request each target rank resolves its own share with "
                        "its peer source rank (docs/target.md, \"Peer resolve\"); off: rank 0 resolves every share")
    p.add_argument("--peer-transport", choices=("stream", "zmq"), default="stream",
                   help="what the source's peer endpoints speak: stream (the default; plain TCP, "
                        "remote_g2/rpc/stream.py) or zmq (ZMQ TCP; rank 0's share through its worker endpoint)")
    p.add_argument("--stream-requests", type=int, default=8, help="requests per sustained-rate round (0: skip)")
    p.add_argument("--stream-depth", type=int, default=2, help="requests in flight at most in a sustained round")
    p.add_argument("--stream-rounds", type=int, default=3, help="sustained rounds (each: e2e and raw, alternating)")
    p.add_argument("--stream-poll-us", type=float, default=1000.0,
                   help="get_finished polling interval in sustained rounds (an engine polls once per step)")
    p.add_argument("--registry-bind", default=None,
                   help="where this process's registry listens (default tcp://127.0.0.1:0; under --netns the "
                        "registry host's subnet address, port 0)")
    p.add_argument("--netns", action="store_true",
                   help="registry, source worker and target worker on three network namespaces (hosts) of one "
                        "box, over UCX TCP (needs root; see above)")
    p.add_argument("--raw-progress-us", type=float, default=None,
                   help="raw baseline: during raw READs the source drives its bare agent every N µs (0: "
                        "continuously), as over UCX TCP every READ needs; -1: never faster than every 20 ms. "
                        "Default: 200 under --netns, -1 on one host (UCX cma copies without the source)")
    p.add_argument("--netns-inner", default=None, help=argparse.SUPPRESS)  # the hosts, as JSON: run inside them
    p.add_argument("--keep-logs", type=Path, help="copy each worker's output (its ranks', UCX's) into this directory")
    p.add_argument("--json", type=Path, help="also write the results here (parent directories are created)")
    p.add_argument("--events-json", type=Path,
                   help="also write every request's raw timestamps per block size (NAME-64k.json, ...), on "
                        "CLOCK_MONOTONIC, to line up with a `perf sched record -k CLOCK_MONOTONIC` of the run")
    args = p.parse_args()
    kibs = [int(x) for x in args.blocks_kib.split(",") if x.strip()]
    if not 0 < args.mib <= 512 or not 0 < args.reps <= 100 or not kibs:
        p.error("need 0 < --mib <= 512, 0 < --reps <= 100 and at least one block size")
    if not 0 <= args.stream_requests <= 100 or not 1 <= args.stream_depth <= 8 or not 1 <= args.stream_rounds <= 20:
        p.error("need 0 <= --stream-requests <= 100, 1 <= --stream-depth <= 8, 1 <= --stream-rounds <= 20")
    for k in kibs:
        if k <= 0 or k % 4 or ((args.mib << 20) // TP) % (k * 1024):
            p.error(f"block size {k} KiB must be a multiple of 4 KiB dividing {args.mib // TP} MiB")
    if not MPIEXEC.exists():
        p.error(f"{MPIEXEC} not found (pip install mpich)")
    if args.raw_progress_us is None:
        args.raw_progress_us = 200.0 if args.netns else -1.0
    # SIGTERM unwinds like Ctrl-C: every worker is stopped (and under --netns every namespace removed)
    signal.signal(signal.SIGTERM, _terminated)
    if args.netns and args.netns_inner is None:
        return run_across_hosts(args, len(kibs))

    hosts: dict[str, Any] | None = None
    if args.netns_inner is not None:
        from remote_g2.adapters.reference.netns import Host

        hosts = {name: Host(**h) for name, h in json.loads(args.netns_inner).items()}
    bind = args.registry_bind or (f"tcp://{hosts['registry'].address}:0" if hosts else "tcp://127.0.0.1:0")
    feed_host = bind.rsplit(":", 1)[0]
    server = RegistryServer(MemoryStore(lease_ttl_ms=30_000), bind=bind, feed_bind=f"{feed_host}:0")
    registry = server.start()
    setting: dict[str, Any] = {
        "netns": {name: h.address for name, h in hosts.items()} if hosts else None,
        "ucx_tls": (os.environ.get("UCX_TLS") or "tcp") if hosts else os.environ.get("UCX_TLS"),
        "ucx_log_level": ucx_log_level(), "registry": registry,
        "goals": ({"ratio": NETNS_TARGET_RATIO, "one_block": NETNS_ONE_BLOCK_GOAL} if hosts
                  else {"ratio": TARGET_RATIO, "one_block": None}),
        "raw_progress_us": args.raw_progress_us}
    results: dict[int, dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="rg2-bench-transfer-") as tmp:
            for kib in kibs:
                t = time.monotonic()
                results[kib] = run_config(kib, args, registry, Path(tmp), hosts)
                print(f"[{kib} KiB blocks: {time.monotonic() - t:.1f} s]", file=sys.stderr, flush=True)
    except BenchError as e:
        print(f"bench_transfer: FAILED: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the workers were stopped on the way out (run_config)
        print(f"bench_transfer: interrupted ({e or 'Ctrl-C'})", file=sys.stderr)
        return 130
    finally:
        server.close()
    rows = [summarize(k, results[k], setting["goals"]) for k in kibs]
    if args.json:
        write_result(args.json, "transfer", **{
            "tp": TP, "mib": args.mib, "reps": args.reps,
            "source_layout": args.source_layout, "pool_pages": args.pool_pages, "bind": args.bind,
            "thp_mode": thp_mode(), "poll_us": args.poll_us, "registry_mirror": args.registry_mirror,
            "peer_resolve": args.peer_resolve, "peer_transport": args.peer_transport,
            "stream_requests": args.stream_requests, "stream_depth": args.stream_depth,
            "stream_rounds": args.stream_rounds, "stream_poll_us": args.stream_poll_us, "nixl": nixl_version(),
            "cpus": os.cpu_count(), "machine": platform.machine(), "loadavg": os.getloadavg(),
            "target_ratio": setting["goals"]["ratio"], "one_block_goal": setting["goals"]["one_block"],
            "netns": setting["netns"], "ucx_tls": setting["ucx_tls"], "ucx_log_level": setting["ucx_log_level"],
            "raw_progress_us": args.raw_progress_us, "commit": _commit(), "rows": rows})
    print_tables(rows, args, setting)
    return 0


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _commit() -> str | None:
    """The repository's HEAD (and whether the tree had changes), for the JSON."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "") if head else None


def run_across_hosts(args: argparse.Namespace, sizes: int) -> int:
    """``--netns``: make the hosts, run this bench inside the registry's namespace, remove everything after."""
    from remote_g2.adapters.reference.netns import Hosts, netns_unavailable_reason

    if (why := netns_unavailable_reason()) is not None:
        print(f"bench_transfer: --netns unavailable: {why}", file=sys.stderr)
        return 2
    # per size: the source's start (90 s), the target (--timeout-s), stopping (20 s); and some slack
    budget_s = sizes * (90 + args.timeout_s + 40) + 60
    # Closing them kills whatever still runs inside (by PID) and deletes them: on return, on an exception, on
    # Ctrl-C or SIGTERM (both raise KeyboardInterrupt here); only SIGKILL leaves them
    # (remote_g2.adapters.reference.netns.remove_stale)
    with Hosts(list(HOST_NAMES)) as hosts:
        spec = {h.name: {"name": h.name, "netns": h.netns, "address": h.address, "interface": h.interface}
                for h in hosts}
        inner = subprocess.Popen(hosts["registry"].command(
            [sys.executable, "-m", __spec__.name, *sys.argv[1:], "--netns-inner", json.dumps(spec)]),
            cwd=REPO, env=child_env())
        try:
            return inner.wait(budget_s)
        except (KeyboardInterrupt, subprocess.TimeoutExpired) as e:
            print(f"bench_transfer: stopping ({type(e).__name__})", file=sys.stderr)
            return 1
        finally:
            if inner.poll() is None:
                inner.terminate()  # it stops its workers (see _terminated)
                try:
                    inner.wait(40)
                except subprocess.TimeoutExpired:
                    inner.kill()
                    inner.wait(10)


if __name__ == "__main__":
    sys.exit(main())
