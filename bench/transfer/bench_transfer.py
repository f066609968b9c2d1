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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROCS = "bench.transfer.transfer_procs"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TP = 2
TARGET_RATIO = 0.70  # e2e / raw at full size, one host (issue 5)
NETNS_TARGET_RATIO = 0.80  # across namespaces over UCX TCP (issue 31)
NETNS_ONE_BLOCK_GOAL = 2.0  # a 1-block load at most this many times a raw 1-block READ (issue 31)
HOST_NAMES = ("registry", "source", "target")
LATE_START_MS = 1.0  # a rank whose READ starts this long after the resolve: it waited for a CPU, not for us

from bench.common import REPO, child_env, kill_group, write_result
from remote_g2.memory.host_memory import thp_mode
from remote_g2.registry import MemoryStore, RegistryClient, RegistryServer


class BenchError(Exception):
    pass


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
        result["stream"]["busy"] = _stream_busy(result["stream"], events)
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


# -- analysis -------------------------------------------------------------------------------------

def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def breakdown(series: dict[str, Any], events: list[list[list[Any]]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each timed request of ``series`` cut into phases (seconds) from every rank's timestamps, and their medians.

    The critical path (they add up to the end-to-end time): ``lookup`` (registry
    RPC), ``handoff`` (start_load until the coordinator picks it up), ``resolve``
    (until the resolve RPC returned; with peer resolve, rank 0's ``peer_resolve``
    while the other ranks ask their own peers meanwhile), ``reads`` (until the leader has heard from
    the last rank: fan-out, both ranks' READs, reports), ``finish`` (until the
    outcome is posted; the release RPC is inside it only when the lease's expiry
    came too close, else it runs after the report), ``notice`` (until the
    polling loop saw it). The rest are details.
    """
    rows: list[dict[str, float]] = []
    for req in series["e2e"]:
        t0, t1 = req["t0"], req["t_end"]

        def inside(rank: int, what: str) -> list[list[Any]]:
            return [e for e in events[rank] if e[0] == what and t0 <= e[1] <= t1]

        try:
            begin = inside(0, "begin")[0]
            resolve = (inside(0, "rpc:Resolve") or inside(0, "rpc:PeerResolve"))[0]  # rank 0's share (peer)
            handed = inside(0, "link_send:TargetLoad"), inside(1, "link_recv:TargetLoad")
            release = (inside(0, "rpc:Release") or [[None, None, None]])[0]
            complete = inside(0, "complete")[0]
            done = inside(0, "rank_done")
            reads = [inside(r, "start_read")[0] for r in range(TP)]
            plans = [inside(r, "plan")[0] for r in range(TP)]
            submits = [inside(r, "submit")[0] for r in range(TP)]
            reported = inside(1, "link_send:TargetDone"), inside(0, "link_recv:TargetDone")
        except IndexError:
            continue  # a timestamp fell outside the window; skip this request
        last_done = max(e[1] for e in done)
        row = {
            "e2e": t1 - t0,
            "lookup": req["t_lookup"] - t0,
            "handoff": begin[1] - req["t_lookup"],
            "resolve": resolve[2] - begin[1],
            "reads": last_done - resolve[2],
            "finish": complete[2] - last_done,
            "notice": t1 - complete[2],
            # details
            "resolve_rpc": resolve[2] - resolve[1],
            "release_rpc": (release[2] - release[1]) if release[1] is not None else None,
            # a link message: from the sender's send() until the receiver's receive() returned it
            "link_to_rank1": (handed[1][0][2] - handed[0][0][1]) if all(handed) else None,
            # of which: until rank 1's loop called receive() (its wake-up), and the receive itself (decoding)
            "rank1_up": (handed[1][0][1] - handed[0][0][1]) if all(handed) else None,
            "rank1_decode": (handed[1][0][2] - handed[1][0][1]) if all(handed) else None,
            "rank0_handed": submits[0][1] - resolve[2],
            "rank0_wake": reads[0][1] - submits[0][1],
            "rank0_plan": plans[0][2] - plans[0][1],  # of which: ReadPlanner.plan, in place
            "rank0_read": reads[0][2] - reads[0][1],
            "rank1_handed": submits[1][1] - resolve[2],
            "rank1_wake": reads[1][1] - submits[1][1],
            "rank1_plan": plans[1][2] - plans[1][1],
            "rank1_read": reads[1][2] - reads[1][1],
            "link_from_rank1": (reported[1][0][2] - reported[0][0][1]) if all(reported) else None,
            # rank 1 from the end of its READ post to sending its report (state check, handle release)
            "rank1_wrapup": (reported[0][0][1] - reads[1][2]) if reported[0] else None,
            "read_span": max(r[2] for r in reads) - min(r[1] for r in reads),
            "reads_overlap": min(r[2] for r in reads) - max(r[1] for r in reads),
            "after_reads": last_done - max(r[2] for r in reads),
        }
        row["outside_reads"] = row["e2e"] - row["read_span"]
        # what only a first contact should pay: the source's metadata (its RPC, NIXL loading it), per slower rank
        row["metadata_rpc"] = max(sum(e[2] - e[1] for e in inside(r, "rpc:GetMetadata")) for r in range(TP))
        row["add_peer"] = max(sum(e[2] - e[1] for e in inside(r, "add_peer")) for r in range(TP))
        rows.append(row)
    if not rows:
        return {"requests": 0}, rows
    keys = rows[0].keys()
    return {"requests": len(rows), **{k: _med([r[k] for r in rows]) for k in keys}}, rows


def bytes_read(res: dict[str, Any]) -> int:
    """Every byte the target read from the source in a run: requests and raw READs, warm-ups and streams."""
    total = res["first_contact_bytes"]
    for kind in ("full", "one"):
        series = res[kind]
        total += series["bytes"] * (2 + len(series["e2e"]) + len(series["raw"]))  # + warm-up request and READ
    if st := res.get("stream"):
        total += st["bytes"] * (len(st["e2e"]) + len(st["raw"]))
    return total


def summarize(kib: int, res: dict[str, Any], goals: dict[str, Any]) -> dict[str, Any]:
    full, one = res["full"], res["one"]
    nbytes = full["bytes"]
    e2e = [r["s"] for r in full["e2e"]]
    raw = [r["s"] for r in full["raw"]]
    mem = [r["s"] for r in full["memcpy"]]
    e2e_s, raw_s, mem_s = statistics.median(e2e), statistics.median(raw), statistics.median(mem)
    ratio = raw_s / e2e_s
    one_e2e = [r["s"] for r in one["e2e"]]
    one_raw = [r["s"] for r in one["raw"]]
    out = {
        "block_kib": kib,
        "blocks_per_rank": full["blocks"],
        "descriptors_per_rank": full["raw"][0]["descriptors"],
        "bytes_per_request": nbytes,
        "e2e_s": e2e_s, "e2e_gb_per_s": nbytes / e2e_s / 1e9,
        "raw_s": raw_s, "raw_gb_per_s": nbytes / raw_s / 1e9,
        "memcpy_s": mem_s, "memcpy_gb_per_s": nbytes / mem_s / 1e9,
        "ratio_e2e_over_raw": ratio, "ratio_paired_median": statistics.median(b / a for a, b in zip(e2e, raw)),
        "ratio_paired_range": [min(b / a for a, b in zip(e2e, raw)), max(b / a for a, b in zip(e2e, raw))],
        "target_ratio": goals["ratio"], "target_met": ratio >= goals["ratio"],
        "fixed_cost_s": statistics.median(a - b for a, b in zip(e2e, raw)),
        "outside_reads_s": res["breakdown"]["full"].get("outside_reads"),
        "first_request_s": full["warmup_e2e"]["s"],  # the first full-size one (the target is connected by then)
        "first_contact_s": res["first_contact"]["s"],  # the target's first request: 1 block, a new source
        "first_contact_ms": {p: (None if v is None else (v * 1e3 if p != "requests" else v))
                             for p, v in res["breakdown"]["first_contact"].items()},
        "one_block_e2e_s": statistics.median(one_e2e),
        "one_block_raw_s": statistics.median(one_raw),
        "one_block_fixed_s": statistics.median(a - b for a, b in zip(one_e2e, one_raw)),
        "one_block_ratio": statistics.median(one_e2e) / statistics.median(one_raw),
        "one_block_goal": goals["one_block"],
        "one_block_goal_met": (None if goals["one_block"] is None
                               else statistics.median(one_e2e) / statistics.median(one_raw) <= goals["one_block"]),
        "runs": {"e2e_s": e2e, "raw_s": raw, "memcpy_s": mem, "raw_rank_s": [r["rank_s"] for r in full["raw"]],
                 "raw_start_late_s": [r.get("start_late_s") for r in full["raw"]],
                 "memcpy_rank_s": [r["rank_s"] for r in full["memcpy"]], "one_e2e_s": one_e2e,
                 "one_raw_s": one_raw},
        "stream": _stream_summary(res.get("stream"), goals["ratio"]),
        "source_endpoint": res.get("source_endpoint"),
        "bytes_read": bytes_read(res),
        "source_link_sent": res.get("source_link_sent"),
        "client_stats": res.get("client_stats"),
        "loadavg_after": res.get("loadavg_after"),
        "pins_after": res.get("pins_after"),
        "breakdown_ms": {k: {p: (None if v is None else (v * 1e3 if p != "requests" else v))
                             for p, v in b.items()} for k, b in res["breakdown"].items() if k != "first_contact"},
        "breakdown_rows_ms": {k: [{p: None if v is None else v * 1e3 for p, v in row.items()} for row in rows]
                              for k, rows in res["breakdown_rows"].items()},
    }
    out["late_starts"] = late_starts(out["breakdown_rows_ms"]["full"])
    return out


def _stream_busy(stream: dict[str, Any], events: list[list[list[Any]]]) -> list[list[float]]:
    """Per e2e stream round, each rank's share of the round spent inside its READ posts (copying)."""
    out = []
    for rnd in stream["e2e"]:
        t0, t1 = rnd["t0"], rnd["t_end"]
        out.append([sum(e[2] - e[1] for e in evs if e[0] == "start_read" and t0 <= e[1] <= t1) / (t1 - t0)
                    for evs in events])
    return out


def _stream_summary(st: dict[str, Any] | None, goal: float) -> dict[str, Any] | None:
    """Sustained GB/s of the e2e and raw streams (medians over rounds) and their ratio."""
    if not st or not st["e2e"]:
        return None
    e2e = [r["s"] for r in st["e2e"]]
    raw = [r["s"] for r in st["raw"]]
    e2e_s, raw_s = statistics.median(e2e), statistics.median(raw)
    return {"requests": st["requests"], "depth": st["depth"], "bytes": st["bytes"],
            "e2e_s": e2e_s, "e2e_gb_per_s": st["bytes"] / e2e_s / 1e9,
            "raw_s": raw_s, "raw_gb_per_s": st["bytes"] / raw_s / 1e9,
            "ratio_e2e_over_raw": raw_s / e2e_s, "target_met": raw_s / e2e_s >= goal,
            # each rank's fraction of a round spent copying (inside its READ posts), median over rounds
            "rank_busy": [statistics.median(b[r] for b in st["busy"]) for r in range(len(st["busy"][0]))]
            if st.get("busy") else None,
            "runs": {"e2e_s": e2e, "raw_s": raw}}


def print_tables(rows: list[dict[str, Any]], args: argparse.Namespace, setting: dict[str, Any]) -> None:
    goal = setting["goals"]["ratio"]
    g = f">={goal:.2f}"
    if setting["netns"]:
        print(f"across network namespaces (registry {setting['netns']['registry']}, source "
              f"{setting['netns']['source']}, target {setting['netns']['target']}), UCX_TLS={setting['ucx_tls']}; "
              f"raw: the source drives its bare agent every {args.raw_progress_us:g} µs during raw READs")
    print(f"TP={TP}->{TP}, {args.mib} MiB per request ({args.mib // TP} MiB per rank), median of {args.reps}; "
          f"source blocks {args.source_layout} in {args.pool_pages} pages; ranks bound: {args.bind}; "
          f"peer resolve {args.peer_resolve}" + (f" over {args.peer_transport}; " if args.peer_resolve == "on" else "; ") +
          f"NIXL {_nixl_version()} UCX; "
          f"{os.cpu_count()} CPUs, "
          f"load avg {os.getloadavg()[0]:.2f}")
    hdr = (f"{'block':>6} {'desc/rk':>7} {'e2e ms':>7} {'e2e GB/s':>8} {'raw ms':>7} {'raw GB/s':>8} "
           f"{'memcpy':>7} {'e2e/raw':>7} {'paired':>6} {'range':>9} {g:>6} {'fixed ms':>8} {'1st ms':>7} "
           f"{'1blk e2e':>8} {'1blk raw':>8} {'1blk x':>6}")
    print(hdr)
    for r in rows:
        print(f"{str(r['block_kib']) + 'K':>6} {max(r['descriptors_per_rank']):>7} {r['e2e_s'] * 1e3:>7.2f} "
              f"{r['e2e_gb_per_s']:>8.2f} {r['raw_s'] * 1e3:>7.2f} {r['raw_gb_per_s']:>8.2f} "
              f"{r['memcpy_gb_per_s']:>7.2f} {r['ratio_e2e_over_raw']:>7.2f} {r['ratio_paired_median']:>6.2f} "
              f"{'%.2f-%.2f' % tuple(r['ratio_paired_range']):>9} "
              f"{'yes' if r['target_met'] else 'NO':>6} {r['fixed_cost_s'] * 1e3:>8.2f} "
              f"{r['first_contact_s'] * 1e3:>7.1f} {r['one_block_e2e_s'] * 1e3:>8.2f} "
              f"{r['one_block_raw_s'] * 1e3:>8.3f} {r['one_block_ratio']:>6.2f}")
    one_goal = setting["goals"]["one_block"]
    print("  e2e/raw: ratio of the medians (the target); paired: median of the per-round ratios, range: their\n"
          "  lowest and highest (how much this machine moved during the run); memcpy: GB/s;\n"
          "  fixed: median of (e2e - raw) per round; 1st: the target's first contact with the source (its first\n"
          "  request, 1 block: loads the source's metadata, connects);\n"
          "  1blk: a 1-block request, ms; 1blk x: e2e / raw" + (f" (goal <= {one_goal:g})" if one_goal else ""))
    print("\nfirst contact (the target's first request, 1 block, from a source it never talked to), ms:")
    fc_keys = ["e2e", "lookup", "handoff", "resolve", "reads", "finish", "notice", "metadata_rpc", "add_peer",
               "rank0_read", "rank1_read"]
    print(f"{'block':>6}" + "".join(f"{k:>13}" for k in fc_keys) + f"{'full 1st':>10}")
    for r in rows:
        fc = r["first_contact_ms"]
        print(f"{str(r['block_kib']) + 'K':>6}" + "".join(
            f"{'-' if fc.get(k) is None else f'{fc[k]:.2f}':>13}" for k in fc_keys)
            + f"{r['first_request_s'] * 1e3:>10.1f}")
    print("  metadata_rpc / add_peer: the slower rank's GetMetadata RPC (0: the resolve brought the metadata) /\n"
          "  NIXL loading it (inside resolve/reads); full 1st: the first full-size request after that")
    for r in rows:
        if r.get("source_link_sent") is not None:
            print(f"{r['block_kib']}K: the source host sent {r['source_link_sent'] / 1e9:.2f} GB over its link; the "
                  f"target read {r['bytes_read'] / 1e9:.2f} GB from it ({r['source_link_sent'] / r['bytes_read']:.2f}x)")
    streams = [(r["block_kib"], r["stream"]) for r in rows if r.get("stream")]
    if streams:
        st0 = streams[0][1]
        print(f"\nsustained: {st0['requests']} requests of {args.mib} MiB per round, up to {st0['depth']} in flight, "
              f"median of {args.stream_rounds} rounds")
        print(f"{'block':>6} {'e2e GB/s':>8} {'raw GB/s':>8} {'e2e/raw':>7} {g:>6} {'copying':>12}")
        for kib, st in streams:
            busy = "/".join(f"{b:.2f}" for b in st["rank_busy"]) if st.get("rank_busy") else "-"
            print(f"{str(kib) + 'K':>6} {st['e2e_gb_per_s']:>8.2f} {st['raw_gb_per_s']:>8.2f} "
                  f"{st['ratio_e2e_over_raw']:>7.2f} {'yes' if st['target_met'] else 'NO':>6} {busy:>12}")
        print("  raw: the same READs with as many posted at once (each rank its own), from one shared instant;\n"
              "  copying: each rank's share of an e2e round spent inside its READ posts")
    phases = ["lookup", "handoff", "resolve", "reads", "finish", "notice"]
    details = ["resolve_rpc", "release_rpc", "link_to_rank1", "rank1_up", "rank1_decode", "rank0_handed", "rank0_wake",
               "rank0_plan", "rank0_read", "rank1_handed", "rank1_wake", "rank1_plan", "rank1_read", "rank1_wrapup",
               "link_from_rank1", "reads_overlap", "after_reads", "outside_reads"]
    print("\nwhere a request's time goes (median ms; the first six add up to e2e)"
          + (": over TCP a READ's post returns at once, its bytes move during after_reads/rank1_wrapup"
             if setting["netns"] else ":"))
    print(f"{'':>12}" + "".join(f"{str(r['block_kib']) + 'K ' + k:>12}" for r in rows for k in ("full", "1-blk")))
    for p in ["e2e", *phases, *details]:
        cells = []
        for r in rows:
            for k in ("full", "one"):
                v = r["breakdown_ms"][k].get(p)
                cells.append(f"{'-' if v is None else f'{v:.3f}':>12}")
        print(f"{p:>12}" + "".join(cells))
    late = [f"{r['block_kib']}K {r['late_starts']['count']} of {r['late_starts']['of']}" for r in rows]
    print(f"\nlate starts (a rank's READ began {LATE_START_MS:g} ms or more after the resolve returned): "
          + ", ".join(late) + "\n  on a 2-vCPU VM a woken thread can wait behind the other rank's copy on its CPU "
          "(docs/target.md)")


def late_starts(rows_ms: list[dict[str, Any]]) -> dict[str, int]:
    """How many full-size requests had a rank start its READ ``LATE_START_MS`` or more after the resolve returned."""
    count = sum(max(row[f"rank{r}_handed"] + row[f"rank{r}_wake"] for r in range(TP)) >= LATE_START_MS
                for row in rows_ms)
    return {"count": count, "of": len(rows_ms)}


def _nixl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl")
    except PackageNotFoundError:
        return "?"


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
            "stream_rounds": args.stream_rounds, "stream_poll_us": args.stream_poll_us, "nixl": _nixl_version(),
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
    # Ctrl-C or SIGTERM (both raise KeyboardInterrupt here); only SIGKILL leaves them (remote_g2.adapters.reference.netns.remove_stale)
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
