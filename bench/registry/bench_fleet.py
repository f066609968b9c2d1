"""Fleet simulation: N workers publishing with churn, M targets looking up, against 1-3 registry servers.

    python -m bench.registry.bench_fleet [--servers 1,3] [--store redis,cluster] [--workers 100,1000]
                                [--lookups server,mirror] [--seconds 8] [--json bench/results/fleet.json]

The defaults run the whole matrix (16 configurations) in about 10 minutes on
the 2-core development VM; a smoke run: ``--servers 1 --store redis
--workers 20 --lookups server --seconds 3``.

What it plays, per configuration (servers x store x workers x lookups), each
on a fresh private ``redis-server`` (``--store redis``) or a fresh 3-master
Redis Cluster without replicas (``--store cluster``), with S ``remote-g2
serve`` processes in front of it (lease ``--lease-s``, 10 s as the server's
default; change feed on), everything on 127.0.0.1:

* **Workers** (``--workers`` N): each registers (epoch = wall-clock ns) with a
  failover list that starts at "its" server (worker ``i`` at server ``i % S``,
  then the others), heartbeats every third of the lease, and serves requests:
  it draws a prefix chain from a Zipf distribution (``--zipf`` s over
  ``--chains`` chains per layout, rank 1 most popular; chain lengths 16-128
  blocks of 32-byte hashes, the first ``--shared-blocks`` of each chain shared
  with the other chains of its group, ``--groups`` groups, as a system prompt
  is). A chain it holds is a local hit (moved to the front of its LRU); any
  other chain is stored: ``removed`` events for the least recently used
  chains it evicts to stay within ``--pool-blocks`` blocks (a block two of
  its chains share goes with the last of them), then ``stored`` events for
  the chain's blocks it does not hold yet. Events go out in ``events``
  batches of at least ``--batch`` hashes, in order, under the worker's own
  sequence numbers; a ``resync_needed`` answer sends its whole pool
  (``resync``), an ``unknown_worker`` one registers it again first. Churn:
  workers restart at random (exponential) times, ``--churn-per-min`` of the
  fleet per minute on average: a new epoch, an empty pool filled again by
  its traffic. Workers are split over ``--layouts`` layouts (model ids):
  their hashes never meet.
* **How they run**: ``--procs`` OS processes with ``--threads`` threads each;
  a thread drives its share of the workers round-robin, one call at a time
  (so at most ``procs x threads`` calls are in flight). Every worker has its
  own :class:`RegistryClient` (its own DEALER socket per server and its own
  failover state), so the servers see N peers, as with a real fleet; what
  the simulation does not have is N processes' worth of CPU, and it needs
  none: a worker's engine work is not simulated, only its registry traffic,
  and a thread per worker would spend this box's two cores on switching.
* **Phases**: *fill* — workers store until every pool is full (at most
  ``--fill-seconds``), no churn; *saturated* — ``--seconds`` with the
  publishers closed-loop (each thread sends its next batch as soon as the
  last is answered), every store evicting, churn on, targets looking up,
  followers counting: the event rate is what this box sustains, not a
  fleet's demand; *paced* — ``--seconds`` more with the publishers held to
  ``--load`` (0.5) of the saturated phase's rate: lookup latency with
  headroom.
* **Targets** (``--targets`` M processes): lookups of Zipf-drawn chains (the
  chain's hashes and 4 blocks of the request's own, which no worker holds)
  with their layout's compat key, paced at ``--lookup-rate`` lookups/s each
  (0: back to back). ``--lookups server``: a round trip through a failover
  list starting at server ``t % S`` (the store's lookup script);
  ``--lookups mirror``: each target keeps a :class:`RegistryMirror` of its
  layout (what ``REMOTE_G2_TARGET_REGISTRY_MIRROR=1`` gives a target leader)
  and looks up there, asking the server only until it is ready.
* **Feed followers** (``--followers`` K): raw ZMQ SUB sockets on every
  server's change feed (what each registry mirror receives before it filters
  by layout), counting frames, bytes and gaps (frames the PUB dropped); and
  one :class:`RegistryMirror` of layout 0 in a process of its own, checked
  at the end against the workers' pools. The targets' mirrors (``--lookups
  mirror``) are followers too.

Columns of the table (the JSON has these and more per row: each phase's
counts, lookup reasons, heartbeats/s, restarts, the cores each group of
processes kept busy, the mirror's state):

    srv / store / workers / lookups   the configuration
    entries        (hash, holder) entries at the end (the servers' ``stats``, after the sweep)
    fill ev/s      block events/s applied while filling (stored only), from the publishers' ok answers
    sat ev/s       block events/s applied in the saturated phase (stored + removed), ditto
    ev p50/p99     the publishers' ``events`` round trip in the saturated phase, ms
    lk p50/p99     lookup round trip (or mirror call) in the saturated phase, ms
    paced ev/s     block events/s applied in the paced phase
    lk/s, p50/p99  lookups answered per second (all targets) and their latency in the paced phase, ms
    hit%           paced-phase lookups that found a holder
    B/entry        Redis ``used_memory`` growth (summed over the masters on Cluster) / entries, once the
                   sweepers deleted every retired incarnation
    feed msg/s, MB/s   change-feed frames and bytes per second ONE follower received (all the servers'
                   feeds), saturated phase
    flw            followers attached: raw ones, the layout-0 mirror, the targets' mirrors
    gaps           feed frames the followers missed (all of them)
    ok             every check passed: the block events the servers counted == those the publishers
                   were told were applied; entries == the workers' pools; every retired incarnation
                   swept; the layout-0 mirror holds exactly layout 0's pools

Checks that fail are reported (``problems``), not raised, so a run always
writes its JSON; the exit code is 1 when any configuration has a problem.

Not simulated: engines, sources and NIXL (nothing listens on the workers'
endpoints; no resolve follows a lookup); ``serve --mirror-lookups``;
failures (servers and Redis stay up: ``tests/test_faults_registry.py``);
hosts (everything shares this box's 2 cores with the simulation itself, so
every rate is CPU-bound here and the split between ingest and lookups is
the scheduler's; the JSON's ``cpu_cores`` says who used what); Redis
replicas (the Cluster runs without: a replica per master doubles its
memory and adds the replication stream); and time: the registry holds the
fleet's full state after the fill, but a run lasts seconds, not days.

The code, by part: ``fleet_workers`` (the catalogue, the simulated workers
and the threads that drive them), ``fleet_readers`` (targets, feed
followers, the layout-0 mirror), ``fleet_run`` (one configuration, from a
fresh store to its row and checks); this module: the command line and the
table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from bench import common
from bench.registry.fleet_run import run_config
from bench.registry.fleet_workers import MAX_CHAIN


# -- output -----------------------------------------------------------------------------------------------

COLUMNS = [("srv", "servers", "{}"), ("store", "store", "{}"), ("workers", "workers", "{:,}"),
           ("lookups", "lookups_from", "{}"),
           ("entries", "entries", "{:,}"), ("fill ev/s", "fill_events_per_s", "{:,.0f}"),
           ("sat ev/s", "saturated.events_per_s", "{:,.0f}"), ("ev p50", "saturated.events_p50_ms", "{:.1f}"),
           ("ev p99", "saturated.events_p99_ms", "{:.1f}"), ("lk p50", "saturated.lookup_p50_ms", "{:.2f}"),
           ("lk p99", "saturated.lookup_p99_ms", "{:.2f}"), ("paced ev/s", "paced.events_per_s", "{:,.0f}"),
           ("lk/s", "paced.lookups_per_s", "{:,.0f}"), ("lk p50", "paced.lookup_p50_ms", "{:.2f}"),
           ("lk p99", "paced.lookup_p99_ms", "{:.2f}"), ("hit%", "paced.lookup_hit_rate", "{:.0%}"),
           ("B/entry", "bytes_per_entry", "{:.0f}"),
           ("feed msg/s", "saturated.feed_msgs_per_s_per_follower", "{:,.0f}"),
           ("feed MB/s", "saturated.feed_bytes_per_s_per_follower", "{:.2f}"), ("flw", "followers", "{}"),
           ("gaps", "feed_gaps", "{}")]


def _value(row: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        row = row.get(part, {}) if isinstance(row, dict) else {}
    return row if row != {} else 0


def table(rows: list[dict[str, Any]]) -> str:
    """One line per configuration; ``sat``: the saturated phase, ``paced``: publishers at ``--load`` of it."""
    cells = [[h for h, _, _ in COLUMNS] + ["ok"]]
    for r in rows:
        vals = []
        for _, key, fmt in COLUMNS:
            v = _value(r, key)
            vals.append(fmt.format(v / 1e6 if key.endswith("feed_bytes_per_s_per_follower") else v))
        cells.append(vals + ["yes" if not r.get("problems") else "NO"])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    lines = []
    for n, c in enumerate(cells):
        lines.append("  ".join(x.ljust(w) if i in (1, 3) else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="1,3", help="registry servers per configuration, comma-separated (1-3)")
    ap.add_argument("--store", default="redis,cluster", help="redis and/or cluster, comma-separated")
    ap.add_argument("--workers", default="100,1000", help="simulated workers per configuration, comma-separated")
    ap.add_argument("--seconds", type=float, default=8.0, help="each steady phase (saturated, paced)")
    ap.add_argument("--load", type=float, default=0.5,
                    help="the paced phase's event rate, as a fraction of the saturated phase's")
    ap.add_argument("--fill-seconds", type=float, default=40.0, help="at most this long to fill the pools")
    ap.add_argument("--procs", type=int, default=2, help="worker processes")
    ap.add_argument("--threads", type=int, default=4, help="driver threads per worker process")
    ap.add_argument("--targets", type=int, default=2, help="target processes looking up")
    ap.add_argument("--lookup-rate", type=float, default=500.0, help="lookups/s per target (0: back to back)")
    ap.add_argument("--lookups", default="server,mirror",
                    help="where targets look up, comma-separated: server (a round trip; the store's script), "
                         "mirror (their own registry mirror of their layout; the server until it is ready)")
    ap.add_argument("--followers", type=int, default=2, help="raw change-feed followers (besides the mirror)")
    ap.add_argument("--no-mirror", dest="mirror", action="store_false", help="no layout-0 registry mirror")
    ap.add_argument("--pool-blocks", type=int, default=2048, help="blocks each worker holds (its G2 pool)")
    ap.add_argument("--batch", type=int, default=256, help="hashes per events batch (at least)")
    ap.add_argument("--chains", type=int, default=20_000, help="prefix chains per layout")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of chain popularity")
    ap.add_argument("--groups", type=int, default=64, help="chain groups sharing a prefix (system prompts)")
    ap.add_argument("--shared-blocks", type=int, default=8, help="leading blocks a group's chains share")
    ap.add_argument("--layouts", type=int, default=2, help="model layouts the fleet is split over")
    ap.add_argument("--churn-per-min", type=float, default=0.05, help="fraction of workers restarting a minute")
    ap.add_argument("--lease-s", type=float, default=10.0, help="the servers' --lease-ttl-s")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="client call timeout")
    ap.add_argument("--sweep-wait-s", type=float, default=30.0,
                    help="at the end, wait this long at most for the sweepers before reading Redis memory")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    servers, stores, fleet = _ints(args.servers), args.store.split(","), _ints(args.workers)
    modes = args.lookups.split(",")
    if not all(1 <= s <= 3 for s in servers) or not set(stores) <= {"redis", "cluster"} or not fleet \
            or not set(modes) <= {"server", "mirror"}:
        ap.error("--servers takes 1-3, --store redis and/or cluster, --lookups server and/or mirror, "
                 "--workers at least one count")
    if args.pool_blocks < 2 * MAX_CHAIN:
        ap.error(f"--pool-blocks must hold two of the longest chains ({2 * MAX_CHAIN})")
    rows = []
    t0 = time.time()
    for store in stores:
        for s in servers:
            for n in fleet:
                for mode in modes:
                    print(f"config: {s} server(s), {store}, {n} workers, lookups from {mode}", file=sys.stderr)
                    rows.append(run_config(s, store, n, mode, args))
                    print(table(rows[-1:]), file=sys.stderr)
                    for p in rows[-1]["problems"]:
                        print(f"  PROBLEM: {p}", file=sys.stderr)
    print(table(rows))
    print(f"({time.time() - t0:.0f} s in all; {os.cpu_count()} CPUs)")
    if args.json:
        common.write_result(args.json, "fleet", args=vars(args), rows=rows)
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
