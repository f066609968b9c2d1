"""Soak benchmark (issue 8, load): target clients cycling resolve → NIXL READ → release on an evicting source.

Everything real, on this machine: ``mpiexec -n TP`` synthetic source ranks
(``tests/source_procs/source_rank.py``) whose pools hold ``--num-blocks``
blocks while a churn thread on every rank keeps storing runs of hashes from a
key space of ``--key-space`` (> pool), so LRU eviction never stops; and
``--clients`` reader processes (``tests/source_procs/soak_reader.py``), each
with its own NIXL agent, running ``--cycles`` cycles: resolve a random window
of ``--window`` hashes, READ every matched block from every rank, check every
byte against the pattern, release. All readers start their cycles together;
``--seconds`` bounds the whole load phase.

Checks (exit status 1 if any fails):
  * zero wrong bytes;
  * zero pins and zero open leases on every rank once the readers are done
    (waited for briefly: a release reaches the siblings asynchronously);
  * no errors: every outcome is a full match or a clean miss (``matched <
    window``, 0 included); no ``over_budget`` (the pin budget is sized to
    clients × window), no failed churn store.

Reported: cycles/s over the load phase, p50/p99 cycle latency (every clean
cycle, and those with a READ), outcomes, blocks verified, pool evictions.

    python -m bench.source.bench_soak [--clients 8] [--cycles 2000] [--seconds 600] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import write_result
from bench.common import pct as _pct
from tests.source_procs.harness import SourceWorker, have_mpiexec
from tests.source_procs.soak_reader import run_soak_readers

COUNTS = ("cycles", "full", "partial", "empty", "over_budget", "errors", "wrong_blocks", "wrong_bytes",
          "blocks_verified")


def pct(values: list[float], q: float) -> float | None:
    """bench.common's percentile, None (JSON null) for no sample."""
    return _pct(values, q) if values else None


def source_args(args: argparse.Namespace) -> list[str]:
    """The synthetic source's flags: a full small pool, a budget that fits every client's window, churn."""
    extra = ["--num-blocks", str(args.num_blocks), "--hashes", str(min(args.num_blocks, args.key_space)),
             "--budget", str(args.clients * args.window), "--rpc-workers", str(args.rpc_workers),
             "--churn-hashes", str(args.key_space), "--churn-per-s", str(args.churn_per_s),
             "--churn-batch", str(args.churn_batch), "--lifetime-s", str(args.seconds + 300)]
    if args.rank_seeds:
        extra.append("--churn-rank-seeds")
    return extra


def pins_after(worker: SourceWorker, tp: int, timeout_s: float) -> list[dict[str, Any]]:
    """Each rank's state once it holds no pin and no lease, or its last state after ``timeout_s``."""
    states = []
    for r in range(tp):
        try:
            states.append(worker.wait_state(r, lambda s: s["total_pins"] == 0 and s["service"]["leases_open"] == 0,
                                            timeout_s=timeout_s, what="no pins and no open leases"))
        except AssertionError:
            states.append(worker.state(r))
    return states


def run_soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start the source, run the readers, check the pins, stop the source; the raw result."""
    worker = SourceWorker(workdir / "source", f"soak-{os.getpid()}", np=args.tp, args=source_args(args))
    try:
        t0 = time.monotonic()
        readers = run_soak_readers(worker.endpoint, workdir / "readers", args.clients, key_space=args.key_space,
                                   window=args.window, cycles=args.cycles, seconds=args.seconds, seed=args.seed)
        load_wall_s = time.monotonic() - t0
        after = pins_after(worker, args.tp, args.pin_timeout_s)
        report = worker.stop()
    finally:
        worker.kill()
    return {"readers": readers, "after": after, "done": report["done"], "source_rc": report["rc"],
            "load_wall_s": load_wall_s}


def summarize(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    readers, after = raw["readers"], raw["after"]
    totals = {k: sum(r[k] for r in readers) for k in COUNTS}
    starts = [r["t_start"] for r in readers if r["t_start"] is not None]
    ends = [r["t_end"] for r in readers if r["t_end"] is not None]
    span_s = max(ends) - min(starts) if starts and ends else 0.0
    cycle_ms = [x for r in readers for x in r["cycle_ms"]]
    read_cycle_ms = [x for r in readers for x in r["read_cycle_ms"]]
    read_ms = [x for r in readers for x in r["read_ms"]]
    done = [raw["done"][str(r)] for r in range(args.tp)]
    leaked = [s["total_pins"] for s in after]
    leases_open = [s["service"]["leases_open"] for s in after]
    churn = [d["churn"] or {} for d in done]
    verified_per_rank = totals["blocks_verified"] // args.tp
    failures = []
    if totals["wrong_bytes"]:
        failures.append(f"{totals['wrong_bytes']} wrong bytes in {totals['wrong_blocks']} blocks")
    if any(leaked) or any(leases_open):
        failures.append(f"pins left {leaked}, leases open {leases_open}")
    if totals["errors"]:
        failures.append(f"{totals['errors']} errors")
    if totals["over_budget"]:
        failures.append(f"{totals['over_budget']} over_budget refusals")
    if any(c.get("errors") for c in churn):
        failures.append(f"churn store errors {[c.get('last_error') for c in churn]}")
    asked = args.clients * args.cycles
    return {
        "tp": args.tp,
        "config": {"clients": args.clients, "cycles": args.cycles, "seconds": args.seconds,
                   "num_blocks": args.num_blocks, "key_space": args.key_space, "window": args.window,
                   "churn_per_s": args.churn_per_s, "churn_batch": args.churn_batch, "rank_seeds": args.rank_seeds,
                   "budget": args.clients * args.window, "rpc_workers": args.rpc_workers, "seed": args.seed},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "totals": totals, "complete": totals["cycles"] >= asked,
        "clean_misses": totals["partial"] + totals["empty"],
        "load_span_s": span_s, "cycles_per_s": totals["cycles"] / span_s if span_s > 0 else 0.0,
        "cycle_p50_ms": pct(cycle_ms, 50), "cycle_p99_ms": pct(cycle_ms, 99), "cycle_max_ms": pct(cycle_ms, 100),
        "read_cycle_p50_ms": pct(read_cycle_ms, 50), "read_cycle_p99_ms": pct(read_cycle_ms, 99),
        "read_p50_ms": pct(read_ms, 50), "read_p99_ms": pct(read_ms, 99),
        "pins_after": leaked, "leases_open_after": leases_open,
        "evictions": [d["evictions"] for d in done], "pool_hits": [d["hits"] for d in done],
        "trimmed_blocks": [d["hits"] - verified_per_rank for d in done] if not totals["errors"] else None,
        "churn": churn,
        "per_client": [{"cycles": r["cycles"], "errors": r["errors"], "wrong_bytes": r["wrong_bytes"],
                        "p99_ms": pct(r["cycle_ms"], 99), "rc": r["rc"], "error_samples": r["error_samples"],
                        "mismatches": r["mismatches"]} for r in readers],
        "source_rc": raw["source_rc"], "failures": failures, "ok": not failures,
    }


def print_table(s: dict[str, Any]) -> None:
    c, t = s["config"], s["totals"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    rows = [
        ("cycles (clients x cycles)", f"{t['cycles']} of {c['clients']} x {c['cycles']}"
                                      + ("" if s["complete"] else "  (stopped by --seconds)")),
        ("load phase", f"{s['load_span_s']:.1f} s"),
        ("cycles/s", f"{s['cycles_per_s']:.0f}"),
        ("cycle p50 / p99 (all clean cycles)", f"{ms(s['cycle_p50_ms'])} / {ms(s['cycle_p99_ms'])} ms"),
        ("cycle p50 / p99 (cycles with a READ)", f"{ms(s['read_cycle_p50_ms'])} / {ms(s['read_cycle_p99_ms'])} ms"),
        ("  NIXL READ p50 / p99", f"{ms(s['read_p50_ms'])} / {ms(s['read_p99_ms'])} ms"),
        ("full matches", str(t["full"])),
        ("clean misses: partial / empty", f"{t['partial']} / {t['empty']}"),
        ("blocks verified (all ranks)", str(t["blocks_verified"])),
        ("wrong bytes (blocks)", f"{t['wrong_bytes']} ({t['wrong_blocks']})"),
        ("errors / over_budget", f"{t['errors']} / {t['over_budget']}"),
        ("pins / leases left per rank", f"{s['pins_after']} / {s['leases_open_after']}"),
        ("pool evictions per rank", str(s["evictions"])),
        ("pinned then trimmed per rank", str(s["trimmed_blocks"])),
        ("churn stores per rank (full)", str([f"{x.get('stores')} ({x.get('full')})" for x in s["churn"]])),
        ("result", "ok" if s["ok"] else "FAIL: " + "; ".join(s["failures"])),
    ]
    print(f"soak bench: TP={s['tp']}, pool {c['num_blocks']} blocks, key space {c['key_space']}, window {c['window']}, "
          f"churn {c['churn_per_s']:g} hashes/s per rank{' (own seed per rank)' if c['rank_seeds'] else ''}, "
          f"{s['machine']['cpus']} cpus")
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    for i, r in enumerate(s["per_client"]):
        if r["error_samples"] or r["mismatches"]:
            print(f"  client {i}: errors {r['error_samples'][:3]} mismatches {r['mismatches'][:3]}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--cycles", type=int, default=2000, help="cycles per client")
    p.add_argument("--seconds", type=float, default=600.0, help="upper bound on the load phase")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=128, help="blocks in each rank's pool")
    p.add_argument("--key-space", type=int, default=256, help="hashes churn stores and readers ask for")
    p.add_argument("--window", type=int, default=8, help="hashes per resolve")
    p.add_argument("--churn-per-s", type=float, default=2000.0, help="hashes stored per second on each rank")
    p.add_argument("--churn-batch", type=int, default=8)
    p.add_argument("--rank-seeds", action="store_true", help="each rank churns its own runs (contents diverge)")
    p.add_argument("--rpc-workers", type=int, default=4)
    p.add_argument("--pin-timeout-s", type=float, default=5.0,
                   help="how long pins may take to drop after the last release (below the 30 s lease TTL)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not have_mpiexec():
        raise SystemExit("mpiexec not found next to this Python (pip install mpich)")
    if args.key_space <= args.num_blocks:
        raise SystemExit("--key-space must exceed --num-blocks, or nothing is ever evicted")
    if args.num_blocks < args.clients * args.window + args.churn_batch:
        raise SystemExit("--num-blocks must hold every client's pinned window plus one churn batch")

    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        summary = summarize(args, run_soak(args, Path(tmp)))
    print_table(summary)
    if args.json:
        write_result(args.json, "soak", **summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
