"""Registry benchmark: ingest, lookup latency, and lookup throughput vs raw Redis Lua.

Everything real, on this machine: a private ``redis-server`` (free port), a
``remote-g2 serve --redis-url`` process, clients in separate processes.

Phases
  1. ingest    8 workers register; every block event is sent through the server
               (``events`` batches of --batch hashes) until --blocks (hash, worker)
               entries exist. Reports block events/s.
  2. latency   one client, sequential 128-hash prefix lookups through the server:
               p50 / p99 client-observed; the raw Lua script (baseline), a ping
               through the server and a no-op EVALSHA (floors), interleaved in
               --rounds blocks so all four see the same machine noise.
  3. throughput --clients processes for --seconds each way: lookups through the
               server, and the same lookups as raw EVALSHA of the store's own Lua
               script straight to Redis (the ceiling), alternated --tput-rounds
               times. Reports the ratio.

Both lookup phases also run against a second server on the same Redis started
with ``--mirror-lookups --mirror-peers <the first>``: it answers lookups from
its in-process registry mirror (writes still go to Redis), so the table shows
the script path and the mirror path side by side.

Targets (issue 3): p50 <= 0.5 ms, p99 <= 2 ms; throughput >= 50 % of the raw
ceiling; ingest >= 200 k block events/s.

    python -m bench.registry.bench_registry [--blocks 1000000] [--json out.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

import redis

from bench import common
from bench.common import percentiles
from remote_g2.registry import RegistryClient
from remote_g2.registry.stores.redis_store import RedisStore

from remote_g2.protocol.messages import BlockEvent, LayoutFingerprint

FP = LayoutFingerprint(model_id="bench", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                       num_layers=32, num_kv_heads=8, head_dim=128, tp_size=1)
CHAIN_LEN = 128
HOLDERS_PER_CHAIN = 2


def start_registry(*store_args: str, workers: int = 1) -> tuple[subprocess.Popen[bytes], str]:
    """``remote-g2 serve`` for the benchmarks: leases long enough that no idle worker lapses mid-run."""
    return common.start_registry(*store_args, workers=workers, lease_ttl_s=600)


def chain(c: int) -> list[bytes]:
    """The hashes of chain c: 8-byte u64s, distinct across chains."""
    base = c * CHAIN_LEN
    return [(base + i + 1).to_bytes(8, "big") for i in range(CHAIN_LEN)]


def ingest(endpoint: str, blocks: int, workers: int, batch: int) -> dict[str, Any]:
    """Fill the registry with ``blocks`` entries: every chain is held by HOLDERS_PER_CHAIN workers."""
    chains = blocks // (CHAIN_LEN * HOLDERS_PER_CHAIN)
    per_worker: list[list[bytes]] = [[] for _ in range(workers)]
    for c in range(chains):
        for k in range(HOLDERS_PER_CHAIN):
            per_worker[(c + k) % workers].extend(chain(c))
    with RegistryClient(endpoint, timeout_s=60) as client:
        seqs = {}
        for w in range(workers):
            client.register_worker(f"w{w}", f"tcp://127.0.0.1:{20000 + w}", FP, epoch=1)
            seqs[w] = 1
        total = 0
        t0 = time.perf_counter()
        progress = time.monotonic()
        for w in range(workers):
            hashes = per_worker[w]
            for i in range(0, len(hashes), batch):
                reply = client.events(f"w{w}", 1, seqs[w], [BlockEvent("stored", hashes[i:i + batch])])
                assert reply.status == "ok", reply
                seqs[w] = reply.expected_seq
                total += reply.applied
                if time.monotonic() - progress > 2:
                    progress = time.monotonic()
                    print(f"  ingest: {total:,} / {blocks:,} block events", file=sys.stderr)
        secs = time.perf_counter() - t0
    return {"block_events": total, "seconds": secs, "events_per_s": total / secs, "chains": chains}


def wait_mirror_ready(endpoint: str, timeout_s: float) -> float:
    """Seconds until the server at ``endpoint`` reports its registry mirror complete."""
    t0 = time.monotonic()
    with RegistryClient(endpoint, timeout_s=10) as c:
        while (state := c.stats().mirror) != "ready":
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the mirrored server's copy is still {state!r} after {timeout_s} s")
            time.sleep(0.1)
    return time.monotonic() - t0


class RawLookup:
    """The store's own lookup Lua script, called with EVALSHA straight to Redis (no registry server)."""

    def __init__(self, redis_url: str) -> None:
        self.store = RedisStore(redis_url, lease_ttl_ms=600_000)
        self.client = redis.Redis.from_url(redis_url)

    def __call__(self, hashes: list[bytes]) -> Any:
        return self.store.raw_lookup(self.client, hashes)


def _lookup_loop(kind: str, target: str, chains: int, seconds: float, seed: int, out: Any) -> None:
    rng = random.Random(seed)
    if kind == "server":
        client = RegistryClient(target, timeout_s=10)
        call = client.lookup
    else:
        call = RawLookup(target)
    n = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(20):
            call(chain(rng.randrange(chains)))
        n += 20
    out.put(n)


def throughput(kind: str, target: str, chains: int, clients: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_lookup_loop, args=(kind, target, chains, seconds, i, q)) for i in range(clients)]
    for p in procs:
        p.start()
    counts = [q.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join(30)
    return sum(counts) / seconds


def latency(calls: dict[str, tuple[Any, Any]], chains: int, n: int, rounds: int) -> dict[str, dict[str, float]]:
    """p50/p99 of each call, ``n`` sequential calls each, interleaved in ``rounds`` blocks.

    ``calls`` maps a name to ``(call(hashes), check(reply))``. Interleaving puts
    every call under the same machine noise (this VM's wake-up latency drifts
    from minute to minute), so the rows compare side by side.
    """
    rng = random.Random(1)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call, _ in calls.values():
        for _ in range(50):  # warm-up: connections, script cache
            call(chain(rng.randrange(chains)))
    per_round = max(1, n // rounds)
    for _ in range(rounds):
        for name, (call, check) in calls.items():
            out = samples[name]
            for _ in range(per_round):
                c = chain(rng.randrange(chains))
                t0 = time.perf_counter()
                reply = call(c)
                out.append(time.perf_counter() - t0)
                check(reply)
    return {name: percentiles(s) for name, s in samples.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000, help="(hash, worker) entries to index")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4096, help="hashes per events batch")
    ap.add_argument("--lookups", type=int, default=3000, help="sequential lookups for the latency phase")
    ap.add_argument("--clients", type=int, default=4, help="client processes for the throughput phase")
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput run")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds of the latency phase (server, raw, ping, no-op in turn)")
    ap.add_argument("--tput-rounds", type=int, default=2, help="alternations of the two throughput runs")
    ap.add_argument("--server-workers", type=int, default=1,
                    help="registry serving threads (serve --workers; 1 = direct)")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        redis_proc, redis_url = common.start_redis(tmp)
        reg_proc, endpoint = start_registry("--redis-url", redis_url, workers=args.server_workers)
        mir_proc = None
        try:
            print(f"redis {redis_url}, registry {endpoint}", file=sys.stderr)
            ing = ingest(endpoint, args.blocks, args.workers, args.batch)
            chains = ing["chains"]
            print(f"  ingest done: {ing['events_per_s']:,.0f} block events/s", file=sys.stderr)
            mir_proc, mir_endpoint = start_registry("--redis-url", redis_url, "--mirror-lookups", "--mirror-peers",
                                                    endpoint, workers=args.server_workers)
            mirror_ready_s = wait_mirror_ready(mir_endpoint, 300)
            print(f"  mirrored server ready after {mirror_ready_s:.1f} s", file=sys.stderr)

            def full_match(reply: Any) -> None:
                assert reply.reason == "ok" and reply.matched == CHAIN_LEN, reply

            def raw_ok(reply: Any) -> None:
                assert reply[0] == b"ok" and int(reply[1]) == CHAIN_LEN, reply[:2]

            raw = RawLookup(redis_url)
            noop = raw.client.script_load("return 1")
            with RegistryClient(endpoint, timeout_s=10) as client, \
                    RegistryClient(mir_endpoint, timeout_s=10) as mclient:
                lat = latency({"server": (client.lookup, full_match), "raw": (raw, raw_ok),
                               "mirror": (mclient.lookup, full_match),
                               "ping": (lambda _: client.ping(), lambda r: None),
                               "noop": (lambda _: raw.client.evalsha(noop, 0), lambda r: None)},
                              chains, args.lookups, args.rounds)
            lat_server, lat_raw, lat_ping, lat_noop = lat["server"], lat["raw"], lat["ping"], lat["noop"]
            lat_mirror = lat["mirror"]
            print("  latency done; throughput runs...", file=sys.stderr)
            tput_server = tput_raw = tput_mirror = 0.0
            for _ in range(args.tput_rounds):  # alternated, for the same reason as the latency rounds
                tput_server += throughput("server", endpoint, chains, args.clients, args.seconds) / args.tput_rounds
                tput_raw += throughput("raw", redis_url, chains, args.clients, args.seconds) / args.tput_rounds
                tput_mirror += throughput("server", mir_endpoint, chains, args.clients,
                                          args.seconds) / args.tput_rounds
            with RegistryClient(mir_endpoint, timeout_s=10) as mclient:
                if mclient.stats().mirror != "ready":
                    raise RuntimeError("the mirrored server lost its copy during the run; its numbers are not "
                                       "mirror numbers")
        finally:
            if mir_proc is not None:
                common.stop(mir_proc)
            common.stop(reg_proc)
            common.stop(redis_proc)

    ratio = tput_server / tput_raw
    ratio_mirror = tput_mirror / tput_raw
    rows = [
        ("ingest through server", f"{ing['events_per_s']:,.0f} block events/s", ">= 200,000 /s",
         ing["events_per_s"] >= 200_000),
        ("lookup p50, server (client-observed)", f"{lat_server['p50_ms']:.3f} ms", "<= 0.5 ms",
         lat_server["p50_ms"] <= 0.5),
        ("lookup p99, server (client-observed)", f"{lat_server['p99_ms']:.3f} ms", "<= 2 ms",
         lat_server["p99_ms"] <= 2.0),
        ("lookup p50 / p99, raw Lua (baseline)", f"{lat_raw['p50_ms']:.3f} / {lat_raw['p99_ms']:.3f} ms", "", None),
        ("floor: ping through server p50", f"{lat_ping['p50_ms']:.3f} ms", "", None),
        ("floor: no-op EVALSHA to Redis p50", f"{lat_noop['p50_ms']:.3f} ms", "", None),
        (f"throughput, server, {args.clients} clients", f"{tput_server:,.0f} lookups/s", "", None),
        (f"throughput, raw Lua, {args.clients} clients", f"{tput_raw:,.0f} lookups/s", "", None),
        ("server / raw throughput", f"{ratio:.2f}", ">= 0.50", ratio >= 0.5),
        ("lookup p50, mirrored server", f"{lat_mirror['p50_ms']:.3f} ms", "<= 0.5 ms", lat_mirror["p50_ms"] <= 0.5),
        ("lookup p99, mirrored server", f"{lat_mirror['p99_ms']:.3f} ms", "<= 2 ms", lat_mirror["p99_ms"] <= 2.0),
        (f"throughput, mirrored server, {args.clients} clients", f"{tput_mirror:,.0f} lookups/s", "", None),
        ("mirrored server / raw throughput", f"{ratio_mirror:.2f}", ">= 0.50", ratio_mirror >= 0.5),
        ("mirrored server: snapshot of the registry", f"{mirror_ready_s:.1f} s", "", None),
    ]
    print(f"\nregistry benchmark: {args.blocks:,} entries over {args.workers} workers, {CHAIN_LEN}-hash prefixes, "
          f"real redis-server, {os.cpu_count()} cores")
    w = max(len(r[0]) for r in rows)
    print(f"{'measure':<{w}}  {'value':>28}  {'target':>14}  met")
    print(f"{'-' * w}  {'-' * 28}  {'-' * 14}  ---")
    for name, value, target, met in rows:
        print(f"{name:<{w}}  {value:>28}  {target:>14}  {'' if met is None else ('yes' if met else 'NO')}")
    result = {"blocks": args.blocks, "workers": args.workers, "prefix": CHAIN_LEN, "clients": args.clients,
              "ingest": ing, "latency_server": lat_server, "latency_raw_lua": lat_raw,
              "latency_ping_server": lat_ping, "latency_noop_evalsha": lat_noop,
              "throughput_server_per_s": tput_server, "throughput_raw_lua_per_s": tput_raw,
              "throughput_ratio": ratio, "latency_mirrored_server": lat_mirror,
              "throughput_mirrored_server_per_s": tput_mirror, "throughput_ratio_mirrored": ratio_mirror,
              "mirror_ready_s": mirror_ready_s}
    if args.json:
        print()
        common.write_result(args.json, "registry", args=vars(args), **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
