"""One configuration of ``bench.registry.bench_fleet``: the load driver, from a fresh store to one result row.

:func:`run_config` starts a private ``redis-server`` or Redis Cluster and the registry servers in front of it,
spawns the fleet's processes (``fleet_workers``: the workers; ``fleet_readers``: targets, feed followers, the
layout-0 mirror), opens each phase for all of them at once, collects their reports, reads the servers and Redis
at the end, and checks that it all adds up. A check that fails is a ``problems`` entry of the row, not an
exception; everything it started is stopped on the way out.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import percentiles, proc_cpu_s
from bench.registry.fleet_readers import follower_proc, mirror_proc, target_proc
from bench.registry.fleet_workers import PHASES, fingerprint, merge, phase_ctl, worker_proc
from tests.conftest import cluster_masters, start_redis_cluster  # (the test suite's cluster builder)

KEY_PREFIX = "rg2:"


def _redis_nodes(store: str, url: str) -> list[Any]:
    import redis

    if store == "cluster":
        return [redis.Redis(host=h, port=p, socket_timeout=5) for h, p in cluster_masters(url)]
    return [redis.Redis.from_url(url, socket_timeout=5)]


def _used_memory(nodes: list[Any]) -> int:
    return sum(int(n.info("memory")["used_memory"]) for n in nodes)


def _gone(nodes: list[Any]) -> int:
    """Retired incarnations still waiting for the sweeper (the meta slot's ``gone`` set, wherever it lives)."""
    key = KEY_PREFIX + "{m}:gone"
    total = 0
    for n in nodes:
        try:
            total += int(n.zcard(key))
        except Exception:  # noqa: BLE001 - MOVED: another master holds the meta slot
            pass
    return total


def _cpu_snapshot(groups: dict[str, list[int]]) -> tuple[float, dict[str, float]]:
    return time.time(), {g: sum(proc_cpu_s(p) for p in pids) for g, pids in groups.items()}


def _cpu_share(before: tuple[float, dict[str, float]], after: tuple[float, dict[str, float]]) -> dict[str, float]:
    """Cores each group of processes kept busy between two snapshots."""
    secs = after[0] - before[0]
    return {g: (after[1][g] - before[1][g]) / secs for g in before[1]}


def _get(q: Any, kind: str, timeout: float, stash: list[tuple[str, Any]]) -> Any:
    """The next message of ``kind`` from ``q`` (others are kept in ``stash``)."""
    for i, (k, v) in enumerate(stash):
        if k == kind:
            del stash[i]
            return v
    deadline = time.time() + timeout
    while True:
        left = deadline - time.time()
        if left <= 0:
            raise TimeoutError(f"no {kind!r} report within {timeout:.0f} s")
        k, v = q.get(timeout=left)
        if k == kind:
            return v
        stash.append((k, v))


def _window(ph: dict[str, Any], k: int, seconds: float) -> None:
    """Open steady phase ``k`` for ``seconds``, starting in 0.2 s (every process reads the window first)."""
    start = time.time() + 0.2
    ph["win"][2 * k], ph["win"][2 * k + 1] = start, start + seconds
    ph["go"][k].set()
    time.sleep(max(0.0, start - time.time()))


def run_config(n_servers: int, store: str, n_workers: int, lookups: str, args: argparse.Namespace) -> dict[str, Any]:
    from remote_g2.registry import RegistryClient

    ctx = mp.get_context("spawn")
    row: dict[str, Any] = {"servers": n_servers, "store": store, "workers": n_workers,
                           "lookups_from": lookups}
    problems: list[str] = []
    procs: list[Any] = []    # servers and Redis we started (stopped by PID)
    children: list[Any] = []  # our simulation processes
    tag = f"[{n_servers} srv, {store}, {n_workers} workers, lookups from {lookups}]"
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        try:
            if store == "cluster":
                cprocs, url = start_redis_cluster(Path(tmp))
                procs.extend(cprocs)
                store_args = ("--redis-cluster-url", url)
            else:
                rproc, url = common.start_redis(tmp)
                procs.append(rproc)
                store_args = ("--redis-url", url)
            servers = []
            for k in range(n_servers):
                sproc, ep = common.start_registry(*store_args, log_path=str(Path(tmp) / f"serve{k}.log"),
                                                         lease_ttl_s=args.lease_s)
                procs.append(sproc)
                servers.append(ep)
            nodes = _redis_nodes(store, url)
            mem0 = _used_memory(nodes)
            feeds = []
            for ep in servers:
                with RegistryClient(ep, timeout_s=10) as c:
                    feeds.append(c.feed_info().endpoint)

            nproc = max(1, min(args.procs, n_workers))
            threads = max(1, min(args.threads, n_workers // nproc))
            cfg = {"servers": servers, "chains": args.chains, "zipf": args.zipf, "groups": args.groups,
                   "shared_blocks": args.shared_blocks, "layouts": args.layouts, "pool_blocks": args.pool_blocks,
                   "batch": args.batch, "threads": threads, "driver_threads": nproc * threads,
                   "hb_interval": args.lease_s / 3, "churn_per_min": args.churn_per_min,
                   "fill_seconds": args.fill_seconds, "seconds": args.seconds, "timeout_s": args.timeout_s,
                   "lookup_rate": args.lookup_rate, "target_mirror": lookups == "mirror", "seed": args.seed}
            ph = phase_ctl(ctx)
            q = ctx.Queue()
            stash: list[tuple[str, Any]] = []
            for p in range(nproc):
                children.append(ctx.Process(target=worker_proc, args=(list(range(p, n_workers, nproc)), cfg, ph, q),
                                            daemon=True))
            for t in range(args.targets):
                children.append(ctx.Process(target=target_proc, args=(t, cfg, ph, q), daemon=True))
            if args.followers:
                children.append(ctx.Process(target=follower_proc, args=(feeds, args.followers, ph, q), daemon=True))
            if args.mirror:
                children.append(ctx.Process(target=mirror_proc, args=(servers, fingerprint(0).compat_key(), ph, q),
                                            daemon=True))
            for ch in children:
                ch.start()
            kinds = ["workers"] * nproc + ["targets"] * args.targets + ["followers"] * bool(args.followers) + \
                ["mirror"] * bool(args.mirror)
            groups: dict[str, list[int]] = {"redis": [p.pid for p in procs[:len(procs) - n_servers]],
                                            "servers": [p.pid for p in procs[len(procs) - n_servers:]]}
            for kind, ch in zip(kinds, children):
                groups.setdefault(kind, []).append(ch.pid)
            if args.followers:
                _get(q, "follower_ready", 60, stash)

            fill = merge([_get(q, "fill", args.fill_seconds + 120, stash) for _ in range(nproc)])
            print(f"  {tag} filled in {fill['t1'] - fill['t0']:.1f} s; two steady phases of {args.seconds:.0f} s",
                  file=sys.stderr)
            phase: dict[str, dict[str, Any]] = {}
            cpu: dict[str, dict[str, float]] = {}
            for k, name in enumerate(PHASES):
                if name == "paced":
                    sat = phase["saturated"]
                    ph["rate"].value = args.load * sat["applied"] / (sat["t1"] - sat["t0"])
                _window(ph, k, args.seconds)
                before = _cpu_snapshot(groups)
                phase[name] = merge([_get(q, name, args.seconds + 120, stash) for _ in range(nproc)])
                cpu[name] = _cpu_share(before, _cpu_snapshot(groups))
            pools: dict[str, tuple[int, int]] = {}
            for _ in range(nproc):
                pools.update(_get(q, "pools", 60, stash))
            expected = sum(n for _, n in pools.values())
            expected_l0 = sum(n for layout, n in pools.values() if layout == 0)
            ph["report"].set()
            targets = [_get(q, "target", 120, stash) for _ in range(args.targets)]
            server_events = 0
            for ep in servers:
                with RegistryClient(ep, timeout_s=30) as c:
                    server_events += c.stats().events_ingested
            mirror = None
            if args.mirror:  # the copy has caught up once it holds exactly the layout-0 workers' pools
                deadline = time.time() + 60
                while time.time() < deadline:
                    mirror = _get(q, "mirror", 60, stash)
                    if mirror["ready"] and mirror["entries"] == expected_l0:
                        break
            # entries and memory once the sweepers have deleted every retired incarnation (churn; the
            # servers' block_entries counts those too until then)
            deadline = time.time() + args.sweep_wait_s
            while (gone := _gone(nodes)) and time.time() < deadline:
                time.sleep(0.25)
            with RegistryClient(servers, timeout_s=30) as c:
                entries = c.stats().block_entries
            mem1 = _used_memory(nodes)
            keys = sum(int(n.dbsize()) for n in nodes)
            ph["stop"].set()
            hold = merge([_get(q, "final", 60, stash) for _ in range(nproc)])
            followers = _get(q, "followers", 60, stash) if args.followers else []
            for ch in children:
                ch.join(30)
        finally:
            for ch in children:
                if ch.is_alive():
                    ch.terminate()
                    ch.join(10)
            for p in reversed(procs):
                common.stop(p)

    every = [fill, *phase.values(), hold]
    publisher_applied = sum(r["applied"] for r in every)
    if server_events != publisher_applied:
        problems.append(f"servers counted {server_events} block events, publishers were told {publisher_applied}")
    if any(r["applied"] != r["sent"] for r in every):
        problems.append("an ok batch was answered with another applied count than the hashes it carried")
    if entries != expected:
        problems.append(f"registry holds {entries} entries, the workers' pools {expected}")
    if gone:
        problems.append(f"{gone} retired incarnations still unswept after {args.sweep_wait_s:.0f} s")
    if mirror is not None and not (mirror["ready"] and mirror["entries"] == expected_l0):
        problems.append(f"layout-0 mirror: ready={mirror['ready']}, {mirror['entries']} entries, "
                        f"pools hold {expected_l0}")
    row.update({
        "entries": entries, "entries_expected": expected, "entries_layout0": expected_l0, "redis_keys": keys,
        "fill_s": fill["t1"] - fill["t0"], "fill_block_events": fill["applied"],
        "fill_events_per_s": fill["applied"] / max(1e-9, fill["t1"] - fill["t0"]),
        "server_events_ingested": server_events, "publisher_applied": publisher_applied,
        "redis_used_memory_bytes": mem1 - mem0, "bytes_per_entry": (mem1 - mem0) / entries if entries else 0.0,
        "unswept_incarnations": gone,
        "followers": len(followers) + (1 if mirror is not None else 0) + (args.targets if lookups == "mirror" else 0),
        "raw_followers": len(followers),
        "feed_gaps": sum(f["gaps"] for f in followers), "mirror": mirror,
        # what a healthy run never sees: batches answered resync_needed, heartbeats not ok, lapses, errors
        **{k: sum(r[key] for r in every) for k, key in (
            ("resync_needed", "resync_needed"), ("resyncs", "resyncs"), ("resync_hashes", "resync_hashes"),
            ("hb_not_ok", "hb_not_ok"), ("unknown_worker", "unknown"), ("failovers", "failovers"),
            ("errors", "errors"))},
    })
    for name, r in phase.items():
        secs = r["t1"] - r["t0"]
        ev = percentiles(r["lat"])
        lat = [x for t in targets for x in t[name]["lat"]]
        lk = percentiles(lat)
        reasons: dict[str, int] = {}
        for t in targets:
            for k, v in t[name]["reasons"].items():
                reasons[k] = reasons.get(k, 0) + v
        looked = sum(reasons.values())
        row[name] = {
            "seconds": secs, "block_events": r["applied"], "events_per_s": r["applied"] / secs,
            "batches_per_s": r["batches"] / secs, "events_p50_ms": ev["p50_ms"], "events_p99_ms": ev["p99_ms"],
            "restarts": r["restarts"], "heartbeats_per_s": r["heartbeats"] / secs,
            "lookups": looked, "lookups_per_s": looked / secs, "lookup_p50_ms": lk["p50_ms"],
            "lookup_p99_ms": lk["p99_ms"], "lookup_reasons": reasons,
            "lookup_errors": sum(t[name]["errors"] for t in targets),
            "lookups_from_target_mirror": sum(t[name]["from_mirror"] for t in targets),
            "lookup_hit_rate": reasons.get("ok", 0) / looked if looked else 0.0,
            "mean_matched_blocks": sum(t[name]["matched"] for t in targets) / max(1, reasons.get("ok", 0)),
            "feed_msgs_per_s_per_follower": (sum(f[f"{name}_msgs"] for f in followers) / len(followers) / secs
                                             if followers else 0.0),
            "feed_bytes_per_s_per_follower": (sum(f[f"{name}_bytes"] for f in followers) / len(followers) / secs
                                              if followers else 0.0),
            "cpu_cores": cpu[name],  # cores each group of processes kept busy (of this box's two)
        }
        row["lookup_errors"] = row.get("lookup_errors", 0) + row[name]["lookup_errors"]
    row["target_paced_rate"] = ph["rate"].value
    row["problems"] = problems
    return row
