"""vLLM's own ``p2p`` secondary tier doing the chunk fetch of bench/vllm/bench_vllm_tier.py part 1, for a side-by-side
comparison with remote-g2's tier. No engine, no GPU: two processes of tests/vllm_procs/p2p_proc.py, each vLLM's
real ``TieringOffloadingManager`` (CPU primary tier over a shared ``/dev/shm`` region) with
``P2PSecondaryTierManager`` (``{"type": "p2p", "host": "127.0.0.1", "port": P}``; ZMQ control socket, NIXL/UCX
data plane), stepped every ``--step-ms`` as an engine's scheduler would.

Producer A stores ``--chunks`` chunks of ``--row-mib`` MiB a round into its primary tier; consumer B loads them
through vLLM's manager with the producer named by hand in the request's ``kv_transfer_params``:

* ``symmetric`` (``remote_kv_source: {kv_request_id, remote_host, remote_port}``): B's lookup sends a LookupMsg,
  A looks the keys up in its own tiering manager and pins the hits, B promotes (reserves rows), sends a FetchMsg,
  A NIXL-WRITEs the rows into B's region and answers TransferDoneMsg;
* ``pd`` (A's store carries ``remote_decoder: {kv_request_id}``, B's load ``remote_prefiller: {kv_request_id,
  remote_host, remote_port}``): no lookup round trip, B's lookup is an eager HIT; A parks the stored chunks
  pinned under the id until B's FetchMsg binds them, then WRITEs.

Round 0 warms up (not counted: the first session, its ZMQ connect and NIXL metadata handshake, first touch).
The p2p fetch time is the promotion job's, from ``submit_load`` (the FetchMsg goes out) to the step whose
``get_finished_jobs`` returns it (p2p reports no transfer time of its own), the same span remote-g2's tier clocks
(job start to end). Also shown: the request's whole load (first lookup to last HIT) and the producer's NIXL WRITE
(``write_blocks`` to the poll that saw it done). Every row B got is checked against the producer's bytes
(sha256 of the row A wrote and of the rule that made it): any difference fails the run.

    .venv-vllm/bin/python -m bench.vllm.bench_vllm_p2p [--rounds 7] [--chunks 8] [--row-mib 2] [--mode both]
        [--step-ms 2] [--tier '{"num_threads": 4}'] [--json bench/results/vllm_p2p.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bench.common import REPO, write_result
from bench.vllm import vllm_version
from tests.vllm_harness import AnswerLines
from tests.vllm_procs.tiering_manager import chunk_bytes

PROC = REPO / "tests" / "vllm_procs" / "p2p_proc.py"


class Proc:
    """One p2p_proc.py process, spoken to a JSON line at a time; every wait bounded."""

    def __init__(self, name: str, row_bytes: int, rows: int, step_s: float, tier: dict | None = None) -> None:
        self.name = name
        self.engine_id = f"p2p-bench-{name}-{uuid.uuid4().hex[:10]}"
        cfg = {"block_bytes": row_bytes, "cpu_bytes": rows * row_bytes, "engine_id": self.engine_id, "port": 0,
               "step_s": step_s, "tier": tier or {}}
        self.proc = subprocess.Popen([sys.executable, str(PROC), json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, "UCX_LOG_LEVEL": "error"})
        self.stderr_tail = b""
        self.answers = AnswerLines(self.proc.stdout)
        self.info = self.read(120)
        assert self.info.get("ready"), self.info

    def read(self, timeout_s: float) -> dict:
        """Its next answer (:class:`vllm_harness.AnswerLines`); its stderr's tail is kept for the errors."""
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (answer := self.answers.pop()) is not None:
                return answer
            ready, _, _ = select.select([self.answers, self.proc.stderr], [], [], 0.1)
            if self.proc.stderr in ready:
                self.stderr_tail = (self.stderr_tail + os.read(self.proc.stderr.fileno(), 65536))[-8000:]
            if self.answers in ready and not self.answers.feed():
                raise RuntimeError(f"{self.name} exited ({self.proc.wait(10)}); its stderr ends:\n"
                                   f"{self.stderr_tail.decode(errors='replace')}")
        if self.proc.poll() is None:  # its Python stack, to say where it is stuck
            os.kill(self.proc.pid, signal.SIGUSR1)
            end = time.monotonic() + 2
            while time.monotonic() < end:
                if select.select([self.proc.stderr], [], [], 0.2)[0]:
                    self.stderr_tail = (self.stderr_tail + os.read(self.proc.stderr.fileno(), 65536))[-8000:]
        raise RuntimeError(f"no answer from {self.name} within {timeout_s} s; its stderr ends:\n"
                           f"{self.stderr_tail.decode(errors='replace')}")

    def ask(self, wait_s: float = 30, **cmd: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self.read(wait_s)

    def stop(self) -> None:
        """Ask it to stop; past a bounded wait, kill it (this process's child, by its PID)."""
        if self.proc.poll() is None:
            try:
                self.ask(20, op="stop")
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, 9)
                self.proc.wait(10)
        Path(f"/dev/shm/vllm_offload_{self.engine_id}.mmap").unlink(missing_ok=True)


def expected_sha(seed: int, key_hex: str, row_bytes: int) -> str:
    """The SHA-256 of the row the producer wrote for this key (the rule of tests/vllm_procs/tiering_manager.py)."""
    return hashlib.sha256(chunk_bytes(seed, bytes.fromhex(key_hex), row_bytes)).hexdigest()


def run_mode(a: Proc, b: Proc, mode: str, rounds: int, chunks: int, row_bytes: int) -> dict:
    fetch_ms: list[float] = []
    load_ms: list[float] = []
    write_ms: list[float] = []
    for r in range(rounds + 1):  # round 0 warms up
        ks = [(hashlib.sha256(f"p2p-{mode}-{uuid.uuid4().hex}-{r}-{i}".encode()).digest() + bytes(4)).hex()
              for i in range(chunks)]
        kv_id = f"bench-{mode}-{r}-{uuid.uuid4().hex[:8]}"
        stored = a.ask(op="store", keys=ks, seed=r + 1, kv_request_id=kv_id if mode == "pd" else None)
        assert stored["stored"] == chunks, stored
        a.ask(op="writes")  # (forget earlier WRITEs)
        ans = b.ask(60, op="load", keys=ks, host=a.info["host"], port=a.info["port"], kv_request_id=kv_id,
                    mode=mode, timeout_s=40)
        got = ans["got"]
        bad = {k: (got.get(k), stored["sha"][k]) for k in ks
               if got.get(k) != stored["sha"][k] or stored["sha"][k] != expected_sha(r + 1, k, row_bytes)}
        if bad:
            raise SystemExit(f"{mode} round {r}: {len(bad)} of {chunks} chunks not byte-exact "
                             f"(got, producer's): {bad}; jobs {ans['jobs']}; B stats {b.ask(op='stats')}")
        jobs = ans["jobs"]
        assert sum(j[0] for j in jobs) == chunks and all(j[2] for j in jobs), jobs
        fetch_s = sum(j[1] for j in jobs)
        writes = a.ask(op="writes")["writes"]
        assert sum(w[0] for w in writes) == chunks, writes
        write_s = sum(w[1] for w in writes)
        print(f"{mode:9s} round {r}: {chunks} chunks of {row_bytes / (1 << 20):g} MiB: p2p fetch "
              f"{fetch_s * 1e3:7.2f} ms ({len(jobs)} job(s)), load {ans['load_s'] * 1e3:7.2f} ms, producer's "
              f"WRITE {write_s * 1e3:7.2f} ms ({len(writes)}){'  (warm-up, not counted)' if r == 0 else ''}",
              flush=True)
        if r == 0:
            continue
        fetch_ms.append(fetch_s * 1e3)
        load_ms.append(ans["load_s"] * 1e3)
        write_ms.append(write_s * 1e3)
    gb = chunks * row_bytes / 1e9
    med = statistics.median(fetch_ms)
    return {"fetch_ms": fetch_ms, "load_ms": load_ms, "write_ms": write_ms,
            "fetch_ms_median": med, "fetch_ms_min": min(fetch_ms), "fetch_ms_max": max(fetch_ms),
            "fetch_gbps_median": gb / (med / 1e3), "fetch_gbps_best": gb / (min(fetch_ms) / 1e3),
            "load_ms_median": statistics.median(load_ms), "write_ms_median": statistics.median(write_ms),
            "write_gbps_median": gb / (statistics.median(write_ms) / 1e3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--row-mib", type=float, default=2)
    ap.add_argument("--mode", choices=("symmetric", "pd", "both"), default="both")
    ap.add_argument("--step-ms", type=float, default=2.0, help="idle step interval of both processes "
                    "(2 ms: tests/vllm_procs/tier_proc.py's)")
    ap.add_argument("--tier", default="{}", help="more keys for the p2p tier's config, as JSON "
                    "(e.g. '{\"num_threads\": 1}'; vLLM's defaults otherwise)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    row_bytes = int(args.row_mib * (1 << 20))
    rows = max(6 * args.chunks, 16)  # (bench_vllm_tier.py's)
    modes = ["symmetric", "pd"] if args.mode == "both" else [args.mode]
    t_start = time.monotonic()
    a = b = None
    results: dict[str, dict] = {}
    try:
        tier = json.loads(args.tier)
        a = Proc("producer", row_bytes, rows, args.step_ms / 1e3, tier)
        b = Proc("consumer", row_bytes, rows, args.step_ms / 1e3, tier)
        print(f"producer pid {a.info['pid']} p2p tier {a.info['tier']}; consumer pid {b.info['pid']} "
              f"p2p tier {b.info['tier']}; rows {rows} x {row_bytes} B", flush=True)
        for mode in modes:
            results[mode] = run_mode(a, b, mode, args.rounds, args.chunks, row_bytes)
        stats = {"producer": a.ask(op="stats"), "consumer": b.ask(op="stats")}
    finally:
        for p in (b, a):
            if p is not None:
                p.stop()
    wall = time.monotonic() - t_start
    print(f"\nvLLM p2p tier chunk fetch ({args.rounds} rounds after a warm-up, {args.chunks} x {args.row_mib:g} MiB, "
          f"steps every {args.step_ms:g} ms, byte-exact):")
    print(f"  {'mode':10s} {'fetch median':>13s} {'GB/s':>6s} {'min':>8s} {'max':>8s} {'load median':>12s} "
          f"{'WRITE median':>13s} {'GB/s':>6s}")
    for mode, o in results.items():
        print(f"  {mode:10s} {o['fetch_ms_median']:10.2f} ms {o['fetch_gbps_median']:6.2f} "
              f"{o['fetch_ms_min']:5.2f} ms {o['fetch_ms_max']:5.2f} ms {o['load_ms_median']:9.2f} ms "
              f"{o['write_ms_median']:10.2f} ms {o['write_gbps_median']:6.2f}")
    print("  fetch: the promotion job, submit_load to the step that finds it done; load: the request's first "
          "lookup to last HIT; WRITE: the producer's NIXL WRITE, posted to seen done")
    print(f"  wall {wall:.1f} s")
    if args.json:
        write_result(args.json, "vllm_p2p", vllm=vllm_version(), rounds=args.rounds, chunks=args.chunks,
                     row_bytes=row_bytes,
                     step_ms=args.step_ms, tier_config={k: v for k, v in a.info["tier"].items() if k != "port"},
                     modes=results, final_stats=stats, wall_s=wall)


if __name__ == "__main__":
    main()
